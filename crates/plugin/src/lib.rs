//! vmsight TCG plugin (`libvmsight_plugin.so`): intercepts user-mode `syscall` instructions of an
//! unmodified guest inside QEMU and streams them to vmsight over a [`vmsight_ring`] channel.
//!
//! ```text
//! qemu-system-x86_64 ... -plugin libvmsight_plugin.so,shm=/run/vmsight/NAME/plugin.shm[,records=on|off][,peek=on|off][,sync=N][,verbose=on]
//! ```
//!
//! * At translation time every user-space (`vaddr < 2^47`) `syscall` instruction (`0f 05`,
//!   optionally prefixed) gets two inline per-vCPU scoreboard adds (no helper call) and a
//!   conditional callback that publishes the scoreboard to the channel every `sync` syscalls.
//! * With `records=on` (default) it also gets an exec callback with register read access that
//!   reads RAX, the six argument registers, RSP and CR3 and pushes a syscall-entry record into
//!   the vCPU's ring. `peek=on` additionally copies up to 32 bytes of `write(2)` buffers.
//! * Nothing the guest does can crash QEMU: callbacks never unwrap, panics are caught at every
//!   FFI entry point and counted, failed reads are counted and flagged in the record.
//!
//! The `qemu-plugin` crate provides the install entry point (`register!`); this crate overrides
//! `Register::register_default` so it registers its own `extern "C"` callbacks instead of the
//! crate's handlers, which lock a global mutex and panic (= abort QEMU) on any error.

mod guest;
mod logic;

use std::cell::{Cell, UnsafeCell};
use std::ffi::{c_uint, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use qemu_plugin::install::{Args, Info};
use qemu_plugin::plugin::{HasCallbacks, Register};
use qemu_plugin::sys::{
    self, qemu_plugin_cb_flags, qemu_plugin_cond, qemu_plugin_insn, qemu_plugin_op,
    qemu_plugin_scoreboard, qemu_plugin_tb, qemu_plugin_u64,
};
use qemu_plugin::{register, PluginId};
use vmsight_ring::{
    flags, layout::plugin_flags, monotonic_ns, syscall, Channel, ChannelPlugin, Counter,
    CounterSink, Producer, Record,
};

pub use guest::{MemError, MAX_GUEST_READ};

pub use logic::*;

// ---------------------------------------------------------------------------------------------
// Global state

/// Registers read at every syscall, in this order.
const REG_NAMES: [&str; 9] = ["rax", "rdi", "rsi", "rdx", "r10", "r8", "r9", "rsp", "cr3"];
const R_RAX: usize = 0;
const R_ARGS: usize = 1;
const R_RSI: usize = 2;
const R_RDX: usize = 3;
const R_RSP: usize = 7;
const R_CR3: usize = 8;
/// Registers looked up (and reported) but not read per syscall: RIP is known at translation
/// time and the user-half address check already implies CPL 3.
const REG_NAMES_EXTRA: [&str; 2] = ["rip", "cs"];

/// Scoreboard element: syscalls executed, syscalls since the last publication. Padded to two
/// cache lines so two vCPUs' inline adds never share a line.
const SB_SYSCALLS: usize = 0;
const SB_SINCE_SYNC: usize = 8;
const SB_ELEMENT: usize = 128;

struct State {
    channel: ChannelPlugin,
    opts: Options,
    /// `qemu_plugin_scoreboard *`, stored as an address: the scoreboard is owned by QEMU and
    /// lives until exit; QEMU synchronises its growth with vCPU execution.
    scoreboard: usize,
    /// Register handles in `REG_NAMES` order; `None` if discovery failed (then no records).
    regs: OnceLock<Option<[usize; REG_NAMES.len()]>>,
    vcpus: Box<[OnceLock<VcpuState>]>,
    missing_slot_reported: AtomicBool,
}

impl State {
    fn entry(&self, offset: usize) -> qemu_plugin_u64 {
        qemu_plugin_u64 {
            score: self.scoreboard as *mut qemu_plugin_scoreboard,
            offset,
        }
    }

    fn vcpu(&self, vcpu: c_uint) -> Option<&VcpuState> {
        self.vcpus.get(vcpu as usize).and_then(OnceLock::get)
    }

    fn regs(&self) -> Option<&[usize; REG_NAMES.len()]> {
        self.regs.get().and_then(Option::as_ref)
    }

    fn records_enabled(&self) -> bool {
        self.opts.records && self.regs().is_some()
    }

    /// Counts a callback that arrived with a vCPU index we never initialised. QEMU does this
    /// with single-threaded TCG (`thread=single`), where it bakes the translating vCPU's index
    /// into shared code; such calls are ignored (never used to index anything) and counted as
    /// internal errors of vCPU 0 so they are visible.
    fn count_bad_index(&self) {
        if let Some(v) = self.vcpu(0) {
            v.sink.add(Counter::InternalErrors, 1);
        }
    }

    /// Mirrors `vcpu`'s scoreboard count into the channel. Must run on a thread where QEMU
    /// allows scoreboard access (vCPU callbacks, exit hooks).
    fn publish(&self, vcpu: c_uint) {
        let Some(v) = self.vcpu(vcpu) else { return };
        // SAFETY: the scoreboard is live and `vcpu` was initialised (it has a VcpuState), so
        // its element exists.
        let n = unsafe { sys::qemu_plugin_u64_get(self.entry(SB_SYSCALLS), vcpu) };
        v.sink.set_max(Counter::Syscalls, n);
        self.channel.heartbeat();
    }
}

/// Per-vCPU state. `hot` is only ever accessed by the vCPU's own callbacks, which QEMU never
/// runs concurrently with each other (one thread executes a vCPU at a time); other threads
/// use only `sink` (atomics).
struct VcpuState {
    sink: CounterSink,
    hot: UnsafeCell<Hot>,
}

struct Hot {
    producer: Producer,
    regbuf: guest::ByteBuf,
    membuf: guest::ByteBuf,
}

// SAFETY: see the type's comment: `hot` is confined to the owning vCPU's callbacks, which are
// serialised by QEMU; everything else is atomic.
unsafe impl Sync for VcpuState {}

static STATE: OnceLock<State> = OnceLock::new();

thread_local! {
    /// vCPU index of the current thread (set in vcpu_init, which QEMU runs on the vCPU's
    /// thread); attributes translation-time counts. With single-threaded TCG all vCPUs share a
    /// thread and the count goes to the last initialised one.
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
    let _ = qemu_plugin::qemu_plugin_outs(format!("vmsight-plugin: {msg}\n"));
}

// ---------------------------------------------------------------------------------------------
// Installation

struct VmsightPlugin;

impl HasCallbacks for VmsightPlugin {}

impl Register for VmsightPlugin {
    fn register_default(
        &mut self,
        id: PluginId,
        args: &Args,
        info: &Info,
    ) -> qemu_plugin::Result<()> {
        if let Err(e) = install(id, args, info) {
            // Returning an error would make the qemu-plugin crate panic inside the
            // `extern "C"` install function, which aborts QEMU with a core dump. Exiting with
            // status 1 is what QEMU itself does when a plugin fails to install.
            eprintln!("vmsight-plugin: {e}");
            eprintln!("vmsight-plugin: {USAGE}");
            std::process::exit(1);
        }
        Ok(())
    }
}

register!(VmsightPlugin);

fn install(id: PluginId, args: &Args, info: &Info) -> Result<(), PluginError> {
    let opts = Options::parse(args.raw.iter().map(String::as_str))?;
    if info.target_name != "x86_64" {
        return Err(PluginError::WrongTarget(info.target_name.clone()));
    }
    let system = info.system.as_ref().ok_or(PluginError::NotSystemMode)?;
    let channel = Channel::attach(&opts.shm)?;
    if system.max_vcpus > i64::from(channel.max_vcpus()) || system.max_vcpus < 1 {
        return Err(PluginError::TooManyVcpus {
            qemu: system.max_vcpus,
            channel: channel.max_vcpus(),
        });
    }
    let mut bits = 0;
    if opts.records {
        bits |= plugin_flags::RECORDS;
    }
    if opts.peek {
        bits |= plugin_flags::PEEK;
    }
    channel.set_plugin_info(sys::QEMU_PLUGIN_VERSION, bits);
    // SAFETY: allocation of a QEMU-managed per-vCPU array; QEMU grows it as vCPUs appear.
    let scoreboard = unsafe { sys::qemu_plugin_scoreboard_new(SB_ELEMENT) } as usize;
    let slots = (0..channel.max_vcpus()).map(|_| OnceLock::new()).collect();
    log_debug(&format!(
        "attached to {} (records={}, peek={}, sync={}, QEMU API {}..{}, {} vCPUs max)",
        opts.shm.display(),
        opts.records,
        opts.peek,
        opts.sync_every,
        info.version.mininum,
        info.version.current,
        system.max_vcpus
    ));
    let state = State {
        channel,
        opts,
        scoreboard,
        regs: OnceLock::new(),
        vcpus: slots,
        missing_slot_reported: AtomicBool::new(false),
    };
    if STATE.set(state).is_err() {
        // A second install in the same process (QEMU loads each -plugin once; a duplicate
        // -plugin of the same .so shares our statics): refuse rather than share rings.
        return Err(PluginError::BadValue {
            key: "plugin".into(),
            value: "libvmsight_plugin.so".into(),
            reason: "the plugin is already loaded in this QEMU",
        });
    }
    // These only store function pointers and never fail.
    let _ = qemu_plugin::qemu_plugin_register_vcpu_init_cb(id, Some(on_vcpu_init));
    let _ = qemu_plugin::qemu_plugin_register_vcpu_exit_cb(id, Some(on_vcpu_exit));
    let _ = qemu_plugin::qemu_plugin_register_vcpu_idle_cb(id, Some(on_vcpu_idle));
    let _ = qemu_plugin::qemu_plugin_register_vcpu_tb_trans_cb(id, Some(on_tb_trans));
    let _ = qemu_plugin::qemu_plugin_register_atexit_cb(id, |_| guard(None, on_exit));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Callbacks (all `extern "C"`, all guarded)

extern "C" fn on_vcpu_init(_id: PluginId, vcpu: c_uint) {
    guard(Some(vcpu), || vcpu_init(vcpu));
}

fn vcpu_init(vcpu: c_uint) {
    CURRENT_VCPU.with(|c| c.set(vcpu));
    let Some(st) = STATE.get() else { return };
    st.regs.get_or_init(discover_registers);
    st.channel.report_vcpus(vcpu.saturating_add(1));
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
    if slot.get().is_some() {
        return; // re-init (e.g. CPU reset paths): keep the existing producer.
    }
    let built = (|| -> Result<VcpuState, String> {
        let producer = st.channel.producer(vcpu).map_err(|e| e.to_string())?;
        let sink = st.channel.counters(vcpu).map_err(|e| e.to_string())?;
        let regbuf = guest::ByteBuf::new(256).ok_or("cannot allocate a register buffer")?;
        let membuf = guest::ByteBuf::new(64).ok_or("cannot allocate a memory buffer")?;
        Ok(VcpuState {
            sink,
            hot: UnsafeCell::new(Hot {
                producer,
                regbuf,
                membuf,
            }),
        })
    })();
    match built {
        Ok(v) => {
            let _ = slot.set(v);
        }
        Err(e) => eprintln!("vmsight-plugin: vCPU {vcpu} is not observed: {e}"),
    }
}

fn discover_registers() -> Option<[usize; REG_NAMES.len()]> {
    let regs = guest::list_registers();
    let names: Vec<String> = regs
        .iter()
        .map(|r| format!("{}({})", r.name, r.feature))
        .collect();
    log_debug(&format!(
        "{} guest registers: {}",
        regs.len(),
        names.join(" ")
    ));
    let find = |n: &str| regs.iter().find(|r| r.name == n).map(|r| r.handle);
    let mut out = [0usize; REG_NAMES.len()];
    let mut missing = Vec::new();
    for (slot, name) in out.iter_mut().zip(REG_NAMES) {
        match find(name) {
            Some(h) => *slot = h,
            None => missing.push(name),
        }
    }
    for name in REG_NAMES_EXTRA {
        if find(name).is_none() {
            log_debug(&format!("register {name} not offered by QEMU"));
        }
    }
    if missing.is_empty() {
        Some(out)
    } else {
        eprintln!(
            "vmsight-plugin: QEMU offers no register(s) {}; syscall records are disabled, \
             counting continues",
            missing.join(", ")
        );
        None
    }
}

extern "C" fn on_vcpu_exit(_id: PluginId, vcpu: c_uint) {
    guard(Some(vcpu), || {
        if let Some(st) = STATE.get() {
            st.publish(vcpu);
        }
    });
}

extern "C" fn on_vcpu_idle(_id: PluginId, vcpu: c_uint) {
    guard(Some(vcpu), || {
        if let Some(st) = STATE.get() {
            st.publish(vcpu);
        }
    });
}

extern "C" fn on_tb_trans(_id: PluginId, tb: *mut qemu_plugin_tb) {
    guard(None, || {
        let Some(st) = STATE.get() else { return };
        // SAFETY: `tb` is valid for the duration of this translation callback.
        let n = unsafe { instrument_tb(st, tb) };
        if n > 0 {
            let vcpu = CURRENT_VCPU.with(Cell::get);
            let vcpu = if vcpu == u32::MAX { 0 } else { vcpu };
            if let Some(v) = st.vcpu(vcpu) {
                v.sink.add(Counter::Instrumented, n);
            }
        }
    });
}

/// Instruments the user-mode `syscall` instructions of `tb`; returns how many.
///
/// # Safety
/// `tb` must be the handle passed to the current translation callback.
unsafe fn instrument_tb(st: &State, tb: *mut qemu_plugin_tb) -> u64 {
    // A TB never spans user and kernel halves, and most translations are kernel code: reject
    // those without looking at their instructions.
    // SAFETY: `tb` is valid for the duration of the translation callback (caller).
    if unsafe { sys::qemu_plugin_tb_vaddr(tb) } >= USER_SPACE_END {
        return 0;
    }
    let records = st.records_enabled();
    let mut count = 0;
    // SAFETY: as above.
    let n = unsafe { sys::qemu_plugin_tb_n_insns(tb) };
    for i in 0..n {
        // SAFETY: `i < n`; the handle is valid until the callback returns.
        let insn = unsafe { sys::qemu_plugin_tb_get_insn(tb, i) };
        if insn.is_null() {
            continue;
        }
        // SAFETY: `insn` is a live instruction handle of this TB.
        let vaddr = unsafe { sys::qemu_plugin_insn_vaddr(insn) };
        // SAFETY: as above.
        let size = unsafe { sys::qemu_plugin_insn_size(insn) };
        if vaddr >= USER_SPACE_END || !(2..=15).contains(&size) {
            continue;
        }
        let mut bytes = [0u8; 16];
        // SAFETY: live handle; QEMU copies at most `size <= 15 < 16` bytes into `bytes`.
        let got = unsafe { sys::qemu_plugin_insn_data(insn, bytes.as_mut_ptr().cast(), size) };
        if !is_syscall_insn(&bytes[..got.min(size)]) {
            continue;
        }
        // SAFETY: live instruction handle of the current translation callback.
        unsafe { instrument_syscall(st, insn, vaddr, records) };
        count += 1;
    }
    count
}

/// # Safety
/// `insn` must be an instruction handle of the current translation callback.
unsafe fn instrument_syscall(st: &State, insn: *mut qemu_plugin_insn, vaddr: u64, records: bool) {
    use qemu_plugin_cb_flags::{QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS};
    // Inline ops and callbacks run in registration order, before the instruction executes.
    // SAFETY: `insn` is a live instruction handle (caller) and the scoreboard lives until exit;
    // the callbacks are `extern "C"` functions with the signature QEMU expects.
    unsafe {
        // Counting: inline adds, no helper call at all.
        sys::qemu_plugin_register_vcpu_insn_exec_inline_per_vcpu(
            insn,
            qemu_plugin_op::QEMU_PLUGIN_INLINE_ADD_U64,
            st.entry(SB_SYSCALLS),
            1,
        );
        sys::qemu_plugin_register_vcpu_insn_exec_inline_per_vcpu(
            insn,
            qemu_plugin_op::QEMU_PLUGIN_INLINE_ADD_U64,
            st.entry(SB_SINCE_SYNC),
            1,
        );
        // Publication every `sync_every` syscalls: a helper call only when the count is due.
        sys::qemu_plugin_register_vcpu_insn_exec_cond_cb(
            insn,
            Some(on_sync),
            QEMU_PLUGIN_CB_NO_REGS,
            qemu_plugin_cond::QEMU_PLUGIN_COND_GE,
            st.entry(SB_SINCE_SYNC),
            st.opts.sync_every,
            std::ptr::null_mut(),
        );
        if records {
            // The PC rides in the user-data pointer: no allocation, no RIP read.
            sys::qemu_plugin_register_vcpu_insn_exec_cb(
                insn,
                Some(on_syscall),
                QEMU_PLUGIN_CB_R_REGS,
                vaddr as usize as *mut c_void,
            );
        }
    }
}

extern "C" fn on_sync(vcpu: c_uint, _udata: *mut c_void) {
    guard(Some(vcpu), || {
        let Some(st) = STATE.get() else { return };
        if st.vcpu(vcpu).is_none() {
            st.count_bad_index();
            return;
        }
        st.publish(vcpu);
        // SAFETY: live scoreboard; `vcpu` has a VcpuState, so QEMU initialised it and its
        // scoreboard element exists (checked above: QEMU does not bounds-check the index).
        unsafe { sys::qemu_plugin_u64_set(st.entry(SB_SINCE_SYNC), vcpu, 0) };
    });
}

extern "C" fn on_syscall(vcpu: c_uint, udata: *mut c_void) {
    guard(Some(vcpu), || syscall_entry(vcpu, udata as usize as u64));
}

fn syscall_entry(vcpu: c_uint, pc: u64) {
    let Some(st) = STATE.get() else { return };
    let Some(v) = st.vcpu(vcpu) else {
        st.count_bad_index();
        return;
    };
    let Some(handles) = st.regs() else { return };
    // SAFETY: QEMU runs this vCPU's callbacks one at a time, and no other code touches `hot`
    // (see VcpuState), so this is the only reference.
    let hot = unsafe { &mut *v.hot.get() };
    v.sink.add_single_writer(Counter::Callbacks, 1);

    let mut r = [0u64; REG_NAMES.len()];
    let failed = hot.regbuf.read_registers(handles, &mut r);
    let mut args = [0u64; 6];
    args.copy_from_slice(&r[R_ARGS..R_ARGS + 6]);
    let mut rec = Record::syscall_entry(
        vcpu,
        monotonic_ns(),
        cr3_base(r[R_CR3]),
        pc,
        r[R_RAX],
        args,
        r[R_RSP],
    );
    if failed != 0 {
        rec.flags |= flags::REG_FAULT;
        v.sink.add_single_writer(Counter::RegReadErrors, 1);
    }
    // The kernel decodes the syscall number from EAX (it is an int).
    if st.opts.peek && failed == 0 && r[R_RAX] as u32 == SYS_WRITE {
        let want = r[R_RDX].min(syscall::DATA_BYTES as u64) as usize;
        if want > 0 {
            let mut buf = [0u8; syscall::DATA_BYTES];
            match hot.membuf.read_guest(r[R_RSI], &mut buf[..want]) {
                Ok(got) => {
                    rec.set_data(&buf[..got]);
                    if got < want {
                        rec.flags |= flags::DATA_FAULT;
                        v.sink.add_single_writer(Counter::MemReadErrors, 1);
                    }
                }
                Err(_) => {
                    rec.flags |= flags::DATA_FAULT;
                    v.sink.add_single_writer(Counter::MemReadErrors, 1);
                }
            }
        }
    }
    // A full ring drops and counts inside push; the guest never waits for vmsight.
    hot.producer.push(&rec);
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
                    "vmsight-plugin: vCPU {vcpu}: syscalls {} callbacks {} records {} dropped {} \
                     instrumented {} reg-errors {} mem-errors {} internal-errors {}",
                    g(Counter::Syscalls),
                    g(Counter::Callbacks),
                    g(Counter::RecordsWritten),
                    g(Counter::RecordsDropped),
                    g(Counter::Instrumented),
                    g(Counter::RegReadErrors),
                    g(Counter::MemReadErrors),
                    g(Counter::InternalErrors),
                );
            }
        }
    }
    st.channel.finish();
}
