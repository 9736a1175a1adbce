//! vCPU redirection (plugin API v7): run a guest function on a vCPU taken at a trigger and
//! put the vCPU back exactly as it was (`vmsight_proto::redirect` describes the primitive,
//! `vmsight_ring::redirect` the mailbox it arrives through).
//!
//! * Trigger: a monitored `syscall` instruction of the requested process. The vCPU's
//!   registers are saved, memory and the call frame written, the requested registers set, and
//!   the PC moved to the entry (`qemu_plugin_set_pc`, which leaves the callback).
//! * Return: a return marker instruction executed in the same address space with the frame's
//!   stack pointer (the guest may have moved the task to another vCPU meanwhile). The
//!   registers there are the function's results; every saved register is written back and the
//!   PC moved back to the `syscall` instruction, which then runs as if nothing happened.
//! * Check: when that `syscall` instruction is reached again, the registers are compared with
//!   the saved ones and the mismatches (none, normally) reported.
//!
//! One redirection is active at a time; everything here is rare, so plain mutexes do.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use vmsight_proto::redirect::{RedirectFailure, RedirectRequest, Reg, Trigger, NREGS};
use vmsight_ring::redirect::{Mailbox, ReturnReport};
use vmsight_ring::{monotonic_ns, Counter};

use crate::logic::{cr3_base, mismatch_mask, EFLAGS_IF};
use crate::qemu::{self, Api};
use crate::Ctx;

/// Width of each register in QEMU's gdb layout for x86-64 (EFLAGS is 32 bits).
fn width(r: Reg) -> usize {
    if r == Reg::Eflags {
        4
    } else {
        8
    }
}

/// Environment variable that turns redirection off (`0`/`off`): syscall callbacks are then
/// registered read-only even on API v7 (for measuring what the write access costs).
pub const REDIRECT_ENV: &str = "VMSIGHT_PLUGIN_REDIRECT";

/// Redirection is possible: API v7 with its write functions, and not turned off.
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = std::env::var(REDIRECT_ENV).is_ok_and(|v| matches!(v.trim(), "0" | "off"));
        !off && qemu::api() == Api::V7 && qemu::v7().is_some()
    })
}

/// The last request sequence taken from the mailbox.
static TAKEN: AtomicU64 = AtomicU64::new(0);
/// A redirection is waiting for its return marker.
static ACTIVE_ON: AtomicBool = AtomicBool::new(false);
static ACTIVE: Mutex<Option<Active>> = Mutex::new(None);
/// A restore is waiting to be checked.
static VERIFY_ON: AtomicBool = AtomicBool::new(false);
static VERIFY: Mutex<Option<Verify>> = Mutex::new(None);

struct Active {
    seq: u64,
    /// Kernel trigger: the rax value meaning "not a safe point, try again".
    not_here: Option<u64>,
    cr3: u64,
    /// RSP expected at the return marker.
    ret_rsp: u64,
    pc: u64,
    vcpu: u32,
    t0: u64,
    saved: [u64; NREGS],
}

struct Verify {
    seq: u64,
    cr3: u64,
    pc: u64,
    saved: [u64; NREGS],
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ctx<'_> {
    fn mailbox(&self) -> &Mailbox {
        self.st.channel.redirect_mailbox()
    }

    /// Reads every [`Reg`] of this vCPU; `None` if any read failed.
    fn read_all(&mut self) -> Option<[u64; NREGS]> {
        let mut out = [0u64; NREGS];
        let failed = self.hot.regbuf.read_registers(&self.regs.all, &mut out);
        (failed == 0).then_some(out)
    }

    /// Writes one register; false if QEMU refused.
    fn write_reg(&mut self, r: Reg, v: u64) -> bool {
        let bytes = v.to_le_bytes();
        let h = self.regs.all[r.index()];
        self.hot.regbuf.write_register(h, &bytes[..width(r)])
    }

    /// Writes every saved register back; false if any write failed.
    fn restore(&mut self, saved: &[u64; NREGS]) -> bool {
        let mut ok = true;
        for r in Reg::ALL {
            ok &= self.write_reg(r, saved[r.index()]);
        }
        ok
    }

    /// At a monitored `syscall` instruction of process `tgid` at `pc`: checks a pending
    /// restore, then takes a waiting redirection aimed at this process. Returns the PC to
    /// move to (the caller calls `set_pc` once nothing is left to drop).
    pub(crate) fn redirect_at_syscall(&mut self, tgid: u32, cr3: u64, pc: u64) -> Option<u64> {
        if VERIFY_ON.load(Ordering::Relaxed) {
            self.check_restore(cr3, pc);
        }
        let seen = TAKEN.load(Ordering::SeqCst);
        let seq = self.mailbox().waiting(seen)?;
        if ACTIVE_ON.load(Ordering::Relaxed) {
            return None; // one at a time; the next trigger after the return takes it
        }
        let req = self.mailbox().request();
        if let Some(r) = &req {
            match r.trigger {
                Trigger::Syscall { tgid: want } if want == tgid => {}
                // A kernel trigger (the armed kernel blocks take it), or another process.
                _ => return None,
            }
        }
        if !self.mailbox().claim(&TAKEN, seen, seq) {
            return None; // another vCPU took it, or it is no longer the posted request
        }
        let Some(req) = req else {
            return self.refuse(seq, RedirectFailure::BadRequest);
        };
        if !available() {
            return self.refuse(seq, RedirectFailure::NoWrites);
        }
        let Some(saved) = self.read_all() else {
            return self.refuse(seq, RedirectFailure::RegisterRead);
        };
        self.activate(
            &req,
            Active {
                seq,
                not_here: None,
                cr3,
                ret_rsp: 0,
                pc,
                vcpu: self.vcpu,
                t0: monotonic_ns(),
                saved,
            },
        )
    }

    /// Applies `req` to this vCPU and makes `active` the redirection in progress; returns the
    /// entry to move to (`None` after refusing it).
    fn activate(&mut self, req: &RedirectRequest, mut active: Active) -> Option<u64> {
        match self.apply(req, &active.saved) {
            Ok(ret_rsp) => {
                active.ret_rsp = ret_rsp;
                *lock(&ACTIVE) = Some(active);
                ACTIVE_ON.store(true, Ordering::SeqCst);
                self.count(Counter::Redirects, 1);
                Some(req.entry)
            }
            Err(why) => self.refuse(active.seq, why),
        }
    }

    fn refuse(&mut self, seq: u64, why: RedirectFailure) -> Option<u64> {
        TAKEN.store(seq, Ordering::SeqCst);
        self.mailbox().fail(seq, why);
        crate::log_debug(&format!("redirect {seq} refused: {why}"));
        None
    }

    /// Writes memory, the frame and the registers; returns the RSP expected at the return.
    /// On failure the vCPU is as it was.
    fn apply(
        &mut self,
        req: &RedirectRequest,
        saved: &[u64; NREGS],
    ) -> Result<u64, RedirectFailure> {
        if let Some(m) = &req.memory {
            if !self.hot.membuf.write_guest(m.addr, &m.bytes) {
                return Err(RedirectFailure::MemoryWrite);
            }
        }
        let mut rsp = req
            .regs
            .get(&Reg::Rsp)
            .copied()
            .unwrap_or(saved[Reg::Rsp.index()]);
        if let Some(f) = req.frame {
            // Below the requested stack (kernel trigger) or the current one, aligned as after
            // a `call`: (rsp + 8) % 16 == 0 at the entry.
            let base = req
                .regs
                .get(&Reg::Rsp)
                .copied()
                .unwrap_or(saved[Reg::Rsp.index()]);
            rsp = (base.wrapping_sub(f.reserve) & !15).wrapping_sub(8);
            if !self.hot.membuf.write_guest(rsp, &f.return_to.to_le_bytes()) {
                return Err(RedirectFailure::StackWrite);
            }
        }
        let mut ok = self.write_reg(Reg::Rsp, rsp);
        if matches!(req.trigger, Trigger::Kernel { .. }) && !req.regs.contains_key(&Reg::Eflags) {
            // Like an interrupt handler: nothing may interrupt the function.
            ok = ok && self.write_reg(Reg::Eflags, saved[Reg::Eflags.index()] & !EFLAGS_IF);
        }
        for (r, v) in &req.regs {
            if *r != Reg::Rsp || req.frame.is_none() {
                ok = ok && self.write_reg(*r, *v);
            }
        }
        if !ok {
            let _ = self.restore(saved);
            return Err(RedirectFailure::RegisterWrite);
        }
        // After `ret` popped the frame's return address.
        Ok(if req.frame.is_some() { rsp + 8 } else { rsp })
    }

    /// At a return marker: if it ends the active redirection (same address space, the
    /// frame's stack pointer), reports the result, restores the vCPU and returns the PC to go
    /// back to.
    pub(crate) fn redirect_at_marker(&mut self) -> Option<u64> {
        if !ACTIVE_ON.load(Ordering::Relaxed) {
            return None;
        }
        let at_return = self.read_all()?;
        let mut cr3 = [0u64; 1];
        if self
            .hot
            .regbuf
            .read_registers(&[self.regs.entry[crate::E_CR3]], &mut cr3)
            != 0
        {
            return None;
        }
        let cr3 = cr3_base(cr3[0]);
        let active = {
            let mut a = lock(&ACTIVE);
            let hit = a
                .as_ref()
                .is_some_and(|a| a.cr3 == cr3 && a.ret_rsp == at_return[Reg::Rsp.index()]);
            if !hit {
                return None;
            }
            ACTIVE_ON.store(false, Ordering::SeqCst);
            a.take()?
        };
        let elapsed_ns = monotonic_ns().saturating_sub(active.t0);
        let restored = self.restore(&active.saved);
        if restored && active.not_here == Some(at_return[Reg::Rax.index()]) {
            // The guest said "not here": put the request back for the next safe point.
            self.count(Counter::RedirectRetries, 1);
            TAKEN.store(0, Ordering::SeqCst);
            arm_all(self.st, 1);
            return Some(active.pc);
        }
        let mb = self.mailbox();
        if !mb.cancelled(active.seq) {
            if restored {
                mb.returned(
                    active.seq,
                    &ReturnReport {
                        vcpu: active.vcpu,
                        return_vcpu: self.vcpu,
                        pc: active.pc,
                        elapsed_ns,
                        taken_ns: active.t0,
                        saved: active.saved,
                        at_return,
                    },
                );
                if active.not_here.is_none() {
                    *lock(&VERIFY) = Some(Verify {
                        seq: active.seq,
                        cr3,
                        pc: active.pc,
                        saved: active.saved,
                    });
                    VERIFY_ON.store(true, Ordering::SeqCst);
                }
            } else {
                mb.fail(active.seq, RedirectFailure::Restore);
            }
        }
        Some(active.pc)
    }

    /// At the `syscall` instruction a restore went back to: compares the registers with the
    /// saved ones and reports the mismatches.
    fn check_restore(&mut self, cr3: u64, pc: u64) {
        let v = {
            let mut g = lock(&VERIFY);
            if !g.as_ref().is_some_and(|v| v.cr3 == cr3 && v.pc == pc) {
                return;
            }
            VERIFY_ON.store(false, Ordering::SeqCst);
            g.take()
        };
        let (Some(v), Some(now)) = (v, self.read_all()) else {
            return;
        };
        self.mailbox()
            .verified(v.seq, mismatch_mask(&v.saved, &now), &now);
    }
}

/// Sets the arm word of every vCPU: armed vCPUs call [`Ctx::redirect_in_kernel`] at the start
/// of their next kernel block (an inline compare otherwise).
pub(crate) fn arm_all(st: &crate::State, v: u64) {
    for i in 0..st.vcpu_count() {
        st.sb_set(crate::SB_ARM, i, v);
    }
}

/// The thread that arms the vCPUs when vmsight posts a kernel-triggered request (it sleeps
/// on the mailbox's futex, woken by the post).
pub(crate) fn start_arming(st: &'static crate::State) {
    let spawned = std::thread::Builder::new()
        .name("vmsight-arm".into())
        .spawn(move || {
            let mb = st.channel.redirect_mailbox();
            loop {
                let seen = mb.posted();
                let pending = mb.waiting(TAKEN.load(Ordering::Relaxed)).is_some();
                if pending && mb.is_kernel_request() && !ACTIVE_ON.load(Ordering::Relaxed) {
                    arm_all(st, 1);
                }
                mb.wait_post(seen, std::time::Duration::from_millis(100));
            }
        });
    if let Err(e) = spawned {
        crate::log_debug(&format!("cannot start the arming thread: {e}"));
    }
}

impl Ctx<'_> {
    /// At the start of a kernel block on an armed vCPU, or at a guest safe-point marker
    /// (`need_if` false): takes a kernel-triggered request if interrupts are enabled here or
    /// the guest declared the point safe. Returns the entry to move to.
    pub(crate) fn redirect_in_kernel(&mut self, pc: u64, need_if: bool) -> Option<u64> {
        let disarm = |c: &Self| c.st.sb_set(crate::SB_ARM, c.vcpu, 0);
        let seen = TAKEN.load(Ordering::SeqCst);
        let Some(seq) = self.mailbox().waiting(seen) else {
            disarm(self);
            return None;
        };
        if ACTIVE_ON.load(Ordering::Relaxed) || !self.mailbox().is_kernel_request() {
            disarm(self);
            return None;
        }
        let saved = self.read_all()?;
        if need_if && saved[Reg::Eflags.index()] & EFLAGS_IF == 0 {
            return None; // interrupts off here: stay armed, try the next block
        }
        let req = self.mailbox().request();
        let not_here = match req.as_ref().map(|r| &r.trigger) {
            Some(Trigger::Kernel { not_here }) => Some(*not_here),
            Some(Trigger::Syscall { .. }) => {
                disarm(self);
                return None;
            }
            None => None,
        };
        if !self.mailbox().claim(&TAKEN, seen, seq) {
            // Another vCPU took it, or it is no longer the posted request. Stay armed: the
            // next block sees whether a request still waits (and disarms if none does).
            return None;
        }
        let (Some(req), Some(not_here)) = (req, not_here) else {
            disarm(self);
            return self.refuse(seq, RedirectFailure::BadRequest);
        };
        arm_all(self.st, 0);
        let mut cr3 = [0u64; 1];
        let h = self.regs.entry[crate::E_CR3];
        if self.hot.regbuf.read_registers(&[h], &mut cr3) != 0 {
            return self.refuse(seq, RedirectFailure::RegisterRead);
        }
        self.activate(
            &req,
            Active {
                seq,
                not_here: Some(not_here),
                cr3: cr3_base(cr3[0]),
                ret_rsp: 0,
                pc,
                vcpu: self.vcpu,
                t0: monotonic_ns(),
                saved,
            },
        )
    }
}

/// Moves the vCPU to `pc` (never returns). Called by the instruction callbacks once their
/// guarded work is over, so no frame above QEMU's holds anything to drop.
pub(crate) fn jump(pc: u64) -> ! {
    match qemu::v7() {
        // SAFETY: the callers are the `syscall` and marker callbacks, registered with
        // RegAccess::ReadWritePc on v7 (redirection is only taken when `available()`), and
        // they call this as their last statement.
        Some(f) => unsafe { qemu::set_pc(f, pc) },
        // Unreachable: a PC to move to only ever comes from a v7 redirection.
        None => std::process::abort(),
    }
}
