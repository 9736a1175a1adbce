//! Errors of the public API (setup and lifetime of a backend). Per-request problems never
//! surface here: they become virtio status bytes and metrics.

use std::io;
use std::path::PathBuf;

/// Why a block backend could not be started, or why it stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The disk configuration is unusable.
    #[error("invalid disk configuration for {path}: {reason}")]
    InvalidConfig {
        /// The image.
        path: PathBuf,
        /// Sentence saying what is wrong and what is allowed.
        reason: String,
    },
    /// The image could not be opened.
    #[error("cannot open disk image {path}{mode}: {source}", mode = if *read_only { " read-only" } else { " for reading and writing" })]
    Open {
        /// The image.
        path: PathBuf,
        /// Whether it was opened read-only.
        read_only: bool,
        #[source]
        source: io::Error,
    },
    /// The image is not something we can serve.
    #[error("disk image {path} is not usable: {reason}")]
    BadImage {
        /// The image.
        path: PathBuf,
        /// Sentence saying why.
        reason: String,
    },
    /// Another process (or another backend of this one) holds a conflicting lock.
    #[error("cannot lock disk image {path}: {holder}")]
    Locked {
        /// The image.
        path: PathBuf,
        /// Who holds it and how, e.g. "another process holds it for writing (pid 42, qemu)".
        holder: String,
    },
    /// flock itself failed.
    #[error("cannot lock disk image {path}: {source}")]
    Lock {
        /// The image.
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The vhost-user socket is served by a live process already.
    #[error("vhost-user socket {path} is already in use by another backend")]
    SocketInUse {
        /// The socket.
        path: PathBuf,
    },
    /// The vhost-user socket could not be created.
    #[error("cannot listen on vhost-user socket {path}: {reason}")]
    Socket {
        /// The socket.
        path: PathBuf,
        /// The underlying error, as text.
        reason: String,
    },
    /// The vhost-user daemon could not be created or failed while serving.
    #[error("vhost-user-blk backend for {path} failed: {reason}")]
    Daemon {
        /// The image.
        path: PathBuf,
        /// The underlying error, as text (the daemon's error type is not `Sync`).
        reason: String,
    },
    /// The serving thread could not be started.
    #[error("cannot start the backend thread for {path}: {source}")]
    Thread {
        /// The image.
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The serving thread panicked (a bug: please report it with the log).
    #[error("the backend thread for {path} panicked")]
    Panicked {
        /// The image.
        path: PathBuf,
    },
    /// io_uring was asked for (`io=io_uring`) and this kernel or process cannot use it.
    #[error("cannot serve disk image {path} through io_uring ({reason}); use io=threads")]
    Uring {
        /// The image.
        path: PathBuf,
        /// What failed, with the kernel's error.
        reason: String,
    },
}
