//! Facts the engine did not see: which ones an event needs, and recording a [`Lookup`]'s
//! answers.
//!
//! The observer asks in three steps so that a slow source never runs under the engine's lock
//! (the block side takes that lock for every request): under the lock, [`Engine::missing`]
//! says what the event needs that the tables lack; without it, [`Missing::ask`] runs the
//! lookups; under the lock again, [`Engine::learn`] records the answers, just before the
//! event itself is processed. Only the trace thread changes the fd tables, so nothing the
//! first step saw can change before the third.
//!
//! Each process is asked about once (its working directory, when unknown), each (process, fd)
//! once: failures are remembered until the process execs or exits, resp. until a seen syscall
//! opens, closes or dup's onto that fd.

use super::*;
use crate::lookup::{FdFacts, Lookup, LookupSource, TaskFacts};

/// Most failed fd lookups remembered per process (the set is cleared when full).
const MAX_FD_MISSES: usize = 256;

/// What one event needs from a [`Lookup`].
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Missing {
    pid: u32,
    /// The process's working directory is unknown and it was never asked for.
    task: bool,
    /// Fds the event uses that the table lacks and that were never asked for.
    fds: Vec<u32>,
}

/// A [`Lookup`]'s answers to a [`Missing`].
#[derive(Debug, Default)]
pub(crate) struct Answers {
    pid: u32,
    /// `Some` when the task was asked for (then `Some(None)` when no source answered).
    task: Option<Option<(TaskFacts, LookupSource)>>,
    fds: Vec<(u32, Option<(FdFacts, LookupSource)>)>,
}

impl Missing {
    pub(crate) fn is_empty(&self) -> bool {
        !self.task && self.fds.is_empty()
    }

    /// Runs the lookups (without the engine's lock: they may be slow).
    pub(crate) fn ask(self, lookup: &mut dyn Lookup) -> Answers {
        Answers {
            pid: self.pid,
            task: self.task.then(|| lookup.task(self.pid)),
            fds: self
                .fds
                .iter()
                .map(|&fd| (fd, lookup.fd(self.pid, fd)))
                .collect(),
        }
    }
}

impl Proc {
    /// Remembers that no source knew `fd` (bounded).
    fn note_fd_miss(&mut self, fd: u32) {
        if self.fd_misses.len() >= MAX_FD_MISSES {
            self.fd_misses.clear();
        }
        self.fd_misses.insert(fd);
    }

    /// Forgets what was looked up about the process as a whole: a new program (exec), or a
    /// new process (fork) that may be known where its parent was not.
    pub(super) fn forget_lookups(&mut self) {
        self.task_asked = false;
        self.fd_misses.clear();
    }
}

/// A directory fd argument: `(fd argument, path argument)` of the calls that resolve a path
/// against a directory fd (openat, openat2, unlinkat, renameat, renameat2).
fn dirfd_args(nr: u64) -> &'static [(usize, u8)] {
    match nr {
        257 | 437 | 263 => &[(0, 1)],
        264 | 316 => &[(0, 1), (2, 3)],
        _ => &[],
    }
}

/// The fds a completed call `c` uses that the engine tracks (positions, paths, flags).
fn fds_at_completion(c: &Completed) -> Vec<u32> {
    let e = &c.entry;
    let a = e.args;
    if c.ret().is_none_or(|r| r < 0) {
        return Vec::new(); // a failed call changes no table
    }
    match e.nr {
        // reads and writes (plain, positional, vectored): only on a regular file (the plugin
        // summed it), so the stdout of every process (a tty, a pipe) is not looked up for
        // nothing; lseek fails on what is not seekable.
        nr if io_call(nr, &a).is_some() && e.io.is_some() => vec![a[0] as u32],
        8 => vec![a[0] as u32],
        // ftruncate, fchdir, dup, dup2, dup3: the path follows
        77 | 81 | 32 | 33 | 292 => vec![a[0] as u32],
        // fcntl F_DUPFD, F_SETFD, F_SETFL, F_DUPFD_CLOEXEC
        72 if matches!(a[1], 0 | 2 | 4 | 1030) => vec![a[0] as u32],
        nr if copy::is_copy(nr) => copy_fds(e),
        nr => dirfd_args(nr)
            .iter()
            .filter(|&&(fa, pa)| {
                a[fa] as i64 as i32 != AT_FDCWD as i32
                    && path_arg(e, pa).is_some_and(|d| !d.bytes.starts_with(b"/"))
            })
            .map(|&(fa, _)| a[fa] as u32)
            .collect(),
    }
}

/// The fds of a copy without a user buffer: source and destination.
fn copy_fds(e: &EntryEvent) -> Vec<u32> {
    let a = e.args;
    match e.nr {
        copy::SENDFILE => vec![a[1] as u32, a[0] as u32],
        _ => vec![a[0] as u32, a[2] as u32],
    }
}

/// The fds an entry event `e` uses that the engine needs at once: a write's (its chunks are
/// indexed at entry) and a copy's (registered at entry).
fn fds_at_entry(e: &EntryEvent) -> Vec<u32> {
    match &e.io {
        Some(io) if !io.read => vec![io.fd],
        _ if copy::is_copy(e.nr) => copy_fds(e),
        _ => Vec::new(),
    }
}

impl Engine {
    /// What entry event `e` needs that the tables lack.
    pub(crate) fn missing_at_entry(&self, e: &EntryEvent) -> Missing {
        self.missing(e.tgid, fds_at_entry(e))
    }

    /// What completed call `c` needs that the tables lack.
    pub(crate) fn missing_at_completion(&self, c: &Completed) -> Missing {
        self.missing(c.entry.tgid, fds_at_completion(c))
    }

    /// The working directory of `pid` if it is unknown and was never asked for, and those of
    /// `used` that are neither in its fd table nor known to be unknown.
    fn missing(&self, pid: u32, mut used: Vec<u32>) -> Missing {
        let proc = self.procs.get(&pid);
        used.sort_unstable();
        used.dedup();
        used.retain(|fd| proc.is_none_or(|p| !p.fds.contains_key(fd) && !p.fd_misses.contains(fd)));
        Missing {
            pid,
            task: proc.is_none_or(|p| p.cwd.is_none() && !p.task_asked),
            fds: used,
        }
    }

    /// Records a lookup's answers, if any, in the tables (never over what a seen syscall
    /// said) and counts who answered.
    pub(crate) fn learn(&mut self, a: Option<Answers>) {
        let Some(a) = a else { return };
        if let Some(task) = a.task {
            let known = task.is_some();
            let p = self.proc_mut(a.pid, None);
            p.task_asked = true;
            if let Some((t, source)) = task {
                if p.cwd.is_none() {
                    p.cwd = t.cwd.filter(|c| c.starts_with('/')).map(|c| normalize(&c));
                }
                if p.comm.is_empty() {
                    p.comm = t.comm;
                }
                self.count_lookup(false, source);
            }
            if !known {
                self.counters.lookup_failures += 1;
            }
        }
        for (fd, answer) in a.fds {
            let p = self.proc_mut(a.pid, None);
            match answer {
                Some((f, source)) => {
                    p.fds.entry(fd).or_insert_with(|| FdEntry::looked_up(f));
                    self.count_lookup(true, source);
                }
                None => {
                    p.note_fd_miss(fd);
                    self.counters.lookup_failures += 1;
                }
            }
        }
    }

    fn count_lookup(&mut self, fd: bool, source: LookupSource) {
        let c = &mut self.counters;
        *match (fd, source) {
            (false, LookupSource::Profile) => &mut c.lookups_task_profile,
            (false, LookupSource::Symcall) => &mut c.lookups_task_symcall,
            (true, LookupSource::Profile) => &mut c.lookups_fd_profile,
            (true, LookupSource::Symcall) => &mut c.lookups_fd_symcall,
        } += 1;
    }

    /// A seen syscall opened, closed or dup'ed onto `fd` of `pid`: a failed lookup of it no
    /// longer says anything.
    pub(super) fn forget_fd_miss(&mut self, pid: u32, fd: u32) {
        if let Some(p) = self.procs.get_mut(&pid) {
            p.fd_misses.remove(&fd);
        }
    }
}

impl FdEntry {
    /// An fd table entry from a lookup. What is not a file (`pipe:[..]`, `socket:[..]`,
    /// `anon_inode:..`) gets no path: as an fd not opened by path, it names no file (a
    /// `sendfile` to a socket is not a copy).
    fn looked_up(f: FdFacts) -> FdEntry {
        let offset = f.pos.unwrap_or(0);
        FdEntry {
            path: f.path.starts_with('/').then(|| Arc::from(f.path.as_str())),
            flags: f.flags.unwrap_or(0),
            // f_flags does not carry O_CLOEXEC (it is in the fd table): kept across exec, as
            // the guest would for most inherited fds.
            cloexec: false,
            offset,
            highest: offset,
            inode: 0,
        }
    }
}
