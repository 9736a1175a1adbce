//! The file-system-independent index: inode table, path tree, per-file block maps and the
//! block → owner map.
//!
//! Two stores answer the same queries:
//! - **eager** (what [`Index::crawl`] builds): one set of flat tables for the whole file
//!   system (`tables.rs` describes the records: 40 bytes per inode, 16 per run, 12 per
//!   directory entry, names stored once), plus `phys_order`, indices into the runs sorted by
//!   disk block (the block → owner map, 4 bytes per run), and the fixed-metadata ranges;
//! - **lazy** ([`Index::into_lazy`], `lazy.rs`): only the block → owner map and the
//!   fixed-metadata ranges stay in memory; the tables are split by inode range into sections
//!   of a private file and loaded into a bounded cache when a query first needs them
//!   (Gamma-Ray's lazy loading of file-system metadata, §VI-B).
//!
//! Everything is keyed by inode number or block number: block numbers are answered by the
//! resident map, inode numbers (an inode's metadata and runs, a directory's entries, the parent
//! link of a path) by the one section holding that inode's range. A lazy index answers every
//! query exactly as the eager index it was made from (property-tested); answers that borrowed
//! from the tables (names, symlink targets, inline data) are [`Cow`]s, borrowed from an eager
//! index and copied out of a lazy one's section.

mod lazy;
mod tables;

pub use lazy::{LazyConfig, LazyStats};
pub(crate) use tables::*;

use crate::block::BlockSource;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// Kind of a file, from its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// Regular file.
    Regular,
    /// Directory.
    Directory,
    /// Symbolic link.
    Symlink,
    /// Character device.
    CharDevice,
    /// Block device.
    BlockDevice,
    /// Named pipe.
    Fifo,
    /// Unix socket.
    Socket,
    /// Unrecognised mode.
    Unknown,
}

impl FileKind {
    /// Kind from an `st_mode` value.
    pub fn from_mode(mode: u16) -> Self {
        match mode & 0xF000 {
            0x8000 => FileKind::Regular,
            0x4000 => FileKind::Directory,
            0xA000 => FileKind::Symlink,
            0x2000 => FileKind::CharDevice,
            0x6000 => FileKind::BlockDevice,
            0x1000 => FileKind::Fifo,
            0xC000 => FileKind::Socket,
            _ => FileKind::Unknown,
        }
    }
}

/// Metadata of one inode (times in seconds since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeMeta {
    /// `st_mode` (type and permission bits).
    pub mode: u16,
    /// Owner user id (including the high 16 bits).
    pub uid: u32,
    /// Owner group id (including the high 16 bits).
    pub gid: u32,
    /// Size in bytes (including the high 32 bits).
    pub size: u64,
    /// Last modification.
    pub mtime: i64,
    /// Last status change.
    pub ctime: i64,
    /// Last access.
    pub atime: i64,
    /// Hard link count.
    pub links: u16,
}

impl InodeMeta {
    /// File kind from the mode.
    pub fn kind(&self) -> FileKind {
        FileKind::from_mode(self.mode)
    }
}

/// What one disk block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Owner {
    /// The primary superblock or a backup copy in `group`.
    Superblock {
        /// Block group.
        group: u32,
    },
    /// Group descriptor table (primary or backup) stored in `group`.
    GroupDescriptors {
        /// Block group holding this copy.
        group: u32,
    },
    /// Blocks reserved for growing the group descriptor table (online resize).
    ReservedGdt {
        /// Block group holding them.
        group: u32,
    },
    /// Block bitmap of `group`.
    BlockBitmap {
        /// Block group described.
        group: u32,
    },
    /// Inode bitmap of `group`.
    InodeBitmap {
        /// Block group described.
        group: u32,
    },
    /// A block of the inode table of `group`; `first_ino` is the first inode stored in this block.
    InodeTable {
        /// Block group.
        group: u32,
        /// First inode number in this block.
        first_ino: u32,
    },
    /// Block `file_block` of directory `ino`.
    Directory {
        /// Directory inode.
        ino: u32,
        /// Block index within the directory.
        file_block: u64,
    },
    /// An extent-tree node of `ino`.
    ExtentTree {
        /// Inode.
        ino: u32,
    },
    /// An indirect, double- or triple-indirect block of `ino`.
    IndirectBlock {
        /// Inode.
        ino: u32,
    },
    /// An extended-attribute block (possibly shared; `ino` is one user).
    XattrBlock {
        /// Inode.
        ino: u32,
    },
    /// File data of `ino` at byte `file_offset`.
    Data {
        /// Inode.
        ino: u32,
        /// Byte offset in the file of the start of this block.
        file_offset: u64,
    },
    /// Block `file_block` of the internal journal.
    Journal {
        /// Block index within the journal.
        file_block: u64,
    },
    /// Free or not known to be owned.
    Unknown,
}

/// One run of a file's data: `len` blocks at file block `file_block` are at disk block
/// `disk_block` (blocks relative to the file system start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileExtent {
    /// First block within the file.
    pub file_block: u64,
    /// First block on disk (file-system relative).
    pub disk_block: u64,
    /// Number of blocks.
    pub len: u32,
    /// Allocated but unwritten (reads as zeros).
    pub unwritten: bool,
}

/// One entry of [`Index::read_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry<'a> {
    /// Name bytes (no NUL, no slash); borrowed from an eager index, copied from a lazy one.
    pub name: Cow<'a, [u8]>,
    /// Target inode.
    pub ino: u32,
    /// Kind from the target inode (falls back to the entry's type byte).
    pub kind: FileKind,
}

/// Facts about the crawled file system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsInfo {
    /// Byte offset of the file system on the device (partition start).
    pub partition_start: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Total blocks.
    pub blocks_count: u64,
    /// Total inodes.
    pub inodes_count: u32,
    /// Inodes per group.
    pub inodes_per_group: u32,
    /// Blocks per group.
    pub blocks_per_group: u32,
    /// Block groups.
    pub group_count: u32,
    /// First data block (1 for 1 KiB blocks, else 0).
    pub first_data_block: u32,
    /// On-disk inode size.
    pub inode_size: u16,
    /// Feature flags: compat, incompat, ro_compat.
    pub features: [u32; 3],
    /// File system UUID.
    pub uuid: [u8; 16],
    /// Volume label.
    pub volume_name: String,
    /// Where it was last mounted (helps rebuild absolute paths, as in Gamma-Ray).
    pub last_mounted: String,
    /// Journal inode (0 if none).
    pub journal_ino: u32,
    /// Inode-table start block of every group (for [`Index::inode_location`]).
    pub inode_tables: Vec<u64>,
}

/// A problem confined to one inode (or the tree) found during a lenient crawl.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warning {
    /// Inode concerned, if any.
    pub ino: Option<u32>,
    /// Description.
    pub message: String,
}

/// Counts and memory use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStats {
    /// In-use inodes indexed.
    pub inodes: usize,
    /// Directories.
    pub directories: usize,
    /// Regular files.
    pub regular_files: usize,
    /// Symbolic links.
    pub symlinks: usize,
    /// Directory entries.
    pub entries: usize,
    /// Block runs (data + metadata).
    pub runs: usize,
    /// Fixed-metadata ranges.
    pub meta_ranges: usize,
    /// Heap bytes used by the index (a lazy index: what is resident now).
    pub heap_bytes: usize,
}

impl IndexStats {
    /// Heap bytes per in-use inode.
    pub fn bytes_per_inode(&self) -> f64 {
        if self.inodes == 0 {
            0.0
        } else {
            self.heap_bytes as f64 / self.inodes as f64
        }
    }
}

/// The crawled index of one file system. Built by [`Index::crawl`]; see the module docs for
/// its eager and lazy forms.
pub struct Index {
    pub(crate) fs: FsInfo,
    pub(crate) meta: Vec<MetaRange>,
    pub(crate) warnings: Vec<Warning>,
    pub(crate) store: Store,
}

/// Where the tables are.
#[derive(Debug, Clone)]
pub(crate) enum Store {
    Eager(Eager),
    Lazy(lazy::Lazy),
}

/// All tables in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Eager {
    pub t: Tables,
    /// Indices into `t.extents` sorted by disk block.
    pub phys_order: Vec<u32>,
}

/// The tables a query reads: the eager index's, or one loaded section.
enum Sec<'a> {
    Whole(&'a Tables),
    Part(Arc<Tables>),
}

impl std::ops::Deref for Sec<'_> {
    type Target = Tables;
    fn deref(&self) -> &Tables {
        match self {
            Sec::Whole(t) => t,
            Sec::Part(t) => t,
        }
    }
}

impl<'a> Sec<'a> {
    /// Bytes found by `f`: borrowed from the eager tables, copied out of a section.
    fn bytes<F>(self, f: F) -> Option<Cow<'a, [u8]>>
    where
        F: for<'t> FnOnce(&'t Tables) -> Option<&'t [u8]>,
    {
        match self {
            Sec::Whole(t) => f(t).map(Cow::Borrowed),
            Sec::Part(t) => f(&t).map(|b| Cow::Owned(b.to_vec())),
        }
    }
}

/// The stored form of an eager index (after the magic).
#[derive(Serialize)]
struct StoredRef<'a> {
    fs: &'a FsInfo,
    meta: &'a [MetaRange],
    warnings: &'a [Warning],
    eager: &'a Eager,
}

#[derive(Deserialize)]
struct Stored {
    fs: FsInfo,
    meta: Vec<MetaRange>,
    warnings: Vec<Warning>,
    eager: Eager,
}

const MAGIC: &[u8; 8] = b"VMSFSIX3";
/// Deepest path [`Index::path_of`] follows.
const MAX_PATH_DEPTH: usize = 4096;

fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("fs", &self.fs)
            .field("meta", &self.meta.len())
            .field("warnings", &self.warnings.len())
            .field("store", &self.store)
            .finish()
    }
}

impl Clone for Index {
    /// A lazy index's clone shares its file and resident part and starts with an empty cache.
    fn clone(&self) -> Self {
        Index {
            fs: self.fs.clone(),
            meta: self.meta.clone(),
            warnings: self.warnings.clone(),
            store: self.store.clone(),
        }
    }
}

impl PartialEq for Index {
    /// Eager indexes are equal when their tables are; lazy ones when they read the same opened
    /// file (compare answers to compare a lazy index with an eager one).
    fn eq(&self, other: &Self) -> bool {
        let store = match (&self.store, &other.store) {
            (Store::Eager(a), Store::Eager(b)) => a == b,
            (Store::Lazy(a), Store::Lazy(b)) => a.same_file(b),
            _ => false,
        };
        store && self.fs == other.fs && self.meta == other.meta && self.warnings == other.warnings
    }
}

impl Eq for Index {}

impl Index {
    /// An eager index of crawled tables.
    pub(crate) fn eager(
        fs: FsInfo,
        meta: Vec<MetaRange>,
        warnings: Vec<Warning>,
        t: Tables,
        phys_order: Vec<u32>,
    ) -> Index {
        Index {
            fs,
            meta,
            warnings,
            store: Store::Eager(Eager { t, phys_order }),
        }
    }

    /// File-system facts.
    pub fn fs_info(&self) -> &FsInfo {
        &self.fs
    }

    /// Problems found during a lenient crawl.
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
    }

    /// Whether the tables are loaded on demand ([`Index::into_lazy`]).
    pub fn is_lazy(&self) -> bool {
        matches!(self.store, Store::Lazy(_))
    }

    /// Move the tables into a section file at `path` (created `0600`; an existing file is an
    /// error) and keep only the block → owner map in memory; the rest is loaded on demand.
    /// Every query answers as before. An index that is lazy already is returned as it is.
    pub fn into_lazy(self, path: impl AsRef<Path>, cfg: &LazyConfig) -> Result<Index> {
        let path = path.as_ref();
        if self.is_lazy() {
            return Ok(self);
        }
        self.write_lazy(path, cfg)?;
        drop(self);
        Self::open_lazy(path, cfg)
    }

    /// Write the section file of [`Index::into_lazy`] without giving up this index (to keep
    /// it when writing fails); [`Index::open_lazy`] opens the file.
    pub fn write_lazy(&self, path: impl AsRef<Path>, cfg: &LazyConfig) -> Result<()> {
        let path = path.as_ref();
        let Store::Eager(e) = &self.store else {
            return Err(Error::LazyIndex {
                path: path.to_path_buf(),
                reason: "the index is lazy already".into(),
            });
        };
        lazy::write(&self.fs, &self.meta, &self.warnings, e, path, cfg)
    }

    /// Open a section file written by [`Index::into_lazy`] (untrusted: lengths, checksums and
    /// invariants are checked; a damaged file is an [`Error::LazyIndex`] naming it).
    pub fn open_lazy(path: impl AsRef<Path>, cfg: &LazyConfig) -> Result<Index> {
        let o = lazy::open(path.as_ref(), cfg)?;
        Ok(Index {
            fs: o.fs,
            meta: o.meta,
            warnings: o.warnings,
            store: Store::Lazy(o.lazy),
        })
    }

    /// Counters of a lazy index (`None` for an eager one).
    pub fn lazy_stats(&self) -> Option<LazyStats> {
        match &self.store {
            Store::Eager(_) => None,
            Store::Lazy(l) => Some(l.stats()),
        }
    }

    /// Heap bytes held now (cheap: no walk over the tables).
    pub fn resident_bytes(&self) -> u64 {
        match &self.store {
            Store::Eager(e) => {
                (fixed_bytes(&self.fs, &self.meta, &self.warnings)
                    + e.t.heap_bytes()
                    + vec_bytes(&e.phys_order)) as u64
            }
            Store::Lazy(l) => l.resident_bytes(),
        }
    }

    /// The tables holding inode `ino` (and, for a directory, its entries).
    fn sec(&self, ino: u32) -> Option<Sec<'_>> {
        match &self.store {
            Store::Eager(e) => Some(Sec::Whole(&e.t)),
            Store::Lazy(l) => l.section(ino).map(Sec::Part),
        }
    }

    /// Number of in-use inodes (cheap).
    pub fn inode_count(&self) -> usize {
        match &self.store {
            Store::Eager(e) => e.t.inodes.len(),
            Store::Lazy(l) => usize::try_from(l.counts().inodes).unwrap_or(usize::MAX),
        }
    }

    /// Metadata of `ino`, if it is in use.
    pub fn inode(&self, ino: u32) -> Option<InodeMeta> {
        let t = self.sec(ino)?;
        let (_, r) = t.rec(ino)?;
        Some(t.meta(r))
    }

    /// All indexed inode numbers, ascending (a lazy index loads every section in turn).
    pub fn inodes(&self) -> impl Iterator<Item = u32> + '_ {
        match &self.store {
            Store::Eager(e) => InodeIter::Eager(e.t.inodes.iter()),
            Store::Lazy(l) => InodeIter::Lazy {
                lazy: l,
                next: 0,
                cur: Vec::new().into_iter(),
            },
        }
    }

    /// Runs of `ino` (data, directory, extent-tree, indirect and xattr blocks).
    pub(crate) fn runs(&self, ino: u32) -> Cow<'_, [Run]> {
        match self.sec(ino) {
            Some(Sec::Whole(t)) => Cow::Borrowed(t.runs_of(ino)),
            Some(Sec::Part(t)) => Cow::Owned(t.runs_of(ino).to_vec()),
            None => Cow::Borrowed(&[]),
        }
    }

    /// Data runs of `ino` in file order (holes are gaps; inline files have none).
    pub fn file_extents(&self, ino: u32) -> Vec<FileExtent> {
        let mut v: Vec<FileExtent> = self
            .runs(ino)
            .iter()
            .filter(|r| r.kind() & !RUN_UNWRITTEN == RUN_DATA)
            .map(|r| FileExtent {
                file_block: u64::from(r.logical),
                disk_block: r.phys(),
                len: r.len,
                unwritten: r.kind() & RUN_UNWRITTEN != 0,
            })
            .collect();
        v.sort_by_key(|e| e.file_block);
        v
    }

    /// Metadata blocks owned by `ino` (extent-tree, indirect and xattr blocks) as
    /// `(first block, count)`.
    pub fn metadata_blocks(&self, ino: u32) -> Vec<(u64, u32)> {
        self.runs(ino)
            .iter()
            .filter(|r| r.kind() & !RUN_UNWRITTEN != RUN_DATA)
            .map(|r| (r.phys(), r.len))
            .collect()
    }

    /// Who owns file-system block `block` (never reads a lazy index's file).
    pub fn owner(&self, block: u64) -> Owner {
        if let Some(o) = self.fixed_owner(block) {
            return o;
        }
        match &self.store {
            Store::Eager(e) => self.eager_owner(e, block),
            Store::Lazy(l) => match l.run_at(block) {
                Some((r, delta)) => {
                    self.run_owner(r.ino, r.kind, u64::from(r.logical) + delta, r.is_dir())
                }
                None => Owner::Unknown,
            },
        }
    }

    /// Fixed metadata (superblocks, descriptors, bitmaps, inode tables) holding `block`.
    fn fixed_owner(&self, block: u64) -> Option<Owner> {
        let i = self.meta.partition_point(|m| m.start <= block);
        let m = self.meta.get(i.checked_sub(1)?)?;
        if block - m.start >= u64::from(m.len) {
            return None;
        }
        let group = m.group;
        Some(match m.kind {
            META_SUPERBLOCK => Owner::Superblock { group },
            META_GDT => Owner::GroupDescriptors { group },
            META_RESERVED_GDT => Owner::ReservedGdt { group },
            META_BLOCK_BITMAP => Owner::BlockBitmap { group },
            META_INODE_BITMAP => Owner::InodeBitmap { group },
            _ => {
                let per_block =
                    u64::from(self.fs.block_size) / u64::from(self.fs.inode_size.max(1));
                let first = u64::from(group) * u64::from(self.fs.inodes_per_group)
                    + 1
                    + (block - m.start) * per_block;
                Owner::InodeTable {
                    group,
                    first_ino: u32::try_from(first).unwrap_or(u32::MAX),
                }
            }
        })
    }

    fn eager_owner(&self, e: &Eager, block: u64) -> Owner {
        let extents = &e.t.extents;
        let i = e
            .phys_order
            .partition_point(|&x| extents.get(x as usize).is_some_and(|r| r.phys() <= block));
        let Some(&x) = i.checked_sub(1).and_then(|i| e.phys_order.get(i)) else {
            return Owner::Unknown;
        };
        let Some(run) = extents.get(x as usize) else {
            return Owner::Unknown;
        };
        let delta = block - run.phys();
        if delta >= u64::from(run.len) {
            return Owner::Unknown;
        }
        let k = e.t.inodes.partition_point(|r| r.first_extent <= x);
        let Some(rec) = k.checked_sub(1).and_then(|k| e.t.inodes.get(k)) else {
            return Owner::Unknown;
        };
        let dir = FileKind::from_mode(rec.mode) == FileKind::Directory;
        self.run_owner(rec.ino, run.kind(), u64::from(run.logical) + delta, dir)
    }

    /// The owner of file block `file_block` of a run of kind `kind` owned by `ino`.
    fn run_owner(&self, ino: u32, kind: u8, file_block: u64, dir: bool) -> Owner {
        match kind & !RUN_UNWRITTEN {
            RUN_EXTENT_TREE => Owner::ExtentTree { ino },
            RUN_INDIRECT => Owner::IndirectBlock { ino },
            RUN_XATTR => Owner::XattrBlock { ino },
            _ if ino == self.fs.journal_ino && ino != 0 => Owner::Journal { file_block },
            _ if dir => Owner::Directory { ino, file_block },
            _ => Owner::Data {
                ino,
                file_offset: file_block * u64::from(self.fs.block_size),
            },
        }
    }

    /// The file-system block holding device byte `offset` (device = the source given to
    /// the crawl, i.e. the whole disk when a partition was crawled).
    pub fn block_of_device_offset(&self, offset: u64) -> Option<u64> {
        let rel = offset.checked_sub(self.fs.partition_start)?;
        let b = rel / u64::from(self.fs.block_size.max(1));
        (b < self.fs.blocks_count).then_some(b)
    }

    /// Where the on-disk inode `ino` lives: (file-system block, byte offset in that block).
    pub fn inode_location(&self, ino: u32) -> Option<(u64, u32)> {
        let idx = u64::from(ino.checked_sub(1)?);
        let ipg = u64::from(self.fs.inodes_per_group.max(1));
        let table = *self.fs.inode_tables.get(usize::try_from(idx / ipg).ok()?)?;
        let byte = (idx % ipg) * u64::from(self.fs.inode_size);
        let bs = u64::from(self.fs.block_size.max(1));
        Some((table + byte / bs, u32::try_from(byte % bs).ok()?))
    }

    fn entry_kind(&self, e: &EntryRec) -> FileKind {
        self.inode(e.ino)
            .map_or_else(|| ftype_kind(e.file_type), |m| m.kind())
    }

    /// Entries of directory `ino` (without `.` and `..`), sorted by name.
    pub fn read_dir(&self, ino: u32) -> Option<Vec<DirEntry<'_>>> {
        match self.sec(ino)? {
            Sec::Whole(t) => Some(
                t.dir_range(ino)?
                    .iter()
                    .map(|e| DirEntry {
                        name: Cow::Borrowed(t.name(e)),
                        ino: e.ino,
                        kind: self.entry_kind(e),
                    })
                    .collect(),
            ),
            Sec::Part(t) => Some(
                t.dir_range(ino)?
                    .iter()
                    .map(|e| DirEntry {
                        name: Cow::Owned(t.name(e).to_vec()),
                        ino: e.ino,
                        kind: self.entry_kind(e),
                    })
                    .collect(),
            ),
        }
    }

    /// Entries of directory `ino` with their records (name, target, type, directory block);
    /// `None` if `ino` was not a directory at crawl time.
    pub(crate) fn dir_records(&self, ino: u32) -> Option<Vec<(Vec<u8>, EntryRec)>> {
        let t = self.sec(ino)?;
        let range = t.dir_range(ino)?;
        Some(range.iter().map(|e| (t.name(e).to_vec(), *e)).collect())
    }

    /// Look `name` up in directory `dir`.
    pub fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
        let t = self.sec(dir)?;
        let range = t.dir_range(dir)?;
        let i = range.binary_search_by(|e| t.name(e).cmp(name)).ok()?;
        range.get(i).map(|e| e.ino)
    }

    /// Resolve an absolute path (no symlinks followed; `.` and `..` components handled
    /// lexically). `"/"` is the root inode 2.
    pub fn lookup(&self, path: &str) -> Option<u32> {
        let mut stack: Vec<u32> = vec![2];
        for comp in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if comp == ".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            let cur = *stack.last()?;
            stack.push(self.lookup_in(cur, comp.as_bytes())?);
        }
        stack.last().copied()
    }

    /// The name used for `ino`'s path: (directory, entry name), from its first link.
    pub(crate) fn primary(&self, ino: u32) -> Option<(u32, Cow<'_, [u8]>)> {
        match &self.store {
            Store::Eager(e) => {
                let t = &e.t;
                let (_, r) = t.rec(ino)?;
                if r.first_link == NO_LINK {
                    return None;
                }
                let en = t.entries.get(r.first_link as usize)?;
                let dir = t.dir_of_entry(r.first_link)?;
                Some((dir, Cow::Borrowed(t.name(en))))
            }
            Store::Lazy(l) => l.primary(ino).map(|(d, _, n)| (d, Cow::Owned(n))),
        }
    }

    /// Every entry naming `ino`, as (directory, name), by directory then name.
    pub(crate) fn names_of(&self, ino: u32) -> Vec<(u32, Vec<u8>)> {
        let e = match &self.store {
            Store::Eager(e) => e,
            Store::Lazy(l) => return l.names_of(ino),
        };
        let t = &e.t;
        let mut out = Vec::new();
        for d in &t.dirs {
            for en in t.dir_range(d.ino).unwrap_or(&[]) {
                if en.ino == ino {
                    out.push((d.ino, t.name(en).to_vec()));
                }
            }
        }
        out
    }

    /// One absolute path of `ino` (the first link found breadth-first from the root; other hard
    /// links are reachable through [`Index::read_dir`]). Non-UTF-8 bytes are replaced.
    pub fn path_of(&self, ino: u32) -> Option<String> {
        let mut parts: Vec<Cow<'_, [u8]>> = Vec::new();
        let mut cur = ino;
        for _ in 0..MAX_PATH_DEPTH {
            if cur == 2 {
                let mut s = String::new();
                for p in parts.iter().rev() {
                    s.push('/');
                    s.push_str(&String::from_utf8_lossy(p));
                }
                if s.is_empty() {
                    s.push('/');
                }
                return Some(s);
            }
            let (dir, name) = self.primary(cur)?;
            parts.push(name);
            cur = dir;
        }
        None
    }

    /// Target of symlink `ino`.
    pub fn read_link(&self, ino: u32) -> Option<Cow<'_, [u8]>> {
        self.sec(ino)?.bytes(|t| t.blob(ino, BLOB_SYMLINK))
    }

    /// Inline data of `ino` (inline_data feature), if the file is stored inline.
    pub fn inline_data(&self, ino: u32) -> Option<Cow<'_, [u8]>> {
        self.sec(ino)?.bytes(|t| t.blob(ino, BLOB_INLINE))
    }

    /// Read file data of `ino` at byte `offset` through the index (holes and unwritten
    /// extents read as zeros). Returns the bytes read (short at end of file).
    pub fn read_file(
        &self,
        src: &dyn BlockSource,
        ino: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize> {
        let meta = self
            .inode(ino)
            .ok_or_else(|| Error::inode(ino, "is not in the index"))?;
        if offset >= meta.size {
            return Ok(0);
        }
        let n = usize::try_from((meta.size - offset).min(buf.len() as u64)).unwrap_or(buf.len());
        let buf = &mut buf[..n];
        buf.fill(0);
        if let Some(data) = self.inline_data(ino) {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            if let Some(src) = data.get(start..) {
                let k = src.len().min(n);
                buf[..k].copy_from_slice(&src[..k]);
            }
            return Ok(n);
        }
        let bs = u64::from(self.fs.block_size);
        let end = offset + n as u64;
        for ext in self.file_extents(ino) {
            if ext.unwritten {
                continue;
            }
            let ext_start = ext.file_block * bs;
            let ext_end = ext_start + u64::from(ext.len) * bs;
            let s = ext_start.max(offset);
            let e = ext_end.min(end);
            if s >= e {
                continue;
            }
            let disk = self.fs.partition_start + ext.disk_block * bs + (s - ext_start);
            let dst = &mut buf[(s - offset) as usize..(e - offset) as usize];
            src.read_at(disk, dst)?;
        }
        Ok(n)
    }

    /// Counts and heap usage (a lazy index: what is resident now).
    pub fn stats(&self) -> IndexStats {
        let heap_bytes = usize::try_from(self.resident_bytes()).unwrap_or(usize::MAX);
        let meta_ranges = self.meta.len();
        match &self.store {
            Store::Eager(e) => IndexStats {
                inodes: e.t.inodes.len(),
                directories: e.t.count(FileKind::Directory),
                regular_files: e.t.count(FileKind::Regular),
                symlinks: e.t.count(FileKind::Symlink),
                entries: e.t.entries.len(),
                runs: e.t.extents.len(),
                meta_ranges,
                heap_bytes,
            },
            Store::Lazy(l) => {
                let c = l.counts();
                let n = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
                IndexStats {
                    inodes: n(c.inodes),
                    directories: n(c.directories),
                    regular_files: n(c.regular_files),
                    symlinks: n(c.symlinks),
                    entries: n(c.entries),
                    runs: n(c.runs),
                    meta_ranges,
                    heap_bytes,
                }
            }
        }
    }

    /// Heap bytes of each eager table, by name (for measurements; empty for a lazy index).
    pub fn table_bytes(&self) -> Vec<(&'static str, usize)> {
        let Store::Eager(e) = &self.store else {
            return Vec::new();
        };
        let t = &e.t;
        vec![
            ("inodes", vec_bytes(&t.inodes)),
            ("runs", vec_bytes(&t.extents)),
            ("block order", vec_bytes(&e.phys_order)),
            ("directories", vec_bytes(&t.dirs)),
            ("entries", vec_bytes(&t.entries)),
            ("blobs", vec_bytes(&t.blobs)),
            ("arena", vec_bytes(&t.arena)),
            ("owners", vec_bytes(&t.owners) + vec_bytes(&t.owner_x)),
            ("metadata ranges", vec_bytes(&self.meta)),
        ]
    }

    /// Serialise (magic, then postcard). A lazy index lives in its section file and cannot
    /// be serialised this way.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let Store::Eager(eager) = &self.store else {
            return Err(Error::IndexFormat(
                "a lazy index is stored in its section file (Index::open_lazy)".into(),
            ));
        };
        let mut out = MAGIC.to_vec();
        let stored = StoredRef {
            fs: &self.fs,
            meta: &self.meta,
            warnings: &self.warnings,
            eager,
        };
        let body = postcard::to_stdvec(&stored)
            .map_err(|e| Error::IndexFormat(format!("cannot encode: {e}")))?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decode an index produced by [`Index::to_bytes`] and check its invariants (a stored
    /// index is untrusted too).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let body = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| {
            Error::IndexFormat(
                "missing VMSFSIX3 magic (not an index, or one stored by an older version)".into(),
            )
        })?;
        let s: Stored = postcard::from_bytes(body)
            .map_err(|e| Error::IndexFormat(format!("cannot decode: {e}")))?;
        let idx = Index {
            fs: s.fs,
            meta: s.meta,
            warnings: s.warnings,
            store: Store::Eager(s.eager),
        };
        idx.validate()?;
        Ok(idx)
    }

    /// Store beside the image.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()?).map_err(|source| Error::Io {
            context: format!("writing {}", path.display()),
            source,
        })
    }

    /// Load a stored index.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::IndexFormat(m.into()));
        if self.fs.block_size < 1024 || !self.fs.block_size.is_power_of_two() {
            return bad("block size is not a power of two of at least 1024");
        }
        let Store::Eager(e) = &self.store else {
            return Ok(());
        };
        e.t.validate().or_else(bad)?;
        let ext = &e.t.extents;
        if e.phys_order.len() != ext.len()
            || e.phys_order.iter().any(|&i| i as usize >= ext.len())
            || !e
                .phys_order
                .windows(2)
                .all(|w| ext[w[0] as usize].phys() <= ext[w[1] as usize].phys())
        {
            return bad("block map order is inconsistent");
        }
        if !self.meta.windows(2).all(|w| w[0].start <= w[1].start) {
            return bad("metadata ranges are not sorted");
        }
        if !e.t.parents.is_empty() {
            return bad("an eager index has no parent table");
        }
        Ok(())
    }
}

/// Iterator of [`Index::inodes`].
enum InodeIter<'a> {
    Eager(std::slice::Iter<'a, InodeRec>),
    Lazy {
        lazy: &'a lazy::Lazy,
        next: usize,
        cur: std::vec::IntoIter<u32>,
    },
}

impl Iterator for InodeIter<'_> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        match self {
            InodeIter::Eager(it) => it.next().map(|r| r.ino),
            InodeIter::Lazy { lazy, next, cur } => loop {
                if let Some(i) = cur.next() {
                    return Some(i);
                }
                *cur = lazy.inodes_at(*next)?.into_iter();
                *next += 1;
            },
        }
    }
}

/// Heap bytes of what either store keeps beside its tables.
fn fixed_bytes(fs: &FsInfo, meta: &Vec<MetaRange>, warnings: &[Warning]) -> usize {
    vec_bytes(meta)
        + vec_bytes(&fs.inode_tables)
        + fs.volume_name.capacity()
        + fs.last_mounted.capacity()
        + warnings
            .iter()
            .map(|w| w.message.capacity() + std::mem::size_of::<Warning>())
            .sum::<usize>()
}

fn ftype_kind(t: u8) -> FileKind {
    match t {
        1 => FileKind::Regular,
        2 => FileKind::Directory,
        3 => FileKind::CharDevice,
        4 => FileKind::BlockDevice,
        5 => FileKind::Fifo,
        6 => FileKind::Socket,
        7 => FileKind::Symlink,
        _ => FileKind::Unknown,
    }
}

#[cfg(test)]
mod tests;
