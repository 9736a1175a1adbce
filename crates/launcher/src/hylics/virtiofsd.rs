//! virtiofsd, the virtio-fs daemon that serves the share to the guest, sandboxed to it.
//!
//! vmsight runs the virtio-fs project's own daemon instead of a virtio-fs backend of its own:
//! it is the well-kept implementation of a large protocol (FUSE over virtio), with a sandbox
//! (mount namespace + pivot_root into the shared directory, seccomp) that confines each VM to
//! its own share. Debian bookworm does not package it; `scripts/build-tools.sh` (run by
//! `make`) builds it from crates.io into the vmsight cache.

use std::path::{Path, PathBuf};

use super::spec::ShareSpec;
use crate::daemon::{find_tool, Daemon, DaemonError};

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

/// virtiofsd's arguments: the share only, in its namespace sandbox, with the spec's cache
/// policy, writeback cache and thread pool.
fn args(socket: &Path, dir: &Path, spec: &ShareSpec) -> Vec<String> {
    let mut a = vec![
        format!("--socket-path={}", socket.display()),
        format!("--shared-dir={}", dir.display()),
        format!("--cache={}", spec.cache.as_str()),
        "--sandbox=namespace".into(),
        "--log-level=warn".into(),
    ];
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
    Daemon::start("virtiofsd", bin, &args(socket, dir, spec), socket, log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtiofsd_is_sandboxed_to_the_share() {
        let spec: ShareSpec = "8M,cache=never".parse().expect("parses");
        let a = args(Path::new("/r/fs0.sock"), Path::new("/r/share"), &spec);
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
        let a = args(Path::new("/r/fs0.sock"), Path::new("/r/share"), &spec);
        assert_eq!(a[5..], ["--writeback", "--thread-pool-size=4"]);
    }
}
