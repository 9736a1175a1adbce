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
        let log_err = |source| DaemonError::Log {
            tool,
            path: log.to_owned(),
            source,
        };
        let _ = std::fs::remove_file(socket);
        let out = std::fs::File::create(log).map_err(log_err)?;
        let err = out.try_clone().map_err(log_err)?;
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
