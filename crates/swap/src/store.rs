//! The swap cache: swap pages held in slots of the shared [`Region`], the rest in the swap
//! file. The guest module (bypass) and vmsight's block path run the same operations on the
//! region under its spin lock (docs/swapbypass.md, "The region protocol"); vmsight alone
//! evicts slots to the file, grants slots (the cache size) and gives memory back.
//!
//! The truth for swap page `p`: if `index[p]` names a slot, that slot's page; otherwise the
//! file's page. Every operation keeps that true at each lock release:
//! * a store fills a slot and points the index at it (or clears the index when no slot is
//!   free, and the caller writes the file);
//! * an eviction writes the file first and clears the index after;
//! * file writes of the block path and evictions are ordered by `file_order`, so a stale
//!   eviction can never land after a newer write of the same page.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmsight_proto::sym::swapr::{self, Layout, PAGE};
use vmsight_proto::sym::SWAPHDR;

use crate::error::SwapError;
use crate::region::Region;

/// How long vmsight waits for the guest to release the region's lock before failing the
/// request (only a guest breaking the protocol holds it that long).
const LOCK_WAIT: Duration = Duration::from_secs(2);
/// Slots evicted per batch (one lock hold to pick them, one to release them).
pub const EVICT_BATCH: usize = 256;
/// Free slots punched per lock hold when giving memory back.
const TRIM_BATCH: usize = 32;
/// Slots whose residency one `mincore` call reads when trimming.
const TRIM_WINDOW: u64 = 4096;

/// vmsight's counters (the guest's own are in the region's header).
#[derive(Debug, Default)]
pub struct Counters {
    pub block_reads: AtomicU64,
    pub block_writes: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_inserts: AtomicU64,
    pub write_through: AtomicU64,
    pub discards: AtomicU64,
    pub evicted: AtomicU64,
    pub evict_failures: AtomicU64,
    pub punched: AtomicU64,
    pub lock_timeouts: AtomicU64,
    pub corrupt: AtomicU64,
}

/// Where a block read was served from / a block write went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Cache,
    File,
}

/// Why a block operation failed.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("the guest holds the swap region's lock beyond {LOCK_WAIT:?}")]
    Locked,
    #[error("swap page {0} is beyond the swap disk")]
    Range(u64),
    #[error("swap file I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// State of vmsight's clock hand and eviction in progress.
#[derive(Debug, Default)]
struct Hand {
    /// Next slot the clock looks at.
    clock: u64,
    /// Next slot the grant scan looks at for reserved slots.
    grant: u64,
    /// Next slot the trim scan looks at for free slots.
    trim: u64,
    /// Slots marked evicting whose release could not take the lock yet.
    pending: Vec<(u64, u64)>,
}

/// Region offsets of the header fields used on every operation.
#[derive(Debug, Clone, Copy)]
struct Hdr {
    lock: u64,
    free_top: u64,
    used: u64,
}

/// The swap cache of one swap disk.
#[derive(Debug)]
pub struct SwapStore {
    region: Region,
    layout: Layout,
    hdr: Hdr,
    file: File,
    file_order: Mutex<()>,
    hand: Mutex<Hand>,
    target: AtomicU64,
    pub counters: Counters,
}

/// A slot state word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meta {
    state: u64,
    page: u64,
    referenced: bool,
}

fn decode(w: u64) -> Meta {
    Meta {
        state: (w & swapr::STATE_MASK) >> swapr::STATE_SHIFT,
        page: w & swapr::OFFSET_MASK,
        referenced: w & swapr::REFERENCED != 0,
    }
}

fn encode(state: u64, page: u64) -> u64 {
    (state << swapr::STATE_SHIFT) | (page & swapr::OFFSET_MASK)
}

impl SwapStore {
    /// A cache for `file` (the swap disk, `layout.swap_pages` pages) in a fresh region, with
    /// `cache_pages` slots granted.
    pub fn new(
        name: &str,
        file: File,
        layout: Layout,
        cache_pages: u64,
    ) -> Result<Self, SwapError> {
        if cache_pages > layout.slots {
            return Err(SwapError::TooLarge {
                pages: cache_pages,
                slots: layout.slots,
            });
        }
        let region = Region::create(name, layout)?;
        let store = Self {
            hdr: Hdr {
                lock: SWAPHDR.at("lock") as u64,
                free_top: SWAPHDR.at("free_top") as u64,
                used: SWAPHDR.at("used") as u64,
            },
            region,
            layout,
            file,
            file_order: Mutex::new(()),
            hand: Mutex::new(Hand::default()),
            target: AtomicU64::new(cache_pages),
            counters: Counters::default(),
        };
        store.write_header();
        store.rebalance();
        store
            .region
            .hdr32("vmm_state")
            .store(swapr::VMM_READY, Ordering::Release);
        Ok(store)
    }

    fn write_header(&self) {
        let r = &self.region;
        let l = &self.layout;
        r.hdr64("swap_pages").store(l.swap_pages, Ordering::Relaxed);
        r.hdr32("slots").store(l.slots as u32, Ordering::Relaxed);
        r.hdr64("index_off").store(l.index_off, Ordering::Relaxed);
        r.hdr64("meta_off").store(l.meta_off, Ordering::Relaxed);
        r.hdr64("stack_off").store(l.stack_off, Ordering::Relaxed);
        r.hdr64("data_off").store(l.data_off, Ordering::Relaxed);
        r.hdr64("region_size")
            .store(l.region_size, Ordering::Relaxed);
        r.hdr32("abi").store(swapr::ABI, Ordering::Relaxed);
        r.hdr32("limit").store(
            self.target.load(Ordering::Relaxed) as u32,
            Ordering::Relaxed,
        );
        r.hdr64("magic").store(swapr::MAGIC, Ordering::Release);
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Slots granted now (the cache size in pages).
    pub fn target(&self) -> u64 {
        self.target.load(Ordering::Relaxed)
    }

    /// Sets the cache size; [`SwapStore::rebalance`] and the evictor carry it out.
    pub fn set_target(&self, pages: u64) -> Result<(), SwapError> {
        if pages > self.layout.slots {
            return Err(SwapError::TooLarge {
                pages,
                slots: self.layout.slots,
            });
        }
        self.target.store(pages, Ordering::Relaxed);
        self.region
            .hdr32("limit")
            .store(pages as u32, Ordering::Relaxed);
        Ok(())
    }

    /// Tells the guest module vmsight is gone (it stops using the region).
    pub fn close(&self) {
        self.region
            .hdr32("vmm_state")
            .store(swapr::VMM_GONE, Ordering::Release);
    }

    /// Takes the region's lock, waiting at most [`LOCK_WAIT`].
    fn lock(&self) -> Option<Locked<'_>> {
        let word = self.region.u32_at(self.hdr.lock)?;
        let deadline = Instant::now() + LOCK_WAIT;
        let mut tries = 0u32;
        loop {
            if word
                .compare_exchange(
                    swapr::LOCK_FREE,
                    swapr::LOCK_VMM,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return Some(Locked { s: self, word });
            }
            tries += 1;
            if tries < 256 {
                std::hint::spin_loop();
            } else if tries < 512 {
                std::thread::yield_now();
            } else if Instant::now() > deadline {
                self.counters.lock_timeouts.fetch_add(1, Ordering::Relaxed);
                return None;
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn check_page(&self, page: u64) -> Result<(), OpError> {
        if page >= self.layout.swap_pages {
            return Err(OpError::Range(page));
        }
        Ok(())
    }

    /// Reads swap page `page` into `buf` (4 KiB): from its slot, else from the file.
    pub fn read(&self, page: u64, buf: &mut [u8]) -> Result<Place, OpError> {
        self.check_page(page)?;
        self.counters.block_reads.fetch_add(1, Ordering::Relaxed);
        {
            let l = self.lock().ok_or(OpError::Locked)?;
            if l.load(page, buf, true) {
                self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Place::Cache);
            }
        }
        self.counters.cache_misses.fetch_add(1, Ordering::Relaxed);
        read_file(&self.file, page * PAGE, buf)?;
        Ok(Place::File)
    }

    /// Writes swap page `page`: into a slot when one is free, else to the file.
    pub fn write(&self, page: u64, data: &[u8]) -> Result<Place, OpError> {
        self.check_page(page)?;
        self.counters.block_writes.fetch_add(1, Ordering::Relaxed);
        let _order = self
            .file_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        {
            let l = self.lock().ok_or(OpError::Locked)?;
            if l.store(page, data) {
                self.counters.cache_inserts.fetch_add(1, Ordering::Relaxed);
                return Ok(Place::Cache);
            }
        }
        self.counters.write_through.fetch_add(1, Ordering::Relaxed);
        self.file.write_all_at(data, page * PAGE)?;
        Ok(Place::File)
    }

    /// Forgets swap page `page` (a discard): its slot is freed; the file keeps what it had.
    pub fn discard(&self, page: u64) -> Result<(), OpError> {
        self.check_page(page)?;
        self.counters.discards.fetch_add(1, Ordering::Relaxed);
        let l = self.lock().ok_or(OpError::Locked)?;
        l.invalidate(page);
        Ok(())
    }

    /// Moves up to `want` cold mapped slots to the file (CLOCK: a slot the guest loaded since
    /// the last sweep gets a second chance). Returns how many were evicted.
    pub fn evict(&self, want: usize) -> usize {
        let _order = self
            .file_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut hand = self.hand.lock().unwrap_or_else(PoisonError::into_inner);
        let mut done = self.finish_evictions(&mut hand, Vec::new());
        if want == 0 {
            return done;
        }
        let victims = match self.lock() {
            Some(l) => l.pick_victims(&mut hand.clock, want),
            None => return done,
        };
        let mut results = Vec::with_capacity(victims.len());
        let mut buf = vec![0u8; PAGE as usize];
        for (slot, page) in victims {
            let ok = self.region.read_page(self.layout.slot_data(slot), &mut buf)
                && self.file.write_all_at(&buf, page * PAGE).is_ok();
            if !ok {
                self.counters.evict_failures.fetch_add(1, Ordering::Relaxed);
            }
            results.push((slot, page, ok));
        }
        hand.pending
            .extend(results.iter().filter(|r| !r.2).map(|r| (r.0, u64::MAX)));
        let ok: Vec<_> = results
            .into_iter()
            .filter(|r| r.2)
            .map(|r| (r.0, r.1))
            .collect();
        done += self.finish_evictions(&mut hand, ok);
        done
    }

    /// Releases evicted slots (and any left pending by a lock timeout); a failed write
    /// (`page == u64::MAX`) puts the slot back as mapped.
    fn finish_evictions(&self, hand: &mut Hand, mut batch: Vec<(u64, u64)>) -> usize {
        batch.append(&mut hand.pending);
        if batch.is_empty() {
            return 0;
        }
        let Some(l) = self.lock() else {
            hand.pending = batch;
            return 0;
        };
        let n = batch
            .iter()
            .filter(|(s, p)| l.release_evicted(*s, *p))
            .count();
        self.counters.evicted.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Grants or withdraws free slots to match the cache size, punching withdrawn ones.
    /// Returns the number of mapped slots above the size (what must be evicted next).
    pub fn rebalance(&self) -> u64 {
        let target = self.target();
        let mut hand = self.hand.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(l) = self.lock() else { return 0 };
        let (top, used) = (l.free_top(), l.used());
        let granted = top + used;
        let mut withdrawn = Vec::new();
        if granted < target {
            l.grant(&mut hand.grant, target - granted);
        } else if granted > target {
            withdrawn = l.withdraw((granted - target).min(top));
        }
        drop(l);
        for s in &withdrawn {
            if self.region.punch(self.layout.slot_data(*s)).is_ok() {
                self.counters.punched.fetch_add(1, Ordering::Relaxed);
            }
        }
        used.saturating_sub(target)
    }

    /// Gives back the memory of up to `max` free slots that still hold a stale page, a batch
    /// per lock hold; at most one pass over the slots. Returns how many were punched.
    ///
    /// Residency is read (`mincore`) outside the lock so the guest never waits on it; a slot
    /// is punched only if it is still free under the lock. Counting only resident slots makes
    /// one call give back what it was asked for, however scattered the stale pages are.
    pub fn trim(&self, max: usize) -> usize {
        let mut hand = self.hand.lock().unwrap_or_else(PoisonError::into_inner);
        let slots = self.layout.slots;
        let (mut n, mut scanned) = (0, 0u64);
        while n < max && scanned < slots {
            let start = hand.trim % slots;
            let len = TRIM_WINDOW.min(slots - start).min(slots - scanned);
            let resident = self
                .region
                .resident_pages(self.layout.slot_data(start), len as usize);
            hand.trim = (start + len) % slots;
            scanned += len;
            let mut stale = resident
                .iter()
                .enumerate()
                .filter(|(_, r)| **r)
                .map(|(i, _)| start + i as u64)
                .filter(|&s| self.looks_free(s))
                .peekable();
            while n < max && stale.peek().is_some() {
                let batch: Vec<u64> = stale.by_ref().take(TRIM_BATCH.min(max - n)).collect();
                let Some(l) = self.lock() else { break };
                n += l.punch_free(&batch);
            }
        }
        self.counters.punched.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Whether slot `s` is free, read without the lock: only a hint for picking candidates,
    /// which are checked again under it.
    fn looks_free(&self, s: u64) -> bool {
        let l = &self.layout;
        (s < l.slots)
            .then(|| self.region.u64_at(l.meta_off + s * 8))
            .flatten()
            .is_some_and(|m| decode(m.load(Ordering::Relaxed)).state == swapr::SLOT_FREE)
    }

    /// Free slots and used slots now (clamped to the layout: the guest writes them too).
    pub fn occupancy(&self) -> (u64, u64) {
        let slots = self.layout.slots;
        let top = self
            .region
            .u32_at(self.hdr.free_top)
            .map_or(0, |w| u64::from(w.load(Ordering::Relaxed)));
        let used = self
            .region
            .u32_at(self.hdr.used)
            .map_or(0, |w| u64::from(w.load(Ordering::Relaxed)));
        (top.min(slots), used.min(slots))
    }
}

fn read_file(file: &File, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => {
                // Beyond the file's end (a sparse swap file never written there): zeros.
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The region's lock, held; the operations that need it.
struct Locked<'a> {
    s: &'a SwapStore,
    word: &'a AtomicU32,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.word.store(swapr::LOCK_FREE, Ordering::Release);
    }
}

impl Locked<'_> {
    fn corrupt(&self) {
        self.s.counters.corrupt.fetch_add(1, Ordering::Relaxed);
    }

    fn index(&self, page: u64) -> Option<&AtomicU32> {
        let l = &self.s.layout;
        (page < l.swap_pages)
            .then(|| self.s.region.u32_at(l.index_off + page * 4))
            .flatten()
    }

    fn meta(&self, slot: u64) -> Option<&AtomicU64> {
        let l = &self.s.layout;
        (slot < l.slots)
            .then(|| self.s.region.u64_at(l.meta_off + slot * 8))
            .flatten()
    }

    fn stack(&self, i: u64) -> Option<&AtomicU32> {
        let l = &self.s.layout;
        (i < l.slots)
            .then(|| self.s.region.u32_at(l.stack_off + i * 4))
            .flatten()
    }

    fn hdr(&self, off: u64) -> Option<&AtomicU32> {
        self.s.region.u32_at(off)
    }

    fn free_top(&self) -> u64 {
        let top = self
            .hdr(self.s.hdr.free_top)
            .map_or(0, |w| u64::from(w.load(Ordering::Relaxed)));
        if top > self.s.layout.slots {
            self.corrupt();
            return 0;
        }
        top
    }

    fn set_free_top(&self, v: u64) {
        if let Some(w) = self.hdr(self.s.hdr.free_top) {
            w.store(v as u32, Ordering::Relaxed);
        }
    }

    fn used(&self) -> u64 {
        self.hdr(self.s.hdr.used)
            .map_or(0, |w| u64::from(w.load(Ordering::Relaxed)))
            .min(self.s.layout.slots)
    }

    fn add_used(&self, delta: i64) {
        let v = self
            .used()
            .saturating_add_signed(delta)
            .min(self.s.layout.slots);
        if let Some(w) = self.hdr(self.s.hdr.used) {
            w.store(v as u32, Ordering::Relaxed);
        }
    }

    fn get_meta(&self, slot: u64) -> Option<Meta> {
        self.meta(slot).map(|m| decode(m.load(Ordering::Relaxed)))
    }

    fn set_meta(&self, slot: u64, state: u64, page: u64) {
        if let Some(m) = self.meta(slot) {
            m.store(encode(state, page), Ordering::Relaxed);
        }
    }

    /// The slot the index gives for `page`, if any and in range.
    fn slot_of(&self, page: u64) -> Option<u64> {
        let v = u64::from(self.index(page)?.load(Ordering::Relaxed));
        if v == 0 {
            return None;
        }
        if v > self.s.layout.slots {
            self.corrupt();
            return None;
        }
        Some(v - 1)
    }

    fn set_index(&self, page: u64, slot: Option<u64>) {
        if let Some(w) = self.index(page) {
            w.store(slot.map_or(0, |s| s as u32 + 1), Ordering::Relaxed);
        }
    }

    fn pop_free(&self) -> Option<u64> {
        let top = self.free_top();
        if top == 0 {
            return None;
        }
        let slot = u64::from(self.stack(top - 1)?.load(Ordering::Relaxed));
        self.set_free_top(top - 1);
        match self.get_meta(slot) {
            Some(m) if m.state == swapr::SLOT_FREE => Some(slot),
            _ => {
                self.corrupt();
                None
            }
        }
    }

    fn push_free(&self, slot: u64) {
        let top = self.free_top();
        match self.stack(top) {
            Some(w) => {
                w.store(slot as u32, Ordering::Relaxed);
                self.set_free_top(top + 1);
                self.set_meta(slot, swapr::SLOT_FREE, 0);
            }
            None => self.corrupt(),
        }
    }

    /// The store operation (docs/swapbypass.md): true if `page` now lives in a slot.
    fn store(&self, page: u64, data: &[u8]) -> bool {
        if let Some(s) = self.slot_of(page) {
            match self.get_meta(s) {
                Some(m) if m.state == swapr::SLOT_MAPPED && m.page == page => {
                    let ok = self.s.region.write_page(self.s.layout.slot_data(s), data);
                    self.set_meta(s, swapr::SLOT_MAPPED, page);
                    return ok;
                }
                Some(m) if m.state == swapr::SLOT_EVICTING && m.page == page => {
                    self.set_meta(s, swapr::SLOT_DEAD, page);
                }
                _ => self.corrupt(),
            }
            self.set_index(page, None);
        }
        let Some(s) = self.pop_free() else {
            return false;
        };
        if !self.s.region.write_page(self.s.layout.slot_data(s), data) {
            self.push_free(s);
            return false;
        }
        self.set_meta(s, swapr::SLOT_MAPPED, page);
        self.set_index(page, Some(s));
        self.add_used(1);
        true
    }

    /// The load operation: true if `page` was in a slot (copied into `buf`). The guest marks
    /// what it loads as referenced; vmsight's own reads pass `mark = false`.
    fn load(&self, page: u64, buf: &mut [u8], mark: bool) -> bool {
        let Some(s) = self.slot_of(page) else {
            return false;
        };
        let Some(m) = self.get_meta(s) else {
            return false;
        };
        let live = m.state == swapr::SLOT_MAPPED || m.state == swapr::SLOT_EVICTING;
        if !live || m.page != page {
            self.corrupt();
            return false;
        }
        if mark {
            if let Some(w) = self.meta(s) {
                w.fetch_or(swapr::REFERENCED, Ordering::Relaxed);
            }
        }
        self.s.region.read_page(self.s.layout.slot_data(s), buf)
    }

    /// The invalidate operation.
    fn invalidate(&self, page: u64) {
        let Some(s) = self.slot_of(page) else {
            return;
        };
        self.set_index(page, None);
        match self.get_meta(s) {
            Some(m) if m.state == swapr::SLOT_MAPPED => {
                self.push_free(s);
                self.add_used(-1);
            }
            Some(m) if m.state == swapr::SLOT_EVICTING => {
                self.set_meta(s, swapr::SLOT_DEAD, m.page);
            }
            _ => self.corrupt(),
        }
    }

    /// CLOCK over the slots: marks up to `want` unreferenced mapped slots evicting.
    fn pick_victims(&self, clock: &mut u64, want: usize) -> Vec<(u64, u64)> {
        let slots = self.s.layout.slots;
        let mut out = Vec::new();
        for _ in 0..2 * slots {
            if out.len() >= want {
                break;
            }
            let s = *clock % slots;
            *clock = (s + 1) % slots;
            let Some(w) = self.meta(s) else { continue };
            let m = decode(w.load(Ordering::Relaxed));
            if m.state != swapr::SLOT_MAPPED {
                continue;
            }
            if m.page >= self.s.layout.swap_pages {
                // The guest wrote a page beyond the disk: evicting would write the swap file
                // there.
                self.corrupt();
                continue;
            }
            if m.referenced {
                w.fetch_and(!swapr::REFERENCED, Ordering::Relaxed);
                continue;
            }
            w.store(encode(swapr::SLOT_EVICTING, m.page), Ordering::Relaxed);
            out.push((s, m.page));
        }
        out
    }

    /// Ends the eviction of `slot` (written to the file unless `page == u64::MAX`). True if
    /// the slot was freed.
    fn release_evicted(&self, slot: u64, page: u64) -> bool {
        let Some(m) = self.get_meta(slot) else {
            return false;
        };
        match m.state {
            swapr::SLOT_EVICTING if page == u64::MAX => {
                // The file write failed: the slot stays the page's home.
                self.set_meta(slot, swapr::SLOT_MAPPED, m.page);
                false
            }
            swapr::SLOT_EVICTING => {
                if self.slot_of(m.page) == Some(slot) {
                    self.set_index(m.page, None);
                }
                self.push_free(slot);
                self.add_used(-1);
                true
            }
            swapr::SLOT_DEAD => {
                self.push_free(slot);
                self.add_used(-1);
                page != u64::MAX
            }
            _ => {
                self.corrupt();
                false
            }
        }
    }

    /// Puts up to `n` reserved slots in the free stack.
    fn grant(&self, cursor: &mut u64, n: u64) {
        let slots = self.s.layout.slots;
        let mut left = n;
        for _ in 0..slots {
            if left == 0 {
                break;
            }
            let s = *cursor % slots;
            *cursor = (s + 1) % slots;
            if self.get_meta(s).map(|m| m.state) == Some(swapr::SLOT_RESERVED) {
                self.push_free(s);
                left -= 1;
            }
        }
    }

    /// Takes up to `n` slots off the free stack and reserves them; returns them for punching.
    fn withdraw(&self, n: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for _ in 0..n {
            let Some(s) = self.pop_free() else { break };
            self.set_meta(s, swapr::SLOT_RESERVED, 0);
            out.push(s);
        }
        out
    }

    /// Punches the pages of those of `slots` that are free (they stay free; the next store
    /// refaults a page). Returns how many were punched.
    fn punch_free(&self, slots: &[u64]) -> usize {
        slots
            .iter()
            .filter(|&&s| {
                self.get_meta(s).map(|m| m.state) == Some(swapr::SLOT_FREE)
                    && self.s.region.punch(self.s.layout.slot_data(s)).is_ok()
            })
            .count()
    }
}

#[cfg(test)]
mod tests;
