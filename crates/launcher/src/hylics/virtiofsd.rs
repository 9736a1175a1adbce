//! virtiofsd, the virtio-fs daemon that serves the share to the guest, sandboxed to it.
//!
//! vmsight runs the virtio-fs project's own daemon instead of a virtio-fs backend of its own:
//! it is the well-kept implementation of a large protocol (FUSE over virtio), with a sandbox
//! (mount namespace + pivot_root into the shared directory, seccomp) that confines each VM to
//! its own share. Debian bookworm does not package it; `scripts/build-tools.sh` (run by
//! `make`) builds it from crates.io into the vmsight cache.

use std::path::{Path, PathBuf};

use super::spec::ShareSpec;
use crate::daemon::{find_tool, Daemon, DaemonError, RunAs};

/// Environment variable naming the virtiofsd binary to use.
pub const VIRTIOFSD_ENV: &str = "VMSIGHT_VIRTIOFSD";

/// The virtiofsd to run.
pub fn find() -> Result<PathBuf, DaemonError> {
    find_tool(
        "virtiofsd",
        VIRTIOFSD_ENV,
        &["/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd"],
    )
}

/// Where virtiofsd finds its socket and its share.
enum Endpoints<'a> {
    /// It binds `socket` and opens `dir` itself (it runs as vmsight's user).
    Paths { socket: &'a Path, dir: &'a Path },
    /// vmsight bound the socket (inherited as fd `fd`) and started it in the share as the
    /// uid and gid `ids` (who may not reach either path).
    Inherited { fd: i32, ids: (u32, u32) },
}

/// virtiofsd's arguments: the share only, in its namespace sandbox, with the spec's cache
/// policy, writeback cache and thread pool.
fn args(at: Endpoints<'_>, spec: &ShareSpec) -> Vec<String> {
    let (socket, dir) = match at {
        Endpoints::Paths { socket, dir } => (
            format!("--socket-path={}", socket.display()),
            format!("--shared-dir={}", dir.display()),
        ),
        Endpoints::Inherited { fd, .. } => (format!("--fd={fd}"), "--shared-dir=.".to_owned()),
    };
    let translate = match at {
        // In its user namespace virtiofsd has only its own uid and gid: they are the guest's
        // root, and other guest users cannot own files in the share.
        Endpoints::Inherited {
            ids: (uid, gid), ..
        } => vec![
            format!("--translate-uid=map:0:{uid}:1"),
            format!("--translate-gid=map:0:{gid}:1"),
        ],
        Endpoints::Paths { .. } => Vec::new(),
    };
    let mut a = vec![
        socket,
        dir,
        format!("--cache={}", spec.cache.as_str()),
        "--sandbox=namespace".into(),
        "--log-level=warn".into(),
    ];
    a.extend(translate);
    if spec.writeback {
        a.push("--writeback".into());
    }
    if spec.threads > 0 {
        a.push(format!("--thread-pool-size={}", spec.threads));
    }
    a
}

/// Starts virtiofsd on `socket` for `dir` and waits until it listens.
pub fn start(
    bin: &Path,
    socket: &Path,
    dir: &Path,
    spec: &ShareSpec,
    log: &Path,
) -> Result<Daemon, DaemonError> {
    let at = Endpoints::Paths { socket, dir };
    Daemon::start("virtiofsd", bin, &args(at, spec), socket, log)
}

/// Starts virtiofsd for `dir` as the unprivileged `uid`/`gid` (`crate::confine`): vmsight
/// binds `socket` (0600, its own: QEMU connects as root before it drops its privileges) and
/// hands it over, and virtiofsd starts inside the share. In its namespace sandbox it then
/// sees nothing of the host but the share, and holds no capability on the host.
pub fn start_as(
    bin: &Path,
    socket: &Path,
    dir: &Path,
    spec: &ShareSpec,
    log: &Path,
    (uid, gid): (u32, u32),
) -> Result<Daemon, DaemonError> {
    use std::os::fd::AsRawFd;
    let bind_err = |source| DaemonError::Bind {
        tool: "virtiofsd",
        socket: socket.to_owned(),
        source,
    };
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket).map_err(bind_err)?;
    vmsight_proto::peer::restrict_socket(socket).map_err(bind_err)?;
    let at = Endpoints::Inherited {
        fd: listener.as_raw_fd(),
        ids: (uid, gid),
    };
    let who = RunAs { uid, gid, cwd: dir };
    Daemon::start_as("virtiofsd", bin, &args(at, spec), &listener, log, &who)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtiofsd_is_sandboxed_to_the_share() {
        let spec: ShareSpec = "8M,cache=never".parse().expect("parses");
        let at = || Endpoints::Paths {
            socket: Path::new("/r/fs0.sock"),
            dir: Path::new("/r/share"),
        };
        let a = args(at(), &spec);
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
        let spec: ShareSpec = "8M,writeback=on,threads=4".parse().expect("parses");
        let a = args(at(), &spec);
        assert_eq!(a[5..], ["--writeback", "--thread-pool-size=4"]);
        let a = args(Endpoints::Inherited { fd: 7, ids: (5, 6) }, &spec);
        assert_eq!(a[..2], ["--fd=7", "--shared-dir=."]);
        assert_eq!(
            a[5..7],
            ["--translate-uid=map:0:5:1", "--translate-gid=map:0:6:1"]
        );
    }
}
