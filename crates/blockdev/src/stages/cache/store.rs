//! The cache's storage: a fixed slab of block-sized slots, a map from disk block number to
//! slot, and one intrusive doubly-linked recency list per priority level.
//!
//! Every operation is O(1) (hash map + list splicing; the lowest non-empty level is found
//! with a bit mask) except the dirty set, a `BTreeSet` (O(log n)) kept sorted so write-back
//! can issue dirty blocks in disk order and coalesce neighbours.

use std::collections::{BTreeSet, HashMap};

/// Number of priority levels (recency lists). I/O classes 0..=31 map to their own level.
pub(crate) const LEVELS: usize = 32;

/// "No slot" in the intrusive links.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    block: u64,
    /// Towards the most recently used end.
    prev: u32,
    /// Towards the least recently used end.
    next: u32,
    /// Recency list (priority level) the slot is on.
    level: u8,
    /// I/O class of the latest access (for per-class counters).
    class: u8,
    dirty: bool,
}

/// Block data and bookkeeping of the cache.
pub(crate) struct Store {
    block_size: usize,
    data: Vec<u8>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    map: HashMap<u64, u32>,
    /// Most recently used slot of each level.
    heads: [u32; LEVELS],
    /// Least recently used slot of each level.
    tails: [u32; LEVELS],
    /// Bit `l` set when level `l` has a slot.
    nonempty: u32,
    dirty: BTreeSet<u64>,
}

impl Store {
    /// A store of `nslots` slots of `block_size` bytes. The data area is allocated zeroed,
    /// which the allocator does lazily (calloc / fresh pages), so an unused cache costs little.
    pub(crate) fn new(nslots: u32, block_size: usize) -> Self {
        let n = nslots as usize;
        Self {
            block_size,
            data: vec![0u8; n * block_size],
            slots: vec![
                Slot {
                    block: 0,
                    prev: NIL,
                    next: NIL,
                    level: 0,
                    class: 0,
                    dirty: false,
                };
                n
            ],
            free: (0..nslots).rev().collect(),
            map: HashMap::with_capacity(n),
            heads: [NIL; LEVELS],
            tails: [NIL; LEVELS],
            nonempty: 0,
            dirty: BTreeSet::new(),
        }
    }

    /// Whether a free slot exists.
    pub(crate) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// The slot holding `block`, if cached.
    pub(crate) fn lookup(&self, block: u64) -> Option<u32> {
        self.map.get(&block).copied()
    }

    fn range(&self, slot: u32) -> std::ops::Range<usize> {
        let start = slot as usize * self.block_size;
        start..start + self.block_size
    }

    /// The cached bytes of `slot` (a whole block).
    pub(crate) fn data(&self, slot: u32) -> &[u8] {
        let r = self.range(slot);
        self.data.get(r).unwrap_or(&[])
    }

    /// The cached bytes of `slot`, writable.
    pub(crate) fn data_mut(&mut self, slot: u32) -> &mut [u8] {
        let r = self.range(slot);
        self.data.get_mut(r).unwrap_or(&mut [])
    }

    /// Disk block, class and dirtiness of `slot`.
    pub(crate) fn info(&self, slot: u32) -> (u64, u8, bool) {
        self.slots
            .get(slot as usize)
            .map_or((0, 0, false), |s| (s.block, s.class, s.dirty))
    }

    /// The least recently used slot of the lowest non-empty level: the eviction victim.
    pub(crate) fn victim(&self) -> Option<(u32, u8)> {
        if self.nonempty == 0 {
            return None;
        }
        let level = self.nonempty.trailing_zeros() as usize;
        let slot = *self.tails.get(level)?;
        (slot != NIL).then_some((slot, level as u8))
    }

    fn slot_mut(&mut self, slot: u32) -> Option<&mut Slot> {
        self.slots.get_mut(slot as usize)
    }

    fn unlink(&mut self, slot: u32) {
        let Some(s) = self.slots.get(slot as usize).copied() else {
            return;
        };
        let l = s.level as usize;
        match self.slot_mut(s.prev) {
            Some(p) => p.next = s.next,
            None => {
                if let Some(h) = self.heads.get_mut(l) {
                    *h = s.next;
                }
            }
        }
        match self.slot_mut(s.next) {
            Some(n) => n.prev = s.prev,
            None => {
                if let Some(t) = self.tails.get_mut(l) {
                    *t = s.prev;
                }
            }
        }
        if self.heads.get(l) == Some(&NIL) {
            self.nonempty &= !(1u32 << l);
        }
        if let Some(me) = self.slot_mut(slot) {
            me.prev = NIL;
            me.next = NIL;
        }
    }

    fn push_front(&mut self, slot: u32, level: u8) {
        let l = (level as usize).min(LEVELS - 1);
        let old_head = self.heads.get(l).copied().unwrap_or(NIL);
        if let Some(me) = self.slot_mut(slot) {
            me.prev = NIL;
            me.next = old_head;
            me.level = l as u8;
        }
        match self.slot_mut(old_head) {
            Some(h) => h.prev = slot,
            None => {
                if let Some(t) = self.tails.get_mut(l) {
                    *t = slot;
                }
            }
        }
        if let Some(h) = self.heads.get_mut(l) {
            *h = slot;
        }
        self.nonempty |= 1u32 << l;
    }

    /// Marks `slot` most recently used on `level`, remembering `class`. Returns the previous
    /// class.
    pub(crate) fn touch(&mut self, slot: u32, level: u8, class: u8) -> u8 {
        self.unlink(slot);
        self.push_front(slot, level);
        match self.slot_mut(slot) {
            Some(s) => std::mem::replace(&mut s.class, class),
            None => class,
        }
    }

    /// Puts `block` into a free slot (most recently used on `level`). `None` when no slot is
    /// free or the block is already cached (callers check both first).
    pub(crate) fn insert(&mut self, block: u64, level: u8, class: u8, dirty: bool) -> Option<u32> {
        if self.map.contains_key(&block) {
            return None;
        }
        let slot = self.free.pop()?;
        if let Some(s) = self.slot_mut(slot) {
            s.block = block;
            s.class = class;
            s.dirty = dirty;
        }
        self.map.insert(block, slot);
        if dirty {
            self.dirty.insert(block);
        }
        self.push_front(slot, level);
        Some(slot)
    }

    /// Drops `slot` from the cache (whatever its state; callers write dirty data back first
    /// when it must survive).
    pub(crate) fn remove(&mut self, slot: u32) {
        let (block, _, _) = self.info(slot);
        if self.map.get(&block) != Some(&slot) {
            return;
        }
        self.unlink(slot);
        self.map.remove(&block);
        self.dirty.remove(&block);
        if let Some(s) = self.slot_mut(slot) {
            s.dirty = false;
        }
        self.free.push(slot);
    }

    /// Sets the dirty flag of `slot`; returns the previous one.
    pub(crate) fn set_dirty(&mut self, slot: u32, dirty: bool) -> bool {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return false;
        };
        let was = std::mem::replace(&mut s.dirty, dirty);
        let block = s.block;
        if dirty {
            self.dirty.insert(block);
        } else {
            self.dirty.remove(&block);
        }
        was
    }

    /// Dirty blocks in ascending disk order.
    pub(crate) fn dirty_blocks(&self) -> Vec<u64> {
        self.dirty.iter().copied().collect()
    }

    /// Every cached block number, in no particular order.
    pub(crate) fn cached_blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys().copied()
    }

    /// Number of cached blocks.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn victim_is_lru_of_lowest_level() {
        let mut s = Store::new(4, 16);
        let a = s.insert(10, 3, 3, false).expect("a");
        let b = s.insert(11, 1, 1, false).expect("b");
        let c = s.insert(12, 1, 1, true).expect("c");
        let _d = s.insert(13, 5, 5, false).expect("d");
        assert!(!s.has_free());
        assert_eq!(s.victim(), Some((b, 1)));
        s.touch(b, 1, 1); // b becomes MRU of level 1, c is now LRU there
        assert_eq!(s.victim(), Some((c, 1)));
        assert_eq!(s.dirty_blocks(), vec![12]);
        s.remove(c);
        s.remove(b);
        assert_eq!(s.victim(), Some((a, 3)));
        assert!(s.dirty_blocks().is_empty());
        // Moving a slot to another level updates the lists and the mask.
        s.touch(a, 7, 7);
        assert_eq!(s.victim().map(|v| v.1), Some(5));
        assert_eq!(s.len(), 2);
        assert_eq!(s.lookup(10), Some(a));
        assert_eq!(s.lookup(12), None);
    }

    #[test]
    fn slots_are_reused_and_data_is_per_slot() {
        let mut s = Store::new(2, 8);
        let a = s.insert(1, 0, 0, false).expect("a");
        s.data_mut(a).copy_from_slice(&[1; 8]);
        let b = s.insert(2, 0, 0, false).expect("b");
        s.data_mut(b).copy_from_slice(&[2; 8]);
        assert_eq!(s.insert(3, 0, 0, false), None, "full");
        assert_eq!(s.victim(), Some((a, 0)));
        s.remove(a);
        let c = s.insert(3, 0, 0, true).expect("c");
        assert_eq!(c, a, "freed slot reused");
        assert_eq!(s.data(b), &[2; 8]);
        assert!(s.set_dirty(c, false));
        assert!(s.dirty_blocks().is_empty());
    }
}
