//! Hylics' shared in-memory file system of a running VM: what `vmsight run --shared-mem`
//! writes to `hylics.json`, what `vmsight hylics NAME path|info|resize` reads and what the
//! control socket answers after a resize.

use serde::{Deserialize, Serialize};

/// The VM's share: a host tmpfs served to the guest through virtio-fs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareInfo {
    /// The host directory (the tmpfs mount point) host-side tools read and write.
    pub host_path: String,
    /// Where the guest mounts it.
    pub guest_path: String,
    /// The virtio-fs tag the guest mounts.
    pub tag: String,
    /// The tmpfs size limit, bytes.
    pub size_bytes: u64,
    /// Bytes in use when this was written (tmpfs blocks).
    pub used_bytes: u64,
    /// Files and directories in use (inodes).
    pub files: u64,
    /// virtiofsd's cache mode (`auto`, `always`, `never`, `metadata`).
    pub cache: String,
    /// Resizes since the VM started.
    pub resizes: u64,
}
