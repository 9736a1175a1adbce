//! The inference engine: turns the completed write stream of a virtual disk into file-system
//! events (DS-VMI / Gamma-Ray §IV) and keeps a live view of the file system.
//!
//! The crawl's [`Index`] is the immutable base; writes build an overlay of what changed
//! (inodes, directory entries, block maps). Each written block is reverse-mapped:
//! - data of a known file → a `Write` event right away;
//! - a block nobody owns → the pending set, replayed when metadata later claims it;
//! - an inode-table block → the inodes in it are diffed against the stored state;
//! - a directory block → the directory is marked dirty and diffed when the batch resolves;
//! - a jbd2 journal block → buffered until its transaction commits, then every logged block is
//!   applied to its home location through the same logic and the batch resolves at once, so
//!   metadata events appear at commit time and the view never shows half a transaction.
//!
//! A batch (one transaction, or the home-location writes since the last flush for file systems
//! without a journal) resolves into name events (create/delete/rename/link, matched by inode
//! number across directories), then attribute events, then data writes claimed from the
//! pending set. See docs/filestream.md, "Inference engine".

mod diff;
mod journal;
mod pending;
mod state;

use crate::block::BlockSource;
use crate::error::{Error, Result};
use crate::event::{EventKind, FsEvent};
use crate::index::{
    FileKind, Index, InodeMeta, Owner, Run, RUN_DATA, RUN_EXTENT_TREE, RUN_INDIRECT, RUN_UNWRITTEN,
    RUN_XATTR,
};
use crate::view::{FsRead, ViewEntry};
use journal::{Journal, Txn};
use pending::Pending;
use serde::{Deserialize, Serialize};
use state::{Entries, Geometry, Inode};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Tuning of the [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// How long a write to a block no metadata owns waits to be claimed (Gamma-Ray: 300 s).
    pub pending_ttl: Duration,
    /// Cap on the bytes waiting in the pending set (oldest dropped first).
    pub pending_max_bytes: u64,
    /// Put the written bytes into `Write` events.
    pub capture_data: bool,
    /// Largest `data` of one event; longer writes are split.
    pub max_event_data: usize,
    /// Overload mode: skip data writes (known files and unknown blocks), keep metadata.
    pub drop_data: bool,
    /// Cap on buffered journal blocks, and separately on committed metadata blocks not yet
    /// checkpointed to their home location.
    pub journal_max_bytes: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            pending_ttl: Duration::from_secs(300),
            pending_max_bytes: 64 << 20,
            capture_data: false,
            max_event_data: 64 << 10,
            drop_data: false,
            journal_max_bytes: 64 << 20,
        }
    }
}

/// Counters of an [`Engine`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Write calls and their bytes.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// jbd2 transactions applied at commit.
    pub txns_applied: u64,
    /// Blocks logged by the applied transactions.
    pub journal_blocks_logged: u64,
    /// Revoke records seen and logged blocks skipped because they were revoked.
    pub revoke_records: u64,
    /// Logged blocks not applied because the same transaction revoked them.
    pub revoked_skipped: u64,
    /// Journal checksum mismatches (descriptor, block tag, commit, revoke).
    pub journal_csum_errors: u64,
    /// Malformed or inconsistent transactions dropped.
    pub journal_errors: u64,
    /// Times the journal buffer passed its cap and was dropped (home writes take over).
    pub journal_overflows: u64,
    /// Transactions given up because their blocks never arrived.
    pub journal_abandoned: u64,
    /// Journal bytes buffered now.
    pub journal_buffered_bytes: u64,
    /// Home-location writes identical to an applied transaction's copy (no events).
    pub checkpoint_writes: u64,
    /// Events emitted, in total and per kind.
    pub events: u64,
    /// Events per kind (kinds with a zero count are left out).
    pub events_by_kind: Vec<(EventKind, u64)>,
    /// Blocks and bytes waiting in the pending set.
    pub pending_blocks: u64,
    /// Bytes waiting in the pending set.
    pub pending_bytes: u64,
    /// Pending blocks dropped by TTL.
    pub pending_expired: u64,
    /// Pending blocks dropped by the byte cap.
    pub pending_evicted: u64,
    /// Pending blocks claimed by metadata.
    pub pending_claimed: u64,
    /// Data writes skipped in overload mode, and their bytes.
    pub dropped_data_writes: u64,
    /// Bytes of skipped data writes.
    pub dropped_data_bytes: u64,
    /// Metadata blocks (inodes, directories) that could not be parsed.
    pub metadata_errors: u64,
    /// Events not emitted because the file had no reachable path.
    pub unnamed: u64,
    /// Inodes and directories held in the overlay, and its approximate heap bytes.
    pub overlay_inodes: u64,
    /// Directories held in the overlay.
    pub overlay_dirs: u64,
    /// Approximate heap bytes of the overlay, caches and buffers.
    pub overlay_bytes: u64,
    /// The file-system index's counters (eager or lazy).
    pub index: IndexCounters,
}

/// Counters of the engine's file-system index: what it holds and, when lazy
/// ([`Index::into_lazy`]), what it loaded. One definition for the engine, the launcher's
/// run statistics (`--stats-json`, under each disk's `stream.index`) and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexCounters {
    /// The index is lazy: its sections are loaded on demand.
    pub lazy: bool,
    /// Heap bytes the index holds now (eager: all of it; lazy: the resident part and the
    /// loaded sections).
    pub resident_bytes: u64,
    /// Largest `resident_bytes` so far.
    pub peak_resident_bytes: u64,
    /// Sections read from a lazy index's file (first loads and re-reads after eviction).
    pub sections_loaded: u64,
    /// Sections evicted from a lazy index's cache.
    pub sections_evicted: u64,
    /// Time spent reading, checking and decoding sections.
    pub load_ns: u64,
    /// In-use inodes in the index.
    pub inodes: u64,
    /// In-use inodes whose section was loaded at least once (eager: all of them); over
    /// `inodes`, the share of the file tree loaded.
    pub inodes_loaded: u64,
    /// Section loads that failed (the file was damaged after it was opened).
    pub load_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    writes: u64,
    write_bytes: u64,
    txns: u64,
    checkpoints: u64,
    by_kind: HashMap<EventKind, u64>,
    claimed: u64,
    dropped_writes: u64,
    dropped_bytes: u64,
    meta_errors: u64,
    unnamed: u64,
}

/// What one batch changed, resolved into events at commit / flush.
#[derive(Debug, Default)]
struct Batch {
    dirty_dirs: BTreeSet<u32>,
    /// Inodes changed in the batch, with their metadata and generation at its start.
    changed: BTreeMap<u32, Option<(InodeMeta, Option<u32>)>>,
    /// Inodes seen free at some point of the batch (a later use is a new file).
    freed: BTreeSet<u32>,
    /// Inodes whose block map or size changed: pending blocks may now be theirs.
    claims: BTreeSet<u32>,
    /// Content of directory blocks written in the batch: (directory, block index) -> bytes.
    dir_writes: BTreeMap<(u32, u64), Vec<u8>>,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.dirty_dirs.is_empty() && self.changed.is_empty() && self.claims.is_empty()
    }
}

/// Infers file-system events from the write stream of one virtual disk. See the module docs.
pub struct Engine {
    disk: Arc<dyn BlockSource>,
    index: Index,
    cfg: EngineConfig,
    geo: Geometry,
    bs: u64,
    part: u64,
    isz: usize,
    first_ino: u32,
    /// Changed inodes (`None`: freed).
    inodes: HashMap<u32, Option<Inode>>,
    /// Reverse map of the overlay's runs: (first disk block, inode) -> run.
    rev: BTreeMap<(u64, u32), Run>,
    /// Full entry lists of changed directories.
    dirs: HashMap<u32, Entries>,
    /// The same per directory block, for directories whose entries' blocks are known (all but
    /// inline directories and those past 65534 blocks): a written block is diffed alone,
    /// without reading the others from the disk, which may already be ahead of the stream.
    dir_blocks: HashMap<u32, BTreeMap<u64, Entries>>,
    /// Primary name (directory, entry name) of inodes whose names changed (`None`: none).
    links: HashMap<u32, Option<(u32, Vec<u8>)>>,
    /// Fingerprints of on-disk inodes already compared (skips unchanged slots).
    fps: HashMap<u32, u64>,
    /// Committed metadata blocks newer than their home location (until checkpointed).
    cache: HashMap<u64, Vec<u8>>,
    cache_order: VecDeque<u64>,
    cache_bytes: u64,
    journal: Option<Journal>,
    pending: Pending,
    batch: Batch,
    c: Counters,
}

fn fnv(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &x in b {
        h ^= u64::from(x);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn owner_ino(o: &Owner) -> Option<u32> {
    match *o {
        Owner::Directory { ino, .. }
        | Owner::ExtentTree { ino }
        | Owner::IndirectBlock { ino }
        | Owner::XattrBlock { ino }
        | Owner::Data { ino, .. } => Some(ino),
        _ => None,
    }
}

impl Engine {
    /// An engine for `disk` (the whole virtual disk, read-only; it already holds each write
    /// when the engine is called) described by `index`.
    pub fn new(disk: Arc<dyn BlockSource>, index: Index, cfg: EngineConfig) -> Result<Engine> {
        let fs = index.fs_info().clone();
        let bs = u64::from(fs.block_size);
        let mut sb = vec![0u8; 1024];
        disk.read_at(fs.partition_start + 1024, &mut sb)?;
        if state::le16(&sb, 56) != 0xEF53 {
            return Err(Error::BadMagic {
                found: state::le16(&sb, 56),
            });
        }
        let first_ino = if state::le32(&sb, 76) == 0 {
            11
        } else {
            state::le32(&sb, 84).max(3)
        };
        let geo = Geometry {
            block_size: fs.block_size,
            blocks_count: fs.blocks_count,
            first_data_block: fs.first_data_block,
            huge_file: fs.features[2] & 0x8 != 0,
        };
        let mut e = Engine {
            disk,
            geo,
            bs,
            part: fs.partition_start,
            isz: usize::from(fs.inode_size.max(128)),
            first_ino,
            inodes: HashMap::new(),
            rev: BTreeMap::new(),
            dirs: HashMap::new(),
            dir_blocks: HashMap::new(),
            links: HashMap::new(),
            fps: HashMap::new(),
            cache: HashMap::new(),
            cache_order: VecDeque::new(),
            cache_bytes: 0,
            journal: None,
            pending: Pending::default(),
            batch: Batch::default(),
            c: Counters::default(),
            index,
            cfg,
        };
        if fs.journal_ino != 0 {
            let first = e
                .index
                .file_extents(fs.journal_ino)
                .into_iter()
                .find(|x| x.file_block == 0);
            if let Some(x) = first {
                let sbj = e.read_block(x.disk_block);
                let j = Journal::new(sbj.as_deref(), e.cfg.journal_max_bytes);
                if j.sb.is_some() {
                    e.journal = Some(j);
                }
            }
        }
        Ok(e)
    }

    /// The crawl the engine started from.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Whether a jbd2 journal was found and is being followed.
    pub fn has_journal(&self) -> bool {
        self.journal.is_some()
    }

    /// Overload control: skip data writes (metadata is still processed).
    pub fn set_drop_data(&mut self, on: bool) {
        self.cfg.drop_data = on;
    }

    /// A completed guest write of `data` at byte `offset` of the whole device.
    pub fn write(&mut self, offset: u64, data: &[u8], observed_ns: u64, out: &mut Vec<FsEvent>) {
        let before = out.len();
        self.c.writes += 1;
        self.c.write_bytes += data.len() as u64;
        let bs = self.bs;
        let end = offset.saturating_add(data.len() as u64);
        let mut pos = offset.max(self.part);
        while pos < end {
            let b = (pos - self.part) / bs;
            if b >= self.geo.blocks_count {
                break;
            }
            let bstart = self.part + b * bs;
            let s = pos - bstart;
            let e = end.min(bstart + bs) - bstart;
            let from = (pos - offset) as usize;
            let Some(slice) = data.get(from..from + (e - s) as usize) else {
                break;
            };
            let content = if s == 0 && e == bs {
                slice.to_vec()
            } else {
                // Partial block: merge with the newest copy we know of.
                let mut base = self.read_block(b).unwrap_or_else(|| vec![0; bs as usize]);
                base[s as usize..e as usize].copy_from_slice(slice);
                base
            };
            self.home_block(b, content, s as u32, e as u32, observed_ns, out);
            pos = bstart + e;
        }
        self.count(before, out);
    }

    /// A discard (TRIM) of `len` bytes at `offset`: waiting writes to those blocks are void.
    pub fn discard(&mut self, offset: u64, len: u64, observed_ns: u64, out: &mut Vec<FsEvent>) {
        let _ = (observed_ns, out);
        let Some(rel) = offset.checked_sub(self.part) else {
            return;
        };
        let first = rel.div_ceil(self.bs);
        let last = (rel.saturating_add(len)) / self.bs;
        if last > first {
            self.pending.take_range(first, last - first);
        }
    }

    /// A guest flush: what was written so far is durable, so resolve the open batch (file
    /// systems without a journal; with a journal, commits resolve their own batches).
    pub fn flush(&mut self, observed_ns: u64, out: &mut Vec<FsEvent>) {
        let before = out.len();
        self.resolve(None, observed_ns, out);
        self.count(before, out);
    }

    /// Periodic work at host time `now_ns`: expire pending writes past their TTL and resolve
    /// an open batch.
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<FsEvent>) {
        let before = out.len();
        let ttl = u64::try_from(self.cfg.pending_ttl.as_nanos()).unwrap_or(u64::MAX);
        self.pending.expire(now_ns, ttl);
        self.resolve(None, now_ns, out);
        self.count(before, out);
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            overlay_bytes: self.overlay_bytes(),
            ..self.counters()
        }
    }

    /// The counters of [`Engine::stats`] without its walk over the overlay: `overlay_bytes`
    /// is 0. Cheap (no walk), so a consumer can call it after every batch of writes; the
    /// walk over 100 000 changed inodes after every batch took 9 % of the host's CPU time
    /// in a `tar x` of 100 000 files (perf).
    pub fn counters(&self) -> EngineStats {
        let j = self.journal.as_ref().map(|j| j.stats).unwrap_or_default();
        let mut by_kind: Vec<(EventKind, u64)> =
            self.c.by_kind.iter().map(|(k, v)| (*k, *v)).collect();
        by_kind.sort_by_key(|(k, _)| format!("{k:?}"));
        EngineStats {
            writes: self.c.writes,
            write_bytes: self.c.write_bytes,
            txns_applied: self.c.txns,
            journal_blocks_logged: j.blocks_logged,
            revoke_records: j.revoke_records,
            revoked_skipped: j.revoked_skipped,
            journal_csum_errors: j.csum_errors,
            journal_errors: j.errors,
            journal_overflows: j.overflows,
            journal_abandoned: j.abandoned,
            journal_buffered_bytes: j.buffered_bytes,
            checkpoint_writes: self.c.checkpoints,
            events: self.c.by_kind.values().sum(),
            events_by_kind: by_kind,
            pending_blocks: self.pending.len() as u64,
            pending_bytes: self.pending.bytes(),
            pending_expired: self.pending.expired,
            pending_evicted: self.pending.evicted,
            pending_claimed: self.c.claimed,
            dropped_data_writes: self.c.dropped_writes,
            dropped_data_bytes: self.c.dropped_bytes,
            metadata_errors: self.c.meta_errors,
            unnamed: self.c.unnamed,
            overlay_inodes: self.inodes.len() as u64,
            overlay_dirs: self.dirs.len() as u64,
            overlay_bytes: 0,
            index: self.index_counters(),
        }
    }

    /// The index's part of the counters (cheap: no walk over the index).
    fn index_counters(&self) -> IndexCounters {
        let inodes = self.index.inode_count() as u64;
        match self.index.lazy_stats() {
            None => {
                let bytes = self.index.resident_bytes();
                IndexCounters {
                    resident_bytes: bytes,
                    peak_resident_bytes: bytes,
                    inodes,
                    inodes_loaded: inodes,
                    ..IndexCounters::default()
                }
            }
            Some(l) => IndexCounters {
                lazy: true,
                resident_bytes: l.resident_bytes,
                peak_resident_bytes: l.peak_resident_bytes,
                sections_loaded: l.loads,
                sections_evicted: l.evictions,
                load_ns: l.load_ns,
                inodes,
                inodes_loaded: l.inodes_loaded,
                load_errors: l.load_errors,
            },
        }
    }

    /// Approximate heap bytes of the overlay, caches and buffers: a walk over every inode and
    /// directory entry the overlay holds (O(overlay)).
    pub fn overlay_bytes(&self) -> u64 {
        let j = self.journal.as_ref().map(|j| j.stats).unwrap_or_default();
        let overlay = self
            .inodes
            .values()
            .map(|i| 64 + i.as_ref().map_or(0, Inode::heap_bytes))
            .sum::<usize>()
            + self
                .dirs
                .values()
                .map(|d| d.keys().map(|n| n.len() + 48).sum::<usize>())
                .sum::<usize>()
                * 2
            + self.rev.len() * 48
            + self.links.len() * 48
            + self.fps.len() * 16;
        overlay as u64 + self.cache_bytes + j.buffered_bytes + self.pending.bytes()
    }

    fn count(&mut self, before: usize, out: &[FsEvent]) {
        for e in out.get(before..).unwrap_or(&[]) {
            *self.c.by_kind.entry(e.kind).or_insert(0) += 1;
        }
    }

    // ---- block access -------------------------------------------------------------------

    /// The newest known content of metadata block `b`: a committed copy not yet checkpointed,
    /// else the disk.
    fn read_block(&self, b: u64) -> Option<Vec<u8>> {
        if let Some(c) = self.cache.get(&b) {
            return Some(c.clone());
        }
        let mut buf = vec![0u8; self.bs as usize];
        let off = b.checked_mul(self.bs)?.checked_add(self.part)?;
        self.disk.read_at(off, &mut buf).ok()?;
        Some(buf)
    }

    fn cache_insert(&mut self, b: u64, data: Vec<u8>) {
        let n = data.len() as u64;
        if let Some(old) = self.cache.insert(b, data) {
            self.cache_bytes -= old.len() as u64;
        } else {
            self.cache_order.push_back(b);
        }
        self.cache_bytes += n;
        while self.cache_bytes > self.cfg.journal_max_bytes {
            let Some(old) = self.cache_order.pop_front() else {
                break;
            };
            if let Some(d) = self.cache.remove(&old) {
                self.cache_bytes -= d.len() as u64;
            }
        }
    }

    fn cache_remove(&mut self, b: u64) {
        if let Some(d) = self.cache.remove(&b) {
            self.cache_bytes -= d.len() as u64;
            self.cache_order.retain(|x| *x != b);
        }
    }

    // ---- ownership and stored state -------------------------------------------------------

    fn owner(&self, b: u64) -> Owner {
        for ((phys, ino), run) in self.rev.range(..=(b, u32::MAX)).rev().take(4) {
            if b - phys < u64::from(run.len) {
                return self.owner_from_run(*ino, run, b);
            }
        }
        let o = self.index.owner(b);
        match owner_ino(&o) {
            // The inode's map was replaced: the block is no longer in it.
            Some(ino) if self.inodes.contains_key(&ino) => Owner::Unknown,
            _ => o,
        }
    }

    fn owner_from_run(&self, ino: u32, run: &Run, b: u64) -> Owner {
        match run.kind() & !RUN_UNWRITTEN {
            RUN_EXTENT_TREE => Owner::ExtentTree { ino },
            RUN_INDIRECT => Owner::IndirectBlock { ino },
            RUN_XATTR => Owner::XattrBlock { ino },
            _ => {
                let file_block = u64::from(run.logical) + (b - run.phys());
                if ino == self.index.fs_info().journal_ino {
                    Owner::Journal { file_block }
                } else if self.meta_of(ino).map(|m| m.kind()) == Some(FileKind::Directory) {
                    Owner::Directory { ino, file_block }
                } else {
                    Owner::Data {
                        ino,
                        file_offset: file_block * self.bs,
                    }
                }
            }
        }
    }

    fn meta_of(&self, ino: u32) -> Option<InodeMeta> {
        match self.inodes.get(&ino) {
            Some(i) => i.as_ref().map(|i| i.meta),
            None => self.index.inode(ino),
        }
    }

    fn index_runs(&self, ino: u32) -> std::borrow::Cow<'_, [Run]> {
        self.index.runs(ino)
    }

    /// The stored inode (overlay, else the index) in overlay form.
    /// Whether inode `ino` is in use as far as the engine knows (without building it).
    fn has_inode(&self, ino: u32) -> bool {
        match self.inodes.get(&ino) {
            Some(i) => i.is_some(),
            None => self.index.inode(ino).is_some(),
        }
    }

    fn stored_inode(&self, ino: u32) -> Option<Inode> {
        if let Some(i) = self.inodes.get(&ino) {
            return i.clone();
        }
        let meta = self.index.inode(ino)?;
        let blob = self
            .index
            .read_link(ino)
            .or_else(|| self.index.inline_data(ino))
            .map(std::borrow::Cow::into_owned);
        Some(Inode {
            meta,
            runs: self.index_runs(ino).into_owned(),
            inline: self.index.inline_data(ino).is_some(),
            blob,
            generation: None,
        })
    }

    fn set_inode(&mut self, ino: u32, new: Option<Inode>) {
        match self.inodes.get(&ino) {
            Some(Some(old)) => {
                for r in &old.runs {
                    self.rev.remove(&(r.phys(), ino));
                }
            }
            Some(None) => {}
            None => {
                // First change: the index's runs of this inode stop counting (see `owner`).
            }
        }
        if let Some(n) = &new {
            for r in &n.runs {
                self.rev.insert((r.phys(), ino), *r);
            }
        }
        self.inodes.insert(ino, new);
    }

    // ---- write processing ---------------------------------------------------------------

    fn home_block(
        &mut self,
        b: u64,
        content: Vec<u8>,
        s: u32,
        e: u32,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) {
        let owner = self.owner(b);
        match owner {
            Owner::Journal { file_block } => {
                let Ok(pos) = u32::try_from(file_block) else {
                    return;
                };
                let txns = match self.journal.as_mut() {
                    Some(j) => j.write(pos, &content),
                    None => Vec::new(),
                };
                for t in txns {
                    self.apply_txn(t, ns, out);
                }
            }
            Owner::Data { ino, file_offset } => {
                if self.cfg.drop_data {
                    self.c.dropped_writes += 1;
                    self.c.dropped_bytes += u64::from(e - s);
                    return;
                }
                self.data_write(ino, file_offset, b, content, (s, e), None, ns, out);
            }
            Owner::Unknown => {
                // A freed metadata block may be reused for data: its committed copy is stale.
                self.cache_remove(b);
                if self.cfg.drop_data {
                    self.c.dropped_writes += 1;
                    self.c.dropped_bytes += u64::from(e - s);
                    return;
                }
                // Without data capture only the written range matters; a directory block
                // claimed later is read back from the disk.
                let content = if self.cfg.capture_data {
                    content
                } else {
                    Vec::new()
                };
                self.pending
                    .insert(b, content, s, e, ns, self.cfg.pending_max_bytes);
            }
            _ => {
                if let Some(c) = self.cache.get(&b) {
                    let same = *c == content;
                    self.cache_remove(b);
                    if same {
                        // Checkpoint of a transaction already applied.
                        self.c.checkpoints += 1;
                        return;
                    }
                }
                self.meta_block(b, owner, &content, None, ns, out);
            }
        }
    }

    /// A metadata block's new content (home write or journal replay).
    fn meta_block(
        &mut self,
        b: u64,
        owner: Owner,
        content: &[u8],
        txn: Option<u32>,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) {
        match owner {
            Owner::InodeTable { first_ino, .. } => self.inode_table(first_ino, content),
            Owner::Directory { ino, file_block } => {
                self.batch
                    .dir_writes
                    .insert((ino, file_block), content.to_vec());
                self.batch.dirty_dirs.insert(ino);
            }
            Owner::ExtentTree { ino } | Owner::IndirectBlock { ino } => self.reload_inode(ino),
            Owner::Data { ino, file_offset } => {
                // Journalled data (data=journal, or blocks of small files logged as metadata).
                let bs = self.bs as u32;
                self.data_write(ino, file_offset, b, content.to_vec(), (0, bs), txn, ns, out);
            }
            _ => {}
        }
    }

    fn inode_table(&mut self, first_ino: u32, content: &[u8]) {
        let per = content.len() / self.isz;
        let count = self.index.fs_info().inodes_count;
        for k in 0..per {
            let Some(ino) = first_ino.checked_add(k as u32) else {
                break;
            };
            if ino == 0 || ino > count {
                break;
            }
            if ino < self.first_ino && ino != 2 {
                continue;
            }
            let Some(raw) = content.get(k * self.isz..(k + 1) * self.isz) else {
                break;
            };
            if raw.iter().all(|&x| x == 0) {
                // A never-used inode: mke2fs and the kernel's lazy inode-table initialisation
                // (ext4lazyinit, at the first mount of an image made without it) write whole
                // tables of them. Remembering their fingerprints would cost 16 bytes for every
                // inode of the file system, so absence stands for "zero or unknown": only an
                // inode that had content (a fingerprint or a known file) can change.
                if self.fps.remove(&ino).is_some() || self.has_inode(ino) {
                    self.update_inode(ino, raw);
                }
                continue;
            }
            let fp = fnv(raw);
            if self.fps.get(&ino) == Some(&fp) {
                continue;
            }
            self.fps.insert(ino, fp);
            self.update_inode(ino, raw);
        }
    }

    /// Re-read inode `ino` (its extent-tree or indirect blocks changed).
    fn reload_inode(&mut self, ino: u32) {
        let Some((blk, off)) = self.index.inode_location(ino) else {
            return;
        };
        let Some(buf) = self.read_block(blk) else {
            return;
        };
        let off = off as usize;
        if let Some(raw) = buf.get(off..off + self.isz) {
            let raw = raw.to_vec();
            self.fps.remove(&ino);
            self.update_inode(ino, &raw);
        }
    }

    fn update_inode(&mut self, ino: u32, raw: &[u8]) {
        let geo = self.geo;
        let parsed = {
            let mut read = |b: u64| self.read_block(b);
            state::parse_inode(ino, raw, &geo, &mut read)
        };
        let new = match parsed {
            Ok(n) => n,
            Err(_) => {
                self.c.meta_errors += 1;
                return;
            }
        };
        let old = self.stored_inode(ino);
        let same = match (&old, &new) {
            (Some(o), Some(n)) => {
                o.meta == n.meta
                    && o.runs == n.runs
                    && o.blob == n.blob
                    && o.inline == n.inline
                    && o.generation.is_none_or(|g| Some(g) == n.generation)
            }
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        self.batch
            .changed
            .entry(ino)
            .or_insert_with(|| old.as_ref().map(|o| (o.meta, o.generation)));
        if new.is_none() {
            self.batch.freed.insert(ino);
        }
        let map_changed = match (&old, &new) {
            (Some(o), Some(n)) => o.runs != n.runs || o.blob != n.blob,
            _ => true,
        };
        let size_changed = old.as_ref().map(|o| o.meta.size) != new.as_ref().map(|n| n.meta.size);
        let was_dir = old
            .as_ref()
            .is_some_and(|o| o.kind() == FileKind::Directory);
        let is_dir = new
            .as_ref()
            .is_some_and(|n| n.kind() == FileKind::Directory);
        if (is_dir && map_changed) || (was_dir && !is_dir) {
            self.batch.dirty_dirs.insert(ino);
        }
        if map_changed || size_changed {
            self.batch.claims.insert(ino);
        }
        self.set_inode(ino, new);
    }

    #[allow(clippy::too_many_arguments)]
    fn data_write(
        &mut self,
        ino: u32,
        file_offset: u64,
        block: u64,
        content: Vec<u8>,
        (s, e): (u32, u32),
        txn: Option<u32>,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) {
        let Some(meta) = self.meta_of(ino) else {
            return;
        };
        match meta.kind() {
            FileKind::Regular => {}
            FileKind::Symlink => {
                // A slow symlink's target block written after its inode.
                if file_offset == 0 {
                    if let Some(mut i) = self.stored_inode(ino) {
                        let n = usize::try_from(meta.size.min(4096)).unwrap_or(0);
                        i.blob = content.get(..n).map(<[u8]>::to_vec);
                        self.set_inode(ino, Some(i));
                    }
                }
                return;
            }
            _ => return,
        }
        let start = file_offset + u64::from(s);
        let end = (file_offset + u64::from(e)).min(meta.size);
        let path = self.path_of(ino);
        if start >= end || path.is_none() {
            // Past the known end of file or not named yet: wait for the metadata.
            self.pending
                .insert(block, content, s, e, ns, self.cfg.pending_max_bytes);
            return;
        }
        let Some(path) = path else { return };
        let bytes = content
            .get(s as usize..s as usize + (end - start) as usize)
            .unwrap_or(&[]);
        self.emit_write(ino, &path, start, bytes, txn, ns, out);
        if file_offset + u64::from(e) > meta.size {
            // The part past the known end of file waits for the size update (an append
            // whose data reaches the disk before its inode). The kernel zeroes a page past
            // EOF, so only a tail with data in it can be an append.
            let from = (meta.size - file_offset) as u32;
            let tail = content.get(from as usize..e as usize).unwrap_or(&[]);
            if tail.iter().any(|&x| x != 0) {
                self.pending
                    .insert(block, content, from, e, ns, self.cfg.pending_max_bytes);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn emit_write(
        &self,
        ino: u32,
        path: &str,
        start: u64,
        bytes: &[u8],
        txn: Option<u32>,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) {
        let cap = self.cfg.max_event_data.max(1);
        let mut start = start;
        let mut bytes = bytes;
        // Extend the previous event when this write continues it (up to the data cap).
        if let Some(last) = out.last_mut() {
            if last.kind == EventKind::Write
                && last.ino == ino
                && last.path == path
                && last.txn == txn
                && last.range.is_some_and(|(_, e)| e == start)
            {
                let take = last.data.as_ref().map_or(bytes.len(), |d| {
                    cap.saturating_sub(d.len()).min(bytes.len())
                });
                if let Some(d) = last.data.as_mut() {
                    d.extend_from_slice(&bytes[..take]);
                }
                if let Some(r) = last.range.as_mut() {
                    r.1 = start + take as u64;
                }
                start += take as u64;
                bytes = &bytes[take..];
                if bytes.is_empty() {
                    return;
                }
            }
        }
        if self.cfg.capture_data {
            for (i, chunk) in bytes.chunks(cap).enumerate() {
                let s = start + (i * cap) as u64;
                let e = s + chunk.len() as u64;
                out.push(write_event(ino, path, s, e, Some(chunk.to_vec()), txn, ns));
            }
        } else {
            let end = start + bytes.len() as u64;
            out.push(write_event(ino, path, start, end, None, txn, ns));
        }
    }

    fn apply_txn(&mut self, t: Txn, ns: u64, out: &mut Vec<FsEvent>) {
        for r in &t.revoked {
            self.cache_remove(*r);
        }
        for (home, data) in &t.blocks {
            if data.len() as u64 == self.bs && *home < self.geo.blocks_count {
                self.cache_insert(*home, data.clone());
            }
        }
        // Inodes first, so that blocks allocated in this transaction have their owners.
        for (home, data) in &t.blocks {
            if let Owner::InodeTable { first_ino, .. } = self.owner(*home) {
                self.inode_table(first_ino, data);
            }
        }
        for (home, data) in &t.blocks {
            let owner = self.owner(*home);
            if !matches!(owner, Owner::InodeTable { .. } | Owner::Journal { .. }) {
                self.meta_block(*home, owner, data, Some(t.seq), ns, out);
            }
        }
        self.c.txns += 1;
        self.resolve(Some(t.seq), ns, out);
    }
}

fn write_event(
    ino: u32,
    path: &str,
    start: u64,
    end: u64,
    data: Option<Vec<u8>>,
    txn: Option<u32>,
    ns: u64,
) -> FsEvent {
    FsEvent {
        kind: EventKind::Write,
        path: path.to_string(),
        old_path: None,
        ino,
        old: None,
        new: None,
        range: Some((start, end)),
        data,
        txn,
        observed_ns: ns,
    }
}

impl FsRead for Engine {
    fn stat(&self, ino: u32) -> Option<InodeMeta> {
        self.meta_of(ino)
    }

    fn read_dir(&self, ino: u32) -> Option<Vec<ViewEntry>> {
        if self.meta_of(ino)?.kind() != FileKind::Directory {
            return None;
        }
        let entries = self.entries_of(ino);
        Some(
            entries
                .into_iter()
                .map(|(name, (i, ft))| ViewEntry {
                    kind: self
                        .meta_of(i)
                        .map_or_else(|| state::kind_of_ftype(ft), |m| m.kind()),
                    name,
                    ino: i,
                })
                .collect(),
        )
    }

    fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
        match self.dirs.get(&dir) {
            Some(d) => d.get(name).map(|(i, _)| *i),
            None => self.index.lookup_in(dir, name),
        }
    }

    fn read_link(&self, ino: u32) -> Option<Vec<u8>> {
        match self.inodes.get(&ino) {
            Some(Some(i)) if i.kind() == FileKind::Symlink => i.blob.clone(),
            Some(_) => None,
            None => self.index.read_link(ino).map(std::borrow::Cow::into_owned),
        }
    }

    fn read(&self, ino: u32, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let Some(Some(inode)) = self.inodes.get(&ino) else {
            if self.inodes.contains_key(&ino) {
                return Err(Error::inode(ino, "is not in use"));
            }
            return self.index.read_file(self.disk.as_ref(), ino, offset, buf);
        };
        let size = inode.meta.size;
        if offset >= size {
            return Ok(0);
        }
        let n = usize::try_from((size - offset).min(buf.len() as u64)).unwrap_or(buf.len());
        let buf = &mut buf[..n];
        buf.fill(0);
        if inode.inline {
            if let Some(src) = inode
                .blob
                .as_deref()
                .and_then(|d| d.get(usize::try_from(offset).unwrap_or(usize::MAX)..))
            {
                let k = src.len().min(n);
                buf[..k].copy_from_slice(&src[..k]);
            }
            return Ok(n);
        }
        let bs = self.bs;
        let end = offset + n as u64;
        for r in inode.runs.iter().filter(|r| r.kind() == RUN_DATA) {
            let rs = u64::from(r.logical) * bs;
            let re = rs + u64::from(r.len) * bs;
            let s = rs.max(offset);
            let e = re.min(end);
            if s >= e {
                continue;
            }
            let disk = self.part + r.phys() * bs + (s - rs);
            self.disk
                .read_at(disk, &mut buf[(s - offset) as usize..(e - offset) as usize])?;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
