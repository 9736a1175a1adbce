//! Fuzz entry point of the insight engine's record stream (`fuzz/fuzz_targets/insight_stream.rs`
//! and `tests/fuzz_insight_stream.rs`; see docs/fuzzing.md).
//!
//! Everything the engine is fed comes from the guest: syscall entries and returns (numbers,
//! arguments, captured paths, buffer checksums, application hints) and block requests. An
//! input is a sequence of such operations, delivered the way the trace session delivers them:
//! entries to the [`InsightEngine`] observer and to the syscall tracker, returns to the
//! tracker whose completed calls go to the observer, block writes and reads to the classifier
//! calls, all on an injected clock. The insight log goes to a writer thread and every line it
//! writes must be JSON. Nothing may panic, hang or grow past the engine's bounds.
//!
//! Input layout (decoded by `fuzz/common/input.rs`; missing bytes read as zero): a sequence of
//! operations, each a kind byte then its fields (see [`Op`] and [`encode`]).

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vmsight_introspect::syscall::{
    ArgData, ChunkSum, EntryEvent, IoSums, PosSource, ReturnEvent, ReturnVia, SumsPiece,
    SyscallObserver, Tracker,
};
use vmsight_ring::chunk_sum;

use crate::{DiskRange, FileBlocks, InsightConfig, InsightEngine, InsightLog, CHUNK};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Most operations per input.
const MAX_OPS: usize = 1024;
/// Most captured bytes per argument.
const MAX_ARG: usize = 512;
/// Most 4 KiB chunks per block request or checksum list.
const MAX_CHUNKS: u8 = 8;
/// Distinct 4 KiB contents the operations pick from (so checksums and blocks can match).
pub const POOL: u8 = 16;

/// Syscalls the engine follows (x86-64 numbers); an operation names one by index.
pub const SYSCALLS: [u64; 36] = [
    0, 1, 2, 3, 8, 17, 18, 19, 20, 32, 33, 40, 56, 57, 59, 60, 72, 76, 77, 80, 81, 82, 85, 87, 165,
    166, 231, 257, 263, 264, 275, 292, 316, 322, 326, 437,
];
/// Command names the engine treats specially (copy and encryption tools), and others.
const COMMS: [&str; 6] = ["cp", "dd", "gpg", "openssl", "postgres", "sh"];

/// Outcome bits of [`insight_stream`]: block-write chunks matched a write syscall.
pub const WRITE_DATA: u32 = 1;
/// Block-read chunks matched a read syscall.
pub const READ_DATA: u32 = 2;
/// Block-write chunks matched nothing (metadata).
pub const METADATA: u32 = 4;
/// A copy without a user buffer was followed.
pub const COPY: u32 = 8;
/// The insight log wrote records.
pub const LOGGED: u32 = 16;
/// A syscall completed.
pub const COMPLETED: u32 = 32;

/// One operation of the stream.
#[derive(Debug, Clone)]
pub enum Op {
    /// A syscall entry of thread `tid` (index into [`SYSCALLS`], or a raw number when
    /// `nr >= SYSCALLS.len()`), with captured argument bytes and buffer checksums.
    Entry {
        tid: u8,
        comm: u8,
        nr: u16,
        args: [u64; 6],
        data: Vec<(u8, Vec<u8>)>,
        io: Option<Sums>,
    },
    /// The return of `tid`'s pending call, with checksums of what a read returned.
    Return {
        tid: u8,
        rax: u64,
        late: Option<Sums>,
    },
    /// A block write of pool chunks at `sector` of `disk`, cut by `short` bytes.
    BlockWrite {
        disk: u8,
        sector: u32,
        chunks: Vec<u8>,
        short: u16,
        journal: bool,
    },
    /// A block read, the same way.
    BlockRead {
        disk: u8,
        sector: u32,
        chunks: Vec<u8>,
        short: u16,
    },
    /// A discard.
    Discard { disk: u8, sector: u32, sectors: u32 },
    /// Host time passes.
    Advance { ms: u32 },
    /// The engine finalises what is pending.
    Flush,
}

/// Buffer checksums of a read or write: the file position and the pool chunks.
#[derive(Debug, Clone)]
pub struct Sums {
    pub fd: u8,
    pub read: bool,
    pub append: bool,
    pub pos_chunk: u16,
    pub len: u32,
    pub inode: u8,
    pub chunks: Vec<u8>,
}

/// The 4 KiB content number `k` of the pool.
pub fn pool_chunk(k: u8) -> Vec<u8> {
    let k = k % POOL;
    (0..CHUNK as usize)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(k.wrapping_mul(97)) ^ (i >> 8) as u8)
        .collect()
}

/// Resolves guest files to disk ranges for copies: a fixed, made-up layout.
struct Layout;

impl FileBlocks for Layout {
    fn ranges(&self, guest_path: &str, off: u64, len: u64) -> Vec<DiskRange> {
        let base = (chunk_sum(guest_path.as_bytes()) % 1024) * CHUNK * 16;
        let len = len.min(16 * CHUNK);
        let start = base.saturating_add(off % (16 * CHUNK));
        vec![DiskRange {
            disk: 0,
            bytes: Range {
                start,
                end: start.saturating_add(len),
            },
            file_offset: off,
        }]
    }
}

/// Collects the insight log's output.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The engine under test and what feeds it.
struct Feed {
    engine: InsightEngine,
    tracker: Tracker,
    clock: Arc<AtomicU64>,
    /// Entry timestamp of each thread's last call (late checksums attach to it).
    last_entry: HashMap<u32, u64>,
    completed: u64,
}

impl Feed {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1_000, Ordering::Relaxed) + 1_000
    }

    fn complete(&mut self, calls: Vec<vmsight_introspect::syscall::Completed>) {
        for c in calls {
            self.completed += 1;
            self.engine.on_complete(&c);
        }
    }

    fn apply(&mut self, op: Op) {
        let ts = self.tick();
        match op {
            Op::Entry { .. } => {
                let e = entry_event(op, ts);
                self.last_entry.insert(e.tid, ts);
                self.engine.on_entry(&e);
                let done = self.tracker.on_entry(e);
                self.complete(done);
            }
            Op::Return { tid, rax, late } => {
                let tid = 100 + u32::from(tid % 4);
                if let (Some(s), Some(&at)) = (late, self.last_entry.get(&tid)) {
                    self.tracker.attach_late_sums(at, sums_piece(&s, true));
                }
                let r = return_event(tid, rax, ts);
                let done = self.tracker.on_return(&r);
                self.complete(done);
            }
            Op::BlockWrite {
                disk,
                sector,
                chunks,
                short,
                journal,
            } => {
                let data = block(&chunks, short);
                let off = u64::from(sector) * 512;
                self.engine
                    .lock()
                    .classify_write(u32::from(disk % 2), off, &data, journal);
            }
            Op::BlockRead {
                disk,
                sector,
                chunks,
                short,
            } => {
                let data = block(&chunks, short);
                let off = u64::from(sector) * 512;
                self.engine
                    .lock()
                    .classify_read(u32::from(disk % 2), off, &data);
            }
            Op::Discard {
                disk,
                sector,
                sectors,
            } => {
                let (off, len) = (u64::from(sector) * 512, u64::from(sectors) * 512);
                self.engine
                    .lock()
                    .log_discard(u32::from(disk % 2), off, len);
            }
            Op::Advance { ms } => {
                let now = self
                    .clock
                    .fetch_add(u64::from(ms) * 1_000_000, Ordering::Relaxed);
                self.engine.lock().expire(now);
            }
            Op::Flush => self.engine.lock().flush(),
        }
    }
}

/// The bytes of a block request: pool chunks, the last one cut by `short` bytes.
fn block(chunks: &[u8], short: u16) -> Vec<u8> {
    let mut data: Vec<u8> = chunks.iter().flat_map(|&k| pool_chunk(k)).collect();
    let cut = usize::from(short) % CHUNK as usize;
    data.truncate(data.len().saturating_sub(cut));
    data
}

fn entry_event(op: Op, ts: u64) -> EntryEvent {
    let Op::Entry {
        tid,
        comm,
        nr,
        args,
        data,
        io,
    } = op
    else {
        return EntryEvent::default();
    };
    let tid = 100 + u32::from(tid % 4);
    EntryEvent {
        ts_ns: ts,
        vcpu: 0,
        cr3: 0x1000,
        pc: 0x40_1000,
        task: 0xffff_8880_0000_0000 + u64::from(tid) * 0x1000,
        tid,
        tgid: 100,
        comm: COMMS[usize::from(comm) % COMMS.len()].into(),
        nr: SYSCALLS
            .get(usize::from(nr))
            .copied()
            .unwrap_or(u64::from(nr)),
        args,
        sp: 0x7ff0_0000,
        data: data
            .into_iter()
            .map(|(arg, bytes)| ArgData {
                arg,
                bytes,
                truncated: false,
                fault: false,
            })
            .collect(),
        io: io.map(|s| sums_piece(&s, true).header),
    }
}

/// The checksums `s` describes, as the plugin's SUMS records decode.
fn sums_piece(s: &Sums, last: bool) -> SumsPiece {
    let pos = u64::from(s.pos_chunk) * CHUNK;
    let chunks: Vec<ChunkSum> = s
        .chunks
        .iter()
        .enumerate()
        .map(|(i, &k)| ChunkSum {
            offset: pos + i as u64 * CHUNK,
            sum: chunk_sum(&pool_chunk(k)),
        })
        .collect();
    let header = IoSums {
        fd: u32::from(s.fd),
        read: s.read,
        append: s.append,
        pos_source: if s.append {
            PosSource::InodeSize
        } else {
            PosSource::FilePos
        },
        file_pos: pos,
        len: u64::from(s.len),
        inode: 0xffff_8880_1000_0000 + u64::from(s.inode % 4) * 0x400,
        i_size: pos + u64::from(s.len),
        chunks: chunks.clone(),
        truncated: false,
        fault: false,
        complete: last,
    };
    SumsPiece {
        header,
        sums: chunks.iter().map(|c| (c.offset / CHUNK, c.sum)).collect(),
        last,
    }
}

fn return_event(tid: u32, rax: u64, ts: u64) -> ReturnEvent {
    ReturnEvent {
        ts_ns: ts,
        vcpu: 0,
        cr3: 0x1000,
        task: 0xffff_8880_0000_0000 + u64::from(tid) * 0x1000,
        tid,
        tgid: 100,
        rip: 0x40_1002,
        rax,
        via: ReturnVia::Sysret,
    }
}

/// Runs one fuzz input; panics if a promise is broken. Returns the outcome bits reached.
pub fn insight_stream(data: &[u8]) -> u32 {
    let lines = Lines::default();
    let Ok((log, writer)) = InsightLog::start(Box::new(lines.clone())) else {
        return 0;
    };
    let clock = Arc::new(AtomicU64::new(1_000_000_000));
    let c2 = clock.clone();
    let cfg = InsightConfig {
        max_write_sums: 256,
        max_read_sums: 256,
        max_cached_chunks: 64,
        max_processes: 8,
        ..InsightConfig::default()
    };
    let engine = InsightEngine::with_clock(cfg, log, Arc::new(move || c2.load(Ordering::Relaxed)));
    engine.set_file_blocks(Arc::new(Layout));
    let mut feed = Feed {
        engine,
        tracker: Tracker::new(),
        clock,
        last_entry: HashMap::new(),
        completed: 0,
    };
    let mut inp = Input::new(data);
    for _ in 0..MAX_OPS {
        if inp.is_empty() {
            break;
        }
        feed.apply(decode(&mut inp));
    }
    let rest = feed.tracker.finish();
    feed.complete(rest);
    feed.engine.finish();
    let completed = feed.completed;
    let counters = feed.engine.counters();
    feed.engine.lock().close_log();
    drop(feed);
    let written = writer.finish().unwrap_or(0);
    check_log(&lines, written);
    [
        (counters.write_chunks_data, WRITE_DATA),
        (counters.read_chunks_data, READ_DATA),
        (counters.write_chunks_metadata, METADATA),
        (counters.copy_calls, COPY),
        (written, LOGGED),
        (completed, COMPLETED),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .fold(0, |acc, (_, bit)| acc | bit)
}

/// The log holds one JSON object per record written.
fn check_log(lines: &Lines, written: u64) {
    let out = lines.0.lock().map(|v| v.clone()).unwrap_or_default();
    let mut n = 0u64;
    for line in out.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        n += 1;
        assert!(
            serde_json::from_slice::<serde_json::Value>(line).is_ok_and(|v| v.is_object()),
            "log lines are JSON objects"
        );
    }
    assert_eq!(n, written, "one line per record");
}

fn decode_sums(inp: &mut Input<'_>) -> Sums {
    Sums {
        fd: inp.u8(),
        read: inp.bool(),
        append: inp.bool(),
        pos_chunk: inp.u16(),
        len: inp.u32(),
        inode: inp.u8(),
        chunks: decode_chunks(inp),
    }
}

fn decode_chunks(inp: &mut Input<'_>) -> Vec<u8> {
    let n = inp.u8() % (MAX_CHUNKS + 1);
    inp.take(usize::from(n)).to_vec()
}

/// An argument: small numbers, `AT_FDCWD`, the hint magic, or any value.
fn decode_arg(inp: &mut Input<'_>) -> u64 {
    match inp.u8() % 4 {
        0 => u64::from(inp.u8()),
        1 => (-100i64) as u64,
        2 => crate::VMSIGHT_HINT_MAGIC,
        _ => inp.u64(),
    }
}

fn decode(inp: &mut Input<'_>) -> Op {
    match inp.u8() % 7 {
        0 => Op::Entry {
            tid: inp.u8(),
            comm: inp.u8(),
            nr: u16::from(inp.u8()),
            args: std::array::from_fn(|_| decode_arg(inp)),
            data: (0..inp.u8() % 3)
                .map(|_| (inp.u8() % 18, inp.chunk(MAX_ARG).to_vec()))
                .collect(),
            io: inp.bool().then(|| decode_sums(inp)),
        },
        1 => Op::Return {
            tid: inp.u8(),
            rax: decode_arg(inp),
            late: inp.bool().then(|| decode_sums(inp)),
        },
        2 => Op::BlockWrite {
            disk: inp.u8(),
            sector: inp.u32(),
            chunks: decode_chunks(inp),
            short: inp.u16(),
            journal: inp.bool(),
        },
        3 => Op::BlockRead {
            disk: inp.u8(),
            sector: inp.u32(),
            chunks: decode_chunks(inp),
            short: inp.u16(),
        },
        4 => Op::Discard {
            disk: inp.u8(),
            sector: inp.u32(),
            sectors: inp.u32(),
        },
        5 => Op::Advance { ms: inp.u32() },
        _ => Op::Flush,
    }
}

// ---- encoding (seed generators) --------------------------------------------------------------

fn encode_arg(o: &mut Output, v: u64) {
    if v == (-100i64) as u64 {
        o.u8(1);
    } else if v == crate::VMSIGHT_HINT_MAGIC {
        o.u8(2);
    } else if v < 256 {
        o.u8(0).u8(v as u8);
    } else {
        o.u8(3).u64(v);
    }
}

fn encode_chunks(o: &mut Output, chunks: &[u8]) {
    let n = chunks.len().min(usize::from(MAX_CHUNKS));
    o.u8(n as u8).raw(&chunks[..n]);
}

fn encode_sums(o: &mut Output, s: &Option<Sums>) {
    match s {
        None => {
            o.u8(0);
        }
        Some(s) => {
            o.u8(1).u8(s.fd).u8(u8::from(s.read)).u8(u8::from(s.append));
            o.u16(s.pos_chunk).u32(s.len).u8(s.inode);
            encode_chunks(o, &s.chunks);
        }
    }
}

/// The input that decodes to `ops`.
pub fn encode(ops: &[Op]) -> Vec<u8> {
    let mut o = Output::default();
    for op in ops {
        match op {
            Op::Entry {
                tid,
                comm,
                nr,
                args,
                data,
                io,
            } => {
                o.u8(0).u8(*tid).u8(*comm).u8(*nr as u8);
                for a in args {
                    encode_arg(&mut o, *a);
                }
                o.u8(data.len() as u8);
                for (arg, bytes) in data {
                    o.u8(*arg).chunk(bytes);
                }
                encode_sums(&mut o, io);
            }
            Op::Return { tid, rax, late } => {
                o.u8(1).u8(*tid);
                encode_arg(&mut o, *rax);
                encode_sums(&mut o, late);
            }
            Op::BlockWrite {
                disk,
                sector,
                chunks,
                short,
                journal,
            } => {
                o.u8(2).u8(*disk).u32(*sector);
                encode_chunks(&mut o, chunks);
                o.u16(*short).u8(u8::from(*journal));
            }
            Op::BlockRead {
                disk,
                sector,
                chunks,
                short,
            } => {
                o.u8(3).u8(*disk).u32(*sector);
                encode_chunks(&mut o, chunks);
                o.u16(*short);
            }
            Op::Discard {
                disk,
                sector,
                sectors,
            } => {
                o.u8(4).u8(*disk).u32(*sector).u32(*sectors);
            }
            Op::Advance { ms } => {
                o.u8(5).u32(*ms);
            }
            Op::Flush => {
                o.u8(6);
            }
        }
    }
    o.bytes
}

/// The index of syscall `nr` in [`SYSCALLS`] (for [`Op::Entry`]).
pub fn syscall(nr: u64) -> u16 {
    SYSCALLS
        .iter()
        .position(|&n| n == nr)
        .map_or(nr as u16, |i| i as u16)
}
