//! The flat tables an index is made of, and the lookups on them.
//!
//! An eager [`super::Index`] holds one [`Tables`] for the whole file system; a lazy one holds
//! the same tables per *section* (a range of inode numbers) and loads them on demand (see
//! `lazy.rs`). The lookups below work on either: everything in a section is keyed by the
//! inode numbers of that range (inodes, their runs and symlink targets, the entries of the
//! directories among them).
//!
//! Records (all flat, sorted vectors; no per-block entries, no hash maps):
//! - `inodes`: 40 bytes per in-use inode, sorted by inode number. Owners are an index into
//!   `owners`, the distinct (uid, gid) pairs (a handful on real systems); should an image have
//!   more than 65 535 distinct pairs, the rest are kept exactly in `owner_x`, by inode.
//! - `extents`: 16-byte runs grouped by inode in the order of `inodes`.
//! - `dirs`/`entries`: 8 bytes per directory, 12 per entry, grouped by directory and sorted
//!   by name.
//! - `arena`: names, symlink targets and inline data, each distinct byte string once (a name
//!   like `index.html` or `LC_MESSAGES` that occurs in a thousand directories is stored once).

use super::{FileKind, InodeMeta};
use hashbrown::HashTable;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Stored inode record (40 bytes). Times are kept as ext4 stores them: the low 32 bits
/// (signed seconds) plus two epoch bits each, packed in `epochs` (mtime bits 0–1, ctime 2–3,
/// atime 4–5), which is lossless for ext4's 34-bit second range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct InodeRec {
    pub ino: u32,
    /// Index of the first run in `extents`.
    pub first_extent: u32,
    /// Index of the entry used for its path (eager: in `entries`; a lazy section: in the
    /// entries of its parent's section), or `NO_LINK`.
    pub first_link: u32,
    pub mode: u16,
    pub links: u16,
    /// Index of (uid, gid) in `owners`, or [`OWNER_X`].
    pub owner: u16,
    pub epochs: u8,
    pub mtime: u32,
    pub ctime: u32,
    pub atime: u32,
    pub size: u64,
}

impl InodeRec {
    pub(crate) fn pack_time(secs: i64) -> (u32, u8) {
        let hi = secs.wrapping_sub(i64::from(secs as i32)) >> 32;
        (secs as u32, (hi & 3) as u8)
    }
    pub(crate) fn time(lo: u32, epochs: u8, shift: u8) -> i64 {
        i64::from(lo as i32) + (i64::from((epochs >> shift) & 3) << 32)
    }
}

pub(crate) const NO_LINK: u32 = u32::MAX;
/// `InodeRec::owner` when the pair is kept in `Tables::owner_x`.
pub(crate) const OWNER_X: u16 = u16::MAX;

/// Kinds of runs in `extents`.
pub(crate) const RUN_DATA: u8 = 0;
pub(crate) const RUN_EXTENT_TREE: u8 = 1;
pub(crate) const RUN_INDIRECT: u8 = 2;
pub(crate) const RUN_XATTR: u8 = 3;
pub(crate) const RUN_UNWRITTEN: u8 = 0x80;

/// One run of blocks owned by an inode (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Run {
    /// Disk block (low 48 bits) and kind (top 8 bits).
    pub phys_kind: u64,
    /// First file block (data runs only).
    pub logical: u32,
    /// Number of blocks.
    pub len: u32,
}

impl Run {
    pub fn new(phys: u64, logical: u32, len: u32, kind: u8) -> Self {
        Run {
            phys_kind: (phys & 0xFFFF_FFFF_FFFF) | (u64::from(kind) << 56),
            logical,
            len,
        }
    }
    pub fn phys(&self) -> u64 {
        self.phys_kind & 0xFFFF_FFFF_FFFF
    }
    pub fn kind(&self) -> u8 {
        (self.phys_kind >> 56) as u8
    }
}

/// Fixed metadata kinds in `meta`.
pub(crate) const META_SUPERBLOCK: u8 = 0;
pub(crate) const META_GDT: u8 = 1;
pub(crate) const META_RESERVED_GDT: u8 = 2;
pub(crate) const META_BLOCK_BITMAP: u8 = 3;
pub(crate) const META_INODE_BITMAP: u8 = 4;
pub(crate) const META_INODE_TABLE: u8 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MetaRange {
    pub start: u64,
    pub len: u32,
    pub group: u32,
    pub kind: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DirRec {
    pub ino: u32,
    pub first_entry: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EntryRec {
    pub ino: u32,
    pub name_off: u32,
    pub name_len: u8,
    pub file_type: u8,
    /// Block of the directory holding the entry ([`NO_BLOCK`]: inline or past 65534); fits
    /// in what was padding.
    pub block: u16,
}

/// `EntryRec::block` when the block is not recorded.
pub(crate) const NO_BLOCK: u16 = u16::MAX;

/// Symlink targets and inline data kept in the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Blob {
    pub ino: u32,
    pub off: u32,
    pub len: u32,
    pub kind: u8,
}

pub(crate) const BLOB_SYMLINK: u8 = 0;
pub(crate) const BLOB_INLINE: u8 = 1;

/// The owner of an inode whose (uid, gid) pair is not in `owners`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OwnerX {
    pub ino: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The tables of an index, or of one section of a lazy index.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Tables {
    pub inodes: Vec<InodeRec>,
    pub extents: Vec<Run>,
    pub dirs: Vec<DirRec>,
    pub entries: Vec<EntryRec>,
    pub blobs: Vec<Blob>,
    pub arena: Vec<u8>,
    /// Distinct (uid, gid) pairs; `InodeRec::owner` indexes it.
    pub owners: Vec<(u32, u32)>,
    /// Owners of inodes with `InodeRec::owner == OWNER_X`, sorted by inode.
    pub owner_x: Vec<OwnerX>,
    /// Lazy sections only: the directory holding each inode's first link (parallel to
    /// `inodes`). Empty in an eager index, where the directory follows from `first_link`.
    pub parents: Vec<u32>,
}

fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl Tables {
    /// Position and record of `ino`.
    pub fn rec(&self, ino: u32) -> Option<(usize, &InodeRec)> {
        let i = self.inodes.binary_search_by_key(&ino, |r| r.ino).ok()?;
        self.inodes.get(i).map(|r| (i, r))
    }

    /// (uid, gid) of a record.
    pub fn owner_of(&self, r: &InodeRec) -> (u32, u32) {
        if r.owner == OWNER_X {
            let i = self.owner_x.binary_search_by_key(&r.ino, |o| o.ino);
            return i
                .ok()
                .and_then(|i| self.owner_x.get(i))
                .map_or((0, 0), |o| (o.uid, o.gid));
        }
        self.owners
            .get(usize::from(r.owner))
            .copied()
            .unwrap_or((0, 0))
    }

    /// The public metadata of a record.
    pub fn meta(&self, r: &InodeRec) -> InodeMeta {
        let (uid, gid) = self.owner_of(r);
        InodeMeta {
            mode: r.mode,
            uid,
            gid,
            size: r.size,
            mtime: InodeRec::time(r.mtime, r.epochs, 0),
            ctime: InodeRec::time(r.ctime, r.epochs, 2),
            atime: InodeRec::time(r.atime, r.epochs, 4),
            links: r.links,
        }
    }

    /// Runs of the inode at position `i` of `inodes`.
    pub fn runs_at(&self, i: usize) -> &[Run] {
        let Some(r) = self.inodes.get(i) else {
            return &[];
        };
        let end = self
            .inodes
            .get(i + 1)
            .map_or(self.extents.len(), |n| n.first_extent as usize);
        self.extents
            .get(r.first_extent as usize..end)
            .unwrap_or(&[])
    }

    /// Runs of `ino`.
    pub fn runs_of(&self, ino: u32) -> &[Run] {
        self.rec(ino).map_or(&[], |(i, _)| self.runs_at(i))
    }

    /// Position of directory `ino` in `dirs` and the range of its entries.
    pub fn dir_span(&self, ino: u32) -> Option<(usize, std::ops::Range<usize>)> {
        let i = self.dirs.binary_search_by_key(&ino, |d| d.ino).ok()?;
        let start = self.dirs.get(i)?.first_entry as usize;
        let end = self
            .dirs
            .get(i + 1)
            .map_or(self.entries.len(), |d| d.first_entry as usize);
        (start <= end && end <= self.entries.len()).then_some((i, start..end))
    }

    /// Entries of directory `ino`.
    pub fn dir_range(&self, ino: u32) -> Option<&[EntryRec]> {
        let (_, r) = self.dir_span(ino)?;
        self.entries.get(r)
    }

    /// The directory whose entries include entry number `e` (eager first links).
    pub fn dir_of_entry(&self, e: u32) -> Option<u32> {
        let d = self.dirs.partition_point(|d| d.first_entry <= e);
        Some(self.dirs.get(d.checked_sub(1)?)?.ino)
    }

    /// Name bytes of an entry.
    pub fn name(&self, e: &EntryRec) -> &[u8] {
        let s = e.name_off as usize;
        self.arena
            .get(s..s + usize::from(e.name_len))
            .unwrap_or(&[])
    }

    /// Symlink target or inline data of `ino`.
    pub fn blob(&self, ino: u32, kind: u8) -> Option<&[u8]> {
        let i = self
            .blobs
            .partition_point(|b| (b.ino, b.kind) < (ino, kind));
        let b = self
            .blobs
            .get(i)
            .filter(|b| b.ino == ino && b.kind == kind)?;
        let s = b.off as usize;
        self.arena.get(s..s.checked_add(b.len as usize)?)
    }

    /// Heap bytes of the tables.
    pub fn heap_bytes(&self) -> usize {
        vec_bytes(&self.inodes)
            + vec_bytes(&self.extents)
            + vec_bytes(&self.dirs)
            + vec_bytes(&self.entries)
            + vec_bytes(&self.blobs)
            + vec_bytes(&self.arena)
            + vec_bytes(&self.owners)
            + vec_bytes(&self.owner_x)
            + vec_bytes(&self.parents)
    }

    /// Give back spare capacity.
    pub fn shrink(&mut self) {
        self.inodes.shrink_to_fit();
        self.extents.shrink_to_fit();
        self.dirs.shrink_to_fit();
        self.entries.shrink_to_fit();
        self.blobs.shrink_to_fit();
        self.arena.shrink_to_fit();
        self.owners.shrink_to_fit();
        self.owner_x.shrink_to_fit();
        self.parents.shrink_to_fit();
    }

    /// Count of inodes of kind `k`.
    pub fn count(&self, k: FileKind) -> usize {
        self.inodes
            .iter()
            .filter(|r| FileKind::from_mode(r.mode) == k)
            .count()
    }

    /// The invariants the lookups rely on (stored tables are untrusted). Out-of-range
    /// offsets of single records are harmless (lookups use checked access); order is not.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.inodes.windows(2).all(|w| w[0].ino < w[1].ino) {
            return Err("inodes are not sorted");
        }
        if !self
            .inodes
            .windows(2)
            .all(|w| w[0].first_extent <= w[1].first_extent)
            || self
                .inodes
                .last()
                .is_some_and(|r| r.first_extent as usize > self.extents.len())
        {
            return Err("inode run indices are inconsistent");
        }
        if !self
            .dirs
            .windows(2)
            .all(|w| w[0].ino < w[1].ino && w[0].first_entry <= w[1].first_entry)
            || self
                .dirs
                .last()
                .is_some_and(|d| d.first_entry as usize > self.entries.len())
        {
            return Err("directory table is inconsistent");
        }
        if self
            .entries
            .iter()
            .any(|e| e.name_off as usize + usize::from(e.name_len) > self.arena.len())
        {
            return Err("a name points outside the name arena");
        }
        if !self
            .blobs
            .windows(2)
            .all(|w| (w[0].ino, w[0].kind) < (w[1].ino, w[1].kind))
        {
            return Err("blobs are not sorted");
        }
        if !self.owner_x.windows(2).all(|w| w[0].ino < w[1].ino) {
            return Err("owner overflow table is not sorted");
        }
        if !self.parents.is_empty() && self.parents.len() != self.inodes.len() {
            return Err("parent table does not match the inodes");
        }
        Ok(())
    }
}

/// Builds an arena in which every distinct byte string is stored once. The table holds each
/// string's place in the arena only, 8 bytes a slot (a map from hash to offset took 16, the
/// largest single part of a crawl's peak at 500 000 names); hashes are recomputed from the
/// arena when the table grows. It lives only while the tables are built.
#[derive(Default)]
pub(crate) struct Interner {
    seen: HashTable<(u32, u32)>,
}

fn fnv(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &x in b {
        h ^= u64::from(x);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h ^ (b.len() as u64).rotate_left(48)
}

/// The arena's bytes at (offset, length); empty if out of range (never for entries the
/// interner made).
fn stored(arena: &[u8], (off, len): (u32, u32)) -> &[u8] {
    arena
        .get(off as usize..off as usize + len as usize)
        .unwrap_or(&[])
}

impl Interner {
    /// Offset of `bytes` in `arena`, appending them unless an equal string is there already.
    /// `None` past 4 GiB.
    pub fn intern(&mut self, arena: &mut Vec<u8>, bytes: &[u8]) -> Option<u32> {
        let h = fnv(bytes);
        if let Some(&(off, _)) = self.seen.find(h, |&e| stored(arena, e) == bytes) {
            return Some(off);
        }
        let off = u32::try_from(arena.len()).ok()?;
        let len = u32::try_from(bytes.len()).ok()?;
        u32::try_from(arena.len() + bytes.len()).ok()?;
        arena.extend_from_slice(bytes);
        let arena = &*arena;
        self.seen
            .insert_unique(h, (off, len), |&e| fnv(stored(arena, e)));
        Some(off)
    }
}

/// Builds `owners` (and `owner_x` past 65 535 distinct pairs).
#[derive(Default)]
pub(crate) struct OwnerTable {
    pub pairs: Vec<(u32, u32)>,
    pub overflow: Vec<OwnerX>,
    map: HashMap<(u32, u32), u16>,
}

impl OwnerTable {
    /// The `InodeRec::owner` value for inode `ino` owned by (uid, gid). Inodes must come in
    /// ascending order (so `overflow` stays sorted).
    pub fn id(&mut self, ino: u32, uid: u32, gid: u32) -> u16 {
        if let Some(&i) = self.map.get(&(uid, gid)) {
            return i;
        }
        match u16::try_from(self.pairs.len()) {
            Ok(i) if i < OWNER_X => {
                self.pairs.push((uid, gid));
                self.map.insert((uid, gid), i);
                i
            }
            _ => {
                self.overflow.push(OwnerX { ino, uid, gid });
                OWNER_X
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes_are_compact() {
        assert_eq!(std::mem::size_of::<InodeRec>(), 40);
        for t in [
            0i64,
            -1,
            1 << 31,
            (1 << 31) - 1,
            -(1 << 31),
            3 << 32,
            (3 << 32) + (1 << 31) - 1,
            1_700_000_000,
        ] {
            let (lo, ep) = InodeRec::pack_time(t);
            assert_eq!(InodeRec::time(lo, ep, 0), t, "{t}");
            assert_eq!(InodeRec::time(lo, ep << 4, 4), t, "{t}");
        }
        assert_eq!(std::mem::size_of::<Run>(), 16);
        assert_eq!(std::mem::size_of::<EntryRec>(), 12);
    }

    #[test]
    fn run_packing() {
        let r = Run::new(0xABCD_1234_5678, 7, 9, RUN_INDIRECT);
        assert_eq!(r.phys(), 0xABCD_1234_5678);
        assert_eq!(r.kind(), RUN_INDIRECT);
    }

    #[test]
    fn equal_strings_are_stored_once() {
        let mut arena = Vec::new();
        let mut i = Interner::default();
        let a = i.intern(&mut arena, b"README").expect("fits");
        let b = i.intern(&mut arena, b"index.html").expect("fits");
        assert_eq!(i.intern(&mut arena, b"README"), Some(a));
        assert_eq!(i.intern(&mut arena, b"index.html"), Some(b));
        assert_eq!(arena, b"READMEindex.html");
        // A string whose hash is taken by another (forced by an entry filed under "other"'s
        // hash that points at "README") is still stored, not aliased to the other.
        i.seen
            .insert_unique(fnv(b"other"), (a, 6), |&e| fnv(stored(&arena, e)));
        let c = i.intern(&mut arena, b"other").expect("fits");
        assert_eq!(&arena[c as usize..], b"other");
        assert_eq!(i.intern(&mut arena, b"other"), Some(c));
        // Many strings: the table grows (rehashing from the arena) and still finds them all.
        let offs: Vec<u32> = (0..10_000)
            .map(|n| {
                i.intern(&mut arena, format!("f{n}").as_bytes())
                    .expect("fits")
            })
            .collect();
        for (n, off) in offs.iter().enumerate() {
            assert_eq!(i.intern(&mut arena, format!("f{n}").as_bytes()), Some(*off));
        }
    }

    #[test]
    fn owners_overflow_into_an_exact_side_table() {
        let mut o = OwnerTable::default();
        let ids: Vec<u16> = (0..70_000u32).map(|k| o.id(k + 1, k, k + 1)).collect();
        assert_eq!(o.pairs.len(), usize::from(OWNER_X));
        assert_eq!(o.id(1, 0, 1), 0, "a known pair keeps its id");
        let t = Tables {
            owners: o.pairs.clone(),
            owner_x: o.overflow.clone(),
            ..Tables::default()
        };
        for (k, &owner) in ids.iter().enumerate() {
            let k = k as u32;
            let r = InodeRec {
                ino: k + 1,
                first_extent: 0,
                first_link: NO_LINK,
                mode: 0,
                links: 1,
                owner,
                epochs: 0,
                mtime: 0,
                ctime: 0,
                atime: 0,
                size: 0,
            };
            assert_eq!(t.owner_of(&r), (k, k + 1), "{k}");
        }
    }
}
