//! Volume behaviour against a plain in-memory disk as the oracle, crash recovery, hints and
//! hostile metadata files.

use std::collections::HashMap;
use std::path::Path;

use proptest::prelude::*;
use vmsight_blockdev::insight::DedupHint;

use crate::format::BLOCK;
use crate::volume::{MetaCache, Volume, VolumeOptions, META_FILE};

const MIB: u64 = 1 << 20;

fn opts() -> VolumeOptions {
    VolumeOptions {
        meta_cache: MetaCache::Bytes(64 << 10),
        flush_every: 1 << 40,
        ..VolumeOptions::default()
    }
}

fn block(seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK as usize];
    for (i, b) in v.iter_mut().enumerate() {
        *b = (seed.wrapping_mul(2654435761).wrapping_add(i as u64 / 8) % 251) as u8;
    }
    v
}

fn none(_: usize) -> DedupHint {
    DedupHint::None
}

fn new_volume(dir: &Path, size: u64) -> Volume {
    Volume::create(dir, size).unwrap();
    Volume::open(dir, opts()).unwrap()
}

fn read_block(v: &mut Volume, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK as usize];
    v.read(lba * BLOCK, &mut b).unwrap();
    b
}

#[test]
fn a_new_volume_reads_zeros_and_checks_clean() {
    let d = tempfile::tempdir().unwrap();
    let mut v = new_volume(&d.path().join("v"), 4 * MIB);
    assert!(read_block(&mut v, 17) == vec![0u8; 4096]);
    let r = v.check().unwrap();
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(v.info().used_chunks, 0);
}

#[test]
fn identical_blocks_are_stored_once_and_gc_frees_them_after_discard() {
    let d = tempfile::tempdir().unwrap();
    let mut v = new_volume(&d.path().join("v"), 4 * MIB);
    v.write(0, &block(1), &none).unwrap();
    v.write(10 * BLOCK, &block(1), &none).unwrap();
    v.write(20 * BLOCK, &block(2), &none).unwrap();
    let i = v.info();
    assert_eq!((i.mapped_blocks, i.used_chunks), (3, 2));
    assert_eq!(v.counters.index_hits, 1);
    assert!(read_block(&mut v, 10) == block(1));
    v.discard(0, BLOCK, false).unwrap();
    v.discard(10 * BLOCK, BLOCK, false).unwrap();
    v.flush().unwrap();
    // The index still holds the content: the chunk stays until gc.
    assert_eq!(v.info().used_chunks, 2);
    assert_eq!(v.gc().unwrap(), 1);
    assert_eq!(v.info().used_chunks, 1);
    assert!(read_block(&mut v, 0) == vec![0u8; 4096]);
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn unique_hints_skip_the_index_and_copy_hints_hit_the_hint_cache() {
    let d = tempfile::tempdir().unwrap();
    Volume::create(&d.path().join("v"), 4 * MIB).unwrap();
    let mut o = opts();
    o.hints = true;
    let mut v = Volume::open(&d.path().join("v"), o).unwrap();
    v.write(0, &block(7), &|_| DedupHint::Unique).unwrap();
    assert_eq!(v.counters.unique_hints, 1);
    assert_eq!(v.counters.index_lookups, 0);
    assert_eq!(v.info().index_entries, 0);
    v.write(BLOCK, &block(8), &none).unwrap();
    // A copy: the source is read, the hint stage promotes it, the copy's write hits.
    let _ = read_block(&mut v, 1);
    assert_eq!(v.hints().lock().promote(1..2), 1);
    let lookups = v.counters.index_lookups;
    v.write(5 * BLOCK, &block(8), &|_| DedupHint::Copy).unwrap();
    assert_eq!(v.counters.hint_hits, 1);
    assert_eq!(
        v.counters.index_lookups, lookups,
        "no on-disk lookup for a hint hit"
    );
    assert_eq!(v.info().used_chunks, 2);
    // Overwriting and freeing the source's chunk drops it from the hint cache.
    v.write(BLOCK, &block(9), &none).unwrap();
    v.discard(5 * BLOCK, BLOCK, false).unwrap();
    v.gc().unwrap();
    assert_eq!(v.hints().lock().cached(), 0);
    v.write(6 * BLOCK, &block(8), &|_| DedupHint::Copy).unwrap();
    assert_eq!(v.counters.hint_hits, 1);
    assert!(read_block(&mut v, 6) == block(8));
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn partial_and_unaligned_writes_merge_with_the_old_contents() {
    let d = tempfile::tempdir().unwrap();
    let mut v = new_volume(&d.path().join("v"), 4 * MIB);
    v.write(0, &block(3), &none).unwrap();
    v.write(512, &[0xAA; 1024], &none).unwrap();
    let mut want = block(3);
    want[512..1536].fill(0xAA);
    assert!(read_block(&mut v, 0) == want);
    let mut got = vec![0u8; 1024];
    v.read(512, &mut got).unwrap();
    assert_eq!(got, vec![0xAA; 1024]);
    v.discard(1024, 4096, true).unwrap();
    want[1024..].fill(0);
    assert!(read_block(&mut v, 0) == want);
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn writes_after_the_last_flush_vanish_on_a_crash_and_earlier_ones_stay() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    {
        let mut v = new_volume(&dir, 4 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.flush().unwrap();
        v.write(0, &block(2), &none).unwrap();
        v.write(BLOCK, &block(3), &none).unwrap();
        // Dropped without a commit: what a SIGKILL leaves behind.
    }
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(read_block(&mut v, 0) == block(1));
    assert!(read_block(&mut v, 1) == vec![0u8; 4096]);
    assert!(v.check().unwrap().is_clean());
}

/// Meta-file offset of the header of journal record `seq`.
fn record_offset(meta: &[u8], seq: u64) -> usize {
    let j = crate::format::JOURNAL_START as usize;
    (j..j + crate::format::JOURNAL_PAGES as usize)
        .map(|pg| pg * BLOCK as usize)
        .find(|&o| {
            crate::format::JournalHeader::decode(&meta[o..o + BLOCK as usize])
                .is_some_and(|h| h.seq == seq)
        })
        .unwrap_or_else(|| panic!("journal record {seq} not found"))
}

#[test]
fn a_chain_of_committed_records_is_replayed_and_a_torn_record_ends_it() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    {
        let mut v = new_volume(&dir, 4 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.flush().unwrap();
        v.write(BLOCK, &block(2), &none).unwrap();
        v.flush().unwrap();
        // Dropped without a checkpoint: both commits live only in the journal.
        assert_eq!(
            v.meta_counters().checkpoints,
            0,
            "commits must not checkpoint here"
        );
        assert!(v.meta_counters().commits >= 2);
    }
    let meta = dir.join(META_FILE);
    let crashed = std::fs::read(&meta).unwrap();
    let gen_of = |bytes: &[u8]| {
        let sb = |slot: usize| {
            crate::format::Superblock::decode(&bytes[slot * 4096..(slot + 1) * 4096])
                .map(|s| s.generation)
                .unwrap_or(0)
        };
        sb(0).max(sb(1))
    };
    let g0 = gen_of(&crashed);
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(v.replayed());
    assert!(read_block(&mut v, 0) == block(1));
    assert!(read_block(&mut v, 1) == block(2));
    assert!(v.check().unwrap().is_clean());
    drop(v);
    assert!(gen_of(&std::fs::read(&meta).unwrap()) >= g0 + 2);

    // A torn second record (one image byte flipped) ends the chain: the first commit is
    // replayed, the second is not.
    let mut torn = crashed.clone();
    let second = record_offset(&torn, g0 + 2);
    torn[second + 4096 + 100] ^= 1;
    std::fs::write(&meta, &torn).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(v.replayed());
    assert!(read_block(&mut v, 0) == block(1));
    assert!(read_block(&mut v, 1) == vec![0u8; 4096]);
    assert!(v.check().unwrap().is_clean());
    drop(v);

    // A torn first record: nothing is replayed; the state of the create remains.
    let mut torn = crashed.clone();
    let first = record_offset(&torn, g0 + 1);
    torn[first + 4096 + 100] ^= 1;
    std::fs::write(&meta, &torn).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(!v.replayed());
    assert!(read_block(&mut v, 0) == vec![0u8; 4096]);
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn a_crash_in_the_middle_of_a_checkpoint_replays_the_journal_again() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    let meta = dir.join(META_FILE);
    let before;
    {
        let mut v = new_volume(&dir, 4 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.flush().unwrap();
        before = std::fs::read(&meta).unwrap();
        v.commit().unwrap(); // checkpoint: pages in place, then the superblock
        assert_eq!(v.meta_counters().checkpoints, 1);
    }
    // The in-place pages of the checkpoint landed, its superblock did not.
    let mut crashed = std::fs::read(&meta).unwrap();
    crashed[..2 * BLOCK as usize].copy_from_slice(&before[..2 * BLOCK as usize]);
    std::fs::write(&meta, &crashed).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(v.replayed());
    assert!(read_block(&mut v, 0) == block(1));
    assert!(v.check().unwrap().is_clean());
    // After the checkpoint the journal starts over, and new records follow the new
    // superblock; the old record left in the journal is never replayed again.
    v.write(BLOCK, &block(3), &none).unwrap();
    v.flush().unwrap();
    drop(v);
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(v.replayed());
    assert!(read_block(&mut v, 0) == block(1));
    assert!(read_block(&mut v, 1) == block(3));
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn a_full_journal_checkpoints_and_every_flushed_write_survives_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    Volume::create(&dir, 64 * MIB).unwrap();
    let mut big = opts();
    big.meta_cache = MetaCache::Percent(100.0);
    let blocks = 64 * MIB / BLOCK;
    {
        let mut v = Volume::open(&dir, big).unwrap();
        // Each flush dirties L2P pages far apart: records of several pages fill the journal.
        for i in 0..300u64 {
            let lba = (i * 2053) % blocks;
            v.write(lba * BLOCK, &block(i + 1000), &none).unwrap();
            v.flush().unwrap();
        }
        assert!(
            v.meta_counters().checkpoints > 0,
            "the journal never filled"
        );
        // Dropped without a final checkpoint.
    }
    let mut v = Volume::open(&dir, big).unwrap();
    assert!(v.replayed());
    for i in 0..300u64 {
        let lba = (i * 2053) % blocks;
        assert!(
            read_block(&mut v, lba) == block(i + 1000),
            "block {lba} of write {i}"
        );
    }
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn tables_known_empty_at_open_are_not_read_from_disk() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    {
        let mut v = new_volume(&dir, 64 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.commit().unwrap();
    }
    let mut v = Volume::open(&dir, opts()).unwrap();
    let reads = v.disk_counters().meta_reads;
    // Far from block 0: its L2P page and the reference counts of fresh chunks are empty.
    v.write(40 * MIB, &block(2), &|_| DedupHint::Unique)
        .unwrap();
    assert!(read_block(&mut v, 40 * MIB / BLOCK) == block(2));
    assert!(
        v.meta_counters().empty_misses >= 1,
        "{:?}",
        v.meta_counters()
    );
    // The new chunk's reference count shares a page with chunk 0's (not empty): that page
    // is the only one read.
    assert_eq!(
        v.disk_counters().meta_reads,
        reads + 1,
        "an empty table page was read"
    );
    // The changed page is no longer empty: after a checkpoint and a reopen it reads back.
    v.commit().unwrap();
    drop(v);
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(read_block(&mut v, 40 * MIB / BLOCK) == block(2));
    assert!(read_block(&mut v, 0) == block(1));
    assert!(v.check().unwrap().is_clean());
}

#[test]
fn a_checkpoint_forced_by_a_full_cache_writes_only_committed_images() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    Volume::create(&dir, 64 * MIB).unwrap();
    let mut tiny = opts();
    tiny.meta_cache = MetaCache::Bytes(8 * BLOCK);
    let per_page = 512u64; // L2P entries per page: each write below dirties its own page
    let mut durable = Vec::new();
    let mut v = Volume::open(&dir, tiny).unwrap();
    for i in 0..4u64 {
        v.write(i * per_page * BLOCK, &block(100 + i), &none)
            .unwrap();
        durable.push(i * per_page);
    }
    v.flush().unwrap();
    // Change the committed pages again (their committed images go aside), then touch more
    // pages until a miss finds the cache full of pinned pages and checkpoints.
    for i in 0..4u64 {
        v.write((i * per_page + 1) * BLOCK, &block(200 + i), &none)
            .unwrap();
    }
    let mut k = 4u64;
    while v.meta_counters().demand_checkpoints == 0 && k < 100 {
        v.write(k * per_page * BLOCK, &block(300 + k), &none)
            .unwrap();
        k += 1;
    }
    assert!(
        v.meta_counters().demand_checkpoints > 0,
        "{:?}",
        v.meta_counters()
    );
    drop(v); // crash: nothing after the flush (or a pressure commit) may be half applied
    let mut v = Volume::open(&dir, tiny).unwrap();
    assert!(v.check().unwrap().is_clean());
    for (i, lba) in durable.iter().enumerate() {
        assert!(
            read_block(&mut v, *lba) == block(100 + i as u64),
            "block {lba}"
        );
    }
    // The second writes either all survived (a pressure commit took them) or read as zeros
    // or as their new contents, never anything else.
    for i in 0..4u64 {
        let got = read_block(&mut v, i * per_page + 1);
        assert!(
            got == block(200 + i) || got == vec![0u8; 4096],
            "block {}",
            i * per_page + 1
        );
    }
}

#[test]
fn sequential_metadata_misses_read_ahead_in_one_io() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    Volume::create(&dir, 64 * MIB).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    // 64 MiB of distinct blocks, in order: the L2P map is walked page after page.
    for lba in 0..(64 * MIB / BLOCK) {
        v.write(lba * BLOCK, &block(lba + 7), &none).unwrap();
    }
    v.commit().unwrap();
    drop(v);
    let mut small = opts();
    small.meta_cache = MetaCache::Bytes(8 * BLOCK);
    let mut v = Volume::open(&dir, small).unwrap();
    let before = v.meta_counters();
    let mut buf = vec![0u8; 64 * 1024];
    for off in (0..64 * MIB).step_by(buf.len()) {
        v.read(off, &mut buf).unwrap();
    }
    let m = v.meta_counters();
    let l2p_pages = 64 * MIB / BLOCK / 512;
    assert!(
        m.readahead_pages > before.readahead_pages,
        "no readahead engaged: {m:?}"
    );
    assert!(
        m.misses - before.misses < l2p_pages,
        "{} misses for {l2p_pages} L2P pages read in order",
        m.misses - before.misses
    );
    // Every block still reads back.
    assert!(read_block(&mut v, 5) == block(12));
}

#[test]
fn check_reports_a_wrong_reference_count_and_a_chunk_that_does_not_match_its_hash() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    {
        let mut v = new_volume(&dir, 4 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.flush().unwrap();
    }
    let data = dir.join("data");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[10] ^= 0xFF;
    std::fs::write(&data, &bytes).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    let r = v.check().unwrap();
    assert!(!r.is_clean());
    assert!(
        r.problems.iter().any(|p| p.contains("does not hash")),
        "{r:?}"
    );
}

#[test]
fn a_second_opener_is_refused_while_the_volume_is_open() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    let _v = new_volume(&dir, 4 * MIB);
    let e = Volume::open(&dir, opts()).err().unwrap();
    assert!(e.to_string().contains("in use"), "{e}");
}

#[test]
fn truncated_or_garbage_metadata_is_a_clear_error_on_open() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    drop(new_volume(&dir, 4 * MIB));
    let meta = dir.join(META_FILE);
    let good = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, &good[..good.len() / 2]).unwrap();
    let e = Volume::open(&dir, opts()).err().unwrap().to_string();
    assert!(e.contains("truncated"), "{e}");
    std::fs::write(&meta, &good[..100]).unwrap();
    let e = Volume::open(&dir, opts()).err().unwrap().to_string();
    assert!(e.contains("not a vmsight dedup volume"), "{e}");
    std::fs::write(&meta, vec![0x5a; good.len()]).unwrap();
    let e = Volume::open(&dir, opts()).err().unwrap().to_string();
    assert!(e.contains("no valid superblock"), "{e}");
    let e = Volume::open(&d.path().join("missing"), opts())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no such directory"), "{e}");
}

#[test]
fn export_and_import_round_trip_through_a_raw_image() {
    let d = tempfile::tempdir().unwrap();
    let mut v = new_volume(&d.path().join("v"), 4 * MIB);
    v.write(3 * BLOCK, &block(5), &none).unwrap();
    v.write(700 * BLOCK, &block(6), &none).unwrap();
    let raw = d.path().join("raw.img");
    assert_eq!(v.export(&raw).unwrap(), 2 * BLOCK);
    let bytes = std::fs::read(&raw).unwrap();
    assert_eq!(bytes.len() as u64, 4 * MIB);
    assert_eq!(&bytes[3 * 4096..4 * 4096], &block(5)[..]);
    let mut w = new_volume(&d.path().join("w"), 4 * MIB);
    assert_eq!(w.import(&raw).unwrap(), 2 * BLOCK);
    assert!(read_block(&mut w, 700) == block(6));
    assert!(w.check().unwrap().is_clean());
}

#[test]
fn a_full_volume_reports_full_and_stays_consistent() {
    let d = tempfile::tempdir().unwrap();
    let mut v = new_volume(&d.path().join("v"), MIB);
    let chunks = v.geometry().physical_blocks;
    let mut err = None;
    // Unique content everywhere, overwritten again and again, never flushed: old chunks
    // come back through the pressure commit; the volume fills only when data exceeds it.
    for round in 0..3u64 {
        for lba in 0..v.geometry().logical_blocks {
            if let Err(e) = v.write(lba * BLOCK, &block(round * 10_000 + lba), &none) {
                err = Some(e);
                break;
            }
        }
    }
    // Index-held chunks of earlier rounds are freed by the automatic gc.
    assert!(err.is_none(), "{err:?} with {chunks} chunks");
    assert!(v.check().unwrap().is_clean());
}

#[derive(Debug, Clone)]
enum Op {
    Write {
        lba: u64,
        n: u64,
        seed: u64,
        unique: bool,
    },
    Discard {
        lba: u64,
        n: u64,
    },
    Flush,
    Checkpoint,
    Gc,
    Crash,
}

/// Blocks of the property-test volume: 8 L2P pages, so that a cache of 8 pages runs full of
/// pinned pages and checkpoints on demand.
const PROP_BLOCKS: u64 = 4096;

fn prop_opts() -> VolumeOptions {
    let mut o = opts();
    o.meta_cache = MetaCache::Bytes(8 * BLOCK);
    o
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..PROP_BLOCKS - 8, 1u64..8, 0u64..12, any::<bool>())
            .prop_map(|(lba, n, seed, unique)| Op::Write { lba, n, seed, unique }),
        2 => (0u64..PROP_BLOCKS - 16, 1u64..16).prop_map(|(lba, n)| Op::Discard { lba, n }),
        2 => Just(Op::Flush),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Gc),
        1 => Just(Op::Crash),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random writes (few distinct contents, so much is shared), discards, flushes, gc and
    /// crashes: every block reads back what a plain disk would hold (as of the last flush
    /// after a crash), and check is clean after every reopen.
    #[test]
    fn a_volume_behaves_like_a_plain_disk_through_crashes(ops in prop::collection::vec(op(), 1..60)) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("v");
        Volume::create(&dir, PROP_BLOCKS * BLOCK).unwrap();
        let mut v = Some(Volume::open(&dir, prop_opts()).unwrap());
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut durable = live.clone();
        for op in ops {
            let vol = v.as_mut().unwrap();
            // A commit (dirty-page pressure in a small cache) makes everything so far durable,
            // so blocks go one at a time and the model follows every commit.
            let commits = |vol: &Volume| vol.meta_counters().commits;
            match op {
                Op::Write { lba, n, seed, unique } => {
                    let h = move |_| if unique { DedupHint::Unique } else { DedupHint::None };
                    for k in 0..n {
                        let c0 = commits(vol);
                        vol.write((lba + k) * BLOCK, &block(seed + k), &h).unwrap();
                        live.insert(lba + k, seed + k);
                        if commits(vol) != c0 { durable = live.clone(); }
                    }
                }
                Op::Discard { lba, n } => {
                    for k in 0..n {
                        let c0 = commits(vol);
                        vol.discard((lba + k) * BLOCK, BLOCK, false).unwrap();
                        live.remove(&(lba + k));
                        if commits(vol) != c0 { durable = live.clone(); }
                    }
                }
                Op::Flush => { vol.flush().unwrap(); durable = live.clone(); }
                Op::Checkpoint => { vol.commit().unwrap(); durable = live.clone(); }
                Op::Gc => { vol.gc().unwrap(); durable = live.clone(); }
                Op::Crash => {
                    drop(v.take());
                    let mut w = Volume::open(&dir, prop_opts()).unwrap();
                    let r = w.check().unwrap();
                    prop_assert!(r.is_clean(), "{:?}", r.problems);
                    live = durable.clone();
                    v = Some(w);
                }
            }
        }
        let vol = v.as_mut().unwrap();
        for lba in 0..PROP_BLOCKS {
            let want = live.get(&lba).map_or(vec![0u8; 4096], |s| block(*s));
            prop_assert!(read_block(vol, lba) == want, "block {}", lba);
        }
        let r = vol.check().unwrap();
        prop_assert!(r.is_clean(), "{:?}", r.problems);
    }

    /// Garbage in any table page never panics: operations and check return errors or
    /// report problems.
    #[test]
    fn garbage_table_pages_never_panic(page in 0u64..64, fill in any::<u8>(), at in 0usize..4096) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("v");
        {
            let mut v = new_volume(&dir, MIB);
            for lba in 0..40 { v.write(lba * BLOCK, &block(lba % 5), &none).unwrap(); }
            v.flush().unwrap();
        }
        let meta = dir.join(META_FILE);
        let mut bytes = std::fs::read(&meta).unwrap();
        let geo = crate::format::Geometry::for_size(MIB).unwrap();
        let p = (geo.l2p_start() + page % (geo.meta_pages() - geo.l2p_start())) as usize;
        let o = p * 4096;
        for b in &mut bytes[o + at.min(4000)..o + 4096] { *b = fill; }
        std::fs::write(&meta, &bytes).unwrap();
        if let Ok(mut v) = Volume::open(&dir, opts()) {
            let mut buf = vec![0u8; 8192];
            let _ = v.read(0, &mut buf);
            let _ = v.write(4096, &block(99), &none);
            let _ = v.discard(0, 65536, false);
            let _ = v.gc();
            let _ = v.check();
        }
    }
}
