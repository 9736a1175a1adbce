//! Raw image files: open + flock, zero-copy `preadv`/`pwritev` between the image and guest
//! memory (optionally `O_DIRECT`, falling back to buffered I/O when a request is not aligned
//! or the file system refuses it), `fdatasync`, and discard / write-zeroes with `fallocate`.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};
use vm_memory::GuestMemoryBackend;

use crate::error::BlockError;
use crate::pipeline::{Io, Stage, StageError, Status, Terminal};
use crate::request::{Request, RequestKind, SectorRange, SECTOR_SIZE};

/// Largest number of iovecs passed to one `preadv`/`pwritev` (Linux `IOV_MAX`).
pub(crate) const IOV_MAX: usize = 1024;
/// Size of the zero buffer used when `fallocate` cannot zero a range.
const ZERO_CHUNK: usize = 1 << 20;

/// A raw disk image (regular file or block device) opened and locked for one backend.
#[derive(Debug)]
pub struct RawFile {
    file: File,
    /// Second descriptor opened with `O_DIRECT`, when requested and supported.
    direct: Option<File>,
    /// `direct` is still in use (cleared when the file system refuses an aligned request).
    direct_ok: AtomicBool,
    /// Alignment (offset, length, memory address) required for `O_DIRECT`.
    direct_align: AtomicU64,
    path: PathBuf,
    size: u64,
    read_only: bool,
    /// `fallocate(PUNCH_HOLE)` works on this file.
    punch_ok: AtomicBool,
    /// `fallocate(ZERO_RANGE)` works on this file.
    zero_range_ok: AtomicBool,
}

impl RawFile {
    /// Opens `path` (read-only or read-write), takes the flock (shared for read-only,
    /// exclusive for read-write, never waiting), measures it and, if `direct_io`, opens an
    /// `O_DIRECT` descriptor too (silently skipped where the file system refuses `O_DIRECT`).
    pub fn open(path: &Path, read_only: bool, direct_io: bool) -> Result<Self, BlockError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| BlockError::Open {
                path: path.to_owned(),
                read_only,
                source,
            })?;
        let meta = file.metadata().map_err(|source| BlockError::Open {
            path: path.to_owned(),
            read_only,
            source,
        })?;
        let ft = meta.file_type();
        if !(ft.is_file() || ft.is_block_device()) {
            return Err(BlockError::BadImage {
                path: path.to_owned(),
                reason: "it is neither a regular file nor a block device".into(),
            });
        }
        lock(&file, path, read_only)?;
        let size = file
            .seek(SeekFrom::End(0))
            .map_err(|source| BlockError::Open {
                path: path.to_owned(),
                read_only,
                source,
            })?;
        if size < SECTOR_SIZE {
            return Err(BlockError::BadImage {
                path: path.to_owned(),
                reason: format!("it is {size} bytes long, smaller than one 512-byte sector"),
            });
        }
        if size % SECTOR_SIZE != 0 {
            warn!(
                path = %path.display(),
                size,
                "disk image size is not a multiple of 512; the last partial sector is not visible to the guest"
            );
        }
        let direct = if direct_io {
            match OpenOptions::new()
                .read(true)
                .write(!read_only)
                .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                .open(path)
            {
                Ok(f) => Some(f),
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "O_DIRECT not available, using buffered I/O");
                    None
                }
            }
        } else {
            None
        };
        Ok(Self {
            file,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            direct_align: AtomicU64::new(SECTOR_SIZE),
            path: path.to_owned(),
            size,
            read_only,
            punch_ok: AtomicBool::new(true),
            zero_range_ok: AtomicBool::new(true),
        })
    }

    /// Image size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Capacity in 512-byte sectors (a trailing partial sector is not exposed).
    pub fn capacity_sectors(&self) -> u64 {
        self.size / SECTOR_SIZE
    }

    /// The image path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether aligned requests currently use `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed)
    }

    /// The guest buffers of `req` as iovecs, in order.
    ///
    /// The pointers stay valid while `req` lives: they point into the guest memory mapping the
    /// request holds (`Request::memory`), which is unmapped only when the last holder drops
    /// it. (`ptr_guard_mut` guards only matter for Xen grant mappings, a feature not enabled.)
    pub(crate) fn guest_iovecs(req: &Request) -> Result<Vec<libc::iovec>, StageError> {
        let mem = req.memory();
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(req.segments.len());
        for seg in &req.segments {
            for slice in GuestMemoryBackend::get_slices(mem, seg.addr, seg.len as usize) {
                let slice = slice.map_err(|_| StageError::GuestMemory {
                    addr: seg.addr.0,
                    len: u64::from(seg.len),
                })?;
                iovs.push(libc::iovec {
                    iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                    iov_len: slice.len(),
                });
            }
        }
        Ok(iovs)
    }

    /// The `O_DIRECT` descriptor, if it is in use and `iovs` at `offset` meet its alignment.
    pub(crate) fn direct_fd_for(&self, offset: u64, iovs: &[libc::iovec]) -> Option<RawFd> {
        let direct = self.direct.as_ref().filter(|_| self.is_direct())?;
        let a = self.direct_align.load(Ordering::Relaxed);
        let aligned = offset.is_multiple_of(a)
            && iovs.iter().all(|v| {
                (v.iov_base as u64).is_multiple_of(a) && (v.iov_len as u64).is_multiple_of(a)
            });
        aligned.then(|| direct.as_raw_fd())
    }

    /// The file system refused an aligned `O_DIRECT` request with `EINVAL`: require 4 KiB
    /// alignment from now on, or, if that was already required, stop using `O_DIRECT`.
    pub(crate) fn direct_refused(&self) {
        if self.direct_align.load(Ordering::Relaxed) < 4096 {
            debug!(path = %self.path.display(), "O_DIRECT refused 512-byte alignment, requiring 4096");
            self.direct_align.store(4096, Ordering::Relaxed);
        } else {
            warn!(path = %self.path.display(), "O_DIRECT refused an aligned request, using buffered I/O from now on");
            self.direct_ok.store(false, Ordering::Relaxed);
        }
    }

    /// The buffered (page-cache) descriptor.
    pub(crate) fn buffered_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Whether the image was opened read-only.
    pub(crate) fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Reads or writes the data of `req` at its offset, straight between the image and the
    /// guest buffers.
    fn transfer(&self, req: &Request, write: bool) -> Result<(), StageError> {
        let mut iovs = Self::guest_iovecs(req)?;
        let offset = req.offset();
        let op = if write { "pwritev" } else { "preadv" };
        if let Some(fd) = self.direct_fd_for(offset, &iovs) {
            let mut tmp = iovs.clone();
            match rw_all(fd, &mut tmp, offset, write) {
                Ok(()) => return Ok(()),
                // Fall through to buffered I/O from the start of the request.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.direct_refused(),
                Err(source) => return Err(StageError::Io { op, source }),
            }
        }
        rw_all(self.file.as_raw_fd(), &mut iovs, offset, write)
            .map_err(|source| StageError::Io { op, source })
    }

    fn fallocate(&self, mode: libc::c_int, r: &SectorRange) -> io::Result<()> {
        let off =
            i64::try_from(r.offset()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let len =
            i64::try_from(r.bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        loop {
            // SAFETY: fallocate on a descriptor we own; it touches no memory of ours.
            let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, len) };
            if rc == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn discard(&self, r: &SectorRange) -> Result<(), StageError> {
        if !self.punch_ok.load(Ordering::Relaxed) || r.num_sectors == 0 {
            return Ok(());
        }
        match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, r) {
            Ok(()) => Ok(()),
            Err(e) if unsupported(&e) => {
                // Discard is a hint; a file system without hole punching just keeps the data.
                debug!(path = %self.path.display(), "hole punching not supported; discards become no-ops");
                self.punch_ok.store(false, Ordering::Relaxed);
                Ok(())
            }
            Err(source) => Err(StageError::Io {
                op: "fallocate(PUNCH_HOLE)",
                source,
            }),
        }
    }

    fn write_zeroes(&self, r: &SectorRange) -> Result<(), StageError> {
        if r.num_sectors == 0 {
            return Ok(());
        }
        // With the unmap flag the range may be deallocated: a punched hole reads as zeroes.
        if r.unmap && self.punch_ok.load(Ordering::Relaxed) {
            match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, r) {
                Ok(()) => return Ok(()),
                Err(e) if unsupported(&e) => self.punch_ok.store(false, Ordering::Relaxed),
                Err(source) => {
                    return Err(StageError::Io {
                        op: "fallocate(PUNCH_HOLE)",
                        source,
                    })
                }
            }
        }
        if self.zero_range_ok.load(Ordering::Relaxed) {
            match self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, r) {
                Ok(()) => return Ok(()),
                Err(e) if unsupported(&e) => self.zero_range_ok.store(false, Ordering::Relaxed),
                Err(source) => {
                    return Err(StageError::Io {
                        op: "fallocate(ZERO_RANGE)",
                        source,
                    })
                }
            }
        }
        // Last resort: write zeroes.
        let zeroes = vec![0u8; ZERO_CHUNK.min(r.bytes() as usize)];
        let mut off = r.offset();
        let end = r.offset() + r.bytes();
        while off < end {
            let n = ((end - off) as usize).min(zeroes.len());
            let chunk = zeroes.get(..n).unwrap_or(&[]);
            std::os::unix::fs::FileExt::write_all_at(&self.file, chunk, off).map_err(|source| {
                StageError::Io {
                    op: "pwrite(zeroes)",
                    source,
                }
            })?;
            off += n as u64;
        }
        Ok(())
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::ENOTTY)
    )
}

impl Terminal for RawFile {
    fn name(&self) -> &str {
        FILE_STAGE
    }

    fn execute(&mut self, req: &mut Request) -> Result<Status, StageError> {
        RawFile::execute(self, req)
    }
}

impl RawFile {
    /// Performs the I/O of `req` (read, write, flush, discard, write-zeroes) on the calling
    /// thread. Safe to call from several threads at once.
    pub fn execute(&self, req: &Request) -> Result<Status, StageError> {
        if self.read_only && req.kind.is_mutating() {
            // Validation already refuses these; this is a second line of defence.
            return Ok(Status::IoErr);
        }
        match req.kind {
            RequestKind::Read => self.transfer(req, false)?,
            RequestKind::Write => self.transfer(req, true)?,
            RequestKind::Flush => {
                if !self.read_only {
                    self.file.sync_data().map_err(|source| StageError::Io {
                        op: "fdatasync",
                        source,
                    })?;
                }
            }
            RequestKind::Discard => {
                for r in &req.ranges {
                    self.discard(r)?;
                }
            }
            RequestKind::WriteZeroes => {
                for r in &req.ranges {
                    self.write_zeroes(r)?;
                }
            }
            // The device answers GET_ID itself; a terminal has no serial.
            RequestKind::GetId => return Ok(Status::Unsupp),
        }
        Ok(Status::Ok)
    }
}

/// Name of the image file stage.
pub const FILE_STAGE: &str = "raw-file";
/// Default number of I/O threads per disk.
pub const DEFAULT_IO_THREADS: usize = 4;
/// Most I/O threads per disk.
pub const MAX_IO_THREADS: usize = 64;

/// The image file as the terminal stage: requests are queued to a pool of I/O threads that
/// run blocking `preadv`/`pwritev`/`fdatasync`/`fallocate` straight between the image and
/// guest memory, so the requests of a queue are served concurrently and complete out of
/// order.
///
/// The default engine ([`crate::IoEngine::Threads`]); [`crate::uring::UringStage`] is the
/// other. Measured against each other (docs/benchmarks.md, "The io_uring engine"; 2026-11-28,
/// bench/blk_profile.py 3 reps and bench/foundation.py 5 reps): the ring saves the hand-off to
/// an I/O thread (2.0 against 3.1 context switches and 64-76 against 93-95 us of backend CPU
/// per 4 KiB qd1 request) and gives 1.14x on 4 KiB random writes at queue depth 32, but the
/// guest's IOPS at queue depth 1 and the other fio rows are the same within the spread between
/// repetitions (randread qd32 0.96x, write 1 MiB qd4 0.93x), and io_uring is refused by some
/// kernels and container seccomp profiles. So the pool stays the default.
pub struct FileStage {
    tx: Option<crossbeam_channel::Sender<Io>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for FileStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStage")
            .field("threads", &self.threads.len())
            .finish()
    }
}

impl FileStage {
    /// Serves `file` with `threads` I/O threads (clamped to 1..=[`MAX_IO_THREADS`]).
    pub fn new(file: RawFile, threads: usize) -> Result<Self, BlockError> {
        Self::with_shared(Arc::new(file), threads)
    }

    /// Like [`FileStage::new`], for a file another stage serves too (the io_uring stage hands
    /// its discards and write-zeroes to a pool of one).
    pub(crate) fn with_shared(file: Arc<RawFile>, threads: usize) -> Result<Self, BlockError> {
        let (tx, rx) = crossbeam_channel::unbounded::<Io>();
        let n = threads.clamp(1, MAX_IO_THREADS);
        let mut handles = Vec::with_capacity(n);
        for i in 0..n {
            let rx = rx.clone();
            let worker_file = file.clone();
            let h = std::thread::Builder::new()
                .name(format!("vmsight-io{i}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    vmsight_vhostd::seccomp::install_once(
                        vmsight_vhostd::seccomp::ThreadClass::IoPool,
                    );
                    for mut io in rx {
                        let req = io.request_mut();
                        req.timeline.io_start = Some(Instant::now());
                        let result = worker_file.execute(req);
                        req.timeline.io_end = Some(Instant::now());
                        io.complete(result);
                    }
                })
                .map_err(|source| BlockError::Thread {
                    path: file.path().to_owned(),
                    source,
                })?;
            handles.push(h);
        }
        Ok(Self {
            tx: Some(tx),
            threads: handles,
        })
    }
}

impl Stage for FileStage {
    fn name(&self) -> &str {
        FILE_STAGE
    }

    fn submit(&self, mut io: Io) {
        io.request_mut().timeline.terminal = Some(Instant::now());
        let Some(tx) = &self.tx else {
            io.complete(Ok(Status::IoErr));
            return;
        };
        if let Err(e) = tx.send(io) {
            // Only after Drop began; fail the request rather than lose it.
            e.0.complete(Err(StageError::Stage {
                stage: FILE_STAGE.into(),
                reason: "the I/O threads have stopped".into(),
            }));
        }
    }
}

impl Drop for FileStage {
    fn drop(&mut self) {
        // Closing the channel lets the threads finish what is queued, then end.
        self.tx = None;
        for t in self.threads.drain(..) {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Transfers every byte described by `iovs` at `offset`, looping over short transfers and
/// `IOV_MAX`-sized batches. `iovs` is consumed (advanced) in place.
fn rw_all(fd: RawFd, iovs: &mut [libc::iovec], mut offset: u64, write: bool) -> io::Result<()> {
    let mut idx = 0usize;
    loop {
        // Skip exhausted entries.
        while iovs.get(idx).is_some_and(|v| v.iov_len == 0) {
            idx += 1;
        }
        let Some(batch) = iovs.get(idx..) else {
            return Ok(());
        };
        if batch.is_empty() {
            return Ok(());
        }
        let count = batch.len().min(IOV_MAX);
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `batch` points at `count` valid iovecs; each describes a range of guest
        // memory obtained from `get_slices` on the mapped guest memory, which stays mapped for
        // the whole call (the caller holds the memory guard and the pointer guards). The kernel
        // reads or writes only inside those ranges. The guest may touch the same memory
        // concurrently, which is inherent to virtio and harmless to us (no Rust references to
        // it exist).
        let n = unsafe {
            if write {
                libc::pwritev(fd, batch.as_ptr(), count as libc::c_int, off)
            } else {
                libc::preadv(fd, batch.as_ptr(), count as libc::c_int, off)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the image ended early (was it truncated while in use?)",
            ));
        }
        offset += n as u64;
        idx += advance(&mut iovs[idx..], n as usize);
    }
}

/// Marks the first `n` bytes of `iovs` as transferred: entries fully covered get length 0,
/// a partly covered one is moved forward. Returns how many entries are now exhausted.
pub(crate) fn advance(iovs: &mut [libc::iovec], mut n: usize) -> usize {
    let mut done = 0;
    for v in iovs.iter_mut() {
        if n == 0 {
            break;
        }
        if n >= v.iov_len {
            n -= v.iov_len;
            v.iov_len = 0;
            done += 1;
        } else {
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
            v.iov_len -= n;
            n = 0;
        }
    }
    done
}

/// Takes the image's flock, never waiting; on conflict, says who holds it.
fn lock(file: &File, path: &Path, read_only: bool) -> Result<(), BlockError> {
    let op = if read_only {
        libc::LOCK_SH
    } else {
        libc::LOCK_EX
    };
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(BlockError::Lock {
            path: path.to_owned(),
            source: err,
        });
    }
    // Who holds it, and how? A shared lock succeeding means the holders are readers.
    let holders_are_readers = !read_only && {
        // SAFETY: as above.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if rc == 0 {
            // SAFETY: as above; releases the probe lock we just took.
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        }
        rc == 0
    };
    let how = if holders_are_readers {
        "another process holds it open read-only (shared lock), so it cannot be opened for writing"
    } else {
        "another process holds it for writing"
    };
    let pids = file
        .metadata()
        .map(|m| lock_holders(&m))
        .unwrap_or_default();
    let holder = if pids.is_empty() {
        how.to_owned()
    } else {
        format!("{how} ({})", pids.join(", "))
    };
    Err(BlockError::Locked {
        path: path.to_owned(),
        holder,
    })
}

/// "pid N (comm)" of every process holding a flock on the file, from /proc/locks.
fn lock_holders(meta: &std::fs::Metadata) -> Vec<String> {
    let dev = meta.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let key = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    // A holder found in a torn listing is still a holder; an empty answer is worth a retry.
    for _ in 0..3 {
        let out = holders_in(&read_locks(), &key);
        if !out.is_empty() {
            return out;
        }
    }
    Vec::new()
}

/// /proc/locks in one `read`: the kernel lists the locks page by page, walking its lock list
/// again at each read, so a listing read in several pieces (as `read_to_string` does, starting
/// with a 32-byte probe) can skip a lock when another one goes away in between.
fn read_locks() -> String {
    let Ok(mut f) = std::fs::File::open("/proc/locks") else {
        return String::new();
    };
    let mut buf = vec![0u8; 1 << 20];
    let n = f.read(&mut buf).unwrap_or(0);
    buf.truncate(n);
    String::from_utf8_lossy(&buf).into_owned()
}

/// "pid N (comm)" of the flock holders of the file `key` ("MAJOR:MINOR:INODE") in `locks`.
fn holders_in(locks: &str, key: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in locks.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; blocked waiters have "->".
        if f.get(1) != Some(&"FLOCK") {
            continue;
        }
        if f.get(5) != Some(&key) {
            continue;
        }
        if let Some(pid) = f.get(4) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "?".into());
            let entry = format!("pid {pid} {comm}");
            if !out.contains(&entry) {
                out.push(entry);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn image(len: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tempfile");
        f.write_all(&vec![0x11u8; len]).expect("fill");
        f.flush().expect("flush");
        f
    }

    #[test]
    fn second_writer_is_refused_with_a_clear_message() {
        let img = image(4096);
        let _first = RawFile::open(img.path(), false, false).expect("first open");
        let err = RawFile::open(img.path(), false, false).expect_err("second writer");
        let msg = err.to_string();
        assert!(msg.starts_with("cannot lock disk image "), "{msg}");
        assert!(msg.contains(&img.path().display().to_string()), "{msg}");
        assert!(
            msg.contains("another process holds it for writing"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        // A reader is refused too while a writer holds it.
        let err = RawFile::open(img.path(), true, false).expect_err("reader vs writer");
        assert!(err.to_string().contains("holds it for writing"), "{err}");
    }

    #[test]
    fn readers_share_and_exclude_writers() {
        let img = image(4096);
        let _a = RawFile::open(img.path(), true, false).expect("reader a");
        let _b = RawFile::open(img.path(), true, false).expect("reader b");
        let err = RawFile::open(img.path(), false, false).expect_err("writer vs readers");
        assert!(err.to_string().contains("read-only"), "{err}");
    }

    #[test]
    fn lock_is_released_on_drop() {
        let img = image(4096);
        drop(RawFile::open(img.path(), false, false).expect("first"));
        RawFile::open(img.path(), false, false).expect("again after drop");
    }

    #[test]
    fn tiny_and_odd_images() {
        let img = image(100);
        let err = RawFile::open(img.path(), false, false).expect_err("too small");
        assert!(
            err.to_string().contains("smaller than one 512-byte sector"),
            "{err}"
        );
        let img = image(1536 + 7);
        let f = RawFile::open(img.path(), false, false).expect("odd size");
        assert_eq!(f.capacity_sectors(), 3);
        let dir = tempfile::tempdir().expect("dir");
        let err = RawFile::open(dir.path(), true, false).expect_err("directory");
        assert!(
            err.to_string()
                .contains("neither a regular file nor a block device"),
            "{err}"
        );
        let err =
            RawFile::open(&dir.path().join("missing.img"), false, false).expect_err("missing");
        assert!(err.to_string().contains("cannot open disk image"), "{err}");
    }

    #[test]
    fn direct_io_reads_aligned_and_unaligned_buffers() {
        use crate::request::tests::{header, limits, mem, r, w, HDR, STATUS};
        use crate::request::{parse, Parsed};
        use virtio_bindings::virtio_blk::VIRTIO_BLK_T_IN;
        use virtio_queue::mock::MockSplitQueue;
        use vm_memory::{Bytes, GuestAddress};

        let img = image(64 * 1024);
        let f = RawFile::open(img.path(), false, true).expect("open O_DIRECT");
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 8);
        for addr in [0x2_0000u64, 0x2_0010] {
            // 4 KiB aligned buffer (direct path) and a 16-byte aligned one (buffered fallback).
            let q = MockSplitQueue::new(&m, 16);
            let chain = q
                .build_desc_chain(&[r(HDR, 16), w(addr, 4096), w(STATUS, 1)])
                .expect("chain");
            let Parsed::Request { req, .. } = parse(chain, &m, &limits()) else {
                panic!("parse");
            };
            assert_eq!(f.execute(&req).expect("read"), Status::Ok);
            let mut buf = vec![0u8; 4096];
            m.read_slice(&mut buf, GuestAddress(addr)).expect("buf");
            assert!(buf.iter().all(|&b| b == 0x11));
        }
    }
}
