//! The symbiotic interface, vmsight's side (after SymCall, Lange & Dinda, VEE'11;
//! docs/symbiotic.md): discovery through fw_cfg, a region shared with the guest module
//! `vmsight_sym` through an `ivshmem-doorbell` device, the SymSpy page read without exits, and
//! symcalls over two transports behind one API ([`Symbiotic::call`]).
//!
//! - [`region`]: the shared memfd and its bounded accessors;
//! - [`ivshmem`]: the ivshmem server protocol and the doorbells;
//! - [`spy`]: the SymSpy page read as hostile input;
//! - [`serve`]: the thread that serves QEMU's connection and the guest's doorbells.
//!
//! Symcalls never nest: one call at a time per VM. A call that timed out leaves the interface
//! *busy* until the guest answers it, so a late answer can never be taken for a newer call.

pub mod ivshmem;
pub mod lookup;
pub mod region;
pub mod serve;
pub mod spy;
pub mod sync;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vmsight_proto::sym::{
    call_state, feature, guest_state, nr, refuse, sync_word, transport, vmm_state, CallReply,
    CallRequest, SpyReport, SymCounters, SyncStages, Transport, ABI_VERSION, CALL, CALL_DATA,
    GUEST, VECTORS, VEC_CALL, VEC_STATE, VMM, VMM_MAGIC,
};

use ivshmem::Doorbells;
use region::Region;

/// What can go wrong on vmsight's side of the interface.
#[derive(Debug, thiserror::Error)]
pub enum SymError {
    #[error("VM {vm}: cannot create the symbiotic region: {what}: {source}")]
    Region {
        vm: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("VM {vm}: cannot set up the symbiotic device's doorbells: {source}")]
    Doorbells {
        vm: String,
        #[source]
        source: std::io::Error,
    },
    #[error("VM {vm}: the symbiotic interface is off: {reason}")]
    NotActive { vm: String, reason: String },
    #[error("VM {vm}: the guest module does not serve symcall {nr} ({name})")]
    Unsupported { vm: String, nr: u32, name: String },
    #[error("VM {vm}: the synchronous transport is unavailable: {reason}")]
    SyncUnavailable { vm: String, reason: String },
    #[error(
        "VM {vm}: busy: symcall #{seq} timed out {since_ms} ms ago and the guest has not \
         answered it yet"
    )]
    Busy {
        vm: String,
        seq: u64,
        since_ms: u128,
    },
    #[error("VM {vm}: symcall #{seq} ({name}) got no answer within {ms} ms")]
    Timeout {
        vm: String,
        seq: u64,
        name: String,
        ms: u64,
    },
    #[error("VM {vm}: the synchronous transport failed: {reason}")]
    Sync { vm: String, reason: String },
    #[error("VM {vm}: bad symcall request: {reason}")]
    BadRequest { vm: String, reason: String },
}

/// Where the module's synchronous entry is (from its SymSpy page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncEntry {
    pub entry: u64,
    pub return_to: u64,
    pub stack: u64,
}

/// Why the synchronous transport rings the guest's state doorbell (counted apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Every vCPU was halted when the call was posted: nobody would take it until an
    /// interrupt, so the guest is rung at once.
    Idle,
    /// Every vCPU was halted or running user code (entering the kernel only on the next
    /// timer tick or syscall): rung at once too.
    User,
    /// No vCPU took the call within `sync::WAKE_AFTER` (or again, every `sync::WAKE_AGAIN`).
    Waited,
}

/// The synchronous transport: runs the module's entry on a vCPU (the plugin's redirection,
/// QEMU 11) and returns the entry's `rax`. Set once the plugin channel exists.
pub trait SyncTransport: Send + Sync {
    /// `word` is the entry's first argument: the call number tagged with the call's sequence
    /// (`vmsight_proto::sym::sync_word`).
    fn call(
        &self,
        at: SyncEntry,
        word: u64,
        args: [u64; 5],
        timeout: Duration,
        wake: &dyn Fn(Wake),
    ) -> Result<SyncReturn, String>;
}

/// What a synchronous call's entry returned, and where its time went.
#[derive(Debug, Clone, Copy)]
pub struct SyncReturn {
    /// The entry's `rax`.
    pub rax: i64,
    pub stages: Option<SyncStages>,
}

/// Live counters (atomics: the serving thread and callers update them).
#[derive(Default)]
struct Counters {
    hellos: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    doorbells_call: AtomicU64,
    doorbells_state: AtomicU64,
    doorbells_spurious: AtomicU64,
    calls_doorbell: AtomicU64,
    calls_sync: AtomicU64,
    sync_wakes_idle: AtomicU64,
    sync_wakes_user: AtomicU64,
    sync_wakes_waited: AtomicU64,
    timeouts: AtomicU64,
    busy: AtomicU64,
    spy_reads: AtomicU64,
    spy_problems: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> SymCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SymCounters {
            hellos: g(&self.hellos),
            accepted: g(&self.accepted),
            refused: g(&self.refused),
            doorbells_call: g(&self.doorbells_call),
            doorbells_state: g(&self.doorbells_state),
            doorbells_spurious: g(&self.doorbells_spurious),
            calls_doorbell: g(&self.calls_doorbell),
            calls_sync: g(&self.calls_sync),
            sync_wakes_idle: g(&self.sync_wakes_idle),
            sync_wakes_user: g(&self.sync_wakes_user),
            sync_wakes_waited: g(&self.sync_wakes_waited),
            timeouts: g(&self.timeouts),
            busy: g(&self.busy),
            spy_reads: g(&self.spy_reads),
            spy_problems: g(&self.spy_problems),
        }
    }
}

/// The one call slot (symcalls never nest).
#[derive(Default)]
struct Slot {
    next_seq: u64,
    /// A call that timed out and the guest has not answered yet: its id, when it timed out,
    /// and the module generation it was posted to.
    unanswered: Option<Unanswered>,
}

#[derive(Clone, Copy)]
struct Unanswered {
    seq: u64,
    since: Instant,
    generation: u64,
}

/// A VM's symbiotic interface.
pub struct Symbiotic {
    vm: String,
    region: Region,
    bells: Doorbells,
    features: u32,
    counters: Counters,
    slot: Mutex<Slot>,
    /// The id of the call in flight (0: none); read by the serving thread without the slot.
    in_flight: AtomicU64,
    /// The `done_seq` the last call doorbell found (spurious-doorbell accounting).
    last_answer: AtomicU64,
    /// Bumped whenever the guest module says hello or goes away: a call left unanswered by
    /// an earlier module can never be answered (the module that owed it is gone).
    generation: AtomicU64,
    /// Signalled by the serving thread when the guest rings the call vector.
    answered: (Mutex<u64>, Condvar),
    sync: OnceLock<Box<dyn SyncTransport>>,
    /// Why the synchronous transport is not offered (QEMU 10, no plugin), when it is not.
    sync_missing: Mutex<String>,
}

/// Interval at which the guest refreshes SymSpy unless told otherwise, ms.
pub const DEFAULT_REFRESH_MS: u32 = 200;

impl Symbiotic {
    /// Creates the region and writes vmsight's page; nothing runs yet ([`serve`] does).
    pub fn new(
        vm: &str,
        disk_hints: &[spy::DiskHint],
        swap: bool,
    ) -> Result<Arc<Symbiotic>, SymError> {
        let region = Region::create(vm)?;
        let bells = Doorbells::new().map_err(|source| SymError::Doorbells {
            vm: vm.to_owned(),
            source,
        })?;
        let mut features = feature::SPY | feature::DOORBELL | feature::SYNC;
        if swap {
            features |= feature::SWAP;
        }
        let s = Symbiotic {
            vm: vm.to_owned(),
            region,
            bells,
            features,
            counters: Counters::default(),
            slot: Mutex::new(Slot {
                next_seq: 1,
                unanswered: None,
            }),
            in_flight: AtomicU64::new(0),
            last_answer: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            answered: (Mutex::new(0), Condvar::new()),
            sync: OnceLock::new(),
            sync_missing: Mutex::new("the VM has no TCG plugin speaking API v7 (QEMU 11)".into()),
        };
        s.write_vmm_page(disk_hints);
        Ok(Arc::new(s))
    }

    fn write_vmm_page(&self, hints: &[spy::DiskHint]) {
        let r = &self.region;
        r.store32(VMM.at("abi"), ABI_VERSION);
        r.store32(VMM.at("features"), self.features);
        r.store32(VMM.at("vmm_peer"), ivshmem::VMM_PEER);
        r.store32(VMM.at("refresh_ms"), DEFAULT_REFRESH_MS);
        let v = VMM.field("vmsight_version");
        let mut ver = env!("CARGO_PKG_VERSION").as_bytes().to_vec();
        ver.resize(v.ty.size() - 1, 0);
        r.write(VMM.at("vmsight_version"), &ver);
        spy::write_hints(r, hints);
        r.store32(VMM.at("state"), vmm_state::WAITING);
        // The magic last: the module accepts the device only once the page is complete.
        r.store64(VMM.at("magic"), VMM_MAGIC);
    }

    /// The VM's name.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// The fw_cfg announcement (`abi=1 features=0x7 ...`).
    pub fn announcement(&self) -> String {
        vmsight_proto::sym::announcement(self.features)
            .trim()
            .to_owned()
    }

    /// Offers the synchronous transport (the plugin channel exists and speaks API v7).
    pub fn set_sync(&self, t: Box<dyn SyncTransport>) {
        let _ = self.sync.set(t);
    }

    /// Records why the synchronous transport is not offered.
    pub fn set_sync_missing(&self, why: &str) {
        if let Ok(mut m) = self.sync_missing.lock() {
            *m = why.to_owned();
        }
    }

    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    pub(crate) fn bells(&self) -> &Doorbells {
        &self.bells
    }

    pub fn counters(&self) -> SymCounters {
        self.counters.snapshot()
    }

    /// The guest rang vmsight's state vector: answer a hello, note a refusal.
    pub(crate) fn on_state_doorbell(&self) {
        bump(&self.counters.doorbells_state);
        let r = &self.region;
        let state = r.load32(GUEST.at("state"));
        if matches!(state, guest_state::HELLO | guest_state::GONE) {
            // A new module instance, or none: an unanswered call of the old one is abandoned.
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        let (answer, reason) = match state {
            guest_state::HELLO => {
                bump(&self.counters.hellos);
                if r.load64(GUEST.at("magic")) != vmsight_proto::sym::GUEST_MAGIC {
                    (vmm_state::REFUSED, refuse::MALFORMED)
                } else if r.load32(GUEST.at("abi")) != ABI_VERSION {
                    (vmm_state::REFUSED, refuse::VERSION)
                } else {
                    (vmm_state::ACCEPTED, refuse::NONE)
                }
            }
            // The module refused our version itself: the interface is off on both sides.
            guest_state::REFUSED => (vmm_state::REFUSED, refuse::VERSION),
            // Unloaded: wait for the next hello (never let it find a stale "accepted").
            guest_state::GONE => {
                r.store32(VMM.at("refuse_reason"), refuse::NONE);
                r.store32(VMM.at("state"), vmm_state::WAITING);
                return;
            }
            _ => return,
        };
        if answer == vmm_state::ACCEPTED {
            bump(&self.counters.accepted);
        } else {
            bump(&self.counters.refused);
            tracing::warn!(
                "VM {}: symbiotic module refused: {}",
                self.vm,
                spy::refusal(reason, r.load32(GUEST.at("abi")))
            );
        }
        r.store32(VMM.at("refuse_reason"), reason);
        r.store32(VMM.at("state"), answer);
        // Last: the module trusts the answer only once it carries its hello's id.
        r.store32(
            VMM.at("answered_hello"),
            r.load64(GUEST.at("hello_id")) as u32,
        );
        if let Err(e) = self.bells.ring_guest(VEC_STATE) {
            tracing::warn!("VM {}: cannot ring the guest: {e}", self.vm);
        }
    }

    /// The guest rang vmsight's call vector `rings` times since the last wakeup (an eventfd
    /// adds them up). A ring is spurious unless it brought a new answer: at most one ring per
    /// new `done_seq` of a call vmsight made.
    pub(crate) fn on_call_doorbell(&self, rings: u64) {
        self.counters
            .doorbells_call
            .fetch_add(rings, Ordering::Relaxed);
        let done = self.region.load64(CALL.at("done_seq"));
        let made = self.in_flight.load(Ordering::Acquire);
        let last = self.last_answer.swap(done, Ordering::AcqRel);
        let new_answer = done != last && done != 0 && done <= made;
        let spurious = rings - u64::from(new_answer);
        if spurious > 0 {
            self.counters
                .doorbells_spurious
                .fetch_add(spurious, Ordering::Relaxed);
        }
        let (m, cv) = &self.answered;
        if let Ok(mut g) = m.lock() {
            *g = g.wrapping_add(1);
        }
        cv.notify_all();
    }

    /// vmsight is going away: tell the module to answer nothing more.
    pub fn shutdown(&self) {
        self.region.store32(VMM.at("state"), vmm_state::GONE);
        let _ = self.bells.ring_guest(VEC_STATE);
    }

    /// The interface's state and the guest's page, validated.
    pub fn spy(&self) -> SpyReport {
        bump(&self.counters.spy_reads);
        let mut report = spy::read(&self.region);
        if !report.problems.is_empty() {
            self.counters
                .spy_problems
                .fetch_add(report.problems.len() as u64, Ordering::Relaxed);
        }
        report.features = spy::feature_names(self.features);
        report.transports = self.transports(report.guest.as_ref());
        if report.refused.is_none() && report.vmm_state != "accepted" {
            report.refused = Some(self.inactive_reason());
        }
        report.counters = self.counters.snapshot();
        report
    }

    fn transports(&self, g: Option<&vmsight_proto::sym::GuestSpy>) -> Vec<Transport> {
        if self.active().is_err() {
            return Vec::new();
        }
        let mut t = vec![Transport::Doorbell];
        if self.sync.get().is_some() && g.is_some_and(|g| g.sync_entry) {
            t.push(Transport::Sync);
        }
        t
    }

    fn inactive_reason(&self) -> String {
        let r = &self.region;
        match (r.load32(VMM.at("state")), r.load32(GUEST.at("state"))) {
            (vmm_state::REFUSED, _) => spy::refusal(
                r.load32(VMM.at("refuse_reason")),
                r.load32(GUEST.at("abi")),
            ),
            (vmm_state::GONE, _) => "vmsight is shutting down".into(),
            (_, guest_state::NONE) => {
                "no guest module has answered (the guest loads vmsight_sym at boot with --symbiotic, or with `modprobe vmsight_sym`)".into()
            }
            (_, guest_state::GONE) => "the guest module was unloaded".into(),
            (_, guest_state::HELLO) => "the handshake has not finished".into(),
            (v, g) => format!(
                "vmsight state {}, guest state {}",
                vmsight_proto::sym::vmm_state_name(v),
                vmsight_proto::sym::guest_state_name(g)
            ),
        }
    }

    /// Ok when both sides agreed and the module is active.
    fn active(&self) -> Result<(), SymError> {
        let r = &self.region;
        let ok = r.load32(VMM.at("state")) == vmm_state::ACCEPTED
            && r.load32(GUEST.at("state")) == guest_state::ACTIVE
            && r.load64(GUEST.at("magic")) == vmsight_proto::sym::GUEST_MAGIC;
        if ok {
            Ok(())
        } else {
            Err(SymError::NotActive {
                vm: self.vm.clone(),
                reason: self.inactive_reason(),
            })
        }
    }

    fn announced(&self, n: u32) -> bool {
        if n > nr::MAX {
            return false;
        }
        let word = self
            .region
            .load64(GUEST.at("symcalls") + 8 * (n as usize / 64));
        word & (1 << (n % 64)) != 0
    }

    fn sync_entry(&self) -> Option<SyncEntry> {
        let r = &self.region;
        let e = SyncEntry {
            entry: r.load64(GUEST.at("sync_entry")),
            return_to: r.load64(GUEST.at("sync_return")),
            stack: r.load64(GUEST.at("sync_stack")),
        };
        // Kernel addresses only: the module runs in the kernel half (from 0xff00... with
        // 5-level paging, which TCG guests use, 0xffff8... with 4 levels).
        let kernel = |a: u64| a >= 0xff00_0000_0000_0000;
        (kernel(e.entry) && kernel(e.return_to) && kernel(e.stack)).then_some(e)
    }

    /// Makes one symcall and waits for the answer (or the timeout).
    pub fn call(&self, req: &CallRequest) -> Result<CallReply, SymError> {
        let name = nr::name(req.nr).map_or_else(|| format!("#{}", req.nr), str::to_owned);
        if req.args.len() > 5 {
            return Err(SymError::BadRequest {
                vm: self.vm.clone(),
                reason: format!("{} arguments; a symcall takes at most 5", req.args.len()),
            });
        }
        self.active()?;
        if !self.announced(req.nr) {
            return Err(SymError::Unsupported {
                vm: self.vm.clone(),
                nr: req.nr,
                name,
            });
        }
        let mut args = [0u64; 5];
        args[..req.args.len()].copy_from_slice(&req.args);
        let timeout = Duration::from_millis(
            req.timeout_ms
                .clamp(1, vmsight_proto::sym::MAX_CALL_TIMEOUT_MS),
        );
        let sync = self.choose_transport(req.transport)?;
        let mut slot = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.check_unanswered(&mut slot)?;
        let generation = self.generation.load(Ordering::Acquire);
        let seq = slot.next_seq;
        slot.next_seq += 1;
        let t0 = Instant::now();
        self.in_flight.store(seq, Ordering::Release);
        self.post(
            seq,
            req.nr,
            args,
            if sync.is_some() {
                transport::SYNC
            } else {
                transport::DOORBELL
            },
        );
        if let Some(at) = sync {
            let outcome = self.run_sync(at, sync_word(req.nr, seq), args, timeout);
            return self.sync_outcome(seq, req.nr, name, outcome, timeout, t0);
        }
        self.run_doorbell(seq, timeout)?;
        if self.answer_of(seq) {
            bump(&self.counters.calls_doorbell);
            return Ok(self.reply(seq, req.nr, false, t0.elapsed()));
        }
        bump(&self.counters.timeouts);
        // The module's thread may still answer it: later calls wait for that (busy), unless
        // the module is reloaded first.
        slot.unanswered = Some(Unanswered {
            seq,
            since: Instant::now(),
            generation,
        });
        Err(SymError::Timeout {
            vm: self.vm.clone(),
            seq,
            name,
            ms: timeout.as_millis() as u64,
        })
    }

    /// The end of a synchronous call. The redirection either returned (with the module's
    /// answer in the call page, or with a refusal such as -EBUSY in rax and no answer), or it
    /// never ran or did not return in time: then the post is withdrawn (the module publishes
    /// only for the call still posted), so the next call does not wait for it.
    fn sync_outcome(
        &self,
        seq: u64,
        n: u32,
        name: String,
        outcome: Result<Option<SyncReturn>, SymError>,
        timeout: Duration,
        t0: Instant,
    ) -> Result<CallReply, SymError> {
        let stages = outcome.as_ref().ok().and_then(|o| o.and_then(|r| r.stages));
        if self.answer_of(seq) {
            bump(&self.counters.calls_sync);
            let mut r = self.reply(seq, n, true, t0.elapsed());
            r.stages = stages;
            return Ok(r);
        }
        self.region
            .cas32(CALL.at("state"), call_state::POSTED, call_state::IDLE);
        match outcome {
            Ok(Some(ret)) => {
                bump(&self.counters.calls_sync);
                let mut r = self.reply(seq, n, true, t0.elapsed());
                (r.ret, r.rets, r.data, r.stages) = (ret.rax, [0; 4], Vec::new(), stages);
                Ok(r)
            }
            Ok(None) => {
                bump(&self.counters.timeouts);
                Err(SymError::Timeout {
                    vm: self.vm.clone(),
                    seq,
                    name,
                    ms: timeout.as_millis() as u64,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn choose_transport(&self, want: Transport) -> Result<Option<SyncEntry>, SymError> {
        let available = || -> Result<SyncEntry, String> {
            if self.sync.get().is_none() {
                return Err(self
                    .sync_missing
                    .lock()
                    .map(|m| m.clone())
                    .unwrap_or_default());
            }
            self.sync_entry()
                .ok_or_else(|| "the guest module publishes no synchronous entry".to_owned())
        };
        match want {
            Transport::Doorbell => Ok(None),
            Transport::Auto => Ok(available().ok()),
            Transport::Sync => available()
                .map(Some)
                .map_err(|reason| SymError::SyncUnavailable {
                    vm: self.vm.clone(),
                    reason,
                }),
        }
    }

    /// Fails with `Busy` while an earlier call that timed out is still unanswered by the
    /// module it was posted to (a reloaded module never answers its predecessor's call).
    fn check_unanswered(&self, slot: &mut Slot) -> Result<(), SymError> {
        let Some(Unanswered {
            seq,
            since,
            generation,
        }) = slot.unanswered
        else {
            return Ok(());
        };
        let state = self.region.load32(CALL.at("state"));
        let reloaded = generation != self.generation.load(Ordering::Acquire);
        let finished = reloaded || self.answer_of(seq) || state == call_state::IDLE;
        if finished {
            slot.unanswered = None;
            return Ok(());
        }
        bump(&self.counters.busy);
        Err(SymError::Busy {
            vm: self.vm.clone(),
            seq,
            since_ms: since.elapsed().as_millis(),
        })
    }

    fn post(&self, seq: u64, n: u32, args: [u64; 5], how: u32) {
        let r = &self.region;
        r.store32(CALL.at("state"), call_state::IDLE);
        r.store32(CALL.at("nr"), n);
        r.store32(CALL.at("transport"), how);
        for (i, a) in args.iter().enumerate() {
            r.store64(CALL.at("args") + 8 * i, *a);
        }
        r.store64(CALL.at("ret"), 0);
        for i in 0..4 {
            r.store64(CALL.at("rets") + 8 * i, 0);
        }
        r.store32(CALL.at("data_len"), 0);
        r.store64(CALL.at("seq"), seq);
        r.store32(CALL.at("state"), call_state::POSTED);
    }

    fn answer_of(&self, seq: u64) -> bool {
        self.region.load32(CALL.at("state")) == call_state::DONE
            && self.region.load64(CALL.at("done_seq")) == seq
    }

    /// Rings the guest and waits for its answer: a short spin on the call page (the answer
    /// is often there within microseconds), then sleeps woken by the guest's doorbell.
    fn run_doorbell(&self, seq: u64, timeout: Duration) -> Result<(), SymError> {
        let (m, cv) = &self.answered;
        let mut seen = m.lock().map(|g| *g).unwrap_or(0);
        self.bells
            .ring_guest(VEC_CALL)
            .map_err(|e| SymError::NotActive {
                vm: self.vm.clone(),
                reason: format!("cannot ring the guest: {e}"),
            })?;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_micros(50) {
            if self.answer_of(seq) {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let deadline = t0 + timeout;
        let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if self.answer_of(seq) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(()); // the caller sees no answer: a timeout
            }
            // Wake at least every 5 ms: a lost doorbell costs latency, never the answer.
            let wait = (deadline - now).min(Duration::from_millis(5));
            let (ng, _) = cv
                .wait_timeout_while(g, wait, |c| *c == seen)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            g = ng;
            seen = *g;
        }
    }

    /// Runs the call on a vCPU: `Some(rax)` when the entry returned, `None` when it did not
    /// within `timeout` (the redirection is then cancelled).
    fn run_sync(
        &self,
        at: SyncEntry,
        word: u64,
        args: [u64; 5],
        timeout: Duration,
    ) -> Result<Option<SyncReturn>, SymError> {
        let Some(t) = self.sync.get() else {
            return Err(SymError::SyncUnavailable {
                vm: self.vm.clone(),
                reason: "not offered".into(),
            });
        };
        let wake = |why: Wake| {
            bump(match why {
                Wake::Idle => &self.counters.sync_wakes_idle,
                Wake::User => &self.counters.sync_wakes_user,
                Wake::Waited => &self.counters.sync_wakes_waited,
            });
            let _ = self.bells.ring_guest(VEC_STATE);
        };
        match t.call(at, word, args, timeout, &wake) {
            Ok(r) => Ok(Some(r)),
            Err(reason) if reason.contains("timed out") => Ok(None),
            Err(reason) => Err(SymError::Sync {
                vm: self.vm.clone(),
                reason,
            }),
        }
    }

    fn reply(&self, seq: u64, n: u32, sync: bool, latency: Duration) -> CallReply {
        let r = &self.region;
        let len = (r.load32(CALL.at("data_len")) as usize).min(CALL_DATA);
        CallReply {
            nr: n,
            name: nr::name(n).map(str::to_owned),
            transport: if sync {
                Transport::Sync
            } else {
                Transport::Doorbell
            },
            seq,
            ret: r.load64(CALL.at("ret")) as i64,
            rets: std::array::from_fn(|i| r.load64(CALL.at("rets") + 8 * i)),
            data: r.read(CALL.at("data"), len),
            latency_ns: latency.as_nanos() as u64,
            stages: None,
        }
    }
}

/// Vectors the device is created with.
pub const DEVICE_VECTORS: u32 = VECTORS;

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_proto::sym::GUEST_MAGIC;

    fn hello(s: &Symbiotic, abi: u32, state: u32) {
        s.region.store64(GUEST.at("magic"), GUEST_MAGIC);
        s.region.store32(GUEST.at("abi"), abi);
        s.region.store32(GUEST.at("state"), state);
        s.on_state_doorbell();
    }

    #[test]
    fn the_handshake_accepts_this_version_refuses_others_and_forgets_an_unloaded_module() {
        let s = Symbiotic::new("t", &[], false).unwrap();
        assert_eq!(s.region.load64(VMM.at("magic")), VMM_MAGIC);
        hello(&s, 99, guest_state::HELLO);
        assert_eq!(s.region.load32(VMM.at("state")), vmm_state::REFUSED);
        assert!(s.spy().refused.unwrap().contains("version 99"));
        hello(&s, ABI_VERSION, guest_state::HELLO);
        assert_eq!(s.region.load32(VMM.at("state")), vmm_state::ACCEPTED);
        hello(&s, ABI_VERSION, guest_state::GONE);
        assert_eq!(s.region.load32(VMM.at("state")), vmm_state::WAITING);
        // A guest that refused by itself turns the interface off on vmsight's side too.
        hello(&s, 7, guest_state::REFUSED);
        assert_eq!(s.region.load32(VMM.at("state")), vmm_state::REFUSED);
        let c = s.counters();
        assert_eq!((c.hellos, c.accepted, c.refused), (2, 1, 2));
        // Calls are refused with the reason while the interface is off.
        let e = s
            .call(&CallRequest {
                nr: nr::ECHO,
                args: vec![1],
                transport: Transport::Auto,
                timeout_ms: 10,
            })
            .unwrap_err();
        assert!(e.to_string().contains("version 7"), "{e}");
    }

    /// A synchronous transport that never runs the call, or returns a refusal.
    struct FakeSync(Option<i64>);

    impl SyncTransport for FakeSync {
        fn call(
            &self,
            _: SyncEntry,
            _: u64,
            _: [u64; 5],
            _: Duration,
            _: &dyn Fn(Wake),
        ) -> Result<SyncReturn, String> {
            self.0
                .map(|rax| SyncReturn { rax, stages: None })
                .ok_or_else(|| "timed out".to_owned())
        }
    }

    fn active_with_sync(answer: Option<i64>) -> Arc<Symbiotic> {
        let s = Symbiotic::new("t", &[], false).unwrap();
        hello(&s, ABI_VERSION, guest_state::HELLO);
        s.region.store32(GUEST.at("state"), guest_state::ACTIVE);
        s.region.store64(GUEST.at("symcalls"), 1 << nr::ECHO);
        s.region
            .store64(GUEST.at("sync_entry"), 0xffff_ffff_c000_0000);
        s.region
            .store64(GUEST.at("sync_return"), 0xffff_ffff_c000_0010);
        s.region
            .store64(GUEST.at("sync_stack"), 0xff11_0000_0000_4000);
        s.set_sync(Box::new(FakeSync(answer)));
        s
    }

    fn sync_echo(s: &Symbiotic) -> Result<CallReply, SymError> {
        s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![1],
            transport: Transport::Sync,
            timeout_ms: 10,
        })
    }

    #[test]
    fn a_synchronous_call_that_never_ran_is_withdrawn_and_does_not_block_the_next() {
        let s = active_with_sync(None);
        assert!(matches!(sync_echo(&s), Err(SymError::Timeout { .. })));
        assert_eq!(s.region.load32(CALL.at("state")), call_state::IDLE);
        // Not busy: the next call is posted (and times out the same way).
        assert!(matches!(
            sync_echo(&s),
            Err(SymError::Timeout { seq: 2, .. })
        ));
        assert_eq!(s.counters().busy, 0);
    }

    #[test]
    fn a_synchronous_refusal_without_an_answer_is_the_reply() {
        let s = active_with_sync(Some(-16));
        let r = sync_echo(&s).unwrap();
        assert_eq!(
            (r.ret, r.errno(), r.transport),
            (-16, Some("EBUSY"), Transport::Sync)
        );
        assert_eq!(s.region.load32(CALL.at("state")), call_state::IDLE);
    }

    #[test]
    fn a_doorbell_is_spurious_unless_it_brings_a_new_answer() {
        let s = Symbiotic::new("t", &[], false).unwrap();
        s.in_flight.store(1, Ordering::Release);
        s.region.store64(CALL.at("done_seq"), 1);
        s.region.store32(CALL.at("state"), call_state::DONE);
        s.on_call_doorbell(1);
        assert_eq!(s.counters().doorbells_spurious, 0);
        s.on_call_doorbell(1);
        assert_eq!(s.counters().doorbells_spurious, 1);
        s.on_call_doorbell(3);
        assert_eq!(s.counters().doorbells_spurious, 4);
        // An answer to a call vmsight never made is not an answer.
        s.region.store64(CALL.at("done_seq"), 9);
        s.on_call_doorbell(1);
        assert_eq!(s.counters().doorbells_spurious, 5);
        assert_eq!(s.counters().doorbells_call, 6);
    }

    #[test]
    fn a_call_left_unanswered_by_an_unloaded_module_does_not_make_its_successor_busy() {
        let s = Symbiotic::new("t", &[], false).unwrap();
        let active = |s: &Symbiotic| {
            hello(s, ABI_VERSION, guest_state::HELLO);
            s.region.store32(GUEST.at("state"), guest_state::ACTIVE);
            s.region.store64(GUEST.at("symcalls"), 1 << nr::ECHO);
        };
        let echo = |s: &Symbiotic| {
            s.call(&CallRequest {
                nr: nr::ECHO,
                args: vec![1],
                transport: Transport::Doorbell,
                timeout_ms: 10,
            })
        };
        active(&s);
        assert!(matches!(echo(&s), Err(SymError::Timeout { seq: 1, .. })));
        assert!(matches!(echo(&s), Err(SymError::Busy { seq: 1, .. })));
        // `rmmod; modprobe`: the call page still says "posted" (nobody took the call), but
        // the module that owed the answer is gone: the next call is posted, not refused.
        hello(&s, ABI_VERSION, guest_state::GONE);
        active(&s);
        assert_eq!(s.region.load32(CALL.at("state")), call_state::POSTED);
        assert!(matches!(echo(&s), Err(SymError::Timeout { seq: 2, .. })));
        assert_eq!(s.counters().busy, 1);
        // Without a reload the busy state holds, as before.
        assert!(matches!(echo(&s), Err(SymError::Busy { seq: 2, .. })));
    }

    #[test]
    fn requests_beyond_the_interface_are_refused_before_the_guest_sees_them() {
        let s = Symbiotic::new("t", &[], false).unwrap();
        let r = s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![0; 6],
            transport: Transport::Auto,
            timeout_ms: 10,
        });
        assert!(matches!(r, Err(SymError::BadRequest { .. })), "{r:?}");
        hello(&s, ABI_VERSION, guest_state::HELLO);
        s.region.store32(GUEST.at("state"), guest_state::ACTIVE);
        // Active, but the module announces no symcall: nothing is posted.
        let r = s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![1],
            transport: Transport::Auto,
            timeout_ms: 10,
        });
        assert!(matches!(r, Err(SymError::Unsupported { .. })), "{r:?}");
        assert_eq!(s.region.load32(CALL.at("state")), call_state::IDLE);
        // The synchronous transport is not offered without the plugin.
        s.region.store64(GUEST.at("symcalls"), 1 << nr::ECHO);
        let r = s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![1],
            transport: Transport::Sync,
            timeout_ms: 10,
        });
        assert!(matches!(r, Err(SymError::SyncUnavailable { .. })), "{r:?}");
        // A doorbell call nobody answers times out, and the next one is refused as busy.
        let r = s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![1],
            transport: Transport::Doorbell,
            timeout_ms: 20,
        });
        assert!(matches!(r, Err(SymError::Timeout { .. })), "{r:?}");
        let r = s.call(&CallRequest {
            nr: nr::ECHO,
            args: vec![1],
            transport: Transport::Doorbell,
            timeout_ms: 20,
        });
        assert!(matches!(r, Err(SymError::Busy { .. })), "{r:?}");
        // The late answer clears it.
        s.region.store64(CALL.at("done_seq"), 1);
        s.region.store32(CALL.at("state"), call_state::DONE);
        s.region.store64(CALL.at("ret"), 5);
        let t = std::thread::spawn({
            let s2 = std::sync::Arc::clone(&s);
            move || {
                // Answer the next call (id 2) as the guest would.
                for _ in 0..2000 {
                    if s2.region.load32(CALL.at("state")) == call_state::POSTED {
                        s2.region.store64(CALL.at("ret"), 42);
                        s2.region.store64(CALL.at("done_seq"), 2);
                        s2.region.store32(CALL.at("state"), call_state::DONE);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        let r = s
            .call(&CallRequest {
                nr: nr::ECHO,
                args: vec![1],
                transport: Transport::Doorbell,
                timeout_ms: 5_000,
            })
            .unwrap();
        t.join().unwrap();
        assert_eq!((r.seq, r.ret), (2, 42));
    }
}
