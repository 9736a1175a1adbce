//! SwapBypass (`--swap`, docs/swapbypass.md): the VM's swap disk, served by vmsight from a
//! swap cache in host memory (vmsight_swap's store, resizable while the VM runs, spilling to
//! the swap file), shared with the symbiotic guest module when `--symbiotic` is on so the
//! guest swaps in and out of it without block I/O.
//!
//! This module owns the service: the swap file, the store and its evictor, the report. The
//! device registry's `swap` entry (`devices/swap.rs`) serves the disk and the region to QEMU;
//! the control socket resizes the cache (`vmsight swap NAME cache SIZE`).

pub mod mem;
pub mod spec;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use vmsight_proto::swap::{MemReport, SwapReport};
use vmsight_proto::sym::swapr::{self, Layout, PAGE};
use vmsight_swap::{Evictor, SwapError, SwapStore};

use crate::error::LaunchError;
pub use spec::{SwapSpec, SwapSpecError};

/// The VM's swap service.
pub struct SwapService {
    vm: String,
    spec: SwapSpec,
    path: PathBuf,
    /// The file was created for this run (removed at the end).
    owned_file: bool,
    store: Arc<SwapStore>,
    evictor: Mutex<Option<Evictor>>,
    /// The region is offered to the guest module (`--symbiotic`).
    shared: bool,
    sym: Option<Arc<crate::sym::Symbiotic>>,
    /// The QMP monitor the virtio-mem controller drives (`grow=`).
    qmp: PathBuf,
    mem: Mutex<Option<mem::MemController>>,
    /// The controller's report (kept apart so reporting never waits for the controller).
    mem_report: Mutex<Option<Arc<Mutex<MemReport>>>>,
}

impl std::fmt::Debug for SwapService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapService")
            .field("vm", &self.vm)
            .field("spec", &self.spec)
            .finish()
    }
}

impl SwapService {
    /// Creates the swap file (`dir/swap.img` unless the spec names one), the store with its
    /// region, and starts the evictor.
    pub fn create(
        vm: &str,
        spec: &SwapSpec,
        dir: &Path,
        rt: &Path,
        sym: Option<Arc<crate::sym::Symbiotic>>,
    ) -> Result<Self, LaunchError> {
        let err = |source| LaunchError::Swap {
            vm: vm.to_owned(),
            source,
        };
        let (path, owned_file) = match &spec.file {
            Some(p) => (p.clone(), false),
            None => (dir.join("swap.img"), true),
        };
        let file = open_swap_file(&path, spec.size).map_err(err)?;
        let pages = spec.size / PAGE;
        let layout = Layout::new(pages, (spec.max_cache / PAGE).max(1))
            .ok_or(err(SwapError::Size { bytes: spec.size }))?;
        let cache_pages = (spec.cache / PAGE).min(layout.slots);
        let store = Arc::new(SwapStore::new(vm, file, layout, cache_pages).map_err(err)?);
        let evictor = Evictor::start(store.clone()).map_err(err)?;
        Ok(Self {
            vm: vm.to_owned(),
            spec: spec.clone(),
            path,
            owned_file,
            store,
            evictor: Mutex::new(Some(evictor)),
            shared: sym.is_some(),
            sym,
            qmp: rt.join("swap-qmp.sock"),
            mem: Mutex::new(None),
            mem_report: Mutex::new(None),
        })
    }

    /// Starts the virtio-mem controller when `grow=` allows adding memory; it waits for QEMU
    /// on its own QMP monitor.
    pub fn start_mem(self: &Arc<Self>) -> Result<(), LaunchError> {
        if self.spec.grow == 0 {
            return Ok(());
        }
        let weak: Weak<SwapService> = Arc::downgrade(self);
        let source: mem::Source = Box::new(move || {
            weak.upgrade()
                .map(|s| s.report_without_mem())
                .unwrap_or_default()
        });
        let c =
            mem::MemController::start(self.spec.grow, self.qmp.clone(), source).map_err(|e| {
                LaunchError::Swap {
                    vm: self.vm.clone(),
                    source: SwapError::Thread(e),
                }
            })?;
        *self
            .mem_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(c.shared_report());
        *self.mem.lock().unwrap_or_else(PoisonError::into_inner) = Some(c);
        Ok(())
    }

    /// QEMU's arguments for the virtio-mem device and its monitor (empty without `grow=`).
    pub fn mem_qemu_args(&self) -> Vec<String> {
        if self.spec.grow == 0 {
            return Vec::new();
        }
        mem::qemu_args(self.spec.grow, &self.qmp)
    }

    pub fn spec(&self) -> &SwapSpec {
        &self.spec
    }

    pub fn store(&self) -> &Arc<SwapStore> {
        &self.store
    }

    /// The swap file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the region is shared with the guest module.
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// Resizes the cache to `bytes` (rounded down to pages); the evictor moves pages to the
    /// swap file and gives memory back when it shrinks.
    /// Up to `max-cache` is accepted; the region's metadata leaves slightly fewer slots than
    /// `max-cache` pages, so a size near it is clamped to the slots there are.
    pub fn set_cache(&self, bytes: u64) -> Result<(), LaunchError> {
        let pages = if bytes <= self.spec.max_cache {
            (bytes / PAGE).min(self.store.layout().slots)
        } else {
            bytes / PAGE
        };
        self.store
            .set_target(pages)
            .map_err(|source| LaunchError::Swap {
                vm: self.vm.clone(),
                source,
            })
    }

    /// The report: vmsight's counters, the guest module's (from the region) and the guest's
    /// own swap counters (SymSpy, when the module is there).
    pub fn report(&self) -> SwapReport {
        let mut r = self.report_without_mem();
        r.mem = self
            .mem_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner).clone());
        r
    }

    fn report_without_mem(&self) -> SwapReport {
        let s = &self.store;
        let c = &s.counters;
        let g = |name: &str| s.region().hdr64(name).load(Ordering::Relaxed);
        let (free, used) = s.occupancy();
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut r = SwapReport {
            swap_bytes: self.spec.size,
            file: self.path.clone(),
            bypass_offered: self.shared,
            bypass_active: self.shared
                && s.region().hdr32("guest_state").load(Ordering::Relaxed) == swapr::GUEST_ACTIVE,
            cache_limit_pages: s.target(),
            cache_max_pages: s.layout().slots,
            cache_used_pages: used,
            cache_free_pages: free,
            cache_resident_bytes: s.region().resident_bytes(),
            block_reads: ld(&c.block_reads),
            block_writes: ld(&c.block_writes),
            cache_hits: ld(&c.cache_hits),
            cache_misses: ld(&c.cache_misses),
            cache_inserts: ld(&c.cache_inserts),
            write_through: ld(&c.write_through),
            discards: ld(&c.discards),
            evictions: ld(&c.evicted),
            evict_failures: ld(&c.evict_failures),
            punched: ld(&c.punched),
            lock_timeouts: ld(&c.lock_timeouts),
            corrupt: ld(&c.corrupt),
            ..SwapReport::default()
        };
        if self.shared {
            r.bypass_stores = g("g_stores");
            r.bypass_store_full = g("g_store_full");
            r.bypass_loads = g("g_loads");
            r.bypass_load_misses = g("g_load_misses");
            r.bypass_invalidates = g("g_invalidates");
            r.bypass_busy = g("g_busy");
            r.bypass_lower_reads = g("g_lower_reads");
            r.bypass_lower_writes = g("g_lower_writes");
            r.bypass_corrupt = g("g_corrupt");
            r.bypass_deferred = g("g_deferred");
        }
        if let Some(spy) = self.sym.as_ref().and_then(|s| s.spy().guest) {
            r.guest_pswpin = Some(spy.mem.pswpin);
            r.guest_pswpout = Some(spy.mem.pswpout);
            r.guest_swap_used_kib =
                Some(spy.mem.swap_total_kib.saturating_sub(spy.mem.swap_free_kib));
            r.guest_mem_available_kib = Some(spy.mem.mem_available_kib);
            // The guest's swap on vmsight's disk: the bypass device, or the disk itself
            // (whose name vmsight cannot know; it is the one of the swap disk's size).
            r.guest_swap_device = spy
                .swaps
                .iter()
                .find(|d| d.path == "/dev/vmswap0")
                .or_else(|| {
                    spy.swaps
                        .iter()
                        .find(|d| d.blockdev && d.size_kib + 4 == self.spec.size >> 10)
                })
                .cloned();
        }
        r.with_hit_rate()
    }

    /// Stops the evictor and tells the guest module vmsight is gone (after QEMU exited).
    pub fn shutdown(&self) {
        // Taken out first and dropped (joined) outside the lock: its thread may be reading
        // the report.
        let mem = self
            .mem
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(mem);
        drop(
            self.evictor
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        self.store.close();
    }
}

impl Drop for SwapService {
    fn drop(&mut self) {
        self.shutdown();
        if self.owned_file {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Opens (creating) the swap file with `size` bytes, sparse; an existing file is truncated
/// to nothing first (swap contents never outlive a run).
fn open_swap_file(path: &Path, size: u64) -> Result<std::fs::File, SwapError> {
    let err = |source| SwapError::File {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(err)?;
    f.set_len(size).map_err(err)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_makes_a_sparse_swap_file_reports_and_removes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec: SwapSpec = "8M,cache=1M".parse().expect("spec");
        let svc = SwapService::create("t", &spec, dir.path(), dir.path(), None).expect("service");
        let path = svc.path().to_owned();
        assert_eq!(std::fs::metadata(&path).expect("file").len(), 8 << 20);
        svc.store().write(3, &[9u8; 4096]).expect("write");
        let r = svc.report();
        assert_eq!(r.swap_bytes, 8 << 20);
        assert_eq!(r.cache_limit_pages, 256);
        assert_eq!(r.cache_used_pages, 1);
        assert_eq!(r.block_writes, 1);
        assert!(!r.bypass_offered && !r.bypass_active);
        svc.set_cache(0).expect("resize");
        assert!(svc.set_cache(1 << 40).is_err());
        drop(svc);
        assert!(!path.exists(), "the run's swap file is removed");
    }
}
