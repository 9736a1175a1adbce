//! The io_uring stage against a model of the disk and against the thread pool: data, errors,
//! more requests than the ring holds, completions reaped by an external loop, and shutdown
//! with requests in flight.

use super::*;
use crate::pipeline::{IoResult, Pipeline};
use crate::request::{Request, SectorRange, Segment, SECTOR_SIZE};
use crate::testrng::Rng;
use std::io::Write;
use std::sync::mpsc;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const DISK: usize = 1 << 20;
const MEM: usize = 4 << 20;

fn image(fill: u8) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("tempfile");
    f.write_all(&vec![fill; DISK]).expect("fill");
    f.flush().expect("flush");
    f
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest memory")
}

fn pipeline(path: &std::path::Path, direct: bool, reaping: Reaping) -> (Pipeline, UringEvents) {
    let file = RawFile::open(path, false, direct).expect("open");
    let (stage, events) = UringStage::new(file, reaping).expect("io_uring");
    (Pipeline::with_terminal(Box::new(stage)), events)
}

/// A request over `sectors` sectors at `sector`, its buffer split into segments of random
/// sizes at `addr` (4 KiB aligned when `aligned`, else at odd 16-byte offsets).
fn request(
    m: &GuestMemoryMmap,
    rng: &mut Rng,
    kind: RequestKind,
    sector: u64,
    sectors: u64,
    addr: u64,
) -> Request {
    let mut left = sectors * SECTOR_SIZE;
    let mut segs = Vec::new();
    let mut a = addr;
    while left > 0 {
        let n = (SECTOR_SIZE * (1 + rng.below(8))).min(left);
        segs.push(Segment {
            addr: GuestAddress(a),
            len: n as u32,
        });
        a += n;
        left -= n;
    }
    Request::new_for_test(m, kind, sector, segs)
}

fn run_model(direct: bool, seed: u64) {
    let img = image(0x5a);
    let (p, _ev) = pipeline(img.path(), direct, Reaping::Thread);
    let m = mem();
    let mut model = vec![0x5au8; DISK];
    let mut rng = Rng(seed);
    for i in 0..400 {
        let sectors = 1 + rng.below(64);
        let sector = rng.below(DISK as u64 / SECTOR_SIZE - sectors);
        let align = if rng.below(2) == 0 { 0 } else { 16 };
        let addr = 0x1_0000 + align;
        let off = (sector * SECTOR_SIZE) as usize;
        let len = (sectors * SECTOR_SIZE) as usize;
        if rng.below(3) == 0 {
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            m.write_slice(&data, GuestAddress(addr)).expect("fill");
            let mut req = request(&m, &mut rng, RequestKind::Write, sector, sectors, addr);
            assert_eq!(
                p.run(&mut req).expect("write"),
                Status::Ok,
                "seed {seed} op {i}"
            );
            model[off..off + len].copy_from_slice(&data);
        } else {
            let mut req = request(&m, &mut rng, RequestKind::Read, sector, sectors, addr);
            assert_eq!(
                p.run(&mut req).expect("read"),
                Status::Ok,
                "seed {seed} op {i}"
            );
            let mut got = vec![0u8; len];
            m.read_slice(&mut got, GuestAddress(addr))
                .expect("read back");
            assert!(
                got == model[off..off + len],
                "seed {seed} op {i}: read differs"
            );
        }
    }
    let mut flush = Request::new_for_test(&m, RequestKind::Flush, 0, Vec::new());
    assert_eq!(p.run(&mut flush).expect("flush"), Status::Ok);
    drop(p);
    assert!(
        std::fs::read(img.path()).expect("image") == model,
        "seed {seed}: image differs"
    );
}

#[test]
fn reads_and_writes_of_any_shape_match_a_model_of_the_disk() {
    for seed in [1, 0xdead_beef, 42] {
        run_model(false, seed);
    }
}

#[test]
fn o_direct_reads_and_writes_match_the_model_with_unaligned_buffers_falling_back() {
    for seed in [7, 99] {
        run_model(true, seed);
    }
}

/// Submits `n` reads of one sector each at once and waits for every answer.
fn many_at_once(p: &Pipeline, m: &GuestMemoryMmap, n: u64, events: Option<&UringEvents>) {
    let (tx, rx) = mpsc::channel::<(u64, IoResult)>();
    for i in 0..n {
        let sector = i % (DISK as u64 / SECTOR_SIZE);
        let seg = Segment {
            addr: GuestAddress(0x1_0000 + i * SECTOR_SIZE),
            len: SECTOR_SIZE as u32,
        };
        let req = Request::new_for_test(m, RequestKind::Read, sector, vec![seg]);
        let tx = tx.clone();
        p.submit(req, move |_, r| {
            let _ = tx.send((i, r));
        });
    }
    drop(tx);
    let mut seen = vec![false; n as usize];
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = 0;
    while got < n {
        assert!(Instant::now() < deadline, "only {got} of {n} answered");
        if let Some(ev) = events {
            ev.wait(Duration::from_millis(10));
        }
        match rx.recv_timeout(Duration::from_millis(10)) {
            Ok((i, r)) => {
                assert_eq!(r.expect("read"), Status::Ok);
                assert!(!seen[i as usize], "request {i} answered twice");
                seen[i as usize] = true;
                got += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn more_requests_than_the_ring_holds_all_complete_once() {
    let img = image(0x33);
    let (p, _ev) = pipeline(img.path(), true, Reaping::Thread);
    let m = mem();
    many_at_once(&p, &m, 3000, None);
    let mut b = vec![0u8; 3000 * SECTOR_SIZE as usize];
    m.read_slice(&mut b, GuestAddress(0x1_0000)).expect("read");
    assert!(b.iter().all(|&x| x == 0x33));
}

#[test]
fn an_external_loop_reaps_late_completions() {
    let img = image(0x44);
    let (p, ev) = pipeline(img.path(), true, Reaping::External);
    let m = mem();
    many_at_once(&p, &m, 1000, Some(&ev));
}

#[test]
fn discard_and_write_zeroes_go_through_the_fallback_and_read_as_zeroes() {
    let img = image(0x77);
    let (p, _ev) = pipeline(img.path(), false, Reaping::Thread);
    let m = mem();
    for (kind, sector) in [(RequestKind::WriteZeroes, 8u64), (RequestKind::Discard, 64)] {
        let mut req = Request::new_for_test(&m, kind, 0, Vec::new());
        req.ranges = vec![SectorRange {
            sector,
            num_sectors: 8,
            unmap: true,
        }];
        assert_eq!(p.run(&mut req).expect("zeroes"), Status::Ok);
    }
    let data = std::fs::read(img.path()).expect("image");
    let at = |s: usize| &data[s * 512..(s + 8) * 512];
    assert!(at(8).iter().all(|&b| b == 0), "write-zeroes");
    assert!(data[..8 * 512].iter().all(|&b| b == 0x77), "neighbour kept");
    // A discard may keep the data (a hint); if it punched, the range reads as zeroes.
    assert!(at(64).iter().all(|&b| b == 0) || at(64).iter().all(|&b| b == 0x77));
}

#[test]
fn a_read_past_a_truncated_image_fails_instead_of_hanging() {
    let img = image(0x11);
    let (p, _ev) = pipeline(img.path(), false, Reaping::Thread);
    // Someone truncates the image under the running disk to 2 KiB and a bit.
    std::fs::OpenOptions::new()
        .write(true)
        .open(img.path())
        .expect("open")
        .set_len(2048 + 100)
        .expect("truncate");
    let m = mem();
    let mut rng = Rng(5);
    // Sectors 2..10: the first part is short (the kernel returns what is there), the rest EOF.
    let mut req = request(&m, &mut rng, RequestKind::Read, 2, 8, 0x1_0000);
    match p.run(&mut req) {
        Err(StageError::Io { source, .. }) => {
            assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof, "{source}")
        }
        other => panic!("expected an end-of-file error, got {other:?}"),
    }
}

#[test]
fn guest_memory_that_is_not_mapped_fails_the_request() {
    let img = image(0);
    let (p, _ev) = pipeline(img.path(), false, Reaping::Thread);
    let m = mem();
    let seg = Segment {
        addr: GuestAddress(MEM as u64 + 4096),
        len: 512,
    };
    let mut req = Request::new_for_test(&m, RequestKind::Read, 0, vec![seg]);
    assert!(matches!(
        p.run(&mut req),
        Err(StageError::GuestMemory { .. })
    ));
}

#[test]
fn a_read_only_image_refuses_writes_and_flushes_succeed() {
    let img = image(0x22);
    let file = RawFile::open(img.path(), true, false).expect("open");
    let (stage, _ev) = UringStage::new(file, Reaping::Thread).expect("io_uring");
    let p = Pipeline::with_terminal(Box::new(stage));
    let m = mem();
    let seg = Segment {
        addr: GuestAddress(0x1_0000),
        len: 512,
    };
    let mut req = Request::new_for_test(&m, RequestKind::Write, 0, vec![seg]);
    assert_eq!(p.run(&mut req).expect("answered"), Status::IoErr);
    let mut flush = Request::new_for_test(&m, RequestKind::Flush, 0, Vec::new());
    assert_eq!(p.run(&mut flush).expect("flush"), Status::Ok);
    assert!(std::fs::read(img.path())
        .expect("image")
        .iter()
        .all(|&b| b == 0x22));
}

#[test]
fn dropping_the_stage_with_requests_in_flight_answers_each_once() {
    let img = image(0x55);
    let (p, _ev) = pipeline(img.path(), true, Reaping::Thread);
    let m = mem();
    let (tx, rx) = mpsc::channel::<u64>();
    let n = 500u64;
    for i in 0..n {
        let seg = Segment {
            addr: GuestAddress(0x1_0000 + (i % 64) * 4096),
            len: 4096,
        };
        let req = Request::new_for_test(&m, RequestKind::Read, (i % 200) * 8, vec![seg]);
        let tx = tx.clone();
        p.submit(req, move |_, _| {
            let _ = tx.send(i);
        });
    }
    drop(tx);
    drop(p);
    let mut seen = vec![0u32; n as usize];
    for i in rx.iter() {
        seen[i as usize] += 1;
    }
    assert!(
        seen.iter().all(|&c| c == 1),
        "every request answered exactly once"
    );
}

/// One operation of a generated sequence.
#[derive(Debug, Clone)]
enum GenOp {
    Read {
        sector: u64,
        sectors: u64,
        misalign: bool,
    },
    Write {
        sector: u64,
        sectors: u64,
        misalign: bool,
        fill: u8,
    },
    Flush,
    Zeroes {
        sector: u64,
        sectors: u32,
        unmap: bool,
    },
}

fn gen_op() -> impl proptest::strategy::Strategy<Value = GenOp> {
    use proptest::prelude::*;
    let max = DISK as u64 / SECTOR_SIZE;
    let span = (0..max, 1u64..=128).prop_map(move |(s, n)| (s.min(max - n), n));
    prop_oneof![
        4 => (span.clone(), any::<bool>()).prop_map(|((sector, sectors), misalign)| GenOp::Read { sector, sectors, misalign }),
        4 => (span.clone(), any::<bool>(), any::<u8>()).prop_map(|((sector, sectors), misalign, fill)| GenOp::Write { sector, sectors, misalign, fill }),
        1 => Just(GenOp::Flush),
        1 => (span, any::<bool>()).prop_map(|((sector, sectors), unmap)| GenOp::Zeroes { sector, sectors: sectors as u32, unmap }),
    ]
}

/// Runs `op` on `p` with buffers at `addr`; returns the bytes a read produced.
fn apply(p: &Pipeline, m: &GuestMemoryMmap, op: &GenOp, seed: u64) -> Option<Vec<u8>> {
    let mut rng = Rng(seed);
    let at = |misalign: bool| 0x1_0000 + if misalign { 48 } else { 0 };
    match *op {
        GenOp::Read {
            sector,
            sectors,
            misalign,
        } => {
            let mut req = request(
                m,
                &mut rng,
                RequestKind::Read,
                sector,
                sectors,
                at(misalign),
            );
            assert_eq!(p.run(&mut req).expect("read"), Status::Ok);
            let mut got = vec![0u8; (sectors * SECTOR_SIZE) as usize];
            m.read_slice(&mut got, GuestAddress(at(misalign)))
                .expect("buf");
            Some(got)
        }
        GenOp::Write {
            sector,
            sectors,
            misalign,
            fill,
        } => {
            let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
                .map(|i| fill.wrapping_add((i / 509) as u8))
                .collect();
            m.write_slice(&data, GuestAddress(at(misalign)))
                .expect("fill");
            let mut req = request(
                m,
                &mut rng,
                RequestKind::Write,
                sector,
                sectors,
                at(misalign),
            );
            assert_eq!(p.run(&mut req).expect("write"), Status::Ok);
            None
        }
        GenOp::Flush => {
            let mut req = Request::new_for_test(m, RequestKind::Flush, 0, Vec::new());
            assert_eq!(p.run(&mut req).expect("flush"), Status::Ok);
            None
        }
        GenOp::Zeroes {
            sector,
            sectors,
            unmap,
        } => {
            let mut req = Request::new_for_test(m, RequestKind::WriteZeroes, 0, Vec::new());
            req.ranges = vec![SectorRange {
                sector,
                num_sectors: sectors,
                unmap,
            }];
            assert_eq!(p.run(&mut req).expect("zeroes"), Status::Ok);
            None
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 24,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..Default::default()
    })]

    /// Generated sequences of reads, writes (any size, split into segments, aligned or not),
    /// flushes and write-zeroes give the same reads and the same image through the ring as
    /// through the thread pool, with and without O_DIRECT.
    #[test]
    fn any_sequence_reads_and_leaves_the_same_bytes_as_the_thread_pool(
        ops in proptest::collection::vec(gen_op(), 1..40),
        direct in proptest::prelude::any::<bool>(),
    ) {
        let (a, b) = (image(0x3c), image(0x3c));
        let (ring, _ev) = pipeline(a.path(), direct, Reaping::Thread);
        let pool = Pipeline::with_terminal(Box::new(
            FileStage::new(RawFile::open(b.path(), false, direct).expect("open"), 4).expect("pool"),
        ));
        let (ma, mb) = (mem(), mem());
        for (i, op) in ops.iter().enumerate() {
            let seed = i as u64 * 7919;
            let got = apply(&ring, &ma, op, seed);
            let want = apply(&pool, &mb, op, seed);
            proptest::prop_assert!(got == want, "op {i} {op:?}: the ring read other bytes");
        }
        drop(ring);
        drop(pool);
        let (ia, ib) = (std::fs::read(a.path()).expect("a"), std::fs::read(b.path()).expect("b"));
        proptest::prop_assert!(ia == ib, "the images differ after {ops:?}");
    }
}

/// Both terminals stamp every hand-off of a request that reaches the image, in order.
#[test]
fn both_engines_stamp_the_hand_offs_in_order() {
    let (a, b) = (image(0x11), image(0x11));
    let m = mem();
    let (ring, _ev) = pipeline(a.path(), false, Reaping::Thread);
    let file = RawFile::open(b.path(), false, false).expect("open");
    let pool = Pipeline::with_terminal(Box::new(FileStage::new(file, 2).expect("pool")));
    for (name, p) in [("io_uring", &ring), ("pool", &pool)] {
        for kind in [RequestKind::Read, RequestKind::Write, RequestKind::Flush] {
            let segs = match kind {
                RequestKind::Flush => Vec::new(),
                _ => vec![Segment {
                    addr: GuestAddress(0x1_0000),
                    len: 4096,
                }],
            };
            let mut req = Request::new_for_test(&m, kind, 8, segs);
            let popped = req.submitted_at;
            assert_eq!(p.run(&mut req).expect("run"), Status::Ok, "{name}");
            let t = req.timeline;
            let (Some(a), Some(b), Some(c)) = (t.terminal, t.io_start, t.io_end) else {
                panic!("{name} {kind:?}: incomplete timeline {t:?}");
            };
            assert!(popped <= a && a <= b && b <= c, "{name} {kind:?}: {t:?}");
        }
    }
}
