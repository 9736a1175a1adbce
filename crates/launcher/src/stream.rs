//! File-update streaming for one VM: a write tap on every writable disk, one consumer thread
//! per disk that records the stream and/or feeds the inference engine, and the delivery of the
//! resulting events (docs/filestream.md).
//!
//! ```text
//! disk worker: ... -> WriteTap -> RawFile
//!                        └─ TapQueue ─► consumer thread ─► Recorder (--record-writes)
//!                                                       └► inference engine ─► event sinks
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vmsight_blockdev::tap::{Recorder, TapConfig, TapEvent, TapQueue, TapSnapshot};

/// How long a consumer waits for tap events before doing periodic work (pending-set expiry,
/// overload checks).
const POLL: Duration = Duration::from_millis(200);
/// Most tap events handled in one batch.
const BATCH: usize = 512;

/// Streaming options of `vmsight run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// Copy writes from boot on (`false`: the tap is installed but idle until a live attach).
    pub enabled: bool,
    /// Record the write stream of disk N (0 = root disk) to a file.
    pub record: Vec<(usize, PathBuf)>,
    /// Most payload bytes waiting in one disk's tap queue.
    pub queue_bytes: u64,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            record: Vec::new(),
            queue_bytes: TapConfig::default().max_bytes,
        }
    }
}

/// Parses `N:FILE` of `--record-writes`.
pub fn parse_record_spec(s: &str) -> Result<(usize, PathBuf), String> {
    let (n, file) = s.split_once(':').ok_or_else(|| {
        format!("invalid --record-writes {s:?}: expected DISK:FILE, e.g. 1:/tmp/disk1.rec")
    })?;
    let n: usize = n.parse().map_err(|_| {
        format!("invalid --record-writes {s:?}: {n:?} is not a disk index (0 = root disk)")
    })?;
    if file.is_empty() {
        return Err(format!(
            "invalid --record-writes {s:?}: the file name is empty"
        ));
    }
    Ok((n, PathBuf::from(file)))
}

/// Something that consumes a disk's tap events on the consumer thread.
pub trait TapSink: Send {
    /// Handles a batch, in stream order.
    fn on_batch(&mut self, batch: &[TapEvent]);
    /// Called about every 200 ms and after each batch.
    fn tick(&mut self) {}
    /// The stream ended.
    fn finish(&mut self) {}
}

/// Writes the stream to a recording file.
struct RecordSink {
    rec: Recorder,
    failed: bool,
}

impl TapSink for RecordSink {
    fn on_batch(&mut self, batch: &[TapEvent]) {
        if self.failed {
            return;
        }
        for ev in batch {
            if let Err(e) = self.rec.record(ev) {
                eprintln!("vmsight: write recording stopped: {e}");
                self.failed = true;
                return;
            }
        }
    }

    fn finish(&mut self) {
        if !self.failed {
            if let Err(e) = self.rec.flush() {
                eprintln!("vmsight: write recording incomplete: {e}");
            }
        }
    }
}

/// The tap and consumer of one disk.
pub struct DiskStream {
    /// Disk index (0 = root).
    pub index: usize,
    /// The disk image.
    pub image: PathBuf,
    queue: Arc<TapQueue>,
    consumer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DiskStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStream")
            .field("index", &self.index)
            .field("image", &self.image)
            .finish()
    }
}

impl DiskStream {
    /// A tap queue for disk `index`; the caller installs `WriteTap::new(queue())` in the
    /// disk's pipeline and then calls [`DiskStream::start`].
    pub fn new(index: usize, image: &Path, cfg: &StreamConfig) -> Self {
        let recording = cfg.record.iter().any(|(n, _)| *n == index);
        let queue = TapQueue::new(
            TapConfig {
                max_bytes: cfg.queue_bytes,
            },
            cfg.enabled || recording,
        );
        Self {
            index,
            image: image.to_owned(),
            queue,
            consumer: None,
        }
    }

    /// The queue the disk's tap feeds.
    pub fn queue(&self) -> Arc<TapQueue> {
        self.queue.clone()
    }

    /// Starts the consumer thread with the recorder (if asked for) and `extra` sinks.
    pub fn start(
        &mut self,
        cfg: &StreamConfig,
        mut extra: Vec<Box<dyn TapSink>>,
    ) -> Result<(), String> {
        let mut sinks: Vec<Box<dyn TapSink>> = Vec::new();
        for (n, file) in &cfg.record {
            if *n == self.index {
                let rec = Recorder::create(file).map_err(|e| e.to_string())?;
                sinks.push(Box::new(RecordSink { rec, failed: false }));
            }
        }
        sinks.append(&mut extra);
        let queue = self.queue.clone();
        let handle = std::thread::Builder::new()
            .name(format!("vmsight-stream{}", self.index))
            .spawn(move || consume(&queue, sinks))
            .map_err(|e| format!("cannot start the stream thread: {e}"))?;
        self.consumer = Some(handle);
        Ok(())
    }

    /// Counters of the tap.
    pub fn snapshot(&self) -> TapSnapshot {
        self.queue.snapshot()
    }

    /// Ends the stream after the disk's backend has stopped: drains the queue and joins the
    /// consumer.
    pub fn finish(mut self) -> TapSnapshot {
        self.queue.close();
        if let Some(h) = self.consumer.take() {
            let _ = h.join();
        }
        self.queue.snapshot()
    }
}

fn consume(queue: &TapQueue, mut sinks: Vec<Box<dyn TapSink>>) {
    while let Some(batch) = queue.pop_batch(BATCH, POLL) {
        if !batch.is_empty() {
            for s in sinks.iter_mut() {
                s.on_batch(&batch);
            }
        }
        for s in sinks.iter_mut() {
            s.tick();
        }
    }
    for s in sinks.iter_mut() {
        s.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_spec_parses_and_refuses_garbage() {
        assert_eq!(
            parse_record_spec("1:/tmp/x.rec").expect("valid"),
            (1, PathBuf::from("/tmp/x.rec"))
        );
        assert!(parse_record_spec("x.rec").is_err());
        assert!(parse_record_spec("a:/tmp/x").is_err());
        assert!(parse_record_spec("0:").is_err());
    }

    #[test]
    fn consumer_records_everything_queued_before_finish() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("rec");
        let cfg = StreamConfig {
            record: vec![(0, file.clone())],
            ..StreamConfig::default()
        };
        let mut ds = DiskStream::new(0, Path::new("/dev/null"), &cfg);
        ds.start(&cfg, Vec::new()).expect("starts");
        let q = ds.queue();
        for i in 0..100u64 {
            q.push(vmsight_blockdev::tap::TapKind::Write {
                offset: i * 512,
                len: 4,
                data: Some(vec![i as u8; 4]),
            });
        }
        let snap = ds.finish();
        assert_eq!(snap.events, 100);
        let evs = vmsight_blockdev::tap::read_recording(&file).expect("reads");
        assert_eq!(evs.len(), 100);
        assert_eq!(evs[99].seq, 100);
    }
}
