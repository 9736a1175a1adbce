//! Matching block requests with the tags of the bios they were built from.
//!
//! A tag says "task T submitted sectors [s, e) for reading (or writing)". The guest kernel
//! splits a bio into several requests, merges bios (of one task or of several) into one
//! request, and dispatches requests later, often from another context (kblockd): the tag is
//! pushed at submission, before any of that, so when a request arrives its tags are in the
//! table. A request takes every unconsumed tag of its direction that overlaps it, oldest
//! first; the covered parts are consumed and the uncovered remainders stay for the other
//! requests of a split bio. Tags left over (a bio served from a merged request that another
//! tag already covered, or a request that never came) expire after [`TAG_TTL_NS`].

use std::collections::VecDeque;

use vmsight_ring::blocktag::{BlockOp, BlockTag};

/// Unconsumed tags older than this are dropped.
pub const TAG_TTL_NS: u64 = 30_000_000_000;
/// Most unconsumed tags kept per disk (the oldest go first).
pub const MAX_TAGS: usize = 65_536;

/// One unconsumed tag (or what is left of it).
#[derive(Debug, Clone, Copy)]
struct Entry {
    start: u64,
    end: u64,
    write: bool,
    at_ns: u64,
    tag: BlockTag,
}

/// The unconsumed tags of one disk.
#[derive(Debug, Default)]
pub struct TagTable {
    entries: VecDeque<Entry>,
    /// Tags dropped because the table was full or they expired.
    pub expired: u64,
}

impl TagTable {
    /// Adds a tag pushed at `at_ns` (host CLOCK_MONOTONIC). Tags of other operations
    /// (flush, discard) and empty ones are ignored.
    pub fn push(&mut self, tag: BlockTag, at_ns: u64) {
        let write = match tag.op() {
            BlockOp::Read => false,
            BlockOp::Write => true,
            BlockOp::Other => return,
        };
        let r = tag.sectors();
        if r.is_empty() {
            return;
        }
        if self.entries.len() >= MAX_TAGS {
            self.entries.pop_front();
            self.expired += 1;
        }
        self.entries.push_back(Entry {
            start: r.start,
            end: r.end,
            write,
            at_ns,
            tag,
        });
    }

    /// Drops tags pushed before `now_ns - TAG_TTL_NS`.
    pub fn expire(&mut self, now_ns: u64) {
        let limit = now_ns.saturating_sub(TAG_TTL_NS);
        while self.entries.front().is_some_and(|e| e.at_ns < limit) {
            self.entries.pop_front();
            self.expired += 1;
        }
    }

    /// The tags of a request for sectors `[start, end)` (`write`: its direction), oldest
    /// first; their covered parts are consumed.
    pub fn take(&mut self, start: u64, end: u64, write: bool) -> Vec<BlockTag> {
        let mut out = Vec::new();
        let mut kept = VecDeque::with_capacity(self.entries.len() + 1);
        for e in self.entries.drain(..) {
            if e.write != write || e.end <= start || e.start >= end {
                kept.push_back(e);
                continue;
            }
            out.push(e.tag);
            if e.start < start {
                kept.push_back(Entry { end: start, ..e });
            }
            if e.end > end {
                kept.push_back(Entry { start: end, ..e });
            }
        }
        self.entries = kept;
        out
    }

    /// Unconsumed tags.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No unconsumed tag.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The disk index of a virtio-blk disk name: `vda` is 0 (the root disk), `vdb` 1, ... (the
/// guest names virtio disks in PCI order, which is vmsight's disk order).
pub fn disk_index(name: &[u8; 8]) -> Option<usize> {
    match name {
        [b'v', b'd', l @ b'a'..=b'z', 0, ..] => Some(usize::from(l - b'a')),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(tgid: u32, sector: u64, sectors: u32, write: bool) -> BlockTag {
        BlockTag {
            tgid,
            sector,
            size: sectors << 9,
            opf: u32::from(write),
            ..BlockTag::default()
        }
    }

    #[test]
    fn a_request_takes_the_overlapping_tags_of_its_direction() {
        let mut t = TagTable::default();
        t.push(tag(1, 0, 8, false), 10);
        t.push(tag(2, 8, 8, false), 11);
        t.push(tag(3, 0, 8, true), 12);
        let got: Vec<u32> = t.take(0, 16, false).iter().map(|t| t.tgid).collect();
        assert_eq!(got, vec![1, 2]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.take(0, 8, true)[0].tgid, 3);
        assert!(t.take(0, 16, false).is_empty());
    }

    #[test]
    fn a_split_bio_tags_every_request_it_became() {
        let mut t = TagTable::default();
        t.push(tag(7, 100, 2048, false), 1);
        assert_eq!(t.take(100, 1124, false)[0].tgid, 7);
        assert_eq!(t.take(1124, 2148, false)[0].tgid, 7);
        assert!(t.take(100, 2148, false).is_empty());
        // A request in the middle leaves two remainders.
        t.push(tag(8, 0, 30, false), 2);
        assert_eq!(t.take(10, 20, false).len(), 1);
        assert_eq!(t.take(0, 10, false).len(), 1);
        assert_eq!(t.take(20, 30, false).len(), 1);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn old_tags_expire_and_the_table_is_bounded() {
        let mut t = TagTable::default();
        t.push(tag(1, 0, 8, false), 1);
        t.push(tag(1, 8, 8, false), TAG_TTL_NS + 10);
        t.expire(TAG_TTL_NS + 5);
        assert_eq!((t.len(), t.expired), (1, 1));
        for i in 0..MAX_TAGS as u64 + 5 {
            t.push(tag(2, i * 8, 8, false), TAG_TTL_NS + 10);
        }
        assert_eq!(t.len(), MAX_TAGS);
        assert_eq!(t.expired, 7);
        // Flushes and empty bios are not tags of any request.
        let mut f = tag(3, 0, 0, false);
        t.push(f, 0);
        f.size = 4096;
        f.opf = 2;
        t.push(f, 0);
        assert_eq!(t.len(), MAX_TAGS);
    }

    #[test]
    fn virtio_disk_names_map_to_disk_indexes() {
        assert_eq!(disk_index(b"vda\0\0\0\0\0"), Some(0));
        assert_eq!(disk_index(b"vdc\0\0\0\0\0"), Some(2));
        assert_eq!(disk_index(b"vdaa\0\0\0\0"), None);
        assert_eq!(disk_index(b"sda\0\0\0\0\0"), None);
        assert_eq!(disk_index(&[0xff; 8]), None);
    }
}
