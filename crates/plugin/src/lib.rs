//! vmsight TCG plugin (`libvmsight_plugin.so`): intercepts the syscalls of selected processes
//! of an unmodified guest inside QEMU and streams entries, returns and string/buffer arguments
//! to vmsight over a [`vmsight_ring`] channel.
//!
//! ```text
//! qemu-system-x86_64 ... -plugin libvmsight_plugin.so,shm=PATH[,profile=PATH][,records=on|off][,buf=N][,sync=N][,verbose=on]
//! ```
//!
//! * Every user-mode `syscall` instruction gets inline per-vCPU counting (no helper call) and
//!   a conditional callback that runs only while the vCPU's monitoring state (a per-vCPU
//!   scoreboard word) is not "unmonitored".
//! * Kernel `mov %reg, %cr3` gets a conditional callback (only while some filter is set) that
//!   marks the vCPU "unknown" when the address space changes; the next syscall or
//!   return-to-user on that vCPU classifies the current task (per-CPU `current_task`, its
//!   TGID, comm and `real_parent` chain) against the filters vmsight put in the channel's
//!   control area, through a cache keyed by (TGID, comm).
//! * Kernel `sysretq`/`iretq` get a conditional callback (monitored or unknown only) that
//!   records the return to user mode.
//! * Nothing the guest does can crash QEMU: callbacks never unwrap, panics are caught at every
//!   FFI entry point and counted, every guest read is bounded and failures are counted.
//!
//! * One library serves plugin API v4 (QEMU 10.0) and v7 (QEMU 11.1): [`qemu`] declares the
//!   version QEMU asks for and hides the differences; everything else is version-free.

mod blockhook;
mod guest;
mod logic;
pub mod qemu;
mod redirect;

use std::cell::{Cell, UnsafeCell};
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use qemu::{Cond, Insn, InstallInfo, PluginId, RegAccess, Scoreboard, Tb, Word};
use vmsight_proto::redirect::{RETURN_MARKER, SAFE_POINT_MARKER};
use vmsight_ring::{
    data, flags, layout::plugin_flags, monotonic_ns, Channel, ChannelPlugin, Counter, CounterSink,
    MonitorFilters, Producer, Record, ReturnVia, SumsHeader, COMM_LEN,
};

pub use guest::{MemError, MAX_GUEST_READ};

pub use logic::*;

/// Why a vCPU cannot be observed (it then runs unobserved).
#[derive(Debug, thiserror::Error)]
enum VcpuSetupError {
    /// Its ring or counter block in the channel is unusable.
    #[error("{0}")]
    Channel(#[from] vmsight_ring::Error),
    /// A QEMU byte buffer could not be allocated.
    #[error("cannot allocate a {0} buffer")]
    Alloc(&'static str),
}

// ---------------------------------------------------------------------------------------------
// Global state

/// Registers read at a syscall entry, in this order.
///
/// The `syscall` instruction's address needs RIP at run time: x86 system emulation translates
/// position-independently (CF_PCREL), so one translated block serves every virtual address
/// that maps the same physical code page (shared libraries in different processes), and the
/// translation-time address belongs to whichever process came first. RIP itself is only
/// synchronised at some earlier instruction of the block (often its start), so the exact
/// address is rebuilt in [`runtime_pc`].
const ENTRY_REGS: [&str; 11] = [
    "rax",
    "rdi",
    "rsi",
    "rdx",
    "r10",
    "r8",
    "r9",
    "rsp",
    "rip",
    "cr3",
    "k_gs_base",
];
const E_RAX: usize = 0;
const E_ARGS: usize = 1;
const E_RSP: usize = 7;
const E_RIP: usize = 8;
const E_CR3: usize = 9;
const E_KGS: usize = 10;
/// Registers read at `sysretq`: RCX holds the user RIP, R11 the user RFLAGS.
const SYSRET_REGS: [&str; 6] = ["rax", "rcx", "r11", "rsp", "cr3", "k_gs_base"];
/// Registers read at `iretq` (RIP, CS, RFLAGS, RSP come from the frame at RSP).
const IRET_REGS: [&str; 4] = ["rax", "rsp", "cr3", "k_gs_base"];

/// Scoreboard element: syscalls executed, syscalls since the last publication, monitoring
/// state, tracking flag. Padded to two cache lines so two vCPUs' words never share a line.
const SB_SYSCALLS: usize = 0;
const SB_SINCE_SYNC: usize = 8;
const SB_STATE: usize = 16;
const SB_TRACK: usize = 24;
/// 1 while a kernel-triggered redirection waits for a vCPU (`redirect::arm_all`).
const SB_ARM: usize = 32;
/// 32-bit system calls (`int 0x80`, `sysenter`) executed in user mode, counted inline.
const SB_COMPAT: usize = 40;
/// 1 while the vCPU runs user code, 0 in kernel code (stored inline at every block with the
/// synchronous transport; vmsight reads it next to the arm word).
const SB_USER: usize = 48;
const _: () = assert!(SB_USER - SB_ARM == vmsight_ring::redirect::USER_WORD_AFTER_ARM as usize);
const SB_ELEMENT: usize = 128;

/// Monitoring states (scoreboard `SB_STATE`).
const ST_UNMONITORED: u64 = 0;
const ST_UNKNOWN: u64 = 1;
const ST_MONITORED: u64 = 2;

/// Most processes the plugin remembers as monitored (beyond that, classification still
/// works through the ancestor walk, just without the shortcut).
const MAX_MONITORED_SET: usize = 4096;
/// Most cached (TGID, comm) verdicts; the cache is cleared when full.
const MAX_VERDICTS: usize = 16384;
const PAGE: u64 = 4096;
/// Checksum chunk (Sky §3.4: 4 KiB file-offset-aligned).
const CHUNK: u64 = vmsight_ring::sums::CHUNK;
/// Bytes read per step while looking for a string's NUL.
const STRING_STEP: usize = 256;

/// Register handles looked up at the first vCPU init.
struct Regs {
    entry: [usize; ENTRY_REGS.len()],
    sysret: [usize; SYSRET_REGS.len()],
    iret: [usize; IRET_REGS.len()],
    /// GPR handles by x86 register number (sources of `mov %reg, %cr3`).
    gpr: [usize; 16],
    /// The active GS base (in kernel mode: the per-CPU area), for the block hooks; optional.
    gs_base: Option<usize>,
    /// Every register vCPU redirection saves and restores, in `Reg::ALL` order.
    all: [usize; vmsight_proto::redirect::NREGS],
}

/// Filters and the classification state shared by all vCPUs.
struct Monitor {
    inner: Mutex<MonInner>,
    /// Classification generation: bumped by every invalidation. A classification that
    /// started under an older generation does not cache its verdict and leaves its vCPU
    /// "unknown".
    gen: AtomicU64,
    /// Filter generation applied (mirrors the control area's acknowledgement).
    applied: AtomicU64,
    /// Some filter is set: CR3-write callbacks are enabled.
    tracking: AtomicBool,
    /// Value of the guest's `page_offset_base` (0: not read yet).
    page_offset_base: AtomicU64,
    /// Bumped whenever a cached task identity may have become stale on any vCPU (monitored
    /// fork/clone/exit/prctl, invalidations); per-vCPU task caches carry the epoch they
    /// were filled in.
    task_epoch: AtomicU64,
}

/// A cached classification's key: (TGID, `task->signal`, comm).
type VerdictKey = (u32, u64, [u8; COMM_LEN]);
/// Most processes remembered as described (the set is cleared when full).
const MAX_DESCRIBED: usize = 4096;

struct MonInner {
    filters: MonitorFilters,
    /// Processes currently monitored (filter TGIDs, matched comms, descendants).
    set: MonitoredSet,
    /// Verdicts by (TGID, process identity, comm).
    verdicts: HashMap<VerdictKey, bool>,
    /// Processes whose exe and cwd were sent ([`Ctx::describe_if_new`]).
    described: std::collections::HashSet<VerdictKey>,
}

struct State {
    channel: ChannelPlugin,
    opts: Options,
    kernel: Option<KernelLayout>,
    /// Owned by QEMU, lives until exit; QEMU synchronises its growth with vCPU execution.
    scoreboard: Scoreboard,
    /// Register handles; `None` if discovery failed (then counting only).
    regs: OnceLock<Option<Regs>>,
    vcpus: Box<[OnceLock<VcpuState>]>,
    missing_slot_reported: AtomicBool,
    monitor: Monitor,
    kernel_sites: AtomicU64,
    /// FoxyIdle's block hooks and their channel (`blk=`, with a profile that has the block
    /// submission path).
    blk: Option<blockhook::BlockHooks>,
}

impl State {
    fn entry(&self, offset: usize) -> Word {
        self.scoreboard.word(offset)
    }

    fn vcpu(&self, vcpu: c_uint) -> Option<&VcpuState> {
        self.vcpus.get(vcpu as usize).and_then(OnceLock::get)
    }

    /// vCPU slots (QEMU's maximum).
    fn vcpu_count(&self) -> c_uint {
        self.vcpus.len() as c_uint
    }

    /// SymCall's synchronous transport is on (`symsync=on`, API v7, a profile).
    fn symsync(&self) -> bool {
        self.opts.symsync && self.kernel.is_some() && redirect::available()
    }

    fn regs(&self) -> Option<&Regs> {
        self.regs.get().and_then(Option::as_ref)
    }

    /// Monitoring is possible: records on, a profile, and the registers it needs.
    fn monitoring(&self) -> bool {
        self.opts.records && self.kernel.is_some() && self.regs().is_some()
    }

    /// Reads a scoreboard word of an initialised vCPU.
    fn sb_get(&self, off: usize, vcpu: c_uint) -> u64 {
        if self.vcpu(vcpu).is_none() {
            return 0;
        }
        // SAFETY: the scoreboard is live and `vcpu` was initialised (it has a VcpuState), so
        // QEMU grew the scoreboard to include its element (QEMU does not bounds-check).
        unsafe { self.entry(off).get(vcpu) }
    }

    /// Writes a scoreboard word of an initialised vCPU (from any vCPU thread: the words are
    /// aligned u64s that TCG reads with plain loads; growth happens only while all vCPUs are
    /// stopped).
    fn sb_set(&self, off: usize, vcpu: c_uint, v: u64) {
        if self.vcpu(vcpu).is_none() {
            return;
        }
        // SAFETY: as in `sb_get`.
        unsafe { self.entry(off).set(vcpu, v) }
    }

    /// Counts a callback that arrived with a vCPU index we never initialised (QEMU does this
    /// with single-threaded TCG); such calls are ignored and counted on vCPU 0.
    fn count_bad_index(&self) {
        if let Some(v) = self.vcpu(0) {
            v.sink.add(Counter::InternalErrors, 1);
        }
    }

    /// Mirrors `vcpu`'s scoreboard count into the channel. Must run on a thread where QEMU
    /// allows scoreboard access (vCPU callbacks, exit hooks).
    fn publish(&self, vcpu: c_uint) {
        let Some(v) = self.vcpu(vcpu) else { return };
        v.sink
            .set_max(Counter::Syscalls, self.sb_get(SB_SYSCALLS, vcpu));
        v.sink
            .set_max(Counter::CompatSyscalls, self.sb_get(SB_COMPAT, vcpu));
        self.channel.heartbeat();
    }

    /// Applies new filters if vmsight changed them (one relaxed load when it did not).
    #[inline]
    fn poll_filters(&self, vcpu: c_uint) {
        if self.channel.filter_generation() != self.monitor.applied.load(Ordering::Relaxed) {
            self.apply_filters(Some(vcpu));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MonInner> {
        // A panic while holding the lock was caught by `guard`; the data is still usable.
        self.monitor
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads the control area and applies it: new filters, monitored set reset to the filter
    /// TGIDs, verdicts dropped, every vCPU "unknown" (or "unmonitored" if nothing is
    /// monitored any more).
    fn apply_filters(&self, by: Option<c_uint>) {
        let mut inner = self.lock();
        let Some((g, mut f)) = self.channel.read_filters() else {
            return; // vmsight is writing; the next callback retries
        };
        if g == self.monitor.applied.load(Ordering::Relaxed) {
            return; // another vCPU applied it meanwhile
        }
        f.tgids.retain(|&t| t != 0);
        let tracking = self.monitoring() && !f.is_empty();
        inner.set = MonitoredSet::from_tgids(f.tgids.iter().copied());
        inner.verdicts.clear();
        inner.filters = f;
        self.monitor.tracking.store(tracking, Ordering::SeqCst);
        self.monitor.gen.fetch_add(1, Ordering::SeqCst);
        self.monitor.task_epoch.fetch_add(1, Ordering::SeqCst);
        for v in 0..self.vcpus.len() as c_uint {
            self.sb_set(SB_TRACK, v, u64::from(tracking));
            self.sb_set(
                SB_STATE,
                v,
                if tracking { ST_UNKNOWN } else { ST_UNMONITORED },
            );
            if let Some(vs) = self.vcpu(v) {
                vs.cr3_classified.store(u64::MAX, Ordering::Relaxed);
            }
        }
        self.report_set(&inner);
        self.monitor.applied.store(g, Ordering::SeqCst);
        self.channel.ack_filters(g);
        if let Some(vs) = by.and_then(|v| self.vcpu(v)) {
            vs.sink.add(Counter::Invalidations, 1);
        }
        log_debug(&format!(
            "filters generation {g} applied: tracking={tracking} all={} tgids={:?} comms={}",
            inner.filters.monitor_all,
            inner.filters.tgids,
            inner.filters.comms.len()
        ));
    }

    fn report_set(&self, inner: &MonInner) {
        let list: Vec<u32> = inner.set.tgids().collect();
        self.channel.report_monitored(&list);
    }

    /// Forgets every cached verdict and makes every vCPU re-classify at its next event.
    fn invalidate(&self, inner: &mut MonInner, by: c_uint) {
        inner.verdicts.clear();
        self.monitor.gen.fetch_add(1, Ordering::SeqCst);
        self.monitor.task_epoch.fetch_add(1, Ordering::SeqCst);
        if self.monitor.tracking.load(Ordering::SeqCst) {
            for v in 0..self.vcpus.len() as c_uint {
                self.sb_set(SB_STATE, v, ST_UNKNOWN);
                if let Some(vs) = self.vcpu(v) {
                    vs.cr3_classified.store(u64::MAX, Ordering::Relaxed);
                }
            }
        }
        if let Some(vs) = self.vcpu(by) {
            vs.sink.add(Counter::Invalidations, 1);
        }
    }
}

/// Per-vCPU state. `hot` is only ever accessed by the vCPU's own callbacks, which QEMU never
/// runs concurrently with each other (one thread executes a vCPU at a time); other threads
/// use only `sink` and `cr3_classified` (atomics).
struct VcpuState {
    sink: CounterSink,
    /// CR3 base under which the vCPU's current state was decided (u64::MAX: none). A CR3
    /// write of the same value (TLB flushes rewrite CR3) keeps the state.
    cr3_classified: AtomicU64,
    hot: UnsafeCell<Hot>,
}

/// A syscall whose string argument could not be read at entry (its page was not present yet:
/// a plugin cannot fault pages in, but the kernel does while handling the call).
#[derive(Clone, Copy)]
struct Retry {
    task: u64,
    entry_ts: u64,
    cr3: u64,
    pc: u64,
    nr: u32,
    /// (argument index, guest address), `n` of them used.
    args: [(u8, u64); 4],
    n: usize,
    /// A call that may change the task's exe or cwd ([`changes_details`]): read them again at
    /// a successful return.
    describe: bool,
}

/// Pending late re-reads, keyed by task: a call (execve especially) may block and return on
/// another vCPU, so this is global. Only calls whose string was unreadable at entry are here,
/// which is rare; the return path checks the count before taking the lock.
static RETRIES: std::sync::Mutex<Vec<Retry>> = std::sync::Mutex::new(Vec::new());
static RETRY_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Bound on pending re-reads (oldest dropped): calls that never return must not accumulate.
const MAX_RETRIES: usize = 256;

fn retries_add(rt: Retry) {
    if let Ok(mut v) = RETRIES.lock() {
        v.retain(|r| r.task != rt.task);
        if v.len() >= MAX_RETRIES {
            v.remove(0);
        }
        v.push(rt);
        RETRY_COUNT.store(v.len(), Ordering::Release);
    }
}

fn retries_take(task: u64) -> Option<Retry> {
    if RETRY_COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut v = RETRIES.lock().ok()?;
    let i = v.iter().position(|r| r.task == task)?;
    let rt = v.swap_remove(i);
    RETRY_COUNT.store(v.len(), Ordering::Release);
    Some(rt)
}

/// A monitored `read`/`pread64` of a regular file whose buffer is checksummed at its return
/// (the data is there only then). Keyed by task: a blocking read may return on another vCPU.
#[derive(Clone, Copy)]
struct PendingRead {
    task: u64,
    entry_ts: u64,
    cr3: u64,
    pc: u64,
    /// The buffer, or for a vectored read the iovec array.
    buf: u64,
    /// The buffer's length, or for a vectored read the iovec count.
    len: u64,
    vectored: bool,
    hdr: SumsHeader,
}

static READS: std::sync::Mutex<Vec<PendingRead>> = std::sync::Mutex::new(Vec::new());
static READ_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Bound on pending reads (oldest dropped): a task killed inside a read never returns.
const MAX_READS: usize = 256;

fn reads_add(pr: PendingRead) {
    if let Ok(mut v) = READS.lock() {
        v.retain(|r| r.task != pr.task);
        if v.len() >= MAX_READS {
            v.remove(0);
        }
        v.push(pr);
        READ_COUNT.store(v.len(), Ordering::Release);
    }
}

fn reads_take(task: u64) -> Option<PendingRead> {
    if READ_COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut v = READS.lock().ok()?;
    let i = v.iter().position(|r| r.task == task)?;
    let pr = v.swap_remove(i);
    READ_COUNT.store(v.len(), Ordering::Release);
    Some(pr)
}

/// What the fd table says about one open file.
#[derive(Clone, Copy)]
struct FileInfo {
    pos: u64,
    flags: u32,
    inode: u64,
    i_size: u64,
    regular: bool,
}

struct Hot {
    producer: Producer,
    regbuf: guest::ByteBuf,
    membuf: guest::ByteBuf,
    /// (TGID, process identity, comm) of the last classification on this vCPU: a different task in the same
    /// address space (a renamed thread, a CLONE_VM child) is re-classified.
    last: VerdictKey,
    /// The last process this vCPU checked for [`Ctx::describe_if_new`].
    described: VerdictKey,
    /// Scratch for string/buffer arguments and the DATA records built from them.
    strbuf: Vec<u8>,
    pieces: Vec<Record>,
    /// Scratch for one 4 KiB chunk being checksummed.
    chunk: Box<[u8]>,
    /// The buffer of the call being checksummed, as segments (one for a plain buffer).
    segs: Vec<logic::Segment>,
    /// Scratch for a vectored call's raw iovec array.
    iovraw: Vec<u8>,

    /// CR3 base as last written (known from the CR3-write callbacks while tracking), valid
    /// while `cr3_gen` equals the applied filter generation (tracking was on throughout).
    cur_cr3: u64,
    cr3_gen: u64,
    /// The kernel GS base of this vCPU (its per-CPU area; constant once user space runs).
    kgs: u64,
    /// The last current task read here: (task pointer, fields, task epoch).
    task_cache: Option<(u64, TaskFields, u64)>,
    /// This vCPU's ring of the block-tag channel.
    blk: Option<Producer>,
}

// SAFETY: see the type's comment: `hot` is confined to the owning vCPU's callbacks, which are
// serialised by QEMU; everything else is atomic.
unsafe impl Sync for VcpuState {}

static STATE: OnceLock<State> = OnceLock::new();

thread_local! {
    /// vCPU index of the current thread (set in vcpu_init, which QEMU runs on the vCPU's
    /// thread); attributes translation-time counts.
    static CURRENT_VCPU: Cell<u32> = const { Cell::new(u32::MAX) };
}

/// Runs `f`, turning a panic into a counted internal error: unwinding into QEMU's C frames
/// would abort the process.
fn guard(vcpu: Option<c_uint>, f: impl FnOnce()) {
    if std::panic::catch_unwind(AssertUnwindSafe(f)).is_err() {
        if let (Some(st), Some(v)) = (STATE.get(), vcpu) {
            if let Some(vs) = st.vcpu(v) {
                vs.sink.add(Counter::InternalErrors, 1);
            }
        }
    }
}

fn log_debug(msg: &str) {
    // Shown only with `-d plugin`; failure to log is not worth reporting.
    qemu::outs(&format!("vmsight-plugin: {msg}\n"));
}

// ---------------------------------------------------------------------------------------------
// Guest kernel reads

/// A current task as read at an event.
#[derive(Clone, Copy)]
struct TaskInfo {
    task: u64,
    f: TaskFields,
}

/// Bounded reads of guest kernel memory through the current vCPU's page tables.
struct KernelMem<'a> {
    buf: &'a mut guest::ByteBuf,
    lay: &'a KernelLayout,
    errors: u64,
}

impl KernelRead for KernelMem<'_> {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        KernelMem::read(self, addr, out)
    }
}

impl KernelMem<'_> {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        if !is_kernel_addr(addr) {
            self.errors += 1;
            return false;
        }
        match self.buf.read_guest(addr, out) {
            Ok(n) if n == out.len() => true,
            _ => {
                self.errors += 1;
                false
            }
        }
    }

    fn u64_at(&mut self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// `task->real_parent->tgid`: the PPID `ps` shows (0 for a child of `init_task`).
    fn parent_tgid(&mut self, task: u64) -> Option<u32> {
        let parent = self.u64_at(task.wrapping_add(self.lay.real_parent))?;
        let mut b4 = [0u8; 4];
        self.read(parent.wrapping_add(self.lay.tgid), &mut b4)
            .then(|| u32::from_le_bytes(b4))
    }

    /// pid, tgid and real_parent (one read when they are close, as in every Linux since
    /// they were introduced), then comm.
    fn task_fields(&mut self, task: u64) -> Option<TaskFields> {
        let l = self.lay;
        let lo = l.pid.min(l.tgid).min(l.real_parent);
        let hi = (l.pid + 4).max(l.tgid + 4).max(l.real_parent + 8);
        let mut w = [0u8; 64];
        let (pid, tgid, real_parent) = if hi - lo <= w.len() as u64 {
            let span = &mut w[..(hi - lo) as usize];
            if !self.read(task.wrapping_add(lo), span) {
                return None;
            }
            let at = |off: u64, n: usize| {
                let s = (off - lo) as usize;
                let mut b = [0u8; 8];
                b[..n].copy_from_slice(&span[s..s + n]);
                u64::from_le_bytes(b)
            };
            (at(l.pid, 4), at(l.tgid, 4), at(l.real_parent, 8))
        } else {
            let mut b4 = [0u8; 4];
            if !self.read(task.wrapping_add(l.pid), &mut b4) {
                return None;
            }
            let pid = u64::from(u32::from_le_bytes(b4));
            if !self.read(task.wrapping_add(l.tgid), &mut b4) {
                return None;
            }
            let tgid = u64::from(u32::from_le_bytes(b4));
            (pid, tgid, self.u64_at(task.wrapping_add(l.real_parent))?)
        };
        let mut comm = [0u8; COMM_LEN];
        if !self.read(task.wrapping_add(l.comm), &mut comm) {
            return None;
        }
        let signal = self.u64_at(task.wrapping_add(l.signal))?;
        Some(TaskFields {
            pid: pid as u32,
            tgid: tgid as u32,
            real_parent,
            signal,
            comm,
        })
    }
}

impl TaskMemory for KernelMem<'_> {
    fn fields(&mut self, task: u64) -> Option<TaskFields> {
        if !is_kernel_addr(task) {
            self.errors += 1;
            return None;
        }
        self.task_fields(task)
    }
}

// ---------------------------------------------------------------------------------------------
// Installation

/// Installs the plugin (called by [`qemu::qemu_plugin_install`]).
fn install(id: PluginId, args: &[String], info: &InstallInfo) -> Result<(), PluginError> {
    let opts = Options::parse(args.iter().map(String::as_str))?;
    if info.target_name != "x86_64" {
        return Err(PluginError::WrongTarget(info.target_name.clone()));
    }
    let (_, max_vcpus) = info.system.ok_or(PluginError::NotSystemMode)?;
    let max_vcpus = i64::from(max_vcpus);
    let kernel = opts
        .profile
        .as_deref()
        .map(KernelLayout::load)
        .transpose()?;
    let channel = Channel::attach(&opts.shm)?;
    if max_vcpus > i64::from(channel.max_vcpus()) || max_vcpus < 1 {
        return Err(PluginError::TooManyVcpus {
            qemu: max_vcpus,
            channel: channel.max_vcpus(),
        });
    }
    let mut bits = 0;
    if opts.records {
        bits |= plugin_flags::RECORDS;
    }
    if kernel.is_some() {
        bits |= plugin_flags::PROFILE;
    }
    if opts.translates() {
        bits |= plugin_flags::TRANSLATES;
    }
    channel.set_plugin_info(qemu::api().number(), bits);
    let blk = block_hooks(&opts, kernel.as_ref(), max_vcpus)?;
    let scoreboard = Scoreboard::new(SB_ELEMENT);
    let slots = (0..channel.max_vcpus()).map(|_| OnceLock::new()).collect();
    log_debug(&format!(
        "attached to {} (records={}, count={}, profile={:?}, buf={}, sync={}, plugin API {} of \
         QEMU's {}..{}, {} vCPUs max); kernel layout {kernel:?}",
        opts.shm.display(),
        opts.records,
        opts.count,
        opts.profile,
        opts.buf,
        opts.sync_every,
        qemu::api().number(),
        info.api_min,
        info.api_cur,
        max_vcpus
    ));
    if opts.records && kernel.is_none() {
        log_debug("no profile=: monitoring is off, syscalls are only counted");
    }
    let state = State {
        channel,
        opts,
        kernel,
        scoreboard,
        regs: OnceLock::new(),
        vcpus: slots,
        missing_slot_reported: AtomicBool::new(false),
        monitor: Monitor {
            inner: Mutex::new(MonInner {
                filters: MonitorFilters::none(),
                set: MonitoredSet::default(),
                verdicts: HashMap::new(),
                described: Default::default(),
            }),
            gen: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            tracking: AtomicBool::new(false),
            page_offset_base: AtomicU64::new(0),
            task_epoch: AtomicU64::new(0),
        },
        kernel_sites: AtomicU64::new(0),
        blk,
    };
    let symsync = state.opts.symsync;
    let translates = state.opts.translates();
    if STATE.set(state).is_err() {
        // A second install in the same process (a duplicate -plugin of the same .so shares
        // our statics): refuse rather than share rings.
        return Err(PluginError::BadValue {
            key: "plugin".into(),
            value: "libvmsight_plugin.so".into(),
            reason: "the plugin is already loaded in this QEMU",
        });
    }
    qemu::register_hooks(
        id,
        qemu::Hooks {
            vcpu_init: on_vcpu_init,
            vcpu_exit: on_vcpu_exit,
            vcpu_idle: on_vcpu_idle,
            vcpu_resume: symsync.then_some(on_vcpu_resume as fn(c_uint)),
            // Dormant (nothing asked of the plugin): no translation callback, so QEMU
            // generates the same code as without a plugin.
            tb_trans: translates.then_some(on_tb_trans as fn(Tb<'_>)),
            atexit: || guard(None, on_exit),
        },
    );
    if let Some(st) = STATE.get().filter(|st| symsync && st.symsync()) {
        redirect::start_arming(st);
    }
    Ok(())
}

/// Attaches the block-tag channel of `blk=` and reports what the hooks can do in its header
/// (a profile without the block submission path attaches but hooks nothing, so vmsight can
/// tell the user attribution is unavailable).
fn block_hooks(
    opts: &Options,
    kernel: Option<&KernelLayout>,
    max_vcpus: i64,
) -> Result<Option<blockhook::BlockHooks>, PluginError> {
    let Some(path) = &opts.blk else {
        return Ok(None);
    };
    let channel = Channel::attach(path)?;
    if max_vcpus > i64::from(channel.max_vcpus()) {
        return Err(PluginError::TooManyVcpus {
            qemu: max_vcpus,
            channel: channel.max_vcpus(),
        });
    }
    let layout = kernel.and_then(|k| k.block);
    let mut bits = 0;
    if let Some(l) = &layout {
        bits |= plugin_flags::BLOCK_TAGS;
        if l.prctl.is_some() {
            bits |= plugin_flags::DECLARATIONS;
        }
    } else {
        eprintln!(
            "vmsight-plugin: the kernel profile has no block submission path; block requests \
             are not attributed"
        );
    }
    channel.set_plugin_info(qemu::api().number(), bits);
    Ok(layout.map(|layout| blockhook::BlockHooks { channel, layout }))
}

// ---------------------------------------------------------------------------------------------
// Callbacks (all guarded; instruction callbacks are `extern "C"`)

fn on_vcpu_init(vcpu: c_uint) {
    guard(Some(vcpu), || vcpu_init(vcpu));
}

fn vcpu_init(vcpu: c_uint) {
    CURRENT_VCPU.with(|c| c.set(vcpu));
    let Some(st) = STATE.get() else { return };
    st.regs.get_or_init(discover_registers);
    st.channel.report_vcpus(vcpu.saturating_add(1));
    if st.symsync() {
        publish_arm_words(st, vcpu);
    }
    let Some(slot) = st.vcpus.get(vcpu as usize) else {
        if !st.missing_slot_reported.swap(true, Ordering::Relaxed) {
            eprintln!(
                "vmsight-plugin: vCPU {vcpu} has no slot in the channel ({} slots); it is not \
                 observed",
                st.channel.max_vcpus()
            );
        }
        return;
    };
    if slot.get().is_none() {
        let built = (|| -> Result<VcpuState, VcpuSetupError> {
            let producer = st.channel.producer(vcpu)?;
            let sink = st.channel.counters(vcpu)?;
            let regbuf = guest::ByteBuf::new(256).ok_or(VcpuSetupError::Alloc("register"))?;
            let membuf = guest::ByteBuf::new(512).ok_or(VcpuSetupError::Alloc("memory"))?;
            Ok(VcpuState {
                sink,
                cr3_classified: AtomicU64::new(u64::MAX),
                hot: UnsafeCell::new(Hot {
                    producer,
                    regbuf,
                    membuf,
                    last: (0, 0, [0; COMM_LEN]),
                    described: (0, 0, [0; COMM_LEN]),
                    strbuf: Vec::with_capacity(MAX_STRING),
                    pieces: Vec::with_capacity(64),
                    chunk: vec![0u8; CHUNK as usize].into_boxed_slice(),
                    segs: Vec::with_capacity(8),
                    iovraw: Vec::new(),
                    cur_cr3: u64::MAX,
                    cr3_gen: u64::MAX,
                    kgs: 0,
                    task_cache: None,
                    blk: match &st.blk {
                        Some(b) => Some(b.channel.producer(vcpu)?),
                        None => None,
                    },
                }),
            })
        })();
        match built {
            Ok(v) => {
                let _ = slot.set(v);
            }
            Err(e) => {
                eprintln!("vmsight-plugin: vCPU {vcpu} is not observed: {e}");
                return;
            }
        }
    }
    // Initial filters (vmsight may have set them before QEMU started), then this vCPU's
    // tracking word. The state starts "unmonitored" even when tracking: a vCPU reaches user
    // mode only after a CR3 write to a user address space (which makes it "unknown"), and
    // starting "unknown" would make every boot-time kernel `iretq` (the alternatives
    // patcher's sync_core runs ~100k of them) a callback.
    st.poll_filters(vcpu);
    let tracking = st.monitor.tracking.load(Ordering::SeqCst);
    st.sb_set(SB_TRACK, vcpu, u64::from(tracking));
    st.sb_set(SB_STATE, vcpu, ST_UNMONITORED);
}

fn discover_registers() -> Option<Regs> {
    let regs = guest::list_registers();
    let names: Vec<String> = regs
        .iter()
        .map(|r| {
            format!(
                "{}({}{})",
                r.name,
                r.feature,
                if r.read_only { ",ro" } else { "" }
            )
        })
        .collect();
    log_debug(&format!(
        "{} guest registers: {}",
        regs.len(),
        names.join(" ")
    ));
    let mut missing = Vec::new();
    let mut find = |n: &str| match regs.iter().find(|r| r.name == n) {
        Some(r) => r.handle,
        None => {
            missing.push(n.to_string());
            0
        }
    };
    let out = Regs {
        entry: ENTRY_REGS.map(&mut find),
        sysret: SYSRET_REGS.map(&mut find),
        iret: IRET_REGS.map(&mut find),
        gpr: GPR_NAMES.map(&mut find),
        gs_base: regs.iter().find(|r| r.name == "gs_base").map(|r| r.handle),
        all: vmsight_proto::redirect::Reg::ALL.map(|r| find(r.name())),
    };
    if missing.is_empty() {
        Some(out)
    } else {
        missing.dedup();
        eprintln!(
            "vmsight-plugin: QEMU offers no register(s) {}; monitoring is disabled, counting \
             continues",
            missing.join(", ")
        );
        None
    }
}

fn on_vcpu_exit(vcpu: c_uint) {
    guard(Some(vcpu), || {
        if let Some(st) = STATE.get() {
            st.publish(vcpu);
        }
    });
}

fn on_vcpu_idle(vcpu: c_uint) {
    guard(Some(vcpu), || {
        if let Some(st) = STATE.get() {
            if st.symsync() {
                st.channel.redirect_mailbox().set_idle(vcpu, true);
            }
            if st.vcpu(vcpu).is_some() {
                st.poll_filters(vcpu);
            }
            st.publish(vcpu);
        }
    });
}

/// A halted vCPU runs again (registered with the synchronous transport only): vmsight no
/// longer needs to interrupt the guest for it to take a request.
fn on_vcpu_resume(vcpu: c_uint) {
    guard(Some(vcpu), || {
        if let Some(st) = STATE.get() {
            let mb = st.channel.redirect_mailbox();
            mb.set_idle(vcpu, false);
            mb.set_resumed_at(vmsight_ring::monotonic_ns());
        }
    });
}

fn on_tb_trans(tb: Tb<'_>) {
    guard(None, || {
        let Some(st) = STATE.get() else { return };
        let n = instrument_tb(st, tb);
        if n > 0 {
            let vcpu = CURRENT_VCPU.with(Cell::get);
            let vcpu = if vcpu == u32::MAX { 0 } else { vcpu };
            if let Some(v) = st.vcpu(vcpu) {
                v.sink.add(Counter::Instrumented, n);
            }
        }
    });
}

/// Instruments `tb`: user-mode `syscall` instructions, and (when monitoring is possible)
/// kernel CR3 writes, `sysretq` and `iretq`. Returns how many `syscall`s it instrumented.
fn instrument_tb(st: &State, tb: Tb<'_>) -> u64 {
    let tb_vaddr = tb.vaddr();
    let user = tb_vaddr < USER_SPACE_END;
    let monitoring = st.monitoring();
    let hooks = if user { None } else { st.blk.as_ref() };
    let symsync = st.symsync();
    // Return markers of vCPU redirection, in user and kernel code (v7 with monitoring, or
    // SymCall's synchronous transport).
    let markers = (monitoring || symsync) && redirect::available();
    let kernel = is_kernel_addr(tb_vaddr);
    if !(user || ((monitoring || hooks.is_some() || symsync) && kernel)) {
        return 0;
    }
    if symsync && (user || kernel) {
        // Where the vCPU runs, for vmsight to ring a guest none of whose vCPUs would take a
        // kernel request soon (all halted or in user code): one inline store per block.
        if let Some(first) = tb.insn(0) {
            first.store_inline(st.entry(SB_USER), u64::from(user));
        }
    }
    if symsync && kernel {
        // The kernel trigger: one inline compare per block, a call only while armed.
        if let Some(first) = tb.insn(0) {
            first.on_exec_if(
                on_kernel_armed,
                RegAccess::ReadWritePc,
                st.entry(SB_ARM),
                Cond::Ne,
                0,
                first.vaddr() as usize,
            );
        }
    }
    let mut count = 0;
    for i in 0..tb.n_insns() {
        let Some(insn) = tb.insn(i) else { continue };
        let vaddr = insn.vaddr();
        let size = insn.size();
        if hooks.is_some_and(|h| h.instrument(&insn, vaddr)) {
            continue; // a hooked function entry (matched by address, whatever its bytes)
        }
        let marker_size = markers && size == RETURN_MARKER.len();
        if user {
            if vaddr >= USER_SPACE_END || !(2..=15).contains(&size) {
                continue;
            }
        } else if !((monitoring && (2..=4).contains(&size)) || marker_size) {
            continue; // every instrumented kernel instruction is 2 to 4 bytes long
        }
        let mut bytes = [0u8; 16];
        let got = insn.data(&mut bytes[..size]);
        let bytes = &bytes[..got];
        if marker_size && bytes == RETURN_MARKER {
            insn.on_exec(on_marker, RegAccess::ReadWritePc, 0);
            continue;
        }
        if symsync && !user && marker_size && bytes == SAFE_POINT_MARKER {
            insn.on_exec(on_safe_point, RegAccess::ReadWritePc, vaddr as usize);
            continue;
        }
        if user {
            if is_syscall_insn(bytes) {
                instrument_syscall(st, &insn, vaddr, monitoring);
                count += 1;
            } else if is_compat_syscall_insn(bytes) {
                // Not traced (the i386 ABI has other numbers and registers): counted, so a
                // trace can say what it did not see.
                insn.add_inline(st.entry(SB_COMPAT), 1);
            }
        } else if let Some(k) = decode_kernel_insn(bytes).filter(|_| monitoring) {
            instrument_kernel(st, &insn, vaddr, k);
        }
    }
    count
}

fn instrument_syscall(st: &State, insn: &Insn<'_>, vaddr: u64, mon: bool) {
    // Inline ops and callbacks run in registration order, before the instruction executes.
    // Counting: inline adds, no helper call at all.
    insn.add_inline(st.entry(SB_SYSCALLS), 1);
    insn.add_inline(st.entry(SB_SINCE_SYNC), 1);
    // Publication every `sync_every` syscalls: a helper call only when the count is due.
    insn.on_exec_if(
        on_sync,
        RegAccess::None,
        st.entry(SB_SINCE_SYNC),
        Cond::Ge,
        st.opts.sync_every,
        0,
    );
    if mon {
        // Monitored or unknown only. The PC rides in the user data. With API v7 the callback
        // may redirect the vCPU (vmsight_proto::redirect).
        let access = if redirect::available() {
            RegAccess::ReadWritePc
        } else {
            RegAccess::Read
        };
        insn.on_exec_if(
            on_syscall,
            access,
            st.entry(SB_STATE),
            Cond::Ne,
            ST_UNMONITORED,
            vaddr as usize,
        );
    }
}

fn instrument_kernel(st: &State, insn: &Insn<'_>, vaddr: u64, k: KernelInsn) {
    let (cb, word, udata): (extern "C" fn(c_uint, *mut c_void), usize, usize) = match k {
        KernelInsn::Cr3Write { reg } => (on_cr3_write, SB_TRACK, usize::from(reg)),
        KernelInsn::Sysretq => (on_sysret, SB_STATE, vaddr as usize),
        KernelInsn::Iretq => (on_iret, SB_STATE, vaddr as usize),
    };
    if st.kernel_sites.fetch_add(1, Ordering::Relaxed) < 64 {
        log_debug(&format!("instrumenting {k:?} at {vaddr:#x}"));
    }
    insn.on_exec_if(cb, RegAccess::Read, st.entry(word), Cond::Ne, 0, udata);
}

extern "C" fn on_sync(vcpu: c_uint, _udata: *mut c_void) {
    guard(Some(vcpu), || {
        let Some(st) = STATE.get() else { return };
        if st.vcpu(vcpu).is_none() {
            st.count_bad_index();
            return;
        }
        st.publish(vcpu);
        st.sb_set(SB_SINCE_SYNC, vcpu, 0);
        st.poll_filters(vcpu);
    });
}

/// Everything a vCPU callback needs, resolved once.
struct Ctx<'a> {
    st: &'a State,
    v: &'a VcpuState,
    hot: &'a mut Hot,
    lay: &'a KernelLayout,
    regs: &'a Regs,
    vcpu: c_uint,
}

/// Resolves the context of a vCPU callback, or `None` (counted) if the vCPU is unknown or
/// monitoring is impossible.
fn ctx<'a>(vcpu: c_uint) -> Option<Ctx<'a>> {
    let st = STATE.get()?;
    let Some(v) = st.vcpu(vcpu) else {
        st.count_bad_index();
        return None;
    };
    let lay = st.kernel.as_ref()?;
    let regs = st.regs()?;
    // SAFETY: QEMU runs this vCPU's callbacks one at a time, and no other code touches `hot`
    // (see VcpuState), so this is the only live reference.
    let hot = unsafe { &mut *v.hot.get() };
    Some(Ctx {
        st,
        v,
        hot,
        lay,
        regs,
        vcpu,
    })
}

impl Ctx<'_> {
    fn count(&self, c: Counter, n: u64) {
        self.v.sink.add_single_writer(c, n);
    }

    fn kmem(&mut self) -> KernelMem<'_> {
        KernelMem {
            buf: &mut self.hot.membuf,
            lay: self.lay,
            errors: 0,
        }
    }

    /// The current CR3 base and kernel GS base if this vCPU knows them without reading
    /// registers (CR3 from the CR3-write callbacks while tracking stayed on; GS cached).
    fn known_env(&self) -> Option<(u64, u64)> {
        let h = &*self.hot;
        (h.kgs != 0
            && h.cur_cr3 != u64::MAX
            && h.cr3_gen == self.st.monitor.applied.load(Ordering::Relaxed))
        .then_some((h.cur_cr3, h.kgs))
    }

    /// Remembers register values read the slow way.
    fn learn_env(&mut self, cr3: u64, kgs: u64) {
        if is_kernel_addr(kgs) {
            self.hot.kgs = kgs;
        }
        self.hot.cur_cr3 = cr3;
        self.hot.cr3_gen = self.st.monitor.applied.load(Ordering::Relaxed);
    }

    /// Reads the current task; counts and returns `None` on failure. One guest read when
    /// the task is the one cached on this vCPU and no task epoch passed since.
    fn current(&mut self, kernel_gs: u64) -> Option<TaskInfo> {
        let epoch = self.st.monitor.task_epoch.load(Ordering::Relaxed);
        let off = self.lay.current_task;
        let cached = self.hot.task_cache;
        let mut m = self.kmem();
        let t = if is_kernel_addr(kernel_gs) {
            match m.u64_at(kernel_gs.wrapping_add(off)) {
                Some(task) => match cached {
                    Some((ct, f, e)) if ct == task && e == epoch => Some(TaskInfo { task, f }),
                    _ if is_kernel_addr(task) => m.task_fields(task).map(|f| TaskInfo { task, f }),
                    _ => {
                        m.errors += 1;
                        None
                    }
                },
                None => None,
            }
        } else {
            m.errors += 1;
            None
        };
        let e = m.errors;
        if e > 0 {
            self.count(Counter::KernelReadErrors, e);
        }
        self.hot.task_cache = t.map(|t| (t.task, t.f, epoch));
        t
    }

    /// Decides whether `t` is monitored (cache, then the ancestor walk), sets this vCPU's
    /// state accordingly and returns the decision.
    fn classify(&mut self, t: &TaskInfo, cr3: u64) -> bool {
        self.count(Counter::Classifications, 1);
        let st = self.st;
        let gen0 = st.monitor.gen.load(Ordering::SeqCst);
        let key = (t.f.tgid, t.f.signal, t.f.comm);
        let mut inner = st.lock();
        if inner.set.drop_stale(&t.f) {
            // The TGID's monitored process died unseen (a signal): this one reuses its PID.
            self.count(Counter::StaleTgids, 1);
            st.report_set(&inner);
        }
        let monitored = match inner.verdicts.get(&key) {
            Some(&m) => m,
            None => {
                let mut mem = KernelMem {
                    buf: &mut self.hot.membuf,
                    lay: self.lay,
                    errors: 0,
                };
                let c = {
                    let inner = &*inner;
                    let is_mon = |t: &TaskFields| inner.set.contains(t);
                    logic::classify(&inner.filters, is_mon, &t.f, &mut mem)
                };
                let m = c.verdict.monitored();
                let mut errors = mem.errors;
                // Consistency check (cache misses only): current->mm->pgd must be this CR3.
                // A mismatch means PTI (user CR3 = pgd + 4 KiB) or a wrong profile.
                let mismatch = self.pgd_mismatch(&mut errors, t.task, cr3);
                if errors > 0 {
                    self.count(Counter::KernelReadErrors, errors);
                }
                if mismatch {
                    self.count(Counter::Cr3Mismatches, 1);
                }
                self.count(Counter::AncestorHops, u64::from(c.hops));
                if !c.read_error && st.monitor.gen.load(Ordering::SeqCst) == gen0 {
                    if inner.verdicts.len() >= MAX_VERDICTS {
                        inner.verdicts.clear();
                    }
                    inner.verdicts.insert(key, m);
                }
                if m && !inner.filters.monitor_all
                    && inner.set.len() < MAX_MONITORED_SET
                    && inner.set.insert(&t.f)
                {
                    st.report_set(&inner);
                }
                m
            }
        };
        drop(inner);
        let state = if monitored {
            ST_MONITORED
        } else {
            ST_UNMONITORED
        };
        st.sb_set(SB_STATE, self.vcpu, state);
        self.v.cr3_classified.store(cr3, Ordering::Relaxed);
        self.hot.last = key;
        fence(Ordering::SeqCst);
        if st.monitor.gen.load(Ordering::SeqCst) != gen0 {
            // An invalidation raced with us: stay unknown so the next event re-classifies.
            st.sb_set(SB_STATE, self.vcpu, ST_UNKNOWN);
            self.v.cr3_classified.store(u64::MAX, Ordering::Relaxed);
        }
        monitored
    }

    /// True if `task->mm->pgd` (a direct-map address) does not translate to `cr3`. Reads
    /// `page_offset_base` once. Kernel threads (mm NULL) are not checked.
    fn pgd_mismatch(&mut self, errors: &mut u64, task: u64, cr3: u64) -> bool {
        let lay = self.lay;
        let mon = &self.st.monitor;
        let mut m = KernelMem {
            buf: &mut self.hot.membuf,
            lay,
            errors: 0,
        };
        let mut base = mon.page_offset_base.load(Ordering::Relaxed);
        if base == 0 {
            match m.u64_at(lay.page_offset_base) {
                Some(b) if is_kernel_addr(b) => {
                    mon.page_offset_base.store(b, Ordering::Relaxed);
                    base = b;
                }
                _ => {
                    *errors += m.errors.max(1);
                    return false;
                }
            }
        }
        let r = m
            .u64_at(task.wrapping_add(lay.mm))
            .filter(|&mm| mm != 0)
            .and_then(|mm| m.u64_at(mm.wrapping_add(lay.mm_pgd)))
            .map(|pgd| cr3_base(pgd.wrapping_sub(base)) != cr3);
        *errors += m.errors;
        r.unwrap_or(false)
    }

    /// Monitored? Uses the vCPU state, re-classifying when it is unknown or the task is not
    /// the one last classified here.
    fn decide(&mut self, state: u64, t: &TaskInfo, cr3: u64) -> bool {
        if state == ST_UNKNOWN || (t.f.tgid, t.f.signal, t.f.comm) != self.hot.last {
            self.classify(t, cr3)
        } else {
            state == ST_MONITORED
        }
    }

    fn push_all(&mut self, mut rec: Record) {
        let n = self.hot.pieces.len().min(usize::from(u8::MAX));
        rec.set_data_count(n as u8);
        let p = &mut self.hot.producer;
        let free = p.free(1 + n as u64);
        if free > n as u64 {
            p.push(&rec);
            for d in &self.hot.pieces[..n] {
                p.push(d);
            }
        } else if free >= 1 {
            rec.flags |= flags::DATA_LOST;
            p.push(&rec);
            p.counters()
                .add_single_writer(Counter::RecordsDropped, n as u64);
        } else {
            p.push(&rec); // counts the drop
            p.counters()
                .add_single_writer(Counter::RecordsDropped, n as u64);
        }
        self.count(Counter::DataRecords, n as u64);
    }

    /// Appends DATA pieces for `strbuf[..]` as argument `arg` read from `addr`.
    fn emit_pieces(&mut self, ts: u64, cr3: u64, addr: u64, arg: u8, end_flags: u16) {
        let len = self.hot.strbuf.len();
        let last = pieces(len, data::CAPACITY).count() - 1;
        for (i, (off, n)) in pieces(len, data::CAPACITY).enumerate() {
            let f = if i == last {
                flags::FINAL | end_flags
            } else {
                0
            };
            let rec = Record::data(
                self.vcpu,
                ts,
                cr3,
                addr.wrapping_add(off as u64),
                arg,
                off as u32,
                &self.hot.strbuf[off..off + n],
                f,
            );
            self.hot.pieces.push(rec);
        }
    }

    /// Reads the NUL-terminated string at `addr` (at most [`MAX_STRING`] bytes) into
    /// `strbuf`; returns the DATA end flags.
    fn read_string(&mut self, addr: u64) -> u16 {
        let h = &mut *self.hot;
        h.strbuf.clear();
        if addr == 0 {
            return flags::FAULT;
        }
        let mut a = addr;
        let mut tmp = [0u8; STRING_STEP];
        loop {
            let room = MAX_STRING - h.strbuf.len();
            if room == 0 {
                return flags::TRUNCATED;
            }
            let in_page = (PAGE - (a & (PAGE - 1))) as usize;
            let chunk = in_page.min(STRING_STEP).min(room);
            match h.membuf.read_guest(a, &mut tmp[..chunk]) {
                Ok(n) => {
                    if let Some(p) = nul_position(&tmp[..n]) {
                        h.strbuf.extend_from_slice(&tmp[..p]);
                        return 0;
                    }
                    h.strbuf.extend_from_slice(&tmp[..n]);
                    if n < chunk {
                        return flags::FAULT;
                    }
                    a = match a.checked_add(n as u64) {
                        Some(x) => x,
                        None => return flags::FAULT,
                    };
                }
                Err(_) => return flags::FAULT,
            }
        }
    }

    /// Reads up to `buf=` bytes of the buffer at `addr` of length `len` into `strbuf`.
    fn read_buffer(&mut self, addr: u64, len: u64) -> u16 {
        let h = &mut *self.hot;
        let want = len.min(self.st.opts.buf as u64) as usize;
        let trunc = if len > want as u64 {
            flags::TRUNCATED
        } else {
            0
        };
        h.strbuf.clear();
        if want == 0 {
            return trunc;
        }
        h.strbuf.resize(want, 0);
        match h.membuf.read_guest(addr, &mut h.strbuf[..want]) {
            Ok(n) if n == want => trunc,
            Ok(n) => {
                h.strbuf.truncate(n);
                trunc | flags::FAULT
            }
            Err(_) => {
                h.strbuf.clear();
                trunc | flags::FAULT
            }
        }
    }

    /// Reads the 8 bytes at `addr` (a `loff_t` argument) into `strbuf`; returns the DATA end
    /// flags (`FAULT` with nothing read when the page is not present).
    fn read_u64_arg(&mut self, addr: u64) -> u16 {
        let h = &mut *self.hot;
        h.strbuf.clear();
        h.strbuf.resize(8, 0);
        match h.membuf.read_guest(addr, &mut h.strbuf[..8]) {
            Ok(8) => 0,
            _ => {
                h.strbuf.clear();
                flags::FAULT
            }
        }
    }

    /// Captures the string, buffer and offset-pointer arguments of syscall `nr` into `pieces`.
    fn capture(&mut self, ts: u64, cr3: u64, nr: u32, args: &[u64; 6]) -> Option<Retry> {
        self.hot.pieces.clear();
        let mut retry = Retry {
            task: 0,
            entry_ts: ts,
            cr3,
            pc: 0,
            nr,
            args: [(0, 0); 4],
            n: 0,
            describe: changes_details(nr) && self.lay.paths.is_some(),
        };
        for a in string_args(nr) {
            let addr = args[usize::from(a)];
            let f = self.read_string(addr);
            if f & flags::FAULT != 0 {
                self.count(Counter::MemReadErrors, 1);
                if addr != 0 && self.hot.strbuf.is_empty() && retry.n < retry.args.len() {
                    retry.args[retry.n] = (a, addr);
                    retry.n += 1;
                }
            }
            self.emit_pieces(ts, cr3, addr, a, f);
        }
        if let Some((p, l)) = buffer_arg(nr) {
            if self.st.opts.buf > 0 {
                let addr = args[p];
                let f = self.read_buffer(addr, args[l]);
                if f & flags::FAULT != 0 {
                    self.count(Counter::MemReadErrors, 1);
                }
                self.emit_pieces(ts, cr3, addr, p as u8, f);
            }
        }
        // The offsets a copy starts at (NULL: the fd's position, which vmsight follows).
        for a in offset_args(nr) {
            let addr = args[usize::from(a)];
            if addr != 0 {
                let f = self.read_u64_arg(addr);
                if f & flags::FAULT != 0 {
                    self.count(Counter::MemReadErrors, 1);
                }
                self.emit_pieces(ts, cr3, addr, a, f);
            }
        }
        (retry.n > 0 || retry.describe).then_some(retry)
    }

    /// Appends DATA pieces with the task's executable, working directory and parent's TGID
    /// (and with `comm`, its name), read from guest kernel memory now, while the task surely
    /// lives.
    fn emit_details(&mut self, task: u64, ts: u64, cr3: u64, extra: u16, comm: bool) {
        let Some(pl) = self.lay.paths else { return };
        for (arg, exe) in [(data::EXE_ARG, true), (data::CWD_ARG, false)] {
            let mut out = std::mem::take(&mut self.hot.strbuf);
            let mut m = self.kmem();
            let ok = if exe {
                task_exe(&pl, &mut m, task, &mut out)
            } else {
                task_cwd(&pl, &mut m, task, &mut out)
            }
            .is_some();
            let errors = m.errors;
            self.hot.strbuf = out;
            if errors > 0 {
                self.count(Counter::KernelReadErrors, errors);
            }
            if ok {
                self.emit_pieces(ts, cr3, task, arg, extra);
            }
        }
        if let Some(ppid) = self.kmem().parent_tgid(task) {
            self.hot.strbuf.clear();
            self.hot.strbuf.extend_from_slice(&ppid.to_le_bytes());
            self.emit_pieces(ts, cr3, task, data::PPID_ARG, extra);
        }
        if comm {
            let mut name = [0u8; COMM_LEN];
            let at = task.wrapping_add(self.lay.comm);
            if self.kmem().read(at, &mut name) {
                let n = name.iter().position(|&b| b == 0).unwrap_or(COMM_LEN);
                self.hot.strbuf.clear();
                self.hot.strbuf.extend_from_slice(&name[..n]);
                self.emit_pieces(ts, cr3, task, data::COMM_ARG, extra);
            }
        }
    }

    /// At a monitored syscall entry: the first time this vCPU sees a process (TGID, identity,
    /// comm) that no vCPU described yet, its exe and cwd ride with the entry. Not at an
    /// execve or chdir: their successful return carries the new ones (as LATE pieces of the
    /// same entry, which must not meet the old ones there).
    fn describe_if_new(&mut self, t: &TaskInfo, ts: u64, cr3: u64, nr: u32) {
        let key = (t.f.tgid, t.f.signal, t.f.comm);
        if key == self.hot.described || self.lay.paths.is_none() || changes_details(nr) {
            return;
        }
        self.hot.described = key;
        let new = {
            let mut inner = self.st.lock();
            if inner.described.len() >= MAX_DESCRIBED {
                inner.described.clear(); // described again later: a bound, not an error
            }
            inner.described.insert(key)
        };
        if new {
            self.emit_details(t.task, ts, cr3, 0, false);
        }
    }

    /// Reads `current->files->fdt->fd[fd]` and the file's position, flags and inode size.
    /// `None` for a closed fd or a failed read (counted by the caller through `errors`).
    fn file_info(
        &mut self,
        fl: &FileLayout,
        task: u64,
        fd: u64,
        errors: &mut u64,
    ) -> Option<FileInfo> {
        let mut m = self.kmem();
        let r = (|| {
            let files = m.u64_at(task.wrapping_add(fl.task_files))?;
            let fdt = m.u64_at(files.wrapping_add(fl.files_fdt))?;
            let mut b4 = [0u8; 4];
            if !m.read(fdt.wrapping_add(fl.fdt_max_fds), &mut b4) {
                return None;
            }
            if fd >= u64::from(u32::from_le_bytes(b4)) {
                return None;
            }
            let arr = m.u64_at(fdt.wrapping_add(fl.fdt_fd))?;
            let file = m.u64_at(arr.wrapping_add(fd.wrapping_mul(8)))?;
            if file == 0 {
                return None; // not open: the call fails with EBADF
            }
            let pos = m.u64_at(file.wrapping_add(fl.f_pos))?;
            if !m.read(file.wrapping_add(fl.f_flags), &mut b4) {
                return None;
            }
            let flags = u32::from_le_bytes(b4);
            let inode = m.u64_at(file.wrapping_add(fl.f_inode))?;
            let mut b2 = [0u8; 2];
            if !m.read(inode.wrapping_add(fl.i_mode), &mut b2) {
                return None;
            }
            let regular = u16::from_le_bytes(b2) & S_IFMT == S_IFREG;
            let i_size = m.u64_at(inode.wrapping_add(fl.i_size))?;
            Some(FileInfo {
                pos,
                flags,
                inode,
                i_size,
                regular,
            })
        })();
        *errors += m.errors;
        r
    }

    /// Buffer checksums for a monitored read/write entry (plain or vectored): a write's SUMS
    /// records and partial head/tail DATA pieces are appended to `pieces` (pushed with the
    /// entry); a read is remembered until its return.
    fn entry_sums(&mut self, t: &TaskInfo, ts: u64, cr3: u64, pc: u64, nr: u32, args: &[u64; 6]) {
        let Some(k) = sum_kind(nr) else {
            return;
        };
        let Some(fl) = self.lay.files else { return };
        let mut errors = 0;
        let fi = self.file_info(&fl, t.task, args[0], &mut errors);
        if errors > 0 {
            self.count(Counter::KernelReadErrors, errors);
        }
        let Some(fi) = fi.filter(|f| f.regular) else {
            return;
        };
        let append = !k.read && write_appends(k, args, fi.flags);
        let (pos, src) = if append {
            (fi.i_size, vmsight_ring::sums::POS_ISIZE)
        } else if k.pos == PosArg::Arg3 || (k.pos == PosArg::Arg3OrFilePos && args[3] != u64::MAX) {
            (args[3], vmsight_ring::sums::POS_ARG)
        } else {
            (fi.pos, vmsight_ring::sums::POS_FPOS)
        };
        let Some(len) = self.load_segments(args[1], args[2], k.vectored) else {
            return; // an unreadable iovec array: the call fails with EFAULT
        };
        let hdr = SumsHeader {
            fd: args[0] as u32,
            pos_source: src,
            read: k.read,
            append: fi.flags & O_APPEND != 0 || append,
            pos,
            len,
            inode: fi.inode,
            i_size: fi.i_size,
            ..SumsHeader::default()
        };
        if k.read {
            reads_add(PendingRead {
                task: t.task,
                entry_ts: ts,
                cr3,
                pc,
                buf: args[1],
                len: args[2],
                vectored: k.vectored,
                hdr,
            });
        } else {
            self.buffer_sums(ts, cr3, args[1], hdr, 0);
            self.partial_bytes(ts, cr3, args[1], hdr);
        }
    }

    /// Describes the call's buffer in `hot.segs`: one segment for a plain buffer, the iovec
    /// array's entries for a vectored call. Returns the total length, `None` when the array
    /// cannot be read or is refused by the kernel.
    fn load_segments(&mut self, buf: u64, len: u64, vectored: bool) -> Option<u64> {
        let h = &mut *self.hot;
        if !vectored {
            h.segs.clear();
            h.segs.push(logic::Segment {
                start: 0,
                addr: buf,
                len,
            });
            return Some(len);
        }
        if !h.membuf.read_iovecs(buf, len, &mut h.iovraw) {
            if len <= MAX_IOV {
                self.count(Counter::MemReadErrors, 1);
            }
            return None;
        }
        iov_segments(&h.iovraw, &mut h.segs)
    }

    /// Checksums the whole 4 KiB file-aligned chunks of the buffer at `buf` described by
    /// `hdr` (at most `sumcap` bytes) and appends SUMS records to `pieces`. Always appends at
    /// least one record, so vmsight learns the position and inode even for small writes.
    fn buffer_sums(&mut self, ts: u64, cr3: u64, buf: u64, mut hdr: SumsHeader, extra: u16) {
        let plan = chunk_plan(hdr.pos, hdr.len);
        let cap = self.st.opts.sum_cap / CHUNK;
        let n = plan.whole.min(cap);
        let mut end_flags = if n < plan.whole { flags::TRUNCATED } else { 0 };
        let mut i = 0u64;
        loop {
            let mut vals = [0u64; vmsight_ring::sums::PER_RECORD];
            let take = (n - i).min(vals.len() as u64) as usize;
            let mut valid = 0u8;
            for (k, v) in vals.iter_mut().enumerate().take(take) {
                let off = plan.first_buf + (i + k as u64) * CHUNK;
                let h = &mut *self.hot;
                if h.membuf.read_segments(&h.segs, off, &mut h.chunk[..]) == h.chunk.len() {
                    *v = vmsight_ring::chunk_sum(&h.chunk[..]);
                    valid |= 1 << k;
                } else {
                    end_flags |= flags::FAULT;
                }
            }
            if end_flags & flags::FAULT != 0 && valid.count_ones() as usize != take {
                self.count(Counter::MemReadErrors, 1);
            }
            hdr.count = take;
            hdr.valid = valid;
            hdr.first = plan.first_chunk + i;
            i += take as u64;
            let last = i >= n;
            let f = extra | if last { flags::FINAL | end_flags } else { 0 };
            let rec = Record::sums(self.vcpu, ts, cr3, buf, &hdr, &vals[..take], f);
            self.hot.pieces.push(rec);
            if last {
                break;
            }
        }
    }

    /// Appends DATA pieces with the bytes of a write's partial head and tail chunks, so
    /// vmsight can complete them from its recent-I/O cache (Sky §3.4.4).
    fn partial_bytes(&mut self, ts: u64, cr3: u64, buf: u64, hdr: SumsHeader) {
        let plan = chunk_plan(hdr.pos, hdr.len);
        for (arg, off, len) in [
            (data::HEAD_ARG, 0, plan.head_len),
            (data::TAIL_ARG, plan.tail_start, plan.tail_len),
        ] {
            if len == 0 || len >= CHUNK {
                continue;
            }
            // The guest address of the piece's first byte (for a vectored call, in its iovec).
            let mut addr = buf.wrapping_add(off);
            for_each_run(&self.hot.segs, off, 1, |a, _, _| addr = a);
            let h = &mut *self.hot;
            h.strbuf.clear();
            h.strbuf.resize(len as usize, 0);
            let n = h.membuf.read_segments(&h.segs, off, &mut h.strbuf[..]);
            let f = if n == len as usize {
                0
            } else {
                h.strbuf.truncate(n);
                flags::FAULT
            };
            if f != 0 {
                self.count(Counter::MemReadErrors, 1);
            }
            self.emit_pieces(ts, cr3, addr, arg, f);
        }
    }

    /// At a monitored task's return: if it is the return of a pending read (`rip` right
    /// after its `syscall`, a positive result), pushes the LATE SUMS of the filled buffer.
    fn read_return_sums(&mut self, pr: &PendingRead, rip: u64, rax: u64) {
        let got = rax as i64;
        if rip != pr.pc.wrapping_add(2) || got <= 0 {
            return; // an error, EOF, a restart or a signal handler: nothing was read
        }
        let Some(len) = self.load_segments(pr.buf, pr.len, pr.vectored) else {
            return;
        };
        let mut hdr = pr.hdr;
        hdr.len = (got as u64).min(len);
        self.hot.pieces.clear();
        self.buffer_sums(pr.entry_ts, pr.cr3, pr.buf, hdr, flags::LATE);
        let n = self.hot.pieces.len();
        let p = &mut self.hot.producer;
        if p.free(n as u64) >= n as u64 {
            for d in &self.hot.pieces[..n] {
                p.push(d);
            }
            self.count(Counter::DataRecords, n as u64);
        } else {
            p.counters()
                .add_single_writer(Counter::RecordsDropped, n as u64);
        }
        self.hot.pieces.clear();
    }

    /// Re-reads the strings of `rt` at the call's return and pushes them as LATE pieces. For a
    /// successful execve the old address space is gone; its filename is the new image's
    /// AT_EXECFN, which the kernel copied to the top of the new stack at `usp`.
    fn retry_strings(&mut self, rt: &Retry, rip: u64, rax: u64, usp: u64) {
        self.hot.pieces.clear();
        let exec_done =
            matches!(rt.nr, nr::EXECVE | nr::EXECVEAT) && rip != rt.pc.wrapping_add(2) && rax == 0;
        for &(a, addr) in &rt.args[..rt.n] {
            let first_string_arg = string_args(rt.nr).next() == Some(a);
            let src = if exec_done {
                if !first_string_arg {
                    continue;
                }
                match self.execfn(usp) {
                    Some(p) => p,
                    None => continue,
                }
            } else {
                addr
            };
            let f = self.read_string(src);
            if f & flags::FAULT != 0 && self.hot.strbuf.is_empty() {
                continue;
            }
            self.emit_pieces(rt.entry_ts, rt.cr3, src, a, f | flags::LATE);
        }
        let chdir_done =
            matches!(rt.nr, nr::CHDIR | nr::FCHDIR) && rip == rt.pc.wrapping_add(2) && rax == 0;
        if rt.describe && (exec_done || chdir_done) {
            self.emit_details(rt.task, rt.entry_ts, rt.cr3, flags::LATE, exec_done);
        }
        let n = self.hot.pieces.len();
        let p = &mut self.hot.producer;
        if p.free(n as u64) >= n as u64 {
            for d in &self.hot.pieces[..n] {
                p.push(d);
            }
            self.count(Counter::DataRecords, n as u64);
        }
        self.hot.pieces.clear();
    }

    /// The AT_EXECFN pointer of a process that just started at stack pointer `usp`:
    /// `argc, argv[], NULL, envp[], NULL, auxv pairs`.
    fn execfn(&mut self, usp: u64) -> Option<u64> {
        const AT_NULL: u64 = 0;
        const AT_EXECFN: u64 = 31;
        const MAX_WORDS: u64 = 16 * 1024;
        let mut word = |i: u64| -> Option<u64> {
            let mut b = [0u8; 8];
            match self
                .hot
                .membuf
                .read_guest(usp.checked_add(i.checked_mul(8)?)?, &mut b)
            {
                Ok(8) => Some(u64::from_le_bytes(b)),
                _ => None,
            }
        };
        let argc = word(0)?;
        let mut i = argc.checked_add(2)?; // argv[] and its NULL
        while word(i)? != 0 {
            i += 1;
            if i > MAX_WORDS {
                return None;
            }
        }
        i += 1;
        loop {
            let (t, v) = (word(i)?, word(i + 1)?);
            if t == AT_EXECFN {
                return Some(v);
            }
            if t == AT_NULL || i > MAX_WORDS {
                return None;
            }
            i += 2;
        }
    }
}

/// The run-time address of an instruction translated at `translated`, given a RIP value synced
/// at or before it in the same block: mappings are page-aligned, so the page offset is the
/// translation's, and the instruction is the first address at or after `rip` with that offset
/// (a block ending in `syscall` is shorter than a page).
fn runtime_pc(rip: u64, translated: u64) -> u64 {
    rip.wrapping_add(translated.wrapping_sub(rip) & 0xfff)
}

extern "C" fn on_syscall(vcpu: c_uint, udata: *mut c_void) {
    let mut jump_to = None;
    guard(Some(vcpu), || {
        jump_to = syscall_entry(vcpu, udata as usize as u64)
    });
    if let Some(pc) = jump_to {
        redirect::jump(pc);
    }
}

/// Handles a monitored `syscall` instruction; returns a PC to move the vCPU to when a vCPU
/// redirection takes it here.
fn syscall_entry(vcpu: c_uint, translated_pc: u64) -> Option<u64> {
    let mut c = ctx(vcpu)?;
    c.st.poll_filters(vcpu);
    c.count(Counter::Callbacks, 1);
    let state = c.st.sb_get(SB_STATE, vcpu);
    if state == ST_UNMONITORED {
        return None; // a filter change or classification raced with the condition
    }
    let mut r = [0u64; ENTRY_REGS.len()];
    let known = c.known_env();
    let n = if known.is_some() { E_CR3 } else { r.len() };
    let failed = c.hot.regbuf.read_registers(&c.regs.entry[..n], &mut r[..n]);
    if failed != 0 {
        c.count(Counter::RegReadErrors, 1);
    }
    let (cr3, kgs) = match known {
        Some(k) => k,
        None => {
            let k = (cr3_base(r[E_CR3]), r[E_KGS]);
            if failed == 0 {
                c.learn_env(k.0, k.1);
            }
            k
        }
    };
    let Some(t) = c.current(kgs) else {
        // No task, no decision: leave the vCPU unmonitored until the next address-space
        // switch rather than paying a failing callback per syscall (e.g. under PTI).
        c.st.sb_set(SB_STATE, vcpu, ST_UNMONITORED);
        c.v.cr3_classified.store(cr3, Ordering::Relaxed);
        return None;
    };
    if !c.decide(state, &t, cr3) {
        return None;
    }
    let pc = if failed == 0 {
        runtime_pc(r[E_RIP], translated_pc)
    } else {
        translated_pc
    };
    if let Some(to) = c.redirect_at_syscall(t.f.tgid, cr3, pc) {
        return Some(to); // the syscall runs when the vCPU comes back here
    }
    c.count(Counter::MonitoredSyscalls, 1);
    let ts = monotonic_ns();
    let mut args = [0u64; 6];
    args.copy_from_slice(&r[E_ARGS..E_ARGS + 6]);
    let mut rec = Record::syscall_entry(vcpu, ts, cr3, pc, r[E_RAX], args, r[E_RSP]);
    rec.set_task(t.task, t.f.pid, t.f.tgid, Some(&t.f.comm));
    if failed != 0 {
        rec.flags |= flags::REG_FAULT;
    }
    // The kernel decodes the syscall number from EAX (it is an int).
    let nr = r[E_RAX] as u32;
    if failed == 0 {
        if let Some(mut rt) = c.capture(ts, cr3, nr, &args) {
            rt.task = t.task;
            rt.pc = pc;
            retries_add(rt);
        }
        if c.st.opts.sums {
            c.entry_sums(&t, ts, cr3, pc, nr, &args);
        }
        c.describe_if_new(&t, ts, cr3, nr);
    } else {
        c.hot.pieces.clear();
    }
    c.push_all(rec);
    // Process-tree changes: the child of a monitored process must be classified afresh;
    // an exiting process is forgotten (its TGID and address space may be reused).
    if matches!(
        nr,
        nr::CLONE | nr::CLONE3 | nr::FORK | nr::VFORK | nr::EXIT | nr::PRCTL
    ) {
        // Task identities on any vCPU may change (new or dying threads, renames).
        c.st.monitor.task_epoch.fetch_add(1, Ordering::SeqCst);
    }
    match lifecycle(nr, args[0]) {
        Lifecycle::None => {}
        Lifecycle::Fork => {
            let mut inner = c.st.lock();
            c.st.invalidate(&mut inner, vcpu);
        }
        Lifecycle::Clone3 => {
            let mut b = [0u8; 8];
            let thread = matches!(c.hot.membuf.read_guest(args[0], &mut b), Ok(8))
                && u64::from_le_bytes(b) & CLONE_THREAD != 0;
            if !thread {
                let mut inner = c.st.lock();
                c.st.invalidate(&mut inner, vcpu);
            }
        }
        Lifecycle::ExitGroup => {
            let mut inner = c.st.lock();
            if inner.set.remove(t.f.tgid) {
                c.st.report_set(&inner);
            }
            c.st.invalidate(&mut inner, vcpu);
        }
    }
    None
}

/// A return marker (`vmsight_proto::redirect::RETURN_MARKER`) is about to execute.
extern "C" fn on_marker(vcpu: c_uint, _udata: *mut c_void) {
    let mut jump_to = None;
    guard(Some(vcpu), || {
        jump_to = ctx(vcpu).and_then(|mut c| c.redirect_at_marker());
    });
    if let Some(pc) = jump_to {
        redirect::jump(pc);
    }
}

/// Publishes where every vCPU's arm word is (so far: vCPUs `0..=vcpu`, re-published at each
/// vCPU's initialisation because adding a vCPU may move the scoreboard): vmsight arms the
/// vCPUs for SymCall's synchronous transport by writing them directly.
fn publish_arm_words(st: &State, vcpu: c_uint) {
    let n = (vcpu as usize + 1).min(vmsight_ring::redirect::MAX_ARM_VCPUS);
    let addrs: Vec<u64> = (0..n as c_uint)
        // SAFETY: QEMU sizes scoreboards for the highest vCPU index initialised, so the
        // elements of 0..=vcpu exist.
        .map(|i| unsafe { st.entry(SB_ARM).address(i) })
        .collect();
    st.channel
        .redirect_mailbox()
        .publish_arm(std::process::id(), &addrs);
}

/// The first instruction of a kernel block on an armed vCPU (SymCall's synchronous
/// transport): maybe redirect into the guest module's entry.
extern "C" fn on_kernel_armed(vcpu: c_uint, udata: *mut c_void) {
    let mut jump_to = None;
    guard(Some(vcpu), || {
        jump_to = ctx(vcpu).and_then(|mut c| c.redirect_in_kernel(udata as u64, true));
    });
    if let Some(pc) = jump_to {
        redirect::jump(pc);
    }
}

/// A guest safe-point marker (the SymCall module's wake-up handler): take a waiting kernel
/// request here, whatever the interrupt flag.
extern "C" fn on_safe_point(vcpu: c_uint, udata: *mut c_void) {
    let mut jump_to = None;
    guard(Some(vcpu), || {
        jump_to = ctx(vcpu).and_then(|mut c| c.redirect_in_kernel(udata as u64, false));
    });
    if let Some(pc) = jump_to {
        redirect::jump(pc);
    }
}

extern "C" fn on_cr3_write(vcpu: c_uint, udata: *mut c_void) {
    guard(Some(vcpu), || cr3_write(vcpu, udata as usize));
}

fn cr3_write(vcpu: c_uint, reg: usize) {
    let Some(c) = ctx(vcpu) else { return };
    c.st.poll_filters(vcpu);
    c.count(Counter::Cr3Writes, 1);
    if !c.st.monitor.tracking.load(Ordering::Relaxed) {
        return;
    }
    let Some(&h) = c.regs.gpr.get(reg) else {
        c.count(Counter::InternalErrors, 1);
        return;
    };
    let mut v = [0u64; 1];
    let new = if c.hot.regbuf.read_registers(&[h], &mut v) == 0 {
        cr3_base(v[0])
    } else {
        c.count(Counter::RegReadErrors, 1);
        u64::MAX
    };
    c.hot.cur_cr3 = new;
    c.hot.cr3_gen = c.st.monitor.applied.load(Ordering::Relaxed);
    c.hot.task_cache = None;
    // Same address space again (TLB flushes rewrite CR3): the decision stands.
    if new != u64::MAX
        && new == c.v.cr3_classified.load(Ordering::Relaxed)
        && c.st.sb_get(SB_STATE, vcpu) != ST_UNKNOWN
    {
        return;
    }
    c.st.sb_set(SB_STATE, vcpu, ST_UNKNOWN);
    c.v.cr3_classified.store(u64::MAX, Ordering::Relaxed);
}

extern "C" fn on_sysret(vcpu: c_uint, udata: *mut c_void) {
    guard(Some(vcpu), || {
        kernel_return(vcpu, udata as usize as u64, ReturnVia::Sysret)
    });
}

extern "C" fn on_iret(vcpu: c_uint, udata: *mut c_void) {
    guard(Some(vcpu), || {
        kernel_return(vcpu, udata as usize as u64, ReturnVia::Iret)
    });
}

fn kernel_return(vcpu: c_uint, insn: u64, via: ReturnVia) {
    let Some(mut c) = ctx(vcpu) else { return };
    c.st.poll_filters(vcpu);
    let state = c.st.sb_get(SB_STATE, vcpu);
    if state == ST_UNMONITORED {
        return;
    }
    c.count(Counter::ReturnCallbacks, 1);
    let mut failed;
    let known = c.known_env();
    let (rax, rip, rflags, usp, mut cr3, mut kgs, cs);
    match via {
        ReturnVia::Sysret => {
            let mut r = [0u64; SYSRET_REGS.len()];
            let n = if known.is_some() { 4 } else { r.len() };
            failed = c
                .hot
                .regbuf
                .read_registers(&c.regs.sysret[..n], &mut r[..n]);
            (rax, rip, rflags, usp, cr3, kgs) = (r[0], r[1], r[2], r[3], r[4], r[5]);
            cs = 0x33;
        }
        ReturnVia::Iret => {
            let mut r = [0u64; IRET_REGS.len()];
            let n = if known.is_some() { 2 } else { r.len() };
            failed = c.hot.regbuf.read_registers(&c.regs.iret[..n], &mut r[..n]);
            (rax, cr3, kgs) = (r[0], r[2], r[3]);
            let rsp = r[1];
            // The iret frame: RIP, CS, RFLAGS, RSP, SS.
            let mut f = [0u8; 40];
            let ok = failed & 0b10 == 0 && matches!(c.hot.membuf.read_guest(rsp, &mut f), Ok(40));
            if !ok {
                c.count(Counter::KernelReadErrors, 1);
                return;
            }
            let w = |i: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&f[i * 8..i * 8 + 8]);
                u64::from_le_bytes(b)
            };
            if w(1) & 3 == 0 {
                c.count(Counter::KernelReturns, 1);
                return; // back to kernel mode (interrupted kernel code, sync_core)
            }
            (rip, cs, rflags, usp) = (w(0), w(1), w(2), w(3));
        }
    }
    if failed != 0 {
        c.count(Counter::RegReadErrors, 1);
        failed = 1;
    }
    match known {
        Some(k) => (cr3, kgs) = k,
        None => {
            cr3 = cr3_base(cr3);
            if failed == 0 {
                c.learn_env(cr3, kgs);
            }
        }
    }
    let Some(t) = c.current(kgs) else { return };
    if !c.decide(state, &t, cr3) {
        return;
    }
    if let Some(rt) = retries_take(t.task) {
        c.retry_strings(&rt, rip, rax, usp);
    }
    if let Some(pr) = reads_take(t.task) {
        c.read_return_sums(&pr, rip, rax);
    }
    let mut rec = Record::syscall_return(vcpu, monotonic_ns(), cr3, via, insn, rip, rax);
    rec.set_task(t.task, t.f.pid, t.f.tgid, None);
    rec.payload[vmsight_ring::ret::SP] = usp;
    rec.payload[vmsight_ring::ret::RFLAGS] = rflags;
    rec.payload[vmsight_ring::ret::CS] = cs;
    if failed != 0 {
        rec.flags |= flags::REG_FAULT;
    }
    c.count(Counter::Returns, 1);
    c.hot.producer.push(&rec);
}

fn on_exit() {
    let Some(st) = STATE.get() else { return };
    for vcpu in 0..st.vcpus.len() as u32 {
        st.publish(vcpu);
    }
    if st.opts.verbose {
        for vcpu in 0..st.vcpus.len() as u32 {
            if let Some(v) = st.vcpu(vcpu) {
                let g = |c| v.sink.get(c);
                eprintln!(
                    "vmsight-plugin: vCPU {vcpu}: syscalls {} callbacks {} monitored {} \
                     classifications {} cr3 {} returns {}/{} records {} dropped {} \
                     instrumented {} reg-errors {} mem-errors {} kernel-errors {} internal {}",
                    g(Counter::Syscalls),
                    g(Counter::Callbacks),
                    g(Counter::MonitoredSyscalls),
                    g(Counter::Classifications),
                    g(Counter::Cr3Writes),
                    g(Counter::Returns),
                    g(Counter::ReturnCallbacks),
                    g(Counter::RecordsWritten),
                    g(Counter::RecordsDropped),
                    g(Counter::Instrumented),
                    g(Counter::RegReadErrors),
                    g(Counter::MemReadErrors),
                    g(Counter::KernelReadErrors),
                    g(Counter::InternalErrors),
                );
            }
        }
    }
    st.channel.finish();
    if let Some(b) = &st.blk {
        b.channel.finish();
    }
}
