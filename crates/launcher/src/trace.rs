//! The trace session: drains the plugin's rings, pairs entries with returns, and feeds the
//! observers (strace-style writer, JSON writer, later insight engines).
//!
//! Records from different vCPU rings are merged by timestamp with a short hold-back, so an
//! entry seen on one vCPU is processed before its return on another (Sky §4.2).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use vmsight_introspect::syscall::event::{
    append_piece_ref, append_sums_ref, PieceRef, Spare, SumsRef,
};
use vmsight_introspect::syscall::{
    Completed, Drained, EntryEvent, IoSums, NameFilter, ReturnEvent, SyscallObserver, Tracker,
    TrackerStats,
};
use vmsight_ring::{ChannelHost, Record};

mod queue;

/// What to monitor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceTarget {
    /// The command `vmsight run` runs, and its descendants.
    Command,
    /// A guest process by PID, and its descendants.
    Pid(u32),
    /// Processes whose command name (`comm`) is this, and their descendants.
    Comm(String),
}

/// A `--trace` / `--insight-target` value that names no traceable process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceTargetError {
    #[error("unknown trace target @{0} (use @cmd, a PID or a command name)")]
    UnknownSpecial(String),
    #[error("PID {0} is out of range")]
    PidRange(String),
    #[error("PID 0 cannot be traced")]
    PidZero,
    #[error("command name {0:?} is longer than the kernel's 15-character comm")]
    CommTooLong(String),
}

impl std::str::FromStr for TraceTarget {
    type Err = TraceTargetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s == "@cmd" {
            return Ok(TraceTarget::Command);
        }
        if let Some(rest) = s.strip_prefix('@') {
            return Err(TraceTargetError::UnknownSpecial(rest.into()));
        }
        if s.chars().all(|c| c.is_ascii_digit()) {
            let pid: u32 = s
                .parse()
                .map_err(|_| TraceTargetError::PidRange(s.into()))?;
            if pid == 0 {
                return Err(TraceTargetError::PidZero);
            }
            return Ok(TraceTarget::Pid(pid));
        }
        if s.len() > 15 {
            return Err(TraceTargetError::CommTooLong(s.into()));
        }
        Ok(TraceTarget::Comm(s.to_string()))
    }
}

/// `--trace*` options.
#[derive(Debug, Clone)]
pub struct TraceConfig {
    pub target: TraceTarget,
    /// strace-style lines go here (`None`: stderr).
    pub out: Option<PathBuf>,
    /// Write strace-style lines at all (off when only JSON is wanted).
    pub text: bool,
    pub json: Option<PathBuf>,
    pub filter: NameFilter,
}

/// Counters of a finished trace.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceSummary {
    pub records: u64,
    pub entries: u64,
    pub returns: u64,
    pub data_pieces: u64,
    pub orphan_data: u64,
    pub tracker: TrackerStats,
}

/// The bytes of one DATA record, held in place (see [`vmsight_introspect::syscall::ArgData`]).
#[derive(Debug, Clone)]
pub struct Piece {
    pub arg: u8,
    len: u8,
    raw: [u8; vmsight_ring::data::CAPACITY],
    pub truncated: bool,
    pub fault: bool,
}

impl Piece {
    /// A piece of argument `arg` holding `bytes` (at most [`vmsight_ring::data::CAPACITY`];
    /// the rest is left out).
    pub fn new(arg: u8, bytes: &[u8], truncated: bool, fault: bool) -> Self {
        let mut raw = [0u8; vmsight_ring::data::CAPACITY];
        let n = bytes.len().min(raw.len());
        raw[..n].copy_from_slice(&bytes[..n]);
        Piece {
            arg,
            len: n as u8,
            raw,
            truncated,
            fault,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.raw[..usize::from(self.len)]
    }

    /// The bytes and flags of a DATA record, in place.
    pub(crate) fn from_record(r: &vmsight_ring::Record) -> Self {
        let (raw, len) = r.data_raw();
        Piece {
            arg: r.data_arg(),
            len: len as u8,
            raw,
            truncated: r.flags & vmsight_ring::flags::TRUNCATED != 0,
            fault: r.flags & vmsight_ring::flags::FAULT != 0,
        }
    }

    pub(crate) fn as_piece(&self) -> PieceRef<'_> {
        PieceRef {
            arg: self.arg,
            bytes: self.bytes(),
            truncated: self.truncated,
            fault: self.fault,
        }
    }
}

/// The checksums of one SUMS record, held in place (see
/// [`vmsight_introspect::syscall::SumsPiece`]).
#[derive(Debug, Clone, Default)]
pub struct Sums {
    pub header: IoSums,
    len: u8,
    sums: [(u64, u64); vmsight_ring::sums::PER_RECORD],
    /// Last record of the call.
    pub last: bool,
}

impl Sums {
    /// No checksums yet.
    pub fn new(header: IoSums, last: bool) -> Self {
        Sums {
            header,
            last,
            ..Sums::default()
        }
    }

    /// Adds (chunk index, checksum); false when the record's slots are all used.
    pub fn push(&mut self, chunk: u64, sum: u64) -> bool {
        let Some(slot) = self.sums.get_mut(usize::from(self.len)) else {
            return false;
        };
        *slot = (chunk, sum);
        self.len += 1;
        true
    }

    /// (chunk index = file offset / 4096, checksum).
    pub fn sums(&self) -> &[(u64, u64)] {
        &self.sums[..usize::from(self.len)]
    }

    fn as_sums(&self) -> SumsRef<'_> {
        SumsRef {
            header: &self.header,
            sums: self.sums(),
            last: self.last,
        }
    }
}

/// A decoded ring record.
#[derive(Debug, Clone)]
pub enum RawEvent {
    Entry(EntryEvent),
    /// A piece of an argument's bytes, belonging to the last entry of the same vCPU.
    Data {
        vcpu: u32,
        piece: Piece,
        offset: u32,
    },
    /// A piece re-read at the call's return, for the call that entered at `entry_ts`.
    LateData {
        vcpu: u32,
        entry_ts: u64,
        piece: Piece,
        offset: u32,
    },
    Return(ReturnEvent),
    /// Buffer checksums: at entry (writes; follow their entry like `Data`) or `late` at the
    /// return (reads; attached to the pending call that entered at `entry_ts`).
    Sums {
        vcpu: u32,
        entry_ts: u64,
        late: bool,
        piece: Sums,
    },
}

impl RawEvent {
    fn ts(&self) -> u64 {
        match self {
            RawEvent::Entry(e) => e.ts_ns,
            RawEvent::Return(r) => r.ts_ns,
            RawEvent::Data { .. } => 0,
            RawEvent::LateData { entry_ts, .. } => *entry_ts,
            RawEvent::Sums { late: false, .. } => 0,
            RawEvent::Sums { entry_ts, .. } => *entry_ts,
        }
    }

    /// A late piece or checksums: stamped with its entry's timestamp, delivered after the
    /// records of the same timestamp.
    fn is_late(&self) -> bool {
        matches!(self, RawEvent::LateData { .. } | RawEvent::Sums { .. })
    }

    /// The vCPU whose ring the record came from.
    fn vcpu(&self) -> u32 {
        match self {
            RawEvent::Entry(e) => e.vcpu,
            RawEvent::Return(r) => r.vcpu,
            RawEvent::Data { vcpu, .. }
            | RawEvent::LateData { vcpu, .. }
            | RawEvent::Sums { vcpu, .. } => *vcpu,
        }
    }
}

/// Running trace: call [`TraceSession::finish`] after QEMU has exited.
pub struct TraceSession {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<TraceSummary>,
}

/// Hold-back before processing, so other vCPUs' rings catch up (a vCPU thread may have taken
/// its timestamp but not yet pushed the record).
const HOLD_BACK_NS: u64 = 20_000_000;

/// Pause between drains that found little: well inside the hold-back, so delivery is not
/// delayed, and long enough that waking costs little (each wake-up of this thread is a
/// context switch). The rings hold 65 536 records per vCPU: 5 ms of the fastest guest loop
/// (a getppid loop writes about 1.3 million records a second) fills a tenth of one.
const IDLE_SLEEP: Duration = Duration::from_millis(5);

impl TraceSession {
    pub fn start(
        channel: Arc<Mutex<ChannelHost>>,
        observers: Vec<Box<dyn SyscallObserver>>,
    ) -> std::io::Result<TraceSession> {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("vmsight-trace".into())
            .spawn(move || {
                // Guest-written records and guest memory are all it reads from now on.
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::ChannelReader,
                );
                run(channel, observers, s2)
            })?;
        Ok(TraceSession { stop, handle })
    }

    /// Drains what is left, ends pending calls and returns the counters.
    pub fn finish(self) -> TraceSummary {
        self.stop.store(true, Ordering::Release);
        self.handle.thread().unpark();
        self.handle.join().unwrap_or_default()
    }
}

/// The trace thread: drain the rings, merge their records by timestamp and deliver them
/// until stopped, then end what is pending.
fn run(
    channel: Arc<Mutex<ChannelHost>>,
    observers: Vec<Box<dyn SyscallObserver>>,
    stop: Arc<AtomicBool>,
) -> TraceSummary {
    let mut s = Merger::new(observers);
    let mut batch: Vec<Record> = Vec::with_capacity(4096);
    loop {
        let stopping = stop.load(Ordering::Acquire);
        batch.clear();
        if let Ok(mut ch) = channel.lock() {
            ch.drain(|r| batch.push(*r));
        }
        s.step(&batch, vmsight_ring::monotonic_ns(), stopping);
        if stopping && batch.is_empty() && s.queue.is_empty() {
            break;
        }
        if batch.len() < 1024 {
            // `finish` unparks: the last drain starts at once.
            std::thread::park_timeout(IDLE_SLEEP);
        }
    }
    s.finish()
}

/// The trace thread's state: entries being assembled per vCPU, the records waiting to be
/// ordered, the call tracker and the observers.
struct Merger {
    sum: TraceSummary,
    tracker: Tracker,
    queue: queue::Queue,
    /// The entry being assembled on each vCPU (its data pieces follow it in that ring).
    open: Vec<Option<EntryEvent>>,
    observers: Vec<Box<dyn SyscallObserver>>,
    /// Calls the tracker just completed, on their way to the observers (kept to reuse).
    done: Vec<Completed>,
    /// Buffers of delivered calls, reused by the next ones.
    spare: Spare,
}

impl Merger {
    /// A merger with nothing seen yet.
    fn new(observers: Vec<Box<dyn SyscallObserver>>) -> Self {
        Merger {
            sum: TraceSummary::default(),
            tracker: Tracker::new(),
            queue: queue::Queue::default(),
            open: Vec::new(),
            observers,
            done: Vec::new(),
            spare: Spare::default(),
        }
    }

    /// One drain's worth: take the records, close the entries complete at `now` (all of them
    /// when `stopping`) and deliver what the hold-back allows.
    fn step(&mut self, batch: &[Record], now: u64, stopping: bool) {
        self.sum.records += batch.len() as u64;
        for r in batch {
            self.take_record(r);
        }
        let horizon = self.close_entries(now, stopping);
        self.deliver_until(horizon);
    }

    /// Take one ring record: data pieces join the entry being assembled on their vCPU (or
    /// are queued for the tracker), entries and returns close it.
    fn take_record(&mut self, r: &Record) {
        let Some(ev) = crate::trace_records::convert(r, &mut self.spare) else {
            return;
        };
        let vcpu = ev.vcpu() as usize;
        if vcpu >= 1024 {
            return; // corrupt record: the ring guards indices, this guards the vector
        }
        if self.open.len() <= vcpu {
            self.open.resize(vcpu + 1, None);
        }
        match ev {
            RawEvent::LateData {
                entry_ts,
                piece,
                offset,
                vcpu: v,
            } => {
                self.sum.data_pieces += 1;
                match self.open[vcpu].as_mut() {
                    Some(e) if e.ts_ns == entry_ts => {
                        append_piece_ref(e, piece.as_piece(), offset, &mut self.spare)
                    }
                    // Queued after its entry (same timestamp, stable sort) or attached to
                    // the pending call in the tracker.
                    _ => self.queue.push(
                        vcpu,
                        RawEvent::LateData {
                            vcpu: v,
                            entry_ts,
                            piece,
                            offset,
                        },
                    ),
                }
            }
            RawEvent::Sums {
                vcpu: v,
                entry_ts,
                late,
                piece,
            } => match self.open[vcpu].as_mut() {
                Some(e) if !late || e.ts_ns == entry_ts => {
                    append_sums_ref(e, piece.as_sums(), &mut self.spare)
                }
                _ if late => self.queue.push(
                    vcpu,
                    RawEvent::Sums {
                        vcpu: v,
                        entry_ts,
                        late,
                        piece,
                    },
                ),
                _ => self.sum.orphan_data += 1,
            },
            RawEvent::Data { piece, offset, .. } => {
                self.sum.data_pieces += 1;
                match self.open[vcpu].as_mut() {
                    Some(e) => append_piece_ref(e, piece.as_piece(), offset, &mut self.spare),
                    None => self.sum.orphan_data += 1,
                }
            }
            other => self.take_boundary(vcpu, other),
        }
    }

    /// An entry or a return on `vcpu`: it closes the entry being assembled there; an entry
    /// becomes the one being assembled, a return is queued.
    fn take_boundary(&mut self, vcpu: usize, ev: RawEvent) {
        // A new record on this vCPU closes the entry being assembled.
        if let Some(e) = self.open[vcpu].take() {
            self.queue.push(vcpu, RawEvent::Entry(e));
        }
        match ev {
            RawEvent::Entry(e) => {
                self.sum.entries += 1;
                self.drained(&Drained::Entry {
                    task: e.task,
                    tid: e.tid,
                    ts_ns: e.ts_ns,
                    nr: e.nr,
                });
                self.open[vcpu] = Some(e);
            }
            RawEvent::Return(r) => {
                self.sum.returns += 1;
                self.drained(&Drained::Return {
                    task: r.task,
                    tid: r.tid,
                    ts_ns: r.ts_ns,
                });
                self.queue.push(vcpu, RawEvent::Return(r));
            }
            RawEvent::Data { .. } | RawEvent::LateData { .. } | RawEvent::Sums { .. } => {}
        }
    }

    /// Tells every observer about a record just taken from a ring.
    fn drained(&mut self, ev: &Drained) {
        for o in &mut self.observers {
            o.on_drained(ev);
        }
    }

    /// Queue the entries that are complete (old enough, or all of them when stopping) and
    /// return the timestamp up to which queued records may be delivered.
    fn close_entries(&mut self, now: u64, stopping: bool) -> u64 {
        for (vcpu, slot) in self.open.iter_mut().enumerate() {
            // Pieces follow their entry within microseconds; an entry this old is complete
            // (its vCPU may simply have gone idle after it).
            if slot
                .as_ref()
                .is_some_and(|e| e.ts_ns.saturating_add(HOLD_BACK_NS) < now)
            {
                if let Some(e) = slot.take() {
                    self.queue.push(vcpu, RawEvent::Entry(e));
                }
            }
        }
        let horizon = if stopping {
            for (vcpu, slot) in self.open.iter_mut().enumerate() {
                if let Some(e) = slot.take() {
                    self.queue.push(vcpu, RawEvent::Entry(e));
                }
            }
            u64::MAX
        } else {
            now.saturating_sub(HOLD_BACK_NS)
        };
        // Entries still being assembled hold back everything after them on all vCPUs.
        self.open
            .iter()
            .flatten()
            .map(|e| e.ts_ns.saturating_sub(1))
            .fold(horizon, u64::min)
    }

    /// Deliver the queued records up to `horizon`, in timestamp order (a late piece shares
    /// its entry's timestamp and comes after it).
    fn deliver_until(&mut self, horizon: u64) {
        while let Some(ev) = self.queue.pop_until(horizon) {
            self.deliver(ev);
        }
    }

    /// Deliver one record: entries and returns to the tracker (and entries to the observers),
    /// late pieces to the pending call they belong to.
    fn deliver(&mut self, ev: RawEvent) {
        match ev {
            RawEvent::Entry(e) => {
                tracing::trace!(
                    "entry task={:#x} tid={} nr={} pc={:#x} ts={}",
                    e.task,
                    e.tid,
                    e.nr,
                    e.pc,
                    e.ts_ns
                );
                for o in self.observers.iter_mut() {
                    o.on_entry(&e);
                }
                self.tracker.on_entry_into(e, &mut self.done);
                self.complete();
            }
            RawEvent::Return(r) => {
                tracing::trace!(
                    "return task={:#x} tid={} rip={:#x} rax={:#x} via={:?} ts={}",
                    r.task,
                    r.tid,
                    r.rip,
                    r.rax,
                    r.via,
                    r.ts_ns
                );
                self.tracker.on_return_into(&r, &mut self.done);
                self.complete();
            }
            RawEvent::LateData {
                entry_ts,
                piece,
                offset,
                ..
            } => {
                let p = piece.as_piece();
                if !self
                    .tracker
                    .attach_late_data_ref(entry_ts, p, offset, &mut self.spare)
                {
                    self.sum.orphan_data += 1;
                }
            }
            RawEvent::Sums {
                entry_ts, piece, ..
            } => {
                let p = piece.as_sums();
                if !self
                    .tracker
                    .attach_late_sums_ref(entry_ts, p, &mut self.spare)
                {
                    self.sum.orphan_data += 1;
                }
            }
            RawEvent::Data { .. } => {}
        }
    }

    /// Hand the calls just completed to every observer, in order.
    fn complete(&mut self) {
        for c in self.done.drain(..) {
            for o in self.observers.iter_mut() {
                o.on_complete(&c);
            }
            self.spare.recycle(c.entry);
        }
    }

    /// End the calls still pending, finish the observers and return the counters.
    fn finish(mut self) -> TraceSummary {
        self.done = self.tracker.finish();
        self.complete();
        for o in self.observers.iter_mut() {
            o.finish();
        }
        self.sum.tracker = self.tracker.stats();
        self.sum
    }
}

/// The trace thread's processing without its ring and clock, for benchmarks
/// (`examples/trace_throughput.rs`): batches of records go through exactly the steps
/// [`TraceSession`]'s thread takes after each drain.
#[doc(hidden)]
pub struct Replay(Merger);

impl Replay {
    /// A replay feeding `observers`.
    pub fn new(observers: Vec<Box<dyn SyscallObserver>>) -> Self {
        Replay(Merger::new(observers))
    }

    /// One drain: `batch` as the rings gave it, processed as if the host clock read `now`.
    pub fn step(&mut self, batch: &[Record], now: u64) {
        self.0.step(batch, now, false);
    }

    /// The last drain (everything left is delivered), then the trace's end.
    pub fn finish(mut self) -> TraceSummary {
        self.0.step(&[], u64::MAX, true);
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_introspect::syscall::event::append_piece;
    use vmsight_introspect::syscall::ArgData;

    #[test]
    fn trace_targets_parse() {
        assert_eq!("@cmd".parse::<TraceTarget>().unwrap(), TraceTarget::Command);
        assert_eq!("".parse::<TraceTarget>().unwrap(), TraceTarget::Command);
        assert_eq!("123".parse::<TraceTarget>().unwrap(), TraceTarget::Pid(123));
        assert_eq!(
            "gpg".parse::<TraceTarget>().unwrap(),
            TraceTarget::Comm("gpg".into())
        );
        assert!("0".parse::<TraceTarget>().is_err());
        assert!("@all".parse::<TraceTarget>().is_err());
        assert!("averyveryverylongname".parse::<TraceTarget>().is_err());
    }

    #[test]
    fn pieces_are_appended_in_order() {
        let mut e = EntryEvent::default();
        let p = |b: &[u8], t| ArgData {
            arg: 1,
            bytes: b.to_vec(),
            truncated: t,
            fault: false,
        };
        append_piece(&mut e, p(b"/etc/", true), 0);
        append_piece(&mut e, p(b"passwd", false), 5);
        assert_eq!(e.arg_data(1).unwrap().bytes, b"/etc/passwd");
        assert!(!e.arg_data(1).unwrap().truncated);
        append_piece(&mut e, p(b"zz", false), 99);
        assert!(e.arg_data(1).unwrap().truncated);
    }
}
