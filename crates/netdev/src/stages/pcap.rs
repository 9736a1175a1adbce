//! Capture: writes the device's frames to a pcap file (`--net-pcap FILE`).
//!
//! Every frame the stage sees, in both directions, becomes one record of a classic pcap file
//! (`LINKTYPE_ETHERNET`, microsecond timestamps, the host's byte order) that tcpdump,
//! Wireshark and tshark read: `tcpdump -nn -r FILE`, `tcpdump -nn -r FILE tcp`. The stage
//! never changes or drops a frame.
//!
//! # What is captured
//!
//! * Frames from the guest as the guest sent them, and frames to the guest as the guest
//!   receives them. The pipeline runs frames to the guest through the stages in reverse
//!   order, so a capture stage placed *before* FoxyVegas records the ACKs FoxyVegas rewrote
//!   (what the guest really gets), and the guest's frames before any later stage looks at
//!   them. The launcher places it accordingly.
//! * The Ethernet frame only: the virtio-net header is not recorded. GSO super-frames (up to
//!   64 KiB of TCP or UDP payload in one frame) are recorded as one record of the frame as
//!   it crossed the device, not as the wire segments the host kernel makes of it, just as
//!   tcpdump on a host interface with TSO/GRO shows them. Checksums of frames with a pending
//!   checksum offload (`VIRTIO_NET_HDR_F_NEEDS_CSUM`) hold only the pseudo-header sum, so
//!   tcpdump `-vv` reports them as incorrect, as it does on the sending host.
//! * Timestamps are wall-clock time (the offset between the wall clock and the monotonic
//!   clock the pipeline gives stages is taken once, when the stage is created), at the
//!   moment the device took the frame; records of the two directions may be slightly out of
//!   timestamp order (the worker handles frames in batches), which pcap tools accept.
//!
//! # Options and limits
//!
//! * `snaplen` (default 65535, 1 to 262144): frames longer than this are truncated in their
//!   record; the record keeps the frame's original length. A maximal GSO frame (65535 bytes
//!   of IP plus 18 bytes of link headers) is therefore cut by a few bytes at the default.
//!   (The `pcap-file` reader refuses records whose original length exceeds the snap length;
//!   tcpdump and Wireshark do not.)
//! * `max_bytes` (default unlimited): the file never grows beyond this (the 24-byte file
//!   header counts; it is always written). The first frame whose record would not fit stops
//!   the capture for good — the file holds a complete prefix of the traffic — and every
//!   frame from then on counts in `frames_skipped`.
//! * Writes go through a 1 MiB buffer, flushed by [`NetStage::tick`] (so the file is
//!   readable while the VM runs, at most a tick behind) and by [`NetStage::finish`]. The file
//!   header reaches the file at the first tick too: [`PcapStage::create`] fails when the file
//!   cannot be created, while a device that refuses writes (a full disk) shows as a write
//!   error at the first flush.
//! * A write error (disk full, I/O error) is counted in `write_errors`, logged once, and stops
//!   the capture; frames not known to be in the file count in `frames_skipped`. The file then
//!   ends with the records flushed before the error (possibly followed by a partial record,
//!   which tcpdump reports as a truncated dump file after printing the complete ones).
//!
//! `frames_captured` and `bytes_captured` count records known to be written, updated on each
//! flush; after [`NetStage::finish`], every frame seen is counted exactly once in either
//! `frames_captured` or `frames_skipped`.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::{DataLink, Endianness, TsResolution};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::packet::{Direction, Frame};
use crate::stage::{now_ns, NetStage, Verdict};

/// Default snap length.
pub const DEFAULT_SNAPLEN: u32 = 65_535;
/// Largest accepted snap length (libpcap's `MAXIMUM_SNAPLEN`).
pub const MAX_SNAPLEN: u32 = 262_144;
/// Length of the pcap file header.
pub const FILE_HEADER_LEN: u64 = 24;
/// Length of a record header.
pub const RECORD_HEADER_LEN: u64 = 16;
/// Capacity of the write buffer.
const BUF_CAPACITY: usize = 1 << 20;
/// Latest timestamp a classic pcap record can hold, ns since the epoch.
const MAX_TS_NS: i128 = (u32::MAX as i128) * 1_000_000_000 + 999_999_999;

/// Parameters of a capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PcapConfig {
    /// The capture file (created, or truncated if it exists).
    pub path: PathBuf,
    /// Most bytes of a frame recorded (1 to 262144).
    pub snaplen: u32,
    /// Largest file size in bytes; `None`: unlimited.
    pub max_bytes: Option<u64>,
}

impl PcapConfig {
    /// A capture to `path` with the default snap length (65535) and no size limit.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            snaplen: DEFAULT_SNAPLEN,
            max_bytes: None,
        }
    }
}

/// Why a capture cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PcapError {
    /// The file cannot be created.
    #[error("cannot create capture file {}: {err}", path.display())]
    Create { path: PathBuf, err: std::io::Error },
    /// The file header cannot be written.
    #[error("cannot write capture file {}: {err}", path.display())]
    Write { path: PathBuf, err: String },
    /// The snap length is outside 1 to 262144.
    #[error(
        "snap length {snaplen} of capture file {} is out of range (1 to {MAX_SNAPLEN})",
        path.display()
    )]
    Snaplen { path: PathBuf, snaplen: u32 },
}

/// Live counters of a capture.
#[derive(Debug, Default)]
pub struct PcapMetrics {
    path: String,
    snaplen: u32,
    max_bytes: Option<u64>,
    /// Frames recorded (known to be written: updated on each flush).
    pub frames_captured: AtomicU64,
    /// Frame bytes recorded (after truncation to the snap length, record headers excluded).
    pub bytes_captured: AtomicU64,
    /// Size of the file as written (file header and records).
    pub file_bytes: AtomicU64,
    /// Frames not in the file: after the size limit was reached, after a write error, or
    /// lost in the buffer by a write error.
    pub frames_skipped: AtomicU64,
    /// Write errors (the first one stops the capture).
    pub write_errors: AtomicU64,
    /// The size limit stopped the capture.
    pub limit_reached: AtomicBool,
    /// A write error stopped the capture.
    pub failed: AtomicBool,
}

impl PcapMetrics {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> PcapSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PcapSnapshot {
            path: self.path.clone(),
            snaplen: self.snaplen,
            max_bytes: self.max_bytes,
            frames_captured: g(&self.frames_captured),
            bytes_captured: g(&self.bytes_captured),
            file_bytes: g(&self.file_bytes),
            frames_skipped: g(&self.frames_skipped),
            write_errors: g(&self.write_errors),
            limit_reached: self.limit_reached.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// Serialisable copy of [`PcapMetrics`] (see there for each field).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcapSnapshot {
    /// The capture file.
    pub path: String,
    /// The snap length.
    pub snaplen: u32,
    /// The size limit, bytes (`None`: unlimited).
    pub max_bytes: Option<u64>,
    /// Frames recorded.
    pub frames_captured: u64,
    /// Frame bytes recorded.
    pub bytes_captured: u64,
    /// Size of the file as written.
    pub file_bytes: u64,
    /// Frames not in the file.
    pub frames_skipped: u64,
    /// Write errors.
    pub write_errors: u64,
    /// The size limit stopped the capture.
    pub limit_reached: bool,
    /// A write error stopped the capture.
    pub failed: bool,
}

/// The buffered file.
type Buffered = BufWriter<Box<dyn Write + Send>>;

/// The buffered file, shared by the pcap writer (which writes records into it) and the stage
/// (which flushes it: `PcapWriter` gives no access to its writer but by consuming itself).
/// Both are used on the worker thread only, so the lock is never contended.
#[derive(Clone)]
struct SharedBuf(Arc<Mutex<Buffered>>);

impl SharedBuf {
    fn lock(&self) -> MutexGuard<'_, Buffered> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.lock().write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.lock().write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.lock().flush()
    }
}

/// An open capture: the pcap writer and its buffer.
struct Sink {
    pcap: PcapWriter<SharedBuf>,
    buf: SharedBuf,
}

impl Sink {
    /// Closes the capture without writing what is still buffered.
    fn discard(self) {
        let Sink { pcap, buf } = self;
        drop(pcap.into_writer());
        if let Ok(m) = Arc::try_unwrap(buf.0) {
            let b = m.into_inner().unwrap_or_else(PoisonError::into_inner);
            let (_file, _unwritten) = b.into_parts();
        }
    }
}

/// The capture stage (see the module documentation).
pub struct PcapStage {
    path: PathBuf,
    snaplen: u32,
    max_bytes: Option<u64>,
    /// `None` once the capture stopped (limit, error, finish).
    writer: Option<Sink>,
    /// Bytes handed to the writer (file header included).
    file_bytes: u64,
    /// Records (and their frame bytes) handed to the writer since the last flush.
    pending_frames: u64,
    pending_bytes: u64,
    /// Something (the file header, records) was written since the last flush.
    unflushed: bool,
    /// Wall clock at creation, ns since the epoch.
    wall0_ns: i128,
    /// Monotonic clock at creation, ns.
    mono0_ns: i128,
    metrics: Arc<PcapMetrics>,
}

impl std::fmt::Debug for PcapStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcapStage")
            .field("path", &self.path)
            .field("snaplen", &self.snaplen)
            .field("max_bytes", &self.max_bytes)
            .field("capturing", &self.writer.is_some())
            .field("file_bytes", &self.file_bytes)
            .finish()
    }
}

/// The message of a pcap-file error (its I/O errors display without their cause).
fn describe(e: &pcap_file::PcapError) -> String {
    match e {
        pcap_file::PcapError::IoError(io) => io.to_string(),
        other => other.to_string(),
    }
}

impl PcapStage {
    /// Creates (or truncates) the capture file and writes its header (into the buffer: it
    /// reaches the file at the first tick).
    pub fn create(cfg: PcapConfig) -> Result<(PcapStage, Arc<PcapMetrics>), PcapError> {
        check_snaplen(&cfg)?;
        let file = File::create(&cfg.path).map_err(|err| PcapError::Create {
            path: cfg.path.clone(),
            err,
        })?;
        Self::with_writer(cfg, Box::new(file))
    }

    /// A capture into `out` (the file of [`PcapStage::create`], or a test writer).
    fn with_writer(
        cfg: PcapConfig,
        out: Box<dyn Write + Send>,
    ) -> Result<(PcapStage, Arc<PcapMetrics>), PcapError> {
        check_snaplen(&cfg)?;
        let header = PcapHeader {
            snaplen: cfg.snaplen,
            datalink: DataLink::ETHERNET,
            ts_resolution: TsResolution::MicroSecond,
            endianness: Endianness::native(),
            ..PcapHeader::default()
        };
        let buf = SharedBuf(Arc::new(Mutex::new(BufWriter::with_capacity(
            BUF_CAPACITY,
            out,
        ))));
        let pcap = PcapWriter::with_header(buf.clone(), header).map_err(|e| PcapError::Write {
            path: cfg.path.clone(),
            err: describe(&e),
        })?;
        let wall0 = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        let metrics = Arc::new(PcapMetrics {
            path: cfg.path.display().to_string(),
            snaplen: cfg.snaplen,
            max_bytes: cfg.max_bytes,
            ..PcapMetrics::default()
        });
        let stage = PcapStage {
            path: cfg.path,
            snaplen: cfg.snaplen,
            max_bytes: cfg.max_bytes,
            writer: Some(Sink { pcap, buf }),
            file_bytes: FILE_HEADER_LEN,
            pending_frames: 0,
            pending_bytes: 0,
            unflushed: true,
            wall0_ns: i128::try_from(wall0.as_nanos()).unwrap_or(0),
            mono0_ns: i128::from(now_ns()),
            metrics: Arc::clone(&metrics),
        };
        Ok((stage, metrics))
    }

    /// The capture file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Wall-clock time of the monotonic instant `now_ns`, clamped to what pcap can hold.
    fn timestamp(&self, now_ns: u64) -> Duration {
        let ns = (self.wall0_ns + i128::from(now_ns) - self.mono0_ns).clamp(0, MAX_TS_NS);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(0))
    }

    /// Flushes the buffer; on success the pending records count as captured.
    fn flush(&mut self) {
        let Some(w) = self.writer.as_mut() else {
            return;
        };
        match w.buf.flush() {
            Ok(()) => {
                let m = &self.metrics;
                PcapMetrics::add(&m.frames_captured, self.pending_frames);
                PcapMetrics::add(&m.bytes_captured, self.pending_bytes);
                m.file_bytes.store(self.file_bytes, Ordering::Relaxed);
                self.pending_frames = 0;
                self.pending_bytes = 0;
                self.unflushed = false;
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// A write error: counts it, logs it, drops the buffer and stops the capture. The
    /// pending records are not known to be in the file: they count as skipped.
    fn fail(&mut self, err: &str) {
        let m = &self.metrics;
        PcapMetrics::add(&m.write_errors, 1);
        PcapMetrics::add(&m.frames_skipped, self.pending_frames);
        m.failed.store(true, Ordering::Relaxed);
        self.pending_frames = 0;
        self.pending_bytes = 0;
        if let Some(w) = self.writer.take() {
            // Drop the buffered bytes without another attempt to write them.
            w.discard();
        }
        warn!(
            path = %self.path.display(),
            error = err,
            "write error on the capture file, capture stopped"
        );
    }
}

fn check_snaplen(cfg: &PcapConfig) -> Result<(), PcapError> {
    if (1..=MAX_SNAPLEN).contains(&cfg.snaplen) {
        Ok(())
    } else {
        Err(PcapError::Snaplen {
            path: cfg.path.clone(),
            snaplen: cfg.snaplen,
        })
    }
}

impl NetStage for PcapStage {
    fn on_frame(&mut self, _dir: Direction, frame: &mut Frame, now_ns: u64) -> Verdict {
        let ts = self.timestamp(now_ns);
        let Some(w) = self.writer.as_mut() else {
            PcapMetrics::add(&self.metrics.frames_skipped, 1);
            return Verdict::Pass;
        };
        let incl = frame.data.len().min(self.snaplen as usize);
        let record = RECORD_HEADER_LEN + incl as u64;
        if self
            .max_bytes
            .is_some_and(|max| self.file_bytes.saturating_add(record) > max)
        {
            PcapMetrics::add(&self.metrics.frames_skipped, 1);
            self.metrics.limit_reached.store(true, Ordering::Relaxed);
            info!(
                path = %self.path.display(),
                bytes = self.file_bytes,
                "capture file reached its size limit, capture stopped"
            );
            self.flush();
            self.writer = None;
            return Verdict::Pass;
        }
        let orig_len = u32::try_from(frame.data.len()).unwrap_or(u32::MAX);
        let packet = PcapPacket::new(ts, orig_len, &frame.data[..incl]);
        match w.pcap.write_packet(&packet) {
            Ok(_) => {
                self.file_bytes += record;
                self.pending_frames += 1;
                self.pending_bytes += incl as u64;
                self.unflushed = true;
            }
            Err(e) => {
                PcapMetrics::add(&self.metrics.frames_skipped, 1);
                self.fail(&describe(&e));
            }
        }
        Verdict::Pass
    }

    fn tick(&mut self, _now_ns: u64) {
        if self.unflushed {
            self.flush();
        }
    }

    fn finish(&mut self) {
        self.flush();
        self.writer = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use pcap_file::pcap::{PcapReader, RawPcapPacket};
    use std::process::Command;

    fn frame(data: Vec<u8>) -> Frame {
        Frame {
            hdr: Default::default(),
            data,
        }
    }

    fn tcp(n: usize, payload: usize) -> Vec<u8> {
        tcp4(
            [10, 0, 2, 15],
            40000,
            [10, 0, 2, 2],
            80,
            n as u32,
            Some(1),
            1000,
            n == 0,
            &vec![n as u8; payload],
        )
    }

    /// A UDP frame to the guest.
    fn udp(payload: usize) -> Vec<u8> {
        let mut out = Vec::new();
        etherparse::PacketBuilder::ethernet2([2; 6], [4; 6])
            .ipv4([10, 0, 2, 2], [10, 0, 2, 15], 64)
            .udp(53, 5353)
            .write(&mut out, &vec![9; payload])
            .expect("builds");
        out
    }

    /// Raw records of a capture file (the pcap-file reader refuses truncated records in
    /// `next_packet`, so read them raw), with the header.
    fn records(path: &Path) -> (PcapHeader, Vec<RawPcapPacket<'static>>) {
        let mut r = PcapReader::new(File::open(path).expect("open")).expect("pcap header");
        let header = r.header();
        let mut out = Vec::new();
        while let Some(p) = r.next_raw_packet() {
            out.push(p.expect("record").into_owned());
        }
        (header, out)
    }

    /// tcpdump, the independent reader of the capture: a prerequisite of the tests
    /// (scripts/setup-host.sh installs it); missing, the test fails.
    fn tcpdump() -> PathBuf {
        let mut dirs: Vec<PathBuf> = vec!["/usr/sbin".into(), "/usr/bin".into(), "/sbin".into()];
        if let Some(p) = std::env::var_os("PATH") {
            dirs.extend(std::env::split_paths(&p));
        }
        dirs.into_iter()
            .map(|d| d.join("tcpdump"))
            .find(|p| p.is_file())
            .expect("tcpdump is not installed: it checks the capture (apt install tcpdump)")
    }

    /// Lines tcpdump prints for `path` with `filter`.
    fn tcpdump_lines(tcpdump: &Path, path: &Path, filter: Option<&str>) -> usize {
        let mut cmd = Command::new(tcpdump);
        cmd.arg("-nn").arg("-r").arg(path);
        if let Some(f) = filter {
            cmd.arg(f);
        }
        let out = cmd.output().expect("runs tcpdump");
        assert!(
            out.status.success(),
            "tcpdump failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // One line per packet; continuation lines (decoded payloads) are indented.
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.starts_with(char::is_whitespace))
            .count()
    }

    #[test]
    fn frames_of_both_directions_are_recorded_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cap.pcap");
        let (mut st, m) = PcapStage::create(PcapConfig::new(&path)).expect("create");
        let frames: Vec<(Direction, Vec<u8>)> = vec![
            (Direction::FromGuest, tcp(0, 0)),
            (
                Direction::ToGuest,
                tcp4(
                    [10, 0, 2, 2],
                    80,
                    [10, 0, 2, 15],
                    40000,
                    5,
                    Some(1),
                    9,
                    true,
                    b"",
                ),
            ),
            (Direction::FromGuest, tcp(1, 1000)),
            (Direction::ToGuest, udp(200)),
            (Direction::FromGuest, vec![0xff; 60]), // not IP
            (Direction::FromGuest, tcp(2, 60_000)), // a GSO-sized super-frame
        ];
        let t0 = now_ns();
        for (i, (d, data)) in frames.iter().enumerate() {
            let mut f = frame(data.clone());
            assert_eq!(st.on_frame(*d, &mut f, t0 + i as u64), Verdict::Pass);
            assert_eq!(&f.data, data, "the frame is not changed");
        }
        // Nothing is flushed yet; a tick makes the file readable.
        assert_eq!(m.snapshot().frames_captured, 0);
        st.tick(t0);
        let s = m.snapshot();
        assert_eq!(s.frames_captured, frames.len() as u64);
        let total: usize = frames.iter().map(|(_, d)| d.len()).sum();
        assert_eq!(s.bytes_captured, total as u64);
        let file_len = std::fs::metadata(&path).expect("metadata").len();
        assert_eq!(s.file_bytes, file_len);
        assert_eq!(file_len, 24 + 16 * frames.len() as u64 + total as u64);

        // The pcap-file reader reads the same frames back.
        let mut r = PcapReader::new(File::open(&path).expect("open")).expect("header");
        let h = r.header();
        assert_eq!(h.datalink, DataLink::ETHERNET);
        assert_eq!(h.snaplen, DEFAULT_SNAPLEN);
        assert_eq!(h.ts_resolution, TsResolution::MicroSecond);
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock");
        let mut n = 0;
        while let Some(p) = r.next_packet() {
            let p = p.expect("packet");
            assert_eq!(p.data.as_ref(), frames[n].1.as_slice(), "record {n}");
            assert_eq!(p.orig_len as usize, frames[n].1.len());
            assert!(wall.saturating_sub(p.timestamp) < Duration::from_secs(60));
            assert!(p.timestamp.saturating_sub(wall) < Duration::from_secs(60));
            n += 1;
        }
        assert_eq!(n, frames.len());
        st.finish();
        assert_eq!(m.snapshot().frames_skipped, 0);

        let td = tcpdump();
        assert_eq!(tcpdump_lines(&td, &path, None), frames.len());
        assert_eq!(tcpdump_lines(&td, &path, Some("tcp")), 4);
    }

    #[test]
    fn the_header_is_flushed_at_the_first_tick() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.pcap");
        let (mut st, m) = PcapStage::create(PcapConfig::new(&path)).expect("create");
        assert_eq!(std::fs::metadata(&path).expect("metadata").len(), 0);
        st.tick(now_ns());
        assert_eq!(std::fs::metadata(&path).expect("metadata").len(), 24);
        let (h, recs) = records(&path);
        assert_eq!((h.snaplen, recs.len()), (DEFAULT_SNAPLEN, 0));
        assert_eq!(m.snapshot().file_bytes, 24);
        assert_eq!(tcpdump_lines(&tcpdump(), &path, None), 0);
    }

    #[test]
    fn frames_longer_than_the_snaplen_are_truncated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snap.pcap");
        let cfg = PcapConfig {
            snaplen: 96,
            ..PcapConfig::new(&path)
        };
        let (mut st, m) = PcapStage::create(cfg).expect("create");
        let long = tcp(3, 500);
        let short = tcp(4, 10);
        let t = now_ns();
        st.on_frame(Direction::FromGuest, &mut frame(long.clone()), t);
        st.on_frame(Direction::ToGuest, &mut frame(short.clone()), t);
        st.finish();
        let (h, recs) = records(&path);
        assert_eq!(h.snaplen, 96);
        assert_eq!(recs.len(), 2);
        assert_eq!(
            (recs[0].incl_len, recs[0].orig_len),
            (96, long.len() as u32)
        );
        assert_eq!(recs[0].data.as_ref(), &long[..96]);
        assert_eq!(
            (recs[1].incl_len, recs[1].orig_len),
            (short.len() as u32, short.len() as u32)
        );
        assert_eq!(recs[1].data.as_ref(), short.as_slice());
        assert_eq!(m.snapshot().bytes_captured, 96 + short.len() as u64);
        assert_eq!(tcpdump_lines(&tcpdump(), &path, None), 2);
    }

    #[test]
    fn the_size_limit_stops_the_capture() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("limit.pcap");
        let limit = 5_000;
        let cfg = PcapConfig {
            max_bytes: Some(limit),
            ..PcapConfig::new(&path)
        };
        let (mut st, m) = PcapStage::create(cfg).expect("create");
        let f = tcp(5, 900);
        let rec = 16 + f.len() as u64;
        let t = now_ns();
        for i in 0..20 {
            st.on_frame(Direction::FromGuest, &mut frame(f.clone()), t + i);
            st.tick(t + i);
        }
        // A small frame that would still fit is not captured either: the capture stopped.
        st.on_frame(Direction::ToGuest, &mut frame(vec![1; 20]), t + 21);
        st.finish();
        let s = m.snapshot();
        let fit = (limit - 24) / rec;
        assert!(s.limit_reached);
        assert!(!s.failed);
        assert_eq!(s.frames_captured, fit);
        assert_eq!(s.frames_skipped, 21 - fit);
        assert_eq!(s.frames_captured + s.frames_skipped, 21);
        let len = std::fs::metadata(&path).expect("metadata").len();
        assert!(len <= limit, "{len} > {limit}");
        assert!(len + rec > limit);
        assert_eq!(len, s.file_bytes);
        assert_eq!(records(&path).1.len() as u64, fit);
    }

    #[test]
    fn writing_to_a_full_device_counts_one_error_and_stops() {
        let path = Path::new("/dev/full");
        assert!(path.exists(), "/dev/full is absent: this test needs it");
        let (mut st, m) = PcapStage::create(PcapConfig::new(path)).expect("create");
        let t = now_ns();
        for i in 0..3 {
            let mut f = frame(tcp(i, 100));
            assert_eq!(st.on_frame(Direction::FromGuest, &mut f, t), Verdict::Pass);
        }
        st.tick(t);
        let mut f = frame(tcp(9, 100));
        assert_eq!(st.on_frame(Direction::ToGuest, &mut f, t), Verdict::Pass);
        st.tick(t);
        st.finish();
        let s = m.snapshot();
        assert_eq!(s.write_errors, 1);
        assert!(s.failed);
        assert_eq!((s.frames_captured, s.frames_skipped), (0, 4));
    }

    /// A writer that fails once `limit` bytes were written (and counts what it got).
    struct FailAfter {
        limit: usize,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for FailAfter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let mut got = self.got.lock().expect("lock");
            if got.len() + buf.len() > self.limit {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            got.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_write_error_mid_capture_keeps_what_was_flushed() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let out = FailAfter {
            limit: 3 * (1 << 20),
            got: Arc::clone(&got),
        };
        let (mut st, m) = PcapStage::with_writer(PcapConfig::new("/test/cap.pcap"), Box::new(out))
            .expect("create");
        let f = tcp(1, 1400);
        let t = now_ns();
        // A first batch that fits, flushed.
        for _ in 0..10 {
            st.on_frame(Direction::FromGuest, &mut frame(f.clone()), t);
        }
        st.tick(t);
        assert_eq!(m.snapshot().frames_captured, 10);
        // Then enough to overflow the writer: the buffer's own flushes hit the error.
        let mut n = 10;
        while !m.snapshot().failed {
            let mut fr = frame(f.clone());
            assert_eq!(st.on_frame(Direction::FromGuest, &mut fr, t), Verdict::Pass);
            n += 1;
            assert!(n < 10_000, "no error");
            if n % 100 == 0 {
                st.tick(t);
            }
        }
        for _ in 0..5 {
            st.on_frame(Direction::ToGuest, &mut frame(f.clone()), t);
            n += 1;
        }
        st.tick(t);
        st.finish();
        let s = m.snapshot();
        assert_eq!(s.write_errors, 1);
        assert!(s.frames_captured >= 10);
        assert_eq!(s.frames_captured + s.frames_skipped, n);
        // The file holds at least the flushed records, complete.
        let got = got.lock().expect("lock").clone();
        let mut r = PcapReader::new(io::Cursor::new(got)).expect("header");
        let mut complete = 0;
        while let Some(Ok(_)) = r.next_packet() {
            complete += 1;
        }
        assert!(
            complete >= s.frames_captured,
            "{complete} < {}",
            s.frames_captured
        );
    }

    #[test]
    fn create_errors_name_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing").join("cap.pcap");
        let e = PcapStage::create(PcapConfig::new(&path)).expect_err("no such directory");
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("cannot create capture file {}: ", path.display())),
            "{msg}"
        );
        assert!(msg.contains("No such file or directory"), "{msg}");
        let e = PcapStage::create(PcapConfig {
            snaplen: 0,
            ..PcapConfig::new(dir.path().join("x.pcap"))
        })
        .expect_err("snaplen 0");
        assert!(e.to_string().contains("x.pcap"), "{e}");
        assert!(!dir.path().join("x.pcap").exists());
    }

    #[test]
    fn timestamps_follow_the_monotonic_clock_from_the_wall_clock() {
        let (st, _m) =
            PcapStage::with_writer(PcapConfig::new("/t"), Box::new(io::sink())).expect("create");
        let t = now_ns();
        let a = st.timestamp(t);
        let b = st.timestamp(t + 1_500_000_000);
        assert_eq!(b - a, Duration::from_millis(1500));
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock");
        assert!(wall.saturating_sub(a) < Duration::from_secs(5));
        // Out-of-range clocks are clamped, never an error.
        assert!(st.timestamp(0) <= a);
        assert!(st.timestamp(u64::MAX).as_secs() <= u64::from(u32::MAX));
    }

    #[test]
    fn snapshot_round_trips_through_json() {
        let (mut st, m) =
            PcapStage::with_writer(PcapConfig::new("/x/y.pcap"), Box::new(io::sink()))
                .expect("create");
        st.on_frame(Direction::FromGuest, &mut frame(tcp(1, 10)), now_ns());
        st.finish();
        let s = m.snapshot();
        assert_eq!(s.path, "/x/y.pcap");
        assert_eq!(s.frames_captured, 1);
        let json = serde_json::to_string(&s).expect("serialize");
        let back: PcapSnapshot = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, s);
    }
}
