//! Lazy loading of the index (Gamma-Ray §VI-B): only what reverse-maps a write stays in
//! memory; inodes, block maps, directory entries and names are read from a section file when
//! a query first needs them, and kept in a bounded cache.
//!
//! ## Design
//!
//! [`Index::into_lazy`] writes the crawled index to a file and keeps resident only:
//! - the **run map**: every run of blocks an inode owns (data, directory, extent-tree,
//!   indirect, xattr), sorted by disk block, with its owner's inode number and whether the
//!   owner is a directory (20 bytes per run). With the fixed-metadata ranges (a handful per
//!   block group) it answers [`Index::owner`] exactly as the eager index does, with two binary
//!   searches and no I/O: the write path never waits for the file.
//! - the **section directory** (24 bytes per non-empty section) and the hard-link table (8
//!   bytes per entry of a file with several names, or of a name that is not its file's
//!   primary one).
//!
//! Everything else lives in **sections**: section `s` holds what is keyed by the inode numbers
//! `s·N+1 ..= (s+1)·N` (`N` = [`LazyConfig::section_inodes`], 256 by default): those inodes'
//! records, runs (in file order), symlink targets and inline data, and the entries and names
//! of the directories among them. Every query is keyed by an inode (a file's metadata or block
//! map, a directory's entries, the parent link a path is built from), so each loads one
//! section; a path loads the sections of its ancestors.
//!
//! Why inode ranges and not block groups: ext4 block groups hold 8192 inodes by default
//! (~0.8 MB of index each), so a write to one file would load a seventh of the 56 600-inode
//! tree of a `/usr/share`; Gamma-Ray loads per file. 256 inodes keep the unit near what one directory's files occupy
//! (ext4 allocates a directory's files next to it in inode order), while the per-section cost
//! (directory entry, cache slot, decode) stays below 1.5 bytes per inode.
//!
//! Why a file and not the disk image: the image moves ahead of the write stream (the guest is
//! already writing while the crawl's state is the engine's base), so a section read from the
//! image would already hold the new state and the engine would miss the change. The section
//! file is the crawl-time snapshot.
//!
//! Loaded sections are kept in a cache bounded by count ([`LazyConfig::max_sections`]) and
//! bytes ([`LazyConfig::max_bytes`]); the least recently used section is evicted first, and
//! read again when asked for (a single section larger than the byte bound is kept alone).
//! [`LazyStats`] counts loads, evictions, load time, resident and peak resident bytes and the
//! share of the tree loaded.
//!
//! ## The file
//!
//! Private (created `0600`, never overwritten: an existing file is an error) and untrusted
//! when read: a 40-byte prologue (magic `VMSFSLZ1`, version, header offset and length, CRC-32C
//! of the header and of the prologue), the sections (postcard, each with its own CRC-32C in
//! the directory), then the header (postcard: file-system facts, fixed metadata, warnings, run
//! map, section directory, link table). Lengths are checked against the file, checksums before
//! decoding (all sections' when the file is opened, each one's again when it is loaded), and
//! the decoded tables against the invariants the lookups rely on; a damaged file is an
//! [`Error::LazyIndex`] naming the path. A section that fails when it is loaded later (the
//! file changed under the index after it was opened) is counted in [`LazyStats::load_errors`]
//! with its message, and the query answers as if the section were empty.

use super::tables::{EntryRec, InodeRec, Interner, OwnerTable, Run, Tables, NO_LINK};
use super::{Eager, FileKind, FsInfo, MetaRange, Warning};
use crate::crc::crc32c_raw;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

const MAGIC: &[u8; 8] = b"VMSFSLZ1";
const VERSION: u32 = 1;
const PROLOGUE: usize = 40;
/// `ResRun::flags`: the owner is a directory.
const RES_DIR: u8 = 1;
/// `ResRun::flags`: the run comes before the first inode's runs (owned by nobody).
const RES_ORPHAN: u8 = 2;

/// Tuning of a lazy index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyConfig {
    /// Inodes per section, the unit read from the file (1..=65535; when a file is reopened,
    /// the value it was written with).
    pub section_inodes: u32,
    /// Most sections kept loaded.
    pub max_sections: usize,
    /// Most bytes of loaded sections kept.
    pub max_bytes: u64,
    /// Remove the file's name once it is open (the index keeps its descriptor), so nothing is
    /// left behind, not even after a crash.
    pub unlink: bool,
}

impl Default for LazyConfig {
    fn default() -> Self {
        LazyConfig {
            section_inodes: 256,
            max_sections: 4096,
            max_bytes: 8 << 20,
            unlink: false,
        }
    }
}

/// Counters of a lazy index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LazyStats {
    /// Non-empty sections in the file.
    pub sections: u64,
    /// Sections loaded now.
    pub sections_cached: u64,
    /// Section reads from the file (first loads and re-reads after eviction).
    pub loads: u64,
    /// Sections evicted from the cache.
    pub evictions: u64,
    /// Time spent reading, checking and decoding sections.
    pub load_ns: u64,
    /// Bytes held now: the resident part plus the loaded sections.
    pub resident_bytes: u64,
    /// Largest `resident_bytes` seen.
    pub peak_resident_bytes: u64,
    /// Bytes always resident (run map, section directory, link table, metadata ranges).
    pub fixed_bytes: u64,
    /// In-use inodes in the index.
    pub inodes: u64,
    /// In-use inodes of the sections loaded at least once (the share of the tree loaded).
    pub inodes_loaded: u64,
    /// Section loads that failed (the file was damaged after it was opened).
    pub load_errors: u64,
    /// The last load error.
    pub last_error: Option<String>,
    /// Size of the section file.
    pub file_bytes: u64,
}

/// One run of the resident run map (20 bytes), sorted by disk block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ResRun {
    phys_lo: u32,
    phys_hi: u16,
    /// Run kind as in [`Run::kind`].
    pub kind: u8,
    flags: u8,
    pub logical: u32,
    pub len: u32,
    pub ino: u32,
}

impl ResRun {
    fn new(r: &Run, ino: u32, flags: u8) -> Self {
        let p = r.phys();
        ResRun {
            phys_lo: p as u32,
            phys_hi: (p >> 32) as u16,
            kind: r.kind(),
            flags,
            logical: r.logical,
            len: r.len,
            ino,
        }
    }
    pub fn phys(&self) -> u64 {
        u64::from(self.phys_lo) | u64::from(self.phys_hi) << 32
    }
    pub fn is_dir(&self) -> bool {
        self.flags & RES_DIR != 0
    }
    pub fn is_orphan(&self) -> bool {
        self.flags & RES_ORPHAN != 0
    }
}

/// Where one section is in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct SectionInfo {
    off: u64,
    /// Section number (inodes `sec·N+1 ..= (sec+1)·N`).
    sec: u32,
    len: u32,
    crc: u32,
    /// In-use inodes in it.
    inodes: u32,
}

/// One directory holding an entry of a file whose names are not just its primary link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
struct NameRef {
    ino: u32,
    dir: u32,
}

/// Counts of the whole index (for [`super::Index::stats`] without loading anything).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub inodes: u64,
    pub directories: u64,
    pub regular_files: u64,
    pub symlinks: u64,
    pub entries: u64,
    pub runs: u64,
}

#[derive(Serialize, Deserialize)]
struct Header {
    fs: FsInfo,
    meta: Vec<MetaRange>,
    warnings: Vec<Warning>,
    section_inodes: u32,
    runs: Vec<ResRun>,
    sections: Vec<SectionInfo>,
    names: Vec<NameRef>,
    counts: Counts,
}

fn crc(b: &[u8]) -> u32 {
    !crc32c_raw(!0, b)
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::LazyIndex {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io<'a>(path: &'a Path, what: &str) -> impl FnOnce(std::io::Error) -> Error + 'a {
    let what = what.to_string();
    move |source| Error::Io {
        context: format!("{what} {}", path.display()),
        source,
    }
}

fn section_of(ino: u32, n: u32) -> u32 {
    ino.saturating_sub(1) / n.max(1)
}

// ---- writing --------------------------------------------------------------------------------

/// The section `sec` of an eager index: the inodes, runs, blobs and directories keyed by its
/// inode range, with offsets rebased and strings interned anew.
struct Splitter<'a> {
    t: &'a Tables,
    n: u32,
    /// (section, global index of its first entry), for sections holding directories.
    bases: Vec<(u32, u32)>,
}

impl<'a> Splitter<'a> {
    fn new(t: &'a Tables, n: u32) -> Self {
        let mut bases: Vec<(u32, u32)> = Vec::new();
        for d in &t.dirs {
            let s = section_of(d.ino, n);
            if bases.last().is_none_or(|b| b.0 != s) {
                bases.push((s, d.first_entry));
            }
        }
        Splitter { t, n, bases }
    }

    /// The primary link of the inode at `i` as (parent, index in the parent's section).
    fn link(&self, r: &InodeRec) -> Option<(u32, u32)> {
        if r.first_link == NO_LINK {
            return None;
        }
        self.t.entries.get(r.first_link as usize)?;
        let parent = self.t.dir_of_entry(r.first_link)?;
        let s = section_of(parent, self.n);
        let k = self.bases.binary_search_by_key(&s, |b| b.0).ok()?;
        let base = self.bases.get(k)?.1;
        Some((parent, r.first_link.checked_sub(base)?))
    }

    /// Whether the primary link of `ino` is an entry naming `ino` (then a file with just
    /// that one name needs no entry in the link table).
    fn primary_names_itself(&self, ino: u32) -> bool {
        let Some((_, r)) = self.t.rec(ino) else {
            return false;
        };
        self.link(r).is_some()
            && self
                .t
                .entries
                .get(r.first_link as usize)
                .is_some_and(|e| e.ino == ino)
    }

    fn section(
        &self,
        sec: u32,
        inos: &[InodeRec],
        first: usize,
        dirs: std::ops::Range<usize>,
    ) -> Tables {
        let t = self.t;
        let mut out = Tables::default();
        let mut owners = OwnerTable::default();
        let mut names = Interner::default();
        for (k, r) in inos.iter().enumerate() {
            let mut rec = *r;
            rec.first_extent = out.extents.len() as u32;
            out.extents.extend_from_slice(t.runs_at(first + k));
            let (uid, gid) = t.owner_of(r);
            rec.owner = owners.id(r.ino, uid, gid);
            match self.link(r) {
                Some((parent, local)) => {
                    rec.first_link = local;
                    out.parents.push(parent);
                }
                None => {
                    rec.first_link = NO_LINK;
                    out.parents.push(0);
                }
            }
            out.inodes.push(rec);
        }
        let lo = sec.saturating_mul(self.n);
        let hi = lo.saturating_add(self.n);
        let b0 = t.blobs.partition_point(|b| b.ino.saturating_sub(1) < lo);
        for b in t.blobs.iter().skip(b0) {
            if b.ino.saturating_sub(1) >= hi {
                break;
            }
            // Out of the arena (a damaged stored index): the eager lookup finds nothing either.
            let Some(bytes) = t.blob(b.ino, b.kind) else {
                continue;
            };
            let mut nb = *b;
            nb.off = names.intern(&mut out.arena, bytes).unwrap_or(0);
            nb.len = bytes.len() as u32;
            out.blobs.push(nb);
        }
        for d in t.dirs.get(dirs).unwrap_or(&[]) {
            out.dirs.push(super::tables::DirRec {
                ino: d.ino,
                first_entry: out.entries.len() as u32,
            });
            for e in t.dir_range(d.ino).unwrap_or(&[]) {
                let name = t.name(e);
                out.entries.push(EntryRec {
                    name_off: names.intern(&mut out.arena, name).unwrap_or(0),
                    name_len: name.len() as u8,
                    ..*e
                });
            }
        }
        out.owners = owners.pairs;
        out.owner_x = owners.overflow;
        out.shrink();
        out
    }

    /// Every directory holding an entry of a file whose entries are not exactly its primary
    /// link (hard links, names unreachable from the root, inconsistent stored indexes).
    fn name_table(&self) -> Vec<NameRef> {
        let t = self.t;
        let mut all: Vec<NameRef> = Vec::new();
        for d in &t.dirs {
            for e in t.dir_range(d.ino).unwrap_or(&[]) {
                all.push(NameRef {
                    ino: e.ino,
                    dir: d.ino,
                });
            }
        }
        all.sort_unstable();
        let mut out = Vec::new();
        for group in all.chunk_by(|a, b| a.ino == b.ino) {
            let derivable = usize::from(self.primary_names_itself(group[0].ino));
            if group.len() != derivable {
                out.extend(group.iter().copied());
            }
        }
        out.dedup();
        out.shrink_to_fit();
        out
    }

    /// The run map: every run with its owner, in the eager index's block order (ties in the
    /// same order, so equal blocks resolve to the same owner).
    fn run_map(&self, phys_order: &[u32]) -> Vec<ResRun> {
        let t = self.t;
        let mut out = Vec::with_capacity(phys_order.len());
        for &e in phys_order {
            let Some(run) = t.extents.get(e as usize) else {
                continue;
            };
            let k = t.inodes.partition_point(|r| r.first_extent <= e);
            let res = match k.checked_sub(1).and_then(|k| t.inodes.get(k)) {
                Some(r) => {
                    let dir = FileKind::from_mode(r.mode) == FileKind::Directory;
                    ResRun::new(run, r.ino, if dir { RES_DIR } else { 0 })
                }
                None => ResRun::new(run, 0, RES_ORPHAN),
            };
            out.push(res);
        }
        out
    }
}

/// The sections to write, in order: (section, inode positions, directory positions).
fn plan(t: &Tables, n: u32) -> Vec<(u32, std::ops::Range<usize>, std::ops::Range<usize>)> {
    let mut secs: Vec<u32> = t
        .inodes
        .iter()
        .map(|r| r.ino)
        .chain(t.dirs.iter().map(|d| d.ino))
        .chain(t.blobs.iter().map(|b| b.ino))
        .map(|i| section_of(i, n))
        .collect();
    secs.sort_unstable();
    secs.dedup();
    let (mut i, mut d) = (0usize, 0usize);
    secs.into_iter()
        .map(|s| {
            let i0 = i;
            while t.inodes.get(i).is_some_and(|r| section_of(r.ino, n) == s) {
                i += 1;
            }
            let d0 = d;
            while t.dirs.get(d).is_some_and(|r| section_of(r.ino, n) == s) {
                d += 1;
            }
            (s, i0..i, d0..d)
        })
        .collect()
}

/// Write the eager index as a section file at `path` (created `0600`; an existing file is an
/// error; a file left half-written by an error is removed).
pub(crate) fn write(
    fs: &FsInfo,
    meta: &[MetaRange],
    warnings: &[Warning],
    e: &Eager,
    path: &Path,
    cfg: &LazyConfig,
) -> Result<()> {
    let n = cfg.section_inodes;
    if !(1..=65535).contains(&n) {
        return Err(bad(path, format!("{n} inodes per section (1 to 65535)")));
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path, "creating"))?;
    let r = write_to(&file, fs, meta, warnings, e, path, n);
    if r.is_err() {
        drop(file);
        let _ = std::fs::remove_file(path);
    }
    r
}

fn write_to(
    file: &File,
    fs: &FsInfo,
    meta: &[MetaRange],
    warnings: &[Warning],
    e: &Eager,
    path: &Path,
    n: u32,
) -> Result<()> {
    let t = &e.t;
    let mut w = BufWriter::new(file);
    w.write_all(&[0u8; PROLOGUE]).map_err(io(path, "writing"))?;
    let mut off = PROLOGUE as u64;
    let split = Splitter::new(t, n);
    let mut sections = Vec::new();
    for (sec, inos, dirs) in plan(t, n) {
        let first = inos.start;
        let recs = t.inodes.get(inos).unwrap_or(&[]);
        let tables = split.section(sec, recs, first, dirs);
        let bytes = postcard::to_stdvec(&tables)
            .map_err(|e| bad(path, format!("cannot encode section {sec}: {e}")))?;
        let len = u32::try_from(bytes.len())
            .map_err(|_| bad(path, format!("section {sec} exceeds 4 GiB")))?;
        w.write_all(&bytes).map_err(io(path, "writing"))?;
        sections.push(SectionInfo {
            off,
            sec,
            len,
            crc: crc(&bytes),
            inodes: recs.len() as u32,
        });
        off += u64::from(len);
    }
    let counts = Counts {
        inodes: t.inodes.len() as u64,
        directories: t.count(FileKind::Directory) as u64,
        regular_files: t.count(FileKind::Regular) as u64,
        symlinks: t.count(FileKind::Symlink) as u64,
        entries: t.entries.len() as u64,
        runs: t.extents.len() as u64,
    };
    let header = Header {
        fs: fs.clone(),
        meta: meta.to_vec(),
        warnings: warnings.to_vec(),
        section_inodes: n,
        runs: split.run_map(&e.phys_order),
        sections,
        names: split.name_table(),
        counts,
    };
    let hb = postcard::to_stdvec(&header)
        .map_err(|e| bad(path, format!("cannot encode the header: {e}")))?;
    w.write_all(&hb).map_err(io(path, "writing"))?;
    w.flush().map_err(io(path, "writing"))?;
    drop(w);
    let mut pro = [0u8; PROLOGUE];
    pro[..8].copy_from_slice(MAGIC);
    pro[8..12].copy_from_slice(&VERSION.to_le_bytes());
    pro[16..24].copy_from_slice(&off.to_le_bytes());
    pro[24..32].copy_from_slice(&(hb.len() as u64).to_le_bytes());
    pro[32..36].copy_from_slice(&crc(&hb).to_le_bytes());
    let pc = crc(&pro[..36]);
    pro[36..40].copy_from_slice(&pc.to_le_bytes());
    file.write_all_at(&pro, 0).map_err(io(path, "writing"))?;
    Ok(())
}

// ---- reading --------------------------------------------------------------------------------

/// What never changes after the file is opened; shared by clones of the index.
struct Shared {
    path: PathBuf,
    file: File,
    file_len: u64,
    section_inodes: u32,
    runs: Vec<ResRun>,
    sections: Vec<SectionInfo>,
    names: Vec<NameRef>,
    counts: Counts,
}

/// One loaded section.
struct Slot {
    t: Arc<Tables>,
    bytes: u64,
    /// Last use (LRU order).
    tick: u64,
}

#[derive(Default)]
struct Cache {
    /// Loaded sections by position in `Shared::sections`.
    slots: HashMap<u32, Slot>,
    tick: u64,
    bytes: u64,
    /// Sections loaded at least once (bitset by position).
    ever: Vec<u64>,
    stats: LazyStats,
}

/// The lazy store of an [`super::Index`].
pub(crate) struct Lazy {
    shared: Arc<Shared>,
    cfg: LazyConfig,
    /// Bytes always resident (the shared part and this index's own structures).
    fixed: u64,
    cache: Mutex<Cache>,
}

/// Rough heap cost of a cached section beyond its tables (slot, map entry, `Arc`).
const SLOT_OVERHEAD: u64 = 96;

impl std::fmt::Debug for Lazy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lazy")
            .field("path", &self.shared.path)
            .field("sections", &self.shared.sections.len())
            .field("runs", &self.shared.runs.len())
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl Clone for Lazy {
    /// The same file and resident part, with an empty cache of its own.
    fn clone(&self) -> Self {
        Lazy::with_shared(self.shared.clone(), self.cfg.clone(), self.fixed)
    }
}

/// What [`open`] returns: the file-system facts for the index and its lazy store.
pub(crate) struct Opened {
    pub fs: FsInfo,
    pub meta: Vec<MetaRange>,
    pub warnings: Vec<Warning>,
    pub lazy: Lazy,
}

fn read_prologue(path: &Path, file: &File, len: u64) -> Result<(u64, u64, u32)> {
    if len < PROLOGUE as u64 {
        return Err(bad(
            path,
            format!("{len} bytes is too short for a lazy index"),
        ));
    }
    let mut pro = [0u8; PROLOGUE];
    file.read_exact_at(&mut pro, 0)
        .map_err(io(path, "reading"))?;
    if &pro[..8] != MAGIC {
        return Err(bad(path, "missing VMSFSLZ1 magic (not a lazy index file)"));
    }
    let word = |o: usize| u64::from_le_bytes(pro[o..o + 8].try_into().unwrap_or([0; 8]));
    let half = |o: usize| u32::from_le_bytes(pro[o..o + 4].try_into().unwrap_or([0; 4]));
    if half(8) != VERSION {
        return Err(bad(
            path,
            format!("version {} (this vmsight reads {VERSION})", half(8)),
        ));
    }
    if crc(&pro[..36]) != half(36) {
        return Err(bad(path, "the prologue fails its checksum"));
    }
    let (off, hlen) = (word(16), word(24));
    if off < PROLOGUE as u64 || off.checked_add(hlen) != Some(len) {
        return Err(bad(
            path,
            format!("header at {off}+{hlen} does not end the {len}-byte file"),
        ));
    }
    Ok((off, hlen, half(32)))
}

fn check_header(path: &Path, h: &Header, header_off: u64) -> Result<()> {
    let fail = |m: &str| Err(bad(path, m));
    if h.fs.block_size < 1024 || !h.fs.block_size.is_power_of_two() {
        return fail("block size is not a power of two of at least 1024");
    }
    if !(1..=65535).contains(&h.section_inodes) {
        return fail("inodes per section out of range");
    }
    if !h.meta.windows(2).all(|w| w[0].start <= w[1].start) {
        return fail("metadata ranges are not sorted");
    }
    if !h.runs.windows(2).all(|w| w[0].phys() <= w[1].phys())
        || h.runs
            .iter()
            .any(|r| r.flags & !(RES_DIR | RES_ORPHAN) != 0)
    {
        return fail("the run map is not sorted or has unknown flags");
    }
    if !h.sections.windows(2).all(|w| w[0].sec < w[1].sec)
        || h.sections.iter().any(|s| {
            s.off < PROLOGUE as u64
                || s.off.saturating_add(u64::from(s.len)) > header_off
                || s.inodes > h.section_inodes
        })
    {
        return fail("the section directory is inconsistent");
    }
    if !h.names.windows(2).all(|w| w[0] < w[1]) {
        return fail("the link table is not sorted");
    }
    Ok(())
}

/// Every section's checksum (one sequential read of the file, one section in memory at a
/// time), so that a damaged file is refused when it is opened, not when a write needs it.
fn check_sections(path: &Path, file: &File, sections: &[SectionInfo]) -> Result<()> {
    let mut buf = Vec::new();
    for s in sections {
        buf.resize(s.len as usize, 0);
        file.read_exact_at(&mut buf, s.off)
            .map_err(io(path, "reading"))?;
        if crc(&buf) != s.crc {
            return Err(bad(path, format!("section {} fails its checksum", s.sec)));
        }
    }
    Ok(())
}

/// Open a section file written by [`write`]: check it and read its resident part.
pub(crate) fn open(path: &Path, cfg: &LazyConfig) -> Result<Opened> {
    let file = File::open(path).map_err(io(path, "opening"))?;
    let len = file.metadata().map_err(io(path, "reading"))?.len();
    let (off, hlen, hcrc) = read_prologue(path, &file, len)?;
    let hlen = usize::try_from(hlen).map_err(|_| bad(path, "header too large"))?;
    let mut hb = vec![0u8; hlen];
    file.read_exact_at(&mut hb, off)
        .map_err(io(path, "reading"))?;
    if crc(&hb) != hcrc {
        return Err(bad(path, "the header fails its checksum"));
    }
    let h: Header = postcard::from_bytes(&hb)
        .map_err(|e| bad(path, format!("cannot decode the header: {e}")))?;
    drop(hb);
    check_header(path, &h, off)?;
    check_sections(path, &file, &h.sections)?;
    if cfg.unlink {
        std::fs::remove_file(path).map_err(io(path, "removing"))?;
    }
    let mut runs = h.runs;
    runs.shrink_to_fit();
    let mut sections = h.sections;
    sections.shrink_to_fit();
    let shared = Arc::new(Shared {
        path: path.to_path_buf(),
        file,
        file_len: len,
        section_inodes: h.section_inodes,
        runs,
        sections,
        names: h.names,
        counts: h.counts,
    });
    let cfg = LazyConfig {
        section_inodes: h.section_inodes,
        ..cfg.clone()
    };
    let words = shared.sections.len().div_ceil(64);
    // Everything kept: the shared part, and the facts the index holds beside it.
    let fixed = (std::mem::size_of::<Shared>()
        + shared.path.as_os_str().len()
        + shared.runs.capacity() * std::mem::size_of::<ResRun>()
        + shared.sections.capacity() * std::mem::size_of::<SectionInfo>()
        + shared.names.capacity() * std::mem::size_of::<NameRef>()
        + words * 8
        + super::fixed_bytes(&h.fs, &h.meta, &h.warnings)) as u64;
    Ok(Opened {
        fs: h.fs,
        meta: h.meta,
        warnings: h.warnings,
        lazy: Lazy::with_shared(shared, cfg, fixed),
    })
}

impl Shared {
    fn bad(&self, reason: String) -> Error {
        bad(&self.path, reason)
    }

    /// Read, check and decode the section at position `pos`.
    fn load(&self, pos: usize) -> Result<Tables> {
        let s = *self
            .sections
            .get(pos)
            .ok_or_else(|| self.bad(format!("no section at position {pos}")))?;
        if s.off.saturating_add(u64::from(s.len)) > self.file_len {
            return Err(self.bad(format!("section {} lies past the end of the file", s.sec)));
        }
        let mut buf = vec![0u8; s.len as usize];
        self.file
            .read_exact_at(&mut buf, s.off)
            .map_err(io(&self.path, &format!("reading section {} of", s.sec)))?;
        if crc(&buf) != s.crc {
            return Err(self.bad(format!("section {} fails its checksum", s.sec)));
        }
        let mut t: Tables = postcard::from_bytes(&buf)
            .map_err(|e| self.bad(format!("cannot decode section {}: {e}", s.sec)))?;
        t.validate()
            .map_err(|m| self.bad(format!("section {}: {m}", s.sec)))?;
        self.check_keys(&t, s)?;
        t.shrink();
        Ok(t)
    }

    /// Everything in a section belongs to its inode range.
    fn check_keys(&self, t: &Tables, s: SectionInfo) -> Result<()> {
        let n = self.section_inodes;
        let inside = |ino: u32| section_of(ino, n) == s.sec;
        if t.parents.len() != t.inodes.len()
            || t.inodes.len() != s.inodes as usize
            || !t.inodes.iter().all(|r| inside(r.ino))
            || !t.dirs.iter().all(|d| inside(d.ino))
            || !t.blobs.iter().all(|b| inside(b.ino))
        {
            return Err(self.bad(format!("section {} holds records of other inodes", s.sec)));
        }
        Ok(())
    }
}

impl Lazy {
    fn with_shared(shared: Arc<Shared>, cfg: LazyConfig, fixed: u64) -> Self {
        let words = shared.sections.len().div_ceil(64);
        let stats = LazyStats {
            sections: shared.sections.len() as u64,
            fixed_bytes: fixed,
            resident_bytes: fixed,
            peak_resident_bytes: fixed,
            inodes: shared.counts.inodes,
            file_bytes: shared.file_len,
            ..LazyStats::default()
        };
        Lazy {
            cache: Mutex::new(Cache {
                ever: vec![0; words],
                stats,
                ..Cache::default()
            }),
            shared,
            cfg,
            fixed,
        }
    }

    pub fn counts(&self) -> Counts {
        self.shared.counts
    }

    /// Counters, with the current sizes.
    pub fn stats(&self) -> LazyStats {
        let c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let mut s = c.stats.clone();
        s.sections_cached = c.slots.len() as u64;
        s.resident_bytes = self.fixed + c.bytes;
        s
    }

    /// Heap bytes held now.
    pub fn resident_bytes(&self) -> u64 {
        let c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        self.fixed + c.bytes
    }

    /// Position of the section holding `ino` in the directory.
    fn position(&self, ino: u32) -> Option<u32> {
        let s = section_of(ino, self.shared.section_inodes);
        let p = self
            .shared
            .sections
            .binary_search_by_key(&s, |x| x.sec)
            .ok()?;
        u32::try_from(p).ok()
    }

    /// The section holding `ino` (and, for a directory, its entries); `None` when nothing
    /// is kept for that inode range or the section cannot be read.
    pub fn section(&self, ino: u32) -> Option<Arc<Tables>> {
        self.get(self.position(ino)?)
    }

    /// The section at position `pos`.
    pub fn get(&self, pos: u32) -> Option<Arc<Tables>> {
        let mut c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        c.tick += 1;
        let tick = c.tick;
        if let Some(s) = c.slots.get_mut(&pos) {
            s.tick = tick;
            return Some(s.t.clone());
        }
        let started = Instant::now();
        let loaded = self.shared.load(pos as usize);
        c.stats.load_ns += u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let t = match loaded {
            Ok(t) => Arc::new(t),
            Err(e) => {
                c.stats.load_errors += 1;
                c.stats.last_error = Some(e.to_string());
                return None;
            }
        };
        c.stats.loads += 1;
        let word = (pos / 64) as usize;
        if let Some(w) = c.ever.get_mut(word) {
            if *w & (1 << (pos % 64)) == 0 {
                *w |= 1 << (pos % 64);
                let n = self
                    .shared
                    .sections
                    .get(pos as usize)
                    .map_or(0, |s| s.inodes);
                c.stats.inodes_loaded += u64::from(n);
            }
        }
        let bytes = t.heap_bytes() as u64 + std::mem::size_of::<Tables>() as u64 + SLOT_OVERHEAD;
        c.slots.insert(
            pos,
            Slot {
                t: t.clone(),
                bytes,
                tick,
            },
        );
        c.bytes += bytes;
        self.evict(&mut c);
        c.stats.peak_resident_bytes = c.stats.peak_resident_bytes.max(self.fixed + c.bytes);
        Some(t)
    }

    /// Drop least recently used sections until the cache is within its bounds (the newest
    /// section stays, whatever its size).
    fn evict(&self, c: &mut Cache) {
        while c.slots.len() > 1
            && (c.slots.len() > self.cfg.max_sections || c.bytes > self.cfg.max_bytes)
        {
            let Some((&oldest, _)) = c.slots.iter().min_by_key(|(_, s)| s.tick) else {
                break;
            };
            if let Some(s) = c.slots.remove(&oldest) {
                c.bytes -= s.bytes;
                c.stats.evictions += 1;
            }
        }
    }

    /// Inode numbers of the section at position `pos` (`None` past the last one).
    pub fn inodes_at(&self, pos: usize) -> Option<Vec<u32>> {
        if pos >= self.shared.sections.len() {
            return None;
        }
        let t = u32::try_from(pos).ok().and_then(|p| self.get(p));
        Some(
            t.map(|t| t.inodes.iter().map(|r| r.ino).collect())
                .unwrap_or_default(),
        )
    }

    /// The primary link of `ino`: (parent directory, the entry, its name).
    pub fn primary(&self, ino: u32) -> Option<(u32, EntryRec, Vec<u8>)> {
        let t = self.section(ino)?;
        let (i, r) = t.rec(ino)?;
        if r.first_link == NO_LINK {
            return None;
        }
        let dir = *t.parents.get(i)?;
        let pt = self.section(dir)?;
        let e = *pt.entries.get(r.first_link as usize)?;
        Some((dir, e, pt.name(&e).to_vec()))
    }

    /// Every entry naming `ino`: (directory, name), by directory then name.
    pub fn names_of(&self, ino: u32) -> Vec<(u32, Vec<u8>)> {
        let names = &self.shared.names;
        let first = names.partition_point(|n| n.ino < ino);
        let listed: Vec<u32> = names
            .iter()
            .skip(first)
            .take_while(|n| n.ino == ino)
            .map(|n| n.dir)
            .collect();
        if listed.is_empty() {
            return match self.primary(ino) {
                Some((dir, e, name)) if e.ino == ino => vec![(dir, name)],
                _ => Vec::new(),
            };
        }
        let mut out = Vec::new();
        for dir in listed {
            let Some(t) = self.section(dir) else {
                continue;
            };
            for e in t.dir_range(dir).unwrap_or(&[]) {
                if e.ino == ino {
                    out.push((dir, t.name(e).to_vec()));
                }
            }
        }
        out
    }

    /// The run map's answer for `block`: the run (if it holds the block) and the offset in it.
    pub fn run_at(&self, block: u64) -> Option<(ResRun, u64)> {
        let runs = &self.shared.runs;
        let i = runs.partition_point(|r| r.phys() <= block);
        let r = *runs.get(i.checked_sub(1)?)?;
        let delta = block - r.phys();
        (delta < u64::from(r.len) && !r.is_orphan()).then_some((r, delta))
    }

    /// Whether both are views of the same opened file.
    pub fn same_file(&self, other: &Lazy) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}
