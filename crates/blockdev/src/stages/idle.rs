//! FoxyIdle: an idle-time scheduler that holds background reads while the guest's foreground
//! is using the disk (FoxyTechnique §5; Eggert & Touch, "Idletime scheduling with preemption
//! intervals", SOSP 2005).
//!
//! # Mechanism
//!
//! An injected [`Attribution`] tells, for each read or write, which guest process submitted
//! it and whether that process is foreground or background. A background read that arrives
//! while the foreground is busy is not passed down: the stage keeps it, so to the guest the
//! virtual disk looks like it "seeks" for a long time on that read. The guest kernel then
//! blocks the background process itself in its I/O wait, with no change inside the guest: the
//! background process stops issuing I/O and the disk stays with the foreground. When the disk
//! has been idle for a while, the held reads go down in arrival order.
//!
//! Foreground I/O comes in bursts separated by short think times (a process handles one read,
//! then issues the next). Starting background work in each short gap would put it in front of
//! the next foreground request, so after every foreground completion the disk stays reserved
//! for the foreground for a *preemption interval* (`interval`, default 15 ms).
//!
//! # Rules
//!
//! * Only `Read` and `Write` requests are classified (once each, when they reach the stage).
//!   Every other kind (flush, discard, write-zeroes, get-id) is forwarded at once and does not
//!   affect the scheduler.
//! * [`Owner::Background`] + `Read` is a background read: the only request ever held.
//! * [`Owner::Background`] + `Write` is forwarded at once, never held, and does not count as
//!   foreground (it starts no preemption interval).
//! * [`Owner::Foreground`], [`Owner::Nobody`] (kernel threads, writeback) and
//!   [`Owner::Unknown`] (attribution miss) are foreground: forwarded at once, never held, and
//!   never waiting behind a held request.
//! * The disk is *idle* when no foreground request is in flight and at least `interval` has
//!   passed since the last foreground completion (or no foreground request ever completed).
//! * A background read starts at once only if the disk is idle, nothing is held already (held
//!   requests keep FIFO order) and fewer than `bg_depth` background reads are in flight;
//!   otherwise it is held.
//! * Held reads start from the head of the FIFO, while the disk is idle and fewer than
//!   `bg_depth` background reads are in flight, whenever that may have become true: a
//!   background completion, a background arrival, or the timer at the end of the preemption
//!   interval. A timer callback re-checks everything (a newer foreground completion may have
//!   moved the end of the interval; the stage then arms a new timer). A held read never starts
//!   while a foreground request is in flight, except through the starvation guard or
//!   `release`.
//! * Starvation guard (`max_hold`): a held read older than `max_hold` starts regardless of the
//!   idle condition and of `bg_depth` (counted in `max_hold_releases`). The timer is armed for
//!   the head's deadline; the head is always the oldest held read.
//! * [`Stage::release`] (shutdown) starts every held read at once, releases the timer, and
//!   from then on background reads go straight through: nothing is held after it. A held
//!   [`Io`] is never dropped.
//!
//! Timers are only armed while something is held: a foreground completion with an empty
//! queue costs no timer, since a later background arrival checks the idle condition itself.
//!
//! # Why background writes are not held
//!
//! A write usually reaches the disk from the guest's page cache writeback, long after the
//! process wrote: holding it would not block the background process, only the guest's
//! writeback and its dirty-page throttling, which then stalls every writer, foreground
//! included. Worse, a flush waits for the writes submitted before it (the flush-order stage
//! in front of the pipeline), so a foreground `fsync` would wait behind a held background
//! write: a priority inversion. Writes are therefore passed on, and since they are not
//! foreground they do not keep the disk busy for background reads either.
//!
//! # What `bg_depth` bounds
//!
//! Background reads in flight below this stage are what a newly arriving foreground request
//! may find ahead of it at the disk model below (which serves one request at a time in arrival
//! order). `bg_depth` caps them, so a foreground request waits for at most `bg_depth`
//! background reads (plus reads the starvation guard forced out) before its own service.
//!
//! # Placement
//!
//! Above the disk model, so held reads do not occupy the modelled disk, and above every
//! [`crate::pipeline::Serialized`] stage (the iCache): a request held below such a stage
//! would block its thread and every request queued behind it, foreground included.
//!
//! # Locking and ordering
//!
//! * One `Mutex` guards the scheduler state (in-flight counts, the FIFO of held requests, the
//!   last foreground completion, the armed timer). It is held only for bookkeeping: requests to
//!   start are collected under it and forwarded after the guard is dropped. `Io::forward`,
//!   `Io::forward_then`, `Io::complete` and the [`Attribution`] are never called under it.
//! * [`Timer::at`] is called under the state lock (so the armed deadline stays consistent with
//!   the timer). Lock order: state lock, then the timer's internal lock; the timer runs its
//!   callbacks without its lock, and a callback takes the state lock itself.
//! * Gauges are stored under the state lock, counters are relaxed atomics; both are only
//!   statistics and order nothing.
//! * A completion hook takes a reference to the scheduler and drops it before completing its
//!   request upwards (the request keeps the pipeline, and so the stage, alive until then).
//!   Timer callbacks hold a weak reference; if one ends up holding the last reference (the
//!   pipeline was dropped while a request it started finished), the scheduler is dropped on
//!   another thread, because dropping the timer joins the timer thread.
//! * Held reads are started by one loop per thread: when a read it forwards completes inline
//!   (a terminal that answers at once) and that completion frees the next read, the next one
//!   joins the loop's queue (a thread-local) instead of being forwarded deeper on the same
//!   stack, so a long queue never recurses (the timer thread's stack is small). The queue is
//!   only touched between forwards, never under the state lock.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::histogram::{DurationHistogram, HistogramSnapshot};
use crate::pipeline::{Io, Stage};
use crate::request::{Request, RequestKind};
use crate::timer::Timer;

/// The stage's name in logs and metrics.
const NAME: &str = "idle";
/// Longest accepted preemption interval.
const MAX_INTERVAL: Duration = Duration::from_secs(10);
/// Shortest accepted preemption interval.
const MIN_INTERVAL: Duration = Duration::from_millis(1);
/// Largest accepted `bg_depth`.
const MAX_BG_DEPTH: usize = 64;

/// Who a block request belongs to, as far as the attribution knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Owner {
    /// A foreground process: never held.
    Foreground,
    /// A background process: its reads may be held.
    Background,
    /// No process (kernel threads, writeback): treated as foreground.
    Nobody,
    /// The attribution could not tell (a miss): treated as foreground.
    Unknown,
}

/// The attribution's answer for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Who the request belongs to.
    pub owner: Owner,
    /// Submitting guest TGID (0 unknown / kernel thread).
    pub tgid: u32,
}

/// Classifies requests for the scheduler (implemented by the guest introspection).
pub trait Attribution: Send + Sync {
    /// Called once per Read/Write request when it reaches the stage, before it is served.
    fn classify(&self, req: &Request) -> Verdict;

    /// Called once per classified request when it is started (forwarded down), with how
    /// long the stage held it (zero if not held). Default: nothing.
    fn started(&self, _req: &Request, _v: &Verdict, _held: Duration) {}
}

/// Parameters of the idle scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleConfig {
    /// Preemption interval: how long after a foreground completion the disk stays reserved
    /// for the foreground (1 ms to 10 s).
    pub interval: Duration,
    /// Starvation guard: a background read held longer than this starts regardless; at
    /// least `interval`. `None`: no guard.
    pub max_hold: Option<Duration>,
    /// Most background reads in flight below the stage (1 to 64).
    pub bg_depth: usize,
}

impl Default for IdleConfig {
    /// 15 ms interval, no starvation guard, one background read at a time.
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(15),
            max_hold: None,
            bg_depth: 1,
        }
    }
}

/// Milliseconds of `d`, with a fraction when not whole (for messages).
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl IdleConfig {
    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<(), IdleError> {
        if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&self.interval) {
            return Err(IdleError::Interval(self.interval));
        }
        if let Some(m) = self.max_hold.filter(|m| *m < self.interval) {
            return Err(IdleError::MaxHold {
                max_hold: m,
                interval: self.interval,
            });
        }
        if !(1..=MAX_BG_DEPTH).contains(&self.bg_depth) {
            return Err(IdleError::BgDepth(self.bg_depth));
        }
        Ok(())
    }
}

/// Errors building an idle scheduler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdleError {
    /// `interval` outside 1 ms to 10 s.
    #[error("idle interval {} ms is out of range (1 to 10000 ms)", ms(*.0))]
    Interval(Duration),
    /// `max_hold` shorter than `interval`.
    #[error(
        "idle max_hold {} ms is shorter than the idle interval {} ms",
        ms(*max_hold),
        ms(*interval)
    )]
    MaxHold {
        /// The requested guard.
        max_hold: Duration,
        /// The interval.
        interval: Duration,
    },
    /// `bg_depth` outside 1 to 64.
    #[error("idle bg_depth {0} is out of range (1 to 64)")]
    BgDepth(usize),
    /// The timer thread could not be started.
    #[error("cannot start the idle scheduler's timer: {0}")]
    Timer(String),
}

/// Live counters of an idle scheduler.
#[derive(Debug, Default)]
pub struct IdleMetrics {
    interval_ms: u64,
    max_hold_ms: Option<u64>,
    bg_depth: u64,
    /// Read/write requests of [`Owner::Foreground`].
    pub foreground: AtomicU64,
    /// Background reads (the requests that may be held).
    pub background: AtomicU64,
    /// Background writes (passed on, never held).
    pub background_writes: AtomicU64,
    /// Read/write requests of [`Owner::Nobody`] (scheduled as foreground).
    pub nobody: AtomicU64,
    /// Read/write requests of [`Owner::Unknown`], i.e. attribution misses (scheduled as
    /// foreground).
    pub unknown: AtomicU64,
    /// Requests of other kinds (flush, discard, write-zeroes, get-id), passed on unclassified.
    pub passthrough: AtomicU64,
    /// Background reads that were held (not started on arrival).
    pub held: AtomicU64,
    /// Sum of the time held reads waited, ns.
    pub hold_ns_total: AtomicU64,
    /// Longest time a held read waited, ns.
    pub hold_ns_max: AtomicU64,
    /// Preemption intervals during which at least one background read was held: a foreground
    /// completion starts an interval (ended by the next one or after `interval`); it counts
    /// once if background reads were held when it started or one was held on arrival during
    /// it.
    pub preemption_intervals: AtomicU64,
    /// Held reads started by the starvation guard (`max_hold`) rather than by idleness.
    pub max_hold_releases: AtomicU64,
    /// Gauge: background reads held now.
    pub held_now: AtomicU64,
    /// Gauge: background reads in flight below the stage now.
    pub bg_in_flight: AtomicU64,
    /// Gauge: foreground requests in flight below the stage now.
    pub fg_in_flight: AtomicU64,
    /// Timer error (FoxyTechnique Fig. 9): for each timer callback that started held reads at
    /// the end of a preemption interval, how long after the calculated end (the last
    /// foreground completion plus `interval`) it did so.
    pub timer_error: DurationHistogram,
}

impl IdleMetrics {
    fn new(cfg: &IdleConfig) -> Self {
        Self {
            interval_ms: u64::try_from(cfg.interval.as_millis()).unwrap_or(u64::MAX),
            max_hold_ms: cfg
                .max_hold
                .map(|m| u64::try_from(m.as_millis()).unwrap_or(u64::MAX)),
            bg_depth: cfg.bg_depth as u64,
            ..Self::default()
        }
    }

    /// A copy of every counter and gauge.
    pub fn snapshot(&self) -> IdleSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        IdleSnapshot {
            interval_ms: self.interval_ms,
            max_hold_ms: self.max_hold_ms,
            bg_depth: self.bg_depth,
            foreground: g(&self.foreground),
            background: g(&self.background),
            background_writes: g(&self.background_writes),
            nobody: g(&self.nobody),
            unknown: g(&self.unknown),
            passthrough: g(&self.passthrough),
            held: g(&self.held),
            hold_ns_total: g(&self.hold_ns_total),
            hold_ns_max: g(&self.hold_ns_max),
            preemption_intervals: g(&self.preemption_intervals),
            max_hold_releases: g(&self.max_hold_releases),
            held_now: g(&self.held_now),
            bg_in_flight: g(&self.bg_in_flight),
            fg_in_flight: g(&self.fg_in_flight),
            timer_error: self.timer_error.snapshot(),
        }
    }

    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one classified request by owner and direction.
    fn count_verdict(&self, kind: RequestKind, owner: Owner) {
        let c = match (owner, kind) {
            (Owner::Background, RequestKind::Read) => &self.background,
            (Owner::Background, _) => &self.background_writes,
            (Owner::Foreground, _) => &self.foreground,
            (Owner::Nobody, _) => &self.nobody,
            (Owner::Unknown, _) => &self.unknown,
        };
        Self::add(c, 1);
    }

    /// Counts the wait of a held read that starts now.
    fn count_hold(&self, held: Duration) {
        let ns = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
        Self::add(&self.hold_ns_total, ns);
        self.hold_ns_max.fetch_max(ns, Ordering::Relaxed);
    }

    /// Stores the gauges from the state (called under the state lock).
    fn publish(&self, st: &State) {
        let s = |c: &AtomicU64, n: usize| c.store(n as u64, Ordering::Relaxed);
        s(&self.held_now, st.held.len());
        s(&self.bg_in_flight, st.bg_in_flight);
        s(&self.fg_in_flight, st.fg_in_flight);
    }
}

/// Serialisable copy of [`IdleMetrics`] (see there for each field).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdleSnapshot {
    /// The preemption interval, ms.
    pub interval_ms: u64,
    /// The starvation guard, ms (`None`: no guard).
    pub max_hold_ms: Option<u64>,
    /// Most background reads in flight.
    pub bg_depth: u64,
    /// Read/write requests of foreground processes.
    pub foreground: u64,
    /// Background reads.
    pub background: u64,
    /// Background writes (never held).
    pub background_writes: u64,
    /// Read/write requests of no process (kernel threads, writeback).
    pub nobody: u64,
    /// Attribution misses.
    pub unknown: u64,
    /// Requests of other kinds, passed on unclassified.
    pub passthrough: u64,
    /// Background reads that were held.
    pub held: u64,
    /// Sum of hold times, ns.
    pub hold_ns_total: u64,
    /// Longest hold time, ns.
    pub hold_ns_max: u64,
    /// Preemption intervals during which at least one background read was held.
    pub preemption_intervals: u64,
    /// Held reads started by the starvation guard.
    pub max_hold_releases: u64,
    /// Gauge: background reads held now.
    pub held_now: u64,
    /// Gauge: background reads in flight now.
    pub bg_in_flight: u64,
    /// Gauge: foreground requests in flight now.
    pub fg_in_flight: u64,
    /// Timer error of interval-end releases (see [`IdleMetrics::timer_error`]).
    #[serde(default)]
    pub timer_error: HistogramSnapshot,
}

/// A background read the stage keeps.
struct Held {
    io: Io,
    verdict: Verdict,
    since: Instant,
}

/// What the scheduler knows, behind its one lock.
#[derive(Default)]
struct State {
    /// Foreground requests forwarded and not yet completed.
    fg_in_flight: usize,
    /// Background reads forwarded and not yet completed.
    bg_in_flight: usize,
    /// When the latest foreground request completed.
    last_fg_done: Option<Instant>,
    /// Held background reads, oldest first.
    held: VecDeque<Held>,
    /// The current preemption interval has been counted in `preemption_intervals`.
    interval_counted: bool,
    /// Deadline of the earliest pending timer callback this state relies on.
    armed: Option<Instant>,
    /// `release` ran: nothing is held any more.
    released: bool,
}

impl State {
    /// Now is within the preemption interval of the latest foreground completion.
    fn in_interval(&self, now: Instant, interval: Duration) -> bool {
        self.last_fg_done
            .is_some_and(|t| now.saturating_duration_since(t) < interval)
    }

    /// The disk is idle: no foreground request in flight and the interval has passed.
    fn is_idle(&self, now: Instant, interval: Duration) -> bool {
        self.fg_in_flight == 0 && !self.in_interval(now, interval)
    }

    /// A background read may start by the ordinary rule (idle and below `bg_depth`).
    fn may_start(&self, now: Instant, cfg: &IdleConfig) -> bool {
        self.released || (self.is_idle(now, cfg.interval) && self.bg_in_flight < cfg.bg_depth)
    }

    /// When the disk becomes idle by time alone, if nothing else must happen first (a
    /// foreground or background completion re-checks by itself).
    fn idle_at(&self, cfg: &IdleConfig) -> Option<Instant> {
        if self.fg_in_flight > 0 || self.bg_in_flight >= cfg.bg_depth {
            return None;
        }
        self.last_fg_done.and_then(|t| t.checked_add(cfg.interval))
    }
}

/// Whether a request passes, and how it counts.
enum Class {
    /// Not a read or write: passed on unclassified.
    Pass,
    /// Foreground, nobody or unknown: forwarded at once, counted in flight.
    Foreground(Verdict),
    /// A background write: forwarded at once, not counted.
    BackgroundWrite(Verdict),
    /// A background read: may be held.
    BackgroundRead(Verdict),
}

/// The scheduler shared by the stage, its completion hooks and its timer callbacks.
struct Inner {
    cfg: IdleConfig,
    attribution: Arc<dyn Attribution>,
    metrics: Arc<IdleMetrics>,
    state: Mutex<State>,
    timer: Timer,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Classifies and counts one request.
    fn classify(&self, req: &Request) -> Class {
        if !matches!(req.kind, RequestKind::Read | RequestKind::Write) {
            IdleMetrics::add(&self.metrics.passthrough, 1);
            return Class::Pass;
        }
        let v = self.attribution.classify(req);
        self.metrics.count_verdict(req.kind, v.owner);
        match (v.owner, req.kind) {
            (Owner::Background, RequestKind::Read) => Class::BackgroundRead(v),
            (Owner::Background, _) => Class::BackgroundWrite(v),
            _ => Class::Foreground(v),
        }
    }

    /// Whether the head of the queue waited longer than `max_hold`.
    fn starved(&self, h: &Held, now: Instant) -> bool {
        self.cfg
            .max_hold
            .is_some_and(|m| now.saturating_duration_since(h.since) >= m)
    }

    /// Takes the held reads that may start now, from the head, counting them in flight.
    fn take_ready(&self, st: &mut State, now: Instant) -> Vec<Held> {
        let mut ready = Vec::new();
        while let Some(head) = st.held.front() {
            let ordinary = st.may_start(now, &self.cfg);
            if !ordinary && !self.starved(head, now) {
                break;
            }
            if !ordinary {
                IdleMetrics::add(&self.metrics.max_hold_releases, 1);
            }
            if let Some(h) = st.held.pop_front() {
                st.bg_in_flight += 1;
                ready.push(h);
            }
        }
        ready
    }

    /// The next instant a held read may start by time alone: the end of the interval or the
    /// head's starvation deadline, whichever comes first.
    fn next_deadline(&self, st: &State) -> Option<Instant> {
        if st.released {
            return None;
        }
        let head = st.held.front()?;
        let starve_at = self.cfg.max_hold.and_then(|m| head.since.checked_add(m));
        match (st.idle_at(&self.cfg), starve_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Arms a timer for the next deadline unless an earlier one is pending (its callback
    /// re-plans). Called under the state lock.
    fn arm(self: &Arc<Self>, st: &mut State) {
        let Some(at) = self.next_deadline(st) else {
            return;
        };
        if st.armed.is_some_and(|a| a <= at) {
            return;
        }
        st.armed = Some(at);
        let weak = Arc::downgrade(self);
        self.timer.at(at, move || on_timer(&weak, at));
    }

    /// After any change: takes what may start, arms the timer, updates the gauges.
    fn settle(self: &Arc<Self>, st: &mut State, now: Instant) -> Vec<Held> {
        let ready = self.take_ready(st, now);
        self.arm(st);
        self.metrics.publish(st);
        ready
    }

    /// Starts held reads (outside the lock), oldest first, without recursing: if a start loop
    /// already runs further up this thread's stack (a read it started completed inline), they
    /// join its queue.
    fn start_held(self: &Arc<Self>, ready: Vec<Held>) {
        if ready.is_empty() {
            return;
        }
        let starts = ready.into_iter().map(|held| Start {
            inner: self.clone(),
            held,
        });
        let outermost = STARTS.with(|q| {
            let mut q = q.borrow_mut();
            let outermost = q.is_none();
            q.get_or_insert_with(VecDeque::new).extend(starts);
            outermost
        });
        if outermost {
            run_starts();
        }
    }

    /// Starts one held read, counting its wait.
    fn start_one(self: &Arc<Self>, h: Held) {
        let waited = h.since.elapsed();
        self.metrics.count_hold(waited);
        self.start_background(h.io, h.verdict, waited);
    }

    /// Forwards a background read already counted in flight.
    fn start_background(self: &Arc<Self>, io: Io, v: Verdict, held: Duration) {
        self.attribution.started(io.request(), &v, held);
        let inner = self.clone();
        io.forward_then(move |io, result| {
            inner.background_done();
            drop(inner);
            io.complete(result);
        });
    }

    /// A foreground request arrives: counted in flight and forwarded at once.
    fn start_foreground(self: &Arc<Self>, io: Io, v: Verdict) {
        {
            let mut st = self.lock();
            st.fg_in_flight += 1;
            self.metrics.publish(&st);
        }
        self.attribution.started(io.request(), &v, Duration::ZERO);
        let inner = self.clone();
        io.forward_then(move |io, result| {
            inner.foreground_done();
            drop(inner);
            io.complete(result);
        });
    }

    /// A background read arrives: started at once if allowed, otherwise held.
    fn arrive_background(self: &Arc<Self>, io: Io, v: Verdict) {
        let (ready, direct) = {
            let mut st = self.lock();
            let now = Instant::now();
            let ready = self.take_ready(&mut st, now);
            let direct = if st.held.is_empty() && st.may_start(now, &self.cfg) {
                st.bg_in_flight += 1;
                Some(io)
            } else {
                self.hold(&mut st, io, v, now);
                None
            };
            self.arm(&mut st);
            self.metrics.publish(&st);
            (ready, direct)
        };
        self.start_held(ready);
        if let Some(io) = direct {
            self.start_background(io, v, Duration::ZERO);
        }
    }

    /// Queues a background read (under the lock) and counts it.
    fn hold(&self, st: &mut State, io: Io, verdict: Verdict, now: Instant) {
        IdleMetrics::add(&self.metrics.held, 1);
        if !st.interval_counted && st.in_interval(now, self.cfg.interval) {
            st.interval_counted = true;
            IdleMetrics::add(&self.metrics.preemption_intervals, 1);
        }
        st.held.push_back(Held {
            io,
            verdict,
            since: now,
        });
    }

    /// A foreground request completed: a preemption interval starts now.
    fn foreground_done(self: &Arc<Self>) {
        let ready = {
            let mut st = self.lock();
            let now = Instant::now();
            st.fg_in_flight = st.fg_in_flight.saturating_sub(1);
            st.last_fg_done = Some(now);
            st.interval_counted = !st.held.is_empty();
            if st.interval_counted {
                IdleMetrics::add(&self.metrics.preemption_intervals, 1);
            }
            self.settle(&mut st, now)
        };
        self.start_held(ready);
    }

    /// A background read completed: the next held one may start.
    fn background_done(self: &Arc<Self>) {
        let ready = {
            let mut st = self.lock();
            st.bg_in_flight = st.bg_in_flight.saturating_sub(1);
            self.settle(&mut st, Instant::now())
        };
        self.start_held(ready);
    }

    /// The timer armed for `at` fired: re-check everything.
    fn timer_fired(self: &Arc<Self>, at: Instant) {
        let ready = {
            let mut st = self.lock();
            if st.armed == Some(at) {
                st.armed = None;
            }
            let due = st.idle_at(&self.cfg);
            let now = Instant::now();
            let ready = self.settle(&mut st, now);
            if let Some(due) = due.filter(|d| *d <= now && !ready.is_empty()) {
                self.metrics.timer_error.record(now - due);
            }
            ready
        };
        self.start_held(ready);
    }

    /// Starts every held read and holds nothing from now on.
    fn release(self: &Arc<Self>) {
        let ready = {
            let mut st = self.lock();
            st.released = true;
            self.settle(&mut st, Instant::now())
        };
        self.timer.release();
        self.start_held(ready);
    }
}

/// A held read taken off the FIFO, to be forwarded outside the lock.
struct Start {
    inner: Arc<Inner>,
    held: Held,
}

thread_local! {
    /// Reads waiting for the start loop running on this thread (`None`: no loop runs).
    static STARTS: RefCell<Option<VecDeque<Start>>> = const { RefCell::new(None) };
}

/// Ends this thread's start loop, also on unwind: reads still queued then are dropped, which
/// fails them (never loses them).
struct StartLoop;

impl Drop for StartLoop {
    fn drop(&mut self) {
        let rest = STARTS.with(|q| q.borrow_mut().take());
        drop(rest);
    }
}

/// The start loop: forwards queued reads until none is left, including those queued by
/// completions that ran inline meanwhile.
fn run_starts() {
    let _end = StartLoop;
    while let Some(s) = STARTS.with(|q| q.borrow_mut().as_mut().and_then(VecDeque::pop_front)) {
        s.inner.start_one(s.held);
    }
}

/// A timer callback: runs the scheduler if it still exists.
fn on_timer(weak: &Weak<Inner>, at: Instant) {
    let Some(inner) = weak.upgrade() else {
        return;
    };
    inner.timer_fired(at);
    drop_off_timer_thread(inner);
}

/// Drops a reference taken on the timer thread. If it is the last one, the scheduler (and its
/// [`Timer`], whose drop joins the timer thread) is dropped on a thread of its own; if no
/// thread can be started it is leaked rather than deadlocking.
fn drop_off_timer_thread(inner: Arc<Inner>) {
    let Some(inner) = Arc::into_inner(inner) else {
        return;
    };
    let inner = ManuallyDrop::new(inner);
    let spawned = std::thread::Builder::new()
        .name("vmsight-idle-drop".into())
        .spawn(move || drop(ManuallyDrop::into_inner(inner)));
    if let Err(e) = spawned {
        warn!(error = %e, "idle: cannot start a thread to drop the scheduler; leaking it");
    }
}

/// The FoxyIdle stage. See the module documentation.
pub struct IdleScheduler {
    inner: Arc<Inner>,
}

impl fmt::Debug for IdleScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdleScheduler")
            .field("cfg", &self.inner.cfg)
            .finish()
    }
}

impl IdleScheduler {
    /// A scheduler with `cfg` (validated) classifying through `attribution`, with its timer
    /// thread, and its live counters.
    pub fn new(
        cfg: IdleConfig,
        attribution: Arc<dyn Attribution>,
    ) -> Result<(Self, Arc<IdleMetrics>), IdleError> {
        cfg.validate()?;
        let metrics = Arc::new(IdleMetrics::new(&cfg));
        let timer = Timer::new(NAME).map_err(|e| IdleError::Timer(e.to_string()))?;
        let inner = Arc::new(Inner {
            cfg,
            attribution,
            metrics: metrics.clone(),
            state: Mutex::new(State::default()),
            timer,
        });
        Ok((Self { inner }, metrics))
    }

    /// Like [`new`](Self::new), boxed as a pipeline stage.
    pub fn stage(
        cfg: IdleConfig,
        attribution: Arc<dyn Attribution>,
    ) -> Result<(Box<dyn Stage>, Arc<IdleMetrics>), IdleError> {
        let (s, m) = Self::new(cfg, attribution)?;
        Ok((Box::new(s), m))
    }
}

impl Stage for IdleScheduler {
    fn name(&self) -> &str {
        NAME
    }

    fn submit(&self, io: Io) {
        let inner = &self.inner;
        match inner.classify(io.request()) {
            Class::Pass => io.forward(),
            Class::BackgroundWrite(v) => {
                inner.attribution.started(io.request(), &v, Duration::ZERO);
                io.forward();
            }
            Class::Foreground(v) => inner.start_foreground(io, v),
            Class::BackgroundRead(v) => inner.arrive_background(io, v),
        }
    }

    /// Starts every held read at once; background reads go straight through from now on.
    fn release(&self) {
        self.inner.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::tests::{wait_held, Hold, Shared};
    use crate::pipeline::{IoResult, Pipeline, Status};
    use crate::request::Segment;
    use crate::stages::memdisk::MemDisk;
    use std::collections::HashMap;
    use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// Sectors from here on belong to background processes.
    const BG: u64 = 1000;
    /// Sectors 100..200 are kernel threads' (Nobody), 200..300 attribution misses.
    const NOBODY: u64 = 100;
    const UNKNOWN: u64 = 200;
    /// Bound on any wait in these tests (a hang fails instead of blocking the run).
    const PATIENCE: Duration = Duration::from_secs(10);

    fn owner_of(sector: u64) -> Owner {
        match sector {
            s if s >= BG => Owner::Background,
            s if s >= 300 => Owner::Foreground,
            s if s >= UNKNOWN => Owner::Unknown,
            s if s >= NOBODY => Owner::Nobody,
            _ => Owner::Foreground,
        }
    }

    /// Classifies by sector and records every start with its hold time.
    #[derive(Default)]
    struct BySector {
        classified: AtomicU64,
        started: Mutex<HashMap<u64, Vec<Duration>>>,
    }

    impl BySector {
        /// The hold time of request `id` (it must have started exactly once).
        fn held_for(&self, id: u64) -> Duration {
            let started = self.started.lock().expect("started");
            match started.get(&id).map(Vec::as_slice) {
                Some([d]) => *d,
                other => panic!("request {id} started {other:?}"),
            }
        }
    }

    impl Attribution for BySector {
        fn classify(&self, req: &Request) -> Verdict {
            self.classified.fetch_add(1, Ordering::SeqCst);
            Verdict {
                owner: owner_of(req.sector),
                tgid: 100 + req.sector as u32,
            }
        }
        fn started(&self, req: &Request, v: &Verdict, held: Duration) {
            assert_eq!(v.owner, owner_of(req.sector));
            let mut started = self.started.lock().expect("started");
            started.entry(req.id).or_default().push(held);
        }
    }

    /// Records when each request reaches the stages below the scheduler and when they
    /// complete it: (id, true = down / false = up, instant).
    #[derive(Default)]
    struct Stamp {
        log: Arc<Mutex<Vec<(u64, bool, Instant)>>>,
    }

    impl Stamp {
        fn at(&self, id: u64, down: bool) -> Option<Instant> {
            let log = self.log.lock().expect("log");
            log.iter().find(|e| e.0 == id && e.1 == down).map(|e| e.2)
        }
        fn reached(&self, id: u64) -> bool {
            self.at(id, true).is_some()
        }
    }

    impl Stage for Stamp {
        fn name(&self) -> &str {
            "stamp"
        }
        fn submit(&self, io: Io) {
            let id = io.request().id;
            self.log
                .lock()
                .expect("log")
                .push((id, true, Instant::now()));
            let log = self.log.clone();
            io.forward_then(move |io, r| {
                log.lock().expect("log").push((id, false, Instant::now()));
                io.complete(r);
            });
        }
    }

    /// The byte every sector of the test disk is filled with.
    fn pattern(sector: u64) -> u8 {
        (sector % 251) as u8 + 1
    }

    /// idle -> stamp -> hold -> memory disk, with the disk filled with `pattern`.
    struct Rig {
        p: Pipeline,
        m: Arc<IdleMetrics>,
        attr: Arc<BySector>,
        stamp: Arc<Stamp>,
        hold: Arc<Hold>,
        mem: GuestMemoryMmap,
        tx: Sender<(u64, IoResult)>,
        rx: Mutex<Receiver<(u64, IoResult)>>,
    }

    fn rig(cfg: IdleConfig, hold: Hold) -> Rig {
        let mut disk = MemDisk::new(1 << 20);
        for (i, chunk) in disk.data.chunks_mut(512).enumerate() {
            chunk.fill(pattern(i as u64));
        }
        let attr = Arc::new(BySector::default());
        let (stage, m) = IdleScheduler::stage(cfg, attr.clone()).expect("idle stage");
        let stamp = Arc::new(Stamp::default());
        let hold = Arc::new(hold);
        let mut p = Pipeline::new(Box::new(disk));
        p.push(stage).expect("push idle");
        p.push(Box::new(Shared(stamp.clone()))).expect("push stamp");
        p.push(Box::new(Shared(hold.clone()))).expect("push hold");
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).expect("memory");
        let (tx, rx) = channel();
        Rig {
            p,
            m,
            attr,
            stamp,
            hold,
            mem,
            tx,
            rx: Mutex::new(rx),
        }
    }

    fn cfg(interval_ms: u64) -> IdleConfig {
        IdleConfig {
            interval: Duration::from_millis(interval_ms),
            ..IdleConfig::default()
        }
    }

    impl Rig {
        /// Request `id` of `kind` at `sector`; reads and writes use a 512-byte buffer of
        /// their own at `id * 512`.
        fn req(&self, kind: RequestKind, sector: u64, id: u64) -> Request {
            let segs = match kind {
                RequestKind::Read | RequestKind::Write => vec![Segment {
                    addr: GuestAddress(id * 512),
                    len: 512,
                }],
                _ => Vec::new(),
            };
            let mut r = Request::new_for_test(&self.mem, kind, sector, segs);
            r.id = id;
            r
        }

        fn submit(&self, kind: RequestKind, sector: u64, id: u64) {
            let tx = self.tx.clone();
            self.p.submit(self.req(kind, sector, id), move |r, res| {
                let _ = tx.send((r.id, res));
            });
        }

        fn run(&self, kind: RequestKind, sector: u64, id: u64) -> Status {
            self.p
                .run(&mut self.req(kind, sector, id))
                .expect("request result")
        }

        /// The next completion (bounded wait).
        fn next(&self) -> (u64, Status) {
            let (id, res) = self.wait(PATIENCE).expect("a completion");
            (id, res.expect("request result"))
        }

        /// The next `n` completions' ids, in completion order, all OK.
        fn completions(&self, n: usize) -> Vec<u64> {
            (0..n)
                .map(|_| {
                    let (id, st) = self.next();
                    assert_eq!(st, Status::Ok, "request {id}");
                    id
                })
                .collect()
        }

        fn wait(&self, d: Duration) -> Result<(u64, IoResult), RecvTimeoutError> {
            self.rx.lock().expect("rx").recv_timeout(d)
        }

        fn nothing_completed(&self) -> bool {
            matches!(self.wait(Duration::ZERO), Err(RecvTimeoutError::Timeout))
        }

        /// The read buffer of request `id` holds `sector`'s data.
        fn assert_read_data(&self, id: u64, sector: u64) {
            let mut buf = [0u8; 512];
            self.mem
                .read_slice(&mut buf, GuestAddress(id * 512))
                .expect("guest buffer");
            assert!(
                buf.iter().all(|&b| b == pattern(sector)),
                "request {id} did not read sector {sector}"
            );
        }

        fn snap(&self) -> IdleSnapshot {
            self.m.snapshot()
        }
    }

    #[test]
    fn nothing_is_held_without_a_background_owner() {
        let r = rig(cfg(50), Hold::default());
        for i in 0..12u64 {
            let sector = [5, NOBODY + 5, UNKNOWN + 5][(i % 3) as usize] + i;
            assert_eq!(r.run(RequestKind::Read, sector, i), Status::Ok);
            r.assert_read_data(i, sector);
        }
        r.mem
            .write_slice(&[0xab; 512], GuestAddress(50 * 512))
            .expect("guest buffer");
        assert_eq!(r.run(RequestKind::Write, 7, 50), Status::Ok);
        assert_eq!(r.run(RequestKind::Read, 7, 51), Status::Ok);
        let mut buf = [0u8; 512];
        r.mem
            .read_slice(&mut buf, GuestAddress(51 * 512))
            .expect("guest buffer");
        assert!(buf.iter().all(|&b| b == 0xab), "the write reached the disk");
        let s = r.snap();
        assert_eq!((s.foreground, s.nobody, s.unknown), (6, 4, 4));
        assert_eq!((s.background, s.background_writes), (0, 0));
        assert_eq!((s.held, s.held_now, s.preemption_intervals), (0, 0, 0));
        assert_eq!(
            s.timer_error.count, 0,
            "no timer release without a held read"
        );
        assert_eq!((s.fg_in_flight, s.bg_in_flight), (0, 0));
        assert_eq!(r.attr.held_for(51), Duration::ZERO);
    }

    #[test]
    fn background_read_waits_for_the_interval_after_a_foreground_completion() {
        let interval = Duration::from_millis(100);
        let r = rig(cfg(100), Hold::sector(1));
        // A background read arriving while a foreground read is in flight is held.
        r.submit(RequestKind::Read, 1, 1);
        wait_held(&r.hold, 1);
        r.submit(RequestKind::Read, BG, 2);
        assert_eq!(r.snap().held_now, 1);
        assert!(!r.stamp.reached(2));
        r.hold.let_go();
        assert_eq!(r.completions(2), vec![1, 2]);
        let fg_done = r.stamp.at(1, false).expect("foreground completed");
        let bg_start = r.stamp.at(2, true).expect("background started");
        assert!(
            bg_start >= fg_done + interval,
            "started within the interval"
        );
        assert!(r.attr.held_for(2) >= interval);
        r.assert_read_data(2, BG);
        // One arriving right after a foreground completion waits for the interval too.
        assert_eq!(r.run(RequestKind::Read, 2, 3), Status::Ok);
        r.submit(RequestKind::Read, BG + 1, 4);
        assert_eq!(r.completions(1), vec![4]);
        let fg_done = r.stamp.at(3, false).expect("foreground completed");
        let bg_start = r.stamp.at(4, true).expect("background started");
        assert!(
            bg_start >= fg_done + interval,
            "started within the interval"
        );
        r.assert_read_data(4, BG + 1);
        let s = r.snap();
        assert!(s.held >= 1 && s.preemption_intervals >= 1, "{s:?}");
        assert!(s.hold_ns_max >= interval.as_nanos() as u64, "{s:?}");
        assert_eq!((s.held_now, s.bg_in_flight, s.fg_in_flight), (0, 0, 0));
        // Both held reads went down from the timer at the end of an interval: two timer
        // errors, each shorter than its read's wait (both arrived before the interval ended).
        assert_eq!(s.timer_error.count, 2, "{s:?}");
        assert!(s.timer_error.max_ns <= s.hold_ns_max, "{s:?}");
    }

    #[test]
    fn foreground_requests_pass_held_background_reads() {
        let r = rig(cfg(15), Hold::sector(1));
        r.submit(RequestKind::Read, 1, 1);
        wait_held(&r.hold, 1);
        r.submit(RequestKind::Read, BG, 2);
        r.submit(RequestKind::Read, BG + 1, 3);
        assert_eq!(r.snap().held_now, 2);
        // Foreground, kernel-thread and unattributed requests go straight past them.
        r.submit(RequestKind::Read, 5, 4);
        r.submit(RequestKind::Write, NOBODY, 5);
        r.submit(RequestKind::Read, UNKNOWN, 6);
        let mut passed = r.completions(3);
        passed.sort_unstable();
        assert_eq!(passed, vec![4, 5, 6]);
        r.assert_read_data(4, 5);
        assert_eq!(r.snap().held_now, 2);
        assert!(!r.stamp.reached(2) && !r.stamp.reached(3));
        assert!(r.nothing_completed());
        r.hold.let_go();
        let mut rest = r.completions(3);
        rest.sort_unstable();
        assert_eq!(rest, vec![1, 2, 3]);
        // FIFO among background reads.
        assert!(r.stamp.at(2, true) < r.stamp.at(3, true));
        r.assert_read_data(3, BG + 1);
    }

    #[test]
    fn bg_depth_one_starts_the_next_background_read_after_the_previous_completes() {
        let r = rig(cfg(1), Hold::sector(BG));
        r.submit(RequestKind::Read, BG, 1);
        wait_held(&r.hold, 1);
        r.submit(RequestKind::Read, BG, 2);
        // Long past the interval, and the disk idle: still only one in flight.
        std::thread::sleep(Duration::from_millis(30));
        let s = r.snap();
        assert_eq!((s.held_now, s.bg_in_flight), (1, 1));
        assert_eq!(r.hold.held(), 1);
        assert!(!r.stamp.reached(2));
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![1]);
        wait_held(&r.hold, 1);
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![2]);
        assert!(r.stamp.at(2, true) >= r.stamp.at(1, false));
        r.assert_read_data(2, BG);
        assert_eq!(r.snap().held, 1);
    }

    #[test]
    fn bg_depth_two_lets_two_background_reads_in_flight() {
        let c = IdleConfig {
            bg_depth: 2,
            ..cfg(1)
        };
        let r = rig(c, Hold::sector(BG));
        for id in 1..=3 {
            r.submit(RequestKind::Read, BG, id);
        }
        wait_held(&r.hold, 2);
        let s = r.snap();
        assert_eq!((s.held_now, s.bg_in_flight), (1, 2));
        r.hold.let_go();
        let mut first = r.completions(2);
        first.sort_unstable();
        assert_eq!(first, vec![1, 2]);
        wait_held(&r.hold, 1);
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![3]);
    }

    #[test]
    fn max_hold_releases_a_starved_background_read() {
        let max_hold = Duration::from_millis(50);
        let c = IdleConfig {
            max_hold: Some(max_hold),
            ..cfg(10)
        };
        let r = rig(c, Hold::sector(1));
        // One foreground read stays in flight: the disk is never idle.
        r.submit(RequestKind::Read, 1, 1);
        wait_held(&r.hold, 1);
        r.submit(RequestKind::Read, BG, 2);
        let deadline = Instant::now() + PATIENCE;
        let mut n = 0u64;
        let done = 'wait: loop {
            assert!(Instant::now() < deadline, "the starved read never started");
            // Foreground requests keep arriving, every 2 ms.
            r.submit(RequestKind::Read, 5 + n % 10, 10 + n % 50);
            n += 1;
            std::thread::sleep(Duration::from_millis(2));
            while let Ok((id, res)) = r.wait(Duration::ZERO) {
                if id == 2 {
                    break 'wait res;
                }
                assert_eq!(res.expect("fg"), Status::Ok);
            }
        };
        assert_eq!(done.expect("bg"), Status::Ok);
        r.assert_read_data(2, BG);
        assert!(r.attr.held_for(2) >= max_hold);
        let s = r.snap();
        assert_eq!(s.max_hold_releases, 1);
        assert_eq!(s.held, 1);
        r.hold.let_go();
    }

    #[test]
    fn release_starts_every_held_request_and_holds_nothing_after() {
        let r = rig(cfg(10_000), Hold::sector(1));
        let counts: Arc<Vec<AtomicU64>> = Arc::new((0..10).map(|_| AtomicU64::new(0)).collect());
        let submit = |sector: u64, id: u64| {
            let (counts, tx) = (counts.clone(), r.tx.clone());
            r.p.submit(r.req(RequestKind::Read, sector, id), move |req, res| {
                counts[req.id as usize].fetch_add(1, Ordering::SeqCst);
                let _ = tx.send((req.id, res));
            });
        };
        submit(1, 1);
        wait_held(&r.hold, 1);
        for id in 2..=6 {
            submit(BG + id, id);
        }
        assert_eq!(r.snap().held_now, 5);
        r.p.release();
        let mut all = r.completions(6);
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 3, 4, 5, 6]);
        r.assert_read_data(6, BG + 6);
        let s = r.snap();
        assert_eq!((s.held, s.held_now, s.bg_in_flight), (5, 0, 0));
        // After release a background read goes straight through, even with a foreground
        // request in flight.
        submit(1, 7);
        wait_held(&r.hold, 1);
        submit(BG + 8, 8);
        assert_eq!(r.completions(1), vec![8]);
        assert_eq!(r.snap().held, 5);
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![7]);
        assert!(r.wait(Duration::from_millis(50)).is_err());
        for (id, c) in counts.iter().enumerate().skip(1).take(8) {
            assert_eq!(c.load(Ordering::SeqCst), 1, "request {id}");
        }
    }

    #[test]
    fn background_writes_and_other_kinds_pass_through() {
        let r = rig(cfg(10_000), Hold::writes());
        // A background write in flight is not foreground: a background read starts at once.
        r.submit(RequestKind::Write, BG, 1);
        wait_held(&r.hold, 1);
        r.submit(RequestKind::Read, BG + 1, 2);
        assert_eq!(r.completions(1), vec![2]);
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![1]);
        // Its completion started no interval.
        r.submit(RequestKind::Read, BG + 2, 3);
        assert_eq!(r.completions(1), vec![3]);
        assert_eq!(r.snap().held, 0);
        // Other kinds are neither classified nor held, even with a foreground write in flight.
        r.submit(RequestKind::Write, 5, 4);
        wait_held(&r.hold, 1);
        let kinds = [
            RequestKind::Flush,
            RequestKind::Discard,
            RequestKind::WriteZeroes,
            RequestKind::GetId,
        ];
        for (k, id) in kinds.into_iter().zip(5u64..) {
            r.submit(k, 0, id);
        }
        let mut other: Vec<(u64, Status)> = (0..4).map(|_| r.next()).collect();
        other.sort_unstable_by_key(|o| o.0);
        assert_eq!(
            other,
            vec![
                (5, Status::Ok),
                (6, Status::Ok),
                (7, Status::Ok),
                (8, Status::Unsupp)
            ]
        );
        assert_eq!(r.attr.classified.load(Ordering::SeqCst), 4);
        r.hold.let_go();
        assert_eq!(r.completions(1), vec![4]);
        let s = r.snap();
        assert_eq!((s.background, s.background_writes, s.foreground), (2, 1, 1));
        assert_eq!((s.passthrough, s.held, s.preemption_intervals), (4, 0, 0));
        assert_eq!(r.attr.held_for(1), Duration::ZERO);
    }

    #[test]
    fn concurrent_mixed_requests_all_complete_once() {
        let c = IdleConfig {
            interval: Duration::from_millis(1),
            max_hold: Some(Duration::from_millis(20)),
            bg_depth: 2,
        };
        let r = rig(c, Hold::default());
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let r = &r;
                scope.spawn(move || {
                    for i in 0..200u64 {
                        let sector = if i % 2 == 0 { BG + i } else { i % 300 };
                        r.submit(RequestKind::Read, sector, t * 1000 + i);
                    }
                });
            }
        });
        let mut ids = r.completions(800);
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 800);
        let s = r.snap();
        assert_eq!((s.held_now, s.bg_in_flight, s.fg_in_flight), (0, 0, 0));
        assert_eq!(s.background, 400);
    }

    #[test]
    fn a_long_queue_drains_on_the_timer_thread_without_recursing() {
        // The disk below answers inline, so each started read completes inside its forward
        // and frees the next; the timer thread (small stack) must not nest them.
        let r = rig(cfg(1), Hold::sector(1));
        r.submit(RequestKind::Read, 1, 1);
        wait_held(&r.hold, 1);
        for id in 2..2002 {
            r.submit(RequestKind::Read, BG + id % 1000, id);
        }
        assert_eq!(r.snap().held_now, 2000);
        r.hold.let_go();
        let mut ids = r.completions(2001);
        ids.sort_unstable();
        assert_eq!(ids, (1..2002).collect::<Vec<u64>>());
        r.assert_read_data(2001, BG + 1);
        let s = r.snap();
        assert_eq!((s.held, s.held_now, s.bg_in_flight), (2000, 0, 0));
    }

    #[test]
    fn config_validation_names_the_option() {
        assert_eq!(IdleConfig::default().validate(), Ok(()));
        let bad = |c: IdleConfig| c.validate().expect_err("invalid").to_string();
        let ms = Duration::from_millis;
        assert_eq!(
            bad(IdleConfig {
                interval: Duration::ZERO,
                ..IdleConfig::default()
            }),
            "idle interval 0 ms is out of range (1 to 10000 ms)"
        );
        assert_eq!(
            bad(IdleConfig {
                interval: Duration::from_micros(500),
                ..IdleConfig::default()
            }),
            "idle interval 0.5 ms is out of range (1 to 10000 ms)"
        );
        assert_eq!(
            bad(IdleConfig {
                interval: ms(10_001),
                ..IdleConfig::default()
            }),
            "idle interval 10001 ms is out of range (1 to 10000 ms)"
        );
        assert_eq!(
            bad(IdleConfig {
                max_hold: Some(ms(5)),
                ..IdleConfig::default()
            }),
            "idle max_hold 5 ms is shorter than the idle interval 15 ms"
        );
        for depth in [0, 65] {
            assert_eq!(
                bad(IdleConfig {
                    bg_depth: depth,
                    ..IdleConfig::default()
                }),
                format!("idle bg_depth {depth} is out of range (1 to 64)")
            );
        }
        let edge = IdleConfig {
            interval: ms(10_000),
            max_hold: Some(ms(10_000)),
            bg_depth: 64,
        };
        assert_eq!(edge.validate(), Ok(()));
        let refused = IdleScheduler::stage(
            IdleConfig {
                bg_depth: 0,
                ..IdleConfig::default()
            },
            Arc::new(BySector::default()),
        );
        assert!(matches!(refused, Err(IdleError::BgDepth(0))));
    }

    #[test]
    fn snapshot_round_trips_through_json() {
        let (_, m) = IdleScheduler::new(IdleConfig::default(), Arc::new(BySector::default()))
            .expect("scheduler");
        m.held.fetch_add(3, Ordering::Relaxed);
        let s = m.snapshot();
        assert_eq!((s.interval_ms, s.max_hold_ms, s.bg_depth), (15, None, 1));
        let json = serde_json::to_string(&s).expect("serialize");
        let back: IdleSnapshot = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, s);
        assert_eq!(
            serde_json::to_string(&Owner::Background).expect("owner"),
            "\"background\""
        );
    }
}
