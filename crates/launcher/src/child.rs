//! Helper processes vmsight starts (QEMU, virtiofsd): in their own process group, and tied to
//! vmsight's life.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes `cmd`'s process leave vmsight's process group (a terminal's Ctrl-C reaches vmsight,
/// which stops its children in order) and die with vmsight, even when vmsight is SIGKILLed:
/// no orphans.
///
/// The parent-death signal follows the thread that spawns the child: spawn from a thread that
/// lives as long as the run (the VM's main thread).
pub(crate) fn tie_to_vmsight(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only calls async-signal-safe
    // functions (setpgid, prctl, getppid, getpid, kill).
    unsafe {
        cmd.pre_exec(|| {
            libc::setpgid(0, 0);
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // vmsight died before the prctl took effect.
            if libc::getppid() == 1 {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
}
