//! Reading guest state from inside a vCPU callback: registers and guest virtual memory.
//!
//! Both go through GLib byte arrays owned by QEMU's GLib: QEMU resizes them with
//! `g_byte_array_set_size`, which reads and may reallocate GLib's private fields beyond the
//! public header, so they must be real arrays, not stack-built headers. Every vCPU owns two,
//! allocated once and reused. Register reads differ between plugin APIs (v4 returns the byte
//! count, v7 a `bool`), so the count is taken from the array's growth in both.

use std::ffi::{c_uint, CStr};

use crate::logic::{for_each_run, Segment, MAX_IOV};
use crate::qemu::ffi::{
    self, g_array_free, g_byte_array_set_size, g_byte_array_sized_new, qemu_plugin_get_registers,
    qemu_plugin_read_memory_vaddr, qemu_plugin_register, GByteArray, RegDescV4, RegDescV7,
};
use crate::qemu::{self, Api};

/// Most registers one [`ByteBuf::read_registers`] call reads (vCPU redirection reads 20).
pub const MAX_REGS_PER_READ: usize = 24;

/// Largest single guest memory read the helper accepts (bounds the copy and the time spent in
/// a vCPU callback).
pub const MAX_GUEST_READ: usize = 4096;
const PAGE: u64 = 4096;

/// Errors of `ByteBuf::read_guest` (the plugin's bounded guest memory reader).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemError {
    /// Zero-length reads are rejected by QEMU.
    #[error("A guest memory read of zero bytes was requested")]
    Empty,
    /// Above [`MAX_GUEST_READ`].
    #[error("A guest memory read of {0} bytes exceeds the limit of {MAX_GUEST_READ} bytes")]
    TooLong(usize),
    /// `vaddr + len` wraps around the address space.
    #[error("the guest range {vaddr:#x}+{len} wraps around the address space")]
    Wraps {
        /// Start address.
        vaddr: u64,
        /// Length.
        len: usize,
    },
    /// The first page of the range is not readable (not mapped or not present).
    #[error("the guest address {0:#x} is not mapped")]
    Unmapped(u64),
}

/// A GLib byte array owned by one vCPU. Never freed: a callback of that vCPU may still run
/// while QEMU runs its exit hooks, and the few hundred bytes per vCPU do not matter.
pub struct ByteBuf(*mut GByteArray);

impl ByteBuf {
    /// Allocates an array with room for `reserve` bytes.
    pub fn new(reserve: u32) -> Option<Self> {
        // SAFETY: plain GLib allocation; returns a valid array or aborts on OOM (GLib policy).
        let p = unsafe { g_byte_array_sized_new(reserve) };
        (!p.is_null()).then_some(Self(p))
    }

    /// Reads the registers `handles` of the current vCPU into `out` (little-endian, at most 8
    /// bytes each; wider registers are truncated). Returns a bit mask of the registers whose
    /// read failed (their value is 0); registers beyond the first [`MAX_REGS_PER_READ`] are
    /// never read and always reported failed. Only valid inside a callback registered with
    /// `QEMU_PLUGIN_CB_R_REGS`.
    pub fn read_registers(&mut self, handles: &[usize], out: &mut [u64]) -> u32 {
        let mut failed = 0u32;
        for i in MAX_REGS_PER_READ..handles.len().min(32) {
            failed |= 1 << i;
        }
        // SAFETY: self.0 is a live GByteArray exclusively owned by this vCPU (&mut self).
        unsafe { g_byte_array_set_size(self.0, 0) };
        // (offset, size) of each register in the array: all reads append, one pass parses.
        let mut spans = [(0usize, 0usize); MAX_REGS_PER_READ];
        for (i, &h) in handles.iter().enumerate().take(spans.len()) {
            // SAFETY: self.0 is live; reading `len` of a GByteArray we own is sound.
            let before = unsafe { (*self.0).len } as usize;
            let ok = read_register(h, self.0);
            // SAFETY: as above.
            let after = unsafe { (*self.0).len } as usize;
            if !ok || after <= before {
                failed |= 1 << i;
                continue;
            }
            spans[i] = (before, after - before);
        }
        // SAFETY: after the reads `data` points to `len` initialised bytes owned by the array.
        let bytes = unsafe {
            let a = &*self.0;
            if a.data.is_null() {
                &[][..]
            } else {
                std::slice::from_raw_parts(a.data, a.len as usize)
            }
        };
        for (i, slot) in out
            .iter_mut()
            .enumerate()
            .take(handles.len().min(spans.len()))
        {
            let (off, n) = spans[i];
            *slot = 0;
            if failed & (1 << i) != 0 {
                continue;
            }
            let mut w = [0u8; 8];
            let take = n.min(8);
            match bytes.get(off..off + take) {
                Some(src) => {
                    w[..take].copy_from_slice(src);
                    *slot = u64::from_le_bytes(w);
                }
                None => failed |= 1 << i,
            }
        }
        failed
    }

    /// Copies guest virtual memory at `vaddr` into `out` using the current vCPU's page tables.
    /// Splits the range at page boundaries so a range running into an unmapped page still
    /// returns the readable prefix: `Ok(n)` with `n < out.len()`. Only valid inside a vCPU
    /// callback (QEMU asserts a current CPU).
    pub fn read_guest(&mut self, vaddr: u64, out: &mut [u8]) -> Result<usize, MemError> {
        let len = out.len();
        if len == 0 {
            return Err(MemError::Empty);
        }
        if len > MAX_GUEST_READ {
            return Err(MemError::TooLong(len));
        }
        if vaddr.checked_add(len as u64).is_none() {
            return Err(MemError::Wraps { vaddr, len });
        }
        let mut done = 0usize;
        while done < len {
            let addr = vaddr + done as u64;
            let in_page = (PAGE - (addr & (PAGE - 1))) as usize;
            let chunk = in_page.min(len - done);
            // SAFETY: self.0 is a real GByteArray this vCPU owns; QEMU resizes it to `chunk`
            // and fills it; `chunk > 0`; we are in a vCPU callback, as the API requires.
            let ok = unsafe { qemu_plugin_read_memory_vaddr(addr, self.0, chunk) };
            // SAFETY: reading the public header fields of our array.
            let (data, got) = unsafe { ((*self.0).data, (*self.0).len as usize) };
            if !ok || data.is_null() || got < chunk {
                break;
            }
            // SAFETY: `data` holds `got >= chunk` initialised bytes; `out[done..done+chunk]` is
            // in bounds because `chunk <= len - done`.
            unsafe {
                std::ptr::copy_nonoverlapping(data, out.as_mut_ptr().add(done), chunk);
            }
            done += chunk;
        }
        if done == 0 {
            return Err(MemError::Unmapped(vaddr));
        }
        Ok(done)
    }
}

impl ByteBuf {
    /// Reads `out.len()` bytes at offset `off` of a buffer made of `segs` (a plain buffer is
    /// one segment, a vectored one an iovec array's entries). Returns the bytes read before
    /// the first fault or the buffer's end.
    pub fn read_segments(&mut self, segs: &[Segment], off: u64, out: &mut [u8]) -> usize {
        let mut got = 0usize;
        let mut whole = true;
        for_each_run(segs, off, out.len() as u64, |addr, at, n| {
            if !whole {
                return;
            }
            let r = self.read_guest(addr, &mut out[at..at + n]).unwrap_or(0);
            got += r;
            whole = r == n;
        });
        got
    }

    /// Reads the `count` entries of the guest iovec array at `iov` into `raw` (16 bytes each).
    /// False when any of it cannot be read or `count` is above the kernel's limit.
    pub fn read_iovecs(&mut self, iov: u64, count: u64, raw: &mut Vec<u8>) -> bool {
        if count > MAX_IOV {
            return false;
        }
        raw.clear();
        raw.resize(count as usize * 16, 0);
        let mut done = 0usize;
        while done < raw.len() {
            let n = (raw.len() - done).min(MAX_GUEST_READ);
            let at = iov.wrapping_add(done as u64);
            match self.read_guest(at, &mut raw[done..done + n]) {
                Ok(r) if r == n => done += n,
                _ => return false,
            }
        }
        true
    }
}

impl ByteBuf {
    /// Replaces the array's contents with `bytes`.
    fn fill(&mut self, bytes: &[u8]) -> bool {
        let Ok(len) = c_uint::try_from(bytes.len()) else {
            return false;
        };
        // SAFETY: self.0 is a live GByteArray we own; after set_size it holds `len` bytes at
        // `data` (GLib reallocates as needed), which we overwrite in bounds.
        unsafe {
            g_byte_array_set_size(self.0, len);
            let a = &*self.0;
            if a.data.is_null() || (a.len as usize) < bytes.len() {
                return false;
            }
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), a.data, bytes.len());
        }
        true
    }

    /// Writes `bytes` (little-endian, the register's width) into a register of the current
    /// vCPU. Needs plugin API v7 and a callback registered for register writes; false if QEMU
    /// refuses (or on v4).
    pub fn write_register(&mut self, handle: usize, bytes: &[u8]) -> bool {
        let Some(f) = qemu::v7() else { return false };
        if bytes.is_empty() || !self.fill(bytes) {
            return false;
        }
        // SAFETY: v7's write_register with a handle from qemu_plugin_get_registers and a
        // real, non-empty GByteArray; the caller is a register-writing vCPU callback.
        unsafe { (f.write_register)(handle as *mut qemu_plugin_register, self.0) }
    }

    /// Writes `bytes` to guest virtual memory through the current vCPU's page tables (QEMU's
    /// debug access: page protections do not apply, absent pages fail). Needs API v7.
    pub fn write_guest(&mut self, vaddr: u64, bytes: &[u8]) -> bool {
        let Some(f) = qemu::v7() else { return false };
        if bytes.is_empty() || bytes.len() > MAX_GUEST_READ || !self.fill(bytes) {
            return false;
        }
        if vaddr.checked_add(bytes.len() as u64).is_none() {
            return false;
        }
        // SAFETY: v7's write_memory_vaddr with a real, non-empty GByteArray, from a vCPU
        // callback (QEMU asserts a current CPU).
        unsafe { (f.write_memory_vaddr)(vaddr, self.0) }
    }
}

// SAFETY: the array is only touched by the vCPU that owns it (see VcpuState); moving the
// pointer between threads is harmless.
unsafe impl Send for ByteBuf {}

/// Name and opaque handle of one guest register.
#[derive(Debug, Clone)]
pub struct RegInfo {
    /// Register name as QEMU's gdbstub names it (e.g. `rax`, `cr3`).
    pub name: String,
    /// Feature (gdb XML) it belongs to.
    pub feature: String,
    /// Opaque handle for `qemu_plugin_read_register`.
    pub handle: usize,
    /// QEMU refuses writes (v7 marks RIP read-only: the PC moves with `set_pc`); always true
    /// on v4, which cannot write registers.
    pub read_only: bool,
}

/// Reads one register of the current vCPU, appending it to `buf`; false on failure.
fn read_register(handle: usize, buf: *mut GByteArray) -> bool {
    let h = handle as *mut qemu_plugin_register;
    // SAFETY: `handle` came from qemu_plugin_get_registers (opaque, QEMU validates it); `buf`
    // is a real GByteArray QEMU may grow; we are in a register-reading callback (caller). The
    // v7 call goes through the v7 form (`bool` result) of the same exported function.
    unsafe {
        match qemu::api() {
            Api::V4 => ffi::qemu_plugin_read_register(h, buf) > 0,
            Api::V7 => std::mem::transmute::<
                unsafe extern "C" fn(*mut qemu_plugin_register, *mut GByteArray) -> std::ffi::c_int,
                ffi::ReadRegisterV7,
            >(ffi::qemu_plugin_read_register)(h, buf),
        }
    }
}

/// Lists the current vCPU's registers. Only valid in a vCPU-init (or later vCPU) callback.
pub fn list_registers() -> Vec<RegInfo> {
    // SAFETY: called from a vCPU callback as the API requires; the result is a GArray of
    // register descriptors that we must free (but not the strings).
    let arr = unsafe { qemu_plugin_get_registers() };
    if arr.is_null() {
        return Vec::new();
    }
    // SAFETY: QEMU returned a valid GArray whose elements are the descriptors of the declared
    // API (v7's carry `is_readonly`); names and features are static strings owned by QEMU (or
    // NULL for features).
    let regs = unsafe {
        let a = &*arr;
        let n = a.len as usize;
        match (a.data.is_null(), qemu::api()) {
            (true, _) => Vec::new(),
            (false, Api::V4) => std::slice::from_raw_parts(a.data.cast::<RegDescV4>(), n)
                .iter()
                .map(|d| RegInfo {
                    name: cstr_lossy(d.name),
                    feature: cstr_lossy(d.feature),
                    handle: d.handle as usize,
                    read_only: true,
                })
                .collect(),
            (false, Api::V7) => std::slice::from_raw_parts(a.data.cast::<RegDescV7>(), n)
                .iter()
                .map(|d| RegInfo {
                    name: cstr_lossy(d.name),
                    feature: cstr_lossy(d.feature),
                    handle: d.handle as usize,
                    read_only: d.is_readonly,
                })
                .collect(),
        }
    };
    // SAFETY: we own the array (API contract); free the element storage too.
    unsafe { g_array_free(arr, 1) };
    regs
}

/// Converts a possibly-NULL C string (static in QEMU) to a String.
fn cstr_lossy(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated string owned by QEMU for its lifetime.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
