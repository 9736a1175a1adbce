//! Errors of the crawler and the index.

use thiserror::Error;

/// Everything that can go wrong while reading a disk image, crawling it or loading an index.
///
/// Disk images are untrusted input: every inconsistency found on disk is reported as one of these
/// errors (or, for damage confined to one file, as a [`crate::Warning`] during a lenient crawl),
/// never as a panic.
#[derive(Debug, Error)]
pub enum Error {
    /// The underlying file or device could not be read.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A read went past the end of the device or partition.
    #[error("read of {len} bytes at offset {offset} goes past the end of the device ({device_len} bytes); the image may be truncated")]
    OutOfBounds {
        /// Byte offset of the read.
        offset: u64,
        /// Length of the read.
        len: u64,
        /// Length of the device.
        device_len: u64,
    },
    /// The partition table is malformed.
    #[error("the partition table is invalid: {0}")]
    Partition(String),
    /// The requested partition does not exist.
    #[error("partition {index} does not exist (the disk has {count} partitions)")]
    NoSuchPartition {
        /// Requested partition index (1-based).
        index: usize,
        /// Partitions found.
        count: usize,
    },
    /// No ext2/3/4 superblock magic was found.
    #[error("no ext2/ext3/ext4 file system found: the superblock magic is {found:#06x}, expected 0xef53")]
    BadMagic {
        /// The magic that was read.
        found: u16,
    },
    /// The superblock is inconsistent or uses unsupported features.
    #[error("the superblock is invalid: {0}")]
    Superblock(String),
    /// A group descriptor is inconsistent.
    #[error("group descriptor {group} is invalid: {reason}")]
    GroupDescriptor {
        /// Block group number.
        group: u32,
        /// What is wrong.
        reason: String,
    },
    /// An inode is corrupt (bad extent tree, block map, directory, inline data, ...).
    #[error("inode {ino} is corrupt: {reason}")]
    Inode {
        /// Inode number.
        ino: u32,
        /// What is wrong.
        reason: String,
    },
    /// The directory tree is inconsistent (loops, dangling entries).
    #[error("the directory tree is inconsistent: {0}")]
    DirectoryTree(String),
    /// A configured resource limit was reached.
    #[error("limit exceeded: {0}")]
    Limit(String),
    /// A stored index could not be decoded.
    #[error("the stored index is invalid: {0}")]
    IndexFormat(String),
    /// The section file of a lazy index is damaged or not one.
    #[error("the lazy index file {} is invalid: {reason}", path.display())]
    LazyIndex {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Shorthand result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn inode(ino: u32, reason: impl Into<String>) -> Self {
        Error::Inode {
            ino,
            reason: reason.into(),
        }
    }
}
