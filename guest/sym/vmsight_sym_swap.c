// SPDX-License-Identifier: GPL-2.0
/*
 * SwapBypass, the guest side (docs/swapbypass.md): the guest's swap served from a swap cache
 * in memory that vmsight owns and shares with this module, without block I/O for the pages
 * the cache holds. Part of vmsight_sym: vmsight_sym.c #includes this file (one module, one
 * compilation unit), after its counters' parameter ops and before its PCI driver.
 *
 *  - Region: a second ivshmem device (ivshmem-plain, 1af4:1110, no doorbell) whose BAR2 is
 *    the swap region: the header page struct vsym_swaphdr (magic VSYM_SWAPR_MAGIC), then the
 *    index (u32 per swap page: 0, or slot + 1), the slot states (u64 per slot), the free stack
 *    (u32 per slot) and the slots' pages, at the offsets the header gives. The layout is read
 *    and checked once, when the device is bound, and kept here; what vmsight changes later
 *    (index entries, slot states, the stack) is bounds-checked at every use.
 *  - Device: vmswap0, stacked on the swap disk (the lower disk, module parameter swap_disk),
 *    same capacity, 4 KiB blocks. The truth for swap page OFF is the slot index[OFF] names,
 *    or else the lower disk, whose backend in vmsight consults the same index: a page the
 *    region cannot take (no free slot, lock busy, vmsight not ready) goes to the lower disk
 *    and stays correct. rw_page serves hits without a bio; swap_slot_free_notify drops a
 *    freed swap slot's page from the cache (when the lock is busy then, the page is marked
 *    in the region's deferred bitmap and the drain work drops it soon after).
 *  - Lock: the header's lock word, shared with vmsight (cmpxchg FREE -> GUEST). It is held
 *    with interrupts off (swap_slot_free_notify runs under the swap locks) and only for one
 *    page's work, the 4 KiB copy included; acquiring it spins at most VSWAP_SPIN_US, then
 *    the operation gives up (swap_busy) and the page goes to the lower disk.
 *
 * Everything in the region is written by vmsight too and is checked before use: a value out
 * of bounds counts swap_corrupt and turns the operation into a miss; nothing read from the
 * region is used as a pointer or an unchecked index.
 */
#include <linux/bio.h>
#include <linux/bitmap.h>
#include <linux/blkdev.h>
#include <linux/delay.h>
#include <linux/highmem.h>
#include <linux/mutex.h>
#include <linux/pagemap.h>
#include <linux/slab.h>
#include <linux/wait_bit.h>
#include <linux/workqueue.h>
#include <asm/msr.h>
#include <asm/page.h>
#include <asm/tsc.h>

#define VSWAP_NAME "vmswap0"
/* Tries, 1 us apart, an operation makes for the region lock (vmsight may be descheduled). */
#define VSWAP_SPIN_US 200
#define VSWAP_PATH_MAX 128
#define VSWAP_SECTORS (PAGE_SIZE >> SECTOR_SHIFT)
#define VSWAP_LOWER_MODE (FMODE_READ | FMODE_WRITE | FMODE_EXCL)
/* Deferred invalidations the drain work runs per lock hold, and its wait after a busy lock. */
#define VSWAP_DRAIN_BATCH 64
#define VSWAP_DRAIN_DELAY 1
/* Request flags a piece sent to the lower disk keeps. */
#define VSWAP_PASS_FLAGS \
	(REQ_SYNC | REQ_META | REQ_PRIO | REQ_IDLE | REQ_RAHEAD | REQ_BACKGROUND | REQ_SWAP)

static_assert(PAGE_SIZE == VSYM_SWAPR_PAGE);

/* Counters, in the order of the header's g_* fields (published there at every unlock). */
enum vswap_ctr {
	VSWAP_STORES,
	VSWAP_STORE_FULL,
	VSWAP_LOADS,
	VSWAP_LOAD_MISSES,
	VSWAP_INVALIDATES,
	VSWAP_BUSY,
	VSWAP_LOWER_READS,
	VSWAP_LOWER_WRITES,
	VSWAP_CORRUPT,
	VSWAP_DEFERRED,
	VSWAP_NR_CTR
};
static_assert(offsetof(struct vsym_swaphdr, g_corrupt) ==
	      offsetof(struct vsym_swaphdr, g_stores) + VSWAP_CORRUPT * sizeof(u64));
static_assert(offsetof(struct vsym_swaphdr, g_deferred) ==
	      offsetof(struct vsym_swaphdr, g_stores) + VSWAP_DEFERRED * sizeof(u64));
static_assert(offsetof(struct vsym_swaphdr, g_lower_reads) ==
	      offsetof(struct vsym_swaphdr, g_stores) + VSWAP_LOWER_READS * sizeof(u64));

static atomic_long_t vswap_ctr[VSWAP_NR_CTR];

/*
 * Where the bypass spends its time in the guest, beside the kernel's own swap path: TSC
 * cycles in the module's stores and loads (from the lock to the unlock, the copy included)
 * and in the 4 KiB copies alone, shown in ns by swap_stats (bench/swapbypass.py subtracts
 * them from the guest's system time). Module-local: not in the region's ABI. Both ends of a
 * measurement are read on one CPU (nothing between them sleeps); a negative difference
 * (TCG's vCPU TSCs are not synchronised, should one ever be migrated) is dropped.
 */
enum vswap_time { VSWAP_T_STORE, VSWAP_T_LOAD, VSWAP_T_COPY, VSWAP_NR_T };
static atomic64_t vswap_cycles[VSWAP_NR_T];
static const char *const vswap_time_names[VSWAP_NR_T] = {
	[VSWAP_T_STORE] = "store_ns", [VSWAP_T_LOAD] = "load_ns", [VSWAP_T_COPY] = "copy_ns",
};

static inline void vswap_time_since(enum vswap_time clock, u64 t0)
{
	s64 d = (s64)(rdtsc_ordered() - t0);

	if (d > 0)
		atomic64_add(d, &vswap_cycles[clock]);
}

/*
 * How a page is copied to or from a slot: memcpy (the default) or copy_page, the kernel's
 * page copier (rep movsq, or an unrolled loop of 8-byte moves; memcpy is rep movsb on a CPU
 * with FSRM, which a TCG vCPU of -cpu max has). Both copy the same 4 KiB between page-aligned
 * addresses; the switch is for measuring the copy's share (docs/swapbypass.md).
 */
static bool vswap_copy_page;
module_param_named(swap_copy_page, vswap_copy_page, bool, 0644);
MODULE_PARM_DESC(swap_copy_page, "SwapBypass: copy pages with copy_page instead of memcpy");

/*
 * Whether vmswap0 offers rw_page. With it, 6.1 gives the swap device SWP_SYNCHRONOUS_IO: a
 * swap-in of a page mapped once skips the swap cache and frees the swap slot at once, so a
 * page swapped in and never written is written out again at its next reclaim, and nothing is
 * read ahead. Without it, swap-ins go through the swap cache with readahead (page-cluster) as
 * for any disk, and a clean page keeps its slot. Read when vmswap0 is created (swap_disk).
 */
static bool vswap_rw_page_on = true;
module_param_named(swap_rw_page, vswap_rw_page_on, bool, 0644);
MODULE_PARM_DESC(swap_rw_page, "SwapBypass: offer rw_page (synchronous swap-in without the swap cache); read when swap_disk is set");

static const char *const vswap_ctr_names[VSWAP_NR_CTR] = {
	[VSWAP_STORES] = "stores",		[VSWAP_STORE_FULL] = "store_full",
	[VSWAP_LOADS] = "loads",		[VSWAP_LOAD_MISSES] = "load_misses",
	[VSWAP_INVALIDATES] = "invalidates",	[VSWAP_BUSY] = "busy",
	[VSWAP_LOWER_READS] = "lower_reads",	[VSWAP_LOWER_WRITES] = "lower_writes",
	[VSWAP_CORRUPT] = "corrupt",		[VSWAP_DEFERRED] = "deferred",
};

/* The region's layout as checked at bind time, and where its parts are mapped. */
struct vswap_region {
	void *base;
	struct vsym_swaphdr *hdr;
	u32 *index;
	u64 *meta;
	u32 *stack;
	u8 *data;
	u64 size;
	u64 pages; /* index entries: pages of the swap disk */
	u32 slots;
	/*
	 * Bit per swap page: freed while the lock was busy, its slot not let go yet (the drain
	 * work does it). Set by the free notification; cleared by the drain, under the lock, and
	 * by every store of the page before it takes the lock, so a drain never drops a newer
	 * copy: the kernel reuses a swap page only after its free notification returned.
	 */
	unsigned long *deferred;
};

static DEFINE_MUTEX(vswap_mutex);

/*
 * The swap region and vmswap0. vswap_mutex guards every field but `live`, `claimed` and
 * `inflight`; the I/O paths read `live` under RCU, and `lower` only while vmswap0 exists.
 */
static struct {
	bool ready; /* the module is initialised and not leaving: vmswap0 may exist */
	bool exiting;
	char path[VSWAP_PATH_MAX]; /* swap_disk */

	struct pci_dev *pdev;
	struct vswap_region *reg; /* bound region (owned) */
	struct vswap_region __rcu *live; /* what the I/O paths use: reg, or NULL */
	bool gone_logged;

	struct gendisk *disk;
	struct block_device *lower;
	bool claimed; /* being removed: opens fail (read under disk->open_mutex) */
	struct bio_set bs; /* pieces sent to the lower disk */
	atomic_t inflight; /* of those pieces, not yet completed */
} vswap;

static void vswap_drain(struct work_struct *work);
static DECLARE_DELAYED_WORK(vswap_drain_work, vswap_drain);

static inline void vswap_count(enum vswap_ctr c)
{
	atomic_long_inc(&vswap_ctr[c]);
}

static inline u64 vswap_state(u64 meta)
{
	return (meta & VSYM_SWAPR_STATE_MASK) >> VSYM_SWAPR_STATE_SHIFT;
}

/* Whether slot state word META says STATE for swap page OFF. */
static inline bool vswap_holds(u64 meta, u64 off, u64 state)
{
	return vswap_state(meta) == state && (meta & VSYM_SWAPR_OFFSET_MASK) == off;
}

static inline u64 vswap_meta(u64 state, u64 off)
{
	return (state << VSYM_SWAPR_STATE_SHIFT) | off;
}

/* --- the region protocol (both sides run exactly these operations) ------------------------- */

/* The module's counters into the header, for vmsight to report. Caller holds the lock. */
static void vswap_publish(struct vswap_region *r)
{
	u64 *g = (u64 *)((u8 *)r->hdr + offsetof(struct vsym_swaphdr, g_stores));
	int i;

	for (i = 0; i < VSWAP_NR_CTR; i++)
		WRITE_ONCE(g[i], atomic_long_read(&vswap_ctr[i]));
}

/*
 * Takes the region lock with interrupts off (FLAGS: to restore). Interrupts are back on
 * between tries (unless the caller has them off, as the free notification does), and the
 * tries end after VSWAP_SPIN_US more, 1 us apart: false then, counted as busy.
 *
 * Bounded by a count of delays, not by a clock: with interrupts off and the TSC marked
 * unstable (TCG's vCPUs' TSCs are unsynchronised), local_clock() stands still until the
 * next tick, so a clock-bounded spin in the free notification never ended while the
 * lock's holder waited for this CPU (a guest process holding it, or an IPI to this CPU).
 */
static bool vswap_lock(struct vswap_region *r, unsigned long *flags)
{
	u32 *lock = &r->hdr->lock;
	int tries;

	for (tries = 0;; tries++) {
		local_irq_save(*flags);
		if (READ_ONCE(*lock) == VSYM_SWAPR_LOCK_FREE &&
		    cmpxchg(lock, VSYM_SWAPR_LOCK_FREE, VSYM_SWAPR_LOCK_GUEST) ==
			    VSYM_SWAPR_LOCK_FREE)
			return true;
		local_irq_restore(*flags);
		if (tries >= VSWAP_SPIN_US)
			break;
		udelay(1);
	}
	vswap_count(VSWAP_BUSY);
	return false;
}

static void vswap_unlock(struct vswap_region *r, unsigned long flags)
{
	vswap_publish(r);
	smp_store_release(&r->hdr->lock, VSYM_SWAPR_LOCK_FREE);
	local_irq_restore(flags);
}

/* vmsight's state is not READY: nothing goes to the region. Logged once per binding. */
static void vswap_not_ready(u32 state)
{
	if (state != VSYM_SWAPR_VMM_GONE || xchg(&vswap.gone_logged, true))
		return;
	pr_warn("vmsight left the swap region: swap goes to %s only (the pages the region held went with vmsight)\n",
		VSWAP_NAME);
}

/* With R locked: whether vmsight serves the region. If not, R is unlocked. */
static bool vswap_serving(struct vswap_region *r, unsigned long flags)
{
	u32 state = READ_ONCE(r->hdr->vmm_state);

	if (likely(state == VSYM_SWAPR_VMM_READY))
		return true;
	vswap_unlock(r, flags);
	vswap_not_ready(state);
	return false;
}

/*
 * The region for one operation on swap page OFF, locked: NULL (nothing held) without a
 * region, for a page beyond its index, when the lock stayed busy, or when vmsight does not
 * serve the region. Caller holds rcu_read_lock (the region is unmapped after a grace period).
 */
static struct vswap_region *vswap_begin(u64 off, unsigned long *flags)
{
	struct vswap_region *r = rcu_dereference(vswap.live);

	if (!r || off >= r->pages || !vswap_lock(r, flags))
		return NULL;
	return vswap_serving(r, *flags) ? r : NULL;
}

/* After an operation: -EIO means the region broke the protocol (logged outside the lock). */
static void vswap_check(int err, const char *op, u64 off)
{
	if (err == -EIO)
		pr_warn_ratelimited("swap region: inconsistent index or slot state (%s of page %llu): treated as a miss\n",
				    op, off);
}

/* One page from SRC to DST, timed (both page-aligned, PAGE_SIZE bytes). */
static void vswap_copy(void *dst, const void *src)
{
	u64 t0 = rdtsc_ordered();

	if (READ_ONCE(vswap_copy_page))
		copy_page(dst, (void *)src);
	else
		memcpy(dst, src, PAGE_SIZE);
	vswap_time_since(VSWAP_T_COPY, t0);
}

static void vswap_copy_in(struct vswap_region *r, u32 slot, struct page *page)
{
	void *src = kmap_local_page(page);

	vswap_copy(r->data + (size_t)slot * PAGE_SIZE, src);
	kunmap_local(src);
}

static void vswap_copy_out(struct vswap_region *r, u32 slot, struct page *page)
{
	void *dst = kmap_local_page(page);

	vswap_copy(dst, r->data + (size_t)slot * PAGE_SIZE);
	kunmap_local(dst);
	flush_dcache_page(page);
}

/*
 * store: PAGE becomes swap page OFF's contents in the region. 0, or -ENOSPC (no free slot)
 * or -EIO (corrupt), and then index[OFF] is 0: the caller writes the lower disk. Locked.
 */
static int vswap_store_locked(struct vswap_region *r, u64 off, struct page *page)
{
	struct vsym_swaphdr *h = r->hdr;
	u32 s1 = READ_ONCE(r->index[off]);
	u32 top, s;

	if (s1 > r->slots) {
		WRITE_ONCE(r->index[off], 0);
		return -EIO;
	}
	if (s1) {
		u64 m = READ_ONCE(r->meta[s1 - 1]);

		if (vswap_holds(m, off, VSYM_SWAPR_SLOT_MAPPED)) {
			/* Overwritten in place; the referenced mark is for loads. */
			vswap_copy_in(r, s1 - 1, page);
			WRITE_ONCE(r->meta[s1 - 1], m & ~VSYM_SWAPR_REFERENCED);
			return 0;
		}
		WRITE_ONCE(r->index[off], 0);
		/* Being written to the swap file: never overwritten; vmsight frees it. */
		if (!vswap_holds(m, off, VSYM_SWAPR_SLOT_EVICTING))
			return -EIO;
		WRITE_ONCE(r->meta[s1 - 1], vswap_meta(VSYM_SWAPR_SLOT_DEAD, off));
	}
	top = READ_ONCE(h->free_top);
	if (top > r->slots)
		return -EIO;
	if (!top)
		return -ENOSPC;
	s = READ_ONCE(r->stack[top - 1]);
	if (s >= r->slots || vswap_state(READ_ONCE(r->meta[s])) != VSYM_SWAPR_SLOT_FREE)
		return -EIO;
	WRITE_ONCE(h->free_top, top - 1);
	vswap_copy_in(r, s, page);
	WRITE_ONCE(r->meta[s], vswap_meta(VSYM_SWAPR_SLOT_MAPPED, off));
	WRITE_ONCE(r->index[off], s + 1);
	WRITE_ONCE(h->used, READ_ONCE(h->used) + 1);
	return 0;
}

/* load: swap page OFF from the region into PAGE. 0, or -ENOENT (not cached) or -EIO. Locked. */
static int vswap_load_locked(struct vswap_region *r, u64 off, struct page *page)
{
	u32 s1 = READ_ONCE(r->index[off]);
	u64 m;

	if (!s1)
		return -ENOENT;
	if (s1 > r->slots)
		return -EIO;
	m = READ_ONCE(r->meta[s1 - 1]);
	if (!vswap_holds(m, off, VSYM_SWAPR_SLOT_MAPPED) &&
	    !vswap_holds(m, off, VSYM_SWAPR_SLOT_EVICTING))
		return -EIO;
	vswap_copy_out(r, s1 - 1, page);
	WRITE_ONCE(r->meta[s1 - 1], m | VSYM_SWAPR_REFERENCED);
	return 0;
}

/* invalidate: swap page OFF was freed by the kernel; its slot, if any, is let go. Locked. */
static int vswap_invalidate_locked(struct vswap_region *r, u64 off)
{
	struct vsym_swaphdr *h = r->hdr;
	u32 s1 = READ_ONCE(r->index[off]);
	u32 top, used;
	u64 m;

	if (!s1)
		return 0;
	WRITE_ONCE(r->index[off], 0);
	if (s1 > r->slots)
		return -EIO;
	m = READ_ONCE(r->meta[s1 - 1]);
	if (vswap_holds(m, off, VSYM_SWAPR_SLOT_EVICTING)) {
		WRITE_ONCE(r->meta[s1 - 1], vswap_meta(VSYM_SWAPR_SLOT_DEAD, off));
		return 0;
	}
	if (!vswap_holds(m, off, VSYM_SWAPR_SLOT_MAPPED))
		return -EIO;
	/*
	 * Free even if the stack is inconsistent (then the slot is lost, not stacked): a
	 * mapped slot no index names could be evicted over a newer copy of the page.
	 */
	WRITE_ONCE(r->meta[s1 - 1], vswap_meta(VSYM_SWAPR_SLOT_FREE, 0));
	top = READ_ONCE(h->free_top);
	if (top >= r->slots)
		return -EIO;
	WRITE_ONCE(r->stack[top], s1 - 1);
	WRITE_ONCE(h->free_top, top + 1);
	used = READ_ONCE(h->used);
	if (used)
		WRITE_ONCE(h->used, used - 1);
	return 0;
}

/* A store or a load under the region's lock: one of the *_locked operations. */
typedef int (*vswap_locked_op)(struct vswap_region *r, u64 off, struct page *page);

/*
 * Runs OP on swap page OFF under the region's lock and counts it: DONE when it succeeded,
 * VSWAP_CORRUPT on -EIO, FAILED (unless it is -1) on any other refusal. -EAGAIN when the
 * region is gone or its lock stayed busy (the caller uses the lower disk).
 */
static int vswap_run(u64 off, struct page *page, vswap_locked_op op, int done, int failed,
		     enum vswap_time clock, const char *what)
{
	u64 t0 = rdtsc_ordered();
	struct vswap_region *r;
	unsigned long flags;
	int err;

	rcu_read_lock();
	r = vswap_begin(off, &flags);
	if (!r) {
		rcu_read_unlock();
		return -EAGAIN;
	}
	err = op(r, off, page);
	if (!err)
		vswap_count(done);
	else if (err == -EIO)
		vswap_count(VSWAP_CORRUPT);
	else if (failed >= 0)
		vswap_count(failed);
	vswap_unlock(r, flags);
	rcu_read_unlock();
	vswap_time_since(clock, t0);
	vswap_check(err, what, off);
	return err;
}

/*
 * Swap page OFF is being written: an invalidation of its previous contents still deferred
 * must not run after this store (it would drop the new copy). Called before the lock.
 */
static void vswap_undefer(u64 off)
{
	struct vswap_region *r;

	rcu_read_lock();
	r = rcu_dereference(vswap.live);
	if (r && off < r->pages && test_bit(off, r->deferred))
		clear_bit(off, r->deferred);
	rcu_read_unlock();
}

/*
 * Stores PAGE as swap page OFF. 0 when the region took it; otherwise the caller writes the
 * lower disk. COUNT_FULL: count a full cache (rw_page does not: the bio path retries).
 */
static int vswap_store(u64 off, struct page *page, bool count_full)
{
	vswap_undefer(off);
	return vswap_run(off, page, vswap_store_locked, VSWAP_STORES,
			 count_full ? VSWAP_STORE_FULL : -1, VSWAP_T_STORE, "store");
}

/* Loads swap page OFF into PAGE. 0 on a hit; otherwise the caller reads the lower disk. */
static int vswap_load(u64 off, struct page *page, bool count_miss)
{
	return vswap_run(off, page, vswap_load_locked, VSWAP_LOADS,
			 count_miss ? VSWAP_LOAD_MISSES : -1, VSWAP_T_LOAD, "load");
}

/* Invalidates swap page OFF, counted. Locked. */
static int vswap_invalidate_counted(struct vswap_region *r, u64 off)
{
	int err = vswap_invalidate_locked(r, off);

	if (err)
		vswap_count(VSWAP_CORRUPT);
	vswap_count(VSWAP_INVALIDATES);
	return err;
}

/*
 * Swap page OFF is free. When the lock stays busy, its slot is let go later by the drain
 * work (a slot left mapped would keep the freed page's memory until the page is reused).
 */
static void vswap_invalidate(u64 off)
{
	struct vswap_region *r;
	unsigned long flags;
	int err;

	rcu_read_lock();
	r = rcu_dereference(vswap.live);
	if (!r || off >= r->pages)
		goto out;
	if (!vswap_lock(r, &flags)) {
		set_bit(off, r->deferred);
		vswap_count(VSWAP_DEFERRED);
		queue_delayed_work(system_wq, &vswap_drain_work, VSWAP_DRAIN_DELAY);
		goto out;
	}
	if (!vswap_serving(r, flags))
		goto out;
	err = vswap_invalidate_counted(r, off);
	vswap_unlock(r, flags);
	vswap_check(err, "invalidate", off);
out:
	rcu_read_unlock();
}

/*
 * The drain work: runs the invalidations deferred by a busy lock, a batch per lock hold;
 * comes back after VSWAP_DRAIN_DELAY while the lock stays busy. Nothing is left to do when
 * vmsight stops serving the region (it no longer holds pages for the guest).
 */
static void vswap_drain(struct work_struct *work)
{
	struct vswap_region *r;
	unsigned long flags, off = 0, bad = ULONG_MAX;
	bool again = false;
	int n;

	rcu_read_lock();
	r = rcu_dereference(vswap.live);
	while (r && (off = find_next_bit(r->deferred, r->pages, off)) < r->pages) {
		if (!vswap_lock(r, &flags)) {
			again = true;
			break;
		}
		if (!vswap_serving(r, flags))
			break;
		for (n = 0; off < r->pages && n < VSWAP_DRAIN_BATCH; n++) {
			if (test_and_clear_bit(off, r->deferred) && vswap_invalidate_counted(r, off))
				bad = off;
			off = find_next_bit(r->deferred, r->pages, off + 1);
		}
		vswap_unlock(r, flags);
	}
	rcu_read_unlock();
	if (bad != ULONG_MAX)
		vswap_check(-EIO, "deferred invalidate", bad);
	if (again)
		queue_delayed_work(system_wq, &vswap_drain_work, VSWAP_DRAIN_DELAY);
}

/* --- vmswap0 ------------------------------------------------------------------------------- */

/* Pages of one request the region did not serve, gathered into pieces for the lower disk. */
struct vswap_lower {
	struct bio *parent;
	struct bio *bio; /* the piece being built */
	sector_t next; /* the sector that extends it */
};

/* A piece completed: like bio_chain's completion, plus the count teardown waits for. */
static void vswap_lower_end(struct bio *bio)
{
	struct bio *parent = bio->bi_private;

	if (bio->bi_status && !parent->bi_status)
		parent->bi_status = bio->bi_status;
	bio_put(bio);
	bio_endio(parent);
	if (atomic_dec_and_test(&vswap.inflight))
		wake_up_var(&vswap.inflight);
}

/*
 * Sends the piece being built. Never waited for here: inside submit_bio it only joins
 * current->bio_list, and it completes the parent through the parent's remaining count.
 */
static void vswap_lower_send(struct vswap_lower *l)
{
	struct bio *bio = l->bio;

	if (!bio)
		return;
	l->bio = NULL;
	atomic_long_add(bio->bi_iter.bi_size >> PAGE_SHIFT,
			&vswap_ctr[op_is_write(bio_op(bio)) ? VSWAP_LOWER_WRITES : VSWAP_LOWER_READS]);
	bio_inc_remaining(l->parent);
	atomic_inc(&vswap.inflight);
	submit_bio_noacct(bio);
}

/* Adds the page at SECTOR of the parent request to the lower disk's pieces. */
static void vswap_lower_add(struct vswap_lower *l, sector_t sector, struct page *page)
{
	struct bio *parent = l->parent;
	unsigned int nr;
	struct bio *bio;

	if (l->bio && l->next == sector && bio_add_page(l->bio, page, PAGE_SIZE, 0) == PAGE_SIZE) {
		l->next += VSWAP_SECTORS;
		return;
	}
	vswap_lower_send(l);
	nr = min_t(u64, (bio_end_sector(parent) - sector) / VSWAP_SECTORS, BIO_MAX_VECS);
	/* GFP_NOIO from a mempool with a rescuer: waits, never fails, cannot deadlock. */
	bio = bio_alloc_bioset(vswap.lower, max(nr, 1U),
			       bio_op(parent) | (parent->bi_opf & VSWAP_PASS_FLAGS), GFP_NOIO,
			       &vswap.bs);
	if (!bio) {
		parent->bi_status = BLK_STS_RESOURCE;
		return;
	}
	bio_clone_blkg_association(bio, parent);
	bio->bi_iter.bi_sector = sector;
	bio->bi_ioprio = parent->bi_ioprio;
	bio->bi_private = parent;
	bio->bi_end_io = vswap_lower_end;
	__bio_add_page(bio, page, PAGE_SIZE, 0);
	l->bio = bio;
	l->next = sector + VSWAP_SECTORS;
}

/* Whether BIO is made of whole, page-aligned 4 KiB pages (all that swap and mkswap send). */
static bool vswap_whole_pages(struct bio *bio)
{
	struct bvec_iter iter;
	struct bio_vec bv;

	if (bio->bi_iter.bi_sector & (VSWAP_SECTORS - 1))
		return false;
	bio_for_each_segment(bv, bio, iter)
		if (bv.bv_offset || bv.bv_len != PAGE_SIZE)
			return false;
	return true;
}

/*
 * Reads and writes, page by page: what the region serves is done when this returns; the
 * rest goes to the lower disk in pieces chained to BIO, which completes with the last of
 * them. No discard or write-zeroes is advertised, and no write cache (flushes never come:
 * the block layer drops them, and a store is in memory when it returns).
 */
static void vswap_submit_bio(struct bio *bio)
{
	struct vswap_lower l = { .parent = bio };
	sector_t sector = bio->bi_iter.bi_sector;
	struct bvec_iter iter;
	struct bio_vec bv;
	bool write;

	switch (bio_op(bio)) {
	case REQ_OP_READ:
		write = false;
		break;
	case REQ_OP_WRITE:
		write = true;
		break;
	default:
		bio->bi_status = BLK_STS_NOTSUPP;
		bio_endio(bio);
		return;
	}
	if (!vswap_whole_pages(bio)) {
		pr_warn_ratelimited("%s: %s at sector %llu of %u bytes is not whole 4 KiB pages: refused\n",
				    VSWAP_NAME, write ? "write" : "read",
				    (unsigned long long)sector, bio->bi_iter.bi_size);
		bio_io_error(bio);
		return;
	}
	bio_for_each_segment(bv, bio, iter) {
		u64 off = sector / VSWAP_SECTORS;
		int err = write ? vswap_store(off, bv.bv_page, true) :
				  vswap_load(off, bv.bv_page, true);

		if (err)
			vswap_lower_add(&l, sector, bv.bv_page);
		sector += VSWAP_SECTORS;
	}
	vswap_lower_send(&l);
	bio_endio(bio);
}

/*
 * One page without a bio (swap_readpage with SWP_SYNCHRONOUS_IO, which 6.1 sets for a disk
 * with rw_page; __swap_writepage always tries it first). A hit completes like zram and brd
 * do (page_endio); anything else returns an error without touching the page, and the kernel
 * sends the same page as a bio, which counts the miss and goes to the lower disk.
 */
static int vswap_rw_page(struct block_device *bdev, sector_t sector, struct page *page,
			 enum req_op op)
{
	bool write = op_is_write(op);
	int err;

	if (PageTransHuge(page) || (sector & (VSWAP_SECTORS - 1)))
		return -EOPNOTSUPP;
	err = write ? vswap_store(sector / VSWAP_SECTORS, page, false) :
		      vswap_load(sector / VSWAP_SECTORS, page, false);
	if (err)
		return err;
	page_endio(page, write, 0);
	return 0;
}

/* Called under the swap locks when the kernel frees a swap slot. */
static void vswap_slot_free_notify(struct block_device *bdev, unsigned long offset)
{
	vswap_invalidate(offset);
}

/* Called under disk->open_mutex: a device being removed takes no new opener. */
static int vswap_open(struct block_device *bdev, fmode_t mode)
{
	return READ_ONCE(vswap.claimed) ? -ENXIO : 0;
}

/* .owner: an open vmswap0 (swapon) holds the module, so rmmod fails with EBUSY. */
static const struct block_device_operations vswap_fops = {
	.owner = THIS_MODULE,
	.open = vswap_open,
	.submit_bio = vswap_submit_bio,
	.rw_page = vswap_rw_page,
	.swap_slot_free_notify = vswap_slot_free_notify,
};

/* The same without rw_page (module parameter swap_rw_page=0). */
static const struct block_device_operations vswap_fops_bio = {
	.owner = THIS_MODULE,
	.open = vswap_open,
	.submit_bio = vswap_submit_bio,
	.swap_slot_free_notify = vswap_slot_free_notify,
};

/* Tells vmsight whether vmswap0 uses the region. Caller holds vswap_mutex. */
static void vswap_set_guest_state(void)
{
	if (vswap.reg)
		WRITE_ONCE(vswap.reg->hdr->guest_state,
			   vswap.disk ? VSYM_SWAPR_GUEST_ACTIVE : VSYM_SWAPR_GUEST_NONE);
}

/* Creates vmswap0 over vswap.path. Caller holds vswap_mutex; the region is bound. */
static int vswap_create(void)
{
	struct block_device *lower;
	struct request_queue *q;
	struct gendisk *disk;
	sector_t sectors;
	int err;

	lower = blkdev_get_by_path(vswap.path, VSWAP_LOWER_MODE, &vswap);
	if (IS_ERR(lower)) {
		pr_warn("cannot open the swap disk %s (%ld): no %s\n", vswap.path, PTR_ERR(lower),
			VSWAP_NAME);
		return PTR_ERR(lower);
	}
	sectors = round_down(bdev_nr_sectors(lower), VSWAP_SECTORS);
	if (sectors < 2 * VSWAP_SECTORS) {
		pr_warn("the swap disk %s is too small: no %s\n", vswap.path, VSWAP_NAME);
		err = -EINVAL;
		goto put;
	}
	if (sectors / VSWAP_SECTORS != vswap.reg->pages)
		pr_warn("the swap disk %s has %llu pages, the swap region indexes %llu: pages beyond go to the disk only\n",
			vswap.path, (unsigned long long)(sectors / VSWAP_SECTORS), vswap.reg->pages);
	err = bioset_init(&vswap.bs, BIO_POOL_SIZE, 0, BIOSET_NEED_BVECS | BIOSET_NEED_RESCUER);
	if (err)
		goto put;
	disk = blk_alloc_disk(NUMA_NO_NODE);
	if (!disk) {
		err = -ENOMEM;
		goto bioset;
	}
	/* major 0, minors 0: add_disk takes a number from the extended range. */
	disk->fops = READ_ONCE(vswap_rw_page_on) ? &vswap_fops : &vswap_fops_bio;
	disk->flags |= GENHD_FL_NO_PART;
	strscpy(disk->disk_name, VSWAP_NAME, DISK_NAME_LEN);
	set_capacity(disk, sectors);
	q = disk->queue;
	blk_queue_logical_block_size(q, PAGE_SIZE);
	blk_queue_physical_block_size(q, PAGE_SIZE);
	blk_queue_io_min(q, PAGE_SIZE);
	blk_queue_io_opt(q, PAGE_SIZE);
	/* O_DIRECT buffers page-aligned too, so every request is whole pages. */
	blk_queue_dma_alignment(q, PAGE_SIZE - 1);
	blk_queue_max_hw_sectors(q, BIO_MAX_VECS * VSWAP_SECTORS);
	blk_queue_flag_set(QUEUE_FLAG_NONROT, q);
	blk_queue_flag_clear(QUEUE_FLAG_ADD_RANDOM, q);

	vswap.lower = lower;
	WRITE_ONCE(vswap.claimed, false);
	atomic_set(&vswap.inflight, 0);
	err = add_disk(disk);
	if (err) {
		put_disk(disk);
		vswap.lower = NULL;
		goto bioset;
	}
	vswap.disk = disk;
	vswap_set_guest_state();
	pr_info("%s: swap over %s through vmsight's swap region (%u slots for %llu pages, rw_page %s)\n",
		VSWAP_NAME, vswap.path, vswap.reg->slots, vswap.reg->pages,
		disk->fops->rw_page ? "on" : "off");
	return 0;

bioset:
	bioset_exit(&vswap.bs);
put:
	blkdev_put(lower, VSWAP_LOWER_MODE);
	return err;
}

/*
 * Removes vmswap0: -EBUSY while it is open (swapon), unless FORCE (module exit, where no one
 * can hold it open: an opener holds the module). Caller holds vswap_mutex.
 */
static int vswap_destroy(bool force)
{
	struct gendisk *disk = vswap.disk;

	if (!disk)
		return 0;
	mutex_lock(&disk->open_mutex);
	if (disk_openers(disk) && !force) {
		mutex_unlock(&disk->open_mutex);
		return -EBUSY;
	}
	WRITE_ONCE(vswap.claimed, true);
	mutex_unlock(&disk->open_mutex);
	/* No submit_bio or rw_page runs after this (it freezes and drains the queue)... */
	del_gendisk(disk);
	/* ...but pieces sent to the lower disk may still complete into this module. */
	wait_var_event(&vswap.inflight, !atomic_read(&vswap.inflight));
	put_disk(disk);
	vswap.disk = NULL;
	blkdev_put(vswap.lower, VSWAP_LOWER_MODE);
	vswap.lower = NULL;
	bioset_exit(&vswap.bs);
	vswap_set_guest_state();
	pr_info("%s removed (swap disk %s released)\n", VSWAP_NAME, vswap.path);
	return 0;
}

/* Creates vmswap0 if everything it needs is there. Caller holds vswap_mutex. */
static void vswap_try_create(void)
{
	if (vswap.ready && vswap.reg && vswap.path[0] && !vswap.disk)
		vswap_create();
}

/* --- module parameters --------------------------------------------------------------------- */

/*
 * swap_disk: the lower disk's path. At modprobe it is only kept (vmswap0 comes when the module
 * is up and the region bound); later, writing it creates vmswap0 (or replaces it, if not in
 * use), and writing an empty string removes it (EBUSY while in use).
 */
static int vswap_disk_set(const char *val, const struct kernel_param *kp)
{
	char buf[VSWAP_PATH_MAX], *path;
	int err = 0;

	if (strscpy(buf, val, sizeof(buf)) < 0)
		return -ENAMETOOLONG;
	path = strim(buf); /* echo's newline */
	mutex_lock(&vswap_mutex);
	if (vswap.exiting) {
		err = -ENODEV;
		goto out;
	}
	if (vswap.ready) {
		if (vswap.disk && !strcmp(path, vswap.path))
			goto out; /* already so */
		err = vswap_destroy(false);
		if (err)
			goto out;
	}
	strscpy(vswap.path, path, sizeof(vswap.path));
	if (!vswap.ready || !path[0])
		goto out;
	if (!vswap.reg) {
		pr_info("swap disk %s: %s comes when vmsight's swap region is there\n", path,
			VSWAP_NAME);
		goto out;
	}
	err = vswap_create();
	if (err)
		vswap.path[0] = 0;
out:
	mutex_unlock(&vswap_mutex);
	return err;
}

static int vswap_disk_get(char *buf, const struct kernel_param *kp)
{
	int len;

	mutex_lock(&vswap_mutex);
	len = sysfs_emit(buf, "%s\n", vswap.path);
	mutex_unlock(&vswap_mutex);
	return len;
}

static const struct kernel_param_ops vswap_disk_ops = {
	.set = vswap_disk_set,
	.get = vswap_disk_get,
};
module_param_cb(swap_disk, &vswap_disk_ops, NULL, 0644);
MODULE_PARM_DESC(swap_disk,
		 "SwapBypass: the swap disk (e.g. /dev/vdb) " VSWAP_NAME " stacks on; empty: none");

/* "none", "region" (bound, no vmswap0), "active LOWER SLOTS", or "passthrough LOWER" (vmswap0
 * without a region: everything goes to the lower disk). Caller holds vswap_mutex. */
static int vswap_state_emit(char *buf, int len)
{
	if (vswap.disk && vswap.reg)
		return sysfs_emit_at(buf, len, "active %s %u\n", vswap.path, vswap.reg->slots);
	if (vswap.disk)
		return sysfs_emit_at(buf, len, "passthrough %s\n", vswap.path);
	return sysfs_emit_at(buf, len, "%s\n", vswap.reg ? "region" : "none");
}

static int vswap_state_get(char *buf, const struct kernel_param *kp)
{
	int len;

	mutex_lock(&vswap_mutex);
	len = vswap_state_emit(buf, 0);
	mutex_unlock(&vswap_mutex);
	return len;
}

static const struct kernel_param_ops vswap_state_ops = {
	.set = vsym_counter_set,
	.get = vswap_state_get,
};
module_param_cb(swap_state, &vswap_state_ops, NULL, 0444);
MODULE_PARM_DESC(swap_state, "SwapBypass: none | region | active LOWER SLOTS | passthrough LOWER");

/* Everything in "key value" lines: state, the region's occupancy, the counters. */
static int vswap_stats_get(char *buf, const struct kernel_param *kp)
{
	struct vswap_region *r;
	int len, i;

	mutex_lock(&vswap_mutex);
	len = sysfs_emit(buf, "state ");
	len += vswap_state_emit(buf, len);
	r = vswap.reg;
	if (r) {
		/* Read without the lock: a snapshot for people, not for decisions. */
		len += sysfs_emit_at(buf, len,
				     "vmm_state %u\nswap_pages %llu\nslots %u\nused %u\nfree %u\nlimit %u\n",
				     READ_ONCE(r->hdr->vmm_state), r->pages, r->slots,
				     READ_ONCE(r->hdr->used), READ_ONCE(r->hdr->free_top),
				     READ_ONCE(r->hdr->limit));
	}
	mutex_unlock(&vswap_mutex);
	for (i = 0; i < VSWAP_NR_CTR; i++)
		len += sysfs_emit_at(buf, len, "%s %ld\n", vswap_ctr_names[i],
				     atomic_long_read(&vswap_ctr[i]));
	for (i = 0; i < VSWAP_NR_T; i++)
		len += sysfs_emit_at(buf, len, "%s %llu\n", vswap_time_names[i],
				     tsc_khz ? mul_u64_u32_div(atomic64_read(&vswap_cycles[i]),
							       USEC_PER_SEC, tsc_khz) : 0);
	return len;
}

static const struct kernel_param_ops vswap_stats_ops = {
	.set = vsym_counter_set,
	.get = vswap_stats_get,
};
module_param_cb(swap_stats, &vswap_stats_ops, NULL, 0444);
MODULE_PARM_DESC(swap_stats, "SwapBypass: state, occupancy and counters, KEY VALUE lines");

#define VSWAP_COUNTER_PARAM(name, c, desc)                     \
	module_param_cb(name, &vsym_counter_ops, &vswap_ctr[c], 0444); \
	MODULE_PARM_DESC(name, "SwapBypass: " desc " (read-only counter)")
VSWAP_COUNTER_PARAM(swap_stores, VSWAP_STORES, "pages stored in the region");
VSWAP_COUNTER_PARAM(swap_store_full, VSWAP_STORE_FULL, "stores refused: no free slot");
VSWAP_COUNTER_PARAM(swap_loads, VSWAP_LOADS, "pages loaded from the region");
VSWAP_COUNTER_PARAM(swap_load_misses, VSWAP_LOAD_MISSES, "loads of pages the region lacks");
VSWAP_COUNTER_PARAM(swap_invalidates, VSWAP_INVALIDATES, "freed swap pages dropped");
VSWAP_COUNTER_PARAM(swap_busy, VSWAP_BUSY, "operations given up on a busy region lock");
VSWAP_COUNTER_PARAM(swap_lower_reads, VSWAP_LOWER_READS, "pages read from the swap disk");
VSWAP_COUNTER_PARAM(swap_lower_writes, VSWAP_LOWER_WRITES, "pages written to the swap disk");
VSWAP_COUNTER_PARAM(swap_corrupt, VSWAP_CORRUPT, "protocol violations found in the region");
VSWAP_COUNTER_PARAM(swap_deferred, VSWAP_DEFERRED,
		    "freed pages whose slot was let go later (busy lock at the free)");

/* --- the region's PCI device ---------------------------------------------------------------- */

/* Whether BAR2 of PDEV starts with the swap region's magic. */
static bool vswap_is_region(struct pci_dev *pdev)
{
	void *p;
	bool yes;

	if (!(pci_resource_flags(pdev, 2) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, 2) < 2 * PAGE_SIZE || pci_enable_device(pdev))
		return false;
	p = memremap(pci_resource_start(pdev, 2), PAGE_SIZE, MEMREMAP_WB);
	yes = p && READ_ONCE(((struct vsym_swaphdr *)p)->magic) == VSYM_SWAPR_MAGIC;
	if (p)
		memunmap(p);
	pci_disable_device(pdev);
	return yes;
}

/* Whether part [OFF, OFF + LEN) starts page-aligned at or after FROM and ends within SIZE. */
static bool vswap_part_ok(u64 off, u64 len, u64 from, u64 size)
{
	return off >= from && IS_ALIGNED(off, PAGE_SIZE) && off <= size && len <= size - off;
}

/*
 * Checks the header's layout (the parts in order, each within the region) and fills R.
 * Read once: a later change by vmsight is not followed, so it cannot move a part under us.
 */
static int vswap_layout(struct vswap_region *r, u64 bar_len)
{
	struct vsym_swaphdr *h = r->hdr;
	u64 index_off = READ_ONCE(h->index_off), meta_off = READ_ONCE(h->meta_off);
	u64 stack_off = READ_ONCE(h->stack_off), data_off = READ_ONCE(h->data_off);
	u64 pages = READ_ONCE(h->swap_pages);
	u32 slots = READ_ONCE(h->slots);

	r->size = READ_ONCE(h->region_size);
	if (r->size != bar_len) {
		pr_warn("swap region: its header says %llu bytes, the BAR has %llu: refused\n",
			r->size, bar_len);
		return -EINVAL;
	}
	if (pages < 2 || pages > U32_MAX || !slots ||
	    !vswap_part_ok(index_off, pages * sizeof(u32), PAGE_SIZE, r->size) ||
	    !vswap_part_ok(meta_off, (u64)slots * sizeof(u64), index_off + pages * sizeof(u32),
			   r->size) ||
	    !vswap_part_ok(stack_off, (u64)slots * sizeof(u32), meta_off + (u64)slots * sizeof(u64),
			   r->size) ||
	    !vswap_part_ok(data_off, (u64)slots * PAGE_SIZE, stack_off + (u64)slots * sizeof(u32),
			   r->size)) {
		pr_warn("swap region: bad layout (%llu pages, %u slots, parts at 0x%llx 0x%llx 0x%llx 0x%llx of 0x%llx): refused\n",
			pages, slots, index_off, meta_off, stack_off, data_off, r->size);
		return -EINVAL;
	}
	r->pages = pages;
	r->slots = slots;
	r->index = r->base + index_off;
	r->meta = r->base + meta_off;
	r->stack = r->base + stack_off;
	r->data = r->base + data_off;
	return 0;
}

/* Maps and checks the swap region of PDEV (enabled). Caller holds vswap_mutex. */
static int vswap_bind(struct pci_dev *pdev)
{
	u64 len = pci_resource_len(pdev, 2);
	struct vswap_region *r;
	u32 abi;
	int err;

	r = kzalloc(sizeof(*r), GFP_KERNEL);
	if (!r)
		return -ENOMEM;
	r->base = memremap(pci_resource_start(pdev, 2), len, MEMREMAP_WB);
	if (!r->base) {
		pr_warn("cannot map the %llu-byte swap region\n", len);
		err = -ENOMEM;
		goto free;
	}
	r->hdr = r->base;
	abi = READ_ONCE(r->hdr->abi);
	if (READ_ONCE(r->hdr->magic) != VSYM_SWAPR_MAGIC) {
		err = -ENODEV;
		goto unmap;
	}
	if (abi != VSYM_SWAPR_ABI) {
		pr_warn("the swap region speaks version %u, this module %u: refused, swap goes to the disk\n",
			abi, VSYM_SWAPR_ABI);
		err = -ENODEV;
		goto unmap;
	}
	err = vswap_layout(r, len);
	if (err)
		goto unmap;
	/* At most a 32nd of the region: the index already takes 4 bytes per page. */
	r->deferred = kvcalloc(BITS_TO_LONGS(r->pages), sizeof(long), GFP_KERNEL);
	if (!r->deferred) {
		err = -ENOMEM;
		goto unmap;
	}
	if (!(vsym.fw_features & VSYM_FEAT_SWAP))
		pr_info("fw_cfg does not announce swap (features 0x%x); using the swap region anyway\n",
			vsym.fw_features);
	vswap.pdev = pdev;
	vswap.reg = r;
	vswap.gone_logged = false;
	vswap_set_guest_state();
	rcu_assign_pointer(vswap.live, r);
	pr_info("swap region bound: %llu MiB, %u slots for %llu swap pages (vmm_state %u)\n",
		len >> 20, r->slots, r->pages, READ_ONCE(r->hdr->vmm_state));
	return 0;

unmap:
	memunmap(r->base);
free:
	kfree(r);
	return err;
}

/*
 * Unbinds the region. vmswap0, if any, stays and sends everything to the lower disk, which
 * is right: the disk's backend in vmsight serves the pages the region holds. Caller holds
 * vswap_mutex.
 */
static void vswap_unbind(void)
{
	struct vswap_region *r = vswap.reg;

	if (!r)
		return;
	RCU_INIT_POINTER(vswap.live, NULL);
	/* Operations run under rcu_read_lock: none uses the mapping after this... */
	synchronize_rcu();
	/* ...and a drain that comes after finds no region (it does not queue itself then). */
	cancel_delayed_work_sync(&vswap_drain_work);
	WRITE_ONCE(r->hdr->guest_state, VSYM_SWAPR_GUEST_NONE);
	memunmap(r->base);
	kvfree(r->deferred);
	kfree(r);
	vswap.reg = NULL;
	pci_disable_device(vswap.pdev);
	vswap.pdev = NULL;
	pr_info("swap region unbound%s\n", vswap.disk ? ": " VSWAP_NAME " sends everything to the disk" : "");
}

/* Probe of an ivshmem device whose BAR2 holds the swap region. */
static int vswap_probe(struct pci_dev *pdev)
{
	int err;

	err = pci_enable_device(pdev);
	if (err)
		return err;
	mutex_lock(&vswap_mutex);
	if (vswap.pdev) {
		pr_warn("a second swap region: ignored\n");
		err = -EBUSY;
	} else {
		err = vswap_bind(pdev);
	}
	if (!err)
		vswap_try_create();
	mutex_unlock(&vswap_mutex);
	if (err)
		pci_disable_device(pdev);
	return err;
}

/* PCI removal (or module exit) of a device that is not the symbiotic interface's. */
static void vswap_remove(struct pci_dev *pdev)
{
	mutex_lock(&vswap_mutex);
	if (pdev == vswap.pdev)
		vswap_unbind();
	mutex_unlock(&vswap_mutex);
}

/* The module is up: vmswap0 may be created (now, if swap_disk was given to modprobe). */
static void vswap_start(void)
{
	mutex_lock(&vswap_mutex);
	vswap.ready = true;
	vswap_try_create();
	mutex_unlock(&vswap_mutex);
}

/* The module is leaving: vmswap0 goes (nobody holds it: an opener would hold the module). */
static void vswap_stop(void)
{
	mutex_lock(&vswap_mutex);
	vswap.ready = false;
	vswap.exiting = true;
	vswap_destroy(true);
	mutex_unlock(&vswap_mutex);
}
