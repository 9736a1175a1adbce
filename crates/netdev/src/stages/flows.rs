//! Flows: per-flow traffic metrics of a network device.
//!
//! The stage looks at every frame in both directions, never changes or drops one, and keeps a
//! bounded table of flows with their counters. The launcher reads the totals and the busiest
//! flows through the shared [`FlowMetrics`] without touching the worker's table.
//!
//! # Flows
//!
//! A flow is keyed by its protocol and its two ends, seen from the guest:
//!
//! * `tcp`, `udp`: guest address:port and peer address:port;
//! * `icmp` (ICMPv4 and ICMPv6): guest address and peer address (no ports);
//! * `ip-N` (any other IP protocol number `N`, and IP fragments, whose transport header is not
//!   in the frame): guest address and peer address;
//! * `ether-0xXXXX` (frames that are not IP: ARP, LLDP, ...): one aggregate bucket per
//!   ethertype, without addresses.
//!
//! The guest side is the source of frames from the guest ([`Direction::FromGuest`], counted as
//! `tx`) and the destination of frames to the guest ([`Direction::ToGuest`], counted as
//! `rx`), so both directions of a connection land in the same flow. VLAN tags are skipped.
//!
//! Per flow the stage counts frames and bytes per direction (bytes are Ethernet frame
//! lengths, virtio-net header excluded), and `segments`: the frames the flow is on the wire,
//! i.e. one per ordinary frame and `ceil(payload / gso_size)` per GSO super-frame (TCP or UDP
//! payload). For TCP it records the SYN, FIN (per direction) and RST flags seen, and counts
//! *retransmissions from the guest*: a segment from the guest carrying data whose end
//! sequence number is not beyond the highest end sequence number the guest already sent on
//! the flow (modulo 2^32). A retransmitted GSO super-frame counts once; keep-alive and window
//! probes carrying one old byte count too (they are retransmissions on the wire).
//!
//! # Limits
//!
//! * At most `max_flows` flows (default 4096, at least 1) are tracked. A new flow arriving
//!   when the table is full evicts the least recently seen flow (counted in `evicted`). The
//!   table keeps its flows in recency order, so a frame costs one hash lookup and a few
//!   pointer updates, whatever the table size.
//! * [`NetStage::tick`] expires flows idle for longer than `idle_timeout_ns` (default 120 s),
//!   and TCP flows that are closed (a FIN from both sides, or a RST) and idle for at least
//!   5 s (counted in `expired`). A SYN arriving on a closed flow (a reused port pair) expires
//!   the old flow at once and starts a new one, so the counters and the retransmission
//!   tracking of two connections never mix.
//! * Frames shorter than an Ethernet header, and frames whose ethertype says IP but whose
//!   IP or transport header does not parse, are counted as `malformed_frames` and belong to
//!   no flow. Every frame counts in the per-direction totals.
//!
//! Every tick also refreshes the list of the (up to) 16 flows with the most bytes, which
//! [`FlowMetrics::snapshot`] returns along with the totals.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use etherparse::{NetSlice, SlicedPacket, TransportSlice};
use serde::{Deserialize, Serialize};

use crate::packet::{Direction, Frame, VnetHdr, GSO_ECN, GSO_NONE};
use crate::stage::{NetStage, Verdict};

/// Default bound of the flow table.
pub const DEFAULT_MAX_FLOWS: usize = 4096;
/// Default idle timeout: 120 s.
pub const DEFAULT_IDLE_TIMEOUT_NS: u64 = 120_000_000_000;
/// How long a closed TCP flow stays in the table after its last frame.
pub const CLOSED_LINGER_NS: u64 = 5_000_000_000;
/// How many flows the snapshot lists.
pub const TOP_FLOWS: usize = 16;

/// Length of an Ethernet II header.
const ETH_HDR_LEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
/// Ethertypes of VLAN tags (802.1Q, 802.1ad, legacy QinQ).
const ETHERTYPE_VLANS: [u16; 3] = [0x8100, 0x88a8, 0x9100];
/// Most VLAN tags skipped in front of the ethertype.
const MAX_VLAN_TAGS: usize = 3;

/// Parameters of the flow table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowsConfig {
    /// Most flows tracked at once (at least 1; 0 is taken as 1).
    pub max_flows: usize,
    /// A flow without frames for this long expires (ns).
    pub idle_timeout_ns: u64,
}

impl Default for FlowsConfig {
    /// 4096 flows, 120 s idle timeout.
    fn default() -> Self {
        Self {
            max_flows: DEFAULT_MAX_FLOWS,
            idle_timeout_ns: DEFAULT_IDLE_TIMEOUT_NS,
        }
    }
}

/// The protocol part of a flow key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Proto {
    Tcp,
    Udp,
    /// ICMPv4 or ICMPv6.
    Icmp,
    /// Another IP protocol (or a fragment), by IP protocol number.
    OtherIp(u8),
    /// Not IP, by ethertype.
    NonIp(u16),
}

impl Proto {
    fn has_ports(self) -> bool {
        matches!(self, Proto::Tcp | Proto::Udp)
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Proto::Tcp => f.write_str("tcp"),
            Proto::Udp => f.write_str("udp"),
            Proto::Icmp => f.write_str("icmp"),
            Proto::OtherIp(n) => write!(f, "ip-{n}"),
            Proto::NonIp(e) => write!(f, "ether-0x{e:04x}"),
        }
    }
}

/// What identifies a flow: protocol, guest end, peer end (no ends for non-IP buckets; port 0
/// for protocols without ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct FlowKey {
    proto: Proto,
    guest: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

impl FlowKey {
    /// How an end is shown: `ip:port` for TCP/UDP, `ip` otherwise, `-` without addresses.
    fn end(&self, end: Option<SocketAddr>) -> String {
        match end {
            None => "-".to_owned(),
            Some(a) if self.proto.has_ports() => a.to_string(),
            Some(a) => a.ip().to_string(),
        }
    }
}

/// The TCP fields the stage tracks.
#[derive(Debug, Clone, Copy)]
struct TcpInfo {
    syn: bool,
    ack: bool,
    fin: bool,
    rst: bool,
    seq: u32,
    payload_len: usize,
}

impl TcpInfo {
    /// Sequence number just past the segment (SYN and FIN count one).
    fn seq_end(&self) -> u32 {
        let len = u32::try_from(self.payload_len).unwrap_or(u32::MAX);
        self.seq
            .wrapping_add(len)
            .wrapping_add(u32::from(self.syn))
            .wrapping_add(u32::from(self.fin))
    }
}

/// What one frame tells about its flow.
#[derive(Debug, Clone, Copy)]
struct Observation {
    key: FlowKey,
    /// TCP or UDP payload length (0 for other protocols).
    payload_len: usize,
    tcp: Option<TcpInfo>,
}

/// The ethertype after any VLAN tags; `None` if the frame ends inside the tags.
fn inner_ethertype(data: &[u8]) -> Option<u16> {
    let mut off = 12;
    for _ in 0..=MAX_VLAN_TAGS {
        let b = data.get(off..off + 2)?;
        let et = u16::from_be_bytes([b[0], b[1]]);
        if !ETHERTYPE_VLANS.contains(&et) {
            return Some(et);
        }
        off += 4;
    }
    None
}

/// Classifies a frame; `None` if it is malformed (too short, or IP that does not parse).
fn observe(data: &[u8], dir: Direction) -> Option<Observation> {
    if data.len() < ETH_HDR_LEN {
        return None;
    }
    let non_ip = |et: u16| Observation {
        key: FlowKey {
            proto: Proto::NonIp(et),
            guest: None,
            peer: None,
        },
        payload_len: 0,
        tcp: None,
    };
    let p = match SlicedPacket::from_ethernet(data) {
        Ok(p) => p,
        Err(_) => {
            return match inner_ethertype(data) {
                Some(ETHERTYPE_IPV4 | ETHERTYPE_IPV6) | None => None,
                Some(et) => Some(non_ip(et)),
            }
        }
    };
    let (src, dst, ip_number) = match p.net.as_ref() {
        Some(NetSlice::Ipv4(v4)) => (
            IpAddr::V4(v4.header().source_addr()),
            IpAddr::V4(v4.header().destination_addr()),
            v4.payload().ip_number.0,
        ),
        Some(NetSlice::Ipv6(v6)) => (
            IpAddr::V6(v6.header().source_addr()),
            IpAddr::V6(v6.header().destination_addr()),
            v6.payload().ip_number.0,
        ),
        Some(NetSlice::Arp(_)) | None => {
            return match inner_ethertype(data) {
                Some(ETHERTYPE_IPV4 | ETHERTYPE_IPV6) | None => None,
                Some(et) => Some(non_ip(et)),
            }
        }
    };
    let (proto, sport, dport, payload_len, tcp) = match p.transport.as_ref() {
        Some(TransportSlice::Tcp(t)) => {
            let info = TcpInfo {
                syn: t.syn(),
                ack: t.ack(),
                fin: t.fin(),
                rst: t.rst(),
                seq: t.sequence_number(),
                payload_len: t.payload().len(),
            };
            let (s, d) = (t.source_port(), t.destination_port());
            (Proto::Tcp, s, d, info.payload_len, Some(info))
        }
        Some(TransportSlice::Udp(u)) => (
            Proto::Udp,
            u.source_port(),
            u.destination_port(),
            u.payload().len(),
            None,
        ),
        Some(TransportSlice::Icmpv4(_) | TransportSlice::Icmpv6(_)) => (Proto::Icmp, 0, 0, 0, None),
        Some(TransportSlice::Igmp(_)) | None => (Proto::OtherIp(ip_number), 0, 0, 0, None),
    };
    let (s, d) = (SocketAddr::new(src, sport), SocketAddr::new(dst, dport));
    let (guest, peer) = match dir {
        Direction::FromGuest => (s, d),
        Direction::ToGuest => (d, s),
    };
    Some(Observation {
        key: FlowKey {
            proto,
            guest: Some(guest),
            peer: Some(peer),
        },
        payload_len,
        tcp,
    })
}

/// Wire segments a frame stands for: `ceil(payload / gso_size)` for a GSO frame (at least
/// one), one otherwise. Returns the count and whether the frame was a GSO frame.
fn wire_segments(hdr: &VnetHdr, payload_len: usize) -> (u64, bool) {
    if hdr.gso_type & !GSO_ECN == GSO_NONE || hdr.gso_size == 0 {
        return (1, false);
    }
    let n = payload_len.div_ceil(usize::from(hdr.gso_size)).max(1);
    (u64::try_from(n).unwrap_or(u64::MAX), true)
}

/// `a` is after `b` in sequence space (RFC 1982 style, modulo 2^32).
fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Counters and TCP state of one flow.
#[derive(Debug, Clone, Default)]
struct Flow {
    tx_frames: u64,
    tx_bytes: u64,
    rx_frames: u64,
    rx_bytes: u64,
    segments: u64,
    retransmissions: u64,
    first_ns: u64,
    last_ns: u64,
    syn_tx: bool,
    syn_rx: bool,
    fin_tx: bool,
    fin_rx: bool,
    rst: bool,
    /// Highest end sequence number sent by the guest.
    snd_max: Option<u32>,
}

impl Flow {
    fn closed(&self) -> bool {
        self.rst || (self.fin_tx && self.fin_rx)
    }

    fn bytes(&self) -> u64 {
        self.tx_bytes.saturating_add(self.rx_bytes)
    }

    /// TCP state as shown in snapshots.
    fn state(&self, proto: Proto) -> &'static str {
        if proto != Proto::Tcp {
            "active"
        } else if self.rst {
            "reset"
        } else if self.fin_tx && self.fin_rx {
            "closed"
        } else if self.fin_tx || self.fin_rx {
            "closing"
        } else if self.syn_tx != self.syn_rx {
            "syn"
        } else {
            "open"
        }
    }
}

const NIL: usize = usize::MAX;

/// A slot of the flow table, linked into the recency list.
#[derive(Debug)]
struct Entry {
    key: FlowKey,
    flow: Flow,
    /// Towards the most recently seen flow.
    prev: usize,
    /// Towards the least recently seen flow.
    next: usize,
}

/// Flows by key, in a slab linked in recency order (most recently seen at `head`).
#[derive(Debug)]
struct Table {
    index: HashMap<FlowKey, usize>,
    slots: Vec<Entry>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
}

impl Table {
    fn new() -> Self {
        Self {
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn unlink(&mut self, i: usize) {
        let (prev, next) = (self.slots[i].prev, self.slots[i].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next].prev = prev;
        }
        self.slots[i].prev = NIL;
        self.slots[i].next = NIL;
    }

    fn push_front(&mut self, i: usize) {
        self.slots[i].prev = NIL;
        self.slots[i].next = self.head;
        if self.head != NIL {
            self.slots[self.head].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Makes slot `i` the most recently seen.
    fn touch(&mut self, i: usize) {
        if self.head != i {
            self.unlink(i);
            self.push_front(i);
        }
    }

    fn insert(&mut self, key: FlowKey, flow: Flow) -> usize {
        let entry = Entry {
            key,
            flow,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = entry;
                i
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        };
        self.index.insert(key, i);
        self.push_front(i);
        i
    }

    fn remove(&mut self, i: usize) {
        self.unlink(i);
        let key = self.slots[i].key;
        self.index.remove(&key);
        self.slots[i].flow = Flow::default();
        self.free.push(i);
    }

    /// Slots from the least to the most recently seen.
    fn oldest_first(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(self.tail).filter(|&i| i != NIL), |&i| {
            Some(self.slots[i].prev).filter(|&p| p != NIL)
        })
    }
}

/// One flow in a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowSnapshot {
    /// `tcp`, `udp`, `icmp`, `ip-N` (other IP protocol number N), `ether-0xXXXX` (not IP).
    pub proto: String,
    /// Guest end: `ip:port` (TCP, UDP), `ip` (other IP), `-` (not IP).
    pub guest: String,
    /// Peer end, shown like `guest`.
    pub peer: String,
    /// Frames from the guest.
    pub tx_frames: u64,
    /// Bytes (Ethernet frames) from the guest.
    pub tx_bytes: u64,
    /// Frames to the guest.
    pub rx_frames: u64,
    /// Bytes (Ethernet frames) to the guest.
    pub rx_bytes: u64,
    /// Wire segments, both directions (GSO frames count their segments).
    pub segments: u64,
    /// TCP retransmissions from the guest.
    pub retransmissions: u64,
    /// Time since the flow's first frame, ms (at the refresh).
    pub age_ms: u64,
    /// Time since the flow's last frame, ms (at the refresh).
    pub idle_ms: u64,
    /// TCP: `syn` (SYN from one side only), `open`, `closing` (one FIN), `closed` (both
    /// FINs), `reset`; other protocols: `active`.
    pub state: String,
}

/// Serialisable copy of [`FlowMetrics`] (see there for each field).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowsSnapshot {
    /// Bound of the flow table.
    pub max_flows: u64,
    /// Idle timeout, ms.
    pub idle_timeout_ms: u64,
    /// Frames from the guest.
    pub tx_frames: u64,
    /// Bytes from the guest.
    pub tx_bytes: u64,
    /// Frames to the guest.
    pub rx_frames: u64,
    /// Bytes to the guest.
    pub rx_bytes: u64,
    /// Wire segments from the guest.
    pub tx_segments: u64,
    /// Wire segments to the guest.
    pub rx_segments: u64,
    /// GSO super-frames, both directions.
    pub gso_frames: u64,
    /// TCP retransmissions from the guest.
    pub retransmissions: u64,
    /// Flows ever created.
    pub flows_total: u64,
    /// Flows in the table now.
    pub flows_active: u64,
    /// Flows evicted because the table was full.
    pub evicted: u64,
    /// Flows expired (idle, or closed and lingered).
    pub expired: u64,
    /// Frames that are not IP.
    pub non_ip_frames: u64,
    /// Frames too short for Ethernet, or IP that does not parse.
    pub malformed_frames: u64,
    /// Up to 16 flows with the most bytes, most first (as of the latest tick).
    pub top: Vec<FlowSnapshot>,
}

/// Live counters of a [`Flows`] stage, shared with the launcher.
#[derive(Debug, Default)]
pub struct FlowMetrics {
    max_flows: u64,
    idle_timeout_ms: u64,
    /// Frames from the guest.
    pub tx_frames: AtomicU64,
    /// Bytes (Ethernet frames) from the guest.
    pub tx_bytes: AtomicU64,
    /// Frames to the guest.
    pub rx_frames: AtomicU64,
    /// Bytes (Ethernet frames) to the guest.
    pub rx_bytes: AtomicU64,
    /// Wire segments from the guest (GSO frames count their segments; malformed frames none).
    pub tx_segments: AtomicU64,
    /// Wire segments to the guest.
    pub rx_segments: AtomicU64,
    /// GSO super-frames, both directions.
    pub gso_frames: AtomicU64,
    /// TCP retransmissions from the guest, all flows.
    pub retransmissions: AtomicU64,
    /// Flows ever created.
    pub flows_total: AtomicU64,
    /// Gauge: flows in the table now.
    pub flows_active: AtomicU64,
    /// Flows evicted because the table was full.
    pub evicted: AtomicU64,
    /// Flows expired by [`NetStage::tick`] (idle, or closed and lingered) or replaced by a new
    /// connection on the same ports.
    pub expired: AtomicU64,
    /// Frames that are not IP (they count in their ethertype's bucket).
    pub non_ip_frames: AtomicU64,
    /// Frames shorter than an Ethernet header, or IP frames that do not parse.
    pub malformed_frames: AtomicU64,
    /// The busiest flows as of the latest tick.
    top: Mutex<Vec<FlowSnapshot>>,
}

impl FlowMetrics {
    fn new(cfg: &FlowsConfig) -> Self {
        Self {
            max_flows: cfg.max_flows as u64,
            idle_timeout_ms: cfg.idle_timeout_ns / 1_000_000,
            ..Self::default()
        }
    }

    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// A copy of every counter and of the busiest flows as of the latest tick.
    pub fn snapshot(&self) -> FlowsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FlowsSnapshot {
            max_flows: self.max_flows,
            idle_timeout_ms: self.idle_timeout_ms,
            tx_frames: g(&self.tx_frames),
            tx_bytes: g(&self.tx_bytes),
            rx_frames: g(&self.rx_frames),
            rx_bytes: g(&self.rx_bytes),
            tx_segments: g(&self.tx_segments),
            rx_segments: g(&self.rx_segments),
            gso_frames: g(&self.gso_frames),
            retransmissions: g(&self.retransmissions),
            flows_total: g(&self.flows_total),
            flows_active: g(&self.flows_active),
            evicted: g(&self.evicted),
            expired: g(&self.expired),
            non_ip_frames: g(&self.non_ip_frames),
            malformed_frames: g(&self.malformed_frames),
            top: self
                .top
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// The per-flow metrics stage (see the module documentation).
#[derive(Debug)]
pub struct Flows {
    cfg: FlowsConfig,
    table: Table,
    metrics: Arc<FlowMetrics>,
    /// Latest clock value seen (for the final refresh in `finish`).
    last_now: u64,
    /// Scratch space for the top-flows selection: (bytes, slot).
    scratch: Vec<(u64, usize)>,
}

impl Flows {
    /// A stage with `cfg` (a `max_flows` of 0 is taken as 1) and its shared metrics.
    pub fn new(cfg: FlowsConfig) -> (Flows, Arc<FlowMetrics>) {
        let cfg = FlowsConfig {
            max_flows: cfg.max_flows.max(1),
            ..cfg
        };
        let metrics = Arc::new(FlowMetrics::new(&cfg));
        let stage = Flows {
            cfg,
            table: Table::new(),
            metrics: Arc::clone(&metrics),
            last_now: 0,
            scratch: Vec::new(),
        };
        (stage, metrics)
    }

    fn set_active(&self) {
        self.metrics
            .flows_active
            .store(self.table.len() as u64, Ordering::Relaxed);
    }

    /// The slot of `key`'s flow, created (evicting the least recently seen flow if the table
    /// is full) if needed, and made the most recently seen.
    fn slot(&mut self, key: FlowKey, now_ns: u64) -> usize {
        if let Some(&i) = self.table.index.get(&key) {
            self.table.touch(i);
            return i;
        }
        if self.table.len() >= self.cfg.max_flows {
            let lru = self.table.tail;
            if lru != NIL {
                self.table.remove(lru);
                FlowMetrics::add(&self.metrics.evicted, 1);
            }
        }
        let flow = Flow {
            first_ns: now_ns,
            last_ns: now_ns,
            ..Flow::default()
        };
        let i = self.table.insert(key, flow);
        FlowMetrics::add(&self.metrics.flows_total, 1);
        self.set_active();
        i
    }

    /// Removes the flows idle for too long, and closed flows past their linger.
    fn expire(&mut self, now_ns: u64) {
        let timeout = self.cfg.idle_timeout_ns;
        // The list is in recency order: once a flow is more recent than both limits, so are
        // all the following ones.
        let earliest_limit = timeout.min(CLOSED_LINGER_NS);
        let mut i = self.table.tail;
        let mut expired = 0;
        while i != NIL {
            let e = &self.table.slots[i];
            let (prev, idle) = (e.prev, now_ns.saturating_sub(e.flow.last_ns));
            if idle < earliest_limit {
                break;
            }
            if idle > timeout || (e.flow.closed() && idle >= CLOSED_LINGER_NS) {
                self.table.remove(i);
                expired += 1;
            }
            i = prev;
        }
        if expired > 0 {
            FlowMetrics::add(&self.metrics.expired, expired);
            self.set_active();
        }
    }

    /// Publishes the flows with the most bytes.
    fn refresh_top(&mut self, now_ns: u64) {
        self.scratch.clear();
        self.scratch.extend(
            self.table
                .oldest_first()
                .map(|i| (self.table.slots[i].flow.bytes(), i)),
        );
        let by_bytes = |a: &(u64, usize), b: &(u64, usize)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
        if self.scratch.len() > TOP_FLOWS {
            self.scratch.select_nth_unstable_by(TOP_FLOWS - 1, by_bytes);
            self.scratch.truncate(TOP_FLOWS);
        }
        self.scratch.sort_unstable_by(by_bytes);
        let ms = |ns: u64| ns / 1_000_000;
        let top: Vec<FlowSnapshot> = self
            .scratch
            .iter()
            .map(|&(_, i)| {
                let Entry { key, flow, .. } = &self.table.slots[i];
                FlowSnapshot {
                    proto: key.proto.to_string(),
                    guest: key.end(key.guest),
                    peer: key.end(key.peer),
                    tx_frames: flow.tx_frames,
                    tx_bytes: flow.tx_bytes,
                    rx_frames: flow.rx_frames,
                    rx_bytes: flow.rx_bytes,
                    segments: flow.segments,
                    retransmissions: flow.retransmissions,
                    age_ms: ms(now_ns.saturating_sub(flow.first_ns)),
                    idle_ms: ms(now_ns.saturating_sub(flow.last_ns)),
                    state: flow.state(key.proto).to_owned(),
                }
            })
            .collect();
        *self
            .metrics
            .top
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = top;
    }
}

impl NetStage for Flows {
    fn on_frame(&mut self, dir: Direction, frame: &mut Frame, now_ns: u64) -> Verdict {
        self.last_now = self.last_now.max(now_ns);
        let m = &self.metrics;
        let len = frame.data.len() as u64;
        let (frames, bytes, segs) = match dir {
            Direction::FromGuest => (&m.tx_frames, &m.tx_bytes, &m.tx_segments),
            Direction::ToGuest => (&m.rx_frames, &m.rx_bytes, &m.rx_segments),
        };
        FlowMetrics::add(frames, 1);
        FlowMetrics::add(bytes, len);
        let Some(obs) = observe(&frame.data, dir) else {
            FlowMetrics::add(&m.malformed_frames, 1);
            return Verdict::Pass;
        };
        if matches!(obs.key.proto, Proto::NonIp(_)) {
            FlowMetrics::add(&m.non_ip_frames, 1);
        }
        let (segments, gso) = wire_segments(&frame.hdr, obs.payload_len);
        FlowMetrics::add(segs, segments);
        if gso {
            FlowMetrics::add(&m.gso_frames, 1);
        }

        let mut i = self.slot(obs.key, now_ns);
        if let Some(t) = obs.tcp {
            let f = &self.table.slots[i].flow;
            if t.syn && !t.ack && f.closed() {
                // A new connection on the ports of a closed one.
                self.table.remove(i);
                FlowMetrics::add(&self.metrics.expired, 1);
                i = self.slot(obs.key, now_ns);
            }
        }
        let f = &mut self.table.slots[i].flow;
        f.last_ns = now_ns;
        f.segments = f.segments.saturating_add(segments);
        match dir {
            Direction::FromGuest => {
                f.tx_frames += 1;
                f.tx_bytes += len;
            }
            Direction::ToGuest => {
                f.rx_frames += 1;
                f.rx_bytes += len;
            }
        }
        if let Some(t) = obs.tcp {
            f.rst |= t.rst;
            match dir {
                Direction::FromGuest => {
                    f.syn_tx |= t.syn;
                    f.fin_tx |= t.fin;
                    let end = t.seq_end();
                    match f.snd_max {
                        Some(max) if !seq_after(end, max) => {
                            if t.payload_len > 0 {
                                f.retransmissions += 1;
                                FlowMetrics::add(&self.metrics.retransmissions, 1);
                            }
                        }
                        _ => f.snd_max = Some(end),
                    }
                }
                Direction::ToGuest => {
                    f.syn_rx |= t.syn;
                    f.fin_rx |= t.fin;
                }
            }
        }
        Verdict::Pass
    }

    fn tick(&mut self, now_ns: u64) {
        self.last_now = self.last_now.max(now_ns);
        self.expire(now_ns);
        self.refresh_top(now_ns);
    }

    fn finish(&mut self) {
        self.refresh_top(self.last_now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::packet::{GSO_TCPV4, GSO_UDP};
    use etherparse::{PacketBuilder, TcpHeader};
    use proptest::prelude::*;

    const G: [u8; 4] = [10, 0, 2, 15];
    const P: [u8; 4] = [93, 184, 216, 34];
    const S: u64 = 1_000_000_000;

    fn frame(data: Vec<u8>) -> Frame {
        Frame {
            hdr: VnetHdr::default(),
            data,
        }
    }

    /// A TCP frame with explicit flags.
    #[allow(clippy::too_many_arguments)]
    fn tcp_flags(
        src: [u8; 4],
        sport: u16,
        dst: [u8; 4],
        dport: u16,
        seq: u32,
        syn: bool,
        fin: bool,
        rst: bool,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut h = TcpHeader::new(sport, dport, seq, 1000);
        h.syn = syn;
        h.fin = fin;
        h.rst = rst;
        h.ack = !syn;
        let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4(src, dst, 64)
            .tcp_header(h);
        let mut out = Vec::new();
        b.write(&mut out, payload).expect("builds");
        out
    }

    fn udp4(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, payload: &[u8]) -> Vec<u8> {
        let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4(src, dst, 64)
            .udp(sport, dport);
        let mut out = Vec::new();
        b.write(&mut out, payload).expect("builds");
        out
    }

    fn tx(st: &mut Flows, data: Vec<u8>, now: u64) {
        let mut f = frame(data);
        assert_eq!(
            st.on_frame(Direction::FromGuest, &mut f, now),
            Verdict::Pass
        );
    }

    fn rx(st: &mut Flows, data: Vec<u8>, now: u64) {
        let mut f = frame(data);
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, now), Verdict::Pass);
    }

    /// A guest data segment to the peer.
    fn data(seq: u32, len: usize) -> Vec<u8> {
        tcp4(G, 40000, P, 80, seq, Some(1), 1000, false, &vec![7u8; len])
    }

    fn top(m: &FlowMetrics) -> Vec<FlowSnapshot> {
        m.snapshot().top
    }

    #[test]
    fn both_directions_count_into_one_flow_keyed_by_the_guest_side() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let out = tcp4(G, 40000, P, 80, 1, Some(1), 1000, false, b"GET /");
        let back = tcp4(P, 80, G, 40000, 1, Some(6), 1000, false, b"HTTP/1.1 200 OK");
        let (lo, lb) = (out.len() as u64, back.len() as u64);
        tx(&mut st, out.clone(), S);
        tx(&mut st, out, 2 * S);
        rx(&mut st, back, 3 * S);
        st.tick(4 * S);
        let s = m.snapshot();
        assert_eq!((s.tx_frames, s.tx_bytes), (2, 2 * lo));
        assert_eq!((s.rx_frames, s.rx_bytes), (1, lb));
        assert_eq!((s.flows_total, s.flows_active), (1, 1));
        assert_eq!(s.top.len(), 1);
        let f = &s.top[0];
        assert_eq!(f.proto, "tcp");
        assert_eq!(f.guest, "10.0.2.15:40000");
        assert_eq!(f.peer, "93.184.216.34:80");
        assert_eq!((f.tx_frames, f.tx_bytes), (2, 2 * lo));
        assert_eq!((f.rx_frames, f.rx_bytes), (1, lb));
        assert_eq!(f.segments, 3);
        assert_eq!(f.age_ms, 3000);
        assert_eq!(f.idle_ms, 1000);
        assert_eq!(f.state, "open");
        // Resent identical segment: one retransmission.
        assert_eq!(f.retransmissions, 1);
    }

    #[test]
    fn a_flow_started_by_the_peer_is_keyed_by_the_guest_side_too() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        rx(&mut st, udp4(P, 53, G, 5353, b"q"), 0);
        tx(&mut st, udp4(G, 5353, P, 53, b"answer"), 1);
        rx(&mut st, udp4(P, 53, G, 5354, b"q"), 2);
        st.tick(3);
        let t = top(&m);
        assert_eq!(t.len(), 2);
        let f = t
            .iter()
            .find(|f| f.guest == "10.0.2.15:5353")
            .expect("flow");
        assert_eq!(
            (f.proto.as_str(), f.peer.as_str()),
            ("udp", "93.184.216.34:53")
        );
        assert_eq!((f.tx_frames, f.rx_frames), (1, 1));
        assert_eq!(f.state, "active");
        // Most bytes first.
        assert_eq!(t[0].guest, "10.0.2.15:5353");
        assert_eq!(t[1].guest, "10.0.2.15:5354");
    }

    #[test]
    fn icmp_ipv6_and_non_ip_frames_get_their_buckets() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let mut ping = Vec::new();
        PacketBuilder::ethernet2([2; 6], [4; 6])
            .ipv4(G, P, 64)
            .icmpv4_echo_request(1, 1)
            .write(&mut ping, b"ping")
            .expect("builds");
        tx(&mut st, ping, 0);
        let mut v6 = Vec::new();
        let (g6, p6) = (
            [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
            [0xfd; 16],
        );
        PacketBuilder::ethernet2([2; 6], [4; 6])
            .ipv6(p6, g6, 64)
            .udp(443, 50000)
            .write(&mut v6, b"quic")
            .expect("builds");
        rx(&mut st, v6, 0);
        // An ARP request (ethertype 0x0806), twice, and an LLDP frame (0x88cc).
        let mut arp = vec![0xff; 6];
        arp.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x06]);
        arp.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&[
            2, 0, 0, 0, 0, 1, 10, 0, 2, 15, 0, 0, 0, 0, 0, 0, 10, 0, 2, 2,
        ]);
        tx(&mut st, arp.clone(), 0);
        rx(&mut st, arp, 0);
        let mut lldp = vec![0x01, 0x80, 0xc2, 0, 0, 0x0e, 2, 0, 0, 0, 0, 1, 0x88, 0xcc];
        lldp.extend_from_slice(&[0; 46]);
        rx(&mut st, lldp, 0);
        st.tick(0);
        let s = m.snapshot();
        assert_eq!(s.non_ip_frames, 3);
        assert_eq!(s.malformed_frames, 0);
        assert_eq!(s.flows_active, 4);
        let find = |p: &str| s.top.iter().find(|f| f.proto == p).expect(p).clone();
        let icmp = find("icmp");
        assert_eq!(
            (icmp.guest.as_str(), icmp.peer.as_str()),
            ("10.0.2.15", "93.184.216.34")
        );
        let udp = find("udp");
        assert_eq!(udp.guest, "[fd00::2]:50000");
        assert_eq!(udp.rx_frames, 1);
        let arp = find("ether-0x0806");
        assert_eq!(
            (arp.guest.as_str(), arp.tx_frames, arp.rx_frames),
            ("-", 1, 1)
        );
        assert_eq!(find("ether-0x88cc").rx_frames, 1);
    }

    #[test]
    fn gso_frames_count_their_wire_segments() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let mut f = frame(data(1, 4000));
        f.hdr.gso_type = GSO_TCPV4;
        f.hdr.gso_size = 1448;
        st.on_frame(Direction::FromGuest, &mut f, 0);
        // Exactly two segments' worth.
        let mut g = frame(data(4001, 2896));
        g.hdr.gso_type = GSO_TCPV4 | GSO_ECN;
        g.hdr.gso_size = 1448;
        st.on_frame(Direction::FromGuest, &mut g, 0);
        // A UDP GSO frame to the guest: 3 segments.
        let mut u = frame(udp4(P, 443, G, 50000, &[1; 2500]));
        u.hdr.gso_type = GSO_UDP;
        u.hdr.gso_size = 1200;
        st.on_frame(Direction::ToGuest, &mut u, 0);
        tx(&mut st, data(6897, 10), 0);
        st.tick(0);
        let s = m.snapshot();
        assert_eq!(s.gso_frames, 3);
        assert_eq!((s.tx_segments, s.rx_segments), (3 + 2 + 1, 3));
        assert_eq!(s.tx_frames, 3);
        let t = s.top.iter().find(|f| f.proto == "tcp").expect("tcp");
        assert_eq!(t.segments, 6);
        assert_eq!(t.retransmissions, 0);
        assert_eq!(wire_segments(&VnetHdr::default(), 100_000), (1, false));
    }

    #[test]
    fn retransmissions_from_the_guest_are_counted() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let syn = tcp_flags(G, 40000, P, 80, 99, true, false, false, b"");
        tx(&mut st, syn.clone(), 0);
        tx(&mut st, syn, 1); // SYN retransmission: no data, not counted.
        tx(&mut st, data(100, 100), 2); // 100..200
        tx(&mut st, data(200, 100), 3); // 200..300
        tx(&mut st, data(100, 100), 4); // retransmission
        tx(&mut st, data(150, 150), 5); // partial retransmission, ends at 300
        tx(&mut st, data(250, 100), 6); // overlaps, ends at 350: new data
        tx(
            &mut st,
            tcp4(G, 40000, P, 80, 350, Some(1), 1000, false, b""),
            7,
        ); // pure ACK
           // Segments from the peer never count.
        rx(
            &mut st,
            tcp4(P, 80, G, 40000, 1, Some(350), 1000, false, b"x"),
            8,
        );
        rx(
            &mut st,
            tcp4(P, 80, G, 40000, 1, Some(350), 1000, false, b"x"),
            9,
        );
        st.tick(10);
        assert_eq!(m.snapshot().retransmissions, 2);
        assert_eq!(top(&m)[0].retransmissions, 2);
    }

    #[test]
    fn retransmission_detection_survives_the_sequence_wrap() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let start = u32::MAX - 149; // 2^32 - 150
        tx(&mut st, data(start, 100), 0); // ends at 2^32 - 50
        tx(&mut st, data(start.wrapping_add(100), 100), 1); // wraps: ends at 50
        assert_eq!(m.snapshot().retransmissions, 0);
        tx(&mut st, data(start, 100), 2); // old, before the wrap
        assert_eq!(m.snapshot().retransmissions, 1);
        tx(&mut st, data(start.wrapping_add(100), 100), 3); // the wrapping one again
        assert_eq!(m.snapshot().retransmissions, 2);
        tx(&mut st, data(50, 10), 4); // new data after the wrap
        tx(&mut st, data(0, 10), 5); // old data after the wrap
        assert_eq!(m.snapshot().retransmissions, 3);
        assert!(seq_after(5, u32::MAX - 5));
        assert!(!seq_after(u32::MAX - 5, 5));
        assert!(!seq_after(7, 7));
    }

    #[test]
    fn the_least_recently_seen_flow_is_evicted_when_full() {
        let (mut st, m) = Flows::new(FlowsConfig {
            max_flows: 3,
            ..FlowsConfig::default()
        });
        for (i, port) in [1000u16, 1001, 1002].into_iter().enumerate() {
            tx(&mut st, udp4(G, port, P, 53, b"q"), i as u64);
        }
        // 1000 becomes the most recent; 1001 is now the least recent.
        rx(&mut st, udp4(P, 53, G, 1000, b"a"), 10);
        tx(&mut st, udp4(G, 1003, P, 53, b"q"), 11);
        st.tick(12);
        let s = m.snapshot();
        assert_eq!((s.evicted, s.flows_active, s.flows_total), (1, 3, 4));
        let mut guests: Vec<_> = s.top.iter().map(|f| f.guest.clone()).collect();
        guests.sort();
        assert_eq!(
            guests,
            ["10.0.2.15:1000", "10.0.2.15:1002", "10.0.2.15:1003"]
        );
        // A bound of 0 works as 1.
        let (mut one, m1) = Flows::new(FlowsConfig {
            max_flows: 0,
            ..FlowsConfig::default()
        });
        tx(&mut one, udp4(G, 1, P, 53, b"q"), 0);
        tx(&mut one, udp4(G, 2, P, 53, b"q"), 0);
        assert_eq!(m1.snapshot().evicted, 1);
        assert_eq!(m1.snapshot().flows_active, 1);
    }

    #[test]
    fn idle_flows_expire_in_tick() {
        let (mut st, m) = Flows::new(FlowsConfig {
            max_flows: 16,
            idle_timeout_ns: 10 * S,
        });
        tx(&mut st, udp4(G, 1, P, 53, b"q"), 0);
        tx(&mut st, udp4(G, 2, P, 53, b"q"), 5 * S);
        tx(&mut st, data(1, 10), 6 * S); // open TCP: only the idle timeout applies
        st.tick(10 * S);
        assert_eq!(m.snapshot().expired, 0);
        st.tick(10 * S + 1);
        let s = m.snapshot();
        assert_eq!((s.expired, s.flows_active), (1, 2));
        assert!(s.top.iter().all(|f| f.guest != "10.0.2.15:1"));
        st.tick(17 * S);
        let s = m.snapshot();
        assert_eq!((s.expired, s.flows_active), (3, 0));
        assert!(s.top.is_empty());
        // A frame after expiry starts a new flow.
        tx(&mut st, udp4(G, 1, P, 53, b"q"), 18 * S);
        assert_eq!(m.snapshot().flows_total, 4);
    }

    #[test]
    fn closed_flows_expire_after_the_linger() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let fin_g = tcp_flags(G, 40000, P, 80, 1, false, true, false, b"");
        let fin_p = tcp_flags(P, 80, G, 40000, 1, false, true, false, b"");
        tx(&mut st, fin_g, 0);
        st.tick(0);
        assert_eq!(top(&m)[0].state, "closing");
        rx(&mut st, fin_p, S);
        // A reset flow on other ports.
        rx(
            &mut st,
            tcp_flags(P, 80, G, 40001, 1, false, false, true, b""),
            S,
        );
        // A half-closed flow only expires when idle.
        tx(
            &mut st,
            tcp_flags(G, 40002, P, 80, 1, false, true, false, b""),
            S,
        );
        st.tick(2 * S);
        let states: Vec<_> = top(&m).iter().map(|f| f.state.clone()).collect();
        assert!(states.contains(&"closed".to_owned()), "{states:?}");
        assert!(states.contains(&"reset".to_owned()), "{states:?}");
        st.tick(S + CLOSED_LINGER_NS - 1);
        assert_eq!(m.snapshot().expired, 0);
        st.tick(S + CLOSED_LINGER_NS);
        let s = m.snapshot();
        assert_eq!((s.expired, s.flows_active), (2, 1));
        assert_eq!(s.top[0].state, "closing");
    }

    #[test]
    fn a_syn_on_a_closed_flow_starts_a_new_flow() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        tx(&mut st, data(1000, 100), 0);
        rx(
            &mut st,
            tcp_flags(P, 80, G, 40000, 1, false, false, true, b""),
            1,
        );
        // Port reused with a lower initial sequence number: no retransmissions.
        tx(
            &mut st,
            tcp_flags(G, 40000, P, 80, 9, true, false, false, b""),
            2,
        );
        tx(&mut st, data(10, 100), 3);
        st.tick(4);
        let s = m.snapshot();
        assert_eq!((s.flows_total, s.expired, s.flows_active), (2, 1, 1));
        assert_eq!(s.retransmissions, 0);
        assert_eq!(s.top[0].state, "syn");
        assert_eq!(s.top[0].tx_frames, 2);
    }

    #[test]
    fn malformed_frames_are_counted_and_passed() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        tx(&mut st, vec![], 0);
        tx(&mut st, vec![1; 13], 0);
        // IPv4 ethertype with a bad IP header.
        let mut bad = vec![2; 12];
        bad.extend_from_slice(&[0x08, 0x00, 0x45, 0]);
        rx(&mut st, bad, 0);
        // A VLAN tag cut short.
        let mut vlan = vec![2; 12];
        vlan.extend_from_slice(&[0x81, 0x00, 0]);
        rx(&mut st, vlan, 0);
        // A truncated TCP segment.
        let mut t = data(1, 10);
        t.truncate(40);
        tx(&mut st, t, 0);
        st.tick(0);
        let s = m.snapshot();
        assert_eq!(s.malformed_frames, 5);
        assert_eq!((s.tx_frames, s.rx_frames), (3, 2));
        assert_eq!(s.tx_bytes, 13 + 40);
        assert_eq!((s.flows_total, s.non_ip_frames), (0, 0));
    }

    #[test]
    fn vlan_tagged_ip_is_parsed() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        let mut f = Vec::new();
        PacketBuilder::ethernet2([2; 6], [4; 6])
            .single_vlan(5.try_into().expect("vlan id"))
            .ipv4(G, P, 64)
            .udp(1, 2)
            .write(&mut f, b"x")
            .expect("builds");
        tx(&mut st, f, 0);
        st.tick(0);
        assert_eq!(top(&m)[0].guest, "10.0.2.15:1");
    }

    #[test]
    fn top_lists_at_most_16_flows_by_bytes() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        for port in 0..40u16 {
            let f = udp4(G, port, P, 53, &vec![0; usize::from(port)]);
            tx(&mut st, f, 0);
        }
        st.tick(0);
        let s = m.snapshot();
        assert_eq!(s.top.len(), TOP_FLOWS);
        assert_eq!(s.top[0].guest, "10.0.2.15:39");
        assert_eq!(s.top[15].guest, "10.0.2.15:24");
        let json = serde_json::to_string(&s).expect("serialize");
        let back: FlowsSnapshot = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, s);
    }

    #[test]
    fn finish_refreshes_the_top_flows() {
        let (mut st, m) = Flows::new(FlowsConfig::default());
        tx(&mut st, udp4(G, 1, P, 53, b"q"), 7 * S);
        assert!(top(&m).is_empty());
        st.finish();
        assert_eq!(top(&m).len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200),
                                    to_guest in any::<bool>()) {
            let (mut st, m) = Flows::new(FlowsConfig { max_flows: 4, idle_timeout_ns: 1 });
            let dir = if to_guest { Direction::ToGuest } else { Direction::FromGuest };
            let mut f = frame(bytes);
            prop_assert_eq!(st.on_frame(dir, &mut f, 5), Verdict::Pass);
            st.tick(10);
            let s = m.snapshot();
            prop_assert_eq!(s.tx_frames + s.rx_frames, 1);
        }

        #[test]
        fn truncated_valid_frames_never_panic(cut in 0usize..120, kind in 0u8..3,
                                              gso in any::<u16>(), flip in any::<(usize, u8)>()) {
            let full = match kind {
                0 => tcp4(G, 1, P, 2, 7, Some(1), 100, true, &[3; 60]),
                1 => udp4(P, 53, G, 9, &[4; 60]),
                _ => {
                    let mut v = Vec::new();
                    PacketBuilder::ethernet2([2; 6], [4; 6])
                        .ipv6([1; 16], [2; 16], 9)
                        .tcp(5, 6, 1, 1)
                        .write(&mut v, &[5; 40])
                        .expect("builds");
                    v
                }
            };
            let (mut st, m) = Flows::new(FlowsConfig { max_flows: 2, idle_timeout_ns: 1 });
            let mut data = full[..cut.min(full.len())].to_vec();
            let mut f = frame(data.clone());
            f.hdr.gso_type = GSO_TCPV4;
            f.hdr.gso_size = gso;
            prop_assert_eq!(st.on_frame(Direction::FromGuest, &mut f, 1), Verdict::Pass);
            if !data.is_empty() {
                let at = flip.0 % data.len();
                data[at] ^= flip.1;
            }
            prop_assert_eq!(st.on_frame(Direction::ToGuest, &mut frame(data), 2), Verdict::Pass);
            st.tick(u64::MAX);
            let s = m.snapshot();
            prop_assert_eq!(s.tx_frames + s.rx_frames, 2);
            prop_assert!(s.flows_active <= 2);
        }
    }
}
