//! Parsing and validation of virtio-blk descriptor chains into [`Request`]s.
//!
//! Layout accepted (virtio 1.x, as Linux and QEMU build it, any descriptor split allowed):
//!
//! ```text
//! device-readable descriptors: 16-byte header (type u32, ioprio u32, sector u64) + out data
//! device-writable descriptors: in data ... + status byte (the last byte of the last descriptor)
//! ```
//!
//! Every rule violation maps to a [`RequestError`]. If the chain still has a usable status
//! byte (last descriptor device-writable, non-empty, mapped) the device writes
//! `VIRTIO_BLK_S_IOERR` (or `VIRTIO_BLK_S_UNSUPP`) there; otherwise the chain is returned to
//! the guest with used length 0. Nothing here panics or blocks on guest input.

use std::any::Any;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryMmap};

use crate::pipeline::{StageError, Status};

/// Bytes per virtio-blk sector (fixed by the specification, independent of `blk_size`).
pub const SECTOR_SIZE: u64 = 512;
/// log2 of [`SECTOR_SIZE`].
pub const SECTOR_SHIFT: u32 = 9;
/// Size of `struct virtio_blk_outhdr`.
pub const HEADER_LEN: u64 = 16;
/// Size of one `struct virtio_blk_discard_write_zeroes` segment.
pub const DISCARD_SEGMENT_LEN: u64 = 16;
/// Size of the GET_ID answer.
pub const ID_BYTES: usize = 20;

/// What the guest asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RequestKind {
    /// `VIRTIO_BLK_T_IN`: read sectors into guest memory.
    Read,
    /// `VIRTIO_BLK_T_OUT`: write sectors from guest memory.
    Write,
    /// `VIRTIO_BLK_T_FLUSH`: make completed writes durable.
    Flush,
    /// `VIRTIO_BLK_T_GET_ID`: return the serial (20 bytes).
    GetId,
    /// `VIRTIO_BLK_T_DISCARD`: the sectors' contents are no longer needed.
    Discard,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`: the sectors read back as zeroes.
    WriteZeroes,
}

impl RequestKind {
    /// Whether the request modifies the disk.
    pub fn is_mutating(self) -> bool {
        matches!(
            self,
            RequestKind::Write | RequestKind::Discard | RequestKind::WriteZeroes
        )
    }
}

/// One piece of the request's data buffer in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address (validated to be mapped when the request was parsed).
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// One range of a discard or write-zeroes request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorRange {
    /// First sector.
    pub sector: u64,
    /// Number of sectors.
    pub num_sectors: u32,
    /// Write-zeroes only: the device may deallocate the range.
    pub unmap: bool,
}

impl SectorRange {
    /// Byte offset of the range in the image.
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }
    /// Byte length of the range.
    pub fn bytes(&self) -> u64 {
        u64::from(self.num_sectors) << SECTOR_SHIFT
    }
}

/// Opaque annotations attached by a stage (e.g. the insight classifier) for later stages.
/// Each stage downcasts to the type it knows (`insights.downcast_ref::<MyInsight>()`).
pub type Insights = Arc<dyn Any + Send + Sync>;

/// A validated block request travelling through the pipeline.
///
/// Everything about its shape has been checked: the sector range lies within the disk, lengths
/// are multiples of 512 where required, the data buffers are mapped guest memory with the
/// right direction, and mutating requests only reach a read-write disk.
#[derive(Clone)]
pub struct Request {
    /// What the guest asks for.
    pub kind: RequestKind,
    /// First sector (`Read`/`Write`; 0 for the others, see `ranges`).
    pub sector: u64,
    /// Data length in bytes (`Read`/`Write`: the transfer; `GetId`: bytes to fill; discard and
    /// write-zeroes: total bytes covered by `ranges`; `Flush`: 0).
    pub len: u64,
    /// The data buffers in guest memory, in order (`Read`, `Write`, `GetId`).
    pub segments: Vec<Segment>,
    /// Ranges of a discard or write-zeroes request.
    pub ranges: Vec<SectorRange>,
    /// Per-disk sequence number, unique for the backend's lifetime.
    pub id: u64,
    /// Index of the virtqueue the request came from.
    pub queue: u16,
    /// Annotations attached by stages (none when the request enters the pipeline).
    pub insights: Option<Insights>,
    /// When the request was taken off the available ring.
    pub submitted_at: Instant,
    /// When it passed the hand-offs below the stages (set by the terminal stage).
    pub timeline: Timeline,
    mem: GuestMemoryMmap,
}

/// When a request passed each hand-off after it left the available ring, for the per-disk
/// split of its service time ([`crate::metrics::HandOffTimes`]). The terminal stage sets all
/// three; a request a stage answered itself (a cache hit) or failed before the image keeps
/// `None`s.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timeline {
    /// The terminal stage took the request.
    pub terminal: Option<Instant>,
    /// The transfer began: the system call of an I/O thread, or the ring's submission.
    pub io_start: Option<Instant>,
    /// The transfer ended: the call returned, or its (last) completion was reaped.
    pub io_end: Option<Instant>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("kind", &self.kind)
            .field("sector", &self.sector)
            .field("len", &self.len)
            .field("segments", &self.segments)
            .field("ranges", &self.ranges)
            .field("id", &self.id)
            .field("queue", &self.queue)
            .field("has_insights", &self.insights.is_some())
            .finish()
    }
}

impl Request {
    /// The guest memory the segments point into.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Byte offset of `sector` in the image.
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }

    /// Copies `buf.len()` bytes of the request's data, starting `offset` bytes into it, out of
    /// guest memory (e.g. a write tap reading what the guest writes).
    pub fn read_data(&self, offset: u64, buf: &mut [u8]) -> Result<(), StageError> {
        let mut done = 0usize;
        self.for_each_piece(offset, buf.len() as u64, |addr, len| {
            let end = done + len;
            let dst = buf.get_mut(done..end).ok_or(StageError::GuestMemory {
                addr: addr.0,
                len: len as u64,
            })?;
            self.mem
                .read_slice(dst, addr)
                .map_err(|_| StageError::GuestMemory {
                    addr: addr.0,
                    len: len as u64,
                })?;
            done = end;
            Ok(())
        })
    }

    /// Copies `buf` into the request's data buffers, starting `offset` bytes into them (e.g. a
    /// cache stage answering a read).
    pub fn write_data(&self, offset: u64, buf: &[u8]) -> Result<(), StageError> {
        let mut done = 0usize;
        self.for_each_piece(offset, buf.len() as u64, |addr, len| {
            let end = done + len;
            let src = buf.get(done..end).ok_or(StageError::GuestMemory {
                addr: addr.0,
                len: len as u64,
            })?;
            self.mem
                .write_slice(src, addr)
                .map_err(|_| StageError::GuestMemory {
                    addr: addr.0,
                    len: len as u64,
                })?;
            done = end;
            Ok(())
        })
    }

    /// Calls `f(addr, len)` for each piece of guest memory covering data bytes
    /// `[offset, offset + len)`; fails if that range exceeds the segments.
    fn for_each_piece(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(GuestAddress, usize) -> Result<(), StageError>,
    ) -> Result<(), StageError> {
        let mut skip = offset;
        let mut left = len;
        for seg in &self.segments {
            if left == 0 {
                break;
            }
            let seg_len = u64::from(seg.len);
            if skip >= seg_len {
                skip -= seg_len;
                continue;
            }
            let take = (seg_len - skip).min(left);
            let addr = seg.addr.checked_add(skip).ok_or(StageError::GuestMemory {
                addr: seg.addr.0,
                len: take,
            })?;
            f(addr, take as usize)?;
            left -= take;
            skip = 0;
        }
        if left != 0 {
            return Err(StageError::Stage {
                stage: "request".into(),
                reason: format!(
                    "data access at offset {offset} (+{len}) exceeds the request's {} bytes",
                    self.segments.iter().map(|s| u64::from(s.len)).sum::<u64>()
                ),
            });
        }
        Ok(())
    }

    /// A request generated by a stage itself (e.g. a cache reading whole blocks into its own
    /// buffer or writing dirty blocks back), with its data buffers in `mem`, memory the stage
    /// owns rather than guest RAM. It is not validated: the caller must keep the sector range
    /// inside the disk (e.g. by deriving it from a validated guest request). `len` is the sum
    /// of the segment lengths; `id`, `queue` are 0 and `insights` is `None` (all public fields,
    /// set them if useful).
    pub fn new_internal(
        mem: &GuestMemoryMmap,
        kind: RequestKind,
        sector: u64,
        segments: Vec<Segment>,
    ) -> Self {
        let len = segments.iter().map(|s| u64::from(s.len)).sum();
        Self {
            kind,
            sector,
            len,
            segments,
            ranges: Vec::new(),
            id: 0,
            queue: 0,
            insights: None,
            submitted_at: Instant::now(),
            timeline: Timeline::default(),
            mem: mem.clone(),
        }
    }

    /// Moves the request out, leaving an empty flush request on the same memory in its place
    /// (lets code holding `&mut Request` hand the request to an owner-taking API and put it
    /// back afterwards).
    pub fn take(&mut self) -> Request {
        let empty = Request::new_internal(&self.mem, RequestKind::Flush, 0, Vec::new());
        std::mem::replace(self, empty)
    }

    /// A request built directly, for tests of stages.
    #[cfg(test)]
    pub(crate) fn new_for_test(
        mem: &GuestMemoryMmap,
        kind: RequestKind,
        sector: u64,
        segments: Vec<Segment>,
    ) -> Self {
        Self::new_internal(mem, kind, sector, segments)
    }
}

/// Geometry and limits a request is validated against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Disk size in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Mutating requests are refused.
    pub read_only: bool,
    /// Longest accepted descriptor chain (the queue size).
    pub max_chain_len: u16,
    /// Largest accepted data transfer of one read or write, in bytes.
    pub max_data_len: u64,
    /// `max_discard_sectors` advertised in the config space.
    pub max_discard_sectors: u32,
    /// `max_discard_seg` advertised in the config space.
    pub max_discard_seg: u32,
    /// `max_write_zeroes_sectors` advertised in the config space.
    pub max_write_zeroes_sectors: u32,
    /// `max_write_zeroes_seg` advertised in the config space.
    pub max_write_zeroes_seg: u32,
}

/// Default cap on one read/write transfer (Linux sends at most `max_sectors_kb`, 1280 KiB by
/// default; this leaves room for a raised limit while refusing absurd chains).
pub const DEFAULT_MAX_DATA_LEN: u64 = 64 << 20;

impl Limits {
    /// Limits for a disk of `capacity_sectors`, with the defaults used by the device.
    pub fn new(capacity_sectors: u64, read_only: bool, queue_size: u16) -> Self {
        Self {
            capacity_sectors,
            read_only,
            max_chain_len: queue_size,
            max_data_len: DEFAULT_MAX_DATA_LEN,
            max_discard_sectors: 1 << 22,
            max_discard_seg: 32,
            max_write_zeroes_sectors: 1 << 22,
            max_write_zeroes_seg: 32,
        }
    }
}

/// Why a chain was refused. See docs/blockdev.md for the list of rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    // ---- no usable status byte: returned with used length 0 ----
    /// The chain has no descriptor (e.g. head is an empty indirect table).
    #[error("descriptor chain is empty")]
    EmptyChain,
    /// More descriptors than the queue size, or a loop.
    #[error("descriptor chain is longer than {max} descriptors (or loops)")]
    ChainTooLong {
        /// The limit.
        max: u16,
    },
    /// The chain ends in a descriptor that says it has a next one that cannot be read (bad
    /// index, bad indirect table, unmapped table, more than 4 GiB in total).
    #[error("descriptor chain is broken: a next descriptor cannot be read")]
    BrokenChain,
    /// The last descriptor is device-readable, so there is nowhere to put the status.
    #[error("the last descriptor (status) is not device-writable")]
    StatusNotWritable,
    /// The last descriptor is device-writable but has length 0.
    #[error("the status descriptor has length 0")]
    StatusEmpty,
    /// The status byte's guest address is not mapped.
    #[error("the status byte at {addr:#x} is not in guest memory")]
    StatusUnmapped {
        /// Guest-physical address of the status byte.
        addr: u64,
    },

    // ---- status byte usable: VIRTIO_BLK_S_IOERR ----
    /// No device-readable bytes at all: the chain starts with writable descriptors.
    #[error("the request header is missing or device-writable")]
    HeaderWriteOnly,
    /// Fewer than 16 device-readable bytes.
    #[error("the request header is {len} bytes, shorter than 16")]
    HeaderTooShort {
        /// Readable bytes found.
        len: u64,
    },
    /// A device-readable descriptor follows a device-writable one.
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    /// A descriptor points outside guest memory.
    #[error("descriptor buffer {addr:#x} (+{len} bytes) is not in guest memory")]
    BadAddress {
        /// Guest-physical address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// Data buffers in the wrong direction for the request type (e.g. writable buffers on a
    /// write, readable data on a read, any data on a flush).
    #[error("{kind:?} request carries data buffers in the wrong direction")]
    WrongDirection {
        /// The request type.
        kind: RequestKind,
    },
    /// A read or write whose length is not a multiple of 512.
    #[error("data length {len} is not a multiple of 512")]
    UnalignedLength {
        /// Data length.
        len: u64,
    },
    /// Sector range beyond the end of the disk, or overflowing.
    #[error("sectors {sector}..+{sectors} are beyond the disk's {capacity} sectors")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        sectors: u64,
        /// Disk capacity in sectors.
        capacity: u64,
    },
    /// A transfer larger than [`Limits::max_data_len`].
    #[error("data length {len} exceeds the {max}-byte limit")]
    TooLarge {
        /// Data length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Write, discard or write-zeroes on a read-only disk.
    #[error("{kind:?} request on a read-only disk")]
    ReadOnly {
        /// The request type.
        kind: RequestKind,
    },
    /// GET_ID with no writable buffer.
    #[error("{kind:?} request has no data buffer")]
    MissingData {
        /// The request type.
        kind: RequestKind,
    },
    /// Discard / write-zeroes payload that is empty or not a multiple of 16 bytes.
    #[error("discard/write-zeroes payload of {len} bytes is not a non-empty multiple of 16")]
    BadRangePayload {
        /// Payload length.
        len: u64,
    },
    /// More discard / write-zeroes segments than advertised.
    #[error("{count} discard/write-zeroes segments exceed the advertised {max}")]
    TooManyRanges {
        /// Segments in the request.
        count: u64,
        /// Advertised maximum.
        max: u32,
    },
    /// One discard / write-zeroes segment larger than advertised.
    #[error("a discard/write-zeroes segment of {sectors} sectors exceeds the advertised {max}")]
    RangeTooLarge {
        /// Sectors in the segment.
        sectors: u32,
        /// Advertised maximum.
        max: u32,
    },

    // ---- VIRTIO_BLK_S_UNSUPP ----
    /// Request type this device does not implement.
    #[error("request type {0} is not supported")]
    UnknownType(u32),
    /// Discard with the unmap flag, or reserved flag bits set.
    #[error("discard/write-zeroes flags {0:#x} are not supported")]
    UnsupportedFlags(u32),
}

impl RequestError {
    /// The status to write back, or `None` when the chain has no usable status byte.
    pub fn status(&self) -> Option<Status> {
        use RequestError::*;
        match self {
            EmptyChain
            | ChainTooLong { .. }
            | BrokenChain
            | StatusNotWritable
            | StatusEmpty
            | StatusUnmapped { .. } => None,
            UnknownType(_) | UnsupportedFlags(_) => Some(Status::Unsupp),
            _ => Some(Status::IoErr),
        }
    }
}

/// Outcome of parsing one descriptor chain.
#[derive(Debug)]
pub enum Parsed {
    /// A valid request, and where its status byte goes.
    Request {
        /// The request.
        req: Request,
        /// Guest address of the status byte.
        status: GuestAddress,
    },
    /// An invalid request whose status byte can be written.
    Rejected {
        /// Why.
        error: RequestError,
        /// Guest address of the status byte.
        status: GuestAddress,
    },
    /// An invalid chain with no usable status byte: return it with used length 0.
    Unusable(RequestError),
}

#[derive(Clone, Copy)]
struct Desc {
    addr: GuestAddress,
    len: u32,
    writable: bool,
}

/// Parses and validates one descriptor chain.
pub fn parse<M>(chain: DescriptorChain<M>, mem: &GuestMemoryMmap, limits: &Limits) -> Parsed
where
    M: Deref,
    M::Target: GuestMemory,
{
    // 1. Collect the descriptors, detecting over-long, looping and broken chains.
    let max = usize::from(limits.max_chain_len);
    let mut descs: Vec<Desc> = Vec::new();
    let mut last_has_next = false;
    for d in chain {
        if descs.len() == max {
            return Parsed::Unusable(RequestError::ChainTooLong {
                max: limits.max_chain_len,
            });
        }
        last_has_next = d.has_next();
        descs.push(Desc {
            addr: d.addr(),
            len: d.len(),
            writable: d.is_write_only(),
        });
    }
    if last_has_next {
        // The iterator stopped although the last descriptor announces a next one: either the
        // ttl (queue size) ran out — a loop or over-long chain — or the next one is unreadable.
        if descs.len() >= max {
            return Parsed::Unusable(RequestError::ChainTooLong {
                max: limits.max_chain_len,
            });
        }
        return Parsed::Unusable(RequestError::BrokenChain);
    }

    // 2. Locate the status byte: the last byte of the last descriptor.
    let Some(last) = descs.last().copied() else {
        return Parsed::Unusable(RequestError::EmptyChain);
    };
    if !last.writable {
        return Parsed::Unusable(RequestError::StatusNotWritable);
    }
    if last.len == 0 {
        return Parsed::Unusable(RequestError::StatusEmpty);
    }
    let status = match last.addr.checked_add(u64::from(last.len) - 1) {
        Some(a) if GuestMemoryBackend::check_range(mem, a, 1) => a,
        _ => {
            return Parsed::Unusable(RequestError::StatusUnmapped {
                addr: last.addr.0.wrapping_add(u64::from(last.len) - 1),
            })
        }
    };

    match validate(&descs, mem, limits) {
        Ok(req) => Parsed::Request { req, status },
        Err(error) => Parsed::Rejected { error, status },
    }
}

/// Rules that apply once a status byte exists.
fn validate(
    descs: &[Desc],
    mem: &GuestMemoryMmap,
    limits: &Limits,
) -> Result<Request, RequestError> {
    // 3. Device-readable descriptors first, then device-writable ones.
    // 4. Every buffer must be mapped guest memory.
    let (readable, writable) = check_layout(descs, mem)?;
    // 5. The header: the first 16 readable bytes.
    let (req_type, sector, out_data) = read_header(readable, mem)?;
    // 6. Writable data: everything writable except the final status byte.
    let in_data = writable_data(writable);
    let out_len: u64 = out_data.iter().map(|s| u64::from(s.len)).sum();
    let in_len: u64 = in_data.iter().map(|s| u64::from(s.len)).sum();
    let payload = Payload {
        sector,
        out_data,
        in_data,
        out_len,
        in_len,
    };

    let kind = request_kind(req_type, limits)?;
    let mut req = Request {
        kind,
        sector: 0,
        len: 0,
        segments: Vec::new(),
        ranges: Vec::new(),
        id: 0,
        queue: 0,
        insights: None,
        submitted_at: Instant::now(),
        timeline: Timeline::default(),
        mem: mem.clone(),
    };
    match kind {
        RequestKind::Read | RequestKind::Write => set_data(&mut req, payload, limits)?,
        RequestKind::Flush => {
            if in_len != 0 || out_len != 0 {
                return Err(RequestError::WrongDirection { kind });
            }
        }
        RequestKind::GetId => set_id(&mut req, payload)?,
        RequestKind::Discard | RequestKind::WriteZeroes => {
            set_ranges(&mut req, &payload, mem, limits)?;
        }
    }
    Ok(req)
}

/// The data buffers of a request after its header and before its status byte, with their
/// total lengths, and the sector the header names.
struct Payload {
    /// Sector from the header.
    sector: u64,
    /// Device-readable data (after the header).
    out_data: Vec<Segment>,
    /// Device-writable data (before the status byte).
    in_data: Vec<Segment>,
    out_len: u64,
    in_len: u64,
}

/// Split the chain into its device-readable and device-writable parts, checking that no
/// readable descriptor follows a writable one and that every buffer is mapped.
fn check_layout<'d>(
    descs: &'d [Desc],
    mem: &GuestMemoryMmap,
) -> Result<(&'d [Desc], &'d [Desc]), RequestError> {
    let n_readable = descs.iter().take_while(|d| !d.writable).count();
    let (readable, writable) = descs.split_at(n_readable);
    if writable.iter().any(|d| !d.writable) {
        return Err(RequestError::ReadableAfterWritable);
    }
    for d in descs {
        if d.len > 0 && !GuestMemoryBackend::check_range(mem, d.addr, d.len as usize) {
            return Err(RequestError::BadAddress {
                addr: d.addr.0,
                len: d.len,
            });
        }
    }
    Ok((readable, writable))
}

/// Read the header from the first 16 readable bytes: the request type, the sector, and the
/// readable data segments after it.
fn read_header(
    readable: &[Desc],
    mem: &GuestMemoryMmap,
) -> Result<(u32, u64, Vec<Segment>), RequestError> {
    let readable_len: u64 = readable.iter().map(|d| u64::from(d.len)).sum();
    if readable.is_empty() {
        return Err(RequestError::HeaderWriteOnly);
    }
    if readable_len < HEADER_LEN {
        return Err(RequestError::HeaderTooShort { len: readable_len });
    }
    let readable_segs: Vec<Segment> = readable
        .iter()
        .map(|d| Segment {
            addr: d.addr,
            len: d.len,
        })
        .collect();
    let (header_segs, out_data) = split_segments(&readable_segs, HEADER_LEN);
    let mut header = [0u8; HEADER_LEN as usize];
    gather(mem, &header_segs, &mut header)?;
    let (type_bytes, rest) = header.split_at(4);
    let sector_bytes = rest.get(4..12).unwrap_or(&[0; 8]);
    let req_type = u32::from_le_bytes(type_bytes.try_into().unwrap_or([0xff; 4]));
    let sector = u64::from_le_bytes(sector_bytes.try_into().unwrap_or([0; 8]));
    Ok((req_type, sector, out_data))
}

/// The device-writable data segments: everything writable except the final status byte.
fn writable_data(writable: &[Desc]) -> Vec<Segment> {
    let writable_segs: Vec<Segment> = writable
        .iter()
        .map(|d| Segment {
            addr: d.addr,
            len: d.len,
        })
        .collect();
    let writable_len: u64 = writable_segs.iter().map(|s| u64::from(s.len)).sum();
    let (in_data, _status) = split_segments(&writable_segs, writable_len.saturating_sub(1));
    in_data
}

/// The request kind of header type `req_type`; mutating kinds are refused on a read-only
/// disk.
fn request_kind(req_type: u32, limits: &Limits) -> Result<RequestKind, RequestError> {
    let kind = match req_type {
        VIRTIO_BLK_T_IN => RequestKind::Read,
        VIRTIO_BLK_T_OUT => RequestKind::Write,
        VIRTIO_BLK_T_FLUSH => RequestKind::Flush,
        VIRTIO_BLK_T_GET_ID => RequestKind::GetId,
        VIRTIO_BLK_T_DISCARD => RequestKind::Discard,
        VIRTIO_BLK_T_WRITE_ZEROES => RequestKind::WriteZeroes,
        other => return Err(RequestError::UnknownType(other)),
    };
    if kind.is_mutating() && limits.read_only {
        return Err(RequestError::ReadOnly { kind });
    }
    Ok(kind)
}

/// Check a read's or write's data (direction, size, alignment, range) and set the request's
/// sector, length and segments.
fn set_data(req: &mut Request, p: Payload, limits: &Limits) -> Result<(), RequestError> {
    let kind = req.kind;
    let (data, wrong) = if kind == RequestKind::Read {
        (p.in_data, p.out_len)
    } else {
        (p.out_data, p.in_len)
    };
    if wrong != 0 {
        return Err(RequestError::WrongDirection { kind });
    }
    let len: u64 = data.iter().map(|s| u64::from(s.len)).sum();
    if len > limits.max_data_len {
        return Err(RequestError::TooLarge {
            len,
            max: limits.max_data_len,
        });
    }
    if !len.is_multiple_of(SECTOR_SIZE) {
        return Err(RequestError::UnalignedLength { len });
    }
    check_range(p.sector, len >> SECTOR_SHIFT, limits)?;
    req.sector = p.sector;
    req.len = len;
    req.segments = data;
    Ok(())
}

/// Check a get-id request's buffer and set its length and segments (at most the id's
/// bytes).
fn set_id(req: &mut Request, p: Payload) -> Result<(), RequestError> {
    let kind = req.kind;
    if p.out_len != 0 {
        return Err(RequestError::WrongDirection { kind });
    }
    if p.in_len == 0 {
        return Err(RequestError::MissingData { kind });
    }
    let (id_segs, _) = split_segments(&p.in_data, p.in_len.min(ID_BYTES as u64));
    req.len = p.in_len.min(ID_BYTES as u64);
    req.segments = id_segs;
    Ok(())
}

/// Read and check a discard's or write-zeroes' range payload and set the request's ranges
/// and total length.
fn set_ranges(
    req: &mut Request,
    p: &Payload,
    mem: &GuestMemoryMmap,
    limits: &Limits,
) -> Result<(), RequestError> {
    let kind = req.kind;
    if p.in_len != 0 {
        return Err(RequestError::WrongDirection { kind });
    }
    let out_len = p.out_len;
    if out_len == 0 || !out_len.is_multiple_of(DISCARD_SEGMENT_LEN) {
        return Err(RequestError::BadRangePayload { len: out_len });
    }
    let (max_seg, max_sectors) = if kind == RequestKind::Discard {
        (limits.max_discard_seg, limits.max_discard_sectors)
    } else {
        (limits.max_write_zeroes_seg, limits.max_write_zeroes_sectors)
    };
    let count = out_len / DISCARD_SEGMENT_LEN;
    if count > u64::from(max_seg) {
        return Err(RequestError::TooManyRanges {
            count,
            max: max_seg,
        });
    }
    let mut payload = vec![0u8; out_len as usize];
    gather(mem, &p.out_data, &mut payload)?;
    let mut total = 0u64;
    for raw in payload.chunks_exact(DISCARD_SEGMENT_LEN as usize) {
        let range = parse_range(raw, kind, max_sectors, limits)?;
        total += u64::from(range.num_sectors) << SECTOR_SHIFT;
        req.ranges.push(range);
    }
    req.len = total;
    Ok(())
}

/// Parse and check one 16-byte discard / write-zeroes range: flags allowed for `kind`, at
/// most `max_sectors` sectors, within the disk.
fn parse_range(
    raw: &[u8],
    kind: RequestKind,
    max_sectors: u32,
    limits: &Limits,
) -> Result<SectorRange, RequestError> {
    let (s, rest) = raw.split_at(8);
    let (n, f) = rest.split_at(4);
    let sector = u64::from_le_bytes(s.try_into().unwrap_or([0xff; 8]));
    let num_sectors = u32::from_le_bytes(n.try_into().unwrap_or([0xff; 4]));
    let flags = u32::from_le_bytes(f.try_into().unwrap_or([0xff; 4]));
    let allowed = if kind == RequestKind::WriteZeroes {
        VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
    } else {
        0
    };
    if flags & !allowed != 0 {
        return Err(RequestError::UnsupportedFlags(flags));
    }
    if num_sectors > max_sectors {
        return Err(RequestError::RangeTooLarge {
            sectors: num_sectors,
            max: max_sectors,
        });
    }
    check_range(sector, u64::from(num_sectors), limits)?;
    Ok(SectorRange {
        sector,
        num_sectors,
        unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
    })
}

/// Checks that `sectors` sectors from `sector` lie within the disk, without overflow.
fn check_range(sector: u64, sectors: u64, limits: &Limits) -> Result<(), RequestError> {
    let err = RequestError::OutOfRange {
        sector,
        sectors,
        capacity: limits.capacity_sectors,
    };
    // The byte offset must also fit in u64 (and in i64 for pread's off_t).
    let end = sector.checked_add(sectors).ok_or(err.clone())?;
    if end > limits.capacity_sectors || end > (i64::MAX as u64 >> SECTOR_SHIFT) {
        return Err(err);
    }
    Ok(())
}

/// Splits a segment list after `at` bytes.
fn split_segments(segs: &[Segment], at: u64) -> (Vec<Segment>, Vec<Segment>) {
    let mut head = Vec::new();
    let mut tail = Vec::new();
    let mut left = at;
    for s in segs {
        let len = u64::from(s.len);
        if len == 0 {
            continue;
        }
        if left >= len {
            head.push(*s);
            left -= len;
        } else if left == 0 {
            tail.push(*s);
        } else {
            // `left < len <= u32::MAX`, so both pieces fit in u32.
            let l = left as u32;
            head.push(Segment {
                addr: s.addr,
                len: l,
            });
            tail.push(Segment {
                addr: GuestAddress(s.addr.0.wrapping_add(u64::from(l))),
                len: s.len - l,
            });
            left = 0;
        }
    }
    (head, tail)
}

/// Reads `buf.len()` bytes from the start of `segs`.
fn gather(mem: &GuestMemoryMmap, segs: &[Segment], buf: &mut [u8]) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == buf.len() {
            break;
        }
        let take = (s.len as usize).min(buf.len() - done);
        let dst = buf
            .get_mut(done..done + take)
            .ok_or(RequestError::BadAddress {
                addr: s.addr.0,
                len: s.len,
            })?;
        mem.read_slice(dst, s.addr)
            .map_err(|_| RequestError::BadAddress {
                addr: s.addr.0,
                len: s.len,
            })?;
        done += take;
    }
    if done != buf.len() {
        return Err(RequestError::HeaderTooShort { len: done as u64 });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    pub(crate) const HDR: u64 = 0x1_0000;
    pub(crate) const DATA: u64 = 0x2_0000;
    pub(crate) const STATUS: u64 = 0x3_0000;
    pub(crate) const MEM_SIZE: usize = 0x10_0000;
    pub(crate) const UNMAPPED: u64 = 0x1000_0000;

    pub(crate) fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory")
    }

    /// 1024 sectors, read-write, queue size 16.
    pub(crate) fn limits() -> Limits {
        Limits::new(1024, false, 16)
    }

    pub(crate) fn r(addr: u64, len: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, 0, 0))
    }

    pub(crate) fn w(addr: u64, len: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(
            addr,
            len,
            VRING_DESC_F_WRITE as u16,
            0,
        ))
    }

    pub(crate) fn header(mem: &GuestMemoryMmap, req_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&req_type.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(HDR))
            .expect("write header");
    }

    fn parse_descs(mem: &GuestMemoryMmap, descs: &[RawDescriptor], limits: &Limits) -> Parsed {
        let q = MockSplitQueue::new(mem, 16);
        let chain = q.build_desc_chain(descs).expect("build chain");
        parse(chain, mem, limits)
    }

    fn ok(p: Parsed) -> Request {
        match p {
            Parsed::Request { req, status } => {
                assert_eq!(status, GuestAddress(STATUS));
                req
            }
            other => panic!("expected a valid request, got {other:?}"),
        }
    }

    fn rejected(p: Parsed) -> RequestError {
        match p {
            Parsed::Rejected { error, status } => {
                assert_eq!(status, GuestAddress(STATUS));
                error
            }
            other => panic!("expected a rejected request, got {other:?}"),
        }
    }

    fn unusable(p: Parsed) -> RequestError {
        match p {
            Parsed::Unusable(e) => {
                assert_eq!(e.status(), None);
                e
            }
            other => panic!("expected an unusable chain, got {other:?}"),
        }
    }

    fn range_payload(mem: &GuestMemoryMmap, ranges: &[(u64, u32, u32)]) -> u32 {
        let mut off = DATA;
        for &(sector, n, flags) in ranges {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&sector.to_le_bytes());
            b[8..12].copy_from_slice(&n.to_le_bytes());
            b[12..].copy_from_slice(&flags.to_le_bytes());
            mem.write_slice(&b, GuestAddress(off)).expect("payload");
            off += 16;
        }
        (ranges.len() * 16) as u32
    }

    // ---- valid requests ----

    #[test]
    fn valid_read_is_parsed() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 8);
        let req = ok(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 4096), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(req.kind, RequestKind::Read);
        assert_eq!(req.sector, 8);
        assert_eq!(req.len, 4096);
        assert_eq!(
            req.segments,
            vec![Segment {
                addr: GuestAddress(DATA),
                len: 4096
            }]
        );
    }

    #[test]
    fn valid_write_with_split_header_is_parsed() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 2);
        let req = ok(parse_descs(
            &m,
            &[
                r(HDR, 8),
                r(HDR + 8, 8),
                r(DATA, 512),
                r(DATA + 4096, 1024),
                w(STATUS, 1),
            ],
            &limits(),
        ));
        assert_eq!(req.kind, RequestKind::Write);
        assert_eq!(req.sector, 2);
        assert_eq!(req.len, 1536);
        assert_eq!(req.segments.len(), 2);
    }

    #[test]
    fn header_and_data_may_share_a_descriptor() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        // 16 header bytes + 512 data bytes in one readable descriptor.
        let q = MockSplitQueue::new(&m, 16);
        let chain = q
            .build_desc_chain(&[r(HDR, 16 + 512), w(STATUS, 1)])
            .expect("chain");
        let Parsed::Request { req, .. } = parse(chain, &m, &limits()) else {
            panic!("expected a request");
        };
        assert_eq!(
            req.segments,
            vec![Segment {
                addr: GuestAddress(HDR + 16),
                len: 512
            }]
        );
    }

    #[test]
    fn status_is_the_last_byte_of_the_last_descriptor() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        // Data and status in one writable descriptor of 513 bytes.
        let q = MockSplitQueue::new(&m, 16);
        let chain = q
            .build_desc_chain(&[r(HDR, 16), w(DATA, 513)])
            .expect("chain");
        match parse(chain, &m, &limits()) {
            Parsed::Request { req, status } => {
                assert_eq!(status, GuestAddress(DATA + 512));
                assert_eq!(req.len, 512);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn flush_and_get_id_are_parsed() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_FLUSH, 0);
        let req = ok(parse_descs(&m, &[r(HDR, 16), w(STATUS, 1)], &limits()));
        assert_eq!(req.kind, RequestKind::Flush);
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        let req = ok(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 64), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(req.kind, RequestKind::GetId);
        assert_eq!(req.len, 20);
    }

    #[test]
    fn discard_and_write_zeroes_ranges_are_parsed() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let n = range_payload(&m, &[(0, 8, 0), (100, 16, 0)]);
        let req = ok(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(req.kind, RequestKind::Discard);
        assert_eq!(req.ranges.len(), 2);
        assert_eq!(req.len, 24 * 512);
        header(&m, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let n = range_payload(&m, &[(10, 4, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)]);
        let req = ok(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            req.ranges,
            vec![SectorRange {
                sector: 10,
                num_sectors: 4,
                unmap: true
            }]
        );
    }

    #[test]
    fn request_data_helpers_copy_across_segments() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        m.write_slice(&[1u8; 512], GuestAddress(DATA)).expect("w");
        m.write_slice(&[2u8; 512], GuestAddress(DATA + 0x1000))
            .expect("w");
        let req = ok(parse_descs(
            &m,
            &[
                r(HDR, 16),
                r(DATA, 512),
                r(DATA + 0x1000, 512),
                w(STATUS, 1),
            ],
            &limits(),
        ));
        let mut buf = [0u8; 4];
        req.read_data(510, &mut buf)
            .expect("read across the boundary");
        assert_eq!(buf, [1, 1, 2, 2]);
        req.write_data(511, &[9, 9])
            .expect("write across the boundary");
        req.read_data(510, &mut buf).expect("read back");
        assert_eq!(buf, [1, 9, 9, 2]);
        assert!(req.read_data(1020, &mut [0u8; 8]).is_err(), "past the end");
    }

    // ---- one test per validation rule ----

    #[test]
    fn rule_empty_chain_is_unusable() {
        let m = mem();
        // A head that is an empty indirect table yields no descriptor at all.
        let head = RawDescriptor::from(SplitDescriptor::new(
            0x4_0000,
            0,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        assert_eq!(
            unusable(parse_descs(&m, &[head], &limits())),
            RequestError::EmptyChain
        );
    }

    #[test]
    fn rule_no_header_is_ioerr() {
        let m = mem();
        // Only a status descriptor: no readable bytes at all.
        let e = rejected(parse_descs(&m, &[w(STATUS, 1)], &limits()));
        assert_eq!(e, RequestError::HeaderWriteOnly);
        assert_eq!(e.status(), Some(Status::IoErr));
    }

    #[test]
    fn rule_header_too_short_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(&m, &[r(HDR, 8), w(STATUS, 1)], &limits()));
        assert_eq!(e, RequestError::HeaderTooShort { len: 8 });
        assert_eq!(e.status(), Some(Status::IoErr));
    }

    #[test]
    fn rule_write_only_header_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(
            &m,
            &[w(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::HeaderWriteOnly);
    }

    #[test]
    fn rule_status_missing_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        let e = unusable(parse_descs(&m, &[r(HDR, 16), r(DATA, 512)], &limits()));
        assert_eq!(e, RequestError::StatusNotWritable);
    }

    #[test]
    fn rule_status_not_writable_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = unusable(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), r(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::StatusNotWritable);
    }

    #[test]
    fn rule_status_of_length_zero_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = unusable(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(STATUS, 0)],
            &limits(),
        ));
        assert_eq!(e, RequestError::StatusEmpty);
    }

    #[test]
    fn rule_status_at_unmapped_address_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = unusable(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(UNMAPPED, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::StatusUnmapped { addr: UNMAPPED });
    }

    #[test]
    fn rule_readable_after_writable_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), r(DATA + 512, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::ReadableAfterWritable);
    }

    #[test]
    fn rule_read_with_device_readable_data_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::WrongDirection {
                kind: RequestKind::Read
            }
        );
    }

    #[test]
    fn rule_write_with_device_writable_data_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::WrongDirection {
                kind: RequestKind::Write
            }
        );
    }

    #[test]
    fn rule_flush_with_data_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_FLUSH, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::WrongDirection {
                kind: RequestKind::Flush
            }
        );
    }

    #[test]
    fn rule_sector_beyond_capacity_is_ioerr() {
        let m = mem();
        // Last sector is 1023: a 2-sector read at 1023 crosses the end.
        header(&m, VIRTIO_BLK_T_IN, 1023);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 1024), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::OutOfRange {
                sector: 1023,
                sectors: 2,
                capacity: 1024
            }
        );
        // Exactly the last sector is fine.
        let req = ok(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(req.sector, 1023);
    }

    #[test]
    fn rule_sector_overflow_is_ioerr() {
        let m = mem();
        let mut l = limits();
        l.capacity_sectors = u64::MAX;
        header(&m, VIRTIO_BLK_T_IN, u64::MAX);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            &l,
        ));
        assert!(matches!(e, RequestError::OutOfRange { .. }), "{e:?}");
        // A sector whose byte offset does not fit in off_t.
        header(&m, VIRTIO_BLK_T_IN, u64::MAX >> 9);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            &l,
        ));
        assert!(matches!(e, RequestError::OutOfRange { .. }), "{e:?}");
    }

    #[test]
    fn rule_length_not_multiple_of_512_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 100), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::UnalignedLength { len: 100 });
    }

    #[test]
    fn rule_chain_longer_than_queue_size_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let mut l = limits();
        l.max_chain_len = 4;
        let descs = [
            r(HDR, 16),
            w(DATA, 512),
            w(DATA + 512, 512),
            w(DATA + 1024, 512),
            w(STATUS, 1),
        ];
        let e = unusable(parse_descs(&m, &descs, &l));
        assert_eq!(e, RequestError::ChainTooLong { max: 4 });
    }

    #[test]
    fn rule_looping_chain_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let q = MockSplitQueue::new(&m, 16);
        let next = VRING_DESC_F_NEXT as u16;
        let wr = (VRING_DESC_F_WRITE | VRING_DESC_F_NEXT) as u16;
        // 0 -> 1 -> 2 -> 1 -> 2 ... never ends.
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(HDR, 16, next, 1)),
            RawDescriptor::from(SplitDescriptor::new(DATA, 512, wr, 2)),
            RawDescriptor::from(SplitDescriptor::new(STATUS, 1, wr, 1)),
        ];
        let chain = q.build_multiple_desc_chains(&descs).expect("chain");
        let e = unusable(parse(chain, &m, &limits()));
        assert_eq!(e, RequestError::ChainTooLong { max: 16 });
    }

    #[test]
    fn rule_next_index_out_of_table_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let q = MockSplitQueue::new(&m, 16);
        let descs = [RawDescriptor::from(SplitDescriptor::new(
            HDR,
            16,
            VRING_DESC_F_NEXT as u16,
            200,
        ))];
        let chain = q.build_multiple_desc_chains(&descs).expect("chain");
        assert_eq!(
            unusable(parse(chain, &m, &limits())),
            RequestError::BrokenChain
        );
    }

    #[test]
    fn rule_unmapped_data_buffer_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(UNMAPPED, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::BadAddress {
                addr: UNMAPPED,
                len: 512
            }
        );
        // A buffer that starts mapped but runs past the end of guest memory.
        let end = MEM_SIZE as u64 - 256;
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(end, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::BadAddress {
                addr: end,
                len: 512
            }
        );
    }

    #[test]
    fn rule_unmapped_header_is_ioerr() {
        let m = mem();
        let e = rejected(parse_descs(&m, &[r(UNMAPPED, 16), w(STATUS, 1)], &limits()));
        assert_eq!(
            e,
            RequestError::BadAddress {
                addr: UNMAPPED,
                len: 16
            }
        );
    }

    #[test]
    fn rule_indirect_table_out_of_range_is_unusable() {
        let m = mem();
        // Head refers to an indirect table outside guest memory.
        let head = RawDescriptor::from(SplitDescriptor::new(
            UNMAPPED,
            48,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        assert_eq!(
            unusable(parse_descs(&m, &[head], &limits())),
            RequestError::EmptyChain
        );
        // Table length not a multiple of 16.
        let head = RawDescriptor::from(SplitDescriptor::new(
            0x4_0000,
            40,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        assert_eq!(
            unusable(parse_descs(&m, &[head], &limits())),
            RequestError::EmptyChain
        );
        // Header, then a broken indirect descriptor: the chain is cut short.
        header(&m, VIRTIO_BLK_T_IN, 0);
        let q = MockSplitQueue::new(&m, 16);
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(SplitDescriptor::new(
                UNMAPPED,
                40,
                VRING_DESC_F_INDIRECT as u16,
                0,
            )),
        ];
        let chain = q.build_multiple_desc_chains(&descs).expect("chain");
        assert_eq!(
            unusable(parse(chain, &m, &limits())),
            RequestError::BrokenChain
        );
    }

    #[test]
    fn valid_indirect_chain_is_parsed() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 4);
        let table = 0x4_0000u64;
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        let entries = [
            SplitDescriptor::new(HDR, 16, next, 1),
            SplitDescriptor::new(DATA, 1024, wr | next, 2),
            SplitDescriptor::new(STATUS, 1, wr, 0),
        ];
        for (i, e) in entries.iter().enumerate() {
            m.write_obj(RawDescriptor::from(*e), GuestAddress(table + 16 * i as u64))
                .expect("table");
        }
        let head = RawDescriptor::from(SplitDescriptor::new(
            table,
            48,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        let req = ok(parse_descs(&m, &[head], &limits()));
        assert_eq!(
            (req.kind, req.sector, req.len),
            (RequestKind::Read, 4, 1024)
        );
    }

    #[test]
    fn rule_huge_total_length_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let mut l = limits();
        l.max_data_len = 4096;
        l.capacity_sectors = 1 << 30;
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), w(DATA, 8192), w(STATUS, 1)],
            &l,
        ));
        assert_eq!(
            e,
            RequestError::TooLarge {
                len: 8192,
                max: 4096
            }
        );
    }

    #[test]
    fn rule_chain_over_4gib_is_unusable() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        // The descriptor iterator stops when the chain exceeds 2^32 bytes in total.
        let e = unusable(parse_descs(
            &m,
            &[
                r(HDR, 16),
                w(DATA, u32::MAX - 8),
                w(DATA, 4096),
                w(STATUS, 1),
            ],
            &limits(),
        ));
        assert_eq!(e, RequestError::BrokenChain);
    }

    #[test]
    fn rule_unknown_type_is_unsupp() {
        let m = mem();
        header(&m, 77, 0);
        let e = rejected(parse_descs(&m, &[r(HDR, 16), w(STATUS, 1)], &limits()));
        assert_eq!(e, RequestError::UnknownType(77));
        assert_eq!(e.status(), Some(Status::Unsupp));
    }

    #[test]
    fn rule_write_on_read_only_disk_is_ioerr() {
        let m = mem();
        let mut l = limits();
        l.read_only = true;
        header(&m, VIRTIO_BLK_T_OUT, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)],
            &l,
        ));
        assert_eq!(
            e,
            RequestError::ReadOnly {
                kind: RequestKind::Write
            }
        );
        assert_eq!(e.status(), Some(Status::IoErr));
        for t in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
            header(&m, t, 0);
            let n = range_payload(&m, &[(0, 8, 0)]);
            let e = rejected(parse_descs(&m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)], &l));
            assert!(matches!(e, RequestError::ReadOnly { .. }), "{e:?}");
        }
        // Reads and flushes still work.
        header(&m, VIRTIO_BLK_T_FLUSH, 0);
        ok(parse_descs(&m, &[r(HDR, 16), w(STATUS, 1)], &l));
    }

    #[test]
    fn rule_get_id_without_buffer_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        let e = rejected(parse_descs(&m, &[r(HDR, 16), w(STATUS, 1)], &limits()));
        assert_eq!(
            e,
            RequestError::MissingData {
                kind: RequestKind::GetId
            }
        );
    }

    #[test]
    fn rule_discard_payload_not_multiple_of_16_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, 10), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::BadRangePayload { len: 10 });
        let e = rejected(parse_descs(&m, &[r(HDR, 16), w(STATUS, 1)], &limits()));
        assert_eq!(e, RequestError::BadRangePayload { len: 0 });
    }

    #[test]
    fn rule_discard_with_writable_buffer_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let n = range_payload(&m, &[(0, 8, 0)]);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(DATA + 512, 512), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::WrongDirection {
                kind: RequestKind::Discard
            }
        );
    }

    #[test]
    fn rule_too_many_discard_ranges_is_ioerr() {
        let m = mem();
        let mut l = limits();
        l.max_discard_seg = 2;
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let n = range_payload(&m, &[(0, 1, 0), (1, 1, 0), (2, 1, 0)]);
        let e = rejected(parse_descs(&m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)], &l));
        assert_eq!(e, RequestError::TooManyRanges { count: 3, max: 2 });
    }

    #[test]
    fn rule_discard_range_too_large_is_ioerr() {
        let m = mem();
        let mut l = limits();
        l.max_write_zeroes_sectors = 8;
        header(&m, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let n = range_payload(&m, &[(0, 16, 0)]);
        let e = rejected(parse_descs(&m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)], &l));
        assert_eq!(
            e,
            RequestError::RangeTooLarge {
                sectors: 16,
                max: 8
            }
        );
    }

    #[test]
    fn rule_discard_range_beyond_capacity_is_ioerr() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let n = range_payload(&m, &[(1020, 8, 0)]);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(
            e,
            RequestError::OutOfRange {
                sector: 1020,
                sectors: 8,
                capacity: 1024
            }
        );
        let n = range_payload(&m, &[(u64::MAX - 2, 8, 0)]);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert!(matches!(e, RequestError::OutOfRange { .. }), "{e:?}");
    }

    #[test]
    fn rule_discard_with_unmap_flag_is_unsupp() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        let n = range_payload(&m, &[(0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)]);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::UnsupportedFlags(1));
        assert_eq!(e.status(), Some(Status::Unsupp));
    }

    #[test]
    fn rule_write_zeroes_reserved_flags_are_unsupp() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let n = range_payload(&m, &[(0, 8, 0x8000_0001)]);
        let e = rejected(parse_descs(
            &m,
            &[r(HDR, 16), r(DATA, n), w(STATUS, 1)],
            &limits(),
        ));
        assert_eq!(e, RequestError::UnsupportedFlags(0x8000_0001));
    }
}
