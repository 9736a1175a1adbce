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

#[test]
fn a_committed_journal_is_replayed_and_a_torn_one_ignored() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("v");
    {
        let mut v = new_volume(&dir, 4 * MIB);
        v.write(0, &block(1), &none).unwrap();
        v.flush().unwrap();
    }
    // Simulate a crash after the journal write of commit 2 but before its in-place writes:
    // roll the superblocks back to generation 1 by restoring slot 1 to its old image.
    let meta = dir.join(META_FILE);
    let before = std::fs::read(&meta).unwrap();
    {
        let mut v = Volume::open(&dir, opts()).unwrap();
        v.write(BLOCK, &block(2), &none).unwrap();
        v.flush().unwrap();
    }
    let after = std::fs::read(&meta).unwrap();
    let mut crashed = before.clone();
    let j = (2 * BLOCK) as usize..((2 + crate::format::JOURNAL_PAGES) * BLOCK) as usize;
    crashed[j.clone()].copy_from_slice(&after[j.clone()]);
    std::fs::write(&meta, &crashed).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(v.replayed());
    assert!(read_block(&mut v, 1) == block(2));
    assert!(v.check().unwrap().is_clean());
    drop(v);
    // A torn record (one image byte flipped) is not replayed: the old state remains.
    crashed[j.start + 4096 + 100] ^= 1;
    std::fs::write(&meta, &crashed).unwrap();
    let mut v = Volume::open(&dir, opts()).unwrap();
    assert!(!v.replayed());
    assert!(read_block(&mut v, 0) == block(1));
    assert!(read_block(&mut v, 1) == vec![0u8; 4096]);
    assert!(v.check().unwrap().is_clean());
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
    Gc,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..200, 1u64..8, 0u64..12, any::<bool>())
            .prop_map(|(lba, n, seed, unique)| Op::Write { lba, n, seed, unique }),
        2 => (0u64..200, 1u64..16).prop_map(|(lba, n)| Op::Discard { lba, n }),
        2 => Just(Op::Flush),
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
        Volume::create(&dir, MIB).unwrap();
        let mut v = Some(Volume::open(&dir, opts()).unwrap());
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut durable = live.clone();
        for op in ops {
            let vol = v.as_mut().unwrap();
            match op {
                Op::Write { lba, n, seed, unique } => {
                    let mut buf = Vec::new();
                    for k in 0..n {
                        buf.extend(block(seed + k));
                        live.insert(lba + k, seed + k);
                    }
                    let h = move |_| if unique { DedupHint::Unique } else { DedupHint::None };
                    vol.write(lba * BLOCK, &buf, &h).unwrap();
                }
                Op::Discard { lba, n } => {
                    vol.discard(lba * BLOCK, n * BLOCK, false).unwrap();
                    for k in 0..n { live.remove(&(lba + k)); }
                }
                Op::Flush => { vol.flush().unwrap(); durable = live.clone(); }
                Op::Gc => { vol.gc().unwrap(); durable = live.clone(); }
                Op::Crash => {
                    drop(v.take());
                    let mut w = Volume::open(&dir, opts()).unwrap();
                    let r = w.check().unwrap();
                    prop_assert!(r.is_clean(), "{:?}", r.problems);
                    live = durable.clone();
                    v = Some(w);
                }
            }
        }
        let vol = v.as_mut().unwrap();
        for lba in 0..256u64 {
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
