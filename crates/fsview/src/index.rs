//! The file-system-independent index: inode table, path tree, per-file block maps and the
//! block → owner map.
//!
//! Representation (all flat, sorted vectors; no per-block entries, no hash maps):
//! - `inodes`: one 56-byte record per in-use inode, sorted by inode number.
//! - `extents`: 16-byte runs `(file block, disk block, length, kind)`, grouped by inode in the
//!   same order as `inodes` (each inode record holds the index of its first run); they hold data,
//!   directory, extent-tree, indirect and xattr blocks.
//! - `phys_order`: indices into `extents` sorted by disk block: the block → owner map for
//!   everything owned by an inode (4 bytes per run).
//! - `meta`: ranges for fixed metadata (superblock and group descriptor copies, bitmaps, inode
//!   tables), a handful per block group.
//! - `dirs`/`entries`/`arena`: directory entries (12 bytes + name bytes), grouped by directory
//!   and sorted by name; names, symlink targets and inline data live in one byte arena.
//!
//! Everything is keyed by inode number or block number, both of which map to a block group, so
//! a later version can store and load the index per block group (lazy loading) without changing
//! this API.

use crate::block::BlockSource;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

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

/// Stored inode record (48 bytes). Times are kept as ext4 stores them: the low 32 bits
/// (signed seconds) plus two epoch bits each, packed in `epochs` (mtime bits 0–1, ctime 2–3,
/// atime 4–5), which is lossless for ext4's 34-bit second range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct InodeRec {
    pub ino: u32,
    /// Index of the first run in `extents`.
    pub first_extent: u32,
    /// Index in `entries` of the entry used for its path, or `NO_LINK`.
    pub first_link: u32,
    pub mode: u16,
    pub links: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: u32,
    pub ctime: u32,
    pub atime: u32,
    pub epochs: u8,
}

impl InodeRec {
    pub(crate) fn pack_time(secs: i64) -> (u32, u8) {
        let hi = secs.wrapping_sub(i64::from(secs as i32)) >> 32;
        (secs as u32, (hi & 3) as u8)
    }
    fn time(lo: u32, epochs: u8, shift: u8) -> i64 {
        i64::from(lo as i32) + (i64::from((epochs >> shift) & 3) << 32)
    }
}

pub(crate) const NO_LINK: u32 = u32::MAX;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry<'a> {
    /// Name bytes (no NUL, no slash).
    pub name: &'a [u8],
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
    /// Heap bytes used by the index.
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

/// The crawled index of one file system. Built by [`Index::crawl`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub(crate) fs: FsInfo,
    pub(crate) inodes: Vec<InodeRec>,
    pub(crate) extents: Vec<Run>,
    pub(crate) phys_order: Vec<u32>,
    pub(crate) meta: Vec<MetaRange>,
    pub(crate) dirs: Vec<DirRec>,
    pub(crate) entries: Vec<EntryRec>,
    pub(crate) blobs: Vec<Blob>,
    pub(crate) arena: Vec<u8>,
    pub(crate) warnings: Vec<Warning>,
}

const MAGIC: &[u8; 8] = b"VMSFSIX2";
/// Deepest path [`Index::path_of`] follows.
const MAX_PATH_DEPTH: usize = 4096;

fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl Index {
    /// File-system facts.
    pub fn fs_info(&self) -> &FsInfo {
        &self.fs
    }

    /// Problems found during a lenient crawl.
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
    }

    fn rec(&self, ino: u32) -> Option<(usize, &InodeRec)> {
        let i = self.inodes.binary_search_by_key(&ino, |r| r.ino).ok()?;
        self.inodes.get(i).map(|r| (i, r))
    }

    /// Metadata of `ino`, if it is in use.
    pub fn inode(&self, ino: u32) -> Option<InodeMeta> {
        self.rec(ino).map(|(_, r)| InodeMeta {
            mode: r.mode,
            uid: r.uid,
            gid: r.gid,
            size: r.size,
            mtime: InodeRec::time(r.mtime, r.epochs, 0),
            ctime: InodeRec::time(r.ctime, r.epochs, 2),
            atime: InodeRec::time(r.atime, r.epochs, 4),
            links: r.links,
        })
    }

    /// All indexed inode numbers, ascending.
    pub fn inodes(&self) -> impl Iterator<Item = u32> + '_ {
        self.inodes.iter().map(|r| r.ino)
    }

    fn runs_of(&self, ino: u32) -> &[Run] {
        let Some((i, r)) = self.rec(ino) else {
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

    /// Data runs of `ino` in file order (holes are gaps; inline files have none).
    pub fn file_extents(&self, ino: u32) -> Vec<FileExtent> {
        let mut v: Vec<FileExtent> = self
            .runs_of(ino)
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
        self.runs_of(ino)
            .iter()
            .filter(|r| r.kind() & !RUN_UNWRITTEN != RUN_DATA)
            .map(|r| (r.phys(), r.len))
            .collect()
    }

    /// Who owns file-system block `block`.
    pub fn owner(&self, block: u64) -> Owner {
        // Fixed metadata first.
        let i = self.meta.partition_point(|m| m.start <= block);
        if let Some(m) = i.checked_sub(1).and_then(|i| self.meta.get(i)) {
            if block - m.start < u64::from(m.len) {
                let group = m.group;
                return match m.kind {
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
                };
            }
        }
        let extents = &self.extents;
        let i = self
            .phys_order
            .partition_point(|&e| extents.get(e as usize).is_some_and(|r| r.phys() <= block));
        let Some(&e) = i.checked_sub(1).and_then(|i| self.phys_order.get(i)) else {
            return Owner::Unknown;
        };
        let Some(run) = self.extents.get(e as usize) else {
            return Owner::Unknown;
        };
        let delta = block - run.phys();
        if delta >= u64::from(run.len) {
            return Owner::Unknown;
        }
        let k = self.inodes.partition_point(|r| r.first_extent <= e);
        let Some(rec) = k.checked_sub(1).and_then(|k| self.inodes.get(k)) else {
            return Owner::Unknown;
        };
        let ino = rec.ino;
        match run.kind() & !RUN_UNWRITTEN {
            RUN_EXTENT_TREE => Owner::ExtentTree { ino },
            RUN_INDIRECT => Owner::IndirectBlock { ino },
            RUN_XATTR => Owner::XattrBlock { ino },
            _ => {
                let file_block = u64::from(run.logical) + delta;
                if ino == self.fs.journal_ino && ino != 0 {
                    Owner::Journal { file_block }
                } else if FileKind::from_mode(rec.mode) == FileKind::Directory {
                    Owner::Directory { ino, file_block }
                } else {
                    Owner::Data {
                        ino,
                        file_offset: file_block * u64::from(self.fs.block_size),
                    }
                }
            }
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

    fn dir_range(&self, ino: u32) -> Option<&[EntryRec]> {
        let i = self.dirs.binary_search_by_key(&ino, |d| d.ino).ok()?;
        let start = self.dirs.get(i)?.first_entry as usize;
        let end = self
            .dirs
            .get(i + 1)
            .map_or(self.entries.len(), |d| d.first_entry as usize);
        self.entries.get(start..end)
    }

    fn name(&self, e: &EntryRec) -> &[u8] {
        let s = e.name_off as usize;
        self.arena
            .get(s..s + usize::from(e.name_len))
            .unwrap_or(&[])
    }

    /// Entries of directory `ino` (without `.` and `..`), sorted by name.
    pub fn read_dir(&self, ino: u32) -> Option<Vec<DirEntry<'_>>> {
        let range = self.dir_range(ino)?;
        Some(
            range
                .iter()
                .map(|e| DirEntry {
                    name: self.name(e),
                    ino: e.ino,
                    kind: self
                        .inode(e.ino)
                        .map_or_else(|| ftype_kind(e.file_type), |m| m.kind()),
                })
                .collect(),
        )
    }

    /// Look `name` up in directory `dir`.
    pub fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
        let range = self.dir_range(dir)?;
        let i = range.binary_search_by(|e| self.name(e).cmp(name)).ok()?;
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

    /// One absolute path of `ino` (the first link found breadth-first from the root; other hard
    /// links are reachable through [`Index::read_dir`]). Non-UTF-8 bytes are replaced.
    pub fn path_of(&self, ino: u32) -> Option<String> {
        let mut parts: Vec<&[u8]> = Vec::new();
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
            let (_, r) = self.rec(cur)?;
            if r.first_link == NO_LINK {
                return None;
            }
            let e = self.entries.get(r.first_link as usize)?;
            parts.push(self.name(e));
            let d = self.dirs.partition_point(|d| d.first_entry <= r.first_link);
            cur = self.dirs.get(d.checked_sub(1)?)?.ino;
        }
        None
    }

    /// Target of symlink `ino`.
    pub fn read_link(&self, ino: u32) -> Option<&[u8]> {
        self.blob(ino, BLOB_SYMLINK)
    }

    /// Inline data of `ino` (inline_data feature), if the file is stored inline.
    pub fn inline_data(&self, ino: u32) -> Option<&[u8]> {
        self.blob(ino, BLOB_INLINE)
    }

    fn blob(&self, ino: u32, kind: u8) -> Option<&[u8]> {
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

    /// Counts and heap usage.
    pub fn stats(&self) -> IndexStats {
        let count = |k: FileKind| {
            self.inodes
                .iter()
                .filter(|r| FileKind::from_mode(r.mode) == k)
                .count()
        };
        let heap_bytes = vec_bytes(&self.inodes)
            + vec_bytes(&self.extents)
            + vec_bytes(&self.phys_order)
            + vec_bytes(&self.meta)
            + vec_bytes(&self.dirs)
            + vec_bytes(&self.entries)
            + vec_bytes(&self.blobs)
            + vec_bytes(&self.arena)
            + vec_bytes(&self.fs.inode_tables)
            + self
                .warnings
                .iter()
                .map(|w| w.message.capacity() + std::mem::size_of::<Warning>())
                .sum::<usize>();
        IndexStats {
            inodes: self.inodes.len(),
            directories: count(FileKind::Directory),
            regular_files: count(FileKind::Regular),
            symlinks: count(FileKind::Symlink),
            entries: self.entries.len(),
            runs: self.extents.len(),
            meta_ranges: self.meta.len(),
            heap_bytes,
        }
    }

    /// Serialise (magic, then postcard).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = MAGIC.to_vec();
        let body = postcard::to_stdvec(self)
            .map_err(|e| Error::IndexFormat(format!("cannot encode: {e}")))?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decode an index produced by [`Index::to_bytes`] and check its invariants (a stored
    /// index is untrusted too).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let body = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| {
            Error::IndexFormat(
                "missing VMSFSIX2 magic (not an index, or one stored by an older version)".into(),
            )
        })?;
        let idx: Index = postcard::from_bytes(body)
            .map_err(|e| Error::IndexFormat(format!("cannot decode: {e}")))?;
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
        if !self.inodes.windows(2).all(|w| w[0].ino < w[1].ino) {
            return bad("inodes are not sorted");
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
            return bad("inode run indices are inconsistent");
        }
        if self.phys_order.len() != self.extents.len()
            || self
                .phys_order
                .iter()
                .any(|&i| i as usize >= self.extents.len())
            || !self
                .phys_order
                .windows(2)
                .all(|w| self.extents[w[0] as usize].phys() <= self.extents[w[1] as usize].phys())
        {
            return bad("block map order is inconsistent");
        }
        if !self.meta.windows(2).all(|w| w[0].start <= w[1].start) {
            return bad("metadata ranges are not sorted");
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
            return bad("directory table is inconsistent");
        }
        if self
            .entries
            .iter()
            .any(|e| e.name_off as usize + usize::from(e.name_len) > self.arena.len())
        {
            return bad("a name points outside the name arena");
        }
        if !self
            .blobs
            .windows(2)
            .all(|w| (w[0].ino, w[0].kind) < (w[1].ino, w[1].kind))
        {
            return bad("blobs are not sorted");
        }
        Ok(())
    }
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
mod tests {
    use super::*;

    #[test]
    fn record_sizes_are_compact() {
        assert_eq!(std::mem::size_of::<InodeRec>(), 48);
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
    fn garbage_index_is_rejected() {
        assert!(Index::from_bytes(b"nope").is_err());
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&[0xFF; 64]);
        assert!(Index::from_bytes(&b).is_err());
    }
}
