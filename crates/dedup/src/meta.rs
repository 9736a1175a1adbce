//! The metadata buffer cache (dm-bufio's role) and the journal that makes metadata changes
//! atomic.
//!
//! Table pages are read through a bounded LRU cache. A changed page stays dirty in memory
//! until the next commit, and a committed page stays pinned until the next checkpoint: it is
//! never evicted before its image is in place, so the file plus the journal always hold the
//! last committed state.
//!
//! A **commit** (every guest FLUSH, every `flush-every` writes, dirty-page pressure) appends
//! the dirty pages as one journal record (header + images, BLAKE3 over all of it) and syncs:
//! one sequential write, as jbd2 does. A **checkpoint** (when a miss finds the cache full of
//! pinned pages, when the journal is full, when idle and at shutdown) writes the committed
//! images in place in page order (a page changed again since its commit keeps its committed
//! image aside for this), syncs, and writes the superblock slot not holding the current one with
//! the last committed sequence number, synced; the journal then starts over. Opening a volume
//! replays the chain of valid records that follows the superblock's generation (sequence
//! numbers only grow, so an older record never continues the chain); replay is idempotent,
//! so a crash at any step leaves a state with every commit up to the last complete record.
//!
//! The mount-time scan marks the L2P and reference-count pages that are all zeros; a miss on
//! such a page (a logical range never written, chunks never used) needs no read, as the
//! allocation bitmap of a file system saves reading empty tables. The mark goes with the
//! first change of the page.
//!
//! Misses on the L2P map and the reference counts, whose pages a sequential stream walks in
//! order, read ahead: a miss right after a miss on the page before reads up to
//! [`MAX_READAHEAD`] pages in one I/O (dm-bufio's prefetch), bounded by a quarter of the cache.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::disk::Disk;
use crate::error::{DedupError, Result};
use crate::format::{
    Geometry, JournalHeader, Superblock, BLOCK, JOURNAL_PAGES, JOURNAL_START, MAX_COMMIT_PAGES,
};

type Page = Box<[u8]>;

/// Most pages one readahead reads.
pub const MAX_READAHEAD: u64 = 8;

struct Cached {
    data: Page,
    /// Position in the LRU order (meaningful for unpinned pages only).
    tick: u64,
}

/// Cache counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct MetaCounters {
    pub hits: u64,
    pub misses: u64,
    pub commits: u64,
    pub committed_pages: u64,
    pub checkpoints: u64,
    pub evictions: u64,
    /// Pages read ahead of a sequential miss (not counted as misses).
    pub readahead_pages: u64,
    /// Misses on pages known to be all zeros (no read).
    pub empty_misses: u64,
    /// Checkpoints forced by a full cache of pinned pages.
    pub demand_checkpoints: u64,
}

/// Sequential-miss detection of one table region.
#[derive(Default, Clone, Copy)]
struct Stream {
    last_miss: Option<u64>,
    window: u64,
}

/// The metadata tables behind a bounded page cache.
pub struct MetaStore {
    geo: Geometry,
    /// Sequence number of the last committed record.
    generation: u64,
    /// Generation in the superblock (everything up to it is in place).
    checkpointed: u64,
    /// The superblock slot holding the current superblock.
    sb_slot: u64,
    /// Next free journal page, relative to [`JOURNAL_START`].
    journal_head: u64,
    capacity: usize,
    pages: HashMap<u64, Cached>,
    /// Unpinned pages by last use.
    lru: BTreeMap<u64, u64>,
    /// Pages changed since the last commit.
    dirty: BTreeSet<u64>,
    /// Pages committed to the journal but not yet written in place.
    unchecked: BTreeSet<u64>,
    /// The committed images of unchecked pages changed again since (a checkpoint writes
    /// these, never uncommitted changes).
    shadow: HashMap<u64, Page>,
    tick: u64,
    streams: [Stream; 2],
    /// Bit per L2P and reference-count page: known to be all zeros on disk.
    empty: Vec<u64>,
    pub counters: MetaCounters,
}

fn zero_page() -> Page {
    vec![0u8; BLOCK as usize].into_boxed_slice()
}

impl MetaStore {
    /// Opens the tables of a volume whose superblock is `sb`, replaying the journal records
    /// that follow it. `capacity` is the cache size in pages (at least 8).
    pub fn open(disk: &mut Disk, sb: Superblock, capacity: usize) -> Result<(Self, bool)> {
        let mut store = Self {
            geo: sb.geometry,
            generation: sb.generation,
            checkpointed: sb.generation,
            sb_slot: current_slot(disk, &sb)?,
            journal_head: 0,
            capacity: capacity.max(8),
            pages: HashMap::new(),
            lru: BTreeMap::new(),
            dirty: BTreeSet::new(),
            unchecked: BTreeSet::new(),
            shadow: HashMap::new(),
            tick: 0,
            streams: [Stream::default(); 2],
            empty: Vec::new(),
            counters: MetaCounters::default(),
        };
        let replayed = store.replay(disk)?;
        Ok((store, replayed))
    }

    /// Generation of the last committed state.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Records that table page `page` (L2P or reference counts) is all zeros on disk.
    pub fn mark_empty(&mut self, page: u64) {
        let Some(i) = self.empty_bit(page) else {
            return;
        };
        if self.empty.len() <= i / 64 {
            self.empty.resize(i / 64 + 1, 0);
        }
        self.empty[i / 64] |= 1 << (i % 64);
    }

    fn empty_bit(&self, page: u64) -> Option<usize> {
        (page >= self.geo.l2p_start() && page < self.geo.index_start())
            .then(|| (page - self.geo.l2p_start()) as usize)
    }

    fn is_empty(&self, page: u64) -> bool {
        self.empty_bit(page).is_some_and(|i| {
            self.empty
                .get(i / 64)
                .is_some_and(|w| w & (1 << (i % 64)) != 0)
        })
    }

    fn clear_empty(&mut self, page: u64) {
        if let Some(i) = self.empty_bit(page) {
            if let Some(w) = self.empty.get_mut(i / 64) {
                *w &= !(1 << (i % 64));
            }
        }
    }

    /// Dirty pages waiting for the next commit.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Cache size in pages.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Dirty pages at which the volume commits: the journal's limit, and three quarters of
    /// the cache so that clean pages remain to cache lookups.
    pub fn commit_threshold(&self) -> usize {
        (self.capacity * 3 / 4).clamp(1, MAX_COMMIT_PAGES)
    }

    fn corrupt(disk: &Disk, reason: String) -> DedupError {
        DedupError::Corrupt {
            path: disk.dir().to_owned(),
            reason,
        }
    }

    /// Applies the chain of complete journal records that follows the checkpointed
    /// generation; returns whether there was one.
    fn replay(&mut self, disk: &mut Disk) -> Result<bool> {
        let mut latest: BTreeMap<u64, Page> = BTreeMap::new();
        let mut pos = 0u64;
        let mut seq = self.checkpointed;
        while let Some((h, images)) = self.read_record(disk, pos, seq + 1)? {
            pos += 1 + h.pages.len() as u64;
            seq = h.seq;
            latest.extend(h.pages.into_iter().zip(images));
        }
        if seq == self.checkpointed {
            return Ok(false);
        }
        for (pg, img) in &latest {
            disk.write_meta(*pg, img)?;
        }
        disk.sync_meta()?;
        self.generation = seq;
        self.write_superblock(disk, seq)?;
        Ok(true)
    }

    /// The record at journal page `pos` if it is complete and carries sequence number `seq`.
    fn read_record(
        &self,
        disk: &mut Disk,
        pos: u64,
        seq: u64,
    ) -> Result<Option<(JournalHeader, Vec<Page>)>> {
        if pos >= JOURNAL_PAGES {
            return Ok(None);
        }
        let mut hp = zero_page();
        disk.read_meta(JOURNAL_START + pos, &mut hp)?;
        let Some(h) = JournalHeader::decode(&hp) else {
            return Ok(None);
        };
        if h.seq != seq || pos + 1 + h.pages.len() as u64 > JOURNAL_PAGES {
            return Ok(None);
        }
        let mut images = Vec::with_capacity(h.pages.len());
        for i in 0..h.pages.len() as u64 {
            let mut p = zero_page();
            disk.read_meta(JOURNAL_START + pos + 1 + i, &mut p)?;
            images.push(p);
        }
        let refs: Vec<&[u8]> = images.iter().map(|p| &p[..]).collect();
        if JournalHeader::checksum_of(h.seq, &h.pages, &refs) != h.checksum {
            return Ok(None); // torn record: that commit never completed
        }
        if let Some(bad) = h.pages.iter().find(|p| !self.geo.is_table_page(**p)) {
            return Err(Self::corrupt(
                disk,
                format!("journal record {seq} names page {bad}, which is not a table page"),
            ));
        }
        Ok(Some((h, images)))
    }

    /// Writes the superblock of `generation` into the slot not holding the current one.
    fn write_superblock(&mut self, disk: &mut Disk, generation: u64) -> Result<()> {
        let sb = Superblock {
            geometry: self.geo,
            generation,
        };
        let slot = 1 - self.sb_slot;
        disk.write_meta(slot, &sb.encode())?;
        disk.sync_meta()?;
        self.sb_slot = slot;
        self.checkpointed = generation;
        self.journal_head = 0;
        Ok(())
    }

    fn is_pinned(&self, page: u64) -> bool {
        self.dirty.contains(&page) || self.unchecked.contains(&page)
    }

    fn touch(&mut self, page: u64) {
        self.tick += 1;
        let tick = self.tick;
        let pinned = self.is_pinned(page);
        if let Some(c) = self.pages.get_mut(&page) {
            if !pinned {
                self.lru.remove(&c.tick);
                self.lru.insert(tick, page);
            }
            c.tick = tick;
        }
    }

    fn evict_to_capacity(&mut self) {
        while self.pages.len() > self.capacity {
            let Some((&t, &pg)) = self.lru.iter().next() else {
                break; // only pinned pages left: the caller commits
            };
            self.lru.remove(&t);
            self.pages.remove(&pg);
            self.counters.evictions += 1;
        }
    }

    /// Checkpoints when the cache is full of pinned pages and some of them are only waiting
    /// for their in-place write (dm-bufio writes back on demand the same way).
    fn make_room(&mut self, disk: &mut Disk) -> Result<()> {
        if self.pages.len() >= self.capacity && self.lru.is_empty() && !self.unchecked.is_empty() {
            self.counters.demand_checkpoints += 1;
            self.checkpoint(disk)?;
        }
        Ok(())
    }

    /// The sequential table region of `page` (0 = L2P, 1 = reference counts) and its end.
    fn region(&self, page: u64) -> Option<(usize, u64)> {
        if page >= self.geo.l2p_start() && page < self.geo.rc_start() {
            Some((0, self.geo.rc_start()))
        } else if page >= self.geo.rc_start() && page < self.geo.index_start() {
            Some((1, self.geo.index_start()))
        } else {
            None
        }
    }

    /// Pages to read for a miss on `page`: 1, or a readahead window after a sequential miss.
    fn miss_span(&mut self, page: u64) -> u64 {
        let Some((r, end)) = self.region(page) else {
            return 1;
        };
        let s = &mut self.streams[r];
        let sequential = s
            .last_miss
            .is_some_and(|m| m + 1 == page || m + s.window.max(1) == page);
        s.window = if sequential {
            (s.window * 2).clamp(2, MAX_READAHEAD)
        } else {
            1
        };
        let max = s
            .window
            .min((self.capacity / 4).max(1) as u64)
            .min(end - page);
        let mut n = 1;
        while n < max && !self.pages.contains_key(&(page + n)) && !self.is_empty(page + n) {
            n += 1;
        }
        self.streams[r].last_miss = Some(page + n - 1);
        n
    }

    fn insert_clean(&mut self, page: u64, data: Page) {
        self.tick += 1;
        self.pages.insert(
            page,
            Cached {
                data,
                tick: self.tick,
            },
        );
        self.lru.insert(self.tick, page);
    }

    fn load(&mut self, disk: &mut Disk, page: u64) -> Result<()> {
        if self.pages.contains_key(&page) {
            self.counters.hits += 1;
            self.touch(page);
            return Ok(());
        }
        if !self.geo.is_table_page(page) {
            return Err(Self::corrupt(
                disk,
                format!("page {page} is not a table page"),
            ));
        }
        if self.is_empty(page) {
            self.make_room(disk)?;
            self.counters.empty_misses += 1;
            self.insert_clean(page, zero_page());
            self.evict_to_capacity();
            return Ok(());
        }
        self.make_room(disk)?;
        self.counters.misses += 1;
        let n = self.miss_span(page);
        let mut buf = vec![0u8; (n * BLOCK) as usize];
        disk.read_meta(page, &mut buf)?;
        // Read-ahead pages first, so the requested page is the most recently used.
        for i in (0..n).rev() {
            let at = (i * BLOCK) as usize;
            let data = buf[at..at + BLOCK as usize].to_vec().into_boxed_slice();
            self.insert_clean(page + i, data);
        }
        self.counters.readahead_pages += n - 1;
        self.evict_to_capacity();
        Ok(())
    }

    /// A table page, read through the cache.
    pub fn page(&mut self, disk: &mut Disk, page: u64) -> Result<&[u8]> {
        self.load(disk, page)?;
        match self.pages.get(&page) {
            Some(c) => Ok(&c.data),
            None => Err(Self::corrupt(
                disk,
                format!("page {page} vanished from the cache"),
            )),
        }
    }

    /// A table page to change; it stays in memory until the next checkpoint.
    pub fn page_mut(&mut self, disk: &mut Disk, page: u64) -> Result<&mut [u8]> {
        self.load(disk, page)?;
        self.clear_empty(page);
        if !self.is_pinned(page) {
            if let Some(c) = self.pages.get(&page) {
                self.lru.remove(&c.tick);
            }
        }
        if self.unchecked.contains(&page) && !self.dirty.contains(&page) {
            if let Some(c) = self.pages.get(&page) {
                self.shadow.insert(page, c.data.clone());
            }
        }
        self.dirty.insert(page);
        match self.pages.get_mut(&page) {
            Some(c) => Ok(&mut c.data),
            None => Err(Self::corrupt(
                disk,
                format!("page {page} vanished from the cache"),
            )),
        }
    }

    /// Makes every change so far durable as one atomic step (the caller has synced the data
    /// the changes refer to): appends a journal record. The pages stay pinned until a
    /// checkpoint writes them in place.
    pub fn commit(&mut self, disk: &mut Disk) -> Result<()> {
        let pages: Vec<u64> = self.dirty.iter().copied().collect();
        for chunk in pages.chunks(MAX_COMMIT_PAGES) {
            if self.journal_head + 1 + chunk.len() as u64 > JOURNAL_PAGES {
                self.checkpoint(disk)?;
            }
            self.append_record(disk, chunk)?;
            for pg in chunk {
                self.shadow.remove(pg);
                self.dirty.remove(pg);
                self.unchecked.insert(*pg);
            }
        }
        Ok(())
    }

    /// Writes every committed page in place and moves the superblock to the last commit;
    /// the pages become evictable and the journal starts over. Dirty pages stay dirty.
    pub fn checkpoint(&mut self, disk: &mut Disk) -> Result<()> {
        if self.checkpointed == self.generation {
            return Ok(());
        }
        let pages = std::mem::take(&mut self.unchecked);
        for pg in &pages {
            let data = match (self.shadow.remove(pg), self.pages.get(pg)) {
                (Some(committed), _) => committed,
                (None, Some(c)) => c.data.clone(),
                (None, None) => {
                    return Err(Self::corrupt(
                        disk,
                        format!("committed page {pg} is not cached"),
                    ))
                }
            };
            disk.write_meta(*pg, &data)?;
        }
        disk.sync_meta()?;
        self.write_superblock(disk, self.generation)?;
        for pg in pages {
            if self.dirty.contains(&pg) {
                continue;
            }
            self.tick += 1;
            let tick = self.tick;
            if let Some(c) = self.pages.get_mut(&pg) {
                c.tick = tick;
                self.lru.insert(tick, pg);
            }
        }
        self.counters.checkpoints += 1;
        self.evict_to_capacity();
        Ok(())
    }

    fn append_record(&mut self, disk: &mut Disk, pages: &[u64]) -> Result<()> {
        let seq = self.generation + 1;
        let mut images: Vec<&[u8]> = Vec::with_capacity(pages.len());
        for pg in pages {
            match self.pages.get(pg) {
                Some(c) => images.push(&c.data),
                None => {
                    return Err(Self::corrupt(
                        disk,
                        format!("dirty page {pg} is not cached"),
                    ))
                }
            }
        }
        let header = JournalHeader {
            seq,
            pages: pages.to_vec(),
            checksum: JournalHeader::checksum_of(seq, pages, &images),
        };
        let mut record = header.encode();
        for i in &images {
            record.extend_from_slice(i);
        }
        disk.write_meta(JOURNAL_START + self.journal_head, &record)?;
        disk.sync_meta()?;
        self.journal_head += 1 + pages.len() as u64;
        self.generation = seq;
        self.counters.commits += 1;
        self.counters.committed_pages += pages.len() as u64;
        Ok(())
    }
}

/// The slot (0 or 1) whose superblock is `sb`; slot 0 when both are.
fn current_slot(disk: &mut Disk, sb: &Superblock) -> Result<u64> {
    let mut p = zero_page();
    disk.read_meta(0, &mut p)?;
    Ok(match Superblock::decode(&p) {
        Ok(s0) if s0.generation == sb.generation => 0,
        _ => 1,
    })
}
