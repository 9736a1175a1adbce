//! Storage insights (Sky §3.3–3.6): the insight engine follows the syscalls of monitored
//! processes (fd tables, file sizes, buffer checksums, patterns, application hints) and the
//! classifier stage matches each virtio-blk request against what the engine knows.
//!
//! ```text
//! plugin (SUMS records) -> trace thread -> InsightEngine (SyscallObserver)
//!                                              ^  Arc<Mutex<Engine>>, short critical sections
//! virtqueue -> Classifier (Stage) -------------+-> RequestInsight on the request -> next stage
//!                         \-> insight log writer thread (JSON lines, --insights FILE)
//! ```
//!
//! Copies without a user buffer (`copy_file_range`, `sendfile`, `splice`) are followed down to
//! the source's block reads through a [`FileBlocks`] resolver (the launcher's, over each
//! disk's file-system index).
//!
//! What the engine did not see (the working directory of a process traced from its middle, an
//! inherited fd) it asks a [`Lookup`] (the launcher's reads guest kernel memory), once.
//! Block-write chunks no checksum matched (io_uring, shared file mappings, bytes beyond the
//! plugin's cap) are classified by what the guest kernel says owns their pages
//! ([`PageOwnerSource`]).

pub mod blocks;
pub mod classifier;
pub mod config;
pub mod engine;
pub mod fuzzing;
pub mod hint;
pub mod log;
pub mod lookup;
pub mod pages;

pub use blocks::{DiskRange, FileBlocks, WHOLE_FILE};
pub use classifier::Classifier;
pub use config::{ConfigError, InsightConfig, SizeClasses};
pub use engine::{ClassCounters, Engine, InsightEngine, Tally};
pub use hint::{hint_of, VMSIGHT_HINT_MAGIC};
pub use log::InsightLog;
pub use lookup::{FdFacts, Lookup, LookupSource, TaskFacts};
pub use pages::{PageOwner, PageOwnerSource};

/// Bytes per checksum chunk (Sky §3.4).
pub const CHUNK: u64 = 4096;
