//! Helper processes vmsight starts (QEMU, virtiofsd): in their own process group, and tied to
//! vmsight's life.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// The umask vmsight was started with (`u32::MAX`: not replaced), given back to its helpers.
static USER_UMASK: AtomicU32 = AtomicU32::new(u32::MAX);

/// Makes every file and socket `vmsight run` creates from now on its user's only (umask 077:
/// the runtime directory's files, the working copy, and the outputs named on the command
/// line), whatever umask it was started with. Helpers other than QEMU get the original umask
/// back ([`tie_to_vmsight`]): virtiofsd creates the guest's files in a shared directory.
pub(crate) fn private_umask() {
    // SAFETY: umask only sets the process's file-mode mask and cannot fail.
    let previous = unsafe { libc::umask(0o077) };
    let _ = USER_UMASK.compare_exchange(u32::MAX, previous, Ordering::Relaxed, Ordering::Relaxed);
}

/// Makes `cmd`'s process leave vmsight's process group (a terminal's Ctrl-C reaches vmsight,
/// which stops its children in order) and die with vmsight, even when vmsight is SIGKILLed:
/// no orphans.
///
/// The parent-death signal follows the thread that spawns the child: spawn from a thread that
/// lives as long as the run (the VM's main thread).
pub(crate) fn tie_to_vmsight(cmd: &mut Command) {
    let umask = USER_UMASK.load(Ordering::Relaxed);
    // SAFETY: the closure runs in the forked child before exec and only calls async-signal-safe
    // functions (umask, setpgid, and those of `die_with_parent`).
    unsafe {
        cmd.pre_exec(move || {
            if umask != u32::MAX {
                libc::umask(umask);
            }
            libc::setpgid(0, 0);
            die_with_parent()
        });
    }
}

/// In a forked child before exec: SIGKILL when the parent (vmsight) dies, and at once if it
/// died before the prctl took effect. A change of credentials clears the parent-death
/// signal, so a child that changes user calls this again afterwards. Async-signal-safe
/// (prctl, getppid, getpid, kill).
pub(crate) fn die_with_parent() -> std::io::Result<()> {
    // SAFETY: prctl, getppid, getpid and kill take plain integers and touch no memory.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() == 1 {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    Ok(())
}
