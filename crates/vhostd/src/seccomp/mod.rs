//! System-call filters and capability drops for the threads that handle guest input
//! (docs/security.md): a thread that a guest subverted through a device bug must not be able to
//! start programs, create processes or namespaces, change credentials, mount, load kernel code,
//! trace other processes or make code executable. Built with rust-vmm's `seccompiler`, as
//! Firecracker builds its filters, and installed per thread (no `TSYNC`): only the threads of a
//! class get it, after their set-up.
//!
//! Two kinds of filter (lists in [`lists`]):
//! - an **allow list** per hot class (vring workers, the I/O pool, the plugin channel's reader):
//!   only the calls that class makes, measured on the whole guest suite (`lists.rs` says how),
//!   every other call gets `EPERM` and is written to the kernel's log (`SECCOMP_FILTER_FLAG_LOG`,
//!   an audit record `type=1326` naming the thread and the call). Those threads also give up
//!   every capability first: they only read and write what was opened for them.
//! - the **deny list** for the guest-facing service threads (symbiotic device, swap cache,
//!   file-update streaming, dedup, insight log, vhost-user relays, the NIC's host side): the
//!   calls no such thread makes. Their code paths are many and some need root's capabilities,
//!   so they keep them. (The Hylics offload's connections are not filtered: they enter the
//!   NIC's namespace and run `ip` for a hand-over.)
//!
//! A refused call is an error the thread reports: nothing is killed, and the VM ends normally.

mod lists;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The thread classes that get a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadClass {
    /// A disk's `vring_worker` threads (vhost-user-backend's): they take the guest's
    /// descriptor chains off the virtqueues and run the front stages.
    VringWorker,
    /// The NIC's `vring_worker`: guest frames, the packet stages, the host side of the link.
    NetWorker,
    /// A disk's I/O pool (`vmsight-io<n>`) and io_uring reaper (`vmsight-uring`): file I/O,
    /// completion hooks, used-ring updates.
    IoPool,
    /// The plugin channel's reader (`vmsight-trace`): records the plugin wrote from guest
    /// registers and memory, guest memory read through the kernel profile.
    ChannelReader,
    /// The other threads that take guest-controlled input: the symbiotic device, the swap
    /// cache, file-update streaming, dedup, the insight log, the vhost-user relays and the
    /// NIC's host-side steering.
    GuestService,
}

/// What a class's filter allows and whether its threads keep their capabilities.
struct Policy {
    /// `Some`: only these calls are allowed (some with argument rules: [`allow_list`]);
    /// `None`: everything but the deny list.
    allow: Option<fn() -> Vec<libc::c_long>>,
    /// Whether the threads drop every capability (all five sets) before the filter goes on.
    drop_caps: bool,
}

impl ThreadClass {
    const ALL: [ThreadClass; 5] = [
        ThreadClass::VringWorker,
        ThreadClass::NetWorker,
        ThreadClass::IoPool,
        ThreadClass::ChannelReader,
        ThreadClass::GuestService,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ThreadClass::VringWorker => "vring worker",
            ThreadClass::NetWorker => "NIC vring worker",
            ThreadClass::IoPool => "I/O pool",
            ThreadClass::ChannelReader => "plugin channel reader",
            ThreadClass::GuestService => "guest service",
        }
    }

    fn policy(self) -> Policy {
        let allow: Option<fn() -> Vec<libc::c_long>> = match self {
            ThreadClass::VringWorker => Some(lists::vring_worker),
            ThreadClass::NetWorker => Some(lists::net_worker),
            ThreadClass::IoPool => Some(lists::io_pool),
            ThreadClass::ChannelReader => Some(lists::channel_reader),
            ThreadClass::GuestService => None,
        };
        Policy {
            allow,
            drop_caps: allow.is_some(),
        }
    }
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the seccomp filter of the {class} threads: {reason}")]
    Build { class: &'static str, reason: String },
    #[error("cannot install the seccomp filter on a {class} thread: {source}")]
    Install {
        class: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot drop the capabilities of a {class} thread: {reason}")]
    Capabilities { class: &'static str, reason: String },
}

thread_local! {
    /// Whether the calling thread's filter is on ([`confined`]).
    static CONFINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread runs under a filter of this module: code shared with
/// unconfined threads skips what a filtered thread may not do (another process's memory)
/// instead of having it refused.
pub fn confined() -> bool {
    CONFINED.with(std::cell::Cell::get)
}

/// How many filters were installed, per class (for tests and the log).
static INSTALLED: [AtomicU64; ThreadClass::ALL.len()] =
    [const { AtomicU64::new(0) }; ThreadClass::ALL.len()];

/// Filters installed on threads of `class` so far.
pub fn installed(class: ThreadClass) -> u64 {
    INSTALLED[class as usize].load(Ordering::Relaxed)
}

/// `clone` of a thread (`CLONE_THREAD` set): a new process is never allowed.
fn only_threads() -> Result<SeccompRule, seccompiler::Error> {
    let thread = libc::CLONE_THREAD as u64;
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(thread),
        thread,
    )?])?)
}

/// `mmap`, `mprotect`: never executable memory (argument 2, `prot`, without `PROT_EXEC`), so a
/// subverted thread cannot make code of the guest's data.
fn never_executable() -> Result<SeccompRule, seccompiler::Error> {
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        2,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
        0,
    )?])?)
}

/// `openat` for reading only: no write access, no `O_CREAT` or `O_TRUNC` (argument 2, the
/// flags; `O_RDONLY` is 0).
fn read_only() -> Result<SeccompRule, seccompiler::Error> {
    let writing = (libc::O_WRONLY | libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC) as u64;
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        2,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(writing),
        0,
    )?])?)
}

/// `tgkill` of vmsight's own threads only (argument 0, the thread group): an abort.
fn own_process() -> Result<SeccompRule, seccompiler::Error> {
    // SAFETY: getpid has no arguments and cannot fail.
    let me = unsafe { libc::getpid() } as u64;
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        me,
    )?])?)
}

/// The allow list as a BPF program: the listed calls pass, every other call gets `EPERM`.
/// Some only with an argument rule: `clone` of a thread, `mmap` and `mprotect` without
/// `PROT_EXEC`, `openat` read-only, `tgkill` of this process.
fn allow_list(calls: &[libc::c_long]) -> Result<BpfProgram, seccompiler::Error> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        calls.iter().map(|&nr| (nr, Vec::new())).collect();
    let mut restrict = |nr: libc::c_long, rule: SeccompRule| {
        if let Some(r) = rules.get_mut(&nr) {
            *r = vec![rule];
        }
    };
    restrict(libc::SYS_clone, only_threads()?);
    restrict(libc::SYS_mmap, never_executable()?);
    restrict(libc::SYS_mprotect, never_executable()?);
    restrict(libc::SYS_openat, read_only()?);
    restrict(libc::SYS_tgkill, own_process()?);
    program(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
    )
}

/// The deny list as a BPF program: the listed calls, and `clone` without `CLONE_THREAD` (a
/// new process), get `EPERM`; everything else is allowed.
fn deny_list() -> Result<BpfProgram, seccompiler::Error> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        lists::DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let new_process = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
        0,
    )?;
    rules.insert(libc::SYS_clone, vec![SeccompRule::new(vec![new_process])?]);
    program(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
    )
}

/// `clone3` answers `ENOSYS`: its flags are in memory a filter cannot read, and on `ENOSYS`
/// the C library falls back to `clone`, whose flags the other filter checks. A second filter
/// (one filter has one action for all the calls it matches); installed last, its `ENOSYS`
/// wins over the first filter's `EPERM` (the kernel takes the newest filter's errno).
fn clone3_fallback() -> Result<BpfProgram, seccompiler::Error> {
    let rules = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    program(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )
}

fn program(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    on_match: SeccompAction,
) -> Result<BpfProgram, seccompiler::Error> {
    let filter = SeccompFilter::new(rules, mismatch, on_match, TargetArch::x86_64)?;
    Ok(filter.try_into()?)
}

/// Installs `program` on the calling thread; with `log`, every call it does not allow is also
/// written to the kernel's log. Hand-written because `seccompiler::apply_filter` takes no
/// flags (`SECCOMP_FILTER_FLAG_LOG`).
fn apply(program: &BpfProgram, log: bool) -> std::io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| std::io::Error::other("filter too long"))?;
    let fprog = libc::sock_fprog {
        len,
        // seccompiler's `sock_filter` is `#[repr(C)]` with the kernel's layout, as libc's.
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    let flags = if log {
        libc::SECCOMP_FILTER_FLAG_LOG
    } else {
        0
    };
    // SAFETY: `fprog` points to `program`'s instructions, alive for the call; the kernel copies
    // them and checks them before use.
    let r = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            flags,
            &fprog as *const libc::sock_fprog,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Drops every capability of the calling thread: the bounding set first (that needs
/// `CAP_SETPCAP`, which only a privileged vmsight has; without it the thread has nothing to
/// drop there that it could use: no program can be started), then ambient, inheritable,
/// effective and permitted. A root vmsight's thread keeps uid 0: it can still open root's own
/// files (read-only where the allow list says so), but no other user's.
fn drop_capabilities() -> Result<(), caps::errors::CapsError> {
    use caps::{CapSet, Capability};
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)? {
        caps::clear(None, CapSet::Bounding)?;
    }
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set)?;
    }
    Ok(())
}

/// Installs the filter of `class` on the calling thread (and the threads it will create),
/// after dropping its capabilities if the class does.
pub fn install(class: ThreadClass) -> Result<(), SeccompError> {
    let policy = class.policy();
    let build = |e: seccompiler::Error| SeccompError::Build {
        class: class.name(),
        reason: e.to_string(),
    };
    let main = match policy.allow {
        Some(calls) => allow_list(&calls()),
        None => deny_list(),
    }
    .map_err(build)?;
    let fallback = clone3_fallback().map_err(build)?;
    if policy.drop_caps {
        drop_capabilities().map_err(|e| SeccompError::Capabilities {
            class: class.name(),
            reason: e.to_string(),
        })?;
    }
    let install_err = |source| SeccompError::Install {
        class: class.name(),
        source,
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes constant arguments and only restricts this thread's
    // later execve; the kernel requires it for a filter installed without CAP_SYS_ADMIN.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(install_err(std::io::Error::last_os_error()));
    }
    // The first filter allows `seccomp` (a filter only ever takes rights away), so the second
    // one can go on after it.
    for (p, log) in [(&main, true), (&fallback, false)] {
        apply(p, log).map_err(install_err)?;
    }
    CONFINED.with(|c| c.set(true));
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

    /// Runs `f` on a thread of its own under the filter of `class`.
    fn on_filtered_thread<T: Send + 'static>(
        class: ThreadClass,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            install(class).expect("installs");
            f()
        })
        .join()
        .expect("thread")
    }

    /// The error number of a failed raw call, `None` on success.
    fn errno(r: libc::c_long) -> Option<i32> {
        (r < 0).then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    /// `unshare(0)` changes nothing: it succeeds unless a filter refuses it.
    fn try_unshare() -> Option<i32> {
        // SAFETY: unshare with no flags changes nothing.
        errno(unsafe { libc::unshare(0) }.into())
    }

    /// A raw fork; the child, if one were made, exits at once.
    fn try_fork() -> Option<i32> {
        // SAFETY: a raw fork system call; a child (none is made under a filter) exits at once.
        errno(unsafe {
            let r = libc::syscall(libc::SYS_fork);
            if r == 0 {
                libc::_exit(0);
            }
            r
        })
    }

    /// An anonymous mapping with `prot`, unmapped again on success.
    fn try_mmap(prot: libc::c_int) -> Option<i32> {
        // SAFETY: a fresh anonymous private mapping of one page, unmapped before returning;
        // no memory is touched.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return Some(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
            libc::munmap(p, 4096);
            None
        }
    }

    #[test]
    fn a_deny_listed_thread_cannot_fork_exec_or_unshare_and_may_still_make_threads_and_do_io() {
        let (unshare, fork, exec, thread, io) =
            on_filtered_thread(ThreadClass::GuestService, || {
                let exec = std::process::Command::new("/bin/true")
                    .status()
                    .map_err(|e| e.raw_os_error());
                let thread = std::thread::spawn(|| 7).join().ok();
                let io = std::fs::read("/proc/self/status").is_ok();
                (try_unshare(), try_fork(), exec, thread, io)
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
        assert_eq!(try_unshare(), None);
    }

    /// The capability sets of the calling thread, from the kernel's view of it.
    fn my_capabilities() -> Vec<(String, String)> {
        std::fs::read_to_string("/proc/thread-self/status")
            .expect("status")
            .lines()
            .filter(|l| l.starts_with("Cap"))
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
            .collect()
    }

    #[test]
    fn an_allow_listed_thread_gets_only_its_calls_reads_files_read_only_and_holds_no_capability() {
        let scratch = std::env::temp_dir().join(format!("vmsight-seccomp-{}", std::process::id()));
        let target = scratch.clone();
        let got = on_filtered_thread(ThreadClass::IoPool, move || {
            // SAFETY: socket creates a descriptor, closed at once if it was made.
            let socket = errno(unsafe {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if fd >= 0 {
                    libc::close(fd);
                }
                fd.into()
            });
            let create = std::fs::File::create(&target).map_err(|e| e.raw_os_error());
            let read = std::fs::read("/proc/self/status").is_ok();
            let thread = std::thread::spawn(|| 7).join().ok();
            (
                try_unshare(),
                try_fork(),
                socket,
                create,
                read,
                try_mmap(libc::PROT_READ | libc::PROT_WRITE),
                try_mmap(libc::PROT_READ | libc::PROT_EXEC),
                thread,
                my_capabilities(),
            )
        });
        let (unshare, fork, socket, create, read, rw, exec, thread, caps) = got;
        assert_eq!(unshare, Some(libc::EPERM));
        assert_eq!(fork, Some(libc::EPERM));
        assert_eq!(socket, Some(libc::EPERM), "not on the list");
        assert_eq!(create.err(), Some(Some(libc::EPERM)), "openat for writing");
        assert!(!scratch.exists());
        assert!(read, "openat read-only is on the list");
        assert_eq!(rw, None, "data mappings are allowed");
        assert_eq!(exec, Some(libc::EPERM), "executable mappings are not");
        assert_eq!(thread, Some(7), "threads are allowed");
        for (set, mask) in &caps {
            assert_eq!(
                mask, "0000000000000000",
                "{set} of a filtered thread: {caps:?}"
            );
        }
        assert_eq!(caps.len(), 5, "{caps:?}");
        // The test's own thread keeps what it had.
        assert_eq!(try_unshare(), None);
    }

    #[test]
    fn every_allow_list_builds_and_keeps_the_deny_listed_calls_out() {
        for class in ThreadClass::ALL {
            let Some(calls) = class.policy().allow else {
                continue;
            };
            let calls = calls();
            if let Err(e) = allow_list(&calls) {
                panic!("the {} list: {e}", class.name());
            }
            for nr in lists::DENIED {
                assert!(!calls.contains(nr), "{} allows call {nr}", class.name());
            }
        }
        deny_list().expect("deny list");
    }
}
