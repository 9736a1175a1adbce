//! Guest memory from outside the guest: guest-physical reads from QEMU's shared RAM backend and
//! x86-64 virtual-address translation (4- and 5-level paging) on top of them.
//!
//! Guest RAM is a `memory-backend-memfd,share=on` object in QEMU. vmsight maps the same memfd
//! read-only (`MAP_SHARED`), opened through `/proc/<qemu_pid>/fd/<n>`, so a read costs a memory
//! copy and no round trip through QEMU. The memfd holds RAM contiguously; [`RamLayout`] maps
//! guest-physical addresses onto it the way QEMU's q35 machine does (RAM below 4 GiB up to the
//! low-memory limit, the rest from 4 GiB up).
//!
//! The guest runs while we read: every read copies with volatile loads into a caller buffer,
//! and no Rust reference into guest memory is ever created. A value can still be torn across
//! the guest's own updates (only aligned 8-byte loads, e.g. page-table entries, are atomic);
//! callers validate what they read.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use serde::Serialize;
use thiserror::Error;

/// Size of a base page.
pub const PAGE_SIZE: u64 = 4096;
/// Start of guest RAM above 4 GiB on q35.
pub const Q35_HIGH_RAM_START: u64 = 1 << 32;
/// q35 keeps all RAM below 4 GiB when there is less than this (2.75 GiB) ...
pub const Q35_SPLIT_THRESHOLD: u64 = 0xb000_0000;
/// ... and otherwise puts only the first 2 GiB there (QEMU `pc_q35_init`).
pub const Q35_LOW_SPLIT: u64 = 0x8000_0000;

/// Physical-address bits of a page-table entry (bits 51..12).
const PTE_ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITABLE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_PAGE_SIZE: u64 = 1 << 7;
const PTE_NX: u64 = 1 << 63;

/// Problems reading guest memory.
#[derive(Debug, Error)]
pub enum MemError {
    #[error("guest-physical address {gpa:#x} is not guest RAM (a hole or beyond the end of RAM)")]
    Unmapped { gpa: u64 },
    #[error(
        "Virtual address {va:#x} is not mapped: its level-{level} page-table entry is not present."
    )]
    NotPresent { va: u64, level: u8 },
    #[error("virtual address {va:#x} is not canonical for {levels}-level paging")]
    NonCanonical { va: u64, levels: u8 },
    #[error("the level-{level} page-table entry {entry:#x} for {va:#x} sets the page-size bit, which is reserved at that level")]
    BadEntry { va: u64, level: u8, entry: u64 },
    #[error("x86-64 paging has 4 or 5 levels, not {0}")]
    BadLevels(u8),
    #[error("cannot open guest RAM {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot map guest RAM {path} ({len} bytes): {source}")]
    Map {
        path: PathBuf,
        len: u64,
        source: std::io::Error,
    },
    #[error("the RAM layout needs {need} bytes of backing memory but {path} has {have}")]
    TooSmall { path: PathBuf, need: u64, have: u64 },
    #[error("cannot list the open files of QEMU process {pid} in /proc/{pid}/fd: {source}")]
    ProcFd { pid: u32, source: std::io::Error },
    #[error("QEMU process {pid} has no open file \"/memfd:{name} (deleted)\"{}; is guest RAM a memory-backend-memfd object?", size.map(|s| format!(" of {s} bytes")).unwrap_or_default())]
    NoMemfd {
        pid: u32,
        name: String,
        size: Option<u64>,
    },
    #[error(
        "QEMU process {pid} has {count} memory-backend-memfd files; give the RAM size to pick one."
    )]
    AmbiguousMemfd { pid: u32, count: usize },
}

/// One contiguous piece of guest RAM: `size` bytes at guest-physical `gpa`, stored at byte
/// `offset` of the backing memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RamRegion {
    pub gpa: u64,
    pub offset: u64,
    pub size: u64,
}

/// Where guest RAM appears in the guest-physical address space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RamLayout {
    regions: Vec<RamRegion>,
}

impl RamLayout {
    /// QEMU's q35 layout for `ram_size` bytes with the default `max-ram-below-4g` (4 GiB).
    pub fn q35(ram_size: u64) -> RamLayout {
        RamLayout::q35_with_max_below_4g(ram_size, Q35_HIGH_RAM_START)
    }

    /// QEMU's q35 layout (`hw/i386/pc_q35.c`, `pc_q35_init`): the low-memory limit is 2 GiB
    /// when `ram_size >= 2.75 GiB`, else 2.75 GiB, capped by the machine option
    /// `max-ram-below-4g`; RAM up to the limit sits at 0, the rest at 4 GiB.
    pub fn q35_with_max_below_4g(ram_size: u64, max_ram_below_4g: u64) -> RamLayout {
        let mut lowmem = if ram_size >= Q35_SPLIT_THRESHOLD {
            Q35_LOW_SPLIT
        } else {
            Q35_SPLIT_THRESHOLD
        };
        if max_ram_below_4g != 0 {
            lowmem = lowmem.min(max_ram_below_4g);
        }
        let (below, above) = if ram_size >= lowmem {
            (lowmem, ram_size - lowmem)
        } else {
            (ram_size, 0)
        };
        let mut regions = Vec::new();
        if below > 0 {
            regions.push(RamRegion {
                gpa: 0,
                offset: 0,
                size: below,
            });
        }
        if above > 0 {
            regions.push(RamRegion {
                gpa: Q35_HIGH_RAM_START,
                offset: below,
                size: above,
            });
        }
        RamLayout { regions }
    }

    /// All `size` bytes at guest-physical 0 (memory dumps, tests).
    pub fn flat(size: u64) -> RamLayout {
        RamLayout {
            regions: vec![RamRegion {
                gpa: 0,
                offset: 0,
                size,
            }],
        }
    }

    /// The regions, in guest-physical order.
    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// Total RAM in bytes.
    pub fn ram_size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Bytes of backing memory the layout needs.
    pub fn backing_size(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.offset.saturating_add(r.size))
            .max()
            .unwrap_or(0)
    }

    /// Backing offset of `gpa` and the bytes of RAM from there to the end of its region.
    pub fn locate(&self, gpa: u64) -> Option<(u64, u64)> {
        self.regions.iter().find_map(|r| {
            let rel = gpa.checked_sub(r.gpa)?;
            (rel < r.size).then(|| (r.offset + rel, r.size - rel))
        })
    }
}

/// How the backing memory is held (for `Drop`).
#[derive(Debug)]
enum Backing {
    /// A read-only `mmap` of `len` bytes.
    Mapped,
    /// A `Box<[u8]>` turned into a raw pointer (memory dumps, tests).
    Owned,
}

/// Guest RAM, readable by guest-physical address. Cheap to share behind an `Arc`; all reads
/// copy out.
#[derive(Debug)]
pub struct GuestRam {
    base: NonNull<u8>,
    len: usize,
    backing: Backing,
    layout: RamLayout,
    source: String,
}

// SAFETY: `base` points to memory owned by this value for its whole life (a private read-only
// mapping or a leaked box) that is only ever read, through volatile loads; the memory may be
// changed concurrently by the guest (another process), which no Rust-level reference observes.
// Sharing or moving the handle between threads is therefore sound.
unsafe impl Send for GuestRam {}
// SAFETY: see `Send`: `&GuestRam` only allows volatile reads.
unsafe impl Sync for GuestRam {}

impl Drop for GuestRam {
    fn drop(&mut self) {
        match self.backing {
            Backing::Mapped => {
                // SAFETY: `base`/`len` are exactly the mapping created in `map_file`, unmapped
                // only here, and no references into it exist.
                unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
            }
            Backing::Owned => {
                let slice = std::ptr::slice_from_raw_parts_mut(self.base.as_ptr(), self.len);
                // SAFETY: `base`/`len` came from `Box::into_raw` of a `Box<[u8]>` in
                // `from_bytes` and are released only here.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}

/// Where a running QEMU keeps its guest's RAM: the process and, when it has several
/// `memory-backend-memfd` objects (a virtio-mem device's backend beside the RAM), the RAM's
/// size in bytes that picks the right one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QemuRam {
    pub pid: u32,
    pub ram_size: Option<u64>,
}

/// RAM files opened ahead of the threads that map them ([`QemuRam::preopen`]).
type Preopened = std::collections::BTreeMap<QemuRam, (PathBuf, std::sync::Arc<File>)>;
static PREOPENED: std::sync::Mutex<Preopened> = std::sync::Mutex::new(Preopened::new());

impl QemuRam {
    /// Maps it: from the file [`preopen`](Self::preopen) kept, else found and opened now
    /// ([`GuestRam::open_qemu`]).
    pub fn open(&self) -> Result<GuestRam, MemError> {
        let kept = PREOPENED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(self)
            .cloned();
        match kept {
            Some((path, file)) => {
                let size = file_size(&file, &path)?;
                GuestRam::map_file(&file, &path, RamLayout::q35(size))
            }
            None => GuestRam::open_qemu(self.pid, self.ram_size),
        }
    }

    /// Opens the RAM's memfd now, waiting up to `within` for a starting QEMU to create it,
    /// and keeps it for [`open`](Self::open) while the returned [`KeptRam`] lives. For the threads
    /// that read guest memory later without the right to open another process's files
    /// (they drop their capabilities, and QEMU may run as another user: docs/security.md).
    /// Gives up early when QEMU ends.
    pub fn preopen(&self, within: std::time::Duration) -> Result<KeptRam, MemError> {
        let deadline = std::time::Instant::now() + within;
        let path = loop {
            match locate_qemu_ram(self.pid, self.ram_size) {
                Ok(p) => break p,
                Err(MemError::NoMemfd { .. })
                    if std::time::Instant::now() < deadline
                        && vmsight_proto::layout::process_running(self.pid) =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => return Err(e),
            }
        };
        let file = File::open(&path).map_err(|source| MemError::Open {
            path: path.clone(),
            source,
        })?;
        PREOPENED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(*self, (path, std::sync::Arc::new(file)));
        Ok(KeptRam(*self))
    }
}

/// The RAM file [`QemuRam::preopen`] keeps; dropped, it is closed (mappings made from it
/// stay valid).
#[derive(Debug)]
pub struct KeptRam(QemuRam);

impl Drop for KeptRam {
    fn drop(&mut self) {
        PREOPENED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}

/// The `/proc/<qemu_pid>/fd/<n>` path of QEMU's RAM memfd ([`GuestRam::open_qemu`]).
fn locate_qemu_ram(qemu_pid: u32, ram_size: Option<u64>) -> Result<PathBuf, MemError> {
    let mut found = find_memfds(qemu_pid, QEMU_MEMFD_NAME)?;
    if let Some(size) = ram_size {
        found.retain(|(_, s)| *s == size);
    }
    match found.len() {
        1 => Ok(found.remove(0).0),
        0 => Err(MemError::NoMemfd {
            pid: qemu_pid,
            name: QEMU_MEMFD_NAME.into(),
            size: ram_size,
        }),
        count => Err(MemError::AmbiguousMemfd {
            pid: qemu_pid,
            count,
        }),
    }
}

impl GuestRam {
    /// Maps the RAM of a running QEMU: finds the open memfd of its `memory-backend-memfd`
    /// object among `/proc/<qemu_pid>/fd` (QEMU names every such memfd
    /// [`QEMU_MEMFD_NAME`], not after the object id), maps it read-only and applies the q35
    /// layout for its size. With several such backends, `ram_size` (bytes) picks the one of
    /// that size. Needs the right to open QEMU's fd links (same user or root).
    pub fn open_qemu(qemu_pid: u32, ram_size: Option<u64>) -> Result<GuestRam, MemError> {
        let path = locate_qemu_ram(qemu_pid, ram_size)?;
        let file = File::open(&path).map_err(|source| MemError::Open {
            path: path.clone(),
            source,
        })?;
        let size = file_size(&file, &path)?;
        GuestRam::map_file(&file, &path, RamLayout::q35(size))
    }

    /// Maps a file holding guest RAM contiguously (a memfd path, a raw memory dump) with
    /// `layout`, or the q35 layout for the file's size when `None`.
    pub fn open_file(path: &Path, layout: Option<RamLayout>) -> Result<GuestRam, MemError> {
        let file = File::open(path).map_err(|source| MemError::Open {
            path: path.into(),
            source,
        })?;
        let layout = match layout {
            Some(l) => l,
            None => RamLayout::q35(file_size(&file, path)?),
        };
        GuestRam::map_file(&file, path, layout)
    }

    /// Guest RAM held in process memory (tests, dumps read into memory).
    pub fn from_bytes(bytes: Vec<u8>, layout: RamLayout) -> Result<GuestRam, MemError> {
        let have = bytes.len() as u64;
        if layout.backing_size() > have {
            return Err(MemError::TooSmall {
                path: PathBuf::from("<memory>"),
                need: layout.backing_size(),
                have,
            });
        }
        let boxed = bytes.into_boxed_slice();
        let len = boxed.len();
        let raw = Box::into_raw(boxed).cast::<u8>();
        // A zero-length box has a dangling but non-null pointer; `NonNull::new` cannot fail,
        // the fallback keeps the code free of unwrap.
        let base = NonNull::new(raw).unwrap_or(NonNull::dangling());
        Ok(GuestRam {
            base,
            len,
            backing: Backing::Owned,
            layout,
            source: "<memory>".into(),
        })
    }

    fn map_file(file: &File, path: &Path, layout: RamLayout) -> Result<GuestRam, MemError> {
        let have = file_size(file, path)?;
        let need = layout.backing_size();
        if need > have {
            return Err(MemError::TooSmall {
                path: path.into(),
                need,
                have,
            });
        }
        let map_err = |source| MemError::Map {
            path: path.into(),
            len: need,
            source,
        };
        let len = usize::try_from(need).map_err(|_| map_err(std::io::Error::other("too large")))?;
        if len == 0 {
            return Err(map_err(std::io::Error::other("empty")));
        }
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an open file descriptor;
        // the kernel picks the address, nothing is aliased. The mapping outlives `file`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| map_err(std::io::Error::other("mmap returned NULL")))?;
        Ok(GuestRam {
            base,
            len,
            backing: Backing::Mapped,
            layout,
            source: path.display().to_string(),
        })
    }

    /// The guest-physical layout.
    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// Where the RAM comes from (a path), for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Copies guest-physical `gpa..gpa+buf.len()` into `buf`. Fails with
    /// [`MemError::Unmapped`] naming the first address that is not RAM (`buf` then holds the
    /// bytes before it); never reads outside the backing memory.
    pub fn read_phys(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let mut done = 0usize;
        while done < buf.len() {
            let cur = gpa
                .checked_add(done as u64)
                .ok_or(MemError::Unmapped { gpa: u64::MAX })?;
            let (offset, avail) = self
                .layout
                .locate(cur)
                .ok_or(MemError::Unmapped { gpa: cur })?;
            let n = usize::try_from(avail)
                .unwrap_or(usize::MAX)
                .min(buf.len() - done);
            self.copy_out(offset, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Reads a little-endian u64 at `gpa`; an aligned one with a single (atomic) load.
    pub fn read_u64_phys(&self, gpa: u64) -> Result<u64, MemError> {
        if gpa.is_multiple_of(8) {
            if let Some((offset, avail)) = self.layout.locate(gpa) {
                if avail >= 8 {
                    let off = self.checked_offset(offset, 8, gpa)?;
                    // SAFETY: `off + 8 <= self.len` (checked_offset): the pointer stays inside
                    // the live mapping/box.
                    let ptr = unsafe { self.base.as_ptr().add(off) };
                    if (ptr as usize).is_multiple_of(8) {
                        // SAFETY: 8 readable bytes at an 8-byte-aligned address (checked just
                        // above); a volatile load through a raw pointer, no reference into the
                        // concurrently modified guest memory. Aligned 8-byte loads are atomic
                        // on x86-64, so a page-table entry is never torn.
                        let v = unsafe { std::ptr::read_volatile(ptr.cast::<u64>()) };
                        return Ok(u64::from_le(v));
                    }
                }
            }
        }
        let mut b = [0u8; 8];
        self.read_phys(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// `offset..offset+len` as a usize offset, if inside the backing memory.
    fn checked_offset(&self, offset: u64, len: usize, gpa: u64) -> Result<usize, MemError> {
        let off = usize::try_from(offset).map_err(|_| MemError::Unmapped { gpa })?;
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off),
            _ => Err(MemError::Unmapped { gpa }),
        }
    }

    /// Copies backing bytes `offset..offset+dst.len()` with volatile loads.
    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let off = self.checked_offset(offset, dst.len(), offset)?;
        // SAFETY: `off + dst.len() <= self.len` (checked_offset), so the whole source range is
        // inside the live mapping/box. The guest may modify it concurrently, so only volatile
        // loads through raw pointers are used (never a `&[u8]` into guest memory); `dst` is
        // our own buffer and cannot overlap the read-only source.
        unsafe { volatile_copy(self.base.as_ptr().add(off), dst) };
        Ok(())
    }
}

/// Copies `dst.len()` bytes from `src` with volatile loads: bytes up to 8-byte alignment, then
/// aligned u64 words, then the tail.
///
/// # Safety
/// `src..src+dst.len()` must be readable for the duration of the call.
unsafe fn volatile_copy(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let mut i = 0usize;
    while i < n && !(src as usize).wrapping_add(i).is_multiple_of(8) {
        // SAFETY: `i < n`, within the range the caller guarantees readable.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
    while i + 8 <= n {
        // SAFETY: `src + i` is 8-byte aligned here and `i + 8 <= n`, in the readable range.
        let w = unsafe { std::ptr::read_volatile(src.add(i).cast::<u64>()) };
        dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
        i += 8;
    }
    while i < n {
        // SAFETY: `i < n`, within the readable range.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
}

fn file_size(file: &File, path: &Path) -> Result<u64, MemError> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| MemError::Open {
            path: path.into(),
            source,
        })
}

/// The name QEMU gives the memfd of every `memory-backend-memfd` object (its QOM type name,
/// whatever the object's id): the fd link reads `/memfd:memory-backend-memfd (deleted)`.
pub const QEMU_MEMFD_NAME: &str = "memory-backend-memfd";

/// The `/proc/<pid>/fd/<n>` paths whose link reads `/memfd:<name> (deleted)`, with the size of
/// each file.
pub fn find_memfds(qemu_pid: u32, name: &str) -> Result<Vec<(PathBuf, u64)>, MemError> {
    let dir = PathBuf::from(format!("/proc/{qemu_pid}/fd"));
    let want = format!("/memfd:{name} (deleted)");
    let entries = std::fs::read_dir(&dir).map_err(|source| MemError::ProcFd {
        pid: qemu_pid,
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(target) = std::fs::read_link(&path) else {
            continue; // closed meanwhile
        };
        if target.as_os_str() == want.as_str() {
            if let Ok(meta) = std::fs::metadata(&path) {
                out.push((path, meta.len()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// x86-64 paging depth: 4 levels (48-bit VAs) or 5 levels (CR4.LA57, 57-bit VAs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum PagingMode {
    FourLevel,
    FiveLevel,
}

impl PagingMode {
    /// 4 → `FourLevel`, 5 → `FiveLevel`.
    pub fn from_levels(levels: u8) -> Result<PagingMode, MemError> {
        match levels {
            4 => Ok(PagingMode::FourLevel),
            5 => Ok(PagingMode::FiveLevel),
            n => Err(MemError::BadLevels(n)),
        }
    }

    /// 4 or 5.
    pub fn levels(self) -> u8 {
        match self {
            PagingMode::FourLevel => 4,
            PagingMode::FiveLevel => 5,
        }
    }

    /// Significant virtual-address bits (48 or 57).
    pub fn va_bits(self) -> u32 {
        12 + 9 * u32::from(self.levels())
    }

    /// Whether `va` is canonical (its top bits copy bit `va_bits - 1`).
    pub fn is_canonical(self, va: u64) -> bool {
        let shift = 64 - self.va_bits();
        (((va << shift) as i64) >> shift) as u64 == va
    }
}

/// The result of translating a virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Translation {
    pub va: u64,
    /// Guest-physical address of `va`.
    pub pa: u64,
    /// 4 KiB, 2 MiB or 1 GiB.
    pub page_size: u64,
    /// Writable at every level (R/W bit set all the way down).
    pub writable: bool,
    /// User-accessible at every level (U/S bit set all the way down).
    pub user: bool,
    /// No-execute at some level.
    pub nx: bool,
}

/// A guest address space: the physical address of its top-level page table and the paging
/// depth. Levels are numbered like the hardware: 5 = PML5, 4 = PML4, 3 = PDPT, 2 = PD, 1 = PT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct AddressSpace {
    root: u64,
    mode: PagingMode,
}

impl AddressSpace {
    /// An address space from a CR3 value (PCID bits 11..0 and the no-flush bit 63 are
    /// ignored) and the paging depth, 4 or 5.
    pub fn new(cr3: u64, levels: u8) -> Result<AddressSpace, MemError> {
        Ok(AddressSpace::with_mode(
            cr3,
            PagingMode::from_levels(levels)?,
        ))
    }

    /// Like [`AddressSpace::new`] with a [`PagingMode`].
    pub fn with_mode(cr3: u64, mode: PagingMode) -> AddressSpace {
        AddressSpace {
            root: cr3 & PTE_ADDR_MASK,
            mode,
        }
    }

    /// Physical address of the top-level table (CR3 without PCID/flag bits).
    pub fn cr3(&self) -> u64 {
        self.root
    }

    /// 4 or 5.
    pub fn levels(&self) -> u8 {
        self.mode.levels()
    }

    /// The paging mode.
    pub fn mode(&self) -> PagingMode {
        self.mode
    }

    /// Walks the page tables for `va`. Handles 1 GiB (PDPT) and 2 MiB (PD) pages; a missing
    /// entry is [`MemError::NotPresent`] with its level; a table outside RAM is
    /// [`MemError::Unmapped`].
    pub fn translate(&self, ram: &GuestRam, va: u64) -> Result<Translation, MemError> {
        if !self.mode.is_canonical(va) {
            return Err(MemError::NonCanonical {
                va,
                levels: self.levels(),
            });
        }
        let mut table = self.root;
        let (mut writable, mut user, mut nx) = (true, true, false);
        let mut level = self.levels();
        loop {
            let shift = 12 + 9 * u32::from(level - 1);
            let index = (va >> shift) & 0x1ff;
            let entry = ram.read_u64_phys(table + index * 8)?;
            if entry & PTE_PRESENT == 0 {
                return Err(MemError::NotPresent { va, level });
            }
            writable &= entry & PTE_WRITABLE != 0;
            user &= entry & PTE_USER != 0;
            nx |= entry & PTE_NX != 0;
            let large = entry & PTE_PAGE_SIZE != 0;
            if level == 1 || (large && (level == 2 || level == 3)) {
                let page_size = 1u64 << shift;
                let base = entry & PTE_ADDR_MASK & !(page_size - 1);
                return Ok(Translation {
                    va,
                    pa: base | (va & (page_size - 1)),
                    page_size,
                    writable,
                    user,
                    nx,
                });
            }
            if large {
                return Err(MemError::BadEntry { va, level, entry });
            }
            table = entry & PTE_ADDR_MASK;
            level -= 1;
        }
    }

    /// Copies from `va` into `buf`, page by page. Returns how many bytes were readable:
    /// `buf.len()`, or fewer when a later page faults. Fails when not even the first byte
    /// is readable.
    pub fn read_virt(&self, ram: &GuestRam, va: u64, buf: &mut [u8]) -> Result<usize, MemError> {
        let mut done = 0usize;
        while done < buf.len() {
            let cur = va.wrapping_add(done as u64);
            let step = self.translate(ram, cur).and_then(|t| {
                let in_page = t.page_size - (cur & (t.page_size - 1));
                let n = usize::try_from(in_page)
                    .unwrap_or(usize::MAX)
                    .min(buf.len() - done);
                ram.read_phys(t.pa, &mut buf[done..done + n]).map(|()| n)
            });
            match step {
                Ok(n) => done += n,
                Err(e) if done == 0 => return Err(e),
                Err(_) => return Ok(done),
            }
        }
        Ok(done)
    }

    /// Copies exactly `buf.len()` bytes from `va`, or fails with the fault that stopped it.
    pub fn read_virt_exact(&self, ram: &GuestRam, va: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let n = self.read_virt(ram, va, buf)?;
        if n < buf.len() {
            // Report the fault at the first unreadable byte.
            let at = va.wrapping_add(n as u64);
            let mut one = [0u8; 1];
            self.read_virt(ram, at, &mut one)?;
        }
        Ok(())
    }

    /// Reads a NUL-terminated string of at most `max` bytes at `va` (without the NUL; a longer
    /// string is cut at `max`). Fails if a fault comes before the NUL or `max`.
    pub fn read_cstring(&self, ram: &GuestRam, va: u64, max: usize) -> Result<Vec<u8>, MemError> {
        let mut out = Vec::new();
        let mut chunk = [0u8; 256];
        while out.len() < max {
            let cur = va.wrapping_add(out.len() as u64);
            // Never cross a page in one read: the next page may be unmapped.
            let to_page_end = (PAGE_SIZE - (cur & (PAGE_SIZE - 1))) as usize;
            let n = chunk.len().min(to_page_end).min(max - out.len());
            self.read_virt_exact(ram, cur, &mut chunk[..n])?;
            if let Some(end) = chunk[..n].iter().position(|&c| c == 0) {
                out.extend_from_slice(&chunk[..end]);
                return Ok(out);
            }
            out.extend_from_slice(&chunk[..n]);
        }
        Ok(out)
    }

    /// Reads a little-endian u64 at `va`.
    pub fn read_u64(&self, ram: &GuestRam, va: u64) -> Result<u64, MemError> {
        let mut b = [0u8; 8];
        self.read_virt_exact(ram, va, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads a little-endian u32 at `va`.
    pub fn read_u32(&self, ram: &GuestRam, va: u64) -> Result<u32, MemError> {
        let mut b = [0u8; 4];
        self.read_virt_exact(ram, va, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
}

/// Synthetic guest memory with page tables, for tests of this crate.
#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    /// A flat RAM image with a bump allocator for page-table pages.
    pub struct PtBuilder {
        pub mem: Vec<u8>,
        pub mode: PagingMode,
        pub root: u64,
        next_table: u64,
    }

    impl PtBuilder {
        /// `size` bytes of RAM; page tables are allocated from `tables_at` upwards.
        pub fn new(size: usize, mode: PagingMode, tables_at: u64) -> PtBuilder {
            PtBuilder {
                mem: vec![0; size],
                mode,
                root: tables_at,
                next_table: tables_at + PAGE_SIZE,
            }
        }

        pub fn write(&mut self, pa: u64, bytes: &[u8]) {
            let pa = pa as usize;
            self.mem[pa..pa + bytes.len()].copy_from_slice(bytes);
        }

        pub fn write_u64(&mut self, pa: u64, v: u64) {
            self.write(pa, &v.to_le_bytes());
        }

        pub fn read_u64(&self, pa: u64) -> u64 {
            let pa = pa as usize;
            let mut b = [0u8; 8];
            b.copy_from_slice(&self.mem[pa..pa + 8]);
            u64::from_le_bytes(b)
        }

        /// Maps one page of `page_size` (4 KiB, 2 MiB or 1 GiB) at `va` to `pa` with extra
        /// entry `flags` (present, writable are always set).
        pub fn map(&mut self, va: u64, pa: u64, page_size: u64, flags: u64) {
            let leaf_level: u8 = match page_size {
                0x1000 => 1,
                0x20_0000 => 2,
                0x4000_0000 => 3,
                _ => panic!("bad page size"),
            };
            let mut table = self.root;
            let mut level = self.mode.levels();
            while level > leaf_level {
                let shift = 12 + 9 * u32::from(level - 1);
                let slot = table + ((va >> shift) & 0x1ff) * 8;
                let entry = self.read_u64(slot);
                table = if entry & PTE_PRESENT != 0 {
                    entry & PTE_ADDR_MASK
                } else {
                    let t = self.next_table;
                    self.next_table += PAGE_SIZE;
                    self.write_u64(slot, t | PTE_PRESENT | PTE_WRITABLE | PTE_USER);
                    t
                };
                level -= 1;
            }
            let shift = 12 + 9 * u32::from(leaf_level - 1);
            let slot = table + ((va >> shift) & 0x1ff) * 8;
            let ps = if leaf_level > 1 { PTE_PAGE_SIZE } else { 0 };
            self.write_u64(slot, pa | PTE_PRESENT | PTE_WRITABLE | ps | flags);
        }

        /// Clears the present bit of the level-`level` entry on the path of `va`.
        pub fn unmap_at(&mut self, va: u64, level: u8) {
            let mut table = self.root;
            let mut l = self.mode.levels();
            loop {
                let shift = 12 + 9 * u32::from(l - 1);
                let slot = table + ((va >> shift) & 0x1ff) * 8;
                let entry = self.read_u64(slot);
                if l == level {
                    self.write_u64(slot, entry & !PTE_PRESENT);
                    return;
                }
                table = entry & PTE_ADDR_MASK;
                l -= 1;
            }
        }

        pub fn space(&self) -> AddressSpace {
            AddressSpace::with_mode(self.root, self.mode)
        }

        pub fn into_ram(self) -> GuestRam {
            let len = self.mem.len() as u64;
            GuestRam::from_bytes(self.mem, RamLayout::flat(len)).expect("ram")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::PtBuilder;
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn q35_layout_matches_qemu() {
        // 1 GiB: all low.
        let l = RamLayout::q35(GIB);
        assert_eq!(
            l.regions(),
            &[RamRegion {
                gpa: 0,
                offset: 0,
                size: GIB
            }]
        );
        // Just below 2.75 GiB: still all low.
        let l = RamLayout::q35(0xb000_0000 - MIB);
        assert_eq!(l.regions().len(), 1);
        // 2.75 GiB exactly: split at 2 GiB.
        let l = RamLayout::q35(0xb000_0000);
        assert_eq!(
            l.regions(),
            &[
                RamRegion {
                    gpa: 0,
                    offset: 0,
                    size: 2 * GIB
                },
                RamRegion {
                    gpa: 4 * GIB,
                    offset: 2 * GIB,
                    size: 0xb000_0000 - 2 * GIB
                }
            ]
        );
        assert_eq!(l.ram_size(), 0xb000_0000);
        assert_eq!(l.locate(2 * GIB), None);
        assert_eq!(l.locate(4 * GIB + 5), Some((2 * GIB + 5, 0x3000_0000 - 5)));
        // max-ram-below-4g=1G.
        let l = RamLayout::q35_with_max_below_4g(2 * GIB, GIB);
        assert_eq!(l.regions()[1].gpa, 4 * GIB);
        assert_eq!(l.regions()[1].size, GIB);
    }

    #[test]
    fn phys_reads_are_bounded_and_split_at_holes() {
        let mem: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        let layout = RamLayout {
            regions: vec![
                RamRegion {
                    gpa: 0,
                    offset: 0,
                    size: 8192,
                },
                RamRegion {
                    gpa: 0x10000,
                    offset: 8192,
                    size: 4096,
                },
            ],
        };
        let ram = GuestRam::from_bytes(mem.clone(), layout).expect("ram");
        let mut b = [0u8; 100];
        ram.read_phys(8000, &mut b).expect("in range");
        assert_eq!(&b[..100], &mem[8000..8100]);
        // Crosses the end of the first region into the hole.
        let e = ram.read_phys(8100, &mut b).expect_err("hole");
        assert!(matches!(e, MemError::Unmapped { gpa: 8192 }), "{e}");
        let mut b = [0u8; 16];
        ram.read_phys(0x10000 + 4090, &mut b[..6]).expect("end");
        assert_eq!(&b[..6], &mem[8192 + 4090..8192 + 4096]);
        assert!(ram.read_phys(0x10000 + 4090, &mut b).is_err());
        assert!(ram.read_phys(u64::MAX - 3, &mut b).is_err());
        assert_eq!(
            ram.read_u64_phys(8).expect("u64"),
            u64::from_le_bytes(mem[8..16].try_into().expect("8"))
        );
        assert_eq!(
            ram.read_u64_phys(3).expect("unaligned"),
            u64::from_le_bytes(mem[3..11].try_into().expect("8"))
        );
        // Backing smaller than the layout is refused.
        assert!(matches!(
            GuestRam::from_bytes(vec![0; 10], RamLayout::flat(11)),
            Err(MemError::TooSmall { .. })
        ));
    }

    #[test]
    fn maps_a_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ram");
        let mut data = vec![0u8; 2 * 4096];
        data[4096..4101].copy_from_slice(b"hello");
        std::fs::write(&path, &data).expect("write");
        let ram = GuestRam::open_file(&path, None).expect("map");
        assert_eq!(ram.layout().ram_size(), 8192);
        let mut b = [0u8; 5];
        ram.read_phys(4096, &mut b).expect("read");
        assert_eq!(&b, b"hello");
        assert!(ram.read_phys(8190, &mut b).is_err());
        let e = GuestRam::open_file(&path, Some(RamLayout::flat(3 * 4096))).expect_err("small");
        assert!(e.to_string().contains("needs 12288 bytes"), "{e}");
    }

    fn check_walks(mode: PagingMode) {
        let mut pt = PtBuilder::new(8 * MIB as usize, mode, 0x1000);
        let user_va = 0x0000_7fff_f000_0000u64;
        let kernel_va = if mode == PagingMode::FiveLevel {
            0xff11_0000_0000_0000u64
        } else {
            0xffff_8880_0000_0000
        };
        // Two 4 KiB pages with data, adjacent in VA, not in PA.
        pt.map(user_va, 0x10_0000, 4096, PTE_USER);
        pt.map(user_va + 4096, 0x30_0000, 4096, PTE_USER | PTE_NX);
        pt.write(0x10_0000 + 4090, b"abcdef");
        pt.write(0x30_0000, b"ghij\0tail");
        pt.write(0x30_0000 + 4094, b"xy");
        // A 2 MiB page and a 1 GiB page (PA 0: only its first 8 MiB are RAM).
        pt.map(kernel_va + 0x4000_0000, 0x40_0000, 0x20_0000, 0);
        pt.map(kernel_va, 0, 0x4000_0000, PTE_NX);
        let space = pt.space();
        // A present upper level with a missing leaf, and a missing top-level entry.
        pt.map(user_va + 0x20_0000, 0x50_0000, 4096, PTE_USER);
        pt.unmap_at(user_va + 0x20_0000, 1);
        let ram = pt.into_ram();

        let t = space.translate(&ram, user_va + 5).expect("4k");
        assert_eq!(
            (t.pa, t.page_size, t.user, t.nx),
            (0x10_0005, 4096, true, false)
        );
        let t = space.translate(&ram, user_va + 4096).expect("4k nx");
        assert!(t.nx && t.user && t.writable);
        let t = space
            .translate(&ram, kernel_va + 0x4000_0000 + 0x1234)
            .expect("2M");
        assert_eq!((t.pa, t.page_size, t.user), (0x40_1234, 0x20_0000, false));
        let t = space.translate(&ram, kernel_va + 0x3000).expect("1G");
        assert_eq!((t.pa, t.page_size, t.nx), (0x3000, 0x4000_0000, true));

        let e = space
            .translate(&ram, user_va + 0x20_0000)
            .expect_err("leaf");
        assert!(matches!(e, MemError::NotPresent { level: 1, .. }), "{e}");
        // A VA whose top-level slot is empty.
        let lonely = if mode == PagingMode::FiveLevel {
            0x00ff_0000_0000_0000
        } else {
            0x0000_4000_0000_0000
        };
        let e = space.translate(&ram, lonely).expect_err("top");
        assert!(
            matches!(e, MemError::NotPresent { level, .. } if level == mode.levels()),
            "{e}"
        );
        let noncanon = if mode == PagingMode::FiveLevel {
            0x0100_0000_0000_0000
        } else {
            0x0000_8000_0000_0000
        };
        assert!(matches!(
            space.translate(&ram, noncanon),
            Err(MemError::NonCanonical { .. })
        ));

        // Page-crossing read.
        let mut b = [0u8; 10];
        space
            .read_virt_exact(&ram, user_va + 4090, &mut b)
            .expect("cross");
        assert_eq!(&b, b"abcdefghij");
        assert_eq!(
            space.read_cstring(&ram, user_va + 4093, 64).expect("str"),
            b"defghij"
        );
        assert_eq!(
            space.read_cstring(&ram, user_va + 4093, 4).expect("cut"),
            b"defg"
        );
        // Reads up to the unmapped page after the second one: partial count.
        let mut big = [0u8; 8192];
        let n = space
            .read_virt(&ram, user_va + 4096, &mut big)
            .expect("partial");
        assert_eq!(n, 4096);
        assert!(space
            .read_virt_exact(&ram, user_va + 4096, &mut big)
            .is_err());
        assert!(space.read_virt(&ram, user_va + 8192, &mut b).is_err());
        // A string without NUL running into the unmapped page faults.
        assert!(space.read_cstring(&ram, user_va + 8190, 64).is_err());
        // The 1 GiB page maps beyond RAM: a hole, not a panic.
        assert!(matches!(
            space.read_virt(&ram, kernel_va + 0x3000_0000, &mut b),
            Err(MemError::Unmapped { .. })
        ));
    }

    #[test]
    fn four_level_walk() {
        check_walks(PagingMode::FourLevel);
    }

    #[test]
    fn five_level_walk() {
        check_walks(PagingMode::FiveLevel);
    }

    #[test]
    fn reserved_page_size_bit_and_bad_tables() {
        let mut pt = PtBuilder::new(64 * 1024, PagingMode::FourLevel, 0x1000);
        // PS in a PML4 entry is reserved.
        pt.write_u64(0x1000, 0x2000 | PTE_PRESENT | PTE_PAGE_SIZE);
        // A PML4 entry pointing outside RAM.
        pt.write_u64(0x1008, 0x7_0000_0000 | PTE_PRESENT);
        let space = pt.space();
        let ram = pt.into_ram();
        assert!(matches!(
            space.translate(&ram, 0x10),
            Err(MemError::BadEntry { level: 4, .. })
        ));
        assert!(matches!(
            space.translate(&ram, 1 << 39),
            Err(MemError::Unmapped { .. })
        ));
        assert!(matches!(
            AddressSpace::new(0, 3),
            Err(MemError::BadLevels(3))
        ));
        // PCID bits are ignored.
        assert_eq!(
            AddressSpace::new(0x1234_5fff, 4).expect("ok").cr3(),
            0x1234_5000
        );
    }
}
