/* SPDX-License-Identifier: GPL-2.0 */
/* Generated from crates/proto/src/sym.rs by `cargo test -p vmsight-proto` with
 * VMSIGHT_WRITE_SYM_HEADER=1. Do not edit: the Rust tables are the definition. */
#ifndef VMSIGHT_SYM_ABI_H
#define VMSIGHT_SYM_ABI_H

#define VSYM_ABI_VERSION 2
#define VSYM_REGION_SIZE 65536
#define VSYM_FW_CFG_NAME "opt/vmsight/sym"
#define VSYM_VECTORS 2
#define VSYM_VEC_CALL 0
#define VSYM_VEC_STATE 1
#define VSYM_VMM_MAGIC 0x4d4d564d59534d56ULL
#define VSYM_GUEST_MAGIC 0x5453474d59534d56ULL
#define VSYM_RET_NOT_HERE (-65536LL)
#define VSYM_SYNC_SEQ_SHIFT 32
#define VSYM_SWAPR_MAGIC 0x4752504157534d56ULL
#define VSYM_SWAPR_ABI 2

#define VSYM_SWAPR_PAGE 4096
#define VSYM_SWAPR_VMM_READY 1
#define VSYM_SWAPR_VMM_GONE 2
#define VSYM_SWAPR_GUEST_NONE 0
#define VSYM_SWAPR_GUEST_ACTIVE 1
#define VSYM_SWAPR_LOCK_FREE 0
#define VSYM_SWAPR_LOCK_GUEST 1
#define VSYM_SWAPR_LOCK_VMM 2
#define VSYM_SWAPR_OFFSET_MASK 4294967295
#define VSYM_SWAPR_STATE_SHIFT 32
#define VSYM_SWAPR_STATE_MASK 1095216660480ULL
#define VSYM_SWAPR_REFERENCED 1099511627776ULL
#define VSYM_SWAPR_SLOT_RESERVED 0
#define VSYM_SWAPR_SLOT_FREE 1
#define VSYM_SWAPR_SLOT_MAPPED 2
#define VSYM_SWAPR_SLOT_EVICTING 3
#define VSYM_SWAPR_SLOT_DEAD 4

#define VSYM_FEAT_SPY 1
#define VSYM_FEAT_DOORBELL 2
#define VSYM_FEAT_SYNC 4
#define VSYM_FEAT_SWAP 8

#define VSYM_VMM_WAITING 0
#define VSYM_VMM_ACCEPTED 1
#define VSYM_VMM_REFUSED 2
#define VSYM_VMM_GONE 3

#define VSYM_REFUSE_NONE 0
#define VSYM_REFUSE_VERSION 1
#define VSYM_REFUSE_MALFORMED 2

#define VSYM_GUEST_NONE 0
#define VSYM_GUEST_HELLO 1
#define VSYM_GUEST_ACTIVE 2
#define VSYM_GUEST_REFUSED 3
#define VSYM_GUEST_GONE 4

#define VSYM_CALL_IDLE 0
#define VSYM_CALL_POSTED 1
#define VSYM_CALL_RUNNING 2
#define VSYM_CALL_DONE 3

#define VSYM_TRANSPORT_DOORBELL 1
#define VSYM_TRANSPORT_SYNC 2

#define VSYM_NR_PING 0
#define VSYM_NR_ECHO 1
#define VSYM_NR_TASK_INFO 2
#define VSYM_NR_FD_PATH 3
#define VSYM_NR_PAGE_INFO 4
#define VSYM_NR_SWAP_INFO 5
#define VSYM_NR_TEST_SPIN 64
#define VSYM_NR_MAX 127

#define VSYM_PAGE_PRESENT 1
#define VSYM_PAGE_SWAPPED 2
#define VSYM_PAGE_PTE_WRITE 4
#define VSYM_PAGE_PTE_USER 8
#define VSYM_PAGE_PTE_NX 16
#define VSYM_PAGE_VMA 32
#define VSYM_PAGE_VMA_READ 64
#define VSYM_PAGE_VMA_WRITE 128
#define VSYM_PAGE_VMA_EXEC 256
#define VSYM_PAGE_VMA_SHARED 512
#define VSYM_PAGE_HUGE 1024

#define VSYM_SWAP_WRITEOK 1
#define VSYM_SWAP_BLOCKDEV 2

#define VSYM_HINT_KIND_DISK 1
#define VSYM_HINT_READONLY 1
#define VSYM_HINT_ICACHE 2
#define VSYM_HINT_DEDUP 4
#define VSYM_HINT_DISK_MODEL 8
#define VSYM_HINT_STREAMED 16

struct vsym_hint {
	__u32 kind; /* offset 0 */
	__u32 index; /* offset 4 */
	__u32 flags; /* offset 8 */
	__u32 pad; /* offset 12 */
	char serial[24]; /* offset 16 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_hint, kind) == 0, "vsym_hint.kind");
_Static_assert(__builtin_offsetof(struct vsym_hint, index) == 4, "vsym_hint.index");
_Static_assert(__builtin_offsetof(struct vsym_hint, flags) == 8, "vsym_hint.flags");
_Static_assert(__builtin_offsetof(struct vsym_hint, pad) == 12, "vsym_hint.pad");
_Static_assert(__builtin_offsetof(struct vsym_hint, serial) == 16, "vsym_hint.serial");
_Static_assert(sizeof(struct vsym_hint) <= 40, "vsym_hint size");

struct vsym_swap {
	__u32 type; /* offset 0 */
	__s32 prio; /* offset 4 */
	__u32 flags; /* offset 8 */
	__u32 pad; /* offset 12 */
	__u64 size_kib; /* offset 16 */
	__u64 used_kib; /* offset 24 */
	char path[64]; /* offset 32 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_swap, type) == 0, "vsym_swap.type");
_Static_assert(__builtin_offsetof(struct vsym_swap, prio) == 4, "vsym_swap.prio");
_Static_assert(__builtin_offsetof(struct vsym_swap, flags) == 8, "vsym_swap.flags");
_Static_assert(__builtin_offsetof(struct vsym_swap, pad) == 12, "vsym_swap.pad");
_Static_assert(__builtin_offsetof(struct vsym_swap, size_kib) == 16, "vsym_swap.size_kib");
_Static_assert(__builtin_offsetof(struct vsym_swap, used_kib) == 24, "vsym_swap.used_kib");
_Static_assert(__builtin_offsetof(struct vsym_swap, path) == 32, "vsym_swap.path");
_Static_assert(sizeof(struct vsym_swap) <= 96, "vsym_swap size");

struct vsym_cpu {
	__u32 seq; /* offset 0 */
	__s32 pid; /* offset 4 */
	__s32 tgid; /* offset 8 */
	__u32 pad; /* offset 12 */
	__u64 switches; /* offset 16 */
	char comm[16]; /* offset 24 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_cpu, seq) == 0, "vsym_cpu.seq");
_Static_assert(__builtin_offsetof(struct vsym_cpu, pid) == 4, "vsym_cpu.pid");
_Static_assert(__builtin_offsetof(struct vsym_cpu, tgid) == 8, "vsym_cpu.tgid");
_Static_assert(__builtin_offsetof(struct vsym_cpu, pad) == 12, "vsym_cpu.pad");
_Static_assert(__builtin_offsetof(struct vsym_cpu, switches) == 16, "vsym_cpu.switches");
_Static_assert(__builtin_offsetof(struct vsym_cpu, comm) == 24, "vsym_cpu.comm");
_Static_assert(sizeof(struct vsym_cpu) <= 40, "vsym_cpu size");

struct vsym_vmm {
	__u64 magic; /* offset 0 */
	__u32 abi; /* offset 8 */
	__u32 features; /* offset 12 */
	__u32 state; /* offset 16 */
	__u32 refuse_reason; /* offset 20 */
	__u32 vmm_peer; /* offset 24 */
	__u32 refresh_ms; /* offset 28 */
	char vmsight_version[32]; /* offset 32 */
	__u32 nr_hints; /* offset 64 */
	__u32 answered_hello; /* offset 68 */
	struct vsym_hint hints[16]; /* offset 72 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_vmm, magic) == 0, "vsym_vmm.magic");
_Static_assert(__builtin_offsetof(struct vsym_vmm, abi) == 8, "vsym_vmm.abi");
_Static_assert(__builtin_offsetof(struct vsym_vmm, features) == 12, "vsym_vmm.features");
_Static_assert(__builtin_offsetof(struct vsym_vmm, state) == 16, "vsym_vmm.state");
_Static_assert(__builtin_offsetof(struct vsym_vmm, refuse_reason) == 20, "vsym_vmm.refuse_reason");
_Static_assert(__builtin_offsetof(struct vsym_vmm, vmm_peer) == 24, "vsym_vmm.vmm_peer");
_Static_assert(__builtin_offsetof(struct vsym_vmm, refresh_ms) == 28, "vsym_vmm.refresh_ms");
_Static_assert(__builtin_offsetof(struct vsym_vmm, vmsight_version) == 32, "vsym_vmm.vmsight_version");
_Static_assert(__builtin_offsetof(struct vsym_vmm, nr_hints) == 64, "vsym_vmm.nr_hints");
_Static_assert(__builtin_offsetof(struct vsym_vmm, answered_hello) == 68, "vsym_vmm.answered_hello");
_Static_assert(__builtin_offsetof(struct vsym_vmm, hints) == 72, "vsym_vmm.hints");
_Static_assert(sizeof(struct vsym_vmm) <= 4096, "vsym_vmm size");
#define VSYM_VMM_OFFSET 0x0

struct vsym_guest {
	__u64 magic; /* offset 0 */
	__u32 abi; /* offset 8 */
	__u32 state; /* offset 12 */
	__u32 seq; /* offset 16 */
	__u32 peer; /* offset 20 */
	__u32 nr_cpus; /* offset 24 */
	__u32 refresh_ms; /* offset 28 */
	__u64 updated_ns; /* offset 32 */
	__u64 refreshes; /* offset 40 */
	__u64 symcalls[2]; /* offset 48 */
	__u64 sync_entry; /* offset 64 */
	__u64 sync_return; /* offset 72 */
	__u64 sync_stack; /* offset 80 */
	__u64 hello_id; /* offset 88 */
	char release[64]; /* offset 96 */
	char version[64]; /* offset 160 */
	__u64 mem_total_kib; /* offset 224 */
	__u64 mem_free_kib; /* offset 232 */
	__u64 mem_available_kib; /* offset 240 */
	__u64 swap_total_kib; /* offset 248 */
	__u64 swap_free_kib; /* offset 256 */
	__u64 pswpin; /* offset 264 */
	__u64 pswpout; /* offset 272 */
	__u32 nr_swap; /* offset 280 */
	__u32 pad2; /* offset 284 */
	struct vsym_swap swaps[8]; /* offset 288 */
	__u8 gap_1056[32];
	struct vsym_cpu cpus[64]; /* offset 1088 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_guest, magic) == 0, "vsym_guest.magic");
_Static_assert(__builtin_offsetof(struct vsym_guest, abi) == 8, "vsym_guest.abi");
_Static_assert(__builtin_offsetof(struct vsym_guest, state) == 12, "vsym_guest.state");
_Static_assert(__builtin_offsetof(struct vsym_guest, seq) == 16, "vsym_guest.seq");
_Static_assert(__builtin_offsetof(struct vsym_guest, peer) == 20, "vsym_guest.peer");
_Static_assert(__builtin_offsetof(struct vsym_guest, nr_cpus) == 24, "vsym_guest.nr_cpus");
_Static_assert(__builtin_offsetof(struct vsym_guest, refresh_ms) == 28, "vsym_guest.refresh_ms");
_Static_assert(__builtin_offsetof(struct vsym_guest, updated_ns) == 32, "vsym_guest.updated_ns");
_Static_assert(__builtin_offsetof(struct vsym_guest, refreshes) == 40, "vsym_guest.refreshes");
_Static_assert(__builtin_offsetof(struct vsym_guest, symcalls) == 48, "vsym_guest.symcalls");
_Static_assert(__builtin_offsetof(struct vsym_guest, sync_entry) == 64, "vsym_guest.sync_entry");
_Static_assert(__builtin_offsetof(struct vsym_guest, sync_return) == 72, "vsym_guest.sync_return");
_Static_assert(__builtin_offsetof(struct vsym_guest, sync_stack) == 80, "vsym_guest.sync_stack");
_Static_assert(__builtin_offsetof(struct vsym_guest, hello_id) == 88, "vsym_guest.hello_id");
_Static_assert(__builtin_offsetof(struct vsym_guest, release) == 96, "vsym_guest.release");
_Static_assert(__builtin_offsetof(struct vsym_guest, version) == 160, "vsym_guest.version");
_Static_assert(__builtin_offsetof(struct vsym_guest, mem_total_kib) == 224, "vsym_guest.mem_total_kib");
_Static_assert(__builtin_offsetof(struct vsym_guest, mem_free_kib) == 232, "vsym_guest.mem_free_kib");
_Static_assert(__builtin_offsetof(struct vsym_guest, mem_available_kib) == 240, "vsym_guest.mem_available_kib");
_Static_assert(__builtin_offsetof(struct vsym_guest, swap_total_kib) == 248, "vsym_guest.swap_total_kib");
_Static_assert(__builtin_offsetof(struct vsym_guest, swap_free_kib) == 256, "vsym_guest.swap_free_kib");
_Static_assert(__builtin_offsetof(struct vsym_guest, pswpin) == 264, "vsym_guest.pswpin");
_Static_assert(__builtin_offsetof(struct vsym_guest, pswpout) == 272, "vsym_guest.pswpout");
_Static_assert(__builtin_offsetof(struct vsym_guest, nr_swap) == 280, "vsym_guest.nr_swap");
_Static_assert(__builtin_offsetof(struct vsym_guest, pad2) == 284, "vsym_guest.pad2");
_Static_assert(__builtin_offsetof(struct vsym_guest, swaps) == 288, "vsym_guest.swaps");
_Static_assert(__builtin_offsetof(struct vsym_guest, cpus) == 1088, "vsym_guest.cpus");
_Static_assert(sizeof(struct vsym_guest) <= 8192, "vsym_guest size");
#define VSYM_GUEST_OFFSET 0x1000

struct vsym_call {
	__u64 seq; /* offset 0 */
	__u32 state; /* offset 8 */
	__u32 transport; /* offset 12 */
	__u32 nr; /* offset 16 */
	__u32 pad; /* offset 20 */
	__u64 args[5]; /* offset 24 */
	__u64 done_seq; /* offset 64 */
	__s64 ret; /* offset 72 */
	__u64 rets[4]; /* offset 80 */
	__u32 data_len; /* offset 112 */
	__u32 pad2; /* offset 116 */
	__u64 reserved; /* offset 120 */
	char data[3968]; /* offset 128 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_call, seq) == 0, "vsym_call.seq");
_Static_assert(__builtin_offsetof(struct vsym_call, state) == 8, "vsym_call.state");
_Static_assert(__builtin_offsetof(struct vsym_call, transport) == 12, "vsym_call.transport");
_Static_assert(__builtin_offsetof(struct vsym_call, nr) == 16, "vsym_call.nr");
_Static_assert(__builtin_offsetof(struct vsym_call, pad) == 20, "vsym_call.pad");
_Static_assert(__builtin_offsetof(struct vsym_call, args) == 24, "vsym_call.args");
_Static_assert(__builtin_offsetof(struct vsym_call, done_seq) == 64, "vsym_call.done_seq");
_Static_assert(__builtin_offsetof(struct vsym_call, ret) == 72, "vsym_call.ret");
_Static_assert(__builtin_offsetof(struct vsym_call, rets) == 80, "vsym_call.rets");
_Static_assert(__builtin_offsetof(struct vsym_call, data_len) == 112, "vsym_call.data_len");
_Static_assert(__builtin_offsetof(struct vsym_call, pad2) == 116, "vsym_call.pad2");
_Static_assert(__builtin_offsetof(struct vsym_call, reserved) == 120, "vsym_call.reserved");
_Static_assert(__builtin_offsetof(struct vsym_call, data) == 128, "vsym_call.data");
_Static_assert(sizeof(struct vsym_call) <= 4096, "vsym_call size");
#define VSYM_CALL_OFFSET 0x3000

struct vsym_swaphdr {
	__u64 magic; /* offset 0 */
	__u32 abi; /* offset 8 */
	__u32 vmm_state; /* offset 12 */
	__u64 swap_pages; /* offset 16 */
	__u32 slots; /* offset 24 */
	__u32 lock; /* offset 28 */
	__u64 index_off; /* offset 32 */
	__u64 meta_off; /* offset 40 */
	__u64 stack_off; /* offset 48 */
	__u64 data_off; /* offset 56 */
	__u32 free_top; /* offset 64 */
	__u32 used; /* offset 68 */
	__u32 guest_state; /* offset 72 */
	__u32 limit; /* offset 76 */
	__u64 region_size; /* offset 80 */
	__u8 gap_88[40];
	__u64 g_stores; /* offset 128 */
	__u64 g_store_full; /* offset 136 */
	__u64 g_loads; /* offset 144 */
	__u64 g_load_misses; /* offset 152 */
	__u64 g_invalidates; /* offset 160 */
	__u64 g_busy; /* offset 168 */
	__u64 g_lower_reads; /* offset 176 */
	__u64 g_lower_writes; /* offset 184 */
	__u64 g_corrupt; /* offset 192 */
	__u64 g_deferred; /* offset 200 */
} __attribute__((packed, aligned(8)));
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, magic) == 0, "vsym_swaphdr.magic");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, abi) == 8, "vsym_swaphdr.abi");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, vmm_state) == 12, "vsym_swaphdr.vmm_state");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, swap_pages) == 16, "vsym_swaphdr.swap_pages");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, slots) == 24, "vsym_swaphdr.slots");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, lock) == 28, "vsym_swaphdr.lock");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, index_off) == 32, "vsym_swaphdr.index_off");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, meta_off) == 40, "vsym_swaphdr.meta_off");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, stack_off) == 48, "vsym_swaphdr.stack_off");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, data_off) == 56, "vsym_swaphdr.data_off");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, free_top) == 64, "vsym_swaphdr.free_top");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, used) == 68, "vsym_swaphdr.used");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, guest_state) == 72, "vsym_swaphdr.guest_state");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, limit) == 76, "vsym_swaphdr.limit");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, region_size) == 80, "vsym_swaphdr.region_size");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_stores) == 128, "vsym_swaphdr.g_stores");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_store_full) == 136, "vsym_swaphdr.g_store_full");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_loads) == 144, "vsym_swaphdr.g_loads");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_load_misses) == 152, "vsym_swaphdr.g_load_misses");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_invalidates) == 160, "vsym_swaphdr.g_invalidates");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_busy) == 168, "vsym_swaphdr.g_busy");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_lower_reads) == 176, "vsym_swaphdr.g_lower_reads");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_lower_writes) == 184, "vsym_swaphdr.g_lower_writes");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_corrupt) == 192, "vsym_swaphdr.g_corrupt");
_Static_assert(__builtin_offsetof(struct vsym_swaphdr, g_deferred) == 200, "vsym_swaphdr.g_deferred");
_Static_assert(sizeof(struct vsym_swaphdr) <= 4096, "vsym_swaphdr size");

#endif /* VMSIGHT_SYM_ABI_H */
