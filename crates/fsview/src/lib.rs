//! vmsight-fsview: the disk crawler and index behind agentless file-update streaming
//! (DS-VMI / Gamma-Ray, issue 5).
//!
//! [`Index::crawl`] reads a raw disk image (optionally one partition of it, see
//! [`read_partitions`]) containing an ext2, ext3 or ext4 file system and builds a compact,
//! file-system-independent [`Index`]: inode metadata, the path tree, per-file block maps and a
//! map from every allocated block to its [`Owner`]. The index can be stored beside the image
//! ([`Index::to_bytes`], [`Index::save`]) and reloaded ([`Index::from_bytes`], [`Index::load`]).
//! [`Index::into_lazy`] keeps only its block → owner map in memory and loads the rest from a
//! private section file on demand (Gamma-Ray's lazy metadata loading), answering the same.
//!
//! [`Engine`] (module [`infer`]) follows the disk's write stream from there: it reverse-maps
//! each written block, parses the jbd2 journal, emits [`FsEvent`]s at commit time and serves the
//! last consistent version of the file system through [`FsRead`].
//!
//! Images are untrusted: every on-disk value is validated, loops are bounded and detected,
//! allocations are capped, and corruption is reported as an [`Error`] (or, in a lenient crawl,
//! as a [`Warning`] confined to one inode) — never as a panic.
//!
//! The ext4 format is parsed by hand rather than with a crate: the crawler needs the physical
//! location of every metadata structure (group descriptors, bitmaps, inode tables, extent-tree
//! and indirect blocks) to build the block→owner map, which read-only ext4 libraries such as
//! `ext4-view` do not expose, and hand-written parsing lets every bound be checked explicitly.

mod block;
mod crc;
mod error;
mod event;
mod ext4;
pub mod fuzzing;
mod index;
pub mod infer;
mod partition;
mod view;

pub use block::{BlockSource, FileSource, MemSource, Window};
pub use error::{Error, Result};
pub use event::{EventKind, FsEvent, Value};
pub use ext4::CrawlOptions;
pub use index::{
    DirEntry, FileExtent, FileKind, FsInfo, Index, IndexStats, InodeMeta, LazyConfig, LazyStats,
    Owner, Warning,
};
pub use infer::{Engine, EngineConfig, EngineStats, IndexCounters};
pub use partition::{
    guid_string, read_partitions, Partition, PartitionTable, PartitionType, Scheme,
};
pub use view::{FsRead, StaticView, ViewEntry};
