//! What each argument of a syscall means, for decoding (x86-64 Linux ABI): the single table in
//! [`vmsight_proto::syscall`], which also tells the plugin which arguments to capture,
//! re-exported here.
//!
//! Only syscalls whose arguments are worth decoding are listed; any other syscall is shown
//! with its arguments in hex, like strace does for calls it does not know.

pub use vmsight_proto::syscall::{is_fd_arg, is_path_arg, spec, ArgKind, SyscallSpec};
