//! Deduplicated volumes for vmsight (iDedup, Sky §8).
//!
//! A volume is a directory with a data file of 4 KiB chunks and a metadata file in the spirit
//! of dm-dedup's copy-on-write backend: a logical → physical map, a hash → chunk index,
//! reference counts and a free-chunk allocator, changed atomically through a journal
//! ([`format`], [`meta`]). [`Volume`] is the engine; [`DedupStage`] serves it as the last
//! stage of a disk's block pipeline on its own thread; [`DedupHints`] turns the insight
//! engine's copy hints into hint-cache entries, and unique hints on writes skip the index.
//! The metadata goes through a bounded buffer cache, and a disk model charges data and
//! metadata I/O alike, so the unhinted volume pays the random index I/O dm-dedup pays.
//! docs/dedup.md describes the design, the format, the guarantees and the limits.

pub mod check;
pub mod disk;
pub mod error;
pub mod format;
pub mod fuzzing;
pub mod hints;
pub mod meta;
pub mod stage;
pub mod volume;

pub use check::CheckReport;
pub use error::{DedupError, Result};
pub use hints::{DedupHints, Hints};
pub use stage::{DedupHandle, DedupSnapshot, DedupStage};
pub use volume::{parse_size, MetaCache, Volume, VolumeCounters, VolumeInfo, VolumeOptions};

#[cfg(test)]
mod tests;
