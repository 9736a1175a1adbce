//! Who may use a VM's sockets: the user vmsight runs as, and root (issue 35; docs/security.md).
//!
//! Every socket vmsight listens on is created mode 0600 ([`restrict_socket`]) inside a runtime
//! directory of mode 0700, and every accepted connection is checked with `SO_PEERCRED`
//! ([`check_peer`]): a process of another user that reaches a socket anyway (a directory made
//! with looser modes, a socket passed on) is refused before a byte is read from it.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// The credentials of a connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// A connection refused because its peer is neither the socket's owner nor root.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(
        "refused a connection from uid {uid} (pid {pid}): only uid {owner} (the VM's owner) \
         or root may use this socket"
    )]
    Refused { uid: u32, pid: i32, owner: u32 },
    #[error("cannot read the credentials of a connection (SO_PEERCRED): {0}")]
    Credentials(#[source] io::Error),
}

impl From<PeerError> for io::Error {
    fn from(e: PeerError) -> io::Error {
        let kind = match e {
            PeerError::Refused { .. } => io::ErrorKind::PermissionDenied,
            PeerError::Credentials(_) => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Whether a peer of user `peer` may use a socket served by user `owner`.
pub fn peer_allowed(peer: u32, owner: u32) -> bool {
    peer == owner || peer == 0
}

/// The peer's credentials, as the kernel recorded them at `connect`.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    // Hand-written rather than through nix: this crate is linked into QEMU's process by the
    // plugin and depends on libc alone.
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and live across the call; `len` holds the
    // size of `cred`, so the kernel writes at most that much. The descriptor is open (borrowed
    // from `stream`).
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Accepts the connection if its peer is this process's user or root.
pub fn check_peer(stream: &UnixStream) -> Result<PeerCred, PeerError> {
    let cred = peer_cred(stream).map_err(PeerError::Credentials)?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let owner = unsafe { libc::geteuid() };
    if peer_allowed(cred.uid, owner) {
        Ok(cred)
    } else {
        Err(PeerError::Refused {
            uid: cred.uid,
            pid: cred.pid,
            owner,
        })
    }
}

/// Makes a freshly bound socket file its owner's only (0600), whatever the umask was.
pub fn restrict_socket(path: &Path) -> io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_and_root_are_allowed_and_nobody_else() {
        assert!(peer_allowed(1000, 1000));
        assert!(peer_allowed(0, 1000));
        assert!(peer_allowed(0, 0));
        assert!(!peer_allowed(1001, 1000));
        assert!(!peer_allowed(1000, 0));
    }

    #[test]
    fn a_peer_of_this_process_is_seen_as_this_user() {
        let (a, _b) = UnixStream::pair().expect("pair");
        let c = check_peer(&a).expect("our own user is allowed");
        assert_eq!(c.pid, std::process::id() as i32);
        // SAFETY: geteuid has no arguments and cannot fail.
        assert_eq!(c.uid, unsafe { libc::geteuid() });
    }

    #[test]
    fn a_bound_socket_is_made_0600_whatever_the_umask() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).expect("bind");
        restrict_socket(&p).expect("chmod");
        let mode = std::fs::metadata(&p).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
