//! The pending set: writes to blocks no known metadata owns yet (Gamma-Ray's "unknown write"
//! list). They wait, bounded by a TTL and a byte cap, until metadata claims the block.

use std::collections::{BTreeMap, VecDeque};

/// Bytes a waiting block counts against the cap besides its data (map and queue entries), so
/// blocks kept without their data (when write events carry no bytes) are bounded too.
pub(crate) const ENTRY_OVERHEAD: u64 = 64;

/// One waiting block: its content as last written (empty when the engine keeps no data:
/// then a claim that needs the content, a directory block, reads it from the disk) and the
/// written part of it.
#[derive(Debug, Clone)]
pub(crate) struct PendingBlock {
    pub data: Vec<u8>,
    /// Written byte range inside the block (union of the writes seen).
    pub start: u32,
    pub end: u32,
    pub observed_ns: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    map: BTreeMap<u64, PendingBlock>,
    /// Insertion order for TTL expiry and eviction: (block, observed_ns at insertion).
    order: VecDeque<(u64, u64)>,
    bytes: u64,
    pub expired: u64,
    pub evicted: u64,
}

impl Pending {
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Record a write of `block` (`data` is the whole block, `start..end` the written part).
    pub fn insert(
        &mut self,
        block: u64,
        data: Vec<u8>,
        start: u32,
        end: u32,
        observed_ns: u64,
        max_bytes: u64,
    ) {
        let size = data.len() as u64 + ENTRY_OVERHEAD;
        if size > max_bytes {
            self.evicted += 1;
            return;
        }
        let (start, end) = match self.map.get(&block) {
            Some(old) => (old.start.min(start), old.end.max(end)),
            None => (start, end),
        };
        if let Some(old) = self.map.insert(
            block,
            PendingBlock {
                data,
                start,
                end,
                observed_ns,
            },
        ) {
            self.bytes -= old.data.len() as u64 + ENTRY_OVERHEAD;
        }
        self.bytes += size;
        self.order.push_back((block, observed_ns));
        while self.bytes > max_bytes {
            if !self.pop_oldest() {
                break;
            }
            self.evicted += 1;
        }
        // Stale order entries (rewritten or claimed blocks) are skipped lazily; keep the queue
        // from growing without bound when one block is rewritten over and over.
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order
                .retain(|(b, ns)| map.get(b).is_some_and(|p| p.observed_ns == *ns));
        }
    }

    fn pop_oldest(&mut self) -> bool {
        while let Some((b, ns)) = self.order.pop_front() {
            if self.map.get(&b).is_some_and(|p| p.observed_ns == ns) {
                if let Some(p) = self.map.remove(&b) {
                    self.bytes -= p.data.len() as u64 + ENTRY_OVERHEAD;
                }
                return true;
            }
        }
        false
    }

    /// Remove and return the waiting blocks in `[first, first + len)`.
    pub fn take_range(&mut self, first: u64, len: u64) -> Vec<(u64, PendingBlock)> {
        let keys: Vec<u64> = self
            .map
            .range(first..first.saturating_add(len))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| {
                let p = self.map.remove(&k)?;
                self.bytes -= p.data.len() as u64 + ENTRY_OVERHEAD;
                Some((k, p))
            })
            .collect()
    }

    /// Drop blocks that waited longer than `ttl_ns`.
    pub fn expire(&mut self, now_ns: u64, ttl_ns: u64) {
        while let Some(&(b, ns)) = self.order.front() {
            if now_ns.saturating_sub(ns) < ttl_ns {
                break;
            }
            self.order.pop_front();
            if self.map.get(&b).is_some_and(|p| p.observed_ns == ns) {
                if let Some(p) = self.map.remove(&b) {
                    self.bytes -= p.data.len() as u64 + ENTRY_OVERHEAD;
                }
                self.expired += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_cap_and_claims() {
        let mut p = Pending::default();
        p.insert(10, vec![1; 100], 0, 100, 1_000, 400);
        p.insert(11, vec![2; 100], 0, 50, 2_000, 400);
        p.insert(11, vec![3; 100], 60, 100, 2_500, 400); // merges the ranges
        assert_eq!((p.len(), p.bytes()), (2, 2 * (100 + ENTRY_OVERHEAD)));
        p.insert(12, vec![4; 100], 0, 100, 3_000, 400); // evicts block 10
        assert_eq!(p.evicted, 1);
        let got = p.take_range(11, 1);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].1.start, got[0].1.end, got[0].1.data[0]),
            (0, 100, 3)
        );
        p.expire(3_000 + 999, 1_000);
        assert_eq!(p.len(), 1);
        p.expire(3_000 + 1_000, 1_000);
        assert_eq!((p.len(), p.bytes(), p.expired), (0, 0, 1));
        p.insert(1, vec![0; 400], 0, 400, 0, 400); // larger than the cap
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn blocks_without_data_are_bounded_by_their_entry_overhead() {
        let mut p = Pending::default();
        let cap = 10 * ENTRY_OVERHEAD;
        for b in 0..25 {
            p.insert(b, Vec::new(), 0, 4096, b, cap);
        }
        assert_eq!(p.len(), 10);
        assert_eq!(p.evicted, 15);
        assert_eq!(p.bytes(), cap);
    }
}
