use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::evictor;

fn store(pages: u64, cache: u64) -> (tempfile::TempDir, SwapStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("swap.img"))
        .expect("swap file");
    file.set_len(pages * PAGE).expect("size");
    let layout = Layout::new(pages, pages).expect("layout");
    let s = SwapStore::new("test", file, layout, cache).expect("store");
    (dir, s)
}

fn page(tag: u64) -> Vec<u8> {
    (0..PAGE / 8)
        .flat_map(|i| (tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_le_bytes())
        .collect()
}

fn read(s: &SwapStore, p: u64) -> (Vec<u8>, Place) {
    let mut b = vec![0; PAGE as usize];
    let place = s.read(p, &mut b).expect("read");
    (b, place)
}

fn file_page(dir: &tempfile::TempDir, p: u64) -> Vec<u8> {
    let f = std::fs::read(dir.path().join("swap.img")).expect("file");
    f[(p * PAGE) as usize..((p + 1) * PAGE) as usize].to_vec()
}

#[test]
fn pages_live_in_slots_until_the_cache_is_full_then_in_the_file() {
    let (dir, s) = store(64, 4);
    for p in 0..6 {
        let want = if p < 4 { Place::Cache } else { Place::File };
        assert_eq!(s.write(p, &page(p)).expect("write"), want, "page {p}");
    }
    for p in 0..6 {
        let (b, place) = read(&s, p);
        assert_eq!(b, page(p), "page {p}");
        assert_eq!(place, if p < 4 { Place::Cache } else { Place::File });
    }
    // The file has only what went through: cached pages are not written behind.
    assert_eq!(file_page(&dir, 5), page(5));
    assert_ne!(file_page(&dir, 0), page(0));
    assert_eq!(s.counters.cache_inserts.load(Ordering::Relaxed), 4);
    assert_eq!(s.counters.write_through.load(Ordering::Relaxed), 2);
    assert_eq!(s.occupancy(), (0, 4));
}

#[test]
fn a_rewrite_of_a_cached_page_replaces_it_in_place() {
    let (dir, s) = store(16, 2);
    s.write(3, &page(1)).expect("write");
    s.write(3, &page(2)).expect("rewrite");
    assert_eq!(read(&s, 3).0, page(2));
    assert_eq!(s.occupancy(), (1, 1));
    assert_ne!(file_page(&dir, 3), page(2));
}

#[test]
fn eviction_writes_the_file_before_freeing_the_slot_and_keeps_every_page() {
    let (dir, s) = store(64, 8);
    for p in 0..8 {
        s.write(p, &page(p)).expect("write");
    }
    // Page 0 was loaded since: the clock gives it a second chance.
    let _ = read(&s, 0);
    assert_eq!(s.evict(3), 3);
    assert_eq!(s.occupancy(), (3, 5));
    assert_eq!(read(&s, 0).1, Place::Cache, "the referenced page stayed");
    let in_file = (0..8).filter(|&p| file_page(&dir, p) == page(p)).count();
    assert_eq!(in_file, 3);
    for p in 0..8 {
        assert_eq!(read(&s, p).0, page(p), "page {p}");
    }
    assert_eq!(s.counters.evicted.load(Ordering::Relaxed), 3);
}

#[test]
fn a_page_stored_while_its_old_copy_is_evicted_wins() {
    let (dir, s) = store(16, 4);
    s.write(7, &page(1)).expect("write");
    let victims = s.lock().expect("lock").pick_victims(&mut 0, 1);
    assert_eq!(victims.len(), 1);
    assert_eq!(victims[0].1, 7);
    // The guest stores a new version while vmsight writes the old one out.
    s.lock().expect("lock").store(7, &page(2));
    assert_eq!(read(&s, 7).0, page(2));
    s.file.write_all_at(&page(1), 7 * PAGE).expect("old copy");
    let mut hand = Hand::default();
    assert_eq!(
        s.finish_evictions(&mut hand, victims),
        1,
        "the dead slot is freed"
    );
    assert_eq!(read(&s, 7).0, page(2), "the index still names the new slot");
    assert_eq!(file_page(&dir, 7), page(1));
    assert_eq!(s.occupancy(), (3, 1));
}

#[test]
fn an_invalidate_during_eviction_frees_the_slot_when_the_write_ends() {
    let (_dir, s) = store(16, 4);
    s.write(2, &page(2)).expect("write");
    let victims = s.lock().expect("lock").pick_victims(&mut 0, 1);
    s.discard(2).expect("discard");
    let mut hand = Hand::default();
    s.finish_evictions(&mut hand, victims);
    assert_eq!(s.occupancy(), (4, 0));
}

#[test]
fn shrinking_evicts_and_gives_memory_back_and_growing_grants_again() {
    let (dir, s) = store(256, 200);
    for p in 0..200 {
        s.write(p, &page(p)).expect("write");
    }
    let before = s.region().resident_bytes();
    s.set_target(50).expect("shrink");
    while evictor::step(&s) {}
    let (free, used) = s.occupancy();
    assert!(used <= 50 && free + used <= 50, "free {free} used {used}");
    assert!(
        s.region().resident_bytes() < before,
        "memory was given back"
    );
    for p in 0..200 {
        assert_eq!(read(&s, p).0, page(p), "page {p} after the shrink");
    }
    assert!((0..200).filter(|&p| file_page(&dir, p) == page(p)).count() >= 150);
    s.set_target(220).expect("grow");
    s.rebalance();
    let (free, used) = s.occupancy();
    assert_eq!(free + used, 220);
    assert!(s.set_target(1 << 20).is_err());
}

#[test]
fn the_evictor_keeps_free_slots_once_the_cache_is_full() {
    let (_dir, s) = store(1024, 512);
    for p in 0..512 {
        s.write(p, &page(p)).expect("write");
    }
    assert_eq!(s.occupancy().0, 0);
    while evictor::step(&s) {}
    let (free, _) = s.occupancy();
    assert!(free >= evictor::low_water(512), "free {free}");
}

#[test]
fn trimming_gives_back_free_slots_memory() {
    let (_dir, s) = store(256, 128);
    for p in 0..128 {
        s.write(p, &page(p)).expect("write");
    }
    for p in 0..128 {
        s.discard(p).expect("discard");
    }
    let before = s.region().resident_bytes();
    assert!(s.trim(1000) >= 128);
    assert!(s.region().resident_bytes() + 100 * PAGE <= before);
}

#[test]
fn one_trim_gives_back_scattered_stale_pages_past_already_punched_ones() {
    let (_dir, s) = store(256, 200);
    for p in 0..200 {
        s.write(p, &page(p)).expect("write");
    }
    for p in 0..100 {
        s.discard(p).expect("discard");
    }
    assert_eq!(s.trim(1000), 100, "every freed slot's page, in one call");
    assert_eq!(
        s.trim(1000),
        0,
        "already punched slots are not counted again"
    );
    for p in (100..200).step_by(4) {
        s.discard(p).expect("discard");
    }
    let before = s.region().resident_bytes();
    assert_eq!(s.trim(16), 16, "asked for 16 stale pages, 16 given back");
    assert_eq!(s.trim(1000), 9, "the rest in one more call");
    assert!(s.region().resident_bytes() + 25 * PAGE <= before);
    for p in 100..200 {
        if p % 4 != 0 {
            let mut b = vec![0; PAGE as usize];
            s.read(p, &mut b).expect("read");
            assert_eq!(b, page(p), "a used slot keeps its page");
        }
    }
}

#[test]
fn partial_and_out_of_range_requests_are_refused_cleanly() {
    let (_dir, s) = store(16, 4);
    assert!(matches!(s.write(16, &page(0)), Err(OpError::Range(16))));
    let mut b = vec![0; PAGE as usize];
    assert!(matches!(s.read(99, &mut b), Err(OpError::Range(99))));
    assert!(matches!(s.discard(u64::MAX), Err(OpError::Range(_))));
}

#[test]
fn a_guest_holding_the_lock_makes_requests_fail_not_hang() {
    let (_dir, s) = store(16, 4);
    s.region()
        .u32_at(s.hdr.lock)
        .expect("lock")
        .store(swapr::LOCK_GUEST, Ordering::Relaxed);
    let t = Instant::now();
    assert!(matches!(s.write(1, &page(1)), Err(OpError::Locked)));
    assert!(t.elapsed() >= LOCK_WAIT);
    assert_eq!(s.counters.lock_timeouts.load(Ordering::Relaxed), 1);
}

#[test]
fn a_mapped_slot_naming_a_page_beyond_the_disk_is_never_evicted_there() {
    let (dir, s) = store(16, 4);
    s.write(0, &page(0)).expect("write");
    let l = *s.layout();
    let slot = s
        .region()
        .u32_at(l.index_off)
        .expect("page 0's index entry");
    let slot = u64::from(slot.load(Ordering::Relaxed)) - 1;
    let word = s.region().u64_at(l.meta_off + slot * 8).expect("its state");
    word.store(
        encode(swapr::SLOT_MAPPED, u64::from(u32::MAX)),
        Ordering::Relaxed,
    );
    assert_eq!(s.evict(4), 0);
    let len = std::fs::metadata(dir.path().join("swap.img"))
        .expect("file")
        .len();
    assert_eq!(len, 16 * PAGE, "nothing written beyond the disk");
    assert!(s.counters.corrupt.load(Ordering::Relaxed) > 0);
}

#[test]
fn garbage_in_the_region_never_panics_or_reaches_outside_it() {
    let (_dir, s) = store(64, 32);
    let l = *s.layout();
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..200 {
        // Scribble over the header's counters, the index, the states and the stack.
        for _ in 0..64 {
            let off = (next() % l.data_off) & !7;
            if off == s.hdr.lock & !7 {
                continue;
            }
            if let Some(w) = s.region().u64_at(off) {
                w.store(next(), Ordering::Relaxed);
            }
        }
        let p = next() % 64;
        let _ = s.write(p, &page(round));
        let mut b = vec![0; PAGE as usize];
        let _ = s.read(next() % 64, &mut b);
        let _ = s.discard(next() % 64);
        let _ = s.set_target(next() % (l.slots + 1));
        let _ = evictor::step(&s);
        s.evict(4);
        s.trim(8);
    }
    assert!(s.counters.corrupt.load(Ordering::Relaxed) > 0);
}

#[test]
fn concurrent_writers_and_the_evictor_never_lose_a_page() {
    let (_dir, s) = store(512, 96);
    let s = Arc::new(s);
    let ev = crate::Evictor::start(s.clone()).expect("evictor");
    let workers: Vec<_> = (0..2u64)
        .map(|w| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut model = HashMap::new();
                let mut x = 0x2545_f491_4f6c_dd1du64 + w;
                for i in 0..3000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let p = w * 256 + x % 256;
                    if x.is_multiple_of(3) {
                        if let Some(v) = model.get(&p) {
                            assert_eq!(read(&s, p).0, page(*v), "worker {w} page {p}");
                        }
                    } else {
                        s.write(p, &page(i + w * 100_000)).expect("write");
                        model.insert(p, i + w * 100_000);
                    }
                    if i.is_multiple_of(500) {
                        s.set_target(32 + (x % 64)).expect("resize");
                    }
                }
                for (p, v) in model {
                    assert_eq!(read(&s, p).0, page(v), "worker {w} page {p} at the end");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    drop(ev);
    assert!(
        s.counters.evicted.load(Ordering::Relaxed) > 0,
        "eviction engaged"
    );
}

#[derive(Debug, Clone)]
enum Op {
    Write(u64, u64),
    Read(u64),
    Discard(u64),
    Evict(usize),
    Resize(u64),
    Step,
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..48u64, any::<u64>()).prop_map(|(p, v)| Op::Write(p, v)),
        4 => (0..48u64).prop_map(Op::Read),
        1 => (0..48u64).prop_map(Op::Discard),
        1 => (0..20usize).prop_map(Op::Evict),
        1 => (0..40u64).prop_map(Op::Resize),
        1 => Just(Op::Step),
        1 => Just(Op::Trim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_read_returns_the_last_write_whatever_the_cache_does(ops in prop::collection::vec(op(), 1..200)) {
        let (_dir, s) = store(48, 16);
        let mut model: HashMap<u64, u64> = HashMap::new();
        for o in ops {
            match o {
                Op::Write(p, v) => {
                    s.write(p, &page(v)).expect("write");
                    model.insert(p, v);
                }
                Op::Read(p) => {
                    if let Some(v) = model.get(&p) {
                        prop_assert_eq!(read(&s, p).0, page(*v));
                    }
                }
                Op::Discard(p) => {
                    s.discard(p).expect("discard");
                    model.remove(&p);
                }
                Op::Evict(n) => {
                    s.evict(n);
                }
                Op::Resize(t) => s.set_target(t).expect("resize"),
                Op::Step => {
                    evictor::step(&s);
                }
                Op::Trim => {
                    s.trim(64);
                }
            }
            let (free, used) = s.occupancy();
            prop_assert!(free + used <= s.layout().slots);
        }
        prop_assert_eq!(s.counters.corrupt.load(Ordering::Relaxed), 0);
    }
}
