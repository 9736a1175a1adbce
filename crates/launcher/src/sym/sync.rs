//! The synchronous transport: the plugin redirects a vCPU into the module's entry (QEMU 11,
//! plugin API v7) and puts it back when the entry returns to the module's return marker, with
//! no interrupt on a running guest (`Trigger::Kernel`: the next kernel block a vCPU runs with
//! interrupts enabled). A guest whose vCPUs are all halted (QEMU's idle and resume callbacks,
//! recorded by the plugin) or running user code (a word the plugin stores inline at every
//! block) will not reach such a block soon: vmsight rings the guest's state doorbell at once;
//! otherwise after [`WAKE_AFTER`] without a taker (again every [`WAKE_AGAIN`]). The doorbell
//! interrupts a vCPU, whose handler in the module is a safe point where it takes the call.
//!
//! vmsight arms the vCPUs itself, after ringing (the plugin's arming thread is woken only if it
//! cannot), polls for the answer briefly, then sleeps on the mailbox until the plugin's answer
//! wakes it. Each reply carries where its time went ([`SyncStages`]: posting, ring, a halted
//! vCPU resuming, the take, the return, vmsight seeing it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmsight_proto::redirect::{Frame, RedirectRequest, Reg, Trigger};
use vmsight_proto::sym::RET_NOT_HERE;
use vmsight_ring::redirect::{Progress, USER_WORD_AFTER_ARM};
use vmsight_ring::ChannelHost;

use vmsight_proto::sym::SyncStages;
use vmsight_ring::{monotonic_ns, MailboxHandle};

use super::{Symbiotic, SyncEntry, SyncReturn, SyncTransport, Wake};
use crate::redirect::{lock, post_self_armed, REDIRECT_API};
use crate::vm::prepare::Prepared;

/// How long a request may wait for a running vCPU before vmsight wakes one (a running guest
/// enters a kernel block with interrupts enabled within microseconds).
pub const WAKE_AFTER: Duration = Duration::from_micros(50);
/// How often vmsight rings again while nobody took the request (the woken vCPU may have been
/// at a point that answered "not here" and gone back to sleep).
pub const WAKE_AGAIN: Duration = Duration::from_millis(1);
/// How long the caller spins before it sleeps until the plugin's answer wakes it.
const SPIN: Duration = Duration::from_micros(100);
/// How long the caller keeps polling (spinning, then yielding) when every vCPU was halted at
/// posting: nothing else needs the host's cores until the doorbell wakes one.
const POLL_IDLE: Duration = Duration::from_micros(500);
/// The shortest sleep on the mailbox (a ring due now is rung at the next turn).
const MIN_SLEEP: Duration = Duration::from_micros(5);

/// Whether the VM's plugin is loaded with the synchronous transport (`symsync=on`).
pub fn wanted(cfg: &crate::config::VmConfig, prep: &Prepared) -> bool {
    cfg.symbiotic && prep.use_plugin && prep.qemu.plugin_api() >= REDIRECT_API
}

/// Offers the transport to `sym` if this VM can carry it, else records why not.
pub fn offer(sym: &Symbiotic, prep: &Prepared, channel: Option<&Arc<Mutex<ChannelHost>>>) {
    let api = prep.qemu.plugin_api();
    match channel {
        None => sym.set_sync_missing("the VM runs without the TCG plugin"),
        Some(_) if api < REDIRECT_API => sym.set_sync_missing(&format!(
            "QEMU {}.{} speaks plugin API {api}; the synchronous transport needs API \
             {REDIRECT_API} (QEMU 11.1: --qemu trixie)",
            prep.qemu.version.0, prep.qemu.version.1,
        )),
        Some(c) if prep.guest.profile.is_none() => {
            let _ = c;
            sym.set_sync_missing("the VM has no kernel profile, which the plugin needs")
        }
        Some(c) => sym.set_sync(Box::new(PluginSync {
            channel: c.clone(),
            qemu: std::sync::OnceLock::new(),
            targets: std::sync::OnceLock::new(),
        })),
    }
}

/// QEMU's pid and the addresses of the vCPUs' arm words in its memory (each vCPU's user-mode
/// word is `USER_WORD_AFTER_ARM` bytes after its arm word).
type Targets = (u32, Vec<u64>);

/// The transport over the plugin's redirect mailbox.
struct PluginSync {
    channel: Arc<Mutex<ChannelHost>>,
    /// QEMU's pid once checked to be our child (the plugin publishes it with the arm words).
    qemu: std::sync::OnceLock<Option<u32>>,
    /// The arm words, once the plugin published them.
    targets: std::sync::OnceLock<Targets>,
}

impl PluginSync {
    /// Arms every vCPU by writing 1 into its arm word in QEMU's memory, where the plugin said
    /// they are: an armed vCPU takes the request at its next kernel block, with no plugin
    /// thread to schedule first (on a host whose cores run the vCPUs, waking one costs
    /// milliseconds). False if that is not possible; the plugin's own arming thread then does
    /// it.
    fn arm(&self, targets: Option<&Targets>) -> bool {
        let Some((pid, addrs)) = targets else {
            return false;
        };
        let ones: Vec<u8> = addrs.iter().flat_map(|_| 1u64.to_ne_bytes()).collect();
        let remote: Vec<nix::sys::uio::RemoteIoVec> = addrs
            .iter()
            .map(|&a| nix::sys::uio::RemoteIoVec {
                base: a as usize,
                len: 8,
            })
            .collect();
        nix::sys::uio::process_vm_writev(
            nix::unistd::Pid::from_raw(*pid as i32),
            &[std::io::IoSlice::new(&ones)],
            &remote,
        )
        .is_ok_and(|n| n == ones.len())
    }

    /// QEMU's pid and the addresses of the vCPUs' arm words, if the plugin published them and
    /// that pid is our child (vmsight writes and reads there).
    /// Read once published: the plugin publishes them at start and they never move.
    fn targets(&self) -> Option<&Targets> {
        // A filtered thread (the plugin channel's reader asks the guest through symcalls for
        // its insight lookups) may not touch another process's memory: the plugin's own
        // arming thread does it (docs/security.md).
        if vmsight_vhostd::seccomp::confined() {
            return None;
        }
        if let Some(t) = self.targets.get() {
            return Some(t);
        }
        let (pid, addrs) = lock(&self.channel).redirect_mailbox().arm_targets()?;
        let ours = *self.qemu.get_or_init(|| is_our_child(pid).then_some(pid));
        (ours == Some(pid)).then(|| self.targets.get_or_init(|| (pid, addrs)))
    }

    /// Whether every vCPU is halted or running user code now, so none reaches a kernel block
    /// soon ([`Wake::User`]). False when a vCPU is in the kernel, or when the words cannot be
    /// read.
    fn none_in_kernel_now(&self, targets: Option<&Targets>, idle: u64) -> bool {
        let Some((pid, addrs)) = targets else {
            return false;
        };
        let mut words = vec![0u8; addrs.len() * 8];
        let remote: Vec<nix::sys::uio::RemoteIoVec> = addrs
            .iter()
            .map(|&a| nix::sys::uio::RemoteIoVec {
                base: a.wrapping_add(USER_WORD_AFTER_ARM) as usize,
                len: 8,
            })
            .collect();
        let n = nix::sys::uio::process_vm_readv(
            nix::unistd::Pid::from_raw(*pid as i32),
            &mut [std::io::IoSliceMut::new(&mut words)],
            &remote,
        )
        .is_ok_and(|n| n == words.len());
        n && none_in_kernel(idle, &words)
    }
}

/// Whether every vCPU is halted (bit `v` of `idle`) or running user code (its user-mode word,
/// the `v`th native-endian u64 of `user_words`, is 1).
fn none_in_kernel(idle: u64, user_words: &[u8]) -> bool {
    user_words.chunks_exact(8).enumerate().all(|(v, w)| {
        idle.checked_shr(v as u32).is_some_and(|b| b & 1 == 1) || w == 1u64.to_ne_bytes()
    })
}

/// Whether `pid` is a child of this process (QEMU is: vmsight spawned it).
fn is_our_child(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The fields after the parenthesised command: state, ppid, ...
    let ppid = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse::<u32>().ok());
    ppid == Some(std::process::id())
}

/// The redirection that runs `entry(word, a0..a4)` on the module's stack (`word`: the call
/// number tagged with its sequence, `vmsight_proto::sym::sync_word`).
pub fn request(at: SyncEntry, word: u64, args: [u64; 5], timeout: Duration) -> RedirectRequest {
    let mut regs: BTreeMap<Reg, u64> = Reg::ARGS
        .iter()
        .copied()
        .zip(std::iter::once(word).chain(args))
        .collect();
    regs.insert(Reg::Rsp, at.stack);
    RedirectRequest {
        trigger: Trigger::Kernel {
            not_here: RET_NOT_HERE as u64,
        },
        entry: at.entry,
        frame: Some(Frame {
            return_to: at.return_to,
            reserve: 0,
        }),
        regs,
        memory: None,
        timeout_ms: (timeout.as_millis() as u64).max(1),
    }
}

impl SyncTransport for PluginSync {
    fn call(
        &self,
        at: SyncEntry,
        word: u64,
        args: [u64; 5],
        timeout: Duration,
        wake: &dyn Fn(Wake),
    ) -> Result<SyncReturn, String> {
        let req = request(at, word, args, timeout);
        let posted_ns = monotonic_ns();
        let seq = post_self_armed(&self.channel, &req).map_err(|e| e.to_string())?;
        let mut c = Call {
            seq,
            // Polled and slept on without the channel's lock (the record reader needs it).
            mailbox: lock(&self.channel).redirect_handle(),
            posted_ns,
            t0: Instant::now(),
            timeout,
            rung_ns: None,
            next_wake: Instant::now() + WAKE_AFTER,
            wake,
        };
        let poll = c.start(self);
        loop {
            match c.mailbox.mailbox().progress(seq) {
                Progress::Returned(o) => return Ok(c.returned(&o)),
                Progress::Failed(why) => return Err(why.to_string()),
                Progress::Waiting => {}
            }
            let now = Instant::now();
            if now - c.t0 > timeout {
                c.mailbox.mailbox().cancel(seq);
                return Err(format!(
                    "timed out: {}",
                    crate::redirect::why_no_return(&req)
                ));
            }
            if now >= c.next_wake {
                c.ring(Wake::Waited);
            }
            c.pause(now, poll);
        }
    }
}

/// One synchronous call in flight.
struct Call<'a> {
    seq: u64,
    mailbox: MailboxHandle,
    posted_ns: u64,
    t0: Instant,
    timeout: Duration,
    /// When vmsight first rang the guest (CLOCK_MONOTONIC ns).
    rung_ns: Option<u64>,
    /// When to ring (again) if nobody took the call.
    next_wake: Instant,
    wake: &'a dyn Fn(Wake),
}

impl Call<'_> {
    /// Arms the vCPUs and rings the guest if no vCPU would take the call soon; returns how
    /// long to keep polling before sleeping. Every vCPU halted: ring first, arm after (the
    /// doorbell's way to a vCPU is the long one, and the module's handler is a safe point
    /// armed or not). Else arm first (a vCPU in the kernel takes the call within
    /// microseconds) and ring if none is.
    fn start(&mut self, t: &PluginSync) -> Duration {
        let targets = t.targets();
        let mailbox = self.mailbox.clone();
        let mb = mailbox.mailbox();
        let all_idle = mb.all_vcpus_idle();
        if all_idle {
            self.ring(Wake::Idle);
        }
        if !t.arm(targets) {
            mb.wake_armers();
        }
        if !all_idle && t.none_in_kernel_now(targets, mb.idle_mask()) {
            self.ring(Wake::User);
        }
        // With every vCPU halted the host's cores are free: keep polling through the
        // doorbell's way, yielding the core to QEMU's threads that carry it (a sleeping caller
        // pays a wakeup, ~20-30 us here, on top of it; spinning without yielding delayed
        // those threads: see docs/benchmarks.md).
        if all_idle {
            POLL_IDLE
        } else {
            SPIN
        }
    }

    /// Rings the guest's state doorbell; the next ring is due [`WAKE_AGAIN`] later.
    fn ring(&mut self, why: Wake) {
        self.rung_ns.get_or_insert_with(monotonic_ns);
        (self.wake)(why);
        self.next_wake = Instant::now() + WAKE_AGAIN;
    }

    /// Waits a little for the answer: spins briefly (a guest busy in the kernel answers in
    /// microseconds), yields until `poll`, then sleeps on the mailbox until the plugin's
    /// answer wakes it or the next ring is due. QEMU's threads need the CPU on a host with
    /// few cores (yielding all along measured 4 ms per call with both vCPUs busy in user
    /// mode), and a sleep between polls added up to a timer slack to every answer.
    fn pause(&self, now: Instant, poll: Duration) {
        if now - self.t0 < SPIN {
            std::hint::spin_loop();
        } else if now - self.t0 < poll {
            std::thread::yield_now();
        } else {
            let until = self
                .next_wake
                .min(self.t0 + self.timeout)
                .max(now + MIN_SLEEP);
            self.mailbox.mailbox().wait_answer(self.seq, until - now);
        }
    }

    /// The entry's `rax` and where the call's time went.
    fn returned(&self, o: &vmsight_proto::redirect::RedirectOutcome) -> SyncReturn {
        let seen_ns = monotonic_ns();
        let (taken, resumed) = self.mailbox.mailbox().timing();
        SyncReturn {
            rax: o.at_return.get(&Reg::Rax).copied().unwrap_or(0) as i64,
            stages: stages(
                self.posted_ns,
                self.rung_ns,
                resumed,
                taken,
                o.elapsed_ns,
                seen_ns,
            ),
        }
    }
}

/// The stages of a returned call relative to posting (`None` if the plugin's clock readings
/// do not fit between posting and seeing the answer: a stale or scribbled mailbox).
fn stages(
    posted: u64,
    rung: Option<u64>,
    resumed: u64,
    taken: u64,
    elapsed: u64,
    seen: u64,
) -> Option<SyncStages> {
    let returned = taken.checked_add(elapsed)?;
    if taken < posted || returned > seen {
        return None;
    }
    Some(SyncStages {
        rung_ns: rung.map(|r| r.saturating_sub(posted)),
        resumed_ns: (posted..=taken)
            .contains(&resumed)
            .then(|| resumed - posted),
        taken_ns: taken - posted,
        returned_ns: returned - posted,
        seen_ns: seen - posted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_proto::sym::{nr, sync_word};

    fn words(user: &[u64]) -> Vec<u8> {
        user.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    /// The guest is rung at once only when no vCPU runs kernel code: each is halted or in
    /// user mode; a vCPU in the kernel (word 0, not halted) takes the call by itself.
    #[test]
    fn a_guest_is_rung_at_once_only_when_no_vcpu_runs_kernel_code() {
        assert!(none_in_kernel(0, &words(&[1, 1])));
        assert!(none_in_kernel(0b01, &words(&[0, 1])));
        assert!(none_in_kernel(0b11, &words(&[0, 0])));
        assert!(!none_in_kernel(0b01, &words(&[0, 0])));
        assert!(!none_in_kernel(0, &words(&[1, 0])));
        // Anything but 1 is not user mode (a scribbled word rings nobody).
        assert!(!none_in_kernel(0, &words(&[2, 1])));
        let many = words(&[1; 64]);
        assert!(none_in_kernel(0, &many));
        let mut last_in_kernel = [1; 64];
        last_in_kernel[63] = 0;
        assert!(!none_in_kernel(0, &words(&last_in_kernel)));
        assert!(none_in_kernel(1 << 63, &words(&last_in_kernel)));
    }

    /// The stages are the plugin's and vmsight's clock readings relative to posting; a resume
    /// outside [posting, taken] is not this call's, and readings that do not fit (a stale or
    /// scribbled mailbox) give no stages at all.
    #[test]
    fn stages_are_relative_to_posting_and_only_this_calls() {
        let s = stages(1_000, Some(1_010), 1_200, 1_300, 50, 1_400).expect("fits");
        assert_eq!(
            s,
            SyncStages {
                rung_ns: Some(10),
                resumed_ns: Some(200),
                taken_ns: 300,
                returned_ns: 350,
                seen_ns: 400,
            }
        );
        let old_resume = stages(1_000, None, 900, 1_300, 50, 1_400).expect("fits");
        assert_eq!((old_resume.rung_ns, old_resume.resumed_ns), (None, None));
        assert!(
            stages(1_000, None, 0, 999, 1, 1_400).is_none(),
            "taken before posting"
        );
        assert!(
            stages(1_000, None, 0, 1_300, 200, 1_400).is_none(),
            "returned after seen"
        );
        assert!(
            stages(1_000, None, 0, u64::MAX, 2, u64::MAX).is_none(),
            "overflow"
        );
    }

    /// The entry gets the tagged call number and the five arguments in the System V argument
    /// registers, on the module's stack, below which the frame goes; "not here" is the
    /// module's value.
    #[test]
    fn the_redirection_enters_the_module_with_the_tagged_number_and_the_arguments() {
        let at = SyncEntry {
            entry: 0xffff_ffff_c000_0000,
            return_to: 0xffff_ffff_c000_0010,
            stack: 0xff11_0000_0000_4000,
        };
        let r = request(
            at,
            sync_word(nr::ECHO, 9),
            [1, 2, 3, 4, 5],
            Duration::from_secs(2),
        );
        let got: Vec<u64> = Reg::ARGS.iter().map(|a| r.regs[a]).collect();
        assert_eq!(got, [1 | 9 << 32, 1, 2, 3, 4, 5]);
        assert_eq!(r.regs[&Reg::Rsp], at.stack);
        assert_eq!(r.entry, at.entry);
        assert_eq!(r.frame.map(|f| f.return_to), Some(at.return_to));
        assert_eq!(
            r.trigger,
            Trigger::Kernel {
                not_here: RET_NOT_HERE as u64
            }
        );
        assert_eq!(r.timeout_ms, 2000);
        assert!(r.validate().is_ok());
    }
}
