//! Hylics' send offload, socket scheme (paper §4): a TCP connection the guest accepted is
//! handed to the host, which sends a file of the share on it, and handed back.
//!
//! ```text
//!  guest libhylics            vmsight (vsock service)                     peer
//!  sock-hold ───────────────► steer: Hold (frames of the flow dropped)
//!  TCP_REPAIR freeze, dump
//!  sock-send {state} ───────► host namespace: socket + TCP_REPAIR restore
//!                             steer: Host ─ peer's frames ─► host tap ─► host socket
//!                             sendfile, wait until acknowledged ◄──────────────────► peer
//!                             steer: Hold; freeze, dump, close in repair mode
//!  restore, ◄──── {state} ───
//!  sock-release ────────────► steer: released (the guest's again)
//!  TCP_REPAIR off; the app writes on
//! ```
//!
//! The host socket lives in a namespace of its own (`vmsight-NAME.hylics`) whose tap `hy0`
//! carries the guest's MAC and address, so the connection's 4-tuple is the guest's; the NIC's
//! steer stage (`vmsight_netdev::stages::steer`) moves the connection's frames between the
//! guest and that tap. The recipe (order of the repair calls, what travels) follows CRIU's
//! libsoccr, checked on this host: without holding the flow first, the frozen socket still
//! processes ACKs and the state goes stale; without restoring the timestamp the peer's PAWS
//! check drops every segment; without the window the send window starts at 0.
//!
//! Hand-written setsockopt calls: no crate wraps TCP_REPAIR (socket2 and nix do not).

use std::mem::size_of;
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmsight_netdev::stages::steer::{forward_from_host, FlowKey, SteerControl};
use vmsight_netdev::Tap;
use vmsight_proto::hylics::{TcpState, MAX_HANDBACK_BYTES};

use crate::net::host::{ip, Netns};

/// The tap in the host namespace.
const HOST_TAP: &str = "hy0";
/// How long the host waits for the peer to acknowledge what it sent.
const ACK_TIMEOUT: Duration = Duration::from_secs(60);

// From <linux/tcp.h> (the libc crate lacks some of them).
const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_REPAIR_OPTIONS: libc::c_int = 22;
const TCP_TIMESTAMP: libc::c_int = 24;
const TCP_REPAIR_WINDOW: libc::c_int = 29;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
const TCP_REPAIR_ON: libc::c_int = 1;
const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
const TCPOPT_MSS: u32 = 2;
const TCPOPT_WINDOW: u32 = 3;
const TCPOPT_SACK_PERM: u32 = 4;
const TCPOPT_TIMESTAMP: u32 = 8;
const TCP_ESTABLISHED: u8 = 1;
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
const SIOCINQ: libc::c_ulong = 0x541B;
const SIOCOUTQ: libc::c_ulong = 0x5411;

/// Why a hand-over failed (the sentence goes back to the guest).
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("{0:?} is not an IPv4 address and port")]
    Addr(String),
    #[error("{what} failed: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the peer did not acknowledge the data within {0:?}")]
    NotAcked(Duration),
    #[error("the peer sent {0} bytes while the host held the connection (at most {MAX_HANDBACK_BYTES} can be handed back)")]
    TooMuchReceived(usize),
    #[error("the connection left ESTABLISHED (TCP state {0}) while the host held it: the peer closed or reset it")]
    NotEstablished(u8),
    #[error("setting up the host namespace {ns}: {reason}")]
    Setup { ns: String, reason: String },
    #[error("this VM's NIC cannot steer connections (--net isolated with vmsight's device)")]
    NoSteering,
    #[error("{0}")]
    Steer(#[from] vmsight_netdev::stages::steer::SteerError),
}

fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> HandoverError {
    move |source| HandoverError::Sys { what, source }
}

/// `IP:PORT` (IPv4).
pub fn parse_v4(s: &str) -> Result<SocketAddrV4, HandoverError> {
    s.parse().map_err(|_| HandoverError::Addr(s.to_owned()))
}

/// The connection a state or request names.
pub fn flow_key(local: &str, remote: &str) -> Result<FlowKey, HandoverError> {
    Ok(FlowKey {
        guest: parse_v4(local)?,
        peer: parse_v4(remote)?,
    })
}

/// The `ip netns` name of VM `vm`'s host namespace.
pub fn host_netns_name(vm: &str) -> String {
    format!("{}.hylics", crate::net::host::netns_name(vm))
}

/// The host namespace and the thread forwarding its frames out of the VM's tap.
pub struct HostSide {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Deleted when dropped (after the thread).
    _netns: Netns,
}

/// What the host namespace needs to look like the guest.
pub struct HostSideSpec<'a> {
    pub vm: &'a str,
    pub guest_mac: &'a str,
    pub guest_cidr: String,
    pub gateway: Option<String>,
    pub mtu: u16,
    /// The VM's own namespace (for the gateway's MAC).
    pub vm_netns: &'a str,
    pub vm_tap_name: &'a str,
}

impl HostSide {
    /// Creates `vmsight-NAME.hylics` with tap `hy0` (the guest's MAC and address, a permanent
    /// neighbour entry for the gateway, no IPv6), hands the tap to `ctl`, and forwards what
    /// the host socket sends out of `vm_tap`.
    pub fn start(
        spec: &HostSideSpec<'_>,
        vm_tap: Tap,
        ctl: Arc<SteerControl>,
    ) -> Result<HostSide, HandoverError> {
        let name = host_netns_name(spec.vm);
        let err = |reason: String| HandoverError::Setup {
            ns: name.clone(),
            reason,
        };
        if vmsight_netdev::tap::netns_path(&name).exists() {
            ip(&["netns", "del", &name]).map_err(err)?;
        }
        ip(&["netns", "add", &name]).map_err(err)?;
        let netns = Netns::adopt(name.clone());
        let tap = Tap::open(HOST_TAP, Some(&vmsight_netdev::tap::netns_path(&name)))
            .map_err(|e| err(e.to_string()))?;
        // The host socket's sends arrive as TSO super-frames with partial checksums, and go
        // into the VM's tap as they are (a tap takes them; the kernel segments on the way
        // out): one frame per 64 KiB instead of one per MSS through the forwarding thread.
        tap.set_offloads(vmsight_netdev::tap::TapOffloads {
            csum: true,
            tso4: true,
            tso6: false,
            ecn: false,
        })
        .map_err(|e| err(e.to_string()))?;
        configure(&name, spec).map_err(err)?;
        let tap = Arc::new(tap);
        ctl.set_host_tap(tap.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = forward_from_host(ctl, tap, vm_tap, stop.clone()).map_err(sys("thread"))?;
        Ok(HostSide {
            stop,
            thread: Some(thread),
            _netns: netns,
        })
    }
}

impl Drop for HostSide {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn configure(ns: &str, spec: &HostSideSpec<'_>) -> Result<(), String> {
    let mtu = spec.mtu.to_string();
    for sysctl in ["all", "default"] {
        let path = format!("/proc/sys/net/ipv6/conf/{sysctl}/disable_ipv6");
        in_netns_write(ns, &path, "1")?;
    }
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    ip(&[
        "-n",
        ns,
        "link",
        "set",
        HOST_TAP,
        "address",
        spec.guest_mac,
        "mtu",
        &mtu,
        "up",
    ])?;
    ip(&["-n", ns, "addr", "add", &spec.guest_cidr, "dev", HOST_TAP])?;
    if let Some(gw) = &spec.gateway {
        let gw_mac = mac_in_netns(spec.vm_netns, spec.vm_tap_name)?;
        ip(&[
            "-n",
            ns,
            "neigh",
            "replace",
            gw,
            "lladdr",
            &gw_mac,
            "dev",
            HOST_TAP,
            "nud",
            "permanent",
        ])?;
        ip(&[
            "-n", ns, "route", "add", "default", "via", gw, "dev", HOST_TAP,
        ])?;
    }
    Ok(())
}

/// Writes a /proc/sys file as seen from namespace `ns`.
fn in_netns_write(ns: &str, path: &str, value: &str) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "sh",
            "-c",
            &format!("echo {value} > {path}"),
        ])
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{path} in {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The MAC address of interface `dev` in namespace `ns`.
fn mac_in_netns(ns: &str, dev: &str) -> Result<String, String> {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", dev])
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .map(str::to_owned)
        .ok_or_else(|| format!("no MAC for {dev} in {ns}: {text}"))
}

/// The whole host part of a hand-over, run in the host namespace: restore `st`, steer the
/// flow here, send `count` bytes of `file` from `offset`, wait for the peer's ACK, hold the
/// flow, dump, close in repair mode. Returns the bytes sent and the state to hand back.
pub fn send_on_connection(
    vm: &str,
    ctl: &Arc<SteerControl>,
    st: &TcpState,
    file: std::fs::File,
    offset: u64,
    count: u64,
) -> Result<(u64, TcpState), HandoverError> {
    let key = flow_key(&st.local, &st.remote)?;
    let ns = vmsight_netdev::tap::netns_path(&host_netns_name(vm));
    let (ctl, st) = (ctl.clone(), st.clone());
    std::thread::Builder::new()
        .name("vmsight-hylics-sock".into())
        .spawn(move || {
            vmsight_netdev::tap::enter_netns(&ns).map_err(|e| HandoverError::Setup {
                ns: ns.display().to_string(),
                reason: e.to_string(),
            })?;
            let sock = restore(&st)?;
            ctl.to_host(key)?;
            thaw(&sock)?;
            // From here bytes may be on the wire: the guest must get the real state back
            // even when sending stopped early (a failure answer makes it restore the old,
            // stale one), so a send error only shortens the count.
            let sent = send_and_wait(&sock, &file, offset, count);
            ctl.hold(key)?;
            let back = freeze(&sock, &st.local, &st.remote)?;
            drop(sock); // closed in repair mode: no FIN, no RST
            if let Some(e) = &sent.error {
                tracing::info!(error = %e, sent = sent.sent, count, "hylics: the socket hand-over sent less than asked");
            }
            Ok((sent.sent, back))
        })
        .map_err(sys("thread"))?
        .join()
        .map_err(|_| HandoverError::Sys {
            what: "hand-over thread",
            source: std::io::Error::other("panicked"),
        })?
}

/// What the host sent on the connection, and why it stopped early if it did.
struct Sent {
    sent: u64,
    error: Option<HandoverError>,
}

/// sendfile(2) of `count` bytes from `offset`, then waits until the peer acknowledged them.
fn send_and_wait(sock: &OwnedFd, file: &std::fs::File, offset: u64, count: u64) -> Sent {
    let mut sent = 0;
    let error = send_all(sock, file, offset, count, &mut sent)
        .and_then(|()| wait_acked(sock.as_raw_fd()))
        .err();
    Sent { sent, error }
}

fn send_all(
    sock: &OwnedFd,
    file: &std::fs::File,
    offset: u64,
    count: u64,
    sent: &mut u64,
) -> Result<(), HandoverError> {
    let stream = dup_stream(sock)?;
    let _ = stream.set_write_timeout(Some(ACK_TIMEOUT));
    let mut off = i64::try_from(offset).map_err(|_| HandoverError::Addr("offset".into()))?;
    while *sent < count {
        let chunk = usize::try_from((count - *sent).min(1 << 30)).unwrap_or(1 << 30);
        let n =
            nix::sys::sendfile::sendfile(&stream, file, Some(&mut off), chunk).map_err(|e| {
                HandoverError::Sys {
                    what: "sendfile",
                    source: e.into(),
                }
            })?;
        if n == 0 {
            break;
        }
        *sent += n as u64;
    }
    Ok(())
}

fn dup_stream(sock: &OwnedFd) -> Result<TcpStream, HandoverError> {
    Ok(TcpStream::from(sock.try_clone().map_err(sys("dup"))?))
}

/// Waits until the send queue is empty: the peer acknowledged everything.
fn wait_acked(fd: RawFd) -> Result<(), HandoverError> {
    let t0 = Instant::now();
    while ioctl_int(fd, SIOCOUTQ)? > 0 {
        if t0.elapsed() > ACK_TIMEOUT {
            return Err(HandoverError::NotAcked(ACK_TIMEOUT));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A new socket in the current namespace carrying the connection `st` (repair mode still on).
fn restore(st: &TcpState) -> Result<OwnedFd, HandoverError> {
    let (local, remote) = (parse_v4(&st.local)?, parse_v4(&st.remote)?);
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(sys("socket")(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a socket we just created and own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let fd = sock.as_raw_fd();
    tcp_set(fd, TCP_REPAIR, TCP_REPAIR_ON, "TCP_REPAIR on")?;
    tcp_set(fd, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE, "send queue")?;
    tcp_set(fd, TCP_QUEUE_SEQ, st.snd_seq as libc::c_int, "send seq")?;
    tcp_set(fd, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE, "recv queue")?;
    tcp_set(fd, TCP_QUEUE_SEQ, st.rcv_seq as libc::c_int, "recv seq")?;
    tcp_set(fd, libc::TCP_MAXSEG, st.mss as libc::c_int, "TCP_MAXSEG")?;
    setopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1, "SO_REUSEADDR")?;
    sockaddr_call(fd, local, "bind", |fd, a, l| {
        // SAFETY: `a` points to a sockaddr_in of length `l` that outlives the call.
        unsafe { libc::bind(fd, a, l) }
    })?;
    sockaddr_call(fd, remote, "connect (repair)", |fd, a, l| {
        // SAFETY: as above; in repair mode connect(2) sets the state without a SYN.
        unsafe { libc::connect(fd, a, l) }
    })?;
    set_repair_options(fd, st)?;
    if st.tstamp {
        tcp_set(fd, TCP_TIMESTAMP, st.ts_val as libc::c_int, "TCP_TIMESTAMP")?;
    }
    let window: [u32; 5] = [
        st.snd_wl1,
        st.snd_wnd,
        st.max_window,
        st.rcv_wnd,
        st.rcv_wup,
    ];
    setopt_bytes(fd, TCP_REPAIR_WINDOW, &window, "TCP_REPAIR_WINDOW")?;
    Ok(sock)
}

fn set_repair_options(fd: RawFd, st: &TcpState) -> Result<(), HandoverError> {
    let mut opts: Vec<[u32; 2]> = vec![[TCPOPT_MSS, st.mss]];
    if st.wscale {
        opts.push([
            TCPOPT_WINDOW,
            u32::from(st.snd_wscale) | (u32::from(st.rcv_wscale) << 16),
        ]);
    }
    if st.sack {
        opts.push([TCPOPT_SACK_PERM, 0]);
    }
    if st.tstamp {
        opts.push([TCPOPT_TIMESTAMP, 0]);
    }
    setopt_bytes(fd, TCP_REPAIR_OPTIONS, &opts, "TCP_REPAIR_OPTIONS")
}

/// Repair mode off without a window probe (the peer already knows the window).
fn thaw(sock: &OwnedFd) -> Result<(), HandoverError> {
    let fd = sock.as_raw_fd();
    tcp_set(fd, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP, "TCP_REPAIR off")
}

/// Repair mode on, and the connection's state (with the received, unread bytes).
fn freeze(sock: &OwnedFd, local: &str, remote: &str) -> Result<TcpState, HandoverError> {
    let fd = sock.as_raw_fd();
    tcp_set(fd, TCP_REPAIR, TCP_REPAIR_ON, "TCP_REPAIR on")?;
    // A FIN or RST from the peer cannot travel in the state: the guest would never see it.
    let (state, _, _) = tcp_info_fields(fd)?;
    if state != TCP_ESTABLISHED {
        return Err(HandoverError::NotEstablished(state));
    }
    let inq = usize::try_from(ioctl_int(fd, SIOCINQ)?).unwrap_or(0);
    if inq > MAX_HANDBACK_BYTES {
        return Err(HandoverError::TooMuchReceived(inq));
    }
    tcp_set(fd, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE, "send queue")?;
    let snd_seq = getopt_u32(fd, libc::IPPROTO_TCP, TCP_QUEUE_SEQ)?;
    tcp_set(fd, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE, "recv queue")?;
    let rcv_seq = getopt_u32(fd, libc::IPPROTO_TCP, TCP_QUEUE_SEQ)?;
    let data = peek(fd, inq)?;
    let mss = getopt_u32(fd, libc::IPPROTO_TCP, libc::TCP_MAXSEG)?;
    let ts_val = getopt_u32(fd, libc::IPPROTO_TCP, TCP_TIMESTAMP)?;
    let (_, options, wscales) = tcp_info_fields(fd)?;
    let mut w = [0u32; 5];
    getopt_slice(
        fd,
        libc::IPPROTO_TCP,
        TCP_REPAIR_WINDOW,
        &mut w,
        "TCP_REPAIR_WINDOW",
    )?;
    Ok(TcpState {
        local: local.to_owned(),
        remote: remote.to_owned(),
        snd_seq,
        rcv_seq,
        mss,
        tstamp: options & TCPI_OPT_TIMESTAMPS != 0,
        sack: options & TCPI_OPT_SACK != 0,
        wscale: options & TCPI_OPT_WSCALE != 0,
        snd_wscale: wscales & 0x0f,
        rcv_wscale: wscales >> 4,
        ts_val,
        snd_wl1: w[0],
        snd_wnd: w[1],
        max_window: w[2],
        rcv_wnd: w[3],
        rcv_wup: w[4],
        rcv_data: hex(&data),
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `tcpi_state`, `tcpi_options` and the byte holding `tcpi_snd_wscale` (low nibble) and
/// `tcpi_rcv_wscale`.
fn tcp_info_fields(fd: RawFd) -> Result<(u8, u8, u8), HandoverError> {
    let mut info = [0u8; 104];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes; the kernel writes at most that.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(sys("TCP_INFO")(std::io::Error::last_os_error()));
    }
    Ok((info[0], info[5], info[6]))
}

fn peek(fd: RawFd, n: usize) -> Result<Vec<u8>, HandoverError> {
    let mut buf = vec![0u8; n];
    if n == 0 {
        return Ok(buf);
    }
    // SAFETY: `buf` is writable for `n` bytes.
    let got = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            n,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if got < 0 {
        return Err(sys("peek at the receive queue")(
            std::io::Error::last_os_error(),
        ));
    }
    buf.truncate(got.unsigned_abs());
    Ok(buf)
}

fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> Result<i32, HandoverError> {
    let mut v: libc::c_int = 0;
    // SAFETY: these ioctls write one int through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(fd, req, &mut v) };
    if rc < 0 {
        return Err(sys("socket queue ioctl")(std::io::Error::last_os_error()));
    }
    Ok(v)
}

/// `Ok` for a libc call's non-negative result, else the OS error for `what`.
fn check(rc: libc::c_int, what: &'static str) -> Result<(), HandoverError> {
    if rc < 0 {
        return Err(sys(what)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// A TCP-level integer socket option.
fn tcp_set(
    fd: RawFd,
    name: libc::c_int,
    value: libc::c_int,
    what: &'static str,
) -> Result<(), HandoverError> {
    setopt(fd, libc::IPPROTO_TCP, name, value, what)
}

fn setopt(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
    what: &'static str,
) -> Result<(), HandoverError> {
    setopt_slice(fd, level, name, std::slice::from_ref(&value), what)
}

fn setopt_bytes<T: Copy>(
    fd: RawFd,
    name: libc::c_int,
    value: &[T],
    what: &'static str,
) -> Result<(), HandoverError> {
    setopt_slice(fd, libc::IPPROTO_TCP, name, value, what)
}

fn setopt_slice<T: Copy>(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &[T],
    what: &'static str,
) -> Result<(), HandoverError> {
    // SAFETY: `value` is a live slice of plain integers; its byte size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            value.as_ptr().cast(),
            std::mem::size_of_val(value) as libc::socklen_t,
        )
    };
    check(rc, what)
}

fn getopt_u32(fd: RawFd, level: libc::c_int, name: libc::c_int) -> Result<u32, HandoverError> {
    let mut v = [0u32];
    getopt_slice(fd, level, name, &mut v, "getsockopt")?;
    Ok(v[0])
}

fn getopt_slice(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    out: &mut [u32],
    what: &'static str,
) -> Result<(), HandoverError> {
    let mut len = std::mem::size_of_val(out) as libc::socklen_t;
    // SAFETY: `out` is writable for `len` bytes.
    let rc = unsafe { libc::getsockopt(fd, level, name, out.as_mut_ptr().cast(), &mut len) };
    check(rc, what)
}

fn sockaddr_call(
    fd: RawFd,
    addr: SocketAddrV4,
    what: &'static str,
    call: impl FnOnce(RawFd, *const libc::sockaddr, libc::socklen_t) -> libc::c_int,
) -> Result<(), HandoverError> {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let rc = call(
        fd,
        (&sa as *const libc::sockaddr_in).cast(),
        size_of::<libc::sockaddr_in>() as libc::socklen_t,
    );
    check(rc, what)
}

/// The network namespace path of the host side, for tests and diagnostics.
pub fn host_netns_path(vm: &str) -> PathBuf {
    vmsight_netdev::tap::netns_path(&host_netns_name(vm))
}
