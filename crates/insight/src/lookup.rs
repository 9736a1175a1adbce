//! Lookups: what the engine asks when it did not see the syscall that would have told it.
//!
//! The engine learns fd tables and working directories only from the syscalls it sees. A
//! process that was already running when tracing began, or that inherited its fds (a shell's
//! `> file` redirect), uses fds it never opened in front of the engine and has a working
//! directory no `chdir` told. For those the engine asks a [`Lookup`]: a source that reads the
//! guest's own state (the launcher's kernel-profile reader, or a cooperating guest module
//! through SymCall). The engine does not know how a source works; it only records which
//! source answered ([`LookupSource`]) and caches the answer in its tables.

use serde::Serialize;

/// What a source knows about a process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFacts {
    pub tgid: u32,
    pub ppid: u32,
    pub comm: String,
    /// The executable's path, when the process has one.
    pub exe: Option<String>,
    /// The working directory, absolute (as `/proc/PID/cwd` shows it).
    pub cwd: Option<String>,
}

/// What a source knows about one open file descriptor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FdFacts {
    /// As `/proc/PID/fd/N` shows it: an absolute path (with " (deleted)" for an unlinked
    /// file), or `pipe:[INO]`, `socket:[INO]`, `anon_inode:NAME` for what is not a file.
    pub path: String,
    /// `file.f_flags` (O_* flags), when known.
    pub flags: Option<u64>,
    /// `file.f_pos`, when known.
    pub pos: Option<u64>,
}

/// Which source answered a lookup (the counters keep them apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LookupSource {
    /// Guest kernel memory read from the host with the kernel profile.
    Profile,
    /// The guest kernel module, through a SymCall upcall.
    Symcall,
}

/// A source of facts about guest processes. Called on the trace thread, without the engine's
/// lock; an answer may take a while (a SymCall round trip), so the engine asks at most once
/// per process and once per fd (see docs/insights.md, "Lookups").
pub trait Lookup: Send {
    /// Facts about process `pid` (a thread-group id), and which source answered; `None` when
    /// no source could.
    fn task(&mut self, pid: u32) -> Option<(TaskFacts, LookupSource)>;
    /// Facts about fd `fd` of process `pid`, and which source answered; `None` when no source
    /// could (the fd is not open, the process is gone, the source is unavailable).
    fn fd(&mut self, pid: u32, fd: u32) -> Option<(FdFacts, LookupSource)>;
}
