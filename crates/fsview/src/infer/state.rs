//! The engine's overlay state: inodes and directories changed since the crawl, parsed from
//! written blocks. Parsing here is lenient and bounded: a damaged inode or directory block
//! becomes an error value the engine counts, never a panic.

use crate::index::{
    FileKind, InodeMeta, Run, RUN_DATA, RUN_EXTENT_TREE, RUN_INDIRECT, RUN_UNWRITTEN, RUN_XATTR,
};
use std::collections::{BTreeMap, HashSet};

const FL_EXTENTS: u32 = 0x8_0000;
const FL_INLINE_DATA: u32 = 0x1000_0000;
const FL_HUGE_FILE: u32 = 0x4_0000;
const MAX_EXTENT_DEPTH: u16 = 5;
/// Most runs one inode may map in the overlay (bounds memory for absurd maps).
const MAX_RUNS: usize = 1 << 20;

pub(crate) fn le16(b: &[u8], o: usize) -> u16 {
    b.get(o..o + 2)
        .map_or(0, |s| u16::from_le_bytes([s[0], s[1]]))
}
pub(crate) fn le32(b: &[u8], o: usize) -> u32 {
    b.get(o..o + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// An inode as the engine keeps it after a write changed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Inode {
    pub meta: InodeMeta,
    /// Data, directory, extent-tree, indirect and xattr runs (same form as the index).
    pub runs: Vec<Run>,
    /// Symlink target, inline file data, or the raw inline area of an inline directory.
    pub blob: Option<Vec<u8>>,
    pub inline: bool,
    /// `i_generation`, new for every allocation of the inode (`None`: not known, from the crawl).
    pub generation: Option<u32>,
}

impl Inode {
    pub fn kind(&self) -> FileKind {
        self.meta.kind()
    }
    pub fn heap_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>()
            + self.blob.as_ref().map_or(0, Vec::capacity)
    }
}

/// File-system geometry the parser needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub block_size: u32,
    pub blocks_count: u64,
    pub first_data_block: u32,
    pub huge_file: bool,
}

impl Geometry {
    fn valid(&self, b: u64) -> bool {
        b >= u64::from(self.first_data_block) && b < self.blocks_count
    }
}

/// Reads a metadata block through the engine (committed journal copies first, then disk).
pub(crate) type ReadFn<'a> = &'a mut dyn FnMut(u64) -> Option<Vec<u8>>;

/// Parse on-disk inode `raw`; `Ok(None)` if it is not in use (mode 0 or no links).
pub(crate) fn parse_inode(
    ino: u32,
    raw: &[u8],
    g: &Geometry,
    read: ReadFn<'_>,
) -> Result<Option<Inode>, String> {
    let mode = le16(raw, 0);
    let links = le16(raw, 26);
    if mode == 0 || links == 0 {
        return Ok(None);
    }
    let extra = if raw.len() > 128 { le16(raw, 128) } else { 0 };
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
    if g.huge_file {
        blocks |= u64::from(le16(raw, 116)) << 32;
    }
    let blocks_fs = if g.huge_file && flags & FL_HUGE_FILE != 0 {
        blocks
    } else {
        blocks / (u64::from(g.block_size) / 512)
    };
    let meta = InodeMeta {
        mode,
        uid: u32::from(le16(raw, 2)) | u32::from(le16(raw, 120)) << 16,
        gid: u32::from(le16(raw, 24)) | u32::from(le16(raw, 122)) << 16,
        size,
        mtime: time(16, 136),
        ctime: time(12, 132),
        atime: time(8, 140),
        links,
    };
    let mut m = Mapper {
        g,
        read,
        runs: Vec::new(),
        budget: blocks_fs.min(g.blocks_count),
        visited: HashSet::new(),
        ino,
    };
    let kind = meta.kind();
    let file_acl = u64::from(le32(raw, 104)) | u64::from(le16(raw, 118)) << 32;
    if file_acl != 0 && g.valid(file_acl) {
        m.push(Run::new(file_acl, 0, 1, RUN_XATTR));
        m.budget = m.budget.saturating_sub(1);
    }
    let iblock = raw.get(40..100).unwrap_or(&[]);
    let mut inode = Inode {
        meta,
        runs: Vec::new(),
        blob: None,
        inline: false,
        generation: Some(le32(raw, 100)),
    };
    if flags & FL_INLINE_DATA != 0 {
        let mut data = inline_bytes(raw);
        if kind != FileKind::Directory {
            data.truncate(usize::try_from(size).unwrap_or(usize::MAX));
        }
        inode.blob = Some(data);
        inode.inline = true;
        inode.runs = m.runs;
        return Ok(Some(inode));
    }
    if kind == FileKind::Symlink && size < 60 && m.budget == 0 && flags & FL_EXTENTS == 0 {
        inode.blob = Some(iblock.get(..size as usize).unwrap_or(&[]).to_vec());
        inode.runs = m.runs;
        return Ok(Some(inode));
    }
    if matches!(
        kind,
        FileKind::CharDevice | FileKind::BlockDevice | FileKind::Fifo | FileKind::Socket
    ) {
        inode.runs = m.runs;
        return Ok(Some(inode));
    }
    if flags & FL_EXTENTS != 0 {
        m.extents(iblock, None, 0)?;
    } else {
        m.blockmap(iblock)?;
    }
    inode.runs = m.runs;
    if kind == FileKind::Symlink {
        inode.blob = Some(symlink_target(&inode, m.read));
    }
    Ok(Some(inode))
}

/// A slow symlink's target from its first data block (empty if not readable yet).
pub(crate) fn symlink_target(inode: &Inode, read: ReadFn<'_>) -> Vec<u8> {
    let len = usize::try_from(inode.meta.size.min(4096)).unwrap_or(0);
    let first = inode
        .runs
        .iter()
        .find(|r| r.kind() == RUN_DATA && r.logical == 0)
        .map(Run::phys);
    first
        .and_then(read)
        .and_then(|b| b.get(..len).map(<[u8]>::to_vec))
        .unwrap_or_default()
}

/// Inline data: `i_block` plus the in-inode `system.data` xattr value; a damaged xattr area
/// leaves the `i_block` bytes only (the engine is lenient where the crawler is strict).
fn inline_bytes(raw: &[u8]) -> Vec<u8> {
    crate::ext4::inline_data_raw(raw).unwrap_or_else(|_| raw.get(40..100).unwrap_or(&[]).to_vec())
}

struct Mapper<'g, 'r> {
    g: &'g Geometry,
    read: ReadFn<'r>,
    runs: Vec<Run>,
    budget: u64,
    visited: HashSet<u64>,
    ino: u32,
}

impl Mapper<'_, '_> {
    /// Same merging rule as the crawler, so an unchanged map compares equal to the index.
    fn push(&mut self, r: Run) {
        if let Some(last) = self.runs.last_mut() {
            if last.kind() == r.kind()
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

    fn charge(&mut self, n: u64) -> Result<(), String> {
        if self.runs.len() > MAX_RUNS {
            return Err(format!("inode {} maps more than {MAX_RUNS} runs", self.ino));
        }
        self.budget = self.budget.checked_sub(n).ok_or_else(|| {
            format!(
                "inode {} maps more blocks than its i_blocks count",
                self.ino
            )
        })?;
        Ok(())
    }

    fn extents(&mut self, node: &[u8], expect: Option<u16>, level: u32) -> Result<(), String> {
        let ino = self.ino;
        if le16(node, 0) != 0xF30A {
            return Err(format!("inode {ino}: bad extent header magic"));
        }
        let entries = usize::from(le16(node, 2));
        let depth = le16(node, 6);
        let cap = node.len().saturating_sub(12) / 12;
        if entries > cap
            || depth > MAX_EXTENT_DEPTH
            || expect.is_some_and(|d| d != depth)
            || level > u32::from(MAX_EXTENT_DEPTH)
        {
            return Err(format!("inode {ino}: invalid extent node"));
        }
        for i in 0..entries {
            let e = node.get(12 + 12 * i..24 + 12 * i).unwrap_or(&[]);
            let logical = le32(e, 0);
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
                if !self.g.valid(phys) || !self.g.valid(phys + u64::from(len) - 1) {
                    return Err(format!(
                        "inode {ino}: extent past the end of the file system"
                    ));
                }
                self.charge(u64::from(len))?;
                let kind = if unwritten {
                    RUN_DATA | RUN_UNWRITTEN
                } else {
                    RUN_DATA
                };
                self.push(Run::new(phys, logical, u32::from(len), kind));
            } else {
                let child = u64::from(le16(e, 8)) << 32 | u64::from(le32(e, 4));
                if !self.g.valid(child) || !self.visited.insert(child) {
                    return Err(format!("inode {ino}: bad or looping extent index"));
                }
                self.charge(1)?;
                self.push(Run::new(child, 0, 1, RUN_EXTENT_TREE));
                let buf = (self.read)(child)
                    .ok_or_else(|| format!("inode {ino}: extent node {child} unreadable"))?;
                self.extents(&buf, Some(depth - 1), level + 1)?;
            }
        }
        Ok(())
    }

    fn blockmap(&mut self, iblock: &[u8]) -> Result<(), String> {
        let per = u64::from(self.g.block_size / 4);
        for i in 0..12 {
            let b = u64::from(le32(iblock, i * 4));
            self.ptr(b, i as u64)?;
        }
        let mut logical = 12u64;
        for (slot, level) in [(12usize, 1u32), (13, 2), (14, 3)] {
            let b = u64::from(le32(iblock, slot * 4));
            if b != 0 {
                self.indirect(b, level, logical)?;
            }
            logical += per.pow(level);
        }
        Ok(())
    }

    fn ptr(&mut self, b: u64, logical: u64) -> Result<(), String> {
        if b == 0 {
            return Ok(());
        }
        if !self.g.valid(b) {
            return Err(format!("inode {}: block pointer outside", self.ino));
        }
        let logical = u32::try_from(logical)
            .map_err(|_| format!("inode {}: block map too deep", self.ino))?;
        self.charge(1)?;
        self.push(Run::new(b, logical, 1, RUN_DATA));
        Ok(())
    }

    fn indirect(&mut self, b: u64, level: u32, logical: u64) -> Result<(), String> {
        if !self.g.valid(b) || !self.visited.insert(b) {
            return Err(format!("inode {}: bad indirect block {b}", self.ino));
        }
        self.charge(1)?;
        self.push(Run::new(b, 0, 1, RUN_INDIRECT));
        let buf = (self.read)(b)
            .ok_or_else(|| format!("inode {}: indirect block {b} unreadable", self.ino))?;
        let per = u64::from(self.g.block_size / 4);
        let span = per.pow(level - 1);
        for i in 0..per {
            let p = u64::from(le32(&buf, (i * 4) as usize));
            if p == 0 {
                continue;
            }
            let l = logical + i * span;
            if level == 1 {
                self.ptr(p, l)?;
            } else {
                self.indirect(p, level - 1, l)?;
            }
        }
        Ok(())
    }
}

/// Directory entries by name: target inode and the entry's file-type byte.
pub(crate) type Entries = BTreeMap<Vec<u8>, (u32, u8)>;

/// Parse one directory block or inline area leniently into `out` (`.`/`..`, empty slots, htree
/// node headers and the checksum tail are skipped); `false` if the block is malformed (the
/// entries before the damage are kept).
pub(crate) fn parse_dir_block(blk: &[u8], out: &mut Entries) -> bool {
    let mut p = 0usize;
    while p + 8 <= blk.len() {
        let ino = le32(blk, p);
        let mut rec_len = usize::from(le16(blk, p + 4));
        if blk.len() >= 65536 && (rec_len == 65535 || rec_len == 0) {
            rec_len = 65536;
        }
        let name_len = usize::from(blk[p + 6]);
        let ftype = blk[p + 7];
        if rec_len < 8 || rec_len % 4 != 0 || p + rec_len > blk.len() {
            return false;
        }
        if ino != 0 {
            if 8 + name_len > rec_len || name_len == 0 {
                return false;
            }
            let name = &blk[p + 8..p + 8 + name_len];
            if name != b"." && name != b".." {
                if name.contains(&b'/') || name.contains(&0) {
                    return false;
                }
                out.insert(name.to_vec(), (ino, ftype));
            }
        }
        p += rec_len;
    }
    true
}

/// Entries of an inline directory from its raw inline area (4-byte parent, then entries; the
/// `system.data` part is a second entry area).
pub(crate) fn parse_inline_dir(data: &[u8], out: &mut Entries) -> bool {
    let first = data.get(4..60.min(data.len())).unwrap_or(&[]);
    let mut ok = parse_dir_block(first, out);
    if data.len() > 60 {
        ok &= parse_dir_block(&data[60..], out);
    }
    ok
}

/// File-type byte for a kind (directory entries).
pub(crate) fn ftype_of(k: FileKind) -> u8 {
    match k {
        FileKind::Regular => 1,
        FileKind::Directory => 2,
        FileKind::CharDevice => 3,
        FileKind::BlockDevice => 4,
        FileKind::Fifo => 5,
        FileKind::Socket => 6,
        FileKind::Symlink => 7,
        FileKind::Unknown => 0,
    }
}

/// Kind from a file-type byte.
pub(crate) fn kind_of_ftype(t: u8) -> FileKind {
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

    fn geo() -> Geometry {
        Geometry {
            block_size: 1024,
            blocks_count: 1000,
            first_data_block: 1,
            huge_file: false,
        }
    }

    #[test]
    fn parses_extent_inode_and_rejects_garbage() {
        let mut raw = vec![0u8; 256];
        raw[0..2].copy_from_slice(&0o100644u16.to_le_bytes());
        raw[4..8].copy_from_slice(&3000u32.to_le_bytes());
        raw[26..28].copy_from_slice(&1u16.to_le_bytes());
        raw[28..32].copy_from_slice(&6u32.to_le_bytes()); // 3 KiB in 512-byte units
        raw[32..36].copy_from_slice(&FL_EXTENTS.to_le_bytes());
        // Extent header + one extent: 3 blocks at 200.
        raw[40..42].copy_from_slice(&0xF30Au16.to_le_bytes());
        raw[42..44].copy_from_slice(&1u16.to_le_bytes());
        raw[44..46].copy_from_slice(&4u16.to_le_bytes());
        raw[52 + 4..52 + 6].copy_from_slice(&3u16.to_le_bytes());
        raw[52 + 8..52 + 12].copy_from_slice(&200u32.to_le_bytes());
        let mut read = |_b: u64| None;
        let i = parse_inode(12, &raw, &geo(), &mut read)
            .expect("valid")
            .expect("in use");
        assert_eq!(i.meta.size, 3000);
        assert_eq!(i.runs, vec![Run::new(200, 0, 3, RUN_DATA)]);
        // More blocks than i_blocks: an error, not a panic.
        raw[52 + 4..52 + 6].copy_from_slice(&300u16.to_le_bytes());
        assert!(parse_inode(12, &raw, &geo(), &mut read).is_err());
        // Random garbage never panics.
        let mut seed = 7u64;
        for _ in 0..2000 {
            for x in raw.iter_mut() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *x = (seed >> 56) as u8;
            }
            let mut read = |_b: u64| Some(vec![0xAB; 1024]);
            let _ = parse_inode(12, &raw, &geo(), &mut read);
            let mut e = Entries::new();
            let _ = parse_dir_block(&raw, &mut e);
            let _ = parse_inline_dir(&raw, &mut e);
        }
    }
}
