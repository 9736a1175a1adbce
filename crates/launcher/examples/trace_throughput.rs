//! Host-only microbenchmark of the trace thread: a synthetic `tar x`-like stream of ring
//! records goes through the trace thread's own steps (`trace::Replay`: record decoding,
//! per-vCPU entry assembly, the timestamp merge, the call tracker) into the insight engine,
//! and the time and heap allocations per record are reported. No VM, no ring, no sleeping.
//!
//! Run (from the workspace root):
//!
//! ```text
//! CARGO_TARGET_DIR=/tmp/vs/helper-engine nice cargo run --release -p vmsight-launcher \
//!     --example trace_throughput [-- [--files N] [--reps N] [--bare] [--out DIR]]
//! ```
//!
//! `--bare` leaves the insight engine out: the trace thread's own work only.
//!
//! `--out DIR` also writes the strace text, the JSON trace, the trace summary and the insight
//! counters to DIR, and `classes.json`: the engine's insights of block writes and reads of every
//! file's completed last chunk after the replay (to check that a change keeps them all byte for
//! byte); it is slower.
//!
//! The stream: two vCPUs, one extracting task on each; per file a `read` of the archive (late
//! read sums), an `openat` with its path, a `write` of the file (write sums and the partial
//! tail chunk's bytes in 88-byte DATA pieces), a `utimensat` and a `close`: about 5 records
//! per call, half of them DATA pieces. Drains every 5 ms of guest time, as the trace thread.
//!
//! Measured on the 2-core dev host (3 runs of 5 reps each, base and new binaries run
//! alternately; medians of the runs' medians; thread CPU time):
//!
//! | stream through               | before (83bc290) | after (99013c2)  |
//! |------------------------------|------------------|------------------|
//! | trace path only (`--bare`)   | 209 ns, 1.657 al | 93 ns, 0.004 al  |
//! | with the insight engine      | 420 ns, 1.774 al | 264 ns, 0.121 al |
//!
//! (ns and heap allocations per record.) The engine's own cost, cut next (partial chunks
//! completed in place in recycled buffers, ahash instead of SipHash in the engine's and the
//! tracker's maps, one clock read per callback), same measurement (3 runs each, alternating):
//!
//! | stream through               | before (b07190a) | after (049e48f)  |
//! |------------------------------|------------------|------------------|
//! | trace path only (`--bare`)   | 98 ns, 0.004 al  | 89 ns, 0.004 al  |
//! | with the insight engine      | 270 ns, 0.121 al | 203 ns, 0.087 al |
//!
//! What remains with the engine: its hash indexes (inserting each chunk's checksum, fd and
//! inode tables), the 4 KiB checksum of each completed partial chunk, the clock read.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vmsight_insight::{InsightConfig, InsightEngine, InsightLog};
use vmsight_introspect::syscall::SyscallObserver;
use vmsight_introspect::syscall::{JsonSink, JsonWriter, NameFilter, StraceWriter};
use vmsight_launcher::trace::Replay;
use vmsight_ring::{flags, sums, Record, ReturnVia, SumsHeader};

/// Counts heap allocations (including reallocations) of the whole process.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator, whose contract the
// callers already meet; the counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same layout contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same layout contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `p` came from this allocator (hence from `System`) with layout `l`.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from this allocator (hence from `System`) with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const VCPUS: u32 = 2;
/// Guest time between two calls of one task.
const SPACING_NS: u64 = 80_000;
/// Guest time a call takes.
const CALL_NS: u64 = 15_000;
/// The trace thread's pause between drains.
const DRAIN_NS: u64 = 5_000_000;
const START_NS: u64 = 1_000_000_000;
/// Sizes of the extracted files, in turn.
const SIZES: [u64; 7] = [120, 700, 2000, 5000, 9000, 15000, 33000];

/// A record and the time it reaches its ring.
type Timed = (u64, Record);

/// One task's calls, in ring order.
struct Task {
    vcpu: u32,
    task: u64,
    tid: u32,
    /// Timestamp of the next call's entry.
    ts: u64,
    out: Vec<Timed>,
}

impl Task {
    fn entry(&mut self, nr: u64, args: [u64; 6]) -> u64 {
        let ts = self.ts;
        let mut r = Record::syscall_entry(self.vcpu, ts, 0x1000, 0x7f00_0000_1000, nr, args, 0);
        r.set_task(
            self.task,
            self.tid,
            self.tid,
            Some(b"tar\0\0\0\0\0\0\0\0\0\0\0\0\0"),
        );
        self.out.push((ts, r));
        ts
    }

    fn ret(&mut self, entry_ts: u64, rax: u64) {
        let ts = entry_ts + CALL_NS;
        let mut r = Record::syscall_return(
            self.vcpu,
            ts,
            0x1000,
            ReturnVia::Sysret,
            0xffff_ffff_8100_0000,
            0x7f00_0000_1002,
            rax,
        );
        r.set_task(self.task, self.tid, self.tid, None);
        self.out.push((ts, r));
        self.ts += SPACING_NS;
    }

    /// DATA pieces of `bytes` for argument `arg`, as the plugin cuts them.
    fn pieces(&mut self, ts: u64, arg: u8, bytes: &[u8]) {
        let chunks: Vec<&[u8]> = bytes.chunks(vmsight_ring::data::CAPACITY).collect();
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let f = if last { flags::FINAL } else { 0 };
            let off = (i * vmsight_ring::data::CAPACITY) as u32;
            let r = Record::data(self.vcpu, ts, 0x1000, 0x5000, arg, off, c, f);
            self.out.push((ts, r));
        }
    }

    /// SUMS records of `whole` chunks starting at chunk `first` (late: at the return).
    fn sums(&mut self, ts: u64, at: u64, mut h: SumsHeader, whole: u64, late: bool) {
        let mut i = 0;
        loop {
            let take = (whole - i).min(sums::PER_RECORD as u64) as usize;
            let vals: Vec<u64> = (0..take as u64)
                .map(|k| 0x9e37_79b9 ^ (h.first + i + k))
                .collect();
            h.count = take;
            h.valid = ((1u16 << take) - 1) as u8;
            let first = h.first;
            h.first = first + i;
            i += take as u64;
            let last = i >= whole;
            let f = if late { flags::LATE } else { 0 } | if last { flags::FINAL } else { 0 };
            self.out.push((
                at,
                Record::sums(self.vcpu, ts, 0x1000, 0x5000, &h, &vals, f),
            ));
            h.first = first;
            if last {
                break;
            }
        }
    }

    /// The calls extracting file `n`.
    fn extract(&mut self, n: u64) {
        let inode = 0xffff_8880_1000_0000 + n * 0x400;
        // read(3, buf, 10240) from the archive: sums of the filled buffer at the return.
        let ts = self.entry(0, [3, 0x5000, 10240, 0, 0, 0]);
        let h = SumsHeader {
            fd: 3,
            read: true,
            pos_source: sums::POS_FPOS,
            pos: n * 10240,
            len: 10240,
            first: (n * 10240).div_ceil(4096),
            inode: 0xffff_8880_0000_1000,
            i_size: 1 << 30,
            ..SumsHeader::default()
        };
        self.ret(ts, 10240);
        let at = ts + CALL_NS;
        self.sums(ts, at, h, 2, true);
        // openat(AT_FDCWD, path, O_WRONLY|O_CREAT|O_EXCL, 0600)
        let path = format!("usr/share/doc/pkg{:03}/file{n:06}.txt", n % 500);
        let ts = self.entry(257, [(-100i64) as u64, 0x6000, 0o301, 0o600, 0, 0]);
        self.pieces(ts, 1, path.as_bytes());
        self.ret(ts, 4);
        // write(4, buf, size): sums of the whole chunks, the partial tail's bytes.
        let size = SIZES[(n % SIZES.len() as u64) as usize];
        let ts = self.entry(1, [4, 0x5000, size, 0, 0, 0]);
        let whole = size / 4096;
        let h = SumsHeader {
            fd: 4,
            pos_source: sums::POS_FPOS,
            len: size,
            inode,
            ..SumsHeader::default()
        };
        self.sums(ts, ts, h, whole, false);
        let tail: Vec<u8> = (0..size % 4096).map(|i| (i as u8) ^ (n as u8)).collect();
        let arg = if whole == 0 { HEAD } else { TAIL };
        self.pieces(ts, arg, &tail);
        self.ret(ts, size);
        // utimensat(4, NULL, times, 0), close(4)
        let ts = self.entry(280, [4, 0, 0x7000, 0, 0, 0]);
        self.ret(ts, 0);
        let ts = self.entry(3, [4, 0, 0, 0, 0, 0]);
        self.ret(ts, 0);
    }
}

use vmsight_introspect::syscall::event::{HEAD_ARG as HEAD, TAIL_ARG as TAIL};

/// The drains of `files` extractions per vCPU: each batch ring by ring, and its drain time.
fn stream(files: u64) -> Vec<(u64, Vec<Record>)> {
    let rings: Vec<Vec<Timed>> = (0..VCPUS)
        .map(|v| {
            let mut t = Task {
                vcpu: v,
                task: 0xffff_8880_2000_0000 + u64::from(v) * 0x2000,
                tid: 500 + v,
                ts: START_NS + u64::from(v) * (SPACING_NS / 3),
                out: Vec::new(),
            };
            for n in 0..files {
                t.extract(n * u64::from(VCPUS) + u64::from(v));
            }
            t.out
        })
        .collect();
    let end = rings.iter().flatten().map(|t| t.0).max().unwrap_or(0);
    let mut at = vec![0usize; rings.len()];
    let mut out = Vec::new();
    let mut now = START_NS + DRAIN_NS;
    while now < end + DRAIN_NS {
        let mut batch = Vec::new();
        for (ring, i) in rings.iter().zip(at.iter_mut()) {
            while *i < ring.len() && ring[*i].0 <= now {
                batch.push(ring[*i].1);
                *i += 1;
            }
        }
        out.push((now, batch));
        now += DRAIN_NS;
    }
    out
}

/// The observers of a run: the insight engine (unless `bare`), and the trace writers with
/// `--out`.
fn observers(out: Option<&PathBuf>, bare: bool) -> (InsightEngine, Vec<Box<dyn SyscallObserver>>) {
    let engine = InsightEngine::new(InsightConfig::default(), InsightLog::disabled());
    let mut v: Vec<Box<dyn SyscallObserver>> = Vec::new();
    if !bare {
        v.push(Box::new(engine.clone()));
    }
    if let Some(dir) = out {
        let text = std::fs::File::create(dir.join("trace.txt")).expect("trace.txt");
        let json = std::fs::File::create(dir.join("trace.json")).expect("trace.json");
        v.push(Box::new(StraceWriter::new(
            Box::new(std::io::BufWriter::new(text)),
            NameFilter::all(),
        )));
        let sink = JsonSink::new(Box::new(std::io::BufWriter::new(json)));
        v.push(Box::new(JsonWriter::new(sink, NameFilter::all())));
    }
    (engine, v)
}

/// One replay of the stream: (ns per record, allocations per record).
fn run(
    batches: &[(u64, Vec<Record>)],
    records: u64,
    files: u64,
    out: Option<&PathBuf>,
    bare: bool,
) -> (f64, f64) {
    let (engine, obs) = observers(out, bare);
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = thread_cpu_ns();
    let mut replay = Replay::new(obs);
    for (now, batch) in batches {
        replay.step(batch, *now);
    }
    let summary = replay.finish();
    let ns = (thread_cpu_ns() - t0) as f64;
    let allocs = (ALLOCS.load(Ordering::Relaxed) - a0) as f64;
    if let Some(dir) = out {
        let s = serde_json::to_string_pretty(&summary).unwrap_or_default();
        let c = serde_json::to_string_pretty(&engine.counters()).unwrap_or_default();
        std::fs::write(dir.join("summary.json"), format!("{s}\n{c}\n")).expect("summary");
        if !bare {
            classify(&engine, files, &dir.join("classes.json"));
        }
    }
    (ns / records as f64, allocs / records as f64)
}

/// The 4 KiB chunk file `n`'s write leaves at the end of the file: the partial tail's bytes
/// (as `Task::extract` writes them), zeros beyond.
fn last_chunk(n: u64) -> Vec<u8> {
    let size = SIZES[(n % SIZES.len() as u64) as usize];
    let mut c: Vec<u8> = (0..size % 4096).map(|i| (i as u8) ^ (n as u8)).collect();
    c.resize(4096, 0);
    c
}

/// The block side after the replay (with `--out`): a block write and then a block read of
/// every file's completed last chunk, next to a chunk of zeros (metadata), classified by the
/// engine; their insights and the counters afterwards go to `path` (a check that the engine
/// still classifies every block as before).
fn classify(engine: &InsightEngine, files: u64, path: &std::path::Path) {
    let mut out = Vec::new();
    let mut g = engine.lock();
    for n in 0..files * u64::from(VCPUS) {
        let mut req = last_chunk(n);
        req.resize(8192, 0);
        let w = g.classify_write(0, n * 8192, &req, false);
        let r = g.classify_read(0, n * 8192, &req);
        out.push(serde_json::json!({ "file": n, "write": w, "read": r }));
    }
    g.flush();
    out.push(serde_json::to_value(g.counters()).unwrap_or_default());
    let text = serde_json::to_string_pretty(&out).unwrap_or_default();
    std::fs::write(path, text + "\n").expect("classes.json");
}

/// CPU time of this thread (less disturbed by other work on the host than the wall clock).
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut files = 15_000u64;
    let mut reps = 5usize;
    let mut out = None;
    let mut bare = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--files" => files = args.next().and_then(|v| v.parse().ok()).expect("--files N"),
            "--reps" => reps = args.next().and_then(|v| v.parse().ok()).expect("--reps N"),
            "--out" => out = args.next().map(PathBuf::from),
            "--bare" => bare = true,
            _ => panic!("unknown argument {a}"),
        }
    }
    let batches = stream(files);
    let records: u64 = batches.iter().map(|b| b.1.len() as u64).sum();
    let data = batches
        .iter()
        .flat_map(|b| &b.1)
        .filter(|r| r.kind == vmsight_ring::kind::DATA)
        .count();
    let calls = files * u64::from(VCPUS) * 5;
    println!(
        "{records} records, {calls} calls ({:.2} records/call, {:.0} % DATA), {} drains",
        records as f64 / calls as f64,
        100.0 * data as f64 / records as f64,
        batches.len()
    );
    if out.is_some() {
        run(&batches, records, files, out.as_ref(), bare);
    }
    let (mut ns, mut al) = (Vec::new(), Vec::new());
    for i in 0..reps {
        let (n, a) = run(&batches, records, files, None, bare);
        println!("run {i}: {n:.1} ns (thread CPU)/record, {a:.3} allocations/record");
        ns.push(n);
        al.push(a);
    }
    println!(
        "median: {:.1} ns (thread CPU)/record, {:.3} allocations/record",
        median(ns),
        median(al)
    );
}
