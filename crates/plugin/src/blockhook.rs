//! FoxyIdle's block tags: who submitted each bio, published before the request reaches the
//! virtual disk.
//!
//! Two guest kernel function entries are instrumented (by address, from the profile), with an
//! unconditional callback that costs one helper call per event and nothing elsewhere:
//!
//! * `blk_mq_submit_bio(struct bio *bio)`: runs in the submitting task's context (readahead
//!   and metadata reads included; the kernel's flusher and journal threads are kernel
//!   threads). The callback reads the bio's sector, size, operation and disk, the current
//!   task (TGID, comm, flags) and up to four ancestors, and pushes a
//!   [`vmsight_ring::blocktag::BlockTag`] record. The push happens before the kernel builds
//!   the request, so it is in the ring before the request can reach the backend.
//! * `__x64_sys_prctl(const struct pt_regs *regs)`: a `prctl(VMSIGHT_PRCTL_OPTION,
//!   VMSIGHT_PRCTL_BACKGROUND, on)` from libvmsight becomes a
//!   [`vmsight_ring::blocktag::Declaration`] record; every other prctl returns at once.
//!
//! Both read guest memory through the vCPU's page tables with bounded reads; a failed read
//! drops the event (counted as a kernel read error), never the guest.

use std::ffi::{c_uint, c_void};

use crate::qemu::{Insn, RegAccess};
use vmsight_ring::blocktag::{
    comm_hash, Ancestor, BlockTag, Declaration, ANCESTORS, PRCTL_BACKGROUND, PRCTL_OPTION,
};
use vmsight_ring::{monotonic_ns, ChannelPlugin, Counter, COMM_LEN};

use crate::logic::{is_kernel_addr, BlockLayout};
use crate::{ctx, guard, Ctx, KernelMem};

/// The block-tag channel and what the hooks need.
pub(crate) struct BlockHooks {
    pub channel: ChannelPlugin,
    pub layout: BlockLayout,
}

/// Which hook an instrumented address is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    SubmitBio = 1,
    Prctl = 2,
}

impl BlockHooks {
    fn hook_at(&self, vaddr: u64) -> Option<Hook> {
        if vaddr == self.layout.submit_bio {
            Some(Hook::SubmitBio)
        } else if Some(vaddr) == self.layout.prctl {
            Some(Hook::Prctl)
        } else {
            None
        }
    }

    /// Registers the hook callback if `vaddr` is a hooked function entry; returns whether it
    /// did.
    pub fn instrument(&self, insn: &Insn<'_>, vaddr: u64) -> bool {
        let Some(hook) = self.hook_at(vaddr) else {
            return false;
        };
        insn.on_exec(on_hook, RegAccess::Read, hook as usize);
        true
    }
}

extern "C" fn on_hook(vcpu: c_uint, udata: *mut c_void) {
    guard(Some(vcpu), || {
        let Some(mut c) = ctx(vcpu) else { return };
        let Some(hooks) = c.st.blk.as_ref() else {
            return;
        };
        let lay = hooks.layout;
        match udata as usize {
            1 => submit_bio(&mut c, &lay),
            2 => prctl(&mut c, &lay),
            _ => c.count(Counter::InternalErrors, 1),
        }
    });
}

/// rdi and the active GS base (the kernel's per-CPU area: the hooks run in kernel mode).
fn arg_and_gs(c: &mut Ctx<'_>) -> Option<(u64, u64)> {
    let (Some(rdi), Some(gs)) = (c.regs.gpr.get(7).copied(), c.regs.gs_base) else {
        c.count(Counter::InternalErrors, 1);
        return None;
    };
    let mut v = [0u64; 2];
    if c.hot.regbuf.read_registers(&[rdi, gs], &mut v) != 0 {
        c.count(Counter::RegReadErrors, 1);
        return None;
    }
    Some((v[0], v[1]))
}

/// Reads guest kernel memory for the hooks, counting failures once per event.
struct Reader<'m, 'a> {
    m: &'m mut KernelMem<'a>,
}

impl Reader<'_, '_> {
    fn bytes<const N: usize>(&mut self, addr: u64) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        self.m.read(addr, &mut b).then_some(b)
    }

    fn u32_at(&mut self, addr: u64) -> Option<u32> {
        self.bytes::<4>(addr).map(u32::from_le_bytes)
    }

    fn u64_at(&mut self, addr: u64) -> Option<u64> {
        self.bytes::<8>(addr).map(u64::from_le_bytes)
    }
}

fn submit_bio(c: &mut Ctx<'_>, lay: &BlockLayout) {
    let Some((bio, gs)) = arg_and_gs(c) else {
        return;
    };
    let current_task = c.lay.current_task;
    let mut m = c.kmem();
    let tag = read_tag(&mut Reader { m: &mut m }, lay, current_task, bio, gs);
    let errors = m.errors;
    if errors > 0 {
        c.count(Counter::KernelReadErrors, errors);
    }
    let Some(tag) = tag else { return };
    let rec = tag.to_record(c.vcpu, monotonic_ns(), lay.submit_bio);
    if let Some(p) = c.hot.blk.as_mut() {
        p.push(&rec);
    }
}

fn read_tag(
    r: &mut Reader<'_, '_>,
    lay: &BlockLayout,
    current_task: u64,
    bio: u64,
    gs: u64,
) -> Option<BlockTag> {
    if !is_kernel_addr(bio) || !is_kernel_addr(gs) {
        return None;
    }
    let task = r.u64_at(gs.wrapping_add(current_task))?;
    let f = r.m.task_fields(task)?;
    let bdev = r.u64_at(bio.wrapping_add(lay.bi_bdev))?;
    let disk = r.u64_at(bdev.wrapping_add(lay.bd_disk))?;
    Some(BlockTag {
        sector: r.u64_at(bio.wrapping_add(lay.bi_sector))?,
        size: r.u32_at(bio.wrapping_add(lay.bi_size))?,
        opf: r.u32_at(bio.wrapping_add(lay.bi_opf))?,
        disk_name: r.bytes::<8>(disk.wrapping_add(lay.disk_name))?,
        major: r.u32_at(disk.wrapping_add(lay.major))?,
        first_minor: r.u32_at(disk.wrapping_add(lay.first_minor))?,
        tid: f.pid,
        tgid: f.tgid,
        comm: f.comm,
        task_flags: r.u32_at(task.wrapping_add(lay.task_flags))?,
        ancestors: ancestors(r, f.tgid, f.real_parent),
    })
}

/// Up to [`ANCESTORS`] distinct thread-group ancestors, parent first; stops at init, at a
/// loop, or at the first unreadable task.
fn ancestors(r: &mut Reader<'_, '_>, tgid: u32, mut parent: u64) -> [Ancestor; ANCESTORS] {
    let mut out = [Ancestor::default(); ANCESTORS];
    let mut last = tgid;
    let mut n = 0;
    // A thread's real_parent can be in its own group (threads of threads): allow a few
    // extra hops so four distinct groups are still found.
    for _ in 0..ANCESTORS * 2 {
        if n == ANCESTORS || last <= 1 || !is_kernel_addr(parent) {
            break;
        }
        let Some(f) = r.m.task_fields(parent) else {
            break;
        };
        if f.tgid != last {
            out[n] = Ancestor {
                tgid: f.tgid,
                comm_hash: comm_hash(&f.comm),
            };
            n += 1;
            last = f.tgid;
        }
        if f.real_parent == parent {
            break;
        }
        parent = f.real_parent;
    }
    out
}

fn prctl(c: &mut Ctx<'_>, lay: &BlockLayout) {
    let Some((regs, gs)) = arg_and_gs(c) else {
        return;
    };
    let current_task = c.lay.current_task;
    let mut m = c.kmem();
    let decl = read_declaration(&mut Reader { m: &mut m }, lay, current_task, regs, gs);
    let errors = m.errors;
    if errors > 0 {
        c.count(Counter::KernelReadErrors, errors);
    }
    let (Some(d), Some(pc)) = (decl, lay.prctl) else {
        return;
    };
    let rec = d.to_record(c.vcpu, monotonic_ns(), pc);
    if let Some(p) = c.hot.blk.as_mut() {
        p.push(&rec);
    }
}

fn read_declaration(
    r: &mut Reader<'_, '_>,
    lay: &BlockLayout,
    current_task: u64,
    regs: u64,
    gs: u64,
) -> Option<Declaration> {
    if !is_kernel_addr(regs) || !is_kernel_addr(gs) {
        return None;
    }
    if r.u64_at(regs.wrapping_add(lay.regs_di))? != PRCTL_OPTION
        || r.u64_at(regs.wrapping_add(lay.regs_si))? != PRCTL_BACKGROUND
    {
        return None; // an ordinary prctl: nothing to read further
    }
    let on = r.u64_at(regs.wrapping_add(lay.regs_dx))?;
    let task = r.u64_at(gs.wrapping_add(current_task))?;
    let f = r.m.task_fields(task)?;
    let mut comm = [0u8; COMM_LEN];
    comm.copy_from_slice(&f.comm);
    Some(Declaration {
        tid: f.pid,
        tgid: f.tgid,
        comm,
        background: on != 0,
    })
}
