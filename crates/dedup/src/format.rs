//! The on-disk format of a dedup volume's metadata file (docs/dedup.md has the picture).
//!
//! Everything is in 4 KiB pages, little-endian:
//!
//! | pages | what |
//! |---|---|
//! | 0, 1 | superblock slots: the one with a valid checksum and the highest generation wins; a checkpoint writes the slot not holding the current one |
//! | 2 ..= 2 + [`MAX_COMMIT_PAGES`] | journal: the records appended since the last checkpoint, each a header page (sequence number, page numbers, BLAKE3 of everything) and the page images of one commit |
//! | L2P | logical block → physical chunk + 1 (0 = unmapped, reads as zeros), 512 per page |
//! | refcounts | per physical chunk: references from the L2P map plus one if the hash index holds it, `u32`, 1024 per page |
//! | index | hash buckets: a page holds 102 entries of (BLAKE3 hash, chunk); a full page sets its overflow flag and the probe continues on the next page |
//!
//! All-zero pages are valid empty tables, so a new metadata file is sparse.

use crate::error::{DedupError, Result};
use std::path::Path;

/// Chunk and page size.
pub const BLOCK: u64 = 4096;
/// Superblock magic.
pub const MAGIC: [u8; 8] = *b"VMSDDUP1";
/// Journal header magic.
pub const JOURNAL_MAGIC: [u8; 8] = *b"VMSDJNL1";
/// Format version in the superblock.
pub const VERSION: u32 = 1;
/// Most pages one commit carries (bounded by the journal header's page list).
pub const MAX_COMMIT_PAGES: usize = 500;
/// First journal page.
pub const JOURNAL_START: u64 = 2;
/// Pages of the journal region (header + images).
pub const JOURNAL_PAGES: u64 = 1 + MAX_COMMIT_PAGES as u64;
/// L2P entries per page.
pub const L2P_PER_PAGE: u64 = BLOCK / 8;
/// Reference counts per page.
pub const RC_PER_PAGE: u64 = BLOCK / 4;
/// Bytes of an index entry: 32-byte hash + 8-byte chunk number.
pub const ENTRY_BYTES: usize = 40;
/// Bytes of an index page's header: entry count (u16), flags (u16), reserved.
pub const BUCKET_HEADER: usize = 8;
/// Entries per index page.
pub const ENTRIES_PER_BUCKET: usize = (BLOCK as usize - BUCKET_HEADER) / ENTRY_BYTES;
/// Index page flag: an insertion went on to the next page.
pub const BUCKET_OVERFLOW: u16 = 1;
/// Smallest volume: 1 MiB.
pub const MIN_SIZE: u64 = 1 << 20;
/// Largest volume: 16 TiB.
pub const MAX_SIZE: u64 = 16 << 40;
/// Offset of the journal's page list in its header page.
pub const JOURNAL_LIST: usize = 64;

/// A content hash (BLAKE3).
pub type Hash = [u8; 32];

/// BLAKE3 of one chunk.
pub fn hash_chunk(data: &[u8]) -> Hash {
    *blake3::hash(data).as_bytes()
}

/// Sizes of a volume; everything else is derived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// 4 KiB blocks the guest sees.
    pub logical_blocks: u64,
    /// 4 KiB chunks of the data file.
    pub physical_blocks: u64,
    /// Index pages.
    pub index_buckets: u64,
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

impl Geometry {
    /// The geometry of a new volume of `size` bytes (a multiple of 4 KiB): as many chunks as
    /// logical blocks plus 1/8 (overwrites keep their old chunk until the next commit), and an
    /// index at most half full when every chunk is indexed.
    pub fn for_size(size: u64) -> std::result::Result<Self, String> {
        if !size.is_multiple_of(BLOCK) {
            return Err(format!("the size {size} is not a multiple of 4 KiB"));
        }
        if !(MIN_SIZE..=MAX_SIZE).contains(&size) {
            return Err(format!(
                "the size {size} is outside {MIN_SIZE}..={MAX_SIZE} bytes (1 MiB to 16 TiB)"
            ));
        }
        let logical_blocks = size / BLOCK;
        let physical_blocks = logical_blocks + (logical_blocks / 8).max(256);
        let index_buckets = ceil_div(physical_blocks * 2, ENTRIES_PER_BUCKET as u64).max(1);
        Ok(Self {
            logical_blocks,
            physical_blocks,
            index_buckets,
        })
    }

    /// Checks a geometry read from a superblock.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let size = self.logical_blocks.saturating_mul(BLOCK);
        if !(MIN_SIZE..=MAX_SIZE).contains(&size) {
            return Err(format!("logical size {size} is out of range"));
        }
        if self.physical_blocks < self.logical_blocks
            || self.physical_blocks > self.logical_blocks.saturating_mul(2).saturating_add(1024)
        {
            return Err(format!(
                "{} physical chunks for {} logical blocks",
                self.physical_blocks, self.logical_blocks
            ));
        }
        if self.index_buckets == 0 || self.index_buckets > self.physical_blocks {
            return Err(format!("{} index pages", self.index_buckets));
        }
        Ok(())
    }

    /// Logical size in bytes.
    pub fn logical_bytes(&self) -> u64 {
        self.logical_blocks * BLOCK
    }
    /// First L2P page.
    pub fn l2p_start(&self) -> u64 {
        JOURNAL_START + JOURNAL_PAGES
    }
    /// L2P pages.
    pub fn l2p_pages(&self) -> u64 {
        ceil_div(self.logical_blocks, L2P_PER_PAGE)
    }
    /// First reference-count page.
    pub fn rc_start(&self) -> u64 {
        self.l2p_start() + self.l2p_pages()
    }
    /// Reference-count pages.
    pub fn rc_pages(&self) -> u64 {
        ceil_div(self.physical_blocks, RC_PER_PAGE)
    }
    /// First index page.
    pub fn index_start(&self) -> u64 {
        self.rc_start() + self.rc_pages()
    }
    /// Pages of the whole metadata file.
    pub fn meta_pages(&self) -> u64 {
        self.index_start() + self.index_buckets
    }
    /// Bytes of the metadata file.
    pub fn meta_bytes(&self) -> u64 {
        self.meta_pages() * BLOCK
    }
    /// Bytes of the data file.
    pub fn data_bytes(&self) -> u64 {
        self.physical_blocks * BLOCK
    }
    /// Whether `page` may appear in a journal (table pages only).
    pub fn is_table_page(&self, page: u64) -> bool {
        page >= self.l2p_start() && page < self.meta_pages()
    }
    /// Index page of a hash's home bucket.
    pub fn bucket_of(&self, hash: &Hash) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&hash[..8]);
        u64::from_le_bytes(b) % self.index_buckets
    }
}

/// The superblock: geometry and the generation of the last checkpointed commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub geometry: Geometry,
    pub generation: u64,
}

const SB_FIELDS: usize = 48;

impl Superblock {
    /// The page image.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; BLOCK as usize];
        p[0..8].copy_from_slice(&MAGIC);
        p[8..12].copy_from_slice(&VERSION.to_le_bytes());
        p[16..24].copy_from_slice(&self.geometry.logical_blocks.to_le_bytes());
        p[24..32].copy_from_slice(&self.geometry.physical_blocks.to_le_bytes());
        p[32..40].copy_from_slice(&self.geometry.index_buckets.to_le_bytes());
        p[40..48].copy_from_slice(&self.generation.to_le_bytes());
        let sum = blake3::hash(&p[..SB_FIELDS]);
        p[SB_FIELDS..SB_FIELDS + 32].copy_from_slice(sum.as_bytes());
        p
    }

    /// Decodes a slot; `Err` says why it is not a valid superblock.
    pub fn decode(p: &[u8]) -> std::result::Result<Self, String> {
        if p.len() < SB_FIELDS + 32 {
            return Err("short page".into());
        }
        if p[0..8] != MAGIC {
            return Err("bad magic".into());
        }
        let sum = blake3::hash(&p[..SB_FIELDS]);
        if p[SB_FIELDS..SB_FIELDS + 32] != *sum.as_bytes() {
            return Err("checksum mismatch".into());
        }
        let version = u32_at(p, 8);
        if version != VERSION {
            return Err(format!("format version {version}, expected {VERSION}"));
        }
        let geometry = Geometry {
            logical_blocks: u64_at(p, 16),
            physical_blocks: u64_at(p, 24),
            index_buckets: u64_at(p, 32),
        };
        geometry.validate()?;
        Ok(Self {
            geometry,
            generation: u64_at(p, 40),
        })
    }

    /// The newest valid superblock of the two slots.
    pub fn choose(path: &Path, a: &[u8], b: &[u8]) -> Result<Self> {
        match (Self::decode(a), Self::decode(b)) {
            (Ok(x), Ok(y)) => {
                if x.geometry != y.geometry {
                    return Err(DedupError::Corrupt {
                        path: path.to_owned(),
                        reason: "the two superblocks disagree on the geometry".into(),
                    });
                }
                Ok(if y.generation > x.generation { y } else { x })
            }
            (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
            (Err(e1), Err(e2)) => Err(DedupError::NotVolume {
                path: path.to_owned(),
                reason: format!("no valid superblock (slot 0: {e1}; slot 1: {e2})"),
            }),
        }
    }
}

/// Reads a little-endian u64 at `off` (callers pass in-bounds offsets of a page).
pub fn u64_at(p: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&p[off..off + 8]);
    u64::from_le_bytes(b)
}

/// Reads a little-endian u32 at `off`.
pub fn u32_at(p: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p[off..off + 4]);
    u32::from_le_bytes(b)
}

/// Reads a little-endian u16 at `off`.
pub fn u16_at(p: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([p[off], p[off + 1]])
}

/// A journal header: which pages the commit carries; the images follow it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalHeader {
    pub seq: u64,
    pub pages: Vec<u64>,
    pub checksum: Hash,
}

impl JournalHeader {
    /// BLAKE3 over the sequence number, the page list and the images.
    pub fn checksum_of(seq: u64, pages: &[u64], images: &[&[u8]]) -> Hash {
        let mut h = blake3::Hasher::new();
        h.update(&seq.to_le_bytes());
        for p in pages {
            h.update(&p.to_le_bytes());
        }
        for i in images {
            h.update(i);
        }
        *h.finalize().as_bytes()
    }

    /// The header page.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; BLOCK as usize];
        p[0..8].copy_from_slice(&JOURNAL_MAGIC);
        p[8..16].copy_from_slice(&self.seq.to_le_bytes());
        p[16..20].copy_from_slice(&(self.pages.len() as u32).to_le_bytes());
        p[24..56].copy_from_slice(&self.checksum);
        for (i, pg) in self.pages.iter().enumerate() {
            let o = JOURNAL_LIST + i * 8;
            p[o..o + 8].copy_from_slice(&pg.to_le_bytes());
        }
        p
    }

    /// Decodes a header page; `None` if it is not one (never written, torn, garbage).
    pub fn decode(p: &[u8]) -> Option<Self> {
        if p.len() != BLOCK as usize || p[0..8] != JOURNAL_MAGIC {
            return None;
        }
        let count = u32_at(p, 16) as usize;
        if count > MAX_COMMIT_PAGES {
            return None;
        }
        let mut checksum = [0u8; 32];
        checksum.copy_from_slice(&p[24..56]);
        let pages = (0..count)
            .map(|i| u64_at(p, JOURNAL_LIST + i * 8))
            .collect();
        Some(Self {
            seq: u64_at(p, 8),
            pages,
            checksum,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_of_one_gib_keeps_the_tables_apart_and_the_index_half_full() {
        let g = Geometry::for_size(1 << 30).unwrap();
        assert_eq!(g.logical_blocks, 262_144);
        assert_eq!(g.physical_blocks, 262_144 + 32_768);
        assert!(g.index_buckets * ENTRIES_PER_BUCKET as u64 >= 2 * g.physical_blocks);
        assert!(g.l2p_start() > JOURNAL_START + MAX_COMMIT_PAGES as u64);
        assert_eq!(g.rc_start(), g.l2p_start() + 512);
        assert_eq!(g.index_start(), g.rc_start() + g.rc_pages());
        assert!(g.validate().is_ok());
        assert_eq!(ENTRIES_PER_BUCKET, 102);
    }

    #[test]
    fn sizes_that_are_not_whole_blocks_or_out_of_range_are_refused() {
        assert!(Geometry::for_size(4097 * 1024).is_err());
        assert!(Geometry::for_size(4096).is_err());
        assert!(Geometry::for_size(32 << 40).is_err());
    }

    #[test]
    fn superblock_round_trips_and_rejects_any_flipped_byte() {
        let sb = Superblock {
            geometry: Geometry::for_size(64 << 20).unwrap(),
            generation: 7,
        };
        let p = sb.encode();
        assert_eq!(Superblock::decode(&p).unwrap(), sb);
        for i in 0..80 {
            let mut q = p.clone();
            q[i] ^= 0x40;
            assert!(Superblock::decode(&q).is_err(), "byte {i}");
        }
    }

    #[test]
    fn the_newer_valid_superblock_wins_and_two_bad_ones_are_not_a_volume() {
        let g = Geometry::for_size(64 << 20).unwrap();
        let a = Superblock {
            geometry: g,
            generation: 3,
        }
        .encode();
        let b = Superblock {
            geometry: g,
            generation: 4,
        }
        .encode();
        let p = Path::new("/v");
        assert_eq!(Superblock::choose(p, &a, &b).unwrap().generation, 4);
        assert_eq!(
            Superblock::choose(p, &a, &[0u8; 4096]).unwrap().generation,
            3
        );
        let e = Superblock::choose(p, &[0u8; 4096], &[1u8; 4096]).unwrap_err();
        assert!(e.to_string().contains("no valid superblock"), "{e}");
    }

    #[test]
    fn journal_header_round_trips_and_refuses_oversized_lists() {
        let h = JournalHeader {
            seq: 9,
            pages: vec![600, 601, 9000],
            checksum: [5; 32],
        };
        assert_eq!(JournalHeader::decode(&h.encode()).unwrap(), h);
        let mut p = h.encode();
        p[16..20].copy_from_slice(&(MAX_COMMIT_PAGES as u32 + 1).to_le_bytes());
        assert!(JournalHeader::decode(&p).is_none());
    }
}
