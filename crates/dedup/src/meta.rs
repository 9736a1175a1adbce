//! The metadata buffer cache (dm-bufio's role) and the journal that makes metadata changes
//! atomic.
//!
//! Table pages are read through a bounded LRU cache; a changed page stays dirty in memory
//! until the next commit (it is never evicted dirty, so the file always holds the last
//! committed state). A commit writes the dirty pages as one journal record (header + images,
//! BLAKE3 over all of it), syncs, writes them in place in page order, syncs, and writes the
//! next superblock slot with the new generation, synced. Opening a volume replays a valid
//! journal record whose sequence number follows the superblock's generation; replay is
//! idempotent, so a crash at any step leaves either the old or the new state.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::disk::Disk;
use crate::error::{DedupError, Result};
use crate::format::{Geometry, JournalHeader, Superblock, BLOCK, JOURNAL_START, MAX_COMMIT_PAGES};

type Page = Box<[u8]>;

struct Cached {
    data: Page,
    dirty: bool,
    /// Position in the LRU order (clean pages only).
    tick: u64,
}

/// Cache counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct MetaCounters {
    pub hits: u64,
    pub misses: u64,
    pub commits: u64,
    pub committed_pages: u64,
    pub evictions: u64,
}

/// The metadata tables behind a bounded page cache.
pub struct MetaStore {
    geo: Geometry,
    generation: u64,
    capacity: usize,
    pages: HashMap<u64, Cached>,
    /// Clean pages by last use.
    lru: BTreeMap<u64, u64>,
    dirty: BTreeSet<u64>,
    tick: u64,
    pub counters: MetaCounters,
}

fn zero_page() -> Page {
    vec![0u8; BLOCK as usize].into_boxed_slice()
}

impl MetaStore {
    /// Opens the tables of a volume whose superblock is `sb`, replaying a pending journal
    /// record. `capacity` is the cache size in pages (at least 8).
    pub fn open(disk: &mut Disk, sb: Superblock, capacity: usize) -> Result<(Self, bool)> {
        let mut store = Self {
            geo: sb.geometry,
            generation: sb.generation,
            capacity: capacity.max(8),
            pages: HashMap::new(),
            lru: BTreeMap::new(),
            dirty: BTreeSet::new(),
            tick: 0,
            counters: MetaCounters::default(),
        };
        let replayed = store.replay(disk)?;
        Ok((store, replayed))
    }

    /// Generation of the last committed state.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Dirty pages waiting for the next commit.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Cache size in pages.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Pages the next commit should carry at most: the journal's limit, and three quarters of
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

    /// Applies the journal record of the commit after `generation` if it is complete.
    fn replay(&mut self, disk: &mut Disk) -> Result<bool> {
        let mut hp = zero_page();
        disk.read_meta(JOURNAL_START, &mut hp)?;
        let Some(h) = JournalHeader::decode(&hp) else {
            return Ok(false);
        };
        if h.seq != self.generation + 1 {
            return Ok(false);
        }
        let mut images = Vec::with_capacity(h.pages.len());
        for i in 0..h.pages.len() as u64 {
            let mut p = zero_page();
            disk.read_meta(JOURNAL_START + 1 + i, &mut p)?;
            images.push(p);
        }
        let refs: Vec<&[u8]> = images.iter().map(|p| &p[..]).collect();
        if JournalHeader::checksum_of(h.seq, &h.pages, &refs) != h.checksum {
            return Ok(false); // torn record: the commit never completed
        }
        if let Some(bad) = h.pages.iter().find(|p| !self.geo.is_table_page(**p)) {
            return Err(Self::corrupt(
                disk,
                format!("the journal names page {bad}, which is not a table page"),
            ));
        }
        for (pg, img) in h.pages.iter().zip(&images) {
            disk.write_meta(*pg, img)?;
        }
        disk.sync_meta()?;
        self.write_superblock(disk, h.seq)?;
        Ok(true)
    }

    fn write_superblock(&mut self, disk: &mut Disk, generation: u64) -> Result<()> {
        let sb = Superblock {
            geometry: self.geo,
            generation,
        };
        disk.write_meta(generation % 2, &sb.encode())?;
        disk.sync_meta()?;
        self.generation = generation;
        Ok(())
    }

    fn touch(&mut self, page: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(c) = self.pages.get_mut(&page) {
            if !c.dirty {
                self.lru.remove(&c.tick);
                self.lru.insert(tick, page);
            }
            c.tick = tick;
        }
    }

    fn evict_to_capacity(&mut self) {
        while self.pages.len() > self.capacity {
            let Some((&t, &pg)) = self.lru.iter().next() else {
                break; // only dirty pages left: the caller commits
            };
            self.lru.remove(&t);
            self.pages.remove(&pg);
            self.counters.evictions += 1;
        }
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
        self.counters.misses += 1;
        let mut p = zero_page();
        disk.read_meta(page, &mut p)?;
        self.tick += 1;
        self.pages.insert(
            page,
            Cached {
                data: p,
                dirty: false,
                tick: self.tick,
            },
        );
        self.lru.insert(self.tick, page);
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

    /// A table page to change; it stays in memory until the next commit.
    pub fn page_mut(&mut self, disk: &mut Disk, page: u64) -> Result<&mut [u8]> {
        self.load(disk, page)?;
        let Some(c) = self.pages.get_mut(&page) else {
            return Err(Self::corrupt(
                disk,
                format!("page {page} vanished from the cache"),
            ));
        };
        if !c.dirty {
            c.dirty = true;
            self.lru.remove(&c.tick);
            self.dirty.insert(page);
        }
        Ok(&mut c.data)
    }

    /// Makes every change so far durable as one atomic step (the caller has synced the data
    /// the changes refer to). Nothing to do without dirty pages.
    pub fn commit(&mut self, disk: &mut Disk) -> Result<()> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        let pages: Vec<u64> = self.dirty.iter().copied().collect();
        for chunk in pages.chunks(MAX_COMMIT_PAGES) {
            self.commit_pages(disk, chunk)?;
        }
        self.dirty.clear();
        for pg in pages {
            self.tick += 1;
            let tick = self.tick;
            if let Some(c) = self.pages.get_mut(&pg) {
                c.dirty = false;
                c.tick = tick;
                self.lru.insert(tick, pg);
            }
        }
        self.evict_to_capacity();
        Ok(())
    }

    fn commit_pages(&mut self, disk: &mut Disk, pages: &[u64]) -> Result<()> {
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
        disk.write_meta(JOURNAL_START, &record)?;
        disk.sync_meta()?;
        for pg in pages {
            if let Some(c) = self.pages.get(pg) {
                let data = c.data.clone();
                disk.write_meta(*pg, &data)?;
            }
        }
        disk.sync_meta()?;
        self.write_superblock(disk, seq)?;
        self.counters.commits += 1;
        self.counters.committed_pages += pages.len() as u64;
        Ok(())
    }
}
