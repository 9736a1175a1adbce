//! A dedup volume: create, open, read, write (with hints), discard, commit, garbage-collect.
//!
//! A write of a logical block hashes its 4 KiB (BLAKE3). A *unique* write (hint) takes a free
//! chunk and is never indexed. Any other write looks in the hint cache, then in the on-disk
//! hash index; a hit shares the chunk (its reference count goes up), a miss takes a free chunk,
//! writes it and indexes it. The block's old chunk loses a reference; a chunk without
//! references is free again only after the next commit, so the committed state never points
//! at a reused chunk. Chunks held only by the index (count 1, nothing maps them) stay until
//! garbage collection, so content that comes back is shared again, as in dm-dedup.

use std::fs::{File, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use serde::Serialize;
use vmsight_blockdev::insight::DedupHint;
use vmsight_blockdev::stages::DiskModelConfig;

use crate::disk::{Disk, DiskCounters};
use crate::error::{DedupError, Result};
use crate::format::{
    hash_chunk, u16_at, u32_at, u64_at, Geometry, Hash, Superblock, BLOCK, BUCKET_HEADER,
    BUCKET_OVERFLOW, ENTRIES_PER_BUCKET, ENTRY_BYTES, L2P_PER_PAGE, RC_PER_PAGE,
};
use crate::hints::{Hints, DEFAULT_HINT_ENTRIES};
use crate::meta::{MetaCounters, MetaStore};

/// File name of the data file in a volume directory.
pub const DATA_FILE: &str = "data";
/// File name of the metadata file in a volume directory.
pub const META_FILE: &str = "meta";
/// Largest run of chunks written or read with one system call.
const MAX_RUN: usize = 256;

/// Size of the metadata buffer cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum MetaCache {
    /// Percent of the metadata file (the volume's peak metadata).
    Percent(f64),
    /// Bytes.
    Bytes(u64),
}

impl Default for MetaCache {
    fn default() -> Self {
        Self::Percent(1.0)
    }
}

impl MetaCache {
    /// Parses `N%` or a size with an optional K/M/G suffix (`MiB`, `M`, ...).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("meta-cache {s:?} is not a percentage"))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!(
                    "meta-cache {s:?} must be above 0 % and at most 100 %"
                ));
            }
            return Ok(Self::Percent(v));
        }
        parse_size(s)
            .filter(|b| *b > 0)
            .map(Self::Bytes)
            .ok_or_else(|| format!("meta-cache {s:?} is neither N% nor a size such as 4MiB"))
    }

    /// Pages for a volume of `geo`.
    pub fn pages(&self, geo: &Geometry) -> usize {
        let pages = match self {
            Self::Percent(p) => (geo.meta_pages() as f64 * p / 100.0).ceil() as u64,
            Self::Bytes(b) => b.div_ceil(BLOCK),
        };
        pages.clamp(8, geo.meta_pages()) as usize
    }
}

/// Parses a byte size: digits with an optional suffix K, M, G, T (powers of 1024, with or
/// without `iB`/`B`).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// How a volume is opened.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct VolumeOptions {
    /// Metadata buffer cache size.
    pub meta_cache: MetaCache,
    /// Commit after this many block writes without a FLUSH (dm-dedup's flushrq).
    pub flush_every: u64,
    /// Bound of the hint cache and of the recent-read records (entries each).
    pub hint_entries: usize,
    /// The modelled disk under both files.
    #[serde(skip)]
    pub model: DiskModelConfig,
    /// Record read hashes for copy hints (off when no insight engine feeds hints).
    pub hints: bool,
}

impl Default for VolumeOptions {
    fn default() -> Self {
        Self {
            meta_cache: MetaCache::default(),
            flush_every: 4096,
            hint_entries: DEFAULT_HINT_ENTRIES,
            model: DiskModelConfig::None,
            hints: false,
        }
    }
}

/// Counters of a volume's work (everything the stats show).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct VolumeCounters {
    /// Logical blocks written by the guest.
    pub blocks_written: u64,
    /// Logical blocks read by the guest.
    pub blocks_read: u64,
    /// Writes with a unique hint (no lookup, no insertion).
    pub unique_hints: u64,
    /// Writes with a copy hint.
    pub copy_write_hints: u64,
    /// Writes that found their chunk in the hint cache.
    pub hint_hits: u64,
    /// On-disk index lookups, and how many found the content.
    pub index_lookups: u64,
    pub index_hits: u64,
    /// Index insertions and removals (garbage collection).
    pub index_inserts: u64,
    pub index_removes: u64,
    /// Blocks discarded or zeroed (references dropped).
    pub blocks_discarded: u64,
    /// Chunks freed by garbage collection.
    pub gc_freed: u64,
    /// Commits triggered by a guest FLUSH, by `flush_every`, by the dirty-page bound.
    pub flush_commits: u64,
    pub periodic_commits: u64,
    pub pressure_commits: u64,
}

/// Everything `dedup info` and the stats report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VolumeInfo {
    pub path: PathBuf,
    pub logical_bytes: u64,
    pub logical_blocks: u64,
    pub physical_blocks: u64,
    /// Logical blocks that map to a chunk.
    pub mapped_blocks: u64,
    /// Chunks in use (referenced, indexed or waiting for the next commit to be free).
    pub used_chunks: u64,
    /// Index entries.
    pub index_entries: u64,
    pub index_bytes: u64,
    pub meta_bytes: u64,
    /// mapped / used (1.0 when nothing is stored).
    pub dedup_ratio: f64,
    /// Bytes the mapped blocks would take without dedup, minus what they take.
    pub saved_bytes: u64,
    pub generation: u64,
    pub meta_cache_pages: usize,
}

/// Free chunks.
struct Allocator {
    free: Vec<u64>,
    free_count: u64,
    cursor: u64,
    /// Chunks whose last reference went since the last commit.
    pending: Vec<u64>,
    total: u64,
}

impl Allocator {
    fn new(total: u64) -> Self {
        Self {
            free: vec![0; total.div_ceil(64) as usize],
            free_count: 0,
            cursor: 0,
            pending: Vec::new(),
            total,
        }
    }

    fn is_free(&self, pba: u64) -> bool {
        self.free[(pba / 64) as usize] & (1 << (pba % 64)) != 0
    }

    fn set_free(&mut self, pba: u64) {
        if !self.is_free(pba) {
            self.free[(pba / 64) as usize] |= 1 << (pba % 64);
            self.free_count += 1;
        }
    }

    /// Next free chunk at or after the cursor (next fit keeps sequential writes sequential).
    fn take(&mut self) -> Option<u64> {
        if self.free_count == 0 {
            return None;
        }
        let words = self.free.len() as u64;
        let start = self.cursor / 64;
        for i in 0..=words {
            let w = (start + i) % words;
            let mut bits = self.free[w as usize];
            if i == 0 {
                bits &= !0u64 << (self.cursor % 64);
            }
            if bits != 0 {
                let pba = w * 64 + u64::from(bits.trailing_zeros());
                if pba >= self.total {
                    continue;
                }
                self.free[w as usize] &= !(1 << (pba % 64));
                self.free_count -= 1;
                self.cursor = pba + 1;
                return Some(pba);
            }
        }
        None
    }

    fn release_pending(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            self.set_free(p);
        }
    }
}

/// Chunks waiting to be written: consecutive chunks go down in one call.
#[derive(Default)]
struct DataRun {
    start: u64,
    buf: Vec<u8>,
}

/// An open dedup volume (exclusive: the metadata file is locked).
pub struct Volume {
    dir: PathBuf,
    geo: Geometry,
    disk: Disk,
    meta: MetaStore,
    alloc: Allocator,
    hints: Hints,
    opts: VolumeOptions,
    run: DataRun,
    mapped: u64,
    index_entries: u64,
    writes_since_commit: u64,
    replayed: bool,
    pub counters: VolumeCounters,
    /// The metadata file again: holds the lock, and reads tables outside the cache and the
    /// model (mount-time scan, `check`).
    raw: File,
}

fn io_err(dir: &Path, op: impl Into<String>) -> impl FnOnce(std::io::Error) -> DedupError + '_ {
    let op = op.into();
    move |source| DedupError::Io {
        path: dir.to_owned(),
        op,
        source,
    }
}

fn lock_exclusive(dir: &Path, f: &File) -> Result<()> {
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Err(DedupError::InUse {
            path: dir.to_owned(),
        })
    } else {
        Err(io_err(dir, "locking the metadata file")(e))
    }
}

impl Volume {
    /// Creates an empty volume of `size` bytes in directory `dir` (created if missing; must
    /// not hold a volume already). Both files are sparse.
    pub fn create(dir: &Path, size: u64) -> Result<()> {
        let geo = Geometry::for_size(size).map_err(|reason| DedupError::Create {
            path: dir.to_owned(),
            reason,
        })?;
        std::fs::create_dir_all(dir).map_err(io_err(dir, "creating the volume directory"))?;
        let meta_path = dir.join(META_FILE);
        if meta_path.exists() {
            return Err(DedupError::Create {
                path: dir.to_owned(),
                reason: "it already holds a volume (remove the directory first)".into(),
            });
        }
        let data =
            File::create(dir.join(DATA_FILE)).map_err(io_err(dir, "creating the data file"))?;
        data.set_len(geo.data_bytes())
            .map_err(io_err(dir, "sizing the data file"))?;
        let tmp = dir.join("meta.new");
        let meta = File::create(&tmp).map_err(io_err(dir, "creating the metadata file"))?;
        meta.set_len(geo.meta_bytes())
            .map_err(io_err(dir, "sizing the metadata file"))?;
        let sb = Superblock {
            geometry: geo,
            generation: 0,
        };
        use std::os::unix::fs::FileExt;
        meta.write_all_at(&sb.encode(), 0)
            .map_err(io_err(dir, "writing the superblock"))?;
        meta.sync_all()
            .map_err(io_err(dir, "syncing the metadata file"))?;
        data.sync_all()
            .map_err(io_err(dir, "syncing the data file"))?;
        std::fs::rename(&tmp, &meta_path).map_err(io_err(dir, "naming the metadata file"))?;
        Ok(())
    }

    /// Whether `path` looks like a volume directory (has a metadata file).
    pub fn is_volume(path: &Path) -> bool {
        path.join(META_FILE).is_file()
    }

    /// Opens the volume in `dir` exclusively, replays an unfinished commit and scans the
    /// tables for the allocator. Every inconsistency found on the way is an error.
    pub fn open(dir: &Path, opts: VolumeOptions) -> Result<Self> {
        if !dir.is_dir() {
            return Err(DedupError::NotVolume {
                path: dir.to_owned(),
                reason: "no such directory".into(),
            });
        }
        let open = |name: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(name))
                .map_err(|source| match source.kind() {
                    std::io::ErrorKind::NotFound => DedupError::NotVolume {
                        path: dir.to_owned(),
                        reason: format!("no {name} file"),
                    },
                    _ => io_err(dir, format!("opening the {name} file"))(source),
                })
        };
        let meta = open(META_FILE)?;
        let data = open(DATA_FILE)?;
        let lock = meta
            .try_clone()
            .map_err(io_err(dir, "duplicating a descriptor"))?;
        lock_exclusive(dir, &lock)?;
        let sb = read_superblock(dir, &meta)?;
        let geo = sb.geometry;
        check_file_len(dir, &meta, geo.meta_bytes(), "metadata")?;
        check_file_len(dir, &data, geo.data_bytes(), "data")?;
        let mut disk = Disk::new(dir, data, meta, &geo, opts.model);
        let (meta, replayed) = MetaStore::open(&mut disk, sb, opts.meta_cache.pages(&geo))?;
        let mut v = Self {
            dir: dir.to_owned(),
            geo,
            disk,
            meta,
            alloc: Allocator::new(geo.physical_blocks),
            hints: Hints::new(opts.hint_entries),
            opts,
            run: DataRun::default(),
            mapped: 0,
            index_entries: 0,
            writes_since_commit: 0,
            replayed,
            counters: VolumeCounters::default(),
            raw: lock,
        };
        v.scan()?;
        v.disk.counters = DiskCounters::default();
        v.meta.counters = MetaCounters::default();
        Ok(v)
    }

    /// Builds the allocator and the gauges from the tables (read directly, not through the
    /// cache, and not charged to the model: this is mount time).
    fn scan(&mut self) -> Result<()> {
        let geo = self.geo;
        let mut bad = None;
        let mut mapped = 0;
        let mut used_l2p = vec![false; geo.l2p_pages() as usize];
        self.raw_mappings(|lba, v| {
            if lba >= geo.logical_blocks || v > geo.physical_blocks {
                bad.get_or_insert((lba, v - 1));
            }
            if let Some(u) = used_l2p.get_mut((lba / L2P_PER_PAGE) as usize) {
                *u = true;
            }
            mapped += 1;
        })?;
        if let Some((lba, pba)) = bad {
            return Err(self.corrupt(format!(
                "logical block {lba} maps to chunk {pba} beyond the volume"
            )));
        }
        self.mapped = mapped;
        for (p, _) in used_l2p.iter().enumerate().filter(|(_, u)| !**u) {
            self.meta.mark_empty(geo.l2p_start() + p as u64);
        }
        let mut page = vec![0u8; BLOCK as usize];
        for p in 0..geo.rc_pages() {
            self.raw_page(geo.rc_start() + p, &mut page)?;
            if page.iter().all(|b| *b == 0) {
                self.meta.mark_empty(geo.rc_start() + p);
            }
            for i in 0..RC_PER_PAGE as usize {
                let pba = p * RC_PER_PAGE + i as u64;
                if pba >= geo.physical_blocks {
                    break;
                }
                if u32_at(&page, i * 4) == 0 {
                    self.alloc.set_free(pba);
                }
            }
        }
        for b in 0..geo.index_buckets {
            self.raw_page(geo.index_start() + b, &mut page)?;
            let n = u16_at(&page, 0) as usize;
            if n > ENTRIES_PER_BUCKET {
                return Err(self.corrupt(format!("index page {b} claims {n} entries")));
            }
            self.index_entries += n as u64;
        }
        Ok(())
    }

    /// Calls `f(lba, entry)` for every non-zero L2P entry (entry = chunk + 1), reading the
    /// table pages directly (mount-time scan, `check`).
    pub(crate) fn raw_mappings(&mut self, mut f: impl FnMut(u64, u64)) -> Result<()> {
        let mut page = vec![0u8; BLOCK as usize];
        for p in 0..self.geo.l2p_pages() {
            self.raw_page(self.geo.l2p_start() + p, &mut page)?;
            for i in 0..L2P_PER_PAGE as usize {
                let v = u64_at(&page, i * 8);
                if v != 0 {
                    f(p * L2P_PER_PAGE + i as u64, v);
                }
            }
        }
        Ok(())
    }

    fn raw_page(&mut self, page: u64, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.raw
            .read_exact_at(buf, page * BLOCK)
            .map_err(io_err(&self.dir, format!("reading metadata page {page}")))
    }

    fn corrupt(&self, reason: String) -> DedupError {
        DedupError::Corrupt {
            path: self.dir.clone(),
            reason,
        }
    }

    /// The volume directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    /// Whether opening replayed an unfinished commit.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The hint state shared with the hint stage.
    pub fn hints(&self) -> Hints {
        self.hints.clone()
    }

    /// The options the volume was opened with.
    pub fn options(&self) -> &VolumeOptions {
        &self.opts
    }

    /// Host I/O counters of the files.
    pub fn disk_counters(&self) -> DiskCounters {
        self.disk.counters
    }

    /// Metadata cache counters.
    pub fn meta_counters(&self) -> MetaCounters {
        self.meta.counters
    }

    /// Modelled service time so far (ns) and seeks.
    pub fn modelled(&mut self) -> (u64, u64) {
        let c = self.disk.clock();
        (c.modelled_ns, c.seeks)
    }

    /// Sleeps until the modelled disk finished everything issued so far.
    pub fn wait_model(&mut self) -> std::time::Duration {
        self.disk.clock().wait()
    }

    /// Size, use and ratios.
    pub fn info(&self) -> VolumeInfo {
        let used = self.geo.physical_blocks - self.alloc.free_count;
        VolumeInfo {
            path: self.dir.clone(),
            logical_bytes: self.geo.logical_bytes(),
            logical_blocks: self.geo.logical_blocks,
            physical_blocks: self.geo.physical_blocks,
            mapped_blocks: self.mapped,
            used_chunks: used,
            index_entries: self.index_entries,
            index_bytes: self.geo.index_buckets * BLOCK,
            meta_bytes: self.geo.meta_bytes(),
            dedup_ratio: if used == 0 {
                1.0
            } else {
                self.mapped as f64 / used as f64
            },
            saved_bytes: self.mapped.saturating_sub(used) * BLOCK,
            generation: self.meta.generation(),
            meta_cache_pages: self.meta.capacity(),
        }
    }

    // --- tables -----------------------------------------------------------------------------

    fn l2p_get(&mut self, lba: u64) -> Result<Option<u64>> {
        let page = self.geo.l2p_start() + lba / L2P_PER_PAGE;
        let v = u64_at(
            self.meta.page(&mut self.disk, page)?,
            ((lba % L2P_PER_PAGE) * 8) as usize,
        );
        match v {
            0 => Ok(None),
            v if v <= self.geo.physical_blocks => Ok(Some(v - 1)),
            v => Err(self.corrupt(format!(
                "logical block {lba} maps to chunk {} beyond the volume",
                v - 1
            ))),
        }
    }

    fn l2p_set(&mut self, lba: u64, pba: Option<u64>) -> Result<()> {
        let page = self.geo.l2p_start() + lba / L2P_PER_PAGE;
        let o = ((lba % L2P_PER_PAGE) * 8) as usize;
        let v = pba.map_or(0, |p| p + 1);
        self.meta.page_mut(&mut self.disk, page)?[o..o + 8].copy_from_slice(&v.to_le_bytes());
        self.hints.lock().forget_lba(lba);
        Ok(())
    }

    fn rc_get(&mut self, pba: u64) -> Result<u32> {
        let page = self.geo.rc_start() + pba / RC_PER_PAGE;
        Ok(u32_at(
            self.meta.page(&mut self.disk, page)?,
            ((pba % RC_PER_PAGE) * 4) as usize,
        ))
    }

    fn rc_set(&mut self, pba: u64, v: u32) -> Result<()> {
        let page = self.geo.rc_start() + pba / RC_PER_PAGE;
        let o = ((pba % RC_PER_PAGE) * 4) as usize;
        self.meta.page_mut(&mut self.disk, page)?[o..o + 4].copy_from_slice(&v.to_le_bytes());
        Ok(())
    }

    fn rc_inc(&mut self, pba: u64) -> Result<()> {
        let v = self.rc_get(pba)?;
        if v == 0 {
            return Err(self.corrupt(format!("chunk {pba} is shared but has no references")));
        }
        self.rc_set(pba, v.saturating_add(1))
    }

    /// Drops one reference; a chunk left with none is free after the next commit.
    fn rc_dec(&mut self, pba: u64) -> Result<()> {
        let v = self.rc_get(pba)?;
        if v == 0 {
            return Err(self.corrupt(format!("chunk {pba} loses a reference it does not have")));
        }
        self.rc_set(pba, v - 1)?;
        if v == 1 {
            self.alloc.pending.push(pba);
            self.hints.lock().forget_pba(pba);
        }
        Ok(())
    }

    fn bucket_entry(page: &[u8], i: usize) -> (Hash, u64) {
        let o = BUCKET_HEADER + i * ENTRY_BYTES;
        let mut h = [0u8; 32];
        h.copy_from_slice(&page[o..o + 32]);
        (h, u64_at(page, o + 32))
    }

    /// Index pages probed for `hash`, in order: home page, then while the page overflowed.
    fn index_find(&mut self, hash: &Hash) -> Result<Option<(u64, usize, u64)>> {
        let mut b = self.geo.bucket_of(hash);
        for _ in 0..self.geo.index_buckets {
            let page = self.geo.index_start() + b;
            let p = self.meta.page(&mut self.disk, page)?;
            let n = (u16_at(p, 0) as usize).min(ENTRIES_PER_BUCKET);
            for i in 0..n {
                let (h, pba) = Self::bucket_entry(p, i);
                if h == *hash {
                    if pba >= self.geo.physical_blocks {
                        return Err(self.corrupt(format!(
                            "index page {b} names chunk {pba} beyond the volume"
                        )));
                    }
                    return Ok(Some((page, i, pba)));
                }
            }
            if u16_at(p, 2) & BUCKET_OVERFLOW == 0 {
                return Ok(None);
            }
            b = (b + 1) % self.geo.index_buckets;
        }
        Ok(None)
    }

    fn index_lookup(&mut self, hash: &Hash) -> Result<Option<u64>> {
        self.counters.index_lookups += 1;
        let found = self.index_find(hash)?.map(|(_, _, pba)| pba);
        self.counters.index_hits += u64::from(found.is_some());
        Ok(found)
    }

    fn index_insert(&mut self, hash: &Hash, pba: u64) -> Result<()> {
        let mut b = self.geo.bucket_of(hash);
        for _ in 0..self.geo.index_buckets {
            let page = self.geo.index_start() + b;
            let p = self.meta.page_mut(&mut self.disk, page)?;
            let n = u16_at(p, 0) as usize;
            if n < ENTRIES_PER_BUCKET {
                let o = BUCKET_HEADER + n * ENTRY_BYTES;
                p[o..o + 32].copy_from_slice(hash);
                p[o + 32..o + 40].copy_from_slice(&pba.to_le_bytes());
                p[0..2].copy_from_slice(&((n + 1) as u16).to_le_bytes());
                self.index_entries += 1;
                self.counters.index_inserts += 1;
                return Ok(());
            }
            let flags = u16_at(p, 2) | BUCKET_OVERFLOW;
            p[2..4].copy_from_slice(&flags.to_le_bytes());
            b = (b + 1) % self.geo.index_buckets;
        }
        Err(DedupError::Full {
            path: self.dir.clone(),
            what: "the hash index",
        })
    }

    fn index_remove_at(&mut self, page: u64, i: usize) -> Result<()> {
        let p = self.meta.page_mut(&mut self.disk, page)?;
        let n = (u16_at(p, 0) as usize).min(ENTRIES_PER_BUCKET);
        if i >= n {
            return Ok(());
        }
        let last = BUCKET_HEADER + (n - 1) * ENTRY_BYTES;
        let at = BUCKET_HEADER + i * ENTRY_BYTES;
        p.copy_within(last..last + ENTRY_BYTES, at);
        p[last..last + ENTRY_BYTES].fill(0);
        p[0..2].copy_from_slice(&((n - 1) as u16).to_le_bytes());
        self.index_entries -= 1;
        self.counters.index_removes += 1;
        Ok(())
    }

    // --- data ------------------------------------------------------------------------------

    fn flush_run(&mut self) -> Result<()> {
        if self.run.buf.is_empty() {
            return Ok(());
        }
        let run = std::mem::take(&mut self.run);
        self.disk.write_data(run.start, &run.buf)
    }

    fn push_data(&mut self, pba: u64, data: &[u8]) -> Result<()> {
        let n = (self.run.buf.len() as u64) / BLOCK;
        if !self.run.buf.is_empty() && (self.run.start + n != pba || n as usize >= MAX_RUN) {
            self.flush_run()?;
        }
        if self.run.buf.is_empty() {
            self.run.start = pba;
        }
        self.run.buf.extend_from_slice(data);
        Ok(())
    }

    fn alloc(&mut self) -> Result<u64> {
        if let Some(p) = self.alloc.take() {
            return Ok(p);
        }
        // Chunks freed since the last commit become usable once it is durable.
        if !self.alloc.pending.is_empty() {
            self.commit_inner()?;
            self.counters.pressure_commits += 1;
            if let Some(p) = self.alloc.take() {
                return Ok(p);
            }
        }
        if self.gc()? > 0 {
            if let Some(p) = self.alloc.take() {
                return Ok(p);
            }
        }
        Err(DedupError::Full {
            path: self.dir.clone(),
            what: "no free chunk left",
        })
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset.saturating_add(len);
        if end > self.geo.logical_bytes() {
            return Err(DedupError::OutOfRange {
                path: self.dir.clone(),
                offset,
                end,
                size: self.geo.logical_bytes(),
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at byte `offset` (any 512-byte alignment).
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.flush_run()?;
        let first = offset / BLOCK;
        let end = (offset + buf.len() as u64).div_ceil(BLOCK);
        let mut map = Vec::with_capacity((end - first) as usize);
        for lba in first..end {
            map.push(self.l2p_get(lba)?);
        }
        let mut tmp = vec![0u8; ((end - first) * BLOCK) as usize];
        let mut i = 0usize;
        while i < map.len() {
            let Some(start) = map[i] else {
                i += 1;
                continue;
            };
            let mut n = 1;
            while i + n < map.len() && n < MAX_RUN && map[i + n] == Some(start + n as u64) {
                n += 1;
            }
            let at = i * BLOCK as usize;
            self.disk
                .read_data(start, &mut tmp[at..at + n * BLOCK as usize])?;
            if self.opts.hints {
                let mut h = self.hints.lock();
                for k in 0..n {
                    let o = (i + k) * BLOCK as usize;
                    let hash = hash_chunk(&tmp[o..o + BLOCK as usize]);
                    h.record_read(first + (i + k) as u64, start + k as u64, hash);
                }
            }
            i += n;
        }
        self.counters.blocks_read += end - first;
        let skip = (offset - first * BLOCK) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    /// Writes `data` at byte `offset`; `hint(i)` is the dedup hint of the `i`-th 4 KiB block
    /// of the request (counted from the block holding `offset`). Partial blocks are merged
    /// with their current contents.
    pub fn write(
        &mut self,
        offset: u64,
        data: &[u8],
        hint: &dyn Fn(usize) -> DedupHint,
    ) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        let first = offset / BLOCK;
        let end = (offset + data.len() as u64).div_ceil(BLOCK);
        let mut block = vec![0u8; BLOCK as usize];
        for lba in first..end {
            let bstart = lba * BLOCK;
            let lo = offset.max(bstart);
            let hi = (offset + data.len() as u64).min(bstart + BLOCK);
            let src = &data[(lo - offset) as usize..(hi - offset) as usize];
            if hi - lo < BLOCK {
                self.read(bstart, &mut block)?;
                let at = (lo - bstart) as usize;
                block[at..at + src.len()].copy_from_slice(src);
                self.write_block(lba, &block, hint((lba - first) as usize))?;
            } else {
                self.write_block(lba, src, hint((lba - first) as usize))?;
            }
        }
        self.flush_run()?;
        Ok(())
    }

    fn write_block(&mut self, lba: u64, content: &[u8], hint: DedupHint) -> Result<()> {
        let hash = hash_chunk(content);
        let new = match hint {
            DedupHint::Unique => {
                self.counters.unique_hints += 1;
                let p = self.alloc()?;
                self.push_data(p, content)?;
                self.rc_set(p, 1)?;
                p
            }
            DedupHint::Copy | DedupHint::None => {
                if hint == DedupHint::Copy {
                    self.counters.copy_write_hints += 1;
                }
                self.shared_or_new(&hash, content, hint == DedupHint::Copy)?
            }
        };
        let old = self.l2p_get(lba)?;
        self.l2p_set(lba, Some(new))?;
        match old {
            Some(o) => self.rc_dec(o)?,
            None => self.mapped += 1,
        }
        self.counters.blocks_written += 1;
        self.after_write()
    }

    /// The chunk for content `hash`: from the hint cache, the index, or a new indexed chunk.
    fn shared_or_new(&mut self, hash: &Hash, content: &[u8], copy: bool) -> Result<u64> {
        let hinted = {
            let h = self.hints.lock();
            h.lookup(hash)
                .or_else(|| copy.then(|| h.lookup_recent(hash)).flatten())
        };
        if let Some(p) = hinted {
            // The cache is exact (see hints.rs), and the hash is of the chunk's own bytes;
            // a chunk that lost its references meanwhile is not shared.
            if self.rc_get(p)? > 0 {
                self.counters.hint_hits += 1;
                self.rc_inc(p)?;
                return Ok(p);
            }
            self.hints.lock().forget_pba(p);
        }
        if let Some(p) = self.index_lookup(hash)? {
            self.rc_inc(p)?;
            return Ok(p);
        }
        let p = self.alloc()?;
        self.push_data(p, content)?;
        self.index_insert(hash, p)?;
        self.rc_set(p, 2)?; // the block and the index
        Ok(p)
    }

    fn after_write(&mut self) -> Result<()> {
        self.writes_since_commit += 1;
        if self.meta.dirty_count() >= self.meta.commit_threshold() {
            self.counters.pressure_commits += 1;
            return self.commit_inner();
        }
        if self.writes_since_commit >= self.opts.flush_every {
            self.counters.periodic_commits += 1;
            return self.commit_inner();
        }
        Ok(())
    }

    /// Drops the mappings of the whole blocks in `offset..offset + len` (discard and
    /// write-zeroes: unmapped blocks read as zeros); partial blocks at the ends are zeroed
    /// in place when `zero` is set and left alone otherwise.
    pub fn discard(&mut self, offset: u64, len: u64, zero: bool) -> Result<()> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let first_full = offset.div_ceil(BLOCK);
        let end_full = end / BLOCK;
        if zero {
            let zeros = vec![0u8; BLOCK as usize];
            let head_end = end.min(first_full * BLOCK);
            if offset < head_end {
                let n = (head_end - offset) as usize;
                self.write(offset, &zeros[..n], &|_| DedupHint::None)?;
            }
            let tail_start = (end_full * BLOCK).max(offset).max(head_end);
            if tail_start < end {
                let n = (end - tail_start) as usize;
                self.write(tail_start, &zeros[..n], &|_| DedupHint::None)?;
            }
        }
        for lba in first_full..end_full.max(first_full) {
            if let Some(old) = self.l2p_get(lba)? {
                self.l2p_set(lba, None)?;
                self.rc_dec(old)?;
                self.mapped -= 1;
                self.counters.blocks_discarded += 1;
                self.after_write()?;
            }
        }
        Ok(())
    }

    fn commit_inner(&mut self) -> Result<()> {
        self.flush_run()?;
        self.disk.sync_data()?;
        self.meta.commit(&mut self.disk)?;
        self.alloc.release_pending();
        self.writes_since_commit = 0;
        Ok(())
    }

    /// A guest FLUSH: every write acknowledged so far becomes durable.
    pub fn flush(&mut self) -> Result<()> {
        self.counters.flush_commits += 1;
        self.commit_inner()
    }

    /// Makes everything durable and checkpoints it, so the metadata file alone holds the
    /// state (idle timer, shutdown, before `check`).
    pub fn commit(&mut self) -> Result<()> {
        self.commit_inner()?;
        self.meta.checkpoint(&mut self.disk)
    }

    /// Frees chunks that only the index holds (nothing maps them): removes their entries and
    /// commits. Returns the number freed.
    pub fn gc(&mut self) -> Result<u64> {
        let mut freed = 0;
        for b in 0..self.geo.index_buckets {
            let page = self.geo.index_start() + b;
            let mut i = 0;
            loop {
                let p = self.meta.page(&mut self.disk, page)?;
                let n = (u16_at(p, 0) as usize).min(ENTRIES_PER_BUCKET);
                if i >= n {
                    break;
                }
                let (_, pba) = Self::bucket_entry(p, i);
                if pba < self.geo.physical_blocks && self.rc_get(pba)? == 1 {
                    self.index_remove_at(page, i)?;
                    self.rc_dec(pba)?;
                    freed += 1;
                    if self.meta.dirty_count() >= self.meta.commit_threshold() {
                        self.commit_inner()?;
                    }
                    continue; // the last entry moved into slot i
                }
                i += 1;
            }
        }
        self.commit_inner()?;
        self.counters.gc_freed += freed;
        Ok(freed)
    }

    /// Compares every table with every other and the data: reference counts against the
    /// L2P map and the index, chunks nobody references, index entries against the BLAKE3 of
    /// their chunk. Reads through the files directly.
    pub fn check(&mut self) -> Result<crate::check::CheckReport> {
        self.commit()?;
        crate::check::run(self)
    }

    /// Writes the logical contents to a raw image at `out` (sparse: unmapped blocks are
    /// holes). Returns the bytes of mapped blocks written.
    pub fn export(&mut self, out: &Path) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let f =
            File::create(out).map_err(io_err(&self.dir, format!("creating {}", out.display())))?;
        f.set_len(self.geo.logical_bytes())
            .map_err(io_err(&self.dir, format!("sizing {}", out.display())))?;
        let mut written = 0;
        let mut buf = vec![0u8; BLOCK as usize];
        for lba in 0..self.geo.logical_blocks {
            if self.l2p_get(lba)?.is_none() {
                continue;
            }
            self.read(lba * BLOCK, &mut buf)?;
            f.write_all_at(&buf, lba * BLOCK)
                .map_err(io_err(&self.dir, format!("writing {}", out.display())))?;
            written += BLOCK;
        }
        f.sync_all()
            .map_err(io_err(&self.dir, format!("syncing {}", out.display())))?;
        Ok(written)
    }

    /// Copies a raw image into the volume (all-zero blocks stay unmapped) and commits.
    /// Returns the bytes of non-zero blocks imported.
    pub fn import(&mut self, raw: &Path) -> Result<u64> {
        use std::io::Read;
        let mut f =
            File::open(raw).map_err(io_err(&self.dir, format!("opening {}", raw.display())))?;
        let len = f
            .metadata()
            .map_err(io_err(
                &self.dir,
                format!("reading the size of {}", raw.display()),
            ))?
            .len();
        if len > self.geo.logical_bytes() {
            return Err(DedupError::OutOfRange {
                path: self.dir.clone(),
                offset: 0,
                end: len,
                size: self.geo.logical_bytes(),
            });
        }
        let mut buf = vec![0u8; BLOCK as usize];
        let mut done = 0;
        let mut lba = 0;
        loop {
            let mut got = 0;
            while got < buf.len() {
                let n = f
                    .read(&mut buf[got..])
                    .map_err(io_err(&self.dir, format!("reading {}", raw.display())))?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            if got == 0 {
                break;
            }
            buf[got..].fill(0);
            if buf.iter().any(|b| *b != 0) {
                self.write_block(lba, &buf, DedupHint::None)?;
                done += BLOCK;
            }
            lba += 1;
            if got < buf.len() {
                break;
            }
        }
        self.commit_inner()?;
        Ok(done)
    }

    // --- for check.rs --------------------------------------------------------------------

    pub(crate) fn raw_table_page(&mut self, page: u64, buf: &mut [u8]) -> Result<()> {
        self.raw_page(page, buf)
    }

    pub(crate) fn read_chunk(&mut self, pba: u64, buf: &mut [u8]) -> Result<()> {
        self.disk.read_data(pba, buf)
    }

    pub(crate) fn is_free(&self, pba: u64) -> bool {
        self.alloc.is_free(pba)
    }
}

fn read_superblock(dir: &Path, meta: &File) -> Result<Superblock> {
    use std::os::unix::fs::FileExt;
    let mut a = vec![0u8; BLOCK as usize];
    let mut b = vec![0u8; BLOCK as usize];
    let len = meta
        .metadata()
        .map_err(io_err(dir, "reading the size of the metadata file"))?
        .len();
    if len < 2 * BLOCK {
        return Err(DedupError::NotVolume {
            path: dir.to_owned(),
            reason: format!("the metadata file has {len} bytes, too few for its superblocks"),
        });
    }
    meta.read_exact_at(&mut a, 0)
        .map_err(io_err(dir, "reading superblock slot 0"))?;
    meta.read_exact_at(&mut b, BLOCK)
        .map_err(io_err(dir, "reading superblock slot 1"))?;
    Superblock::choose(dir, &a, &b)
}

fn check_file_len(dir: &Path, f: &File, want: u64, what: &str) -> Result<()> {
    let len = f
        .metadata()
        .map_err(io_err(dir, format!("reading the size of the {what} file")))?
        .len();
    if len < want {
        return Err(DedupError::Corrupt {
            path: dir.to_owned(),
            reason: format!(
                "the {what} file has {len} bytes; the superblock needs {want} (truncated?)"
            ),
        });
    }
    Ok(())
}
