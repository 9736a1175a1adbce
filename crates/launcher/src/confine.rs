//! Least privilege for the processes that face the guest (docs/security.md): QEMU and
//! virtiofsd run as an unprivileged identity of the VM's own when vmsight runs as root, and
//! QEMU under its own seccomp sandbox (`-sandbox`) and in an empty chroot.
//!
//! The identity is **one per VM**, like Firecracker's jailer gives each microVM its own uid:
//! a uid/gid pair with no passwd entry, taken from [`DYNAMIC_BASE`].. and held by an `flock`
//! on a file of the runtime base for the life of the run (released by the kernel even when
//! vmsight is killed). Two VMs never share one, so a QEMU a guest escaped into cannot signal
//! or read another VM's QEMU or files. After QEMU's own `setuid` (QEMU's `-run-with user=`)
//! the kernel also marks it non-dumpable: no process of that uid may ptrace it.

use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The first uid (and gid) of the VM identities: above the ranges distributions give to
/// users (1000..), systemd's dynamic users (61184..65519) and `/etc/subuid` ranges
/// (100000.. in steps of 65536 for the first few thousand users).
pub const DYNAMIC_BASE: u32 = 1_900_000_000;
/// How many VM identities there are.
pub const DYNAMIC_COUNT: u32 = 65_536;
/// The directory of the runtime base that holds the identities' lock files.
const IDS_DIR: &str = ".ids";

/// Who QEMU and virtiofsd run as (`--run-as`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunAs {
    /// A VM identity of its own when vmsight runs as root, else vmsight's user.
    Auto,
    /// vmsight's own user (root, with every capability, when vmsight runs as root).
    Invoker,
    /// These ids (a user's name is resolved by the CLI); only root may ask for them.
    Ids { uid: u32, gid: u32 },
}

impl std::str::FromStr for RunAs {
    type Err = ConfineError;

    fn from_str(s: &str) -> Result<RunAs, ConfineError> {
        match s {
            "auto" => return Ok(RunAs::Auto),
            "self" => return Ok(RunAs::Invoker),
            _ => {}
        }
        let bad = || ConfineError::BadRunAs(s.to_owned());
        if let Some((u, g)) = s.split_once(':') {
            let uid = u.parse().map_err(|_| bad())?;
            let gid = g.parse().map_err(|_| bad())?;
            return Ok(RunAs::Ids { uid, gid });
        }
        if s.is_empty() || s.contains('\0') {
            return Err(bad());
        }
        let user = nix::unistd::User::from_name(s)
            .ok()
            .flatten()
            .ok_or_else(|| ConfineError::NoSuchUser(s.to_owned()))?;
        Ok(RunAs::Ids {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })
    }
}

impl std::fmt::Display for RunAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunAs::Auto => f.write_str("auto"),
            RunAs::Invoker => f.write_str("self"),
            RunAs::Ids { uid, gid } => write!(f, "{uid}:{gid}"),
        }
    }
}

/// Why the VM's processes cannot be given their identity.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("--run-as {0}: expected auto, self, a user's name or UID:GID")]
    BadRunAs(String),
    #[error("--run-as {0}: no such user")]
    NoSuchUser(String),
    #[error("--run-as {0}: only root can run QEMU as another user (vmsight runs as uid {1})")]
    NotRoot(String, u32),
    #[error("--run-as {0}: uid and gid 0 are root; use `--run-as self` to keep QEMU root")]
    Root(String),
    #[error("cannot lock a VM identity in {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("all {DYNAMIC_COUNT} VM identities from uid {DYNAMIC_BASE} are taken or belong to users (see {0})")]
    Exhausted(PathBuf),
    #[error("cannot give {path} to uid {uid}: {source}")]
    Chown {
        path: PathBuf,
        uid: u32,
        #[source]
        source: std::io::Error,
    },
}

/// The unprivileged identity the VM's QEMU and virtiofsd run as.
#[derive(Debug)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// The lock that keeps a dynamic identity this VM's (`None`: given on the command line).
    _lock: Option<nix::fcntl::Flock<File>>,
}

impl Identity {
    /// Gives `path` to this identity (its owner and group).
    pub fn give(&self, path: &Path) -> Result<(), ConfineError> {
        std::os::unix::fs::chown(path, Some(self.uid), Some(self.gid)).map_err(|source| {
            ConfineError::Chown {
                path: path.to_owned(),
                uid: self.uid,
                source,
            }
        })
    }
}

/// The identity `run_as` asks for the VM `vm`, whose runtime base is `base`; `None`: QEMU and
/// virtiofsd keep vmsight's user (not root, or `--run-as self`).
pub fn identity(run_as: &RunAs, base: &Path, vm: &str) -> Result<Option<Identity>, ConfineError> {
    let me = nix::unistd::geteuid().as_raw();
    match run_as {
        RunAs::Invoker => Ok(None),
        RunAs::Auto if me != 0 => Ok(None),
        RunAs::Auto => dynamic(base, vm).map(Some),
        RunAs::Ids { .. } if me != 0 => Err(ConfineError::NotRoot(run_as.to_string(), me)),
        RunAs::Ids { uid: 0, .. } | RunAs::Ids { gid: 0, .. } => {
            Err(ConfineError::Root(run_as.to_string()))
        }
        RunAs::Ids { uid, gid } => Ok(Some(Identity {
            uid: *uid,
            gid: *gid,
            _lock: None,
        })),
    }
}

/// A free dynamic identity, its search started at a slot derived from the VM's name (a VM
/// usually gets the same uid run after run, which keeps logs readable).
fn dynamic(base: &Path, vm: &str) -> Result<Identity, ConfineError> {
    let dir = base.join(IDS_DIR);
    let lock_err = |path: &Path, source| ConfineError::Lock {
        path: path.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&dir)
        .map_err(|e| lock_err(&dir, e))?;
    let start = fnv1a(vm.as_bytes()) % u64::from(DYNAMIC_COUNT);
    for i in 0..u64::from(DYNAMIC_COUNT) {
        let uid = DYNAMIC_BASE + ((start + i) % u64::from(DYNAMIC_COUNT)) as u32;
        if id_is_known(uid) {
            continue;
        }
        let path = dir.join(uid.to_string());
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| lock_err(&path, e))?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                return Ok(Identity {
                    uid,
                    gid: uid,
                    _lock: Some(lock),
                })
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => continue,
            Err((_, e)) => return Err(lock_err(&path, e.into())),
        }
    }
    Err(ConfineError::Exhausted(dir))
}

/// Whether a user or group of the system already has `id`.
fn id_is_known(id: u32) -> bool {
    let uid = nix::unistd::Uid::from_raw(id);
    let gid = nix::unistd::Gid::from_raw(id);
    matches!(nix::unistd::User::from_uid(uid), Ok(Some(_)))
        || matches!(nix::unistd::Group::from_gid(gid), Ok(Some(_)))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// QEMU's own seccomp filter (`-sandbox`), with what vmsight's devices allow: every group of
/// system calls QEMU can deny, except raising privileges when QEMU drops them itself
/// (`-run-with user=` calls setuid after the filter is in place, and QEMU dies with SIGSYS:
/// measured with QEMU 10.0 and 11.1). After that drop QEMU has no capability left, so the
/// set*id calls it could still make cannot gain anything. Measured to break nothing:
/// vhost-user disks, NIC, vsock and virtio-fs, the plugin (its rings, profile and threads),
/// ivshmem (the symbiotic interface), virtio-mem (swap growth).
pub fn sandbox_arg(drops_privileges: bool) -> String {
    let elevate = if drops_privileges { "allow" } else { "deny" };
    format!("on,obsolete=deny,elevateprivileges={elevate},spawn=deny,resourcecontrol=deny")
}

/// QEMU's `-run-with` for `id`: its uid and gid, and a chroot into the empty `jail` once it
/// has opened everything it needs (QEMU opens no file after start-up: the QMP commands
/// vmsight sends open none).
pub fn run_with_arg(id: &Identity, jail: &Path) -> String {
    format!("user={}:{},chroot={}", id.uid, id.gid, jail.display())
}

/// Kills QEMU when vmsight ends, however it ends (SIGKILL included). QEMU's own change of
/// user (`-run-with user=`) clears the parent-death signal vmsight gave it (the kernel clears
/// it on every change of credentials, and QEMU 10 has no `exit-with-parent`), so a small
/// forked process waits instead: it holds the read end of a pipe whose only write end is
/// vmsight's, and a pidfd of QEMU. When vmsight's end closes (at teardown, or by the kernel
/// when vmsight dies) it sends QEMU SIGKILL through the pidfd (never a recycled pid) and exits.
#[derive(Debug)]
pub struct ExitGuard {
    /// The write end: closing it sets the guard off.
    write: Option<std::os::fd::OwnedFd>,
    pid: libc::pid_t,
}

impl ExitGuard {
    /// Starts the guard of QEMU `qemu` (vmsight's child, not yet reaped: its pid is still
    /// its own).
    pub fn start(qemu: u32) -> std::io::Result<ExitGuard> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, qemu as libc::pid_t, 0) };
        if pidfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the fd was just returned by pidfd_open and is owned by nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (rfd, wfd, pfd) = (read.as_raw_fd(), write.as_raw_fd(), pidfd.as_raw_fd());
        // SAFETY: in the child only async-signal-safe system calls run (close, close_range,
        // setpgid, read, pidfd_send_signal, _exit) on values copied before the fork; it
        // never returns into Rust code.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: as above.
            unsafe { guard_child(rfd, wfd, pfd) };
        }
        Ok(ExitGuard {
            write: Some(write),
            pid,
        })
    }
}

/// The guard process: keeps only its two fds, leaves vmsight's process group (a terminal's
/// Ctrl-C is vmsight's to handle), waits for end of file and kills QEMU.
///
/// # Safety
/// Only in the child of a fork: it calls async-signal-safe functions only and never returns.
unsafe fn guard_child(rfd: i32, wfd: i32, pidfd: i32) -> ! {
    // SAFETY: the caller is the forked child; every call below is an async-signal-safe system
    // call on fds and values it owns, and the last one ends the process.
    unsafe {
        libc::close(wfd);
        let (lo, hi) = if rfd < pidfd {
            (rfd, pidfd)
        } else {
            (pidfd, rfd)
        };
        let close_range = |first: i32, last: u32| {
            if first >= 0 && (first as u32) <= last {
                libc::syscall(libc::SYS_close_range, first as u32, last, 0);
            }
        };
        if lo > 0 {
            close_range(0, (lo - 1) as u32);
        }
        if hi > lo + 1 {
            close_range(lo + 1, (hi - 1) as u32);
        }
        close_range(hi + 1, u32::MAX);
        libc::setpgid(0, 0);
        let mut b = 0u8;
        loop {
            let n = libc::read(rfd, (&mut b as *mut u8).cast(), 1);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            break;
        }
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd,
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
        libc::_exit(0)
    }
}

impl Drop for ExitGuard {
    /// Sets the guard off (QEMU is gone by now, or must go) and reaps it.
    fn drop(&mut self) {
        drop(self.write.take());
        let mut status = 0;
        // SAFETY: waitpid on the guard, our own child, with a valid status pointer.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_as_is_auto_self_a_name_or_ids() {
        assert_eq!("auto".parse::<RunAs>().unwrap(), RunAs::Auto);
        assert_eq!("self".parse::<RunAs>().unwrap(), RunAs::Invoker);
        assert_eq!(
            "1234:5678".parse::<RunAs>().unwrap(),
            RunAs::Ids {
                uid: 1234,
                gid: 5678
            }
        );
        assert_eq!(
            "root".parse::<RunAs>().unwrap(),
            RunAs::Ids { uid: 0, gid: 0 }
        );
        assert!(matches!(
            "no-such-user-here".parse::<RunAs>(),
            Err(ConfineError::NoSuchUser(_))
        ));
        assert!(matches!(
            "1:x".parse::<RunAs>(),
            Err(ConfineError::BadRunAs(_))
        ));
    }

    #[test]
    fn root_is_not_an_unprivileged_identity() {
        let base = tempfile::tempdir().unwrap();
        let e = identity(&RunAs::Ids { uid: 0, gid: 5 }, base.path(), "vm");
        if nix::unistd::geteuid().is_root() {
            assert!(matches!(e, Err(ConfineError::Root(_))), "{e:?}");
        } else {
            assert!(matches!(e, Err(ConfineError::NotRoot(..))), "{e:?}");
        }
    }

    #[test]
    fn two_vms_never_share_an_identity_and_a_finished_one_is_reused() {
        if !nix::unistd::geteuid().is_root() {
            return; // without root, Auto keeps vmsight's user
        }
        let base = tempfile::tempdir().unwrap();
        let a = identity(&RunAs::Auto, base.path(), "vm").unwrap().unwrap();
        let b = identity(&RunAs::Auto, base.path(), "vm").unwrap().unwrap();
        assert_ne!(a.uid, b.uid, "the second run of a name gets another id");
        assert!(a.uid >= DYNAMIC_BASE && b.uid >= DYNAMIC_BASE);
        assert_eq!((a.uid, b.uid), (a.gid, b.gid));
        let first = a.uid;
        drop(a);
        let c = identity(&RunAs::Auto, base.path(), "vm").unwrap().unwrap();
        assert_eq!(c.uid, first, "the lock went with the run");
    }

    #[test]
    fn the_exit_guard_kills_its_process_when_its_owner_lets_go() {
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let guard = ExitGuard::start(child.id()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(child.try_wait().unwrap().is_none(), "alive while guarded");
        drop(guard);
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }

    #[test]
    fn the_sandbox_denies_raising_privileges_unless_qemu_drops_them_itself() {
        assert!(sandbox_arg(false).contains("elevateprivileges=deny"));
        assert!(sandbox_arg(true).contains("elevateprivileges=allow"));
        for a in [sandbox_arg(false), sandbox_arg(true)] {
            assert!(a.starts_with("on,") && a.contains("spawn=deny"), "{a}");
        }
    }
}
