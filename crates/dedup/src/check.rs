//! `vmsight dedup check`: every table against every other and against the data.

use serde::Serialize;

use crate::error::Result;
use crate::format::{
    hash_chunk, u16_at, u32_at, u64_at, Hash, BLOCK, BUCKET_HEADER, BUCKET_OVERFLOW,
    ENTRIES_PER_BUCKET, ENTRY_BYTES, RC_PER_PAGE,
};
use crate::volume::Volume;

/// Problems listed in full; beyond that they are counted.
const MAX_LISTED: usize = 100;

/// What `check` found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    /// Logical blocks mapped.
    pub mapped_blocks: u64,
    /// Chunks with a reference count above zero.
    pub referenced_chunks: u64,
    /// Index entries, and how many of them were hashed again and matched.
    pub index_entries: u64,
    pub verified_chunks: u64,
    /// Commit generation checked.
    pub generation: u64,
    /// Whether opening the volume replayed an unfinished commit.
    pub replayed: bool,
    /// Every inconsistency (the first 100), one sentence each.
    pub problems: Vec<String>,
    /// Problems in all.
    pub problem_count: u64,
}

impl CheckReport {
    /// True when nothing is inconsistent.
    pub fn is_clean(&self) -> bool {
        self.problem_count == 0
    }

    fn problem(&mut self, p: String) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED {
            self.problems.push(p);
        }
    }
}

/// Runs the check on a volume whose state is committed.
pub(crate) fn run(v: &mut Volume) -> Result<CheckReport> {
    let geo = v.geometry();
    let mut r = CheckReport {
        generation: v.info().generation,
        replayed: v.replayed(),
        ..CheckReport::default()
    };
    let mut expected = vec![0u64; geo.physical_blocks as usize];
    v.raw_mappings(|lba, e| {
        if lba >= geo.logical_blocks {
            r.problem(format!("L2P slot {lba} beyond the volume is mapped"));
            return;
        }
        r.mapped_blocks += 1;
        match expected.get_mut((e - 1) as usize) {
            Some(c) => *c += 1,
            None => r.problem(format!(
                "logical block {lba} maps to chunk {} beyond the volume",
                e - 1
            )),
        }
    })?;
    check_index(v, &mut r, &mut expected)?;
    let mut page = vec![0u8; BLOCK as usize];
    for p in 0..geo.rc_pages() {
        v.raw_table_page(geo.rc_start() + p, &mut page)?;
        for i in 0..RC_PER_PAGE as usize {
            let pba = p * RC_PER_PAGE + i as u64;
            if pba >= geo.physical_blocks {
                break;
            }
            let have = u64::from(u32_at(&page, i * 4));
            let want = expected[pba as usize];
            if have > 0 {
                r.referenced_chunks += 1;
            }
            if have != want {
                let what = if want == 0 { "orphan chunk" } else { "chunk" };
                r.problem(format!(
                    "{what} {pba}: reference count {have}, but {want} references exist"
                ));
            }
            if have > 0 && v.is_free(pba) {
                r.problem(format!(
                    "chunk {pba} is referenced and also on the free list"
                ));
            }
        }
    }
    Ok(r)
}

fn check_index(v: &mut Volume, r: &mut CheckReport, expected: &mut [u64]) -> Result<()> {
    let geo = v.geometry();
    let mut page = vec![0u8; BLOCK as usize];
    let mut chunk = vec![0u8; BLOCK as usize];
    let mut overflow = vec![false; geo.index_buckets as usize];
    let mut entries: Vec<(u64, Hash, u64)> = Vec::new();
    for b in 0..geo.index_buckets {
        v.raw_table_page(geo.index_start() + b, &mut page)?;
        let n = u16_at(&page, 0) as usize;
        overflow[b as usize] = u16_at(&page, 2) & BUCKET_OVERFLOW != 0;
        if n > ENTRIES_PER_BUCKET {
            r.problem(format!(
                "index page {b} claims {n} entries (at most {ENTRIES_PER_BUCKET})"
            ));
            continue;
        }
        for i in 0..n {
            let o = BUCKET_HEADER + i * ENTRY_BYTES;
            let mut h = [0u8; 32];
            h.copy_from_slice(&page[o..o + 32]);
            entries.push((b, h, u64_at(&page, o + 32)));
        }
    }
    let mut by_hash = std::collections::HashSet::new();
    let mut by_chunk = std::collections::HashSet::new();
    for (b, h, pba) in entries {
        r.index_entries += 1;
        if pba >= geo.physical_blocks {
            r.problem(format!(
                "index page {b} names chunk {pba} beyond the volume"
            ));
            continue;
        }
        expected[pba as usize] += 1;
        if !by_hash.insert(h) {
            r.problem(format!(
                "a hash is indexed twice (second copy on index page {b})"
            ));
        }
        if !by_chunk.insert(pba) {
            r.problem(format!("chunk {pba} is indexed under two hashes"));
        }
        if !reachable(geo.bucket_of(&h), b, geo.index_buckets, &overflow) {
            r.problem(format!(
                "the entry for chunk {pba} on index page {b} cannot be found from its home page"
            ));
        }
        v.read_chunk(pba, &mut chunk)?;
        if hash_chunk(&chunk) == h {
            r.verified_chunks += 1;
        } else {
            r.problem(format!("chunk {pba} does not hash to its index entry"));
        }
    }
    Ok(())
}

/// Whether a probe from `home` reaches page `at`: every page before it overflowed.
fn reachable(home: u64, at: u64, buckets: u64, overflow: &[bool]) -> bool {
    let mut b = home;
    for _ in 0..buckets {
        if b == at {
            return true;
        }
        if !overflow[b as usize] {
            return false;
        }
        b = (b + 1) % buckets;
    }
    false
}
