//! Syscall interception, daemon side: what each syscall's arguments mean, pairing of entries
//! with their returns per task (Sky §4.2), and strace-style / JSON rendering.
//!
//! The TCG plugin reports raw events (an entry at the user `syscall` instruction, a return at
//! the kernel's `sysretq`/`iretq` back to user mode); everything that needs judgement happens
//! here, in the vmsight process, so the plugin stays small and fast.

pub mod event;
pub mod format;
pub mod observe;
pub mod spec;
pub mod tables;
pub mod tracker;

pub use event::{
    ArgData, ChunkSum, EntryEvent, IoSums, PosSource, ReturnEvent, ReturnVia, SumsPiece,
};
pub use format::{strace_line, JsonRecord};
pub use observe::{
    Drained, FilterError, JsonSink, JsonWriter, NameFilter, StraceWriter, SyscallObserver,
};
pub use spec::{ArgKind, SyscallSpec};
pub use tracker::{Completed, Outcome, Tracker, TrackerStats};

/// The syscall's name, or `syscall_N` for unknown numbers.
pub fn name(nr: u64) -> String {
    vmsight_proto::syscall::name(nr)
        .map(str::to_string)
        .unwrap_or_else(|| format!("syscall_{nr}"))
}

/// The number of a syscall name, for `--trace-filter`.
pub fn number(name: &str) -> Option<u64> {
    vmsight_proto::syscall::number(name)
}

/// x86-64 numbers the pairing logic needs.
pub mod nr {
    pub const RT_SIGRETURN: u64 = 15;
    pub const CLONE: u64 = 56;
    pub const FORK: u64 = 57;
    pub const VFORK: u64 = 58;
    pub const EXECVE: u64 = 59;
    pub const EXIT: u64 = 60;
    pub const EXIT_GROUP: u64 = 231;
    pub const RESTART_SYSCALL: u64 = 219;
    pub const EXECVEAT: u64 = 322;
    pub const CHDIR: u64 = 80;
    pub const FCHDIR: u64 = 81;
    pub const CLONE3: u64 = 435;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_round_trip() {
        assert_eq!(name(0), "read");
        assert_eq!(name(59), "execve");
        assert_eq!(name(257), "openat");
        assert_eq!(name(435), "clone3");
        assert_eq!(name(100_000), "syscall_100000");
        assert_eq!(number("openat"), Some(257));
        assert_eq!(number("nope"), None);
        assert_eq!(tables::errno_name(2), Some("ENOENT"));
        assert_eq!(tables::errno_name(512), Some("ERESTARTSYS"));
    }
}
