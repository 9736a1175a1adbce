//! Errors of the network device, each naming what it is about (the interface, the socket,
//! the namespace).

use std::path::PathBuf;

/// Why a network device could not be set up or ended.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("bad interface name {name:?}: 1 to 15 letters, digits, '-', '_' or '.'")]
    BadIfname { name: String },
    #[error("tap {name}: {op} failed: {source}")]
    Tap {
        name: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot enter network namespace {}: {source}", path.display())]
    Netns {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("vhost-user-net socket {}: {reason}", path.display())]
    Socket { path: PathBuf, reason: String },
    #[error("vhost-user-net socket {} is in use by a running backend", path.display())]
    SocketInUse { path: PathBuf },
    #[error("vhost-user-net backend on {}: {reason}", path.display())]
    Daemon { path: PathBuf, reason: String },
    #[error("cannot start a network device thread: {source}")]
    Thread {
        #[source]
        source: std::io::Error,
    },
    #[error("a network device thread panicked")]
    Panicked,
}
