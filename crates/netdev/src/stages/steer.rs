//! Steering of single TCP connections away from the guest (Hylics' socket scheme).
//!
//! While vmsight sends on a connection the guest accepted, the connection lives in a host
//! socket (recreated with `TCP_REPAIR` in a namespace of its own that carries the guest's
//! address and MAC). This stage moves the connection's frames:
//!
//! ```text
//!            peer ── VM tap ──► [steer] ──► guest            (normal)
//!  Hold:     peer ── VM tap ──► [steer] ✗                    both ways dropped (TCP retransmits)
//!  Host:     peer ── VM tap ──► [steer] ──► host tap ──► host socket
//!            host socket ──► host tap ──► forward_from_host ──► VM tap ──► peer
//! ```
//!
//! Frames the guest sends for a steered connection are dropped in both modes (its socket is
//! frozen; what it might still send is in the state it handed over). The table is bounded
//! ([`MAX_FLOWS`]): the guest asks for entries and is hostile input.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::packet::{tcp_segment, Direction, Frame, TcpSegment, VNET_HDR_LEN};
use crate::stage::{NetStage, Verdict};
use crate::tap::Tap;

/// Connections steered at once.
pub const MAX_FLOWS: usize = 64;

/// One connection: the guest's end and the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub guest: SocketAddrV4,
    pub peer: SocketAddrV4,
}

/// Where a steered connection's frames go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SteerMode {
    /// Nowhere: dropped both ways (during a hand-over).
    Hold,
    /// To the host socket, and the host socket's frames out to the peer.
    Host,
}

/// Why a flow could not be steered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SteerError {
    #[error("at most {MAX_FLOWS} connections can be handed over at once")]
    Full,
    #[error("the connection {0:?} is not being handed over")]
    Unknown(FlowKey),
}

/// Counters of the steering.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SteerSnapshot {
    /// Frames dropped while a connection was held (both ways).
    pub held_drops: u64,
    /// Frames from the peer delivered to the host socket.
    pub to_host: u64,
    /// Frames of the host socket sent to the peer.
    pub from_host: u64,
    /// Frames the guest sent on a steered connection (dropped).
    pub guest_drops: u64,
    /// Frames on the host tap that belong to no steered connection (dropped).
    pub stray: u64,
    /// Hand-overs started (`hold` of a new connection).
    pub handovers: u64,
}

#[derive(Debug, Default)]
struct Counters {
    held_drops: AtomicU64,
    to_host: AtomicU64,
    from_host: AtomicU64,
    guest_drops: AtomicU64,
    stray: AtomicU64,
    handovers: AtomicU64,
}

/// The steering table, shared by the stage (device worker), the forwarding thread and the
/// service that hands connections over.
#[derive(Debug, Default)]
pub struct SteerControl {
    flows: Mutex<HashMap<FlowKey, SteerMode>>,
    /// `flows.len()`, read without the lock on the fast path.
    count: AtomicUsize,
    host_tap: Mutex<Option<Arc<Tap>>>,
    counters: Counters,
}

impl SteerControl {
    /// An empty table.
    pub fn new() -> Arc<SteerControl> {
        Arc::new(SteerControl::default())
    }

    /// Where frames for [`SteerMode::Host`] go (the host socket's namespace's tap).
    pub fn set_host_tap(&self, tap: Arc<Tap>) {
        *self.host_tap.lock().unwrap_or_else(PoisonError::into_inner) = Some(tap);
    }

    /// Starts (or goes back to) holding `key`.
    pub fn hold(&self, key: FlowKey) -> Result<(), SteerError> {
        let mut f = self.flows.lock().unwrap_or_else(PoisonError::into_inner);
        if !f.contains_key(&key) {
            if f.len() >= MAX_FLOWS {
                return Err(SteerError::Full);
            }
            self.counters.handovers.fetch_add(1, Ordering::Relaxed);
        }
        f.insert(key, SteerMode::Hold);
        self.count.store(f.len(), Ordering::Release);
        Ok(())
    }

    /// Sends `key`'s frames to the host socket (it must be held first).
    pub fn to_host(&self, key: FlowKey) -> Result<(), SteerError> {
        let mut f = self.flows.lock().unwrap_or_else(PoisonError::into_inner);
        match f.get_mut(&key) {
            Some(m) => {
                *m = SteerMode::Host;
                Ok(())
            }
            None => Err(SteerError::Unknown(key)),
        }
    }

    /// Gives `key` back to the guest; whether it was steered.
    pub fn release(&self, key: FlowKey) -> bool {
        let mut f = self.flows.lock().unwrap_or_else(PoisonError::into_inner);
        let was = f.remove(&key).is_some();
        self.count.store(f.len(), Ordering::Release);
        was
    }

    /// The mode of `key`, if steered.
    pub fn mode(&self, key: &FlowKey) -> Option<SteerMode> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.flows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .copied()
    }

    /// The counters now.
    pub fn snapshot(&self) -> SteerSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        SteerSnapshot {
            held_drops: g(&c.held_drops),
            to_host: g(&c.to_host),
            from_host: g(&c.from_host),
            guest_drops: g(&c.guest_drops),
            stray: g(&c.stray),
            handovers: g(&c.handovers),
        }
    }

    fn deliver_to_host(&self, frame: &Frame) {
        let tap = self
            .host_tap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match tap {
            Some(t) if t.write(&frame.hdr.to_bytes(), &frame.data).is_ok() => {
                self.counters.to_host.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                self.counters.held_drops.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The flow a segment belongs to, seen from the guest (`dir` says which end is the guest's).
fn key_of(seg: &TcpSegment, dir: Direction) -> Option<FlowKey> {
    let (IpAddr::V4(src), IpAddr::V4(dst)) = (seg.src, seg.dst) else {
        return None;
    };
    let (s, d) = (
        SocketAddrV4::new(src, seg.sport),
        SocketAddrV4::new(dst, seg.dport),
    );
    Some(match dir {
        Direction::FromGuest => FlowKey { guest: s, peer: d },
        Direction::ToGuest => FlowKey { guest: d, peer: s },
    })
}

/// The pipeline stage.
#[derive(Debug)]
pub struct Steer {
    ctl: Arc<SteerControl>,
}

impl Steer {
    /// A stage steering by `ctl`'s table.
    pub fn new(ctl: Arc<SteerControl>) -> Steer {
        Steer { ctl }
    }
}

impl NetStage for Steer {
    fn on_frame(&mut self, dir: Direction, frame: &mut Frame, _now_ns: u64) -> Verdict {
        if self.ctl.count.load(Ordering::Acquire) == 0 {
            return Verdict::Pass;
        }
        let Some(key) = tcp_segment(&frame.data).and_then(|s| key_of(&s, dir)) else {
            return Verdict::Pass;
        };
        let c = &self.ctl.counters;
        match (self.ctl.mode(&key), dir) {
            (None, _) => return Verdict::Pass,
            (Some(_), Direction::FromGuest) => c.guest_drops.fetch_add(1, Ordering::Relaxed),
            (Some(SteerMode::Hold), Direction::ToGuest) => {
                c.held_drops.fetch_add(1, Ordering::Relaxed)
            }
            (Some(SteerMode::Host), Direction::ToGuest) => {
                self.ctl.deliver_to_host(frame);
                0
            }
        };
        Verdict::Drop
    }
}

/// Forwards the host socket's frames from `host_tap` out of `vm_tap` (as if the guest sent
/// them) until `stop`: only TCP segments of connections in [`SteerMode::Host`], from the
/// guest's address; everything else the host namespace emits is dropped.
pub fn forward_from_host(
    ctl: Arc<SteerControl>,
    host_tap: Arc<Tap>,
    vm_tap: Tap,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vmsight-steer".into())
        .spawn(move || {
            // Frames from the host side of the link are all it handles from now on.
            vmsight_vhostd::seccomp::install_once(
                vmsight_vhostd::seccomp::ThreadClass::GuestService,
            );
            let mut buf = vec![0u8; VNET_HDR_LEN + crate::packet::MAX_FRAME_LEN];
            while !stop.load(Ordering::Relaxed) {
                if !readable(&host_tap, Duration::from_millis(100)) {
                    continue;
                }
                while let Ok(n) = host_tap.read(&mut buf) {
                    forward_one(&ctl, &vm_tap, &buf[..n]);
                }
            }
        })
}

fn forward_one(ctl: &SteerControl, vm_tap: &Tap, buf: &[u8]) {
    let Some((hdr, data)) = buf.split_first_chunk::<VNET_HDR_LEN>() else {
        return;
    };
    let key = tcp_segment(data).and_then(|s| key_of(&s, Direction::FromGuest));
    let ok = key.is_some_and(|k| ctl.mode(&k) == Some(SteerMode::Host));
    if ok && vm_tap.write(hdr, data).is_ok() {
        ctl.counters.from_host.fetch_add(1, Ordering::Relaxed);
    } else {
        ctl.counters.stray.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether `tap` has a frame to read within `timeout`.
fn readable(tap: &Tap, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: tap.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    rc > 0 && pfd.revents & libc::POLLIN != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;

    fn key() -> FlowKey {
        FlowKey {
            guest: "10.0.2.15:8080".parse().unwrap(),
            peer: "10.0.2.1:40000".parse().unwrap(),
        }
    }

    /// A one-byte segment between the guest's port 8080 and the peer's `peer_port`.
    fn frame_with(dir: Direction, peer_port: u16) -> Frame {
        let (guest, peer) = (([10, 0, 2, 15], 8080), ([10, 0, 2, 1], peer_port));
        let ((src, sport), (dst, dport)) = match dir {
            Direction::ToGuest => (peer, guest),
            Direction::FromGuest => (guest, peer),
        };
        Frame {
            hdr: Default::default(),
            data: tcp4(src, sport, dst, dport, 1, Some(1), 100, false, b"x"),
        }
    }

    fn frame(dir: Direction) -> Frame {
        frame_with(dir, 40000)
    }

    #[test]
    fn only_the_steered_connection_is_held_and_released() {
        let ctl = SteerControl::new();
        let mut st = Steer::new(ctl.clone());
        let mut f = frame(Direction::ToGuest);
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, 0), Verdict::Pass);
        ctl.hold(key()).unwrap();
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, 0), Verdict::Drop);
        let mut g = frame(Direction::FromGuest);
        assert_eq!(st.on_frame(Direction::FromGuest, &mut g, 0), Verdict::Drop);
        // Another connection of the same guest passes.
        let mut other = frame_with(Direction::ToGuest, 40001);
        assert_eq!(
            st.on_frame(Direction::ToGuest, &mut other, 0),
            Verdict::Pass
        );
        // Host mode without a host tap: dropped, counted as held.
        ctl.to_host(key()).unwrap();
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, 0), Verdict::Drop);
        assert!(ctl.release(key()));
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, 0), Verdict::Pass);
        let s = ctl.snapshot();
        assert_eq!((s.held_drops, s.guest_drops, s.handovers), (2, 1, 1));
        assert!(!ctl.release(key()));
        assert_eq!(ctl.to_host(key()), Err(SteerError::Unknown(key())));
    }

    #[test]
    fn the_table_is_bounded() {
        let ctl = SteerControl::new();
        for port in 0..MAX_FLOWS as u16 {
            let mut k = key();
            k.peer.set_port(port + 1);
            ctl.hold(k).unwrap();
        }
        assert_eq!(ctl.hold(key()), Err(SteerError::Full));
    }

    #[test]
    fn garbage_frames_pass_untouched() {
        let ctl = SteerControl::new();
        ctl.hold(key()).unwrap();
        let mut st = Steer::new(ctl);
        for data in [vec![], vec![0u8; 13], vec![0xffu8; 200]] {
            let mut f = Frame {
                hdr: Default::default(),
                data,
            };
            assert_eq!(st.on_frame(Direction::ToGuest, &mut f, 0), Verdict::Pass);
        }
    }
}
