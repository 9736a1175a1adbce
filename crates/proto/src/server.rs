//! One Unix-socket accept loop for every vmsight service (event bus, view server, control
//! socket).
//!
//! The accept thread sleeps in `poll(2)` on two descriptors, the listening socket and an
//! eventfd that [`UnixServer::stop`] (or drop) signals, so it wakes only for a connection or
//! for shutdown: no periodic wake-up, and stopping takes as long as one `poll` return. Each
//! accepted connection is handed to the service's callback on the accept thread; services
//! that talk for long start a thread of their own there.
//!
//! Here rather than in a crate of its own because every user already depends on this crate and
//! it needs nothing beyond `libc` (`poll`, `eventfd`), which this crate already uses. It is
//! written on `libc` directly rather than `nix` to keep this crate's dependencies to the four
//! it has; the plugin links this crate and does not use this module.
//!
//! The socket file: [`UnixServer::bind`] replaces a stale socket (nobody listening) but refuses
//! to replace a socket someone listens on or a file that is not a socket. When the server
//! stops it removes the socket file if it is still the one it bound (same device and inode);
//! a file that replaced it meanwhile, or a directory that is already gone, is left alone.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How long the loop waits (for shutdown only) after an accept error that would otherwise make
/// the listener readable again at once (out of file descriptors, out of memory).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket could not be bound, or someone listens there already.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Something that is not a socket is at the path.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// The shutdown eventfd or the accept thread could not be created.
    #[error("cannot start serving {path}: {source}")]
    Start {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

impl ServeError {
    /// The socket path the error is about.
    pub fn path(&self) -> &Path {
        match self {
            ServeError::Bind { path, .. } | ServeError::Start { path, .. } => path,
            ServeError::NotASocket(path) => path,
        }
    }

    /// The error as an `io::Error` (kind `AlreadyExists` for a file in the way), for services
    /// whose own errors carry one.
    pub fn into_io(self) -> io::Error {
        match self {
            ServeError::Bind { source, .. } | ServeError::Start { source, .. } => source,
            e @ ServeError::NotASocket(_) => io::Error::new(io::ErrorKind::AlreadyExists, e),
        }
    }
}

/// Binds a Unix socket at `path` (mode 0600, whatever the umask), replacing a stale socket file
/// but nothing else.
pub fn bind_socket(path: &Path) -> Result<UnixListener, ServeError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(ServeError::Bind {
                    path: path.to_path_buf(),
                    source: io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "another process is listening there",
                    ),
                });
            }
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(|source| ServeError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    crate::peer::restrict_socket(path).map_err(|source| ServeError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(listener)
}

/// A Unix-socket server: a thread accepting connections on one socket until stopped.
/// Dropping it stops it (see [`UnixServer::stop`]).
#[derive(Debug)]
pub struct UnixServer {
    path: PathBuf,
    /// Device and inode of the socket file this server bound.
    identity: Option<(u64, u64)>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl UnixServer {
    /// Binds `path` (see [`bind_socket`]) and starts a thread named `thread_name` that calls
    /// `on_connect` with every accepted connection (in blocking mode) or accept error.
    pub fn bind<F>(path: &Path, thread_name: &str, on_connect: F) -> Result<UnixServer, ServeError>
    where
        F: FnMut(io::Result<UnixStream>) + Send + 'static,
    {
        let listener = bind_socket(path)?;
        Self::serve(listener, path, thread_name, on_connect)
    }

    /// Serves an already bound `listener` whose socket file is `path`.
    pub fn serve<F>(
        listener: UnixListener,
        path: &Path,
        thread_name: &str,
        on_connect: F,
    ) -> Result<UnixServer, ServeError>
    where
        F: FnMut(io::Result<UnixStream>) + Send + 'static,
    {
        let start = |source| ServeError::Start {
            path: path.to_path_buf(),
            source,
        };
        // Non-blocking, so a connection that went away between poll and accept cannot block
        // the loop in accept.
        listener.set_nonblocking(true).map_err(start)?;
        let identity = std::fs::symlink_metadata(path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        let wake = Arc::new(EventFd::new().map_err(start)?);
        let w = Arc::clone(&wake);
        let thread = thread::Builder::new()
            .name(thread_name.to_string())
            .spawn(move || accept_loop(&listener, &w, on_connect))
            .map_err(start)?;
        Ok(UnixServer {
            path: path.to_path_buf(),
            identity,
            wake,
            thread: Some(thread),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting: wakes the accept thread, waits for it (it returns at once, or once the
    /// callback it is running returns) and removes the socket file if it is still the one
    /// this server bound. Connections already handed out are not touched.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.wake.signal();
        let _ = thread.join();
        if self.still_ours() {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// True if the file at the path is the socket this server bound.
    fn still_ours(&self) -> bool {
        let now = std::fs::symlink_metadata(&self.path)
            .ok()
            .filter(|m| m.file_type().is_socket())
            .map(|m| (m.dev(), m.ino()));
        now.is_some() && now == self.identity
    }
}

impl Drop for UnixServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Accepts until `wake` is signalled.
fn accept_loop<F>(listener: &UnixListener, wake: &EventFd, mut on_connect: F)
where
    F: FnMut(io::Result<UnixStream>),
{
    loop {
        let Ok((incoming, stop)) = wait_readable(listener.as_raw_fd(), wake.as_raw_fd(), None)
        else {
            // poll itself failed (out of memory): pause, still answering shutdown.
            if wake.wait(ACCEPT_ERROR_PAUSE) {
                return;
            }
            continue;
        };
        if stop {
            return;
        }
        if !incoming {
            continue;
        }
        match listener.accept() {
            // Another user's process never reaches the callback (it sees the connection
            // closed); the callback gets the refusal, to log it.
            Ok((stream, _)) => match crate::peer::check_peer(&stream) {
                Err(refused) => on_connect(Err(refused.into())),
                Ok(_) => match stream.set_nonblocking(false) {
                    Ok(()) => on_connect(Ok(stream)),
                    Err(e) => on_connect(Err(e)),
                },
            },
            Err(e) if is_transient(&e) => {}
            Err(e) => {
                on_connect(Err(e));
                if wake.wait(ACCEPT_ERROR_PAUSE) {
                    return;
                }
            }
        }
    }
}

/// Accept errors that only mean "nothing to accept right now".
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
    )
}

/// Waits until `a` or `b` is readable (or `timeout` passes); returns which are. Interrupted
/// waits are resumed (with the full timeout again: callers use short ones or none).
fn wait_readable(a: RawFd, b: RawFd, timeout: Option<Duration>) -> io::Result<(bool, bool)> {
    let mut fds = [pollfd(a), pollfd(b)];
    let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
    loop {
        // SAFETY: `fds` is a valid array of two pollfd structs that lives across the call,
        // and its length is passed with it.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok((fds[0].revents != 0, fds[1].revents != 0));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// A non-blocking eventfd used as a one-way "stop" flag: once signalled it stays readable.
#[derive(Debug)]
struct EventFd(OwnedFd);

impl EventFd {
    fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd, is valid and owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the eventfd readable (and keeps it so: it is never read).
    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one`, which lives across the call, to an eventfd
        // this struct owns. The counter cannot overflow from a handful of signals, so the
        // write cannot fail in a way that matters.
        let _ = unsafe {
            libc::write(
                self.0.as_raw_fd(),
                std::ptr::from_ref(&one).cast::<libc::c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Waits up to `timeout` for the signal; true if it came.
    fn wait(&self, timeout: Duration) -> bool {
        let fd = self.0.as_raw_fd();
        wait_readable(fd, fd, Some(timeout)).is_ok_and(|(ready, _)| ready)
    }

    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::sync::mpsc;
    use std::time::Instant;

    fn echo_server(path: &Path) -> UnixServer {
        UnixServer::bind(path, "test-accept", |conn: io::Result<UnixStream>| {
            let Ok(mut s) = conn else { return };
            let mut line = String::new();
            let _ = BufReader::new(&s).read_line(&mut line);
            let _ = s.write_all(line.as_bytes());
        })
        .expect("binds")
    }

    fn ask(path: &Path, text: &str) -> String {
        let mut c = UnixStream::connect(path).expect("connects");
        c.write_all(format!("{text}\n").as_bytes()).expect("writes");
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line).expect("reads");
        line
    }

    #[test]
    fn serves_connections() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        let srv = echo_server(&p);
        assert_eq!(srv.path(), p);
        for i in 0..20 {
            assert_eq!(ask(&p, &format!("hello {i}")), format!("hello {i}\n"));
        }
    }

    #[test]
    fn stops_promptly_without_any_connection() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        let srv = echo_server(&p);
        // Let the thread settle into poll.
        thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        srv.stop();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "stop took {:?}",
            t.elapsed()
        );
        assert!(UnixStream::connect(&p).is_err(), "nobody listens any more");
    }

    #[test]
    fn removes_its_socket_file_on_stop_and_drop() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        echo_server(&p).stop();
        assert!(!p.exists(), "removed by stop");
        drop(echo_server(&p));
        assert!(!p.exists(), "removed by drop");
    }

    #[test]
    fn leaves_a_file_that_replaced_its_socket_and_survives_a_removed_one() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        let srv = echo_server(&p);
        std::fs::remove_file(&p).expect("remove");
        std::fs::write(&p, b"not ours").expect("write");
        srv.stop();
        assert_eq!(std::fs::read(&p).expect("still there"), b"not ours");
        // The socket file (or its directory) removed before the server: stop still works.
        std::fs::remove_file(&p).expect("remove");
        let srv = echo_server(&p);
        std::fs::remove_file(&p).expect("remove");
        srv.stop();
        assert!(!p.exists());
    }

    #[test]
    fn replaces_stale_sockets_only() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        std::fs::write(&p, b"x").expect("write");
        assert!(matches!(bind_socket(&p), Err(ServeError::NotASocket(_))));
        std::fs::remove_file(&p).expect("remove");
        let srv = echo_server(&p);
        let e = UnixServer::bind(&p, "second", |_| {}).expect_err("in use");
        assert!(matches!(e, ServeError::Bind { .. }), "{e}");
        assert_eq!(e.path(), p);
        drop(srv);
        // A stale socket (nobody listening) is replaced.
        drop(UnixListener::bind(&p).expect("stale"));
        let _srv = echo_server(&p);
        assert_eq!(ask(&p, "again"), "again\n");
    }

    #[test]
    fn stop_waits_for_a_running_callback_only() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s.sock");
        let (tx, rx) = mpsc::channel();
        let srv = UnixServer::bind(&p, "test-accept", move |conn| {
            // Hand the connection to another thread, as real services do.
            let _ = tx.send(conn.is_ok());
        })
        .expect("binds");
        let _c = UnixStream::connect(&p).expect("connects");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
        let t = Instant::now();
        drop(srv);
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
