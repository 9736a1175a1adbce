//! Pipeline stages shipped with the block backend.
//!
//! * [`cache`]: the iCache, a read/write block cache in host RAM with a plain LRU policy (the
//!   bcache-without-hints baseline) or Sky's priority policy (evict the lowest I/O class first).
//! * [`diskmodel`]: delays requests so the fast host disk behaves like an HDD or a SATA SSD;
//!   goes below the cache, just above the raw file.
//! * [`idle`]: FoxyIdle, an idle-time scheduler that holds background processes' reads while
//!   the foreground uses the disk (preemption intervals); goes above the cache and the disk
//!   model.
//!
//! Each constructor returns the stage and an `Arc` of its live counters, kept apart from
//! [`crate::BlockMetrics`] so the launcher can report them separately (see docs/icache.md).

pub mod cache;
pub mod diskmodel;
pub mod idle;
#[cfg(test)]
pub(crate) mod memdisk;
pub mod order;

pub use cache::{
    CacheConfig, CacheConfigError, CacheMetrics, CacheMode, CachePolicy, CacheSnapshot, ICache,
};
pub use diskmodel::{
    DiskModel, DiskModelConfig, DiskModelError, DiskModelMetrics, DiskModelSnapshot, HddParams,
    ModelClock, SsdParams,
};
pub use idle::{
    Attribution, IdleConfig, IdleError, IdleMetrics, IdleScheduler, IdleSnapshot, Owner, Verdict,
};
pub use order::FlushOrder;
