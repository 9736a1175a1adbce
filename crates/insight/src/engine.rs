//! The insight engine: per-process fd tables, file sizes, the checksum indexes and the
//! pending-classification queue shared by the syscall side (a [`SyscallObserver`] on the
//! trace thread) and the block side ([`crate::Classifier`]: writes on the queue thread, reads
//! in a completion hook on whichever thread completes them, an I/O thread or a timer).
//!
//! Both sides lock one mutex for short, bounded work (hash lookups, no I/O): log records go
//! to [`InsightLog`]'s writer thread through a non-blocking queue. The [`FileBlocks`]
//! resolver of copies without a user buffer (module `copy`) and the [`Lookup`] source of what
//! no seen syscall said (module `facts`) are called without that lock.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::Serialize;
use vmsight_blockdev::insight::{
    BlockRecord, Content, FileRecord, InsightRecord, Pattern, RequestInsight,
};
use vmsight_introspect::syscall::event::{HEAD_ARG, TAIL_ARG};
use vmsight_introspect::syscall::{ArgData, Completed, EntryEvent, IoSums, SyscallObserver};
use vmsight_ring::chunk_sum;

use crate::blocks::{DiskRange, FileBlocks};
use crate::config::InsightConfig;
use crate::hint::hint_of;
use crate::log::InsightLog;
use crate::lookup::Lookup;
use crate::pages::{PageOwner, PageOwnerSource};
use crate::CHUNK;

mod copy;
mod facts;
mod forks;

/// The engine's hash maps and sets. Their keys (checksums of guest data, guest inode pointers,
/// pids, fds, guest paths) are chosen by the guest, so the hasher must resist collisions it
/// could craft: `ahash`'s randomly seeded one does, as std's SipHash did, at a fraction of its
/// cost (hashing was about a third of the engine's time per syscall; FxHash would not be safe
/// here).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
pub(crate) type HashSet<K> = std::collections::HashSet<K, ahash::RandomState>;

/// Source of "now" in host CLOCK_MONOTONIC ns (injectable for tests).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// What a write (or read) syscall said about one 4 KiB chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    pub pid: u32,
    pub file: Option<Arc<str>>,
    /// Guest inode pointer (0 unknown).
    pub inode: u64,
    /// File offset of the chunk.
    pub offset: u64,
    pub size_class: u8,
    pub pattern: Option<Pattern>,
    pub app_class: Option<u8>,
    /// When the syscall was seen (host ns).
    pub at: u64,
    /// An expected destination chunk of a copy without a user buffer (`copy_file_range`,
    /// `sendfile`, `splice`): indexed from the block read of its source.
    pub copied: bool,
    /// Known only from the page's owner (no write syscall's checksum matched yet): final only
    /// if none arrives within the write grace, which would bring the writer's hint and pid.
    pub by_page: bool,
    /// Neither data of a known file nor metadata: no checksum matched and the guest kernel's
    /// page says only that it is a process's anonymous memory (an `O_DIRECT` buffer), or the
    /// page could not be read. Logged as `unknown` (lowest class, deduplicated as usual),
    /// never as metadata. Provisional like `by_page`.
    pub unknown: bool,
}

impl ChunkMeta {
    /// A match that no later syscall can improve.
    fn settled(m: &Option<ChunkMeta>) -> bool {
        m.as_ref().is_some_and(|m| !m.by_page)
    }

    /// Data of a known (or at least real) file: matched, copied or page-owned, not unknown.
    fn is_data(m: &Option<ChunkMeta>) -> bool {
        m.as_ref().is_some_and(|m| !m.unknown)
    }

    /// Unknown (see [`ChunkMeta::unknown`]).
    fn is_unknown(m: &Option<ChunkMeta>) -> bool {
        m.as_ref().is_some_and(|m| m.unknown)
    }

    /// A chunk the engine cannot place (see [`ChunkMeta::unknown`]), seen at `now`.
    fn unplaced(now: u64, size_class: u8) -> ChunkMeta {
        ChunkMeta {
            pid: 0,
            file: None,
            inode: 0,
            offset: 0,
            size_class,
            pattern: None,
            app_class: None,
            at: now,
            copied: false,
            by_page: true,
            unknown: true,
        }
    }
}

#[derive(Debug, Clone)]
struct Indexed {
    meta: ChunkMeta,
    /// Identical chunks written and not yet matched (e.g. zero-filled chunks).
    count: u32,
}

/// Requests and bytes of one class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub requests: u64,
    pub bytes: u64,
}

/// Counters of the classification (per class, content and the matching machinery).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClassCounters {
    /// Write requests by final class.
    pub writes: BTreeMap<u8, Tally>,
    /// Read requests by final class.
    pub reads: BTreeMap<u8, Tally>,
    /// 4 KiB chunks of block writes, final: data (a write syscall's checksum, a copy or the
    /// page's owner), unknown (an anonymous or unreadable page no checksum matched), metadata.
    pub write_chunks_data: u64,
    pub write_chunks_unknown: u64,
    pub write_chunks_metadata: u64,
    /// 4 KiB chunks of block reads, final: data (content a syscall showed, a copy's source,
    /// or the page's owner), unknown, metadata.
    pub read_chunks_data: u64,
    pub read_chunks_unknown: u64,
    pub read_chunks_metadata: u64,
    /// Of the data chunks above, those known only from their page's owner (a regular file's
    /// page-cache page, see [`crate::pages`]; final).
    pub write_chunks_by_page: u64,
    pub read_chunks_by_page: u64,
    /// Chunks no checksum matched whose page was a process's anonymous memory (an `O_DIRECT`
    /// buffer) / could not be read, counted when asked (a late syscall may still match).
    pub write_chunks_anonymous: u64,
    pub write_chunks_owner_unknown: u64,
    pub read_chunks_anonymous: u64,
    pub read_chunks_owner_unknown: u64,
    /// Block-write chunks whose checksum matched content several writes produced, moved by
    /// their page's owner to another file or offset, or to metadata.
    pub write_chunks_reattributed: u64,
    /// Chunks matched only after the block request was classified (trace thread lag).
    pub late_matches: u64,
    /// Partial chunks completed from the recent-I/O cache / that could not be completed.
    pub partial_completed: u64,
    pub partial_unknown: u64,
    /// Index entries evicted by the bounds before they matched.
    pub evicted: u64,
    /// Write sums superseded by a newer write of the same file chunk.
    pub superseded: u64,
    /// `copy_file_range`, `sendfile` and `splice` calls followed (they copied bytes of a file
    /// the process opened by path).
    pub copy_calls: u64,
    /// Followed copies whose source range was mapped to disk ranges / could not be (file not
    /// found on any disk's file system, blocks not known, no index).
    pub copy_ranges_mapped: u64,
    pub copy_ranges_unmapped: u64,
    /// Block read requests given the copy hint when classified (data of a file being copied).
    pub copy_reads: u64,
    /// Block read requests of a copy's source classified before the copy was known (the trace
    /// thread lags): only their log records say copy.
    pub copy_reads_late: u64,
    /// 4 KiB chunks read from a copy's source and indexed as expected writes of its
    /// destination / block-write chunks that matched one.
    pub copy_expected_chunks: u64,
    pub copy_write_chunks: u64,
    /// Lookups (module `facts`) of what no seen syscall said, by what was asked and which
    /// source answered: a process's working directory (asked at its first event) and an fd
    /// it used but was not seen opening (inherited, or opened before tracing began).
    pub lookups_task_profile: u64,
    pub lookups_task_symcall: u64,
    pub lookups_fd_profile: u64,
    pub lookups_fd_symcall: u64,
    /// Lookups no source could answer (each asked once: see `facts`).
    pub lookup_failures: u64,
    /// New processes whose fd table and working directory were taken from their parent's
    /// fork entry at their own first call, because they ran before the parent's return was
    /// seen (a `vfork` child always does; module `forks`).
    pub forks_adopted: u64,
}

impl ClassCounters {
    /// Lookups answered, by any source.
    pub fn lookups_answered(&self) -> u64 {
        self.lookups_task_profile
            + self.lookups_task_symcall
            + self.lookups_fd_profile
            + self.lookups_fd_symcall
    }
}

#[derive(Debug, Clone)]
struct FdEntry {
    path: Option<Arc<str>>,
    flags: u64,
    cloexec: bool,
    offset: u64,
    highest: u64,
    inode: u64,
}

#[derive(Debug, Clone, Default)]
struct Proc {
    comm: String,
    cwd: Option<String>,
    fds: HashMap<u32, FdEntry>,
    /// Checksums of chunks this process read recently (copy detection, Sky §3.5).
    recent_reads: HashSet<u64>,
    recent_order: VecDeque<u64>,
    /// The working directory was asked of the lookup (answered or not): not asked again
    /// until the process execs.
    task_asked: bool,
    /// Fds no lookup source knew: not asked again until a seen syscall opens, closes or
    /// dup's onto them (bounded).
    fd_misses: HashSet<u32>,
    /// The tables came from the parent's fork entry at the process's own first call, before
    /// the parent's return was seen (module `forks`): that return leaves them.
    adopted: bool,
}

const RECENT_READS: usize = 4096;

/// Argument `i`'s bytes, unless reading them faulted before any byte was read.
/// For a read or write syscall: (the file position is an argument, it writes). `read`,
/// `write`, `pread64`, `pwrite64`, `readv`, `writev`, `preadv`, `pwritev`, and `preadv2`/
/// `pwritev2`, whose offset -1 means the file's position.
pub(crate) fn io_call(nr: u64, a: &[u64; 6]) -> Option<(bool, bool)> {
    match nr {
        0 | 19 => Some((false, false)),
        1 | 20 => Some((false, true)),
        17 | 295 => Some((true, false)),
        18 | 296 => Some((true, true)),
        327 => Some((a[3] != u64::MAX, false)),
        328 => Some((a[3] != u64::MAX, true)),
        _ => None,
    }
}

fn path_arg(e: &EntryEvent, i: u8) -> Option<&ArgData> {
    e.arg_data(i).filter(|d| !d.fault || !d.bytes.is_empty())
}

impl Proc {
    fn note_read(&mut self, sum: u64) {
        if self.recent_reads.insert(sum) {
            self.recent_order.push_back(sum);
            if self.recent_order.len() > RECENT_READS {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent_reads.remove(&old);
                }
            }
        }
    }
}

/// A block request whose log record waits for late syscall events.
#[derive(Debug, Clone)]
struct Pending {
    write: bool,
    record: BlockRecord,
    /// Per 4 KiB chunk: checksum and the match, once known.
    chunks: Vec<(u64, Option<ChunkMeta>)>,
}

const O_APPEND: u64 = 0o2000;
const O_TRUNC: u64 = 0o1000;
const O_CLOEXEC: u64 = 0o2000000;
const O_CREAT: u64 = 0o100;
const O_WRONLY: u64 = 1;
const AT_FDCWD: i64 = -100;
const AT_REMOVEDIR: u64 = 0x200;
const CLONE_THREAD: u64 = 0x10000;

const COPY_TOOLS: &[&str] = &["cp", "dd", "rsync"];
const ENCRYPT_TOOLS: &[&str] = &["gpg", "gpg2", "openssl", "age"];
const ENCRYPT_EXT: &[&str] = &[".gpg", ".enc", ".age", ".aes", ".pgp"];

/// The engine's state. Use it through [`InsightEngine`].
pub struct Engine {
    cfg: InsightConfig,
    clock: Clock,
    t0: u64,
    log: InsightLog,
    procs: HashMap<u32, Proc>,
    sizes: HashMap<Arc<str>, u64>,
    writes: HashMap<u64, Indexed>,
    write_order: VecDeque<u64>,
    /// (inode, chunk index) → the checksum last written there (older ones are superseded).
    latest: HashMap<(u64, u64), u64>,
    /// Data chunks seen recently (matched writes, read syscalls): the best-known insight for
    /// block reads of the same content.
    known: HashMap<u64, ChunkMeta>,
    known_order: VecDeque<u64>,
    /// The same by place: file → file offset → checksum (a copy's source content).
    known_at: HashMap<Arc<str>, BTreeMap<u64, u64>>,
    pending: BTreeMap<u64, Pending>,
    /// (deadline, id) of every pending request, soonest first: `expire` pops the due ones
    /// instead of scanning `pending` at every call (a scan per syscall and per block request
    /// was 8 % of vmsight's CPU time in a tar x of 100 000 files, perf). Ids already finished
    /// (matched, or evicted by the cap) are skipped when they come up.
    deadlines: BinaryHeap<Reverse<(u64, u64)>>,
    pending_by_fnv: HashMap<u64, Vec<u64>>,
    next_pending: u64,
    /// Recent-I/O cache: last known contents of file chunks (Sky §3.4.4).
    chunks: HashMap<(u64, u64), Box<[u8]>>,
    chunk_order: VecDeque<(u64, u64)>,
    /// The buffer of the chunk the cache evicted last, reused for the next one it caches.
    spare_chunk: Option<Box<[u8]>>,
    /// Pending block reads by position: (disk, offset, pending id).
    pending_reads: BTreeSet<(u32, u64, u64)>,
    /// Longest pending block read (bounds the position queries).
    pending_read_max: u64,
    /// Copies without a user buffer being followed.
    copies: copy::Copies,
    /// What the write syscalls said about a guest inode (by `struct inode *`): the file and
    /// its last writer, for block writes classified by page ownership.
    inodes: HashMap<u64, InodeFacts>,
    inode_order: VecDeque<u64>,
    /// Where each disk's file system is mounted in the guest (from the mounts the trace saw;
    /// the root disk at `/`): turns a page owner's path within its file system into a guest path.
    disk_mounts: HashMap<u32, String>,
    /// The parents' tables at forks still in flight (module `forks`).
    forks: forks::Forks,
    counters: ClassCounters,
}

/// What the engine knows of a guest inode from the latest read or write syscall it saw on it.
#[derive(Debug, Clone)]
struct InodeFacts {
    file: Option<Arc<str>>,
    pid: u32,
    pattern: Option<Pattern>,
    /// The application's hint on that syscall: a page-owned chunk of the inode takes it (the
    /// file's hint, e.g. a database's table file), so a read or write no syscall's checksum
    /// matched still reaches the cache with its class.
    app_class: Option<u8>,
}

/// Most inodes remembered for page-owned chunks (oldest first out).
const MAX_INODES: usize = 65_536;

fn comm_is(comm: &str, list: &[&str]) -> bool {
    list.contains(&comm)
}

/// Normalises `.` and `..` components of an absolute path.
fn normalize(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

impl Engine {
    fn new(cfg: InsightConfig, log: InsightLog, clock: Clock) -> Self {
        let t0 = clock();
        Self {
            cfg,
            clock,
            t0,
            log,
            procs: HashMap::default(),
            sizes: HashMap::default(),
            writes: HashMap::default(),
            write_order: VecDeque::new(),
            latest: HashMap::default(),
            known: HashMap::default(),
            known_order: VecDeque::new(),
            known_at: HashMap::default(),
            pending: BTreeMap::new(),
            deadlines: BinaryHeap::new(),
            pending_by_fnv: HashMap::default(),
            next_pending: 0,
            chunks: HashMap::default(),
            chunk_order: VecDeque::new(),
            spare_chunk: None,
            pending_reads: BTreeSet::new(),
            pending_read_max: 0,
            copies: copy::Copies::default(),
            inodes: HashMap::default(),
            inode_order: VecDeque::new(),
            disk_mounts: [(0, "/".to_string())].into_iter().collect(),
            forks: forks::Forks::default(),
            counters: ClassCounters::default(),
        }
    }

    /// Host time now (the engine's clock).
    pub fn now(&self) -> u64 {
        (self.clock)()
    }

    /// The counters so far.
    pub fn counters(&self) -> &ClassCounters {
        &self.counters
    }

    /// The tracked position of `pid`'s fd `fd` (tests).
    #[cfg(test)]
    pub(crate) fn fd_offset(&self, pid: u32, fd: u32) -> Option<u64> {
        Some(self.procs.get(&pid)?.fds.get(&fd)?.offset)
    }

    /// Sets a process's working directory (e.g. read from the guest's `fs_struct`).
    pub fn set_cwd(&mut self, pid: u32, cwd: &str) {
        self.proc_mut(pid, None).cwd = Some(normalize(cwd));
    }

    fn proc_mut(&mut self, pid: u32, comm: Option<&str>) -> &mut Proc {
        if !self.procs.contains_key(&pid) && self.procs.len() >= self.cfg.max_processes {
            self.procs.clear(); // bounded memory beats stale tables
        }
        let p = self.procs.entry(pid).or_default();
        if let Some(c) = comm {
            if p.comm != c {
                p.comm = c.to_string();
            }
        }
        p
    }

    // --- syscall side ---------------------------------------------------------------------

    fn resolve(&self, pid: u32, dirfd: Option<u64>, path: &[u8]) -> String {
        let p = String::from_utf8_lossy(path);
        if p.starts_with('/') {
            return normalize(&p);
        }
        let proc = self.procs.get(&pid);
        let base = match dirfd {
            Some(d) if d as i64 as i32 != AT_FDCWD as i32 => proc
                .and_then(|pr| pr.fds.get(&(d as u32)))
                .and_then(|f| f.path.as_deref().map(str::to_string)),
            _ => proc.and_then(|pr| pr.cwd.clone()),
        };
        match base {
            Some(b) => normalize(&format!("{b}/{p}")),
            None => p.into_owned(), // cwd unknown: the relative path as given
        }
    }

    fn file_size(&self, path: Option<&Arc<str>>) -> Option<u64> {
        path.and_then(|p| self.sizes.get(p).copied())
    }

    fn set_size(&mut self, path: Option<&Arc<str>>, size: u64) {
        if let Some(p) = path {
            if self.sizes.len() >= 1 << 16 && !self.sizes.contains_key(p) {
                self.sizes.clear();
            }
            self.sizes.insert(p.clone(), size);
        }
    }

    fn pattern_for(&self, comm: &str, path: Option<&str>) -> Option<Pattern> {
        if comm_is(comm, ENCRYPT_TOOLS)
            || path.is_some_and(|p| ENCRYPT_EXT.iter().any(|e| p.ends_with(e)))
        {
            Some(Pattern::Encrypt)
        } else if comm_is(comm, COPY_TOOLS) {
            Some(Pattern::Copy)
        } else {
            None
        }
    }

    /// Indexes the chunks of a write at its entry (Sky §3.4.1: the buffer may change right
    /// after the call, so the plugin summed it at entry).
    /// `now`: when the observer got the entry (its clock read, shared with `expire`).
    fn on_write_entry(&mut self, e: &EntryEvent, io: &IoSums, now: u64) {
        let pid = e.tgid;
        let fd = self.proc_mut(pid, Some(&e.comm)).fds.get(&io.fd);
        let path = fd.and_then(|f| f.path.clone());
        if !self.cfg.paths.is_empty() && !path.as_deref().is_some_and(|p| self.cfg.selects(p)) {
            return;
        }
        let size = io
            .i_size
            .max(io.end())
            .max(self.file_size(path.as_ref()).unwrap_or(0));
        self.set_size(path.as_ref(), size);
        let base = ChunkMeta {
            pid,
            file: path.clone(),
            inode: io.inode,
            offset: 0,
            size_class: self.cfg.size_classes.class_of(size),
            pattern: self.pattern_for(&e.comm, path.as_deref()),
            app_class: hint_of(e),
            at: now,
            copied: false,
            by_page: false,
            unknown: false,
        };
        self.note_inode(&base);
        for c in &io.chunks {
            let mut m = base.clone();
            m.offset = c.offset;
            if m.pattern.is_none()
                && self
                    .procs
                    .get(&pid)
                    .is_some_and(|p| p.recent_reads.contains(&c.sum))
            {
                m.pattern = Some(Pattern::Copy);
            }
            self.index_write(c.sum, m);
        }
        // Partial head/tail chunks (Sky §3.4.4), completed from the recent-I/O cache.
        let plan_end = io.end();
        let head = e.arg_data(HEAD_ARG).filter(|d| !d.fault);
        let tail = e.arg_data(TAIL_ARG).filter(|d| !d.fault);
        if let Some(h) = head {
            self.complete_partial(io, io.file_pos, &h.bytes, size, &base);
        }
        if let Some(t) = tail {
            let start = plan_end.saturating_sub(t.bytes.len() as u64);
            self.complete_partial(io, start, &t.bytes, size, &base);
        }
    }

    /// Builds the whole 4 KiB chunk that a write of `bytes` at file offset `off` produces
    /// (old contents from the cache, zeros beyond end of file `eof`) and indexes it.
    fn complete_partial(
        &mut self,
        io: &IoSums,
        off: u64,
        bytes: &[u8],
        eof: u64,
        base: &ChunkMeta,
    ) {
        if bytes.is_empty() || bytes.len() as u64 >= CHUNK || io.inode == 0 {
            return;
        }
        let idx = off / CHUNK;
        let start = idx * CHUNK;
        let within = (off - start) as usize;
        if within + bytes.len() > CHUNK as usize {
            return; // not a single chunk: the plugin never sends that
        }
        let old_size = io.i_size;
        let needs_old = (off > start && start < old_size)
            || (off + (bytes.len() as u64) < (start + CHUNK).min(old_size));
        let key = (io.inode, idx);
        let cached = self.chunks.contains_key(&key);
        if !cached && needs_old {
            self.counters.partial_unknown += 1;
            return;
        }
        // The page beyond end of file is zero on disk.
        let valid = eof.saturating_sub(start).min(CHUNK) as usize;
        let sum = match self.chunks.get_mut(&key) {
            Some(buf) => patch_chunk(buf, within, bytes, valid),
            None => {
                let mut buf = self.spare_chunk();
                buf.fill(0);
                let sum = patch_chunk(&mut buf, within, bytes, valid);
                self.cache_chunk(io.inode, idx, buf);
                sum
            }
        };
        self.counters.partial_completed += 1;
        let mut m = base.clone();
        m.offset = start;
        self.index_write(sum, m);
    }

    /// A 4 KiB buffer for a new cached chunk: the last one the cache evicted, or a new one
    /// (contents unspecified).
    fn spare_chunk(&mut self) -> Box<[u8]> {
        self.spare_chunk
            .take()
            .unwrap_or_else(|| vec![0u8; CHUNK as usize].into_boxed_slice())
    }

    /// Caches `bytes` (one whole chunk) as the contents of chunk `idx` of `inode`.
    fn cache_chunk_bytes(&mut self, inode: u64, idx: u64, bytes: &[u8]) {
        match self.chunks.get_mut(&(inode, idx)) {
            Some(b) if b.len() == bytes.len() => b.copy_from_slice(bytes),
            _ => {
                let mut buf = self.spare_chunk();
                if buf.len() == bytes.len() {
                    buf.copy_from_slice(bytes);
                } else {
                    buf = bytes.into();
                }
                self.cache_chunk(inode, idx, buf);
            }
        }
    }

    fn cache_chunk(&mut self, inode: u64, idx: u64, bytes: Box<[u8]>) {
        if self.chunks.insert((inode, idx), bytes).is_none() {
            self.chunk_order.push_back((inode, idx));
            while self.chunk_order.len() > self.cfg.max_cached_chunks {
                if let Some(k) = self.chunk_order.pop_front() {
                    // Kept for the next new chunk (saves an allocation and a free).
                    self.spare_chunk = self.chunks.remove(&k);
                }
            }
        }
    }

    /// Remembers the file and writer of `m`'s inode for page-owned chunks.
    fn note_inode(&mut self, m: &ChunkMeta) {
        if m.inode == 0 {
            return;
        }
        let facts = InodeFacts {
            file: m.file.clone(),
            pid: m.pid,
            pattern: m.pattern,
            app_class: m.app_class,
        };
        if self.inodes.insert(m.inode, facts).is_none() {
            self.inode_order.push_back(m.inode);
            while self.inode_order.len() > MAX_INODES {
                if let Some(k) = self.inode_order.pop_front() {
                    self.inodes.remove(&k);
                }
            }
        }
    }

    /// The guest path of `path` (from the root of disk `disk`'s file system), when the disk's
    /// mount point is known.
    fn guest_path(&self, disk: u32, path: &str) -> Option<String> {
        let mount = self.disk_mounts.get(&disk)?;
        Some(match (mount.as_str(), path) {
            ("/", p) => p.to_string(),
            (m, "/") => m.to_string(),
            (m, p) => format!("{}{p}", m.trim_end_matches('/')),
        })
    }

    /// A mount the trace saw: a virtio disk's file system now appears at `target`.
    pub(crate) fn note_mount(&mut self, source: &str, target: &str) {
        if let Some(disk) = crate::blocks::virtio_disk(source) {
            self.disk_mounts.insert(disk, normalize(target));
        }
    }

    /// An unmount the trace saw.
    pub(crate) fn note_umount(&mut self, target: &str) {
        let t = normalize(target);
        self.disk_mounts.retain(|_, m| *m != t);
    }

    /// The meta of a block chunk no checksum matched, from its page's owner (`None`: no page
    /// source, or the chunk is not one whole page): a regular file's page-cache page is that
    /// file's data at `offset` (the file and writer as the write syscalls named the inode,
    /// when they did; the size class from the inode's size); an anonymous or unreadable page
    /// is unknown; anything else, and no owner at all (Sky's rule), metadata.
    fn page_meta(&mut self, disk: u32, owner: Option<PageOwner>, now: u64) -> Option<ChunkMeta> {
        let (inode, offset, size, path) = match owner? {
            PageOwner::File {
                inode,
                offset,
                size,
                path,
                ..
            } => (inode, offset, size, path),
            PageOwner::Anonymous | PageOwner::Unknown => {
                return Some(ChunkMeta::unplaced(now, self.cfg.size_classes.otherwise));
            }
            PageOwner::Metadata => return None,
        };
        let facts = self.inodes.get(&inode).cloned();
        let file = facts
            .as_ref()
            .and_then(|f| f.file.clone())
            .or_else(|| Some(self.guest_path(disk, &path?)?.into()));
        if !self.cfg.paths.is_empty() && !file.as_deref().is_some_and(|p| self.cfg.selects(p)) {
            return None; // not a selected file (or not known to be one)
        }
        let size = size.max(self.file_size(file.as_ref()).unwrap_or(0));
        Some(ChunkMeta {
            pid: facts.as_ref().map_or(0, |f| f.pid),
            file,
            inode,
            offset,
            size_class: self.cfg.size_classes.class_of(size),
            pattern: facts.as_ref().and_then(|f| f.pattern),
            app_class: facts.and_then(|f| f.app_class),
            at: now,
            copied: false,
            by_page: true,
            unknown: false,
        })
    }

    /// Counts what a page's owner said about a chunk no checksum matched.
    fn count_owner(&mut self, write: bool, owner: Option<&PageOwner>) {
        let c = &mut self.counters;
        match (write, owner) {
            (true, Some(PageOwner::Anonymous)) => c.write_chunks_anonymous += 1,
            (true, Some(PageOwner::Unknown)) => c.write_chunks_owner_unknown += 1,
            (false, Some(PageOwner::Anonymous)) => c.read_chunks_anonymous += 1,
            (false, Some(PageOwner::Unknown)) => c.read_chunks_owner_unknown += 1,
            _ => {}
        }
    }

    fn index_write(&mut self, sum: u64, m: ChunkMeta) {
        // Supersede what was written to the same file chunk before (it never reaches disk
        // if the page is rewritten before writeback).
        if m.inode != 0 {
            let key = (m.inode, m.offset / CHUNK);
            if let Some(old) = self.latest.insert(key, sum) {
                if old != sum && self.unindex(old) {
                    self.counters.superseded += 1;
                }
            }
        }
        // A block write that already went by (trace lag) waits for exactly this.
        if self.match_pending(sum, &m, true) {
            return;
        }
        match self.writes.get_mut(&sum) {
            Some(ix) => {
                ix.count = ix.count.saturating_add(1);
                ix.meta = m;
            }
            None => {
                self.writes.insert(sum, Indexed { meta: m, count: 1 });
                self.write_order.push_back(sum);
                while self.write_order.len() > self.cfg.max_write_sums {
                    if let Some(old) = self.write_order.pop_front() {
                        if self.writes.remove(&old).is_some() {
                            self.counters.evicted += 1;
                        }
                    }
                }
            }
        }
    }

    fn unindex(&mut self, sum: u64) -> bool {
        match self.writes.get_mut(&sum) {
            Some(ix) if ix.count > 1 => {
                ix.count -= 1;
                true
            }
            Some(_) => {
                self.writes.remove(&sum);
                true
            }
            None => false,
        }
    }

    /// Takes one indexed write chunk with checksum `sum` (Sky removes matched sums).
    /// Takes the indexed write of content `sum`, and whether other writes of the same content
    /// were indexed too (then the meta is the latest writer's, which need not be this block's).
    fn take_write(&mut self, sum: u64) -> Option<(ChunkMeta, bool)> {
        let ix = self.writes.get(&sum)?;
        let (m, ambiguous) = (ix.meta.clone(), ix.count > 1);
        self.unindex(sum);
        if m.inode != 0 && self.latest.get(&(m.inode, m.offset / CHUNK)) == Some(&sum) {
            self.latest.remove(&(m.inode, m.offset / CHUNK));
        }
        Some((m, ambiguous))
    }

    /// A checksum match of content several writes produced (identical chunks: zeros, a
    /// program writing one buffer to many files) names the latest writer; the page's owner
    /// says whose block this is. A regular file's page elsewhere re-attributes the chunk, a
    /// metadata page makes it metadata; an unreadable or anonymous owner keeps the match.
    fn verify_ambiguous(
        &mut self,
        disk: u32,
        m: ChunkMeta,
        owner: Option<PageOwner>,
        now: u64,
    ) -> Option<ChunkMeta> {
        match owner {
            Some(PageOwner::File { inode, offset, .. })
                if (inode, offset) != (m.inode, m.offset) =>
            {
                self.counters.write_chunks_reattributed += 1;
                let mut pm = self.page_meta(disk, owner, now)?;
                pm.by_page = false; // a write syscall did write this content
                Some(pm)
            }
            Some(PageOwner::Metadata) => {
                self.counters.write_chunks_reattributed += 1;
                None
            }
            _ => Some(m),
        }
    }

    /// Marks the first pending block request (of the given direction) waiting for `sum`.
    fn match_pending(&mut self, sum: u64, m: &ChunkMeta, write: bool) -> bool {
        let Some(ids) = self.pending_by_fnv.get(&sum).cloned() else {
            return false;
        };
        for id in ids {
            if let Some(p) = self.pending.get_mut(&id) {
                if p.write != write {
                    continue;
                }
                if let Some(slot) = p
                    .chunks
                    .iter_mut()
                    .find(|(f, mm)| *f == sum && !ChunkMeta::settled(mm))
                {
                    slot.1 = Some(m.clone());
                    self.counters.late_matches += u64::from(write);
                    if p.chunks.iter().all(|c| ChunkMeta::settled(&c.1)) {
                        self.finish_pending(id);
                    }
                    return true;
                }
            }
        }
        false
    }

    fn remember_known(&mut self, sum: u64, m: ChunkMeta) {
        let at = m.file.clone().map(|f| (f, m.offset));
        match self.known.insert(sum, m) {
            Some(old) => {
                if old.file.as_ref().map(|f| (f, old.offset)) != at.as_ref().map(|(f, o)| (f, *o)) {
                    self.forget_known_at(&old, sum);
                }
            }
            None => {
                self.known_order.push_back(sum);
                while self.known_order.len() > self.cfg.max_read_sums {
                    if let Some(old) = self.known_order.pop_front() {
                        if let Some(m) = self.known.remove(&old) {
                            self.forget_known_at(&m, old);
                        }
                    }
                }
            }
        }
        if let Some((f, o)) = at {
            self.known_at.entry(f).or_default().insert(o, sum);
        }
    }

    /// Drops the by-place entry of known chunk `sum` (described by `m`), if it is still the
    /// content known there.
    fn forget_known_at(&mut self, m: &ChunkMeta, sum: u64) {
        let Some(f) = &m.file else { return };
        if let Some(t) = self.known_at.get_mut(f) {
            if t.get(&m.offset) == Some(&sum) {
                t.remove(&m.offset);
                if t.is_empty() {
                    self.known_at.remove(f);
                }
            }
        }
    }

    /// A read returned: its chunks classify the block reads seen in the window (Sky §3.4.1)
    /// and feed copy detection.
    fn on_read_complete(&mut self, e: &EntryEvent, io: &IoSums, now: u64) {
        let pid = e.tgid;
        let fd = self.proc_mut(pid, Some(&e.comm)).fds.get(&io.fd);
        let path = fd.and_then(|f| f.path.clone());
        if !self.cfg.paths.is_empty() && !path.as_deref().is_some_and(|p| self.cfg.selects(p)) {
            return;
        }
        let size = io.i_size.max(self.file_size(path.as_ref()).unwrap_or(0));
        self.set_size(path.as_ref(), size);
        let base = ChunkMeta {
            pid,
            file: path.clone(),
            inode: io.inode,
            offset: 0,
            size_class: self.cfg.size_classes.class_of(size),
            pattern: self.pattern_for(&e.comm, path.as_deref()),
            app_class: hint_of(e),
            at: now,
            copied: false,
            by_page: false,
            unknown: false,
        };
        self.note_inode(&base);
        for c in &io.chunks {
            let mut m = base.clone();
            m.offset = c.offset;
            self.match_pending(c.sum, &m, false);
            self.remember_known(c.sum, m);
            // The process is there: `proc_mut` above added it, and nothing since removes one.
            if let Some(p) = self.procs.get_mut(&pid) {
                p.note_read(c.sum);
            }
        }
    }

    fn fd_copy(&mut self, pid: u32, from: u64, to: u64, cloexec: bool) {
        self.forget_fd_miss(pid, to as u32);
        let Some(p) = self.procs.get_mut(&pid) else {
            return;
        };
        if let Some(mut f) = p.fds.get(&(from as u32)).cloned() {
            f.cloexec = cloexec;
            p.fds.insert(to as u32, f);
        } else {
            p.fds.remove(&(to as u32));
        }
    }

    fn file_event(&mut self, truncate: bool, path: String, size: u64, pid: u32) {
        if !self.cfg.selects(&path) {
            return; // --insight-paths: only the followed files' events
        }
        let ts = self.now().saturating_sub(self.t0);
        let r = FileRecord {
            ts_ns: ts,
            file: path,
            size,
            pid,
        };
        self.log.write(if truncate {
            InsightRecord::Truncate(r)
        } else {
            InsightRecord::Unlink(r)
        });
    }

    fn rename(&mut self, old: &str, new: &str) {
        let new: Arc<str> = Arc::from(new);
        for p in self.procs.values_mut() {
            for f in p.fds.values_mut() {
                if f.path.as_deref() == Some(old) {
                    f.path = Some(new.clone());
                }
            }
        }
        if let Some(s) = self.sizes.remove(old) {
            self.sizes.insert(new, s);
        }
    }

    /// A completed call: fd tables and file sizes, copies without a user buffer, mounts.
    /// Returns what must be done outside the lock (resolving a copy's blocks, telling the
    /// resolver about a mount).
    /// `now`: when the observer got the call (its clock read, shared with `expire`).
    fn on_complete(&mut self, c: &Completed, now: u64) -> Option<copy::Followup> {
        match c.entry.nr {
            copy::COPY_FILE_RANGE | copy::SENDFILE | copy::SPLICE => self.on_copy_complete(c),
            copy::MOUNT | copy::UMOUNT2 => self.on_mount(c),
            _ => {
                self.update_tables(c, now);
                None
            }
        }
    }

    /// Updates fd tables and file sizes from a completed call.
    fn update_tables(&mut self, c: &Completed, now: u64) {
        let e = &c.entry;
        let pid = e.tgid;
        let a = e.args;
        let ret = c.ret();
        let ok = ret.is_some_and(|r| r >= 0);
        match e.nr {
            // open, openat, creat, openat2
            2 | 257 | 85 | 437 if ok => self.on_open(e, ret.unwrap_or(0) as u32),
            3 if ok => {
                if let Some(p) = self.procs.get_mut(&pid) {
                    p.fds.remove(&(a[0] as u32));
                    p.fd_misses.remove(&(a[0] as u32));
                }
            }
            32 if ok => self.fd_copy(pid, a[0], ret.unwrap_or(0) as u64, false),
            33 if ok => self.fd_copy(pid, a[0], a[1], false),
            292 if ok => self.fd_copy(pid, a[0], a[1], a[2] & O_CLOEXEC != 0),
            72 if ok => self.on_fcntl(pid, a, ret),
            nr if ok && (nr == 8 || io_call(nr, &a).is_some()) => {
                self.on_io(e, ret.unwrap_or(0) as u64, now)
            }
            77 if ok => self.on_ftruncate(pid, a[0], a[1]),
            76 if ok => {
                if let Some(d) = path_arg(e, 0) {
                    let path = self.resolve(pid, None, &d.bytes);
                    self.set_size(Some(&Arc::from(path.as_str())), a[1]);
                    self.file_event(true, path, a[1], pid);
                }
            }
            87 if ok => self.on_unlink(pid, None, path_arg(e, 0)),
            263 if ok && a[2] & AT_REMOVEDIR == 0 => {
                self.on_unlink(pid, Some(a[0]), path_arg(e, 1));
            }
            82 | 264 | 316 if ok => self.on_rename(e),
            80 if ok => {
                if let Some(d) = path_arg(e, 0) {
                    let cwd = self.resolve(pid, None, &d.bytes);
                    if cwd.starts_with('/') {
                        self.proc_mut(pid, None).cwd = Some(cwd);
                    }
                }
            }
            81 if ok => self.on_fchdir(pid, a[0]),
            59 | 322 if ok => {
                if let Some(p) = self.procs.get_mut(&pid) {
                    p.fds.retain(|_, f| !f.cloexec);
                    p.recent_reads.clear();
                    p.recent_order.clear();
                    p.forget_lookups();
                }
            }
            // fork, vfork, clone (not a thread), clone3 (flags unknown here: a thread's
            // copy is keyed by its tid and simply never used)
            57 | 58 | 56 | 435 if forks::starts_process(e) => match ret {
                Some(child) if child > 0 => self.fork_returned(pid, e.tid, child as u32),
                _ => self.fork_failed(pid, e.tid),
            },
            231 => {
                self.procs.remove(&pid);
            }
            _ => {}
        }
    }

    /// A successful open, openat, creat or openat2 that returned `fd`: the new fd table entry,
    /// and the truncation it may have done.
    fn on_open(&mut self, e: &EntryEvent, fd: u32) {
        let pid = e.tgid;
        let a = e.args;
        let (dirfd, pi, flags) = match e.nr {
            2 => (None, 0, a[1]),
            85 => (None, 0, O_CREAT | O_WRONLY | O_TRUNC),
            _ => (Some(a[0]), 1, if e.nr == 257 { a[2] } else { 0 }),
        };
        self.forget_fd_miss(pid, fd);
        let Some(d) = path_arg(e, pi) else { return };
        let path = self.resolve(pid, dirfd, &d.bytes);
        let p: Arc<str> = Arc::from(path.as_str());
        if flags & O_TRUNC != 0 && flags & 3 != 0 {
            if self.file_size(Some(&p)).unwrap_or(1) > 0 {
                self.file_event(true, path.clone(), 0, pid);
            }
            self.set_size(Some(&p), 0);
        }
        self.proc_mut(pid, Some(&e.comm)).fds.insert(
            fd,
            FdEntry {
                path: Some(p),
                flags,
                cloexec: flags & O_CLOEXEC != 0,
                offset: 0,
                highest: 0,
                inode: 0,
            },
        );
    }

    /// A successful fcntl: descriptor duplication, and the close-on-exec and append flags.
    fn on_fcntl(&mut self, pid: u32, a: [u64; 6], ret: Option<i64>) {
        match a[1] {
            0 | 1030 => self.fd_copy(pid, a[0], ret.unwrap_or(0) as u64, a[1] == 1030),
            2 => {
                if let Some(f) = self
                    .procs
                    .get_mut(&pid)
                    .and_then(|p| p.fds.get_mut(&(a[0] as u32)))
                {
                    f.cloexec = a[2] & 1 != 0;
                }
            }
            4 => {
                if let Some(f) = self
                    .procs
                    .get_mut(&pid)
                    .and_then(|p| p.fds.get_mut(&(a[0] as u32)))
                {
                    f.flags = (f.flags & !O_APPEND) | (a[2] & O_APPEND);
                }
            }
            _ => {}
        }
    }

    /// A successful read or write (plain, positional or vectored: [`io_call`]) or lseek that
    /// returned `n`: the fd's offset and inode, the file's size, and read classification.
    fn on_io(&mut self, e: &EntryEvent, n: u64, now: u64) {
        let pid = e.tgid;
        let a = e.args;
        let io = e.io.as_ref();
        let (positional, write) = io_call(e.nr, &a).unwrap_or((false, false));
        let mut grow = None;
        if let Some(f) = self
            .procs
            .get_mut(&pid)
            .and_then(|p| p.fds.get_mut(&(a[0] as u32)))
        {
            if let Some(io) = io {
                f.inode = io.inode;
            }
            let start = match (e.nr, io) {
                (8, _) => {
                    f.offset = n;
                    return;
                }
                (_, Some(io)) => io.file_pos,
                _ if positional => a[3],
                _ => f.offset,
            };
            let end = start.saturating_add(n);
            if !positional {
                f.offset = end;
            }
            f.highest = f.highest.max(end);
            if write {
                grow = Some((f.path.clone(), end));
            }
        }
        if let Some((p, end)) = grow {
            let s = self.file_size(p.as_ref()).unwrap_or(0).max(end);
            self.set_size(p.as_ref(), s);
        }
        if let Some(io) = io.filter(|io| io.read) {
            self.on_read_complete(e, io, now);
        }
    }

    /// A successful ftruncate of `fd` to `size`.
    fn on_ftruncate(&mut self, pid: u32, fd: u64, size: u64) {
        let p = self
            .procs
            .get(&pid)
            .and_then(|p| p.fds.get(&(fd as u32)))
            .and_then(|f| f.path.clone());
        self.set_size(p.as_ref(), size);
        if let Some(p) = p {
            self.file_event(true, p.to_string(), size, pid);
        }
    }

    /// A successful unlink or unlinkat (not of a directory) of path argument `d`.
    fn on_unlink(&mut self, pid: u32, dirfd: Option<u64>, d: Option<&ArgData>) {
        if let Some(d) = d {
            let path = self.resolve(pid, dirfd, &d.bytes);
            self.sizes.remove(path.as_str());
            self.file_event(false, path, 0, pid);
        }
    }

    /// A successful rename, renameat or renameat2.
    fn on_rename(&mut self, e: &EntryEvent) {
        let pid = e.tgid;
        let a = e.args;
        let (od, oi, nd, ni) = if e.nr == 82 {
            (None, 0, None, 1)
        } else {
            (Some(a[0]), 1, Some(a[2]), 3)
        };
        if let (Some(o), Some(n)) = (path_arg(e, oi), path_arg(e, ni)) {
            let old = self.resolve(pid, od, &o.bytes);
            let new = self.resolve(pid, nd, &n.bytes);
            self.rename(&old, &new);
        }
    }

    /// A successful fchdir to `fd`: the process's working directory is the fd's path.
    fn on_fchdir(&mut self, pid: u32, fd: u64) {
        let p = self
            .procs
            .get(&pid)
            .and_then(|p| p.fds.get(&(fd as u32)))
            .and_then(|f| f.path.as_deref().map(str::to_string));
        if let Some(p) = p {
            self.proc_mut(pid, None).cwd = Some(p);
        }
    }

    // --- block side -----------------------------------------------------------------------

    /// Classifies a block write of `data` at disk byte `offset` (Sky §3.4.1): every 4 KiB
    /// chunk is looked up among the write syscalls' checksums.
    pub fn classify_write(
        &mut self,
        disk: u32,
        offset: u64,
        data: &[u8],
        journal: bool,
    ) -> RequestInsight {
        self.classify_write_owned(disk, offset, data, journal, &mut |_| None)
    }

    /// [`Self::classify_write`], and a chunk no checksum matched is file data if `owner`
    /// (the chunk's index in the request → what the guest kernel says its page holds; `None`
    /// without a page source or when the chunk is not one whole page) says it is a regular
    /// file's page, unknown if an anonymous or unreadable one (see [`crate::pages`]).
    pub fn classify_write_owned(
        &mut self,
        disk: u32,
        offset: u64,
        data: &[u8],
        journal: bool,
        owner: &mut dyn FnMut(usize) -> Option<PageOwner>,
    ) -> RequestInsight {
        let now = self.now();
        let mut chunks = Vec::with_capacity(data.len() / CHUNK as usize + 1);
        for (i, c) in data.chunks(CHUNK as usize).enumerate() {
            let sum = chunk_sum(c);
            let whole = c.len() == CHUNK as usize;
            let m = if whole { self.take_write(sum) } else { None };
            let m = match m {
                Some((m, false)) => Some(m),
                Some((m, true)) => self.verify_ambiguous(disk, m, owner(i), now),
                None if whole => {
                    let o = owner(i);
                    self.count_owner(true, o.as_ref());
                    self.page_meta(disk, o, now)
                }
                None => None,
            };
            if let Some(m) = m.as_ref().filter(|m| !m.unknown) {
                // The block now holds these bytes: they complete later partial writes.
                if m.inode != 0 {
                    self.cache_chunk_bytes(m.inode, m.offset / CHUNK, c);
                }
                self.remember_known(sum, m.clone());
            }
            chunks.push((sum, m));
        }
        let insight = self.insight_of(&chunks, journal);
        let record = BlockRecord {
            ts_ns: now.saturating_sub(self.t0),
            disk,
            offset,
            len: data.len() as u64,
            insight: insight.clone(),
        };
        let all = chunks.iter().all(|c| ChunkMeta::settled(&c.1));
        if all || self.cfg.write_grace.is_zero() {
            self.emit(true, record, &chunks);
        } else {
            self.add_pending(
                true,
                record,
                chunks,
                now + self.cfg.write_grace.as_nanos() as u64,
            );
        }
        self.expire(now);
        insight
    }

    /// Classifies a block read of `data` (after the backend filled it). The read syscall that
    /// consumes it returns later, so the final class is retroactive (log and counters); the
    /// request gets the best-known insight now: data of a known file if its content was seen
    /// at a syscall recently, else metadata.
    pub fn classify_read(&mut self, disk: u32, offset: u64, data: &[u8]) -> RequestInsight {
        self.classify_read_owned(disk, offset, data, &[])
    }

    /// [`Self::classify_read`] with the owners of the request's pages (`owners[i]` for chunk
    /// `i`, from [`Self::read_owners_insight`]'s caller; missing or `None`: not known): a
    /// chunk whose content no syscall showed is its page's file's data (readahead fills the
    /// page cache's own pages), unknown for an anonymous or unreadable page, else metadata.
    /// Page-owned chunks still wait the read window for the read syscall that names the
    /// reader.
    pub fn classify_read_owned(
        &mut self,
        disk: u32,
        offset: u64,
        data: &[u8],
        owners: &[Option<PageOwner>],
    ) -> RequestInsight {
        let now = self.now();
        let mut chunks: Vec<(u64, Option<ChunkMeta>)> = data
            .chunks(CHUNK as usize)
            .map(|c| {
                let sum = chunk_sum(c);
                // Content seen at a syscall: a past fact, final.
                let m = self.known.get(&sum).cloned().map(|mut m| {
                    m.by_page = false;
                    m
                });
                (sum, m)
            })
            .collect();
        // Data of a file being copied without a user buffer (no read syscall will match it).
        self.expire_copies(now);
        if self.copy_hint_read(disk, offset, data.len() as u64, &mut chunks, now) {
            self.counters.copy_reads += 1;
        }
        for (i, c) in chunks.iter_mut().enumerate() {
            if c.1.is_none() {
                let o = owners.get(i).cloned().flatten();
                self.count_owner(false, o.as_ref());
                c.1 = self.page_meta(disk, o, now);
            }
        }
        let insight = self.insight_of(&chunks, false);
        let record = BlockRecord {
            ts_ns: now.saturating_sub(self.t0),
            disk,
            offset,
            len: data.len() as u64,
            insight: insight.clone(),
        };
        if chunks.iter().all(|c| ChunkMeta::settled(&c.1)) || self.cfg.read_window.is_zero() {
            self.emit(false, record, &chunks);
        } else {
            // Known chunks are final; the others wait for a read syscall in the window.
            self.add_pending(
                false,
                record,
                chunks,
                now + self.cfg.read_window.as_nanos() as u64,
            );
        }
        self.expire(now);
        insight
    }

    /// The insight of a block read before it goes down, from its pages' owners alone (what
    /// the guest kernel's page cache says the pages will hold), so stages below (the cache)
    /// see the class at the first access. Nothing is logged or counted: the read is
    /// classified again, with its data, by [`Self::classify_read_owned`].
    pub fn read_owners_insight(
        &mut self,
        disk: u32,
        owners: &[Option<PageOwner>],
    ) -> RequestInsight {
        let now = self.now();
        let chunks: Vec<(u64, Option<ChunkMeta>)> = owners
            .iter()
            .map(|o| (0, self.page_meta(disk, o.clone(), now)))
            .collect();
        self.insight_of(&chunks, false)
    }

    fn add_pending(
        &mut self,
        write: bool,
        record: BlockRecord,
        chunks: Vec<(u64, Option<ChunkMeta>)>,
        deadline: u64,
    ) {
        let id = self.next_pending;
        self.next_pending += 1;
        if !write {
            self.pending_reads.insert((record.disk, record.offset, id));
            self.pending_read_max = self.pending_read_max.max(record.len);
        }
        for (f, m) in &chunks {
            if !ChunkMeta::settled(m) {
                self.pending_by_fnv.entry(*f).or_default().push(id);
            }
        }
        self.pending.insert(
            id,
            Pending {
                write,
                record,
                chunks,
            },
        );
        self.deadlines.push(Reverse((deadline, id)));
        let max = if write {
            self.cfg.max_write_sums
        } else {
            self.cfg.max_read_sums
        };
        while self.pending.len() > max.max(1) {
            let Some((&first, _)) = self.pending.iter().next() else {
                break;
            };
            self.finish_pending(first);
        }
    }

    fn finish_pending(&mut self, id: u64) {
        if let Some(p) = self.pending.remove(&id) {
            if !p.write {
                self.pending_reads
                    .remove(&(p.record.disk, p.record.offset, id));
            }
            for (f, _) in &p.chunks {
                if let Some(v) = self.pending_by_fnv.get_mut(f) {
                    v.retain(|&x| x != id);
                    if v.is_empty() {
                        self.pending_by_fnv.remove(f);
                    }
                }
            }
            let mut r = p.record;
            r.insight = self.insight_of(&p.chunks, r.insight.journal);
            self.emit(p.write, r, &p.chunks);
        }
    }

    /// Finalises pending requests whose window or grace has passed.
    pub fn expire(&mut self, now: u64) {
        self.expire_copies(now);
        let mut due = Vec::new();
        while let Some(&Reverse((deadline, id))) = self.deadlines.peek() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            due.push(id);
        }
        // In classification order, as the log always had them.
        due.sort_unstable();
        for id in due {
            self.finish_pending(id);
        }
    }

    /// Logs a discard / write-zeroes range (ends block lifetimes in `vmsight report`).
    pub fn log_discard(&mut self, disk: u32, offset: u64, len: u64) {
        let ts = self.now().saturating_sub(self.t0);
        self.log.write(InsightRecord::Discard(BlockRecord {
            ts_ns: ts,
            disk,
            offset,
            len,
            insight: RequestInsight::metadata(),
        }));
    }

    /// Stops logging (drops the log's sender so its writer thread can end).
    pub fn close_log(&mut self) {
        self.log = InsightLog::disabled();
    }

    /// Finalises everything (end of run).
    pub fn flush(&mut self) {
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            self.finish_pending(id);
        }
        self.deadlines.clear();
    }

    fn emit(&mut self, write: bool, r: BlockRecord, chunks: &[(u64, Option<ChunkMeta>)]) {
        let data = chunks.iter().filter(|c| ChunkMeta::is_data(&c.1)).count() as u64;
        let unknown = chunks
            .iter()
            .filter(|c| ChunkMeta::is_unknown(&c.1))
            .count() as u64;
        let meta = chunks.len() as u64 - data - unknown;
        let by_page = chunks
            .iter()
            .filter(|c| c.1.as_ref().is_some_and(|m| m.by_page && !m.unknown))
            .count() as u64;
        let c = &mut self.counters;
        let (tally, d, u, m, p) = if write {
            (
                &mut c.writes,
                &mut c.write_chunks_data,
                &mut c.write_chunks_unknown,
                &mut c.write_chunks_metadata,
                &mut c.write_chunks_by_page,
            )
        } else {
            (
                &mut c.reads,
                &mut c.read_chunks_data,
                &mut c.read_chunks_unknown,
                &mut c.read_chunks_metadata,
                &mut c.read_chunks_by_page,
            )
        };
        *d += data;
        *u += unknown;
        *m += meta;
        *p += by_page;
        let t = tally.entry(r.insight.class).or_default();
        t.requests += 1;
        t.bytes += r.len;
        if write {
            self.counters.copy_write_chunks += chunks
                .iter()
                .filter(|c| c.1.as_ref().is_some_and(|m| m.copied))
                .count() as u64;
        }
        // One log record per run of chunks with the same classification: a request the guest
        // merged from blocks of several files is logged as the parts it is made of, so hints
        // and files are attributed to exactly their blocks.
        let mut start = 0usize;
        while start < chunks.len() {
            let ins = self.insight_of(&chunks[start..start + 1], r.insight.journal);
            let mut end = start + 1;
            while end < chunks.len() && {
                let next = self.insight_of(&chunks[end..end + 1], r.insight.journal);
                // A record says where its first byte is in its file; the rest must follow on.
                let follows = ins.file_offset.map(|o| o + (end - start) as u64 * CHUNK);
                same_run(&next, &ins) && next.file_offset == follows
            } {
                end += 1;
            }
            let off = start as u64 * CHUNK;
            let len = (end as u64 * CHUNK).min(r.len).saturating_sub(off);
            let mut part = r.clone();
            part.offset = r.offset + off;
            part.len = len;
            part.insight = if start == 0 && end == chunks.len() {
                let mut whole = r.insight.clone();
                whole.block_classes.clear();
                whole
            } else {
                ins
            };
            self.log.write(if write {
                InsightRecord::Write(part)
            } else {
                InsightRecord::Read(part)
            });
            start = end;
        }
        if chunks.is_empty() {
            self.log.write(if write {
                InsightRecord::Write(r)
            } else {
                InsightRecord::Read(r)
            });
        }
    }

    /// The insight of a request from its chunks' matches.
    fn insight_of(&self, chunks: &[(u64, Option<ChunkMeta>)], journal: bool) -> RequestInsight {
        let sizes = &self.cfg.size_classes;
        let hits: Vec<(usize, &ChunkMeta)> = chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.1.as_ref().filter(|m| !m.unknown).map(|m| (i, m)))
            .collect();
        let unknown = chunks
            .iter()
            .filter(|c| ChunkMeta::is_unknown(&c.1))
            .count();
        let metadata = chunks.len() - hits.len() - unknown;
        let mut ins = RequestInsight::metadata();
        ins.journal = journal;
        ins.class = sizes.metadata;
        ins.content = match (hits.len(), unknown, metadata) {
            (0, 0, _) => return ins,
            (_, 0, 0) => Content::Data,
            (0, _, 0) => Content::Unknown,
            _ => Content::Mixed,
        };
        if let Some(&(i0, first)) = hits.first() {
            ins.pid = (first.pid != 0).then_some(first.pid); // 0: a page-owned chunk, writer unknown
            ins.file = first.file.clone();
            ins.file_offset = Some(first.offset.saturating_sub(i0 as u64 * CHUNK));
            ins.size_class = hits.iter().map(|h| h.1.size_class).max();
            ins.pattern = hits.iter().find_map(|h| h.1.pattern);
            ins.app_class = hits.iter().find_map(|h| h.1.app_class);
        }
        // Per block: metadata its class, unknown the lowest (like a file of unknown size),
        // data its hint or size class.
        let per: Vec<u8> = chunks
            .iter()
            .map(|c| match &c.1 {
                None => sizes.metadata,
                Some(m) if m.unknown => sizes.otherwise,
                Some(m) => m.app_class.unwrap_or(m.size_class),
            })
            .collect();
        ins.class = match (ins.app_class, ins.content) {
            (Some(a), _) => a,
            // A mixed request carries metadata: it keeps the metadata class.
            (None, Content::Mixed) if metadata > 0 => sizes.metadata,
            (None, Content::Unknown) => sizes.otherwise,
            (None, _) => per.iter().copied().max().unwrap_or(sizes.otherwise),
        };
        if chunks.len() > 1 {
            // Blocks of different files (or data next to metadata) keep their own class.
            let apps: Vec<Option<u8>> = chunks
                .iter()
                .map(|c| c.1.as_ref().and_then(|m| m.app_class))
                .collect();
            if apps.iter().any(|a| *a != apps[0]) {
                // Hinted and unhinted (or differently hinted) blocks in one request: the
                // request as a whole has no single application class.
                ins.app_class = None;
                ins.class = per.iter().copied().max().unwrap_or(ins.class);
            }
            if per.iter().any(|c| *c != per[0]) {
                ins.block_classes = per;
            }
        }
        ins
    }
}

/// The shared insight engine: register a clone as a [`SyscallObserver`] of the trace
/// session and give clones to [`crate::Classifier`]s.
#[derive(Clone)]
pub struct InsightEngine {
    inner: Arc<Mutex<Engine>>,
    /// Where guest files live on the disks (copies without a user buffer); set once, when
    /// the disks' file systems are known. Used without the engine's lock.
    blocks: Arc<OnceLock<Arc<dyn FileBlocks>>>,
    /// Where the observer asks for what it did not see (module `facts`). Its own lock, taken
    /// only by the trace thread (and `set_lookup`), so a slow lookup never holds the engine's.
    lookup: Arc<Mutex<Option<Box<dyn Lookup>>>>,
    /// Who owns a guest page (module `pages`): set once guest memory can be read; used
    /// without the engine's lock.
    pages: Arc<OnceLock<Arc<dyn PageOwnerSource>>>,
}

impl InsightEngine {
    /// An engine with the host monotonic clock.
    pub fn new(cfg: InsightConfig, log: InsightLog) -> Self {
        Self::with_clock(cfg, log, Arc::new(vmsight_ring::monotonic_ns))
    }

    /// An engine with an injected clock (tests).
    pub fn with_clock(cfg: InsightConfig, log: InsightLog, clock: Clock) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Engine::new(cfg, log, clock))),
            blocks: Arc::default(),
            lookup: Arc::default(),
            pages: Arc::default(),
        }
    }

    /// Locks the engine (a panic elsewhere does not make the data unusable).
    pub fn lock(&self) -> MutexGuard<'_, Engine> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A copy of the counters.
    pub fn counters(&self) -> ClassCounters {
        self.lock().counters.clone()
    }

    /// Sets the resolver of guest files to disk ranges, with which copies without a user
    /// buffer are followed down to their block reads (every clone shares it). `false` if
    /// one was already set (it stays).
    pub fn set_file_blocks(&self, blocks: Arc<dyn FileBlocks>) -> bool {
        self.blocks.set(blocks).is_ok()
    }

    /// Sets the source of page ownership with which block-write chunks no checksum matched are
    /// classified (every clone shares it). `false` if one was already set (it stays).
    pub fn set_page_owners(&self, pages: Arc<dyn PageOwnerSource>) -> bool {
        self.pages.set(pages).is_ok()
    }

    /// The page ownership source, when one is set.
    pub fn page_owners(&self) -> Option<&Arc<dyn PageOwnerSource>> {
        self.pages.get()
    }

    /// Sets (or, with `None`, removes) the source the engine asks for the working directory of
    /// a process and the fds it did not see opened (every clone shares it).
    pub fn set_lookup(&self, lookup: Option<Box<dyn Lookup>>) {
        *self
            .lookup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = lookup;
    }

    /// Asks the lookup, if one is set, for what `missing` (run under the engine's lock) says
    /// the tables lack; the lookups themselves run without the engine's lock.
    fn ask(&self, missing: impl FnOnce(&Engine) -> facts::Missing) -> Option<facts::Answers> {
        let mut slot = self
            .lookup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let lookup = slot.as_mut()?;
        let need = missing(&self.lock());
        (!need.is_empty()).then(|| need.ask(lookup.as_mut()))
    }

    /// Resolves a copy's source outside the engine's lock and registers it.
    fn begin_copy(&self, req: copy::CopyReq) {
        let ranges: Vec<DiskRange> = match self.blocks.get() {
            Some(b) => b.ranges(&req.src, req.off, req.len),
            None => Vec::new(),
        };
        self.lock().copy_begin(req, ranges);
    }
}

impl SyscallObserver for InsightEngine {
    fn on_entry(&mut self, e: &EntryEvent) {
        // A new process's tables before anything else it does (module `forks`).
        let ppid = forks::parent_tgid(e);
        if ppid.is_some() || forks::starts_process(e) {
            let mut g = self.lock();
            if let Some(pp) = ppid {
                g.adopt(e.tgid, pp);
            }
            if forks::starts_process(e) {
                g.fork_entry(e);
            }
        }
        let answers = self.ask(|g| g.missing_at_entry(e));
        if let Some(io) = e.io.as_ref().filter(|io| !io.read) {
            let mut g = self.lock();
            g.learn(answers);
            // Requests whose grace ended before this event must not match it.
            let now = g.now();
            g.expire(now);
            g.on_write_entry(e, io, now);
        } else if copy::is_copy(e.nr) {
            // Registered at entry: the source's block reads happen during the call.
            let req = {
                let mut g = self.lock();
                g.learn(answers);
                let now = g.now();
                g.expire(now);
                g.copy_request(e, None)
            };
            if let Some(req) = req {
                self.begin_copy(req);
            }
        } else if answers.is_some() {
            self.lock().learn(answers);
        }
    }

    fn on_complete(&mut self, c: &Completed) {
        let answers = self.ask(|g| g.missing_at_completion(c));
        let follow = {
            let mut g = self.lock();
            g.learn(answers);
            let now = g.now();
            g.expire(now);
            g.on_complete(c, now)
        };
        match follow {
            Some(copy::Followup::Copy(req)) => self.begin_copy(req),
            Some(copy::Followup::Mount { source, target }) => {
                self.lock().note_mount(&source, &target);
                if let Some(b) = self.blocks.get() {
                    b.note_mount(&source, &target);
                }
            }
            Some(copy::Followup::Umount { target }) => {
                self.lock().note_umount(&target);
                if let Some(b) = self.blocks.get() {
                    b.note_umount(&target);
                }
            }
            None => {}
        }
    }

    fn finish(&mut self) {
        self.lock().flush();
    }
}

/// Writes `bytes` into chunk `buf` at `within`, zeroes it from `valid` on (beyond end of file)
/// and returns its checksum.
fn patch_chunk(buf: &mut [u8], within: usize, bytes: &[u8], valid: usize) -> u64 {
    buf[within..within + bytes.len()].copy_from_slice(bytes);
    buf[valid..].fill(0);
    chunk_sum(buf)
}

/// Whether two single-chunk insights belong to the same logged run.
fn same_run(a: &RequestInsight, b: &RequestInsight) -> bool {
    a.class == b.class
        && a.content == b.content
        && a.app_class == b.app_class
        && a.file == b.file
        && a.pid == b.pid
        && a.pattern == b.pattern
        && a.size_class == b.size_class
}
