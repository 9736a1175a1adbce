//! The write tap: a pipeline stage that copies every completed guest write into a bounded
//! asynchronous queue for the file-update streaming service (DS-VMI / Gamma-Ray §IV-A), and a
//! recorder/reader of such streams for debugging and tests.
//!
//! ```text
//! guest write -> ... -> WriteTap -> ... -> RawFile      (the guest's request completes here)
//!                          └─ copy (offset, bytes) -> TapQueue -> consumer thread (inference)
//! ```
//!
//! The tap copies a write only after the layers below completed it successfully, so the
//! consumer may assume the image already holds the bytes. It never blocks the guest: when the
//! queued bytes pass the queue's limit, further writes are queued *without their bytes*
//! (`data: None`) and the consumer re-reads them from the image (which holds the newest bytes
//! of those blocks; an event may then describe a later state, never a wrong one). Flushes are
//! passed through as markers: they bound what the guest considers durable.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::pipeline::{Io, Stage, Status};
use crate::request::{Request, RequestKind};

/// What a tapped request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TapKind {
    /// Bytes written at `offset`; `data` is `None` when the queue was over its limit and the
    /// bytes were not copied (the consumer reads them from the image).
    Write {
        /// Byte offset on the disk.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// The written bytes, if copied.
        data: Option<Vec<u8>>,
    },
    /// A discard: the range's contents are no longer needed.
    Discard {
        /// Byte offset on the disk.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A write-zeroes: the range reads back as zeroes.
    WriteZeroes {
        /// Byte offset on the disk.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A completed flush: every earlier write is durable.
    Flush,
}

/// One tapped request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapEvent {
    /// Position in the disk's tap stream, from 1.
    pub seq: u64,
    /// Host wall-clock time (ns since the epoch) when the request completed.
    pub observed_ns: u64,
    /// What happened.
    pub kind: TapKind,
}

impl TapEvent {
    /// Bytes of payload held by this event.
    pub fn payload_bytes(&self) -> u64 {
        match &self.kind {
            TapKind::Write { data: Some(d), .. } => d.len() as u64,
            _ => 0,
        }
    }
}

/// Limits of a tap queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TapConfig {
    /// Most payload bytes held in the queue; writes beyond it are queued without bytes.
    /// Gamma-Ray's default queue was 250 MB.
    pub max_bytes: u64,
}

impl Default for TapConfig {
    fn default() -> Self {
        Self {
            max_bytes: 256 << 20,
        }
    }
}

/// Counters of a tap, readable from any thread.
#[derive(Debug, Default)]
pub struct TapMetrics {
    /// Events queued.
    pub events: AtomicU64,
    /// Payload bytes copied.
    pub bytes: AtomicU64,
    /// Writes queued without their bytes because the queue was full.
    pub writes_without_data: AtomicU64,
    /// Bytes of those writes.
    pub bytes_without_data: AtomicU64,
    /// Writes whose guest buffer could not be read after completion (queued without bytes).
    pub read_errors: AtomicU64,
    /// Highest payload bytes held at once.
    pub peak_queued_bytes: AtomicU64,
}

/// A snapshot of [`TapMetrics`] plus the current queue depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TapSnapshot {
    /// Events queued so far.
    pub events: u64,
    /// Payload bytes copied so far.
    pub bytes: u64,
    /// Writes queued without bytes (overload).
    pub writes_without_data: u64,
    /// Bytes of those writes.
    pub bytes_without_data: u64,
    /// Guest buffers that could not be read.
    pub read_errors: u64,
    /// Highest payload bytes held at once.
    pub peak_queued_bytes: u64,
    /// Events waiting now.
    pub queued_events: u64,
    /// Payload bytes waiting now.
    pub queued_bytes: u64,
}

struct QueueState {
    events: VecDeque<TapEvent>,
    bytes: u64,
    next_seq: u64,
    closed: bool,
}

/// The bounded queue between the tap (producer, on the disk's worker thread) and one consumer.
pub struct TapQueue {
    cfg: TapConfig,
    state: Mutex<QueueState>,
    ready: Condvar,
    metrics: TapMetrics,
    enabled: AtomicBool,
}

impl std::fmt::Debug for TapQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapQueue")
            .field("cfg", &self.cfg)
            .field("enabled", &self.is_enabled())
            .finish()
    }
}

impl TapQueue {
    /// An empty queue; `enabled` says whether the tap copies writes from the start (a live
    /// attach enables it later).
    pub fn new(cfg: TapConfig, enabled: bool) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            state: Mutex::new(QueueState {
                events: VecDeque::new(),
                bytes: 0,
                next_seq: 1,
                closed: false,
            }),
            ready: Condvar::new(),
            metrics: TapMetrics::default(),
            enabled: AtomicBool::new(enabled),
        })
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A panic while holding this lock cannot leave the queue inconsistent (every update is
        // a push or pop plus counters), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts or stops copying writes (stopping does not discard what is queued).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Release);
    }

    /// Whether the tap copies writes now.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Whether a write of `len` bytes would still be copied.
    fn has_room(&self, state: &QueueState, len: u64) -> bool {
        state.bytes.saturating_add(len) <= self.cfg.max_bytes
    }

    /// Queues `kind` (called by the tap). Never blocks on the consumer.
    pub fn push(&self, mut kind: TapKind) {
        let observed_ns = wall_ns();
        let mut st = self.lock();
        if st.closed {
            return;
        }
        if let TapKind::Write { len, data, .. } = &mut kind {
            if data.is_some() && !self.has_room(&st, *len) {
                *data = None;
                self.metrics
                    .writes_without_data
                    .fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .bytes_without_data
                    .fetch_add(*len, Ordering::Relaxed);
            }
        }
        let ev = TapEvent {
            seq: st.next_seq,
            observed_ns,
            kind,
        };
        st.next_seq += 1;
        let b = ev.payload_bytes();
        st.bytes += b;
        self.metrics.events.fetch_add(1, Ordering::Relaxed);
        self.metrics.bytes.fetch_add(b, Ordering::Relaxed);
        self.metrics
            .peak_queued_bytes
            .fetch_max(st.bytes, Ordering::Relaxed);
        st.events.push_back(ev);
        drop(st);
        self.ready.notify_one();
    }

    /// Takes up to `max` events, waiting up to `timeout` for the first one. Returns an empty
    /// vector on timeout, `None` once the queue is closed and drained.
    pub fn pop_batch(&self, max: usize, timeout: Duration) -> Option<Vec<TapEvent>> {
        let mut st = self.lock();
        if st.events.is_empty() && !st.closed {
            st = self
                .ready
                .wait_timeout(st, timeout)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        if st.events.is_empty() {
            return if st.closed { None } else { Some(Vec::new()) };
        }
        let n = st.events.len().min(max.max(1));
        let batch: Vec<TapEvent> = st.events.drain(..n).collect();
        let freed: u64 = batch.iter().map(TapEvent::payload_bytes).sum();
        st.bytes = st.bytes.saturating_sub(freed);
        Some(batch)
    }

    /// Ends the stream: the consumer drains what is queued, then `pop_batch` returns `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Fraction of the byte limit in use now (0.0–1.0+), for overload control.
    pub fn fill_ratio(&self) -> f64 {
        self.fill_ratio_with(0)
    }

    /// Like [`TapQueue::fill_ratio`], counting `taken` bytes the consumer has just taken out
    /// but not processed yet (a batch in hand is still backlog).
    pub fn fill_ratio_with(&self, taken: u64) -> f64 {
        let st = self.lock();
        if self.cfg.max_bytes == 0 {
            return 1.0;
        }
        st.bytes.saturating_add(taken) as f64 / self.cfg.max_bytes as f64
    }

    /// Counters and current depth.
    pub fn snapshot(&self) -> TapSnapshot {
        let (queued_events, queued_bytes) = {
            let st = self.lock();
            (st.events.len() as u64, st.bytes)
        };
        let m = &self.metrics;
        TapSnapshot {
            events: m.events.load(Ordering::Relaxed),
            bytes: m.bytes.load(Ordering::Relaxed),
            writes_without_data: m.writes_without_data.load(Ordering::Relaxed),
            bytes_without_data: m.bytes_without_data.load(Ordering::Relaxed),
            read_errors: m.read_errors.load(Ordering::Relaxed),
            peak_queued_bytes: m.peak_queued_bytes.load(Ordering::Relaxed),
            queued_events,
            queued_bytes,
        }
    }
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The pipeline stage: passes every request down, then copies completed mutations into the
/// queue.
#[derive(Debug)]
pub struct WriteTap {
    queue: Arc<TapQueue>,
}

impl WriteTap {
    /// A tap feeding `queue`.
    pub fn new(queue: Arc<TapQueue>) -> Self {
        Self { queue }
    }
}

impl Stage for WriteTap {
    fn name(&self) -> &str {
        "write-tap"
    }

    fn submit(&self, io: Io) {
        let queue = self.queue.clone();
        io.forward_then(move |io, result| {
            if matches!(result, Ok(Status::Ok)) && queue.is_enabled() {
                record(&queue, io.request());
            }
            io.complete(result);
        });
    }
}

/// Copies one completed mutation into the queue (bytes only while there is room).
fn record(queue: &TapQueue, req: &Request) {
    match req.kind {
        RequestKind::Write => {
            let offset = req.offset();
            let len = req.len;
            let room = {
                let st = queue.lock();
                queue.has_room(&st, len)
            };
            let data = if room {
                let mut buf = vec![0u8; usize::try_from(len).unwrap_or(0)];
                match req.read_data(0, &mut buf) {
                    Ok(()) => Some(buf),
                    Err(_) => {
                        queue.metrics.read_errors.fetch_add(1, Ordering::Relaxed);
                        None
                    }
                }
            } else {
                let m = &queue.metrics;
                m.writes_without_data.fetch_add(1, Ordering::Relaxed);
                m.bytes_without_data.fetch_add(len, Ordering::Relaxed);
                None
            };
            queue.push(TapKind::Write { offset, len, data });
        }
        RequestKind::Discard | RequestKind::WriteZeroes => {
            for r in &req.ranges {
                let (offset, len) = (r.offset(), r.bytes());
                queue.push(if req.kind == RequestKind::Discard {
                    TapKind::Discard { offset, len }
                } else {
                    TapKind::WriteZeroes { offset, len }
                });
            }
        }
        RequestKind::Flush => queue.push(TapKind::Flush),
        RequestKind::Read | RequestKind::GetId => {}
    }
}

/// Magic at the start of a recording file (version 1).
pub const RECORDING_MAGIC: &[u8; 8] = b"VMSWREC1";

/// Errors of reading or writing a recording.
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    /// The file could not be opened, read or written.
    #[error("recording {path}: {source}")]
    Io {
        /// The file.
        path: String,
        #[source]
        source: io::Error,
    },
    /// The file is not a recording or is damaged.
    #[error("recording {path} is not usable: {reason}")]
    Format {
        /// The file.
        path: String,
        /// Sentence saying what is wrong.
        reason: String,
    },
}

const K_WRITE: u8 = 1;
const K_WRITE_NODATA: u8 = 2;
const K_DISCARD: u8 = 3;
const K_ZEROES: u8 = 4;
const K_FLUSH: u8 = 5;
/// Largest write accepted when reading a recording (a guard against damaged length fields;
/// virtio-blk requests are far smaller).
const MAX_RECORDED_WRITE: u64 = 1 << 30;

/// Writes a tap stream to a file.
///
/// Format (little-endian): the 8-byte magic `VMSWREC1`, then one frame per event:
/// `kind: u8` (1 write, 2 write without bytes, 3 discard, 4 write-zeroes, 5 flush),
/// `seq: u64`, `observed_ns: u64`, `offset: u64`, `len: u64`, then `len` bytes for kind 1.
pub struct Recorder {
    out: BufWriter<File>,
    path: String,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("path", &self.path)
            .finish()
    }
}

impl Recorder {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(path: &Path) -> Result<Self, RecordingError> {
        let p = path.display().to_string();
        let io_err = |source| RecordingError::Io {
            path: p.clone(),
            source,
        };
        let mut out = BufWriter::new(File::create(path).map_err(io_err)?);
        out.write_all(RECORDING_MAGIC).map_err(io_err)?;
        Ok(Self { out, path: p })
    }

    /// Appends one event.
    pub fn record(&mut self, ev: &TapEvent) -> Result<(), RecordingError> {
        let (kind, offset, len, data): (u8, u64, u64, Option<&[u8]>) = match &ev.kind {
            TapKind::Write {
                offset,
                data: Some(d),
                ..
            } => (K_WRITE, *offset, d.len() as u64, Some(d.as_slice())),
            TapKind::Write {
                offset,
                len,
                data: None,
            } => (K_WRITE_NODATA, *offset, *len, None),
            TapKind::Discard { offset, len } => (K_DISCARD, *offset, *len, None),
            TapKind::WriteZeroes { offset, len } => (K_ZEROES, *offset, *len, None),
            TapKind::Flush => (K_FLUSH, 0, 0, None),
        };
        let mut frame = [0u8; 33];
        frame[0] = kind;
        frame[1..9].copy_from_slice(&ev.seq.to_le_bytes());
        frame[9..17].copy_from_slice(&ev.observed_ns.to_le_bytes());
        frame[17..25].copy_from_slice(&offset.to_le_bytes());
        frame[25..33].copy_from_slice(&len.to_le_bytes());
        let io_err = |source| RecordingError::Io {
            path: self.path.clone(),
            source,
        };
        self.out.write_all(&frame).map_err(io_err)?;
        if let Some(d) = data {
            self.out.write_all(d).map_err(io_err)?;
        }
        Ok(())
    }

    /// Flushes buffered frames to the file.
    pub fn flush(&mut self) -> Result<(), RecordingError> {
        self.out.flush().map_err(|source| RecordingError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// Reads a recording made by [`Recorder`], one event at a time.
pub struct RecordingReader {
    input: BufReader<File>,
    path: String,
}

impl std::fmt::Debug for RecordingReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingReader")
            .field("path", &self.path)
            .finish()
    }
}

impl RecordingReader {
    /// Opens `path` and checks the header.
    pub fn open(path: &Path) -> Result<Self, RecordingError> {
        let p = path.display().to_string();
        let file = File::open(path).map_err(|source| RecordingError::Io {
            path: p.clone(),
            source,
        })?;
        let mut input = BufReader::new(file);
        let mut magic = [0u8; 8];
        input
            .read_exact(&mut magic)
            .map_err(|_| RecordingError::Format {
                path: p.clone(),
                reason: "it is shorter than the 8-byte header".into(),
            })?;
        if &magic != RECORDING_MAGIC {
            return Err(RecordingError::Format {
                path: p,
                reason: "the header is not VMSWREC1 (not a vmsight write recording)".into(),
            });
        }
        Ok(Self { input, path: p })
    }

    /// The next event, `Ok(None)` at a clean end of file.
    pub fn next_event(&mut self) -> Result<Option<TapEvent>, RecordingError> {
        let mut frame = [0u8; 33];
        let mut got = 0;
        while got < frame.len() {
            match self.input.read(&mut frame[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(RecordingError::Io {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        }
        if got == 0 {
            return Ok(None);
        }
        let bad = |reason: String| RecordingError::Format {
            path: self.path.clone(),
            reason,
        };
        if got < frame.len() {
            return Err(bad(format!(
                "it ends inside a frame header ({got} of 33 bytes)"
            )));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&frame[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let (seq, observed_ns, offset, len) = (word(1), word(9), word(17), word(25));
        let kind = match frame[0] {
            K_WRITE => {
                if len > MAX_RECORDED_WRITE {
                    return Err(bad(format!(
                        "frame {seq} claims a {len}-byte write (damaged length field)"
                    )));
                }
                // Read through `take`: the buffer grows with what the file really holds, so a
                // damaged length in a short file costs nothing before the read fails.
                let mut data = Vec::new();
                let got = (&mut self.input)
                    .take(len)
                    .read_to_end(&mut data)
                    .map_err(|_| bad(format!("it ends inside the data of frame {seq}")))?;
                if got as u64 != len {
                    return Err(bad(format!("it ends inside the data of frame {seq}")));
                }
                TapKind::Write {
                    offset,
                    len,
                    data: Some(data),
                }
            }
            K_WRITE_NODATA => TapKind::Write {
                offset,
                len,
                data: None,
            },
            K_DISCARD => TapKind::Discard { offset, len },
            K_ZEROES => TapKind::WriteZeroes { offset, len },
            K_FLUSH => TapKind::Flush,
            k => return Err(bad(format!("frame {seq} has unknown kind {k}"))),
        };
        Ok(Some(TapEvent {
            seq,
            observed_ns,
            kind,
        }))
    }
}

/// Reads a whole recording into memory.
pub fn read_recording(path: &Path) -> Result<Vec<TapEvent>, RecordingError> {
    let mut r = RecordingReader::open(path)?;
    let mut out = Vec::new();
    while let Some(ev) = r.next_event()? {
        out.push(ev);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Pipeline, StageError, Terminal};
    use crate::request::Segment;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    struct Sink;
    impl Terminal for Sink {
        fn name(&self) -> &str {
            "sink"
        }
        fn execute(&mut self, _req: &mut Request) -> Result<Status, StageError> {
            Ok(Status::Ok)
        }
    }

    struct Fail;
    impl Terminal for Fail {
        fn name(&self) -> &str {
            "fail"
        }
        fn execute(&mut self, _req: &mut Request) -> Result<Status, StageError> {
            Ok(Status::IoErr)
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory")
    }

    fn write_req(m: &GuestMemoryMmap, sector: u64, bytes: &[u8]) -> Request {
        m.write_slice(bytes, GuestAddress(0x1000)).expect("fill");
        Request::new_for_test(
            m,
            RequestKind::Write,
            sector,
            vec![Segment {
                addr: GuestAddress(0x1000),
                len: bytes.len() as u32,
            }],
        )
    }

    #[test]
    fn completed_write_is_copied_with_offset_and_bytes() {
        let m = mem();
        let q = TapQueue::new(TapConfig::default(), true);
        let mut p = Pipeline::new(Box::new(Sink));
        p.push(Box::new(WriteTap::new(q.clone()))).expect("push");
        let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
        let mut r = write_req(&m, 8, &data);
        assert_eq!(p.run(&mut r).expect("runs"), Status::Ok);
        let batch = q.pop_batch(10, Duration::ZERO).expect("open");
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].seq, 1);
        assert_eq!(
            batch[0].kind,
            TapKind::Write {
                offset: 8 * 512,
                len: 1024,
                data: Some(data)
            }
        );
    }

    #[test]
    fn failed_write_is_not_tapped() {
        let m = mem();
        let q = TapQueue::new(TapConfig::default(), true);
        let mut p = Pipeline::new(Box::new(Fail));
        p.push(Box::new(WriteTap::new(q.clone()))).expect("push");
        let mut r = write_req(&m, 0, &[1u8; 512]);
        assert_eq!(p.run(&mut r).expect("runs"), Status::IoErr);
        assert!(q.pop_batch(10, Duration::ZERO).expect("open").is_empty());
    }

    #[test]
    fn disabled_tap_copies_nothing_until_enabled() {
        let m = mem();
        let q = TapQueue::new(TapConfig::default(), false);
        let mut p = Pipeline::new(Box::new(Sink));
        p.push(Box::new(WriteTap::new(q.clone()))).expect("push");
        let mut r = write_req(&m, 0, &[1u8; 512]);
        p.run(&mut r).expect("runs");
        assert!(q.pop_batch(10, Duration::ZERO).expect("open").is_empty());
        q.set_enabled(true);
        let mut r = write_req(&m, 1, &[2u8; 512]);
        p.run(&mut r).expect("runs");
        assert_eq!(q.pop_batch(10, Duration::ZERO).expect("open").len(), 1);
    }

    #[test]
    fn over_limit_writes_are_queued_without_bytes_and_counted() {
        let m = mem();
        let q = TapQueue::new(TapConfig { max_bytes: 1024 }, true);
        let mut p = Pipeline::new(Box::new(Sink));
        p.push(Box::new(WriteTap::new(q.clone()))).expect("push");
        for s in 0..3 {
            let mut r = write_req(&m, s, &[s as u8; 512]);
            p.run(&mut r).expect("runs");
        }
        let batch = q.pop_batch(10, Duration::ZERO).expect("open");
        let with_data = batch
            .iter()
            .filter(|e| matches!(e.kind, TapKind::Write { data: Some(_), .. }))
            .count();
        assert_eq!(with_data, 2);
        assert!(matches!(
            batch[2].kind,
            TapKind::Write {
                offset: 1024,
                len: 512,
                data: None
            }
        ));
        let s = q.snapshot();
        assert_eq!(s.writes_without_data, 1);
        assert_eq!(s.bytes_without_data, 512);
        assert_eq!(s.queued_bytes, 0);
    }

    #[test]
    fn close_drains_then_ends() {
        let q = TapQueue::new(TapConfig::default(), true);
        q.push(TapKind::Flush);
        q.close();
        assert_eq!(q.pop_batch(10, Duration::ZERO).expect("drains").len(), 1);
        assert!(q.pop_batch(10, Duration::ZERO).is_none());
        q.push(TapKind::Flush);
        assert!(
            q.pop_batch(10, Duration::ZERO).is_none(),
            "closed queue takes nothing"
        );
    }

    #[test]
    fn recording_round_trips_every_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rec");
        let events = vec![
            TapEvent {
                seq: 1,
                observed_ns: 10,
                kind: TapKind::Write {
                    offset: 4096,
                    len: 3,
                    data: Some(vec![1, 2, 3]),
                },
            },
            TapEvent {
                seq: 2,
                observed_ns: 11,
                kind: TapKind::Write {
                    offset: 0,
                    len: 512,
                    data: None,
                },
            },
            TapEvent {
                seq: 3,
                observed_ns: 12,
                kind: TapKind::Discard {
                    offset: 512,
                    len: 1024,
                },
            },
            TapEvent {
                seq: 4,
                observed_ns: 13,
                kind: TapKind::WriteZeroes {
                    offset: 0,
                    len: 4096,
                },
            },
            TapEvent {
                seq: 5,
                observed_ns: 14,
                kind: TapKind::Flush,
            },
        ];
        let mut rec = Recorder::create(&path).expect("create");
        for e in &events {
            rec.record(e).expect("record");
        }
        rec.flush().expect("flush");
        assert_eq!(read_recording(&path).expect("read"), events);
    }

    #[test]
    fn damaged_recordings_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rec");
        std::fs::write(&path, b"NOTAREC!").expect("write");
        let e = read_recording(&path).expect_err("bad magic");
        assert!(
            e.to_string().contains("not a vmsight write recording"),
            "{e}"
        );

        let mut bytes = RECORDING_MAGIC.to_vec();
        bytes.push(K_WRITE);
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&100u64.to_le_bytes());
        bytes.extend_from_slice(&[0u8; 10]);
        std::fs::write(&path, &bytes).expect("write");
        let e = read_recording(&path).expect_err("truncated data");
        assert!(e.to_string().contains("ends inside the data"), "{e}");

        bytes.truncate(8 + 5);
        std::fs::write(&path, &bytes).expect("write");
        let e = read_recording(&path).expect_err("truncated header");
        assert!(e.to_string().contains("inside a frame header"), "{e}");
    }
}
