//! FoxyVegas: TCP Vegas for any guest congestion control, by rewriting the receive window of
//! the ACKs the guest gets (FoxyTechnique paper, §4).
//!
//! # Idea
//!
//! A TCP sender never has more than `min(cwnd, rwnd)` bytes in flight. `cwnd` lives inside the
//! guest kernel and is invisible to the device, but `rwnd` travels in every ACK the peer sends,
//! and every such ACK passes through this device. FoxyVegas runs the Vegas algorithm itself for
//! every TCP flow on which the guest sends data, and whenever the Vegas window is smaller than
//! the window the peer advertised, it lowers the window field of the ACK before the guest sees
//! it. The guest believes its receiver is slow and sends no more than Vegas would: whatever
//! congestion control the guest runs (CUBIC, BBR, Reno, ...) behaves like Vegas as long as it
//! would send *more* than Vegas (a guest that sends less is left alone: FoxyVegas only ever
//! lowers windows).
//!
//! # Algorithm
//!
//! * **Flows.** A table keyed by (guest ip, guest port, peer ip, peer port), IPv4 and IPv6. A
//!   flow starts as *half-open* on the first SYN (the guest's for an active open, the peer's
//!   for a passive one; half-open entries live in a small separate table so a SYN flood from
//!   the network cannot push established flows out) and enters the flow table when the
//!   matching SYN-ACK passes (its ACK number must acknowledge the SYN). The two SYNs give
//!   the window scaling (in effect only if both carried the option, RFC 7323; shifts above 14
//!   are taken as 14) and the guest's send MSS (the peer's MSS option, or 536 for IPv4 / 1220
//!   for IPv6 without one (RFC 9293 §3.7.1), at most the guest's own MSS option; zero means
//!   absent; at least 88 like Linux's `TCP_MIN_MSS`). When the guest sends TSO/GSO frames,
//!   their `gso_size` (the guest's real segment size, options excluded) refines the MSS
//!   downwards. A data segment from the guest on an unknown flow (a connection older than the
//!   device, or one whose state was evicted) creates a *mid-connection* flow: it is measured
//!   like the others but never rewritten because the window scale is unknown
//!   ([`FoxyVegasSnapshot::flows_untracked_scale`]). Frames from the network never create
//!   flows except through the half-open table. A RST from either side ends the flow; so do
//!   FINs from both sides. The table holds at most `max_flows` flows (the least recently
//!   active is evicted), flows idle for `idle_timeout_ns` expire in [`NetStage::tick`].
//! * **RTT samples.** Each guest data segment adds the sequence range it brings for the first
//!   time with its send time to a bounded queue (256 entries per flow; while it is full, new
//!   segments are not sampled: with more segments in flight than that, dropping the oldest
//!   instead would leave every ACK without a sample). A segment that resends bytes already
//!   sent is a retransmission: by Karn's rule every pending sample overlapping the resent
//!   bytes is dropped and the resent bytes are not sampled. An ACK from the peer that advances the acknowledged sequence (duplicates, stale
//!   ACKs and ACKs of bytes never sent are ignored) covers every pending range that starts
//!   before its ACK number; the sample is `now - send time` of the *latest-sent* covered range
//!   (like Linux's `ca_rtt`), covered ranges are removed and a range covered only partly (a
//!   GSO super-frame acknowledged piecewise, as Linux samples partly acked TSO frames) is
//!   trimmed and stays pending. Samples of 0 count as 1 µs. Sequence numbers are compared
//!   with wrapping arithmetic (RFC 1982 style) so flows cross 2^32 normally; a segment more
//!   than 2^30 bytes away from the flow's sequence space is ignored.
//! * **Vegas** (Brakmo & Peterson 1994, arithmetic as in Linux `tcp_vegas.c`). `base_rtt` is
//!   the smallest sample ever seen on the flow. A round starts with `beg_snd_nxt = snd_nxt`
//!   and ends with the first ACK covering `beg_snd_nxt`; the round's RTT is the minimum of its
//!   samples (which filters out delayed ACKs). With `cwnd` in segments,
//!   `diff = cwnd * (rtt - base_rtt) / rtt` estimates the segments queued in the network (the
//!   paper's `(Expected - Actual) * BaseRTT`; Linux divides by `base_rtt` instead). At the end
//!   of a round with at least 3 samples (fewer means delayed ACKs dominate; like Linux the
//!   round then grows the window like Reno: doubling in slow start, +1 otherwise, and a round
//!   without samples changes nothing):
//!   - *slow start* (from the initial 10 segments): while `diff <= gamma` the window doubles
//!     **every other round**, as in the Vegas paper, so that the window is held for a round
//!     before it is judged (Linux doubles every round). Once `diff > gamma`, slow start ends
//!     for good with `cwnd = min(cwnd, target + 1)`, `target = cwnd * base_rtt / rtt`. The
//!     samples of a round come from segments sent during the previous one, and their minimum
//!     from the first of those, sent before the doubled window filled: slow start can
//!     overshoot the path by up to a factor of two before it sees the queue (as Linux's Vegas
//!     does); `target + 1` cuts most of it and congestion avoidance the rest, one segment per
//!     round;
//!   - *congestion avoidance*: `diff > beta` → `cwnd - 1`; `diff < alpha` → `cwnd + 1`;
//!     otherwise unchanged.
//!
//!   The window never goes below `min_window_segments` (nor above 2^20 segments).
//!   **Application-limited flows:** a round may not grow the window beyond twice the largest
//!   number of segments in flight (sent, not yet acknowledged) during the round, so a flow that
//!   does not use its window (interactive, request/response, idle) keeps a window about the
//!   size it uses instead of one that doubles forever; when it starts sending more, the window
//!   can grow by at most a factor of two per round.
//! * **Rewrite.** For every ACK to the guest on a flow whose handshake was seen (not SYN, not
//!   RST), after the ACK's own sample and round have been taken into account:
//!   `peer = field << shift` bytes and `vegas = cwnd * mss` bytes; if `vegas < peer` the field
//!   becomes `ceil(vegas / 2^shift)` (at least 1, never more than the original: a window is
//!   never grown). Only the two window bytes change, plus the TCP checksum, updated
//!   incrementally (RFC 1624, [`csum_update16`]) unless the virtio header says the checksum is
//!   still to be computed (`NEEDS_CSUM`: then the field holds only the pseudo-header sum, which
//!   does not cover the window, and is left alone). Every rewrite can be logged as one JSON line
//!   ([`RewriteRecord`]).
//!
//! # Differences from Vegas in the guest
//!
//! * RTTs are measured at the device, from the moment the guest's frame reaches the device to
//!   the moment the peer's ACK does: the guest's own scheduling and virtualization delays are
//!   not in them (the paper's point, Fig. 4), but a slow guest that takes long to send queued
//!   data is not seen either.
//! * FoxyVegas caps the window; the guest's algorithm still decides below the cap. Losses are
//!   the guest's business: FoxyVegas does not shrink its window on loss (the guest does) and
//!   does not re-enter slow start after idle periods or timeouts.
//! * The window is counted in MSS-sized segments; a guest sending smaller segments gets
//!   proportionally more segments in flight. Without GSO frames the MSS from the handshake
//!   includes the TCP option bytes (timestamps), about 1% of slack.
//! * Lowering the advertised window can move its right edge backwards ("shrinking", which
//!   receivers should avoid); senders must tolerate it (RFC 9293 §3.8.6.2.2). Vegas lowers the
//!   window one segment per round except on leaving slow start.
//!
//! # Limits
//!
//! * Only flows whose handshake passed through the device are rewritten (the scale is needed).
//! * The flow state can be disturbed by forged segments (a blind RST with the right 4-tuple
//!   ends the flow's state; the flow is then no longer limited). FoxyVegas is a policy, not an
//!   enforcement mechanism: a guest can always make its flows look mid-connection.
//! * One worker thread: all state is per device, no locking on the data path; memory is bounded
//!   by `max_flows` flows with at most 256 samples each, plus at most 1024 half-open entries.

use std::collections::{HashMap, VecDeque};
use std::io::{BufWriter, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::packet::{tcp_segment, Direction, Frame, TcpSegment, GSO_ECN, GSO_TCPV4, GSO_TCPV6};
use crate::stage::{NetStage, Verdict};

/// Window of a new flow, in segments (Linux's initial window, RFC 6928).
pub const INITIAL_CWND_SEGMENTS: u32 = 10;
/// Largest window FoxyVegas computes, in segments.
pub const MAX_CWND_SEGMENTS: u32 = 1 << 20;
/// Send MSS of an IPv4 flow whose peer sent no MSS option (RFC 9293 §3.7.1).
pub const DEFAULT_MSS_V4: u32 = 536;
/// Send MSS of an IPv6 flow whose peer sent no MSS option (RFC 9293 §3.7.1).
pub const DEFAULT_MSS_V6: u32 = 1220;
/// Smallest MSS FoxyVegas believes (Linux `TCP_MIN_MSS`).
pub const MIN_MSS: u32 = 88;
/// Largest window shift (RFC 7323 §2.3).
pub const MAX_WSCALE: u8 = 14;
/// Pending RTT samples kept per flow (segments sent while it is full are not sampled).
pub const MAX_PENDING_SAMPLES: usize = 256;
/// Samples a round needs for the Vegas computation (Linux: more than 2).
pub const MIN_ROUND_SAMPLES: u32 = 3;
/// Flows listed by [`FoxyVegasMetrics::flows`].
pub const SNAPSHOT_FLOWS: usize = 16;
/// Most half-open connections remembered.
pub const MAX_HALF_OPEN: usize = 1024;

/// Smallest RTT sample (a sample of 0 counts as this).
const MIN_RTT_NS: u64 = 1_000;
/// Segments further than this from a flow's sequence space are ignored.
const MAX_SEQ_JUMP: u32 = 1 << 30;
/// Largest alpha, beta or gamma accepted.
const MAX_PARAM: u32 = 1000;

// ---------------------------------------------------------------------------------------------
// Configuration

/// Parameters of FoxyVegas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoxyVegasConfig {
    /// Fewer queued segments than this: the window grows (congestion avoidance).
    pub alpha: u32,
    /// More queued segments than this: the window shrinks (congestion avoidance).
    pub beta: u32,
    /// More queued segments than this ends slow start.
    pub gamma: u32,
    /// Most flows tracked at once (the least recently active is evicted).
    pub max_flows: usize,
    /// A flow without frames for this long is forgotten.
    pub idle_timeout_ns: u64,
    /// The window never goes below this many segments.
    pub min_window_segments: u32,
}

impl Default for FoxyVegasConfig {
    fn default() -> Self {
        Self {
            alpha: 2,
            beta: 4,
            gamma: 1,
            max_flows: 4096,
            idle_timeout_ns: 120_000_000_000,
            min_window_segments: 2,
        }
    }
}

/// A FoxyVegas configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FoxyVegasConfigError {
    #[error("foxyvegas: expected alpha,beta,gamma (e.g. \"2,4,1\"), got {0:?}")]
    Malformed(String),
    #[error("foxyvegas: {name} ({value:?}) is not a whole number")]
    NotANumber { name: &'static str, value: String },
    #[error("foxyvegas: {name} (0) must be greater than 0")]
    Zero { name: &'static str },
    #[error("foxyvegas: {name} ({value}) must not exceed {max}")]
    TooLarge {
        name: &'static str,
        value: u64,
        max: u64,
    },
    #[error("foxyvegas: alpha ({alpha}) must not exceed beta ({beta})")]
    AlphaAboveBeta { alpha: u32, beta: u32 },
}

impl FoxyVegasConfig {
    /// Parses the CLI form `alpha,beta,gamma` (segments, e.g. `2,4,1`); the empty string gives
    /// the defaults. The other fields keep their defaults.
    pub fn parse(spec: &str) -> Result<Self, FoxyVegasConfigError> {
        let spec = spec.trim();
        if spec.is_empty() {
            return Ok(Self::default());
        }
        let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
        let [a, b, g] = parts.as_slice() else {
            return Err(FoxyVegasConfigError::Malformed(spec.to_string()));
        };
        let num = |name: &'static str, s: &str| {
            s.parse::<u32>()
                .map_err(|_| FoxyVegasConfigError::NotANumber {
                    name,
                    value: s.to_string(),
                })
        };
        let cfg = Self {
            alpha: num("alpha", a)?,
            beta: num("beta", b)?,
            gamma: num("gamma", g)?,
            ..Self::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the ranges: alpha, beta, gamma in 1..=1000 with alpha <= beta; max_flows,
    /// idle_timeout_ns and min_window_segments above 0, min_window_segments at most 1000.
    pub fn validate(&self) -> Result<(), FoxyVegasConfigError> {
        for (name, v) in [
            ("alpha", self.alpha),
            ("beta", self.beta),
            ("gamma", self.gamma),
            ("min_window_segments", self.min_window_segments),
        ] {
            if v == 0 {
                return Err(FoxyVegasConfigError::Zero { name });
            }
            if v > MAX_PARAM {
                return Err(FoxyVegasConfigError::TooLarge {
                    name,
                    value: u64::from(v),
                    max: u64::from(MAX_PARAM),
                });
            }
        }
        if self.alpha > self.beta {
            return Err(FoxyVegasConfigError::AlphaAboveBeta {
                alpha: self.alpha,
                beta: self.beta,
            });
        }
        if self.max_flows == 0 {
            return Err(FoxyVegasConfigError::Zero { name: "max_flows" });
        }
        if self.idle_timeout_ns == 0 {
            return Err(FoxyVegasConfigError::Zero {
                name: "idle_timeout_ns",
            });
        }
        Ok(())
    }

    /// The configuration made usable without failing (used by [`FoxyVegas::new`]).
    fn sanitized(mut self) -> Self {
        self.max_flows = self.max_flows.max(1);
        self.min_window_segments = self.min_window_segments.clamp(1, MAX_CWND_SEGMENTS);
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics

/// Counters of one FoxyVegas stage, shared with the launcher. Counters are updated as frames
/// pass; `flows_active`, `half_open_active` and `min_base_rtt_us` and the flow list also in
/// every tick.
#[derive(Debug, Default)]
pub struct FoxyVegasMetrics {
    flows_active: AtomicU64,
    flows_total: AtomicU64,
    flows_untracked_scale: AtomicU64,
    flows_expired: AtomicU64,
    flows_evicted: AtomicU64,
    flows_closed: AtomicU64,
    half_open_active: AtomicU64,
    half_open_evicted: AtomicU64,
    half_open_expired: AtomicU64,
    data_segments: AtomicU64,
    retransmissions: AtomicU64,
    rtt_samples: AtomicU64,
    acks_seen: AtomicU64,
    rewrites: AtomicU64,
    rewrite_log_errors: AtomicU64,
    min_base_rtt_us: AtomicU64,
    lowest_base_rtt_us: AtomicU64,
    flows: Mutex<Vec<FlowSnapshot>>,
}

/// A copy of [`FoxyVegasMetrics`]' counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FoxyVegasSnapshot {
    /// Flows in the table (handshake seen or mid-connection).
    pub flows_active: u64,
    /// Flows ever entered into the table.
    pub flows_total: u64,
    /// Of those, flows first seen mid-connection (never rewritten).
    pub flows_untracked_scale: u64,
    /// Flows forgotten after `idle_timeout_ns` without frames.
    pub flows_expired: u64,
    /// Flows evicted because the table was full.
    pub flows_evicted: u64,
    /// Flows ended by RST, by FINs from both sides, or replaced by a new connection.
    pub flows_closed: u64,
    /// Half-open connections (SYN seen, SYN-ACK not yet).
    pub half_open_active: u64,
    /// Half-open connections evicted because their table was full.
    pub half_open_evicted: u64,
    /// Half-open connections forgotten after `idle_timeout_ns`.
    pub half_open_expired: u64,
    /// Guest segments with payload on tracked flows (retransmissions included).
    pub data_segments: u64,
    /// Of those, segments resending bytes already sent.
    pub retransmissions: u64,
    /// RTT samples taken.
    pub rtt_samples: u64,
    /// ACK segments to the guest on tracked flows.
    pub acks_seen: u64,
    /// ACKs whose window was lowered.
    pub rewrites: u64,
    /// Rewrite log write failures (the log stops at the first).
    pub rewrite_log_errors: u64,
    /// Smallest base RTT over the active flows with samples, in µs (0 if none).
    pub min_base_rtt_us: u64,
    /// Smallest base RTT of any flow since the stage started, in µs (0 if none): what
    /// `min_base_rtt_us` was at its lowest, kept after the flows end.
    #[serde(default)]
    pub lowest_base_rtt_us: u64,
}

/// One flow in [`FoxyVegasMetrics::flows`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowSnapshot {
    /// Guest end, `ip:port` (`[ip]:port` for IPv6).
    pub guest: String,
    /// Peer end.
    pub peer: String,
    /// Smallest RTT seen (µs, 0 before the first sample).
    pub base_rtt_us: u64,
    /// Latest RTT sample (µs, 0 before the first sample).
    pub last_rtt_us: u64,
    /// Vegas window in segments.
    pub cwnd_segments: u32,
    /// Send MSS in bytes.
    pub mss: u32,
    /// Peer's window shift in effect (0 without scaling).
    pub shift: u8,
    /// Whether the handshake was seen (false: mid-connection, never rewritten).
    pub scale_known: bool,
    /// Whether the flow is still in slow start.
    pub slow_start: bool,
    /// ACKs rewritten on this flow.
    pub rewrites: u64,
}

impl FoxyVegasMetrics {
    /// The counters now.
    pub fn snapshot(&self) -> FoxyVegasSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FoxyVegasSnapshot {
            flows_active: g(&self.flows_active),
            flows_total: g(&self.flows_total),
            flows_untracked_scale: g(&self.flows_untracked_scale),
            flows_expired: g(&self.flows_expired),
            flows_evicted: g(&self.flows_evicted),
            flows_closed: g(&self.flows_closed),
            half_open_active: g(&self.half_open_active),
            half_open_evicted: g(&self.half_open_evicted),
            half_open_expired: g(&self.half_open_expired),
            data_segments: g(&self.data_segments),
            retransmissions: g(&self.retransmissions),
            rtt_samples: g(&self.rtt_samples),
            acks_seen: g(&self.acks_seen),
            rewrites: g(&self.rewrites),
            rewrite_log_errors: g(&self.rewrite_log_errors),
            min_base_rtt_us: g(&self.min_base_rtt_us),
            lowest_base_rtt_us: g(&self.lowest_base_rtt_us),
        }
    }

    /// Up to [`SNAPSHOT_FLOWS`] most recently active flows, most recent first, as of the last
    /// tick.
    pub fn flows(&self) -> Vec<FlowSnapshot> {
        self.flows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

fn add(a: &AtomicU64, n: usize) {
    a.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
}

fn set(a: &AtomicU64, v: usize) {
    a.store(u64::try_from(v).unwrap_or(u64::MAX), Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// Rewrite log

/// One rewritten ACK, one JSON line of the rewrite log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewriteRecord {
    /// Device clock when the ACK passed (ns).
    pub t_ns: u64,
    /// Guest end, `ip:port` (`[ip]:port` for IPv6).
    pub guest: String,
    /// Peer end.
    pub peer: String,
    /// ACK number of the segment.
    pub ack: u32,
    /// Window field as the peer sent it.
    pub old_field: u16,
    /// Window field the guest gets.
    pub new_field: u16,
    /// Window shift in effect (0 without scaling).
    pub shift: u8,
    /// Window the guest gets, in bytes (`new_field << shift`, at least `cwnd_segments * mss`
    /// because of the rounding up).
    pub window_bytes: u64,
    /// Window the peer advertised, in bytes (`old_field << shift`).
    pub peer_window_bytes: u64,
    /// Vegas window in segments.
    pub cwnd_segments: u32,
    /// Send MSS in bytes.
    pub mss: u32,
    /// Smallest RTT seen on the flow (µs, 0 before the first sample).
    pub base_rtt_us: u64,
    /// Latest RTT sample (µs, 0 before the first sample).
    pub rtt_us: u64,
}

// ---------------------------------------------------------------------------------------------
// Small pure helpers

/// `a` is before `b` in sequence space (wrapping).
fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// `a` is after `b` in sequence space (wrapping).
fn after(a: u32, b: u32) -> bool {
    before(b, a)
}

/// Incremental update of an Internet checksum when one 16-bit word changes from `old` to
/// `new` (RFC 1624 eqn. 3: `HC' = ~(~HC + ~m + m')`, one's complement arithmetic).
pub fn csum_update16(hc: u16, old: u16, new: u16) -> u16 {
    let mut sum = u32::from(!hc) + u32::from(!old) + u32::from(new);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !((sum & 0xffff) as u16)
}

/// The window field FoxyVegas gives the guest instead of `old_field` (scaled by `shift`) when
/// the Vegas window is `window_bytes`: `None` when the peer's window is not larger than the
/// Vegas window (nothing to do); otherwise `ceil(window_bytes / 2^shift)`, at least 1 and
/// always smaller than `old_field`.
pub fn scaled_window_field(old_field: u16, shift: u8, window_bytes: u64) -> Option<u16> {
    let shift = shift.min(MAX_WSCALE);
    let peer_bytes = u64::from(old_field) << shift;
    if window_bytes >= peer_bytes {
        return None;
    }
    let field = window_bytes.div_ceil(1u64 << shift).max(1);
    let field = u16::try_from(field).unwrap_or(u16::MAX).min(old_field);
    (field < old_field).then_some(field)
}

fn micros(ns: u64) -> u64 {
    ns / 1_000
}

// ---------------------------------------------------------------------------------------------
// Flow state

/// A flow, from the guest's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct FlowKey {
    guest: IpAddr,
    guest_port: u16,
    peer: IpAddr,
    peer_port: u16,
}

impl FlowKey {
    fn of(dir: Direction, seg: &TcpSegment) -> Self {
        match dir {
            Direction::FromGuest => Self {
                guest: seg.src,
                guest_port: seg.sport,
                peer: seg.dst,
                peer_port: seg.dport,
            },
            Direction::ToGuest => Self {
                guest: seg.dst,
                guest_port: seg.dport,
                peer: seg.src,
                peer_port: seg.sport,
            },
        }
    }

    fn guest_str(&self) -> String {
        SocketAddr::new(self.guest, self.guest_port).to_string()
    }

    fn peer_str(&self) -> String {
        SocketAddr::new(self.peer, self.peer_port).to_string()
    }
}

/// Who sent the first SYN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opener {
    Guest,
    Peer,
}

/// A SYN waiting for its SYN-ACK.
#[derive(Debug, Clone, Copy)]
struct HalfOpen {
    opener: Opener,
    isn: u32,
    wscale: Option<u8>,
    mss: Option<u16>,
    last_ns: u64,
}

/// Bytes `[start, end)` first sent at `t_ns`, not yet acknowledged.
#[derive(Debug, Clone, Copy)]
struct Sample {
    start: u32,
    end: u32,
    t_ns: u64,
}

#[derive(Debug)]
struct Flow {
    /// Handshake seen: the window scale is known and ACKs may be rewritten.
    scale_known: bool,
    /// Peer's window shift in effect.
    shift: u8,
    /// MSS from the handshake (upper bound of `mss`).
    max_mss: u32,
    /// Send MSS used for the window.
    mss: u32,
    /// Highest ACK from the peer.
    snd_una: u32,
    /// Sequence just past the highest byte (or FIN) the guest sent.
    snd_nxt: u32,
    samples: VecDeque<Sample>,
    /// `u64::MAX` before the first sample.
    base_rtt_ns: u64,
    /// 0 before the first sample.
    last_rtt_ns: u64,
    /// `beg_snd_nxt`: the round ends when an ACK covers it.
    round_end: u32,
    /// Smallest sample of the round (`u64::MAX`: none).
    round_min_ns: u64,
    round_samples: u32,
    round_max_inflight: u64,
    cwnd: u32,
    slow_start: bool,
    /// Slow start doubles at the end of this round (alternates).
    ss_grow: bool,
    fin_guest: bool,
    fin_peer: bool,
    last_ns: u64,
    rewrites: u64,
}

/// What happened when a guest segment was taken into account.
#[derive(Debug, Default, PartialEq, Eq)]
struct SegOutcome {
    data: bool,
    retransmission: bool,
}

impl Flow {
    fn new(
        scale_known: bool,
        shift: u8,
        mss: u32,
        snd_una: u32,
        snd_nxt: u32,
        cfg: &FoxyVegasConfig,
        now: u64,
    ) -> Self {
        let mss = mss.clamp(MIN_MSS, u32::from(u16::MAX));
        Self {
            scale_known,
            shift: shift.min(MAX_WSCALE),
            max_mss: mss,
            mss,
            snd_una,
            snd_nxt,
            samples: VecDeque::new(),
            base_rtt_ns: u64::MAX,
            last_rtt_ns: 0,
            round_end: snd_nxt,
            round_min_ns: u64::MAX,
            round_samples: 0,
            round_max_inflight: 0,
            cwnd: INITIAL_CWND_SEGMENTS.max(cfg.min_window_segments),
            slow_start: true,
            ss_grow: true,
            fin_guest: false,
            fin_peer: false,
            last_ns: now,
            rewrites: 0,
        }
    }

    fn inflight_bytes(&self) -> u64 {
        if before(self.snd_nxt, self.snd_una) {
            0
        } else {
            u64::from(self.snd_nxt.wrapping_sub(self.snd_una))
        }
    }

    fn segments(&self, bytes: u64) -> u32 {
        u32::try_from(bytes.div_ceil(u64::from(self.mss.max(1)))).unwrap_or(u32::MAX)
    }

    /// Learns the guest's real segment size from a GSO frame's `gso_size`.
    fn learn_gso_size(&mut self, gso_size: u16) {
        let g = u32::from(gso_size);
        if !self.scale_known {
            // Mid-connection: no handshake MSS to bound it.
            self.max_mss = self.max_mss.max(g.min(u32::from(u16::MAX)));
        }
        self.mss = g.clamp(MIN_MSS, self.max_mss.max(MIN_MSS));
    }

    /// A segment from the guest (not SYN, not RST).
    fn on_guest_segment(&mut self, seg: &TcpSegment, now: u64) -> SegOutcome {
        self.last_ns = now;
        if seg.flags.fin {
            self.fin_guest = true;
        }
        let mut out = SegOutcome::default();
        let has_data = seg.payload_len > 0;
        if !has_data && !seg.flags.fin {
            return out; // pure ACK: nothing sent
        }
        let end = seg.seq_end();
        let dist = end.wrapping_sub(self.snd_nxt) as i32;
        if dist.unsigned_abs() > MAX_SEQ_JUMP
            || seg.seq.wrapping_sub(self.snd_nxt) as i32 > MAX_SEQ_JUMP as i32
        {
            return out; // not this flow's sequence space
        }
        out.data = has_data;
        if !after(end, self.snd_nxt) {
            // Everything in it was sent before.
            if has_data {
                out.retransmission = true;
                self.karn(seg.seq, end);
            }
            return out;
        }
        let new_start = if before(seg.seq, self.snd_nxt) {
            // Partly old bytes (repacketized retransmission).
            if has_data {
                out.retransmission = true;
            }
            self.karn(seg.seq, self.snd_nxt);
            self.snd_nxt
        } else {
            seg.seq
        };
        self.snd_nxt = end;
        if has_data && self.samples.len() < MAX_PENDING_SAMPLES {
            self.samples.push_back(Sample {
                start: new_start,
                end,
                t_ns: now,
            });
        }
        self.round_max_inflight = self.round_max_inflight.max(self.inflight_bytes());
        out
    }

    /// Karn's rule: bytes `[a, b)` are being resent, so no ACK can tell which copy it
    /// acknowledges; forget their samples.
    fn karn(&mut self, a: u32, b: u32) {
        self.samples
            .retain(|s| !(before(s.start, b) && before(a, s.end)));
    }

    /// An ACK from the peer; returns whether it gave an RTT sample.
    fn on_peer_ack(&mut self, ack: u32, now: u64, cfg: &FoxyVegasConfig) -> bool {
        if !after(ack, self.snd_una) || after(ack, self.snd_nxt) {
            return false; // duplicate, stale, or acknowledges bytes never sent
        }
        let mut latest: Option<u64> = None;
        while let Some(s) = self.samples.front_mut() {
            if !before(s.start, ack) {
                break;
            }
            latest = Some(latest.map_or(s.t_ns, |l| l.max(s.t_ns)));
            if after(s.end, ack) {
                s.start = ack; // partly acknowledged: the rest stays pending
                break;
            }
            self.samples.pop_front();
        }
        let sampled = if let Some(t) = latest {
            let rtt = now.saturating_sub(t).max(MIN_RTT_NS);
            self.last_rtt_ns = rtt;
            self.base_rtt_ns = self.base_rtt_ns.min(rtt);
            self.round_min_ns = self.round_min_ns.min(rtt);
            self.round_samples = self.round_samples.saturating_add(1);
            true
        } else {
            false
        };
        self.snd_una = ack;
        if !before(ack, self.round_end) {
            self.end_round(cfg);
            self.round_end = self.snd_nxt;
            self.round_min_ns = u64::MAX;
            self.round_samples = 0;
            self.round_max_inflight = self.inflight_bytes();
        }
        sampled
    }

    /// The Vegas window update at the end of a round.
    fn end_round(&mut self, cfg: &FoxyVegasConfig) {
        let old = self.cwnd;
        let mut cwnd = old;
        let grow_ss = |flow: &mut Self| {
            let grow = flow.ss_grow;
            flow.ss_grow = !flow.ss_grow;
            if grow {
                old.saturating_mul(2)
            } else {
                old
            }
        };
        if self.round_samples >= MIN_ROUND_SAMPLES && self.base_rtt_ns != u64::MAX {
            let base = self.base_rtt_ns.max(MIN_RTT_NS);
            let rtt = self.round_min_ns.max(base);
            let c = u128::from(old);
            let diff = c * u128::from(rtt - base) / u128::from(rtt);
            if self.slow_start {
                if diff > u128::from(cfg.gamma) {
                    let target = c * u128::from(base) / u128::from(rtt);
                    let target = u32::try_from(target).unwrap_or(u32::MAX);
                    cwnd = old.min(target.saturating_add(1));
                    self.slow_start = false;
                } else {
                    cwnd = grow_ss(self);
                }
            } else if diff > u128::from(cfg.beta) {
                cwnd = old.saturating_sub(1);
            } else if diff < u128::from(cfg.alpha) {
                cwnd = old.saturating_add(1);
            }
        } else if self.round_samples > 0 {
            // Too few samples to trust (delayed ACKs): grow like Reno, as Linux does.
            cwnd = if self.slow_start {
                grow_ss(self)
            } else {
                old.saturating_add(1)
            };
        }
        if cwnd > old {
            // Application-limited rounds do not grow the window past twice their use.
            let cap = self
                .segments(self.round_max_inflight)
                .saturating_mul(2)
                .max(old);
            cwnd = cwnd.min(cap);
        }
        self.cwnd = cwnd.max(cfg.min_window_segments).min(MAX_CWND_SEGMENTS);
    }

    /// Lowers the window of an ACK to the guest if Vegas allows less than the peer does;
    /// returns `(old, new)` field values when it did.
    fn rewrite(&mut self, frame: &mut Frame, seg: &TcpSegment) -> Option<(u16, u16)> {
        if !self.scale_known || seg.flags.syn || seg.flags.rst || !seg.flags.ack {
            return None;
        }
        let vegas = u64::from(self.cwnd) * u64::from(self.mss);
        let new = scaled_window_field(seg.window, self.shift, vegas)?;
        let wo = seg.window_offset();
        let co = seg.checksum_offset();
        let (wend, cend) = (wo.checked_add(2)?, co.checked_add(2)?);
        if wend > frame.data.len() || cend > frame.data.len() {
            return None;
        }
        let old_b = frame.data.get(wo..wend)?;
        let old = u16::from_be_bytes([old_b[0], old_b[1]]);
        if old != seg.window {
            return None;
        }
        frame
            .data
            .get_mut(wo..wend)?
            .copy_from_slice(&new.to_be_bytes());
        if !frame.hdr.needs_csum() {
            if let Some(c) = frame.data.get_mut(co..cend) {
                let hc = u16::from_be_bytes([c[0], c[1]]);
                c.copy_from_slice(&csum_update16(hc, old, new).to_be_bytes());
            }
        }
        self.rewrites = self.rewrites.saturating_add(1);
        Some((old, new))
    }

    fn snapshot(&self, key: &FlowKey) -> FlowSnapshot {
        FlowSnapshot {
            guest: key.guest_str(),
            peer: key.peer_str(),
            base_rtt_us: self.base_rtt_us(),
            last_rtt_us: micros(self.last_rtt_ns),
            cwnd_segments: self.cwnd,
            mss: self.mss,
            shift: self.shift,
            scale_known: self.scale_known,
            slow_start: self.slow_start,
            rewrites: self.rewrites,
        }
    }

    fn base_rtt_us(&self) -> u64 {
        if self.base_rtt_ns == u64::MAX {
            0
        } else {
            micros(self.base_rtt_ns)
        }
    }
}

fn default_mss(ip: IpAddr) -> u32 {
    match ip {
        IpAddr::V4(_) => DEFAULT_MSS_V4,
        IpAddr::V6(_) => DEFAULT_MSS_V6,
    }
}

// ---------------------------------------------------------------------------------------------
// The stage

/// The FoxyVegas packet stage (see the module documentation).
pub struct FoxyVegas {
    cfg: FoxyVegasConfig,
    flows: HashMap<FlowKey, Flow>,
    half_open: HashMap<FlowKey, HalfOpen>,
    half_open_max: usize,
    log: Option<BufWriter<Box<dyn Write + Send>>>,
    metrics: Arc<FoxyVegasMetrics>,
}

impl std::fmt::Debug for FoxyVegas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FoxyVegas")
            .field("cfg", &self.cfg)
            .field("flows", &self.flows.len())
            .field("half_open", &self.half_open.len())
            .field("logging", &self.log.is_some())
            .finish()
    }
}

impl FoxyVegas {
    /// A FoxyVegas stage and its metrics. `log`, if given, receives one JSON
    /// [`RewriteRecord`] line per rewritten ACK (buffered; flushed in every tick and at the
    /// end). `cfg` should have passed [`FoxyVegasConfig::validate`]; out-of-range values are
    /// made usable rather than refused.
    pub fn new(
        cfg: FoxyVegasConfig,
        log: Option<Box<dyn Write + Send>>,
    ) -> (Self, Arc<FoxyVegasMetrics>) {
        let metrics = Arc::new(FoxyVegasMetrics::default());
        (Self::with_metrics(cfg, log, metrics.clone()), metrics)
    }

    /// Like [`FoxyVegas::new`], with metrics the caller already holds.
    pub fn with_metrics(
        cfg: FoxyVegasConfig,
        log: Option<Box<dyn Write + Send>>,
        metrics: Arc<FoxyVegasMetrics>,
    ) -> Self {
        let cfg = cfg.sanitized();
        let half_open_max = cfg.max_flows.clamp(1, MAX_HALF_OPEN);
        Self {
            cfg,
            flows: HashMap::new(),
            half_open: HashMap::new(),
            half_open_max,
            log: log.map(|w| BufWriter::with_capacity(64 * 1024, w)),
            metrics,
        }
    }

    /// The metrics of this stage.
    pub fn metrics(&self) -> Arc<FoxyVegasMetrics> {
        self.metrics.clone()
    }

    fn gauges(&self) {
        set(&self.metrics.flows_active, self.flows.len());
        set(&self.metrics.half_open_active, self.half_open.len());
    }

    fn remove_flow(&mut self, key: &FlowKey) {
        if self.flows.remove(key).is_some() {
            bump(&self.metrics.flows_closed);
        }
    }

    /// Inserts a flow, evicting the least recently active ones if the table is full.
    fn insert_flow(&mut self, key: FlowKey, flow: Flow) {
        self.remove_flow(&key);
        while self.flows.len() >= self.cfg.max_flows {
            let Some(victim) = self
                .flows
                .iter()
                .min_by_key(|(_, f)| f.last_ns)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.flows.remove(&victim);
            bump(&self.metrics.flows_evicted);
        }
        self.flows.insert(key, flow);
        bump(&self.metrics.flows_total);
        self.gauges();
    }

    /// A SYN without ACK: remember it until the SYN-ACK.
    fn note_syn(&mut self, opener: Opener, key: FlowKey, seg: &TcpSegment, now: u64) {
        if !self.half_open.contains_key(&key) {
            while self.half_open.len() >= self.half_open_max {
                let Some(victim) = self
                    .half_open
                    .iter()
                    .min_by_key(|(_, h)| h.last_ns)
                    .map(|(k, _)| *k)
                else {
                    break;
                };
                self.half_open.remove(&victim);
                bump(&self.metrics.half_open_evicted);
            }
        }
        self.half_open.insert(
            key,
            HalfOpen {
                opener,
                isn: seg.seq,
                wscale: seg.wscale,
                mss: seg.mss.filter(|&m| m > 0),
                last_ns: now,
            },
        );
        self.gauges();
    }

    /// A SYN-ACK from the side that did not open: completes the handshake if it
    /// acknowledges the remembered SYN.
    fn complete_handshake(&mut self, opener: Opener, key: FlowKey, seg: &TcpSegment, now: u64) {
        let Some(h) = self.half_open.get(&key).copied() else {
            if let Some(f) = self.flows.get_mut(&key) {
                f.last_ns = now; // a retransmitted SYN-ACK
            }
            return;
        };
        if h.opener != opener || seg.ack != h.isn.wrapping_add(1) {
            return;
        }
        self.half_open.remove(&key);
        let syn_mss = seg.mss.filter(|&m| m > 0);
        let (guest_ws, peer_ws, guest_mss, peer_mss) = match opener {
            Opener::Guest => (h.wscale, seg.wscale, h.mss, syn_mss),
            Opener::Peer => (seg.wscale, h.wscale, syn_mss, h.mss),
        };
        let shift = match (guest_ws, peer_ws) {
            (Some(_), Some(p)) => p.min(MAX_WSCALE),
            _ => 0,
        };
        let mut mss = peer_mss.map_or(default_mss(key.guest), u32::from);
        if let Some(g) = guest_mss {
            mss = mss.min(u32::from(g));
        }
        let (una, nxt) = match opener {
            // The peer's SYN-ACK acknowledges the guest's SYN.
            Opener::Guest => (seg.ack, seg.ack),
            // The guest's SYN-ACK is in flight.
            Opener::Peer => (seg.seq, seg.seq.wrapping_add(1)),
        };
        let flow = Flow::new(true, shift, mss, una, nxt, &self.cfg, now);
        self.insert_flow(key, flow);
    }

    /// A RST ends the flow; a SYN (or SYN-ACK) is a handshake step. True when `seg` was one
    /// of them (nothing else to do with it). `sender` sent it.
    fn reset_or_handshake(
        &mut self,
        sender: Opener,
        key: FlowKey,
        seg: &TcpSegment,
        now: u64,
    ) -> bool {
        let f = seg.flags;
        if f.rst {
            self.half_open.remove(&key);
            self.remove_flow(&key);
            self.gauges();
            return true;
        }
        if !f.syn {
            return false;
        }
        if f.ack {
            // A SYN-ACK completes the handshake the other side opened.
            let opener = match sender {
                Opener::Guest => Opener::Peer,
                Opener::Peer => Opener::Guest,
            };
            self.complete_handshake(opener, key, seg, now);
        } else {
            self.note_syn(sender, key, seg, now);
        }
        true
    }

    fn guest_frame(&mut self, key: FlowKey, seg: &TcpSegment, frame: &Frame, now: u64) {
        let f = seg.flags;
        if self.reset_or_handshake(Opener::Guest, key, seg, now) {
            return;
        }
        if !self.flows.contains_key(&key) {
            if seg.payload_len == 0 || f.fin {
                return; // a pure ACK or FIN of a flow we do not know (or just closed)
            }
            let mss = default_mss(key.guest);
            let flow = Flow::new(false, 0, mss, seg.seq, seg.seq, &self.cfg, now);
            self.insert_flow(key, flow);
            bump(&self.metrics.flows_untracked_scale);
        }
        let Some(flow) = self.flows.get_mut(&key) else {
            return;
        };
        let gso = frame.hdr.gso_type & !GSO_ECN;
        if (gso == GSO_TCPV4 || gso == GSO_TCPV6) && frame.hdr.gso_size > 0 {
            flow.learn_gso_size(frame.hdr.gso_size);
        } else if !flow.scale_known {
            // Mid-connection: the largest plain segment is the best MSS guess.
            let len = u32::try_from(seg.payload_len).unwrap_or(u32::MAX);
            if len > flow.mss {
                flow.mss = len.min(u32::from(u16::MAX));
                flow.max_mss = flow.max_mss.max(flow.mss);
            }
        }
        let out = flow.on_guest_segment(seg, now);
        let done = flow.fin_guest && flow.fin_peer;
        if out.data {
            bump(&self.metrics.data_segments);
        }
        if out.retransmission {
            bump(&self.metrics.retransmissions);
        }
        if done {
            self.remove_flow(&key);
            self.gauges();
        }
    }

    fn peer_frame(&mut self, key: FlowKey, seg: &TcpSegment, frame: &mut Frame, now: u64) {
        let f = seg.flags;
        if self.reset_or_handshake(Opener::Peer, key, seg, now) {
            return;
        }
        let Some(flow) = self.flows.get_mut(&key) else {
            return;
        };
        flow.last_ns = now;
        if f.fin {
            flow.fin_peer = true;
        }
        let mut record = None;
        if f.ack {
            bump(&self.metrics.acks_seen);
            if flow.on_peer_ack(seg.ack, now, &self.cfg) {
                bump(&self.metrics.rtt_samples);
            }
            if let Some((old, new)) = flow.rewrite(frame, seg) {
                bump(&self.metrics.rewrites);
                if self.log.is_some() {
                    let shift = flow.shift;
                    record = Some(RewriteRecord {
                        t_ns: now,
                        guest: key.guest_str(),
                        peer: key.peer_str(),
                        ack: seg.ack,
                        old_field: old,
                        new_field: new,
                        shift,
                        window_bytes: u64::from(new) << shift,
                        peer_window_bytes: u64::from(old) << shift,
                        cwnd_segments: flow.cwnd,
                        mss: flow.mss,
                        base_rtt_us: flow.base_rtt_us(),
                        rtt_us: micros(flow.last_rtt_ns),
                    });
                }
            }
        }
        let done = flow.fin_guest && flow.fin_peer;
        if done {
            self.remove_flow(&key);
            self.gauges();
        }
        if let Some(r) = record {
            self.log_record(&r);
        }
    }

    fn log_record(&mut self, rec: &RewriteRecord) {
        let Some(w) = self.log.as_mut() else {
            return;
        };
        let res = serde_json::to_writer(&mut *w, rec)
            .map_err(std::io::Error::from)
            .and_then(|()| w.write_all(b"\n"));
        if res.is_err() {
            self.log_failed();
        }
    }

    fn flush_log(&mut self) {
        if let Some(w) = self.log.as_mut() {
            if w.flush().is_err() {
                self.log_failed();
            }
        }
    }

    /// Counts a log error and stops logging, without trying to write the buffer again.
    fn log_failed(&mut self) {
        bump(&self.metrics.rewrite_log_errors);
        if let Some(w) = self.log.take() {
            drop(w.into_parts());
        }
        tracing::warn!("foxyvegas: rewrite log write failed; logging stopped");
    }

    /// Publishes the gauges and the flow list.
    fn publish(&self) {
        self.gauges();
        let min_base = self
            .flows
            .values()
            .filter(|f| f.base_rtt_ns != u64::MAX)
            .map(Flow::base_rtt_us)
            .min()
            .unwrap_or(0);
        self.metrics
            .min_base_rtt_us
            .store(min_base, Ordering::Relaxed);
        if min_base > 0 {
            let _ = self.metrics.lowest_base_rtt_us.fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |cur| (cur == 0 || min_base < cur).then_some(min_base),
            );
        }
        let mut recent: Vec<(&FlowKey, &Flow)> = self.flows.iter().collect();
        let by_recency =
            |a: &(&FlowKey, &Flow), b: &(&FlowKey, &Flow)| b.1.last_ns.cmp(&a.1.last_ns);
        if recent.len() > SNAPSHOT_FLOWS {
            recent.select_nth_unstable_by(SNAPSHOT_FLOWS - 1, by_recency);
            recent.truncate(SNAPSHOT_FLOWS);
        }
        recent.sort_by(by_recency);
        let list: Vec<FlowSnapshot> = recent.iter().map(|(k, f)| f.snapshot(k)).collect();
        *self
            .metrics
            .flows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = list;
    }
}

impl NetStage for FoxyVegas {
    fn on_frame(&mut self, dir: Direction, frame: &mut Frame, now_ns: u64) -> Verdict {
        let Some(seg) = tcp_segment(&frame.data) else {
            return Verdict::Pass;
        };
        let key = FlowKey::of(dir, &seg);
        match dir {
            Direction::FromGuest => self.guest_frame(key, &seg, frame, now_ns),
            Direction::ToGuest => self.peer_frame(key, &seg, frame, now_ns),
        }
        Verdict::Pass
    }

    fn tick(&mut self, now_ns: u64) {
        let idle = self.cfg.idle_timeout_ns;
        let n0 = self.flows.len();
        self.flows
            .retain(|_, f| now_ns.saturating_sub(f.last_ns) <= idle);
        add(
            &self.metrics.flows_expired,
            n0.saturating_sub(self.flows.len()),
        );
        let h0 = self.half_open.len();
        self.half_open
            .retain(|_, h| now_ns.saturating_sub(h.last_ns) <= idle);
        add(
            &self.metrics.half_open_expired,
            h0.saturating_sub(self.half_open.len()),
        );
        self.publish();
        self.flush_log();
    }

    fn finish(&mut self) {
        self.publish();
        self.flush_log();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{VnetHdr, FLAG_NEEDS_CSUM};
    use etherparse::{
        NetHeaders, PacketBuilder, PacketHeaders, PayloadSlice, TcpOptionElement, TransportHeader,
    };
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;
    const PEER_ISN: u32 = 5_000_000;

    /// Which connection a test frame belongs to.
    #[derive(Debug, Clone, Copy)]
    struct Conn {
        v6: bool,
        gport: u16,
    }

    /// TCP flags of a test frame.
    #[derive(Debug, Clone, Copy, Default)]
    struct Fl {
        syn: bool,
        ack: Option<u32>,
        fin: bool,
        rst: bool,
    }

    fn ack(a: u32) -> Fl {
        Fl {
            ack: Some(a),
            ..Fl::default()
        }
    }

    const G4: [u8; 4] = [10, 0, 2, 15];
    const P4: [u8; 4] = [10, 0, 2, 1];
    const G6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x15];
    const P6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01];

    impl Conn {
        fn v4() -> Self {
            Self {
                v6: false,
                gport: 40000,
            }
        }

        fn v6() -> Self {
            Self {
                v6: true,
                gport: 40000,
            }
        }

        fn port(gport: u16) -> Self {
            Self { v6: false, gport }
        }

        #[allow(clippy::too_many_arguments)]
        fn seg(
            &self,
            from_guest: bool,
            seq: u32,
            fl: Fl,
            window: u16,
            opts: &[TcpOptionElement],
            len: usize,
        ) -> Frame {
            let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
            let b = match (self.v6, from_guest) {
                (false, true) => b.ipv4(G4, P4, 64),
                (false, false) => b.ipv4(P4, G4, 64),
                (true, true) => b.ipv6(G6, P6, 64),
                (true, false) => b.ipv6(P6, G6, 64),
            };
            let (sp, dp) = if from_guest {
                (self.gport, 5201)
            } else {
                (5201, self.gport)
            };
            let mut b = b.tcp(sp, dp, seq, window);
            if fl.syn {
                b = b.syn();
            }
            if let Some(a) = fl.ack {
                b = b.ack(a);
            }
            if fl.fin {
                b = b.fin();
            }
            if fl.rst {
                b = b.rst();
            }
            if !opts.is_empty() {
                b = b.options(opts).expect("options fit");
            }
            let mut data = Vec::new();
            b.write(&mut data, &vec![0x5a; len]).expect("builds");
            Frame {
                hdr: VnetHdr::default(),
                data,
            }
        }

        /// A data segment from the guest.
        fn data(&self, seq: u32, len: usize) -> Frame {
            self.seg(true, seq, ack(PEER_ISN + 1), 1000, &[], len)
        }

        /// An ACK from the peer.
        fn ack(&self, a: u32, window: u16) -> Frame {
            self.seg(false, PEER_ISN + 1, ack(a), window, &[], 0)
        }
    }

    fn opts(ws: Option<u8>, mss: Option<u16>) -> Vec<TcpOptionElement> {
        let mut o = Vec::new();
        if let Some(m) = mss {
            o.push(TcpOptionElement::MaximumSegmentSize(m));
        }
        if let Some(s) = ws {
            o.push(TcpOptionElement::WindowScale(s));
        }
        o
    }

    fn g(fv: &mut FoxyVegas, f: &mut Frame, t: u64) {
        assert_eq!(fv.on_frame(Direction::FromGuest, f, t), Verdict::Pass);
    }

    fn p(fv: &mut FoxyVegas, f: &mut Frame, t: u64) {
        assert_eq!(fv.on_frame(Direction::ToGuest, f, t), Verdict::Pass);
    }

    /// Guest-opened handshake: guest SYN (ISN `giss`), peer SYN-ACK, guest ACK, at `t`.
    #[allow(clippy::too_many_arguments)]
    fn handshake(
        fv: &mut FoxyVegas,
        c: Conn,
        giss: u32,
        gws: Option<u8>,
        pws: Option<u8>,
        gmss: Option<u16>,
        pmss: Option<u16>,
        t: u64,
    ) {
        let syn = Fl {
            syn: true,
            ..Fl::default()
        };
        let mut f = c.seg(true, giss, syn, 64240, &opts(gws, gmss), 0);
        g(fv, &mut f, t);
        let synack = Fl {
            syn: true,
            ack: Some(giss.wrapping_add(1)),
            ..Fl::default()
        };
        let mut f = c.seg(false, PEER_ISN, synack, 65535, &opts(pws, pmss), 0);
        let before = f.clone();
        p(fv, &mut f, t + MS);
        assert_eq!(f, before, "a SYN-ACK is never rewritten");
        let mut f = c.seg(true, giss.wrapping_add(1), ack(PEER_ISN + 1), 502, &[], 0);
        g(fv, &mut f, t + MS);
    }

    fn std_handshake(fv: &mut FoxyVegas, c: Conn, giss: u32, t: u64) {
        handshake(fv, c, giss, Some(7), Some(7), Some(1460), Some(1460), t);
    }

    fn window(f: &Frame) -> u16 {
        tcp_segment(&f.data).expect("tcp").window
    }

    fn only_flow(fv: &FoxyVegas) -> &Flow {
        assert_eq!(fv.flows.len(), 1);
        fv.flows.values().next().expect("one flow")
    }

    /// (checksum in the frame, checksum computed from scratch).
    fn checksums(data: &[u8]) -> (u16, u16) {
        let h = PacketHeaders::from_ethernet_slice(data).expect("parses");
        let Some(TransportHeader::Tcp(t)) = h.transport.clone() else {
            panic!("not tcp")
        };
        let PayloadSlice::Tcp(payload) = h.payload else {
            panic!("no tcp payload")
        };
        let calc = match h.net {
            Some(NetHeaders::Ipv4(ip, _)) => t.calc_checksum_ipv4(&ip, payload),
            Some(NetHeaders::Ipv6(ip, _)) => t.calc_checksum_ipv6(&ip, payload),
            _ => panic!("not ip"),
        }
        .expect("checksum");
        (t.checksum, calc)
    }

    /// One's complement equality (0x0000 and 0xffff are both zero).
    fn csum_eq(a: u16, b: u16) -> bool {
        a == b || (a | b == 0xffff && (a == 0 || b == 0))
    }

    fn new_fv() -> (FoxyVegas, Arc<FoxyVegasMetrics>) {
        FoxyVegas::new(FoxyVegasConfig::default(), None)
    }

    // ---- configuration

    #[test]
    fn config_parses_good_specs() {
        assert_eq!(FoxyVegasConfig::parse(""), Ok(FoxyVegasConfig::default()));
        assert_eq!(FoxyVegasConfig::parse("  "), Ok(FoxyVegasConfig::default()));
        let c = FoxyVegasConfig::parse("2,4,1").expect("ok");
        assert_eq!((c.alpha, c.beta, c.gamma), (2, 4, 1));
        assert_eq!(c.max_flows, 4096);
        assert_eq!(c.idle_timeout_ns, 120_000_000_000);
        assert_eq!(c.min_window_segments, 2);
        let c = FoxyVegasConfig::parse(" 3 , 3 , 7 ").expect("ok");
        assert_eq!((c.alpha, c.beta, c.gamma), (3, 3, 7));
        assert!(FoxyVegasConfig::parse("1000,1000,1000").is_ok());
        assert_eq!(FoxyVegasConfig::default().validate(), Ok(()));
    }

    #[test]
    fn config_rejects_bad_specs_naming_the_value() {
        let e = |s: &str| FoxyVegasConfig::parse(s).expect_err(s).to_string();
        assert_eq!(e("5,4,1"), "foxyvegas: alpha (5) must not exceed beta (4)");
        assert_eq!(e("0,4,1"), "foxyvegas: alpha (0) must be greater than 0");
        assert_eq!(e("1,4,0"), "foxyvegas: gamma (0) must be greater than 0");
        assert_eq!(
            e("2,4,1001"),
            "foxyvegas: gamma (1001) must not exceed 1000"
        );
        assert_eq!(e("2,x,1"), "foxyvegas: beta (\"x\") is not a whole number");
        assert_eq!(
            e("-1,4,1"),
            "foxyvegas: alpha (\"-1\") is not a whole number"
        );
        assert_eq!(e("2,,1"), "foxyvegas: beta (\"\") is not a whole number");
        assert!(e("2,4").contains("\"2,4\""));
        assert!(e("2,4,1,1").contains("expected alpha,beta,gamma"));
        assert!(e("99999999999,4,1").contains("99999999999"));
        let zero_flows = FoxyVegasConfig {
            max_flows: 0,
            ..FoxyVegasConfig::default()
        };
        assert_eq!(
            zero_flows.validate(),
            Err(FoxyVegasConfigError::Zero { name: "max_flows" })
        );
    }

    #[test]
    fn an_unvalidated_config_does_not_break_the_stage() {
        let cfg = FoxyVegasConfig {
            alpha: 9,
            beta: 1,
            gamma: 0,
            max_flows: 0,
            idle_timeout_ns: 0,
            min_window_segments: 0,
        };
        let (mut fv, m) = FoxyVegas::new(cfg, None);
        std_handshake(&mut fv, Conn::v4(), 1000, 0);
        let mut f = Conn::v4().ack(1001, 65535);
        p(&mut fv, &mut f, 2 * MS);
        assert_eq!(m.snapshot().flows_active, 1);
        fv.tick(10 * MS);
        assert_eq!(m.snapshot().flows_expired, 1);
    }

    // ---- pure helpers

    #[test]
    fn wrapping_sequence_comparisons() {
        assert!(before(1, 2));
        assert!(!before(2, 2));
        assert!(before(u32::MAX - 5, 3));
        assert!(after(3, u32::MAX - 5));
        assert!(!after(u32::MAX - 5, 3));
    }

    #[test]
    fn scaled_field_is_the_ceiling_and_never_grows() {
        // 14600 bytes with shift 7: 114.06 -> 115.
        assert_eq!(scaled_window_field(1000, 7, 14_600), Some(115));
        // Exact multiple: no rounding.
        assert_eq!(scaled_window_field(1000, 7, 128 * 100), Some(100));
        // Vegas window not smaller than the peer's: nothing.
        assert_eq!(scaled_window_field(100, 7, 12_800), None);
        assert_eq!(scaled_window_field(100, 7, 20_000), None);
        // The ceiling would equal the old field: nothing.
        assert_eq!(scaled_window_field(115, 7, 14_600), None);
        // At least 1.
        assert_eq!(scaled_window_field(65535, 14, 1), Some(1));
        // Zero window stays.
        assert_eq!(scaled_window_field(0, 7, 0), None);
        // Unscaled.
        assert_eq!(scaled_window_field(65535, 0, 14_600), Some(14_600));
        // Absurd shifts are clamped to 14.
        assert_eq!(
            scaled_window_field(65535, 200, 1 << 20),
            scaled_window_field(65535, 14, 1 << 20)
        );
    }

    fn full_csum(words: &[u16]) -> u16 {
        let mut s: u32 = 0;
        for w in words {
            s += u32::from(*w);
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }

    #[test]
    fn incremental_checksum_matches_a_known_case() {
        // RFC 1624 §4 example style: data words and a changed one.
        let mut words = vec![
            0x4500, 0x0073, 0x0000, 0x4000, 0x4011, 0xc0a8, 0x0001, 0xc0a8,
        ];
        let hc = full_csum(&words);
        let old = words[3];
        words[3] = 0x1234;
        assert!(csum_eq(csum_update16(hc, old, 0x1234), full_csum(&words)));
        // No change leaves the checksum as it is.
        assert_eq!(csum_update16(0xbeef, 7, 7), 0xbeef);
    }

    proptest! {
        #[test]
        fn incremental_checksum_matches_recompute(
            mut words in prop::collection::vec(any::<u16>(), 1..64),
            idx in any::<prop::sample::Index>(),
            new in any::<u16>(),
        ) {
            let i = idx.index(words.len());
            let hc = full_csum(&words);
            let old = words[i];
            words[i] = new;
            let inc = csum_update16(hc, old, new);
            prop_assert!(csum_eq(inc, full_csum(&words)), "{inc:#x} vs {:#x}", full_csum(&words));
        }
    }

    // ---- handshake

    #[test]
    fn handshake_with_window_scaling() {
        let (mut fv, m) = new_fv();
        handshake(
            &mut fv,
            Conn::v4(),
            1000,
            Some(7),
            Some(9),
            Some(1460),
            Some(1400),
            0,
        );
        let f = only_flow(&fv);
        assert!(f.scale_known);
        assert_eq!(f.shift, 9);
        assert_eq!(f.mss, 1400, "the peer's MSS, under the guest's");
        assert_eq!((f.snd_una, f.snd_nxt), (1001, 1001));
        // 1000 << 9 = 512000 bytes > 10 * 1400: ceil(14000 / 512) = 28.
        let mut a = Conn::v4().ack(1001, 1000);
        p(&mut fv, &mut a, 2 * MS);
        assert_eq!(window(&a), 28);
        let s = m.snapshot();
        assert_eq!((s.flows_total, s.flows_active, s.rewrites), (1, 1, 1));
        assert_eq!(s.flows_untracked_scale, 0);
        fv.tick(3 * MS);
        let fl = m.flows();
        assert_eq!(fl.len(), 1);
        assert_eq!(fl[0].guest, "10.0.2.15:40000");
        assert_eq!(fl[0].peer, "10.0.2.1:5201");
        assert_eq!((fl[0].shift, fl[0].mss, fl[0].cwnd_segments), (9, 1400, 10));
        assert!(fl[0].scale_known && fl[0].slow_start);
        assert_eq!(fl[0].rewrites, 1);
    }

    #[test]
    fn handshake_without_scaling_uses_unscaled_windows() {
        // Only the peer offers scaling: not in effect (RFC 7323).
        let (mut fv, _m) = new_fv();
        handshake(
            &mut fv,
            Conn::v4(),
            1000,
            None,
            Some(7),
            Some(1460),
            Some(1460),
            0,
        );
        assert_eq!(only_flow(&fv).shift, 0);
        let mut a = Conn::v4().ack(1001, 65535);
        p(&mut fv, &mut a, 2 * MS);
        assert_eq!(window(&a), 14_600);
        // Only the guest offers it, and no MSS from the peer: 536 (IPv4 default).
        let (mut fv, _m) = new_fv();
        handshake(
            &mut fv,
            Conn::v4(),
            1000,
            Some(7),
            None,
            Some(1460),
            None,
            0,
        );
        let f = only_flow(&fv);
        assert_eq!((f.shift, f.mss), (0, 536));
        // IPv6 default MSS is 1220; a zero MSS option counts as absent.
        let (mut fv, _m) = new_fv();
        handshake(
            &mut fv,
            Conn::v6(),
            1000,
            Some(7),
            Some(7),
            Some(1440),
            Some(0),
            0,
        );
        let f = only_flow(&fv);
        assert_eq!((f.shift, f.mss), (7, 1220));
    }

    #[test]
    fn absurd_options_are_clamped() {
        let (mut fv, _m) = new_fv();
        handshake(
            &mut fv,
            Conn::v4(),
            1000,
            Some(200),
            Some(99),
            Some(1),
            Some(3),
            0,
        );
        let f = only_flow(&fv);
        assert_eq!(f.shift, 14);
        assert_eq!(f.mss, MIN_MSS);
    }

    #[test]
    fn a_syn_ack_must_acknowledge_the_syn() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        let syn = Fl {
            syn: true,
            ..Fl::default()
        };
        let mut f = c.seg(true, 1000, syn, 64240, &opts(Some(7), Some(1460)), 0);
        g(&mut fv, &mut f, 0);
        assert_eq!(m.snapshot().half_open_active, 1);
        let bad = Fl {
            syn: true,
            ack: Some(77),
            ..Fl::default()
        };
        let mut f = c.seg(false, PEER_ISN, bad, 65535, &opts(Some(7), Some(1460)), 0);
        p(&mut fv, &mut f, MS);
        assert_eq!(m.snapshot().flows_total, 0);
        // Refused: RST clears the half-open entry.
        let rst = Fl {
            rst: true,
            ack: Some(1001),
            ..Fl::default()
        };
        let mut f = c.seg(false, 0, rst, 0, &[], 0);
        p(&mut fv, &mut f, MS);
        fv.tick(2 * MS);
        let s = m.snapshot();
        assert_eq!((s.half_open_active, s.flows_total), (0, 0));
    }

    #[test]
    fn passive_open_is_tracked_too() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        let syn = Fl {
            syn: true,
            ..Fl::default()
        };
        let mut f = c.seg(false, PEER_ISN, syn, 65535, &opts(Some(8), Some(1400)), 0);
        p(&mut fv, &mut f, 0);
        let synack = Fl {
            syn: true,
            ack: Some(PEER_ISN + 1),
            ..Fl::default()
        };
        let mut f = c.seg(true, 7000, synack, 64240, &opts(Some(7), Some(1460)), 0);
        g(&mut fv, &mut f, MS);
        let fl = only_flow(&fv);
        assert_eq!(
            (fl.shift, fl.mss, fl.snd_una, fl.snd_nxt),
            (8, 1400, 7000, 7001)
        );
        // Peer's ACK of the SYN-ACK: rewritten (65535 << 8 is far above 14000).
        let mut a = c.ack(7001, 65535);
        p(&mut fv, &mut a, 2 * MS);
        assert_eq!(window(&a), 14_000_u32.div_ceil(256) as u16);
        let mut d = c.data(7001, 1400);
        g(&mut fv, &mut d, 3 * MS);
        let mut a = c.ack(8401, 65535);
        p(&mut fv, &mut a, 13 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 10 * MS);
        assert_eq!(m.snapshot().rtt_samples, 1);
    }

    // ---- RTT sampling

    #[test]
    fn cumulative_ack_samples_the_latest_sent_covered_segment() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        for (i, t) in [100, 101, 102].iter().enumerate() {
            let mut d = c.data(1001 + 1000 * i as u32, 1000);
            g(&mut fv, &mut d, t * MS);
        }
        // A delayed ACK covering the first two: 120 - 101.
        let mut a = c.ack(3001, 65535);
        p(&mut fv, &mut a, 120 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 19 * MS);
        // A duplicate changes nothing.
        let mut a = c.ack(3001, 65535);
        p(&mut fv, &mut a, 125 * MS);
        assert_eq!(m.snapshot().rtt_samples, 1);
        let mut a = c.ack(4001, 65535);
        p(&mut fv, &mut a, 130 * MS);
        let f = only_flow(&fv);
        assert_eq!(f.last_rtt_ns, 28 * MS);
        assert_eq!(f.base_rtt_ns, 19 * MS);
        assert!(f.samples.is_empty());
        // A 60000-byte GSO super-frame acknowledged piecewise gives one sample per ACK.
        let mut d = c.data(4001, 60_000);
        d.hdr.gso_type = GSO_TCPV4;
        d.hdr.gso_size = 1448;
        g(&mut fv, &mut d, 140 * MS);
        assert_eq!(only_flow(&fv).mss, 1448, "gso_size refines the MSS");
        let mut a = c.ack(4001 + 2896, 65535);
        p(&mut fv, &mut a, 150 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 10 * MS);
        assert_eq!(only_flow(&fv).samples.len(), 1, "the rest stays pending");
        let mut a = c.ack(64_001, 65535);
        p(&mut fv, &mut a, 165 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 25 * MS);
        // An ACK of bytes never sent is ignored.
        let mut a = c.ack(100_000, 65535);
        p(&mut fv, &mut a, 170 * MS);
        let s = m.snapshot();
        assert_eq!(s.rtt_samples, 4);
        assert_eq!(s.data_segments, 4);
        assert_eq!(s.acks_seen, 6);
        assert_eq!(only_flow(&fv).snd_una, 64_001);
        fv.tick(171 * MS);
        assert_eq!(m.snapshot().min_base_rtt_us, 10_000);
        // The flow ends (RST): no active flow, but the lowest base RTT stays.
        let rst = Fl {
            rst: true,
            ..ack(64_001)
        };
        let mut r = c.seg(false, PEER_ISN + 1, rst, 0, &[], 0);
        p(&mut fv, &mut r, 180 * MS);
        fv.tick(400 * MS);
        let s = m.snapshot();
        assert_eq!((s.flows_active, s.min_base_rtt_us), (0, 0));
        assert_eq!(s.lowest_base_rtt_us, 10_000);
    }

    #[test]
    fn karn_rule_skips_retransmitted_bytes() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        let mut d = c.data(1001, 1000);
        g(&mut fv, &mut d, 100 * MS);
        let mut d = c.data(1001, 1000);
        g(&mut fv, &mut d, 150 * MS);
        let mut a = c.ack(2001, 65535);
        p(&mut fv, &mut a, 160 * MS);
        let s = m.snapshot();
        assert_eq!(
            (s.retransmissions, s.rtt_samples, s.data_segments),
            (1, 0, 2)
        );
        // Repacketized: [2001, 3001) sent, then [2501, 3501) resent with new bytes at the end.
        let mut d = c.data(2001, 1000);
        g(&mut fv, &mut d, 200 * MS);
        let mut d = c.data(2501, 1000);
        g(&mut fv, &mut d, 210 * MS);
        assert_eq!(m.snapshot().retransmissions, 2);
        let mut a = c.ack(3001, 65535);
        p(&mut fv, &mut a, 230 * MS);
        assert_eq!(
            m.snapshot().rtt_samples,
            0,
            "the old copy's sample was dropped"
        );
        let mut a = c.ack(3501, 65535);
        p(&mut fv, &mut a, 240 * MS);
        assert_eq!(m.snapshot().rtt_samples, 1);
        assert_eq!(only_flow(&fv).last_rtt_ns, 30 * MS);
        // A fresh segment samples normally.
        let mut d = c.data(3501, 1000);
        g(&mut fv, &mut d, 300 * MS);
        let mut a = c.ack(4501, 65535);
        p(&mut fv, &mut a, 310 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 10 * MS);
        assert_eq!(m.snapshot().rtt_samples, 2);
    }

    #[test]
    fn sequence_numbers_wrap_around() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        let giss = u32::MAX - 2500;
        std_handshake(&mut fv, c, giss, 0);
        let mut seq = giss.wrapping_add(1);
        for i in 0..5u64 {
            let mut d = c.data(seq, 1000);
            g(&mut fv, &mut d, (100 + i) * MS);
            seq = seq.wrapping_add(1000);
        }
        assert!(seq < 10_000, "crossed 2^32");
        // Resend the segment straddling the wrap: a retransmission.
        let mut d = c.data(giss.wrapping_add(2001), 1000);
        g(&mut fv, &mut d, 106 * MS);
        let mut s = giss.wrapping_add(1);
        for i in 0..5u64 {
            s = s.wrapping_add(1000);
            let mut a = c.ack(s, 65535);
            p(&mut fv, &mut a, (110 + i) * MS);
            assert!(window(&a) < 65535, "rewritten across the wrap");
        }
        let snap = m.snapshot();
        assert_eq!(snap.retransmissions, 1);
        assert_eq!(snap.rtt_samples, 4, "all but the retransmitted one");
        let f = only_flow(&fv);
        assert_eq!(f.snd_una, seq);
        assert_eq!(f.base_rtt_ns, 10 * MS);
        assert!(f.samples.is_empty());
    }

    #[test]
    fn segments_far_outside_the_sequence_space_are_ignored() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        let mut d = c.data(1001u32.wrapping_add(1 << 31), 1000);
        g(&mut fv, &mut d, 10 * MS);
        let f = only_flow(&fv);
        assert_eq!(f.snd_nxt, 1001);
        assert!(f.samples.is_empty());
        assert_eq!(m.snapshot().data_segments, 0);
    }

    #[test]
    fn the_sample_queue_is_bounded() {
        let (mut fv, _m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        let mut seq = 1001u32;
        for i in 0..(MAX_PENDING_SAMPLES as u64 + 50) {
            let mut d = c.data(seq, 100);
            g(&mut fv, &mut d, MS + i);
            seq += 100;
        }
        // Full: the segments beyond the first 256 were not sampled.
        let f = only_flow(&fv);
        assert_eq!(f.samples.len(), MAX_PENDING_SAMPLES);
        assert_eq!(f.samples.front().map(|s| s.start), Some(1001));
        assert_eq!(f.samples.back().map(|s| s.start), Some(1001 + 255 * 100));
        // ACKs make room, and the next segments are sampled again.
        let mut a = c.ack(2001, 65535);
        p(&mut fv, &mut a, 10 * MS);
        assert_eq!(only_flow(&fv).last_rtt_ns, 10 * MS - (MS + 9));
        let mut d = c.data(seq, 100);
        g(&mut fv, &mut d, 11 * MS);
        let f = only_flow(&fv);
        assert_eq!(f.samples.len(), MAX_PENDING_SAMPLES - 9);
        assert_eq!(f.samples.back().map(|s| s.start), Some(seq));
        // With more segments in flight than the queue holds, every ACK still finds samples.
        let mut s = Sim::new(10 * MS, 2000);
        s.adv = 400;
        s.app_limit = 400;
        s.run(3000);
        assert!(s.m.snapshot().rtt_samples > 1000);
    }

    // ---- Vegas

    fn flow_for_rounds(cwnd: u32, slow_start: bool) -> Flow {
        let cfg = FoxyVegasConfig::default();
        let mut f = Flow::new(true, 0, 1000, 0, 0, &cfg, 0);
        f.cwnd = cwnd;
        f.slow_start = slow_start;
        f.base_rtt_ns = 10 * MS;
        f
    }

    fn round(f: &mut Flow, rtt: u64, samples: u32, inflight_segs: u64) -> u32 {
        f.round_min_ns = rtt;
        f.round_samples = samples;
        f.round_max_inflight = inflight_segs * 1000;
        f.end_round(&FoxyVegasConfig::default());
        f.cwnd
    }

    #[test]
    fn congestion_avoidance_follows_alpha_and_beta() {
        // diff = 20 * 0 / 10 = 0 < alpha: +1.
        assert_eq!(round(&mut flow_for_rounds(20, false), 10 * MS, 3, 20), 21);
        // diff = 20 * 10 / 20 = 10 > beta: -1.
        assert_eq!(round(&mut flow_for_rounds(20, false), 20 * MS, 3, 20), 19);
        // diff = 20 * 1.8 / 11.8 = 3: unchanged.
        assert_eq!(
            round(&mut flow_for_rounds(20, false), 11_800_000, 3, 20),
            20
        );
        // diff = 2 (alpha) and 4 (beta) are inside the band.
        assert_eq!(
            round(&mut flow_for_rounds(10, false), 12_500_000, 3, 10),
            10
        );
        assert_eq!(
            round(&mut flow_for_rounds(20, false), 12_500_000, 3, 20),
            20
        );
        // diff = 2 * 90 / 100 = 1 < alpha: +1.
        assert_eq!(round(&mut flow_for_rounds(2, false), 100 * MS, 3, 2), 3);
        // Never below the minimum window: diff = 6 * 990 / 1000 = 5 > beta, but 6 is the floor.
        let cfg = FoxyVegasConfig {
            min_window_segments: 6,
            ..FoxyVegasConfig::default()
        };
        let mut f = flow_for_rounds(6, false);
        f.round_min_ns = 1000 * MS;
        f.round_samples = 3;
        f.end_round(&cfg);
        assert_eq!(f.cwnd, 6);
        // Too few samples: Reno's +1.
        assert_eq!(round(&mut flow_for_rounds(20, false), 50 * MS, 2, 20), 21);
        // No sample: unchanged.
        assert_eq!(round(&mut flow_for_rounds(20, false), u64::MAX, 0, 20), 20);
    }

    #[test]
    fn slow_start_doubles_every_other_round_and_exits_on_gamma() {
        let mut f = flow_for_rounds(10, true);
        assert_eq!(round(&mut f, 10 * MS, 5, 10), 20);
        assert_eq!(round(&mut f, 10 * MS, 5, 20), 20, "hold round");
        assert_eq!(round(&mut f, 10 * MS, 5, 20), 40);
        assert!(f.slow_start);
        // diff = 40 * 5 / 15 = 13 > gamma: cwnd = min(40, 40 * 10 / 15 + 1) = 27.
        assert_eq!(round(&mut f, 15 * MS, 5, 40), 27);
        assert!(!f.slow_start);
        // diff = 1 = gamma stays in slow start.
        let mut f = flow_for_rounds(10, true);
        assert_eq!(round(&mut f, 11_200_000, 5, 10), 20);
        assert!(f.slow_start);
    }

    #[test]
    fn application_limited_rounds_do_not_grow_the_window() {
        let mut f = flow_for_rounds(10, true);
        assert_eq!(round(&mut f, 10 * MS, 5, 3), 10);
        let mut f = flow_for_rounds(10, true);
        assert_eq!(round(&mut f, 10 * MS, 5, 7), 14);
        let mut f = flow_for_rounds(30, false);
        assert_eq!(
            round(&mut f, 10 * MS, 5, 3),
            30,
            "no growth, but no shrink either"
        );
    }

    /// A closed loop: a guest that always fills the window it is offered (up to `app_limit`
    /// segments), one ACK per segment, and a bottleneck with base RTT `base` that can carry
    /// `bdp` segments per RTT (more in flight wait in its queue).
    struct Sim {
        fv: FoxyVegas,
        m: Arc<FoxyVegasMetrics>,
        c: Conn,
        t: u64,
        nxt: u32,
        pending: VecDeque<(u32, u64)>,
        adv: u32,
        app_limit: u32,
        base: u64,
        bdp: u32,
    }

    const SIM_MSS: u32 = 1000;

    impl Sim {
        fn new(base: u64, bdp: u32) -> Self {
            let (mut fv, m) = new_fv();
            let c = Conn::v4();
            handshake(
                &mut fv,
                c,
                1000,
                Some(7),
                Some(7),
                Some(1000),
                Some(1000),
                0,
            );
            Self {
                fv,
                m,
                c,
                t: 10 * MS,
                nxt: 1001,
                pending: VecDeque::new(),
                adv: 10,
                app_limit: u32::MAX,
                base,
                bdp,
            }
        }

        fn rtt(&self, inflight: u32) -> u64 {
            let per_seg = self.base / u64::from(self.bdp);
            self.base + u64::from(inflight.saturating_sub(self.bdp)) * per_seg
        }

        fn run(&mut self, acks: usize) {
            for _ in 0..acks {
                let limit = self.adv.min(self.app_limit).max(1);
                while (self.pending.len() as u32) < limit {
                    let r = self.rtt(self.pending.len() as u32 + 1);
                    let mut d = self.c.data(self.nxt, SIM_MSS as usize);
                    g(&mut self.fv, &mut d, self.t);
                    self.nxt = self.nxt.wrapping_add(SIM_MSS);
                    self.pending.push_back((self.nxt, self.t + r));
                }
                let (end, at) = self.pending.pop_front().expect("in flight");
                self.t = self.t.max(at);
                let mut a = self.c.ack(end, 65535);
                p(&mut self.fv, &mut a, self.t);
                let w = u64::from(window(&a)) << 7;
                self.adv = u32::try_from(w / u64::from(SIM_MSS)).unwrap_or(u32::MAX);
            }
        }

        fn flow(&self) -> &Flow {
            only_flow(&self.fv)
        }
    }

    #[test]
    fn vegas_settles_decreases_when_rtt_grows_and_increases_at_base_rtt() {
        let mut s = Sim::new(10 * MS, 20);
        s.run(3000);
        let f = s.flow();
        assert!(!f.slow_start);
        assert_eq!(f.base_rtt_ns, 10 * MS);
        // Vegas keeps alpha..beta segments queued: 22..=24 in flight.
        assert!((21..=25).contains(&f.cwnd), "cwnd {}", f.cwnd);
        let settled = f.cwnd;
        // The bottleneck halves: the RTT grows, the window follows down.
        s.bdp = 10;
        s.run(3000);
        let f = s.flow();
        assert!(f.cwnd < settled);
        assert!((11..=15).contains(&f.cwnd), "cwnd {}", f.cwnd);
        // Capacity quadruples: the RTT stays at base, the window grows one per round.
        let low = f.cwnd;
        s.bdp = 60;
        s.run(2000);
        let mid = s.flow().cwnd;
        assert!(mid > low + 10, "cwnd {mid}");
        s.run(8000);
        assert!((61..=65).contains(&s.flow().cwnd), "cwnd {}", s.flow().cwnd);
        // The guest was held to the Vegas window through rewritten ACKs.
        assert!(s.m.snapshot().rewrites > 10_000);
        assert!(s.adv <= s.flow().cwnd + 1);
    }

    #[test]
    fn slow_start_ends_near_the_bottleneck() {
        let mut s = Sim::new(10 * MS, 100);
        let mut rounds = 0;
        while s.flow().slow_start && rounds < 200 {
            s.run(50);
            rounds += 1;
        }
        let f = s.flow();
        assert!(!f.slow_start);
        // The round's minimum RTT lags the window (it comes from the first segments sent
        // after the last doubling), so slow start overshoots, then target + 1 cuts back.
        assert!((100..=2 * 100 + 5).contains(&f.cwnd), "cwnd {}", f.cwnd);
        s.run(30_000);
        assert!(
            (101..=105).contains(&s.flow().cwnd),
            "cwnd {}",
            s.flow().cwnd
        );
    }

    #[test]
    fn an_application_limited_flow_keeps_a_small_window() {
        let mut s = Sim::new(10 * MS, 1000);
        s.app_limit = 4;
        s.run(2000);
        assert_eq!(s.flow().cwnd, 10);
        s.app_limit = 8;
        s.run(2000);
        assert!(s.flow().cwnd <= 16, "cwnd {}", s.flow().cwnd);
        s.app_limit = u32::MAX;
        s.run(3000);
        assert!(s.flow().cwnd > 100, "grows once the window is used");
    }

    // ---- rewriting

    #[test]
    fn rewrite_only_when_vegas_is_smaller_and_never_grows() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        // 10 * 1460 = 14600 bytes; shift 7.
        for (field, expect) in [
            (1000, 115),
            (100, 100),
            (115, 115),
            (114, 114),
            (0, 0),
            (65535, 115),
        ] {
            let mut a = c.ack(1001, field);
            let before = a.clone();
            p(&mut fv, &mut a, 2 * MS);
            assert_eq!(window(&a), expect, "field {field}");
            if expect == field {
                assert_eq!(a, before, "field {field} untouched");
            }
        }
        assert_eq!(m.snapshot().rewrites, 2);
        // Data from the peer with an ACK is rewritten too, its payload untouched.
        let mut a = c.seg(false, PEER_ISN + 1, ack(1001), 1000, &[], 300);
        let before = a.clone();
        p(&mut fv, &mut a, 3 * MS);
        assert_eq!(window(&a), 115);
        assert_eq!(
            a.data[a.data.len() - 300..],
            before.data[before.data.len() - 300..]
        );
        // RST and segments without ACK are not.
        let mut r = c.seg(
            false,
            PEER_ISN + 1,
            Fl {
                rst: true,
                ack: Some(1001),
                ..Fl::default()
            },
            1000,
            &[],
            0,
        );
        let before = r.clone();
        p(&mut fv, &mut r, 4 * MS);
        assert_eq!(r, before);
        assert_eq!(m.snapshot().flows_active, 0, "RST ends the flow");
    }

    #[test]
    fn rewritten_checksums_are_valid_for_ipv4_and_ipv6() {
        for c in [Conn::v4(), Conn::v6()] {
            let (mut fv, m) = new_fv();
            std_handshake(&mut fv, c, 1000, 0);
            for (i, field) in [65535u16, 40_000, 1000, 200, 116].into_iter().enumerate() {
                let mut a = c.seg(false, PEER_ISN + 1, ack(1001), field, &[], i * 7);
                let (stored, calc) = checksums(&a.data);
                assert_eq!(stored, calc, "the test frame starts valid");
                p(&mut fv, &mut a, 2 * MS);
                assert_eq!(window(&a), 115);
                let (stored, calc) = checksums(&a.data);
                assert!(
                    csum_eq(stored, calc),
                    "v6={} field {field}: {stored:#x} vs {calc:#x}",
                    c.v6
                );
            }
            assert_eq!(m.snapshot().rewrites, 5);
        }
    }

    #[test]
    fn needs_csum_frames_keep_their_checksum_field() {
        for c in [Conn::v4(), Conn::v6()] {
            let (mut fv, _m) = new_fv();
            std_handshake(&mut fv, c, 1000, 0);
            let mut a = c.ack(1001, 65535);
            a.hdr.flags = FLAG_NEEDS_CSUM;
            let before = a.clone();
            p(&mut fv, &mut a, 2 * MS);
            let seg = tcp_segment(&a.data).expect("tcp");
            assert_eq!(seg.window, 115);
            let co = seg.checksum_offset();
            assert_eq!(a.data[co..co + 2], before.data[co..co + 2]);
            let wo = seg.window_offset();
            for (i, (x, y)) in a.data.iter().zip(&before.data).enumerate() {
                if i != wo && i != wo + 1 {
                    assert_eq!(x, y, "byte {i}");
                }
            }
        }
    }

    #[test]
    fn mid_connection_flows_are_measured_but_never_rewritten() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        // Pure ACKs and FINs of unknown flows create nothing.
        let mut a = c.seg(true, 500, ack(9), 100, &[], 0);
        g(&mut fv, &mut a, 0);
        assert_eq!(m.snapshot().flows_total, 0);
        // Nor do ACKs from the network.
        let mut a = c.ack(500, 65535);
        p(&mut fv, &mut a, 0);
        assert_eq!(m.snapshot().flows_total, 0);
        let mut d = c.data(500, 1448);
        g(&mut fv, &mut d, MS);
        let mut a = c.ack(1948, 65535);
        let before = a.clone();
        p(&mut fv, &mut a, 11 * MS);
        assert_eq!(a, before);
        let s = m.snapshot();
        assert_eq!(
            (
                s.flows_total,
                s.flows_untracked_scale,
                s.rtt_samples,
                s.rewrites
            ),
            (1, 1, 1, 0)
        );
        let f = only_flow(&fv);
        assert!(!f.scale_known);
        assert_eq!(f.mss, 1448, "learned from the segment");
        fv.tick(12 * MS);
        assert!(!m.flows()[0].scale_known);
    }

    // ---- table

    #[test]
    fn the_table_is_bounded_lru_and_idle_flows_expire() {
        let cfg = FoxyVegasConfig {
            max_flows: 2,
            ..FoxyVegasConfig::default()
        };
        let idle = cfg.idle_timeout_ns;
        let (mut fv, m) = FoxyVegas::new(cfg, None);
        std_handshake(&mut fv, Conn::port(1), 1000, 10 * MS);
        std_handshake(&mut fv, Conn::port(2), 1000, 20 * MS);
        // Flow 1 is active again: flow 2 becomes the least recently active.
        let mut d = Conn::port(1).data(1001, 100);
        g(&mut fv, &mut d, 30 * MS);
        std_handshake(&mut fv, Conn::port(3), 1000, 40 * MS);
        let s = m.snapshot();
        assert_eq!((s.flows_total, s.flows_active, s.flows_evicted), (3, 2, 1));
        let mut ports: Vec<u16> = fv.flows.keys().map(|k| k.guest_port).collect();
        ports.sort_unstable();
        assert_eq!(ports, [1, 3]);
        fv.tick(41 * MS);
        let fl = m.flows();
        assert_eq!(fl.len(), 2);
        assert_eq!(fl[0].guest, "10.0.2.15:3", "most recent first");
        // Flow 1 idles out first.
        fv.tick(30 * MS + idle + 1);
        let s = m.snapshot();
        assert_eq!((s.flows_expired, s.flows_active), (1, 1));
        fv.tick(41 * MS + idle + 1);
        let s = m.snapshot();
        assert_eq!(
            (s.flows_expired, s.flows_active, s.min_base_rtt_us),
            (2, 0, 0)
        );

        assert!(m.flows().is_empty());
    }

    #[test]
    fn half_open_connections_are_bounded_and_expire() {
        let cfg = FoxyVegasConfig {
            max_flows: 3,
            ..FoxyVegasConfig::default()
        };
        let idle = cfg.idle_timeout_ns;
        let (mut fv, m) = FoxyVegas::new(cfg, None);
        let syn = Fl {
            syn: true,
            ..Fl::default()
        };
        for port in 1..=10u16 {
            let mut f = Conn::port(port).seg(false, 1, syn, 100, &[], 0);
            p(&mut fv, &mut f, u64::from(port) * MS);
        }
        let s = m.snapshot();
        assert_eq!(
            (s.half_open_active, s.half_open_evicted, s.flows_total),
            (3, 7, 0)
        );
        fv.tick(10 * MS + idle + 1);
        let s = m.snapshot();
        assert_eq!((s.half_open_active, s.half_open_expired), (0, 3));
    }

    #[test]
    fn fins_from_both_sides_end_the_flow() {
        let (mut fv, m) = new_fv();
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        let mut d = c.seg(
            true,
            1001,
            Fl {
                fin: true,
                ack: Some(PEER_ISN + 1),
                ..Fl::default()
            },
            100,
            &[],
            10,
        );
        g(&mut fv, &mut d, MS);
        assert_eq!(only_flow(&fv).snd_nxt, 1012, "data and FIN");
        let mut a = c.seg(
            false,
            PEER_ISN + 1,
            Fl {
                fin: true,
                ack: Some(1012),
                ..Fl::default()
            },
            65535,
            &[],
            0,
        );
        p(&mut fv, &mut a, 2 * MS);
        assert_eq!(window(&a), 115, "the last ACK is still rewritten");
        let s = m.snapshot();
        assert_eq!((s.flows_active, s.flows_closed, s.rtt_samples), (0, 1, 1));
        // The guest's final ACK creates nothing.
        let mut a = c.seg(true, 1012, ack(PEER_ISN + 2), 100, &[], 0);
        g(&mut fv, &mut a, 3 * MS);
        assert_eq!(m.snapshot().flows_total, 1);
    }

    // ---- the rewrite log

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("disk full"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::Error::other("disk full"))
        }
    }

    #[test]
    fn the_rewrite_log_matches_the_frames() {
        for c in [Conn::v4(), Conn::v6()] {
            let buf = SharedBuf::default();
            let (mut fv, m) =
                FoxyVegas::new(FoxyVegasConfig::default(), Some(Box::new(buf.clone())));
            std_handshake(&mut fv, c, 1000, 0);
            let mut seq = 1001u32;
            let mut out = Vec::new();
            for i in 0..20u64 {
                let mut d = c.data(seq, 1460);
                g(&mut fv, &mut d, (10 + i) * MS);
                seq += 1460;
                let mut a = c.ack(seq, 40_000 - i as u16);
                p(&mut fv, &mut a, (30 + i) * MS);
                out.push((seq, 40_000 - i as u16, window(&a), (30 + i) * MS));
            }
            fv.finish();
            let text = String::from_utf8(buf.0.lock().expect("lock").clone()).expect("utf8");
            let recs: Vec<RewriteRecord> = text
                .lines()
                .map(|l| serde_json::from_str(l).expect("a RewriteRecord"))
                .collect();
            assert_eq!(recs.len(), 20);
            assert_eq!(m.snapshot().rewrites, 20);
            for (r, (ack, old, new, t)) in recs.iter().zip(&out) {
                assert_eq!(
                    (r.ack, r.old_field, r.new_field, r.t_ns),
                    (*ack, *old, *new, *t)
                );
                assert_eq!(r.shift, 7);
                assert_eq!(r.window_bytes, u64::from(r.new_field) << 7);
                assert_eq!(r.peer_window_bytes, u64::from(r.old_field) << 7);
                assert_eq!(r.mss, 1460);
                assert!(r.window_bytes >= u64::from(r.cwnd_segments) * 1460);
                assert!(r.window_bytes < u64::from(r.cwnd_segments) * 1460 + 128);
                assert_eq!(r.base_rtt_us, 20_000);
                assert_eq!(r.rtt_us, 20_000);
            }
            let (guest, peer) = if c.v6 {
                ("[fd00::15]:40000", "[fd00::1]:5201")
            } else {
                ("10.0.2.15:40000", "10.0.2.1:5201")
            };
            assert_eq!(
                (recs[0].guest.as_str(), recs[0].peer.as_str()),
                (guest, peer)
            );
            assert_eq!(m.snapshot().rewrite_log_errors, 0);
        }
    }

    #[test]
    fn a_failing_rewrite_log_is_counted_once_and_abandoned() {
        let (mut fv, m) = FoxyVegas::new(FoxyVegasConfig::default(), Some(Box::new(Broken)));
        let c = Conn::v4();
        std_handshake(&mut fv, c, 1000, 0);
        for i in 0..3 {
            let mut a = c.ack(1001, 65535);
            p(&mut fv, &mut a, (2 + i) * MS);
            fv.tick((2 + i) * MS);
        }
        fv.finish();
        let s = m.snapshot();
        assert_eq!((s.rewrites, s.rewrite_log_errors), (3, 1));
    }

    // ---- hostile input

    /// Valid frames of one scaled flow (after `std_handshake`), to mutate.
    fn corpus(c: Conn) -> Vec<(Direction, Frame)> {
        let fin = Fl {
            fin: true,
            ack: Some(PEER_ISN + 1),
            ..Fl::default()
        };
        let syn = Fl {
            syn: true,
            ..Fl::default()
        };
        vec![
            (Direction::FromGuest, c.data(1001, 1000)),
            (Direction::FromGuest, c.data(2001, 3000)),
            (Direction::ToGuest, c.ack(2001, 65535)),
            (Direction::ToGuest, c.ack(5001, 30_000)),
            (
                Direction::ToGuest,
                c.seg(false, PEER_ISN + 1, ack(1001), 9000, &[], 40),
            ),
            (
                Direction::ToGuest,
                c.seg(false, PEER_ISN + 1, fin, 9000, &[], 0),
            ),
            (Direction::FromGuest, c.seg(true, 5001, fin, 9000, &[], 0)),
            (
                Direction::FromGuest,
                c.seg(true, 1000, syn, 9000, &opts(Some(7), Some(1460)), 0),
            ),
        ]
    }

    fn check_only_window_and_checksum_changed(
        before: &Frame,
        after: &Frame,
        seg: Option<TcpSegment>,
    ) {
        assert_eq!(before.hdr, after.hdr);
        assert_eq!(before.data.len(), after.data.len());
        let Some(seg) = seg else {
            assert_eq!(before.data, after.data, "not TCP: untouched");
            return;
        };
        let wo = seg.window_offset();
        let co = seg.checksum_offset();
        for (i, (x, y)) in before.data.iter().zip(&after.data).enumerate() {
            if !(wo..wo + 2).contains(&i) && !(co..co + 2).contains(&i) {
                assert_eq!(x, y, "byte {i} changed");
            }
        }
        let old = u16::from_be_bytes([before.data[wo], before.data[wo + 1]]);
        let new = u16::from_be_bytes([after.data[wo], after.data[wo + 1]]);
        assert!(new <= old, "a window grew: {old} -> {new}");
        if before.hdr.needs_csum() {
            assert_eq!(before.data[co..co + 2], after.data[co..co + 2]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn hostile_frames_never_panic_and_only_touch_the_window(
            v6 in any::<bool>(),
            ops in prop::collection::vec(
                (
                    any::<bool>(),
                    0usize..10,
                    prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
                    prop::option::of(any::<prop::sample::Index>()),
                    prop::collection::vec(any::<u8>(), 0..120),
                    any::<u8>(),
                    0u64..50_000_000,
                ),
                1..40,
            ),
        ) {
            let c = if v6 { Conn::v6() } else { Conn::v4() };
            let cfg = FoxyVegasConfig { max_flows: 4, ..FoxyVegasConfig::default() };
            let (mut fv, m) = FoxyVegas::new(cfg, Some(Box::new(std::io::sink())));
            std_handshake(&mut fv, c, 1000, 0);
            let corpus = corpus(c);
            let mut t = 10 * MS;
            for (to_guest, pick, muts, trunc, random, flags, dt) in ops {
                t += dt;
                let (dir, mut frame) = if pick >= corpus.len() {
                    let dir = if to_guest { Direction::ToGuest } else { Direction::FromGuest };
                    (dir, Frame { hdr: VnetHdr::default(), data: random })
                } else {
                    let (dir, f) = corpus[pick].clone();
                    (dir, f)
                };
                for (idx, x) in muts {
                    if !frame.data.is_empty() {
                        let i = idx.index(frame.data.len());
                        frame.data[i] ^= x;
                    }
                }
                if let Some(n) = trunc {
                    let n = n.index(frame.data.len() + 1);
                    frame.data.truncate(n);
                }
                frame.hdr.flags = flags & 3;
                let before = frame.clone();
                let seg = tcp_segment(&frame.data);
                prop_assert_eq!(fv.on_frame(dir, &mut frame, t), Verdict::Pass);
                check_only_window_and_checksum_changed(&before, &frame, seg);
                if flags & 0x80 != 0 {
                    fv.tick(t);
                }
            }
            fv.finish();
            let s = m.snapshot();
            prop_assert!(s.flows_active <= 4);
        }
    }
}
