//! The in-memory hint cache (Sky §8.1) and the stage that feeds it.
//!
//! The volume remembers, for the chunks it read recently, the chunk and its BLAKE3 hash
//! computed from its *own* buffer (never from guest memory, which the guest may change after
//! the read). The classifier decides only after a read completed whether the reading process
//! copies; the [`DedupHints`] stage sits above the classifier, so its completion hook runs
//! after the insight is attached, and promotes the read's blocks into the hint cache
//! (hash → chunk). A write looks there before the on-disk index. A write the classifier
//! marks as a copy's that misses the hint cache also looks among the recent reads by hash:
//! it catches the copy's first reads, which can reach the disk before the insight engine has
//! seen the copy's syscall and so come back without a copy hint.
//!
//! The cache is kept exact: every change of a logical block's mapping drops its recent-read
//! record, and a chunk whose last reference goes is dropped from the cache before it can be
//! reused, so a hit names a chunk that holds exactly the bytes of that hash.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use vmsight_blockdev::insight::{DedupHint, RequestInsight};
use vmsight_blockdev::{Io, RequestKind, Stage, Status};

use crate::format::{Hash, BLOCK};

/// Default bound of the recent-read records and of the hint cache (entries each; 65 536
/// chunks = 256 MiB of data, about 6 MiB of memory each).
pub const DEFAULT_HINT_ENTRIES: usize = 65_536;

/// Recent reads and the hint cache of one volume.
pub struct HintState {
    cap: usize,
    recent: HashMap<u64, (u64, Hash)>,
    /// The recent reads by hash (the last block read with that content).
    recent_by_hash: HashMap<Hash, u64>,
    recent_order: VecDeque<u64>,
    cache: HashMap<Hash, u64>,
    by_pba: HashMap<u64, Hash>,
    cache_order: VecDeque<Hash>,
}

impl HintState {
    fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            recent: HashMap::new(),
            recent_by_hash: HashMap::new(),
            recent_order: VecDeque::new(),
            cache: HashMap::new(),
            by_pba: HashMap::new(),
            cache_order: VecDeque::new(),
        }
    }

    /// The volume read logical block `lba` from chunk `pba` whose bytes hash to `hash`.
    pub fn record_read(&mut self, lba: u64, pba: u64, hash: Hash) {
        match self.recent.insert(lba, (pba, hash)) {
            Some((_, old)) => self.unindex_recent(lba, &old),
            None => {
                self.recent_order.push_back(lba);
                while self.recent_order.len() > self.cap {
                    if let Some(old) = self.recent_order.pop_front() {
                        self.forget_lba(old);
                    }
                }
            }
        }
        self.recent_by_hash.insert(hash, lba);
    }

    fn unindex_recent(&mut self, lba: u64, hash: &Hash) {
        if self.recent_by_hash.get(hash) == Some(&lba) {
            self.recent_by_hash.remove(hash);
        }
    }

    /// Logical block `lba` changed its mapping.
    pub fn forget_lba(&mut self, lba: u64) {
        if let Some((_, h)) = self.recent.remove(&lba) {
            self.unindex_recent(lba, &h);
        }
    }

    /// The chunk a recent read found holding bytes that hash to `hash` (for writes marked
    /// as a copy's).
    pub fn lookup_recent(&self, hash: &Hash) -> Option<u64> {
        let lba = self.recent_by_hash.get(hash)?;
        self.recent
            .get(lba)
            .filter(|(_, h)| h == hash)
            .map(|(pba, _)| *pba)
    }

    /// Chunk `pba` lost its last reference (it may be reused after the next commit).
    pub fn forget_pba(&mut self, pba: u64) {
        if let Some(h) = self.by_pba.remove(&pba) {
            if self.cache.get(&h) == Some(&pba) {
                self.cache.remove(&h);
            }
        }
    }

    /// A copy hint for reads of logical blocks `lbas`: their recorded chunks enter the cache.
    /// Returns how many did.
    pub fn promote(&mut self, lbas: std::ops::Range<u64>) -> u64 {
        let mut n = 0;
        for lba in lbas {
            let Some(&(pba, hash)) = self.recent.get(&lba) else {
                continue;
            };
            n += 1;
            if let Some(old) = self.cache.insert(hash, pba) {
                if old != pba {
                    self.by_pba.remove(&old);
                }
            } else {
                self.cache_order.push_back(hash);
            }
            self.by_pba.insert(pba, hash);
            while self.cache_order.len() > self.cap {
                if let Some(h) = self.cache_order.pop_front() {
                    if let Some(p) = self.cache.remove(&h) {
                        self.by_pba.remove(&p);
                    }
                }
            }
        }
        n
    }

    /// The chunk holding bytes that hash to `hash`, if a copy hint put it here.
    pub fn lookup(&self, hash: &Hash) -> Option<u64> {
        self.cache.get(hash).copied()
    }

    /// Entries in the hint cache.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }
}

/// The shared hint state and the counters of the hint stage.
#[derive(Clone)]
pub struct Hints {
    state: Arc<Mutex<HintState>>,
    /// Blocks of copy-hinted reads.
    pub copy_hinted_blocks: Arc<AtomicU64>,
    /// Of those, blocks whose chunk entered the hint cache.
    pub promoted: Arc<AtomicU64>,
}

impl Hints {
    /// A hint state bounded to `cap` entries of each kind.
    pub fn new(cap: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(HintState::new(cap))),
            copy_hinted_blocks: Arc::new(AtomicU64::new(0)),
            promoted: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Locks the state (short, in-memory work only).
    pub fn lock(&self) -> MutexGuard<'_, HintState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The stage above the classifier that turns copy-hinted reads into hint-cache entries.
pub struct DedupHints {
    hints: Hints,
}

impl DedupHints {
    /// The stage over `hints` (shared with the volume).
    pub fn stage(hints: Hints) -> Box<dyn Stage> {
        Box::new(Self { hints })
    }
}

impl Stage for DedupHints {
    fn name(&self) -> &str {
        "dedup-hints"
    }

    fn submit(&self, io: Io) {
        if io.request().kind != RequestKind::Read {
            io.forward();
            return;
        }
        let hints = self.hints.clone();
        io.forward_then(move |io, result| {
            if matches!(result, Ok(Status::Ok)) {
                let req = io.request();
                let copy = req
                    .insights
                    .as_ref()
                    .and_then(|i| i.downcast_ref::<RequestInsight>())
                    .is_some_and(|i| i.dedup_hint(false) == DedupHint::Copy);
                if copy {
                    // Only whole blocks were recorded; a partial first block is skipped.
                    let first = req.offset().div_ceil(BLOCK);
                    let end = (req.offset() + req.len) / BLOCK;
                    if end > first {
                        let n = hints.lock().promote(first..end);
                        hints
                            .copy_hinted_blocks
                            .fetch_add(end - first, Ordering::Relaxed);
                        hints.promoted.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
            io.complete(result);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promoted_reads_hit_and_a_freed_chunk_never_hits_again() {
        let mut s = HintState::new(16);
        s.record_read(10, 100, [1; 32]);
        s.record_read(11, 101, [2; 32]);
        assert_eq!(
            s.lookup(&[1; 32]),
            None,
            "a read without a copy hint is not cached"
        );
        assert_eq!(s.promote(10..13), 2);
        assert_eq!(s.lookup(&[1; 32]), Some(100));
        s.forget_pba(100);
        assert_eq!(s.lookup(&[1; 32]), None);
        assert_eq!(s.lookup(&[2; 32]), Some(101));
    }

    #[test]
    fn a_remapped_block_is_not_promoted_from_its_old_chunk() {
        let mut s = HintState::new(16);
        s.record_read(5, 50, [9; 32]);
        s.forget_lba(5);
        assert_eq!(s.promote(5..6), 0);
        assert_eq!(s.lookup(&[9; 32]), None);
    }

    #[test]
    fn recent_reads_answer_by_hash_until_their_block_changes() {
        let mut s = HintState::new(2);
        s.record_read(1, 10, [1; 32]);
        s.record_read(2, 20, [2; 32]);
        assert_eq!(s.lookup_recent(&[1; 32]), Some(10));
        assert_eq!(s.lookup(&[1; 32]), None, "not in the hint cache itself");
        s.forget_lba(1);
        assert_eq!(
            s.lookup_recent(&[1; 32]),
            None,
            "a remapped block answers no more"
        );
        s.record_read(2, 21, [3; 32]);
        assert_eq!(
            s.lookup_recent(&[2; 32]),
            None,
            "the block's old content is gone"
        );
        assert_eq!(s.lookup_recent(&[3; 32]), Some(21));
        s.record_read(3, 30, [4; 32]);
        s.record_read(4, 40, [5; 32]);
        assert_eq!(s.lookup_recent(&[3; 32]), None, "evicted with its block");
        assert!(s.recent_by_hash.len() <= 2);
    }

    #[test]
    fn both_maps_stay_bounded() {
        let mut s = HintState::new(4);
        for i in 0..100u64 {
            let mut h = [0u8; 32];
            h[..8].copy_from_slice(&i.to_le_bytes());
            s.record_read(i, i + 1000, h);
            s.promote(i..i + 1);
        }
        assert!(s.recent.len() <= 4 && s.recent_by_hash.len() <= 4);
        assert!(s.cache.len() <= 4 && s.by_pba.len() <= 4);
    }
}
