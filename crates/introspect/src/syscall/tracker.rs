//! Pairs syscall entries with their returns, per task (Sky §4.2, adapted to what a TCG plugin
//! sees: an entry at the user `syscall` instruction and every return to user mode).
//!
//! Identity is the guest `task_struct` pointer, so a call that blocks on one vCPU and returns on
//! another pairs correctly, and so do threads sharing an address space. Each task has a stack of
//! pending entries, because a signal handler may make syscalls while an interrupted one waits.
//! A return to user mode at `rip` means, for the innermost pending entry `E`:
//! - `rip == E.pc + 2`: `E` returned, `rax` is its value;
//! - `E` is `rt_sigreturn`: it returned (to wherever the signal frame said), and the frame may
//!   also complete or restart the entry below it (see [`Tracker::on_return`]);
//! - `E` is a successful `execve`/`execveat`: the new image starts elsewhere with `rax == 0`;
//! - `rip == E.pc`: the kernel rewound the instruction to restart `E` (`-ERESTART*`): `E` ended
//!   without a value and will be entered again;
//! - anything else: a signal handler starts; `E` stays pending.
//!
//! `exit`/`exit_group` never return and are completed at entry; `exit_group` also ends the
//! pending calls of the other threads of its process. A return with nothing pending (an
//! interrupt return, a new thread's first return after `clone`) is not a syscall exit.

use std::collections::hash_map::Entry;

/// The tracker's maps, keyed by guest task pointers and pids (chosen by the guest): `ahash`'s
/// randomly seeded hasher resists crafted collisions as std's SipHash does, for less (the
/// hashing was about 2 % of the trace thread's time per record).
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;

use serde::Serialize;

use super::event::{
    append_piece_ref, append_sums_ref, ArgData, EntryEvent, PieceRef, ReturnEvent, Spare,
    SumsPiece, SumsRef,
};
use super::nr;

/// How a syscall ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Returned this raw value (negative errno on failure).
    Returned(i64),
    /// Interrupted and restarted by the kernel (`-ERESTART*`, shown as `?` like strace).
    Restarted,
    /// Never returns (`exit`, `exit_group`), or its thread was ended by another's `exit_group`.
    NoReturn,
}

/// A syscall with its outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Completed {
    pub entry: EntryEvent,
    pub outcome: Outcome,
    pub exit_ts_ns: Option<u64>,
    pub exit_vcpu: Option<u32>,
}

impl Completed {
    /// The raw return value, when there is one.
    pub fn ret(&self) -> Option<i64> {
        match self.outcome {
            Outcome::Returned(v) => Some(v),
            _ => None,
        }
    }
}

/// Counters about the pairing itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TrackerStats {
    pub entries: u64,
    pub returns: u64,
    pub completed: u64,
    pub restarted: u64,
    /// Returns to user mode with no pending syscall (interrupts, new threads).
    pub unmatched_returns: u64,
    /// Signal handler starts observed while a syscall was pending.
    pub signal_deliveries: u64,
    /// Pending entries dropped because a task's stack grew past the bound (guest misbehaving).
    pub overflowed: u64,
    /// Largest number of tasks with pending syscalls at once.
    pub peak_pending_tasks: u64,
}

/// Bound on nested pending syscalls of one task (signal handlers inside handlers).
const MAX_DEPTH: usize = 64;
/// Bound on completions held behind one interrupted call.
const MAX_HELD: usize = 4096;

/// A call waiting for its return.
#[derive(Debug)]
struct Pending {
    e: EntryEvent,
    /// A signal handler was entered while this call was pending: (time, vCPU) of that return.
    /// Its outcome is only known when the handler's sigreturn comes back, but it happened
    /// first, so it is reported before the handler's own calls (like strace).
    interrupted: Option<(u64, u32)>,
    /// The handler's completed calls, reported after this one.
    held: Vec<Completed>,
}

/// The pairing state.
#[derive(Debug, Default)]
pub struct Tracker {
    pending: HashMap<u64, Vec<Pending>>,
    /// Signal-handler entry points seen per process, to tell a signal delivered on the way out
    /// of `rt_sigreturn` (the kernel enters the handler with rax = 0) from its own return.
    handlers: HashMap<u32, Vec<u64>>,
    stats: TrackerStats,
    /// Emptied stacks kept for the next task that enters a call (most calls return before the
    /// task's next one: without these, every call would allocate a stack).
    spare: Vec<Vec<Pending>>,
    /// Scratch of [`Tracker::on_return_into`]: the calls one return completes.
    resolved: Vec<(Pending, Outcome)>,
}

/// Bound on [`Tracker::spare`].
const MAX_SPARE: usize = 64;

/// Bound on remembered handler addresses per process.
const MAX_HANDLERS: usize = 64;

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> TrackerStats {
        self.stats
    }

    /// Tasks that currently have a pending syscall.
    pub fn pending_tasks(&self) -> usize {
        self.pending.len()
    }

    fn done(&mut self, entry: EntryEvent, outcome: Outcome, r: Option<&ReturnEvent>) -> Completed {
        self.stats.completed += 1;
        if outcome == Outcome::Restarted {
            self.stats.restarted += 1;
        }
        Completed {
            entry,
            outcome,
            exit_ts_ns: r.map(|r| r.ts_ns),
            exit_vcpu: r.map(|r| r.vcpu),
        }
    }

    /// A monitored task entered a syscall. Returns what completed because of it.
    pub fn on_entry(&mut self, e: EntryEvent) -> Vec<Completed> {
        let mut out = Vec::new();
        self.on_entry_into(e, &mut out);
        out
    }

    /// [`Tracker::on_entry`], appending what completed to `out` (reuse it: no allocation).
    pub fn on_entry_into(&mut self, e: EntryEvent, out: &mut Vec<Completed>) {
        self.stats.entries += 1;
        match e.nr {
            nr::EXIT => {
                let task = e.task;
                if let Some(stack) = self.pending.remove(&task) {
                    self.flush_stack(stack, out);
                }
                out.push(self.done(e, Outcome::NoReturn, None));
            }
            nr::EXIT_GROUP => {
                // Every other thread of the process dies with it: their calls never return.
                let tgid = e.tgid;
                let mut tasks: Vec<u64> = self
                    .pending
                    .iter()
                    .filter(|(t, v)| **t == e.task || v.first().is_some_and(|p| p.e.tgid == tgid))
                    .map(|(t, _)| *t)
                    .collect();
                tasks.sort_unstable();
                for t in tasks {
                    if let Some(stack) = self.pending.remove(&t) {
                        self.flush_stack(stack, out);
                    }
                }
                out.push(self.done(e, Outcome::NoReturn, None));
            }
            _ => {
                let stack = match self.pending.entry(e.task) {
                    Entry::Occupied(o) => o.into_mut(),
                    Entry::Vacant(v) => v.insert(self.spare.pop().unwrap_or_default()),
                };
                if stack.len() >= MAX_DEPTH {
                    stack.remove(0);
                    self.stats.overflowed += 1;
                }
                stack.push(Pending {
                    e,
                    interrupted: None,
                    held: Vec::new(),
                });
                self.stats.peak_pending_tasks =
                    self.stats.peak_pending_tasks.max(self.pending.len() as u64);
            }
        }
    }

    /// Keeps an emptied stack for reuse.
    fn recycle(&mut self, stack: Vec<Pending>) {
        if self.spare.len() < MAX_SPARE {
            self.spare.push(stack);
        }
    }

    /// Ends a whole stack without returns, outermost call first (it started first).
    fn flush_stack(&mut self, mut stack: Vec<Pending>, out: &mut Vec<Completed>) {
        for p in stack.drain(..) {
            let exit = p.interrupted;
            let mut c = self.done(p.e, Outcome::NoReturn, None);
            if let Some((ts, vcpu)) = exit {
                c.exit_ts_ns = Some(ts);
                c.exit_vcpu = Some(vcpu);
            }
            out.push(c);
            out.extend(p.held);
        }
        self.recycle(stack);
    }

    /// Completes a pending call; an interrupted one ends at its signal delivery.
    fn resolve(&mut self, p: Pending, outcome: Outcome, r: &ReturnEvent, out: &mut Vec<Completed>) {
        let mut c = self.done(p.e, outcome, Some(r));
        if let Some((ts, vcpu)) = p.interrupted {
            c.exit_ts_ns = Some(ts);
            c.exit_vcpu = Some(vcpu);
        }
        out.push(c);
        out.extend(p.held);
    }

    /// A monitored task returned to user mode. Returns what completed.
    pub fn on_return(&mut self, r: &ReturnEvent) -> Vec<Completed> {
        let mut out = Vec::new();
        self.on_return_into(r, &mut out);
        out
    }

    /// [`Tracker::on_return`], appending what completed to `out` (reuse it: no allocation).
    pub fn on_return_into(&mut self, r: &ReturnEvent, out: &mut Vec<Completed>) {
        self.stats.returns += 1;
        let Some(mut stack) = self.pending.remove(&r.task) else {
            self.stats.unmatched_returns += 1;
            return;
        };
        let rax = r.rax as i64;
        let known_handler = self
            .handlers
            .get(&r.tgid)
            .is_some_and(|h| h.contains(&r.rip));
        // An rt_sigreturn on top "returns" the restored rax to wherever the signal frame points;
        // the same rip then decides the calls it interrupted, which are reported first. But if
        // another signal is delivered on the way out, the return goes to a handler with rax 0:
        // then the sigreturn is itself interrupted, and completes when that handler's own
        // sigreturn restores the context.
        let sigreturn = match stack.last_mut() {
            Some(p) if p.e.nr == nr::RT_SIGRETURN && rax == 0 && known_handler => {
                self.stats.signal_deliveries += 1;
                if p.interrupted.is_none() {
                    p.interrupted = Some((r.ts_ns, r.vcpu));
                }
                None
            }
            Some(p) if p.e.nr == nr::RT_SIGRETURN => stack.pop(),
            _ => None,
        };
        let after_sigreturn = sigreturn.is_some();
        // Calls this return completes are reported outermost first: each interrupted call
        // precedes its handler's calls (held in it). The outer sigreturns it completes, found
        // innermost first, wait here; the call it stops at (outermost) goes first.
        let start = out.len();
        let mut resolved = std::mem::take(&mut self.resolved);
        while let Some(top) = stack.last_mut() {
            if after_sigreturn && top.e.nr == nr::RT_SIGRETURN && top.interrupted.is_some() {
                // An outer sigreturn interrupted by the signal whose sigreturn just returned:
                // it returns the same restored context.
                if let Some(p) = stack.pop() {
                    resolved.push((p, Outcome::Returned(rax)));
                }
                continue;
            }
            if sigreturn.is_none() && top.e.nr == nr::RT_SIGRETURN {
                break; // interrupted just above
            }
            let is_exec = matches!(top.e.nr, nr::EXECVE | nr::EXECVEAT);
            let outcome = if r.rip == top.e.pc.wrapping_add(2) {
                Some(Outcome::Returned(rax))
            } else if r.rip == top.e.pc {
                Some(Outcome::Restarted)
            } else if is_exec && rax == 0 && !after_sigreturn {
                Some(Outcome::Returned(0))
            } else {
                // A signal handler starts (or a sigreturn lands in user code): still pending.
                if !after_sigreturn {
                    self.stats.signal_deliveries += 1;
                    if top.interrupted.is_none() {
                        top.interrupted = Some((r.ts_ns, r.vcpu));
                    }
                    let h = self.handlers.entry(r.tgid).or_default();
                    if !h.contains(&r.rip) && h.len() < MAX_HANDLERS {
                        h.push(r.rip);
                    }
                }
                None
            };
            if let Some(o) = outcome {
                if let Some(p) = stack.pop() {
                    self.resolve(p, o, r, out);
                }
            }
            break;
        }
        for (p, o) in resolved.drain(..).rev() {
            self.resolve(p, o, r, out);
        }
        self.resolved = resolved;
        if let Some(p) = sigreturn {
            self.resolve(p, Outcome::Returned(rax), r, out);
        }
        // Completions inside a handler wait behind the call that handler interrupted.
        if let Some(holder) = stack.iter_mut().rev().find(|p| p.interrupted.is_some()) {
            if holder.held.len() + (out.len() - start) <= MAX_HELD {
                holder.held.extend(out.drain(start..));
            }
        }
        if stack.is_empty() {
            self.recycle(stack);
        } else {
            self.pending.insert(r.task, stack);
        }
    }

    /// Ends everything still pending (the VM stopped): those calls never returned.
    pub fn finish(&mut self) -> Vec<Completed> {
        let mut out = Vec::new();
        let mut all: Vec<(u64, Vec<Pending>)> = self.pending.drain().collect();
        all.sort_by_key(|(t, _)| *t);
        for (_, stack) in all {
            self.flush_stack(stack, &mut out);
        }
        out
    }

    /// Attaches argument bytes captured after the entry (the plugin re-reads a string whose
    /// page was not present at entry once the kernel has faulted it in) to the pending call
    /// that entered at `entry_ts`. Returns false when no such call is pending.
    pub fn attach_late_data(&mut self, entry_ts: u64, piece: ArgData, offset: u32) -> bool {
        self.attach_late_data_ref(entry_ts, piece.as_piece(), offset, &mut Spare::default())
    }

    /// [`Tracker::attach_late_data`] of a borrowed piece, with buffers from `spare`.
    pub fn attach_late_data_ref(
        &mut self,
        entry_ts: u64,
        piece: PieceRef<'_>,
        offset: u32,
        spare: &mut Spare,
    ) -> bool {
        self.pending_at(entry_ts)
            .map(|e| append_piece_ref(e, piece, offset, spare))
            .is_some()
    }

    /// Attaches checksums computed at a call's return (reads) to the pending call that
    /// entered at `entry_ts`; false if no such call is pending.
    pub fn attach_late_sums(&mut self, entry_ts: u64, piece: SumsPiece) -> bool {
        self.attach_late_sums_ref(entry_ts, piece.as_ref(), &mut Spare::default())
    }

    /// [`Tracker::attach_late_sums`] of a borrowed record, with buffers from `spare`.
    pub fn attach_late_sums_ref(
        &mut self,
        entry_ts: u64,
        piece: SumsRef<'_>,
        spare: &mut Spare,
    ) -> bool {
        self.pending_at(entry_ts)
            .map(|e| append_sums_ref(e, piece, spare))
            .is_some()
    }

    /// The pending call that entered at `entry_ts`.
    fn pending_at(&mut self, entry_ts: u64) -> Option<&mut EntryEvent> {
        self.pending
            .values_mut()
            .find_map(|stack| stack.iter_mut().find(|p| p.e.ts_ns == entry_ts))
            .map(|p| &mut p.e)
    }
}

#[cfg(test)]
mod tests {
    use super::super::event::ReturnVia;
    use super::*;

    fn entry(task: u64, tid: u32, nr: u64, pc: u64, ts: u64) -> EntryEvent {
        EntryEvent {
            ts_ns: ts,
            task,
            tid,
            tgid: 100,
            nr,
            pc,
            ..Default::default()
        }
    }

    fn ret(task: u64, rip: u64, rax: i64, vcpu: u32) -> ReturnEvent {
        ReturnEvent {
            ts_ns: 0,
            vcpu,
            cr3: 0,
            task,
            tid: 0,
            tgid: 100,
            rip,
            rax: rax as u64,
            via: ReturnVia::Sysret,
        }
    }

    fn names(v: &[Completed]) -> Vec<(u64, Option<i64>)> {
        v.iter().map(|c| (c.entry.nr, c.ret())).collect()
    }

    #[test]
    fn plain_call_pairs_with_its_return() {
        let mut t = Tracker::new();
        assert!(t.on_entry(entry(1, 10, 0, 0x1000, 1)).is_empty());
        let c = t.on_return(&ret(1, 0x1002, 5, 0));
        assert_eq!(names(&c), vec![(0, Some(5))]);
        assert_eq!(t.pending_tasks(), 0);
    }

    #[test]
    fn blocking_call_resumes_on_another_vcpu_and_other_tasks_interleave() {
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, 0, 0x1000, 1)); // read blocks on vcpu 0
        t.on_entry(entry(2, 11, 1, 0x2000, 2)); // another thread writes
        assert_eq!(
            names(&t.on_return(&ret(2, 0x2002, 3, 0))),
            vec![(1, Some(3))]
        );
        let c = t.on_return(&ret(1, 0x1002, 7, 1));
        assert_eq!(names(&c), vec![(0, Some(7))]);
        assert_eq!(c[0].exit_vcpu, Some(1));
    }

    #[test]
    fn interrupt_returns_and_new_threads_are_not_exits() {
        let mut t = Tracker::new();
        assert!(t.on_return(&ret(9, 0x5000, 0, 0)).is_empty());
        assert_eq!(t.stats().unmatched_returns, 1);
    }

    #[test]
    fn sa_restart_handler_with_its_own_syscall() {
        // read blocks, a signal arrives: handler runs and writes, sigreturn restarts the read.
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, 0, 0x1000, 1)); // read
        assert!(t.on_return(&ret(1, 0x7000, 0, 0)).is_empty()); // handler starts
        assert_eq!(t.stats().signal_deliveries, 1);
        t.on_entry(entry(1, 10, 1, 0x7010, 2)); // write in the handler
                                                // Held until the interrupted read's outcome is known.
        assert!(t.on_return(&ret(1, 0x7012, 4, 0)).is_empty());
        t.on_entry(entry(1, 10, nr::RT_SIGRETURN, 0x7020, 3));
        // sigreturn resumes at the read's syscall instruction: the read is restarted.
        let c = t.on_return(&ret(1, 0x1000, 0, 0));
        // Reported like strace: the interrupted read, the handler's write, then sigreturn.
        assert_eq!(
            names(&c),
            vec![(0, None), (1, Some(4)), (nr::RT_SIGRETURN, Some(0))]
        );
        assert_eq!(c[0].outcome, Outcome::Restarted);
        t.on_entry(entry(1, 10, 0, 0x1000, 4)); // re-executed read
        assert_eq!(
            names(&t.on_return(&ret(1, 0x1002, 1, 1))),
            vec![(0, Some(1))]
        );
        assert_eq!(t.pending_tasks(), 0);
    }

    #[test]
    fn eintr_after_a_handler_completes_the_interrupted_call() {
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, 0, 0x1000, 1));
        t.on_return(&ret(1, 0x7000, 0, 0));
        t.on_entry(entry(1, 10, nr::RT_SIGRETURN, 0x7020, 2));
        let c = t.on_return(&ret(1, 0x1002, -4, 0));
        assert_eq!(names(&c), vec![(0, Some(-4)), (nr::RT_SIGRETURN, Some(-4))]);
    }

    #[test]
    fn signal_delivered_on_the_way_out_of_sigreturn() {
        // wait4 blocks; SIGCHLD #1: handler, sigreturn; on its way out SIGCHLD #2 is delivered
        // (rax 0, same handler); the second sigreturn finally returns wait4's value.
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, 61, 0x1000, 1)); // wait4
        assert!(t.on_return(&ret(1, 0x7000, 0, 0)).is_empty()); // handler #1
        t.on_entry(entry(1, 10, 1, 0x7010, 2)); // write in handler #1
        assert!(t.on_return(&ret(1, 0x7012, 3, 0)).is_empty());
        t.on_entry(entry(1, 10, nr::RT_SIGRETURN, 0x7020, 3));
        assert!(t.on_return(&ret(1, 0x7000, 0, 0)).is_empty()); // handler #2 instead
        t.on_entry(entry(1, 10, 1, 0x7010, 4)); // write in handler #2
        assert!(t.on_return(&ret(1, 0x7012, 3, 0)).is_empty());
        t.on_entry(entry(1, 10, nr::RT_SIGRETURN, 0x7020, 5));
        let c = t.on_return(&ret(1, 0x1002, 189, 0));
        assert_eq!(
            names(&c),
            vec![
                (61, Some(189)),
                (1, Some(3)),
                (nr::RT_SIGRETURN, Some(189)),
                (1, Some(3)),
                (nr::RT_SIGRETURN, Some(189)),
            ]
        );
        assert_eq!(t.pending_tasks(), 0);
    }

    #[test]
    fn restart_without_handler() {
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, 0, 0x1000, 1));
        let c = t.on_return(&ret(1, 0x1000, 0, 0));
        assert_eq!(c[0].outcome, Outcome::Restarted);
    }

    #[test]
    fn execve_returns_into_the_new_image() {
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, nr::EXECVE, 0x1000, 1));
        let c = t.on_return(&ret(1, 0x401000, 0, 0));
        assert_eq!(names(&c), vec![(nr::EXECVE, Some(0))]);
        // A failed execve returns normally.
        t.on_entry(entry(1, 10, nr::EXECVE, 0x1000, 2));
        let c = t.on_return(&ret(1, 0x1002, -2, 0));
        assert_eq!(names(&c), vec![(nr::EXECVE, Some(-2))]);
    }

    #[test]
    fn exit_group_ends_the_other_threads_calls() {
        let mut t = Tracker::new();
        t.on_entry(entry(2, 11, 202, 0x3000, 1)); // futex in thread 2
        let c = t.on_entry(entry(1, 10, nr::EXIT_GROUP, 0x1000, 2));
        assert_eq!(names(&c), vec![(202, None), (nr::EXIT_GROUP, None)]);
        assert_eq!(t.pending_tasks(), 0);
    }

    #[test]
    fn fork_has_one_return_in_the_parent() {
        let mut t = Tracker::new();
        t.on_entry(entry(1, 10, nr::CLONE, 0x1000, 1));
        // The child (a new task) returns first with 0: not a completion.
        assert!(t.on_return(&ret(2, 0x1002, 0, 1)).is_empty());
        assert_eq!(
            names(&t.on_return(&ret(1, 0x1002, 42, 0))),
            vec![(nr::CLONE, Some(42))]
        );
    }

    #[test]
    fn the_into_forms_append_and_reused_stacks_start_empty() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        t.on_entry_into(entry(1, 10, 0, 0x1000, 1), &mut out);
        t.on_return_into(&ret(1, 0x1002, 5, 0), &mut out);
        // Task 2 gets task 1's emptied stack: only its own call is pending.
        t.on_entry_into(entry(2, 11, 1, 0x2000, 2), &mut out);
        t.on_return_into(&ret(2, 0x2002, 6, 0), &mut out);
        t.on_entry_into(entry(3, 12, nr::EXIT, 0x3000, 3), &mut out);
        assert_eq!(
            names(&out),
            vec![(0, Some(5)), (1, Some(6)), (nr::EXIT, None)]
        );
        assert_eq!(t.pending_tasks(), 0);
    }

    #[test]
    fn a_handlers_completion_is_held_without_what_out_held_before() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        t.on_entry_into(entry(2, 11, 3, 0x2000, 1), &mut out);
        t.on_return_into(&ret(2, 0x2002, 0, 0), &mut out); // close, reported
        t.on_entry_into(entry(1, 10, 0, 0x1000, 2), &mut out); // read
        t.on_return_into(&ret(1, 0x7000, 0, 0), &mut out); // handler starts
        t.on_entry_into(entry(1, 10, 1, 0x7010, 3), &mut out); // write in the handler
        t.on_return_into(&ret(1, 0x7012, 4, 0), &mut out); // held
        assert_eq!(names(&out), vec![(3, Some(0))]);
        t.on_entry_into(entry(1, 10, nr::RT_SIGRETURN, 0x7020, 4), &mut out);
        t.on_return_into(&ret(1, 0x1002, -4, 0), &mut out);
        assert_eq!(
            names(&out),
            vec![
                (3, Some(0)),
                (0, Some(-4)),
                (1, Some(4)),
                (nr::RT_SIGRETURN, Some(-4))
            ]
        );
    }

    #[test]
    fn runaway_nesting_is_bounded() {
        let mut t = Tracker::new();
        for i in 0..1000 {
            t.on_entry(entry(1, 10, 0, 0x1000 + i * 16, i));
        }
        assert!(t.stats().overflowed > 0);
        assert_eq!(t.finish().len(), MAX_DEPTH);
    }
}
