//! The x86-64 Linux syscall table, once for every user: names, errno names and what each
//! argument is. The plugin (in QEMU) captures the arguments this table calls strings
//! ([`string_args`]) and the written buffer ([`buffer_arg`]) at syscall entry; the trace
//! decoder (`vmsight_introspect::syscall`) shows each argument by its [`ArgKind`]. One table,
//! so the plugin never captures what the decoder does not show or the other way round.
//!
//! Syscall numbers are ABI: they never change, new syscalls only append.

mod tables;

pub use tables::{errno_name, SYSCALL_NAMES};

/// Argument indices above the six registers under which the plugin ships bytes that are not
/// an argument's (DATA records of the call's entry; `LATE` ones read at its return).
pub mod extra_arg {
    /// A write's partial *head* chunk: from its file position up to the next 4 KiB file
    /// boundary (or the whole buffer if it ends before it).
    pub const HEAD: u8 = 16;
    /// A write's partial *tail* chunk: from the last 4 KiB file boundary inside the buffer to
    /// its end.
    pub const TAIL: u8 = 17;
    /// The task's executable path (`mm->exe_file`, rendered like `/proc/PID/exe`): at the
    /// first syscall of a process the plugin sees, and at a successful execve's return.
    pub const EXE: u8 = 18;
    /// The task's working directory (`fs->pwd`): with [`EXE`], and at a successful chdir or
    /// fchdir's return.
    pub const CWD: u8 = 19;
    /// The task's `comm` after a successful execve (the entry carries the old one).
    pub const COMM: u8 = 20;
    /// The TGID of the task's `real_parent` (4 bytes, little-endian): with [`EXE`] and
    /// [`CWD`].
    pub const PPID: u8 = 21;
}

/// The meaning of one argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A file descriptor.
    Fd,
    /// A directory fd of the *at() calls (`AT_FDCWD` = -100).
    DirFd,
    /// A NUL-terminated path, captured at entry.
    Path,
    /// A NUL-terminated string that is not a path (an xattr or memfd name, a file-system
    /// type), captured at entry.
    Str,
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
    /// A pointer to a 64-bit file offset the call reads and updates (`loff_t *` of
    /// `sendfile`, `splice`, `copy_file_range`): the plugin captures the 8 bytes at entry
    /// (the offset the call starts at); NULL means the fd's own position.
    OffPtr,
}

impl ArgKind {
    /// True for arguments captured as NUL-terminated strings.
    pub fn is_string(self) -> bool {
        matches!(self, ArgKind::Path | ArgKind::Str)
    }
}

/// A syscall's name and argument kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyscallSpec {
    /// The name; empty for an unassigned number.
    pub name: &'static str,
    /// The arguments to show.
    pub args: &'static [ArgKind],
}

use ArgKind::*;

/// How a syscall the table does not describe is shown: six arguments in hex, like strace
/// does for calls it does not know.
const UNKNOWN_ARGS: &[ArgKind] = &[Hex, Hex, Hex, Hex, Hex, Hex];

/// The syscall's name, or `None` for an unassigned number.
pub fn name(nr: u64) -> Option<&'static str> {
    usize::try_from(nr)
        .ok()
        .and_then(|i| SYSCALL_NAMES.get(i).copied())
        .filter(|n| !n.is_empty())
}

/// The number of a syscall name.
pub fn number(name: &str) -> Option<u64> {
    SYSCALL_NAMES
        .iter()
        .position(|n| !n.is_empty() && *n == name)
        .map(|i| i as u64)
}

/// The decoding spec for syscall `nr`.
pub fn spec(nr: u64) -> SyscallSpec {
    SyscallSpec {
        name: name(nr).unwrap_or(""),
        args: known_args(nr).unwrap_or(UNKNOWN_ARGS),
    }
}

/// Whether argument `i` of syscall `nr` is a file descriptor (including *at() dirfds).
pub fn is_fd_arg(nr: u64, i: usize) -> bool {
    matches!(spec(nr).args.get(i), Some(Fd | DirFd))
}

/// Whether argument `i` of syscall `nr` is a path.
pub fn is_path_arg(nr: u64, i: usize) -> bool {
    matches!(spec(nr).args.get(i), Some(Path))
}

/// Indices of the NUL-terminated string arguments (paths, names) of syscall `nr`, which the
/// plugin captures at entry.
pub fn string_args(nr: u64) -> impl Iterator<Item = u8> {
    known_args(nr)
        .unwrap_or(&[])
        .iter()
        .zip(0u8..)
        .filter(|(k, _)| k.is_string())
        .map(|(_, i)| i)
}

/// Indices of the offset-pointer arguments ([`ArgKind::OffPtr`]) of syscall `nr`, whose
/// 64-bit value the plugin captures at entry when the pointer is not NULL.
pub fn offset_args(nr: u64) -> impl Iterator<Item = u8> {
    known_args(nr)
        .unwrap_or(&[])
        .iter()
        .zip(0u8..)
        .filter(|(k, _)| matches!(k, OffPtr))
        .map(|(_, i)| i)
}

/// The value an offset-pointer argument pointed to at entry, from its captured bytes
/// (`None`: not captured, e.g. an unreadable page).
pub fn offset_value(bytes: &[u8]) -> Option<u64> {
    bytes.try_into().ok().map(u64::from_le_bytes)
}

/// For syscalls whose input buffer the plugin captures at entry: `(pointer arg, length arg)`.
pub fn buffer_arg(nr: u64) -> Option<(usize, usize)> {
    known_args(nr)?
        .iter()
        .enumerate()
        .find_map(|(i, k)| match k {
            InBuf(len) => Some((i, usize::from(*len))),
            _ => None,
        })
}

/// splice and copy_file_range: fd_in, *off_in, fd_out, *off_out, len, flags.
const COPY_ARGS: &[ArgKind] = &[Fd, OffPtr, Fd, OffPtr, Size, Hex];

/// The arguments of the syscalls worth decoding, by number (a jump table: the plugin asks on
/// every monitored syscall entry). Any other syscall is shown with [`UNKNOWN_ARGS`].
fn known_args(nr: u64) -> Option<&'static [ArgKind]> {
    Some(match nr {
        0 => &[Fd, OutBuf, Size],                // read
        1 => &[Fd, InBuf(2), Size],              // write
        2 => &[Path, OpenFlags, Mode],           // open
        3 => &[Fd],                              // close
        4 => &[Path, Hex],                       // stat
        5 => &[Fd, Hex],                         // fstat
        6 => &[Path, Hex],                       // lstat
        8 => &[Fd, Int, Whence],                 // lseek
        9 => &[Hex, Size, Hex, Hex, Fd, Hex],    // mmap
        10 => &[Hex, Size, Hex],                 // mprotect
        11 => &[Hex, Size, Hex],                 // munmap
        12 => &[Hex],                            // brk
        13 => &[Signal, Hex, Hex, Size],         // rt_sigaction
        14 => &[Int, Hex, Hex, Size],            // rt_sigprocmask
        15 => &[],                               // rt_sigreturn
        16 => &[Fd, Hex, Hex],                   // ioctl
        17 => &[Fd, OutBuf, Size, Int],          // pread64
        18 => &[Fd, InBuf(2), Size, Int],        // pwrite64
        19 => &[Fd, Hex, Int, Int, Int, Hex],    // readv
        20 => &[Fd, Hex, Int, Int, Int, Hex],    // writev
        21 => &[Path, Int],                      // access
        22 => &[Hex],                            // pipe
        24 => &[],                               // sched_yield
        32 => &[Fd],                             // dup
        33 => &[Fd, Fd],                         // dup2
        34 => &[],                               // pause
        39 => &[],                               // getpid
        40 => &[Fd, Fd, OffPtr, Size],           // sendfile
        57 => &[],                               // fork
        58 => &[],                               // vfork
        59 => &[Path, Hex, Hex],                 // execve
        60 => &[Int],                            // exit
        61 => &[Int, Hex, Hex, Hex],             // wait4
        62 => &[Int, Signal],                    // kill
        72 => &[Fd, Int, Hex],                   // fcntl
        74 => &[Fd],                             // fsync
        75 => &[Fd],                             // fdatasync
        76 => &[Path, Int],                      // truncate
        77 => &[Fd, Int],                        // ftruncate
        78 => &[Fd, OutBuf, Size],               // getdents
        80 => &[Path],                           // chdir
        81 => &[Fd],                             // fchdir
        82 => &[Path, Path],                     // rename
        83 => &[Path, Mode],                     // mkdir
        84 => &[Path],                           // rmdir
        85 => &[Path, Mode],                     // creat
        86 => &[Path, Path],                     // link
        87 => &[Path],                           // unlink
        88 => &[Path, Path],                     // symlink
        89 => &[Path, OutBuf, Size],             // readlink
        90 => &[Path, Mode],                     // chmod
        91 => &[Fd, Mode],                       // fchmod
        92 => &[Path, Int, Int],                 // chown
        93 => &[Fd, Int, Int],                   // fchown
        94 => &[Path, Int, Int],                 // lchown
        110 => &[],                              // getppid
        132 => &[Path, Hex],                     // utime
        133 => &[Path, Mode, Hex],               // mknod
        137 => &[Path, Hex],                     // statfs
        138 => &[Fd, Hex],                       // fstatfs
        155 => &[Path, Path],                    // pivot_root
        161 => &[Path],                          // chroot
        162 => &[],                              // sync
        163 => &[Path],                          // acct
        165 => &[Path, Path, Path, Hex, Hex],    // mount
        166 => &[Path, Hex],                     // umount2
        167 => &[Path, Hex],                     // swapon
        168 => &[Path],                          // swapoff
        179 => &[Hex, Path, Int, Hex],           // quotactl
        186 => &[],                              // gettid
        188 => &[Path, Str, Hex, Size, Hex],     // setxattr
        189 => &[Path, Str, Hex, Size, Hex],     // lsetxattr
        190 => &[Fd, Str, Hex, Size, Hex],       // fsetxattr
        191 => &[Path, Str, Hex, Size],          // getxattr
        192 => &[Path, Str, Hex, Size],          // lgetxattr
        193 => &[Fd, Str, Hex, Size],            // fgetxattr
        194 => &[Path, Hex, Size],               // listxattr
        195 => &[Path, Hex, Size],               // llistxattr
        197 => &[Path, Str],                     // removexattr
        198 => &[Path, Str],                     // lremovexattr
        199 => &[Fd, Str],                       // fremovexattr
        217 => &[Fd, OutBuf, Size],              // getdents64
        221 => &[Fd, Int, Int, Int],             // fadvise64
        231 => &[Int],                           // exit_group
        234 => &[Int, Int, Signal],              // tgkill
        235 => &[Path, Hex],                     // utimes
        254 => &[Fd, Path, Hex],                 // inotify_add_watch
        257 => &[DirFd, Path, OpenFlags, Mode],  // openat
        258 => &[DirFd, Path, Mode],             // mkdirat
        259 => &[DirFd, Path, Mode, Hex],        // mknodat
        260 => &[DirFd, Path, Int, Int, Hex],    // fchownat
        261 => &[DirFd, Path, Hex],              // futimesat
        262 => &[DirFd, Path, Hex, Hex],         // newfstatat
        263 => &[DirFd, Path, Hex],              // unlinkat
        264 => &[DirFd, Path, DirFd, Path, Hex], // renameat
        265 => &[DirFd, Path, DirFd, Path, Hex], // linkat
        266 => &[Path, DirFd, Path],             // symlinkat
        267 => &[DirFd, Path, OutBuf, Size],     // readlinkat
        268 => &[DirFd, Path, Mode],             // fchmodat
        269 => &[DirFd, Path, Int, Hex],         // faccessat
        275 => COPY_ARGS,                        // splice
        280 => &[DirFd, Path, Hex, Hex],         // utimensat
        285 => &[Fd, Hex, Int, Int],             // fallocate
        292 => &[Fd, Fd, Hex],                   // dup3
        293 => &[Hex, Hex],                      // pipe2
        295 => &[Fd, Hex, Int, Int, Int, Hex],   // preadv
        296 => &[Fd, Hex, Int, Int, Int, Hex],   // pwritev
        301 => &[Fd, Hex, Hex, DirFd, Path],     // fanotify_mark
        303 => &[DirFd, Path, Hex, Hex, Hex],    // name_to_handle_at
        306 => &[Fd],                            // syncfs
        316 => &[DirFd, Path, DirFd, Path, Hex], // renameat2
        319 => &[Str, Hex],                      // memfd_create
        322 => &[DirFd, Path, Hex, Hex, Hex],    // execveat
        326 => COPY_ARGS,                        // copy_file_range
        327 => &[Fd, Hex, Int, Int, Int, Hex],   // preadv2
        328 => &[Fd, Hex, Int, Int, Int, Hex],   // pwritev2
        332 => &[DirFd, Path, Hex, Hex, Hex],    // statx
        428 => &[DirFd, Path, Hex],              // open_tree
        429 => &[DirFd, Path, DirFd, Path, Hex], // move_mount
        430 => &[Str, Hex],                      // fsopen
        433 => &[DirFd, Path, Hex],              // fspick
        437 => &[DirFd, Path, Hex, Size],        // openat2
        439 => &[DirFd, Path, Int, Hex],         // faccessat2
        442 => &[DirFd, Path, Hex, Hex, Size],   // mount_setattr
        452 => &[DirFd, Path, Mode, Hex],        // fchmodat2
        _ => return None,
    })
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
        assert_eq!(spec(100_000).name, "");
        assert_eq!(spec(452).name, "fchmodat2");
    }

    #[test]
    fn names_and_numbers_round_trip() {
        assert_eq!(name(0), Some("read"));
        assert_eq!(name(435), Some("clone3"));
        assert_eq!(name(100_000), None);
        assert_eq!(number("openat"), Some(257));
        assert_eq!(number("nope"), None);
        assert_eq!(number(""), None);
        assert_eq!(errno_name(2), Some("ENOENT"));
        assert_eq!(errno_name(512), Some("ERESTARTSYS"));
        for (nr, n) in SYSCALL_NAMES.iter().enumerate() {
            if !n.is_empty() {
                assert_eq!(number(n), Some(nr as u64), "{n}");
            }
        }
    }

    #[test]
    fn every_described_syscall_has_a_name_and_at_most_six_args() {
        for nr in 0..1024 {
            if let Some(args) = known_args(nr) {
                assert!(name(nr).is_some(), "{nr}");
                assert!(args.len() <= 6, "{nr}");
            }
        }
    }

    /// The plugin's former table of string arguments, which the single table replaced: the
    /// plugin must keep capturing exactly these.
    fn former_plugin_string_args(nr: u64) -> &'static [u8] {
        match nr {
            2 | 4 | 6 | 21 | 59 | 76 | 80 | 83 | 84 | 85 | 87 | 89 | 90 | 92 | 94 | 132 | 133
            | 137 | 161 | 163 | 166 | 167 | 168 | 194 | 195 | 235 | 319 | 430 => &[0],
            82 | 86 | 88 | 155 | 188 | 189 | 191 | 192 | 197 | 198 => &[0, 1],
            165 => &[0, 1, 2],
            190 | 193 | 199 | 254 | 179 => &[1],
            257 | 258 | 259 | 260 | 261 | 262 | 263 | 267 | 268 | 269 | 280 | 303 | 322 | 332
            | 428 | 433 | 437 | 439 | 442 | 452 => &[1],
            264 | 265 | 316 | 429 => &[1, 3],
            266 => &[0, 2],
            301 => &[4],
            _ => &[],
        }
    }

    #[test]
    fn string_args_are_the_plugins_former_table() {
        for nr in 0..1024 {
            let got: Vec<u8> = string_args(nr).collect();
            assert_eq!(got, former_plugin_string_args(nr), "syscall {nr}");
        }
    }

    #[test]
    fn offset_pointers_are_those_of_the_copy_calls() {
        let with: Vec<(u64, Vec<u8>)> = (0..1024)
            .map(|nr| (nr, offset_args(nr).collect::<Vec<u8>>()))
            .filter(|(_, a)| !a.is_empty())
            .collect();
        assert_eq!(with, [(40, vec![2]), (275, vec![1, 3]), (326, vec![1, 3])]);
        assert_eq!(spec(275).name, "splice");
        assert_eq!(offset_value(&7u64.to_le_bytes()), Some(7));
        assert_eq!(offset_value(&[1, 2, 3]), None);
    }

    #[test]
    fn buffer_args_are_write_and_pwrite64() {
        assert_eq!(buffer_arg(1), Some((1, 2)));
        assert_eq!(buffer_arg(18), Some((1, 2)));
        assert_eq!(buffer_arg(0), None);
        let with_buffer: Vec<u64> = (0..1024).filter(|nr| buffer_arg(*nr).is_some()).collect();
        assert_eq!(with_buffer, [1, 18]);
    }
}
