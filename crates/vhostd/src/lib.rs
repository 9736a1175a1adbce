//! How every vmsight vhost-user backend (disks, network) is served.
//!
//! [`serve`] binds the Unix socket synchronously, so QEMU can connect as soon as it returns,
//! then a thread accepts one frontend and serves it until it disconnects or [`Served::stop`]
//! is called; the queue workers are stopped and joined, the socket file removed, and an
//! `after` hook runs (a block pipeline writes back what it holds). The device-specific part
//! is the `VhostUserBackend` implementation and an optional `setup` hook that registers extra
//! file descriptors (a tap) with the workers before serving starts.

mod relay;
pub mod seccomp;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tracing::{debug, info, warn};
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::{
    Error as DaemonError, ShutdownHandle, VhostUserBackend, VhostUserDaemon, VringRwLock,
};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

/// Why a backend could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("vhost-user socket {}: {reason}", path.display())]
    Socket { path: PathBuf, reason: String },
    #[error("vhost-user socket {} is in use by a running backend", path.display())]
    SocketInUse { path: PathBuf },
    #[error("vhost-user backend on {}: {reason}", path.display())]
    Daemon { path: PathBuf, reason: String },
    #[error("cannot start the vhost-user backend thread for {}: {source}", path.display())]
    Thread {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the vhost-user backend thread for {} panicked", path.display())]
    Panicked { path: PathBuf },
}

/// The vring type every vmsight backend uses.
pub type Vring = VringRwLock<GuestMemoryAtomic<GuestMemoryMmap>>;

/// The daemon type a backend `B` is served by.
pub type Daemon<B> = VhostUserDaemon<B>;

/// Shared between the handle and the serving thread to stop it.
struct ShutdownState {
    requested: AtomicBool,
    conn: Mutex<Option<ShutdownHandle>>,
    socket: PathBuf,
}

impl ShutdownState {
    fn request(&self) {
        self.requested.store(true, Ordering::SeqCst);
        let conn = match self.conn.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        match conn {
            Some(h) => h.shutdown(),
            // Still waiting for QEMU: wake the accept() with a connection of our own.
            None => {
                let _ = UnixStream::connect(&self.socket);
            }
        }
    }
}

/// A backend being served.
pub struct Served {
    thread: Option<JoinHandle<Result<(), ServeError>>>,
    shutdown: Arc<ShutdownState>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("socket", &self.shutdown.socket)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl Served {
    /// Asks the backend to stop: disconnects QEMU or stops waiting for it. Returns at once.
    pub fn stop(&self) {
        self.shutdown.request();
    }

    /// Stops waiting for a frontend that never connected (QEMU exited during its start-up):
    /// without it, the serving thread would accept for ever. A backend that served a
    /// frontend is left to end by itself. Call it once QEMU is gone.
    pub fn stop_if_never_connected(&self) {
        let connected = match self.shutdown.conn.lock() {
            Ok(g) => g.is_some(),
            Err(p) => p.into_inner().is_some(),
        };
        if !connected {
            self.shutdown.request();
        }
    }

    /// Whether the serving thread has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// The Unix socket QEMU connects to.
    pub fn socket(&self) -> &Path {
        &self.shutdown.socket
    }

    /// Waits for the serving thread (a frontend disconnect and a requested stop are `Ok`).
    pub fn join(&mut self) -> Result<(), ServeError> {
        match self.thread.take() {
            None => Ok(()),
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(ServeError::Panicked {
                    path: self.shutdown.socket.clone(),
                })
            }),
        }
    }

    /// Whether the thread was already joined.
    pub fn joined(&self) -> bool {
        self.thread.is_none()
    }
}

/// How the frontend's connection reaches the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// The daemon accepts QEMU's connection itself.
    Direct,
    /// Through [`relay`]: `SET_VRING_ENABLE` before `SET_FEATURES` is dropped (QEMU's
    /// virtio-net sends it; the vhost crate refuses it).
    Relay,
}

/// Serves `backend` on `socket` under the thread name `name`. `setup` runs on the daemon
/// before it accepts (register extra listeners with its workers); `after` runs on the serving
/// thread once the workers are stopped and joined.
pub fn serve<B>(
    name: &str,
    backend: B,
    socket: &Path,
    connection: Connection,
    setup: impl FnOnce(&Daemon<B>) -> Result<(), String>,
    after: impl FnOnce() + Send + 'static,
) -> Result<Served, ServeError>
where
    B: VhostUserBackend<Bitmap = (), Vring = Vring> + Clone + 'static,
{
    let daemon_err = |reason: String| ServeError::Daemon {
        path: socket.to_owned(),
        reason,
    };
    let daemon = VhostUserDaemon::new(
        name.to_owned(),
        backend,
        GuestMemoryAtomic::new(GuestMemoryMmap::new()),
    )
    .map_err(|e| daemon_err(e.to_string()))?;
    setup(&daemon).map_err(daemon_err)?;
    check_socket_free(socket)?;
    let sock_err = |e: String| ServeError::Socket {
        path: socket.to_owned(),
        reason: e,
    };
    let listener = match connection {
        Connection::Direct => {
            Accept::Daemon(Listener::new(socket, true).map_err(|e| sock_err(e.to_string()))?)
        }
        Connection::Relay => {
            Accept::Relay(UnixListener::bind(socket).map_err(|e| sock_err(e.to_string()))?)
        }
    };
    // The frontend (QEMU) runs as the VM's owner: nobody else may connect. A directly
    // accepted connection (vhost-user-backend's listener) is kept from other users by the
    // mode alone; a relayed one is also checked with SO_PEERCRED.
    vmsight_proto::peer::restrict_socket(socket).map_err(|e| sock_err(e.to_string()))?;
    let shutdown = Arc::new(ShutdownState {
        requested: AtomicBool::new(false),
        conn: Mutex::new(None),
        socket: socket.to_owned(),
    });
    let state = shutdown.clone();
    let thread = std::thread::Builder::new()
        .name(name.chars().take(15).collect())
        .spawn(move || {
            let result = run(daemon, listener, &state);
            after();
            result
        })
        .map_err(|source| ServeError::Thread {
            path: socket.to_owned(),
            source,
        })?;
    Ok(Served {
        thread: Some(thread),
        shutdown,
    })
}

/// Refuses to replace a socket a live backend is listening on; removes a stale one.
fn check_socket_free(socket: &Path) -> Result<(), ServeError> {
    let Ok(meta) = std::fs::symlink_metadata(socket) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ServeError::Socket {
            path: socket.to_owned(),
            reason: "the path exists and is not a socket".into(),
        });
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(ServeError::SocketInUse {
            path: socket.to_owned(),
        });
    }
    Ok(())
}

/// Where the frontend's connection is accepted.
enum Accept {
    Daemon(Listener),
    Relay(UnixListener),
}

/// Accepts QEMU on `listener` and connects the daemon to it through a relay thread.
fn start_relayed<B>(
    daemon: &mut VhostUserDaemon<B>,
    listener: &UnixListener,
    shutdown: &ShutdownState,
) -> Result<(), String>
where
    B: VhostUserBackend<Bitmap = (), Vring = Vring> + Clone + 'static,
{
    let frontend = accept_allowed(listener)?;
    if shutdown.requested.load(Ordering::SeqCst) {
        return Err("stopped before a frontend connected".into());
    }
    let inner_path = shutdown.socket.with_extension("backend");
    let _ = std::fs::remove_file(&inner_path);
    let inner = UnixListener::bind(&inner_path).map_err(|e| e.to_string())?;
    let path = inner_path.to_string_lossy().into_owned();
    // The connect lands in the backlog; the accept below takes it.
    let started = daemon.start_client(&path).map_err(|e| e.to_string());
    let accepted = inner.accept().map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&inner_path);
    started?;
    let (backend, _) = accepted?;
    std::thread::Builder::new()
        .name("vmsight-vu-relay".into())
        .spawn(move || {
            // QEMU's vhost-user messages are all it handles from now on.
            seccomp::install_once(seccomp::ThreadClass::GuestService);
            relay::run(frontend, backend)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The first connection on `listener` whose peer may use the VM's sockets (its owner or
/// root); others are closed, logged, and the accept goes on.
fn accept_allowed(listener: &UnixListener) -> Result<UnixStream, String> {
    loop {
        let (conn, _) = listener.accept().map_err(|e| e.to_string())?;
        match vmsight_proto::peer::check_peer(&conn) {
            Ok(_) => return Ok(conn),
            Err(e) => warn!("vhost-user socket: {e}"),
        }
    }
}

/// The serving thread: accept one frontend, serve it until it disconnects, stop the workers.
fn run<B>(
    mut daemon: VhostUserDaemon<B>,
    mut listener: Accept,
    shutdown: &ShutdownState,
) -> Result<(), ServeError>
where
    B: VhostUserBackend<Bitmap = (), Vring = Vring> + Clone + 'static,
{
    let socket = shutdown.socket.clone();
    let err = |reason: String| ServeError::Daemon {
        path: socket.clone(),
        reason,
    };
    let started = match &mut listener {
        Accept::Daemon(l) => daemon.start(l).map_err(|e| e.to_string()),
        Accept::Relay(l) => start_relayed(&mut daemon, l, shutdown),
    };
    let result = match started {
        Err(e) if shutdown.requested.load(Ordering::SeqCst) => {
            debug!(error = %e, "backend stopped before a frontend connected");
            Ok(())
        }
        Err(e) => Err(err(e.to_string())),
        Ok(()) => {
            if let Ok(mut g) = shutdown.conn.lock() {
                *g = daemon.shutdown_handle();
            }
            if shutdown.requested.load(Ordering::SeqCst) {
                // Asked to stop while we were accepting.
                daemon.request_shutdown();
            }
            info!(socket = %socket.display(), "vhost-user frontend connected");
            match daemon.wait() {
                Ok(()) => Ok(()),
                Err(DaemonError::HandleRequest(
                    VhostUserError::Disconnected
                    | VhostUserError::PartialMessage
                    | VhostUserError::SocketBroken(_),
                )) => Ok(()),
                Err(_) if shutdown.requested.load(Ordering::SeqCst) => Ok(()),
                Err(e) => Err(err(e.to_string())),
            }
        }
    };
    // Stop the queue worker threads; dropping the daemon joins them.
    for h in daemon.get_epoll_handlers() {
        h.send_exit_event();
    }
    drop(daemon);
    if matches!(listener, Accept::Relay(_)) {
        let _ = std::fs::remove_file(&socket);
    }
    drop(listener); // a daemon listener removes its socket file itself
    match &result {
        Ok(()) => info!(socket = %socket.display(), "vhost-user backend stopped"),
        Err(e) => {
            tracing::warn!(socket = %socket.display(), error = %e, "vhost-user backend failed")
        }
    }
    result
}

/// Guest memory as the vhost-user crates hand it to a backend.
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap>;

/// Where a backend keeps the guest memory table it was given (`update_memory`), read by its
/// queue workers.
#[derive(Default)]
pub struct MemorySlot(std::sync::RwLock<Option<GuestMem>>);

impl MemorySlot {
    /// Stores the table QEMU sent (`VhostUserBackend::update_memory`).
    pub fn set(&self, mem: GuestMem) {
        match self.0.write() {
            Ok(mut g) => *g = Some(mem),
            Err(p) => *p.into_inner() = Some(mem),
        }
    }

    /// The current table, `None` before QEMU sent one.
    pub fn get(&self) -> Option<GuestMem> {
        match self.0.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// The exit event of a queue worker (`VhostUserBackend::exit_event`): logged and `None` if
/// the eventfd cannot be made.
pub fn exit_event() -> Option<(
    vmm_sys_util::event::EventConsumer,
    vmm_sys_util::event::EventNotifier,
)> {
    use vmm_sys_util::event::{new_event_consumer_and_notifier, EventFlag};
    match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
        Ok(pair) => Some(pair),
        Err(e) => {
            tracing::error!(error = %e, "cannot create the worker exit event");
            None
        }
    }
}
