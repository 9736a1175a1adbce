//! The swap region: a memfd that vmsight creates, maps and shares with QEMU (`ivshmem-plain`,
//! so the guest module sees it as a PCI BAR), laid out by [`vmsight_proto::sym::swapr::Layout`].
//!
//! Everything in it can be written by the guest at any time, so every access goes through
//! bounds-checked atomics or volatile word copies: a hostile guest can garble its own swapped
//! pages, never make vmsight read or write outside the mapping.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64};

use vmsight_proto::sym::swapr::{Layout, PAGE};
use vmsight_proto::sym::SWAPHDR;

use crate::error::SwapError;

/// Words of a page.
const WORDS: usize = (PAGE / 8) as usize;

/// The mapped region.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    file: File,
    layout: Layout,
}

// SAFETY: the mapping lives as long as the Region and is only accessed through atomics and
// volatile copies, which are sound from any thread.
unsafe impl Send for Region {}
// SAFETY: as above; no `&mut` into the mapping is ever handed out.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.len)
            .field("layout", &self.layout)
            .finish()
    }
}

impl Region {
    /// Creates a zeroed region of `layout.region_size` bytes (sparse: memory is used only
    /// where pages are written).
    pub fn create(name: &str, layout: Layout) -> Result<Self, SwapError> {
        let bytes = layout.region_size;
        let err = |source| SwapError::Region { bytes, source };
        let cname = std::ffi::CString::new(format!("vmsight-swap-{name}"))
            .map_err(|_| err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just created and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(bytes).map_err(err)?;
        let len =
            usize::try_from(bytes).map_err(|_| err(std::io::ErrorKind::InvalidInput.into()))?;
        // SAFETY: a fresh shared mapping of the whole file; checked for MAP_FAILED below.
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
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            file,
            layout,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// A path QEMU can open to map the same memory (`memory-backend-file,mem-path=`).
    pub fn qemu_path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.file.as_raw_fd()
        ))
    }

    /// The `u32` at byte `off`, if it lies in the region and is aligned.
    pub fn u32_at(&self, off: u64) -> Option<&AtomicU32> {
        let off = usize::try_from(off).ok()?;
        if !off.is_multiple_of(4) || off.checked_add(4)? > self.len {
            return None;
        }
        // SAFETY: in bounds and aligned (the mapping is page-aligned); AtomicU32 has the
        // layout of u32 and tolerates concurrent access from the guest.
        Some(unsafe { &*self.ptr.add(off).cast::<AtomicU32>() })
    }

    /// The `u64` at byte `off`, if it lies in the region and is aligned.
    pub fn u64_at(&self, off: u64) -> Option<&AtomicU64> {
        let off = usize::try_from(off).ok()?;
        if !off.is_multiple_of(8) || off.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and aligned; AtomicU64 has the layout of u64.
        Some(unsafe { &*self.ptr.add(off).cast::<AtomicU64>() })
    }

    /// A header field (a programming error if the name is not in the table).
    pub fn hdr32(&self, name: &str) -> &AtomicU32 {
        self.u32_at(SWAPHDR.at(name) as u64)
            .unwrap_or_else(|| panic!("header field {name} is not a u32 in the region"))
    }

    /// A 64-bit header field.
    pub fn hdr64(&self, name: &str) -> &AtomicU64 {
        self.u64_at(SWAPHDR.at(name) as u64)
            .unwrap_or_else(|| panic!("header field {name} is not a u64 in the region"))
    }

    /// Pointer to the 4 KiB page at byte `off`, if it lies in the region and is page-aligned.
    fn page_ptr(&self, off: u64) -> Option<*mut u64> {
        let o = usize::try_from(off).ok()?;
        if !off.is_multiple_of(PAGE) || o.checked_add(PAGE as usize)? > self.len {
            return None;
        }
        // SAFETY: in bounds (checked above).
        Some(unsafe { self.ptr.add(o).cast::<u64>() })
    }

    /// Copies the page at `off` into `buf` (4 KiB) with volatile word reads: the guest may be
    /// writing it (only a guest breaking the protocol does; it gets garbage, vmsight does not
    /// care). False if `off` is not a page of the region or `buf` is not a page.
    pub fn read_page(&self, off: u64, buf: &mut [u8]) -> bool {
        let (Some(p), true) = (self.page_ptr(off), buf.len() == PAGE as usize) else {
            return false;
        };
        for (i, chunk) in buf.chunks_exact_mut(8).enumerate().take(WORDS) {
            // SAFETY: i < WORDS keeps the read inside the page checked by page_ptr.
            let w = unsafe { std::ptr::read_volatile(p.add(i)) };
            chunk.copy_from_slice(&w.to_ne_bytes());
        }
        true
    }

    /// Copies `data` (4 KiB) into the page at `off` with volatile word writes.
    pub fn write_page(&self, off: u64, data: &[u8]) -> bool {
        let (Some(p), true) = (self.page_ptr(off), data.len() == PAGE as usize) else {
            return false;
        };
        for (i, chunk) in data.chunks_exact(8).enumerate().take(WORDS) {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            // SAFETY: i < WORDS keeps the write inside the page checked by page_ptr.
            unsafe { std::ptr::write_volatile(p.add(i), u64::from_ne_bytes(w)) };
        }
        true
    }

    /// Gives the memory of the page at `off` back to the host (the page reads as zeros after).
    pub fn punch(&self, off: u64) -> std::io::Result<()> {
        if self.page_ptr(off).is_none() {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        let (o, l) = (off as libc::off_t, PAGE as libc::off_t);
        // SAFETY: fallocate on our own memfd; the range is inside it.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                o,
                l,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Which of the `n` pages from `off` hold host memory now (`mincore` on the mapping: a
    /// punched or never-written page is not resident). Empty if the range is not inside the
    /// region or the call fails.
    pub fn resident_pages(&self, off: u64, n: usize) -> Vec<bool> {
        let bytes = n.saturating_mul(PAGE as usize);
        let (Some(p), Some(end)) = (self.page_ptr(off), (off as usize).checked_add(bytes)) else {
            return Vec::new();
        };
        if n == 0 || end > self.len {
            return Vec::new();
        }
        let mut vec = vec![0u8; n];
        // SAFETY: [p, p + bytes) lies inside our mapping (checked above) and `vec` has one
        // byte per page of it, as mincore requires.
        let r = unsafe { libc::mincore(p.cast(), bytes, vec.as_mut_ptr()) };
        if r < 0 {
            return Vec::new();
        }
        vec.into_iter().map(|b| b & 1 == 1).collect()
    }

    /// Bytes of host memory the region holds now (its resident pages in the memfd).
    pub fn resident_bytes(&self) -> u64 {
        // SAFETY: fstat on our own fd into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(self.file.as_raw_fd(), &mut st) } < 0 {
            return 0;
        }
        (st.st_blocks as u64) * 512
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in create; nothing borrows it any more
        // (borrows of the atomics are tied to &self).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> Region {
        Region::create("t", Layout::new(64, 64).expect("layout")).expect("region")
    }

    #[test]
    fn pages_round_trip_and_out_of_bounds_is_refused() {
        let r = region();
        let l = *r.layout();
        let page: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
        assert!(r.write_page(l.slot_data(3), &page));
        let mut back = vec![0; 4096];
        assert!(r.read_page(l.slot_data(3), &mut back));
        assert_eq!(back, page);
        assert!(!r.read_page(l.region_size, &mut back));
        assert!(!r.read_page(l.slot_data(1) + 8, &mut back), "unaligned");
        assert!(!r.write_page(l.slot_data(1), &page[..100]));
        assert!(r.u32_at(l.region_size - 4).is_some());
        assert!(r.u32_at(l.region_size).is_none());
        assert!(r.u64_at(3).is_none());
    }

    #[test]
    fn residency_follows_writes_and_punches() {
        let r = region();
        let l = *r.layout();
        assert_eq!(r.resident_pages(l.slot_data(0), 4), vec![false; 4]);
        assert!(r.write_page(l.slot_data(1), &[7u8; 4096]));
        assert!(r.write_page(l.slot_data(3), &[7u8; 4096]));
        assert_eq!(
            r.resident_pages(l.slot_data(0), 4),
            [false, true, false, true]
        );
        r.punch(l.slot_data(1)).expect("punch");
        assert_eq!(
            r.resident_pages(l.slot_data(0), 4),
            [false, false, false, true]
        );
        assert!(
            r.resident_pages(l.region_size - PAGE, 2).is_empty(),
            "past the end"
        );
        assert!(
            r.resident_pages(l.slot_data(0) + 8, 1).is_empty(),
            "unaligned"
        );
    }

    #[test]
    fn punched_pages_read_zero_and_give_memory_back() {
        let r = region();
        let off = r.layout().slot_data(5);
        assert!(r.write_page(off, &[7u8; 4096]));
        let before = r.resident_bytes();
        r.punch(off).expect("punch");
        assert!(r.resident_bytes() < before);
        let mut back = vec![1; 4096];
        assert!(r.read_page(off, &mut back));
        assert!(back.iter().all(|&b| b == 0));
    }
}
