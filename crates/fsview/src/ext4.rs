//! ext2/ext3/ext4 crawler: superblock, group descriptors, inode tables, extent trees, classic
//! block maps, directories (linear and htree), inline data, symlinks.

use crate::block::{BlockSource, Window};
use crate::crc::crc32c_raw;
use crate::error::{Error, Result};
use crate::index::*;
use crate::partition::Partition;
use std::collections::{HashSet, VecDeque};

// Feature bits.
const COMPAT_SPARSE_SUPER2: u32 = 0x200;
const INCOMPAT_COMPRESSION: u32 = 0x1;
const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
const INCOMPAT_META_BG: u32 = 0x10;
const INCOMPAT_64BIT: u32 = 0x80;
const INCOMPAT_CSUM_SEED: u32 = 0x2000;
const INCOMPAT_DIRDATA: u32 = 0x1000;
const RO_SPARSE_SUPER: u32 = 0x1;
const RO_HUGE_FILE: u32 = 0x8;
const RO_GDT_CSUM: u32 = 0x10;
const RO_BIGALLOC: u32 = 0x200;
const RO_METADATA_CSUM: u32 = 0x400;

// Inode flags.
const FL_HUGE_FILE: u32 = 0x4_0000;
const FL_EXTENTS: u32 = 0x8_0000;
const FL_INLINE_DATA: u32 = 0x1000_0000;

const BG_INODE_UNINIT: u16 = 0x1;

/// Deepest extent tree accepted (the kernel allows 5).
const MAX_EXTENT_DEPTH: u16 = 5;
/// Bytes read from the device at once when scanning inode tables and directories.
const CHUNK: u64 = 1 << 20;
/// Largest directory read (bytes); bigger directories are an error.
const MAX_DIR_BYTES: u64 = 1 << 30;
/// Warnings kept (the rest are counted).
const MAX_WARNINGS: usize = 1000;
/// Longest symlink target stored.
const MAX_SYMLINK: u64 = 4096;

/// How strictly to crawl.
#[derive(Debug, Clone, Copy, Default)]
pub struct CrawlOptions {
    /// Turn the first per-inode problem into an error instead of a [`Warning`].
    pub strict: bool,
    /// Skip checksum verification (metadata_csum).
    pub no_checksums: bool,
}

fn le16(b: &[u8], o: usize) -> u16 {
    b.get(o..o + 2)
        .map_or(0, |s| u16::from_le_bytes([s[0], s[1]]))
}
fn le32(b: &[u8], o: usize) -> u32 {
    b.get(o..o + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

struct Super {
    inodes_count: u32,
    blocks_count: u64,
    first_data_block: u32,
    block_size: u32,
    blocks_per_group: u32,
    inodes_per_group: u32,
    inode_size: u16,
    compat: u32,
    incompat: u32,
    ro_compat: u32,
    uuid: [u8; 16],
    volume_name: String,
    last_mounted: String,
    reserved_gdt: u16,
    journal_ino: u32,
    desc_size: u16,
    first_meta_bg: u32,
    backup_bgs: [u32; 2],
    csum_seed: u32,
    group_count: u32,
    first_ino: u32,
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn parse_super(b: &[u8], dev_len: u64, opts: &CrawlOptions) -> Result<Super> {
    let magic = le16(b, 56);
    if magic != 0xEF53 {
        return Err(Error::BadMagic { found: magic });
    }
    let bad = |m: String| Err(Error::Superblock(m));
    let log = le32(b, 24);
    if log > 6 {
        return bad(format!("block size 2^(10+{log}) is larger than 64 KiB"));
    }
    let block_size = 1024u32 << log;
    let rev = le32(b, 76);
    let compat = le32(b, 92);
    let incompat = le32(b, 96);
    let ro_compat = le32(b, 100);
    if incompat & (INCOMPAT_COMPRESSION | INCOMPAT_JOURNAL_DEV | INCOMPAT_DIRDATA) != 0 {
        return bad(format!(
            "unsupported incompatible features {:#x} (compression, external journal device or dirdata)",
            incompat & (INCOMPAT_COMPRESSION | INCOMPAT_JOURNAL_DEV | INCOMPAT_DIRDATA)
        ));
    }
    if ro_compat & RO_BIGALLOC != 0 {
        return bad("bigalloc (clusters larger than blocks) is not supported".into());
    }
    if ro_compat & RO_METADATA_CSUM != 0 && !opts.no_checksums {
        let stored = le32(b, 0x3FC);
        let computed = crc32c_raw(!0, b.get(..0x3FC).unwrap_or(&[]));
        if stored != computed {
            return bad(format!(
                "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            ));
        }
    }
    let is64 = incompat & INCOMPAT_64BIT != 0;
    let blocks_count = u64::from(le32(b, 4))
        | if is64 {
            u64::from(le32(b, 336)) << 32
        } else {
            0
        };
    let first_data_block = le32(b, 20);
    let blocks_per_group = le32(b, 32);
    let inodes_per_group = le32(b, 40);
    let inodes_count = le32(b, 0);
    let (inode_size, first_ino) = if rev == 0 {
        (128u16, 11u32)
    } else {
        (le16(b, 88), le32(b, 84))
    };
    if inode_size < 128 || !inode_size.is_power_of_two() || u32::from(inode_size) > block_size {
        return bad(format!("inode size {inode_size} is invalid"));
    }
    if blocks_per_group == 0 || blocks_per_group > 8 * block_size {
        return bad(format!(
            "{blocks_per_group} blocks per group do not fit one {block_size}-byte bitmap"
        ));
    }
    if inodes_per_group == 0 || inodes_per_group > 8 * block_size {
        return bad(format!(
            "{inodes_per_group} inodes per group do not fit one {block_size}-byte bitmap"
        ));
    }
    let expected_first = u32::from(block_size == 1024);
    if first_data_block != expected_first {
        return bad(format!(
            "first data block is {first_data_block}, expected {expected_first} for {block_size}-byte blocks"
        ));
    }
    if blocks_count <= u64::from(first_data_block) || blocks_count >= 1 << 48 {
        return bad(format!("block count {blocks_count} is invalid"));
    }
    let fs_bytes = blocks_count
        .checked_mul(u64::from(block_size))
        .ok_or_else(|| Error::Superblock("file system size overflows".into()))?;
    if fs_bytes > dev_len {
        return bad(format!(
            "the file system needs {fs_bytes} bytes ({blocks_count} blocks of {block_size}) but the device has only {dev_len}; the image is truncated"
        ));
    }
    let groups = (blocks_count - u64::from(first_data_block)).div_ceil(u64::from(blocks_per_group));
    let group_count = u32::try_from(groups)
        .map_err(|_| Error::Superblock(format!("{groups} block groups is too many")))?;
    if u64::from(inodes_count) != u64::from(inodes_per_group) * groups {
        return bad(format!(
            "inode count {inodes_count} is not {inodes_per_group} inodes per group x {groups} groups"
        ));
    }
    let desc_size = if is64 { le16(b, 254) } else { 32 };
    if desc_size < 32 || !desc_size.is_power_of_two() || u32::from(desc_size) > block_size {
        return bad(format!("group descriptor size {desc_size} is invalid"));
    }
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(b.get(104..120).unwrap_or(&[0; 16]));
    let csum_seed = if incompat & INCOMPAT_CSUM_SEED != 0 {
        le32(b, 0x270)
    } else {
        crc32c_raw(!0, &uuid)
    };
    if first_ino < 3 || first_ino > inodes_count {
        return bad(format!("first non-reserved inode {first_ino} is invalid"));
    }
    Ok(Super {
        inodes_count,
        blocks_count,
        first_data_block,
        block_size,
        blocks_per_group,
        inodes_per_group,
        inode_size,
        compat,
        incompat,
        ro_compat,
        uuid,
        volume_name: cstr(b.get(120..136).unwrap_or(&[])),
        last_mounted: cstr(b.get(136..200).unwrap_or(&[])),
        reserved_gdt: le16(b, 206),
        journal_ino: le32(b, 224),
        desc_size,
        first_meta_bg: le32(b, 260),
        backup_bgs: [le32(b, 0x24C), le32(b, 0x250)],
        csum_seed,
        group_count,
        first_ino,
    })
}

impl Super {
    fn has_super(&self, g: u32) -> bool {
        if g == 0 {
            return true;
        }
        if self.compat & COMPAT_SPARSE_SUPER2 != 0 {
            return g == self.backup_bgs[0] || g == self.backup_bgs[1];
        }
        if self.ro_compat & RO_SPARSE_SUPER == 0 || g == 1 {
            return true;
        }
        [3u32, 5, 7].iter().any(|&p| {
            let mut x = p;
            while x < g {
                match x.checked_mul(p) {
                    Some(n) => x = n,
                    None => return false,
                }
            }
            x == g
        })
    }
    fn group_first_block(&self, g: u32) -> u64 {
        u64::from(self.first_data_block) + u64::from(g) * u64::from(self.blocks_per_group)
    }
    fn descs_per_block(&self) -> u32 {
        self.block_size / u32::from(self.desc_size)
    }
    fn gdt_blocks(&self) -> u32 {
        self.group_count.div_ceil(self.descs_per_block())
    }
    fn csum(&self) -> bool {
        self.ro_compat & RO_METADATA_CSUM != 0
    }
    fn huge_file(&self) -> bool {
        self.ro_compat & RO_HUGE_FILE != 0
    }
    fn valid_block(&self, b: u64) -> bool {
        b >= u64::from(self.first_data_block) && b < self.blocks_count
    }
    /// Block number of GDT block `i` (primary copy).
    fn gdt_block(&self, i: u32) -> u64 {
        let sb_block = u64::from(self.first_data_block);
        if self.incompat & INCOMPAT_META_BG == 0 || i < self.first_meta_bg {
            return sb_block + 1 + u64::from(i);
        }
        let g = i.saturating_mul(self.descs_per_block());
        self.group_first_block(g) + u64::from(self.has_super(g))
    }
}

#[derive(Clone, Copy)]
struct Group {
    block_bitmap: u64,
    inode_bitmap: u64,
    inode_table: u64,
    flags: u16,
    itable_unused: u32,
}

struct Crawler<'a> {
    src: &'a dyn BlockSource,
    sb: Super,
    groups: Vec<Group>,
    opts: CrawlOptions,
    warnings: Vec<Warning>,
    dropped_warnings: usize,
    inodes: Vec<InodeRec>,
    runs: Vec<Run>,
    blobs: Vec<Blob>,
    arena: Vec<u8>,
    /// Strings already in the arena (each name and symlink target is stored once).
    strings: Interner,
    owners: OwnerTable,
    /// (dir inode, first run index, run count) for directories to read after the scan.
    dirs_to_read: Vec<u32>,
    inline_dirs: Vec<(u32, Vec<u8>)>,
    /// Blocks that may still be mapped by inodes (see `charge`).
    global_budget: u64,
}

/// A parsed on-disk inode.
struct RawInode<'b> {
    raw: &'b [u8],
    mode: u16,
    size: u64,
    flags: u32,
    blocks_fs: u64,
    file_acl: u64,
}

impl Index {
    /// Crawl the ext2/3/4 file system on `src` (or on `partition` of it) leniently: damage
    /// confined to one inode becomes a [`Warning`]; damage to global structures is an error.
    pub fn crawl(src: &dyn BlockSource, partition: Option<&Partition>) -> Result<Index> {
        Self::crawl_with(src, partition, &CrawlOptions::default())
    }

    /// [`Index::crawl`] with options.
    pub fn crawl_with(
        src: &dyn BlockSource,
        partition: Option<&Partition>,
        opts: &CrawlOptions,
    ) -> Result<Index> {
        let (start, len) = match partition {
            Some(p) => (p.start, p.size.min(src.len().saturating_sub(p.start))),
            None => (0, src.len()),
        };
        let win = Window::new(src, start, len)?;
        let mut sbuf = vec![0u8; 1024];
        win.read_at(1024, &mut sbuf)?;
        let sb = parse_super(&sbuf, len, opts)?;
        let mut c = Crawler {
            src: &win,
            sb,
            groups: Vec::new(),
            opts: *opts,
            warnings: Vec::new(),
            dropped_warnings: 0,
            inodes: Vec::new(),
            runs: Vec::new(),
            blobs: Vec::new(),
            arena: Vec::new(),
            strings: Interner::default(),
            owners: OwnerTable::default(),
            dirs_to_read: Vec::new(),
            inline_dirs: Vec::new(),
            global_budget: 0,
        };
        c.global_budget = c.sb.blocks_count.saturating_add(1024);
        c.read_groups()?;
        c.scan_inodes()?;
        c.finish(start)
    }
}

impl Crawler<'_> {
    fn warn(&mut self, err: Error) -> Result<()> {
        if self.opts.strict || matches!(err, Error::Limit(_) | Error::Io { .. }) {
            return Err(err);
        }
        let ino = match &err {
            Error::Inode { ino, .. } => Some(*ino),
            _ => None,
        };
        if self.warnings.len() < MAX_WARNINGS {
            self.warnings.push(Warning {
                ino,
                message: err.to_string(),
            });
        } else {
            self.dropped_warnings += 1;
        }
        Ok(())
    }

    fn read(&self, block: u64, count: u64) -> Result<Vec<u8>> {
        let bs = u64::from(self.sb.block_size);
        let off = block
            .checked_mul(bs)
            .ok_or_else(|| Error::Limit(format!("block {block} overflows a byte offset")))?;
        let len = count
            .checked_mul(bs)
            .filter(|l| *l <= MAX_DIR_BYTES)
            .ok_or_else(|| Error::Limit(format!("read of {count} blocks is too large")))?;
        let mut v = vec![0u8; len as usize];
        self.src.read_at(off, &mut v)?;
        Ok(v)
    }

    fn read_groups(&mut self) -> Result<()> {
        let sb = &self.sb;
        let ds = usize::from(sb.desc_size);
        let dpb = sb.descs_per_block();
        let mut groups = Vec::with_capacity(sb.group_count as usize);
        let mut gdt_warnings = Vec::new();
        for i in 0..sb.gdt_blocks() {
            let blk = sb.gdt_block(i);
            if !sb.valid_block(blk) {
                return Err(Error::Superblock(format!(
                    "group descriptor block {i} would be at block {blk}, outside the file system"
                )));
            }
            let buf = self.read(blk, 1)?;
            for (k, d) in buf.chunks_exact(ds).enumerate() {
                let g = i * dpb + k as u32;
                if g >= sb.group_count {
                    break;
                }
                let hi = |o: usize| -> u64 {
                    if ds >= 64 {
                        u64::from(le32(d, o)) << 32
                    } else {
                        0
                    }
                };
                let grp = Group {
                    block_bitmap: u64::from(le32(d, 0)) | hi(32),
                    inode_bitmap: u64::from(le32(d, 4)) | hi(36),
                    inode_table: u64::from(le32(d, 8)) | hi(40),
                    flags: le16(d, 18),
                    itable_unused: u32::from(le16(d, 28))
                        | if ds >= 64 {
                            u32::from(le16(d, 50)) << 16
                        } else {
                            0
                        },
                };
                if sb.csum() && !self.opts.no_checksums {
                    let mut copy = d.to_vec();
                    copy[30] = 0;
                    copy[31] = 0;
                    let c = crc32c_raw(sb.csum_seed, &g.to_le_bytes());
                    let c = crc32c_raw(c, &copy) & 0xFFFF;
                    if c != u32::from(le16(d, 30)) {
                        gdt_warnings.push(Error::GroupDescriptor {
                            group: g,
                            reason: format!(
                                "checksum mismatch (stored {:#06x}, computed {c:#06x})",
                                le16(d, 30)
                            ),
                        });
                    }
                }
                let it_blocks = (u64::from(sb.inodes_per_group) * u64::from(sb.inode_size))
                    .div_ceil(u64::from(sb.block_size));
                let bad = |what: &str, b: u64| Error::GroupDescriptor {
                    group: g,
                    reason: format!("{what} at block {b} is outside the file system"),
                };
                if !sb.valid_block(grp.block_bitmap) {
                    return Err(bad("the block bitmap", grp.block_bitmap));
                }
                if !sb.valid_block(grp.inode_bitmap) {
                    return Err(bad("the inode bitmap", grp.inode_bitmap));
                }
                if !sb.valid_block(grp.inode_table)
                    || !sb.valid_block(grp.inode_table.saturating_add(it_blocks - 1))
                {
                    return Err(bad("the inode table", grp.inode_table));
                }
                groups.push(grp);
            }
        }
        if groups.len() != sb.group_count as usize {
            return Err(Error::Superblock(format!(
                "found {} group descriptors for {} groups",
                groups.len(),
                sb.group_count
            )));
        }
        self.groups = groups;
        for w in gdt_warnings {
            self.warn(w)?;
        }
        Ok(())
    }

    fn scan_inodes(&mut self) -> Result<()> {
        let sb_ipg = self.sb.inodes_per_group;
        let isz = u64::from(self.sb.inode_size);
        let bs = u64::from(self.sb.block_size);
        let uninit_ok = self.sb.ro_compat & (RO_GDT_CSUM | RO_METADATA_CSUM) != 0;
        for g in 0..self.sb.group_count {
            let grp = self.groups[g as usize];
            if uninit_ok && grp.flags & BG_INODE_UNINIT != 0 {
                continue;
            }
            let mut used = sb_ipg;
            if uninit_ok {
                used = sb_ipg.saturating_sub(grp.itable_unused.min(sb_ipg));
            }
            if used == 0 {
                continue;
            }
            let bitmap = self.read(grp.inode_bitmap, 1)?;
            let total_bytes = u64::from(used) * isz;
            let mut done = 0u64;
            while done < total_bytes {
                let chunk = (total_bytes - done).min(CHUNK);
                let first_block = grp.inode_table + done / bs;
                let nblocks = chunk.div_ceil(bs);
                let buf = self.read(first_block, nblocks)?;
                let n_in_chunk = chunk / isz;
                let base = done / isz;
                for k in 0..n_in_chunk {
                    let idx = (base + k) as u32;
                    let bit = bitmap
                        .get((idx / 8) as usize)
                        .is_some_and(|b| b & (1 << (idx % 8)) != 0);
                    if !bit {
                        continue;
                    }
                    let ino = g * sb_ipg + idx + 1;
                    let o = (k * isz) as usize;
                    let Some(raw) = buf.get(o..o + isz as usize) else {
                        continue;
                    };
                    if let Err(e) = self.inode(ino, raw) {
                        self.warn(e)?;
                    }
                }
                done += chunk;
            }
        }
        Ok(())
    }

    fn inode(&mut self, ino: u32, raw: &[u8]) -> Result<()> {
        let sb = &self.sb;
        let (csum_on, seed) = (sb.csum() && !self.opts.no_checksums, sb.csum_seed);
        let mode = le16(raw, 0);
        if mode == 0
            || (ino < sb.first_ino && ino != 2 && ino != sb.journal_ino && le16(raw, 26) == 0)
        {
            return Ok(());
        }
        // The inode bitmap is the authority: an in-use inode with no links is an orphan (open
        // but unlinked; its i_dtime links the orphan list) and still owns its blocks.
        let links = le16(raw, 26);
        let extra = if raw.len() > 128 { le16(raw, 128) } else { 0 };
        if csum_on {
            let mut copy = raw.to_vec();
            copy[0x7C] = 0;
            copy[0x7D] = 0;
            let has_hi = raw.len() > 128 && extra >= 4;
            if has_hi {
                copy[0x82] = 0;
                copy[0x83] = 0;
            }
            let c = crc32c_raw(seed, &ino.to_le_bytes());
            let c = crc32c_raw(c, &raw[100..104]);
            let c = crc32c_raw(c, &copy);
            let stored = u32::from(le16(raw, 0x7C))
                | if has_hi {
                    u32::from(le16(raw, 0x82)) << 16
                } else {
                    0
                };
            let c = if has_hi { c } else { c & 0xFFFF };
            if c != stored {
                self.warn(Error::inode(
                    ino,
                    format!("checksum mismatch (stored {stored:#010x}, computed {c:#010x})"),
                ))?;
            }
        }
        let sb = &self.sb;
        let time = |o: usize, xo: usize| -> i64 {
            let base = i64::from(le32(raw, o) as i32);
            if raw.len() > 128 && usize::from(extra) + 128 >= xo + 4 {
                base + (i64::from(le32(raw, xo) & 3) << 32)
            } else {
                base
            }
        };
        let size = u64::from(le32(raw, 4)) | u64::from(le32(raw, 108)) << 32;
        let flags = le32(raw, 32);
        let mut blocks = u64::from(le32(raw, 28));
        if sb.huge_file() {
            blocks |= u64::from(le16(raw, 116)) << 32;
        }
        let blocks_fs = if sb.huge_file() && flags & FL_HUGE_FILE != 0 {
            blocks
        } else {
            blocks / (u64::from(sb.block_size) / 512)
        };
        let file_acl = u64::from(le32(raw, 104)) | u64::from(le16(raw, 118)) << 32;
        let first_extent = u32::try_from(self.runs.len())
            .map_err(|_| Error::Limit("more than 2^32 block runs".into()))?;
        let (mtime, em) = InodeRec::pack_time(time(16, 136));
        let (ctime, ec) = InodeRec::pack_time(time(12, 132));
        let (atime, ea) = InodeRec::pack_time(time(8, 140));
        let uid = u32::from(le16(raw, 2)) | u32::from(le16(raw, 120)) << 16;
        let gid = u32::from(le16(raw, 24)) | u32::from(le16(raw, 122)) << 16;
        self.inodes.push(InodeRec {
            ino,
            first_extent,
            first_link: NO_LINK,
            mode,
            links,
            owner: self.owners.id(ino, uid, gid),
            size,
            mtime,
            ctime,
            atime,
            epochs: em | ec << 2 | ea << 4,
        });
        let ri = RawInode {
            raw,
            mode,
            size,
            flags,
            blocks_fs: blocks_fs.min(sb.blocks_count),
            file_acl,
        };
        if let Err(e) = self.map_inode(ino, &ri) {
            self.runs.truncate(first_extent as usize);
            return Err(e);
        }
        Ok(())
    }

    fn map_inode(&mut self, ino: u32, ri: &RawInode<'_>) -> Result<()> {
        let kind = FileKind::from_mode(ri.mode);
        let mut budget = ri.blocks_fs;
        if ri.file_acl != 0 {
            if !self.sb.valid_block(ri.file_acl) {
                return Err(Error::inode(
                    ino,
                    format!("xattr block {} is outside the file system", ri.file_acl),
                ));
            }
            self.push_run(Run::new(ri.file_acl, 0, 1, RUN_XATTR));
            budget = budget.saturating_sub(1);
        }
        let iblock = ri.raw.get(40..100).unwrap_or(&[]);
        if ri.flags & FL_INLINE_DATA != 0 {
            let data = self.inline_bytes(ino, ri)?;
            if kind == FileKind::Directory {
                self.inline_dirs.push((ino, data));
            } else {
                self.add_blob(
                    ino,
                    if kind == FileKind::Symlink {
                        BLOB_SYMLINK
                    } else {
                        BLOB_INLINE
                    },
                    &data,
                );
            }
            return Ok(());
        }
        if kind == FileKind::Symlink && ri.size < 60 && budget == 0 && ri.flags & FL_EXTENTS == 0 {
            let t = iblock.get(..ri.size as usize).unwrap_or(&[]).to_vec();
            self.add_blob(ino, BLOB_SYMLINK, &t);
            return Ok(());
        }
        if matches!(
            kind,
            FileKind::CharDevice | FileKind::BlockDevice | FileKind::Fifo | FileKind::Socket
        ) {
            return Ok(());
        }
        if ino == 7 {
            // Resize inode: its double-indirect block lists the reserved GDT blocks, which are
            // recorded as fixed metadata; do not walk it as a file.
            let dind = u64::from(le32(iblock, 13 * 4));
            if self.sb.valid_block(dind) {
                self.push_run(Run::new(dind, 0, 1, RUN_INDIRECT));
            }
            return Ok(());
        }
        if ri.flags & FL_EXTENTS != 0 {
            let mut visited = HashSet::new();
            self.walk_extents(ino, iblock, None, 0, &mut budget, &mut visited)?;
        } else {
            self.walk_blockmap(ino, iblock, &mut budget)?;
        }
        if kind == FileKind::Directory {
            self.dirs_to_read.push(ino);
        } else if kind == FileKind::Symlink {
            // Slow symlink: target in the first data block.
            let len = ri.size.min(MAX_SYMLINK);
            let first = self
                .current_runs()
                .iter()
                .find(|r| r.kind() == RUN_DATA && r.logical == 0)
                .map(|r| r.phys());
            if let Some(b) = first {
                let buf = self.read(b, 1)?;
                let t = buf.get(..len as usize).unwrap_or(&[]).to_vec();
                self.add_blob(ino, BLOB_SYMLINK, &t);
            }
        }
        Ok(())
    }

    fn current_runs(&self) -> &[Run] {
        let start = self.inodes.last().map_or(0, |r| r.first_extent as usize);
        self.runs.get(start..).unwrap_or(&[])
    }

    fn add_blob(&mut self, ino: u32, kind: u8, data: &[u8]) {
        let Ok(len) = u32::try_from(data.len()) else {
            return;
        };
        let Some(off) = self.strings.intern(&mut self.arena, data) else {
            return;
        };
        self.blobs.push(Blob {
            ino,
            off,
            len,
            kind,
        });
    }

    /// Inline data: up to 60 bytes in i_block, the rest in the in-inode `system.data` xattr.
    fn inline_bytes(&self, ino: u32, ri: &RawInode<'_>) -> Result<Vec<u8>> {
        let mut data = inline_data_raw(ri.raw).map_err(|why| Error::inode(ino, why))?;
        if FileKind::from_mode(ri.mode) != FileKind::Directory {
            if ri.size > data.len() as u64 {
                return Err(Error::inode(
                    ino,
                    format!(
                        "inline size {} exceeds the {} inline bytes",
                        ri.size,
                        data.len()
                    ),
                ));
            }
            data.truncate(ri.size as usize);
        }
        Ok(data)
    }

    fn push_run(&mut self, r: Run) {
        let start = self.inodes.last().map_or(0, |r| r.first_extent as usize);
        let len = self.runs.len();
        if let Some(last) = self.runs.last_mut() {
            if len > start
                && last.kind() == r.kind()
                && last.phys().checked_add(u64::from(last.len)) == Some(r.phys())
                && (r.kind() & !RUN_UNWRITTEN != RUN_DATA
                    || last.logical.checked_add(last.len) == Some(r.logical))
            {
                if let Some(n) = last.len.checked_add(r.len) {
                    last.len = n;
                    return;
                }
            }
        }
        self.runs.push(r);
    }

    fn charge(&mut self, ino: u32, budget: &mut u64, n: u64) -> Result<()> {
        *budget = budget.checked_sub(n).ok_or_else(|| {
            Error::inode(
                ino,
                "maps more blocks than its i_blocks count (cross-linked or looping block map)",
            )
        })?;
        // Across all inodes, a consistent file system owns each block at most once; cap the
        // total so that cross-linked files cannot multiply the work and memory of a crawl.
        self.global_budget = self.global_budget.checked_sub(n).ok_or_else(|| {
            Error::Limit(format!(
                "the inodes map more blocks than the file system has ({}); files are cross-linked",
                self.sb.blocks_count
            ))
        })?;
        Ok(())
    }

    fn walk_extents(
        &mut self,
        ino: u32,
        node: &[u8],
        expect_depth: Option<u16>,
        level: u32,
        budget: &mut u64,
        visited: &mut HashSet<u64>,
    ) -> Result<()> {
        if le16(node, 0) != 0xF30A {
            return Err(Error::inode(
                ino,
                format!("extent header magic {:#06x} is not 0xf30a", le16(node, 0)),
            ));
        }
        let entries = usize::from(le16(node, 2));
        let max = usize::from(le16(node, 4));
        let depth = le16(node, 6);
        let cap = (node.len() - 12) / 12;
        if entries > max || max > cap {
            return Err(Error::inode(
                ino,
                format!("extent node has {entries} entries, max {max}, room for {cap}"),
            ));
        }
        if depth > MAX_EXTENT_DEPTH
            || expect_depth.is_some_and(|d| d != depth)
            || level > u32::from(MAX_EXTENT_DEPTH)
        {
            return Err(Error::inode(
                ino,
                format!("extent tree depth {depth} is invalid at level {level}"),
            ));
        }
        let mut last_logical: Option<u32> = None;
        for i in 0..entries {
            let e = &node[12 + 12 * i..24 + 12 * i];
            let logical = le32(e, 0);
            if last_logical.is_some_and(|l| logical < l) {
                return Err(Error::inode(
                    ino,
                    "extent entries are not sorted by file block",
                ));
            }
            last_logical = Some(logical);
            if depth == 0 {
                let raw_len = le16(e, 4);
                let (len, unwritten) = if raw_len > 32768 {
                    (raw_len - 32768, true)
                } else {
                    (raw_len, false)
                };
                let phys = u64::from(le16(e, 6)) << 32 | u64::from(le32(e, 8));
                if len == 0 {
                    continue;
                }
                if !self.sb.valid_block(phys) || !self.sb.valid_block(phys + u64::from(len) - 1) {
                    return Err(Error::inode(ino, format!("extent at block {phys} (+{len}) points past the end of the file system")));
                }
                if u64::from(logical) + u64::from(len) > 1 << 32 {
                    return Err(Error::inode(ino, "extent file range overflows 2^32 blocks"));
                }
                self.charge(ino, budget, u64::from(len))?;
                let kind = if unwritten {
                    RUN_DATA | RUN_UNWRITTEN
                } else {
                    RUN_DATA
                };
                self.push_run(Run::new(phys, logical, u32::from(len), kind));
            } else {
                let child = u64::from(le16(e, 8)) << 32 | u64::from(le32(e, 4));
                if !self.sb.valid_block(child) {
                    return Err(Error::inode(
                        ino,
                        format!(
                            "extent index points to block {child}, past the end of the file system"
                        ),
                    ));
                }
                if !visited.insert(child) {
                    return Err(Error::inode(
                        ino,
                        format!("extent tree loops: block {child} is referenced twice"),
                    ));
                }
                self.charge(ino, budget, 1)?;
                self.push_run(Run::new(child, 0, 1, RUN_EXTENT_TREE));
                let buf = self.read(child, 1)?;
                self.walk_extents(ino, &buf, Some(depth - 1), level + 1, budget, visited)?;
            }
        }
        Ok(())
    }

    fn walk_blockmap(&mut self, ino: u32, iblock: &[u8], budget: &mut u64) -> Result<()> {
        let per = u64::from(self.sb.block_size / 4);
        let mut logical = 0u64;
        for i in 0..12 {
            let b = u64::from(le32(iblock, i * 4));
            self.map_ptr(ino, b, logical, budget)?;
            logical += 1;
        }
        for (slot, level) in [(12usize, 1u32), (13, 2), (14, 3)] {
            let b = u64::from(le32(iblock, slot * 4));
            let span = per.pow(level);
            if b != 0 {
                self.walk_indirect(ino, b, level, logical, budget)?;
            }
            logical += span;
        }
        Ok(())
    }

    fn map_ptr(&mut self, ino: u32, b: u64, logical: u64, budget: &mut u64) -> Result<()> {
        if b == 0 {
            return Ok(());
        }
        if !self.sb.valid_block(b) {
            return Err(Error::inode(
                ino,
                format!("block pointer {b} is outside the file system"),
            ));
        }
        let logical = u32::try_from(logical)
            .map_err(|_| Error::inode(ino, "block map reaches past file block 2^32"))?;
        self.charge(ino, budget, 1)?;
        self.push_run(Run::new(b, logical, 1, RUN_DATA));
        Ok(())
    }

    fn walk_indirect(
        &mut self,
        ino: u32,
        b: u64,
        level: u32,
        logical: u64,
        budget: &mut u64,
    ) -> Result<()> {
        if !self.sb.valid_block(b) {
            return Err(Error::inode(
                ino,
                format!("indirect block {b} is outside the file system"),
            ));
        }
        self.charge(ino, budget, 1)?;
        self.push_run(Run::new(b, 0, 1, RUN_INDIRECT));
        let buf = self.read(b, 1)?;
        let per = u64::from(self.sb.block_size / 4);
        let span = per.pow(level - 1);
        for i in 0..per {
            let p = u64::from(le32(&buf, (i * 4) as usize));
            if p == 0 {
                continue;
            }
            let l = logical + i * span;
            if level == 1 {
                self.map_ptr(ino, p, l, budget)?;
            } else {
                self.walk_indirect(ino, p, level - 1, l, budget)?;
            }
        }
        Ok(())
    }

    /// Read the directories and build the index: metadata ranges, path tree, first links.
    fn finish(mut self, partition_start: u64) -> Result<Index> {
        // Directories.
        let raw_entries = self.read_all_directories()?;
        // Fixed metadata ranges.
        let meta = meta_ranges(&self.sb, &self.groups);
        // Path tree: sort entries by (dir, name), drop dangling ones.
        let (dirs, entries, dangling) = self.path_tree(raw_entries)?;
        // BFS from the root for first links and directory loops.
        let mut t = self.take_tables(dirs, entries);
        let loops = link_from_root(&mut t);
        for d in dangling.into_iter().chain(loops) {
            self.warn(d)?;
        }
        let phys_order = self.seal(&mut t);
        let fs = self.fs_info(partition_start);
        Ok(Index::eager(
            fs,
            meta,
            std::mem::take(&mut self.warnings),
            t,
            phys_order,
        ))
    }

    /// Read the entries of every directory the scan found (block-mapped, then inline); one
    /// that cannot be read becomes a warning.
    fn read_all_directories(&mut self) -> Result<RawEntries> {
        let mut raw_entries = RawEntries::default();
        let dirs = std::mem::take(&mut self.dirs_to_read);
        let inline_dirs = std::mem::take(&mut self.inline_dirs);
        for ino in dirs {
            if let Err(e) = self.read_directory(ino, &mut raw_entries) {
                self.warn(e)?;
            }
        }
        for (ino, data) in inline_dirs {
            if let Err(e) = parse_inline_dir(ino, &data, &mut raw_entries) {
                self.warn(e)?;
            }
        }
        Ok(raw_entries)
    }

    /// Sort the entries by (dir, name) into directory records and entry records (names go to
    /// the arena); entries pointing to inodes not in use are dropped and returned as errors.
    fn path_tree(
        &mut self,
        mut raw_entries: RawEntries,
    ) -> Result<(Vec<DirRec>, Vec<EntryRec>, Vec<Error>)> {
        raw_entries.sort_dedup();
        let mut dirs: Vec<DirRec> = Vec::new();
        let mut entries: Vec<EntryRec> = Vec::with_capacity(raw_entries.recs.len());
        let mut dangling = Vec::new();
        for e in &raw_entries.recs {
            let (dir, target, name) = (e.dir, e.target, raw_entries.name(e));
            if self
                .inodes
                .binary_search_by_key(&target, |r| r.ino)
                .is_err()
            {
                dangling.push(Error::inode(
                    dir,
                    format!(
                        "entry {:?} points to inode {target}, which is not in use",
                        String::from_utf8_lossy(name)
                    ),
                ));
                continue;
            }
            if dirs.last().is_none_or(|d| d.ino != dir) {
                dirs.push(DirRec {
                    ino: dir,
                    first_entry: entries.len() as u32,
                });
            }
            let name_off = self
                .strings
                .intern(&mut self.arena, name)
                .ok_or_else(|| Error::Limit("name arena exceeds 4 GiB".into()))?;
            entries.push(EntryRec {
                ino: target,
                name_off,
                name_len: e.name_len,
                file_type: e.ftype,
                block: e.block,
            });
        }
        self.add_empty_dirs(&mut dirs, entries.len() as u32);
        Ok((dirs, entries, dangling))
    }

    /// Give directories that exist but have no entries an (empty) record; they take the start
    /// of the next directory (or `n_entries`) so that `first_entry` stays monotonic.
    fn add_empty_dirs(&self, dirs: &mut Vec<DirRec>, n_entries: u32) {
        let empty: Vec<DirRec> = self
            .inodes
            .iter()
            .filter(|r| {
                FileKind::from_mode(r.mode) == FileKind::Directory
                    && dirs.binary_search_by_key(&r.ino, |d| d.ino).is_err()
            })
            .map(|r| DirRec {
                ino: r.ino,
                first_entry: u32::MAX,
            })
            .collect();
        dirs.extend(empty);
        dirs.sort_by_key(|d| d.ino);
        let mut next = n_entries;
        for d in dirs.iter_mut().rev() {
            if d.first_entry == u32::MAX {
                d.first_entry = next;
            } else {
                next = d.first_entry;
            }
        }
    }

    /// Move the crawled tables out (first links and the physical order are filled in
    /// afterwards).
    fn take_tables(&mut self, dirs: Vec<DirRec>, entries: Vec<EntryRec>) -> Tables {
        let owners = std::mem::take(&mut self.owners);
        self.strings = Interner::default();
        Tables {
            inodes: std::mem::take(&mut self.inodes),
            extents: std::mem::take(&mut self.runs),
            dirs,
            entries,
            blobs: std::mem::take(&mut self.blobs),
            arena: std::mem::take(&mut self.arena),
            owners: owners.pairs,
            owner_x: owners.overflow,
            parents: Vec::new(),
        }
    }

    /// File-system facts for the index.
    fn fs_info(&self, partition_start: u64) -> FsInfo {
        let sb = &self.sb;
        FsInfo {
            partition_start,
            block_size: sb.block_size,
            blocks_count: sb.blocks_count,
            inodes_count: sb.inodes_count,
            inodes_per_group: sb.inodes_per_group,
            blocks_per_group: sb.blocks_per_group,
            group_count: sb.group_count,
            first_data_block: sb.first_data_block,
            inode_size: sb.inode_size,
            features: [sb.compat, sb.incompat, sb.ro_compat],
            uuid: sb.uuid,
            volume_name: sb.volume_name.clone(),
            last_mounted: sb.last_mounted.clone(),
            journal_ino: sb.journal_ino,
            inode_tables: self.groups.iter().map(|g| g.inode_table).collect(),
        }
    }

    /// Order the runs by physical block (returned), add the dropped-warnings note and trim
    /// the tables.
    fn seal(&mut self, t: &mut Tables) -> Vec<u32> {
        let mut order: Vec<u32> = (0..t.extents.len() as u32).collect();
        order.sort_by_key(|&i| t.extents[i as usize].phys());
        if self.dropped_warnings > 0 {
            self.warnings.push(Warning {
                ino: None,
                message: format!("{} further warnings were dropped", self.dropped_warnings),
            });
        }
        t.shrink();
        order
    }

    fn read_directory(&mut self, ino: u32, out: &mut RawEntries) -> Result<()> {
        let i = self
            .inodes
            .binary_search_by_key(&ino, |r| r.ino)
            .map_err(|_| Error::inode(ino, "directory vanished"))?;
        let rec = self.inodes[i];
        let end = self
            .inodes
            .get(i + 1)
            .map_or(self.runs.len(), |n| n.first_extent as usize);
        let runs: Vec<Run> = self
            .runs
            .get(rec.first_extent as usize..end)
            .unwrap_or(&[])
            .to_vec();
        let bs = u64::from(self.sb.block_size);
        let nblocks = rec.size.div_ceil(bs);
        if rec.size > MAX_DIR_BYTES {
            return Err(Error::inode(
                ino,
                format!(
                    "directory size {} exceeds the {MAX_DIR_BYTES}-byte limit",
                    rec.size
                ),
            ));
        }
        for r in runs.iter().filter(|r| r.kind() == RUN_DATA) {
            let first = u64::from(r.logical);
            if first >= nblocks {
                continue;
            }
            let count = u64::from(r.len).min(nblocks - first);
            let mut done = 0;
            while done < count {
                let n = (count - done).min(CHUNK / bs).max(1);
                let buf = self.read(r.phys() + done, n)?;
                for (k, blk) in buf.chunks_exact(bs as usize).enumerate() {
                    // Which directory block holds each entry lets the inference engine diff
                    // one block without reading the others.
                    let fb = first + done + k as u64;
                    let block = u16::try_from(fb).unwrap_or(NO_BLOCK);
                    parse_dir_block(ino, blk, block, out)?;
                }
                done += n;
            }
        }
        Ok(())
    }
}

/// The directory entries found by the crawl, before they become the index's entry table:
/// fixed-size records, their names in one buffer. (A `Vec<u8>` per name cost about 70 bytes
/// per entry at the crawl's peak, more than the whole index keeps per inode.)
#[derive(Default)]
struct RawEntries {
    recs: Vec<RawEntry>,
    names: Vec<u8>,
}

/// One directory entry: directory, target inode, name (in [`RawEntries::names`]), file type,
/// directory block index (`NO_BLOCK` for inline directories and blocks past 65534).
#[derive(Debug, Clone, Copy)]
struct RawEntry {
    dir: u32,
    target: u32,
    name_off: u32,
    block: u16,
    name_len: u8,
    ftype: u8,
}

impl RawEntry {
    /// The entry's name in `names` (its [`RawEntries::names`]).
    fn name_in<'n>(&self, names: &'n [u8]) -> &'n [u8] {
        &names[self.name_off as usize..][..usize::from(self.name_len)]
    }
}

impl RawEntries {
    /// Appends an entry; names are at most 255 bytes (ext4's `name_len` is one byte).
    fn push(&mut self, dir: u32, name: &[u8], target: u32, ftype: u8, block: u16) -> Result<()> {
        let name_off = u32::try_from(self.names.len())
            .map_err(|_| Error::Limit("directory names exceed 4 GiB".into()))?;
        let name_len = u8::try_from(name.len())
            .map_err(|_| Error::inode(dir, "directory entry name longer than 255 bytes"))?;
        self.names.extend_from_slice(name);
        self.recs.push(RawEntry {
            dir,
            target,
            name_off,
            block,
            name_len,
            ftype,
        });
        Ok(())
    }

    fn name(&self, e: &RawEntry) -> &[u8] {
        e.name_in(&self.names)
    }

    /// Sorts by (directory, name) and keeps the first entry found of each pair: names are
    /// appended in the order found, so the name offset orders equal pairs the way a stable
    /// sort would, without its buffer of half the records.
    fn sort_dedup(&mut self) {
        let names = &self.names;
        let name = |e: &RawEntry| e.name_in(names);
        self.recs.sort_unstable_by(|a, b| {
            (a.dir, name(a), a.name_off).cmp(&(b.dir, name(b), b.name_off))
        });
        self.recs
            .dedup_by(|a, b| a.dir == b.dir && name(a) == name(b));
    }
}

/// Parse the entries of an inline directory: a 4-byte parent inode, then entries; the xattr
/// part (past byte 60) is a second entry area.
fn parse_inline_dir(ino: u32, data: &[u8], out: &mut RawEntries) -> Result<()> {
    let first = data.get(4..60.min(data.len())).unwrap_or(&[]);
    parse_dir_block(ino, first, NO_BLOCK, out)?;
    if data.len() > 60 {
        parse_dir_block(ino, &data[60..], NO_BLOCK, out)?;
    }
    Ok(())
}

/// The fixed metadata ranges of every group (superblock and descriptor copies, bitmaps,
/// inode table), sorted by first block.
fn meta_ranges(sb: &Super, groups: &[Group]) -> Vec<MetaRange> {
    let mut meta = Vec::new();
    let it_blocks = (u64::from(sb.inodes_per_group) * u64::from(sb.inode_size))
        .div_ceil(u64::from(sb.block_size)) as u32;
    for g in 0..sb.group_count {
        push_descriptor_ranges(sb, g, &mut meta);
        let grp = groups[g as usize];
        meta.push(MetaRange {
            start: grp.block_bitmap,
            len: 1,
            group: g,
            kind: META_BLOCK_BITMAP,
        });
        meta.push(MetaRange {
            start: grp.inode_bitmap,
            len: 1,
            group: g,
            kind: META_INODE_BITMAP,
        });
        meta.push(MetaRange {
            start: grp.inode_table,
            len: it_blocks,
            group: g,
            kind: META_INODE_TABLE,
        });
    }
    meta.sort_by_key(|m| m.start);
    meta
}

/// Push group `g`'s superblock copy, classic and reserved descriptor blocks, and its
/// meta_bg descriptor block, where it has them.
fn push_descriptor_ranges(sb: &Super, g: u32, meta: &mut Vec<MetaRange>) {
    let meta_bg = sb.incompat & INCOMPAT_META_BG != 0;
    let dpb = sb.descs_per_block();
    let first = sb.group_first_block(g);
    if sb.has_super(g) {
        let sb_block = if g == 0 {
            u64::from(sb.first_data_block)
        } else {
            first
        };
        meta.push(MetaRange {
            start: sb_block,
            len: 1,
            group: g,
            kind: META_SUPERBLOCK,
        });
        let classic = if meta_bg {
            sb.first_meta_bg.min(sb.gdt_blocks())
        } else {
            sb.gdt_blocks()
        };
        if classic > 0 {
            meta.push(MetaRange {
                start: sb_block + 1,
                len: classic,
                group: g,
                kind: META_GDT,
            });
        }
        if sb.reserved_gdt > 0 {
            meta.push(MetaRange {
                start: sb_block + 1 + u64::from(classic),
                len: u32::from(sb.reserved_gdt),
                group: g,
                kind: META_RESERVED_GDT,
            });
        }
    }
    if meta_bg {
        let m = g / dpb;
        let pos = g % dpb;
        if m >= sb.first_meta_bg && (pos == 0 || pos == 1 || pos == dpb - 1) {
            meta.push(MetaRange {
                start: first + u64::from(sb.has_super(g)),
                len: 1,
                group: g,
                kind: META_GDT,
            });
        }
    }
}

/// Walk the directory tree breadth-first from the root, setting each inode's first link;
/// returns the directories linked a second time (loops or directory hard links).
fn link_from_root(index: &mut Tables) -> Vec<Error> {
    let mut loops = Vec::new();
    let mut visited: HashSet<u32> = HashSet::new();
    let mut queue = VecDeque::new();
    visited.insert(2);
    queue.push_back(2u32);
    while let Some(d) = queue.pop_front() {
        let Ok(di) = index.dirs.binary_search_by_key(&d, |x| x.ino) else {
            continue;
        };
        let start = index.dirs[di].first_entry as usize;
        let end = index
            .dirs
            .get(di + 1)
            .map_or(index.entries.len(), |x| x.first_entry as usize);
        for ei in start..end {
            let t = index.entries[ei].ino;
            let Ok(ti) = index.inodes.binary_search_by_key(&t, |r| r.ino) else {
                continue;
            };
            let is_dir = FileKind::from_mode(index.inodes[ti].mode) == FileKind::Directory;
            if index.inodes[ti].first_link == NO_LINK && t != 2 {
                index.inodes[ti].first_link = ei as u32;
            }
            if is_dir && !visited.insert(t) {
                loops.push(Error::DirectoryTree(format!(
                    "directory inode {t} is linked a second time from directory inode {d} (a loop or a directory hard link)"
                )));
            } else if is_dir {
                queue.push_back(t);
            }
        }
    }
    loops
}

/// Parse one directory block (or inline area) into [`RawEntries`], skipping `.`, `..`, empty
/// slots, htree node headers and the checksum tail.
fn parse_dir_block(dir: u32, blk: &[u8], block: u16, out: &mut RawEntries) -> Result<()> {
    let mut p = 0usize;
    while p + 8 <= blk.len() {
        let ino = le32(blk, p);
        let mut rec_len = usize::from(le16(blk, p + 4));
        if blk.len() >= 65536 && (rec_len == 65535 || rec_len == 0) {
            rec_len = 65536;
        }
        let name_len = usize::from(blk[p + 6]);
        let ftype = blk[p + 7];
        if rec_len < 8 || !rec_len.is_multiple_of(4) || p + rec_len > blk.len() {
            return Err(Error::inode(
                dir,
                format!("directory entry at offset {p} has invalid record length {rec_len}"),
            ));
        }
        if ino != 0 {
            if 8 + name_len > rec_len || name_len == 0 {
                return Err(Error::inode(dir, format!("directory entry at offset {p} has name length {name_len} for record length {rec_len}")));
            }
            let name = &blk[p + 8..p + 8 + name_len];
            if name != b"." && name != b".." {
                if name.contains(&b'/') || name.contains(&0) {
                    return Err(Error::inode(
                        dir,
                        "directory entry name contains '/' or NUL",
                    ));
                }
                out.push(dir, name, ino, ftype, block)?;
            }
        }
        p += rec_len;
    }
    Ok(())
}

/// The inline data of a raw inode record: `i_block` (60 bytes) followed by the value of the
/// in-inode `system.data` extended attribute. Shared by the crawler (strict) and the inference
/// engine (lenient). Each xattr entry is at least 16 bytes, so the walk is bounded by the
/// inode size.
pub(crate) fn inline_data_raw(raw: &[u8]) -> std::result::Result<Vec<u8>, &'static str> {
    let mut data = raw.get(40..100).unwrap_or(&[]).to_vec();
    let extra = if raw.len() > 128 {
        usize::from(le16(raw, 128))
    } else {
        0
    };
    let start = 128 + extra;
    if raw.len() >= start + 4 && le32(raw, start) == 0xEA02_0000 {
        let base = start + 4;
        let mut p = base;
        while p + 16 <= raw.len() && le32(raw, p) != 0 {
            let name_len = usize::from(raw[p]);
            let index = raw[p + 1];
            let voff = usize::from(le16(raw, p + 2));
            let vsize = le32(raw, p + 8) as usize;
            let name = raw
                .get(p + 16..p + 16 + name_len)
                .ok_or("in-inode xattr name runs past the inode")?;
            if index == 7 && name == b"data" {
                let v = raw
                    .get(base.saturating_add(voff)..base.saturating_add(voff).saturating_add(vsize))
                    .ok_or("system.data value runs past the inode")?;
                data.extend_from_slice(v);
                break;
            }
            p += (16 + name_len + 3) & !3;
        }
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirent(buf: &mut Vec<u8>, ino: u32, rec_len: u16, name: &[u8], ftype: u8) {
        buf.extend_from_slice(&ino.to_le_bytes());
        buf.extend_from_slice(&rec_len.to_le_bytes());
        buf.push(name.len() as u8);
        buf.push(ftype);
        buf.extend_from_slice(name);
        buf.resize(buf.len() + usize::from(rec_len) - 8 - name.len(), 0);
    }

    #[test]
    fn directory_block_parsing() {
        let mut b = Vec::new();
        dirent(&mut b, 2, 12, b".", 2);
        dirent(&mut b, 2, 12, b"..", 2);
        dirent(&mut b, 0, 16, b"gone", 1); // deleted slot
        dirent(&mut b, 12, 1024 - 40, b"file", 1);
        let mut out = RawEntries::default();
        parse_dir_block(2, &b, 0, &mut out).expect("valid block");
        assert_eq!(out.recs.len(), 1);
        let e = out.recs[0];
        assert_eq!((e.dir, e.target, e.ftype, e.block), (2, 12, 1, 0));
        assert_eq!(out.name(&e), b"file");

        let mut bad = b.clone();
        bad[4] = 7; // rec_len not a multiple of 4
        assert!(parse_dir_block(2, &bad, 0, &mut out).is_err());
        let mut bad = b.clone();
        bad[4..6].copy_from_slice(&2000u16.to_le_bytes()); // past the block
        assert!(parse_dir_block(2, &bad, 0, &mut out).is_err());
        let mut bad = b;
        bad[40 + 8] = b'/';
        let e = parse_dir_block(2, &bad, 0, &mut out).expect_err("slash");
        assert!(e.to_string().contains("'/'"));
    }

    /// Entries sort by (directory, name); of two entries with the same directory and name
    /// (a corrupt directory) the one found first stays, as with a stable sort.
    #[test]
    fn raw_entries_sort_by_directory_and_name_and_keep_the_first_duplicate() {
        let mut r = RawEntries::default();
        for (dir, name, target) in [
            (5, &b"b"[..], 50),
            (3, b"zz", 30),
            (5, b"a", 51),
            (5, b"b", 52),
            (3, b"z", 31),
            (5, b"b", 53),
        ] {
            r.push(dir, name, target, 1, 0).expect("push");
        }
        r.sort_dedup();
        let got: Vec<(u32, Vec<u8>, u32)> = r
            .recs
            .iter()
            .map(|e| (e.dir, r.name(e).to_vec(), e.target))
            .collect();
        assert_eq!(
            got,
            vec![
                (3, b"z".to_vec(), 31),
                (3, b"zz".to_vec(), 30),
                (5, b"a".to_vec(), 51),
                (5, b"b".to_vec(), 50),
            ]
        );
    }

    #[test]
    fn superblock_validation() {
        let opts = CrawlOptions::default();
        let mut sb = vec![0u8; 1024];
        assert!(matches!(
            parse_super(&sb, 1 << 20, &opts),
            Err(Error::BadMagic { found: 0 })
        ));
        sb[56..58].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[4..8].copy_from_slice(&1024u32.to_le_bytes()); // blocks
        sb[20..24].copy_from_slice(&1u32.to_le_bytes()); // first data block
        sb[32..36].copy_from_slice(&8192u32.to_le_bytes());
        sb[40..44].copy_from_slice(&256u32.to_le_bytes());
        sb[0..4].copy_from_slice(&256u32.to_le_bytes());
        sb[76..80].copy_from_slice(&1u32.to_le_bytes());
        sb[84..88].copy_from_slice(&11u32.to_le_bytes());
        sb[88..90].copy_from_slice(&128u16.to_le_bytes());
        let s = parse_super(&sb, 1 << 20, &opts).expect("valid");
        assert_eq!((s.block_size, s.group_count), (1024, 1));
        let e = parse_super(&sb, 1000 * 1024, &opts)
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("truncated")));
        sb[88..90].copy_from_slice(&100u16.to_le_bytes());
        assert!(parse_super(&sb, 1 << 20, &opts).is_err());
    }

    #[test]
    fn sparse_super_groups() {
        let opts = CrawlOptions::default();
        let mut sb = vec![0u8; 1024];
        sb[56..58].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[4..8].copy_from_slice(&(100 * 8192u32).to_le_bytes());
        sb[32..36].copy_from_slice(&8192u32.to_le_bytes());
        sb[40..44].copy_from_slice(&16u32.to_le_bytes());
        sb[0..4].copy_from_slice(&1600u32.to_le_bytes());
        sb[24..28].copy_from_slice(&2u32.to_le_bytes()); // 4 KiB
        sb[100..104].copy_from_slice(&RO_SPARSE_SUPER.to_le_bytes());
        let s = parse_super(&sb, 1 << 32, &opts).expect("valid");
        let with: Vec<u32> = (0..100).filter(|&g| s.has_super(g)).collect();
        assert_eq!(with, vec![0, 1, 3, 5, 7, 9, 25, 27, 49, 81]);
    }
}
