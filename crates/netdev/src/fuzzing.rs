//! Fuzz entry point of the NIC's hostile input (see docs/fuzzing.md):
//!
//! - [`virtio_net_frames`]: Ethernet frames from the guest and from peers, through the packet
//!   pipeline the launcher builds (the flow table [`Flows`] first, then [`FoxyVegas`]),
//!   interleaved with the stages' ticks. Frames are TCP segments built from decoded fields
//!   (handshakes, data, ACKs, options, bad checksums, checksum offload, GSO), edited by a byte
//!   flip and a cut, or raw bytes.

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TcpOptionElement, TransportSlice};

use crate::packet::{tcp_segment, Direction, Frame, TcpSegment, VnetHdr};
use crate::stage::{NetPipeline, Verdict};
use crate::stages::flows::{FlowMetrics, Flows, FlowsConfig, TOP_FLOWS};
use crate::stages::foxyvegas::{
    FoxyVegas, FoxyVegasConfig, FoxyVegasMetrics, MAX_HALF_OPEN, SNAPSHOT_FLOWS,
};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Outcome bits of [`virtio_net_frames`]: a frame that is not a TCP segment passed unchanged.
pub const NET_NOT_TCP: u32 = 1;
/// A TCP segment passed unchanged.
pub const NET_TCP_UNCHANGED: u32 = 2;
/// A TCP segment's window was lowered (its checksum updated or left to the offload).
pub const NET_REWRITTEN: u32 = 4;
/// A full table evicted a flow (flow table or FoxyVegas).
pub const NET_EVICTED: u32 = 8;
/// A tick expired a flow (flow table or FoxyVegas).
pub const NET_EXPIRED: u32 = 16;

/// Most operations of one input.
const MAX_NET_OPS: usize = 64;
/// Longest raw frame.
const MAX_RAW: usize = 1600;
/// Longest payload of a built segment.
const MAX_PAYLOAD: u16 = 1500;
/// The guest's and the peer's addresses.
const GUEST4: [u8; 4] = [10, 0, 2, 15];
const PEER4: [u8; 4] = [10, 0, 2, 1];
const GUEST6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x15];
const PEER6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01];

/// A TCP segment to build. `flags`: bit 0 to the guest, 1 IPv6, 2 SYN, 3 ACK, 4 FIN, 5 RST,
/// 6 MSS and window scale options, 7 a wrong checksum.
#[derive(Debug, Clone, Copy, Default)]
pub struct Segment {
    pub flags: u8,
    /// The guest's port is `40000 + port % 8`.
    pub port: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    pub mss: u16,
    pub wscale: u8,
    /// Payload bytes (at most 1500).
    pub payload: u16,
}

/// Segment flag bits.
pub const TO_GUEST: u8 = 1;
pub const V6: u8 = 2;
pub const SYN: u8 = 4;
pub const ACK: u8 = 8;
pub const FIN: u8 = 16;
pub const RST: u8 = 32;
pub const OPTIONS: u8 = 64;
pub const BAD_CSUM: u8 = 128;

/// After building: the virtio-net header's first bytes, a byte flip and a cut.
#[derive(Debug, Clone, Copy, Default)]
pub struct Edit {
    /// `VnetHdr::flags` (bit 0: the checksum is left to the receiver).
    pub hdr_flags: u8,
    pub gso_type: u8,
    pub gso_size: u16,
    /// XOR `xor` into the byte at `at % len` (nothing when `xor` is 0).
    pub at: u16,
    pub xor: u8,
    /// Cut to `cut - 1` bytes (0: no cut).
    pub cut: u16,
}

/// One step of the NIC.
#[derive(Debug, Clone)]
pub enum NetOp {
    /// A built TCP segment, `dt_us` after the previous frame.
    Tcp {
        seg: Segment,
        edit: Edit,
        dt_us: u16,
    },
    /// Raw bytes as an Ethernet frame (`dir` bit 0: to the guest).
    Raw { dir: u8, edit: Edit, bytes: Vec<u8> },
    /// The clock advances by `ms` and every stage ticks.
    Tick { ms: u16 },
}

/// Runs one NIC input; panics if a promise is broken. Returns the outcome bits reached.
///
/// Input: a configuration byte (table size `1 + b % 8` for both stages, idle timeout
/// `100 ms * (1 + b / 8)`), then operations until the input ends. Promises checked: every frame
/// passes (neither stage drops), keeps its virtio-net header and length, and is either
/// unchanged or a TCP segment whose window field was lowered and whose checksum field was
/// updated so that a checksum valid before is valid after (left alone when the header says
/// the receiver computes it); no other byte changes; both tables and the half-open table stay
/// within their bound, the published lists within theirs, and every frame is counted once.
pub fn virtio_net_frames(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let cfg = inp.u8();
    let max_flows = 1 + usize::from(cfg % 8);
    let idle_ns = 100_000_000 * (1 + u64::from(cfg / 8));
    let mut nic = Nic::new(max_flows, idle_ns);
    let mut seen = 0;
    for _ in 0..MAX_NET_OPS {
        if inp.is_empty() {
            break;
        }
        seen |= nic.step(&decode_net_op(&mut inp));
    }
    seen | nic.finish()
}

/// The pipeline under test and what the entry knows about it.
struct Nic {
    pipeline: NetPipeline,
    flows: std::sync::Arc<FlowMetrics>,
    fv: std::sync::Arc<FoxyVegasMetrics>,
    max_flows: usize,
    now: u64,
    frames: u64,
}

impl Nic {
    fn new(max_flows: usize, idle_timeout_ns: u64) -> Self {
        let (flows, fm) = Flows::new(FlowsConfig {
            max_flows,
            idle_timeout_ns,
        });
        let cfg = FoxyVegasConfig {
            max_flows,
            idle_timeout_ns,
            ..FoxyVegasConfig::default()
        };
        let (fv, vm) = FoxyVegas::new(cfg, Some(Box::new(std::io::sink())));
        let pipeline = NetPipeline::new(vec![
            ("flows", Box::new(flows)),
            ("foxyvegas", Box::new(fv)),
        ]);
        Self {
            pipeline,
            flows: fm,
            fv: vm,
            max_flows,
            now: 1_000_000_000,
            frames: 0,
        }
    }

    fn step(&mut self, op: &NetOp) -> u32 {
        match op {
            NetOp::Tick { ms } => {
                self.now += u64::from(*ms) * 1_000_000;
                self.pipeline.tick(self.now);
                self.check_bounds();
                0
            }
            NetOp::Tcp { seg, edit, dt_us } => {
                self.now += u64::from(*dt_us);
                let dir = if seg.flags & TO_GUEST != 0 {
                    Direction::ToGuest
                } else {
                    Direction::FromGuest
                };
                self.frame(dir, edited(build(seg), edit))
            }
            NetOp::Raw { dir, edit, bytes } => {
                let dir = if dir & 1 != 0 {
                    Direction::ToGuest
                } else {
                    Direction::FromGuest
                };
                self.frame(dir, edited(bytes.clone(), edit))
            }
        }
    }

    /// Runs one frame and checks what the stages did to it.
    fn frame(&mut self, dir: Direction, mut frame: Frame) -> u32 {
        let before = frame.clone();
        let seg = tcp_segment(&frame.data);
        let verdict = self.pipeline.run(dir, &mut frame, self.now);
        assert_eq!(
            verdict,
            Verdict::Pass,
            "the flow table and FoxyVegas never drop"
        );
        self.frames += 1;
        self.check_bounds();
        check_only_the_window_changed(&before, &frame, seg.as_ref())
    }

    fn check_bounds(&self) {
        let f = self.flows.snapshot();
        let v = self.fv.snapshot();
        let max = self.max_flows as u64;
        assert!(
            f.flows_active <= max,
            "flow table: {} flows",
            f.flows_active
        );
        assert!(f.top.len() <= TOP_FLOWS);
        assert_eq!(
            f.tx_frames + f.rx_frames,
            self.frames,
            "every frame counted once"
        );
        assert!(v.flows_active <= max, "FoxyVegas: {} flows", v.flows_active);
        assert!(v.half_open_active <= max.min(MAX_HALF_OPEN as u64));
        assert!(self.fv.flows().len() <= SNAPSHOT_FLOWS);
    }

    /// Ticks far in the future (everything expires), finishes the stages, and says whether a
    /// table ever evicted or expired a flow.
    fn finish(mut self) -> u32 {
        self.pipeline.tick(self.now);
        self.pipeline.finish();
        self.check_bounds();
        let f = self.flows.snapshot();
        let v = self.fv.snapshot();
        let mut bits = 0;
        if f.evicted + v.flows_evicted + v.half_open_evicted > 0 {
            bits |= NET_EVICTED;
        }
        if f.expired + v.flows_expired + v.half_open_expired > 0 {
            bits |= NET_EXPIRED;
        }
        self.pipeline.tick(u64::MAX);
        let (f, v) = (self.flows.snapshot(), self.fv.snapshot());
        assert_eq!(f.flows_active, 0, "every flow expires");
        assert_eq!(v.flows_active + v.half_open_active, 0, "every flow expires");
        bits
    }
}

/// The frame `seg` describes, with correct checksums unless it asks for a wrong one.
fn build(seg: &Segment) -> Vec<u8> {
    let to_guest = seg.flags & TO_GUEST != 0;
    let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    let b = match (seg.flags & V6 != 0, to_guest) {
        (false, false) => b.ipv4(GUEST4, PEER4, 64),
        (false, true) => b.ipv4(PEER4, GUEST4, 64),
        (true, false) => b.ipv6(GUEST6, PEER6, 64),
        (true, true) => b.ipv6(PEER6, GUEST6, 64),
    };
    let guest_port = 40000 + u16::from(seg.port % 8);
    let (sport, dport) = if to_guest {
        (5201, guest_port)
    } else {
        (guest_port, 5201)
    };
    let mut t = b.tcp(sport, dport, seg.seq, seg.window);
    if seg.flags & SYN != 0 {
        t = t.syn();
    }
    if seg.flags & ACK != 0 {
        t = t.ack(seg.ack);
    }
    if seg.flags & FIN != 0 {
        t = t.fin();
    }
    if seg.flags & RST != 0 {
        t = t.rst();
    }
    if seg.flags & OPTIONS != 0 {
        let opts = [
            TcpOptionElement::MaximumSegmentSize(seg.mss),
            TcpOptionElement::WindowScale(seg.wscale),
        ];
        t = match t.options(&opts) {
            Ok(t) => t,
            Err(e) => panic!("two options fit a TCP header: {e}"),
        };
    }
    let payload: Vec<u8> = (0..seg.payload.min(MAX_PAYLOAD)).map(|i| i as u8).collect();
    let mut out = Vec::new();
    if let Err(e) = t.write(&mut out, &payload) {
        panic!("a segment of at most {MAX_PAYLOAD} bytes builds: {e}");
    }
    if seg.flags & BAD_CSUM != 0 {
        if let Some(s) = tcp_segment(&out) {
            out[s.checksum_offset()] ^= 0x5a;
        }
    }
    out
}

/// `data` in a frame with `edit`'s header, flipped byte and cut.
fn edited(mut data: Vec<u8>, edit: &Edit) -> Frame {
    if edit.xor != 0 && !data.is_empty() {
        let at = usize::from(edit.at) % data.len();
        data[at] ^= edit.xor;
    }
    if edit.cut > 0 {
        data.truncate(usize::from(edit.cut - 1));
    }
    let hdr = VnetHdr {
        flags: edit.hdr_flags,
        gso_type: edit.gso_type,
        gso_size: edit.gso_size,
        ..VnetHdr::default()
    };
    Frame { hdr, data }
}

/// The oracle of one frame: the header and length stay; a frame that is not TCP is unchanged;
/// a TCP segment changes at most its window (lowered) and its checksum (kept valid, or left
/// alone when the receiver computes it).
fn check_only_the_window_changed(before: &Frame, after: &Frame, seg: Option<&TcpSegment>) -> u32 {
    assert_eq!(before.hdr, after.hdr, "the virtio-net header never changes");
    assert_eq!(
        before.data.len(),
        after.data.len(),
        "the length never changes"
    );
    let Some(seg) = seg else {
        assert_eq!(
            before.data, after.data,
            "a frame that is not TCP passes unchanged"
        );
        return NET_NOT_TCP;
    };
    if before.data == after.data {
        return NET_TCP_UNCHANGED;
    }
    let (wo, co) = (seg.window_offset(), seg.checksum_offset());
    for (i, (x, y)) in before.data.iter().zip(&after.data).enumerate() {
        let touchable = (wo..wo + 2).contains(&i) || (co..co + 2).contains(&i);
        assert!(touchable || x == y, "byte {i} changed: {x:#x} -> {y:#x}");
    }
    let field = |d: &[u8]| u16::from_be_bytes([d[wo], d[wo + 1]]);
    let (old, new) = (field(&before.data), field(&after.data));
    assert!(new < old, "the window only shrinks: {old} -> {new}");
    if before.hdr.needs_csum() {
        assert_eq!(
            before.data[co..co + 2],
            after.data[co..co + 2],
            "a checksum the receiver computes is left alone"
        );
    } else if checksum_ok(&before.data) {
        assert!(checksum_ok(&after.data), "a valid checksum stays valid");
    }
    NET_REWRITTEN
}

/// Whether the TCP checksum of an Ethernet frame verifies (one's complement sum of the
/// pseudo-header and the segment, checksum included, is all ones), as a receiver checks it.
fn checksum_ok(frame: &[u8]) -> bool {
    let Ok(p) = SlicedPacket::from_ethernet(frame) else {
        return false;
    };
    let Some(TransportSlice::Tcp(tcp)) = p.transport.as_ref() else {
        return false;
    };
    let segment = tcp.slice();
    let Ok(len) = u32::try_from(segment.len()) else {
        return false;
    };
    let mut sum: u64 = u64::from(len) + 6; // TCP's protocol number
    match p.net.as_ref() {
        Some(NetSlice::Ipv4(v4)) => {
            let h = v4.header();
            sum += words(&h.source()) + words(&h.destination());
        }
        Some(NetSlice::Ipv6(v6)) => {
            let h = v6.header();
            sum += words(&h.source()) + words(&h.destination());
        }
        _ => return false,
    }
    sum += words(segment);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum == 0xffff
}

/// The sum of `b`'s big-endian 16-bit words (an odd last byte padded with zero).
fn words(b: &[u8]) -> u64 {
    b.chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum()
}

fn decode_edit(inp: &mut Input<'_>) -> Edit {
    Edit {
        hdr_flags: inp.u8(),
        gso_type: inp.u8(),
        gso_size: inp.u16(),
        at: inp.u16(),
        xor: inp.u8(),
        cut: inp.u16(),
    }
}

fn decode_segment(inp: &mut Input<'_>) -> Segment {
    Segment {
        flags: inp.u8(),
        port: inp.u8(),
        seq: inp.u32(),
        ack: inp.u32(),
        window: inp.u16(),
        mss: inp.u16(),
        wscale: inp.u8(),
        payload: inp.u16() % (MAX_PAYLOAD + 1),
    }
}

fn decode_net_op(inp: &mut Input<'_>) -> NetOp {
    match inp.u8() % 4 {
        0 => NetOp::Tick { ms: inp.u16() },
        1 => NetOp::Raw {
            dir: inp.u8(),
            edit: decode_edit(inp),
            bytes: inp.chunk(MAX_RAW).to_vec(),
        },
        _ => NetOp::Tcp {
            seg: decode_segment(inp),
            edit: decode_edit(inp),
            dt_us: inp.u16(),
        },
    }
}

fn encode_edit(o: &mut Output, e: &Edit) {
    o.u8(e.hdr_flags).u8(e.gso_type).u16(e.gso_size);
    o.u16(e.at).u8(e.xor).u16(e.cut);
}

/// Encodes a NIC input: the configuration byte (see [`virtio_net_frames`]) and the operations.
pub fn encode_net(config: u8, ops: &[NetOp]) -> Vec<u8> {
    let mut o = Output::default();
    o.u8(config);
    for op in ops {
        match op {
            NetOp::Tick { ms } => {
                o.u8(0).u16(*ms);
            }
            NetOp::Raw { dir, edit, bytes } => {
                o.u8(1).u8(*dir);
                encode_edit(&mut o, edit);
                o.chunk(bytes);
            }
            NetOp::Tcp { seg, edit, dt_us } => {
                o.u8(2).u8(seg.flags).u8(seg.port).u32(seg.seq).u32(seg.ack);
                o.u16(seg.window)
                    .u16(seg.mss)
                    .u8(seg.wscale)
                    .u16(seg.payload);
                encode_edit(&mut o, edit);
                o.u16(*dt_us);
            }
        }
    }
    o.bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_oracle_accepts_built_segments_and_refuses_damaged_ones() {
        for flags in [0, V6, TO_GUEST | ACK | OPTIONS, V6 | SYN | OPTIONS] {
            let seg = Segment {
                flags,
                payload: 333,
                ..Segment::default()
            };
            assert!(checksum_ok(&build(&seg)), "flags {flags:#x}");
            let bad = Segment {
                flags: flags | BAD_CSUM,
                ..seg
            };
            assert!(!checksum_ok(&build(&bad)), "flags {flags:#x}");
        }
    }
}
