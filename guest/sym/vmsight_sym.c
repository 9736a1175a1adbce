// SPDX-License-Identifier: GPL-2.0
/*
 * vmsight_sym: the guest half of vmsight's symbiotic interface (docs/symbiotic.md), after
 * SymCall (Lange & Dinda, VEE'11): a passive page the VMM reads (SymSpy) and upcalls the VMM
 * makes into the guest kernel (symcalls), numbered like system calls.
 *
 * The layout of the shared region, every number and every state come from
 * vmsight_sym_abi.h, which is generated from crates/proto/src/sym.rs (the definition).
 *
 *  - Discovery: fw_cfg file "opt/vmsight/sym" ("abi=2 features=0x7 size=65536 vectors=2"),
 *    read here through the legacy fw_cfg I/O ports (qemu_fw_cfg.ko is not needed).
 *  - Device: PCI ivshmem-doorbell 1af4:1110. BAR0 = registers, BAR2 = the 64 KiB region
 *    (VMM page 0x0000, SymSpy page 0x1000, call page 0x3000), MSI-X vector 0 = calls,
 *    vector 1 = state changes. Only a device whose VMM page carries VSYM_VMM_MAGIC is taken.
 *  - Handshake: the module writes its interface version; vmsight accepts or refuses it.
 *  - SymSpy: kernel release, symcall bitmap, memory and swap counters, swap devices
 *    (refreshed every refresh_ms under the page's seqlock), and what each CPU runs (written
 *    at every context switch by a sched_switch tracepoint probe).
 *  - Symcalls: one table of handlers indexed by number. Handlers never sleep and never wait
 *    for a lock (trylock, or -EWOULDBLOCK), because the same handlers run on the synchronous
 *    transport, where the VMM redirected a vCPU at an arbitrary point of the guest kernel
 *    (SymCall §5.5). Two transports:
 *      doorbell: vmsight posts a call in the call page and rings our vector 0; PING is
 *        answered in the hard interrupt handler, everything else in the irq thread; the
 *        answer is signalled by ringing vmsight's vector 0.
 *      sync: vmsight (QEMU 11 vCPU redirection) enters vsym_sync_stub on sync_stack with
 *        interrupts disabled and the return address sync_return; results go to the call page
 *        as well and the return value is the call's ret.
 *
 *  - SwapBypass (vmsight_sym_swap.c, #included below): a second ivshmem device whose BAR2 is
 *    a swap cache vmsight owns; the block device vmswap0, stacked on the swap disk, swaps
 *    pages in and out of it without block I/O.
 *
 * Everything read from the shared region is untrusted: numbers are bounded, nothing read from
 * it is used as a pointer or a length, and the module keeps its own copies of its sequence
 * counters.
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/types.h>
#include <linux/pci.h>
#include <linux/random.h>
#include <linux/ctype.h>
#include <linux/io.h>
#include <linux/interrupt.h>
#include <linux/delay.h>
#include <linux/workqueue.h>
#include <linux/slab.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/sched/mm.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/fdtable.h>
#include <linux/fs_struct.h>
#include <linux/fs.h>
#include <linux/dcache.h>
#include <linux/mm.h>
#include <linux/mmap_lock.h>
#include <linux/pgtable.h>
#include <linux/swap.h>
#include <linux/swapops.h>
#include <linux/vmstat.h>
#include <linux/utsname.h>
#include <linux/kprobes.h>
#include <linux/tracepoint.h>
#include <linux/seqlock.h>
#include <linux/spinlock.h>
#include <linux/rcupdate.h>
#include <linux/nospec.h>
#include <linux/ratelimit.h>
#include <linux/string.h>
#include <linux/moduleparam.h>
#include <uapi/linux/qemu_fw_cfg.h>
#include <asm/msr.h>
#include <asm/cpufeature.h>

#include "vmsight_sym_abi.h"

/* Every message starts with "vmsight_sym: ", also in the test build vmsight_sym_v99. */
#undef pr_fmt
#define pr_fmt(fmt) "vmsight_sym: " fmt

/* The interface version this module speaks (-DVSYM_MODULE_ABI=N builds a module for another
 * version, which vmsight and this module must refuse). */
#ifndef VSYM_MODULE_ABI
#define VSYM_MODULE_ABI VSYM_ABI_VERSION
#endif

/* ivshmem BAR0 registers (QEMU docs/specs/ivshmem-spec.rst). */
#define IVSHMEM_INTR_MASK 0x00
#define IVSHMEM_INTR_STATUS 0x04
#define IVSHMEM_IV_POSITION 0x08
#define IVSHMEM_DOORBELL 0x0c
#define IVSHMEM_REGS_SIZE 0x100

/* Legacy fw_cfg I/O ports (x86). */
#define FW_CFG_PORT_SEL 0x510
#define FW_CFG_PORT_DATA 0x511
#define FW_CFG_MAX_FILES 1024

#define VSYM_SYNC_STACK_SIZE (16 * 1024)
#define VSYM_HANDSHAKE_MS 3000
#define VSYM_REFRESH_DEFAULT_MS 200
#define VSYM_REFRESH_MIN_MS 20
#define VSYM_REFRESH_MAX_MS 10000
#define VSYM_MAX_SWAPS 8
#define VSYM_MAX_CPUS 64
#define VSYM_SPIN_MAX_MS 60000

/* Capacities, checked against the generated layout. */
static_assert(sizeof(((struct vsym_guest *)0)->swaps) == VSYM_MAX_SWAPS * sizeof(struct vsym_swap));
static_assert(sizeof(((struct vsym_guest *)0)->cpus) == VSYM_MAX_CPUS * sizeof(struct vsym_cpu));
static_assert(sizeof(struct vsym_swap) == 96);
#define VSYM_CALL_DATA ((u32)sizeof(((struct vsym_call *)0)->data))
static_assert(VSYM_CALL_OFFSET + sizeof(struct vsym_call) <= VSYM_REGION_SIZE);
static_assert(VSYM_GUEST_OFFSET + sizeof(struct vsym_guest) <= VSYM_CALL_OFFSET);

static unsigned int refresh_ms;
module_param(refresh_ms, uint, 0444);
MODULE_PARM_DESC(refresh_ms,
		 "SymSpy refresh period in ms (0: vmsight's choice, default 200; clamped to 20..10000)");

/* Counters, read-only in /sys/module/vmsight_sym/parameters/. */
static atomic_long_t vsym_spurious = ATOMIC_LONG_INIT(0); /* doorbells with nothing posted */
static atomic_long_t vsym_calls = ATOMIC_LONG_INIT(0); /* doorbell calls answered */
static atomic_long_t vsym_sync_calls = ATOMIC_LONG_INIT(0); /* synchronous entries */
static atomic_long_t vsym_stale = ATOMIC_LONG_INIT(0); /* answers dropped: call replaced */

static int vsym_counter_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%ld\n", atomic_long_read((atomic_long_t *)kp->arg));
}

static int vsym_counter_set(const char *val, const struct kernel_param *kp)
{
	return -EPERM;
}

static const struct kernel_param_ops vsym_counter_ops = {
	.set = vsym_counter_set,
	.get = vsym_counter_get,
};
module_param_cb(spurious_doorbells, &vsym_counter_ops, &vsym_spurious, 0444);
MODULE_PARM_DESC(spurious_doorbells, "call doorbells with no call posted (read-only counter)");
module_param_cb(doorbell_calls, &vsym_counter_ops, &vsym_calls, 0444);
MODULE_PARM_DESC(doorbell_calls, "symcalls answered over the doorbell transport (read-only)");
module_param_cb(sync_calls, &vsym_counter_ops, &vsym_sync_calls, 0444);
MODULE_PARM_DESC(sync_calls, "synchronous entries (read-only counter)");
module_param_cb(stale_answers, &vsym_counter_ops, &vsym_stale, 0444);
MODULE_PARM_DESC(stale_answers, "answers dropped because vmsight replaced the call (read-only)");

/* Non-exported kernel symbols, resolved through kallsyms_lookup_name. */
struct vsym_ksyms {
	struct swap_info_struct **swap_info;
	unsigned int *nr_swapfiles;
	spinlock_t *swap_lock;
	long *total_swap_pages;
	seqlock_t *mount_lock;
};

static struct {
	/* fw_cfg announcement. */
	u32 fw_abi;
	u32 fw_features;
	u32 fw_size;
	u32 fw_vectors;

	struct pci_dev *pdev;
	void __iomem *regs;
	void *region;
	struct vsym_vmm *vmm;
	struct vsym_guest *guest;
	struct vsym_call *call;
	u32 peer; /* our ivshmem peer id (IVPosition) */
	u32 vmm_peer; /* vmsight's peer id, read once at probe */
	u32 features; /* announced features */
	u32 refresh_ms;
	u32 guest_state;
	u32 hello_id; /* this load's hello: vmsight echoes it in answered_hello */
	u32 page_seq; /* our copy of guest->seq */
	u64 refreshes;
	u64 symcalls[2];

	bool vectors_on;
	bool call_irq_on;
	bool state_irq_on;
	bool spy_on; /* tracepoint probe writes cpus[] */
	bool work_on;
	bool active; /* handshake done: calls are answered */
	bool vmm_gone; /* vmsight said GONE */
	bool stopping; /* module is being removed */

	struct tracepoint *tp_switch;
	struct delayed_work work;
	void *sync_stack;
	struct vsym_ksyms ks;
	bool ks_ok;
	int probe_err;
} vsym;

/*
 * vmsight's per-device hints (the VMM page), for the guest's own tools: one line per disk,
 * "disk INDEX SERIAL FLAGS" in /sys/module/vmsight_sym/parameters/hints (read-only). The page
 * is vmsight's, but it is read like anything shared: count and strings bounded here.
 */
static int vsym_hints_get(char *buf, const struct kernel_param *kp)
{
	static const struct {
		u32 bit;
		const char *name;
	} names[] = {
		{ VSYM_HINT_READONLY, "read-only" }, { VSYM_HINT_ICACHE, "icache" },
		{ VSYM_HINT_DEDUP, "dedup" },	      { VSYM_HINT_DISK_MODEL, "disk-model" },
		{ VSYM_HINT_STREAMED, "streamed" },
	};
	struct vsym_vmm *v = READ_ONCE(vsym.vmm);
	int len = 0;
	u32 n, i, j;

	if (!v)
		return 0;
	n = min_t(u32, READ_ONCE(v->nr_hints), ARRAY_SIZE(v->hints));
	for (i = 0; i < n; i++) {
		char serial[sizeof(v->hints[0].serial) + 1];
		u32 flags = READ_ONCE(v->hints[i].flags), any = 0;

		memcpy(serial, v->hints[i].serial, sizeof(serial) - 1);
		serial[sizeof(serial) - 1] = 0;
		for (j = 0; serial[j]; j++)
			if (!isgraph(serial[j]))
				serial[j] = '?';
		if (READ_ONCE(v->hints[i].kind) != VSYM_HINT_KIND_DISK)
			continue;
		len += sysfs_emit_at(buf, len, "disk %u %s", READ_ONCE(v->hints[i].index),
				     serial[0] ? serial : "-");
		for (j = 0; j < ARRAY_SIZE(names); j++)
			if (flags & names[j].bit)
				len += sysfs_emit_at(buf, len, "%s%s", any++ ? "," : " ",
						     names[j].name);
		len += sysfs_emit_at(buf, len, "\n");
	}
	return len;
}

static const struct kernel_param_ops vsym_hints_ops = {
	.set = vsym_counter_set,
	.get = vsym_hints_get,
};
module_param_cb(hints, &vsym_hints_ops, NULL, 0444);
MODULE_PARM_DESC(hints, "vmsight's per-device hints: disk INDEX SERIAL FLAGS (read-only)");

/* Handler execution is exclusive (it owns the scratch buffers below). */
static atomic_t vsym_busy = ATOMIC_INIT(0);
/* Claiming a posted call and publishing an answer on the call page. */
static DEFINE_SPINLOCK(vsym_call_lock);
/* Synchronous entries currently executing (module removal waits for them). */
static atomic_t vsym_sync_inflight = ATOMIC_INIT(0);

/* A handler's output data and d_path scratch (owned by the vsym_busy holder). */
static char vsym_out[sizeof(((struct vsym_call *)0)->data)] __aligned(8);
static char vsym_pathbuf[PATH_MAX];
/* The refresh work's own scratch (it runs concurrently with handlers). */
static char vsym_work_pathbuf[PATH_MAX];
static struct vsym_swap vsym_work_swaps[VSYM_MAX_SWAPS];

static DEFINE_PER_CPU(u32, vsym_cpu_seq);
static DEFINE_PER_CPU(u64, vsym_cpu_switches);

static inline bool vsym_live(void)
{
	return READ_ONCE(vsym.active) && !READ_ONCE(vsym.vmm_gone) && !READ_ONCE(vsym.stopping);
}

/* Rings vmsight's vector VEC. */
static void vsym_ring(u32 vec)
{
	if (vsym.regs)
		iowrite32(((vsym.vmm_peer & 0xffff) << 16) | (vec & 0xffff),
			  vsym.regs + IVSHMEM_DOORBELL);
}

/* --- fw_cfg -------------------------------------------------------------------------------- */

static void fwcfg_select(u16 key)
{
	outw(key, FW_CFG_PORT_SEL);
}

static void fwcfg_read(void *buf, size_t len)
{
	u8 *p = buf;

	while (len--)
		*p++ = inb(FW_CFG_PORT_DATA);
}

/* Reads the announcement into BUF (NUL-terminated). -ENODEV if there is no fw_cfg or no such
 * file. */
static int fwcfg_read_announcement(char *buf, size_t len)
{
	char sig[4];
	__be32 count_be;
	u32 count, i;

	/* Never poke I/O ports on bare metal. */
	if (!boot_cpu_has(X86_FEATURE_HYPERVISOR))
		return -ENODEV;
	fwcfg_select(FW_CFG_SIGNATURE);
	fwcfg_read(sig, sizeof(sig));
	if (memcmp(sig, "QEMU", 4))
		return -ENODEV;
	fwcfg_select(FW_CFG_FILE_DIR);
	fwcfg_read(&count_be, sizeof(count_be));
	count = min_t(u32, be32_to_cpu(count_be), FW_CFG_MAX_FILES);
	for (i = 0; i < count; i++) {
		struct fw_cfg_file f;
		u32 size;

		fwcfg_read(&f, sizeof(f));
		f.name[sizeof(f.name) - 1] = 0;
		if (strcmp(f.name, VSYM_FW_CFG_NAME))
			continue;
		size = min_t(u32, be32_to_cpu(f.size), len - 1);
		fwcfg_select(be16_to_cpu(f.select));
		fwcfg_read(buf, size);
		buf[size] = 0;
		return 0;
	}
	return -ENODEV;
}

/* "abi=2 features=0x7 size=65536 vectors=2" */
static void fwcfg_parse(char *s)
{
	char *tok;

	while ((tok = strsep(&s, " \t\r\n")) != NULL) {
		char *val = strchr(tok, '=');
		u32 v;

		if (!val)
			continue;
		*val++ = 0;
		if (kstrtou32(val, 0, &v))
			continue;
		if (!strcmp(tok, "abi"))
			vsym.fw_abi = v;
		else if (!strcmp(tok, "features"))
			vsym.fw_features = v;
		else if (!strcmp(tok, "size"))
			vsym.fw_size = v;
		else if (!strcmp(tok, "vectors"))
			vsym.fw_vectors = v;
	}
}

/* --- kernel symbols ------------------------------------------------------------------------ */

static unsigned long vsym_kallsyms(const char *name)
{
	static unsigned long (*lookup)(const char *name);

	if (!lookup) {
		struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };
		unsigned long addr;

		if (register_kprobe(&kp) < 0)
			return 0;
		addr = (unsigned long)kp.addr;
		unregister_kprobe(&kp);
		/* With IBT the probe sits after the function's endbr64 (f3 0f 1e fa). */
		if (addr && *(u32 *)(addr - 4) == 0xfa1e0ff3)
			addr -= 4;
		lookup = (void *)addr;
		if (!lookup)
			return 0;
	}
	return lookup(name);
}

static void vsym_resolve(void)
{
	struct vsym_ksyms *k = &vsym.ks;

	k->swap_info = (void *)vsym_kallsyms("swap_info");
	k->nr_swapfiles = (void *)vsym_kallsyms("nr_swapfiles");
	k->swap_lock = (void *)vsym_kallsyms("swap_lock");
	k->total_swap_pages = (void *)vsym_kallsyms("total_swap_pages");
	k->mount_lock = (void *)vsym_kallsyms("mount_lock");
	vsym.ks_ok = k->swap_info && k->nr_swapfiles && k->swap_lock && k->total_swap_pages;
	if (!vsym.ks_ok)
		pr_warn("cannot resolve swap_info/nr_swapfiles/swap_lock/total_swap_pages: no swap data\n");
	if (!k->mount_lock)
		pr_warn("cannot resolve mount_lock: synchronous calls return no paths\n");
}

/* --- helpers for handlers (never sleep, never wait for a lock) ----------------------------- */

struct vsym_ctx {
	u64 args[5];
	u64 rets[4];
	char *data; /* vsym_out */
	u32 len;
	u32 transport;
};

/* Appends the string S (LEN bytes) and a NUL, truncated to what fits. */
static void vsym_put(struct vsym_ctx *c, const char *s, size_t len)
{
	size_t room;

	if (c->len >= VSYM_CALL_DATA)
		return;
	room = VSYM_CALL_DATA - c->len - 1;
	len = min(len, room);
	memcpy(c->data + c->len, s, len);
	c->data[c->len + len] = 0;
	c->len += len + 1;
}

static inline bool vsym_seq_busy(seqlock_t *sl)
{
	return (raw_read_seqcount(&sl->seqcount) & 1) || spin_is_locked(&sl->lock);
}

/*
 * d_path without waiting. On the doorbell transport (an irq thread) d_path can only spin for
 * a writer on another CPU. On the synchronous transport the interrupted context may hold
 * rename_lock, mount_lock or current->fs->seq for writing (d_path would spin for ever), or
 * current may have no fs (exiting): refuse with -EWOULDBLOCK then.
 */
static char *vsym_d_path(const struct path *path, u32 transport, char *buf, int len)
{
	if (transport == VSYM_TRANSPORT_SYNC) {
		struct fs_struct *fs = READ_ONCE(current->fs);

		if (!fs || (raw_read_seqcount(&fs->seq) & 1))
			return ERR_PTR(-EWOULDBLOCK);
		if (!vsym.ks.mount_lock || vsym_seq_busy(vsym.ks.mount_lock) ||
		    vsym_seq_busy(&rename_lock))
			return ERR_PTR(-EWOULDBLOCK);
	}
	return d_path(path, buf, len);
}

/* Appends the path (or an empty string when it cannot be named); -EWOULDBLOCK passes up. */
static long vsym_put_path(struct vsym_ctx *c, const struct path *path)
{
	char *p = vsym_d_path(path, c->transport, vsym_pathbuf, sizeof(vsym_pathbuf));

	if (IS_ERR(p)) {
		if (PTR_ERR(p) == -EWOULDBLOCK)
			return -EWOULDBLOCK;
		vsym_put(c, "", 0);
		return 0;
	}
	vsym_put(c, p, strnlen(p, vsym_pathbuf + sizeof(vsym_pathbuf) - p));
	return 0;
}

/* The task with pid PID in the initial pid namespace. Caller holds rcu_read_lock. */
static struct task_struct *vsym_task(u64 pid)
{
	struct pid *p;

	if (pid == 0 || pid > PID_MAX_LIMIT)
		return NULL;
	p = find_pid_ns((int)pid, &init_pid_ns);
	return p ? pid_task(p, PIDTYPE_PID) : NULL;
}

/*
 * The task with this pid, its alloc_lock (task_lock) taken if it was free: that lock keeps
 * ->mm, ->fs, ->files and ->comm. Call under rcu_read_lock(); on success unlock with
 * spin_unlock(&(*t)->alloc_lock). -ESRCH without such a task, -EWOULDBLOCK if the lock is held
 * (a handler never waits: the interrupted context may hold it).
 */
static long vsym_task_locked(u64 pid, struct task_struct **t)
{
	*t = vsym_task(pid);
	if (!*t)
		return -ESRCH;
	if (!spin_trylock(&(*t)->alloc_lock)) {
		*t = NULL;
		return -EWOULDBLOCK;
	}
	return 0;
}

/* Sum of an event over all CPUs, lock-free (all_vm_events takes cpus_read_lock). */
static u64 vsym_vm_event(enum vm_event_item item)
{
	u64 sum = 0;
	int cpu;

	for_each_possible_cpu(cpu)
		sum += per_cpu(vm_event_states, cpu).event[item];
	return sum;
}

/*
 * The swap devices like /proc/swaps (slot in use, swap_map and swap_file set), at most MAX
 * into OUT, and the totals like /proc/meminfo (si_swapinfo). ATOMIC: only try swap_lock.
 * Returns the number of records written, or a negative errno.
 */
static int vsym_collect_swaps(struct vsym_swap *out, int max, bool atomic, u32 transport,
			      char *pathbuf, u64 *total_kib, u64 *free_kib)
{
	struct vsym_ksyms *k = &vsym.ks;
	unsigned long to_be_unused = 0;
	unsigned int type, nr;
	int n = 0;
	long err = 0;

	*total_kib = *free_kib = 0;
	if (!vsym.ks_ok)
		return -ENOSYS;
	if (atomic) {
		if (!spin_trylock(k->swap_lock))
			return -EWOULDBLOCK;
	} else {
		spin_lock(k->swap_lock);
	}
	nr = min_t(unsigned int, READ_ONCE(*k->nr_swapfiles), MAX_SWAPFILES);
	for (type = 0; type < nr; type++) {
		struct swap_info_struct *si = READ_ONCE(k->swap_info[type]);
		struct vsym_swap rec;
		struct file *file;
		unsigned long flags;
		char *p;

		if (!si)
			continue;
		flags = READ_ONCE(si->flags);
		if ((flags & SWP_USED) && !(flags & SWP_WRITEOK))
			to_be_unused += READ_ONCE(si->inuse_pages);
		file = READ_ONCE(si->swap_file);
		if (!(flags & SWP_USED) || !READ_ONCE(si->swap_map) || !file || n >= max)
			continue;
		memset(&rec, 0, sizeof(rec));
		rec.type = type;
		rec.prio = si->prio;
		rec.flags = (flags & SWP_WRITEOK) ? VSYM_SWAP_WRITEOK : 0;
		if (file_inode(file) && S_ISBLK(file_inode(file)->i_mode))
			rec.flags |= VSYM_SWAP_BLOCKDEV;
		rec.size_kib = (u64)si->pages << (PAGE_SHIFT - 10);
		rec.used_kib = (u64)READ_ONCE(si->inuse_pages) << (PAGE_SHIFT - 10);
		p = vsym_d_path(&file->f_path, transport, pathbuf, PATH_MAX);
		if (IS_ERR(p)) {
			if (PTR_ERR(p) == -EWOULDBLOCK) {
				err = -EWOULDBLOCK;
				break;
			}
		} else {
			strscpy(rec.path, p, sizeof(rec.path));
		}
		memcpy(&out[n++], &rec, sizeof(rec));
	}
	*total_kib = (u64)(READ_ONCE(*k->total_swap_pages) + to_be_unused) << (PAGE_SHIFT - 10);
	*free_kib = (u64)(atomic_long_read(&nr_swap_pages) + to_be_unused) << (PAGE_SHIFT - 10);
	spin_unlock(k->swap_lock);
	return err ? err : n;
}

/* --- handlers ------------------------------------------------------------------------------ */

static long vsym_h_ping(struct vsym_ctx *c)
{
	return 0;
}

static long vsym_h_echo(struct vsym_ctx *c)
{
	int i;

	for (i = 0; i < 4; i++)
		c->rets[i] = c->args[i + 1];
	return (long)(c->args[0] & LLONG_MAX);
}

/* task_info(pid): rets = [tgid, ppid, threads, flags], data "comm\0exe\0cwd\0". */
static long vsym_h_task_info(struct vsym_ctx *c)
{
	struct task_struct *t;
	char comm[TASK_COMM_LEN];
	long ret = 0;

	rcu_read_lock();
	ret = vsym_task_locked(c->args[0], &t);
	if (ret)
		goto out;
	c->rets[0] = t->tgid;
	c->rets[1] = pid_alive(t) ? rcu_dereference(t->real_parent)->tgid : 0;
	c->rets[2] = t->signal ? get_nr_threads(t) : 0;
	c->rets[3] = (t->flags & PF_KTHREAD) ? 1 : 0;
	memcpy(comm, t->comm, sizeof(comm));
	comm[sizeof(comm) - 1] = 0;
	vsym_put(c, comm, strlen(comm));

	/* exe: mm->exe_file is RCU-managed; the mm cannot go while task_lock is held. */
	if (!(t->flags & PF_KTHREAD) && t->mm) {
		struct file *exe = rcu_dereference(t->mm->exe_file);

		if (exe)
			ret = vsym_put_path(c, &exe->f_path);
		else
			vsym_put(c, "", 0);
	} else {
		vsym_put(c, "", 0);
	}
	/* cwd: fs->lock keeps pwd (chdir takes it), so no reference is needed. */
	if (!ret) {
		struct fs_struct *fs = t->fs;

		if (!fs) {
			vsym_put(c, "", 0);
		} else if (!spin_trylock(&fs->lock)) {
			ret = -EWOULDBLOCK;
		} else {
			struct path pwd = fs->pwd;

			if (pwd.dentry && pwd.mnt)
				ret = vsym_put_path(c, &pwd);
			else
				vsym_put(c, "", 0);
			spin_unlock(&fs->lock);
		}
	}
	spin_unlock(&t->alloc_lock);
out:
	rcu_read_unlock();
	return ret;
}

/* fd_path(pid, fd): rets = [f_flags, f_pos, ino, size], data the path. */
static long vsym_h_fd_path(struct vsym_ctx *c)
{
	struct task_struct *t;
	struct files_struct *files;
	struct file *file = NULL;
	long ret = 0;
	u64 fd = c->args[1];

	rcu_read_lock();
	/*
	 * Like task_lookup_next_fd_rcu (exported), which takes task_lock unconditionally: here
	 * only tried. task_lock keeps ->files; files stay valid and the fd table and the file
	 * are freed after an RCU grace period.
	 */
	ret = vsym_task_locked(c->args[0], &t);
	if (ret)
		goto out;
	files = t->files;
	if (files && fd < files_fdtable(files)->max_fds)
		file = files_lookup_fd_rcu(files, (unsigned int)fd);
	if (!file) {
		ret = -EBADF;
	} else {
		struct inode *inode = file_inode(file);

		c->rets[0] = file->f_flags;
		c->rets[1] = file->f_pos;
		c->rets[2] = inode ? inode->i_ino : 0;
		c->rets[3] = inode ? i_size_read(inode) : 0;
		ret = vsym_put_path(c, &file->f_path);
	}
	spin_unlock(&t->alloc_lock);
out:
	rcu_read_unlock();
	return ret;
}

/* page_info's bits for a present leaf entry (PTE, or a huge PMD/PUD) with these flags. */
static u64 vsym_leaf_flags(pteval_t f)
{
	u64 flags = VSYM_PAGE_PRESENT;

	if (f & _PAGE_RW)
		flags |= VSYM_PAGE_PTE_WRITE;
	if (f & _PAGE_USER)
		flags |= VSYM_PAGE_PTE_USER;
	if (f & _PAGE_NX)
		flags |= VSYM_PAGE_PTE_NX;
	return flags;
}

/* page_info(pid, vaddr): rets = [flags, pfn, swap type, swap offset]. */
static long vsym_h_page_info(struct vsym_ctx *c)
{
	u64 addr = c->args[1];
	struct task_struct *t;
	struct mm_struct *mm;
	struct vm_area_struct *vma;
	u64 flags = 0, pfn = 0, stype = 0, soff = 0;
	long ret = 0;
	pgd_t *pgd;
	p4d_t *p4d, p4dv;
	pud_t *pud, pudv;
	pmd_t *pmd, pmdv;
	pte_t *ptep, pte;

	if (addr >= TASK_SIZE_MAX)
		return -EFAULT;
	rcu_read_lock();
	ret = vsym_task_locked(c->args[0], &t);
	if (ret)
		goto out;
	/* task_lock held and ->mm set: mm_users > 0 (exit_mm clears ->mm under it first). */
	mm = (t->flags & PF_KTHREAD) ? NULL : t->mm;
	if (!mm) {
		ret = -EINVAL;
		goto unlock_task;
	}
	if (!mmap_read_trylock(mm)) {
		ret = -EWOULDBLOCK;
		goto unlock_task;
	}
	vma = find_vma(mm, addr);
	if (vma && vma->vm_start <= addr) {
		flags |= VSYM_PAGE_VMA;
		if (vma->vm_flags & VM_READ)
			flags |= VSYM_PAGE_VMA_READ;
		if (vma->vm_flags & VM_WRITE)
			flags |= VSYM_PAGE_VMA_WRITE;
		if (vma->vm_flags & VM_EXEC)
			flags |= VSYM_PAGE_VMA_EXEC;
		if (vma->vm_flags & VM_SHARED)
			flags |= VSYM_PAGE_VMA_SHARED;
	}
	/* mmap_lock held for reading: page tables are not freed under us. */
	pgd = pgd_offset(mm, addr);
	if (pgd_none(READ_ONCE(*pgd)) || pgd_bad(READ_ONCE(*pgd)))
		goto done;
	p4d = p4d_offset(pgd, addr);
	p4dv = READ_ONCE(*p4d);
	if (p4d_none(p4dv) || p4d_bad(p4dv))
		goto done;
	pud = pud_offset(p4d, addr);
	pudv = READ_ONCE(*pud);
	if (pud_none(pudv))
		goto done;
	if (pud_leaf(pudv)) {
		if (pud_present(pudv)) {
			flags |= VSYM_PAGE_HUGE | vsym_leaf_flags(pud_flags(pudv));
			pfn = pud_pfn(pudv) + ((addr & ~PUD_MASK) >> PAGE_SHIFT);
		}
		goto done;
	}
	if (pud_bad(pudv))
		goto done;
	pmd = pmd_offset(pud, addr);
	pmdv = READ_ONCE(*pmd);
	if (pmd_none(pmdv))
		goto done;
	if (pmd_leaf(pmdv)) {
		if (pmd_present(pmdv)) {
			flags |= VSYM_PAGE_HUGE | vsym_leaf_flags(pmd_flags(pmdv));
			pfn = pmd_pfn(pmdv) + ((addr & ~PMD_MASK) >> PAGE_SHIFT);
		}
		goto done;
	}
	/* A non-present PMD (THP migration entry) or a bad one: nothing mapped here. */
	if (!pmd_present(pmdv) || pmd_bad(pmdv))
		goto done;
	ptep = pte_offset_map(&pmdv, addr);
	pte = READ_ONCE(*ptep);
	pte_unmap(ptep);
	if (pte_present(pte)) {
		flags |= vsym_leaf_flags(pte_flags(pte));
		pfn = pte_pfn(pte);
	} else if (is_swap_pte(pte)) {
		swp_entry_t e = pte_to_swp_entry(pte);

		if (!non_swap_entry(e)) {
			flags |= VSYM_PAGE_SWAPPED;
			stype = swp_type(e);
			soff = swp_offset(e);
		}
	}
done:
	c->rets[0] = flags;
	c->rets[1] = pfn;
	c->rets[2] = stype;
	c->rets[3] = soff;
	mmap_read_unlock(mm);
unlock_task:
	spin_unlock(&t->alloc_lock);
out:
	rcu_read_unlock();
	return ret;
}

/* swap_info(): ret = devices, data = records, rets = [total KiB, free KiB, pswpin, pswpout]. */
static long vsym_h_swap_info(struct vsym_ctx *c)
{
	int max = min_t(int, MAX_SWAPFILES, VSYM_CALL_DATA / sizeof(struct vsym_swap));
	u64 total, free;
	int n;

	n = vsym_collect_swaps((struct vsym_swap *)c->data, max, true, c->transport,
			       vsym_pathbuf, &total, &free);
	if (n < 0)
		return n;
	c->len = n * sizeof(struct vsym_swap);
	c->rets[0] = total;
	c->rets[1] = free;
	c->rets[2] = vsym_vm_event(PSWPIN);
	c->rets[3] = vsym_vm_event(PSWPOUT);
	return n;
}

/*
 * test_spin(ms, ...): busy-waits, then answers like ECHO. Test only. The deadline uses the
 * NMI-safe clock: ktime_get() could spin for ever on the synchronous transport if the
 * interrupted context is updating the timekeeper.
 */
static long vsym_h_test_spin(struct vsym_ctx *c)
{
	u64 ms = min_t(u64, c->args[0], VSYM_SPIN_MAX_MS);
	u64 end = ktime_get_mono_fast_ns() + ms * NSEC_PER_MSEC;
	u64 i;

	/* At most 2 * ms steps of 1 ms: bounded even if the clock stood still. */
	for (i = 0; i < 2 * ms && ktime_get_mono_fast_ns() < end; i++) {
		if (READ_ONCE(vsym.stopping))
			break;
		mdelay(1);
		if (c->transport == VSYM_TRANSPORT_DOORBELL)
			cond_resched();
	}
	return vsym_h_echo(c);
}

struct vsym_handler {
	const char *name;
	long (*fn)(struct vsym_ctx *c);
};

/* The symcall table, indexed by number (crates/proto/src/sym.rs `nr`). */
static const struct vsym_handler vsym_table[VSYM_NR_MAX + 1] = {
	[VSYM_NR_PING] = { "ping", vsym_h_ping },
	[VSYM_NR_ECHO] = { "echo", vsym_h_echo },
	[VSYM_NR_TASK_INFO] = { "task_info", vsym_h_task_info },
	[VSYM_NR_FD_PATH] = { "fd_path", vsym_h_fd_path },
	[VSYM_NR_PAGE_INFO] = { "page_info", vsym_h_page_info },
	[VSYM_NR_SWAP_INFO] = { "swap_info", vsym_h_swap_info },
	[VSYM_NR_TEST_SPIN] = { "test_spin", vsym_h_test_spin },
};

static bool vsym_handles(u64 nr)
{
	if (nr > VSYM_NR_MAX)
		return false;
	nr = array_index_nospec(nr, VSYM_NR_MAX + 1);
	return vsym_table[nr].fn && (vsym.symcalls[nr / 64] & BIT_ULL(nr % 64));
}

struct vsym_res {
	s64 ret;
	u64 rets[4];
	u32 len;
};

/* Runs call NR. The caller holds vsym_busy. */
static void vsym_dispatch(u64 nr, const u64 *args, u32 transport, struct vsym_res *r)
{
	struct vsym_ctx c = { .data = vsym_out, .transport = transport };

	memcpy(c.args, args, sizeof(c.args));
	if (!vsym_handles(nr)) {
		memset(r, 0, sizeof(*r));
		r->ret = -ENOSYS;
		return;
	}
	r->ret = vsym_table[array_index_nospec(nr, VSYM_NR_MAX + 1)].fn(&c);
	memcpy(r->rets, c.rets, sizeof(r->rets));
	r->len = r->ret < 0 ? 0 : min(c.len, VSYM_CALL_DATA);
}

/* Writes an answer to the call page. Caller holds vsym_call_lock. */
static void vsym_publish(u64 seq, const struct vsym_res *r, const char *data)
{
	struct vsym_call *call = vsym.call;
	u32 len = min(r->len, VSYM_CALL_DATA);
	int i;

	WRITE_ONCE(call->ret, r->ret);
	for (i = 0; i < 4; i++)
		WRITE_ONCE(call->rets[i], r->rets[i]);
	if (len && data)
		memcpy(call->data, data, len);
	WRITE_ONCE(call->data_len, data ? len : 0);
	smp_wmb();
	WRITE_ONCE(call->done_seq, seq);
	smp_wmb();
	WRITE_ONCE(call->state, VSYM_CALL_DONE);
}

/* Takes a posted doorbell call (POSTED -> RUNNING). Caller holds vsym_call_lock. */
static bool vsym_claim(u64 *seq, u64 *nr, u64 *args)
{
	struct vsym_call *call = vsym.call;
	int i;

	if (READ_ONCE(call->state) != VSYM_CALL_POSTED ||
	    READ_ONCE(call->transport) != VSYM_TRANSPORT_DOORBELL)
		return false;
	smp_rmb();
	*seq = READ_ONCE(call->seq);
	*nr = READ_ONCE(call->nr);
	for (i = 0; i < 5; i++)
		args[i] = READ_ONCE(call->args[i]);
	return cmpxchg(&call->state, VSYM_CALL_POSTED, VSYM_CALL_RUNNING) == VSYM_CALL_POSTED;
}

/* Whether the call page still holds the call we took. Caller holds vsym_call_lock. */
static bool vsym_still_ours(u64 seq)
{
	return READ_ONCE(vsym.call->seq) == seq &&
	       READ_ONCE(vsym.call->state) == VSYM_CALL_RUNNING;
}

/* --- doorbell transport -------------------------------------------------------------------- */

static irqreturn_t vsym_call_irq(int irq, void *dev)
{
	struct vsym_call *call = vsym.call;
	struct vsym_res res = { 0 };
	u64 seq, nr, args[5];
	bool answered = false;

	if (!vsym_live() || READ_ONCE(call->state) != VSYM_CALL_POSTED ||
	    READ_ONCE(call->transport) != VSYM_TRANSPORT_DOORBELL) {
		atomic_long_inc(&vsym_spurious);
		pr_debug_ratelimited("spurious call doorbell\n");
		return IRQ_HANDLED;
	}
	smp_rmb();
	if (READ_ONCE(call->nr) != VSYM_NR_PING)
		return IRQ_WAKE_THREAD;
	/* The bare round trip: answered here, without the thread. */
	spin_lock(&vsym_call_lock);
	if (READ_ONCE(call->nr) == VSYM_NR_PING && vsym_claim(&seq, &nr, args)) {
		if (nr == VSYM_NR_PING) {
			vsym_publish(seq, &res, NULL);
			answered = true;
		} else {
			/* Replaced between the checks: give it back to the thread. */
			cmpxchg(&call->state, VSYM_CALL_RUNNING, VSYM_CALL_POSTED);
		}
	}
	spin_unlock(&vsym_call_lock);
	if (answered) {
		atomic_long_inc(&vsym_calls);
		vsym_ring(VSYM_VEC_CALL);
		return IRQ_HANDLED;
	}
	return IRQ_WAKE_THREAD;
}

static irqreturn_t vsym_call_thread(int irq, void *dev)
{
	while (vsym_live()) {
		struct vsym_res res;
		unsigned long fl;
		u64 seq, nr, args[5];
		bool mine, published;

		spin_lock_irqsave(&vsym_call_lock, fl);
		if (!vsym_claim(&seq, &nr, args)) {
			spin_unlock_irqrestore(&vsym_call_lock, fl);
			break;
		}
		spin_unlock_irqrestore(&vsym_call_lock, fl);

		mine = atomic_cmpxchg(&vsym_busy, 0, 1) == 0;
		if (mine) {
			vsym_dispatch(nr, args, VSYM_TRANSPORT_DOORBELL, &res);
		} else {
			/* A synchronous call runs on another CPU. */
			memset(&res, 0, sizeof(res));
			res.ret = -EBUSY;
		}
		spin_lock_irqsave(&vsym_call_lock, fl);
		published = vsym_still_ours(seq);
		if (published)
			vsym_publish(seq, &res, mine ? vsym_out : NULL);
		spin_unlock_irqrestore(&vsym_call_lock, fl);
		if (mine)
			atomic_set_release(&vsym_busy, 0);
		if (published) {
			atomic_long_inc(&vsym_calls);
			vsym_ring(VSYM_VEC_CALL);
		} else {
			atomic_long_inc(&vsym_stale);
		}
	}
	return IRQ_HANDLED;
}

/* Vector 1 from vmsight: its state changed. */
/*
 * The synchronous transport's safe point: 7 bytes nopl 0x45464153(%rax) ("SAFE") that the
 * VMM's plugin recognises. A vCPU executing it while a synchronous call waits is redirected
 * into vsym_sync_stub right here, whatever the interrupt flag says: this is the state
 * vector's interrupt handler, interrupting code that had interrupts enabled, with RCU watching
 * and the kernel's GS base, as safe as any point where an interrupt is taken.
 */
static noinline void vsym_safe_point(void)
{
	asm volatile(".byte 0x0f, 0x1f, 0x80, 0x53, 0x41, 0x46, 0x45" ::: "memory");
}

static irqreturn_t vsym_state_irq(int irq, void *dev)
{
	struct vsym_call *call = vsym.call;

	if (READ_ONCE(vsym.vmm->state) == VSYM_VMM_GONE && !READ_ONCE(vsym.vmm_gone)) {
		WRITE_ONCE(vsym.vmm_gone, true);
		pr_info("vmsight is gone: symcalls and SymSpy stopped until the module is removed\n");
	}
	/*
	 * vmsight rings the state vector when a synchronous call finds no vCPU in the kernel with
	 * interrupts enabled (an idle guest, or one busy in user mode): give it a safe point.
	 */
	if (dev && vsym_live() && READ_ONCE(call->state) == VSYM_CALL_POSTED &&
	    READ_ONCE(call->transport) == VSYM_TRANSPORT_SYNC)
		vsym_safe_point();
	return IRQ_HANDLED;
}

/* --- synchronous transport ----------------------------------------------------------------- */

/*
 * sync_entry / sync_return. The VMM jumps to vsym_sync_stub with rsp = sync_stack - 8 (holding
 * a return address it never needs) and puts the vCPU back when it reaches vsym_sync_return,
 * whose 7 bytes nopl 0x564d5352(%rax) ("RSMV") it recognises; ud2 stops anything that runs
 * on. The VMM saves and restores every register except the arithmetic flags, which QEMU keeps
 * outside EFLAGS where a TCG plugin cannot reach them: the interrupted code may be between a
 * compare and the jump that reads it, so the stub saves the flags (pushfq computes them) and
 * puts them back (popfq) itself. Then it drops the return address, as `ret` would, so rsp at
 * the marker is what the VMM expects, without a `ret` (none is needed, and a plain one
 * would be a naked return in a retpoline/rethunk build).
 */
asm(".pushsection .text, \"ax\"\n"
    ".balign 16\n"
    ".globl vsym_sync_stub\n"
    ".type vsym_sync_stub, @function\n"
    "vsym_sync_stub:\n"
    "pushfq\n"
    "call vsym_sync_entry\n"
    "popfq\n"
    "lea 8(%rsp), %rsp\n"
    "vsym_sync_return:\n"
    ".byte 0x0f, 0x1f, 0x80, 0x52, 0x53, 0x4d, 0x56\n"
    "ud2\n"
    ".size vsym_sync_stub, . - vsym_sync_stub\n"
    ".popsection\n");
extern const u8 vsym_sync_stub[];
extern const u8 vsym_sync_return[];

static noinline long vsym_sync_call(u64 word, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4)
{
	u64 args[5] = { a0, a1, a2, a3, a4 };
	u64 nr = (u32)word;
	u32 tag = word >> VSYM_SYNC_SEQ_SHIFT;
	struct vsym_res res;
	u64 seq;

	if (!vsym_live())
		return -ESHUTDOWN;
	/*
	 * If the interrupted context on this CPU holds the call lock or runs a handler, give
	 * up; otherwise neither can become held by this CPU while we run, and other CPUs hold
	 * the lock only for a few stores, so taking it later cannot deadlock.
	 */
	if (!spin_trylock(&vsym_call_lock))
		return -EBUSY;
	spin_unlock(&vsym_call_lock);
	if (atomic_cmpxchg(&vsym_busy, 0, 1) != 0)
		return -EBUSY;
	/*
	 * The call this entry answers: vmsight may give up on it and post another meanwhile.
	 * The entry carries the low half of its call's sequence; if the page holds another call
	 * (this redirection ran late), these arguments are not that call's: answer nothing.
	 */
	seq = READ_ONCE(vsym.call->seq);
	if ((u32)seq != tag) {
		atomic_long_inc(&vsym_stale);
		atomic_set_release(&vsym_busy, 0);
		return -ESTALE;
	}
	atomic_long_inc(&vsym_sync_calls);
	vsym_dispatch(nr, args, VSYM_TRANSPORT_SYNC, &res);
	spin_lock(&vsym_call_lock);
	/* Still the posted call (vmsight withdraws a call it gave up on: state IDLE). */
	if (READ_ONCE(vsym.call->seq) == seq && READ_ONCE(vsym.call->state) == VSYM_CALL_POSTED)
		vsym_publish(seq, &res, vsym_out);
	else
		atomic_long_inc(&vsym_stale);
	spin_unlock(&vsym_call_lock);
	atomic_set_release(&vsym_busy, 0);
	return res.ret;
}

/*
 * The synchronous entry, called by vsym_sync_stub with the six arguments the VMM put in rdi,
 * rsi, rdx, rcx, r8, r9, interrupts off: the call number tagged with the call's sequence
 * (bits 0-31 and 32-63 of the first, VSYM_SYNC_SEQ_SHIFT) and the call's five arguments. No stack protector and no tracing: the GS base is
 * checked before anything uses it. Not static: the stub calls it by name.
 */
__visible noinline notrace __no_stack_protector long vsym_sync_entry(u64 word, u64 a0, u64 a1,
								  u64 a2, u64 a3, u64 a4);
__visible noinline notrace __no_stack_protector long vsym_sync_entry(u64 word, u64 a0, u64 a1,
								  u64 a2, u64 a3, u64 a4)
{
	u64 gs = __rdmsr(MSR_GS_BASE);
	unsigned int cpu;
	long ret;

	/*
	 * Per-CPU data is reachable only if GS holds a CPU's per-CPU base (not so around
	 * swapgs on kernel entry and exit, where it is the user's, which may be any canonical
	 * address): then the GS base is that CPU's __per_cpu_offset.
	 */
	for (cpu = 0; cpu < nr_cpu_ids; cpu++)
		if (__per_cpu_offset[cpu] == gs)
			break;
	if (cpu >= nr_cpu_ids)
		return VSYM_RET_NOT_HERE;
	preempt_disable();
	if (!rcu_is_watching()) {
		ret = VSYM_RET_NOT_HERE;
	} else {
		atomic_inc(&vsym_sync_inflight);
		ret = vsym_sync_call(word, a0, a1, a2, a3, a4);
		atomic_dec(&vsym_sync_inflight);
	}
	/* preempt_enable_no_resched(), which modules may not use: never schedule here. */
	barrier();
	preempt_count_dec();
	return ret;
}
NOKPROBE_SYMBOL(vsym_sync_entry);

/* --- SymSpy -------------------------------------------------------------------------------- */

static notrace void vsym_sched_switch(void *data, bool preempt, struct task_struct *prev,
				      struct task_struct *next, unsigned int prev_state)
{
	unsigned int cpu = smp_processor_id();
	struct vsym_cpu *rec;
	char comm[TASK_COMM_LEN];
	u32 *seq;
	u64 *switches;

	if (!READ_ONCE(vsym.spy_on) || cpu >= VSYM_MAX_CPUS)
		return;
	rec = &vsym.guest->cpus[cpu];
	seq = this_cpu_ptr(&vsym_cpu_seq);
	switches = this_cpu_ptr(&vsym_cpu_switches);
	memcpy(comm, next->comm, sizeof(comm));
	comm[sizeof(comm) - 1] = 0;
	(*seq)++;
	WRITE_ONCE(rec->seq, *seq); /* odd */
	smp_wmb();
	WRITE_ONCE(rec->pid, next->pid);
	WRITE_ONCE(rec->tgid, next->tgid);
	WRITE_ONCE(rec->switches, ++(*switches));
	memcpy(rec->comm, comm, sizeof(rec->comm));
	smp_wmb();
	(*seq)++;
	WRITE_ONCE(rec->seq, *seq); /* even */
}

static void vsym_find_tracepoint(struct tracepoint *tp, void *priv)
{
	if (!strcmp(tp->name, "sched_switch"))
		*(struct tracepoint **)priv = tp;
}

static void vsym_put_str(char *dst, size_t size, const char *src)
{
	char tmp[64];

	BUILD_BUG_ON(sizeof(tmp) < sizeof(((struct vsym_guest *)0)->release));
	memset(tmp, 0, sizeof(tmp));
	strscpy(tmp, src, min(size, sizeof(tmp)));
	memcpy(dst, tmp, min(size, sizeof(tmp)));
}

/* The header fields (rewritten at every refresh: the page is not ours alone). */
static void vsym_write_header(void)
{
	struct vsym_guest *g = vsym.guest;
	struct new_utsname *u = init_utsname();

	WRITE_ONCE(g->magic, VSYM_GUEST_MAGIC);
	WRITE_ONCE(g->abi, VSYM_MODULE_ABI);
	WRITE_ONCE(g->peer, vsym.peer);
	WRITE_ONCE(g->nr_cpus, min_t(u32, num_possible_cpus(), VSYM_MAX_CPUS));
	WRITE_ONCE(g->refresh_ms, vsym.refresh_ms);
	WRITE_ONCE(g->symcalls[0], vsym.symcalls[0]);
	WRITE_ONCE(g->symcalls[1], vsym.symcalls[1]);
	if (vsym.sync_stack && vsym.guest_state != VSYM_GUEST_GONE) {
		WRITE_ONCE(g->sync_entry, (u64)(unsigned long)vsym_sync_stub);
		WRITE_ONCE(g->sync_return, (u64)(unsigned long)vsym_sync_return);
		WRITE_ONCE(g->sync_stack,
			   (u64)(unsigned long)vsym.sync_stack + VSYM_SYNC_STACK_SIZE);
	} else {
		WRITE_ONCE(g->sync_entry, 0);
		WRITE_ONCE(g->sync_return, 0);
		WRITE_ONCE(g->sync_stack, 0);
	}
	vsym_put_str(g->release, sizeof(g->release), u->release);
	vsym_put_str(g->version, sizeof(g->version), u->version);
}

static void vsym_spy_begin(void)
{
	vsym.page_seq |= 1; /* odd */
	WRITE_ONCE(vsym.guest->seq, vsym.page_seq);
	smp_wmb();
}

static void vsym_spy_end(void)
{
	smp_wmb();
	vsym.page_seq++; /* even */
	WRITE_ONCE(vsym.guest->seq, vsym.page_seq);
}

/* Sets the guest state (inside the page's seqlock). */
static void vsym_set_state(u32 state)
{
	vsym.guest_state = state;
	vsym_spy_begin();
	vsym_write_header();
	smp_wmb();
	WRITE_ONCE(vsym.guest->state, state);
	vsym_spy_end();
}

/* One SymSpy refresh. Process context (may take swap_lock); single writer. */
static void vsym_refresh_page(void)
{
	struct vsym_guest *g = vsym.guest;
	struct sysinfo si;
	u64 avail, total = 0, free = 0, pswpin, pswpout;
	int n, i;

	si_meminfo(&si);
	avail = si_mem_available();
	n = vsym_collect_swaps(vsym_work_swaps, VSYM_MAX_SWAPS, false, VSYM_TRANSPORT_DOORBELL,
			       vsym_work_pathbuf, &total, &free);
	if (n < 0)
		n = 0;
	pswpin = vsym_vm_event(PSWPIN);
	pswpout = vsym_vm_event(PSWPOUT);

	vsym_spy_begin();
	vsym_write_header();
	WRITE_ONCE(g->state, vsym.guest_state);
	WRITE_ONCE(g->updated_ns, ktime_get_ns());
	WRITE_ONCE(g->refreshes, ++vsym.refreshes);
	WRITE_ONCE(g->mem_total_kib, (u64)si.totalram * si.mem_unit / 1024);
	WRITE_ONCE(g->mem_free_kib, (u64)si.freeram * si.mem_unit / 1024);
	WRITE_ONCE(g->mem_available_kib, avail << (PAGE_SHIFT - 10));
	WRITE_ONCE(g->swap_total_kib, total);
	WRITE_ONCE(g->swap_free_kib, free);
	WRITE_ONCE(g->pswpin, pswpin);
	WRITE_ONCE(g->pswpout, pswpout);
	WRITE_ONCE(g->nr_swap, n);
	for (i = 0; i < VSYM_MAX_SWAPS; i++) {
		if (i < n)
			memcpy(&g->swaps[i], &vsym_work_swaps[i], sizeof(g->swaps[i]));
		else
			memset(&g->swaps[i], 0, sizeof(g->swaps[i]));
	}
	vsym_spy_end();
}

static void vsym_refresh_work(struct work_struct *w)
{
	/* Also notices vmsight leaving if its state doorbell was lost. */
	if (READ_ONCE(vsym.vmm->state) == VSYM_VMM_GONE)
		vsym_state_irq(0, NULL);
	if (!vsym_live())
		return;
	vsym_refresh_page();
	schedule_delayed_work(&vsym.work, msecs_to_jiffies(vsym.refresh_ms));
}

/* --- SwapBypass ---------------------------------------------------------------------------- */

#include "vmsight_sym_swap.c"

/* --- device -------------------------------------------------------------------------------- */

/* Undoes whatever probe set up; the module's state is reset for another probe. */
static void vsym_teardown(void)
{
	struct pci_dev *pdev = vsym.pdev;
	int i;

	WRITE_ONCE(vsym.stopping, true);
	WRITE_ONCE(vsym.active, false);
	if (vsym.work_on) {
		cancel_delayed_work_sync(&vsym.work);
		vsym.work_on = false;
	}
	/* Say GONE and clear the synchronous entry point: vmsight must not call in any more. */
	if (vsym.guest && (vsym.guest_state == VSYM_GUEST_HELLO ||
			   vsym.guest_state == VSYM_GUEST_ACTIVE)) {
		vsym_set_state(VSYM_GUEST_GONE);
		vsym_ring(VSYM_VEC_STATE);
	}
	if (vsym.spy_on) {
		WRITE_ONCE(vsym.spy_on, false);
		tracepoint_probe_unregister(vsym.tp_switch, (void *)vsym_sched_switch, NULL);
		tracepoint_synchronize_unregister();
	}
	if (vsym.sync_stack) {
		/*
		 * A synchronous entry runs with interrupts off, so a grace period covers one
		 * that is already past its first instructions; then wait (bounded) for the
		 * counter. TEST_SPIN stops early when it sees `stopping`.
		 */
		synchronize_rcu();
		for (i = 0; i < 1000 && atomic_read(&vsym_sync_inflight); i++)
			msleep(1);
		if (atomic_read(&vsym_sync_inflight))
			pr_warn("a synchronous call is still running; its stack is leaked\n");
		else
			kfree(vsym.sync_stack);
		vsym.sync_stack = NULL;
	}
	if (vsym.call_irq_on)
		free_irq(pci_irq_vector(pdev, VSYM_VEC_CALL), &vsym);
	if (vsym.state_irq_on)
		free_irq(pci_irq_vector(pdev, VSYM_VEC_STATE), &vsym);
	vsym.call_irq_on = vsym.state_irq_on = false;
	if (vsym.vectors_on)
		pci_free_irq_vectors(pdev);
	vsym.vectors_on = false;
	if (vsym.region)
		memunmap(vsym.region);
	if (vsym.regs)
		pci_iounmap(pdev, vsym.regs);
	if (pdev) {
		pci_clear_master(pdev);
		pci_disable_device(pdev);
	}
	vsym.region = NULL;
	vsym.vmm = NULL;
	vsym.guest = NULL;
	vsym.call = NULL;
	vsym.regs = NULL;
	vsym.pdev = NULL;
	vsym.guest_state = VSYM_GUEST_NONE;
	vsym.vmm_gone = false;
}

/* Waits (at most 3 s, sleeping) for vmsight's answer to the hello. */
static int vsym_handshake(void)
{
	unsigned long deadline = jiffies + msecs_to_jiffies(VSYM_HANDSHAKE_MS);

	for (;;) {
		/* An answer counts only if it is to this hello (a stale one may be there). */
		bool ours = READ_ONCE(vsym.vmm->answered_hello) == vsym.hello_id;
		u32 s;

		smp_rmb();
		s = READ_ONCE(vsym.vmm->state);
		if (!ours && s != VSYM_VMM_GONE)
			s = VSYM_VMM_WAITING;
		if (s == VSYM_VMM_ACCEPTED)
			return 0;
		if (s == VSYM_VMM_REFUSED) {
			u32 why = READ_ONCE(vsym.vmm->refuse_reason);

			pr_warn("vmsight refused this module (reason %u: %s): symbiotic interface disabled\n",
				why,
				why == VSYM_REFUSE_VERSION   ? "interface version" :
				why == VSYM_REFUSE_MALFORMED ? "malformed guest page" :
							       "unknown");
			return -EPROTONOSUPPORT;
		}
		if (s == VSYM_VMM_GONE) {
			pr_warn("vmsight is shutting down: symbiotic interface disabled\n");
			return -ENODEV;
		}
		if (time_after(jiffies, deadline)) {
			pr_warn("vmsight did not answer the handshake within %u ms: symbiotic interface disabled\n",
				VSYM_HANDSHAKE_MS);
			return -ETIMEDOUT;
		}
		msleep(5);
	}
}

/* Probe of the symbiotic interface's device (ivshmem-doorbell, VSYM_VMM_MAGIC in BAR2). */
static int vsym_probe_sym(struct pci_dev *pdev)
{
	char ver[sizeof(((struct vsym_vmm *)0)->vmsight_version) + 1];
	u32 ms;
	int err, i;

	if (vsym.pdev)
		return -EBUSY;
	err = pci_enable_device(pdev);
	if (err)
		return err;
	vsym.pdev = pdev;
	vsym.stopping = false;
	vsym.vmm_gone = false;
	vsym.guest_state = VSYM_GUEST_NONE;
	if (!(pci_resource_flags(pdev, 2) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, 2) < VSYM_REGION_SIZE ||
	    !(pci_resource_flags(pdev, 0) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, 0) < IVSHMEM_REGS_SIZE) {
		err = -ENODEV;
		goto fail;
	}
	/* Not claimed with pci_request_regions: with CONFIG_IO_STRICT_DEVMEM a busy BAR could
	 * not be mapped through sysfs by root (the sym-hostile test program does that). */
	vsym.region = memremap(pci_resource_start(pdev, 2), VSYM_REGION_SIZE, MEMREMAP_WB);
	if (!vsym.region) {
		err = -ENOMEM;
		goto fail;
	}
	vsym.vmm = vsym.region + VSYM_VMM_OFFSET;
	vsym.guest = vsym.region + VSYM_GUEST_OFFSET;
	vsym.call = vsym.region + VSYM_CALL_OFFSET;
	if (READ_ONCE(vsym.vmm->magic) != VSYM_VMM_MAGIC) {
		dev_info(&pdev->dev, "vmsight_sym: ivshmem device without vmsight's magic: not ours\n");
		vsym.guest = NULL; /* never touch another user's memory */
		err = -ENODEV;
		goto fail;
	}
	vsym.regs = pci_iomap(pdev, 0, IVSHMEM_REGS_SIZE);
	if (!vsym.regs) {
		err = -ENOMEM;
		goto fail;
	}
	vsym.peer = ioread32(vsym.regs + IVSHMEM_IV_POSITION);
	vsym.vmm_peer = READ_ONCE(vsym.vmm->vmm_peer) & 0xffff;
	vsym.features = vsym.fw_features;
	ms = refresh_ms ? refresh_ms : READ_ONCE(vsym.vmm->refresh_ms);
	vsym.refresh_ms = clamp_t(u32, ms ? ms : VSYM_REFRESH_DEFAULT_MS, VSYM_REFRESH_MIN_MS,
				  VSYM_REFRESH_MAX_MS);
	memcpy(ver, vsym.vmm->vmsight_version, sizeof(ver) - 1);
	ver[sizeof(ver) - 1] = 0;

	/* The guest page starts clean. */
	memset(vsym.guest, 0, sizeof(*vsym.guest));
	vsym.page_seq = 0;

	if (vsym.fw_abi != VSYM_MODULE_ABI) {
		vsym_set_state(VSYM_GUEST_REFUSED);
		vsym_ring(VSYM_VEC_STATE);
		pr_warn("VMM speaks interface %u, this module %u: symbiotic interface disabled\n",
			vsym.fw_abi, VSYM_MODULE_ABI);
		err = -EPROTONOSUPPORT;
		goto fail;
	}

	pci_set_master(pdev); /* MSI-X messages are bus-master writes */
	err = pci_alloc_irq_vectors(pdev, VSYM_VECTORS, VSYM_VECTORS, PCI_IRQ_MSIX);
	if (err < 0) {
		pr_warn("cannot enable the device's %u MSI-X vectors (%d)\n", VSYM_VECTORS, err);
		goto fail;
	}
	vsym.vectors_on = true;

	vsym.sync_stack = kzalloc(VSYM_SYNC_STACK_SIZE, GFP_KERNEL);
	if (!vsym.sync_stack) {
		err = -ENOMEM;
		goto fail;
	}
	BUILD_BUG_ON(VSYM_SYNC_STACK_SIZE % 16);
	vsym_resolve();
	memset(vsym.symcalls, 0, sizeof(vsym.symcalls));
	for (i = 0; i <= VSYM_NR_MAX; i++) {
		if (!vsym_table[i].fn)
			continue;
		if (i == VSYM_NR_SWAP_INFO && !vsym.ks_ok)
			continue;
		vsym.symcalls[i / 64] |= BIT_ULL(i % 64);
	}

	/* Hello: our version, page and a fresh id, then wait for vmsight's answer to it. */
	vsym.hello_id = get_random_u32() | 1;
	WRITE_ONCE(vsym.guest->hello_id, vsym.hello_id);
	vsym_set_state(VSYM_GUEST_HELLO);
	vsym_ring(VSYM_VEC_STATE);
	err = vsym_handshake();
	if (err)
		goto fail;

	err = request_irq(pci_irq_vector(pdev, VSYM_VEC_STATE), vsym_state_irq, 0,
			  "vmsight_sym-state", &vsym);
	if (err)
		goto fail;
	vsym.state_irq_on = true;
	if (vsym.features & VSYM_FEAT_DOORBELL) {
		err = request_threaded_irq(pci_irq_vector(pdev, VSYM_VEC_CALL), vsym_call_irq,
					   vsym_call_thread, 0, "vmsight_sym-call", &vsym);
		if (err)
			goto fail;
		vsym.call_irq_on = true;
	}
	if (vsym.features & VSYM_FEAT_SPY) {
		vsym.tp_switch = NULL;
		for_each_kernel_tracepoint(vsym_find_tracepoint, &vsym.tp_switch);
		if (!vsym.tp_switch) {
			pr_warn("tracepoint sched_switch not found: no per-CPU tasks\n");
		} else {
			WRITE_ONCE(vsym.spy_on, true);
			err = tracepoint_probe_register(vsym.tp_switch, (void *)vsym_sched_switch,
							NULL);
			if (err) {
				WRITE_ONCE(vsym.spy_on, false);
				pr_warn("cannot attach to sched_switch (%d): no per-CPU tasks\n", err);
			}
		}
	}
	vsym.guest_state = VSYM_GUEST_ACTIVE;
	WRITE_ONCE(vsym.active, true);
	vsym_refresh_page();
	if (vsym.features & VSYM_FEAT_SPY) {
		INIT_DELAYED_WORK(&vsym.work, vsym_refresh_work);
		vsym.work_on = true;
		schedule_delayed_work(&vsym.work, msecs_to_jiffies(vsym.refresh_ms));
	}
	vsym_ring(VSYM_VEC_STATE);
	pr_info("symbiotic interface %u active (vmsight %.32s, peer %u, vmsight peer %u, features 0x%x, refresh %u ms)\n",
		VSYM_MODULE_ABI, ver, vsym.peer, vsym.vmm_peer, vsym.features, vsym.refresh_ms);
	return 0;

fail:
	vsym.probe_err = err;
	vsym_teardown();
	return err;
}

/*
 * Every ivshmem device: the swap region's (VSYM_SWAPR_MAGIC in BAR2, bound whatever the
 * interface's handshake says) or else, maybe, the symbiotic interface's.
 */
static int vsym_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	if (vswap_is_region(pdev))
		return vswap_probe(pdev);
	return vsym_probe_sym(pdev);
}

static void vsym_remove(struct pci_dev *pdev)
{
	if (pdev == vsym.pdev)
		vsym_teardown();
	else
		vswap_remove(pdev);
}

/* No MODULE_DEVICE_TABLE: the module is loaded on request (vmsight.sym=1), not by alias. */
static const struct pci_device_id vsym_ids[] = {
	{ PCI_DEVICE(0x1af4, 0x1110) },
	{ 0 }
};

static struct pci_driver vsym_driver = {
	.name = KBUILD_MODNAME,
	.id_table = vsym_ids,
	.probe = vsym_probe,
	.remove = vsym_remove,
};

static int __init vsym_init(void)
{
	char ann[128];
	int err;

	err = fwcfg_read_announcement(ann, sizeof(ann));
	if (err) {
		pr_info("no symbiotic VMM (fw_cfg %s absent)\n", VSYM_FW_CFG_NAME);
		return -ENODEV;
	}
	fwcfg_parse(ann);
	if (vsym.fw_size && vsym.fw_size < VSYM_REGION_SIZE)
		pr_warn("fw_cfg announces a %u-byte region, less than %u\n", vsym.fw_size,
			VSYM_REGION_SIZE);
	vsym.probe_err = 0;
	err = pci_register_driver(&vsym_driver);
	if (err)
		return err;
	if (!vsym.pdev) {
		pci_unregister_driver(&vsym_driver);
		if (vsym.probe_err == -EPROTONOSUPPORT || vsym.probe_err == -ETIMEDOUT)
			return vsym.probe_err;
		pr_info("fw_cfg announces the interface but no vmsight ivshmem device was found\n");
		return -ENODEV;
	}
	vswap_start();
	return 0;
}

static void __exit vsym_exit(void)
{
	/* vmswap0 first (it may use the region), then the devices. */
	vswap_stop();
	pci_unregister_driver(&vsym_driver);
}

module_init(vsym_init);
module_exit(vsym_exit);

MODULE_LICENSE("GPL");
MODULE_AUTHOR("vmsight");
MODULE_DESCRIPTION("vmsight symbiotic interface (SymSpy and SymCall), interface version "
		   __stringify(VSYM_MODULE_ABI));
