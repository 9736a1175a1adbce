//! A new process's tables (fds, working directory) from the moment it starts.
//!
//! A child's fd table is its parent's as it was *when the fork began*: nothing the parent does
//! between the fork's entry and its return can change it (the calling thread is in the kernel;
//! a `vfork` parent is even suspended until the child execs or exits). The parent's return,
//! though, may be seen long after the child's first calls: under `vfork` (dash runs every
//! command through it) the child execs and writes its output before the parent returns, and on
//! a loaded host the other vCPU may run the child first. Copying the table at the parent's
//! return would leave the child's first writes without a file, and would overwrite what the
//! child had already opened.
//!
//! So the engine keeps a snapshot of the parent's tables at every fork entry, keyed by the
//! forking thread. The child's first entry carries its parent's TGID (the plugin reads it when
//! it first describes a process): a child not yet known takes the snapshot there ("adopted").
//! At the parent's return, a child that was adopted keeps its own tables; one that was not
//! (no parent TGID from the plugin: no kernel profile with paths) gets the snapshot then.

use super::*;

/// Most fork snapshots waiting for their child or their return (the set is cleared when full:
/// a child then falls back to its parent's return).
const MAX_PENDING_FORKS: usize = 256;

/// `clone`, `fork`, `vfork`, `clone3`.
const FORK_CALLS: [u64; 4] = [56, 57, 58, 435];

/// Fork snapshots by forking thread `(tgid, tid)`: (entry timestamp, the parent's tables).
#[derive(Debug, Default)]
pub(super) struct Forks {
    pending: HashMap<(u32, u32), (u64, Proc)>,
}

/// Whether entry `e` starts a new process (a `clone` without `CLONE_THREAD`; `clone3`'s flags
/// are in guest memory, so it counts: a thread's snapshot is simply never adopted).
pub(super) fn starts_process(e: &EntryEvent) -> bool {
    FORK_CALLS.contains(&e.nr) && !(e.nr == 56 && e.args[0] & CLONE_THREAD != 0)
}

/// The parent TGID the plugin attached to a task's first entry, if it is a process (positive).
pub(super) fn parent_tgid(e: &EntryEvent) -> Option<u32> {
    e.parent_tgid()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p > 0)
}

impl Engine {
    /// A fork's entry: remembers the forking process's tables for the child.
    pub(super) fn fork_entry(&mut self, e: &EntryEvent) {
        let Some(parent) = self.procs.get(&e.tgid) else {
            return;
        };
        let mut snap = parent.clone();
        snap.recent_reads.clear();
        snap.recent_order.clear();
        snap.forget_lookups();
        snap.adopted = false;
        let pending = &mut self.forks.pending;
        if pending.len() >= MAX_PENDING_FORKS && !pending.contains_key(&(e.tgid, e.tid)) {
            pending.clear();
        }
        pending.insert((e.tgid, e.tid), (e.ts_ns, snap));
    }

    /// The first entry of a process the engine does not know, whose parent `ppid` has a fork
    /// in flight: the child starts with the parent's tables as they were at that fork (the
    /// latest one, if several of the parent's threads fork at once).
    pub(super) fn adopt(&mut self, child: u32, ppid: u32) {
        if self.procs.contains_key(&child) || self.procs.len() >= self.cfg.max_processes {
            return;
        }
        let snap = self
            .forks
            .pending
            .iter()
            .filter(|((tgid, _), _)| *tgid == ppid)
            .max_by_key(|(_, (ts, _))| *ts)
            .map(|(_, (_, p))| p.clone());
        if let Some(mut p) = snap {
            p.adopted = true;
            self.procs.insert(child, p);
            self.counters.forks_adopted += 1;
        }
    }

    /// A fork by thread `(pid, tid)` returned `child` in the parent: the child gets the
    /// snapshot of the fork's entry (or the parent's tables now, without one) unless it was
    /// adopted at its first entry, within the process bound.
    pub(super) fn fork_returned(&mut self, pid: u32, tid: u32, child: u32) {
        let snap = self.forks.pending.remove(&(pid, tid)).map(|(_, p)| p);
        if let Some(p) = self.procs.get_mut(&child).filter(|p| p.adopted) {
            p.adopted = false;
            return;
        }
        let Some(mut p) = snap.or_else(|| {
            self.procs.get(&pid).cloned().map(|mut p| {
                p.recent_reads.clear();
                p.recent_order.clear();
                p.forget_lookups();
                p
            })
        }) else {
            return;
        };
        p.adopted = false;
        if self.procs.len() < self.cfg.max_processes || self.procs.contains_key(&child) {
            self.procs.insert(child, p);
        }
    }

    /// A fork that failed: its snapshot is dropped.
    pub(super) fn fork_failed(&mut self, pid: u32, tid: u32) {
        self.forks.pending.remove(&(pid, tid));
    }
}
