//! Copies without a user buffer (copy_file_range, sendfile, splice): the source's block
//! reads are hinted through a resolver, the destination's writes match as copied data.

use std::sync::Mutex;

use vmsight_blockdev::insight::DedupHint;

use super::*;
use crate::blocks::{DiskRange, FileBlocks, WHOLE_FILE};

const CFR: u64 = 326;
const SENDFILE: u64 = 40;
const SPLICE: u64 = 275;
const PID: u32 = 50;
/// Where the fake resolver puts `/data/src` on disk 0 (16 KiB long).
const SRC_AT: u64 = 64 << 20;
const SRC_SIZE: u64 = 16384;

/// A resolver that knows a few files, each contiguous on one disk.
#[derive(Default)]
struct FakeBlocks {
    files: Vec<(&'static str, u32, u64, u64)>,
    mounts: Mutex<Vec<(String, String)>>,
    calls: Mutex<Vec<(String, u64, u64)>>,
}

impl FileBlocks for FakeBlocks {
    fn ranges(&self, path: &str, off: u64, len: u64) -> Vec<DiskRange> {
        self.calls.lock().unwrap().push((path.into(), off, len));
        let Some(&(_, disk, at, size)) = self.files.iter().find(|f| f.0 == path) else {
            return Vec::new();
        };
        let end = if len == WHOLE_FILE {
            size
        } else {
            off.saturating_add(len).min(size)
        };
        if off >= end {
            return Vec::new();
        }
        let (s, e) = (off / 4096 * 4096, end.div_ceil(4096) * 4096);
        vec![DiskRange {
            disk,
            bytes: at + s..at + e,
            file_offset: s,
        }]
    }

    fn note_mount(&self, source: &str, target: &str) {
        self.mounts
            .lock()
            .unwrap()
            .push((source.into(), target.into()));
    }
}

fn src_world() -> (World, Arc<FakeBlocks>) {
    let w = world(InsightConfig::default());
    let blocks = Arc::new(FakeBlocks {
        files: vec![("/data/src", 0, SRC_AT, SRC_SIZE)],
        ..FakeBlocks::default()
    });
    assert!(w.engine.set_file_blocks(blocks.clone()));
    assert!(
        !w.engine.set_file_blocks(Arc::new(FakeBlocks::default())),
        "set once"
    );
    (w, blocks)
}

impl World {
    /// A copy call with the values behind its offset pointers, as the plugin captures them.
    fn copy_call(&mut self, nr: u64, args: [u64; 6], ret: i64, offs: &[(u8, u64)]) -> Completed {
        let mut c = self.call(PID, "cp", nr, args, ret);
        for &(arg, v) in offs {
            c.entry.data.push(ArgData {
                arg,
                bytes: v.to_le_bytes().to_vec(),
                ..Default::default()
            });
        }
        c
    }

    fn open_pair(&mut self) {
        self.open(PID, "cp", "/data/src", 3, 0);
        self.open(PID, "cp", "/data/dst", 4, 0o1101);
    }
}

fn is_copy_data(i: &RequestInsight, file: &str) -> bool {
    i.content == Content::Data
        && i.pattern == Some(Pattern::Copy)
        && i.file.as_deref() == Some(file)
        && i.pid == Some(PID)
}

#[test]
fn copy_file_range_with_explicit_offsets_hints_reads_and_expects_the_destination() {
    let (mut w, blocks) = src_world();
    w.open_pair();
    let data = content(40, 16384);
    // copy_file_range(3, [8192], 4, [8192], 8192, 0)
    let c = w.copy_call(
        CFR,
        [3, 0x7f00, 4, 0x7f08, 8192, 0],
        8192,
        &[(1, 8192), (3, 8192)],
    );
    w.engine.on_entry(&c.entry);
    assert_eq!(
        blocks.calls.lock().unwrap().as_slice(),
        &[("/data/src".to_string(), 8192, 8192)]
    );
    // The source's blocks are read while the call runs.
    let r = w.block_read(SRC_AT + 8192, &data[8192..]);
    assert!(is_copy_data(&r, "/data/src"), "{r:?}");
    assert_eq!(r.file_offset, Some(8192));
    assert_eq!(r.dedup_hint(false), DedupHint::Copy);
    // Outside the copied range: metadata as before.
    let out = w.block_read(SRC_AT, &data[..8192]);
    assert_eq!((out.content, out.pattern), (Content::Metadata, None));
    w.engine.on_complete(&c);
    // Explicit offsets: the fd positions do not move.
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(0));
    assert_eq!(w.engine.lock().fd_offset(PID, 4), Some(0));
    // Writeback of the destination, much later: copied data, not metadata.
    w.advance(Duration::from_secs(30));
    let d = w.block_write(200 << 20, &data[8192..]);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    assert_eq!(d.file_offset, Some(8192));
    assert_eq!(d.dedup_hint(true), DedupHint::Copy);
    let n = w.engine.counters();
    assert_eq!(
        (
            n.copy_calls,
            n.copy_ranges_mapped,
            n.copy_ranges_unmapped,
            n.copy_reads,
            n.copy_expected_chunks,
            n.copy_write_chunks
        ),
        (1, 1, 0, 1, 2, 2)
    );
}

#[test]
fn copy_file_range_with_null_offsets_follows_the_fd_positions() {
    let (mut w, blocks) = src_world();
    w.open_pair();
    let data = content(41, 16384);
    // The source position is 4096 after a read(3, .., 4096).
    let rd = w.call(PID, "cp", 0, [3, 0x1000, 4096, 0, 0, 0], 4096);
    w.syscall(&rd);
    // copy_file_range(3, NULL, 4, NULL, huge, 0), as coreutils 9 cp does.
    let c = w.copy_call(CFR, [3, 0, 4, 0, 1 << 62, 0], 12288, &[]);
    w.engine.on_entry(&c.entry);
    assert_eq!(blocks.calls.lock().unwrap()[0].1, 4096);
    let r = w.block_read(SRC_AT + 4096, &data[4096..]);
    assert!(is_copy_data(&r, "/data/src"), "{r:?}");
    assert_eq!(r.file_offset, Some(4096));
    assert_eq!(
        w.block_read(SRC_AT, &data[..4096]).content,
        Content::Metadata
    );
    w.engine.on_complete(&c);
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(16384));
    assert_eq!(w.engine.lock().fd_offset(PID, 4), Some(12288));
    // The end-of-file call that copies nothing is not a copy.
    let eof = w.copy_call(CFR, [3, 0, 4, 0, 1 << 62, 0], 0, &[]);
    w.syscall(&eof);
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(16384));
    // Source byte 4096 went to destination byte 0.
    let d = w.block_write(300 << 20, &data[4096..8192]);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    assert_eq!(d.file_offset, Some(0));
    let n = w.engine.counters();
    assert_eq!((n.copy_calls, n.copy_ranges_mapped), (1, 1));
}

#[test]
fn sendfile_to_a_file_is_followed_and_to_a_socket_is_not() {
    let (mut w, _) = src_world();
    w.open_pair();
    let data = content(42, 16384);
    // sendfile(4, 3, NULL, 16384): the source's and the destination's positions.
    let c = w.copy_call(SENDFILE, [4, 3, 0, 16384, 0, 0], 16384, &[]);
    w.engine.on_entry(&c.entry);
    let r = w.block_read(SRC_AT, &data);
    assert!(is_copy_data(&r, "/data/src"), "{r:?}");
    w.engine.on_complete(&c);
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(16384));
    assert_eq!(w.engine.lock().fd_offset(PID, 4), Some(16384));
    let d = w.block_write(400 << 20, &data);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    // sendfile(9, 3, [0], 4096) to a socket (fd 9 was not opened by path): not a copy, the
    // source position stays (the offset pointer is used).
    let s = w.copy_call(SENDFILE, [9, 3, 0x7f00, 4096, 0, 0], 4096, &[(2, 0)]);
    w.syscall(&s);
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(16384));
    assert_eq!(w.engine.counters().copy_calls, 1);
}

#[test]
fn splice_into_a_pipe_hints_the_source_and_expects_its_chunks() {
    let (mut w, _) = src_world();
    w.open(PID, "cp", "/data/src", 3, 0);
    let data = content(43, 16384);
    // splice(3, [4096], 7 (a pipe), NULL, 8192, 0).
    let c = w.copy_call(SPLICE, [3, 0x7f00, 7, 0, 8192, 0], 8192, &[(1, 4096)]);
    w.engine.on_entry(&c.entry);
    let r = w.block_read(SRC_AT + 4096, &data[4096..12288]);
    assert!(is_copy_data(&r, "/data/src"), "{r:?}");
    w.engine.on_complete(&c);
    assert_eq!(w.engine.lock().fd_offset(PID, 3), Some(0));
    // The chunks come out of the pipe into some file: a copy, file unknown.
    let d = w.block_write(500 << 20, &data[4096..12288]);
    assert_eq!((d.content, d.pattern), (Content::Data, Some(Pattern::Copy)));
    assert_eq!(d.dedup_hint(true), DedupHint::Copy);
}

#[test]
fn copy_ranges_expire_after_the_read_window() {
    let (mut w, _) = src_world();
    w.open_pair();
    let data = content(44, 16384);
    let c = w.copy_call(CFR, [3, 0, 4, 0, 16384, 0], 16384, &[]);
    w.syscall(&c);
    w.advance(Duration::from_secs(3));
    assert!(is_copy_data(
        &w.block_read(SRC_AT, &data[..4096]),
        "/data/src"
    ));
    w.advance(Duration::from_secs(2));
    let late = w.block_read(SRC_AT + 4096, &data[4096..8192]);
    assert_eq!((late.content, late.pattern), (Content::Metadata, None));
}

#[test]
fn unmapped_source_counts_and_changes_nothing() {
    let (mut w, _) = src_world();
    w.open(PID, "cp", "/elsewhere/x", 3, 0);
    w.open(PID, "cp", "/data/dst", 4, 0o1101);
    let c = w.copy_call(CFR, [3, 0, 4, 0, 8192, 0], 8192, &[]);
    w.syscall(&c);
    let data = content(45, 8192);
    assert_eq!(w.block_read(SRC_AT, &data).content, Content::Metadata);
    let n = w.engine.counters();
    assert_eq!(
        (n.copy_calls, n.copy_ranges_mapped, n.copy_ranges_unmapped),
        (1, 0, 1)
    );
    // A copy from an fd the process did not open by path is not followed at all.
    let c = w.copy_call(CFR, [8, 0, 4, 0, 8192, 0], 8192, &[]);
    w.syscall(&c);
    assert_eq!(w.engine.counters().copy_calls, 1);
}

/// Returns every kind of nonsense.
struct Garbage;

impl FileBlocks for Garbage {
    #[allow(clippy::reversed_empty_ranges)]
    fn ranges(&self, _: &str, _: u64, _: u64) -> Vec<DiskRange> {
        let mut v = vec![
            DiskRange {
                disk: 0,
                bytes: 9000..10,
                file_offset: 0,
            },
            DiskRange {
                disk: 0,
                bytes: 0..u64::MAX,
                file_offset: 0,
            },
            DiskRange {
                disk: 0,
                bytes: 4096..8192,
                file_offset: u64::MAX - 10,
            },
            DiskRange {
                disk: 7,
                bytes: 0..4096,
                file_offset: 0,
            },
            DiskRange {
                disk: 0,
                bytes: u64::MAX - 4096..u64::MAX,
                file_offset: 0,
            },
        ];
        // Far more ranges than a call may keep, overlapping.
        v.extend((0..100_000u64).map(|i| DiskRange {
            disk: 0,
            bytes: (1 << 30) + i * 512..(1 << 30) + i * 512 + 8192,
            file_offset: i * 4096,
        }));
        v
    }
}

#[test]
fn a_resolver_returning_garbage_is_harmless() {
    let mut w = world(InsightConfig::default());
    assert!(w.engine.set_file_blocks(Arc::new(Garbage)));
    w.open_pair();
    let c = w.copy_call(CFR, [3, 0, 4, 0, 1 << 20, 0], 1 << 20, &[]);
    w.syscall(&c);
    let data = content(46, 8192);
    // Reads anywhere keep working; the last range (end of the disk) must not overflow.
    for off in [0, 4096, 1 << 30, (1 << 30) + 512, u64::MAX - 8192] {
        let _ = w.block_read(off, &data);
    }
    let mut last = data[..4096].to_vec();
    let _ = w.block_read(u64::MAX - 4096, &last);
    last.truncate(512);
    let _ = w.block_read(u64::MAX - 512, &last);
    // An unrelated file's data write still matches its own syscall.
    w.open(60, "app", "/other", 5, 0o101);
    let x = content(47, 4096);
    let c = w.io_event(60, "app", 5, 0, &x, 0, false);
    w.syscall(&c);
    let i = w.block_write(1 << 40, &x);
    assert_eq!(i.file.as_deref(), Some("/other"));
    assert_eq!(i.pattern, None);
}

#[test]
fn reads_before_the_copy_was_known_are_corrected_in_the_log() {
    let (mut w, _) = src_world();
    w.open_pair();
    let data = content(48, 8192);
    // The block thread is ahead of the trace thread: the read comes first.
    let early = w.block_read(SRC_AT, &data);
    assert_eq!(early.content, Content::Metadata, "nothing known yet");
    w.advance(Duration::from_millis(30));
    let c = w.copy_call(CFR, [3, 0, 4, 0, 8192, 0], 8192, &[]);
    w.syscall(&c);
    // Its chunks are expected in the destination all the same.
    let d = w.block_write(600 << 20, &data);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    assert_eq!(w.engine.counters().copy_reads_late, 1);
    assert_eq!(w.engine.counters().copy_reads, 0);
    let recs = w.records();
    let reads: Vec<_> = recs
        .iter()
        .filter_map(|r| match r {
            InsightRecord::Read(b) => Some(b),
            _ => None,
        })
        .collect();
    assert_eq!(reads.len(), 1);
    assert!(is_copy_data(&reads[0].insight, "/data/src"), "{reads:?}");
}

#[test]
fn without_disk_ranges_known_content_of_the_source_is_hinted() {
    // No resolver: the source was written by a monitored process, so its content is known.
    let mut w = world(InsightConfig::default());
    w.open(PID, "mk", "/data/src", 3, 0o101);
    let data = content(49, 8192);
    let c = w.io_event(PID, "mk", 3, 0, &data, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(700 << 20, &data).content, Content::Data);
    w.open(PID, "cp", "/data/src", 5, 0);
    w.open(PID, "cp", "/data/dst", 4, 0o1101);
    let c = w.copy_call(CFR, [5, 0, 4, 0, 8192, 0], 8192, &[]);
    w.engine.on_entry(&c.entry);
    let r = w.block_read(700 << 20, &data);
    assert!(is_copy_data(&r, "/data/src"), "{r:?}");
    w.engine.on_complete(&c);
    let d = w.block_write(800 << 20, &data);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    let n = w.engine.counters();
    assert_eq!((n.copy_ranges_unmapped, n.copy_expected_chunks), (1, 2));
}

#[test]
fn a_copy_whose_offset_was_not_captured_takes_the_whole_file() {
    let (mut w, blocks) = src_world();
    w.open_pair();
    // The pointer is not NULL but its page was not readable: no value.
    let c = w.copy_call(CFR, [3, 0x7f00, 4, 0x7f08, 4096, 0], 4096, &[]);
    w.syscall(&c);
    assert_eq!(
        blocks.calls.lock().unwrap()[0],
        ("/data/src".to_string(), 0, WHOLE_FILE)
    );
    let data = content(50, 16384);
    assert!(is_copy_data(
        &w.block_read(SRC_AT + 12288, &data[12288..]),
        "/data/src"
    ));
}

#[test]
fn mounts_reach_the_resolver() {
    let (mut w, blocks) = src_world();
    let mut c = w.call(1, "mount", 165, [0x1000, 0x2000, 0x3000, 0, 0, 0], 0);
    for (arg, s) in [(0u8, "/dev/vdb"), (1, "/mnt/dd"), (2, "ext4")] {
        c.entry.data.push(ArgData {
            arg,
            bytes: s.as_bytes().to_vec(),
            ..Default::default()
        });
    }
    w.syscall(&c);
    assert_eq!(
        blocks.mounts.lock().unwrap().as_slice(),
        &[("/dev/vdb".to_string(), "/mnt/dd".to_string())]
    );
}

#[test]
fn a_source_in_the_page_cache_is_expected_in_the_destination_from_what_is_known() {
    // The source was written by a monitored process and written back: its content is known.
    let (mut w, _) = src_world();
    w.open(PID, "mk", "/data/src", 3, 0o101);
    let data = content(51, 16384);
    let c = w.io_event(PID, "mk", 3, 0, &data, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(SRC_AT, &data).content, Content::Data);
    // cp copies bytes 4096.. from the page cache: no block read at all.
    w.open(PID, "cp", "/data/src", 5, 0);
    w.open(PID, "cp", "/data/dst", 4, 0o1101);
    let c = w.copy_call(CFR, [5, 0x7f00, 4, 0, 1 << 30, 0], 12288, &[(1, 4096)]);
    w.syscall(&c);
    assert_eq!(w.engine.counters().copy_expected_chunks, 3);
    let d = w.block_write(900 << 20, &data[4096..]);
    assert!(is_copy_data(&d, "/data/dst"), "{d:?}");
    assert_eq!(d.file_offset, Some(0));
    // Chunk 0 was not copied: not expected.
    assert_eq!(
        w.block_write(901 << 20, &data[..4096]).content,
        Content::Metadata
    );
    assert_eq!(w.engine.counters().copy_write_chunks, 3);
}
