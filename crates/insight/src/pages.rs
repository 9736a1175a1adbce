//! Page ownership: what the guest kernel says a block request's pages hold.
//!
//! Checksums tie a block write to a write syscall only when the plugin saw the bytes at a
//! syscall: not for io_uring or AIO (buffers named in memory, not in arguments), stores into
//! a shared file mapping (no syscall at all), or bytes beyond the plugin's per-call cap. The
//! guest kernel knows in every case: writeback hands the page cache's own pages to the device,
//! and each page's `struct page` names the file (`mapping->host`) and the offset (`index`).
//! The engine asks a [`PageOwnerSource`] (the launcher's reads guest memory with the kernel
//! profile: `vmsight_introspect::kernel::pages`) about the chunks no checksum matched.

use vmsight_blockdev::request::Segment;

pub use vmsight_introspect::kernel::pages::PageOwner;

use crate::CHUNK;

/// Answers who owns a guest-physical page. Called on the block backend's threads with the
/// engine's lock held, so it must be quick (a few reads of guest memory) and never block on
/// the guest.
pub trait PageOwnerSource: Send + Sync {
    /// The owner of the page at guest-physical address `gpa` (page-aligned).
    fn owner(&self, gpa: u64) -> PageOwner;
}

/// The guest-physical page of each 4 KiB chunk of a request's data (`len` bytes in `segments`): `Some` when the chunk is one
/// whole, page-aligned page of one segment (how the guest's block layer passes page-cache
/// pages), `None` otherwise (a bounce buffer, a chunk spanning segments, a partial chunk).
pub fn chunk_pages(segments: &[Segment], len: u64) -> Vec<Option<u64>> {
    let n = len.div_ceil(CHUNK).min(1 << 20) as usize; // guarded by the request's limits
    let mut out = vec![None; n];
    let mut at = 0u64; // data offset of the segment's start
    for seg in segments {
        let (gpa, end) = (seg.addr.0, at + u64::from(seg.len));
        // Chunks starting inside this segment.
        let mut c = at.div_ceil(CHUNK) * CHUNK;
        while c < end && c < len {
            let whole = c + CHUNK <= end && c + CHUNK <= len;
            let addr = gpa.wrapping_add(c - at);
            if let Some(slot) = out.get_mut((c / CHUNK) as usize) {
                *slot = (whole && addr % CHUNK == 0).then_some(addr);
            }
            c += CHUNK;
        }
        at = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_aligned_pages_are_named_and_the_rest_is_not() {
        // Segments: two aligned pages, then one page split over two segments, then a
        // misaligned page and a partial tail.
        let segs = [
            (0x10_0000u64, 8192u32),
            (0x20_0000, 2048),
            (0x30_0800, 2048),
            (0x40_0100, 4096),
            (0x50_0000, 512),
        ];
        let segs: Vec<Segment> = segs
            .iter()
            .map(|&(a, len)| Segment {
                addr: vm_memory::GuestAddress(a),
                len,
            })
            .collect();
        let len = segs.iter().map(|s| u64::from(s.len)).sum();
        assert_eq!(
            chunk_pages(&segs, len),
            vec![Some(0x10_0000), Some(0x10_1000), None, None, None]
        );
    }
}
