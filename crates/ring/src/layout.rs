//! On-file layout of the channel: header, per-vCPU counter blocks and per-vCPU rings.
//!
//! Everything lives in one file mapped `MAP_SHARED` by both processes. All multi-byte values are
//! native-endian (both sides run on the same host). Every field another process may write is an
//! atomic, so neither side ever performs a non-atomic access to memory the other side writes,
//! except the record slots, which are copied with volatile accesses and whose every bit pattern
//! is a valid [`crate::Record`].
//!
//! ```text
//! offset 0                      header (one 4 KiB page)
//! offset CONTROL_OFFSET         control area (two pages, see [`crate::control`]):
//!     +0     monitor filters (vmsight writes, seqlock) and their generation
//!     +2048  vCPU redirect mailbox (see [`crate::redirect`])
//!     +4096  plugin report (plugin writes): applied generation, monitored TGIDs (seqlock)
//! offset COUNTERS_OFFSET        max_vcpus counter blocks, COUNTER_STRIDE (256) bytes each
//! offset rings_offset           max_vcpus rings, ring_stride bytes each (page aligned):
//!     +0    head  (AtomicU64, producer writes)   own 128-byte line pair
//!     +128  tail  (AtomicU64, consumer writes)   own 128-byte line pair
//!     +256  ring_records slots of RECORD_SIZE (128) bytes
//! ```

use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::Record;

/// `b"VMSRING\0"` read as a little-endian u64; written last by the creator.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VMSRING\0");
/// Version of this layout; bumped on any incompatible change of header, counters or records.
/// (5: the redirect mailbox gained `at_check`, which moved the arm-word addresses.)
pub const LAYOUT_VERSION: u32 = 5;
/// Size of the header region (one page so the counters start page aligned).
pub const HEADER_SIZE: u64 = 4096;
/// Offset of the control area (monitor filters and the plugin's report).
pub const CONTROL_OFFSET: u64 = HEADER_SIZE;
/// Size of the control area: one page of filters, one page of plugin report.
pub const CONTROL_SIZE: u64 = 2 * 4096;
/// Offset of the first per-vCPU counter block.
pub const COUNTERS_OFFSET: u64 = CONTROL_OFFSET + CONTROL_SIZE;
/// Size of one per-vCPU counter block: four cache lines (32 counters), a multiple of 128 so
/// the adjacent-line prefetcher of one vCPU's counters never drags in another vCPU's line.
pub const COUNTER_STRIDE: u64 = 256;
/// Number of u64 cells in a counter block.
pub const COUNTER_CELLS: usize = (COUNTER_STRIDE / 8) as usize;
/// Size of the per-ring control area (head and tail, each on its own 128-byte pair of lines).
pub const RING_CONTROL_SIZE: u64 = 256;
/// Size of one record slot.
pub const RECORD_SIZE: u64 = 128;
/// Largest accepted vCPU count (QEMU's x86 limit is far higher, but a channel this wide is
/// already gigabytes with big rings; the bound keeps size arithmetic trivially safe).
pub const MAX_VCPUS: u32 = 1024;
/// Smallest accepted ring capacity in records.
pub const MIN_RING_RECORDS: u32 = 2;
/// Largest accepted ring capacity in records (2^22 records = 512 MiB per vCPU).
pub const MAX_RING_RECORDS: u32 = 1 << 22;

const PAGE: u64 = 4096;

/// Consumer (vmsight) liveness states stored in [`Header::consumer_state`].
pub mod consumer_state {
    /// The file is being initialised or was never owned by a consumer.
    pub const NONE: u32 = 0;
    /// A `ChannelHost` holds the file open.
    pub const ALIVE: u32 = 1;
    /// The `ChannelHost` was dropped.
    pub const CLOSED: u32 = 2;
}

/// Producer (plugin) liveness states stored in [`Header::producer_state`].
pub mod producer_state {
    /// No plugin has attached yet.
    pub const NONE: u32 = 0;
    /// The plugin attached and is running.
    pub const RUNNING: u32 = 1;
    /// The plugin ran its exit hook: counters are final.
    pub const FINISHED: u32 = 2;
}

/// The header at offset 0. Every field is atomic because the file is shared with another
/// process; the layout fields are written once by the creator before [`Header::magic`].
#[repr(C)]
pub struct Header {
    /// [`MAGIC`]; stored last (Release) by the creator, so a reader that sees it (Acquire) sees
    /// an initialised header.
    pub magic: AtomicU64,
    /// [`LAYOUT_VERSION`].
    pub layout_version: AtomicU32,
    /// [`RECORD_SIZE`].
    pub record_size: AtomicU32,
    /// Number of per-vCPU counter blocks and rings.
    pub max_vcpus: AtomicU32,
    /// Records per ring (power of two).
    pub ring_records: AtomicU32,
    /// [`HEADER_SIZE`].
    pub header_size: AtomicU32,
    /// [`COUNTER_STRIDE`].
    pub counter_stride: AtomicU32,
    /// Offset of counter block 0.
    pub counters_offset: AtomicU64,
    /// Offset of ring 0.
    pub rings_offset: AtomicU64,
    /// Distance between rings.
    pub ring_stride: AtomicU64,
    /// Size of the whole file.
    pub total_size: AtomicU64,
    /// See [`consumer_state`].
    pub consumer_state: AtomicU32,
    /// PID of the consumer process.
    pub consumer_pid: AtomicU32,
    /// See [`producer_state`].
    pub producer_state: AtomicU32,
    /// PID of the producer (QEMU) process.
    pub producer_pid: AtomicU32,
    /// The QEMU plugin API version the plugin was built for.
    pub plugin_api_version: AtomicU32,
    /// Number of vCPUs the plugin has seen initialised.
    pub plugin_vcpus: AtomicU32,
    /// Plugin option bits ([`plugin_flags`]).
    pub plugin_flags: AtomicU32,
    /// Reserved, zero.
    pub reserved0: AtomicU32,
    /// CLOCK_MONOTONIC nanoseconds of the last counter publication by the plugin.
    pub producer_heartbeat_ns: AtomicU64,
    /// How many times a plugin attached to this file.
    pub attach_count: AtomicU64,
    /// [`CONTROL_OFFSET`].
    pub control_offset: AtomicU64,
    /// [`CONTROL_SIZE`].
    pub control_size: AtomicU64,
}

/// Bits of [`Header::plugin_flags`].
pub mod plugin_flags {
    /// The plugin pushes syscall records (`records=on`).
    pub const RECORDS: u32 = 1 << 0;
    /// The plugin has a kernel profile (`profile=`) and can monitor tasks; without it only
    /// counting works.
    pub const PROFILE: u32 = 1 << 1;
    /// Block-tag channel only: the kernel profile has the block submission path and the
    /// plugin hooks it (FoxyIdle attribution works).
    pub const BLOCK_TAGS: u32 = 1 << 2;
    /// Block-tag channel only: the plugin hooks the prctl entry (guest declarations work).
    pub const DECLARATIONS: u32 = 1 << 3;
    /// The plugin instruments translated code (it counts `syscall` instructions at least).
    /// Without it the plugin is dormant: no translation callback, so QEMU translates exactly
    /// as without a plugin, and nothing is counted.
    pub const TRANSLATES: u32 = 1 << 4;
}

const _: () = assert!(std::mem::size_of::<Header>() as u64 <= HEADER_SIZE);
const _: () = assert!(std::mem::size_of::<Record>() as u64 == RECORD_SIZE);

/// Why a channel geometry is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// The vCPU count is 0 or above [`MAX_VCPUS`].
    #[error("max_vcpus is {0}, but it must be between 1 and {MAX_VCPUS}")]
    VcpuCount(u32),
    /// The ring length is not a power of two in range.
    #[error(
        "ring_records is {0}, but it must be a power of two between {MIN_RING_RECORDS} and \
         {MAX_RING_RECORDS}"
    )]
    RingRecords(u32),
    /// The channel would not fit this process's address space.
    #[error("{0} bytes do not fit the address space")]
    TooLarge(u64),
}

/// Geometry of a channel, computed from the two free parameters. Both sides compute it locally
/// and never index with offsets read back from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Number of vCPU slots.
    pub max_vcpus: u32,
    /// Records per ring (power of two).
    pub ring_records: u32,
    /// Offset of ring 0.
    pub rings_offset: u64,
    /// Distance between rings.
    pub ring_stride: u64,
    /// Size of the file.
    pub total_size: u64,
}

impl Geometry {
    /// Computes the layout, or explains which parameter is out of range.
    pub fn new(max_vcpus: u32, ring_records: u32) -> Result<Self, GeometryError> {
        if max_vcpus == 0 || max_vcpus > MAX_VCPUS {
            return Err(GeometryError::VcpuCount(max_vcpus));
        }
        if !(MIN_RING_RECORDS..=MAX_RING_RECORDS).contains(&ring_records)
            || !ring_records.is_power_of_two()
        {
            return Err(GeometryError::RingRecords(ring_records));
        }
        // The bounds above keep every product far below 2^63: no overflow possible.
        let rings_offset = align_up(COUNTERS_OFFSET + u64::from(max_vcpus) * COUNTER_STRIDE);
        let ring_stride = align_up(RING_CONTROL_SIZE + u64::from(ring_records) * RECORD_SIZE);
        let total_size = rings_offset + u64::from(max_vcpus) * ring_stride;
        Ok(Self {
            max_vcpus,
            ring_records,
            rings_offset,
            ring_stride,
            total_size,
        })
    }

    /// Offset of the counter block of `vcpu` (caller checked `vcpu < max_vcpus`).
    pub fn counters_at(&self, vcpu: u32) -> u64 {
        COUNTERS_OFFSET + u64::from(vcpu) * COUNTER_STRIDE
    }

    /// Offset of the ring control area of `vcpu` (caller checked `vcpu < max_vcpus`).
    pub fn ring_at(&self, vcpu: u32) -> u64 {
        self.rings_offset + u64::from(vcpu) * self.ring_stride
    }

    /// Index mask of a ring.
    pub fn mask(&self) -> u64 {
        u64::from(self.ring_records) - 1
    }
}

fn align_up(v: u64) -> u64 {
    v.div_ceil(PAGE) * PAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_offsets_match_the_documented_layout() {
        use std::mem::offset_of;
        assert_eq!(offset_of!(Header, layout_version), 8);
        assert_eq!(offset_of!(Header, max_vcpus), 16);
        assert_eq!(offset_of!(Header, ring_records), 20);
        assert_eq!(offset_of!(Header, counters_offset), 32);
        assert_eq!(offset_of!(Header, rings_offset), 40);
        assert_eq!(offset_of!(Header, total_size), 56);
        assert_eq!(offset_of!(Header, consumer_state), 64);
        assert_eq!(offset_of!(Header, producer_state), 72);
        assert_eq!(offset_of!(Header, plugin_api_version), 80);
        assert_eq!(offset_of!(Header, plugin_flags), 88);
        assert_eq!(offset_of!(Header, producer_heartbeat_ns), 96);
        assert_eq!(offset_of!(Header, attach_count), 104);
        assert_eq!(offset_of!(Header, control_offset), 112);
        assert_eq!(offset_of!(Header, control_size), 120);
        assert_eq!(offset_of!(Record, payload), 32);
    }

    #[test]
    fn geometry_is_page_aligned_and_bounded() {
        let g = Geometry::new(2, 1024).expect("valid geometry");
        assert_eq!(g.rings_offset % PAGE, 0);
        assert_eq!(g.ring_stride % PAGE, 0);
        assert_eq!(g.total_size, g.rings_offset + 2 * g.ring_stride);
        assert!(Geometry::new(0, 1024).is_err());
        assert!(Geometry::new(2, 1000).is_err());
        assert!(Geometry::new(2, 1).is_err());
        assert!(Geometry::new(MAX_VCPUS + 1, 1024).is_err());
        assert!(Geometry::new(MAX_VCPUS, MAX_RING_RECORDS).is_ok());
    }
}
