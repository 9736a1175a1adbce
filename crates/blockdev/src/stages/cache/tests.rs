//! Tests of the iCache against an in-memory disk and a model of what the disk must hold.

use super::*;
use crate::insight::{RequestInsight, CLASS_METADATA};
use crate::pipeline::{Pipeline, Terminal};
use crate::request::SectorRange;
use crate::stages::memdisk::MemDisk;
use vm_memory::GuestMemoryMmap;

const BS: u64 = 4096;

/// `Next` that goes straight to a [`MemDisk`] we can still inspect.
struct ToDisk<'a>(&'a mut MemDisk);
impl Next for ToDisk<'_> {
    fn run(&mut self, req: &mut Request) -> Result<Status, StageError> {
        self.0.execute(req)
    }
}

use crate::testrng::Rng;

fn guest_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).expect("guest memory")
}

fn insight(class: u8, journal: bool) -> Option<Insights> {
    let mut i = RequestInsight::metadata();
    i.class = class;
    i.journal = journal;
    Some(Arc::new(i))
}

fn cache(blocks: u64, policy: CachePolicy, mode: CacheMode) -> ICache {
    ICache::new(CacheConfig {
        size_bytes: blocks * BS,
        policy,
        mode,
        block_size: BS as u32,
    })
    .expect("cache")
    .0
}

/// Segments of `len` bytes in guest memory at `base`, split at `cuts` (byte positions).
fn segments(base: u64, len: u64, cuts: &[u64]) -> Vec<Segment> {
    let mut points: Vec<u64> = cuts.iter().copied().filter(|&c| c > 0 && c < len).collect();
    points.sort_unstable();
    points.dedup();
    points.push(len);
    let mut out = Vec::new();
    let mut prev = 0;
    for (i, p) in points.into_iter().enumerate() {
        // Leave gaps between segments so a wrong offset cannot go unnoticed.
        out.push(Segment {
            addr: GuestAddress(base + prev + i as u64 * 512),
            len: (p - prev) as u32,
        });
        prev = p;
    }
    out
}

fn read_guest(mem: &GuestMemoryMmap, segs: &[Segment]) -> Vec<u8> {
    let mut v = Vec::new();
    for s in segs {
        let mut b = vec![0u8; s.len as usize];
        mem.read_slice(&mut b, s.addr).expect("guest read");
        v.extend_from_slice(&b);
    }
    v
}

fn write_guest(mem: &GuestMemoryMmap, segs: &[Segment], data: &[u8]) {
    let mut off = 0usize;
    for s in segs {
        let n = s.len as usize;
        mem.write_slice(&data[off..off + n], s.addr)
            .expect("guest write");
        off += n;
    }
}

fn do_read(
    c: &mut ICache,
    disk: &mut MemDisk,
    mem: &GuestMemoryMmap,
    sector: u64,
    len: u64,
    ins: Option<Insights>,
) -> Vec<u8> {
    let segs = segments(0x10_0000, len, &[len / 3 / 512 * 512 + 100]);
    write_guest(mem, &segs, &vec![0xee; len as usize]);
    let mut r = Request::new_for_test(mem, RequestKind::Read, sector, segs.clone());
    r.insights = ins;
    assert_eq!(
        c.process(&mut r, &mut ToDisk(disk)).expect("read"),
        Status::Ok
    );
    read_guest(mem, &segs)
}

fn do_write(
    c: &mut ICache,
    disk: &mut MemDisk,
    mem: &GuestMemoryMmap,
    sector: u64,
    data: &[u8],
    ins: Option<Insights>,
) -> Status {
    let segs = segments(0x20_0000, data.len() as u64, &[4096, 700]);
    write_guest(mem, &segs, data);
    let mut r = Request::new_for_test(mem, RequestKind::Write, sector, segs);
    r.insights = ins;
    c.process(&mut r, &mut ToDisk(disk)).expect("write")
}

fn do_simple(
    c: &mut ICache,
    disk: &mut MemDisk,
    mem: &GuestMemoryMmap,
    kind: RequestKind,
    ranges: Vec<SectorRange>,
) -> Status {
    let mut r = Request::new_for_test(mem, kind, 0, Vec::new());
    r.len = ranges.iter().map(|r| r.bytes()).sum();
    r.ranges = ranges;
    c.process(&mut r, &mut ToDisk(disk)).expect("request")
}

/// Random mix of reads, writes (aligned, unaligned, partial blocks), discards, write-zeroes
/// and flushes; every read must return what the model disk holds, and after every flush
/// (write-through: after every write) the disk itself must hold every acknowledged write.
fn random_run(policy: CachePolicy, mode: CacheMode, cache_blocks: u64, seed: u64) {
    // 64 whole blocks plus a 1 KiB tail, so the last block is partial.
    let disk_len = 64 * BS + 1024;
    let sectors = disk_len / 512;
    let mut disk = MemDisk::new(disk_len as usize);
    let mut rng = Rng(seed);
    // Start from a non-zero image.
    for b in disk.data.iter_mut() {
        *b = rng.next() as u8;
    }
    let mut model = disk.data.clone();
    let mut c = cache(cache_blocks, policy, mode);
    let m = c.metrics();
    let mem = guest_mem();
    let classes = [0u8, 1, 2, 3, 4, 5, 7, 32];
    for op in 0..1500 {
        let ins = match rng.below(5) {
            0 => None,
            _ => insight(
                classes[rng.below(classes.len() as u64) as usize],
                rng.below(6) == 0,
            ),
        };
        // Half the requests block-aligned, half anywhere.
        let (sector, nsec) = if rng.below(2) == 0 {
            let blocks = sectors / 8;
            let b = rng.below(blocks);
            let n = 1 + rng.below((blocks - b).min(6));
            (b * 8, n * 8)
        } else {
            let s = rng.below(sectors);
            (s, 1 + rng.below((sectors - s).min(20)))
        };
        let (off, len) = (sector * 512, nsec * 512);
        match rng.below(20) {
            0..=7 => {
                let got = do_read(&mut c, &mut disk, &mem, sector, len, ins);
                assert!(
                    got == model[off as usize..(off + len) as usize],
                    "op {op}: read of sectors {sector}+{nsec} differs ({policy} {mode} {cache_blocks} blocks, seed {seed})"
                );
            }
            8..=14 => {
                let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                let st = do_write(&mut c, &mut disk, &mem, sector, &data, ins);
                assert_eq!(st, Status::Ok);
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
                if mode == CacheMode::WriteThrough {
                    assert!(
                        disk.data == model,
                        "op {op}: write-through left the disk behind"
                    );
                }
            }
            15..=16 => {
                let kind = if rng.below(2) == 0 {
                    RequestKind::Discard
                } else {
                    RequestKind::WriteZeroes
                };
                let mut ranges = Vec::new();
                for _ in 0..1 + rng.below(2) {
                    let s = rng.below(sectors);
                    let n = 1 + rng.below((sectors - s).min(40));
                    ranges.push(SectorRange {
                        sector: s,
                        num_sectors: n as u32,
                        unmap: false,
                    });
                    model[(s * 512) as usize..((s + n) * 512) as usize].fill(0);
                }
                assert_eq!(do_simple(&mut c, &mut disk, &mem, kind, ranges), Status::Ok);
            }
            _ => {
                assert_eq!(
                    do_simple(&mut c, &mut disk, &mem, RequestKind::Flush, Vec::new()),
                    Status::Ok
                );
                assert!(
                    disk.data == model,
                    "op {op}: after FLUSH the disk misses writes"
                );
                assert_eq!(m.snapshot().dirty_bytes, 0);
            }
        }
        let s = m.snapshot();
        assert!(s.resident_bytes <= cache_blocks * BS, "{s:?}");
        assert_eq!(s.resident_bytes, c.store.len() as u64 * BS);
        assert!(s.dirty_bytes <= s.resident_bytes);
        if mode == CacheMode::WriteThrough {
            assert_eq!(s.dirty_bytes, 0);
        }
    }
    // A clean stop writes everything back.
    c.shutdown(&mut ToDisk(&mut disk)).expect("shutdown");
    assert!(disk.data == model, "after shutdown the disk misses writes");
    let s = m.snapshot();
    assert_eq!(s.dirty_bytes, 0);
    assert!(s.hits > 0 && s.misses > 0, "{s:?}");
}

#[test]
fn random_requests_read_back_what_a_plain_disk_would() {
    for policy in [CachePolicy::Lru, CachePolicy::Priority] {
        for mode in [CacheMode::WriteThrough, CacheMode::WriteBack] {
            for (i, blocks) in [1u64, 2, 3, 8, 24, 100].into_iter().enumerate() {
                random_run(policy, mode, blocks, 0x5eed + i as u64 * 7919);
            }
        }
    }
}

#[test]
fn priority_keeps_metadata_through_a_data_flood_and_lru_does_not() {
    let mem = guest_mem();
    let mut results = Vec::new();
    for policy in [CachePolicy::Lru, CachePolicy::Priority] {
        let mut disk = MemDisk::new((256 * BS) as usize);
        let mut c = cache(8, policy, CacheMode::WriteThrough);
        // 4 metadata blocks, read twice.
        for b in 0..4u64 {
            do_read(
                &mut c,
                &mut disk,
                &mem,
                b * 8,
                BS,
                insight(CLASS_METADATA, false),
            );
        }
        // A 100-block sequential read of a big file (class 0).
        for b in 100..200u64 {
            do_read(&mut c, &mut disk, &mem, b * 8, BS, insight(0, false));
        }
        let before = c.metrics().snapshot();
        for b in 0..4u64 {
            do_read(
                &mut c,
                &mut disk,
                &mem,
                b * 8,
                BS,
                insight(CLASS_METADATA, false),
            );
        }
        let after = c.metrics().snapshot();
        results.push(after.classes[5].hits - before.classes[5].hits);
        if policy == CachePolicy::Priority {
            // Data still used the four free slots; nothing of class 5 was evicted.
            assert_eq!(after.classes[5].evictions, 0);
            assert_eq!(after.classes[5].resident_bytes, 4 * BS);
            assert_eq!(after.classes[0].resident_bytes, 4 * BS);
            assert!(after.classes[0].not_admitted == 0, "class 0 evicts class 0");
        }
    }
    assert_eq!(results, vec![0, 4], "lru hits, priority hits");
}

#[test]
fn lower_class_is_not_admitted_over_higher_ones() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(2, CachePolicy::Priority, CacheMode::WriteThrough);
    do_read(&mut c, &mut disk, &mem, 0, BS, insight(5, false));
    do_read(&mut c, &mut disk, &mem, 8, BS, insight(3, false));
    do_read(&mut c, &mut disk, &mem, 16, BS, insight(1, false));
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[1].not_admitted, 1);
    assert_eq!(s.classes[1].inserted, 0);
    // A higher class evicts the lowest one present (class 3), not the LRU block overall.
    do_read(&mut c, &mut disk, &mem, 24, BS, insight(4, false));
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[3].evictions, 1);
    assert_eq!(s.classes[5].resident_bytes, BS);
    assert_eq!(s.classes[4].resident_bytes, BS);
    // The class follows the latest access: block 0 re-read as class 0 becomes the victim.
    do_read(&mut c, &mut disk, &mem, 0, BS, insight(0, false));
    do_read(&mut c, &mut disk, &mem, 32, BS, insight(2, false));
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[0].evictions, 1);
    assert_eq!(s.classes[4].resident_bytes, BS);
    assert_eq!(s.classes[2].resident_bytes, BS);
}

#[test]
fn journal_writes_are_not_inserted_by_priority_but_are_by_lru() {
    let mem = guest_mem();
    for (policy, expect) in [(CachePolicy::Priority, 0u64), (CachePolicy::Lru, 2)] {
        let mut disk = MemDisk::new((64 * BS) as usize);
        let mut c = cache(8, policy, CacheMode::WriteBack);
        let data = vec![7u8; 2 * BS as usize];
        assert_eq!(
            do_write(&mut c, &mut disk, &mem, 16, &data, insight(5, true)),
            Status::Ok
        );
        let s = c.metrics().snapshot();
        assert_eq!(s.classes[5].inserted, expect, "{policy}");
        if policy == CachePolicy::Priority {
            // Not cached, so written through at once even in write-back mode.
            assert_eq!(&disk.data[16 * 512..16 * 512 + data.len()], &data[..]);
        }
    }
}

#[test]
fn write_back_holds_writes_until_flush_and_writes_them_in_runs() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(16, CachePolicy::Lru, CacheMode::WriteBack);
    let data: Vec<u8> = (0..8 * BS).map(|i| (i / 7) as u8).collect();
    // Eight blocks written one at a time, in reverse order.
    for b in (0..8u64).rev() {
        let piece = &data[(b * BS) as usize..((b + 1) * BS) as usize];
        do_write(&mut c, &mut disk, &mem, 80 + b * 8, piece, None);
    }
    assert_eq!(disk.writes, 0, "nothing below before FLUSH");
    assert_eq!(c.metrics().snapshot().dirty_bytes, 8 * BS);
    // Reads see the dirty data.
    assert_eq!(do_read(&mut c, &mut disk, &mem, 80, 8 * BS, None), data);
    assert_eq!(disk.reads, 0);
    assert_eq!(
        do_simple(&mut c, &mut disk, &mem, RequestKind::Flush, Vec::new()),
        Status::Ok
    );
    assert_eq!(&disk.data[80 * 512..80 * 512 + data.len()], &data[..]);
    // One coalesced write, then the flush.
    let tail: Vec<_> = disk.log.iter().map(|e| (e.0, e.1, e.2)).collect();
    assert_eq!(
        tail,
        vec![
            (RequestKind::Write, 80 * 512, 8 * BS),
            (RequestKind::Flush, 0, 0)
        ]
    );
    let s = c.metrics().snapshot();
    assert_eq!(
        (s.dirty_bytes, s.writebacks, s.writeback_requests),
        (0, 8, 1)
    );
}

#[test]
fn evicting_a_dirty_block_writes_it_first() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(1, CachePolicy::Lru, CacheMode::WriteBack);
    do_write(&mut c, &mut disk, &mem, 0, &vec![1u8; BS as usize], None);
    assert_eq!(disk.writes, 0);
    do_write(&mut c, &mut disk, &mem, 8, &vec![2u8; BS as usize], None);
    assert_eq!(disk.writes, 1);
    assert!(disk.data[..BS as usize].iter().all(|&b| b == 1));
    assert!(disk.data[BS as usize..2 * BS as usize]
        .iter()
        .all(|&b| b == 0));
    assert_eq!(c.metrics().snapshot().classes[0].evictions, 1);
}

#[test]
fn failed_write_back_keeps_blocks_dirty_and_reports_the_error() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Priority, CacheMode::WriteBack);
    do_write(&mut c, &mut disk, &mem, 8, &vec![9u8; BS as usize], None);
    disk.fail_writes = true;
    assert_eq!(
        do_simple(&mut c, &mut disk, &mem, RequestKind::Flush, Vec::new()),
        Status::IoErr
    );
    assert_eq!(c.metrics().snapshot().dirty_bytes, BS);
    assert!(c.shutdown(&mut ToDisk(&mut disk)).is_err());
    disk.fail_writes = false;
    assert_eq!(
        do_simple(&mut c, &mut disk, &mem, RequestKind::Flush, Vec::new()),
        Status::Ok
    );
    assert!(disk.data[8 * 512..8 * 512 + BS as usize]
        .iter()
        .all(|&b| b == 9));
    assert_eq!(c.metrics().snapshot().dirty_bytes, 0);
}

#[test]
fn write_through_failure_drops_cached_copies() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Lru, CacheMode::WriteThrough);
    do_read(&mut c, &mut disk, &mem, 0, 2 * BS, None);
    assert_eq!(c.store.len(), 2);
    disk.fail_writes = true;
    assert_eq!(
        do_write(&mut c, &mut disk, &mem, 4, &vec![3u8; BS as usize], None),
        Status::IoErr
    );
    assert_eq!(
        c.store.len(),
        0,
        "both blocks the write touched are dropped"
    );
    assert_eq!(c.metrics().snapshot().invalidated, 2);
}

#[test]
fn discard_of_part_of_a_dirty_block_keeps_the_rest() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Lru, CacheMode::WriteBack);
    do_write(&mut c, &mut disk, &mem, 0, &vec![5u8; BS as usize], None);
    let r = SectorRange {
        sector: 2,
        num_sectors: 2,
        unmap: false,
    };
    assert_eq!(
        do_simple(&mut c, &mut disk, &mem, RequestKind::WriteZeroes, vec![r]),
        Status::Ok
    );
    let got = do_read(&mut c, &mut disk, &mem, 0, BS, None);
    assert!(got[..1024].iter().all(|&b| b == 5));
    assert!(got[1024..2048].iter().all(|&b| b == 0));
    assert!(got[2048..].iter().all(|&b| b == 5));
}

#[test]
fn a_dirty_block_a_discard_covers_dies_in_the_cache_unwritten() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Lru, CacheMode::WriteBack);
    // Two dirty blocks; a discard covers the first wholly and half of the second.
    do_write(
        &mut c,
        &mut disk,
        &mem,
        0,
        &vec![5u8; 2 * BS as usize],
        None,
    );
    let r = SectorRange {
        sector: 0,
        num_sectors: (BS / 512 + BS / 1024) as u32,
        unmap: false,
    };
    assert_eq!(
        do_simple(&mut c, &mut disk, &mem, RequestKind::Discard, vec![r]),
        Status::Ok
    );
    let writes: Vec<_> = disk
        .log
        .iter()
        .filter(|e| e.0 == RequestKind::Write)
        .map(|e| (e.1, e.2))
        .collect();
    assert_eq!(
        writes,
        vec![(BS, BS)],
        "only the partly covered block was written back"
    );
    let s = c.metrics().snapshot();
    assert_eq!((s.dirty_discarded, s.writebacks, s.dirty_bytes), (1, 1, 0));
}

#[test]
fn shutdown_through_a_pipeline_writes_dirty_blocks_to_the_image() {
    use std::io::Write as _;
    let mut f = tempfile::NamedTempFile::new().expect("tmp");
    f.write_all(&vec![0u8; 64 * BS as usize]).expect("fill");
    f.flush().expect("flush");
    let file = crate::file::RawFile::open(f.path(), false, false).expect("open");
    let mut p = Pipeline::new(Box::new(file));
    let (stage, m) = ICache::stage(CacheConfig {
        mode: CacheMode::WriteBack,
        ..CacheConfig::from_mib(1)
    })
    .expect("cache");
    p.push(stage).expect("push");
    let mem = guest_mem();
    let segs = segments(0x1000, 2 * BS, &[]);
    write_guest(&mem, &segs, &vec![0x42; 2 * BS as usize]);
    let mut r = Request::new_for_test(&mem, RequestKind::Write, 16, segs);
    assert_eq!(p.run(&mut r).expect("write"), Status::Ok);
    assert_eq!(m.snapshot().dirty_bytes, 2 * BS);
    let on_disk = std::fs::read(f.path()).expect("read image");
    assert!(on_disk[16 * 512..16 * 512 + 2 * BS as usize]
        .iter()
        .all(|&b| b == 0));
    p.shutdown().expect("shutdown");
    let on_disk = std::fs::read(f.path()).expect("read image");
    assert!(on_disk[16 * 512..16 * 512 + 2 * BS as usize]
        .iter()
        .all(|&b| b == 0x42));
    assert_eq!(m.snapshot().dirty_bytes, 0);
}

#[test]
fn config_parses_and_refuses_with_sentences() {
    assert_eq!("lru".parse::<CachePolicy>(), Ok(CachePolicy::Lru));
    assert_eq!("Priority".parse::<CachePolicy>(), Ok(CachePolicy::Priority));
    assert_eq!("write-back".parse::<CacheMode>(), Ok(CacheMode::WriteBack));
    assert_eq!(
        "write-through".parse::<CacheMode>(),
        Ok(CacheMode::WriteThrough)
    );
    for p in [CachePolicy::Lru, CachePolicy::Priority] {
        assert_eq!(p.to_string().parse::<CachePolicy>(), Ok(p));
    }
    for m in [CacheMode::WriteThrough, CacheMode::WriteBack] {
        assert_eq!(m.to_string().parse::<CacheMode>(), Ok(m));
    }
    let e = "arc".parse::<CachePolicy>().expect_err("unknown");
    assert!(e.to_string().contains("\"lru\" or \"priority\""), "{e}");
    let e = "wb".parse::<CacheMode>().expect_err("unknown");
    assert!(e.to_string().contains("write-back"), "{e}");
    let mut c = CacheConfig::from_mib(0);
    assert!(matches!(
        c.validate(),
        Err(CacheConfigError::TooSmall { .. })
    ));
    c.size_bytes = 1 << 20;
    c.block_size = 1000;
    assert!(matches!(
        c.validate(),
        Err(CacheConfigError::BadBlockSize(1000))
    ));
    assert_eq!(CacheConfig::from_mib(1).validate(), Ok(256));
    assert_eq!(
        CacheConfig::from_mib(64).to_string(),
        "64 MiB priority write-through (4096-byte blocks)"
    );
}

#[test]
fn snapshot_round_trips_through_json() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Priority, CacheMode::WriteThrough);
    do_read(&mut c, &mut disk, &mem, 0, BS, insight(40, false));
    do_read(&mut c, &mut disk, &mem, 0, BS, insight(40, false));
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[6].class, "other");
    assert_eq!((s.classes[6].hits, s.classes[6].misses), (1, 1));
    assert_eq!(s.hit_rate(), Some(0.5));
    let json = serde_json::to_string(&s).expect("json");
    assert!(json.contains("\"policy\":\"priority\""), "{json}");
    let back: CacheSnapshot = serde_json::from_str(&json).expect("parse");
    assert_eq!(back, s);
}

#[test]
fn a_read_without_insight_keeps_the_class_of_a_cached_block() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(4, CachePolicy::Priority, CacheMode::WriteThrough);
    let data = vec![7u8; BS as usize];
    do_write(
        &mut c,
        &mut disk,
        &mem,
        0,
        &data,
        insight(CLASS_METADATA, false),
    );
    // The classifier cannot know what a read is before the read syscall returns: the hit must
    // not demote the metadata block to the default class.
    assert_eq!(do_read(&mut c, &mut disk, &mem, 0, BS, None), data);
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[5].resident_bytes, BS);
    assert_eq!(s.classes[5].hits, 1);
    assert_eq!(s.classes[0].resident_bytes, 0);
    // A miss without insight enters at the default class.
    do_read(&mut c, &mut disk, &mem, 8, BS, None);
    assert_eq!(c.metrics().snapshot().classes[0].resident_bytes, BS);
}

#[test]
fn a_merged_request_caches_each_block_with_its_own_class() {
    let mem = guest_mem();
    let mut disk = MemDisk::new((64 * BS) as usize);
    let mut c = cache(8, CachePolicy::Priority, CacheMode::WriteThrough);
    let mut ins = crate::insight::RequestInsight::metadata();
    ins.class = 5;
    ins.block_classes = vec![5, 0, 4];
    let data = vec![3u8; 3 * BS as usize];
    let st = do_write(
        &mut c,
        &mut disk,
        &mem,
        0,
        &data,
        Some(std::sync::Arc::new(ins) as Insights),
    );
    assert_eq!(st, Status::Ok);
    let s = c.metrics().snapshot();
    assert_eq!(s.classes[5].resident_bytes, BS);
    assert_eq!(s.classes[0].resident_bytes, BS);
    assert_eq!(s.classes[4].resident_bytes, BS);
}
