//! Classifier tests on crafted syscall / block-request sequences, with an injected clock.
#![allow(
    clippy::unwrap_used,
    clippy::too_many_arguments,
    clippy::single_range_in_vec_init
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vmsight_blockdev::insight::{Content, InsightRecord, Pattern};
use vmsight_introspect::syscall::event::{ArgData, HEAD_ARG, PPID_ARG, TAIL_ARG};
use vmsight_introspect::syscall::{
    ChunkSum, Completed, EntryEvent, IoSums, Outcome, PosSource, SyscallObserver,
};
use vmsight_ring::chunk_sum;

use super::*;
use crate::config::InsightConfig;
use crate::hint::VMSIGHT_HINT_MAGIC;
use crate::log::InsightLog;

const INODE: u64 = 0xffff_8880_0000_1000;

struct World {
    engine: InsightEngine,
    clock: Arc<AtomicU64>,
    classifier: Classifier,
    log: std::path::PathBuf,
    writer: Option<crate::log::LogWriter>,
    _dir: std::path::PathBuf,
    ts: u64,
}

fn world(cfg: InsightConfig) -> World {
    let dir = std::env::temp_dir().join(format!(
        "vmsight-insight-test-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("insights.jsonl");
    let (l, writer) = InsightLog::create(&log).unwrap();
    let clock = Arc::new(AtomicU64::new(1_000_000_000));
    let c2 = clock.clone();
    let engine = InsightEngine::with_clock(cfg, l, Arc::new(move || c2.load(Ordering::SeqCst)));
    let classifier = Classifier::build(engine.clone(), 0, vec![1 << 20..2 << 20]);
    World {
        engine,
        clock,
        classifier,
        log,
        writer: Some(writer),
        _dir: dir,
        ts: 1,
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn content(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i * 7 + i / 4096) as u8))
        .collect()
}

impl World {
    fn advance(&self, d: Duration) {
        self.clock.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }

    fn call(&mut self, pid: u32, comm: &str, nr: u64, args: [u64; 6], ret: i64) -> Completed {
        self.ts += 1;
        Completed {
            entry: EntryEvent {
                ts_ns: self.ts,
                tid: pid,
                tgid: pid,
                comm: comm.into(),
                nr,
                args,
                ..Default::default()
            },
            outcome: Outcome::Returned(ret),
            exit_ts_ns: Some(self.ts),
            exit_vcpu: Some(0),
        }
    }

    fn open(&mut self, pid: u32, comm: &str, path: &str, fd: i64, flags: u64) {
        let mut c = self.call(
            pid,
            comm,
            257,
            [(-100i64) as u64, 0x1000, flags, 0o644, 0, 0],
            fd,
        );
        c.entry.data.push(ArgData {
            arg: 1,
            bytes: path.as_bytes().to_vec(),
            truncated: false,
            fault: false,
        });
        self.engine.on_entry(&c.entry);
        self.engine.on_complete(&c);
    }

    /// What the plugin would send for a write of `buf` at file position `pos`.
    fn io_event(
        &mut self,
        pid: u32,
        comm: &str,
        fd: u32,
        pos: u64,
        buf: &[u8],
        i_size: u64,
        read: bool,
    ) -> Completed {
        let nr = if read { 17 } else { 18 };
        let mut c = self.call(
            pid,
            comm,
            nr,
            [u64::from(fd), 0x7000, buf.len() as u64, pos, 0, 0],
            buf.len() as i64,
        );
        let first = pos.div_ceil(4096) * 4096;
        let mut chunks = Vec::new();
        let mut off = first;
        while off + 4096 <= pos + buf.len() as u64 {
            let s = (off - pos) as usize;
            chunks.push(ChunkSum {
                offset: off,
                sum: chunk_sum(&buf[s..s + 4096]),
            });
            off += 4096;
        }
        if !read {
            let end = pos + buf.len() as u64;
            let last = end / 4096 * 4096;
            if chunks.is_empty() && (pos / 4096 == (end.saturating_sub(1)) / 4096) {
                c.entry.data.push(ArgData {
                    arg: HEAD_ARG,
                    bytes: buf.to_vec(),
                    ..Default::default()
                });
            } else {
                let head = (first - pos) as usize;
                if head > 0 {
                    c.entry.data.push(ArgData {
                        arg: HEAD_ARG,
                        bytes: buf[..head].to_vec(),
                        ..Default::default()
                    });
                }
                if last > first.max(pos) || (chunks.is_empty() && last > pos) {
                    let t = (last - pos) as usize;
                    if t < buf.len() {
                        c.entry.data.push(ArgData {
                            arg: TAIL_ARG,
                            bytes: buf[t..].to_vec(),
                            ..Default::default()
                        });
                    }
                }
            }
        }
        c.entry.io = Some(IoSums {
            fd,
            read,
            append: false,
            pos_source: PosSource::Arg,
            file_pos: pos,
            len: buf.len() as u64,
            inode: INODE + u64::from(fd) * 0x1000,
            i_size,
            chunks,
            truncated: false,
            fault: false,
            complete: true,
        });
        c
    }

    fn syscall(&mut self, c: &Completed) {
        self.engine.on_entry(&c.entry);
        self.engine.on_complete(c);
    }

    fn block_write(&mut self, offset: u64, data: &[u8]) -> RequestInsight {
        let j = self.classifier.in_journal(offset, data.len() as u64);
        self.engine.lock().classify_write(0, offset, data, j)
    }

    fn block_read(&mut self, offset: u64, data: &[u8]) -> RequestInsight {
        self.engine.lock().classify_read(0, offset, data)
    }

    fn records(&mut self) -> Vec<InsightRecord> {
        SyscallObserver::finish(&mut self.engine);
        // The engine holds the only sender: closing it ends the writer thread.
        self.engine.lock().close_log();
        self.writer.take().unwrap().finish().unwrap();
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

#[test]
fn aligned_write_is_data_with_size_class_and_file() {
    let mut w = world(InsightConfig::default());
    w.open(100, "app", "/data/a", 3, 0o101);
    let buf = content(1, 8192);
    let c = w.io_event(100, "app", 3, 0, &buf, 0, false);
    w.syscall(&c);
    let meta = content(99, 4096);
    let i = w.block_write(40960, &buf);
    assert_eq!(i.content, Content::Data);
    assert_eq!(i.class, 4, "an 8 KiB file is in the <1 MiB class");
    assert_eq!(i.file.as_deref(), Some("/data/a"));
    assert_eq!((i.pid, i.file_offset), (Some(100), Some(0)));
    assert!(!i.journal);
    // Matched sums are consumed: the same content again is not data.
    assert_eq!(w.block_write(40960, &buf).content, Content::Metadata);
    let m = w.block_write(1 << 20, &meta);
    assert_eq!(
        (m.content, m.class, m.journal),
        (Content::Metadata, 5, true)
    );
    // Half matched (after the grace of the unmatched request above, which would otherwise
    // take the late syscall's chunk).
    w.advance(Duration::from_secs(2));
    let c = w.io_event(100, "app", 3, 8192, &buf[..4096], 8192, false);
    w.syscall(&c);
    let mut mixed = buf[..4096].to_vec();
    mixed.extend_from_slice(&meta);
    let x = w.block_write(0, &mixed);
    assert_eq!((x.content, x.class), (Content::Mixed, 5));
    let recs = w.records();
    let writes: Vec<_> = recs
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Write(b) => Some(b),
            _ => None,
        })
        .collect();
    // The mixed request is logged as its two parts: the data chunk and the metadata chunk.
    assert_eq!(writes.len(), 5);
    let parts: Vec<_> = writes[3..]
        .iter()
        .map(|b| (b.offset, b.len, b.insight.content, b.insight.class))
        .collect();
    assert_eq!(
        parts,
        vec![
            (0, 4096, Content::Data, 4),
            (4096, 4096, Content::Metadata, 5)
        ]
    );
    assert_eq!(
        x.block_classes,
        vec![4, 5],
        "the cache gets a class per block"
    );
    let cnt = w.engine.counters();
    assert_eq!(cnt.write_chunks_data, 3);
    assert_eq!(cnt.writes.get(&4).unwrap().requests, 1);
}

#[test]
fn misaligned_and_small_appends_are_completed_from_the_recent_io_cache() {
    let mut w = world(InsightConfig::default());
    w.open(7, "mail", "/var/mail/box", 4, 0o2101);
    // First append: 100 bytes to an empty file -> a partial head chunk, zeros after EOF.
    let a = content(2, 100);
    let c = w.io_event(7, "mail", 4, 0, &a, 0, false);
    w.syscall(&c);
    let mut block = vec![0u8; 4096];
    block[..100].copy_from_slice(&a);
    assert_eq!(w.block_write(8192, &block).content, Content::Data);
    // Second append: 5000 bytes at offset 100 -> head completes chunk 0 from the cache,
    // tail (1004 bytes) starts chunk 1.
    let b = content(3, 5000);
    let c = w.io_event(7, "mail", 4, 100, &b, 100, false);
    w.syscall(&c);
    let mut file = a.clone();
    file.extend_from_slice(&b);
    file.resize(8192, 0);
    let i = w.block_write(8192, &file);
    assert_eq!(i.content, Content::Data, "{i:?}");
    assert_eq!(i.file_offset, Some(0));
    let cnt = w.engine.counters();
    assert_eq!(cnt.partial_completed, 3);
    assert_eq!(cnt.partial_unknown, 0);
    // An overwrite in the middle of a chunk whose old contents were never seen cannot be
    // completed: counted, and the block is (wrongly but safely) metadata.
    w.open(7, "mail", "/var/mail/other", 5, 0o2);
    let c = w.io_event(7, "mail", 5, 50, &a, 1 << 20, false);
    w.syscall(&c);
    assert_eq!(w.engine.counters().partial_unknown, 1);
}

#[test]
fn block_write_before_the_syscall_event_is_reclassified_in_the_log() {
    let mut w = world(InsightConfig::default());
    w.open(100, "app", "/x", 3, 0o101);
    let buf = content(4, 4096);
    // The block thread is ahead of the trace thread.
    let early = w.block_write(0, &buf);
    assert_eq!(
        early.content,
        Content::Metadata,
        "the request itself saw metadata"
    );
    w.advance(Duration::from_millis(300));
    let c = w.io_event(100, "app", 3, 0, &buf, 0, false);
    w.syscall(&c);
    // Outside the grace it stays metadata.
    let other = content(5, 4096);
    w.block_write(4096, &other);
    w.advance(Duration::from_secs(2));
    let c = w.io_event(100, "app", 3, 4096, &other, 4096, false);
    w.syscall(&c);
    let recs = w.records();
    let contents: Vec<(u64, Content)> = recs
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Write(b) => Some((b.offset, b.insight.content)),
            _ => None,
        })
        .collect();
    assert!(contents.contains(&(0, Content::Data)), "{contents:?}");
    assert!(
        contents.contains(&(4096, Content::Metadata)),
        "{contents:?}"
    );
    assert_eq!(w.engine.counters().late_matches, 1);
}

#[test]
fn chunks_of_one_write_split_across_requests_and_vcpus_all_match() {
    let mut w = world(InsightConfig::default());
    w.open(5, "app", "/big", 3, 0o101);
    let buf = content(6, 3 << 20); // 3 MiB -> class 2
    let mut c = w.io_event(5, "app", 3, 0, &buf, 0, false);
    c.entry.vcpu = 1;
    w.syscall(&c);
    // Writeback in reverse order and odd sizes.
    let i1 = w.block_write(10 << 20, &buf[2 << 20..]);
    let i2 = w.block_write(9 << 20, &buf[4096..2 << 20]);
    let i3 = w.block_write(8 << 20, &buf[..4096]);
    for i in [&i1, &i2, &i3] {
        assert_eq!((i.content, i.class), (Content::Data, 2), "{i:?}");
    }
    assert_eq!(i1.file_offset, Some(2 << 20));
}

#[test]
fn reads_match_retroactively_within_the_window_only() {
    let mut w = world(InsightConfig::default());
    w.open(9, "cat", "/etc/big", 3, 0);
    let d1 = content(7, 8192);
    let d2 = content(8, 4096);
    let r = w.block_read(0, &d1);
    assert_eq!(r.content, Content::Metadata, "nothing known yet");
    let r2 = w.block_read(8192, &d2);
    w.advance(Duration::from_secs(1));
    let c = w.io_event(9, "cat", 3, 0, &d1, 3 << 19, true);
    w.syscall(&c);
    w.advance(Duration::from_secs(5)); // d2's syscall comes too late
    let c = w.io_event(9, "cat", 3, 8192, &d2, 3 << 19, true);
    w.syscall(&c);
    assert_eq!(r2.content, Content::Metadata);
    // Content seen at a syscall is known: a later block read of it is data at once.
    let again = w.block_read(4096, &d1[..4096]);
    assert_eq!((again.content, again.class), (Content::Data, 3));
    let recs = w.records();
    let reads: Vec<(u64, Content)> = recs
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Read(b) => Some((b.offset, b.insight.content)),
            _ => None,
        })
        .collect();
    assert!(reads.contains(&(0, Content::Data)), "{reads:?}");
    assert!(reads.contains(&(8192, Content::Metadata)), "{reads:?}");
}

#[test]
fn copy_and_encrypt_patterns_and_app_hints() {
    let mut w = world(InsightConfig::default());
    // A process that writes what it just read is copying, whatever its name.
    w.open(11, "mycopy", "/src", 3, 0);
    w.open(11, "mycopy", "/dst", 4, 0o101);
    let d = content(9, 4096);
    let c = w.io_event(11, "mycopy", 3, 0, &d, 4096, true);
    w.syscall(&c);
    let c = w.io_event(11, "mycopy", 4, 0, &d, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(0, &d).pattern, Some(Pattern::Copy));
    // gpg output.
    w.open(12, "gpg", "/secret.gpg", 3, 0o101);
    let e = content(10, 4096);
    let c = w.io_event(12, "gpg", 3, 0, &e, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(4096, &e).pattern, Some(Pattern::Encrypt));
    // A hinted pwrite64: args[4] = magic, args[5] = class -> class overrides.
    w.open(13, "db", "/db/index", 3, 0o2);
    let h = content(11, 4096);
    let mut c = w.io_event(13, "db", 3, 0, &h, 0, false);
    c.entry.args[4] = VMSIGHT_HINT_MAGIC;
    c.entry.args[5] = 1;
    w.syscall(&c);
    let i = w.block_write(8192, &h);
    assert_eq!(
        (i.app_class, i.class, i.content),
        (Some(1), 1, Content::Data)
    );
}

#[test]
fn fd_table_follows_dup_fork_chdir_and_path_selection() {
    let cfg = InsightConfig {
        paths: vec!["/sel".into()],
        ..InsightConfig::default()
    };
    let mut w = world(cfg);
    let c = {
        let mut c = w.call(20, "sh", 80, [0x1000, 0, 0, 0, 0, 0], 0);
        c.entry.data.push(ArgData {
            arg: 0,
            bytes: b"/sel/dir".to_vec(),
            ..Default::default()
        });
        c
    };
    w.syscall(&c);
    w.open(20, "sh", "f", 3, 0o101); // relative: /sel/dir/f
    let c = w.call(20, "sh", 33, [3, 7, 0, 0, 0, 0], 7); // dup2(3, 7)
    w.syscall(&c);
    let c = w.call(20, "sh", 57, [0; 6], 21); // fork -> 21
    w.syscall(&c);
    let d = content(12, 4096);
    let c = w.io_event(21, "sh", 7, 0, &d, 0, false);
    w.syscall(&c);
    let i = w.block_write(0, &d);
    assert_eq!(i.file.as_deref(), Some("/sel/dir/f"));
    assert_eq!(i.pid, Some(21));
    // Not selected: not indexed.
    w.open(20, "sh", "/other/g", 4, 0o101);
    let e = content(13, 4096);
    let c = w.io_event(20, "sh", 4, 0, &e, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(4096, &e).content, Content::Metadata);
    // unlink and ftruncate reach the log.
    let c = w.call(20, "sh", 77, [3, 10, 0, 0, 0, 0], 0);
    w.syscall(&c);
    let mut c = w.call(20, "sh", 87, [0x1000, 0, 0, 0, 0, 0], 0);
    c.entry.data.push(ArgData {
        arg: 0,
        bytes: b"f".to_vec(),
        ..Default::default()
    });
    w.syscall(&c);
    // ... but those of files outside the selected paths do not (a shell's `> /dev/null`).
    let c = w.call(20, "sh", 77, [4, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    let recs = w.records();
    assert!(recs.iter().any(
        |r| matches!(r, InsightRecord::Truncate(f) if f.file == "/sel/dir/f" && f.size == 10)
    ));
    assert!(recs
        .iter()
        .any(|r| matches!(r, InsightRecord::Unlink(f) if f.file == "/sel/dir/f")));
    assert!(!recs.iter().any(
        |r| matches!(r, InsightRecord::Truncate(f) | InsightRecord::Unlink(f) if f.file == "/other/g")
    ));
}

/// dash runs a command with its redirection through `vfork`: the parent opens the file and
/// dup2's it onto fd 1, then vforks; the child execs and writes before the parent's return is
/// seen. The child's writes are the file's from its first one, and what the child opens
/// before that return survives it.
#[test]
fn a_vfork_child_writing_before_its_parents_return_has_the_parents_fds() {
    let mut w = world(InsightConfig::default());
    w.open(20, "sh", "/root/out", 3, 0o1101); // O_WRONLY|O_CREAT|O_TRUNC
    let c = w.call(20, "sh", 33, [3, 1, 0, 0, 0, 0], 1); // dup2(3, 1)
    w.syscall(&c);
    let c = w.call(20, "sh", 3, [3, 0, 0, 0, 0, 0], 0); // close(3)
    w.syscall(&c);
    let vfork = w.call(20, "sh", 58, [0; 6], 21);
    w.engine.on_entry(&vfork.entry);
    // The child's first call carries its parent's TGID (the plugin's description).
    let mut first = w.call(21, "sh", 14, [2, 0, 0, 0, 0, 0], 0);
    first.entry.data.push(ArgData {
        arg: PPID_ARG,
        bytes: 20i32.to_le_bytes().to_vec(),
        ..Default::default()
    });
    w.syscall(&first);
    let c = w.call(21, "head", 59, [0x1000, 0, 0, 0, 0, 0], 0); // execve
    w.syscall(&c);
    w.open(21, "head", "/root/other", 5, 0o101);
    let d = content(21, 8192);
    let c = w.io_event(21, "head", 1, 0, &d, 0, false);
    w.syscall(&c);
    // Only now the parent's vfork returns.
    w.engine.on_complete(&vfork);
    let e = content(22, 4096);
    let c = w.io_event(21, "head", 5, 0, &e, 0, false);
    w.syscall(&c);
    let f = content(23, 4096);
    let c = w.io_event(21, "head", 1, 8192, &f, 8192, false);
    w.syscall(&c);
    assert_eq!(w.engine.counters().forks_adopted, 1);
    for (off, data, file, at) in [
        (0, &d, "/root/out", 0),
        (8192, &f, "/root/out", 8192),
        (65536, &e, "/root/other", 0),
    ] {
        let i = w.block_write(off, data);
        assert_eq!(i.content, Content::Data, "{file} at {at}");
        assert_eq!(i.file.as_deref(), Some(file));
        assert_eq!(i.file_offset, Some(at), "{file}");
        assert_eq!(i.pid, Some(21));
    }
}

/// Without the parent's TGID on the child's first call, the child gets the parent's tables
/// as they were at the fork's entry when the fork returns, not as they are by then.
#[test]
fn a_fork_child_without_a_parent_tgid_gets_the_tables_of_the_forks_entry() {
    let mut w = world(InsightConfig::default());
    w.open(30, "sh", "/root/kept", 4, 0o101);
    let fork = w.call(30, "sh", 57, [0; 6], 31);
    w.engine.on_entry(&fork.entry);
    // Another thread of the parent closes fd 4 while the fork is in flight.
    let mut c = w.call(30, "sh", 3, [4, 0, 0, 0, 0, 0], 0);
    c.entry.tid = 32;
    w.syscall(&c);
    w.engine.on_complete(&fork);
    let d = content(31, 4096);
    let c = w.io_event(31, "sh", 4, 0, &d, 0, false);
    w.syscall(&c);
    assert_eq!(w.engine.counters().forks_adopted, 0);
    let i = w.block_write(0, &d);
    assert_eq!(i.file.as_deref(), Some("/root/kept"));
    assert_eq!(i.pid, Some(31));
}

#[test]
fn overwritten_chunks_are_superseded_and_identical_chunks_counted() {
    let mut w = world(InsightConfig::default());
    w.open(30, "app", "/z", 3, 0o101);
    let zeros = vec![0u8; 8192];
    let c = w.io_event(30, "app", 3, 0, &zeros, 0, false);
    w.syscall(&c);
    // Two identical zero chunks: both block chunks match.
    assert_eq!(w.block_write(0, &zeros).content, Content::Data);
    let a = content(14, 4096);
    let b = content(15, 4096);
    let c = w.io_event(30, "app", 3, 8192, &a, 8192, false);
    w.syscall(&c);
    let c = w.io_event(30, "app", 3, 8192, &b, 12288, false);
    w.syscall(&c);
    assert_eq!(w.engine.counters().superseded, 1);
    assert_eq!(w.block_write(4096, &a).content, Content::Metadata);
    assert_eq!(w.block_write(4096, &b).content, Content::Data);
}

#[test]
fn a_request_merged_from_a_hinted_and_an_unhinted_file_keeps_each_blocks_hint() {
    let mut w = world(InsightConfig::default());
    w.open(100, "dd", "/t/hinted", 3, 0o101);
    w.open(100, "dd", "/p/plain", 4, 0o101);
    let a = content(11, 8192);
    let b = content(12, 8192);
    // The hinted file's pwrite64 carries application class 6 (libvmsight / the shim).
    let mut ca = w.io_event(100, "dd", 3, 0, &a, 0, false);
    ca.entry.args[4] = VMSIGHT_HINT_MAGIC;
    ca.entry.args[5] = 6;
    w.syscall(&ca);
    let cb = w.io_event(100, "dd", 4, 0, &b, 0, false);
    w.syscall(&cb);
    // The guest block layer merged both files' neighbouring blocks into one request.
    let mut merged = a.clone();
    merged.extend_from_slice(&b);
    let i = w.block_write(1 << 20, &merged);
    assert_eq!(i.content, Content::Data);
    assert_eq!(
        i.app_class, None,
        "no single application class for the whole request"
    );
    assert_eq!(i.block_classes, vec![6, 6, 4, 4]);
    let parts: Vec<_> = w
        .records()
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Write(b) => Some((
                b.offset,
                b.len,
                b.insight.app_class,
                b.insight.file.as_deref().map(str::to_string),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        parts,
        vec![
            (1 << 20, 8192, Some(6), Some("/t/hinted".to_string())),
            ((1 << 20) + 8192, 8192, None, Some("/p/plain".to_string())),
        ]
    );
}

mod copy;
mod lookup;

#[test]
fn vectored_writes_and_reads_are_matched_and_move_the_fd_offset_like_the_kernel() {
    let mut w = world(InsightConfig::default());
    w.open(100, "app", "/data/v", 3, 0o101);
    let buf = content(7, 16384);
    // writev of 8 KiB at the file position, then pwritev2(offset -1) of 4 KiB (also at the
    // file position), then pwritev at 64 KiB (positional: the position stays).
    for (nr, pos, range, off_arg) in [
        (20, 0, 0..8192, 0),
        (328, 8192, 8192..12288, u64::MAX),
        (296, 65536, 12288..16384, 65536),
    ] {
        let mut c = w.io_event(100, "app", 3, pos, &buf[range], 0, false);
        c.entry.nr = nr;
        c.entry.args[3] = off_arg;
        if off_arg != 65536 {
            c.entry.io.as_mut().unwrap().pos_source = PosSource::FilePos;
        }
        w.syscall(&c);
    }
    assert_eq!(w.engine.lock().fd_offset(100, 3), Some(12288));
    for (i, disk) in [(0usize, 40960u64), (1, 45056), (2, 49152), (3, 53248)] {
        let got = w.block_write(disk, &buf[i * 4096..(i + 1) * 4096]);
        let want = if i == 3 { 65536 } else { i as u64 * 4096 };
        assert_eq!(
            (got.content, got.file.as_deref(), got.file_offset),
            (Content::Data, Some("/data/v"), Some(want)),
            "chunk {i}"
        );
    }
    // readv: the block read is data once the vectored read's sums arrive; the offset moves.
    let r = content(9, 4096);
    assert_eq!(w.block_read(1 << 21, &r).content, Content::Metadata);
    let mut c = w.io_event(100, "app", 3, 12288, &r, 16384, true);
    c.entry.nr = 19;
    c.entry.io.as_mut().unwrap().pos_source = PosSource::FilePos;
    w.syscall(&c);
    assert_eq!(w.engine.lock().fd_offset(100, 3), Some(16384));
    assert_eq!(w.engine.counters().write_chunks_data, 4);
    let recs = w.records();
    let read_data = recs.iter().any(|r| {
        matches!(r, InsightRecord::Read(b) if b.offset == 1 << 21 && b.insight.content == Content::Data)
    });
    assert!(read_data, "the readv's block read is reclassified as data");
}

#[test]
fn chunks_no_checksum_matched_are_data_when_their_page_belongs_to_a_regular_file() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    w.open(100, "app", "/data/big", 3, 0o101);
    // The syscall showed only the first chunk's checksum (as with the plugin's cap); the
    // kernel's pages say what the other three are.
    let buf = content(3, 4 * 4096);
    let mut c = w.io_event(100, "app", 3, 0, &buf[..4096], 3 << 20, false);
    c.entry.io.as_mut().unwrap().len = buf.len() as u64;
    w.syscall(&c);
    let inode = INODE + 3 * 0x1000;
    let owners = [
        PageOwner::File {
            inode,
            ino: 12,
            offset: 0,
            size: 3 << 20,
            path: None,
        },
        PageOwner::File {
            inode,
            ino: 12,
            offset: 4096,
            size: 3 << 20,
            path: None,
        },
        PageOwner::Anonymous,
        PageOwner::File {
            inode: 0xffff_8880_0000_9000, // a file no syscall named
            ino: 13,
            offset: 12 << 20,
            size: 16 << 20,
            path: Some("/other".into()),
        },
    ];
    let mut asked = Vec::new();
    let i = w
        .engine
        .lock()
        .classify_write_owned(0, 0, &buf, false, &mut |k| {
            asked.push(k);
            Some(owners[k].clone())
        });
    assert_eq!(asked, vec![1, 2, 3], "a matched chunk is not asked about");
    assert_eq!(i.content, Content::Mixed);
    assert_eq!(
        i.block_classes,
        vec![2, 2, 0, 0],
        "size classes from the inodes; the anonymous page unknown, the lowest class"
    );
    let writes: Vec<_> = w
        .records()
        .into_iter()
        .filter_map(|r| match r {
            InsightRecord::Write(b) => Some(b),
            _ => None,
        })
        .collect();
    let parts: Vec<_> = writes
        .iter()
        .map(|b| {
            (
                b.offset,
                b.insight.content,
                b.insight.file.as_deref().map(str::to_owned),
                b.insight.file_offset,
                b.insight.pid,
            )
        })
        .collect();
    assert_eq!(
        parts,
        vec![
            (
                0,
                Content::Data,
                Some("/data/big".into()),
                Some(0),
                Some(100)
            ),
            (8192, Content::Unknown, None, None, None),
            (
                12288,
                Content::Data,
                Some("/other".into()),
                Some(12 << 20),
                None
            ),
        ]
    );
    // Counted when final (the anonymous chunk waited for a late syscall).
    let cnt = w.engine.counters();
    assert_eq!(
        (
            cnt.write_chunks_data,
            cnt.write_chunks_by_page,
            cnt.write_chunks_anonymous,
            cnt.write_chunks_unknown,
            cnt.write_chunks_metadata
        ),
        (3, 2, 1, 1, 0),
        "an anonymous page is unknown, never metadata"
    );
}

#[test]
fn page_owned_chunks_of_unselected_files_stay_metadata() {
    use crate::pages::PageOwner;
    let cfg = InsightConfig {
        paths: vec!["/data".into()],
        ..InsightConfig::default()
    };
    let w = world(cfg);
    let buf = content(4, 4096);
    let i = w
        .engine
        .lock()
        .classify_write_owned(0, 0, &buf, false, &mut |_| {
            Some(PageOwner::File {
                inode: INODE,
                ino: 12,
                offset: 0,
                size: 4096,
                path: Some("/elsewhere/x".into()),
            })
        });
    assert_eq!(i.content, Content::Metadata, "an unselected file");
    assert_eq!(w.engine.counters().write_chunks_by_page, 0);
}

#[test]
fn a_page_owned_chunk_still_takes_the_hint_of_a_syscall_that_arrives_within_the_grace() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    w.open(13, "db", "/db/index", 3, 0o2);
    let h = content(12, 4096);
    // The block write comes before the trace thread delivered the hinted pwrite64.
    let i = w
        .engine
        .lock()
        .classify_write_owned(0, 0, &h, false, &mut |_| {
            Some(PageOwner::File {
                inode: INODE + 3 * 0x1000,
                ino: 40,
                offset: 0,
                size: 4096,
                path: Some("/db/index".into()),
            })
        });
    assert_eq!(
        (i.content, i.app_class),
        (Content::Data, None),
        "data by its page"
    );
    let mut c = w.io_event(13, "db", 3, 0, &h, 0, false);
    c.entry.args[4] = VMSIGHT_HINT_MAGIC;
    c.entry.args[5] = 1;
    w.syscall(&c);
    let recs = w.records();
    let b = recs
        .iter()
        .find_map(|r| match r {
            InsightRecord::Write(b) => Some(b),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        (b.insight.app_class, b.insight.pid, b.insight.content),
        (Some(1), Some(13), Content::Data),
        "the log record carries the late syscall's hint and writer"
    );
    let cnt = w.engine.counters();
    assert_eq!((cnt.write_chunks_by_page, cnt.late_matches), (0, 1));
}

#[test]
fn blocks_of_one_file_that_do_not_follow_on_in_the_file_are_logged_apart() {
    let mut w = world(InsightConfig::default());
    w.open(100, "app", "/data/f", 3, 0o101);
    let (a, b) = (content(21, 4096), content(22, 4096));
    // File chunks 0 and 2, written next to each other on the disk.
    let c = w.io_event(100, "app", 3, 0, &a, 0, false);
    w.syscall(&c);
    let c = w.io_event(100, "app", 3, 8192, &b, 4096, false);
    w.syscall(&c);
    let mut both = a.clone();
    both.extend_from_slice(&b);
    assert_eq!(w.block_write(1 << 30, &both).content, Content::Data);
    let parts: Vec<_> = w
        .records()
        .into_iter()
        .filter_map(|r| match r {
            InsightRecord::Write(b) => Some((b.offset, b.len, b.insight.file_offset)),
            _ => None,
        })
        .collect();
    assert_eq!(
        parts,
        vec![
            (1 << 30, 4096, Some(0)),
            ((1 << 30) + 4096, 4096, Some(8192))
        ],
        "one record would say the second block is the file's bytes 4096..8192"
    );
}

#[test]
fn identical_content_of_several_files_is_attributed_by_the_pages_owner() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    let same = content(30, 4096);
    // Two files get the same bytes (one buffer written twice); the index names the latest.
    w.open(100, "app", "/data/a", 3, 0o101);
    let c = w.io_event(100, "app", 3, 0, &same, 0, false);
    w.syscall(&c);
    w.open(100, "app", "/data/b", 4, 0o101);
    let c = w.io_event(100, "app", 4, 8192, &same, 0, false);
    w.syscall(&c);
    let a_page = PageOwner::File {
        inode: INODE + 3 * 0x1000,
        ino: 50,
        offset: 0,
        size: 4096,
        path: Some("/data/a".into()),
    };
    let i = w
        .engine
        .lock()
        .classify_write_owned(0, 0, &same, false, &mut |_| Some(a_page.clone()));
    assert_eq!(
        (i.file.as_deref(), i.file_offset),
        (Some("/data/a"), Some(0)),
        "the block is /data/a's, not the latest writer's"
    );
    // The other copy is /data/b's, now unambiguous; a third identical block whose page is
    // metadata (say a zeroed table) is not called data of either.
    let i = w.block_write(4096, &same);
    assert_eq!(i.file.as_deref(), Some("/data/b"));
    let c = w.io_event(100, "app", 4, 16384, &same, 12288, false);
    w.syscall(&c);
    let c = w.io_event(100, "app", 4, 20480, &same, 16384, false);
    w.syscall(&c);
    let i = w
        .engine
        .lock()
        .classify_write_owned(0, 8192, &same, false, &mut |_| Some(PageOwner::Metadata));
    assert_eq!(i.content, Content::Metadata);
    assert_eq!(w.engine.counters().write_chunks_reattributed, 2);
}

#[test]
fn a_block_read_is_its_pages_files_data_before_and_after_it_goes_down() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    let file = |offset| {
        Some(PageOwner::File {
            inode: 0xffff_8880_0000_a000,
            ino: 77,
            offset,
            size: 3 << 20,
            path: Some("/data/db".into()),
        })
    };
    // Readahead of two page-cache pages of /data/db, a bdev (metadata) page, an O_DIRECT
    // (anonymous) page and a chunk that is not one whole page.
    let owners = vec![
        file(8192),
        file(12288),
        Some(PageOwner::Metadata),
        Some(PageOwner::Anonymous),
        None,
    ];
    let before = w.engine.lock().read_owners_insight(0, &owners);
    assert_eq!(before.content, Content::Mixed);
    assert_eq!(before.block_classes, vec![2, 2, 5, 0, 5], "3 MiB: class 2");
    assert_eq!(before.file.as_deref(), Some("/data/db"));
    assert_eq!(before.file_offset, Some(8192));
    assert_eq!(
        w.engine.counters().reads.len(),
        0,
        "nothing logged or counted yet"
    );
    let data = content(40, 5 * 4096);
    let after = w.engine.lock().classify_read_owned(0, 0, &data, &owners);
    assert_eq!(after, before, "the data changes nothing no syscall showed");
    // The reader's syscall arrives within the window and names the reader.
    w.open(21, "reader", "/data/db", 4, 0);
    w.advance(Duration::from_millis(100));
    let mut c = w.io_event(21, "reader", 4, 8192, &data[..8192], 3 << 20, true);
    c.entry.io.as_mut().unwrap().inode = 0xffff_8880_0000_a000;
    w.syscall(&c);
    w.advance(Duration::from_secs(5));
    let recs = w.records();
    let reads: Vec<(u64, Content, Option<u32>)> = recs
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Read(b) => Some((b.offset, b.insight.content, b.insight.pid)),
            _ => None,
        })
        .collect();
    assert_eq!(
        reads,
        vec![
            (0, Content::Data, Some(21)),
            (8192, Content::Metadata, None),
            (12288, Content::Unknown, None),
            (16384, Content::Metadata, None),
        ]
    );
    let cnt = w.engine.counters();
    assert_eq!(
        (
            cnt.read_chunks_data,
            cnt.read_chunks_by_page,
            cnt.read_chunks_unknown,
            cnt.read_chunks_anonymous,
            cnt.read_chunks_metadata
        ),
        (2, 0, 1, 1, 2),
        "the reader's syscall settled both data chunks"
    );
}

#[test]
fn a_page_owned_read_no_syscall_claims_stays_data_of_its_file() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    let owners = vec![Some(PageOwner::File {
        inode: 0xffff_8880_0000_b000,
        ino: 78,
        offset: 0,
        size: 100 << 20,
        path: Some("/big".into()),
    })];
    // No mount known for disk 0 other than the root: the path is the file system's own.
    w.engine.lock().note_mount("/dev/vda", "/");
    let r = w
        .engine
        .lock()
        .classify_read_owned(0, 0, &content(41, 4096), &owners);
    assert_eq!((r.content, r.class), (Content::Data, 0), "a large file");
    w.advance(Duration::from_secs(5));
    let recs = w.records();
    assert!(
        recs.iter().any(|r| matches!(r, InsightRecord::Read(b)
            if b.insight.content == Content::Data && b.insight.file.as_deref() == Some("/big"))),
        "{recs:?}"
    );
    assert_eq!(w.engine.counters().read_chunks_by_page, 1);
}

#[test]
fn without_a_page_source_unmatched_chunks_stay_metadata_never_unknown() {
    let mut w = world(InsightConfig::default());
    let r = w.block_write(0, &content(42, 8192));
    assert_eq!(r.content, Content::Metadata, "Sky's rule");
    let r = w.block_read(0, &content(43, 8192));
    assert_eq!(r.content, Content::Metadata);
    let cnt = w.engine.counters();
    assert_eq!((cnt.write_chunks_unknown, cnt.read_chunks_unknown), (0, 0));
}

#[test]
fn a_page_owned_read_takes_the_hint_the_files_latest_syscall_carried() {
    use crate::pages::PageOwner;
    let mut w = world(InsightConfig::default());
    w.open(30, "mariadbd", "/db/t.MYD", 5, 2);
    // A hinted read of the file's first chunk (the shim's register convention).
    let first = content(50, 4096);
    let mut c = w.io_event(30, "mariadbd", 5, 0, &first, 1 << 30, true);
    c.entry.args[4] = VMSIGHT_HINT_MAGIC;
    c.entry.args[5] = 4;
    w.syscall(&c);
    // Readahead of a later page of the same inode: no syscall showed it yet.
    let owners = vec![Some(PageOwner::File {
        inode: INODE + 5 * 0x1000,
        ino: 90,
        offset: 1 << 20,
        size: 1 << 30,
        path: Some("/db/t.MYD".into()),
    })];
    let before = w.engine.lock().read_owners_insight(0, &owners);
    assert_eq!(
        (before.content, before.app_class, before.class),
        (Content::Data, Some(4), 4),
        "the file's hint, not its size class (0)"
    );
}
