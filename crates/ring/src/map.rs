//! The shared mapping and typed accessors into it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use crate::control::{FilterArea, ReportArea};
use crate::layout::{Geometry, Header, CONTROL_OFFSET, COUNTER_CELLS, RING_CONTROL_SIZE};
use crate::Record;

/// One per-vCPU counter block (two cache lines).
#[repr(C, align(256))]
pub(crate) struct CounterBlock {
    pub(crate) cells: [AtomicU64; COUNTER_CELLS],
}

/// A `MAP_SHARED` mapping of a whole channel file plus the geometry it was validated against.
///
/// All accessors index with the locally computed [`Geometry`], never with offsets read from the
/// file, and every accessor bounds-checks its vCPU argument, so no value another process writes
/// can move an access outside the mapping.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    pub(crate) geometry: Geometry,
}

// SAFETY: the mapping is plain memory; all shared fields are accessed through atomics, and
// record slots only through volatile copies of a plain-old-data type, so sharing the pointer
// between threads adds no hazard beyond the SPSC protocol the ring types implement.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`: `&Mapping` only hands out atomics and raw slot pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` read-write and shared. `len` must not exceed the file size
    /// (the caller checked it), or touching the tail would raise SIGBUS.
    pub(crate) fn map(file: &File, len: usize, geometry: Geometry) -> std::io::Result<Self> {
        if len == 0 || (geometry.total_size as usize) > len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "mapping length does not cover the channel geometry",
            ));
        }
        // SAFETY: a fresh mapping (addr NULL) of a regular file we hold open; the kernel
        // validates fd, length and protection and reports failure as MAP_FAILED. No
        // MAP_POPULATE: prefaulting made every ring resident at start (16 MiB for two vCPUs,
        // in vmsight and in QEMU) although a VM that monitors nothing never writes a record;
        // a ring's page is now allocated by the producer's first record in it (one minor fault
        // per 32 records, on the first lap only).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap returned a null pointer"))?;
        Ok(Self { ptr, len, geometry })
    }

    /// The header at offset 0.
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping is at least `total_size >= HEADER_SIZE >= size_of::<Header>()`
        // bytes, page aligned (so aligned for Header), and Header consists only of atomics, for
        // which any bit pattern is valid and concurrent access from other processes is sound.
        unsafe { &*self.ptr.as_ptr().cast::<Header>() }
    }

    /// The filter half of the control area. Only valid on a full mapping (not the
    /// header-only probe mapping used during attach).
    pub(crate) fn filters(&self) -> &FilterArea {
        debug_assert!(self.len as u64 >= CONTROL_OFFSET + 4096);
        // SAFETY: every full mapping covers `total_size`, which the geometry places beyond the
        // control area (CONTROL_OFFSET + CONTROL_SIZE <= COUNTERS_OFFSET <= rings_offset);
        // the offset is page aligned; FilterArea holds only atomics (any bits valid, shared
        // access sound).
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(CONTROL_OFFSET as usize)
                .cast::<FilterArea>()
        }
    }

    /// The redirect mailbox in the filter page (full mappings only).
    pub(crate) fn mailbox(&self) -> &crate::redirect::Mailbox {
        debug_assert!(self.len as u64 >= CONTROL_OFFSET + 4096);
        // SAFETY: as for `filters`: the mailbox lies in the filter page after FilterArea
        // (checked at compile time in `redirect`), 8-byte aligned, and holds only atomics.
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .add((CONTROL_OFFSET + crate::redirect::MAILBOX_OFFSET) as usize)
                .cast::<crate::redirect::Mailbox>()
        }
    }

    /// The plugin-report half of the control area (full mappings only).
    pub(crate) fn report(&self) -> &ReportArea {
        debug_assert!(self.len as u64 >= CONTROL_OFFSET + 8192);
        // SAFETY: as for `filters`, one page further, still inside the control area.
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(CONTROL_OFFSET as usize + 4096)
                .cast::<ReportArea>()
        }
    }

    /// Counter block of `vcpu`, or `None` if out of range.
    pub(crate) fn counters(&self, vcpu: u32) -> Option<&CounterBlock> {
        if vcpu >= self.geometry.max_vcpus {
            return None;
        }
        let off = self.geometry.counters_at(vcpu) as usize;
        // SAFETY: `vcpu < max_vcpus`, so the block lies inside the counters region, which the
        // geometry places inside `total_size <= len`; offsets are multiples of 256 from a page
        // aligned base, matching CounterBlock's alignment; it contains only atomics.
        Some(unsafe { &*self.ptr.as_ptr().add(off).cast::<CounterBlock>() })
    }

    /// Head (producer index) of ring `vcpu`.
    pub(crate) fn head(&self, vcpu: u32) -> Option<&AtomicU64> {
        self.control(vcpu, 0)
    }

    /// Tail (consumer index) of ring `vcpu`.
    pub(crate) fn tail(&self, vcpu: u32) -> Option<&AtomicU64> {
        self.control(vcpu, 128)
    }

    fn control(&self, vcpu: u32, delta: u64) -> Option<&AtomicU64> {
        if vcpu >= self.geometry.max_vcpus {
            return None;
        }
        let off = (self.geometry.ring_at(vcpu) + delta) as usize;
        // SAFETY: `vcpu < max_vcpus` keeps the ring control area inside the mapping; ring
        // offsets are page aligned and `delta` is 0 or 128, so the AtomicU64 is aligned.
        Some(unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() })
    }

    /// Pointer to slot 0 of ring `vcpu`; slots `0..ring_records` follow it.
    pub(crate) fn slots(&self, vcpu: u32) -> Option<*mut Record> {
        if vcpu >= self.geometry.max_vcpus {
            return None;
        }
        let off = (self.geometry.ring_at(vcpu) + RING_CONTROL_SIZE) as usize;
        // SAFETY: in bounds as above; the pointer is only used with indices masked by
        // `ring_records - 1`, which the geometry reserved after the control area.
        Some(unsafe { self.ptr.as_ptr().add(off).cast::<Record>() })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region returned by mmap; no references derived from it
        // outlive `self` because every handle holds an `Arc<Mapping>`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}
