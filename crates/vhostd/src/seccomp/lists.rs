//! The calls each thread class may make (allow lists) and the calls no filtered thread makes
//! (the deny list).
//!
//! **How the allow lists were made.** Every system call of every thread of vmsight was counted
//! by thread name over the whole guest suite (`cargo test -p vmsight-tests`, 144 guest tests,
//! every disk, NIC, tracing and service configuration) with bpftrace on the
//! `raw_syscalls:sys_enter` tracepoint (the script and the counts: docs/security.md). Each list
//! is that set minus the set-up call made before the filters go on (`prctl`; `seccomp` stays,
//! for the second filter), plus [`COMMON`]: the calls of code paths the suite does not reach
//! but every thread may take (a panic's unwinding and abort, a log line, a thread's start and
//! end, memory growth). A
//! call missing here is refused with `EPERM` and written to the kernel log (audit record
//! `type=1326`, with the thread's name and the call's number): add it with the path that
//! makes it.

/// Calls any Rust thread may make on paths the suite does not reach: memory (never
/// executable: `mmap` and `mprotect` have an argument rule), locks, signals of its own, time,
/// a thread's start (`clone` only of a thread, `clone3` answers `ENOSYS`) and end, a log line,
/// a panic and an abort (`tgkill` only of its own process: an argument rule), a further
/// filter.
const COMMON: &[libc::c_long] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_mremap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_clone,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // Installing the next filter of the same thread (a filter can only take rights away).
    libc::SYS_seccomp,
];

/// Reading a file read-only (an argument rule keeps `openat` to `O_RDONLY` without
/// `O_CREAT`/`O_TRUNC`) and asking about files: the kernel profile and QEMU's
/// `/proc/PID/fd` entries, read at an insight lookup's first question. The RAM itself is
/// opened beforehand by vmsight's main thread (`QemuRam::preopen`): these threads have no
/// capability left to open another user's QEMU's files.
const READ_FILES: &[libc::c_long] = &[
    libc::SYS_openat,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_lseek,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
];

/// I/O on files already open (the disk's image, a dedup store): whatever the stages and
/// the terminal stage use, `io_uring` included.
const FILE_IO: &[libc::c_long] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_fallocate,
    libc::SYS_io_uring_enter,
];

/// Waiting for events: vhost-user-backend's epoll loop, the kick and call eventfds.
const EVENTS: &[libc::c_long] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_read,
];

/// A disk's vring worker (measured: `brk close epoll_wait exit futex getdents64 getrandom
/// gettid io_uring_enter madvise mmap mprotect munmap newfstatat openat read readlink
/// rt_sigprocmask sched_getaffinity sigaltstack statx write writev`, with the NIC's worker,
/// whose threads have the same name): events, the front stages (an insight lookup reads
/// files), file I/O of a stage that does it in place.
pub(super) fn vring_worker() -> Vec<libc::c_long> {
    [COMMON, EVENTS, READ_FILES, FILE_IO].concat()
}

/// The NIC's vring worker: events, frames read from and written to the host side of the link
/// (`read`, `writev`; netdev's only calls besides set-up), the clock of its stages.
pub(super) fn net_worker() -> Vec<libc::c_long> {
    [COMMON, EVENTS, &[libc::SYS_readv]].concat()
}

/// A disk's I/O pool (measured: `brk close exit fallocate fdatasync futex gettid madvise mmap
/// mprotect munmap openat preadv pwritev read rt_sigprocmask sched_getaffinity sched_yield
/// sigaltstack write`; `openat` of `/proc/sys/vm/overcommit_memory`, read-only) and its
/// io_uring reaper, which the guest suite does not run (blockdev's unit tests do: it waits
/// with `poll` on the ring's eventfd and reads it).
pub(super) fn io_pool() -> Vec<libc::c_long> {
    [COMMON, EVENTS, FILE_IO, READ_FILES].concat()
}

/// The plugin channel's reader (measured: `brk close exit futex getdents64 getpid getrandom
/// gettid madvise mmap mprotect mremap munmap newfstatat openat read readlink rt_sigprocmask
/// sched_getaffinity sigaltstack statx write`): guest memory and the kernel profile read
/// for its lookups, records written to the trace output and the insight engine.
pub(super) fn channel_reader() -> Vec<libc::c_long> {
    [COMMON, READ_FILES, &[libc::SYS_poll, libc::SYS_ppoll]].concat()
}

/// System calls no filtered thread makes: programs, processes, namespaces, credentials,
/// mounts, kernel code and state, other processes' memory (the guest services' deny list).
pub(super) const DENIED: &[libc::c_long] = &[
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_setresuid,
    libc::SYS_setresgid,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_setgroups,
    libc::SYS_capset,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_syslog,
    libc::SYS_personality,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_quotactl,
    libc::SYS_mknod,
    libc::SYS_mknodat,
];
