//! iCache: a read/write block cache in host RAM (Sky §7), as a pipeline stage.
//!
//! The cache unit is a 4 KiB block keyed by its disk block number. Two policies:
//!
//! * `lru`: one recency list; classes are only counted, never used (the bcache-without-hints
//!   baseline);
//! * `priority`: Sky's iCache. One recency list per I/O class; the victim is the least
//!   recently used block of the lowest class present, a block is only admitted when that
//!   victim's class is not higher than its own, journal writes are not inserted, and each
//!   access moves the block to the class of its latest insight.
//!
//! Two modes: `write-through` (writes go to the disk, then cached copies are updated) and
//! `write-back` (whole-block writes stay dirty in RAM until a FLUSH, an eviction or the
//! backend's shutdown writes them down, in disk order).
//!
//! Correctness rules (every path keeps them): a block's cached copy is always the newest data
//! of that block (clean: equal to the disk; dirty: newer); reads serve cached blocks from RAM
//! and only the missing runs from below; data is copied out of guest memory once, so what is
//! cached is exactly what reached the disk even if the guest changes its buffer meanwhile.

mod store;

use std::any::Any;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::insight::{RequestInsight, CLASS_DEFAULT};
use crate::pipeline::{Next, Serialized, Stage, StageError, Status, SyncStage};
use crate::request::{Insights, Request, RequestKind, Segment, DEFAULT_MAX_DATA_LEN, SECTOR_SHIFT};
use store::{Store, LEVELS};

/// Cache block size: the unit of caching (ext4's and the page cache's block size).
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;
/// Counter buckets: classes 0..=5 (Sky Table 6) and "other" (application classes above 5,
/// and 32).
pub const CLASS_BUCKETS: usize = 7;
/// Largest run of dirty blocks written back in one request (keeps requests reasonable and
/// lets the disk model see sequential writes).
const MAX_WRITEBACK_RUN: u64 = 1 << 20;
/// Size of the stage's own I/O buffer; longer transfers are split.
const BOUNCE_LEN: u64 = DEFAULT_MAX_DATA_LEN;
/// Largest cache accepted (slot numbers are u32; also a sanity bound for typos).
const MAX_SIZE_BYTES: u64 = 1 << 40;

/// Eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CachePolicy {
    /// Plain LRU, ignores classes (baseline).
    Lru,
    /// Sky's iCache: lowest class first, LRU within a class; journal writes not inserted.
    Priority,
}

/// Write policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Writes reach the disk before they are acknowledged; the cache only holds clean copies.
    WriteThrough,
    /// Whole-block writes are acknowledged from RAM and written down on FLUSH, eviction or
    /// shutdown.
    WriteBack,
}

/// Configuration errors, with sentences fit for the CLI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheConfigError {
    /// Unknown `--cache-policy` value.
    #[error("unknown cache policy {0:?}; expected \"lru\" or \"priority\"")]
    UnknownPolicy(String),
    /// Unknown `--cache-mode` value.
    #[error("unknown cache mode {0:?}; expected \"write-through\" or \"write-back\"")]
    UnknownMode(String),
    /// Block size not a power of two between 512 and 1 MiB.
    #[error("cache block size {0} is not a power of two between 512 and 1048576")]
    BadBlockSize(u32),
    /// Cache smaller than one block.
    #[error("cache size {size} bytes is smaller than one {block}-byte block")]
    TooSmall {
        /// Requested size.
        size: u64,
        /// Block size.
        block: u32,
    },
    /// Cache absurdly large.
    #[error("cache size {size} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Requested size.
        size: u64,
        /// Limit.
        max: u64,
    },
    /// The stage's I/O buffer could not be mapped.
    #[error("cannot allocate the cache's I/O buffer: {0}")]
    Buffer(String),
    /// The cache's thread could not be started.
    #[error("cannot start the cache's thread: {0}")]
    Thread(String),
}

impl FromStr for CachePolicy {
    type Err = CacheConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "priority" => Ok(Self::Priority),
            _ => Err(CacheConfigError::UnknownPolicy(s.to_owned())),
        }
    }
}

impl fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Lru => "lru",
            Self::Priority => "priority",
        })
    }
}

impl FromStr for CacheMode {
    type Err = CacheConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "write-through" | "writethrough" => Ok(Self::WriteThrough),
            "write-back" | "writeback" => Ok(Self::WriteBack),
            _ => Err(CacheConfigError::UnknownMode(s.to_owned())),
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::WriteThrough => "write-through",
            Self::WriteBack => "write-back",
        })
    }
}

/// What the launcher passes to build an [`ICache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheConfig {
    /// RAM for cached blocks, in bytes (rounded down to whole blocks).
    pub size_bytes: u64,
    /// Eviction policy.
    pub policy: CachePolicy,
    /// Write policy.
    pub mode: CacheMode,
    /// Cache unit in bytes (default 4096).
    pub block_size: u32,
}

impl CacheConfig {
    /// `mib` MiB, priority policy, write-through, 4 KiB blocks.
    pub fn from_mib(mib: u64) -> Self {
        Self {
            size_bytes: mib.saturating_mul(1 << 20),
            policy: CachePolicy::Priority,
            mode: CacheMode::WriteThrough,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }

    /// Checks the configuration and returns the number of cache slots.
    pub fn validate(&self) -> Result<u32, CacheConfigError> {
        let bs = self.block_size;
        if !bs.is_power_of_two() || !(512..=(1 << 20)).contains(&bs) {
            return Err(CacheConfigError::BadBlockSize(bs));
        }
        if self.size_bytes > MAX_SIZE_BYTES {
            return Err(CacheConfigError::TooLarge {
                size: self.size_bytes,
                max: MAX_SIZE_BYTES,
            });
        }
        let slots = self.size_bytes / u64::from(bs);
        if slots == 0 {
            return Err(CacheConfigError::TooSmall {
                size: self.size_bytes,
                block: bs,
            });
        }
        u32::try_from(slots).map_err(|_| CacheConfigError::TooLarge {
            size: self.size_bytes,
            max: MAX_SIZE_BYTES,
        })
    }
}

impl fmt::Display for CacheConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = self.size_bytes as f64 / f64::from(1u32 << 20);
        write!(
            f,
            "{mib} MiB {} {} ({}-byte blocks)",
            self.policy, self.mode, self.block_size
        )
    }
}

/// Counter bucket of an I/O class: 0..=5 are their own, everything else is "other" (6).
pub fn class_bucket(class: u8) -> usize {
    (class as usize).min(CLASS_BUCKETS - 1)
}

/// Live counters of one cache (relaxed atomics, readable from any thread).
#[derive(Debug)]
pub struct CacheMetrics {
    config: CacheConfig,
    /// Blocks of reads served from the cache, per class bucket (class of the request).
    pub hits: [AtomicU64; CLASS_BUCKETS],
    /// Blocks of reads that went below, per class bucket.
    pub misses: [AtomicU64; CLASS_BUCKETS],
    /// Blocks inserted, per class bucket.
    pub inserted: [AtomicU64; CLASS_BUCKETS],
    /// Bytes resident, per class bucket (class of each block's latest access); a gauge.
    pub resident_bytes: [AtomicU64; CLASS_BUCKETS],
    /// Blocks evicted to make room, per class bucket of the evicted block.
    pub evictions: [AtomicU64; CLASS_BUCKETS],
    /// Blocks the priority policy refused to insert (every resident block outranked them),
    /// per class bucket.
    pub not_admitted: [AtomicU64; CLASS_BUCKETS],
    /// Cached blocks dropped because a discard / write-zeroes / failed write covered them.
    pub invalidated: AtomicU64,
    /// Bytes held dirty (write-back); a gauge.
    pub dirty_bytes: AtomicU64,
    /// Dirty blocks written to the disk (by flush, eviction or shutdown).
    pub writebacks: AtomicU64,
    /// Write requests issued below to write dirty blocks back.
    pub writeback_requests: AtomicU64,
    /// Dirty blocks a discard or write-zeroes covered before they were written back: writes
    /// the disk never had to take (block lifetimes shorter than the time to write-back).
    pub dirty_discarded: AtomicU64,
}

impl CacheMetrics {
    fn new(config: CacheConfig) -> Self {
        Self {
            config,
            hits: Default::default(),
            misses: Default::default(),
            inserted: Default::default(),
            resident_bytes: Default::default(),
            evictions: Default::default(),
            not_admitted: Default::default(),
            invalidated: AtomicU64::new(0),
            dirty_bytes: AtomicU64::new(0),
            writebacks: AtomicU64::new(0),
            writeback_requests: AtomicU64::new(0),
            dirty_discarded: AtomicU64::new(0),
        }
    }

    /// A copy of every counter (each read atomically, not all together).
    pub fn snapshot(&self) -> CacheSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let classes = (0..CLASS_BUCKETS)
            .map(|i| {
                let at = |a: &[AtomicU64; CLASS_BUCKETS]| a.get(i).map_or(0, g);
                ClassSnapshot {
                    class: if i + 1 < CLASS_BUCKETS {
                        i.to_string()
                    } else {
                        "other".into()
                    },
                    hits: at(&self.hits),
                    misses: at(&self.misses),
                    inserted: at(&self.inserted),
                    resident_bytes: at(&self.resident_bytes),
                    evictions: at(&self.evictions),
                    not_admitted: at(&self.not_admitted),
                }
            })
            .collect::<Vec<_>>();
        CacheSnapshot {
            policy: self.config.policy,
            mode: self.config.mode,
            size_bytes: self.config.size_bytes,
            block_size: self.config.block_size,
            hits: classes.iter().map(|c| c.hits).sum(),
            misses: classes.iter().map(|c| c.misses).sum(),
            resident_bytes: classes.iter().map(|c| c.resident_bytes).sum(),
            classes,
            invalidated: g(&self.invalidated),
            dirty_bytes: g(&self.dirty_bytes),
            writebacks: g(&self.writebacks),
            writeback_requests: g(&self.writeback_requests),
            dirty_discarded: g(&self.dirty_discarded),
        }
    }
}

/// Counters of one class bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassSnapshot {
    /// "0".."5" or "other".
    pub class: String,
    /// Read blocks served from RAM.
    pub hits: u64,
    /// Read blocks that went below.
    pub misses: u64,
    /// Blocks inserted.
    pub inserted: u64,
    /// Bytes resident now.
    pub resident_bytes: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks refused by the priority policy.
    pub not_admitted: u64,
}

/// Serialisable copy of [`CacheMetrics`] (for `--stats-json` and the benchmarks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSnapshot {
    /// Eviction policy.
    pub policy: CachePolicy,
    /// Write policy.
    pub mode: CacheMode,
    /// Configured size in bytes.
    pub size_bytes: u64,
    /// Cache unit in bytes.
    pub block_size: u32,
    /// Sum of the per-class hits.
    pub hits: u64,
    /// Sum of the per-class misses.
    pub misses: u64,
    /// Sum of the per-class resident bytes.
    pub resident_bytes: u64,
    /// Per class bucket: 0..=5, then "other".
    pub classes: Vec<ClassSnapshot>,
    /// Cached blocks dropped by discards, write-zeroes or failed writes.
    pub invalidated: u64,
    /// Dirty bytes now.
    pub dirty_bytes: u64,
    /// Dirty blocks written back.
    pub writebacks: u64,
    /// Write requests used for write-back.
    pub writeback_requests: u64,
    /// Dirty blocks dropped unwritten because a discard or write-zeroes covered them.
    #[serde(default)]
    pub dirty_discarded: u64,
}

impl CacheSnapshot {
    /// Read hit ratio in blocks, `None` before any read.
    pub fn hit_rate(&self) -> Option<f64> {
        let total = self.hits + self.misses;
        (total > 0).then(|| self.hits as f64 / total as f64)
    }
}

/// Class and journal flag of a request; no insight means [`CLASS_DEFAULT`], not journal.
fn request_class(req: &Request) -> (u8, bool) {
    request_insight(req).map_or((CLASS_DEFAULT, false), |i| (i.class, i.journal))
}

fn request_insight(req: &Request) -> Option<&RequestInsight> {
    req.insights.as_ref().and_then(|i| {
        let any: &(dyn Any + Send + Sync) = &**i;
        any.downcast_ref::<RequestInsight>()
    })
}

/// Class of the part of `req` at disk byte `pos`: a request merged from several files carries
/// one class per 4 KiB of its data.
fn class_at(req: &Request, pos: u64, default: u8) -> u8 {
    match request_insight(req) {
        Some(i) if !i.block_classes.is_empty() => {
            let idx = pos.saturating_sub(req.offset()) / 4096;
            i.class_of_block(usize::try_from(idx).unwrap_or(usize::MAX))
        }
        _ => default,
    }
}

fn stage_err(reason: String) -> StageError {
    StageError::Stage {
        stage: "icache".into(),
        reason,
    }
}

/// Copies as much of `src` into `dst` as fits (lengths always match here; never panics).
fn copy_into(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    if let (Some(d), Some(s)) = (dst.get_mut(..n), src.get(..n)) {
        d.copy_from_slice(s);
    }
}

/// The stage's own memory for I/O below (never guest RAM), and the requests it issues.
struct Lower {
    bounce: GuestMemoryMmap,
}

impl Lower {
    fn new() -> Result<Self, CacheConfigError> {
        let bounce = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), BOUNCE_LEN as usize)])
            .map_err(|e| CacheConfigError::Buffer(e.to_string()))?;
        Ok(Self { bounce })
    }

    fn request(&self, kind: RequestKind, offset: u64, len: usize) -> Request {
        Request::new_internal(
            &self.bounce,
            kind,
            offset >> SECTOR_SHIFT,
            vec![Segment {
                addr: GuestAddress(0),
                len: len as u32,
            }],
        )
    }

    /// Writes `data` at byte `offset` (sector-aligned) through the rest of the pipeline.
    fn write(
        &self,
        next: &mut dyn Next,
        offset: u64,
        data: &[u8],
        insights: Option<&Insights>,
    ) -> Result<Status, StageError> {
        for (i, chunk) in data.chunks(BOUNCE_LEN as usize).enumerate() {
            self.bounce
                .write_slice(chunk, GuestAddress(0))
                .map_err(|e| stage_err(format!("cannot fill the I/O buffer: {e}")))?;
            let mut r = self.request(
                RequestKind::Write,
                offset + i as u64 * BOUNCE_LEN,
                chunk.len(),
            );
            r.insights = insights.cloned();
            let st = next.run(&mut r)?;
            if st != Status::Ok {
                return Ok(st);
            }
        }
        Ok(Status::Ok)
    }

    /// Reads `out.len()` bytes at byte `offset` (sector-aligned) from the rest of the pipeline.
    fn read(
        &self,
        next: &mut dyn Next,
        offset: u64,
        out: &mut [u8],
        insights: Option<&Insights>,
    ) -> Result<Status, StageError> {
        for (i, chunk) in out.chunks_mut(BOUNCE_LEN as usize).enumerate() {
            let mut r = self.request(
                RequestKind::Read,
                offset + i as u64 * BOUNCE_LEN,
                chunk.len(),
            );
            r.insights = insights.cloned();
            let st = next.run(&mut r)?;
            if st != Status::Ok {
                return Ok(st);
            }
            self.bounce
                .read_slice(chunk, GuestAddress(0))
                .map_err(|e| stage_err(format!("cannot read the I/O buffer: {e}")))?;
        }
        Ok(Status::Ok)
    }

    fn flush(&self, next: &mut dyn Next) -> Result<Status, StageError> {
        let mut r = Request::new_internal(&self.bounce, RequestKind::Flush, 0, Vec::new());
        next.run(&mut r)
    }
}

/// The iCache stage. Build it with [`ICache::new`] or [`ICache::stage`].
///
/// On a clean stop the backend calls [`Stage::shutdown`], which writes dirty blocks back and
/// flushes the disk. Dropping the stage without that loses dirty blocks (it has no access to
/// the disk on its own), exactly like a crash: only data acknowledged before the guest's last
/// FLUSH is guaranteed to be on the image.
pub struct ICache {
    cfg: CacheConfig,
    bs: u64,
    store: Store,
    lower: Lower,
    metrics: Arc<CacheMetrics>,
    /// Scratch for request data (taken out while a request is handled).
    buf: Vec<u8>,
}

impl fmt::Debug for ICache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ICache")
            .field("config", &self.cfg)
            .field("blocks", &self.store.len())
            .finish()
    }
}

impl ICache {
    /// A cache with `cfg`, and its live counters.
    pub fn new(cfg: CacheConfig) -> Result<(Self, Arc<CacheMetrics>), CacheConfigError> {
        let slots = cfg.validate()?;
        let metrics = Arc::new(CacheMetrics::new(cfg));
        let cache = Self {
            cfg,
            bs: u64::from(cfg.block_size),
            store: Store::new(slots, cfg.block_size as usize),
            lower: Lower::new()?,
            metrics: metrics.clone(),
            buf: Vec::new(),
        };
        Ok((cache, metrics))
    }

    /// Like [`new`](Self::new), as a pipeline stage for `spawn_backend_with`. The cache runs
    /// [`Serialized`]: on its own thread, one request at a time (its fills and write-backs are
    /// several dependent I/Os per request), while the stages below stay asynchronous.
    pub fn stage(
        cfg: CacheConfig,
    ) -> Result<(Box<dyn Stage>, Arc<CacheMetrics>), CacheConfigError> {
        let (c, m) = Self::new(cfg)?;
        let s = Serialized::new(c).map_err(|e| CacheConfigError::Thread(e.to_string()))?;
        Ok((Box::new(s), m))
    }

    /// Live counters.
    pub fn metrics(&self) -> Arc<CacheMetrics> {
        self.metrics.clone()
    }

    /// Writes every dirty block back and flushes the disk (what [`Stage::shutdown`] does;
    /// callable directly by owners of a pipeline). No-op in write-through mode.
    pub fn shutdown_flush(&mut self, next: &mut dyn Next) -> Result<(), StageError> {
        if self.cfg.mode != CacheMode::WriteBack {
            return Ok(());
        }
        let st = self.write_back_all(next)?;
        let st = if st == Status::Ok {
            self.lower.flush(next)?
        } else {
            st
        };
        if st != Status::Ok {
            return Err(stage_err(format!(
                "writing dirty blocks back at shutdown failed with status {st:?}"
            )));
        }
        Ok(())
    }

    /// Recency level of a class under the configured policy.
    fn level(&self, class: u8) -> u8 {
        match self.cfg.policy {
            CachePolicy::Lru => 0,
            // Class 32 ("unique payload", a dedup hint) says nothing about priority.
            CachePolicy::Priority if (class as usize) < LEVELS => class,
            CachePolicy::Priority => CLASS_DEFAULT,
        }
    }

    fn counter(a: &[AtomicU64; CLASS_BUCKETS], class: u8) -> &AtomicU64 {
        // class_bucket() < CLASS_BUCKETS, so the fallback is never used.
        a.get(class_bucket(class)).unwrap_or(&a[0])
    }

    fn add(a: &[AtomicU64; CLASS_BUCKETS], class: u8, n: u64) {
        Self::counter(a, class).fetch_add(n, Ordering::Relaxed);
    }

    fn sub(a: &[AtomicU64; CLASS_BUCKETS], class: u8, n: u64) {
        Self::counter(a, class).fetch_sub(n, Ordering::Relaxed);
    }

    /// Records an access to `slot` with `class`: most recently used, at the class's level.
    fn touch(&mut self, slot: u32, class: u8) {
        let level = self.level(class);
        let old = self.store.touch(slot, level, class);
        if class_bucket(old) != class_bucket(class) {
            Self::sub(&self.metrics.resident_bytes, old, self.bs);
            Self::add(&self.metrics.resident_bytes, class, self.bs);
        }
    }

    fn set_dirty(&mut self, slot: u32, dirty: bool) {
        let was = self.store.set_dirty(slot, dirty);
        match (was, dirty) {
            (false, true) => {
                self.metrics
                    .dirty_bytes
                    .fetch_add(self.bs, Ordering::Relaxed);
            }
            (true, false) => {
                self.metrics
                    .dirty_bytes
                    .fetch_sub(self.bs, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Drops `slot` without writing it anywhere.
    fn drop_slot(&mut self, slot: u32) {
        let (_, class, dirty) = self.store.info(slot);
        if dirty {
            self.metrics
                .dirty_bytes
                .fetch_sub(self.bs, Ordering::Relaxed);
        }
        Self::sub(&self.metrics.resident_bytes, class, self.bs);
        self.store.remove(slot);
    }

    /// Writes a dirty `slot` to the disk and marks it clean.
    fn write_back_slot(&mut self, next: &mut dyn Next, slot: u32) -> Result<(), StageError> {
        let (block, _, dirty) = self.store.info(slot);
        if !dirty {
            return Ok(());
        }
        let st = self
            .lower
            .write(next, block * self.bs, self.store.data(slot), None)?;
        if st != Status::Ok {
            return Err(stage_err(format!(
                "writing back cached block {block} failed with status {st:?}"
            )));
        }
        self.metrics.writebacks.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .writeback_requests
            .fetch_add(1, Ordering::Relaxed);
        self.set_dirty(slot, false);
        Ok(())
    }

    /// Makes room for and inserts `block` of `class` with `data`. `Ok(false)` when the
    /// priority policy refuses it (the lowest resident class is above its class). Evicting a
    /// dirty block writes it back first; if that fails, the error is returned and nothing is
    /// evicted.
    fn insert(
        &mut self,
        next: &mut dyn Next,
        block: u64,
        class: u8,
        data: &[u8],
        dirty: bool,
    ) -> Result<bool, StageError> {
        let level = self.level(class);
        if !self.store.has_free() {
            let Some((victim, victim_level)) = self.store.victim() else {
                return Ok(false);
            };
            if victim_level > level {
                Self::add(&self.metrics.not_admitted, class, 1);
                return Ok(false);
            }
            self.write_back_slot(next, victim)?;
            let (_, victim_class, _) = self.store.info(victim);
            Self::add(&self.metrics.evictions, victim_class, 1);
            self.drop_slot(victim);
        }
        let Some(slot) = self.store.insert(block, level, class, dirty) else {
            return Ok(false);
        };
        copy_into(self.store.data_mut(slot), data);
        Self::add(&self.metrics.inserted, class, 1);
        Self::add(&self.metrics.resident_bytes, class, self.bs);
        if dirty {
            self.metrics
                .dirty_bytes
                .fetch_add(self.bs, Ordering::Relaxed);
        }
        Ok(true)
    }

    /// Blocks overlapping bytes `[start, end)`, with the overlap as absolute byte offsets.
    fn blocks(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64, u64)> {
        let bs = self.bs;
        let last = if end > start {
            (end - 1) / bs + 1
        } else {
            start / bs
        };
        (start / bs..last).map(move |b| {
            let s = start.max(b * bs);
            let e = end.min((b + 1) * bs);
            (b, s, e)
        })
    }

    fn read(
        &mut self,
        req: &mut Request,
        next: &mut dyn Next,
        buf: &mut Vec<u8>,
    ) -> Result<Status, StageError> {
        let (class, _) = request_class(req);
        // A read usually arrives without an insight (the classifier learns what it was only
        // when the read syscall returns): a hit then keeps the block's class instead of
        // demoting it, and a miss enters at the default class.
        let known = req.insights.is_some();
        let start = req.offset();
        let end = start + req.len;
        let bs = self.bs;
        // First serve what is cached (before any insertion can evict it) and note the runs
        // that must come from below.
        let mut missing: Vec<(u64, u64)> = Vec::new();
        let blocks: Vec<_> = self.blocks(start, end).collect();
        for (block, s, e) in blocks {
            if let Some(slot) = self.store.lookup(block) {
                let off = block * bs;
                let piece = self
                    .store
                    .data(slot)
                    .get((s - off) as usize..(e - off) as usize)
                    .ok_or_else(|| stage_err(format!("cached block {block} is short")))?;
                req.write_data(s - start, piece)?;
                let class = if known {
                    class
                } else {
                    self.store.info(slot).1
                };
                self.touch(slot, class);
                Self::add(&self.metrics.hits, class, 1);
            } else {
                Self::add(&self.metrics.misses, class, 1);
                match missing.last_mut() {
                    Some(run) if run.1 == s => run.1 = e,
                    _ => missing.push((s, e)),
                }
            }
        }
        for (s, e) in missing {
            buf.clear();
            buf.resize((e - s) as usize, 0);
            let st = self.lower.read(next, s, buf, req.insights.as_ref())?;
            if st != Status::Ok {
                return Ok(st);
            }
            req.write_data(s - start, buf)?;
            // Only whole blocks are cached; partial ones were read for this request only.
            let mut block = s.div_ceil(bs);
            while (block + 1) * bs <= e {
                let off = (block * bs - s) as usize;
                if let Some(data) = buf.get(off..off + bs as usize) {
                    if self.store.lookup(block).is_none() {
                        self.insert(next, block, class, data, false)?;
                    }
                }
                block += 1;
            }
        }
        Ok(Status::Ok)
    }

    /// Drops every cached block overlapping `[start, end)` (clean copies only; callers handle
    /// dirty ones first).
    fn invalidate(&mut self, start: u64, end: u64) {
        let blocks: Vec<_> = self.blocks(start, end).collect();
        for (block, _, _) in blocks {
            if let Some(slot) = self.store.lookup(block) {
                self.drop_slot(slot);
                self.metrics.invalidated.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn write(
        &mut self,
        req: &mut Request,
        next: &mut dyn Next,
        buf: &mut Vec<u8>,
    ) -> Result<Status, StageError> {
        let (class, journal) = request_class(req);
        // Sky did not cache journal writes: written once, read only at recovery.
        let admit = !(journal && self.cfg.policy == CachePolicy::Priority);
        let start = req.offset();
        let end = start + req.len;
        let bs = self.bs;
        // One copy out of guest memory: the disk and the cache get the same bytes even if
        // the guest changes its buffer meanwhile.
        buf.clear();
        buf.resize(req.len as usize, 0);
        req.read_data(0, buf)?;
        let blocks: Vec<_> = self.blocks(start, end).collect();
        match self.cfg.mode {
            CacheMode::WriteThrough => {
                match self.lower.write(next, start, buf, req.insights.as_ref()) {
                    Ok(Status::Ok) => {}
                    other => {
                        // The disk's content there is unknown now: keep no copy.
                        self.invalidate(start, end);
                        return other;
                    }
                }
                for (block, s, e) in blocks {
                    let piece = buf
                        .get((s - start) as usize..(e - start) as usize)
                        .unwrap_or(&[]);
                    if let Some(slot) = self.store.lookup(block) {
                        let off = (s - block * bs) as usize;
                        if let Some(d) = self.store.data_mut(slot).get_mut(off..) {
                            copy_into(d, piece);
                        }
                        self.touch(slot, class_at(req, s, class));
                    } else if admit && e - s == bs {
                        self.insert(next, block, class_at(req, s, class), piece, false)?;
                    }
                }
                Ok(Status::Ok)
            }
            CacheMode::WriteBack => {
                let mut through: Vec<(u64, u64)> = Vec::new();
                for (block, s, e) in blocks {
                    let piece = buf
                        .get((s - start) as usize..(e - start) as usize)
                        .unwrap_or(&[]);
                    if let Some(slot) = self.store.lookup(block) {
                        let off = (s - block * bs) as usize;
                        if let Some(d) = self.store.data_mut(slot).get_mut(off..) {
                            copy_into(d, piece);
                        }
                        self.touch(slot, class_at(req, s, class));
                        self.set_dirty(slot, true);
                        continue;
                    }
                    if admit
                        && e - s == bs
                        && self.insert(next, block, class_at(req, s, class), piece, true)?
                    {
                        continue;
                    }
                    // Partial block not cached, journal, or refused by the policy: to disk.
                    match through.last_mut() {
                        Some(run) if run.1 == s => run.1 = e,
                        _ => through.push((s, e)),
                    }
                }
                for (s, e) in through {
                    let piece = buf
                        .get((s - start) as usize..(e - start) as usize)
                        .unwrap_or(&[]);
                    let st = self.lower.write(next, s, piece, req.insights.as_ref())?;
                    if st != Status::Ok {
                        return Ok(st);
                    }
                }
                Ok(Status::Ok)
            }
        }
    }

    /// Discard / write-zeroes: cached blocks they overlap are dropped; a partially covered
    /// dirty block is written back first so its uncovered part survives.
    fn discard(&mut self, req: &mut Request, next: &mut dyn Next) -> Result<Status, StageError> {
        let ranges: Vec<(u64, u64)> = req
            .ranges
            .iter()
            .map(|r| (r.offset(), r.offset() + r.bytes()))
            .collect();
        for (start, end) in ranges {
            let range_blocks = (end.saturating_sub(start)) / self.bs + 2;
            // Walk whichever is smaller: the range or the cache.
            let hit: Vec<(u64, u64, u64)> = if range_blocks as usize <= self.store.len() {
                self.blocks(start, end)
                    .filter(|(b, _, _)| self.store.lookup(*b).is_some())
                    .collect()
            } else {
                let bs = self.bs;
                let mut v: Vec<_> = self
                    .store
                    .cached_blocks()
                    .filter(|b| b * bs < end && (b + 1) * bs > start)
                    .map(|b| (b, start.max(b * bs), end.min((b + 1) * bs)))
                    .collect();
                v.sort_unstable();
                v
            };
            for (block, s, e) in hit {
                let Some(slot) = self.store.lookup(block) else {
                    continue;
                };
                if e - s < self.bs {
                    self.write_back_slot(next, slot)?;
                } else if self.store.info(slot).2 {
                    self.metrics.dirty_discarded.fetch_add(1, Ordering::Relaxed);
                }
                self.drop_slot(slot);
                self.metrics.invalidated.fetch_add(1, Ordering::Relaxed);
            }
        }
        next.run(req)
    }

    /// Writes every dirty block down in disk order, coalescing neighbours. Blocks stay dirty
    /// if their write fails (the status is returned; a later flush retries).
    fn write_back_all(&mut self, next: &mut dyn Next) -> Result<Status, StageError> {
        let dirty = self.store.dirty_blocks();
        if dirty.is_empty() {
            return Ok(Status::Ok);
        }
        let bs = self.bs;
        let max_run = (MAX_WRITEBACK_RUN / bs).max(1);
        let mut runs: Vec<Vec<u64>> = Vec::new();
        for b in dirty {
            match runs.last_mut() {
                Some(run)
                    if run.last().is_some_and(|&l| l + 1 == b) && (run.len() as u64) < max_run =>
                {
                    run.push(b)
                }
                _ => runs.push(vec![b]),
            }
        }
        let mut data = std::mem::take(&mut self.buf);
        let result = (|| {
            for run in &runs {
                data.clear();
                let mut slots = Vec::with_capacity(run.len());
                for &b in run {
                    let slot = self
                        .store
                        .lookup(b)
                        .ok_or_else(|| stage_err(format!("dirty block {b} is not cached")))?;
                    data.extend_from_slice(self.store.data(slot));
                    slots.push(slot);
                }
                let first = run.first().copied().unwrap_or(0);
                let st = self.lower.write(next, first * bs, &data, None)?;
                if st != Status::Ok {
                    return Ok(st);
                }
                self.metrics
                    .writeback_requests
                    .fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .writebacks
                    .fetch_add(slots.len() as u64, Ordering::Relaxed);
                for slot in slots {
                    self.set_dirty(slot, false);
                }
            }
            Ok(Status::Ok)
        })();
        self.buf = data;
        result
    }
}

impl SyncStage for ICache {
    fn name(&self) -> &str {
        "icache"
    }

    fn process(&mut self, req: &mut Request, next: &mut dyn Next) -> Result<Status, StageError> {
        match req.kind {
            RequestKind::Read | RequestKind::Write if req.len > 0 => {
                let mut buf = std::mem::take(&mut self.buf);
                let result = if req.kind == RequestKind::Read {
                    self.read(req, next, &mut buf)
                } else {
                    self.write(req, next, &mut buf)
                };
                // Keep the scratch for the next request, but not a huge one.
                if buf.capacity() <= 4 << 20 {
                    self.buf = buf;
                }
                result
            }
            RequestKind::Discard | RequestKind::WriteZeroes => self.discard(req, next),
            RequestKind::Flush => {
                if self.cfg.mode == CacheMode::WriteBack {
                    let st = self.write_back_all(next)?;
                    if st != Status::Ok {
                        warn!(status = ?st, "write-back before FLUSH failed");
                        return Ok(st);
                    }
                }
                next.run(req)
            }
            _ => next.run(req),
        }
    }

    fn shutdown(&mut self, next: &mut dyn Next) -> Result<(), StageError> {
        let dirty = self.metrics.dirty_bytes.load(Ordering::Relaxed);
        debug!(dirty_bytes = dirty, "icache shutdown");
        self.shutdown_flush(next)
    }
}

#[cfg(test)]
mod tests;
