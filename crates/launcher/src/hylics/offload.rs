//! Hylics' send offload, module scheme (paper §4): the guest asks vmsight over vsock to send a
//! file of the share to a client, and vmsight sends it from the host's tmpfs with sendfile(2),
//! so the payload never crosses the guest's CPUs or its network device.
//!
//! The service listens on the vsock device's host socket for guest connections to host port
//! [`SERVICE_PORT`] (`<rt>/vsock.sock_5100`, vhost-device-vsock's hybrid vsock). Each
//! connection carries JSON lines: a [`HylicsRequest`] per line, a [`HylicsReply`] per line.
//! The same channel carries the guest library's task reports and eviction-advice requests to
//! the share-size controller ([`super::control`]).
//!
//! Everything the guest sends is hostile input:
//! - request lines are bounded ([`MAX_REQUEST_LINE`]) and must parse as a known request;
//! - the file is opened relative to the share with `openat2(RESOLVE_IN_ROOT)`: `..` and
//!   symlinks the guest made can never leave the share (the kernel resolves them as if the
//!   share were `/`); only regular files are sent;
//! - the TCP connection to the client is made from the VM's own network namespace, so the
//!   guest reaches through vmsight exactly what it can reach itself, and never the host's own
//!   services; loopback, unspecified and multicast destinations are refused; VMs without a
//!   namespace of their own (`--net tap=`/`bridge=`/`none`) get no send offload;
//! - connect and send have time limits, and at most [`MAX_CONNECTIONS`] guest connections are
//!   served at once.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use vmsight_proto::hylics::{HylicsReply, HylicsRequest, MAX_REQUEST_LINE, SERVICE_PORT};
use vmsight_proto::server::{ServeError, UnixServer};

use super::control::ShareController;
use super::handover::{self, HandoverError};
use vmsight_netdev::stages::steer::{FlowKey, SteerControl};

/// Guest connections served at once; more are answered "busy" and closed.
pub const MAX_CONNECTIONS: u64 = 16;
/// How long a connection to the client may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one write to the client may block (a stalled client ends the request).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a guest connection may stay silent between requests.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a send-offload request failed; the sentence goes back to the guest.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error("{0:?} is not IP:PORT")]
    Dest(String),
    #[error("destination {0} is not allowed (loopback, unspecified or multicast)")]
    DestNotAllowed(SocketAddr),
    #[error("this VM has no network namespace of its own (--net isolated): no send offload")]
    NoNamespace,
    #[error("no Hylics controller in this VM (start it with --hylics-slo TAU)")]
    NoController,
    #[error("socket hand-over: {0}")]
    Handover(#[from] HandoverError),
    #[error("sock-send on a connection this channel did not hold first (sock-hold)")]
    NotHeld,
    #[error("{0}")]
    Report(#[from] super::control::ReportError),
    #[error("the path is empty or has a NUL byte")]
    Path,
    #[error("cannot open {path:?} in the share: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0:?} is not a regular file")]
    NotRegular(String),
    #[error("offset {offset} is beyond the end of {path:?} ({size} bytes)")]
    Range {
        path: String,
        offset: u64,
        size: u64,
    },
    #[error("cannot enter the VM's network namespace: {0}")]
    Netns(String),
    #[error("cannot connect to {dest}: {source}")]
    Connect {
        dest: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("sending to {dest} failed after {sent} bytes: {source}")]
    Send {
        dest: SocketAddr,
        sent: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Counters of the send offload (stats, metrics).
#[derive(Debug, Default)]
pub struct OffloadMetrics {
    requests: AtomicU64,
    files_sent: AtomicU64,
    bytes_sent: AtomicU64,
    failures: AtomicU64,
    busy: AtomicU64,
    bad_requests: AtomicU64,
    active: AtomicU64,
}

/// A copy of [`OffloadMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OffloadSnapshot {
    /// Requests that parsed.
    pub requests: u64,
    /// Files (ranges) sent completely.
    pub files_sent: u64,
    /// Payload bytes sent by the host on the guest's behalf.
    pub bytes_sent: u64,
    /// Requests that failed (refused, unreachable client, short send).
    pub failures: u64,
    /// Connections turned away because [`MAX_CONNECTIONS`] were being served.
    pub busy: u64,
    /// Lines that were too long or not a request (the connection is closed).
    pub bad_requests: u64,
}

impl OffloadMetrics {
    /// The counters now.
    pub fn snapshot(&self) -> OffloadSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        OffloadSnapshot {
            requests: g(&self.requests),
            files_sent: g(&self.files_sent),
            bytes_sent: g(&self.bytes_sent),
            failures: g(&self.failures),
            busy: g(&self.busy),
            bad_requests: g(&self.bad_requests),
        }
    }
}

/// What a request may use.
#[derive(Debug, Clone)]
pub struct OffloadCtx {
    /// The share's host directory.
    pub share_dir: PathBuf,
    /// The VM's network namespace (`/run/netns/...`), if it has one.
    pub netns: Option<PathBuf>,
    /// The share-size controller the task reports go to (`--hylics-slo`).
    pub controller: Option<Arc<ShareController>>,
    /// The VM (its host namespace for handed-over connections is named after it).
    pub vm: String,
    /// The NIC's steering table (socket scheme), with an isolated network on vmsight's NIC.
    pub steer: Option<Arc<SteerControl>>,
}

/// The running service.
pub struct OffloadService {
    server: UnixServer,
    metrics: Arc<OffloadMetrics>,
}

impl OffloadService {
    /// Listens for the guest's connections to host port [`SERVICE_PORT`] on the vsock
    /// device's host socket `uds` (`<uds>_5100`).
    pub fn start(uds: &Path, ctx: OffloadCtx) -> Result<OffloadService, ServeError> {
        let path = PathBuf::from(format!("{}_{SERVICE_PORT}", uds.display()));
        let metrics = Arc::new(OffloadMetrics::default());
        let m = metrics.clone();
        let ctx = Arc::new(ctx);
        let server = UnixServer::bind(&path, "vmsight-hylics", move |conn| match conn {
            Ok(stream) => admit(stream, ctx.clone(), m.clone()),
            Err(e) => tracing::debug!(error = %e, "hylics: accept failed"),
        })?;
        Ok(OffloadService { server, metrics })
    }

    /// The counters, shared.
    pub fn metrics(&self) -> Arc<OffloadMetrics> {
        self.metrics.clone()
    }

    /// Stops listening (connections being served finish on their own threads).
    pub fn stop(self) {
        self.server.stop();
    }
}

/// Serves a connection on a thread of its own, or turns it away when too many are served.
fn admit(stream: UnixStream, ctx: Arc<OffloadCtx>, m: Arc<OffloadMetrics>) {
    if m.active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        m.active.fetch_sub(1, Ordering::AcqRel);
        m.busy.fetch_add(1, Ordering::Relaxed);
        let mut s = stream;
        let _ = reply(
            &mut s,
            &HylicsReply::failed("busy: too many offload connections"),
        );
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("vmsight-hylics-conn".into())
        .spawn({
            let m = m.clone();
            move || {
                // Not filtered: a connection enters the NIC's network namespace (`setns`) and a
                // hand-over runs `ip` there (docs/security.md, "Still trusted").
                serve_conn(stream, &ctx, &m);
                m.active.fetch_sub(1, Ordering::AcqRel);
            }
        });
    if spawned.is_err() {
        m.active.fetch_sub(1, Ordering::AcqRel);
    }
}

fn reply(s: &mut UnixStream, r: &HylicsReply) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line)
}

/// Answers the requests of one guest connection until it closes or misbehaves.
fn serve_conn(stream: UnixStream, ctx: &OffloadCtx, m: &OffloadMetrics) {
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut input = BufReader::new(stream);
    let mut line = Vec::new();
    let mut held = HeldFlows::new(ctx.steer.clone());
    loop {
        line.clear();
        let limit = (MAX_REQUEST_LINE + 1) as u64;
        match (&mut input).take(limit).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let Some(req) = parse_request(&line) else {
            m.bad_requests.fetch_add(1, Ordering::Relaxed);
            let _ = reply(
                &mut out,
                &HylicsReply::failed("bad request (one JSON object per line, at most 4096 bytes)"),
            );
            return;
        };
        m.requests.fetch_add(1, Ordering::Relaxed);
        let answer = match handle(&req, ctx, m, &mut held) {
            Ok(answer) => answer,
            Err(e) => {
                m.failures.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "hylics: a guest request failed");
                HylicsReply::failed(e.to_string())
            }
        };
        if reply(&mut out, &answer).is_err() {
            return;
        }
    }
}

/// A complete, bounded line that is a request; `None` otherwise.
pub(crate) fn parse_request(line: &[u8]) -> Option<HylicsRequest> {
    if line.len() > MAX_REQUEST_LINE || line.last() != Some(&b'\n') {
        return None;
    }
    serde_json::from_slice(line).ok()
}

/// The connections one guest connection holds; released when it ends, so a guest that
/// disappears mid-hand-over never leaves a connection steered away from it.
struct HeldFlows {
    steer: Option<Arc<SteerControl>>,
    flows: Vec<FlowKey>,
}

impl HeldFlows {
    fn new(steer: Option<Arc<SteerControl>>) -> Self {
        Self {
            steer,
            flows: Vec::new(),
        }
    }

    fn steer(&self) -> Result<&Arc<SteerControl>, OffloadError> {
        self.steer
            .as_ref()
            .ok_or(OffloadError::Handover(HandoverError::NoSteering))
    }

    fn hold(&mut self, key: FlowKey) -> Result<(), OffloadError> {
        self.steer()?.hold(key).map_err(HandoverError::from)?;
        if !self.flows.contains(&key) {
            self.flows.push(key);
        }
        Ok(())
    }

    fn release(&mut self, key: FlowKey) -> Result<(), OffloadError> {
        self.flows.retain(|k| *k != key);
        self.steer()?.release(key);
        Ok(())
    }
}

impl Drop for HeldFlows {
    fn drop(&mut self) {
        if let Some(s) = &self.steer {
            for k in self.flows.drain(..) {
                s.release(k);
            }
        }
    }
}

fn handle(
    req: &HylicsRequest,
    ctx: &OffloadCtx,
    m: &OffloadMetrics,
    held: &mut HeldFlows,
) -> Result<HylicsReply, OffloadError> {
    match req {
        HylicsRequest::SockHold { local, remote } => {
            held.hold(handover::flow_key(local, remote)?)?;
            Ok(HylicsReply::ack())
        }
        HylicsRequest::SockRelease { local, remote } => {
            held.release(handover::flow_key(local, remote)?)?;
            Ok(HylicsReply::ack())
        }
        HylicsRequest::SockSend {
            path,
            offset,
            len,
            tcp,
        } => {
            let key = handover::flow_key(&tcp.local, &tcp.remote)?;
            if !held.flows.contains(&key) {
                return Err(OffloadError::NotHeld);
            }
            let file = open_in_share(&ctx.share_dir, path)?;
            let size = file
                .metadata()
                .map_err(|source| OffloadError::Open {
                    path: path.clone(),
                    source,
                })?
                .len();
            let count = range(path, size, *offset, *len)?;
            let (bytes, back) =
                handover::send_on_connection(&ctx.vm, held.steer()?, tcp, file, *offset, count)?;
            m.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            m.files_sent.fetch_add(1, Ordering::Relaxed);
            Ok(HylicsReply::SockSent {
                ok: vmsight_proto::hylics::True,
                bytes,
                tcp: back,
            })
        }
        HylicsRequest::SendFile {
            dest,
            path,
            offset,
            len,
        } => {
            let bytes = send_file(ctx, m, dest, path, *offset, *len)?;
            m.files_sent.fetch_add(1, Ordering::Relaxed);
            Ok(HylicsReply::sent(bytes))
        }
        HylicsRequest::Arrive => {
            controller(ctx)?.arrived()?;
            Ok(HylicsReply::ack())
        }
        HylicsRequest::Task { response_secs } => {
            controller(ctx)?.done(*response_secs)?;
            Ok(HylicsReply::ack())
        }
        HylicsRequest::Advice => {
            let a = controller(ctx)?.advice();
            Ok(HylicsReply::Advice {
                ok: vmsight_proto::hylics::True,
                free_bytes: a.free_bytes,
                evict: a.evict,
            })
        }
    }
}

fn controller(ctx: &OffloadCtx) -> Result<&ShareController, OffloadError> {
    ctx.controller.as_deref().ok_or(OffloadError::NoController)
}

/// Module scheme: sends `len` bytes of the share's `path` from `offset` to `dest`.
fn send_file(
    ctx: &OffloadCtx,
    m: &OffloadMetrics,
    dest: &str,
    path: &str,
    offset: u64,
    len: u64,
) -> Result<u64, OffloadError> {
    let dest = parse_dest(dest)?;
    let netns = ctx.netns.as_deref().ok_or(OffloadError::NoNamespace)?;
    let file = open_in_share(&ctx.share_dir, path)?;
    let size = file
        .metadata()
        .map_err(|source| OffloadError::Open {
            path: path.to_owned(),
            source,
        })?
        .len();
    let count = range(path, size, offset, len)?;
    let sock = connect_in_netns(netns, dest)?;
    send_range(&file, &sock, offset, count, dest, m)
}

/// `IP:PORT`, not loopback, unspecified or multicast.
pub(crate) fn parse_dest(dest: &str) -> Result<SocketAddr, OffloadError> {
    let addr: SocketAddr = dest
        .parse()
        .map_err(|_| OffloadError::Dest(dest.to_owned()))?;
    let ip = addr.ip();
    let bad = ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || addr.port() == 0
        || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    if bad {
        return Err(OffloadError::DestNotAllowed(addr));
    }
    Ok(addr)
}

/// Bytes to send: `len`, or to the end when 0, never beyond the end.
pub(crate) fn range(path: &str, size: u64, offset: u64, len: u64) -> Result<u64, OffloadError> {
    if offset > size {
        return Err(OffloadError::Range {
            path: path.to_owned(),
            offset,
            size,
        });
    }
    let left = size - offset;
    Ok(if len == 0 { left } else { len.min(left) })
}

/// Opens `path` for reading as if the share were the root: `..`, absolute symlinks and
/// magic links cannot leave it (`openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`).
///
/// Hand-written because neither `nix` 0.29 nor std wraps openat2(2); `cap-std` would, at the
/// cost of a dependency tree for one call.
pub(crate) fn open_in_share(share: &Path, path: &str) -> Result<File, OffloadError> {
    use std::os::unix::ffi::OsStrExt;
    let open_err = |source| OffloadError::Open {
        path: path.to_owned(),
        source,
    };
    let rel = path.trim_start_matches('/');
    if rel.is_empty() || rel.as_bytes().contains(&0) {
        return Err(OffloadError::Path);
    }
    let root = File::open(share).map_err(open_err)?;
    let c_path = std::ffi::CString::new(std::ffi::OsStr::new(rel).as_bytes())
        .map_err(|_| OffloadError::Path)?;
    // SAFETY: open_how is three integers (libc marks it non-exhaustive for future fields);
    // all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads `c_path` (a NUL-terminated string that outlives the call) and
    // `how` (a properly initialized open_how whose size is passed); it returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            c_path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(open_err(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a file descriptor openat2 just returned to us and nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        return Err(OffloadError::NotRegular(path.to_owned()));
    }
    Ok(file)
}

/// A TCP connection to `dest` made from the VM's network namespace: a short-lived thread
/// enters the namespace and connects; the socket stays in that namespace afterwards.
fn connect_in_netns(netns: &Path, dest: SocketAddr) -> Result<TcpStream, OffloadError> {
    let netns = netns.to_owned();
    let joined = std::thread::Builder::new()
        .name("vmsight-hylics-ns".into())
        .spawn(move || -> Result<TcpStream, OffloadError> {
            vmsight_netdev::tap::enter_netns(&netns)
                .map_err(|e| OffloadError::Netns(e.to_string()))?;
            TcpStream::connect_timeout(&dest, CONNECT_TIMEOUT)
                .map_err(|source| OffloadError::Connect { dest, source })
        })
        .map_err(|e| OffloadError::Netns(e.to_string()))?
        .join()
        .map_err(|_| OffloadError::Netns("the namespace thread panicked".into()))?;
    let sock = joined?;
    let _ = sock.set_write_timeout(Some(SEND_TIMEOUT));
    let _ = sock.set_nodelay(true);
    Ok(sock)
}

/// sendfile(2) from the tmpfs file to the socket: `count` bytes from `offset`.
fn send_range(
    file: &File,
    sock: &TcpStream,
    offset: u64,
    count: u64,
    dest: SocketAddr,
    m: &OffloadMetrics,
) -> Result<u64, OffloadError> {
    let mut off = i64::try_from(offset).map_err(|_| OffloadError::Send {
        dest,
        sent: 0,
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    let mut sent = 0u64;
    while sent < count {
        let chunk = usize::try_from((count - sent).min(1 << 30)).unwrap_or(1 << 30);
        match nix::sys::sendfile::sendfile64(sock.as_fd(), file.as_fd(), Some(&mut off), chunk) {
            Ok(0) => break, // the file shrank under us
            Ok(n) => {
                sent += n as u64;
                m.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                return Err(OffloadError::Send {
                    dest,
                    sent,
                    source: std::io::Error::from(e),
                })
            }
        }
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn share() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::write(
            d.path().join("f.bin"),
            (0..=255u8).cycle().take(100_000).collect::<Vec<_>>(),
        )
        .expect("write");
        std::fs::create_dir(d.path().join("sub")).expect("mkdir");
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("sub/abs")).expect("ln");
        std::os::unix::fs::symlink("../../../../etc/passwd", d.path().join("sub/rel")).expect("ln");
        d
    }

    #[test]
    fn paths_resolve_inside_the_share_only() {
        let d = share();
        assert!(open_in_share(d.path(), "f.bin").is_ok());
        assert!(
            open_in_share(d.path(), "/f.bin").is_ok(),
            "a leading / means the share's root"
        );
        // Escapes resolve inside the share, where there is no etc/passwd.
        for escape in [
            "../../../../etc/passwd",
            "sub/abs",
            "sub/rel",
            "/../etc/passwd",
        ] {
            let e = open_in_share(d.path(), escape).expect_err(escape);
            assert!(
                matches!(&e, OffloadError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
                "{escape}: {e}"
            );
        }
        assert!(matches!(
            open_in_share(d.path(), "sub"),
            Err(OffloadError::NotRegular(_))
        ));
        assert!(matches!(
            open_in_share(d.path(), ""),
            Err(OffloadError::Path)
        ));
        assert!(matches!(
            open_in_share(d.path(), "a\0b"),
            Err(OffloadError::Path)
        ));
    }

    #[test]
    fn destinations_are_ip_and_port_and_never_loopback() {
        assert_eq!(
            parse_dest("10.0.2.1:9000").expect("ok"),
            "10.0.2.1:9000".parse().expect("addr")
        );
        for bad in [
            "127.0.0.1:22",
            "[::1]:22",
            "0.0.0.0:80",
            "224.0.0.1:5",
            "10.0.2.1:0",
            "255.255.255.255:9",
        ] {
            assert!(
                matches!(parse_dest(bad), Err(OffloadError::DestNotAllowed(_))),
                "{bad}"
            );
        }
        for bad in ["localhost:80", "10.0.2.1", "x", ""] {
            assert!(
                matches!(parse_dest(bad), Err(OffloadError::Dest(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn ranges_stop_at_the_end_of_the_file() {
        assert_eq!(range("f", 100, 0, 0).expect("ok"), 100);
        assert_eq!(range("f", 100, 40, 0).expect("ok"), 60);
        assert_eq!(range("f", 100, 40, 10).expect("ok"), 10);
        assert_eq!(range("f", 100, 40, 1000).expect("ok"), 60);
        assert_eq!(range("f", 100, 100, 0).expect("ok"), 0);
        assert!(range("f", 100, 101, 0).is_err());
    }

    #[test]
    fn request_lines_are_bounded_and_typed() {
        assert!(
            parse_request(b"{\"op\":\"send-file\",\"dest\":\"1.2.3.4:5\",\"path\":\"a\"}\n")
                .is_some()
        );
        assert!(
            parse_request(b"{\"op\":\"send-file\",\"dest\":\"1.2.3.4:5\",\"path\":\"a\"}")
                .is_none(),
            "no newline: truncated"
        );
        let mut long = br#"{"op":"send-file","dest":"1.2.3.4:5","path":""#.to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_REQUEST_LINE));
        long.extend(b"\"}\n");
        assert!(parse_request(&long).is_none());
        assert!(parse_request(b"\xff\xfe\n").is_none());
    }

    /// sendfile of a range to a real TCP socket: the receiver gets exactly those bytes.
    #[test]
    fn a_range_is_sent_byte_for_byte() {
        let d = share();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut got = Vec::new();
            s.read_to_end(&mut got).expect("read");
            got
        });
        let file = open_in_share(d.path(), "f.bin").expect("open");
        let sock = TcpStream::connect(addr).expect("connect");
        let m = OffloadMetrics::default();
        let n = send_range(&file, &sock, 1000, 50_000, addr, &m).expect("sends");
        drop(sock);
        let got = reader.join().expect("reader");
        let want: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        assert_eq!(n, 50_000);
        assert_eq!(got, want[1000..51_000]);
        assert_eq!(m.snapshot().bytes_sent, 50_000);
    }
}
