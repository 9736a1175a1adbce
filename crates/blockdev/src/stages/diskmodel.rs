//! A disk model stage: makes the (fast) host disk behave like an HDD or a SATA SSD by delaying
//! each request to the service time the model computes.
//!
//! It goes below the cache, just above the raw file, so it only sees requests the cache sends
//! down. Each request is executed on the host at once; its completion is held on a timer until
//! the modelled disk would have finished it, so host I/O time counts towards the modelled time
//! instead of adding to it. The modelled disk serves one request at a time in arrival order
//! (no command queueing): a request starts when the previous one is modelled to end. Nothing
//! sleeps; other requests keep flowing while completions wait.
//!
//! HDD (`DiskModelConfig::hdd()`, defaults of a 7200 rpm SATA disk):
//!
//! ```text
//! contiguous (starts where the previous request ended):  t = len / rate
//! otherwise:  t = seek(d) + rotation + len / rate
//!   seek(d)  = 0                                   if d = 0
//!            = settle + full_stroke * sqrt(d / span) otherwise (capped at d = span)
//!   rotation = half a revolution = 30 / rpm s       (fixed average: deterministic)
//!   d        = |start - head|, head = end of the previous request, span = disk capacity
//! ```
//!
//! The square-root seek curve is the classic model of an arm that accelerates over half the
//! distance and decelerates over the rest (Ruemmler & Wilkes, "An introduction to disk drive
//! modeling", 1994); settle 0.5 ms, full stroke 15 ms, 150 MB/s media rate. FLUSH and DISCARD
//! cost nothing modelled (the model already charges every write as reaching the media, and an
//! HDD ignores discards); WRITE_ZEROES is charged as a write of its bytes.
//!
//! SSD (`DiskModelConfig::ssd()`): reads `90 µs + len / 500 MB/s`, writes `40 µs + len / 500
//! MB/s`, no position dependence; FLUSH and DISCARD free.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::pipeline::{Io, Stage, StageError};
use crate::request::{Request, RequestKind};
use crate::timer::Timer;

/// Parameters of the HDD model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HddParams {
    /// Spindle speed; the average rotational latency is half a revolution.
    pub rpm: f64,
    /// Seek time for the shortest non-zero move (head settle), ms.
    pub settle_ms: f64,
    /// Extra seek time of a full-stroke move (over `span`), ms.
    pub full_stroke_ms: f64,
    /// Media transfer rate, MB/s (10^6 bytes).
    pub mbps: f64,
    /// Bytes a full stroke covers; `None` = the disk's capacity.
    pub span_bytes: Option<u64>,
}

/// Parameters of the SSD model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SsdParams {
    /// Fixed latency of a read, µs.
    pub read_us: f64,
    /// Fixed latency of a write, µs.
    pub write_us: f64,
    /// Transfer rate, MB/s (10^6 bytes).
    pub mbps: f64,
}

/// Which disk to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model", rename_all = "lowercase")]
pub enum DiskModelConfig {
    /// No delay: the host disk as it is.
    None,
    /// A magnetic disk.
    Hdd(HddParams),
    /// A SATA SSD.
    Ssd(SsdParams),
}

impl DiskModelConfig {
    /// 7200 rpm, settle 0.5 ms, full stroke 15 ms, 150 MB/s, span = disk capacity.
    pub fn hdd() -> Self {
        Self::Hdd(HddParams {
            rpm: 7200.0,
            settle_ms: 0.5,
            full_stroke_ms: 15.0,
            mbps: 150.0,
            span_bytes: None,
        })
    }

    /// Reads 90 µs, writes 40 µs, plus 500 MB/s.
    pub fn ssd() -> Self {
        Self::Ssd(SsdParams {
            read_us: 90.0,
            write_us: 40.0,
            mbps: 500.0,
        })
    }

    /// One line naming the model and every parameter, for benchmark results. `capacity` is
    /// the disk size used when the HDD span is not set.
    pub fn describe(&self, capacity_bytes: u64) -> String {
        match self {
            Self::None => "none (host disk as is)".into(),
            Self::Hdd(p) => format!(
                "hdd: {} rpm (avg rotational {:.2} ms), seek {} ms + {} ms x sqrt(distance/{:.2} GiB), \
                 {} MB/s, contiguous requests skip seek and rotation, flush/discard free",
                p.rpm,
                rotation_ms(p.rpm),
                p.settle_ms,
                p.full_stroke_ms,
                p.span_bytes.unwrap_or(capacity_bytes) as f64 / f64::from(1u32 << 30),
                p.mbps
            ),
            Self::Ssd(p) => format!(
                "ssd: read {} us, write {} us, + size / {} MB/s, flush/discard free",
                p.read_us, p.write_us, p.mbps
            ),
        }
    }
}

impl fmt::Display for DiskModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Hdd(_) => "hdd",
            Self::Ssd(_) => "ssd",
        })
    }
}

/// Errors parsing `--disk-model`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiskModelError {
    /// Not hdd, ssd or none.
    #[error("unknown disk model {0:?}; expected \"hdd\", \"ssd\" or \"none\" (optionally \"hdd:rpm=5400,seek_ms=12\")")]
    Unknown(String),
    /// A parameter the model does not have.
    #[error("disk model {model} has no parameter {key:?}; it takes {allowed}")]
    UnknownKey {
        /// hdd or ssd.
        model: &'static str,
        /// The offending key.
        key: String,
        /// The accepted keys.
        allowed: &'static str,
    },
    /// A value that is not a positive number.
    #[error("disk model parameter {key}={value:?} is not a positive number")]
    BadValue {
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// `none` takes no parameters.
    #[error("disk model \"none\" takes no parameters")]
    NoneWithParams,
}

const HDD_KEYS: &str = "rpm, settle_ms, seek_ms (full stroke), mbps, span_gib";
const SSD_KEYS: &str = "read_us, write_us, mbps";

impl FromStr for DiskModelConfig {
    type Err = DiskModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (name, params) = match s.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (s, None),
        };
        let mut cfg = match name.to_ascii_lowercase().as_str() {
            "none" => {
                return match params {
                    Some(p) if !p.trim().is_empty() => Err(DiskModelError::NoneWithParams),
                    _ => Ok(Self::None),
                }
            }
            "hdd" => Self::hdd(),
            "ssd" => Self::ssd(),
            _ => return Err(DiskModelError::Unknown(s.to_owned())),
        };
        for kv in params
            .unwrap_or("")
            .split(',')
            .filter(|p| !p.trim().is_empty())
        {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let (k, v) = (k.trim(), v.trim());
            let num: f64 = v
                .parse()
                .ok()
                .filter(|x: &f64| x.is_finite() && *x > 0.0)
                .ok_or_else(|| DiskModelError::BadValue {
                    key: k.to_owned(),
                    value: v.to_owned(),
                })?;
            let unknown = |model, allowed| DiskModelError::UnknownKey {
                model,
                key: k.to_owned(),
                allowed,
            };
            match &mut cfg {
                Self::Hdd(p) => match k {
                    "rpm" => p.rpm = num,
                    "settle_ms" => p.settle_ms = num,
                    "seek_ms" | "full_stroke_ms" => p.full_stroke_ms = num,
                    "mbps" => p.mbps = num,
                    "span_gib" => p.span_bytes = Some((num * f64::from(1u32 << 30)) as u64),
                    _ => return Err(unknown("hdd", HDD_KEYS)),
                },
                Self::Ssd(p) => match k {
                    "read_us" => p.read_us = num,
                    "write_us" => p.write_us = num,
                    "mbps" => p.mbps = num,
                    _ => return Err(unknown("ssd", SSD_KEYS)),
                },
                Self::None => return Err(DiskModelError::NoneWithParams),
            }
        }
        Ok(cfg)
    }
}

fn rotation_ms(rpm: f64) -> f64 {
    30_000.0 / rpm
}

fn transfer_ns(bytes: u64, mbps: f64) -> f64 {
    bytes as f64 * 1_000.0 / mbps
}

/// Where the modelled head is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Head {
    /// End of the previous request (byte offset), if any.
    last_end: Option<u64>,
}

/// The model's verdict on one request.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Service {
    ns: f64,
    /// The head moved.
    seek: bool,
    /// The request continued the previous one (transfer only).
    contiguous: bool,
}

/// The pure model: service time of one request given the head position, and the new head.
fn service(
    cfg: &DiskModelConfig,
    span: u64,
    head: &mut Head,
    kind: RequestKind,
    offset: u64,
    len: u64,
) -> Service {
    let none = Service {
        ns: 0.0,
        seek: false,
        contiguous: false,
    };
    match cfg {
        DiskModelConfig::None => none,
        DiskModelConfig::Ssd(p) => match kind {
            RequestKind::Read => Service {
                ns: p.read_us * 1e3 + transfer_ns(len, p.mbps),
                ..none
            },
            RequestKind::Write | RequestKind::WriteZeroes => Service {
                ns: p.write_us * 1e3 + transfer_ns(len, p.mbps),
                ..none
            },
            _ => none,
        },
        DiskModelConfig::Hdd(p) => {
            if !matches!(
                kind,
                RequestKind::Read | RequestKind::Write | RequestKind::WriteZeroes
            ) {
                return none;
            }
            let xfer = transfer_ns(len, p.mbps);
            let contiguous = head.last_end == Some(offset);
            let from = head.last_end.unwrap_or(0);
            head.last_end = Some(offset.saturating_add(len));
            if contiguous {
                return Service {
                    ns: xfer,
                    seek: false,
                    contiguous: true,
                };
            }
            let d = from.abs_diff(offset);
            let seek_ms = if d == 0 {
                0.0
            } else {
                let frac = (d as f64 / span.max(1) as f64).min(1.0);
                p.settle_ms + p.full_stroke_ms * frac.sqrt()
            };
            Service {
                ns: (seek_ms + rotation_ms(p.rpm)) * 1e6 + xfer,
                seek: d != 0,
                contiguous: false,
            }
        }
    }
}

/// A modelled disk for a synchronous owner that issues its own I/Os at byte positions of one
/// address space (e.g. a dedup volume's data and metadata files laid out on one spindle):
/// [`ModelClock::charge`] adds each I/O's service time to the disk's busy period, and the
/// owner waits with [`ModelClock::wait`] before it answers the guest. One request at a time,
/// in the order charged, as [`DiskModel`] does.
#[derive(Debug)]
pub struct ModelClock {
    cfg: DiskModelConfig,
    span: u64,
    head: Head,
    busy_until: Option<Instant>,
    /// Sum of the modelled service times, ns.
    pub modelled_ns: u64,
    /// I/Os that needed a head move.
    pub seeks: u64,
}

impl ModelClock {
    /// A model of `cfg` over an address space of `span_bytes` (the HDD's full stroke unless
    /// its `span_gib` is set).
    pub fn new(cfg: DiskModelConfig, span_bytes: u64) -> Self {
        let span = match cfg {
            DiskModelConfig::Hdd(p) => p.span_bytes.unwrap_or(span_bytes),
            _ => span_bytes,
        };
        Self {
            cfg,
            span,
            head: Head::default(),
            busy_until: None,
            modelled_ns: 0,
            seeks: 0,
        }
    }

    /// Whether the model delays anything.
    pub fn is_active(&self) -> bool {
        !matches!(self.cfg, DiskModelConfig::None)
    }

    /// Charges one I/O of `len` bytes at `offset` (reads, writes and write-zeroes cost; FLUSH
    /// and DISCARD are free) and returns its modelled service time.
    pub fn charge(&mut self, kind: RequestKind, offset: u64, len: u64) -> Duration {
        let svc = service(&self.cfg, self.span, &mut self.head, kind, offset, len);
        let d = Duration::from_nanos(svc.ns.max(0.0) as u64);
        if d.is_zero() {
            return d;
        }
        let now = Instant::now();
        let start = self.busy_until.map_or(now, |b| b.max(now));
        self.busy_until = Some(start + d);
        self.modelled_ns += d.as_nanos() as u64;
        self.seeks += u64::from(svc.seek);
        d
    }

    /// Sleeps until the modelled disk has finished everything charged so far; returns how
    /// long it slept. Only for threads that may block.
    pub fn wait(&mut self) -> Duration {
        let Some(due) = self.busy_until else {
            return Duration::ZERO;
        };
        let now = Instant::now();
        if due <= now {
            return Duration::ZERO;
        }
        let d = due - now;
        std::thread::sleep(d);
        d
    }
}

/// Live counters of a disk model.
#[derive(Debug)]
pub struct DiskModelMetrics {
    description: String,
    /// Requests that went through the model.
    pub requests: AtomicU64,
    /// Sum of modelled service times, ns.
    pub modelled_busy_ns: AtomicU64,
    /// Sum of host I/O times, ns.
    pub host_ns: AtomicU64,
    /// Sum of the time completions were held past their host I/O, ns.
    pub slept_ns: AtomicU64,
    /// Requests that needed a head move.
    pub seeks: AtomicU64,
    /// Requests contiguous to the previous one (no seek, no rotation).
    pub sequential: AtomicU64,
    /// Requests whose host I/O took longer than the model (the model could not slow them).
    pub overruns: AtomicU64,
    /// Bytes read / written through the model (what reached the modelled disk).
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
}

impl DiskModelMetrics {
    /// The model's one-line description (the same as [`DiskModelConfig::describe`]).
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> DiskModelSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DiskModelSnapshot {
            model: self.description.clone(),
            requests: g(&self.requests),
            modelled_busy_ns: g(&self.modelled_busy_ns),
            host_ns: g(&self.host_ns),
            slept_ns: g(&self.slept_ns),
            seeks: g(&self.seeks),
            sequential: g(&self.sequential),
            overruns: g(&self.overruns),
            read_bytes: g(&self.read_bytes),
            write_bytes: g(&self.write_bytes),
        }
    }
}

/// Serialisable copy of [`DiskModelMetrics`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskModelSnapshot {
    /// The model and its parameters.
    pub model: String,
    /// Requests that went through the model.
    pub requests: u64,
    /// Sum of modelled service times, ns.
    pub modelled_busy_ns: u64,
    /// Sum of host I/O times, ns.
    pub host_ns: u64,
    /// Sum of the time completions were held past their host I/O, ns.
    pub slept_ns: u64,
    /// Requests that needed a head move.
    pub seeks: u64,
    /// Requests contiguous to the previous one.
    pub sequential: u64,
    /// Requests whose host I/O outlasted the model.
    pub overruns: u64,
    /// Bytes read / written through the model.
    #[serde(default)]
    pub read_bytes: u64,
    #[serde(default)]
    pub write_bytes: u64,
}

/// The modelled disk's state: where its head is and until when it is busy.
#[derive(Debug, Default)]
struct ModelState {
    head: Head,
    busy_until: Option<Instant>,
}

/// The disk model stage.
pub struct DiskModel {
    cfg: DiskModelConfig,
    span: u64,
    state: Mutex<ModelState>,
    metrics: Arc<DiskModelMetrics>,
    timer: Arc<Timer>,
}

impl fmt::Debug for DiskModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskModel")
            .field("cfg", &self.cfg)
            .field("span", &self.span)
            .finish()
    }
}

impl DiskModel {
    /// A model of `cfg` for a disk of `capacity_bytes` (the HDD seek span unless set), with
    /// its timer thread.
    pub fn new(
        cfg: DiskModelConfig,
        capacity_bytes: u64,
    ) -> Result<(Self, Arc<DiskModelMetrics>), StageError> {
        let span = match cfg {
            DiskModelConfig::Hdd(p) => p.span_bytes.unwrap_or(capacity_bytes),
            _ => capacity_bytes,
        };
        let metrics = Arc::new(DiskModelMetrics {
            description: cfg.describe(capacity_bytes),
            requests: AtomicU64::new(0),
            modelled_busy_ns: AtomicU64::new(0),
            host_ns: AtomicU64::new(0),
            slept_ns: AtomicU64::new(0),
            seeks: AtomicU64::new(0),
            sequential: AtomicU64::new(0),
            overruns: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
        });
        let model = Self {
            cfg,
            span,
            state: Mutex::new(ModelState::default()),
            metrics: metrics.clone(),
            timer: Arc::new(Timer::new("disk-model")?),
        };
        Ok((model, metrics))
    }

    /// Like [`new`](Self::new), boxed for `spawn_backend_with`.
    pub fn stage(
        cfg: DiskModelConfig,
        capacity_bytes: u64,
    ) -> Result<(Box<dyn Stage>, Arc<DiskModelMetrics>), StageError> {
        let (s, m) = Self::new(cfg, capacity_bytes)?;
        Ok((Box::new(s), m))
    }

    /// Modelled service time of `req` and the instant the modelled disk finishes it (the
    /// disk serves one request at a time, in arrival order: no command queueing).
    fn schedule(&self, req: &Request, now: Instant) -> (Service, Instant) {
        let (offset, len) = match req.kind {
            RequestKind::WriteZeroes => (
                req.ranges.first().map_or(0, |r| r.offset()),
                req.ranges.iter().map(|r| r.bytes()).sum(),
            ),
            _ => (req.offset(), req.len),
        };
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let svc = service(&self.cfg, self.span, &mut st.head, req.kind, offset, len);
        let start = st.busy_until.map_or(now, |b| b.max(now));
        let due = start + Duration::from_nanos(svc.ns.max(0.0) as u64);
        st.busy_until = Some(due);
        (svc, due)
    }

    fn count(&self, kind: RequestKind, len: u64, svc: &Service) {
        let m = &self.metrics;
        m.requests.fetch_add(1, Ordering::Relaxed);
        match kind {
            RequestKind::Read => m.read_bytes.fetch_add(len, Ordering::Relaxed),
            RequestKind::Write => m.write_bytes.fetch_add(len, Ordering::Relaxed),
            _ => 0,
        };
        m.modelled_busy_ns
            .fetch_add(svc.ns.max(0.0) as u64, Ordering::Relaxed);
        if matches!(
            kind,
            RequestKind::Read | RequestKind::Write | RequestKind::WriteZeroes
        ) {
            if svc.seek {
                m.seeks.fetch_add(1, Ordering::Relaxed);
            }
            if svc.contiguous {
                m.sequential.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Stage for DiskModel {
    fn name(&self) -> &str {
        "disk-model"
    }

    /// The request runs on the host at once; its completion is held on the timer until the
    /// modelled disk would have finished it, so host I/O time counts towards the modelled
    /// time instead of adding to it. Nothing blocks: other requests keep flowing.
    fn submit(&self, io: Io) {
        let now = Instant::now();
        let (svc, due) = self.schedule(io.request(), now);
        self.count(io.request().kind, io.request().len, &svc);
        if svc.ns <= 0.0 {
            io.forward();
            return;
        }
        let timer = self.timer.clone();
        let m = self.metrics.clone();
        io.forward_then(move |io, result| {
            let done = Instant::now();
            m.host_ns.fetch_add(
                u64::try_from(done.duration_since(now).as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            if done < due {
                m.slept_ns.fetch_add(
                    u64::try_from((due - done).as_nanos()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                timer.at(due, move || io.complete(result));
            } else {
                m.overruns.fetch_add(1, Ordering::Relaxed);
                io.complete(result);
            }
        });
    }

    fn release(&self) {
        self.timer.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn hdd_service(head: &mut Head, kind: RequestKind, off: u64, len: u64) -> Service {
        service(&DiskModelConfig::hdd(), 10 * GIB, head, kind, off, len)
    }

    #[test]
    fn hdd_random_read_pays_seek_rotation_and_transfer() {
        let mut head = Head { last_end: Some(0) };
        // A quarter of the span away: settle + 15 ms * sqrt(1/4) = 0.5 + 7.5 ms.
        let s = hdd_service(&mut head, RequestKind::Read, 10 * GIB / 4, 4096);
        let rot = 30_000.0 / 7200.0; // 4.1667 ms
        let xfer_ns = 4096.0 * 1000.0 / 150.0; // 27.3 µs
        let expect = (0.5 + 7.5 + rot) * 1e6 + xfer_ns;
        assert!((s.ns - expect).abs() < 1.0, "{} vs {expect}", s.ns);
        assert!(s.seek);
        assert_eq!(head.last_end, Some(10 * GIB / 4 + 4096));
    }

    #[test]
    fn hdd_contiguous_request_is_transfer_only() {
        let mut head = Head::default();
        let _ = hdd_service(&mut head, RequestKind::Write, 1 << 20, 1 << 20);
        let s = hdd_service(&mut head, RequestKind::Write, 2 << 20, 1 << 20);
        assert!(!s.seek && s.contiguous);
        let expect = (1u64 << 20) as f64 * 1000.0 / 150.0; // ~7 ms for 1 MiB
        assert!((s.ns - expect).abs() < 1.0);
    }

    #[test]
    fn hdd_seek_grows_with_distance_and_caps_at_full_stroke() {
        let times: Vec<f64> = [4096u64, GIB, 5 * GIB, 10 * GIB, 100 * GIB]
            .iter()
            .map(|&d| {
                let mut head = Head { last_end: Some(0) };
                hdd_service(&mut head, RequestKind::Read, d, 512).ns
            })
            .collect();
        for w in times.windows(2) {
            assert!(w[0] <= w[1], "{times:?}");
        }
        let full = (0.5 + 15.0 + 30_000.0 / 7200.0) * 1e6 + 512.0 * 1000.0 / 150.0;
        assert!((times[3] - full).abs() < 1.0);
        assert!(
            (times[4] - full).abs() < 1.0,
            "beyond the span is a full stroke"
        );
        // Just behind the head is a (short) seek; exactly at it is contiguous.
        let mut head = Head {
            last_end: Some(8192),
        };
        let s = hdd_service(&mut head, RequestKind::Read, 8192 - 512, 512);
        assert!(s.seek);
        let mut head = Head {
            last_end: Some(4096),
        };
        let s = hdd_service(&mut head, RequestKind::Read, 4096, 512);
        assert!(!s.seek && s.contiguous);
    }

    #[test]
    fn flush_and_discard_are_free_and_do_not_move_the_head() {
        let mut head = Head {
            last_end: Some(4096),
        };
        for k in [RequestKind::Flush, RequestKind::Discard] {
            assert_eq!(hdd_service(&mut head, k, 0, 0).ns, 0.0);
        }
        assert_eq!(head.last_end, Some(4096));
    }

    #[test]
    fn ssd_is_base_latency_plus_transfer() {
        let cfg = DiskModelConfig::ssd();
        let mut head = Head::default();
        let r = service(&cfg, GIB, &mut head, RequestKind::Read, 123 << 20, 4096);
        assert!((r.ns - (90_000.0 + 4096.0 * 1000.0 / 500.0)).abs() < 1.0);
        let w = service(&cfg, GIB, &mut head, RequestKind::Write, 0, 1 << 20);
        assert!((w.ns - (40_000.0 + (1u64 << 20) as f64 * 2.0)).abs() < 1.0);
        assert!(!r.seek && !w.seek);
        let n = service(
            &DiskModelConfig::None,
            GIB,
            &mut head,
            RequestKind::Read,
            0,
            4096,
        );
        assert_eq!(n.ns, 0.0);
    }

    #[test]
    fn parses_names_and_parameters_with_clear_errors() {
        assert_eq!("none".parse::<DiskModelConfig>(), Ok(DiskModelConfig::None));
        assert_eq!("HDD".parse::<DiskModelConfig>(), Ok(DiskModelConfig::hdd()));
        assert_eq!("ssd".parse::<DiskModelConfig>(), Ok(DiskModelConfig::ssd()));
        let DiskModelConfig::Hdd(p) = "hdd:rpm=5400,seek_ms=12,mbps=100,span_gib=2"
            .parse::<DiskModelConfig>()
            .expect("params")
        else {
            panic!("not hdd");
        };
        assert_eq!((p.rpm, p.full_stroke_ms, p.mbps), (5400.0, 12.0, 100.0));
        assert_eq!(p.span_bytes, Some(2 * GIB));
        let e = "tape".parse::<DiskModelConfig>().expect_err("unknown");
        assert!(e.to_string().contains("expected \"hdd\""), "{e}");
        let e = "ssd:rpm=1".parse::<DiskModelConfig>().expect_err("key");
        assert!(e.to_string().contains("read_us"), "{e}");
        let e = "hdd:rpm=-3".parse::<DiskModelConfig>().expect_err("value");
        assert!(e.to_string().contains("positive"), "{e}");
        assert!("none:x=1".parse::<DiskModelConfig>().is_err());
    }

    #[test]
    fn describe_names_every_parameter() {
        let d = DiskModelConfig::hdd().describe(8 * GIB);
        for part in [
            "7200 rpm", "4.17 ms", "0.5 ms", "15 ms", "8.00 GiB", "150 MB/s",
        ] {
            assert!(d.contains(part), "{part} missing in {d}");
        }
        let d = DiskModelConfig::ssd().describe(GIB);
        assert!(
            d.contains("90 us") && d.contains("40 us") && d.contains("500 MB/s"),
            "{d}"
        );
        let (_, m) = DiskModel::new(DiskModelConfig::ssd(), GIB).expect("model");
        assert_eq!(m.describe(), d);
        assert_eq!(m.snapshot().model, d);
    }

    #[test]
    fn stage_counts_requests_and_seeks() {
        use crate::pipeline::{Pipeline, Status};
        use crate::request::Segment;
        use crate::stages::memdisk::MemDisk;
        use vm_memory::{GuestAddress, GuestMemoryMmap};
        // A tiny custom HDD so the sleeps stay short (microseconds).
        let cfg: DiskModelConfig = "hdd:rpm=6000000,settle_ms=0.001,seek_ms=0.001,mbps=100000"
            .parse()
            .expect("cfg");
        let (stage, m) = DiskModel::stage(cfg, 1 << 20).expect("model");
        let mut p = Pipeline::new(Box::new(MemDisk::new(1 << 20)));
        p.push(stage).expect("push");
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).expect("mem");
        let seg = Segment {
            addr: GuestAddress(0),
            len: 4096,
        };
        for sector in [0u64, 8, 800, 808] {
            let mut r = Request::new_for_test(&mem, RequestKind::Read, sector, vec![seg]);
            assert_eq!(p.run(&mut r).expect("run"), Status::Ok);
        }
        let s = m.snapshot();
        assert_eq!(s.requests, 4);
        // The first request finds the head at 0 (no move, but a rotation), 8 follows 0,
        // 800 is a seek, 808 follows it.
        assert_eq!((s.seeks, s.sequential), (1, 2));
        assert!(s.modelled_busy_ns > 0);
        assert_eq!((s.read_bytes, s.write_bytes), (4 * 4096, 0));
    }
}
