//! File-update streaming for one VM: a write tap on every writable disk, one consumer thread
//! per disk that records the stream and/or feeds the inference engine, and the delivery of the
//! resulting events (docs/filestream.md).
//!
//! ```text
//! pipeline: ... -> WriteTap -> [disk-model] -> raw file (I/O threads)
//!                    └─ completion hook: TapQueue ─► consumer thread ─► Recorder (--record-writes)
//!                                                                    └► inference engine ─► event sinks
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use vmsight_blockdev::tap::{
    Recorder, RecordingError, TapConfig, TapEvent, TapKind, TapQueue, TapSnapshot,
};
use vmsight_events::{Addresser, EventBus, RedisPublisher};
use vmsight_fsview::{Engine, EngineConfig, FsEvent, FsRead, Index, LazyConfig};

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
    /// Also write every event as a JSON line to this file (`--events FILE`).
    pub events_file: Option<PathBuf>,
    /// Publish every event to Redis (`--redis URL`).
    pub redis: Option<String>,
    /// Put the written bytes into `write` events (file output and Redis).
    pub data: bool,
    /// Host part of event channels (`$VMSIGHT_HOST` or the host name by default).
    pub host: String,
    /// Keep each disk's index lazily (`--stream-lazy`): only the block map stays in memory,
    /// the rest is read from a section file when writes touch it (docs/filestream.md).
    pub lazy: bool,
    /// Most bytes of loaded index sections per disk (`--stream-lazy-cache-mb`).
    pub lazy_cache_bytes: u64,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            record: Vec::new(),
            queue_bytes: TapConfig::default().max_bytes,
            events_file: None,
            redis: None,
            data: false,
            host: vmsight_events::host_name(),
            lazy: false,
            lazy_cache_bytes: LazyConfig::default().max_bytes,
        }
    }
}

/// Where and how one disk's index is kept lazily.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyPlan {
    /// The section file (private; its name is removed once it is open).
    pub file: PathBuf,
    /// Cache bounds.
    pub cfg: LazyConfig,
}

impl LazyPlan {
    /// The plan of disk `disk` of VM `vm` with `--stream-lazy`: the section file goes to the
    /// VM's directory in the cache (`<cache>/vms/<vm>/disk<N>.fsidx`, on disk: the runtime
    /// directory is a tmpfs, whose pages would be memory again).
    pub fn for_disk(cfg: &StreamConfig, vm: &str, disk: usize) -> Option<LazyPlan> {
        if !cfg.lazy {
            return None;
        }
        let dir = match vmsight_image::cache_dir() {
            Ok(c) => c.join("vms").join(vm),
            Err(e) => {
                tracing::warn!(
                    "--stream-lazy: no cache directory ({e}); disk {disk} is indexed in memory"
                );
                return None;
            }
        };
        Some(LazyPlan {
            file: dir.join(format!("disk{disk}.fsidx")),
            cfg: LazyConfig {
                max_bytes: cfg.lazy_cache_bytes,
                unlink: true,
                ..LazyConfig::default()
            },
        })
    }
}

/// Why an `N:FILE` of `--record-writes` does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordSpecError {
    /// No colon.
    #[error("invalid --record-writes {0:?}: expected DISK:FILE, e.g. 1:/tmp/disk1.rec")]
    Form(String),
    /// The part before the colon is not a number.
    #[error("invalid --record-writes {spec:?}: {disk:?} is not a disk index (0 = root disk)")]
    Disk {
        /// The whole argument.
        spec: String,
        /// Its disk part.
        disk: String,
    },
    /// Nothing after the colon.
    #[error("invalid --record-writes {0:?}: the file name is empty")]
    NoFile(String),
}

/// Parses `N:FILE` of `--record-writes`.
pub fn parse_record_spec(s: &str) -> Result<(usize, PathBuf), RecordSpecError> {
    let (n, file) = s
        .split_once(':')
        .ok_or_else(|| RecordSpecError::Form(s.into()))?;
    let n: usize = n.parse().map_err(|_| RecordSpecError::Disk {
        spec: s.into(),
        disk: n.into(),
    })?;
    if file.is_empty() {
        return Err(RecordSpecError::NoFile(s.into()));
    }
    Ok((n, PathBuf::from(file)))
}

/// Why a disk's stream consumer could not start.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The write recording (`--record-writes`) could not be created.
    #[error(transparent)]
    Record(#[from] RecordingError),
    /// The consumer thread could not be started.
    #[error("cannot start the stream thread of disk {disk}: {source}")]
    Thread {
        /// Disk index.
        disk: usize,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Why the event outputs could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// The embedded bus (`events.sock`).
    #[error(transparent)]
    Bus(#[from] vmsight_events::BusError),
    /// Redis (`--redis`).
    #[error(transparent)]
    Redis(#[from] vmsight_events::RedisError),
    /// The events file (`--events`).
    #[error("cannot create the events file {path}: {source}")]
    EventsFile {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Why `vmsight replay` failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The scratch directory could not be created.
    #[error("cannot create a scratch directory: {0}")]
    Scratch(#[source] std::io::Error),
    /// The base image could not be copied.
    #[error("cannot copy {base} to a scratch image: {source}")]
    Copy {
        /// The base image.
        base: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The scratch image has no usable file system.
    #[error(transparent)]
    Crawl(#[from] vmsight_fsview::Error),
    /// The recording cannot be read.
    #[error(transparent)]
    Recording(#[from] RecordingError),
    /// Writing to the scratch image failed.
    #[error("cannot apply the recording to the scratch image: {0}")]
    Apply(#[source] std::io::Error),
    /// A frame of the recording cannot be read (truncated, unknown kind, damaged length).
    #[error("frame {frame} of the recording: {source}")]
    Damaged {
        /// Position of the frame in the file, from 1.
        frame: u64,
        /// What the reader found (it names the file).
        #[source]
        source: RecordingError,
    },
    /// A write was recorded without its bytes.
    #[error(
        "recording {}: frame {frame} (event {seq}) has no bytes (the tap queue was full); it \
         cannot be replayed",
        recording.display()
    )]
    NoBytes {
        /// The recording.
        recording: PathBuf,
        /// Position of the frame in the file, from 1.
        frame: u64,
        /// The event's sequence number.
        seq: u64,
    },
    /// An event reaches beyond the base image (a damaged recording, or another image's).
    #[error(
        "recording {}: frame {frame} (event {seq}) covers bytes {offset}..{end} of a {size}-byte \
         base image (a damaged recording, or one of another image)",
        recording.display()
    )]
    BeyondImage {
        /// The recording.
        recording: PathBuf,
        /// Position of the frame in the file, from 1.
        frame: u64,
        /// The event's sequence number.
        seq: u64,
        /// Its range.
        offset: u64,
        /// End of its range (saturated).
        end: u64,
        /// Size of the base image.
        size: u64,
    },
    /// Writing the events failed.
    #[error("cannot write the events: {0}")]
    Output(#[source] std::io::Error),
}

/// Where a replayed event comes from: the recording and the frame's position in it.
struct Frame<'a> {
    recording: &'a Path,
    frame: u64,
    seq: u64,
}

impl Frame<'_> {
    /// Refuses an event whose range `offset..offset + len` is not inside an image of `size`
    /// bytes: a recording is file input, and a damaged length must not make the replay write
    /// or loop for ever.
    fn within_image(&self, offset: u64, len: u64, size: u64) -> Result<(), ReplayError> {
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            end => Err(ReplayError::BeyondImage {
                recording: self.recording.to_owned(),
                frame: self.frame,
                seq: self.seq,
                offset,
                end: end.unwrap_or(u64::MAX),
                size,
            }),
        }
    }

    /// The error of a write recorded without its bytes.
    fn no_bytes(&self) -> ReplayError {
        ReplayError::NoBytes {
            recording: self.recording.to_owned(),
            frame: self.frame,
            seq: self.seq,
        }
    }
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
    /// The disk's inference engine (empty until crawled).
    pub slot: Arc<RwLock<EngineSlot>>,
    /// Set to ask the consumer to crawl and start inferring (live attach).
    pub attach: Arc<AtomicBool>,
    /// Inference counters.
    pub infer: Arc<Mutex<InferStats>>,
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
            slot: Arc::default(),
            attach: Arc::default(),
            infer: Arc::default(),
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
    ) -> Result<(), StreamError> {
        let mut sinks: Vec<Box<dyn TapSink>> = Vec::new();
        for (n, file) in &cfg.record {
            if *n == self.index {
                let rec = Recorder::create(file)?;
                sinks.push(Box::new(RecordSink { rec, failed: false }));
            }
        }
        sinks.append(&mut extra);
        let queue = self.queue.clone();
        let handle = std::thread::Builder::new()
            .name(format!("vmsight-stream{}", self.index))
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                consume(&queue, sinks)
            })
            .map_err(|source| StreamError::Thread {
                disk: self.index,
                source,
            })?;
        self.consumer = Some(handle);
        Ok(())
    }

    /// Counters of the tap.
    pub fn snapshot(&self) -> TapSnapshot {
        self.queue.snapshot()
    }

    /// Ends the stream after the disk's backend has stopped: drains the queue and joins the
    /// consumer.
    pub fn finish(mut self) -> (TapSnapshot, Option<InferStats>) {
        self.queue.close();
        if let Some(h) = self.consumer.take() {
            let _ = h.join();
        }
        let ready = self.slot.read().map(|s| s.0.is_some()).unwrap_or(false);
        let infer = if ready {
            self.infer.lock().ok().map(|s| s.clone())
        } else {
            None
        };
        (self.queue.snapshot(), infer)
    }

    /// Starts streaming on a disk whose tap was idle (live attach): the tap queues writes from
    /// now on and the consumer crawls the image, then replays and follows them.
    pub fn attach_live(&self) -> bool {
        let ready = self.slot.read().map(|s| s.0.is_some()).unwrap_or(false);
        if ready {
            return false;
        }
        self.queue.set_enabled(true);
        self.attach.store(true, Ordering::Release);
        true
    }

    /// Whether the disk's engine is running.
    pub fn is_streaming(&self) -> bool {
        self.slot.read().map(|s| s.0.is_some()).unwrap_or(false)
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
    use vmsight_blockdev::tap::{Recorder, TapEvent, TapKind};

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
        let (snap, _) = ds.finish();
        assert_eq!(snap.events, 100);
        let evs = vmsight_blockdev::tap::read_recording(&file).expect("reads");
        assert_eq!(evs.len(), 100);
        assert_eq!(evs[99].seq, 100);
    }

    const BASE_SIZE: u64 = 8 << 20;

    /// A fresh 8 MiB ext4 image in `dir`.
    fn base_image(dir: &Path) -> PathBuf {
        let base = dir.join("base.img");
        std::fs::File::create(&base)
            .and_then(|f| f.set_len(BASE_SIZE))
            .expect("image");
        let ok = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&base)
            .status()
            .expect("mkfs.ext4 must be installed");
        assert!(ok.success());
        base
    }

    /// Records `kinds` (sequence numbers from 1) to `dir/r.rec`.
    fn recording(dir: &Path, kinds: Vec<TapKind>) -> PathBuf {
        let rec = dir.join("r.rec");
        let mut r = Recorder::create(&rec).expect("recorder");
        for (i, kind) in kinds.into_iter().enumerate() {
            let ev = TapEvent {
                seq: i as u64 + 1,
                observed_ns: 0,
                kind,
            };
            r.record(&ev).expect("records");
        }
        r.flush().expect("flushes");
        rec
    }

    /// Replays a recording of `kinds` over a fresh base image; also returns the recording.
    fn replay_kinds(kinds: Vec<TapKind>) -> (Result<ReplayStats, ReplayError>, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = base_image(dir.path());
        let rec = recording(dir.path(), kinds);
        let r = replay(&base, &rec, "", false, &mut std::io::sink());
        (r, rec)
    }

    /// Events inside the base image: a write, a write-zeroes, a discard and a flush.
    fn in_range_events() -> Vec<TapKind> {
        vec![
            TapKind::Write {
                offset: 1 << 20,
                len: 4096,
                data: Some(vec![0x5a; 4096]),
            },
            TapKind::WriteZeroes {
                offset: (1 << 20) + 4096,
                len: 8192,
            },
            TapKind::Discard {
                offset: BASE_SIZE - 4096,
                len: 4096,
            },
            TapKind::Flush,
        ]
    }

    #[test]
    fn a_recorded_range_beyond_the_base_image_is_refused_naming_the_recording_and_frame() {
        for bad in [
            TapKind::Discard {
                offset: 4096,
                len: u64::MAX - 100,
            },
            TapKind::WriteZeroes {
                offset: BASE_SIZE,
                len: 4096,
            },
            TapKind::WriteZeroes {
                offset: 4096,
                len: BASE_SIZE,
            },
            TapKind::Write {
                offset: BASE_SIZE - 512,
                len: 1024,
                data: Some(vec![7; 1024]),
            },
        ] {
            let what = format!("{bad:?}");
            // Two good events first: the damaged one is the third frame.
            let mut kinds = in_range_events()[..2].to_vec();
            kinds.push(bad);
            match replay_kinds(kinds) {
                (Err(e @ ReplayError::BeyondImage { frame: 3, .. }), rec) => {
                    let msg = e.to_string();
                    assert!(msg.contains(&rec.display().to_string()), "{msg}");
                    assert!(msg.contains("frame 3 (event 3)"), "{msg}");
                    assert!(msg.contains("damaged recording"), "{msg}");
                }
                (other, _) => panic!("{what}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_recording_cut_inside_a_frame_is_refused_naming_the_recording_and_frame() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = base_image(dir.path());
        let rec = recording(dir.path(), in_range_events());
        let bytes = std::fs::read(&rec).expect("read");
        // Cut inside the first write's data, then inside the second frame's header.
        for cut in [8 + 33 + 100, 8 + 33 + 4096 + 10] {
            std::fs::write(&rec, &bytes[..cut]).expect("cut");
            match replay(&base, &rec, "", false, &mut std::io::sink()) {
                Err(e @ ReplayError::Damaged { .. }) => {
                    let msg = e.to_string();
                    let frame = if cut < 8 + 33 + 4096 { 1 } else { 2 };
                    assert!(msg.contains(&format!("frame {frame} of")), "{msg}");
                    assert!(msg.contains(&rec.display().to_string()), "{msg}");
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_write_recorded_without_bytes_is_refused_naming_the_recording() {
        let (r, rec) = replay_kinds(vec![TapKind::Write {
            offset: 0,
            len: 4096,
            data: None,
        }]);
        match r {
            Err(e @ ReplayError::NoBytes { frame: 1, .. }) => {
                assert!(e.to_string().contains(&rec.display().to_string()), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_undamaged_recording_inside_the_image_replays_every_event() {
        let events = in_range_events();
        let n = events.len() as u64;
        let (r, _) = replay_kinds(events);
        let s = r.expect("an in-range recording replays");
        assert_eq!(s.tap_events, n);
    }

    /// An ext4 image of a few files (mkfs.ext4 -d).
    fn small_ext4(dir: &Path) -> PathBuf {
        let tree = dir.join("tree");
        std::fs::create_dir_all(tree.join("d")).expect("mkdir");
        for k in 0..50 {
            std::fs::write(tree.join(format!("d/f{k}")), b"x").expect("write");
        }
        let img = dir.join("fs.img");
        let st = std::process::Command::new("mkfs.ext4")
            .args(["-F", "-q", "-d"])
            .arg(&tree)
            .arg(&img)
            .arg("16M")
            .status()
            .unwrap_or_else(|e| panic!("mkfs.ext4 could not be run ({e}); install e2fsprogs"));
        assert!(st.success());
        img
    }

    #[test]
    fn a_lazy_plan_gives_an_engine_on_a_private_unlinked_section_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = small_ext4(dir.path());
        let cfg = StreamConfig {
            lazy: true,
            lazy_cache_bytes: 1 << 20,
            ..StreamConfig::default()
        };
        let mut plan = LazyPlan::for_disk(&cfg, "vm", 1).expect("a plan with --stream-lazy");
        assert!(plan.file.ends_with("vms/vm/disk1.fsidx"), "{plan:?}");
        assert_eq!(plan.cfg.max_bytes, 1 << 20);
        assert!(LazyPlan::for_disk(&StreamConfig::default(), "vm", 1).is_none());
        plan.file = dir.path().join("cache/vms/vm/disk1.fsidx");
        // A stale file of a killed run is replaced.
        std::fs::create_dir_all(plan.file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&plan.file, b"stale").expect("stale");
        let engine = make_engine(&img, false, Some(&plan)).expect("engine");
        assert!(engine.index().is_lazy());
        assert!(!plan.file.exists(), "the name is removed once open");
        let st = engine.counters().index;
        assert!(st.lazy && st.resident_bytes > 0, "{st:?}");
        let f = engine
            .lookup("/d/f7")
            .expect("found through the section file");
        assert_eq!(engine.stat(f).map(|m| m.size), Some(1));
        let again = engine.counters().index;
        assert!(again.lazy && again.sections_loaded > 0, "{again:?}");
        assert_eq!(again.inodes, st.inodes);
    }

    #[test]
    fn an_unwritable_section_file_leaves_the_index_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = small_ext4(dir.path());
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, b"").expect("file");
        let plan = LazyPlan {
            file: blocker.join("disk0.fsidx"),
            cfg: LazyConfig::default(),
        };
        let engine = make_engine(&img, false, Some(&plan)).expect("engine");
        assert!(!engine.index().is_lazy());
        assert!(engine.lookup("/d/f7").is_some());
    }
}

// ---------------------------------------------------------------------------------------------
// Inference and delivery.

/// Where a VM's file events go: the embedded bus (`vmsight watch`), Redis, a JSON-lines file.
pub struct Delivery {
    addr: Addresser,
    bus: Option<EventBus>,
    redis: Option<RedisPublisher>,
    file: Option<Mutex<BufWriter<File>>>,
    /// Put written bytes into the file output (the bus and Redis decide per subscriber/config).
    file_data: bool,
    delivered: AtomicU64,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("bus", &self.bus.is_some())
            .field("redis", &self.redis.is_some())
            .field("file", &self.file.is_some())
            .finish()
    }
}

impl Delivery {
    /// Opens the outputs: the bus socket at `bus_socket`, Redis at `redis` (fails now on a bad
    /// URL or password), the events file.
    pub fn open(
        host: String,
        vm: &str,
        bus_socket: Option<&Path>,
        redis: Option<&str>,
        file: Option<&Path>,
        data: bool,
    ) -> Result<Self, DeliveryError> {
        let bus = match bus_socket {
            Some(p) => Some(EventBus::bind(p)?),
            None => None,
        };
        let redis = match redis {
            Some(url) => Some(RedisPublisher::connect_with(
                url,
                vmsight_events::DEFAULT_REDIS_QUEUE,
                data,
            )?),
            None => None,
        };
        let file = match file {
            Some(p) => Some(Mutex::new(BufWriter::new(File::create(p).map_err(
                |source| DeliveryError::EventsFile {
                    path: p.into(),
                    source,
                },
            )?))),
            None => None,
        };
        Ok(Self {
            addr: Addresser::new(host, vm),
            bus,
            redis,
            file,
            file_data: data,
            delivered: AtomicU64::new(0),
        })
    }

    /// Numbers `ev` and hands it to every output.
    pub fn deliver(&self, ev: FsEvent) {
        let m = self.addr.wrap(ev);
        if let Some(b) = &self.bus {
            b.publish(&m);
        }
        if let Some(r) = &self.redis {
            r.publish(&m);
        }
        if let Some(f) = &self.file {
            if let Ok(mut f) = f.lock() {
                let _ = writeln!(f, "{}", m.to_json(self.file_data));
            }
        }
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }

    /// Pushes buffered output out (the events file; Redis up to a short timeout).
    pub fn flush(&self) {
        if let Some(f) = &self.file {
            if let Ok(mut f) = f.lock() {
                let _ = f.flush();
            }
        }
        if let Some(r) = &self.redis {
            r.flush(Duration::from_secs(2));
        }
    }

    /// Events delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }
}

/// The inference engine of one disk, once its file system has been crawled. The view server
/// reads it between batches.
#[derive(Default)]
pub struct EngineSlot(pub Option<Engine>);

impl std::fmt::Debug for EngineSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSlot")
            .field("ready", &self.0.is_some())
            .finish()
    }
}

impl FsRead for EngineSlot {
    fn stat(&self, ino: u32) -> Option<vmsight_fsview::InodeMeta> {
        self.0.as_ref()?.stat(ino)
    }
    fn read_dir(&self, ino: u32) -> Option<Vec<vmsight_fsview::ViewEntry>> {
        self.0.as_ref()?.read_dir(ino)
    }
    fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
        self.0.as_ref()?.lookup_in(dir, name)
    }
    fn read_link(&self, ino: u32) -> Option<Vec<u8>> {
        self.0.as_ref()?.read_link(ino)
    }
    fn read(&self, ino: u32, offset: u64, buf: &mut [u8]) -> vmsight_fsview::Result<usize> {
        match &self.0 {
            Some(e) => e.read(ino, offset, buf),
            None => Ok(0),
        }
    }
}

/// Crawls the ext2/3/4 file system on `image` (first partition, or the whole disk) and makes
/// an engine for it; with a `lazy` plan the index is moved to its section file (if that
/// fails, it stays in memory, with a warning).
pub fn make_engine(
    image: &Path,
    data: bool,
    lazy: Option<&LazyPlan>,
) -> vmsight_fsview::Result<Engine> {
    let disk = crate::disksource::open(image)?;
    let part = vmsight_fsview::read_partitions(&*disk)?
        .partitions
        .first()
        .cloned();
    let mut index = Index::crawl(&*disk, part.as_ref())?;
    if let Some(plan) = lazy {
        index = make_lazy(index, plan)?;
    }
    trim_heap();
    Engine::new(
        disk,
        index,
        EngineConfig {
            capture_data: data,
            // Without data capture a waiting block costs its entry only (~64 bytes), so 8 MiB
            // tracks 131 072 blocks (512 MiB of 4 KiB blocks) where 64 MiB of kept data
            // tracked 16 384.
            pending_max_bytes: if data { 64 << 20 } else { 8 << 20 },
            ..EngineConfig::default()
        },
    )
}

/// `index` as a lazy index in `plan`'s file; the index stays in memory (with a warning) when
/// the file cannot be written.
fn make_lazy(index: Index, plan: &LazyPlan) -> vmsight_fsview::Result<Index> {
    let written = plan
        .file
        .parent()
        .map_or(Ok(()), |d| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
        })
        .map_err(|e| {
            format!(
                "cannot create the directory of {}: {e}",
                plan.file.display()
            )
        })
        .and_then(|()| {
            // A file left by a run killed before the name was removed.
            let _ = std::fs::remove_file(&plan.file);
            index
                .write_lazy(&plan.file, &plan.cfg)
                .map_err(|e| e.to_string())
        });
    if let Err(e) = written {
        tracing::warn!("--stream-lazy: {e}; the index stays in memory");
        return Ok(index);
    }
    drop(index);
    Index::open_lazy(&plan.file, &plan.cfg)
}

/// Gives the crawl's freed temporaries (a directory entry's name each, the tables' growth)
/// back to the system: glibc keeps freed heap memory, which would count as the run's
/// private memory for as long as it runs.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free heap memory to the kernel; live allocations
    // are untouched, and it is thread-safe (it takes the arenas' locks).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Counters of one disk's inference, for `--stats`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InferStats {
    pub events: u64,
    pub events_by_kind: Vec<(String, u64)>,
    pub txns_applied: u64,
    pub checkpoint_writes: u64,
    pub journal_errors: u64,
    pub pending_blocks: u64,
    pub pending_expired: u64,
    /// Pending blocks dropped by the pending set's byte cap (their data events are lost).
    pub pending_evicted: u64,
    pub pending_claimed: u64,
    pub dropped_data_writes: u64,
    pub dropped_data_bytes: u64,
    pub overload_episodes: u64,
    pub metadata_errors: u64,
    pub overlay_bytes: u64,
    pub reread_writes: u64,
    /// The disk's file-system index: eager or lazy (`--stream-lazy`), what it holds and
    /// loaded (fsview's own counters, one definition).
    pub index: vmsight_fsview::IndexCounters,
}

/// Queue fill at which data writes start being dropped (Gamma-Ray §VI), and at which they
/// are kept again.
const OVERLOAD_ON: f64 = 0.5;
const OVERLOAD_OFF: f64 = 0.1;
/// Largest piece of a write-zeroes fed to the engine at once.
const ZERO_CHUNK: u64 = 1 << 20;

/// Feeds one disk's tap stream to its inference engine and delivers the events.
pub struct EngineSink {
    slot: Arc<RwLock<EngineSlot>>,
    delivery: Arc<Delivery>,
    queue: Arc<TapQueue>,
    image: PathBuf,
    /// Guest path where this disk's file system is mounted ("" for the root disk).
    prefix: String,
    data: bool,
    /// Set by a live attach: crawl now and start inferring.
    attach: Arc<AtomicBool>,
    reread: Option<File>,
    overloaded: bool,
    stats: Arc<Mutex<InferStats>>,
    out: Vec<FsEvent>,
    /// When the overlay's heap bytes were last walked (at most once per
    /// [`OVERLAY_REFRESH`]: the walk is O(overlay), the other counters are cheap).
    overlay_walked: Option<std::time::Instant>,
    /// `--stream-lazy`: where a live attach keeps the index.
    lazy: Option<LazyPlan>,
}

/// How often the stream consumer walks the overlay for its heap bytes (`overlay_bytes`).
const OVERLAY_REFRESH: Duration = Duration::from_secs(1);

impl EngineSink {
    /// A sink for disk image `image` whose engine lives in `slot` (already filled when
    /// streaming from boot, empty for a later attach).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        slot: Arc<RwLock<EngineSlot>>,
        delivery: Arc<Delivery>,
        queue: Arc<TapQueue>,
        image: &Path,
        prefix: String,
        data: bool,
        attach: Arc<AtomicBool>,
        stats: Arc<Mutex<InferStats>>,
    ) -> Self {
        Self {
            slot,
            delivery,
            queue,
            image: image.to_owned(),
            prefix,
            data,
            attach,
            reread: File::open(image).ok(),
            overloaded: false,
            stats,
            out: Vec::new(),
            overlay_walked: None,
            lazy: None,
        }
    }

    /// Keep the index of a later live attach lazily, as `plan` says.
    pub fn with_lazy(mut self, plan: Option<LazyPlan>) -> Self {
        self.lazy = plan;
        self
    }

    fn deliver(&mut self) {
        for mut ev in self.out.drain(..) {
            if !self.prefix.is_empty() {
                ev.path = join_prefix(&self.prefix, &ev.path);
                if let Some(o) = ev.old_path.take() {
                    ev.old_path = Some(join_prefix(&self.prefix, &o));
                }
            }
            self.delivery.deliver(ev);
        }
    }

    fn apply(&mut self, engine: &mut Engine, ev: &TapEvent) {
        let ns = ev.observed_ns;
        match &ev.kind {
            TapKind::Write {
                offset,
                data: Some(d),
                ..
            } => engine.write(*offset, d, ns, &mut self.out),
            TapKind::Write {
                offset,
                len,
                data: None,
            } => {
                // Queued without bytes (overload): the image holds the newest bytes of these
                // blocks.
                let mut buf = vec![0u8; usize::try_from(*len).unwrap_or(0)];
                let ok = self
                    .reread
                    .as_ref()
                    .is_some_and(|f| f.read_exact_at(&mut buf, *offset).is_ok());
                if ok {
                    engine.write(*offset, &buf, ns, &mut self.out);
                    if let Ok(mut s) = self.stats.lock() {
                        s.reread_writes += 1;
                    }
                }
            }
            TapKind::Discard { offset, len } => engine.discard(*offset, *len, ns, &mut self.out),
            TapKind::WriteZeroes { offset, len } => {
                let mut done = 0;
                while done < *len {
                    let n = (*len - done).min(ZERO_CHUNK);
                    let zeros = vec![0u8; n as usize];
                    engine.write(offset + done, &zeros, ns, &mut self.out);
                    done += n;
                }
            }
            TapKind::Flush => engine.flush(ns, &mut self.out),
        }
    }

    fn overload_control(&mut self, engine: &mut Engine, in_hand: u64) {
        // The batch just taken out of the queue is still backlog: counting only what is left
        // in the queue would almost never see the overload.
        let fill = self.queue.fill_ratio_with(in_hand);
        if !self.overloaded && fill > OVERLOAD_ON {
            self.overloaded = true;
            engine.set_drop_data(true);
            if let Ok(mut s) = self.stats.lock() {
                s.overload_episodes += 1;
            }
            tracing::warn!(
                "stream of {} overloaded ({:.0}% of the queue): dropping data writes, keeping metadata",
                self.image.display(),
                fill * 100.0
            );
        } else if self.overloaded && fill < OVERLOAD_OFF {
            self.overloaded = false;
            engine.set_drop_data(false);
        }
    }

    fn update_stats(&mut self, engine: &Engine) {
        let e = engine.counters();
        let walk = self
            .overlay_walked
            .is_none_or(|t| t.elapsed() >= OVERLAY_REFRESH);
        let overlay = walk.then(|| engine.overlay_bytes());
        if walk {
            self.overlay_walked = Some(std::time::Instant::now());
        }
        if let Ok(mut s) = self.stats.lock() {
            s.events = e.events;
            s.events_by_kind = e
                .events_by_kind
                .iter()
                .map(|(k, n)| (format!("{k:?}").to_lowercase(), *n))
                .collect();
            s.txns_applied = e.txns_applied;
            s.checkpoint_writes = e.checkpoint_writes;
            s.journal_errors = e.journal_errors + e.journal_csum_errors;
            s.pending_blocks = e.pending_blocks;
            s.pending_expired = e.pending_expired;
            s.pending_evicted = e.pending_evicted;
            s.pending_claimed = e.pending_claimed;
            s.dropped_data_writes = e.dropped_data_writes;
            s.dropped_data_bytes = e.dropped_data_bytes;
            s.metadata_errors = e.metadata_errors;
            if let Some(bytes) = overlay {
                s.overlay_bytes = bytes;
            }
            if e.index.load_errors > s.index.load_errors {
                let why = engine.index().lazy_stats().and_then(|l| l.last_error);
                tracing::error!(
                    "the lazy index of {} lost a section: {}",
                    self.image.display(),
                    why.unwrap_or_default()
                );
            }
            s.index = e.index;
        }
    }

    /// Live attach: crawl the image as it is now (the tap is already queueing writes made
    /// from here on; replaying them over the crawl is harmless because the engine diffs).
    fn try_attach(&mut self) {
        if !self.attach.swap(false, Ordering::AcqRel) {
            return;
        }
        let started = std::time::Instant::now();
        match make_engine(&self.image, self.data, self.lazy.as_ref()) {
            Ok(engine) => {
                if let Ok(mut slot) = self.slot.write() {
                    slot.0 = Some(engine);
                }
                tracing::info!(
                    "attached to {} after a {:?} crawl",
                    self.image.display(),
                    started.elapsed()
                );
            }
            Err(e) => eprintln!("vmsight: cannot stream {}: {e}", self.image.display()),
        }
    }
}

fn join_prefix(prefix: &str, path: &str) -> String {
    if path == "/" {
        prefix.to_string()
    } else {
        format!("{prefix}{path}")
    }
}

impl TapSink for EngineSink {
    fn on_batch(&mut self, batch: &[TapEvent]) {
        self.try_attach();
        let slot = self.slot.clone();
        let Ok(mut guard) = slot.write() else {
            return;
        };
        let Some(engine) = guard.0.as_mut() else {
            // Not attached: nothing to infer from (the tap is normally off then).
            return;
        };
        let in_hand: u64 = batch.iter().map(TapEvent::payload_bytes).sum();
        self.overload_control(engine, in_hand);
        for ev in batch {
            self.apply(engine, ev);
        }
        self.update_stats(engine);
        drop(guard);
        self.deliver();
    }

    fn tick(&mut self) {
        self.try_attach();
        let slot = self.slot.clone();
        if let Ok(mut guard) = slot.write() {
            if let Some(engine) = guard.0.as_mut() {
                engine.tick(vmsight_events::now_ns(), &mut self.out);
                self.update_stats(engine);
            }
        }
        self.deliver();
    }

    fn finish(&mut self) {
        self.overlay_walked = None; // the final numbers walk the overlay once more
        self.tick();
        self.delivery.flush();
    }
}

/// Counters of a [`replay`].
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ReplayStats {
    /// Tap events replayed.
    pub tap_events: u64,
    /// File events produced.
    pub file_events: u64,
}

/// Replays a write recording made with `--record-writes` on top of `base` (the disk image as it
/// was when the recording started): each write is applied to a scratch copy of the image, then
/// fed to an engine crawled from that copy, exactly as in a live run. Every event goes to
/// `out` as a JSON line (same schema as `--events`, host `replay`, vm = the recording's name).
pub fn replay(
    base: &Path,
    recording: &Path,
    prefix: &str,
    data: bool,
    out: &mut dyn Write,
) -> Result<ReplayStats, ReplayError> {
    let scratch = tempfile::Builder::new()
        .prefix("vmsight-replay")
        .tempdir()
        .map_err(ReplayError::Scratch)?;
    let image = scratch.path().join("disk.img");
    crate::runtime::sparse_copy(base, &image, crate::runtime::Durability::Scratch).map_err(
        |source| ReplayError::Copy {
            base: base.into(),
            source,
        },
    )?;
    let mut engine = make_engine(&image, data, None)?;
    let disk = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .map_err(ReplayError::Apply)?;
    let size = disk.metadata().map_err(ReplayError::Apply)?.len();
    let mut reader = vmsight_blockdev::tap::RecordingReader::open(recording)?;
    let name = recording
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "recording".into());
    let addr = Addresser::new("replay", name);
    let mut stats = ReplayStats::default();
    let mut evs = Vec::new();
    let io = ReplayError::Apply;
    loop {
        let frame = stats.tap_events + 1;
        let Some(ev) = reader
            .next_event()
            .map_err(|source| ReplayError::Damaged { frame, source })?
        else {
            break;
        };
        stats.tap_events += 1;
        let at = Frame {
            recording,
            frame,
            seq: ev.seq,
        };
        let ns = ev.observed_ns;
        match &ev.kind {
            TapKind::Write {
                offset,
                data: Some(d),
                ..
            } => {
                at.within_image(*offset, d.len() as u64, size)?;
                disk.write_all_at(d, *offset).map_err(io)?;
                engine.write(*offset, d, ns, &mut evs);
            }
            TapKind::Write { .. } => {
                // Recorded without bytes (the live queue was over its limit): the live run
                // re-read them from the image; a replay cannot, so it says so.
                return Err(at.no_bytes());
            }
            TapKind::WriteZeroes { offset, len } => {
                at.within_image(*offset, *len, size)?;
                let mut done = 0;
                while done < *len {
                    let n = (*len - done).min(ZERO_CHUNK);
                    let zeros = vec![0u8; n as usize];
                    disk.write_all_at(&zeros, offset + done).map_err(io)?;
                    engine.write(offset + done, &zeros, ns, &mut evs);
                    done += n;
                }
            }
            TapKind::Discard { offset, len } => {
                at.within_image(*offset, *len, size)?;
                engine.discard(*offset, *len, ns, &mut evs);
            }
            TapKind::Flush => engine.flush(ns, &mut evs),
        }
        for mut e in evs.drain(..) {
            if !prefix.is_empty() {
                e.path = join_prefix(prefix, &e.path);
                if let Some(o) = e.old_path.take() {
                    e.old_path = Some(join_prefix(prefix, &o));
                }
            }
            stats.file_events += 1;
            writeln!(out, "{}", addr.wrap(e).to_json(data)).map_err(ReplayError::Output)?;
        }
    }
    Ok(stats)
}
