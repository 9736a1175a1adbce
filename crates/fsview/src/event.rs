//! File-system events inferred from the virtual disk's write stream (the output of the
//! inference engine, the payload of every transport). The JSON form is documented in
//! docs/filestream.md ("Message schema"); transports add the `host`/`vm` address and a
//! per-VM sequence number around it.

use serde::{Deserialize, Serialize};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// A regular file (or device node, fifo, socket) appeared.
    Create,
    /// A directory appeared.
    Mkdir,
    /// A symbolic link appeared (`new` holds the target).
    Symlink,
    /// Another name for an existing inode appeared (`old_path` is an existing name).
    Link,
    /// A non-directory name disappeared.
    Delete,
    /// A directory disappeared.
    Rmdir,
    /// A name moved (`old_path` → `path`), possibly across directories.
    Rename,
    /// The size shrank.
    Truncate,
    /// The size grew.
    Extend,
    /// Permission bits changed.
    Chmod,
    /// Owner or group changed.
    Chown,
    /// The modification time changed.
    Mtime,
    /// File data was written (`range`, and `data` when requested).
    Write,
}

/// An old or new value carried by an event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Value {
    /// Permission and type bits (`st_mode`).
    Mode(u16),
    /// Owner and group.
    Owner {
        /// User id.
        uid: u32,
        /// Group id.
        gid: u32,
    },
    /// Size in bytes.
    Size(u64),
    /// Seconds since the epoch.
    Time(i64),
    /// Symlink target.
    Target(String),
}

/// One inferred file-system event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    /// What happened.
    #[serde(rename = "type")]
    pub kind: EventKind,
    /// Absolute guest path (the new name for a rename).
    pub path: String,
    /// Previous name (rename) or the existing name (link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_path: Option<String>,
    /// Guest inode number.
    pub ino: u32,
    /// Value before the change, where meaningful.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old: Option<Value>,
    /// Value after the change, where meaningful.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new: Option<Value>,
    /// Written byte range `[start, end)` in the file (`Write`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<(u64, u64)>,
    /// Written bytes (`Write`, only when data delivery is enabled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Vec<u8>>,
    /// jbd2 transaction that carried the metadata change, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub txn: Option<u32>,
    /// Host wall-clock time (ns since the epoch) at which the block write that revealed the
    /// event completed.
    pub observed_ns: u64,
}
