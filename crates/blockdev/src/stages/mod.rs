//! Pipeline stages shipped with the block backend.
//!
//! * [`cache`]: the iCache, a read/write block cache in host RAM with a plain LRU policy (the
//!   bcache-without-hints baseline) or Sky's priority policy (evict the lowest I/O class first).
//! * [`diskmodel`]: delays requests so the fast host disk behaves like an HDD or a SATA SSD;
//!   goes below the cache, just above the raw file.
//!
//! Each constructor returns the stage and an `Arc` of its live counters, kept apart from
//! [`crate::BlockMetrics`] so the launcher can report them separately (see docs/icache.md).

pub mod cache;
pub mod diskmodel;
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
pub use order::FlushOrder;
