//! SwapBypass's report (`vmsight swap NAME status`, `--stats-json` key `swap`, the control
//! socket): the swap disk, its cache in host memory, the guest module's bypass and the
//! guest's own swap counters, and the memory vmsight added to the guest.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// State and counters of a VM's swap disk and cache. Pages are 4 KiB.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SwapReport {
    /// Size of the swap disk, bytes.
    pub swap_bytes: u64,
    /// The swap file behind the cache.
    pub file: PathBuf,
    /// The cache is shared with the guest (`--symbiotic`): the module can bypass the disk.
    pub bypass_offered: bool,
    /// The guest module's bypass device is up.
    pub bypass_active: bool,
    /// Cache size granted, in pages (`cache=`, `vmsight swap NAME cache SIZE`).
    pub cache_limit_pages: u64,
    /// The most pages the cache can ever hold (the region's slots).
    pub cache_max_pages: u64,
    /// Pages in the cache now.
    pub cache_used_pages: u64,
    /// Free slots the guest may store into now.
    pub cache_free_pages: u64,
    /// Host memory the cache's region holds now, bytes.
    pub cache_resident_bytes: u64,
    /// Block requests' pages on the swap disk (the guest's disk path).
    pub block_reads: u64,
    pub block_writes: u64,
    /// Block reads served from the cache / from the swap file.
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Block writes stored in the cache / written to the swap file (cache full).
    pub cache_inserts: u64,
    pub write_through: u64,
    pub discards: u64,
    /// Pages moved from the cache to the swap file (resize, keeping free slots).
    pub evictions: u64,
    pub evict_failures: u64,
    /// Slot pages whose memory was given back to the host.
    pub punched: u64,
    /// Block requests failed because the guest held the region's lock too long.
    pub lock_timeouts: u64,
    /// Inconsistent region contents vmsight met (only a misbehaving guest causes them).
    pub corrupt: u64,
    /// The guest module's counters (read from the region: reported, not trusted): pages
    /// stored into and loaded from the cache, stores refused (no free slot), loads that
    /// missed, slots freed, lock waits given up, pages sent to the disk path instead, and
    /// freed pages whose slot was let go later because the lock was busy at the free.
    pub bypass_stores: u64,
    pub bypass_store_full: u64,
    pub bypass_loads: u64,
    pub bypass_load_misses: u64,
    pub bypass_invalidates: u64,
    pub bypass_busy: u64,
    pub bypass_lower_reads: u64,
    pub bypass_lower_writes: u64,
    pub bypass_corrupt: u64,
    pub bypass_deferred: u64,
    /// Swap-ins served from memory (bypass loads and block-path cache hits) over all swap-ins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<f64>,
    /// The guest's own `/proc/vmstat` pswpin/pswpout and swap in use, from SymSpy (absent
    /// without the symbiotic module).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_pswpin: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_pswpout: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_swap_used_kib: Option<u64>,
    /// The guest's swap device on vmsight's swap disk as the guest kernel lists it (SymSpy):
    /// its path, swap type (the index in the guest's swap entries), priority and use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_swap_device: Option<crate::sym::SwapDevice>,
    /// The guest's MemAvailable (SymSpy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mem_available_kib: Option<u64>,
    /// Guest memory vmsight adds when the guest thrashes (virtio-mem), when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<MemReport>,
}

/// The virtio-mem device vmsight resizes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemReport {
    /// The most vmsight may add, bytes (`grow=`).
    pub max_bytes: u64,
    /// What vmsight asks the guest to have plugged now, bytes.
    pub requested_bytes: u64,
    /// What the guest has plugged now (QEMU's `size` property), bytes.
    pub plugged_bytes: u64,
    /// Bytes added and removed over the run, and how many times.
    pub added_bytes: u64,
    pub removed_bytes: u64,
    pub grows: u64,
    pub shrinks: u64,
}

impl SwapReport {
    /// Fills [`SwapReport::hit_rate`] from the counters.
    pub fn with_hit_rate(mut self) -> Self {
        let hits = self.bypass_loads + self.cache_hits;
        let all = self.bypass_loads + self.block_reads;
        self.hit_rate = (all > 0).then(|| hits as f64 / all as f64);
        self
    }

    /// One line for `--stats` and `vmsight swap NAME status`.
    pub fn summary(&self) -> String {
        let mib = |p: u64| (p * 4096) >> 20;
        let mut s = format!(
            "swap {} MiB: cache {}/{} MiB used ({} MiB resident, max {} MiB), bypass {}; \
             block reads {} (cache hits {}), block writes {} (cached {}), evicted {}; \
             bypass stores {} (full {}), loads {} (misses {})",
            self.swap_bytes >> 20,
            mib(self.cache_used_pages),
            mib(self.cache_limit_pages),
            self.cache_resident_bytes >> 20,
            mib(self.cache_max_pages),
            match (self.bypass_offered, self.bypass_active) {
                (_, true) => "active",
                (true, false) => "offered, not in use",
                (false, false) => "off",
            },
            self.block_reads,
            self.cache_hits,
            self.block_writes,
            self.cache_inserts,
            self.evictions,
            self.bypass_stores,
            self.bypass_store_full,
            self.bypass_loads,
            self.bypass_load_misses,
        );
        if let Some(h) = self.hit_rate {
            s.push_str(&format!(", hit rate {:.1} %", h * 100.0));
        }
        if let (Some(i), Some(o)) = (self.guest_pswpin, self.guest_pswpout) {
            s.push_str(&format!("; guest pswpin {i} pswpout {o}"));
        }
        if let Some(d) = &self.guest_swap_device {
            s.push_str(&format!(
                "; guest swaps on {} (swap type {}, priority {}, {} KiB used)",
                d.path, d.kind, d.prio, d.used_kib
            ));
        }
        if let Some(m) = &self.mem {
            s.push_str(&format!(
                "; memory added {} MiB now (max {} MiB, {} grows, {} shrinks)",
                m.plugged_bytes >> 20,
                m.max_bytes >> 20,
                m.grows,
                m.shrinks
            ));
        }
        s
    }
}
