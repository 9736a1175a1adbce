//! The redirect mailbox: one vCPU redirection request from vmsight to the plugin and its
//! outcome back (the request and outcome types are `vmsight_proto::redirect`).
//!
//! It sits in the unused second half of the filter page of the control area. One request is
//! outstanding at a time. vmsight stores the request fields, then `req_seq` (Release); the
//! plugin sees a new sequence at its next trigger check, reads the fields, then claims it
//! ([`Mailbox::claim`]: a compare-and-swap on its own record of the last sequence taken, and a
//! check that the sequence is still the one posted, so a vCPU that read an older sequence never
//! runs it after another vCPU answered it), and answers by storing the outcome fields and then `done_seq` (only for the request posted last
//! and not answered yet, and `done_seq` never goes back: a vCPU preempted after it read an older
//! sequence cannot undo a newer answer); after the restore is checked it
//! stores the mismatch mask and `verified_seq`. vmsight gives up on a request by storing its
//! sequence in `cancel_seq`: the plugin does not take a cancelled request, and drops a
//! cancelled active one (the vCPU then stays wherever the guest function took it).
//!
//! ```text
//! CONTROL_OFFSET + 2048   Mailbox (201 u64 atomics, 1608 bytes)
//!   req_seq cancel_seq done_seq verified_seq
//!   trigger tgid entry has_frame return_to reserve set_mask set[20]
//!   mem_addr mem_len mem[32]
//!   status vcpu return_vcpu pc elapsed_ns saved[20] at_return[20] mismatch_mask
//!   at_check[20]
//!   arm_pid arm_n arm_addr[64]
//!   idle host_waiting taken_ns resume_ns
//! ```
//!
//! vmsight waits for an answer asleep on `done_seq`'s futex once a short spin is over
//! ([`Mailbox::wait_answer`]); `host_waiting` tells the plugin to wake it when it answers, so
//! a sleeping caller sees the answer at once instead of at its next poll.
//!
//! Every field is an atomic; a scribbled mailbox yields a request the plugin validates like
//! any other (and the plugin's writes are bounded by the request's own limits).

use std::collections::BTreeMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use vmsight_proto::redirect::{
    Frame, MemWrite, RedirectFailure, RedirectOutcome, RedirectRequest, Reg, Trigger,
    MAX_MEMORY_WRITE, NREGS,
};

/// Offset of the mailbox inside the control area.
pub const MAILBOX_OFFSET: u64 = 2048;
const MEM_WORDS: usize = MAX_MEMORY_WRITE / 8;
/// `trigger` code of [`Trigger::Syscall`] (`tgid` holds the TGID).
const TRIGGER_SYSCALL: u64 = 1;
/// `trigger` code of [`Trigger::Kernel`] (`tgid` holds the not-here value).
const TRIGGER_KERNEL: u64 = 2;

/// The mailbox's fields (see the module documentation).
#[repr(C)]
pub struct Mailbox {
    req_seq: AtomicU64,
    cancel_seq: AtomicU64,
    done_seq: AtomicU64,
    verified_seq: AtomicU64,
    trigger: AtomicU64,
    tgid: AtomicU64,
    entry: AtomicU64,
    has_frame: AtomicU64,
    return_to: AtomicU64,
    reserve: AtomicU64,
    set_mask: AtomicU64,
    set: [AtomicU64; NREGS],
    mem_addr: AtomicU64,
    mem_len: AtomicU64,
    mem: [AtomicU64; MEM_WORDS],
    status: AtomicU64,
    vcpu: AtomicU64,
    return_vcpu: AtomicU64,
    pc: AtomicU64,
    elapsed_ns: AtomicU64,
    saved: [AtomicU64; NREGS],
    at_return: [AtomicU64; NREGS],
    mismatch_mask: AtomicU64,
    /// The registers where the restore was checked (what differed is in `mismatch_mask`).
    at_check: [AtomicU64; NREGS],
    /// QEMU's pid and the addresses (in QEMU's memory) of every vCPU's arm word, published by
    /// the plugin: vmsight arms the vCPUs for a kernel-triggered request by writing 1 there
    /// itself (`process_vm_writev`), with no plugin thread to wake first.
    arm_pid: AtomicU64,
    arm_n: AtomicU64,
    arm_addr: [AtomicU64; MAX_ARM_VCPUS],
    /// Bit `v` set while vCPU `v` is halted (between QEMU's idle and resume callbacks): a
    /// kernel-triggered request nobody will take until the guest is interrupted.
    idle: AtomicU64,
    /// Non-zero while vmsight sleeps on `done_seq`'s futex: the plugin wakes it when it answers.
    host_waiting: AtomicU64,
    /// CLOCK_MONOTONIC when the last answered request was taken by a vCPU.
    taken_ns: AtomicU64,
    /// CLOCK_MONOTONIC of the last time a halted vCPU resumed.
    resume_ns: AtomicU64,
}

/// Most vCPUs whose arm words the mailbox publishes.
pub const MAX_ARM_VCPUS: usize = 64;

/// Where a vCPU's user-mode word is in QEMU's memory, in bytes after its arm word (both are in
/// the plugin's per-vCPU scoreboard element): 1 while the vCPU runs user code, 0 while it runs
/// kernel code, stored inline at every translation block while SymCall's synchronous
/// transport is on. vmsight reads it (`process_vm_readv`) to ring a guest whose vCPUs would not
/// reach a kernel block soon.
pub const USER_WORD_AFTER_ARM: u64 = 16;

const _: () = assert!(std::mem::size_of::<Mailbox>() == (111 + NREGS + 2 + MAX_ARM_VCPUS + 4) * 8);
const _: () = assert!(MAX_ARM_VCPUS <= 64, "one idle bit per vCPU in a u64");
const _: () = assert!(MAILBOX_OFFSET as usize + std::mem::size_of::<Mailbox>() <= 4096);
const _: () = assert!(MAILBOX_OFFSET as usize >= std::mem::size_of::<crate::control::FilterArea>());

/// What the host sees of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Not answered yet.
    Waiting,
    /// The plugin could not redirect.
    Failed(RedirectFailure),
    /// The function returned and the vCPU was restored; `restore_mismatch` is `None` until
    /// the plugin has checked the restore.
    Returned(RedirectOutcome),
}

/// Errors of the host's side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MailboxError {
    /// Another request has neither been answered nor cancelled.
    #[error("another vCPU redirection is still in progress (sequence {0})")]
    Busy(u64),
    /// The request is outside the limits.
    #[error(transparent)]
    Invalid(#[from] vmsight_proto::redirect::RedirectError),
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn store(a: &AtomicU64, v: u64) {
    a.store(v, Ordering::Relaxed);
}

fn load_regs(a: &[AtomicU64; NREGS]) -> [u64; NREGS] {
    std::array::from_fn(|i| load(&a[i]))
}

impl Mailbox {
    /// True while the last posted request is neither answered nor cancelled.
    fn outstanding(&self) -> Option<u64> {
        let req = self.req_seq.load(Ordering::Acquire);
        let answered = self.done_seq.load(Ordering::Acquire) == req;
        let cancelled = self.cancel_seq.load(Ordering::Acquire) == req;
        (req != 0 && !answered && !cancelled).then_some(req)
    }

    // -----------------------------------------------------------------------------------------
    // vmsight's side

    /// Posts `req`; returns its sequence. Wakes the plugin's arming thread.
    pub fn post(&self, req: &RedirectRequest) -> Result<u64, MailboxError> {
        let seq = self.post_quiet(req)?;
        self.wake_armers();
        Ok(seq)
    }

    /// Posts `req` without waking the plugin's arming thread, for a caller that arms the
    /// vCPUs itself (a woken thread in QEMU competes for the host's cores with the vCPU the
    /// caller waits for); it calls [`Mailbox::wake_armers`] if it cannot. The thread also
    /// looks on its own every 100 ms.
    pub fn post_quiet(&self, req: &RedirectRequest) -> Result<u64, MailboxError> {
        req.validate()?;
        if let Some(seq) = self.outstanding() {
            return Err(MailboxError::Busy(seq));
        }
        // Pairs with the fence in `claim`: a vCPU that reads any field stored below also sees
        // the answer or cancel that freed the mailbox, so it cannot take the fields as those of
        // the older request it read the sequence of.
        fence(Ordering::Release);
        let (code, arg) = match req.trigger {
            Trigger::Syscall { tgid } => (TRIGGER_SYSCALL, u64::from(tgid)),
            Trigger::Kernel { not_here } => (TRIGGER_KERNEL, not_here),
        };
        store(&self.trigger, code);
        store(&self.tgid, arg);
        store(&self.entry, req.entry);
        let frame = req.frame.unwrap_or(Frame {
            return_to: 0,
            reserve: 0,
        });
        store(&self.has_frame, u64::from(req.frame.is_some()));
        store(&self.return_to, frame.return_to);
        store(&self.reserve, frame.reserve);
        let mut mask = 0u64;
        for (r, v) in &req.regs {
            mask |= 1 << r.index();
            store(&self.set[r.index()], *v);
        }
        store(&self.set_mask, mask);
        let (addr, bytes) = match &req.memory {
            Some(m) => (m.addr, m.bytes.as_slice()),
            None => (0, &[][..]),
        };
        store(&self.mem_addr, addr);
        store(&self.mem_len, bytes.len() as u64);
        for (i, w) in self.mem.iter().enumerate() {
            let mut b = [0u8; 8];
            if let Some(src) = bytes.get(i * 8..) {
                let n = src.len().min(8);
                b[..n].copy_from_slice(&src[..n]);
            }
            store(w, u64::from_le_bytes(b));
        }
        let seq = self.req_seq.load(Ordering::Relaxed).wrapping_add(1).max(1);
        self.req_seq.store(seq, Ordering::Release);
        Ok(seq)
    }

    /// Wakes the plugin's arming thread (asleep in [`Mailbox::wait_post`]).
    pub fn wake_armers(&self) {
        futex_wake(&self.req_seq);
    }

    /// Where request `seq` stands.
    pub fn progress(&self, seq: u64) -> Progress {
        if self.done_seq.load(Ordering::Acquire) != seq {
            return Progress::Waiting;
        }
        if let Some(f) = RedirectFailure::from_code(load(&self.status)) {
            return Progress::Failed(f);
        }
        let verified = self.verified_seq.load(Ordering::Acquire) == seq;
        let mask = load(&self.mismatch_mask);
        let differed = |r: &Reg| mask & (1 << r.index()) != 0;
        Progress::Returned(RedirectOutcome {
            vcpu: load(&self.vcpu) as u32,
            return_vcpu: load(&self.return_vcpu) as u32,
            pc: load(&self.pc),
            elapsed_ns: load(&self.elapsed_ns),
            saved: vmsight_proto::redirect::reg_map(&load_regs(&self.saved)),
            at_return: vmsight_proto::redirect::reg_map(&load_regs(&self.at_return)),
            restore_mismatch: verified.then(|| Reg::ALL.into_iter().filter(differed).collect()),
            at_check: if verified {
                Reg::ALL
                    .into_iter()
                    .filter(differed)
                    .map(|r| (r, load(&self.at_check[r.index()])))
                    .collect()
            } else {
                BTreeMap::new()
            },
        })
    }

    /// Sleeps until request `seq` is answered or `timeout` passes (spurious wakeups happen:
    /// callers check [`Mailbox::progress`]). The plugin wakes the sleeper when it answers.
    pub fn wait_answer(&self, seq: u64, timeout: std::time::Duration) {
        // With `answer`: either the plugin sees `host_waiting` after its store of `done_seq`
        // and wakes us, or we see its `done_seq` here (SeqCst on both sides), or the futex
        // compares a changed `done_seq` and returns at once.
        self.host_waiting.store(1, Ordering::SeqCst);
        let done = self.done_seq.load(Ordering::SeqCst);
        if done != seq {
            futex_wait(&self.done_seq, done, timeout);
        }
        self.host_waiting.store(0, Ordering::SeqCst);
    }

    /// When the answered request was taken by a vCPU, and when a halted vCPU last resumed
    /// (CLOCK_MONOTONIC ns, 0 if never): where the time of a synchronous call went.
    pub fn timing(&self) -> (u64, u64) {
        (load(&self.taken_ns), load(&self.resume_ns))
    }

    /// Gives up on request `seq`.
    pub fn cancel(&self, seq: u64) {
        self.cancel_seq.store(seq, Ordering::Release);
    }

    // -----------------------------------------------------------------------------------------
    // The plugin's side

    /// The sequence of a request waiting to be taken, if any (one load when there is none).
    #[inline]
    pub fn waiting(&self, taken: u64) -> Option<u64> {
        let req = self.req_seq.load(Ordering::Acquire);
        if req == taken || req == 0 {
            return None;
        }
        self.outstanding()
    }

    /// Claims request `seq`, which [`Mailbox::waiting`]`(seen)` returned, for this vCPU, after
    /// its fields were read with [`Mailbox::request`]. `taken` is the plugin's record of the
    /// last sequence taken, shared by its vCPUs; `seen` is what it held when `waiting` was
    /// called.
    ///
    /// True only if no other vCPU took anything since (`taken` still `seen`) and `seq` is still
    /// the posted, unanswered, uncancelled request, which also proves the fields read before
    /// were `seq`'s. A vCPU whose host thread was preempted between `waiting` and here must not
    /// run a request another vCPU already answered: vmsight may have posted the next one, and
    /// the stale request's arguments would then be answered under the new sequence.
    pub fn claim(&self, taken: &AtomicU64, seen: u64, seq: u64) -> bool {
        if seen == seq
            || taken
                .compare_exchange(seen, seq, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return false;
        }
        fence(Ordering::Acquire);
        self.outstanding() == Some(seq)
    }

    /// Sleeps until `req_seq` differs from `seen` or `timeout` passes (a plugin thread that
    /// arms the vCPUs for kernel-triggered requests waits here; vmsight wakes it on post).
    pub fn wait_post(&self, seen: u64, timeout: std::time::Duration) {
        futex_wait(&self.req_seq, seen, timeout);
    }

    /// Publishes where the arm words of vCPUs `0..addrs.len()` are in QEMU (process `pid`).
    pub fn publish_arm(&self, pid: u32, addrs: &[u64]) {
        let n = addrs.len().min(MAX_ARM_VCPUS);
        for (slot, a) in self.arm_addr.iter().zip(&addrs[..n]) {
            store(slot, *a);
        }
        store(&self.arm_pid, u64::from(pid));
        self.arm_n.store(n as u64, Ordering::Release);
    }

    /// What [`Mailbox::publish_arm`] published: QEMU's pid and the arm words' addresses.
    pub fn arm_targets(&self) -> Option<(u32, Vec<u64>)> {
        let n = (self.arm_n.load(Ordering::Acquire) as usize).min(MAX_ARM_VCPUS);
        let pid = u32::try_from(load(&self.arm_pid)).ok().filter(|p| *p > 1)?;
        (n > 0).then(|| (pid, self.arm_addr[..n].iter().map(load).collect()))
    }

    /// Records that vCPU `vcpu` halted (`true`) or resumed (the plugin's idle and resume
    /// callbacks). vCPUs beyond [`MAX_ARM_VCPUS`] are not recorded.
    pub fn set_idle(&self, vcpu: u32, idle: bool) {
        if vcpu as usize >= MAX_ARM_VCPUS {
            return;
        }
        let bit = 1u64 << vcpu;
        if idle {
            self.idle.fetch_or(bit, Ordering::AcqRel);
        } else {
            self.idle.fetch_and(!bit, Ordering::AcqRel);
        }
    }

    /// Records that a halted vCPU resumed at `now_ns` (CLOCK_MONOTONIC), for
    /// [`Mailbox::timing`].
    pub fn set_resumed_at(&self, now_ns: u64) {
        store(&self.resume_ns, now_ns);
    }

    /// True when every vCPU whose arm word is published is halted: a kernel-triggered request
    /// waits for an interrupt, so the guest is best woken at once. `false` with none
    /// published (nothing known).
    pub fn all_vcpus_idle(&self) -> bool {
        let n = (self.arm_n.load(Ordering::Acquire) as usize).min(MAX_ARM_VCPUS);
        let want = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        n > 0 && self.idle_mask() & want == want
    }

    /// The halted vCPUs, bit `v` for vCPU `v` (see [`Mailbox::set_idle`]).
    pub fn idle_mask(&self) -> u64 {
        self.idle.load(Ordering::Acquire)
    }

    /// The last posted sequence (what [`Mailbox::wait_post`] compares with).
    pub fn posted(&self) -> u64 {
        self.req_seq.load(Ordering::Acquire)
    }

    /// The trigger of the waiting request, without reading the rest (cheap check).
    pub fn is_kernel_request(&self) -> bool {
        load(&self.trigger) == TRIGGER_KERNEL
    }

    /// True if vmsight gave up on `seq`.
    pub fn cancelled(&self, seq: u64) -> bool {
        self.cancel_seq.load(Ordering::Acquire) == seq
    }

    /// Reads request `seq` (call after [`Mailbox::waiting`] returned it). `None` if the fields
    /// do not form a valid request (a scribbled mailbox).
    pub fn request(&self) -> Option<RedirectRequest> {
        let trigger = match load(&self.trigger) {
            TRIGGER_SYSCALL => Trigger::Syscall {
                tgid: u32::try_from(load(&self.tgid)).ok()?,
            },
            TRIGGER_KERNEL => Trigger::Kernel {
                not_here: load(&self.tgid),
            },
            _ => return None,
        };
        let mask = load(&self.set_mask);
        let regs: BTreeMap<Reg, u64> = Reg::ALL
            .into_iter()
            .filter(|r| mask & (1 << r.index()) != 0)
            .map(|r| (r, load(&self.set[r.index()])))
            .collect();
        let len = usize::try_from(load(&self.mem_len)).ok()?;
        let memory = if len == 0 {
            None
        } else {
            if len > MAX_MEMORY_WRITE {
                return None;
            }
            let mut bytes: Vec<u8> = self
                .mem
                .iter()
                .flat_map(|w| load(w).to_le_bytes())
                .collect();
            bytes.truncate(len);
            Some(MemWrite {
                addr: load(&self.mem_addr),
                bytes,
            })
        };
        let req = RedirectRequest {
            trigger,
            entry: load(&self.entry),
            frame: (load(&self.has_frame) != 0).then(|| Frame {
                return_to: load(&self.return_to),
                reserve: load(&self.reserve),
            }),
            regs,
            memory,
            // The plugin does not time out; vmsight does.
            timeout_ms: 1,
        };
        req.validate().ok().map(|()| req)
    }

    /// True if `seq` is the request posted last and nobody answered it yet. A vCPU may act on
    /// a sequence it read long before (its host thread preempted meanwhile): an answer to an
    /// older request must not touch the outcome of a newer one, which vmsight may already
    /// have read as answered.
    fn unanswered(&self, seq: u64) -> bool {
        self.req_seq.load(Ordering::Acquire) == seq && self.done_seq.load(Ordering::Acquire) != seq
    }

    /// Marks `seq` answered. `done_seq` never goes back, so a late answer cannot make a newer,
    /// answered request look outstanding again.
    fn answer(&self, seq: u64) {
        self.done_seq.fetch_max(seq, Ordering::SeqCst);
        if self.host_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&self.done_seq);
        }
    }

    /// Answers `seq` with a failure (ignored unless `seq` is the unanswered request).
    pub fn fail(&self, seq: u64, why: RedirectFailure) {
        if !self.unanswered(seq) {
            return;
        }
        store(&self.status, why.code());
        self.answer(seq);
    }

    /// Answers `seq` with the return (ignored unless `seq` is the unanswered request).
    pub fn returned(&self, seq: u64, o: &ReturnReport) {
        if !self.unanswered(seq) {
            return;
        }
        store(&self.status, 0);
        store(&self.vcpu, u64::from(o.vcpu));
        store(&self.return_vcpu, u64::from(o.return_vcpu));
        store(&self.pc, o.pc);
        store(&self.elapsed_ns, o.elapsed_ns);
        store(&self.taken_ns, o.taken_ns);
        for i in 0..NREGS {
            store(&self.saved[i], o.saved[i]);
            store(&self.at_return[i], o.at_return[i]);
        }
        self.answer(seq);
    }

    /// Reports the restore check of `seq`: bit `i` set if `Reg::ALL[i]` differed, and the
    /// registers as the check found them.
    pub fn verified(&self, seq: u64, mismatch_mask: u64, at_check: &[u64; NREGS]) {
        store(&self.mismatch_mask, mismatch_mask);
        for (a, v) in self.at_check.iter().zip(at_check) {
            store(a, *v);
        }
        self.verified_seq.store(seq, Ordering::Release);
    }
}

/// The futex word of a 64-bit atomic: its low half (x86-64 is little-endian).
fn futex_word(a: &AtomicU64) -> *const u32 {
    (a as *const AtomicU64).cast::<u32>()
}

/// Wakes every waiter on `a` (shared, not private: the waiter is in QEMU's process).
fn futex_wake(a: &AtomicU64) {
    // SAFETY: FUTEX_WAKE on an aligned word of live shared memory; no memory is written.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(a),
            libc::FUTEX_WAKE,
            i32::MAX,
            0,
            0,
            0,
        );
    }
}

/// Sleeps while the low half of `a` equals the low half of `seen`, at most `timeout`.
fn futex_wait(a: &AtomicU64, seen: u64, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: FUTEX_WAIT on an aligned word of live shared memory with a valid timeout; the
    // kernel only reads the word. Spurious wakeups are fine: callers re-check.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(a),
            libc::FUTEX_WAIT,
            seen as u32,
            &ts as *const libc::timespec,
            0,
            0,
        );
    }
}

/// The plugin's report of a return, in mailbox order.
#[derive(Debug, Clone, Copy)]
pub struct ReturnReport {
    pub vcpu: u32,
    pub return_vcpu: u32,
    pub pc: u64,
    pub elapsed_ns: u64,
    /// CLOCK_MONOTONIC when the vCPU took the request.
    pub taken_ns: u64,
    pub saved: [u64; NREGS],
    pub at_return: [u64; NREGS],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mailbox() -> Box<Mailbox> {
        // SAFETY: Mailbox is only atomics, for which all-zero bits are valid.
        unsafe { Box::new(std::mem::zeroed()) }
    }

    fn req() -> RedirectRequest {
        let mut r = RedirectRequest::call(
            Trigger::Syscall { tgid: 42 },
            0x40_1000,
            &[1, 2, 3, 4, 5, 6],
            0x40_2000,
        );
        r.regs.insert(Reg::FsBase, 0x7f00_0000_0000);
        r.memory = Some(MemWrite {
            addr: 0x50_0000,
            bytes: (0..13).collect(),
        });
        r
    }

    /// The idle bits follow the vCPUs' halts and resumes; "every vCPU idle" needs all the
    /// published vCPUs halted, and nothing is known before the arm words are published.
    #[test]
    fn every_vcpu_is_idle_only_when_all_published_vcpus_halted() {
        let m = mailbox();
        m.set_idle(0, true);
        assert!(!m.all_vcpus_idle(), "no vCPU published yet");
        m.publish_arm(100, &[0x1000, 0x2000]);
        assert!(!m.all_vcpus_idle());
        m.set_idle(1, true);
        assert!(m.all_vcpus_idle());
        m.set_idle(0, false);
        assert!(!m.all_vcpus_idle());
        m.set_idle(0, true);
        m.set_idle(64, true); // beyond the bits: ignored
        m.set_idle(u32::MAX, false);
        assert!(m.all_vcpus_idle());
        let all: Vec<u64> = (0..MAX_ARM_VCPUS as u64).collect();
        m.publish_arm(100, &all);
        assert!(!m.all_vcpus_idle());
        for v in 0..MAX_ARM_VCPUS as u32 {
            m.set_idle(v, true);
        }
        assert!(m.all_vcpus_idle());
    }

    /// A kernel-triggered request (SymCall's synchronous transport) keeps its not-here value
    /// and its stack (a kernel frame goes below the requested rsp), and the arming thread's
    /// cheap check sees it; a post wakes a waiter at once.
    #[test]
    fn a_kernel_request_crosses_the_mailbox_and_wakes_the_waiter() {
        let m = std::sync::Arc::new(*mailbox());
        let mut r = RedirectRequest::call(
            Trigger::Kernel {
                not_here: (-0x1_0000i64) as u64,
            },
            0xffff_ffff_c000_1000,
            &[1, 2],
            0xffff_ffff_c000_2000,
        );
        r.regs.insert(Reg::Rsp, 0xffff_c900_0000_4000);
        let seen = m.posted();
        let m2 = m.clone();
        let waiter = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            m2.wait_post(seen, std::time::Duration::from_secs(20));
            t0.elapsed()
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let seq = m.post(&r).expect("posted");
        assert!(waiter.join().unwrap() < std::time::Duration::from_secs(20));
        assert_eq!(m.waiting(0), Some(seq));
        assert!(m.is_kernel_request());
        assert_eq!(m.request(), Some(RedirectRequest { timeout_ms: 1, ..r }));
    }

    #[test]
    fn a_request_crosses_the_mailbox_intact() {
        let m = mailbox();
        assert_eq!(m.waiting(0), None);
        let seq = m.post(&req()).expect("posted");
        assert_eq!(m.waiting(0), Some(seq));
        let mut got = m.request().expect("valid");
        got.timeout_ms = req().timeout_ms;
        assert_eq!(got, req());
        assert_eq!(m.waiting(seq), None, "taken requests are not seen again");
    }

    #[test]
    fn one_request_at_a_time_until_answered_or_cancelled() {
        let m = mailbox();
        let a = m.post(&req()).expect("posted");
        assert_eq!(m.post(&req()), Err(MailboxError::Busy(a)));
        m.cancel(a);
        assert!(m.cancelled(a));
        assert_eq!(m.waiting(0), None, "a cancelled request is not taken");
        let b = m.post(&req()).expect("posted after the cancel");
        assert_ne!(a, b);
        m.fail(b, RedirectFailure::StackWrite);
        assert_eq!(m.progress(b), Progress::Failed(RedirectFailure::StackWrite));
        assert!(
            m.post(&req()).is_ok(),
            "an answered request frees the mailbox"
        );
    }

    #[test]
    fn a_late_answer_to_an_older_request_leaves_the_newer_one_alone() {
        // A vCPU read request `a`, was preempted, and answers it after `b` was posted and
        // answered (the make test failure: every later post was refused as busy).
        let m = mailbox();
        let a = m.post(&req()).expect("posted");
        m.fail(a, RedirectFailure::RegisterRead);
        let b = m.post(&req()).expect("posted");
        let report = ReturnReport {
            vcpu: 0,
            return_vcpu: 0,
            pc: 0x40_0100,
            elapsed_ns: 1,
            taken_ns: 7,
            saved: [0; NREGS],
            at_return: [7; NREGS],
        };
        m.returned(b, &report);
        m.fail(a, RedirectFailure::BadRequest);
        m.returned(a, &report);
        assert!(
            matches!(m.progress(b), Progress::Returned(_)),
            "{:?}",
            m.progress(b)
        );
        let c = m.post(&req()).expect("the mailbox is free after b");
        // A second answer to the same request changes nothing either.
        m.fail(c, RedirectFailure::StackWrite);
        m.returned(c, &report);
        assert_eq!(m.progress(c), Progress::Failed(RedirectFailure::StackWrite));
        // Nor does an answer to a cancelled request once a newer one is posted.
        let d = m.post(&req()).expect("posted");
        m.cancel(d);
        let e = m.post(&req()).expect("posted after the cancel");
        m.fail(d, RedirectFailure::Restore);
        assert_eq!(m.progress(e), Progress::Waiting);
        assert_eq!(m.post(&req()), Err(MailboxError::Busy(e)));
    }

    /// A caller asleep in `wait_answer` is woken by the answer (it does not sleep out its
    /// timeout), and the answer's timing is readable after.
    #[test]
    fn the_answer_wakes_a_caller_asleep_on_the_mailbox() {
        let m: &'static Mailbox = Box::leak(mailbox());
        let seq = m.post(&req()).expect("posted");
        let timeout = std::time::Duration::from_secs(30);
        let waiter = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while m.progress(seq) == Progress::Waiting {
                m.wait_answer(seq, timeout);
            }
            t0.elapsed()
        });
        // Answer once the waiter sleeps (it has set host_waiting, and had time to enter the
        // futex: answered before that, the futex returns at once and nothing is tested).
        while m.host_waiting.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        m.set_resumed_at(5);
        m.returned(seq, &report(3));
        let slept = waiter.join().expect("waiter");
        assert!(
            slept < timeout / 2,
            "woken by the answer, not the timeout: {slept:?}"
        );
        assert_eq!(m.timing(), (7, 5));
        // Answered already: returns at once.
        m.wait_answer(seq, timeout);
        assert_eq!(m.host_waiting.load(Ordering::SeqCst), 0);
    }

    fn report(rax: u64) -> ReturnReport {
        let mut at_return = [0u64; NREGS];
        at_return[Reg::Rax.index()] = rax;
        ReturnReport {
            vcpu: 0,
            return_vcpu: 0,
            pc: 0x40_0100,
            elapsed_ns: 1,
            taken_ns: 7,
            saved: [0; NREGS],
            at_return,
        }
    }

    /// The make test failure (one wrong synchronous symcall answer in 2000): a vCPU read
    /// request `a` and was preempted; another vCPU took and answered `a`, vmsight posted `b`
    /// and a vCPU took it. The first vCPU must not take `a` now (a swap of the taken record
    /// let it, and `a`'s arguments ran under `b`'s sequence).
    #[test]
    fn a_vcpu_that_read_a_request_late_cannot_take_it_after_another_answered_it() {
        let m = mailbox();
        let taken = AtomicU64::new(0);
        let a = m.post(&req()).expect("posted");
        let late_seen = taken.load(Ordering::SeqCst);
        assert_eq!(m.waiting(late_seen), Some(a));
        // Another vCPU takes and answers it; the next request is posted and taken.
        assert!(m.claim(&taken, 0, a));
        assert!(!m.claim(&taken, 0, a), "one vCPU only");
        m.returned(a, &report(1));
        let b = m.post(&req()).expect("posted");
        assert!(m.claim(&taken, a, b));
        assert!(!m.claim(&taken, late_seen, a), "the late vCPU backs off");
        assert_eq!(taken.load(Ordering::SeqCst), b);
        // Same when `a` was cancelled and `b` not taken yet (the record did not move), and
        // after a "not here" retry reset the record to 0.
        m.returned(b, &report(2));
        let c = m.post(&req()).expect("posted");
        let seen = taken.load(Ordering::SeqCst);
        m.cancel(c);
        let d = m.post(&req()).expect("posted");
        assert!(!m.claim(&taken, seen, c), "a cancelled, replaced request");
        assert_eq!(
            m.waiting(taken.load(Ordering::SeqCst)),
            Some(d),
            "d still waits"
        );
        taken.store(0, Ordering::SeqCst);
        assert!(!m.claim(&taken, 0, c), "not after a reset either");
        let seen = taken.load(Ordering::SeqCst);
        assert_eq!(m.waiting(seen), Some(d), "the failed claim left d takeable");
        assert!(m.claim(&taken, seen, d));
    }

    /// vmsight posts request after request, each with its own argument, while three "vCPUs"
    /// race to take them, yielding at every step (as a preempted host thread would): every
    /// request is run exactly once, and every answer carries the arguments it was posted with.
    #[test]
    fn racing_vcpus_run_each_request_once_with_its_own_arguments() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        const N: u64 = 3000;
        let m: Arc<Mailbox> = Arc::new(*mailbox());
        let taken = Arc::new(AtomicU64::new(0));
        let runs = Arc::new((0..=N).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
        let stop = Arc::new(AtomicBool::new(false));
        let vcpus: Vec<_> = (0..3)
            .map(|v| {
                let (m, taken, runs, stop) = (m.clone(), taken.clone(), runs.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let seen = taken.load(Ordering::SeqCst);
                        let Some(seq) = m.waiting(seen) else {
                            std::thread::yield_now();
                            continue;
                        };
                        if (i + v).is_multiple_of(3) {
                            std::thread::yield_now();
                        }
                        let r = m.request();
                        if (i + v).is_multiple_of(5) {
                            std::thread::yield_now();
                        }
                        if !m.claim(&taken, seen, seq) {
                            continue;
                        }
                        let r = r.expect("a claimed request is valid");
                        let arg = r.regs[&Reg::Rdi];
                        assert_eq!(r.regs[&Reg::Rsi], !arg, "torn read of request {seq}");
                        assert_eq!(r.regs[&Reg::Rsp], 0x7ffc_0000 + 16 * arg, "torn read");
                        runs[(arg as usize).min(N as usize)].fetch_add(1, Ordering::SeqCst);
                        m.returned(seq, &report(arg));
                    }
                })
            })
            .collect();
        for k in 1..=N {
            let mut r = RedirectRequest::call(
                Trigger::Kernel { not_here: 1 },
                0x40_1000,
                &[k, !k],
                0x40_2000,
            );
            r.regs.insert(Reg::Rsp, 0x7ffc_0000 + 16 * k);
            let seq = m.post(&r).expect("the previous one was answered");
            let t0 = std::time::Instant::now();
            let got = loop {
                if let Progress::Returned(o) = m.progress(seq) {
                    break o.at_return[&Reg::Rax];
                }
                assert!(t0.elapsed().as_secs() < 60, "request {k} never answered");
                std::thread::yield_now();
            };
            assert_eq!(got, k, "request {k} answered with another's argument");
        }
        stop.store(true, Ordering::Relaxed);
        for v in vcpus {
            v.join().unwrap();
        }
        assert!(runs[1..].iter().all(|r| r.load(Ordering::SeqCst) == 1));
        assert_eq!(runs[0].load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_outcome_and_the_restore_check_come_back() {
        let m = mailbox();
        let seq = m.post(&req()).expect("posted");
        assert_eq!(m.progress(seq), Progress::Waiting);
        let mut saved = [0u64; NREGS];
        saved[Reg::Rsp.index()] = 0x7ffc_0000;
        let mut at_return = [0u64; NREGS];
        at_return[Reg::Rax.index()] = 99;
        m.returned(
            seq,
            &ReturnReport {
                vcpu: 1,
                return_vcpu: 0,
                pc: 0x40_0100,
                elapsed_ns: 5000,
                taken_ns: 7,
                saved,
                at_return,
            },
        );
        let Progress::Returned(o) = m.progress(seq) else {
            panic!("returned")
        };
        assert_eq!(o.at_return[&Reg::Rax], 99);
        assert_eq!(o.saved[&Reg::Rsp], 0x7ffc_0000);
        assert_eq!((o.vcpu, o.return_vcpu, o.pc), (1, 0, 0x40_0100));
        assert_eq!(o.restore_mismatch, None, "not checked yet");
        assert!(o.at_check.is_empty());
        let mut at_check = saved;
        at_check[Reg::Rdi.index()] = 0x55;
        m.verified(seq, 1 << Reg::Rdi.index(), &at_check);
        let Progress::Returned(o) = m.progress(seq) else {
            panic!("returned")
        };
        assert_eq!(o.restore_mismatch, Some(vec![Reg::Rdi]));
        // Only the registers that differed, with what the check found.
        assert_eq!(o.at_check, [(Reg::Rdi, 0x55)].into_iter().collect());
    }

    #[test]
    fn scribbled_fields_never_make_an_invalid_request() {
        let m = mailbox();
        m.post(&req()).expect("posted");
        store(&m.mem_len, 10_000);
        assert_eq!(m.request(), None, "an oversized memory write is refused");
        store(&m.mem_len, 0);
        store(&m.trigger, 77);
        assert_eq!(m.request(), None, "an unknown trigger is refused");
        store(&m.trigger, TRIGGER_SYSCALL);
        store(&m.entry, 0);
        assert_eq!(m.request(), None, "entry 0 is refused");
        store(&m.entry, 1);
        store(&m.tgid, u64::MAX);
        assert_eq!(m.request(), None, "a TGID beyond u32 is refused");
    }
}
