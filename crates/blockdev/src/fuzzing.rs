//! Fuzz entry point of the virtio-blk request parser (`fuzz/fuzz_targets/virtio_blk_request.rs`
//! and `tests/fuzz_virtio_blk_request.rs`; see docs/fuzzing.md).
//!
//! The guest owns the descriptor table, the available ring and every buffer, so the fuzzer's
//! bytes become exactly those: a split virtqueue of 16 descriptors in 64 KiB of guest memory
//! whose chains go through the real `virtio_queue` iterator and [`crate::request::parse`].
//! Every outcome must keep the parser's promises (docs/blockdev.md): a valid request lies
//! inside the disk with mapped buffers of the right size, a rejected one still has a status
//! byte, an unusable one has none.
//!
//! Input layout (decoded by `fuzz/common/input.rs`; missing bytes read as zero):
//!
//! ```text
//! config u8 (bit 0 read-only, bits 1-3 capacity), chains u8, heads: chains x u16,
//! descriptors u8 then per descriptor: place u8, addr u16, len u16, flags u8, next u8,
//! the rest: the data area (headers, payloads, indirect tables) at DATA_AT
//! ```

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::request::{parse, Limits, Parsed, Request, RequestKind, ID_BYTES, SECTOR_SIZE};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Guest memory size.
pub const MEM_SIZE: u64 = 0x1_0000;
/// Queue size (and most descriptors).
pub const QUEUE_SIZE: u16 = 16;
/// Guest address of the descriptor table.
pub const DESC_AT: u64 = 0x100;
/// Guest address of the available ring.
pub const AVAIL_AT: u64 = 0x400;
/// Guest address of the used ring.
pub const USED_AT: u64 = 0x800;
/// Guest address of the data area the rest of the input fills.
pub const DATA_AT: u64 = 0x1000;
/// Most chains popped per input.
const MAX_CHAINS: u8 = 4;
/// Disk sizes (sectors) a case picks from: empty, tiny, small, large, the largest offsets.
const CAPACITIES: [u64; 8] = [0, 1, 8, 1024, 1 << 21, 1 << 40, u64::MAX >> 9, u64::MAX];

/// Where a descriptor's address points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// `DATA_AT + addr`: the fuzzer's data area (may run past the end of memory).
    Data,
    /// `addr` itself: anywhere in the low 64 KiB, rings and tables included.
    Low,
    /// Just below 2^64: unmapped, and `addr + len` overflows.
    Top,
    /// Just past guest memory.
    Past,
}

/// One descriptor as the seed generators describe it.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub place: Place,
    pub addr: u16,
    pub len: u16,
    /// `VRING_DESC_F_*` bits; bit 7 multiplies `len` by 65536.
    pub flags: u8,
    pub next: u8,
}

/// Outcome bits returned by [`virtio_blk_request`]: a valid request was parsed.
pub const VALID: u32 = 1;
/// A request was rejected with a status.
pub const REJECTED: u32 = 2;
/// A chain had no usable status byte.
pub const UNUSABLE: u32 = 4;
/// A discard or write-zeroes request was valid.
pub const VALID_RANGES: u32 = 8;

/// Runs one fuzz input through the queue and the parser; panics if a promise is broken.
/// Returns the outcome bits seen (so drivers can check every outcome is reached).
pub fn virtio_blk_request(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let config = inp.u8();
    let limits = Limits::new(
        CAPACITIES[usize::from((config >> 1) & 7)],
        config & 1 != 0,
        QUEUE_SIZE,
    );
    let chains = inp.u8() % (MAX_CHAINS + 1);
    let heads: Vec<u16> = (0..chains).map(|_| inp.u16()).collect();
    let ndesc = inp.u8() % (QUEUE_SIZE as u8 + 1);
    let descs: Vec<[u8; 16]> = (0..ndesc).map(|_| raw_desc(&mut inp)).collect();
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]) else {
        return 0; // no memory for the mapping: nothing to test
    };
    let area = inp.take((MEM_SIZE - DATA_AT) as usize);
    let wrote = write_queue(&mem, &heads, &descs, area);
    assert!(wrote, "the fixed layout fits guest memory");
    let mut q = match Queue::new(QUEUE_SIZE) {
        Ok(q) => q,
        Err(e) => panic!("a queue of {QUEUE_SIZE} is valid: {e}"),
    };
    q.set_desc_table_address(Some(DESC_AT as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL_AT as u32), Some(0));
    q.set_used_ring_address(Some(USED_AT as u32), Some(0));
    q.set_ready(true);
    let mut seen = 0;
    for _ in 0..MAX_CHAINS {
        let Some(chain) = q.pop_descriptor_chain(&mem) else {
            break;
        };
        seen |= check(parse(chain, &mem, &limits), &mem, &limits);
    }
    seen
}

/// Decodes one descriptor into its 16 table bytes.
fn raw_desc(inp: &mut Input<'_>) -> [u8; 16] {
    let place = match inp.u8() & 3 {
        0 => Place::Data,
        1 => Place::Low,
        2 => Place::Top,
        _ => Place::Past,
    };
    let d = Desc {
        place,
        addr: inp.u16(),
        len: inp.u16(),
        flags: inp.u8(),
        next: inp.u8(),
    };
    encode_desc(&d)
}

/// The 16 bytes of a split-ring descriptor.
fn encode_desc(d: &Desc) -> [u8; 16] {
    let a = u64::from(d.addr);
    let addr = match d.place {
        Place::Data => DATA_AT + a,
        Place::Low => a,
        Place::Top => u64::MAX - a,
        Place::Past => MEM_SIZE + a,
    };
    let len = if d.flags & 0x80 != 0 {
        u32::from(d.len) << 16
    } else {
        u32::from(d.len)
    };
    let flags = u16::from(d.flags)
        & (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE | VRING_DESC_F_INDIRECT) as u16;
    let mut raw = [0u8; 16];
    raw[..8].copy_from_slice(&addr.to_le_bytes());
    raw[8..12].copy_from_slice(&len.to_le_bytes());
    raw[12..14].copy_from_slice(&flags.to_le_bytes());
    raw[14..].copy_from_slice(&u16::from(d.next).to_le_bytes());
    raw
}

/// Writes the descriptor table, the available ring (with `heads`) and the data area.
fn write_queue(mem: &GuestMemoryMmap, heads: &[u16], descs: &[[u8; 16]], area: &[u8]) -> bool {
    let mut ok = true;
    for (i, d) in descs.iter().enumerate() {
        ok &= mem
            .write_slice(d, GuestAddress(DESC_AT + 16 * i as u64))
            .is_ok();
    }
    let mut avail = vec![0u8; 4 + 2 * usize::from(QUEUE_SIZE)];
    avail[2..4].copy_from_slice(&(heads.len() as u16).to_le_bytes());
    for (i, h) in heads.iter().enumerate() {
        avail[4 + 2 * i..6 + 2 * i].copy_from_slice(&h.to_le_bytes());
    }
    ok &= mem.write_slice(&avail, GuestAddress(AVAIL_AT)).is_ok();
    ok & mem.write_slice(area, GuestAddress(DATA_AT)).is_ok()
}

/// The parser's promises for one outcome; returns its outcome bit.
fn check(p: Parsed, mem: &GuestMemoryMmap, limits: &Limits) -> u32 {
    let mapped = |status| GuestMemoryBackend::check_range(mem, status, 1);
    match p {
        Parsed::Request { req, status } => {
            assert!(mapped(status), "status byte mapped");
            check_request(&req, mem, limits);
            if req.ranges.is_empty() {
                VALID
            } else {
                VALID | VALID_RANGES
            }
        }
        Parsed::Rejected { error, status } => {
            assert!(mapped(status), "status byte mapped");
            assert!(error.status().is_some(), "{error} has a status");
            REJECTED
        }
        Parsed::Unusable(error) => {
            assert!(error.status().is_none(), "{error} has no status");
            UNUSABLE
        }
    }
}

/// A valid request lies inside the disk, with mapped buffers adding up to its length.
fn check_request(req: &Request, mem: &GuestMemoryMmap, limits: &Limits) {
    assert!(
        !(limits.read_only && req.kind.is_mutating()),
        "{:?} accepted on a read-only disk",
        req.kind
    );
    for s in &req.segments {
        assert!(
            s.len == 0 || GuestMemoryBackend::check_range(mem, s.addr, s.len as usize),
            "segment {s:?} not mapped"
        );
    }
    let seg_len: u64 = req.segments.iter().map(|s| u64::from(s.len)).sum();
    match req.kind {
        RequestKind::Read | RequestKind::Write => {
            assert_eq!(seg_len, req.len, "segments add up to the length");
            assert!(req.len.is_multiple_of(SECTOR_SIZE) && req.len <= limits.max_data_len);
            let end = req.sector.checked_add(req.len / SECTOR_SIZE);
            assert!(end.is_some_and(|e| e <= limits.capacity_sectors), "{req:?}");
        }
        RequestKind::GetId => {
            assert_eq!(seg_len, req.len);
            assert!(req.len > 0 && req.len <= ID_BYTES as u64);
        }
        RequestKind::Flush => assert_eq!((req.len, seg_len), (0, 0)),
        RequestKind::Discard | RequestKind::WriteZeroes => check_ranges(req, limits),
    }
}

/// Discard / write-zeroes ranges lie inside the disk and add up to the length.
fn check_ranges(req: &Request, limits: &Limits) {
    assert!(!req.ranges.is_empty());
    let mut total = 0u64;
    for r in &req.ranges {
        let end = r.sector.checked_add(u64::from(r.num_sectors));
        assert!(end.is_some_and(|e| e <= limits.capacity_sectors), "{r:?}");
        assert!(!r.unmap || req.kind == RequestKind::WriteZeroes);
        total += r.bytes();
    }
    assert_eq!(total, req.len);
}

// ---- seeds ---------------------------------------------------------------------------------

/// Offsets in the data area used by the seeds.
const HDR: u16 = 0;
const BUF: u16 = 0x100;
const STATUS: u16 = 0x300;
const TABLE: u16 = 0x400;

fn d(place: Place, addr: u16, len: u16, flags: u32, next: u8) -> Desc {
    Desc {
        place,
        addr,
        len,
        flags: flags as u8,
        next,
    }
}

/// Readable descriptor in the data area, chained to `next`.
fn rd(addr: u16, len: u16, next: u8) -> Desc {
    d(Place::Data, addr, len, VRING_DESC_F_NEXT, next)
}

/// Writable descriptor in the data area, chained to `next`.
fn wr(addr: u16, len: u16, next: u8) -> Desc {
    d(
        Place::Data,
        addr,
        len,
        VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
        next,
    )
}

/// The final writable status descriptor.
fn status() -> Desc {
    d(Place::Data, STATUS, 1, VRING_DESC_F_WRITE, 0)
}

fn header(req_type: u32, sector: u64) -> Vec<u8> {
    let mut h = vec![0u8; 16];
    h[..4].copy_from_slice(&req_type.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    h
}

fn range(sector: u64, n: u32, flags: u32) -> Vec<u8> {
    let mut b = sector.to_le_bytes().to_vec();
    b.extend_from_slice(&n.to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    b
}

/// Encodes one case: `config`, one chain from descriptor 0, `descs`, and the data area with
/// `pieces` placed at their offsets.
fn case(config: u8, descs: &[Desc], pieces: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut o = Output::default();
    o.u8(config).u8(1).u16(0).u8(descs.len() as u8);
    for x in descs {
        let place = match x.place {
            Place::Data => 0,
            Place::Low => 1,
            Place::Top => 2,
            Place::Past => 3,
        };
        o.u8(place).u16(x.addr).u16(x.len).u8(x.flags).u8(x.next);
    }
    let end = pieces
        .iter()
        .map(|(at, b)| usize::from(*at) + b.len())
        .max()
        .unwrap_or(0)
        .max(usize::from(STATUS) + 1);
    let mut area = vec![0u8; end];
    for (at, b) in pieces {
        area[usize::from(*at)..usize::from(*at) + b.len()].copy_from_slice(b);
    }
    o.raw(&area);
    o.bytes
}

/// A handful of valid and near-valid inputs (the committed corpus is made from these).
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use virtio_bindings::virtio_blk::*;
    const RW_1024: u8 = 3 << 1; // capacity 1024 sectors, read-write
    let ranges = [range(8, 8, 0), range(100, 4, 0)].concat();
    let indirect_table: Vec<u8> = [rd(HDR, 16, 1), wr(BUF, 512, 2), status()]
        .iter()
        .flat_map(|x| encode_desc(x).to_vec())
        .collect();
    vec![
        (
            "read",
            case(
                RW_1024,
                &[rd(HDR, 16, 1), wr(BUF, 1024, 2), status()],
                &[(HDR, header(VIRTIO_BLK_T_IN, 8))],
            ),
        ),
        (
            "write-split-header",
            case(
                RW_1024,
                &[
                    rd(HDR, 10, 1),
                    rd(HDR + 10, 6, 2),
                    rd(BUF, 512, 3),
                    status(),
                ],
                &[(HDR, header(VIRTIO_BLK_T_OUT, 1023))],
            ),
        ),
        (
            "flush",
            case(
                RW_1024,
                &[rd(HDR, 16, 1), status()],
                &[(HDR, header(VIRTIO_BLK_T_FLUSH, 0))],
            ),
        ),
        (
            "get-id",
            case(
                RW_1024,
                &[rd(HDR, 16, 1), wr(BUF, 20, 2), status()],
                &[(HDR, header(VIRTIO_BLK_T_GET_ID, 0))],
            ),
        ),
        (
            "discard",
            case(
                RW_1024,
                &[rd(HDR, 16, 1), rd(BUF, 32, 2), status()],
                &[(HDR, header(VIRTIO_BLK_T_DISCARD, 0)), (BUF, ranges)],
            ),
        ),
        (
            "write-zeroes-unmap-read-only",
            case(
                RW_1024 | 1,
                &[rd(HDR, 16, 1), rd(BUF, 16, 2), status()],
                &[
                    (HDR, header(VIRTIO_BLK_T_WRITE_ZEROES, 0)),
                    (BUF, range(0, 1024, 1)),
                ],
            ),
        ),
        (
            "indirect",
            case(
                RW_1024,
                &[d(Place::Data, TABLE, 48, VRING_DESC_F_INDIRECT, 0)],
                &[(HDR, header(VIRTIO_BLK_T_IN, 0)), (TABLE, indirect_table)],
            ),
        ),
        (
            "loop",
            case(
                RW_1024,
                &[rd(HDR, 16, 1), wr(BUF, 512, 0)],
                &[(HDR, header(VIRTIO_BLK_T_IN, 0))],
            ),
        ),
        (
            "read-past-the-end",
            case(
                RW_1024,
                &[
                    rd(HDR, 16, 1),
                    d(
                        Place::Past,
                        0,
                        512,
                        VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
                        2,
                    ),
                    status(),
                ],
                &[(HDR, header(VIRTIO_BLK_T_IN, u64::MAX))],
            ),
        ),
    ]
}
