//! Fuzz entry point of the ext4 and jbd2 parsers as the inference engine sees them
//! (`fuzz/fuzz_targets/ext4_journal.rs` and `tests/fuzz_ext4_journal.rs`; see
//! docs/fuzzing.md).
//!
//! An input is a small disk image and a write stream: the image (sparse: runs of bytes at
//! offsets, zeroes elsewhere) is partition-scanned and crawled, and if the crawl succeeds an
//! [`Engine`] follows the write stream exactly as in a live run (each write lands on the image
//! first, then the engine hears of it), parsing the jbd2 journal, inodes, extent trees and
//! directory blocks it writes. At the end the engine's view is walked. Nothing may panic, loop
//! without bound or grow past the engine's caps.
//!
//! Input layout (decoded by `fuzz/common/input.rs`; missing bytes read as zero):
//!
//! ```text
//! flags u8 (bit 0 strict crawl, bit 1 verify checksums, bit 2 capture data, bit 3 drop data)
//! image KiB u16 (at most MAX_IMAGE_KIB), runs u16, per run: offset u32, bytes (u16 length)
//! then operations until the input ends: kind u8 (0 write: offset u32, bytes (u16 length);
//!   1 discard: offset u32, len u32; 2 flush; 3 tick: seconds u16)
//! ```

use std::sync::{Arc, RwLock};

use crate::block::BlockSource;
use crate::error::{Error, Result};
use crate::{
    read_partitions, CrawlOptions, Engine, EngineConfig, FsEvent, FsRead, Index, MemSource,
};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Largest image an input can describe.
pub const MAX_IMAGE_KIB: u16 = 8192;
/// Longest write of one operation.
pub const MAX_WRITE: usize = 16 << 10;
/// Most operations per input.
const MAX_OPS: usize = 512;
/// Most inodes the final walk visits.
const MAX_WALK: usize = 256;

/// Outcome bits returned by [`ext4_journal`]: the crawl succeeded.
pub const CRAWLED: u32 = 1;
/// The crawl refused the image.
pub const REFUSED: u32 = 2;
/// The engine found and followed a jbd2 journal.
pub const JOURNAL: u32 = 4;
/// The engine applied a journal transaction.
pub const TXN_APPLIED: u32 = 8;
/// The engine emitted file events.
pub const EVENTS: u32 = 16;
/// The engine dropped a malformed transaction or found a bad journal checksum.
pub const JOURNAL_ERROR: u32 = 32;

/// One operation of the write stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// The guest wrote `data` at byte `offset`.
    Write { offset: u32, data: Vec<u8> },
    /// A discard.
    Discard { offset: u32, len: u32 },
    /// A flush.
    Flush,
    /// Time passes (pending writes expire).
    Tick { secs: u16 },
}

/// The disk under the engine: the image, changed by the write stream.
struct Disk(RwLock<Vec<u8>>);

impl Disk {
    fn write(&self, offset: u64, data: &[u8]) {
        let mut img = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(img.len());
        let end = start.saturating_add(data.len()).min(img.len());
        img[start..end].copy_from_slice(&data[..end - start]);
    }
}

impl BlockSource for Disk {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        let img = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let device_len = img.len() as u64;
        let src = usize::try_from(off)
            .ok()
            .and_then(|s| img.get(s..s.checked_add(buf.len())?));
        match src {
            Some(s) => {
                buf.copy_from_slice(s);
                Ok(())
            }
            None => Err(Error::OutOfBounds {
                offset: off,
                len: buf.len() as u64,
                device_len,
            }),
        }
    }

    fn len(&self) -> u64 {
        self.0.read().map_or(0, |img| img.len() as u64)
    }
}

/// Runs one fuzz input; panics if a promise is broken. Returns the outcome bits reached.
pub fn ext4_journal(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let flags = inp.u8();
    let image = decode_image(&mut inp);
    let opts = CrawlOptions {
        strict: flags & 1 != 0,
        no_checksums: flags & 2 == 0,
    };
    let mem = MemSource(image);
    let part = read_partitions(&mem)
        .ok()
        .and_then(|t| t.partitions.first().cloned());
    // The partition scan may find garbage: crawling the whole disk is what matters here.
    let _ = part.map(|p| Index::crawl_with(&mem, Some(&p), &opts));
    let index = match Index::crawl_with(&mem, None, &opts) {
        Ok(index) => index,
        Err(_) => return REFUSED,
    };
    check_index(&index);
    let cfg = EngineConfig {
        capture_data: flags & 4 != 0,
        drop_data: flags & 8 != 0,
        pending_max_bytes: 4 << 20,
        journal_max_bytes: 4 << 20,
        ..EngineConfig::default()
    };
    let disk = Arc::new(Disk(RwLock::new(mem.0)));
    let Ok(mut engine) = Engine::new(disk.clone(), index, cfg) else {
        return CRAWLED | REFUSED;
    };
    let mut seen = CRAWLED;
    if engine.has_journal() {
        seen |= JOURNAL;
    }
    let mut out = Vec::new();
    let mut now = 1_000_000_000u64;
    for _ in 0..MAX_OPS {
        if inp.is_empty() {
            break;
        }
        now += 1_000;
        apply(&mut inp, &disk, &mut engine, &mut now, &mut out);
    }
    engine.flush(now, &mut out);
    let stats = engine.stats();
    assert!(stats.journal_buffered_bytes <= 4 << 20, "journal cap kept");
    if stats.txns_applied > 0 {
        seen |= TXN_APPLIED;
    }
    if stats.journal_errors + stats.journal_csum_errors > 0 {
        seen |= JOURNAL_ERROR;
    }
    if !out.is_empty() {
        seen |= EVENTS;
    }
    walk(&engine);
    seen
}

/// The sparse image: its size, then runs of bytes.
fn decode_image(inp: &mut Input<'_>) -> Vec<u8> {
    let kib = inp.u16().min(MAX_IMAGE_KIB);
    let mut image = vec![0u8; usize::from(kib) * 1024];
    let runs = inp.u16();
    for _ in 0..runs {
        if inp.is_empty() {
            break;
        }
        let at = inp.u32() as usize;
        let bytes = inp.chunk(MAX_WRITE);
        if image.is_empty() {
            continue;
        }
        let at = at % image.len();
        let end = (at + bytes.len()).min(image.len());
        image[at..end].copy_from_slice(&bytes[..end - at]);
    }
    image
}

/// Decodes and applies one operation of the write stream.
fn apply(inp: &mut Input<'_>, disk: &Disk, e: &mut Engine, now: &mut u64, out: &mut Vec<FsEvent>) {
    match inp.u8() % 4 {
        0 => {
            let offset = u64::from(inp.u32());
            let data = inp.chunk(MAX_WRITE);
            disk.write(offset, data);
            e.write(offset, data, *now, out);
        }
        1 => {
            let (offset, len) = (inp.u32(), inp.u32());
            e.discard(u64::from(offset), u64::from(len), *now, out);
        }
        2 => e.flush(*now, out),
        _ => {
            *now += u64::from(inp.u16()) * 1_000_000_000;
            e.tick(*now, out);
        }
    }
    assert!(out.len() < 1 << 20, "events are bounded by the input");
}

/// A crawl's index survives its own serialisation and answers its lookups.
fn check_index(index: &Index) {
    if let Ok(bytes) = index.to_bytes() {
        assert!(Index::from_bytes(&bytes).is_ok(), "an index reloads");
    }
    for ino in index.inodes().take(MAX_WALK) {
        let _ = index.path_of(ino);
        let _ = index.read_dir(ino);
        let _ = index.file_extents(ino);
    }
}

/// Walks the engine's view from the root: directories, links and the first bytes of files.
fn walk(view: &dyn FsRead) {
    let mut todo = vec![2u32];
    let mut visited = std::collections::HashSet::new();
    let mut buf = [0u8; 4096];
    while let Some(ino) = todo.pop() {
        if visited.len() >= MAX_WALK || !visited.insert(ino) {
            continue;
        }
        let _ = view.stat(ino);
        let _ = view.read_link(ino);
        let _ = view.read(ino, 0, &mut buf);
        if let Some(entries) = view.read_dir(ino) {
            for en in entries.iter().take(MAX_WALK) {
                assert!(
                    view.lookup_in(ino, &en.name).is_some(),
                    "listed names resolve"
                );
                todo.push(en.ino);
            }
        }
    }
}

/// Encodes an input: `flags`, `image` as runs of non-zero bytes, then `ops`.
pub fn encode(flags: u8, image: &[u8], ops: &[Op]) -> Vec<u8> {
    let mut o = Output::default();
    let kib = u16::try_from(image.len().div_ceil(1024)).unwrap_or(MAX_IMAGE_KIB);
    let runs = nonzero_runs(image);
    o.u8(flags)
        .u16(kib.min(MAX_IMAGE_KIB))
        .u16(runs.len() as u16);
    for (at, bytes) in runs {
        o.u32(at as u32).chunk(bytes);
    }
    for op in ops {
        match op {
            Op::Write { offset, data } => o.u8(0).u32(*offset).chunk(data),
            Op::Discard { offset, len } => o.u8(1).u32(*offset).u32(*len),
            Op::Flush => o.u8(2),
            Op::Tick { secs } => o.u8(3).u16(*secs),
        };
    }
    o.bytes
}

/// Runs of `image` that are not zero (short zero gaps included), at most 4 KiB each.
fn nonzero_runs(image: &[u8]) -> Vec<(usize, &[u8])> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < image.len() {
        if image[i] == 0 {
            i += 1;
            continue;
        }
        let start = i;
        let mut last = i;
        while i < image.len() && i - start < 4096 && i - last <= 16 {
            if image[i] != 0 {
                last = i;
            }
            i += 1;
        }
        runs.push((start, &image[start..=last]));
        i = last + 1;
    }
    runs
}

/// Splits `bytes` into writes of at most [`MAX_WRITE`] bytes at `offset`.
pub fn writes(offset: u32, bytes: &[u8]) -> Vec<Op> {
    bytes
        .chunks(MAX_WRITE)
        .enumerate()
        .map(|(i, c)| Op::Write {
            offset: offset + (i * MAX_WRITE) as u32,
            data: c.to_vec(),
        })
        .collect()
}
