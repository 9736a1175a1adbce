//! The share-size controller of a running VM (Hylics §5, `--hylics-slo`): the profiler that
//! takes the guest library's task reports, the thread that runs Algorithm 1
//! ([`vmsight_hylics::Controller`]) whenever the control interval expires and resizes the
//! share, the eviction advice for the guest when a shrink does not fit, and the JSON decision
//! log.
//!
//! ```text
//!  guest libhylics ──vsock──► offload service ──report()──► [bounded channel]
//!                                                               │
//!       controller thread: collect until ci expires ─► step ─► log line
//!                                                               └─► Share::resize(m)
//!                                   refused (files in the way) ─► advice: coldest files
//! ```
//!
//! Reports are hostile input: a response time must be finite and within
//! [`MAX_RESPONSE_SECS`]; the channel and each interval's list are bounded, and what does not
//! fit is counted, never stored.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use vmsight_hylics::{
    bytes_to_free, cold_files_to_evict, Controller, ControllerConfig, LogHeader, LogRecord,
    Measurement, ShareFile,
};
use vmsight_proto::hylics::{ControllerStatus, MAX_ADVICE_FILES, MAX_RESPONSE_SECS};

use super::{Share, ShareError};

/// Reports queued between the vsock service and the controller thread.
const CHANNEL_DEPTH: usize = 65_536;
/// Response times kept per control interval (more are counted as rejected).
const MAX_TASKS_PER_INTERVAL: usize = 1_000_000;
/// Files looked at when choosing what to evict.
const MAX_SCAN_FILES: usize = 100_000;

/// Why the controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("the Hylics controller: {0}")]
    Config(#[from] vmsight_hylics::ConfigError),
    #[error("cannot write the Hylics decision log {path}: {source}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the Hylics controller thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A task report the guest sent that the controller does not take.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("response_secs {0} is not a finite number of seconds in [0, {MAX_RESPONSE_SECS}]")]
    BadResponse(f64),
    #[error("the controller is overloaded with reports; this one was dropped")]
    Overloaded,
    #[error("the controller has stopped")]
    Stopped,
}

enum Event {
    Arrive,
    Done(f64),
    Stop,
}

/// What the guest should move out of the share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Advice {
    /// Bytes the share must lose to fit the controller's size.
    pub free_bytes: u64,
    /// Paths relative to the share's root (with a leading `/`), coldest first.
    pub evict: Vec<String>,
}

/// The running controller.
pub struct ShareController {
    tx: SyncSender<Event>,
    state: Arc<Mutex<State>>,
    counters: Arc<Counters>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for ShareController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareController")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

/// Report counters, updated without the state lock.
#[derive(Debug, Default)]
struct Counters {
    tasks: AtomicU64,
    arrivals: AtomicU64,
    rejected: AtomicU64,
}

/// What the thread publishes for the status and the advice.
#[derive(Debug, Clone)]
struct State {
    status: ControllerStatus,
    advice: Advice,
}

impl ShareController {
    /// Starts the controller of `share` (whose size is the controller's start), writing the
    /// decision log to `log` if given.
    pub fn start(
        config: ControllerConfig,
        share: Arc<Share>,
        log: Option<&Path>,
    ) -> Result<Arc<ShareController>, ControlError> {
        let controller = Controller::new(config.clone())?;
        let log_writer = log.map(|p| open_log(p, &config)).transpose()?;
        let state = Arc::new(Mutex::new(State {
            status: initial_status(&config, &share, log),
            advice: Advice::default(),
        }));
        let counters = Arc::new(Counters::default());
        let (tx, rx) = mpsc::sync_channel(CHANNEL_DEPTH);
        let worker = Worker {
            controller,
            share,
            log: log_writer,
            state: state.clone(),
            counters: counters.clone(),
            arrivals_reported: false,
        };
        let thread = std::thread::Builder::new()
            .name("vmsight-hylics-ctl".into())
            .spawn(move || worker.run(rx))
            .map_err(ControlError::Thread)?;
        Ok(Arc::new(ShareController {
            tx,
            state,
            counters,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// The guest reported a task arrival.
    pub fn arrived(&self) -> Result<(), ReportError> {
        self.send(Event::Arrive)
    }

    /// The guest reported a completed task and its response time.
    pub fn done(&self, response_secs: f64) -> Result<(), ReportError> {
        if !(response_secs.is_finite() && (0.0..=MAX_RESPONSE_SECS).contains(&response_secs)) {
            self.counters.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ReportError::BadResponse(response_secs));
        }
        self.send(Event::Done(response_secs))
    }

    fn send(&self, e: Event) -> Result<(), ReportError> {
        match self.tx.try_send(e) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                Err(ReportError::Overloaded)
            }
            Err(TrySendError::Disconnected(_)) => Err(ReportError::Stopped),
        }
    }

    /// The files the guest should move out, at most [`MAX_ADVICE_FILES`] at a time.
    pub fn advice(&self) -> Advice {
        let Ok(mut st) = self.state.lock() else {
            return Advice::default();
        };
        let mut advice = st.advice.clone();
        advice.evict.truncate(MAX_ADVICE_FILES);
        st.status.advised_files += advice.evict.len() as u64;
        advice
    }

    /// The controller's state now.
    pub fn status(&self) -> ControllerStatus {
        let mut s = match self.state.lock() {
            Ok(st) => st.status.clone(),
            Err(p) => p.into_inner().status.clone(),
        };
        s.tasks = self.counters.tasks.load(Ordering::Relaxed);
        s.arrivals = self.counters.arrivals.load(Ordering::Relaxed);
        s.rejected_reports = self.counters.rejected.load(Ordering::Relaxed);
        s
    }

    /// Stops the thread (the log is flushed) and returns the final state. Idempotent.
    pub fn stop(&self) -> ControllerStatus {
        let _ = self.tx.send(Event::Stop);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
        self.status()
    }
}

/// One line for `--stats` and `vmsight hylics NAME controller`.
pub fn summary(s: &ControllerStatus) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let r = s
        .last_r_secs
        .map_or_else(|| "-".to_owned(), |r| format!("{r:.3} s"));
    format!(
        "controller {} (tau {:.3} s): target {:.1} MiB, share {:.1} MiB, last R {r}, {} decisions, {} tasks, {} arrivals, {} reports rejected, {} shrinks refused, {} files advised, next interval {:.1} s",
        s.mode,
        s.tau_secs,
        mib(s.target_bytes),
        mib(s.share_bytes),
        s.decisions,
        s.tasks,
        s.arrivals,
        s.rejected_reports,
        s.refused_shrinks,
        s.advised_files,
        s.ci_secs
    )
}

fn initial_status(
    config: &ControllerConfig,
    share: &Share,
    log: Option<&Path>,
) -> ControllerStatus {
    ControllerStatus {
        mode: config.mode.name().into(),
        tau_secs: config.tau_secs,
        target_bytes: config.m_initial_bytes,
        share_bytes: share.size(),
        ci_secs: config.ci_initial_secs,
        decisions: 0,
        tasks: 0,
        arrivals: 0,
        rejected_reports: 0,
        refused_shrinks: 0,
        advised_files: 0,
        last_r_secs: None,
        last_lambda: None,
        last_reasons: Vec::new(),
        log: log.map(|p| p.display().to_string()),
    }
}

/// Creates the log and writes its header (the configuration, so the log replays alone).
fn open_log(path: &Path, config: &ControllerConfig) -> Result<BufWriter<File>, ControlError> {
    let err = |source| ControlError::Log {
        path: path.to_owned(),
        source,
    };
    let mut w = BufWriter::new(File::create(path).map_err(err)?);
    let header = LogHeader::new(config.clone())
        .to_line()
        .map_err(|e| err(std::io::Error::other(e)))?;
    w.write_all(header.as_bytes()).map_err(err)?;
    w.flush().map_err(err)?;
    Ok(w)
}

/// The controller thread's own state.
struct Worker {
    controller: Controller,
    share: Arc<Share>,
    log: Option<BufWriter<File>>,
    state: Arc<Mutex<State>>,
    counters: Arc<Counters>,
    /// Whether the guest ever sent an arrival: if not, completions stand in for arrivals.
    arrivals_reported: bool,
}

/// One control interval's reports.
#[derive(Default)]
struct Interval {
    responses: Vec<f64>,
    arrivals: u64,
}

impl Worker {
    fn run(mut self, rx: Receiver<Event>) {
        let t0 = Instant::now();
        let mut start = 0.0;
        let mut interval = Interval::default();
        loop {
            let deadline = start + self.controller.ci_secs();
            let wait = (deadline - t0.elapsed().as_secs_f64()).max(0.0);
            match rx.recv_timeout(Duration::from_secs_f64(wait)) {
                Ok(Event::Arrive) => {
                    self.arrivals_reported = true;
                    self.counters.arrivals.fetch_add(1, Ordering::Relaxed);
                    interval.arrivals += 1;
                }
                Ok(Event::Done(r)) => self.record(&mut interval, r),
                Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    let now = t0.elapsed().as_secs_f64();
                    self.step(start, now, std::mem::take(&mut interval));
                    start = now;
                }
            }
        }
        if !interval.responses.is_empty() || interval.arrivals > 0 {
            // The last, partial interval: logged so the log holds every reported task (and
            // replays), but not applied, since the share is going away with the VM.
            let now = t0.elapsed().as_secs_f64();
            let record = self.decide(start, now, interval);
            self.write_log(&record);
            if let Ok(mut st) = self.state.lock() {
                st.status.decisions = record.decision.k + 1;
            }
        }
        if let Some(w) = &mut self.log {
            let _ = w.flush();
        }
    }

    fn record(&self, interval: &mut Interval, r: f64) {
        self.counters.tasks.fetch_add(1, Ordering::Relaxed);
        if interval.responses.len() < MAX_TASKS_PER_INTERVAL {
            interval.responses.push(r);
        } else {
            self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The controller's decision on the interval `[start, now)`.
    fn decide(&mut self, start: f64, now: f64, interval: Interval) -> LogRecord {
        let arrivals = if self.arrivals_reported {
            interval.arrivals
        } else {
            interval.responses.len() as u64
        };
        let input = Measurement {
            start_secs: start,
            t_secs: now,
            response_times_secs: interval.responses,
            arrivals,
        };
        self.controller.step_logged(now, input)
    }

    /// The interval `[start, now)` is over: decide, log, apply.
    fn step(&mut self, start: f64, now: f64, interval: Interval) {
        let record = self.decide(start, now, interval);
        self.write_log(&record);
        let target = record.decision.m_after_bytes;
        let refused = self.apply(target);
        self.publish(&record, refused);
    }

    fn write_log(&mut self, record: &LogRecord) {
        let Some(w) = &mut self.log else {
            return;
        };
        let line = serde_json::to_string(record).map_err(std::io::Error::other);
        let res = line.and_then(|l| {
            w.write_all(l.as_bytes())?;
            w.write_all(b"\n")?;
            w.flush()
        });
        if let Err(e) = res {
            tracing::warn!(error = %e, "hylics: the decision log is incomplete; logging stops");
            self.log = None;
        }
    }

    /// Resizes the share to `target` unless it is there already; on a refused shrink the
    /// advice names the coldest files. Returns whether the shrink was refused.
    fn apply(&self, target: u64) -> Option<Advice> {
        if self.share.size() == target {
            return None;
        }
        match self.share.resize(target) {
            Ok(_) => None,
            Err(ShareError::InUse { used, .. }) => Some(eviction_advice(
                self.share.dir(),
                bytes_to_free(used, target),
            )),
            Err(e) => {
                tracing::warn!(error = %e, target, "hylics: the controller's resize failed");
                None
            }
        }
    }

    fn publish(&self, record: &LogRecord, refused: Option<Advice>) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        let d = &record.decision;
        let s = &mut st.status;
        s.target_bytes = d.m_after_bytes;
        s.share_bytes = self.share.size();
        s.ci_secs = d.next_ci_secs;
        s.decisions = d.k + 1;
        s.last_r_secs = d.measured_r_secs.or(s.last_r_secs);
        s.last_lambda = d.lambda;
        s.last_reasons = d
            .reasons
            .iter()
            .map(|r| {
                serde_json::to_value(r)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
            })
            .map(|r| r.unwrap_or_default())
            .collect();
        if refused.is_some() {
            s.refused_shrinks += 1;
        }
        st.advice = refused.unwrap_or_default();
    }
}

/// The coldest files of the share (host view) adding up to `free_bytes`.
fn eviction_advice(dir: &Path, free_bytes: u64) -> Advice {
    let files = share_files(dir);
    let plan = cold_files_to_evict(&files, free_bytes);
    Advice {
        free_bytes,
        evict: plan
            .files
            .iter()
            .map(|f| format!("/{}", f.path.display()))
            .collect(),
    }
}

/// Regular files under `dir` (relative paths), with their size and last use (the later of
/// access and modification: tmpfs keeps atime with relatime). Symlinks are not followed;
/// the walk stops after [`MAX_SCAN_FILES`] entries.
fn share_files(dir: &Path) -> Vec<ShareFile> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    let mut seen = 0usize;
    while let Some(rel) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(dir.join(&rel)) else {
            continue;
        };
        for e in entries.flatten() {
            seen += 1;
            if seen > MAX_SCAN_FILES {
                return out;
            }
            let Ok(md) = e.metadata() else { continue };
            let path = rel.join(e.file_name());
            if md.is_dir() {
                stack.push(path);
            } else if md.is_file() {
                out.push(ShareFile {
                    path,
                    size_bytes: md.len(),
                    last_access_secs: last_use_secs(&md),
                });
            }
        }
    }
    out
}

fn last_use_secs(md: &std::fs::Metadata) -> f64 {
    let secs = |t: std::io::Result<SystemTime>| {
        t.ok()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64())
    };
    secs(md.accessed()).max(secs(md.modified()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hylics::spec::{CacheMode, ShareSpec};
    use std::time::Duration;

    const MIB: u64 = 1 << 20;

    /// A controller over a real tmpfs share (mounting needs root: the test fails otherwise; the
    /// suite runs as root). One task
    /// arrives in the first 0.2 s interval (λ = 5/s); with τ = 4 s Eq. 2 needs E[X|m] <=
    /// 4/21 s, which the curve's smallest size (2 MiB, 0.05 s) meets, so the queueing
    /// predictor shrinks the share to 2 MiB; 3 MiB of files are in the way.
    #[test]
    fn a_refused_shrink_advises_the_coldest_files_and_the_log_replays() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts a tmpfs share: run it as root (make test does)"
        );
        let tmp = tempfile::tempdir().expect("tmp");
        let spec = ShareSpec {
            size: 8 * MIB,
            guest_path: "/hylics".into(),
            cache: CacheMode::Auto,
            writeback: false,
            threads: 0,
        };
        let dir = tmp.path().join("hylics/share");
        let share =
            Arc::new(Share::create(&dir, &tmp.path().join("h.json"), &spec, None).expect("mounts"));
        for (name, age) in [("cold", 100u64), ("warm", 10)] {
            let p = dir.join(name);
            std::fs::write(&p, vec![1u8; (3 * MIB / 2) as usize]).expect("write");
            let t = SystemTime::now() - Duration::from_secs(age);
            let f = File::options().write(true).open(&p).expect("open");
            f.set_times(std::fs::FileTimes::new().set_accessed(t).set_modified(t))
                .expect("times");
        }
        let curve = tmp.path().join("curve.json");
        std::fs::write(
            &curve,
            r#"{"points":[{"m_bytes":2097152,"service_secs":0.05},{"m_bytes":8388608,"service_secs":0.01}]}"#,
        )
        .expect("curve");
        let log = tmp.path().join("decisions.log");
        let slo: crate::hylics::SloSpec = format!(
            "4,mode=queueing_only,curve={},ci=0.2:0.2,log={}",
            curve.display(),
            log.display()
        )
        .parse()
        .expect("spec");
        let c = ShareController::start(
            slo.config(8 * MIB).expect("config"),
            share.clone(),
            slo.log_path(),
        )
        .expect("starts");
        assert!(c.done(f64::NAN).is_err() && c.done(-1.0).is_err());
        c.arrived().expect("arrival");
        c.done(0.05).expect("report");
        let deadline = Instant::now() + Duration::from_secs(20);
        while c.status().refused_shrinks == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let st = c.status();
        assert_eq!(st.target_bytes, 2 * MIB, "{st:?}");
        assert!(st.refused_shrinks >= 1, "{st:?}");
        assert_eq!(
            st.share_bytes,
            8 * MIB,
            "nothing was lost: the shrink waited"
        );
        assert_eq!((st.tasks, st.arrivals, st.rejected_reports), (1, 1, 2));
        let advice = c.advice();
        assert_eq!(advice.evict, vec!["/cold".to_string()], "{advice:?}");
        // The guest moves the file out; the next interval's resize goes through.
        std::fs::remove_file(dir.join("cold")).expect("rm");
        let deadline = Instant::now() + Duration::from_secs(20);
        while share.size() != 2 * MIB && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(share.size(), 2 * MIB);
        // A task reported just before the stop is logged too (in the last, partial interval
        // unless an interval ended in between).
        c.done(0.07).expect("report");
        let end = c.stop();
        assert!(c.advice().evict.is_empty(), "no advice once it fits");
        assert!(end.decisions >= 2);
        let file = vmsight_hylics::LogFile::parse(&std::fs::read_to_string(&log).expect("log"))
            .expect("parses");
        assert_eq!(file.records.len() as u64, end.decisions);
        let logged: Vec<f64> = file
            .records
            .iter()
            .flat_map(|r| r.input.response_times_secs.iter().copied())
            .collect();
        assert_eq!(
            logged,
            vec![0.05, 0.07],
            "every reported task is in the log"
        );
        file.replay().expect("every decision reproduces");
        drop(c);
        drop(share);
    }

    #[test]
    fn share_files_lists_regular_files_with_relative_paths() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("a"), vec![0u8; 10]).expect("write");
        std::fs::write(dir.path().join("sub/b"), vec![0u8; 20]).expect("write");
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).expect("symlink");
        let mut files = share_files(dir.path());
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let names: Vec<_> = files
            .iter()
            .map(|f| (f.path.clone(), f.size_bytes))
            .collect();
        assert_eq!(
            names,
            vec![(PathBuf::from("a"), 10), (PathBuf::from("sub/b"), 20)]
        );
    }

    #[test]
    fn advice_names_the_coldest_files_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, age_secs) in [("old", 300u64), ("mid", 200), ("new", 0)] {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![1u8; 1000]).expect("write");
            let t = SystemTime::now() - Duration::from_secs(age_secs);
            let f = File::options().write(true).open(&p).expect("open");
            f.set_times(std::fs::FileTimes::new().set_accessed(t).set_modified(t))
                .expect("times");
        }
        let a = eviction_advice(dir.path(), 1500);
        assert_eq!(a.evict, vec!["/old".to_string(), "/mid".to_string()]);
        assert_eq!(a.free_bytes, 1500);
        assert!(eviction_advice(dir.path(), 0).evict.is_empty());
    }
}
