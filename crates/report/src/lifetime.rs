//! Block lifetimes (Sky §6.2): how long a 4 KiB block of file data stays live on the disk.
//!
//! A block is born when a data write (content `data` or `mixed`) covers it. Its life ends at
//! the first of:
//! - an **overwrite**: any later write to the same disk block (data or metadata: the block was
//!   reused), or a data write of the same file offset chunk to another disk block (the file
//!   system relocated it, e.g. copy-on-write);
//! - a **discard** (or write-zeroes) request covering the disk block;
//! - an **unlink** of the file that owns the block;
//! - a **truncate** of the owning file to a size at or below the block's file offset (a block
//!   that keeps some bytes of the file stays alive).
//!
//! Blocks still alive at the end of the log are reported separately with their age at the last
//! record, as Sky's Figure 5 does (its CDF does not reach 1.0). Only blocks of `data` requests
//! with a known file and file offset have an owner; `mixed` requests are tracked by disk block
//! only, because which of their chunks are metadata is not recorded.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Block size of the lifetime accounting: the 4 KiB chunk of Sky's checksums.
pub const BLOCK: u64 = 4096;

/// What ended a block's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EndKind {
    /// Rewritten in place, reused for other data or metadata, or relocated by the file system.
    Overwrite,
    /// Discarded (TRIM/UNMAP) or zeroed.
    Discard,
    /// Its file was unlinked.
    Unlink,
    /// Its file was truncated below the block's offset.
    Truncate,
}

impl EndKind {
    /// Every kind, in report order.
    pub const ALL: [EndKind; 4] = [
        EndKind::Overwrite,
        EndKind::Discard,
        EndKind::Unlink,
        EndKind::Truncate,
    ];

    /// Lower-case name, as in the JSON output.
    pub fn name(self) -> &'static str {
        match self {
            EndKind::Overwrite => "overwrite",
            EndKind::Discard => "discard",
            EndKind::Unlink => "unlink",
            EndKind::Truncate => "truncate",
        }
    }
}

/// (file, 4 KiB chunk index in the file).
type Owner = (Arc<str>, u64);

#[derive(Debug)]
struct Live {
    born_ns: u64,
    owner: Option<Owner>,
}

/// Follows block births and deaths through the records of an insight log.
#[derive(Debug, Default)]
pub struct Tracker {
    /// (disk, block number) → the live block there.
    blocks: HashMap<(u32, u64), Live>,
    /// file → chunk → (disk, block) of its live blocks, ordered for truncate ranges.
    files: HashMap<Arc<str>, BTreeMap<u64, (u32, u64)>>,
    ended: Vec<(u64, EndKind)>,
    born: u64,
    last_ns: u64,
}

/// Blocks `offset..offset+len` touches (partly covered blocks included).
fn blocks_of(offset: u64, len: u64) -> std::ops::Range<u64> {
    let first = offset / BLOCK;
    let end = offset.saturating_add(len).div_ceil(BLOCK);
    first..end.max(first)
}

impl Tracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    fn seen(&mut self, ts_ns: u64) {
        self.last_ns = self.last_ns.max(ts_ns);
    }

    fn end_block(&mut self, key: (u32, u64), ts_ns: u64, kind: EndKind) {
        if let Some(live) = self.blocks.remove(&key) {
            if let Some((file, chunk)) = &live.owner {
                if let Some(chunks) = self.files.get_mut(file) {
                    if chunks.get(chunk) == Some(&key) {
                        chunks.remove(chunk);
                    }
                    if chunks.is_empty() {
                        self.files.remove(file);
                    }
                }
            }
            self.ended.push((ts_ns.saturating_sub(live.born_ns), kind));
        }
    }

    /// A write of `len` bytes at disk byte `offset`. `data` says whether it carries file data
    /// (born blocks) or metadata (only ends lives); `file` and `file_offset` (of the request's
    /// first byte) give data blocks an owner.
    pub fn write(
        &mut self,
        ts_ns: u64,
        disk: u32,
        offset: u64,
        len: u64,
        data: bool,
        owner: Option<(&Arc<str>, u64)>,
    ) {
        self.seen(ts_ns);
        for b in blocks_of(offset, len) {
            self.end_block((disk, b), ts_ns, EndKind::Overwrite);
            if !data {
                continue;
            }
            let owner = owner.map(|(file, file_offset)| {
                // The file byte stored at this block's first byte the request covers.
                let disk_pos = (b * BLOCK).max(offset);
                let chunk = (file_offset + (disk_pos - offset)) / BLOCK;
                (Arc::clone(file), chunk)
            });
            if let Some((file, chunk)) = &owner {
                // The same file chunk written elsewhere: the old copy is dead (relocation).
                let old = self.files.get(file).and_then(|c| c.get(chunk)).copied();
                if let Some(old) = old {
                    self.end_block(old, ts_ns, EndKind::Overwrite);
                }
                self.files
                    .entry(Arc::clone(file))
                    .or_default()
                    .insert(*chunk, (disk, b));
            }
            self.blocks.insert(
                (disk, b),
                Live {
                    born_ns: ts_ns,
                    owner,
                },
            );
            self.born += 1;
        }
    }

    /// A discard or write-zeroes request.
    pub fn discard(&mut self, ts_ns: u64, disk: u32, offset: u64, len: u64) {
        self.seen(ts_ns);
        for b in blocks_of(offset, len) {
            self.end_block((disk, b), ts_ns, EndKind::Discard);
        }
    }

    /// `file` was unlinked.
    pub fn unlink(&mut self, ts_ns: u64, file: &str) {
        self.seen(ts_ns);
        let keys: Vec<(u32, u64)> = self
            .files
            .get(file)
            .map(|c| c.values().copied().collect())
            .unwrap_or_default();
        for k in keys {
            self.end_block(k, ts_ns, EndKind::Unlink);
        }
    }

    /// `file` was truncated to `size` bytes: blocks whose file offset is `>= size` die.
    pub fn truncate(&mut self, ts_ns: u64, file: &str, size: u64) {
        self.seen(ts_ns);
        let first_dead = size.div_ceil(BLOCK);
        let keys: Vec<(u32, u64)> = self
            .files
            .get(file)
            .map(|c| c.range(first_dead..).map(|(_, k)| *k).collect())
            .unwrap_or_default();
        for k in keys {
            self.end_block(k, ts_ns, EndKind::Truncate);
        }
    }

    /// Any other record: only advances the clock for the age of live blocks.
    pub fn observe(&mut self, ts_ns: u64) {
        self.seen(ts_ns);
    }

    /// The lifetimes: ended ones with their kind, and the ages of blocks alive at the end.
    pub fn finish(self) -> Lifetimes {
        let last = self.last_ns;
        let mut alive: Vec<u64> = self
            .blocks
            .values()
            .map(|l| last.saturating_sub(l.born_ns))
            .collect();
        alive.sort_unstable();
        let mut ended = self.ended;
        ended.sort_unstable();
        Lifetimes {
            born: self.born,
            ended,
            alive,
        }
    }
}

/// The result of a [`Tracker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifetimes {
    /// Blocks born (one per block per data write).
    pub born: u64,
    /// (lifetime in ns, what ended it), sorted by lifetime.
    pub ended: Vec<(u64, EndKind)>,
    /// Ages in ns at the last record of the blocks still alive, sorted.
    pub alive: Vec<u64>,
}

/// Order statistics of a set of durations, in ns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub min_ns: u64,
    pub p10_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `sorted` (ascending); `None` when empty.
    pub fn of(sorted: &[u64]) -> Option<Self> {
        let n = sorted.len();
        if n == 0 {
            return None;
        }
        let at = |p: u64| {
            // Nearest rank: ceil(p/100 * n), 1-based.
            let rank = (p as usize * n).div_ceil(100).max(1);
            sorted[rank.min(n) - 1]
        };
        Some(Self {
            count: n as u64,
            min_ns: sorted[0],
            p10_ns: at(10),
            p50_ns: at(50),
            p90_ns: at(90),
            p99_ns: at(99),
            max_ns: sorted[n - 1],
        })
    }
}

impl Lifetimes {
    /// Sorted lifetimes of the blocks ended by `kind`, or by anything when `None`.
    pub fn durations(&self, kind: Option<EndKind>) -> Vec<u64> {
        self.ended
            .iter()
            .filter(|(_, k)| kind.is_none_or(|want| *k == want))
            .map(|(d, _)| *d)
            .collect()
    }

    /// Fraction of all born blocks whose life ended within `limit_ns` (the CDF of Sky's
    /// Figure 5: blocks still alive keep it below 1).
    pub fn cdf_at(&self, limit_ns: u64) -> f64 {
        if self.born == 0 {
            return 0.0;
        }
        let n = self.ended.partition_point(|(d, _)| *d <= limit_ns);
        n as f64 / self.born as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn overwrite_in_place_ends_the_old_block() {
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(S, 0, 8192, 8192, true, Some((&a, 0)));
        t.write(4 * S, 0, 12288, 4096, true, Some((&a, 4096)));
        t.observe(10 * S);
        let l = t.finish();
        assert_eq!(l.born, 3);
        assert_eq!(l.ended, vec![(3 * S, EndKind::Overwrite)]);
        // Block 2 born at 1 s, block 3 (new) at 4 s: ages 9 s and 6 s at 10 s.
        assert_eq!(l.alive, vec![6 * S, 9 * S]);
    }

    #[test]
    fn metadata_write_over_a_data_block_ends_it_without_a_birth() {
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(S, 1, 0, 4096, true, Some((&a, 0)));
        t.write(2 * S, 1, 0, 4096, false, None);
        let l = t.finish();
        assert_eq!(l.born, 1);
        assert_eq!(l.ended, vec![(S, EndKind::Overwrite)]);
        assert!(l.alive.is_empty());
    }

    #[test]
    fn relocated_file_chunk_ends_the_old_copy() {
        // Copy-on-write: chunk 0 of /a moves from block 10 to block 20.
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(S, 0, 10 * BLOCK, BLOCK, true, Some((&a, 0)));
        t.write(3 * S, 0, 20 * BLOCK, BLOCK, true, Some((&a, 0)));
        t.unlink(7 * S, "/a");
        let l = t.finish();
        assert_eq!(
            l.ended,
            vec![(2 * S, EndKind::Overwrite), (4 * S, EndKind::Unlink)]
        );
    }

    #[test]
    fn discard_ends_only_the_covered_blocks() {
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(0, 0, 0, 4 * BLOCK, true, Some((&a, 0)));
        t.discard(5 * S, 0, BLOCK, 2 * BLOCK);
        t.discard(6 * S, 1, BLOCK, 2 * BLOCK); // other disk: nothing
        let l = t.finish();
        assert_eq!(
            l.ended,
            vec![(5 * S, EndKind::Discard), (5 * S, EndKind::Discard)]
        );
        assert_eq!(l.alive.len(), 2);
    }

    #[test]
    fn unlink_ends_every_block_of_the_file_and_nothing_else() {
        let mut t = Tracker::new();
        let (a, b) = (f("/a"), f("/b"));
        t.write(S, 0, 0, 3 * BLOCK, true, Some((&a, 0)));
        t.write(2 * S, 0, 100 * BLOCK, BLOCK, true, Some((&b, 0)));
        t.unlink(31 * S, "/a");
        t.unlink(32 * S, "/nonexistent");
        let l = t.finish();
        assert_eq!(l.ended, vec![(30 * S, EndKind::Unlink); 3]);
        assert_eq!(l.alive, vec![30 * S]);
        // A later write of the freed blocks is a new birth, not an overwrite.
        let mut t2 = Tracker::new();
        t2.write(S, 0, 0, BLOCK, true, Some((&a, 0)));
        t2.unlink(2 * S, "/a");
        t2.write(3 * S, 0, 0, BLOCK, true, Some((&b, 0)));
        let l2 = t2.finish();
        assert_eq!(l2.ended, vec![(S, EndKind::Unlink)]);
        assert_eq!(l2.born, 2);
    }

    #[test]
    fn truncate_ends_blocks_at_or_beyond_the_new_size_only() {
        let mut t = Tracker::new();
        let a = f("/a");
        // Chunks 0..4 of /a at blocks 0..4.
        t.write(0, 0, 0, 4 * BLOCK, true, Some((&a, 0)));
        // Size 5000: chunk 1 (4096..8192) still holds bytes 4096..5000, so it lives.
        t.truncate(2 * S, "/a", 5000);
        let l = t.finish();
        assert_eq!(l.ended, vec![(2 * S, EndKind::Truncate); 2]);
        assert_eq!(l.alive.len(), 2);

        let mut t = Tracker::new();
        t.write(0, 0, 0, 2 * BLOCK, true, Some((&a, 0)));
        t.truncate(S, "/a", 4096); // exactly one chunk kept
        t.truncate(2 * S, "/a", 0); // everything
        let l = t.finish();
        assert_eq!(
            l.ended,
            vec![(S, EndKind::Truncate), (2 * S, EndKind::Truncate)]
        );
    }

    #[test]
    fn misaligned_request_maps_file_offsets_per_block() {
        // A request starting mid-block at disk byte 6144 with file offset 2048: its blocks 1
        // and 2 hold file chunks 0 and 1.
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(0, 0, 6144, 4096, true, Some((&a, 2048)));
        t.truncate(S, "/a", 4096);
        let l = t.finish();
        assert_eq!(l.born, 2);
        assert_eq!(l.ended, vec![(S, EndKind::Truncate)]);
    }

    #[test]
    fn mixed_blocks_have_no_owner() {
        // A mixed request of /a's: not owned, so /a's unlink does not end it.
        let mut t = Tracker::new();
        t.write(0, 0, 0, BLOCK, true, None);
        t.unlink(S, "/a");
        let l = t.finish();
        assert!(l.ended.is_empty());
        assert_eq!(l.alive.len(), 1);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        let p = Percentiles::of(&v).unwrap();
        assert_eq!(
            (p.min_ns, p.p10_ns, p.p50_ns, p.p90_ns, p.p99_ns, p.max_ns),
            (1, 10, 50, 90, 99, 100)
        );
        let p = Percentiles::of(&[7]).unwrap();
        assert_eq!((p.p10_ns, p.p99_ns), (7, 7));
        assert!(Percentiles::of(&[]).is_none());
    }

    #[test]
    fn cdf_counts_alive_blocks_in_the_denominator() {
        let mut t = Tracker::new();
        let a = f("/a");
        t.write(0, 0, 0, 4 * BLOCK, true, Some((&a, 0)));
        t.discard(S, 0, 0, BLOCK);
        t.discard(3 * S, 0, BLOCK, BLOCK);
        let l = t.finish();
        assert_eq!(l.cdf_at(S / 2), 0.0);
        assert_eq!(l.cdf_at(S), 0.25);
        assert_eq!(l.cdf_at(100 * S), 0.5);
    }
}
