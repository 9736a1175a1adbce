//! The symbiotic interface (SymSpy and SymCall): the layout of the memory region vmsight shares
//! with the guest module `vmsight_sym`, the call numbers, and the fw_cfg announcement.
//!
//! The region is the shared memory of an `ivshmem-doorbell` PCI device (BAR2) whose memory
//! vmsight owns (docs/symbiotic.md). It holds three pages:
//!
//! | offset | page | written by |
//! |---|---|---|
//! | `0x0000` | [`VMM`]: vmsight's version, features, the handshake state, per-device hints | vmsight |
//! | `0x1000` | [`GUEST`] (SymSpy): kernel, supported symcalls, per-CPU current task, memory and swap counters, swap devices | the guest module |
//! | `0x3000` | [`CALL`]: one symcall's number, arguments and results (symcalls never nest) | both, by turns |
//!
//! Every page is described once, as a table of fields ([`Page`]); the Rust side reads and
//! writes through the table's offsets and the module's C header (`guest/sym/vmsight_sym_abi.h`)
//! is generated from the same tables ([`c_header`]; a unit test fails when the committed
//! header is stale). Everything the guest writes is hostile input: readers bound every count,
//! every string and every offset by the table.

/// Interface version. A module speaking another version is refused by both sides.
/// Version 2: the synchronous entry's first argument carries the call's sequence
/// ([`sync_word`]).
pub const ABI_VERSION: u32 = 2;
/// Size of the shared region (a power of two: it is a PCI BAR).
pub const REGION_SIZE: usize = 64 * 1024;
/// fw_cfg item announcing the interface (`abi=2 features=0x7 size=65536 vectors=2`).
pub const FW_CFG_NAME: &str = "opt/vmsight/sym";
/// Interrupt vectors of the device, on each side.
pub const VECTORS: u32 = 2;
/// Vector 0: a call was posted (to the guest) / a call is done (to vmsight).
pub const VEC_CALL: u32 = 0;
/// Vector 1: wake up / the handshake state changed.
pub const VEC_STATE: u32 = 1;

/// `VMM.magic`: "VMSYMVMM".
pub const VMM_MAGIC: u64 = u64::from_le_bytes(*b"VMSYMVMM");
/// `GUEST.magic`: "VMSYMGST".
pub const GUEST_MAGIC: u64 = u64::from_le_bytes(*b"VMSYMGST");

/// Feature bits (`VMM.features`, announced in fw_cfg).
pub mod feature {
    /// vmsight reads the SymSpy page.
    pub const SPY: u32 = 1;
    /// Symcalls over the doorbell transport.
    pub const DOORBELL: u32 = 2;
    /// Symcalls over the synchronous transport (vCPU redirection, QEMU 11).
    pub const SYNC: u32 = 4;
    /// SwapBypass: a swap region (second ivshmem device, [`super::swapr`]) is attached.
    pub const SWAP: u32 = 8;
}

/// `VMM.state`: vmsight's answer to the module's hello.
pub mod vmm_state {
    /// Waiting for a module.
    pub const WAITING: u32 = 0;
    /// The module's version and page were accepted: the interface is on.
    pub const ACCEPTED: u32 = 1;
    /// The module was refused (`VMM.refuse_reason`): the interface is off.
    pub const REFUSED: u32 = 2;
    /// vmsight is shutting down: answer nothing more.
    pub const GONE: u32 = 3;
}

/// `VMM.refuse_reason`.
pub mod refuse {
    pub const NONE: u32 = 0;
    /// The module speaks another interface version.
    pub const VERSION: u32 = 1;
    /// The module's page is malformed (bad magic).
    pub const MALFORMED: u32 = 2;
}

/// `GUEST.state`.
pub mod guest_state {
    /// No module has written the page.
    pub const NONE: u32 = 0;
    /// The module wrote its version and waits for vmsight's answer.
    pub const HELLO: u32 = 1;
    /// The interface is on: the page is refreshed and symcalls are served.
    pub const ACTIVE: u32 = 2;
    /// The module refused the VMM's version (it says so here, then unloads).
    pub const REFUSED: u32 = 3;
    /// The module was unloaded.
    pub const GONE: u32 = 4;
}

/// `CALL.state`.
pub mod call_state {
    pub const IDLE: u32 = 0;
    /// vmsight posted a call (`CALL.seq` is its id).
    pub const POSTED: u32 = 1;
    /// The guest took the call.
    pub const RUNNING: u32 = 2;
    /// The guest answered (`CALL.done_seq` = the id it answered).
    pub const DONE: u32 = 3;
}

/// `CALL.transport`.
pub mod transport {
    pub const DOORBELL: u32 = 1;
    pub const SYNC: u32 = 2;
}

/// Symcall numbers (the module's handler table, like syscall numbers).
pub mod nr {
    /// The bare round trip: answered at once, with no handler work (the doorbell transport's
    /// floor: answered in the module's interrupt handler).
    pub const PING: u32 = 0;
    /// Returns `ret = a0`, `rets = a1..a4`.
    pub const ECHO: u32 = 1;
    /// `task_info(pid)`: `rets = [tgid, ppid, threads, flags]`, data `comm\0exe\0cwd\0`.
    pub const TASK_INFO: u32 = 2;
    /// `fd_path(pid, fd)`: `rets = [f_flags, f_pos, ino, size]`, data the path.
    pub const FD_PATH: u32 = 3;
    /// `page_info(pid, vaddr)`: `rets = [page flags, pfn, swap type, swap offset]`.
    pub const PAGE_INFO: u32 = 4;
    /// `swap_info()`: `ret` = devices, data = that many swap records, `rets = [swap total
    /// KiB, swap free KiB, pswpin, pswpout]`.
    pub const SWAP_INFO: u32 = 5;
    /// Test only: spins `a0` ms (at most 60 000) in the handler, then answers like ECHO.
    pub const TEST_SPIN: u32 = 64;
    /// Highest number the module may announce.
    pub const MAX: u32 = 127;

    /// The name of a symcall number.
    pub fn name(n: u32) -> Option<&'static str> {
        Some(match n {
            PING => "ping",
            ECHO => "echo",
            TASK_INFO => "task_info",
            FD_PATH => "fd_path",
            PAGE_INFO => "page_info",
            SWAP_INFO => "swap_info",
            TEST_SPIN => "test_spin",
            _ => return None,
        })
    }

    /// The number of a symcall name.
    pub fn by_name(s: &str) -> Option<u32> {
        [
            PING, ECHO, TASK_INFO, FD_PATH, PAGE_INFO, SWAP_INFO, TEST_SPIN,
        ]
        .into_iter()
        .find(|&n| name(n) == Some(s))
    }
}

/// `page_info` flag bits (`rets[0]`).
pub mod page {
    pub const PRESENT: u64 = 1;
    pub const SWAPPED: u64 = 2;
    pub const PTE_WRITE: u64 = 4;
    pub const PTE_USER: u64 = 8;
    pub const PTE_NX: u64 = 16;
    /// The address is inside a mapping (VMA); the four bits below are its permissions.
    pub const VMA: u64 = 32;
    pub const VMA_READ: u64 = 64;
    pub const VMA_WRITE: u64 = 128;
    pub const VMA_EXEC: u64 = 256;
    pub const VMA_SHARED: u64 = 512;
    /// Mapped by a huge page (PMD or PUD).
    pub const HUGE: u64 = 1024;
}

/// Swap record flag bits.
pub mod swap_flag {
    /// In use and writable (`SWP_WRITEOK`).
    pub const WRITEOK: u32 = 1;
    /// A block device (otherwise a file).
    pub const BLOCKDEV: u32 = 2;
}

/// Device hint kinds and flags (`VMM.hints`).
pub mod hint {
    pub const KIND_DISK: u32 = 1;
    pub const READONLY: u32 = 1;
    pub const ICACHE: u32 = 2;
    pub const DEDUP: u32 = 4;
    pub const DISK_MODEL: u32 = 8;
    pub const STREAMED: u32 = 16;
}

/// Ret value of the synchronous entry when the vCPU was not at a safe point (RCU not
/// watching): the plugin puts it back and tries again at the next opportunity.
pub const RET_NOT_HERE: i64 = -0x1_0000;

/// Where the call's sequence sits in the synchronous entry's first argument.
pub const SYNC_SEQ_SHIFT: u32 = 32;

/// The synchronous entry's first argument: the call number in bits 0-31 and the low 32 bits of
/// the call page's `seq` in bits 32-63. The module runs the call only while the page still
/// holds that sequence, so a redirection that runs late (its vCPU's host thread preempted after
/// it was taken, or a cancelled one) never answers a newer call with the older one's arguments.
pub fn sync_word(nr: u32, seq: u64) -> u64 {
    u64::from(nr) | (seq & 0xffff_ffff) << SYNC_SEQ_SHIFT
}

/// Capacities.
pub const MAX_HINTS: usize = 16;
pub const MAX_SWAPS: usize = 8;
pub const MAX_CPUS: usize = 64;
pub const SWAP_PATH: usize = 64;
pub const CALL_DATA: usize = 3968;

/// A field's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    U32,
    I32,
    U64,
    I64,
    /// A NUL-padded byte string of this many bytes.
    Str(usize),
    /// This many `u64`s.
    U64s(usize),
    /// This many records of the named sub-layout.
    Array(&'static Page, usize),
}

impl Ty {
    /// Size in bytes.
    pub const fn size(&self) -> usize {
        match *self {
            Ty::U32 | Ty::I32 => 4,
            Ty::U64 | Ty::I64 => 8,
            Ty::Str(n) => n,
            Ty::U64s(n) => 8 * n,
            Ty::Array(p, n) => p.size * n,
        }
    }
}

/// One field of a page or record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub ty: Ty,
}

/// A page (or a record inside one): its C name, where it starts in the region (0 for
/// records), its size, and its fields in offset order.
#[derive(Debug, PartialEq, Eq)]
pub struct Page {
    pub c_name: &'static str,
    pub base: usize,
    pub size: usize,
    pub fields: &'static [Field],
}

impl Page {
    /// The field called `name` (a programming error if absent: the tables are static).
    pub fn field(&self, name: &str) -> Field {
        *self
            .fields
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{} has no field {name}", self.c_name))
    }

    /// Region offset of `name`.
    pub fn at(&self, name: &str) -> usize {
        self.base + self.field(name).offset
    }
}

const fn f(name: &'static str, offset: usize, ty: Ty) -> Field {
    Field { name, offset, ty }
}

/// A device hint (`VMM.hints[]`).
pub static HINT: Page = Page {
    c_name: "vsym_hint",
    base: 0,
    size: 40,
    fields: &[
        f("kind", 0, Ty::U32),
        f("index", 4, Ty::U32),
        f("flags", 8, Ty::U32),
        f("pad", 12, Ty::U32),
        f("serial", 16, Ty::Str(24)),
    ],
};

/// A swap device (`GUEST.swaps[]`, `swap_info` data).
pub static SWAP: Page = Page {
    c_name: "vsym_swap",
    base: 0,
    size: 96,
    fields: &[
        f("type", 0, Ty::U32),
        f("prio", 4, Ty::I32),
        f("flags", 8, Ty::U32),
        f("pad", 12, Ty::U32),
        f("size_kib", 16, Ty::U64),
        f("used_kib", 24, Ty::U64),
        f("path", 32, Ty::Str(SWAP_PATH)),
    ],
};

/// What one CPU runs (`GUEST.cpus[]`), written by that CPU at every context switch.
pub static CPU: Page = Page {
    c_name: "vsym_cpu",
    base: 0,
    size: 40,
    fields: &[
        f("seq", 0, Ty::U32),
        f("pid", 4, Ty::I32),
        f("tgid", 8, Ty::I32),
        f("pad", 12, Ty::U32),
        f("switches", 16, Ty::U64),
        f("comm", 24, Ty::Str(16)),
    ],
};

/// vmsight's page.
pub static VMM: Page = Page {
    c_name: "vsym_vmm",
    base: 0,
    size: 4096,
    fields: &[
        f("magic", 0, Ty::U64),
        f("abi", 8, Ty::U32),
        f("features", 12, Ty::U32),
        f("state", 16, Ty::U32),
        f("refuse_reason", 20, Ty::U32),
        f("vmm_peer", 24, Ty::U32),
        f("refresh_ms", 28, Ty::U32),
        f("vmsight_version", 32, Ty::Str(32)),
        f("nr_hints", 64, Ty::U32),
        // The guest's `hello_id` this answer (state, refuse_reason) belongs to.
        f("answered_hello", 68, Ty::U32),
        f("hints", 72, Ty::Array(&HINT, MAX_HINTS)),
    ],
};

/// The guest's page (SymSpy).
pub static GUEST: Page = Page {
    c_name: "vsym_guest",
    base: 0x1000,
    size: 8192,
    fields: &[
        f("magic", 0, Ty::U64),
        f("abi", 8, Ty::U32),
        f("state", 12, Ty::U32),
        f("seq", 16, Ty::U32),
        f("peer", 20, Ty::U32),
        f("nr_cpus", 24, Ty::U32),
        f("refresh_ms", 28, Ty::U32),
        f("updated_ns", 32, Ty::U64),
        f("refreshes", 40, Ty::U64),
        f("symcalls", 48, Ty::U64s(2)),
        f("sync_entry", 64, Ty::U64),
        f("sync_return", 72, Ty::U64),
        f("sync_stack", 80, Ty::U64),
        // A fresh id per hello; the module trusts only an answer carrying it.
        f("hello_id", 88, Ty::U64),
        f("release", 96, Ty::Str(64)),
        f("version", 160, Ty::Str(64)),
        f("mem_total_kib", 224, Ty::U64),
        f("mem_free_kib", 232, Ty::U64),
        f("mem_available_kib", 240, Ty::U64),
        f("swap_total_kib", 248, Ty::U64),
        f("swap_free_kib", 256, Ty::U64),
        f("pswpin", 264, Ty::U64),
        f("pswpout", 272, Ty::U64),
        f("nr_swap", 280, Ty::U32),
        f("pad2", 284, Ty::U32),
        f("swaps", 288, Ty::Array(&SWAP, MAX_SWAPS)),
        f("cpus", 1088, Ty::Array(&CPU, MAX_CPUS)),
    ],
};

/// The call page.
pub static CALL: Page = Page {
    c_name: "vsym_call",
    base: 0x3000,
    size: 4096,
    fields: &[
        f("seq", 0, Ty::U64),
        f("state", 8, Ty::U32),
        f("transport", 12, Ty::U32),
        f("nr", 16, Ty::U32),
        f("pad", 20, Ty::U32),
        f("args", 24, Ty::U64s(5)),
        f("done_seq", 64, Ty::U64),
        f("ret", 72, Ty::I64),
        f("rets", 80, Ty::U64s(4)),
        f("data_len", 112, Ty::U32),
        f("pad2", 116, Ty::U32),
        f("reserved", 120, Ty::U64),
        f("data", 128, Ty::Str(CALL_DATA)),
    ],
};

/// Every page and record, records first (the C header declares them in this order).
/// The header page of the swap region (SwapBypass, docs/swapbypass.md). The region is a
/// second ivshmem device (`ivshmem-plain`) whose memory vmsight owns: this page, then the
/// index (`u32` per swap page: 0 or slot + 1), the slot states (`u64` per slot), the free
/// stack (`u32` per slot) and the slots' pages, at the offsets the header gives. Its `base`
/// is the start of the swap region, not of the symbiotic region.
pub static SWAPHDR: Page = Page {
    c_name: "vsym_swaphdr",
    base: 0,
    size: 4096,
    fields: &[
        f("magic", 0, Ty::U64),
        f("abi", 8, Ty::U32),
        f("vmm_state", 12, Ty::U32),
        f("swap_pages", 16, Ty::U64),
        f("slots", 24, Ty::U32),
        // The spin lock both sides take around every index, state and stack change.
        f("lock", 28, Ty::U32),
        f("index_off", 32, Ty::U64),
        f("meta_off", 40, Ty::U64),
        f("stack_off", 48, Ty::U64),
        f("data_off", 56, Ty::U64),
        // Entries in the free stack (slots the guest may take).
        f("free_top", 64, Ty::U32),
        // Slots holding a page (mapped, being evicted, or dead until the eviction ends).
        f("used", 68, Ty::U32),
        f("guest_state", 72, Ty::U32),
        // The cache size vmsight grants, in slots (informational; the free stack enforces it).
        f("limit", 76, Ty::U32),
        f("region_size", 80, Ty::U64),
        // The guest module's counters (hostile input to vmsight: reported, never trusted).
        f("g_stores", 128, Ty::U64),
        f("g_store_full", 136, Ty::U64),
        f("g_loads", 144, Ty::U64),
        f("g_load_misses", 152, Ty::U64),
        f("g_invalidates", 160, Ty::U64),
        f("g_busy", 168, Ty::U64),
        f("g_lower_reads", 176, Ty::U64),
        f("g_lower_writes", 184, Ty::U64),
        f("g_corrupt", 192, Ty::U64),
        // Freed pages whose slot the module let go later (the lock was busy at the free).
        f("g_deferred", 200, Ty::U64),
    ],
};

/// The swap region (SwapBypass): constants and its layout for a swap size.
pub mod swapr {
    /// `SWAPHDR.magic`.
    pub const MAGIC: u64 = u64::from_le_bytes(*b"VMSWAPRG");
    /// `SWAPHDR.abi`: the swap region's own version (2: `g_deferred`, and the module frees
    /// the slots of pages freed while the lock was busy later instead of never).
    pub const ABI: u32 = 2;
    /// Page size of the swap device, slots and index.
    pub const PAGE: u64 = 4096;
    /// `vmm_state`: vmsight serves the region.
    pub const VMM_READY: u32 = 1;
    /// `vmm_state`: vmsight is gone; the module stops using the region.
    pub const VMM_GONE: u32 = 2;
    /// `guest_state`: no module uses the region.
    pub const GUEST_NONE: u32 = 0;
    /// `guest_state`: the module's bypass device is up.
    pub const GUEST_ACTIVE: u32 = 1;
    /// `lock`: free, held by the guest, held by vmsight.
    pub const LOCK_FREE: u32 = 0;
    pub const LOCK_GUEST: u32 = 1;
    pub const LOCK_VMM: u32 = 2;
    /// A slot state word (`meta[slot]`): bits 0-31 the swap page it holds, bits 32-39 the
    /// state, bit 40 the referenced mark the guest sets when it loads the slot.
    pub const OFFSET_MASK: u64 = 0xffff_ffff;
    pub const STATE_SHIFT: u32 = 32;
    pub const STATE_MASK: u64 = 0xff << 32;
    pub const REFERENCED: u64 = 1 << 40;
    /// Not allocatable: outside the cache size vmsight grants (its memory is given back).
    pub const SLOT_RESERVED: u64 = 0;
    /// In the free stack.
    pub const SLOT_FREE: u64 = 1;
    /// Holds the current contents of its swap page; the index points at it.
    pub const SLOT_MAPPED: u64 = 2;
    /// vmsight is writing it to the swap file; still mapped and readable, never overwritten.
    pub const SLOT_EVICTING: u64 = 3;
    /// Unmapped while being evicted; vmsight frees it when the write ends.
    pub const SLOT_DEAD: u64 = 4;

    /// Where everything is in a swap region.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Layout {
        /// Pages of the swap disk (index entries).
        pub swap_pages: u64,
        /// Slots (the most pages the cache can ever hold).
        pub slots: u64,
        pub index_off: u64,
        pub meta_off: u64,
        pub stack_off: u64,
        pub data_off: u64,
        /// The region's size: a power of two (a PCI BAR), at least `data_off + slots pages`.
        pub region_size: u64,
    }

    fn pages_for(bytes: u64) -> u64 {
        bytes.div_ceil(PAGE)
    }

    impl Layout {
        /// The layout for a swap disk of `swap_pages` pages with room for at most `max_slots`
        /// cached pages (fewer when the power-of-two region leaves less room). `None` when the
        /// swap is empty or beyond what 32-bit offsets address.
        pub fn new(swap_pages: u64, max_slots: u64) -> Option<Self> {
            if swap_pages < 2 || swap_pages > u64::from(u32::MAX) || max_slots == 0 {
                return None;
            }
            let max_slots = max_slots.min(swap_pages);
            let index_off = PAGE;
            let fixed = |slots: u64| {
                let meta_off = index_off + pages_for(swap_pages * 4) * PAGE;
                let stack_off = meta_off + pages_for(slots * 8) * PAGE;
                let data_off = stack_off + pages_for(slots * 4) * PAGE;
                (meta_off, stack_off, data_off)
            };
            // A PCI BAR is a power of two: take the one the pages alone need and fit as many
            // slots in it as its metadata leaves room for.
            let region_size = (max_slots * PAGE)
                .next_power_of_two()
                .max((fixed(1).2 + PAGE).next_power_of_two());
            let fits = |s: u64| fixed(s).2 + s * PAGE <= region_size;
            let mut slots = max_slots;
            while slots > 0 && !fits(slots) {
                // Each step removes at least one page's worth of slots.
                let over = (fixed(slots).2 + slots * PAGE - region_size).div_ceil(PAGE);
                slots = slots.saturating_sub(over.max(1));
            }
            if slots == 0 {
                return None;
            }
            let (meta_off, stack_off, data_off) = fixed(slots);
            Some(Self {
                swap_pages,
                slots,
                index_off,
                meta_off,
                stack_off,
                data_off,
                region_size,
            })
        }

        /// Region offset of slot `s`'s page.
        pub fn slot_data(&self, s: u64) -> u64 {
            self.data_off + s * PAGE
        }
    }
}

pub static ALL: [&Page; 7] = [&HINT, &SWAP, &CPU, &VMM, &GUEST, &CALL, &SWAPHDR];

/// The C header of the layout, for the guest module.
pub fn c_header() -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    s.push_str(
        "/* SPDX-License-Identifier: GPL-2.0 */\n\
         /* Generated from crates/proto/src/sym.rs by `cargo test -p vmsight-proto` with\n \
         * VMSIGHT_WRITE_SYM_HEADER=1. Do not edit: the Rust tables are the definition. */\n\
         #ifndef VMSIGHT_SYM_ABI_H\n#define VMSIGHT_SYM_ABI_H\n\n",
    );
    let _ = writeln!(s, "#define VSYM_ABI_VERSION {ABI_VERSION}");
    let _ = writeln!(s, "#define VSYM_REGION_SIZE {REGION_SIZE}");
    let _ = writeln!(s, "#define VSYM_FW_CFG_NAME \"{FW_CFG_NAME}\"");
    let _ = writeln!(s, "#define VSYM_VECTORS {VECTORS}");
    let _ = writeln!(s, "#define VSYM_VEC_CALL {VEC_CALL}");
    let _ = writeln!(s, "#define VSYM_VEC_STATE {VEC_STATE}");
    let _ = writeln!(s, "#define VSYM_VMM_MAGIC 0x{VMM_MAGIC:016x}ULL");
    let _ = writeln!(s, "#define VSYM_GUEST_MAGIC 0x{GUEST_MAGIC:016x}ULL");
    let _ = writeln!(s, "#define VSYM_RET_NOT_HERE ({RET_NOT_HERE}LL)");
    let _ = writeln!(s, "#define VSYM_SYNC_SEQ_SHIFT {SYNC_SEQ_SHIFT}");
    let _ = writeln!(s, "#define VSYM_SWAPR_MAGIC 0x{:016x}ULL", swapr::MAGIC);
    let _ = writeln!(s, "#define VSYM_SWAPR_ABI {}", swapr::ABI);
    let consts: &[(&str, &[(&str, u64)])] = &[
        (
            "SWAPR",
            &[
                ("PAGE", swapr::PAGE),
                ("VMM_READY", swapr::VMM_READY.into()),
                ("VMM_GONE", swapr::VMM_GONE.into()),
                ("GUEST_NONE", swapr::GUEST_NONE.into()),
                ("GUEST_ACTIVE", swapr::GUEST_ACTIVE.into()),
                ("LOCK_FREE", swapr::LOCK_FREE.into()),
                ("LOCK_GUEST", swapr::LOCK_GUEST.into()),
                ("LOCK_VMM", swapr::LOCK_VMM.into()),
                ("OFFSET_MASK", swapr::OFFSET_MASK),
                ("STATE_SHIFT", swapr::STATE_SHIFT.into()),
                ("STATE_MASK", swapr::STATE_MASK),
                ("REFERENCED", swapr::REFERENCED),
                ("SLOT_RESERVED", swapr::SLOT_RESERVED),
                ("SLOT_FREE", swapr::SLOT_FREE),
                ("SLOT_MAPPED", swapr::SLOT_MAPPED),
                ("SLOT_EVICTING", swapr::SLOT_EVICTING),
                ("SLOT_DEAD", swapr::SLOT_DEAD),
            ],
        ),
        (
            "FEAT",
            &[
                ("SPY", feature::SPY.into()),
                ("DOORBELL", feature::DOORBELL.into()),
                ("SYNC", feature::SYNC.into()),
                ("SWAP", feature::SWAP.into()),
            ],
        ),
        (
            "VMM",
            &[
                ("WAITING", vmm_state::WAITING.into()),
                ("ACCEPTED", vmm_state::ACCEPTED.into()),
                ("REFUSED", vmm_state::REFUSED.into()),
                ("GONE", vmm_state::GONE.into()),
            ],
        ),
        (
            "REFUSE",
            &[
                ("NONE", refuse::NONE.into()),
                ("VERSION", refuse::VERSION.into()),
                ("MALFORMED", refuse::MALFORMED.into()),
            ],
        ),
        (
            "GUEST",
            &[
                ("NONE", guest_state::NONE.into()),
                ("HELLO", guest_state::HELLO.into()),
                ("ACTIVE", guest_state::ACTIVE.into()),
                ("REFUSED", guest_state::REFUSED.into()),
                ("GONE", guest_state::GONE.into()),
            ],
        ),
        (
            "CALL",
            &[
                ("IDLE", call_state::IDLE.into()),
                ("POSTED", call_state::POSTED.into()),
                ("RUNNING", call_state::RUNNING.into()),
                ("DONE", call_state::DONE.into()),
            ],
        ),
        (
            "TRANSPORT",
            &[
                ("DOORBELL", transport::DOORBELL.into()),
                ("SYNC", transport::SYNC.into()),
            ],
        ),
        (
            "NR",
            &[
                ("PING", nr::PING.into()),
                ("ECHO", nr::ECHO.into()),
                ("TASK_INFO", nr::TASK_INFO.into()),
                ("FD_PATH", nr::FD_PATH.into()),
                ("PAGE_INFO", nr::PAGE_INFO.into()),
                ("SWAP_INFO", nr::SWAP_INFO.into()),
                ("TEST_SPIN", nr::TEST_SPIN.into()),
                ("MAX", nr::MAX.into()),
            ],
        ),
        (
            "PAGE",
            &[
                ("PRESENT", page::PRESENT),
                ("SWAPPED", page::SWAPPED),
                ("PTE_WRITE", page::PTE_WRITE),
                ("PTE_USER", page::PTE_USER),
                ("PTE_NX", page::PTE_NX),
                ("VMA", page::VMA),
                ("VMA_READ", page::VMA_READ),
                ("VMA_WRITE", page::VMA_WRITE),
                ("VMA_EXEC", page::VMA_EXEC),
                ("VMA_SHARED", page::VMA_SHARED),
                ("HUGE", page::HUGE),
            ],
        ),
        (
            "SWAP",
            &[
                ("WRITEOK", swap_flag::WRITEOK.into()),
                ("BLOCKDEV", swap_flag::BLOCKDEV.into()),
            ],
        ),
        (
            "HINT",
            &[
                ("KIND_DISK", hint::KIND_DISK.into()),
                ("READONLY", hint::READONLY.into()),
                ("ICACHE", hint::ICACHE.into()),
                ("DEDUP", hint::DEDUP.into()),
                ("DISK_MODEL", hint::DISK_MODEL.into()),
                ("STREAMED", hint::STREAMED.into()),
            ],
        ),
    ];
    for (group, items) in consts {
        s.push('\n');
        for (n, v) in *items {
            let suffix = if *v > u64::from(u32::MAX) { "ULL" } else { "" };
            let _ = writeln!(s, "#define VSYM_{group}_{n} {v}{suffix}");
        }
    }
    for p in ALL {
        let _ = write!(s, "\nstruct {} {{\n", p.c_name);
        let mut end = 0;
        for fl in p.fields {
            if fl.offset > end {
                // The tables may leave gaps; the C struct must keep the same offsets.
                let _ = writeln!(s, "\t__u8 gap_{end}[{}];", fl.offset - end);
            }
            end = fl.offset + fl.ty.size();
            let decl = match fl.ty {
                Ty::U32 => format!("__u32 {}", fl.name),
                Ty::I32 => format!("__s32 {}", fl.name),
                Ty::U64 => format!("__u64 {}", fl.name),
                Ty::I64 => format!("__s64 {}", fl.name),
                Ty::Str(n) => format!("char {}[{n}]", fl.name),
                Ty::U64s(n) => format!("__u64 {}[{n}]", fl.name),
                Ty::Array(sub, n) => format!("struct {} {}[{n}]", sub.c_name, fl.name),
            };
            let _ = writeln!(s, "\t{decl}; /* offset {} */", fl.offset);
        }
        let _ = writeln!(s, "}} __attribute__((packed, aligned(8)));");
        for fl in p.fields {
            let _ = writeln!(
                s,
                "_Static_assert(__builtin_offsetof(struct {}, {}) == {}, \"{}.{}\");",
                p.c_name, fl.name, fl.offset, p.c_name, fl.name
            );
        }
        let _ = writeln!(
            s,
            "_Static_assert(sizeof(struct {}) <= {}, \"{} size\");",
            p.c_name, p.size, p.c_name
        );
        if p.base != 0 || std::ptr::eq(p, &VMM) {
            let _ = writeln!(
                s,
                "#define VSYM_{}_OFFSET 0x{:x}",
                p.c_name.trim_start_matches("vsym_").to_uppercase(),
                p.base
            );
        }
    }
    s.push_str("\n#endif /* VMSIGHT_SYM_ABI_H */\n");
    s
}

/// The fw_cfg announcement vmsight puts in [`FW_CFG_NAME`].
pub fn announcement(features: u32) -> String {
    format!("abi={ABI_VERSION} features=0x{features:x} size={REGION_SIZE} vectors={VECTORS}\n")
}

// --- reports (control socket, CLI) ---------------------------------------------------------

use serde::{Deserialize, Serialize};

/// Which transport carries a symcall.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The synchronous transport where available (QEMU 11 with the plugin and a module that
    /// publishes its entry), else the doorbell.
    #[default]
    Auto,
    Doorbell,
    Sync,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Doorbell => "doorbell",
            Transport::Sync => "sync",
        }
    }
}

/// A symcall to make (`vmsight sym NAME call`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRequest {
    /// The call number ([`nr`]).
    pub nr: u32,
    /// Up to five arguments by value (missing ones are 0).
    #[serde(default)]
    pub args: Vec<u64>,
    #[serde(default)]
    pub transport: Transport,
    /// How long the caller waits for the guest's answer.
    pub timeout_ms: u64,
}

/// Most a caller may wait for one symcall.
pub const MAX_CALL_TIMEOUT_MS: u64 = 60_000;

/// A symcall's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallReply {
    pub nr: u32,
    /// The call's name, when the number is known.
    pub name: Option<String>,
    /// The transport that carried it (`doorbell` or `sync`).
    pub transport: Transport,
    /// The call's id (`CALL.seq`).
    pub seq: u64,
    /// `>= 0`: success (call-specific); `< 0`: a negative errno.
    pub ret: i64,
    pub rets: [u64; 4],
    /// The call's data (strings, records), at most [`CALL_DATA`] bytes.
    pub data: Vec<u8>,
    /// Host time from posting to the answer, nanoseconds.
    pub latency_ns: u64,
    /// Where a synchronous call's time went (absent on the doorbell transport).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<SyncStages>,
}

/// Where a synchronous call's time went: nanoseconds after vmsight posted the redirection, on
/// the host's CLOCK_MONOTONIC (read by vmsight and by the plugin inside QEMU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncStages {
    /// vmsight first rang the guest's state doorbell (none: a running vCPU took the call).
    pub rung_ns: Option<u64>,
    /// A halted vCPU last resumed before the call was taken (none: no vCPU resumed since
    /// posting).
    pub resumed_ns: Option<u64>,
    /// A vCPU took the request (the plugin's claim).
    pub taken_ns: u64,
    /// The module's entry reached the return marker.
    pub returned_ns: u64,
    /// vmsight saw the answer.
    pub seen_ns: u64,
}

/// The answer of `task_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    pub tgid: u64,
    pub ppid: u64,
    pub threads: u64,
    pub kernel_thread: bool,
    pub comm: String,
    /// Empty for kernel threads.
    pub exe: String,
    pub cwd: String,
}

/// The answer of `fd_path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdPath {
    pub path: String,
    pub flags: u64,
    pub pos: u64,
    pub ino: u64,
    pub size: u64,
}

/// The answer of `page_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageInfo {
    pub present: bool,
    pub swapped: bool,
    /// Page-table permissions (present pages).
    pub writable: bool,
    pub user: bool,
    pub nx: bool,
    pub huge: bool,
    /// The mapping's permissions, if the address is in one.
    pub vma: Option<VmaPerms>,
    /// Physical frame (present pages).
    pub pfn: Option<u64>,
    /// Swap entry (swapped pages).
    pub swap_type: Option<u64>,
    pub swap_offset: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmaPerms {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    pub shared: bool,
}

/// One swap device (SymSpy and `swap_info`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapDevice {
    /// The swap type: the index in swap entries.
    #[serde(rename = "type")]
    pub kind: u32,
    pub prio: i32,
    pub writeok: bool,
    pub blockdev: bool,
    pub size_kib: u64,
    pub used_kib: u64,
    pub path: String,
}

/// The answer of `swap_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapInfo {
    pub devices: Vec<SwapDevice>,
    pub swap_total_kib: u64,
    pub swap_free_kib: u64,
    pub pswpin: u64,
    pub pswpout: u64,
}

/// A call's answer decoded by its number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Decoded {
    Ping,
    Echo { values: [u64; 5] },
    TaskInfo(TaskInfo),
    FdPath(FdPath),
    PageInfo(PageInfo),
    SwapInfo(SwapInfo),
    TestSpin { values: [u64; 5] },
}

/// Splits NUL-terminated strings (at most `n`), lossy UTF-8: the guest wrote them.
fn c_strings(data: &[u8], n: usize) -> Vec<String> {
    data.split(|&b| b == 0)
        .take(n)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// A NUL-padded string field.
pub fn c_str(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The little-endian `u32` at `off` of a copied page (callers bound `off` by the tables).
pub fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap_or_default())
}

/// The little-endian `u64` at `off` of a copied page.
pub fn le_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap_or_default())
}

/// Decodes one swap record (`SWAP.size` bytes).
pub fn swap_record(b: &[u8]) -> SwapDevice {
    let flags = le_u32(b, SWAP.field("flags").offset);
    let path = SWAP.field("path");
    SwapDevice {
        kind: le_u32(b, SWAP.field("type").offset),
        prio: le_u32(b, SWAP.field("prio").offset) as i32,
        writeok: flags & swap_flag::WRITEOK != 0,
        blockdev: flags & swap_flag::BLOCKDEV != 0,
        size_kib: le_u64(b, SWAP.field("size_kib").offset),
        used_kib: le_u64(b, SWAP.field("used_kib").offset),
        path: c_str(&b[path.offset..path.offset + path.ty.size()]),
    }
}

impl CallReply {
    /// The errno name of a negative `ret` (`ESRCH`), if it is one.
    pub fn errno(&self) -> Option<&'static str> {
        if self.ret >= 0 || self.ret < -4095 {
            return None;
        }
        crate::syscall::errno_name(-self.ret)
    }

    /// The answer by call number; `None` for a failed call or an unknown number.
    pub fn decode(&self) -> Option<Decoded> {
        if self.ret < 0 {
            return None;
        }
        let r = self.rets;
        let five = [self.ret as u64, r[0], r[1], r[2], r[3]];
        Some(match self.nr {
            nr::PING => Decoded::Ping,
            nr::ECHO => Decoded::Echo { values: five },
            nr::TEST_SPIN => Decoded::TestSpin { values: five },
            nr::TASK_INFO => {
                let s = c_strings(&self.data, 3);
                let get = |i: usize| s.get(i).cloned().unwrap_or_default();
                Decoded::TaskInfo(TaskInfo {
                    tgid: r[0],
                    ppid: r[1],
                    threads: r[2],
                    kernel_thread: r[3] & 1 != 0,
                    comm: get(0),
                    exe: get(1),
                    cwd: get(2),
                })
            }
            nr::FD_PATH => Decoded::FdPath(FdPath {
                path: c_str(&self.data),
                flags: r[0],
                pos: r[1],
                ino: r[2],
                size: r[3],
            }),
            nr::PAGE_INFO => {
                let f = r[0];
                let has = |bit: u64| f & bit != 0;
                Decoded::PageInfo(PageInfo {
                    present: has(page::PRESENT),
                    swapped: has(page::SWAPPED),
                    writable: has(page::PTE_WRITE),
                    user: has(page::PTE_USER),
                    nx: has(page::PTE_NX),
                    huge: has(page::HUGE),
                    vma: has(page::VMA).then_some(VmaPerms {
                        read: has(page::VMA_READ),
                        write: has(page::VMA_WRITE),
                        exec: has(page::VMA_EXEC),
                        shared: has(page::VMA_SHARED),
                    }),
                    pfn: has(page::PRESENT).then_some(r[1]),
                    swap_type: has(page::SWAPPED).then_some(r[2]),
                    swap_offset: has(page::SWAPPED).then_some(r[3]),
                })
            }
            nr::SWAP_INFO => {
                let n = (self.ret as usize)
                    .min(MAX_SWAPS)
                    .min(self.data.len() / SWAP.size);
                Decoded::SwapInfo(SwapInfo {
                    devices: (0..n)
                        .map(|i| swap_record(&self.data[i * SWAP.size..(i + 1) * SWAP.size]))
                        .collect(),
                    swap_total_kib: r[0],
                    swap_free_kib: r[1],
                    pswpin: r[2],
                    pswpout: r[3],
                })
            }
            _ => return None,
        })
    }
}

/// What one CPU runs (SymSpy).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuTask {
    pub cpu: u32,
    pub pid: i32,
    pub tgid: i32,
    pub comm: String,
    pub switches: u64,
}

/// Memory and swap counters (SymSpy), KiB and pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemCounters {
    pub mem_total_kib: u64,
    pub mem_free_kib: u64,
    pub mem_available_kib: u64,
    pub swap_total_kib: u64,
    pub swap_free_kib: u64,
    pub pswpin: u64,
    pub pswpout: u64,
}

/// The guest's SymSpy page, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestSpy {
    pub abi: u32,
    pub peer: u32,
    pub release: String,
    pub version: String,
    pub nr_cpus: u32,
    pub refresh_ms: u32,
    /// How many times the guest refreshed the page (grows every `refresh_ms`).
    pub refreshes: u64,
    /// The symcalls the module serves, by name (number when unknown to vmsight).
    pub symcalls: Vec<String>,
    /// Whether the module offers the synchronous entry.
    pub sync_entry: bool,
    pub mem: MemCounters,
    pub swaps: Vec<SwapDevice>,
    pub cpus: Vec<CpuTask>,
}

/// Counters of a VM's symbiotic interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SymCounters {
    /// Handshakes (module hellos) seen, accepted, refused.
    pub hellos: u64,
    pub accepted: u64,
    pub refused: u64,
    /// Doorbells from the guest: call done, state, and ones that matched nothing.
    pub doorbells_call: u64,
    pub doorbells_state: u64,
    pub doorbells_spurious: u64,
    /// Symcalls answered, by transport, and failed ones.
    pub calls_doorbell: u64,
    pub calls_sync: u64,
    /// State doorbells the synchronous transport rang to wake the guest: at once, because
    /// every vCPU was halted, or halted or in user code; and after waiting for a running vCPU
    /// to take the call.
    #[serde(default)]
    pub sync_wakes_idle: u64,
    #[serde(default)]
    pub sync_wakes_user: u64,
    #[serde(default)]
    pub sync_wakes_waited: u64,
    pub timeouts: u64,
    pub busy: u64,
    /// SymSpy reads and the problems found in them (hostile or torn pages).
    pub spy_reads: u64,
    pub spy_problems: u64,
}

/// `vmsight sym NAME spy`: the interface's state and the guest's page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpyReport {
    /// vmsight's interface version and features.
    pub abi: u32,
    pub features: Vec<String>,
    /// `waiting`, `accepted`, `refused`, `gone`.
    pub vmm_state: String,
    /// `none`, `hello`, `active`, `refused`, `gone`, or `invalid (N)`.
    pub guest_state: String,
    /// Why the interface is off, when it is.
    pub refused: Option<String>,
    /// Transports a call can use now.
    pub transports: Vec<Transport>,
    /// The page, when a module wrote a valid one.
    pub guest: Option<GuestSpy>,
    /// What was wrong in the page (each field checked as hostile input).
    pub problems: Vec<String>,
    pub counters: SymCounters,
}

/// Name of a `VMM.state`.
pub fn vmm_state_name(s: u32) -> String {
    match s {
        vmm_state::WAITING => "waiting".into(),
        vmm_state::ACCEPTED => "accepted".into(),
        vmm_state::REFUSED => "refused".into(),
        vmm_state::GONE => "gone".into(),
        n => format!("invalid ({n})"),
    }
}

/// Name of a `GUEST.state`.
pub fn guest_state_name(s: u32) -> String {
    match s {
        guest_state::NONE => "none".into(),
        guest_state::HELLO => "hello".into(),
        guest_state::ACTIVE => "active".into(),
        guest_state::REFUSED => "refused".into(),
        guest_state::GONE => "gone".into(),
        n => format!("invalid ({n})"),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_synchronous_entry_word_carries_the_number_and_the_low_half_of_the_sequence() {
        assert_eq!(sync_word(nr::ECHO, 5), 1 | 5 << 32);
        // Only the low 32 bits of the sequence: the module compares with (u32)seq.
        assert_eq!(sync_word(nr::TEST_SPIN, 0x1_0000_0007), 64 | 7 << 32);
        assert_eq!(sync_word(nr::PING, u64::MAX) as u32, nr::PING);
        assert_eq!(sync_word(nr::PING, u64::MAX) >> SYNC_SEQ_SHIFT, 0xffff_ffff);
    }

    use super::*;

    #[test]
    fn swap_regions_are_powers_of_two_with_aligned_parts_and_room_for_their_slots() {
        for (pages, max) in [
            (131_072, 131_072),
            (131_072, 4096),
            (2, 2),
            (25_600, 25_600),
        ] {
            let l = swapr::Layout::new(pages, max).expect("a layout");
            assert!(l.region_size.is_power_of_two(), "{l:?}");
            assert!(l.slots >= 1 && l.slots <= max, "{l:?}");
            assert!(l.slot_data(l.slots) <= l.region_size, "{l:?}");
            for off in [l.index_off, l.meta_off, l.stack_off, l.data_off] {
                assert_eq!(off % swapr::PAGE, 0, "{l:?}");
            }
            assert!(l.meta_off >= l.index_off + pages * 4, "{l:?}");
            assert!(l.stack_off >= l.meta_off + l.slots * 8, "{l:?}");
            assert!(l.data_off >= l.stack_off + l.slots * 4, "{l:?}");
        }
        // 512 MiB of swap: a 512 MiB region whose metadata costs under 1 % of the slots.
        let l = swapr::Layout::new(131_072, 131_072).expect("a layout");
        assert_eq!(l.region_size, 512 << 20);
        assert!(l.slots > 131_072 * 99 / 100, "{l:?}");
        assert_eq!(swapr::Layout::new(0, 10), None);
        assert_eq!(swapr::Layout::new(10, 0), None);
        assert_eq!(swapr::Layout::new(1 << 33, 10), None);
    }

    /// Fields are in offset order, do not overlap, and fit their page; pages do not overlap
    /// and fit the region.
    #[test]
    fn tables_are_consistent() {
        for p in ALL {
            let mut end = 0;
            for fl in p.fields {
                assert!(fl.offset >= end, "{}.{} overlaps", p.c_name, fl.name);
                let align = match fl.ty {
                    Ty::U32 | Ty::I32 => 4,
                    Ty::Str(_) => 1,
                    _ => 8,
                };
                assert_eq!(fl.offset % align, 0, "{}.{} misaligned", p.c_name, fl.name);
                end = fl.offset + fl.ty.size();
            }
            assert!(
                end <= p.size,
                "{} is {end} bytes, more than {}",
                p.c_name,
                p.size
            );
        }
        let pages = [&VMM, &GUEST, &CALL];
        for w in pages.windows(2) {
            assert!(w[0].base + w[0].size <= w[1].base);
        }
        assert!(CALL.base + CALL.size <= REGION_SIZE);
        assert!(REGION_SIZE.is_power_of_two());
        assert_eq!(CALL.field("data").ty, Ty::Str(CALL_DATA));
        assert_eq!(CALL.at("data") + CALL_DATA, CALL.base + CALL.size);
    }

    #[test]
    fn names_and_numbers_round_trip() {
        for n in [0, 1, 2, 3, 4, 5, 64] {
            assert_eq!(nr::by_name(nr::name(n).unwrap()), Some(n));
        }
        assert_eq!(nr::name(6), None);
        assert_eq!(nr::by_name("nope"), None);
    }

    fn reply(n: u32, ret: i64, rets: [u64; 4], data: &[u8]) -> CallReply {
        CallReply {
            nr: n,
            name: nr::name(n).map(str::to_owned),
            transport: Transport::Doorbell,
            seq: 1,
            ret,
            rets,
            data: data.to_vec(),
            latency_ns: 0,
            stages: None,
        }
    }

    #[test]
    fn answers_decode_by_call_number_and_errors_by_errno() {
        let t = reply(
            nr::TASK_INFO,
            0,
            [7, 1, 2, 0],
            b"sleep\0/usr/bin/sleep\0/tmp\0",
        );
        let Some(Decoded::TaskInfo(t)) = t.decode() else {
            panic!("not a task_info answer");
        };
        assert_eq!((t.tgid, t.ppid, t.threads), (7, 1, 2));
        assert_eq!(
            (t.comm.as_str(), t.exe.as_str(), t.cwd.as_str()),
            ("sleep", "/usr/bin/sleep", "/tmp")
        );
        let p = reply(
            nr::PAGE_INFO,
            0,
            [page::SWAPPED | page::VMA | page::VMA_WRITE, 0, 0, 712],
            b"",
        );
        let Some(Decoded::PageInfo(p)) = p.decode() else {
            panic!("not a page_info answer");
        };
        assert!(p.swapped && !p.present && p.pfn.is_none());
        assert_eq!((p.swap_type, p.swap_offset), (Some(0), Some(712)));
        assert!(p.vma.is_some_and(|v| v.write && !v.exec));
        // A swap_info whose count exceeds the records present is cut to what is there.
        let mut rec = vec![0u8; SWAP.size];
        rec[SWAP.field("path").offset..][..9].copy_from_slice(b"/swapfile");
        let w = reply(nr::SWAP_INFO, 5, [1, 2, 3, 4], &rec);
        let Some(Decoded::SwapInfo(w)) = w.decode() else {
            panic!("not a swap_info answer");
        };
        assert_eq!(w.devices.len(), 1);
        assert_eq!(w.devices[0].path, "/swapfile");
        let e = reply(nr::FD_PATH, -9, [0; 4], b"");
        assert_eq!((e.decode(), e.errno()), (None, Some("EBADF")));
        // Unterminated, non-UTF-8 strings from the guest decode lossily, never panic.
        let f = reply(nr::FD_PATH, 0, [0; 4], &[0xff; 40]);
        assert!(matches!(f.decode(), Some(Decoded::FdPath(_))));
    }

    /// The module's header is generated from these tables; the committed copy must match.
    #[test]
    fn committed_c_header_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../guest/sym/vmsight_sym_abi.h"
        );
        let want = c_header();
        if std::env::var_os("VMSIGHT_WRITE_SYM_HEADER").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "{path} is stale: run VMSIGHT_WRITE_SYM_HEADER=1 cargo test -p vmsight-proto sym"
        );
    }
}
