//! Errors of dedup volumes: each names the volume (its directory) and says what failed.

use std::io;
use std::path::PathBuf;

/// Why a volume operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// A system call on one of the volume's files failed.
    #[error("dedup volume {path}: {op} failed: {source}")]
    Io {
        /// The volume directory.
        path: PathBuf,
        /// What was attempted ("reading the metadata file", "fdatasync of the data file", ...).
        op: String,
        #[source]
        source: io::Error,
    },
    /// The directory holds no volume (no metadata file, or not ours).
    #[error("{path} is not a vmsight dedup volume: {reason}")]
    NotVolume {
        /// The path given.
        path: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },
    /// The metadata contradicts itself or the files (a corrupt or truncated metadata file).
    #[error("dedup volume {path} is corrupt: {reason}")]
    Corrupt {
        /// The volume directory.
        path: PathBuf,
        /// What is inconsistent.
        reason: String,
    },
    /// Another process (a running VM, another `vmsight dedup`) has the volume open.
    #[error(
        "dedup volume {path} is in use by another process (a running VM or vmsight dedup command)"
    )]
    InUse {
        /// The volume directory.
        path: PathBuf,
    },
    /// No free physical chunk or hash-index slot is left, even after garbage collection.
    #[error("dedup volume {path} is full: {what}")]
    Full {
        /// The volume directory.
        path: PathBuf,
        /// What ran out.
        what: &'static str,
    },
    /// `dedup create` was asked for something impossible.
    #[error("cannot create dedup volume {path}: {reason}")]
    Create {
        /// The volume directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A request lies outside the volume.
    #[error("dedup volume {path}: bytes {offset}..{end} lie outside the volume of {size} bytes")]
    OutOfRange {
        /// The volume directory.
        path: PathBuf,
        /// First byte.
        offset: u64,
        /// End of the range.
        end: u64,
        /// Logical size.
        size: u64,
    },
    /// The volume's worker thread is gone (the backend stopped).
    #[error("dedup volume {path}: the volume's worker has stopped")]
    Stopped {
        /// The volume directory.
        path: PathBuf,
    },
}

/// Result of volume operations.
pub type Result<T> = std::result::Result<T, DedupError>;
