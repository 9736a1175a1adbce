//! Raw declarations of the parts of QEMU's TCG plugin API (`qemu-plugin.h`) the plugin uses,
//! for API v4 (QEMU 9.2-10.0) and API v7 (QEMU 11.1).
//!
//! Written by hand from QEMU's documented API rather than taken from a crate: the
//! `qemu-plugin`/`qemu-plugin-sys` crates stop at API v5, hard-code the version in a read-only
//! static (so one library cannot declare v4 to QEMU 10 and v7 to QEMU 11), and no Debian
//! package ships `qemu-plugin.h` for QEMU 11.1. The v7 differences below were checked against
//! QEMU 11.1.3 itself (Debian 1:11.1.3+ds-1~bpo13+1) with probe plugins that print the
//! registers every callback receives, and by disassembling the exported functions:
//!
//! | what | v4 | v7 |
//! |---|---|---|
//! | vCPU init/exit/idle/resume callback | `(id, vcpu_index)` | `(vcpu_index, userdata)` |
//! | translation callback | `(id, tb)` | `(tb, userdata)` |
//! | at-exit callback | `(id, userdata)` | `(userdata)` |
//! | `register_vcpu_{init,exit,idle,resume,tb_trans}_cb` | `(id, cb)` | `(id, cb, userdata)` |
//! | `qemu_plugin_read_register` | `int` bytes read, -1 on error | `bool` |
//! | `qemu_plugin_reg_descriptor` | 24 bytes | 32 bytes (`+ bool is_readonly`) |
//! | register handles | index + 1 | `(index + 1) << 1 \| is_readonly` (opaque either way) |
//! | new | | `write_register`, `write_memory_vaddr`, `read/write_memory_hwaddr`, `translate_vaddr`, `set_pc`, `register_vcpu_discon_cb` |
//!
//! Instruction callbacks (`(vcpu_index, userdata)`), conditional callbacks, inline
//! operations, scoreboards, translation-block and instruction queries, `get_registers` and
//! `read_memory_vaddr` are the same in both.
//!
//! Only functions every supported QEMU exports are linked directly: QEMU opens plugins with
//! immediate binding, so an undefined v7-only symbol would make QEMU 10 refuse the library.
//! The v7-only functions are looked up with `dlsym` at install ([`V7Fns`]).

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `qemu_plugin_id_t`.
pub type PluginId = u64;

/// Opaque `struct qemu_plugin_tb`.
#[repr(C)]
pub struct qemu_plugin_tb {
    _private: [u8; 0],
}

/// Opaque `struct qemu_plugin_insn`.
#[repr(C)]
pub struct qemu_plugin_insn {
    _private: [u8; 0],
}

/// Opaque `struct qemu_plugin_register` (the handle type of register reads and writes).
#[repr(C)]
pub struct qemu_plugin_register {
    _private: [u8; 0],
}

/// Opaque `struct qemu_plugin_scoreboard`.
#[repr(C)]
pub struct qemu_plugin_scoreboard {
    _private: [u8; 0],
}

/// `qemu_plugin_u64`: one u64 at `offset` in every vCPU's scoreboard element.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct qemu_plugin_u64 {
    pub score: *mut qemu_plugin_scoreboard,
    pub offset: usize,
}

/// GLib's public `GArray` header.
#[repr(C)]
pub struct GArray {
    pub data: *mut c_char,
    pub len: c_uint,
}

/// GLib's public `GByteArray` header.
#[repr(C)]
pub struct GByteArray {
    pub data: *mut u8,
    pub len: c_uint,
}

/// `qemu_info_t.version`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct qemu_info_version {
    pub min: c_int,
    pub cur: c_int,
}

/// `qemu_info_t.system` (the only member of its union).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct qemu_info_system {
    pub smp_vcpus: c_int,
    pub max_vcpus: c_int,
}

/// `qemu_info_t`, passed to `qemu_plugin_install` (same layout in v4 and v7).
#[repr(C)]
pub struct qemu_info_t {
    pub target_name: *const c_char,
    pub version: qemu_info_version,
    pub system_emulation: bool,
    /// Valid only when `system_emulation` is true.
    pub system: qemu_info_system,
}

/// `qemu_plugin_reg_descriptor` in API v4.
#[repr(C)]
pub struct RegDescV4 {
    pub handle: *mut qemu_plugin_register,
    pub name: *const c_char,
    pub feature: *const c_char,
}

/// `qemu_plugin_reg_descriptor` in API v7.
#[repr(C)]
pub struct RegDescV7 {
    pub handle: *mut qemu_plugin_register,
    pub name: *const c_char,
    pub feature: *const c_char,
    pub is_readonly: bool,
}

/// `enum qemu_plugin_cb_flags`.
pub const CB_NO_REGS: c_uint = 0;
pub const CB_R_REGS: c_uint = 1;
pub const CB_RW_REGS: c_uint = 2;
/// v7: the callback may also call `qemu_plugin_set_pc`.
pub const CB_RW_REGS_PC: c_uint = 3;

/// `enum qemu_plugin_cond`.
pub const COND_NE: c_uint = 3;
pub const COND_GE: c_uint = 7;

/// `enum qemu_plugin_op`.
pub const INLINE_ADD_U64: c_uint = 0;
pub const INLINE_STORE_U64: c_uint = 1;

/// `enum qemu_plugin_discon_type` (v7), a bit mask.
pub const DISCON_INTERRUPT: c_uint = 1;
pub const DISCON_EXCEPTION: c_uint = 2;
pub const DISCON_HOSTCALL: c_uint = 4;

/// `enum qemu_plugin_hwaddr_operation_result` (v7): success.
pub const HWADDR_OK: c_uint = 0;

/// `qemu_plugin_vcpu_udata_cb_t`: instruction and translation-block execution callbacks.
pub type VcpuUdataCb = extern "C" fn(vcpu_index: c_uint, userdata: *mut c_void);

/// v4 `qemu_plugin_vcpu_simple_cb_t`.
pub type VcpuSimpleCbV4 = extern "C" fn(id: PluginId, vcpu_index: c_uint);
/// v4 `qemu_plugin_vcpu_tb_trans_cb_t`.
pub type TbTransCbV4 = extern "C" fn(id: PluginId, tb: *mut qemu_plugin_tb);
/// v4 `qemu_plugin_udata_cb_t`.
pub type UdataCbV4 = extern "C" fn(id: PluginId, userdata: *mut c_void);

/// v7 `qemu_plugin_vcpu_udata_cb_t` as init/exit/idle callbacks receive it.
pub type VcpuCbV7 = extern "C" fn(vcpu_index: c_uint, userdata: *mut c_void);
/// v7 `qemu_plugin_vcpu_tb_trans_cb_t`.
pub type TbTransCbV7 = extern "C" fn(tb: *mut qemu_plugin_tb, userdata: *mut c_void);
/// v7 `qemu_plugin_udata_cb_t`.
pub type UdataCbV7 = extern "C" fn(userdata: *mut c_void);
/// v7 `qemu_plugin_vcpu_discon_cb_t`: an interrupt, exception or host call moved the vCPU
/// from `from_pc` to `to_pc` (the handler's first instruction).
pub type DisconCbV7 = extern "C" fn(
    vcpu_index: c_uint,
    kind: c_uint,
    from_pc: u64,
    to_pc: u64,
    userdata: *mut c_void,
);

// Exported by every QEMU the plugin supports, with the same C signature in v4 and v7 except
// where noted (the v4 form is declared; `super` calls the v7 form through a cast).
extern "C" {
    /// v4 form; v7 adds a trailing `void *userdata`.
    pub fn qemu_plugin_register_vcpu_init_cb(id: PluginId, cb: VcpuSimpleCbV4);
    /// v4 form; v7 adds a trailing `void *userdata`.
    pub fn qemu_plugin_register_vcpu_exit_cb(id: PluginId, cb: VcpuSimpleCbV4);
    /// v4 form; v7 adds a trailing `void *userdata`.
    pub fn qemu_plugin_register_vcpu_idle_cb(id: PluginId, cb: VcpuSimpleCbV4);
    /// v4 form; v7 adds a trailing `void *userdata` (the same type as the idle callback's).
    pub fn qemu_plugin_register_vcpu_resume_cb(id: PluginId, cb: VcpuSimpleCbV4);
    /// v4 form; v7 adds a trailing `void *userdata`.
    pub fn qemu_plugin_register_vcpu_tb_trans_cb(id: PluginId, cb: TbTransCbV4);
    /// v4 form; v7's callback takes only the user data.
    pub fn qemu_plugin_register_atexit_cb(id: PluginId, cb: UdataCbV4, userdata: *mut c_void);

    pub fn qemu_plugin_tb_n_insns(tb: *const qemu_plugin_tb) -> usize;
    pub fn qemu_plugin_tb_vaddr(tb: *const qemu_plugin_tb) -> u64;
    pub fn qemu_plugin_tb_get_insn(tb: *const qemu_plugin_tb, idx: usize) -> *mut qemu_plugin_insn;
    pub fn qemu_plugin_insn_data(
        insn: *const qemu_plugin_insn,
        dest: *mut c_void,
        len: usize,
    ) -> usize;
    pub fn qemu_plugin_insn_size(insn: *const qemu_plugin_insn) -> usize;
    pub fn qemu_plugin_insn_vaddr(insn: *const qemu_plugin_insn) -> u64;

    pub fn qemu_plugin_register_vcpu_insn_exec_cb(
        insn: *mut qemu_plugin_insn,
        cb: VcpuUdataCb,
        flags: c_uint,
        userdata: *mut c_void,
    );
    pub fn qemu_plugin_register_vcpu_insn_exec_cond_cb(
        insn: *mut qemu_plugin_insn,
        cb: VcpuUdataCb,
        flags: c_uint,
        cond: c_uint,
        entry: qemu_plugin_u64,
        imm: u64,
        userdata: *mut c_void,
    );
    pub fn qemu_plugin_register_vcpu_insn_exec_inline_per_vcpu(
        insn: *mut qemu_plugin_insn,
        op: c_uint,
        entry: qemu_plugin_u64,
        imm: u64,
    );

    pub fn qemu_plugin_scoreboard_new(element_size: usize) -> *mut qemu_plugin_scoreboard;
    pub fn qemu_plugin_scoreboard_find(
        score: *mut qemu_plugin_scoreboard,
        vcpu_index: c_uint,
    ) -> *mut c_void;
    pub fn qemu_plugin_u64_get(entry: qemu_plugin_u64, vcpu_index: c_uint) -> u64;
    pub fn qemu_plugin_u64_set(entry: qemu_plugin_u64, vcpu_index: c_uint, value: u64);

    pub fn qemu_plugin_outs(string: *const c_char);

    /// Elements are [`RegDescV4`] or [`RegDescV7`]; the caller frees the array.
    pub fn qemu_plugin_get_registers() -> *mut GArray;
    /// v4 form (returns the bytes appended, -1 on error); v7 returns `bool`.
    pub fn qemu_plugin_read_register(
        handle: *mut qemu_plugin_register,
        buf: *mut GByteArray,
    ) -> c_int;
    pub fn qemu_plugin_read_memory_vaddr(addr: u64, data: *mut GByteArray, len: usize) -> bool;
}

// GLib is linked into QEMU, which exports it to plugins.
extern "C" {
    pub fn g_byte_array_sized_new(reserved_size: c_uint) -> *mut GByteArray;
    pub fn g_byte_array_set_size(array: *mut GByteArray, length: c_uint) -> *mut GByteArray;
    pub fn g_byte_array_append(
        array: *mut GByteArray,
        data: *const u8,
        len: c_uint,
    ) -> *mut GByteArray;
    pub fn g_array_free(array: *mut GArray, free_segment: c_int) -> *mut c_char;
}

/// The v7 forms of the functions whose signature changed.
pub type RegisterVcpuCbV7 = unsafe extern "C" fn(PluginId, VcpuCbV7, *mut c_void);
pub type RegisterTbTransCbV7 = unsafe extern "C" fn(PluginId, TbTransCbV7, *mut c_void);
pub type RegisterAtexitCbV7 = unsafe extern "C" fn(PluginId, UdataCbV7, *mut c_void);
pub type ReadRegisterV7 = unsafe extern "C" fn(*mut qemu_plugin_register, *mut GByteArray) -> bool;

/// Functions only API v7 offers, resolved at install.
#[derive(Clone, Copy)]
pub struct V7Fns {
    /// `bool qemu_plugin_write_register(handle, GByteArray *buf)`: needs a callback
    /// registered with `CB_RW_REGS` or `CB_RW_REGS_PC`; RIP is read-only (use `set_pc`).
    pub write_register: unsafe extern "C" fn(*mut qemu_plugin_register, *mut GByteArray) -> bool,
    /// `bool qemu_plugin_write_memory_vaddr(uint64_t addr, GByteArray *data)`.
    pub write_memory_vaddr: unsafe extern "C" fn(u64, *mut GByteArray) -> bool,
    /// `enum qemu_plugin_hwaddr_operation_result qemu_plugin_read_memory_hwaddr(uint64_t
    /// addr, GByteArray *data, size_t len)`.
    pub read_memory_hwaddr: unsafe extern "C" fn(u64, *mut GByteArray, usize) -> c_uint,
    /// `bool qemu_plugin_translate_vaddr(uint64_t vaddr, uint64_t *hwaddr)`.
    pub translate_vaddr: unsafe extern "C" fn(u64, *mut u64) -> bool,
    /// `void qemu_plugin_set_pc(uint64_t vaddr)`: only in a `CB_RW_REGS_PC` callback (or a
    /// discontinuity callback); never returns (QEMU leaves the callback with a long jump).
    pub set_pc: unsafe extern "C" fn(u64) -> !,
    /// `void qemu_plugin_register_vcpu_discon_cb(id, enum qemu_plugin_discon_type, cb,
    /// void *userdata)`.
    pub register_vcpu_discon_cb: unsafe extern "C" fn(PluginId, c_uint, DisconCbV7, *mut c_void),
}

/// Names of [`V7Fns`]' symbols, in field order.
pub const V7_SYMBOLS: [&str; 6] = [
    "qemu_plugin_write_register",
    "qemu_plugin_write_memory_vaddr",
    "qemu_plugin_read_memory_hwaddr",
    "qemu_plugin_translate_vaddr",
    "qemu_plugin_set_pc",
    "qemu_plugin_register_vcpu_discon_cb",
];
