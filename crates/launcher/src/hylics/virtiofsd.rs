//! virtiofsd, the virtio-fs daemon that serves the share to the guest: found, started per VM,
//! sandboxed to the share, stopped with the VM.
//!
//! vmsight runs the virtio-fs project's own daemon instead of a virtio-fs backend of its own:
//! it is the well-kept implementation of a large protocol (FUSE over virtio), with a sandbox
//! (mount namespace + pivot_root into the shared directory, seccomp) that confines each VM to
//! its own share. Debian bookworm does not package it; `scripts/build-tools.sh` (run by
//! `make`) builds it from crates.io into the vmsight cache.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::spec::CacheMode;

/// Environment variable naming the virtiofsd binary to use.
pub const VIRTIOFSD_ENV: &str = "VMSIGHT_VIRTIOFSD";

/// How long virtiofsd gets to create its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long virtiofsd gets to exit by itself once QEMU is gone (it exits when its vhost-user
/// connection closes) before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Why virtiofsd could not serve the share.
#[derive(Debug, thiserror::Error)]
pub enum VirtiofsdError {
    #[error("virtiofsd was not found (looked at {looked}); build it with `make tools` (scripts/build-tools.sh) or set {VIRTIOFSD_ENV}")]
    NotFound { looked: String },
    #[error("cannot start virtiofsd {path}: {source}")]
    Spawn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("virtiofsd exited ({status}) before serving {socket}; its log {log}: {tail}")]
    Exited {
        status: ExitStatus,
        socket: PathBuf,
        log: PathBuf,
        tail: String,
    },
    #[error("virtiofsd did not create {socket} within {secs} s (log: {log})")]
    Timeout {
        socket: PathBuf,
        log: PathBuf,
        secs: u64,
    },
    #[error("cannot create virtiofsd's log {path}: {source}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where virtiofsd may be, in order: `$VMSIGHT_VIRTIOFSD`, the vmsight cache's tools, `PATH`,
/// the paths distributions install it at.
fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os(VIRTIOFSD_ENV).filter(|p| !p.is_empty()) {
        v.push(PathBuf::from(p));
        return v;
    }
    if let Ok(cache) = vmsight_image::cache_dir() {
        v.push(cache.join("tools/current/bin/virtiofsd"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        v.extend(std::env::split_paths(&path).map(|d| d.join("virtiofsd")));
    }
    v.push("/usr/libexec/virtiofsd".into());
    v.push("/usr/lib/qemu/virtiofsd".into());
    v
}

/// The virtiofsd to run.
pub fn find() -> Result<PathBuf, VirtiofsdError> {
    use std::os::unix::fs::PermissionsExt;
    let all = candidates();
    all.iter()
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .cloned()
        .ok_or_else(|| VirtiofsdError::NotFound {
            looked: format!(
                "${VIRTIOFSD_ENV}, {}, PATH, /usr/libexec/virtiofsd, /usr/lib/qemu/virtiofsd",
                vmsight_image::cache_dir()
                    .map(|c| c.join("tools/current/bin/virtiofsd").display().to_string())
                    .unwrap_or_else(|_| "~/.cache/vmsight/tools/current/bin/virtiofsd".into())
            ),
        })
}

/// virtiofsd's arguments: the share only, in its namespace sandbox.
fn args(socket: &Path, dir: &Path, cache: CacheMode) -> Vec<String> {
    vec![
        format!("--socket-path={}", socket.display()),
        format!("--shared-dir={}", dir.display()),
        format!("--cache={}", cache.as_str()),
        "--sandbox=namespace".into(),
        "--log-level=warn".into(),
    ]
}

/// A running virtiofsd.
#[derive(Debug)]
pub struct Virtiofsd {
    child: Child,
    log: PathBuf,
}

impl Virtiofsd {
    /// Starts virtiofsd on `socket` for `dir` and waits until it listens.
    pub fn start(
        bin: &Path,
        socket: &Path,
        dir: &Path,
        cache: CacheMode,
        log: &Path,
    ) -> Result<Virtiofsd, VirtiofsdError> {
        let _ = std::fs::remove_file(socket);
        let out = std::fs::File::create(log).map_err(|source| VirtiofsdError::Log {
            path: log.to_owned(),
            source,
        })?;
        let err = out.try_clone().map_err(|source| VirtiofsdError::Log {
            path: log.to_owned(),
            source,
        })?;
        let mut cmd = Command::new(bin);
        cmd.args(args(socket, dir, cache))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        crate::child::tie_to_vmsight(&mut cmd);
        let child = cmd.spawn().map_err(|source| VirtiofsdError::Spawn {
            path: bin.to_owned(),
            source,
        })?;
        let mut d = Virtiofsd {
            child,
            log: log.to_owned(),
        };
        d.wait_for_socket(socket)?;
        Ok(d)
    }

    fn wait_for_socket(&mut self, socket: &Path) -> Result<(), VirtiofsdError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.exited() {
                return Err(VirtiofsdError::Exited {
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
                return Err(VirtiofsdError::Timeout {
                    socket: socket.to_owned(),
                    log: self.log.clone(),
                    secs: START_TIMEOUT.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if virtiofsd has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// After QEMU is gone: lets virtiofsd exit by itself (bounded), else kills it. Returns its
    /// exit status when it ended by itself.
    pub fn stop(mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
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

    #[test]
    fn virtiofsd_is_sandboxed_to_the_share() {
        let a = args(
            Path::new("/r/fs0.sock"),
            Path::new("/r/share"),
            CacheMode::Never,
        );
        assert_eq!(
            a,
            [
                "--socket-path=/r/fs0.sock",
                "--shared-dir=/r/share",
                "--cache=never",
                "--sandbox=namespace",
                "--log-level=warn"
            ]
        );
    }

    #[test]
    fn a_daemon_that_dies_at_once_is_reported_with_its_log() {
        let tmp = tempfile::tempdir().expect("tmp");
        let fake = tmp.path().join("virtiofsd");
        std::fs::write(&fake, "#!/bin/sh\necho 'bad option' >&2\nexit 3\n").expect("write");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let e = Virtiofsd::start(
            &fake,
            &tmp.path().join("s.sock"),
            tmp.path(),
            CacheMode::Auto,
            &tmp.path().join("log"),
        )
        .expect_err("exits");
        let msg = e.to_string();
        assert!(
            msg.contains("exited") && msg.contains("bad option"),
            "{msg}"
        );
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
