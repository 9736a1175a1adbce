//! What each argument of a syscall means, for decoding (x86-64 Linux ABI).
//!
//! Only syscalls whose arguments are worth decoding are listed; any other syscall is shown
//! with its arguments in hex, like strace does for calls it does not know.

use super::tables::SYSCALL_NAMES;

/// The meaning of one argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A file descriptor.
    Fd,
    /// A directory fd of the *at() calls (`AT_FDCWD` = -100).
    DirFd,
    /// A NUL-terminated path, captured at entry.
    Path,
    /// A buffer the call reads from user memory (write), captured at entry; length in arg N.
    InBuf(u8),
    /// A buffer the kernel fills (read): shown as an address.
    OutBuf,
    /// A signed integer.
    Int,
    /// An unsigned size or count.
    Size,
    /// A pointer or opaque value, in hex.
    Hex,
    /// open(2) flags.
    OpenFlags,
    /// A file mode, in octal.
    Mode,
    /// A signal number.
    Signal,
    /// lseek whence.
    Whence,
}

/// A syscall's name and argument kinds.
#[derive(Debug, Clone, Copy)]
pub struct SyscallSpec {
    pub name: &'static str,
    pub args: &'static [ArgKind],
}

use ArgKind::*;

/// The decoding spec for syscall `nr`.
pub fn spec(nr: u64) -> SyscallSpec {
    let name = usize::try_from(nr)
        .ok()
        .and_then(|i| SYSCALL_NAMES.get(i).copied())
        .unwrap_or("");
    let args: &'static [ArgKind] = match name {
        "read" => &[Fd, OutBuf, Size],
        "pread64" => &[Fd, OutBuf, Size, Int],
        "write" => &[Fd, InBuf(2), Size],
        "pwrite64" => &[Fd, InBuf(2), Size, Int],
        "readv" | "writev" | "preadv" | "pwritev" | "preadv2" | "pwritev2" => {
            &[Fd, Hex, Int, Int, Int, Hex]
        }
        "open" => &[Path, OpenFlags, Mode],
        "creat" => &[Path, Mode],
        "openat" => &[DirFd, Path, OpenFlags, Mode],
        "openat2" => &[DirFd, Path, Hex, Size],
        "close" | "fsync" | "fdatasync" | "fchdir" | "syncfs" => &[Fd],
        "stat" | "lstat" | "statfs" => &[Path, Hex],
        "fstat" | "fstatfs" => &[Fd, Hex],
        "newfstatat" => &[DirFd, Path, Hex, Hex],
        "statx" => &[DirFd, Path, Hex, Hex, Hex],
        "access" => &[Path, Int],
        "faccessat" | "faccessat2" => &[DirFd, Path, Int, Hex],
        "lseek" => &[Fd, Int, Whence],
        "dup" => &[Fd],
        "dup2" => &[Fd, Fd],
        "dup3" => &[Fd, Fd, Hex],
        "fcntl" => &[Fd, Int, Hex],
        "ioctl" => &[Fd, Hex, Hex],
        "ftruncate" => &[Fd, Int],
        "truncate" => &[Path, Int],
        "getdents64" | "getdents" => &[Fd, OutBuf, Size],
        "chdir" | "rmdir" | "unlink" | "chroot" => &[Path],
        "mkdir" => &[Path, Mode],
        "mkdirat" => &[DirFd, Path, Mode],
        "unlinkat" => &[DirFd, Path, Hex],
        "rename" | "link" | "symlink" => &[Path, Path],
        "renameat" | "linkat" => &[DirFd, Path, DirFd, Path, Hex],
        "renameat2" => &[DirFd, Path, DirFd, Path, Hex],
        "symlinkat" => &[Path, DirFd, Path],
        "readlink" => &[Path, OutBuf, Size],
        "readlinkat" => &[DirFd, Path, OutBuf, Size],
        "chmod" => &[Path, Mode],
        "fchmod" => &[Fd, Mode],
        "fchmodat" => &[DirFd, Path, Mode],
        "chown" | "lchown" => &[Path, Int, Int],
        "fchown" => &[Fd, Int, Int],
        "fchownat" => &[DirFd, Path, Int, Int, Hex],
        "utimensat" => &[DirFd, Path, Hex, Hex],
        "execve" => &[Path, Hex, Hex],
        "execveat" => &[DirFd, Path, Hex, Hex, Hex],
        "exit" | "exit_group" => &[Int],
        "kill" => &[Int, Signal],
        "tgkill" => &[Int, Int, Signal],
        "wait4" => &[Int, Hex, Hex, Hex],
        "pipe" => &[Hex],
        "pipe2" => &[Hex, Hex],
        "mmap" => &[Hex, Size, Hex, Hex, Fd, Hex],
        "munmap" | "mprotect" => &[Hex, Size, Hex],
        "brk" => &[Hex],
        "sendfile" => &[Fd, Fd, Hex, Size],
        "copy_file_range" => &[Fd, Hex, Fd, Hex, Size, Hex],
        "fadvise64" => &[Fd, Int, Int, Int],
        "fallocate" => &[Fd, Hex, Int, Int],
        "getpid" | "getppid" | "gettid" | "sync" | "fork" | "vfork" | "rt_sigreturn"
        | "sched_yield" | "pause" => &[],
        "rt_sigaction" => &[Signal, Hex, Hex, Size],
        "rt_sigprocmask" => &[Int, Hex, Hex, Size],
        "mount" => &[Path, Path, Path, Hex, Hex],
        "umount2" => &[Path, Hex],
        "mknod" => &[Path, Mode, Hex],
        "mknodat" => &[DirFd, Path, Mode, Hex],
        "getxattr" | "lgetxattr" | "setxattr" | "lsetxattr" | "listxattr" | "llistxattr"
        | "removexattr" | "lremovexattr" => &[Path, Hex, Hex, Size, Hex],
        "inotify_add_watch" => &[Fd, Path, Hex],
        _ => &[Hex, Hex, Hex, Hex, Hex, Hex],
    };
    SyscallSpec { name, args }
}

/// Whether argument `i` of syscall `nr` is a file descriptor (including *at() dirfds).
pub fn is_fd_arg(nr: u64, i: usize) -> bool {
    matches!(spec(nr).args.get(i), Some(Fd | DirFd))
}

/// Whether argument `i` of syscall `nr` is a path.
pub fn is_path_arg(nr: u64, i: usize) -> bool {
    matches!(spec(nr).args.get(i), Some(Path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_calls_are_decoded() {
        assert_eq!(spec(257).name, "openat");
        assert_eq!(spec(257).args, &[DirFd, Path, OpenFlags, Mode]);
        assert!(is_fd_arg(0, 0));
        assert!(is_path_arg(257, 1));
        assert!(!is_path_arg(257, 0));
        assert_eq!(spec(100_000).args.len(), 6);
    }
}
