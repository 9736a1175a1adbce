//! The shared region: a memfd that vmsight creates, maps, and hands to QEMU (the
//! `ivshmem-doorbell` device's BAR2). The guest module writes it concurrently, so every access
//! is an atomic or volatile load/store at an offset from the layout tables
//! (`vmsight_proto::sym`), bounds-checked against the region's size.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use vmsight_proto::sym::REGION_SIZE;

use super::SymError;

/// The mapped region.
pub struct Region {
    ptr: NonNull<u8>,
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory accessed only through atomics and volatile copies; the
// pointer stays valid until drop, which needs `&mut self`.
unsafe impl Send for Region {}
// SAFETY: as above: no method hands out a plain reference into the mapping.
unsafe impl Sync for Region {}

impl Region {
    /// Creates the memfd (sealed against shrinking, so a mapping can never fault) and maps it.
    pub fn create(vm: &str) -> Result<Region, SymError> {
        let err = |what: &'static str| {
            let source = std::io::Error::last_os_error();
            SymError::Region {
                vm: vm.to_owned(),
                what,
                source,
            }
        };
        let name = CString::new("vmsight-sym").unwrap_or_default();
        // SAFETY: `name` is a valid C string; the flags are constants.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(err("memfd_create"));
        }
        // SAFETY: memfd_create returned a new descriptor we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), REGION_SIZE as libc::off_t) } != 0 {
            return Err(err("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(err("sealing the memfd"));
        }
        // SAFETY: a fresh shared mapping of the whole (sealed, fixed-size) file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err("mmap"));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| err("mmap"))?;
        Ok(Region { ptr, fd })
    }

    /// The memfd, for QEMU.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(off: usize, len: usize, align: usize) {
        assert!(
            off.is_multiple_of(align) && off.checked_add(len).is_some_and(|e| e <= REGION_SIZE),
            "region access {off:#x}+{len} out of bounds or misaligned"
        );
    }

    fn a32(&self, off: usize) -> &AtomicU32 {
        Self::check(off, 4, 4);
        // SAFETY: in bounds and aligned (checked); the mapping lives as long as `self`;
        // AtomicU32 has the layout of u32 and concurrent access by the guest is what atomics
        // are for.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    fn a64(&self, off: usize) -> &AtomicU64 {
        Self::check(off, 8, 8);
        // SAFETY: as in `a32`.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    pub fn load32(&self, off: usize) -> u32 {
        self.a32(off).load(Ordering::Acquire)
    }

    pub fn store32(&self, off: usize, v: u32) {
        self.a32(off).store(v, Ordering::Release)
    }

    /// Stores `new` if the value is `current`; true if it did.
    pub fn cas32(&self, off: usize, current: u32, new: u32) -> bool {
        self.a32(off)
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub fn load64(&self, off: usize) -> u64 {
        self.a64(off).load(Ordering::Acquire)
    }

    pub fn store64(&self, off: usize, v: u64) {
        self.a64(off).store(v, Ordering::Release)
    }

    /// A copy of `len` bytes at `off` (the guest may be writing them: callers validate).
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        Self::check(off, len, 1);
        (0..len)
            // SAFETY: in bounds (checked); volatile because another party writes the memory.
            .map(|i| unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(off + i)) })
            .collect()
    }

    /// Writes `bytes` at `off`.
    pub fn write(&self, off: usize, bytes: &[u8]) {
        Self::check(off, bytes.len(), 1);
        for (i, b) in bytes.iter().enumerate() {
            // SAFETY: in bounds (checked).
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off + i), *b) }
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), REGION_SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_wrote_and_refuses_out_of_bounds() {
        let r = Region::create("t").unwrap();
        r.store64(8, 0x1122_3344_5566_7788);
        assert_eq!(r.load64(8), 0x1122_3344_5566_7788);
        r.write(100, b"abc");
        assert_eq!(r.read(100, 3), b"abc");
        assert!(std::panic::catch_unwind(|| r.read(REGION_SIZE - 1, 2)).is_err());
        assert!(std::panic::catch_unwind(|| r.load32(2)).is_err());
    }
}
