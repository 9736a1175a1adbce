//! System-call filters for the threads that handle guest input (docs/security.md): a thread
//! that a guest subverted through a device bug must not be able to start programs, create
//! processes or namespaces, change credentials, mount, load kernel code or trace other
//! processes. Built with rust-vmm's `seccompiler`, as Firecracker builds its filters, and
//! installed per thread (no `TSYNC`): only the threads of a class get it, after their set-up.
//!
//! This is a **deny list** of the calls those threads never make, answered with `EPERM` (the
//! thread sees an error it reports; nothing is killed): vmsight's threads run as root, and the
//! list takes away what root could do with them beyond the files it can already open. An
//! allow list per class (Firecracker's model) is the next step; it needs every call of every
//! code path of the class enumerated (docs/security.md, "Still trusted").

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The thread classes that get a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadClass {
    /// The vhost-user backends' `vring_worker` threads: they take the guest's descriptor
    /// chains off the virtqueues and run the front stages.
    VringWorker,
    /// A disk's I/O pool (`vmsight-io<n>`): file I/O, completion hooks, used-ring updates.
    IoPool,
    /// The plugin channel's reader (`vmsight-trace`): records the plugin wrote from guest
    /// registers and memory, guest memory read through the kernel profile.
    ChannelReader,
}

impl ThreadClass {
    pub fn name(self) -> &'static str {
        match self {
            ThreadClass::VringWorker => "vring worker",
            ThreadClass::IoPool => "I/O pool",
            ThreadClass::ChannelReader => "plugin channel reader",
        }
    }
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the seccomp filter of the {class} threads: {reason}")]
    Build { class: &'static str, reason: String },
    #[error("cannot install the seccomp filter on a {class} thread: {reason}")]
    Install { class: &'static str, reason: String },
}

/// System calls no filtered thread makes: programs, processes, namespaces, credentials,
/// mounts, kernel code and state, other processes' memory.
const DENIED: &[libc::c_long] = &[
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

/// How many filters were installed, per class (for tests and the log).
static INSTALLED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// Filters installed on threads of `class` so far.
pub fn installed(class: ThreadClass) -> u64 {
    INSTALLED[class as usize].load(Ordering::Relaxed)
}

/// The deny list as a BPF program: the listed calls, and `clone` without `CLONE_THREAD` (a
/// new process), get `EPERM`; everything else is allowed.
fn deny_list() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let new_process = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
        0,
    )
    .map_err(|e| e.to_string())?;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![new_process]).map_err(|e| e.to_string())?],
    );
    program(rules, SeccompAction::Errno(libc::EPERM as u32))
}

/// `clone3` answers `ENOSYS`: its flags are in memory a filter cannot read, and on `ENOSYS`
/// the C library falls back to `clone`, whose flags the deny list checks. (A second filter:
/// one filter has one action for all the calls it matches.)
fn clone3_fallback() -> Result<BpfProgram, String> {
    let rules = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    program(rules, SeccompAction::Errno(libc::ENOSYS as u32))
}

fn program(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    on_match: SeccompAction,
) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, on_match, TargetArch::x86_64)
        .map_err(|e| e.to_string())?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// Installs the filter of `class` on the calling thread (and the threads it will create).
pub fn install(class: ThreadClass) -> Result<(), SeccompError> {
    let build = |reason| SeccompError::Build {
        class: class.name(),
        reason,
    };
    let programs = [
        deny_list().map_err(build)?,
        clone3_fallback().map_err(build)?,
    ];
    for p in &programs {
        seccompiler::apply_filter(p).map_err(|e| SeccompError::Install {
            class: class.name(),
            reason: e.to_string(),
        })?;
    }
    INSTALLED[class as usize].fetch_add(1, Ordering::Relaxed);
    probe(class);
    Ok(())
}

/// Environment variable that turns the filters off (`off`): for debugging a refused call, and
/// to measure what the filters cost (bench/foundation.py, `vmsight-unconfined`).
pub const SECCOMP_ENV: &str = "VMSIGHT_SECCOMP";

/// Whether the filters are on (unless [`SECCOMP_ENV`] is `off`, read once).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(SECCOMP_ENV).map_or(true, |v| v != "off"))
}

/// Installs the filter of `class` on the calling thread once; later calls on the same thread
/// do nothing. For threads vmsight does not start itself (the vhost-user backend crate's
/// workers): called from the first callback they run.
pub fn install_once(class: ThreadClass) {
    thread_local! {
        static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if DONE.with(|d| d.replace(true)) || !enabled() {
        return;
    }
    if let Err(e) = install(class) {
        tracing::warn!("{e}; the thread runs unfiltered");
    }
}

/// Environment variable that makes every newly filtered thread try one forbidden call and log
/// the answer: the test-only hook that shows a filter engaged (tests/tests/security.rs).
pub const PROBE_ENV: &str = "VMSIGHT_TEST_SECCOMP_PROBE";

/// With [`PROBE_ENV`] set: `unshare(0)`, which changes nothing and succeeds without a filter.
fn probe(class: ThreadClass) {
    if std::env::var_os(PROBE_ENV).is_none() {
        return;
    }
    // SAFETY: unshare with no flags changes nothing; it only reports success or an error.
    let r = unsafe { libc::unshare(0) };
    let answer = if r == 0 {
        "allowed".to_owned()
    } else {
        format!("refused: {}", std::io::Error::last_os_error())
    };
    tracing::warn!(
        "seccomp probe ({} thread): a forbidden call (unshare) was {answer}",
        class.name()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a thread of its own: the filter stays with that thread.
    fn on_filtered_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            install(ThreadClass::IoPool).expect("installs");
            f()
        })
        .join()
        .expect("thread")
    }

    fn errno(r: libc::c_long) -> Option<i32> {
        (r < 0).then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    #[test]
    fn a_filtered_thread_cannot_fork_exec_or_unshare_and_may_still_make_threads_and_do_io() {
        let (unshare, fork, exec, thread, io) = on_filtered_thread(|| {
            // SAFETY: unshare(0) changes nothing.
            let unshare = errno(unsafe { libc::unshare(0) }.into());
            // SAFETY: a raw fork system call; refused by the filter, so no child exists (if it
            // did, the child exits at once).
            let fork = errno(unsafe {
                let r = libc::syscall(libc::SYS_fork);
                if r == 0 {
                    libc::_exit(0);
                }
                r
            });
            let exec = std::process::Command::new("/bin/true")
                .status()
                .map_err(|e| e.raw_os_error());
            let thread = std::thread::spawn(|| 7).join().ok();
            let io = std::fs::read("/proc/self/status").is_ok();
            (unshare, fork, exec, thread, io)
        });
        assert_eq!(unshare, Some(libc::EPERM));
        assert_eq!(fork, Some(libc::EPERM));
        assert!(exec.is_err(), "no program starts: {exec:?}");
        assert_eq!(
            thread,
            Some(7),
            "threads are still allowed (clone3 falls back)"
        );
        assert!(io, "files are still readable");
        // This thread is not filtered.
        // SAFETY: unshare(0) changes nothing.
        assert_eq!(unsafe { libc::unshare(0) }, 0);
    }
}
