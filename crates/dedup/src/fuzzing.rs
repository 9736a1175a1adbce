//! Fuzz entry point of the dedup volume's files (see docs/fuzzing.md):
//!
//! - [`dedup_metadata`]: a volume's metadata file damaged before it is opened. The volume is
//!   one of three templates made once per process (an empty volume, one with a checkpointed
//!   state, one with commits only in its journal); the input scribbles its superblocks,
//!   journal, logical map, reference counts and hash index, re-seals checksums the way
//!   someone who knows the format would, writes superblocks of other geometries and cuts or
//!   extends the files; then [`Volume::open`] replays and scans it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use vmsight_blockdev::insight::DedupHint;

use crate::error::DedupError;
use crate::format::{JournalHeader, Superblock, BLOCK, JOURNAL_PAGES, JOURNAL_START, L2P_PER_PAGE};
use crate::volume::{Volume, VolumeOptions, DATA_FILE, META_FILE};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Outcome bits of [`dedup_metadata`]: the volume was refused as not a volume (no valid
/// superblock, wrong file).
pub const DD_NOT_VOLUME: u32 = 1;
/// It was refused as corrupt (the reason names what contradicts what).
pub const DD_CORRUPT: u32 = 2;
/// It opened, and its check found nothing wrong.
pub const DD_CLEAN: u32 = 4;
/// It opened, and its check reported problems.
pub const DD_PROBLEMS: u32 = 8;
/// Opening it replayed journal records.
pub const DD_REPLAYED: u32 = 16;

/// Size of the template volumes.
const VOLUME_BYTES: u64 = 1 << 20;
/// Logical blocks the templates wrote (block `i` holds chunk `i % 6`, so two are duplicates).
const WRITTEN: u64 = 8;
/// Most operations of one input.
const MAX_DEDUP_OPS: usize = 32;
/// Longest scribble.
const MAX_SCRIBBLE: usize = 256;
/// Largest metadata or data file an input may ask for (pages).
const MAX_FILE_PAGES: u64 = 16 << 10;

/// A volume's files as the templates hold them.
#[derive(Debug, Clone)]
struct Files {
    meta: Sparse,
    data: Sparse,
}

/// A file as its length and its pages that are not all zeros.
#[derive(Debug, Clone, Default)]
struct Sparse {
    len: u64,
    pages: BTreeMap<u64, Vec<u8>>,
}

impl Sparse {
    fn of(bytes: &[u8]) -> Self {
        let pages = bytes
            .chunks(BLOCK as usize)
            .enumerate()
            .filter(|(_, p)| p.iter().any(|&b| b != 0))
            .map(|(i, p)| (i as u64, p.to_vec()))
            .collect();
        Self {
            len: bytes.len() as u64,
            pages,
        }
    }

    /// Page `i` (zeros when it was never written; `None` past the end).
    fn page(&self, i: u64) -> Option<Vec<u8>> {
        ((i + 1) * BLOCK <= self.len).then(|| {
            self.pages
                .get(&i)
                .cloned()
                .unwrap_or_else(|| vec![0; BLOCK as usize])
        })
    }

    /// `bytes` at `at`, cut at the end of the file.
    fn put(&mut self, at: u64, bytes: &[u8]) {
        let end = at.saturating_add(bytes.len() as u64).min(self.len);
        let mut off = at;
        while off < end {
            let (i, within) = (off / BLOCK, (off % BLOCK) as usize);
            let n = (end - off).min(BLOCK - within as u64) as usize;
            let page = self
                .pages
                .entry(i)
                .or_insert_with(|| vec![0; BLOCK as usize]);
            let src = (off - at) as usize;
            page[within..within + n].copy_from_slice(&bytes[src..src + n]);
            off += n as u64;
        }
    }

    fn resize(&mut self, len: u64) {
        self.len = len;
        self.pages.retain(|i, _| (i + 1) * BLOCK <= len);
    }

    /// Writes the file (pages never written are holes).
    fn write(&self, path: &Path) -> Option<()> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(path).ok()?;
        f.set_len(self.len).ok()?;
        for (i, page) in &self.pages {
            f.write_all_at(page, i * BLOCK).ok()?;
        }
        Some(())
    }
}

/// The templates: empty, checkpointed, journal only (`None` if they cannot be made).
fn templates() -> Option<&'static [Files; 3]> {
    static T: OnceLock<Option<[Files; 3]>> = OnceLock::new();
    T.get_or_init(make_templates).as_ref()
}

fn make_templates() -> Option<[Files; 3]> {
    let tmp = scratch()?;
    let dir = tmp.path().join("v");
    Volume::create(&dir, VOLUME_BYTES).ok()?;
    let empty = read_files(&dir)?;
    {
        let mut v = Volume::open(&dir, VolumeOptions::default()).ok()?;
        for lba in 0..WRITTEN {
            v.write(lba * BLOCK, &chunk(lba % 6), &no_hint).ok()?;
        }
        v.flush().ok()?;
        // Dropped without a checkpoint: the commit lives only in the journal.
    }
    let journal = read_files(&dir)?;
    drop(Volume::open(&dir, VolumeOptions::default()).ok()?);
    let checkpointed = read_files(&dir)?;
    Some([empty, checkpointed, journal])
}

/// The contents of chunk `k` of the templates.
fn chunk(k: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i.wrapping_mul(k + 3) >> 3) as u8 ^ k as u8)
        .collect()
}

/// A scratch directory of this process, on tmpfs when there is one; removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch() -> Option<Scratch> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "vmsight-fuzz-dedup-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(name);
    std::fs::create_dir(&dir).ok()?;
    Some(Scratch(dir))
}

/// No hint for any block.
fn no_hint(_: usize) -> DedupHint {
    DedupHint::None
}

fn read_files(dir: &Path) -> Option<Files> {
    Some(Files {
        meta: Sparse::of(&std::fs::read(dir.join(META_FILE)).ok()?),
        data: Sparse::of(&std::fs::read(dir.join(DATA_FILE)).ok()?),
    })
}

/// One edit of the metadata file before it is opened.
#[derive(Debug, Clone)]
pub enum MetaOp {
    /// `bytes` at byte `offset % 4096` of page `page` (modulo the file's pages).
    Scribble {
        page: u16,
        offset: u16,
        bytes: Vec<u8>,
    },
    /// The `u64` `value` at word `word % 512` of page `page` of `area` (0 superblocks,
    /// 1 journal, 2 logical map, 3 reference counts, 4 hash index; the page wraps in the area).
    Word {
        area: u8,
        page: u16,
        word: u16,
        value: u64,
    },
    /// Both superblocks' and the journal chain's checksums made to match their contents.
    Reseal,
    /// A valid superblock in slot `slot % 2`: `256 + logical` logical blocks, `physical`
    /// chunks, `buckets` index pages, generation `generation`.
    Superblock {
        slot: u8,
        logical: u16,
        physical: u32,
        buckets: u16,
        generation: u64,
    },
    /// The metadata file (or the data file) cut or extended to `pages % 16384` pages.
    Resize { data: bool, pages: u16 },
}

/// Runs one damaged volume; panics if a promise is broken. Returns the outcome bits reached.
///
/// Input: the template (`b % 3`: empty, checkpointed, journal only), then edits until the
/// input ends. Promises checked: no panic; opening fails only with `NotVolume` or `Corrupt`
/// (never an I/O error, never a panic or an allocation the files do not justify); an opened
/// volume's tables and chunks fit in its files, and every block read back is zeros or one of
/// its chunks; its check runs; when the check is clean, a new block written, flushed and read
/// after opening the volume again is that block.
pub fn dedup_metadata(data: &[u8]) -> u32 {
    let Some(templates) = templates() else {
        return 0;
    };
    let mut inp = Input::new(data);
    let mut files = templates[usize::from(inp.u8() % 3)].clone();
    for _ in 0..MAX_DEDUP_OPS {
        if inp.is_empty() {
            break;
        }
        apply(&mut files, &decode_meta_op(&mut inp));
    }
    let Some(tmp) = scratch() else {
        return 0;
    };
    let dir = tmp.path().join("v");
    if write_files(&dir, &files).is_none() {
        return 0;
    }
    match Volume::open(&dir, VolumeOptions::default()) {
        Ok(v) => check_volume(&dir, v, &files),
        Err(DedupError::NotVolume { .. }) => DD_NOT_VOLUME,
        Err(DedupError::Corrupt { reason, .. }) => {
            assert!(!reason.is_empty(), "a corrupt volume says why");
            DD_CORRUPT
        }
        Err(e) => panic!("opening a damaged volume: {e}"),
    }
}

/// The promises of an opened volume (see [`dedup_metadata`]).
fn check_volume(dir: &Path, mut v: Volume, files: &Files) -> u32 {
    let geo = v.geometry();
    assert!(
        geo.meta_bytes() <= files.meta.len,
        "the metadata file holds the tables"
    );
    assert!(
        geo.data_bytes() <= files.data.len,
        "the data file holds the chunks"
    );
    let info = v.info();
    assert!(info.mapped_blocks <= geo.logical_blocks && info.used_chunks <= geo.physical_blocks);
    let mut bits = if v.replayed() { DD_REPLAYED } else { 0 };
    read_back(&mut v, files);
    let report = match v.check() {
        Ok(r) => r,
        Err(DedupError::Corrupt { .. }) => return bits | DD_PROBLEMS,
        Err(e) => panic!("checking an opened volume: {e}"),
    };
    if !report.is_clean() {
        return bits | DD_PROBLEMS;
    }
    bits |= DD_CLEAN;
    let lba = WRITTEN + 1;
    let new = vec![0xa5; BLOCK as usize];
    match v.write(lba * BLOCK, &new, &no_hint) {
        Ok(()) => {}
        Err(DedupError::Full { .. }) => return bits,
        Err(e) => panic!("a write to a clean volume: {e}"),
    }
    if let Err(e) = v.flush() {
        panic!("a flush of a clean volume: {e}");
    }
    drop(v);
    let mut v = match Volume::open(dir, VolumeOptions::default()) {
        Ok(v) => v,
        Err(e) => panic!("a clean volume opens again after a write: {e}"),
    };
    let mut got = vec![0; BLOCK as usize];
    if let Err(e) = v.read(lba * BLOCK, &mut got) {
        panic!("reading back the write: {e}");
    }
    assert!(got == new, "the written block reads back");
    bits
}

/// Reads the first MiB of the volume (and its last block): every block is zeros or one of the
/// data file's chunks.
fn read_back(v: &mut Volume, files: &Files) {
    let geo = v.geometry();
    let len = geo.logical_bytes().min(VOLUME_BYTES);
    let mut buf = vec![0u8; len as usize];
    let ends = [
        (0, &mut buf[..]),
        (geo.logical_bytes() - BLOCK, &mut [0u8; 4096][..]),
    ];
    for (at, b) in ends {
        match v.read(at, b) {
            Ok(()) => {
                for blk in b.chunks(BLOCK as usize) {
                    let chunk = is_chunk_of(blk, &files.data, geo.physical_blocks);
                    assert!(chunk, "a block read back is not one of the volume's chunks");
                }
            }
            Err(DedupError::Corrupt { .. }) => {}
            Err(e) => panic!("reading an opened volume at {at}: {e}"),
        }
    }
    let past = v.read(geo.logical_bytes(), &mut [0u8; 4096]);
    assert!(
        matches!(past, Err(DedupError::OutOfRange { .. })),
        "{past:?}"
    );
}

/// Whether `block` is zeros or one of the volume's `chunks` first chunks of `data`.
fn is_chunk_of(block: &[u8], data: &Sparse, chunks: u64) -> bool {
    block.iter().all(|&b| b == 0) || data.pages.range(..chunks).any(|(_, c)| c == block)
}

/// Writes the files into `dir`.
fn write_files(dir: &Path, files: &Files) -> Option<()> {
    std::fs::create_dir_all(dir).ok()?;
    files.meta.write(&dir.join(META_FILE))?;
    files.data.write(&dir.join(DATA_FILE))
}

fn apply(files: &mut Files, op: &MetaOp) {
    let meta = &mut files.meta;
    let pages = (meta.len / BLOCK).max(1);
    match op {
        MetaOp::Scribble {
            page,
            offset,
            bytes,
        } => {
            let at = (u64::from(*page) % pages) * BLOCK + u64::from(*offset) % BLOCK;
            meta.put(at, bytes);
        }
        MetaOp::Word {
            area,
            page,
            word,
            value,
        } => {
            let (start, len) = area_pages(*area);
            let at = (start + u64::from(*page) % len) * BLOCK + u64::from(*word % 512) * 8;
            meta.put(at, &value.to_le_bytes());
        }
        MetaOp::Reseal => reseal(meta),
        MetaOp::Superblock {
            slot,
            logical,
            physical,
            buckets,
            generation,
        } => {
            let sb = Superblock {
                geometry: crate::format::Geometry {
                    logical_blocks: 256 + u64::from(*logical),
                    physical_blocks: u64::from(*physical),
                    index_buckets: u64::from(*buckets),
                },
                generation: *generation,
            };
            meta.put(u64::from(slot % 2) * BLOCK, &sb.encode());
        }
        MetaOp::Resize { data, pages } => {
            let len = u64::from(*pages) % MAX_FILE_PAGES * BLOCK;
            let file = if *data { &mut files.data } else { meta };
            file.resize(len);
        }
    }
}

/// The first page and the pages of an area of the templates' metadata file.
fn area_pages(area: u8) -> (u64, u64) {
    let geo = match crate::format::Geometry::for_size(VOLUME_BYTES) {
        Ok(g) => g,
        Err(e) => panic!("the templates' geometry: {e}"),
    };
    match area % 5 {
        0 => (0, 2),
        1 => (JOURNAL_START, JOURNAL_PAGES),
        2 => (geo.l2p_start(), geo.l2p_pages()),
        3 => (geo.rc_start(), geo.rc_pages()),
        _ => (geo.index_start(), geo.index_buckets),
    }
}

/// Makes both superblocks' checksums and the journal chain's match their contents.
fn reseal(meta: &mut Sparse) {
    const SB_FIELDS: usize = 48;
    for slot in 0..2 {
        let Some(mut p) = meta.page(slot) else {
            return;
        };
        let sum = blake3::hash(&p[..SB_FIELDS]);
        p[SB_FIELDS..SB_FIELDS + 32].copy_from_slice(sum.as_bytes());
        meta.put(slot * BLOCK, &p);
    }
    let mut pos = 0;
    while pos < JOURNAL_PAGES {
        let Some(mut h) = meta
            .page(JOURNAL_START + pos)
            .and_then(|p| JournalHeader::decode(&p))
        else {
            return;
        };
        let end = (pos + 1 + h.pages.len() as u64).min(JOURNAL_PAGES);
        let images: Option<Vec<Vec<u8>>> = (pos + 1..end)
            .map(|i| meta.page(JOURNAL_START + i))
            .collect();
        let Some(images) = images else {
            return;
        };
        let refs: Vec<&[u8]> = images.iter().map(|p| &p[..]).collect();
        h.checksum = JournalHeader::checksum_of(h.seq, &h.pages, &refs);
        meta.put((JOURNAL_START + pos) * BLOCK, &h.encode());
        pos = end;
    }
}

fn decode_meta_op(inp: &mut Input<'_>) -> MetaOp {
    match inp.u8() % 8 {
        0 | 1 => MetaOp::Scribble {
            page: inp.u16(),
            offset: inp.u16(),
            bytes: inp.chunk(MAX_SCRIBBLE).to_vec(),
        },
        2..=4 => MetaOp::Word {
            area: inp.u8(),
            page: inp.u16(),
            word: inp.u16(),
            value: inp.u64(),
        },
        5 => MetaOp::Reseal,
        6 => MetaOp::Superblock {
            slot: inp.u8(),
            logical: inp.u16(),
            physical: inp.u32(),
            buckets: inp.u16(),
            generation: inp.u64(),
        },
        _ => MetaOp::Resize {
            data: inp.bool(),
            pages: inp.u16(),
        },
    }
}

/// Encodes a dedup input: the template (0 empty, 1 checkpointed, 2 journal only) and the
/// edits.
pub fn encode_dedup(template: u8, ops: &[MetaOp]) -> Vec<u8> {
    let mut o = Output::default();
    o.u8(template);
    for op in ops {
        match op {
            MetaOp::Scribble {
                page,
                offset,
                bytes,
            } => o.u8(0).u16(*page).u16(*offset).chunk(bytes),
            MetaOp::Word {
                area,
                page,
                word,
                value,
            } => o.u8(2).u8(*area).u16(*page).u16(*word).u64(*value),
            MetaOp::Reseal => o.u8(5),
            MetaOp::Superblock {
                slot,
                logical,
                physical,
                buckets,
                generation,
            } => o
                .u8(6)
                .u8(*slot)
                .u16(*logical)
                .u32(*physical)
                .u16(*buckets)
                .u64(*generation),
            MetaOp::Resize { data, pages } => o.u8(7).u8(u8::from(*data)).u16(*pages),
        };
    }
    o.bytes
}

/// The word of a logical block's map entry in the templates (for seeds): area 2, page, word.
pub fn l2p_word(lba: u64) -> (u16, u16) {
    ((lba / L2P_PER_PAGE) as u16, (lba % L2P_PER_PAGE) as u16)
}
