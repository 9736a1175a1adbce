//! External daemons vmsight runs beside QEMU for a VM's devices (virtiofsd, vhost-device-vsock):
//! found in the vmsight cache's tools or on the system, started with a log of their own and
//! tied to vmsight's life, awaited until they listen, polled while the VM runs, and stopped at
//! teardown.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a daemon gets to create its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a daemon gets to exit by itself once QEMU is gone (vhost-user daemons exit when
/// their frontend's connection closes) before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Why a daemon could not serve its device.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{tool} was not found (looked at ${env}, {cache}, PATH{extra}); build it with `make tools` (scripts/build-tools.sh) or set {env}")]
    NotFound {
        tool: &'static str,
        env: &'static str,
        cache: String,
        extra: String,
    },
    #[error("cannot start {tool} {path}: {source}")]
    Spawn {
        tool: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} exited ({status}) before serving {socket}; its log {log}: {tail}")]
    Exited {
        tool: &'static str,
        status: ExitStatus,
        socket: PathBuf,
        log: PathBuf,
        tail: String,
    },
    #[error("{tool} did not create {socket} within {secs} s (log: {log})")]
    Timeout {
        tool: &'static str,
        socket: PathBuf,
        log: PathBuf,
        secs: u64,
    },
    #[error("cannot listen on {socket} for {tool}: {source}")]
    Bind {
        tool: &'static str,
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create {tool}'s log {path}: {source}")]
    Log {
        tool: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Finds the executable `tool`, in order: `$env`, the vmsight cache's
/// `tools/current/bin/<tool>` (scripts/build-tools.sh), `PATH`, then `extra` paths.
pub fn find_tool(
    tool: &'static str,
    env: &'static str,
    extra: &[&str],
) -> Result<PathBuf, DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let cache = vmsight_image::cache_dir()
        .map(|c| c.join("tools/current/bin").join(tool))
        .unwrap_or_else(|_| PathBuf::from("~/.cache/vmsight/tools/current/bin").join(tool));
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::iter::once(cache.clone())
        .chain(std::env::split_paths(&path).map(|d| d.join(tool)))
        .chain(extra.iter().map(PathBuf::from))
        .find(|p| executable(p))
        .ok_or_else(|| DaemonError::NotFound {
            tool,
            env,
            cache: cache.display().to_string(),
            extra: extra.iter().map(|e| format!(", {e}")).collect(),
        })
}

/// A running daemon.
#[derive(Debug)]
pub struct Daemon {
    tool: &'static str,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `bin args` with stdout and stderr to `log`, and waits until `socket` exists.
    pub fn start(
        tool: &'static str,
        bin: &Path,
        args: &[String],
        socket: &Path,
        log: &Path,
    ) -> Result<Daemon, DaemonError> {
        let _ = std::fs::remove_file(socket);
        let (out, err) = log_files(tool, log)?;
        let mut cmd = Command::new(bin);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        crate::child::tie_to_vmsight(&mut cmd);
        let child = cmd.spawn().map_err(|source| DaemonError::Spawn {
            tool,
            path: bin.to_owned(),
            source,
        })?;
        let mut d = Daemon {
            tool,
            child,
            log: log.to_owned(),
        };
        d.wait_for_socket(socket)?;
        Ok(d)
    }

    /// Starts `bin args` as the unprivileged `who` (`crate::confine`): vmsight binds the
    /// daemon's listening socket itself (`listener`, handed over as an inherited fd whose
    /// number the caller put in `args`), the binary is executed from an fd vmsight opened
    /// (`fexecve`: the new user may not reach its path, e.g. under `/root/.cache`), and the
    /// process starts in `who.cwd`, entered while still root (the new user may not reach that
    /// path either: the runtime directory is root's only). Its stdout and stderr go to `log`.
    pub fn start_as(
        tool: &'static str,
        bin: &Path,
        args: &[String],
        listener: &std::os::unix::net::UnixListener,
        log: &Path,
        who: &RunAs<'_>,
    ) -> Result<Daemon, DaemonError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let spawn_err = |source| DaemonError::Spawn {
            tool,
            path: bin.to_owned(),
            source,
        };
        let invalid = |e| spawn_err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e));
        let exe = std::fs::File::open(bin).map_err(spawn_err)?;
        let (out, err) = log_files(tool, log)?;
        // Everything the child needs, made before the fork (it may not allocate).
        let cstr = |b: &[u8]| std::ffi::CString::new(b).map_err(invalid);
        let exec = ExecVectors::new(
            std::iter::once(cstr(tool.as_bytes()))
                .chain(args.iter().map(|a| cstr(a.as_bytes())))
                .collect::<Result<_, _>>()?,
            std::env::vars_os()
                .map(|(k, v)| cstr(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
                .collect::<Result<_, _>>()?,
        );
        let cwd = cstr(who.cwd.as_os_str().as_bytes())?;
        let mut cmd = Command::new(bin);
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        crate::child::tie_to_vmsight(&mut cmd);
        let (fd, exe_fd) = (listener.as_raw_fd(), exe.as_raw_fd());
        let (uid, gid) = (who.uid, who.gid);
        // SAFETY: the closure runs in the forked child before exec and only calls
        // async-signal-safe functions (fcntl, chdir, setgroups, setgid, setuid, prctl,
        // `die_with_parent`, fexecve) on memory made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let check = |r: libc::c_int| {
                    if r == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                };
                check(libc::fcntl(fd, libc::F_SETFD, 0))?;
                check(libc::chdir(cwd.as_ptr()))?;
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(gid))?;
                check(libc::setuid(uid))?;
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                // The change of user cleared the parent-death signal: set it again.
                crate::child::die_with_parent()?;
                Err(exec.fexecve(exe_fd))
            });
        }
        let child = cmd.spawn().map_err(spawn_err)?;
        Ok(Daemon {
            tool,
            child,
            log: log.to_owned(),
        })
    }

    fn wait_for_socket(&mut self, socket: &Path) -> Result<(), DaemonError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.exited() {
                return Err(DaemonError::Exited {
                    tool: self.tool,
                    status,
                    socket: socket.to_owned(),
                    log: self.log.clone(),
                    tail: log_tail(&self.log),
                });
            }
            if socket.exists() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(DaemonError::Timeout {
                    tool: self.tool,
                    socket: socket.to_owned(),
                    log: self.log.clone(),
                    secs: START_TIMEOUT.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if the daemon has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// What the supervisor is told when the daemon exited while the VM runs.
    pub fn stopped(&mut self) -> Option<String> {
        let status = self.exited()?;
        Some(format!(
            "{} exited ({status}): {}",
            self.tool,
            log_tail(&self.log)
        ))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// After QEMU is gone: lets the daemon exit by itself (bounded), else kills it. Returns
    /// an error sentence when it exited by itself with a failure.
    pub fn stop(mut self) -> Option<String> {
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Some(s) = self.exited() {
                return (!s.success())
                    .then(|| format!("{} exited ({s}): {}", self.tool, log_tail(&self.log)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }
}

/// A device's daemon, shared between the supervisor's polls (`stopped`) and teardown.
#[derive(Debug)]
pub struct DaemonSlot(std::sync::Mutex<Option<Daemon>>);

impl DaemonSlot {
    pub fn new(d: Daemon) -> DaemonSlot {
        DaemonSlot(std::sync::Mutex::new(Some(d)))
    }

    /// [`Device::stopped`](crate::devices::Device::stopped) for a device served by this daemon.
    pub fn stopped(&self) -> Option<String> {
        self.0.lock().ok()?.as_mut()?.stopped()
    }

    /// Stops the daemon ([`Daemon::stop`]); the error sentence names the device `id`.
    pub fn stop(&self, id: &str) -> Option<String> {
        let d = self.0.lock().ok()?.take()?;
        d.stop().map(|e| format!("{id}: {e}"))
    }
}

/// A daemon's stdout and stderr, both to `log` (created afresh).
fn log_files(
    tool: &'static str,
    log: &Path,
) -> Result<(std::fs::File, std::fs::File), DaemonError> {
    let log_err = |source| DaemonError::Log {
        tool,
        path: log.to_owned(),
        source,
    };
    let out = std::fs::File::create(log).map_err(log_err)?;
    let err = out.try_clone().map_err(log_err)?;
    Ok((out, err))
}

/// `fexecve`'s argument and environment vectors, null-terminated, made before the fork (the
/// child of a multi-threaded process may not allocate).
struct ExecVectors {
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// The strings the vectors point into (their heap buffers never move).
    _strings: (Vec<std::ffi::CString>, Vec<std::ffi::CString>),
}

// SAFETY: the pointers point into the CStrings this value owns, which are never changed or
// dropped while it lives; the value is only read (in the forked child), never shared mutably.
unsafe impl Send for ExecVectors {}
// SAFETY: as for Send: shared access only reads the vectors.
unsafe impl Sync for ExecVectors {}

impl ExecVectors {
    fn new(args: Vec<std::ffi::CString>, env: Vec<std::ffi::CString>) -> ExecVectors {
        let vector = |v: &[std::ffi::CString]| {
            v.iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        ExecVectors {
            argv: vector(&args),
            envp: vector(&env),
            _strings: (args, env),
        }
    }

    /// Executes the program open at `fd` with these vectors; returns only on failure.
    fn fexecve(&self, fd: std::os::fd::RawFd) -> std::io::Error {
        // SAFETY: both vectors are null-terminated arrays of pointers to NUL-terminated
        // strings this value owns; fexecve only reads them.
        unsafe { libc::fexecve(fd, self.argv.as_ptr(), self.envp.as_ptr()) };
        std::io::Error::last_os_error()
    }
}

/// The unprivileged user a daemon runs as, and the directory it starts in.
#[derive(Debug, Clone, Copy)]
pub struct RunAs<'a> {
    pub uid: u32,
    pub gid: u32,
    pub cwd: &'a Path,
}

/// The last 3 non-empty lines of a log, joined (empty if unreadable).
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("daemon");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }

    #[test]
    fn a_daemon_that_dies_at_once_is_reported_with_its_log() {
        let tmp = tempfile::tempdir().expect("tmp");
        let bin = script(tmp.path(), "echo 'bad option' >&2\nexit 3");
        let e = Daemon::start(
            "faked",
            &bin,
            &[],
            &tmp.path().join("s.sock"),
            &tmp.path().join("log"),
        )
        .expect_err("exits");
        let msg = e.to_string();
        assert!(
            msg.starts_with("faked exited") && msg.contains("bad option"),
            "{msg}"
        );
    }

    #[test]
    fn a_daemon_is_ready_when_its_socket_exists_and_is_killed_at_stop() {
        let tmp = tempfile::tempdir().expect("tmp");
        let sock = tmp.path().join("s.sock");
        let bin = script(tmp.path(), "touch \"$1\"\nexec sleep 60");
        let mut d = Daemon::start(
            "faked",
            &bin,
            &[sock.display().to_string()],
            &sock,
            &tmp.path().join("log"),
        )
        .expect("starts");
        assert!(d.stopped().is_none());
        assert_eq!(
            d.stop(),
            None,
            "killed after the grace period, not an error"
        );
    }

    /// As root: the daemon runs as the given ids, without groups or capabilities, starts in
    /// a directory its user cannot reach by path, and inherits the listening socket.
    #[test]
    fn a_daemon_started_as_another_user_gets_its_ids_its_directory_and_the_socket() {
        if !nix::unistd::geteuid().is_root() {
            return; // changing users needs root
        }
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        let cwd = tmp.path().join("start");
        std::fs::create_dir(&cwd).expect("mkdir");
        let sock = tmp.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        let fd = listener.as_raw_fd();
        let log = tmp.path().join("log");
        let script = format!(
            "grep -E '^(Uid|Gid|Groups|CapEff|NoNewPrivs)' /proc/self/status; pwd; \
             readlink /proc/self/fd/{fd}"
        );
        let who = RunAs {
            uid: 1_900_065_535,
            gid: 1_900_065_534,
            cwd: &cwd,
        };
        let mut d = Daemon::start_as(
            "faked",
            Path::new("/bin/sh"),
            &["-c".into(), script],
            &listener,
            &log,
            &who,
        )
        .expect("starts");
        let status = d.child.wait().expect("waits");
        let out = std::fs::read_to_string(&log).expect("log");
        assert!(status.success(), "{out}");
        for want in [
            "Uid:\t1900065535\t1900065535\t1900065535\t1900065535",
            "Gid:\t1900065534\t1900065534\t1900065534\t1900065534",
            "CapEff:\t0000000000000000",
            "NoNewPrivs:\t1",
        ] {
            assert!(out.contains(want), "{want:?} in {out}");
        }
        assert!(out.lines().any(|l| l.trim() == "Groups:"), "{out}");
        assert!(out.contains(&format!("{}\n", cwd.display())), "{out}");
        assert!(out.contains("socket:["), "the listener is inherited: {out}");
    }

    #[test]
    fn tools_are_found_through_the_environment_first() {
        let tmp = tempfile::tempdir().expect("tmp");
        // A variable no other test sets.
        std::env::set_var("VMSIGHT_TEST_FIND_TOOL", tmp.path());
        let p = find_tool("nonexistent-tool", "VMSIGHT_TEST_FIND_TOOL", &[]).expect("env");
        assert_eq!(p, tmp.path());
        std::env::remove_var("VMSIGHT_TEST_FIND_TOOL");
        let e = find_tool(
            "nonexistent-tool",
            "VMSIGHT_TEST_FIND_TOOL",
            &["/nowhere/x"],
        )
        .expect_err("missing");
        assert!(e.to_string().contains("/nowhere/x") && e.to_string().contains("make tools"));
    }

    #[test]
    fn log_tails_keep_the_last_lines() {
        let tmp = tempfile::tempdir().expect("tmp");
        let log = tmp.path().join("log");
        std::fs::write(&log, "a\n\nb\nc\nd\n").expect("write");
        assert_eq!(log_tail(&log), "b | c | d");
        assert_eq!(log_tail(&tmp.path().join("none")), "");
    }
}
