//! vmsight-blockdev: vmsight's own vhost-user-blk backend.
//!
//! One backend serves one raw disk image on one Unix socket to one QEMU
//! `vhost-user-blk-pci` device. Requests flow through a pipeline of stages:
//!
//! ```text
//! virtqueue ─► request.rs (parse + validate) ─► flush-order ─► Stage … ─► FileStage
//!                      │ invalid                 (completion hooks run  │ I/O threads:
//!                      │                          on the way back up)   │ preadv/pwritev/
//!                      └──────── status byte / used ring ◄──────────────┘ fdatasync/fallocate
//!
//! Requests are asynchronous (`pipeline::Io`): several are in flight per queue and they
//! complete out of order, from whichever thread finishes them.
//! ```
//!
//! ```no_run
//! use std::path::Path;
//! use vmsight_blockdev::{spawn_backend, DiskConfig};
//!
//! let cfg = DiskConfig::new("/var/lib/vm/disk.img");
//! let handle = spawn_backend(cfg, Path::new("/run/vm/disk0.sock"))?;
//! // start QEMU with -chardev socket,id=d0,path=/run/vm/disk0.sock
//! //                 -device vhost-user-blk-pci,chardev=d0,num-queues=2
//! println!("{:?}", handle.metrics().snapshot());
//! handle.wait()?; // returns when QEMU disconnects
//! # Ok::<(), vmsight_blockdev::BlockError>(())
//! ```
//!
//! See `docs/blockdev.md` for features, validation rules, metrics and how to add a stage.

mod device;
mod error;
pub mod file;
pub mod fuzzing;
pub mod histogram;
pub mod insight;
pub mod metrics;
pub mod pipeline;
pub mod request;
pub mod stages;
pub mod tap;
#[cfg(test)]
mod testrng;
pub mod timer;
pub mod uring;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use vmm_sys_util::epoll::EventSet;

pub use device::CONFIG_SPACE_LEN;
pub use error::BlockError;
pub use file::{FileStage, RawFile};
pub use metrics::{BlockMetrics, ErrorCounts, HandOffTimes, MetricsSnapshot};
pub use pipeline::{
    Io, IoResult, Lower, Next, Pipeline, Serialized, Stage, StageError, Status, SyncStage, Terminal,
};
pub use request::{
    Insights, Limits, Request, RequestError, RequestKind, SectorRange, Segment, Timeline,
    SECTOR_SIZE,
};
pub use uring::{Reaping, UringEvents, UringStage};

use device::{BlockDevice, DeviceSpec};

/// Default number of virtqueues (QEMU's `num-queues` must not exceed it).
pub const DEFAULT_NUM_QUEUES: u16 = 2;
/// Default (and maximum accepted) virtqueue size; QEMU's `queue-size` must not exceed it.
pub const DEFAULT_QUEUE_SIZE: u16 = 128;
/// Most queues a backend accepts.
pub const MAX_NUM_QUEUES: u16 = 64;

/// One disk to serve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskConfig {
    /// Raw image file (or block device).
    pub path: PathBuf,
    /// Offer `VIRTIO_BLK_F_RO`, open the image read-only with a shared lock, and refuse
    /// writes, discards and write-zeroes with `VIRTIO_BLK_S_IOERR`.
    pub read_only: bool,
    /// Answer to `VIRTIO_BLK_T_GET_ID` (`/sys/block/vdX/serial` in the guest); at most 20 bytes.
    pub serial: String,
    /// Number of virtqueues offered (1..=64). QEMU's `num-queues` must be at most this.
    pub num_queues: u16,
    /// Largest virtqueue size accepted (power of two, 4..=32768); `seg_max` is this minus 2.
    /// QEMU's `queue-size` (128 by default) must be at most this.
    pub queue_size: u16,
    /// Use `O_DIRECT` for aligned reads and writes (falls back to buffered I/O when a request
    /// is unaligned or the file system refuses `O_DIRECT`).
    pub direct_io: bool,
    /// I/O threads serving the image (requests in flight at once below the stages);
    /// 1..=[`file::MAX_IO_THREADS`]. Only for [`IoEngine::Threads`].
    #[serde(default = "default_io_threads")]
    pub io_threads: usize,
    /// How the image's reads, writes and flushes reach the kernel.
    #[serde(default)]
    pub io_engine: IoEngine,
}

/// How a disk's image is served ([`DiskConfig::io_engine`]). Why the pool is the default, with
/// the numbers: [`FileStage`]'s documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoEngine {
    /// A pool of I/O threads running blocking `preadv`/`pwritev` ([`FileStage`]).
    #[default]
    Threads,
    /// One io_uring per disk, submitted from and reaped on the virtqueue's worker thread
    /// ([`uring::UringStage`]).
    IoUring,
}

impl IoEngine {
    /// The name users write (`io=threads`, `io=io_uring`).
    pub fn as_str(self) -> &'static str {
        match self {
            IoEngine::Threads => "threads",
            IoEngine::IoUring => "io_uring",
        }
    }
}

/// A name that is not an [`IoEngine`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an I/O engine (threads, io_uring)")]
pub struct UnknownIoEngine(pub String);

impl std::str::FromStr for IoEngine {
    type Err = UnknownIoEngine;
    fn from_str(s: &str) -> Result<Self, UnknownIoEngine> {
        match s {
            "threads" => Ok(IoEngine::Threads),
            "io_uring" => Ok(IoEngine::IoUring),
            other => Err(UnknownIoEngine(other.to_owned())),
        }
    }
}

fn default_io_threads() -> usize {
    file::DEFAULT_IO_THREADS
}

impl DiskConfig {
    /// Read-write, serial from the file name (truncated to 20 bytes), 2 queues of 128, buffered.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "vmsight-disk".into());
        let mut serial = String::new();
        for ch in stem.chars() {
            if serial.len() + ch.len_utf8() > request::ID_BYTES {
                break;
            }
            serial.push(ch);
        }
        Self {
            path,
            read_only: false,
            serial,
            num_queues: DEFAULT_NUM_QUEUES,
            queue_size: DEFAULT_QUEUE_SIZE,
            direct_io: false,
            io_threads: file::DEFAULT_IO_THREADS,
            io_engine: IoEngine::default(),
        }
    }

    fn validate(&self) -> Result<(), BlockError> {
        let bad = |reason: String| BlockError::InvalidConfig {
            path: self.path.clone(),
            reason,
        };
        if self.serial.len() > request::ID_BYTES {
            return Err(bad(format!(
                "the serial {:?} is {} bytes long; virtio-blk allows at most 20",
                self.serial,
                self.serial.len()
            )));
        }
        if self.num_queues == 0 || self.num_queues > MAX_NUM_QUEUES {
            return Err(bad(format!(
                "num_queues is {}; it must be between 1 and {MAX_NUM_QUEUES}",
                self.num_queues
            )));
        }
        if self.io_threads == 0 || self.io_threads > file::MAX_IO_THREADS {
            return Err(bad(format!(
                "io_threads is {}; it must be between 1 and {}",
                self.io_threads,
                file::MAX_IO_THREADS
            )));
        }
        if !self.queue_size.is_power_of_two() || self.queue_size < 4 {
            return Err(bad(format!(
                "queue_size is {}; it must be a power of two between 4 and 32768",
                self.queue_size
            )));
        }
        Ok(())
    }
}

/// A running backend.
///
/// Dropping the handle without [`wait`](Self::wait) stops the backend (the connection to QEMU
/// is shut down and the thread joined).
pub struct BackendHandle {
    metrics: Arc<BlockMetrics>,
    served: vmsight_vhostd::Served,
    image: PathBuf,
    capacity_bytes: u64,
    stages: Vec<String>,
}

impl std::fmt::Debug for BackendHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendHandle")
            .field("image", &self.image)
            .field("socket", &self.served.socket())
            .field("stages", &self.stages)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl BackendHandle {
    /// Live counters of this disk.
    pub fn metrics(&self) -> Arc<BlockMetrics> {
        self.metrics.clone()
    }

    /// Blocks until the frontend disconnects (`Ok`, also when QEMU exits or is killed), the
    /// backend is shut down with [`shutdown`](Self::shutdown) (`Ok`), or a fatal error occurs.
    pub fn wait(mut self) -> Result<(), BlockError> {
        self.join()
    }

    /// Whether the serving thread has ended.
    pub fn is_finished(&self) -> bool {
        self.served.is_finished()
    }

    /// Asks the backend to stop: disconnects QEMU (whose disk then fails I/O) or stops waiting
    /// for it to connect. Returns at once; use [`wait`](Self::wait) to join.
    pub fn shutdown(&self) {
        self.served.stop();
    }

    /// Once QEMU is gone: stops waiting for it if it never connected, so that
    /// [`wait`](Self::wait) returns.
    pub fn frontend_gone(&self) {
        self.served.stop_if_never_connected();
    }

    /// The Unix socket QEMU connects to.
    pub fn socket_path(&self) -> &Path {
        self.served.socket()
    }

    /// The served image.
    pub fn image_path(&self) -> &Path {
        &self.image
    }

    /// Size exposed to the guest, in bytes (a multiple of 512).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Names of the pipeline stages, in order, ending with the terminal (`"raw-file"`).
    pub fn stage_names(&self) -> &[String] {
        &self.stages
    }

    fn join(&mut self) -> Result<(), BlockError> {
        self.served.join().map_err(|e| serve_error(&self.image, e))
    }
}

impl Drop for BackendHandle {
    fn drop(&mut self) {
        if !self.served.joined() {
            self.served.stop();
            if let Err(e) = self.join() {
                warn!(error = %e, "block backend ended with an error");
            }
        }
    }
}

/// The disk's view of a serving failure.
fn serve_error(image: &Path, e: vmsight_vhostd::ServeError) -> BlockError {
    use vmsight_vhostd::ServeError as S;
    match e {
        S::SocketInUse { path } => BlockError::SocketInUse { path },
        S::Socket { path, reason } => BlockError::Socket { path, reason },
        S::Thread { source, .. } => BlockError::Thread {
            path: image.to_owned(),
            source,
        },
        S::Panicked { .. } => BlockError::Panicked {
            path: image.to_owned(),
        },
        S::Daemon { reason, .. } => BlockError::Daemon {
            path: image.to_owned(),
            reason,
        },
    }
}

/// Opens and locks the image, binds the Unix listener at `socket` synchronously (so QEMU can
/// connect as soon as this returns), then serves in a background thread. The pipeline is just
/// the raw file.
pub fn spawn_backend(cfg: DiskConfig, socket: &Path) -> Result<BackendHandle, BlockError> {
    spawn_backend_with(cfg, socket, Vec::new())
}

/// Like [`spawn_backend`], with `stages` installed in front of the raw file, in order (the
/// first one sees every request first).
pub fn spawn_backend_with(
    cfg: DiskConfig,
    socket: &Path,
    stages: Vec<Box<dyn Stage>>,
) -> Result<BackendHandle, BlockError> {
    spawn_backend_on(cfg, socket, Backing::Image, stages)
}

/// What the last stage of a disk's pipeline is.
pub enum Backing {
    /// `DiskConfig::path` as a raw image ([`FileStage`], opened and locked here).
    Image,
    /// A terminal stage that owns its storage itself (e.g. a dedup volume), serving a disk of
    /// `capacity_bytes` (a multiple of 512).
    Stage {
        /// The terminal.
        terminal: Box<dyn Stage>,
        /// Size of the disk the guest sees.
        capacity_bytes: u64,
    },
}

/// Like [`spawn_backend_with`], over `backing`.
pub fn spawn_backend_on(
    cfg: DiskConfig,
    socket: &Path,
    backing: Backing,
    stages: Vec<Box<dyn Stage>>,
) -> Result<BackendHandle, BlockError> {
    cfg.validate()?;
    let mut uring_events = None;
    let (terminal, capacity_sectors): (Box<dyn Stage>, u64) = match backing {
        Backing::Image => {
            let file = RawFile::open(&cfg.path, cfg.read_only, cfg.direct_io)?;
            let sectors = file.capacity_sectors();
            let stage: Box<dyn Stage> = match cfg.io_engine {
                IoEngine::Threads => Box::new(FileStage::new(file, cfg.io_threads)?),
                IoEngine::IoUring => {
                    let (stage, events) = UringStage::new(file, Reaping::External)?;
                    uring_events = Some(events);
                    Box::new(stage)
                }
            };
            (stage, sectors)
        }
        Backing::Stage {
            terminal,
            capacity_bytes,
        } => (terminal, capacity_bytes / SECTOR_SIZE),
    };
    let mut serial = [0u8; request::ID_BYTES];
    for (d, s) in serial.iter_mut().zip(cfg.serial.as_bytes()) {
        *d = *s;
    }
    let spec = DeviceSpec {
        limits: Limits::new(capacity_sectors, cfg.read_only, cfg.queue_size),
        num_queues: cfg.num_queues,
        queue_size: cfg.queue_size,
        serial,
    };
    let path_err = |e: StageError| BlockError::Daemon {
        path: cfg.path.clone(),
        reason: e.to_string(),
    };
    let mut pipeline = Pipeline::with_terminal(terminal);
    pipeline
        .push(Box::new(stages::FlushOrder::new()))
        .map_err(path_err)?;
    for s in stages {
        pipeline.push(s).map_err(path_err)?;
    }
    let stage_names = pipeline.stage_names();
    let metrics = Arc::new(BlockMetrics::new());
    let uring_id = u64::from(cfg.num_queues) + 1;
    let device = Arc::new(
        BlockDevice::new(spec, pipeline, metrics.clone())
            .with_uring(uring_events.clone().map(|ev| (ev, uring_id as u16))),
    );

    let finisher = device.clone();
    let served = vmsight_vhostd::serve(
        &format!("vmsight-blk-{}", cfg.serial),
        device,
        socket,
        vmsight_vhostd::Connection::Direct,
        // The io_uring's completions are handled by the queue worker's own epoll loop.
        |daemon| match &uring_events {
            None => Ok(()),
            Some(ev) => daemon
                .get_epoll_handlers()
                .first()
                .ok_or("the daemon has no worker")?
                .register_listener(ev.fd(), EventSet::IN, uring_id)
                .map_err(|e| format!("cannot watch the io_uring's eventfd: {e}")),
        },
        // The queue workers are joined: let stages write out what they hold (write-back).
        move || finisher.shutdown_pipeline(),
    )
    .map_err(|e| serve_error(&cfg.path, e))?;
    info!(
        image = %cfg.path.display(),
        socket = %socket.display(),
        capacity_sectors,
        read_only = cfg.read_only,
        queues = cfg.num_queues,
        io = cfg.io_engine.as_str(),
        stages = ?stage_names,
        "vhost-user-blk backend listening"
    );
    Ok(BackendHandle {
        metrics,
        served,
        image: cfg.path,
        capacity_bytes: capacity_sectors * SECTOR_SIZE,
        stages: stage_names,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    fn image() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tempfile");
        f.write_all(&[0u8; 64 * 1024]).expect("fill");
        f.flush().expect("flush");
        f
    }

    fn wait_finished(h: &BackendHandle) {
        let t = Instant::now();
        while !h.is_finished() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "backend did not stop"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    struct Tap;
    impl Stage for Tap {
        fn name(&self) -> &str {
            "tap"
        }
        fn submit(&self, io: Io) {
            io.forward();
        }
    }

    #[test]
    fn socket_is_bound_on_return_and_shutdown_before_connect_is_ok() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        let h = spawn_backend_with(DiskConfig::new(img.path()), &sock, vec![Box::new(Tap)])
            .expect("spawn");
        assert!(sock.exists(), "listener bound synchronously");
        assert_eq!(h.stage_names(), ["flush-order", "tap", "raw-file"]);
        assert_eq!(h.capacity_bytes(), 64 * 1024);
        assert!(!h.is_finished());
        h.shutdown();
        wait_finished(&h);
        h.wait().expect("clean stop");
        assert!(!sock.exists(), "socket removed");
        // The image lock is released with the backend.
        RawFile::open(img.path(), false, false).expect("lock released");
    }

    #[test]
    fn frontend_disconnect_ends_the_backend_with_ok() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        let h = spawn_backend(DiskConfig::new(img.path()), &sock).expect("spawn");
        let conn = UnixStream::connect(&sock).expect("connect");
        std::thread::sleep(Duration::from_millis(50));
        drop(conn); // like QEMU exiting
        wait_finished(&h);
        h.wait().expect("disconnect is a normal end");
    }

    #[test]
    fn shutdown_while_connected_is_ok() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        let h = spawn_backend(DiskConfig::new(img.path()), &sock).expect("spawn");
        let _conn = UnixStream::connect(&sock).expect("connect");
        std::thread::sleep(Duration::from_millis(50));
        h.shutdown();
        wait_finished(&h);
        h.wait().expect("shutdown is a normal end");
    }

    #[test]
    fn dropping_the_handle_stops_the_backend() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        drop(spawn_backend(DiskConfig::new(img.path()), &sock).expect("spawn"));
        assert!(!sock.exists());
        RawFile::open(img.path(), false, false).expect("lock released");
    }

    #[test]
    fn two_backends_cannot_write_one_image() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let _h =
            spawn_backend(DiskConfig::new(img.path()), &dir.path().join("a.sock")).expect("first");
        let err = spawn_backend(DiskConfig::new(img.path()), &dir.path().join("b.sock"))
            .expect_err("second");
        assert!(matches!(err, BlockError::Locked { .. }), "{err}");
        assert!(!dir.path().join("b.sock").exists());
    }

    #[test]
    fn a_live_socket_is_not_stolen() {
        let a = image();
        let b = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        let _h = spawn_backend(DiskConfig::new(a.path()), &sock).expect("first");
        let err = spawn_backend(DiskConfig::new(b.path()), &sock).expect_err("second");
        assert!(matches!(err, BlockError::SocketInUse { .. }), "{err}");
        // A stale socket file (nobody listening) is replaced.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
        let h = spawn_backend(DiskConfig::new(b.path()), &stale).expect("stale socket replaced");
        h.shutdown();
        h.wait().expect("stop");
    }

    #[test]
    fn bad_configurations_are_refused_with_sentences() {
        let img = image();
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("d0.sock");
        let mut c = DiskConfig::new(img.path());
        c.serial = "x".repeat(21);
        let e = spawn_backend(c, &sock).expect_err("serial");
        assert!(e.to_string().contains("at most 20"), "{e}");
        let mut c = DiskConfig::new(img.path());
        c.num_queues = 0;
        assert!(spawn_backend(c, &sock)
            .expect_err("queues")
            .to_string()
            .contains("num_queues"));
        let mut c = DiskConfig::new(img.path());
        c.queue_size = 100;
        assert!(spawn_backend(c, &sock)
            .expect_err("size")
            .to_string()
            .contains("power of two"));
        assert!(!sock.exists());
    }

    #[test]
    fn default_serial_comes_from_the_file_name() {
        let c = DiskConfig::new("/images/a-very-long-disk-name-indeed.img");
        assert_eq!(c.serial, "a-very-long-disk-nam");
        assert_eq!(c.serial.len(), 20);
        assert_eq!((c.num_queues, c.queue_size, c.read_only), (2, 128, false));
    }
}
