//! The plugin's one interface to QEMU: API selection, the install entry point, callback
//! registration and safe handles over [`ffi`].
//!
//! One library serves QEMU 10.0 (plugin API v4) and QEMU 11.1 (API v7). QEMU reads the
//! exported `qemu_plugin_version` right after loading the library, before any plugin code
//! runs, so the version is chosen by a library constructor ([`select_api`]):
//! `VMSIGHT_PLUGIN_API=4|7` if set, otherwise v7 when the loading QEMU exports
//! `qemu_plugin_set_pc` (API v7 only) and v4 otherwise. QEMU itself then refuses the library
//! cleanly if the choice is outside the range it supports. Everything above this module is
//! version-free: callbacks are registered as plain Rust functions, and the version-specific
//! trampolines live here.

pub mod ffi;

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

pub use ffi::PluginId;

/// The plugin API this library declared to QEMU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// QEMU 9.2-10.0.
    V4,
    /// QEMU 11.1.
    V7,
}

impl Api {
    /// The API number QEMU sees.
    pub fn number(self) -> u32 {
        match self {
            Api::V4 => 4,
            Api::V7 => 7,
        }
    }

    fn from_number(n: i32) -> Option<Api> {
        match n {
            4 => Some(Api::V4),
            7 => Some(Api::V7),
            _ => None,
        }
    }
}

/// `int qemu_plugin_version`: the API version QEMU checks before installing the plugin. An
/// atomic has the layout of an `int`; the constructor stores the chosen version before QEMU
/// reads it.
#[export_name = "qemu_plugin_version"]
pub static QEMU_PLUGIN_VERSION: AtomicI32 = AtomicI32::new(4);

/// Environment variable that forces the declared API (`4` or `7`).
pub const API_ENV: &str = "VMSIGHT_PLUGIN_API";

#[used]
#[link_section = ".init_array"]
static SELECT_API_AT_LOAD: extern "C" fn() = select_api;

/// Library constructor: chooses the API version (see the module documentation).
extern "C" fn select_api() {
    let forced = std::env::var(API_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .and_then(Api::from_number);
    let api = forced.unwrap_or_else(|| {
        if symbol("qemu_plugin_set_pc").is_some() {
            Api::V7
        } else {
            Api::V4
        }
    });
    QEMU_PLUGIN_VERSION.store(api.number() as i32, Ordering::SeqCst);
}

/// The API in use.
pub fn api() -> Api {
    Api::from_number(QEMU_PLUGIN_VERSION.load(Ordering::Relaxed)).unwrap_or(Api::V4)
}

/// Looks a symbol up in the global scope (QEMU's executable exports the plugin API).
fn symbol(name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name; the result is only compared
    // with NULL or transmuted to the documented signature by the caller.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

static V7: OnceLock<Option<ffi::V7Fns>> = OnceLock::new();

/// The v7-only functions, when QEMU offers them all (resolved once).
pub fn v7() -> Option<&'static ffi::V7Fns> {
    V7.get_or_init(|| {
        if api() != Api::V7 {
            return None;
        }
        let p: Vec<*mut c_void> = ffi::V7_SYMBOLS
            .iter()
            .map(|s| symbol(s))
            .collect::<Option<_>>()?;
        // SAFETY: each pointer is QEMU's exported function of that name, whose C signature
        // in API v7 is the field's type (see ffi's table, checked against QEMU 11.1.3).
        unsafe {
            Some(ffi::V7Fns {
                write_register: fn_ptr(p[0]),
                write_memory_vaddr: fn_ptr(p[1]),
                read_memory_hwaddr: fn_ptr(p[2]),
                translate_vaddr: fn_ptr(p[3]),
                set_pc: fn_ptr(p[4]),
                register_vcpu_discon_cb: fn_ptr(p[5]),
            })
        }
    })
    .as_ref()
}

/// Reinterprets a symbol address as a function pointer type.
///
/// # Safety
/// `p` must be the address of a function whose C signature is `F`.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

// ---------------------------------------------------------------------------------------------
// Installation

/// What QEMU told the plugin at install.
#[derive(Debug, Clone)]
pub struct InstallInfo {
    pub target_name: String,
    /// QEMU's supported API range.
    pub api_min: i32,
    pub api_cur: i32,
    /// `(initial vCPUs, maximum vCPUs)` in full-system emulation, `None` in user mode.
    pub system: Option<(i32, i32)>,
}

/// `int qemu_plugin_install(qemu_plugin_id_t, const qemu_info_t *, int argc, char **argv)`.
///
/// # Safety
/// Called by QEMU once with a valid `info` and `argc` valid C strings in `argv`.
#[no_mangle]
pub unsafe extern "C" fn qemu_plugin_install(
    id: PluginId,
    info: *const ffi::qemu_info_t,
    argc: c_int,
    argv: *const *const c_char,
) -> c_int {
    // SAFETY: QEMU passes a valid info block and argument vector (caller contract).
    let (info, args) = unsafe { install_args(info, argc, argv) };
    let result = std::panic::catch_unwind(|| crate::install(id, &args, &info));
    match result {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("vmsight-plugin: {e}");
            eprintln!("vmsight-plugin: {}", crate::USAGE);
            1
        }
        Err(_) => {
            eprintln!("vmsight-plugin: internal error while installing");
            1
        }
    }
}

/// Copies QEMU's install arguments into owned values.
///
/// # Safety
/// As [`qemu_plugin_install`].
unsafe fn install_args(
    info: *const ffi::qemu_info_t,
    argc: c_int,
    argv: *const *const c_char,
) -> (InstallInfo, Vec<String>) {
    let owned = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: QEMU's strings are NUL-terminated and live during install.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    // SAFETY: `info` is valid during install (caller).
    let i = unsafe { &*info };
    let info = InstallInfo {
        target_name: owned(i.target_name),
        api_min: i.version.min,
        api_cur: i.version.cur,
        system: i
            .system_emulation
            .then_some((i.system.smp_vcpus, i.system.max_vcpus)),
    };
    let args = (0..usize::try_from(argc).unwrap_or(0))
        // SAFETY: `argv` has `argc` entries (caller).
        .map(|k| owned(unsafe { *argv.add(k) }))
        .collect();
    (info, args)
}

// ---------------------------------------------------------------------------------------------
// Lifecycle callbacks

/// The plugin's lifecycle callbacks, as plain functions.
pub struct Hooks {
    pub vcpu_init: fn(c_uint),
    pub vcpu_exit: fn(c_uint),
    pub vcpu_idle: fn(c_uint),
    /// `None`: no resume callback (only the synchronous transport needs to know when a
    /// halted vCPU runs again).
    pub vcpu_resume: Option<fn(c_uint)>,
    /// `None`: no translation callback at all (a dormant plugin; see `Options::translates`).
    pub tb_trans: Option<fn(Tb<'_>)>,
    pub atexit: fn(),
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

fn hooks() -> Option<&'static Hooks> {
    HOOKS.get()
}

extern "C" fn init_v4(_id: PluginId, vcpu: c_uint) {
    if let Some(h) = hooks() {
        (h.vcpu_init)(vcpu);
    }
}
extern "C" fn exit_v4(_id: PluginId, vcpu: c_uint) {
    if let Some(h) = hooks() {
        (h.vcpu_exit)(vcpu);
    }
}
extern "C" fn idle_v4(_id: PluginId, vcpu: c_uint) {
    if let Some(h) = hooks() {
        (h.vcpu_idle)(vcpu);
    }
}
extern "C" fn resume_v4(_id: PluginId, vcpu: c_uint) {
    if let Some(f) = hooks().and_then(|h| h.vcpu_resume) {
        f(vcpu);
    }
}
extern "C" fn tb_v4(_id: PluginId, tb: *mut ffi::qemu_plugin_tb) {
    if let Some(f) = hooks().and_then(|h| h.tb_trans) {
        f(Tb::new(tb));
    }
}
extern "C" fn atexit_v4(_id: PluginId, _udata: *mut c_void) {
    if let Some(h) = hooks() {
        (h.atexit)();
    }
}
extern "C" fn init_v7(vcpu: c_uint, _udata: *mut c_void) {
    if let Some(h) = hooks() {
        (h.vcpu_init)(vcpu);
    }
}
extern "C" fn exit_v7(vcpu: c_uint, _udata: *mut c_void) {
    if let Some(h) = hooks() {
        (h.vcpu_exit)(vcpu);
    }
}
extern "C" fn idle_v7(vcpu: c_uint, _udata: *mut c_void) {
    if let Some(h) = hooks() {
        (h.vcpu_idle)(vcpu);
    }
}
extern "C" fn resume_v7(vcpu: c_uint, _udata: *mut c_void) {
    if let Some(f) = hooks().and_then(|h| h.vcpu_resume) {
        f(vcpu);
    }
}
extern "C" fn tb_v7(tb: *mut ffi::qemu_plugin_tb, _udata: *mut c_void) {
    if let Some(f) = hooks().and_then(|h| h.tb_trans) {
        f(Tb::new(tb));
    }
}
extern "C" fn atexit_v7(_udata: *mut c_void) {
    if let Some(h) = hooks() {
        (h.atexit)();
    }
}

/// Registers the lifecycle callbacks (once; later calls are ignored). Call during install.
pub fn register_hooks(id: PluginId, h: Hooks) {
    let translates = h.tb_trans.is_some();
    let resumes = h.vcpu_resume.is_some();
    if HOOKS.set(h).is_err() {
        return;
    }
    let null = std::ptr::null_mut();
    // SAFETY: registration during install with callbacks of the signature the declared API
    // passes (ffi's table); the v7 calls use the v7 forms of the same exported functions.
    unsafe {
        match api() {
            Api::V4 => {
                ffi::qemu_plugin_register_vcpu_init_cb(id, init_v4);
                ffi::qemu_plugin_register_vcpu_exit_cb(id, exit_v4);
                ffi::qemu_plugin_register_vcpu_idle_cb(id, idle_v4);
                if resumes {
                    ffi::qemu_plugin_register_vcpu_resume_cb(id, resume_v4);
                }
                if translates {
                    ffi::qemu_plugin_register_vcpu_tb_trans_cb(id, tb_v4);
                }
                ffi::qemu_plugin_register_atexit_cb(id, atexit_v4, null);
            }
            Api::V7 => {
                let vcpu = |f: unsafe extern "C" fn(PluginId, ffi::VcpuSimpleCbV4)| {
                    std::mem::transmute::<_, ffi::RegisterVcpuCbV7>(f)
                };
                vcpu(ffi::qemu_plugin_register_vcpu_init_cb)(id, init_v7, null);
                vcpu(ffi::qemu_plugin_register_vcpu_exit_cb)(id, exit_v7, null);
                vcpu(ffi::qemu_plugin_register_vcpu_idle_cb)(id, idle_v7, null);
                if resumes {
                    vcpu(ffi::qemu_plugin_register_vcpu_resume_cb)(id, resume_v7, null);
                }
                let tb = std::mem::transmute::<
                    unsafe extern "C" fn(PluginId, ffi::TbTransCbV4),
                    ffi::RegisterTbTransCbV7,
                >(ffi::qemu_plugin_register_vcpu_tb_trans_cb);
                if translates {
                    tb(id, tb_v7, null);
                }
                let at = std::mem::transmute::<
                    unsafe extern "C" fn(PluginId, ffi::UdataCbV4, *mut c_void),
                    ffi::RegisterAtexitCbV7,
                >(ffi::qemu_plugin_register_atexit_cb);
                at(id, atexit_v7, null);
            }
        }
    }
}

/// Registers `cb` for interrupts, exceptions and host calls (the `DISCON_*` bits of `kinds`);
/// returns false on API v4, which has no such callbacks.
pub fn register_discon(id: PluginId, kinds: c_uint, cb: ffi::DisconCbV7) -> bool {
    let Some(f) = v7() else { return false };
    // SAFETY: v7 registration with a callback of the v7 discontinuity signature.
    unsafe { (f.register_vcpu_discon_cb)(id, kinds, cb, std::ptr::null_mut()) };
    true
}

/// Moves the current vCPU's PC to `pc` and leaves the callback (QEMU long-jumps back into its
/// execution loop; this never returns).
///
/// # Safety
/// Only in a callback registered with [`RegAccess::ReadWritePc`] on API v7, and only as the
/// last thing the callback does: the frames it unwinds past must hold nothing to drop
/// (a long jump runs no destructors).
pub unsafe fn set_pc(f: &ffi::V7Fns, pc: u64) -> ! {
    // SAFETY: the caller's contract above.
    unsafe { (f.set_pc)(pc) }
}

/// Writes a line to QEMU's plugin log (shown with `-d plugin`).
pub fn outs(msg: &str) {
    if let Ok(c) = CString::new(msg) {
        // SAFETY: NUL-terminated string, copied by QEMU.
        unsafe { ffi::qemu_plugin_outs(c.as_ptr()) };
    }
}

// ---------------------------------------------------------------------------------------------
// Translation-time handles

/// A translation block, valid only inside the translation callback that received it.
#[derive(Clone, Copy)]
pub struct Tb<'a> {
    raw: *mut ffi::qemu_plugin_tb,
    _cb: PhantomData<&'a ()>,
}

impl Tb<'_> {
    fn new(raw: *mut ffi::qemu_plugin_tb) -> Self {
        Tb {
            raw,
            _cb: PhantomData,
        }
    }

    /// The guest virtual address of the first instruction.
    pub fn vaddr(&self) -> u64 {
        // SAFETY: the handle is live for the callback's duration ('a).
        unsafe { ffi::qemu_plugin_tb_vaddr(self.raw) }
    }

    pub fn n_insns(&self) -> usize {
        // SAFETY: as above.
        unsafe { ffi::qemu_plugin_tb_n_insns(self.raw) }
    }

    pub fn insn(&self, idx: usize) -> Option<Insn<'_>> {
        if idx >= self.n_insns() {
            return None;
        }
        // SAFETY: live handle, index in range.
        let raw = unsafe { ffi::qemu_plugin_tb_get_insn(self.raw, idx) };
        (!raw.is_null()).then_some(Insn {
            raw,
            _cb: PhantomData,
        })
    }
}

/// One instruction of a [`Tb`] being translated.
#[derive(Clone, Copy)]
pub struct Insn<'a> {
    raw: *mut ffi::qemu_plugin_insn,
    _cb: PhantomData<&'a ()>,
}

/// A scoreboard word: `offset` in every vCPU's element.
#[derive(Clone, Copy, Debug)]
pub struct Word(pub ffi::qemu_plugin_u64);

/// How a callback uses the vCPU's registers (`enum qemu_plugin_cb_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegAccess {
    None,
    Read,
    /// Read and write registers, and (v7) redirect the vCPU with `set_pc`.
    ReadWritePc,
}

impl RegAccess {
    fn flags(self) -> c_uint {
        match self {
            RegAccess::None => ffi::CB_NO_REGS,
            RegAccess::Read => ffi::CB_R_REGS,
            // v4 has no PC flag; RW_REGS is its strongest (and unused: writes do not exist).
            RegAccess::ReadWritePc if api() == Api::V4 => ffi::CB_RW_REGS,
            RegAccess::ReadWritePc => ffi::CB_RW_REGS_PC,
        }
    }
}

/// Conditions of conditional callbacks.
#[derive(Clone, Copy, Debug)]
pub enum Cond {
    Ne,
    Ge,
}

impl Insn<'_> {
    pub fn vaddr(&self) -> u64 {
        // SAFETY: live instruction handle of the current translation ('a).
        unsafe { ffi::qemu_plugin_insn_vaddr(self.raw) }
    }

    pub fn size(&self) -> usize {
        // SAFETY: as above.
        unsafe { ffi::qemu_plugin_insn_size(self.raw) }
    }

    /// Copies the instruction's bytes into `out`; returns how many.
    pub fn data(&self, out: &mut [u8]) -> usize {
        // SAFETY: QEMU copies at most `out.len()` bytes into `out`.
        let n = unsafe { ffi::qemu_plugin_insn_data(self.raw, out.as_mut_ptr().cast(), out.len()) };
        n.min(out.len())
    }

    /// Calls `cb(vcpu, udata)` every time the instruction is about to execute.
    pub fn on_exec(&self, cb: ffi::VcpuUdataCb, access: RegAccess, udata: usize) {
        // SAFETY: live handle; `cb` has the instruction-callback signature (same in v4/v7).
        unsafe {
            ffi::qemu_plugin_register_vcpu_insn_exec_cb(
                self.raw,
                cb,
                access.flags(),
                udata as *mut c_void,
            );
        }
    }

    /// Calls `cb(vcpu, udata)` when the instruction is about to execute and the vCPU's `word`
    /// compares with `imm` as `cond` says (evaluated inline, no call otherwise).
    pub fn on_exec_if(
        &self,
        cb: ffi::VcpuUdataCb,
        access: RegAccess,
        word: Word,
        cond: Cond,
        imm: u64,
        udata: usize,
    ) {
        let cond = match cond {
            Cond::Ne => ffi::COND_NE,
            Cond::Ge => ffi::COND_GE,
        };
        // SAFETY: live handle; the scoreboard behind `word` lives until QEMU exits.
        unsafe {
            ffi::qemu_plugin_register_vcpu_insn_exec_cond_cb(
                self.raw,
                cb,
                access.flags(),
                cond,
                word.0,
                imm,
                udata as *mut c_void,
            );
        }
    }

    /// Stores `imm` into the vCPU's `word` inline every time the instruction executes.
    pub fn store_inline(&self, word: Word, imm: u64) {
        // SAFETY: live handle; the scoreboard lives until QEMU exits.
        unsafe {
            ffi::qemu_plugin_register_vcpu_insn_exec_inline_per_vcpu(
                self.raw,
                ffi::INLINE_STORE_U64,
                word.0,
                imm,
            );
        }
    }

    /// Adds `imm` to the vCPU's `word` inline every time the instruction executes.
    pub fn add_inline(&self, word: Word, imm: u64) {
        // SAFETY: live handle; the scoreboard lives until QEMU exits.
        unsafe {
            ffi::qemu_plugin_register_vcpu_insn_exec_inline_per_vcpu(
                self.raw,
                ffi::INLINE_ADD_U64,
                word.0,
                imm,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scoreboard

/// A QEMU scoreboard (one element per vCPU, grown by QEMU), never freed.
#[derive(Clone, Copy, Debug)]
pub struct Scoreboard(usize);

impl Scoreboard {
    /// Allocates a scoreboard of `element` bytes per vCPU.
    pub fn new(element: usize) -> Scoreboard {
        // SAFETY: plain QEMU allocation; lives until QEMU exits.
        Scoreboard(unsafe { ffi::qemu_plugin_scoreboard_new(element) } as usize)
    }

    pub fn word(&self, offset: usize) -> Word {
        Word(ffi::qemu_plugin_u64 {
            score: self.0 as *mut ffi::qemu_plugin_scoreboard,
            offset,
        })
    }
}

impl Word {
    /// The word's address in QEMU's memory for `vcpu` (valid until QEMU grows the scoreboard,
    /// which it does only when a vCPU is added).
    ///
    /// # Safety
    /// `vcpu` must be a vCPU QEMU has initialised (QEMU does not bounds-check).
    pub unsafe fn address(&self, vcpu: c_uint) -> u64 {
        // SAFETY: caller guarantees the element exists; QEMU returns a pointer into the
        // scoreboard's array, which we only turn into a number.
        let element = unsafe { ffi::qemu_plugin_scoreboard_find(self.0.score, vcpu) };
        element as u64 + self.0.offset as u64
    }

    /// # Safety
    /// `vcpu` must be a vCPU QEMU has initialised (QEMU does not bounds-check).
    pub unsafe fn get(&self, vcpu: c_uint) -> u64 {
        // SAFETY: caller guarantees the element exists.
        unsafe { ffi::qemu_plugin_u64_get(self.0, vcpu) }
    }

    /// # Safety
    /// As [`Word::get`].
    pub unsafe fn set(&self, vcpu: c_uint, v: u64) {
        // SAFETY: caller guarantees the element exists.
        unsafe { ffi::qemu_plugin_u64_set(self.0, vcpu, v) }
    }
}

// SAFETY: a scoreboard handle is an address QEMU keeps valid until exit; QEMU synchronises
// element growth with vCPU execution.
unsafe impl Send for Word {}
// SAFETY: as above.
unsafe impl Sync for Word {}
