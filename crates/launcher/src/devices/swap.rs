//! The swap disk (`--swap`, docs/swapbypass.md): a vhost-user-blk disk whose pipeline ends in
//! the swap cache's stage, and, with `--symbiotic`, the cache's region as an `ivshmem-plain`
//! device for the guest module's bypass. The guest init formats and enables the swap (it finds
//! the disk by its serial, named on the kernel command line).

use std::path::PathBuf;
use std::sync::Arc;

use vmsight_blockdev::{spawn_backend_on, BackendHandle, Backing, BlockMetrics, DiskConfig};
use vmsight_proto::swap::SwapReport;

use super::blk::{self, QUEUE_SIZE};
use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::error::LaunchError;
use crate::stages::{self, DiskCtx, Sample, StageMetrics};
use crate::swap::{spec::SERIAL, SwapService};

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "swap",
    start,
};

/// QEMU's ids of the region's memory backend and device.
const MEM_ID: &str = "swapmem";
const REGION_ID: &str = "swapregion";
/// Queues of the swap disk (the guest swaps from any vCPU).
const QUEUES: u16 = 2;

/// The running swap disk.
pub struct SwapDevice {
    svc: Arc<SwapService>,
    index: usize,
    socket: PathBuf,
    handle: BackendHandle,
    metrics: Arc<BlockMetrics>,
    stages: Vec<(&'static str, Arc<dyn StageMetrics>)>,
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let Some(svc) = env.swap else {
        return Ok(Vec::new());
    };
    // After the root disk and the `--disk`s.
    let index = env.prep.disks.len();
    let socket = env.prep.rt.paths().disk_socket(index);
    let path = svc.path().to_owned();
    let capacity = svc.spec().size;
    let ctx = DiskCtx {
        index,
        path: &path,
        read_only: false,
        capacity_bytes: capacity,
        cfg: env.cfg,
        options: env
            .cfg
            .stages
            .iter()
            .find(|r| r.name == stages::diskmodel::ENTRY.name)
            .map(|r| r.options.as_str()),
        insight: None,
        stream: None,
        dedup: None,
        idle: None,
    };
    // Only the disk model applies to the swap disk (the HDD baseline of the benchmarks): the
    // cache, classifier, tap and idle stages are about file systems.
    let model = (stages::diskmodel::ENTRY.build)(&ctx)?;
    let stage = vmsight_swap::SwapStage::start(svc.store().clone()).map_err(|source| {
        LaunchError::Swap {
            vm: env.cfg.name.clone(),
            source,
        }
    })?;
    let (mut list, mut metrics) = (Vec::new(), Vec::new());
    if let Some(m) = model {
        if let Some(h) = m.metrics {
            metrics.push((stages::diskmodel::ENTRY.name, h));
        }
        list.push(m.stage);
    }
    let backend = spawn_backend_on(
        DiskConfig {
            path: path.clone(),
            read_only: false,
            serial: SERIAL.into(),
            num_queues: QUEUES,
            queue_size: QUEUE_SIZE,
            direct_io: false,
            io_threads: 1,
            io_engine: vmsight_blockdev::IoEngine::Threads,
        },
        &socket,
        Backing::Stage {
            terminal: Box::new(stage),
            capacity_bytes: capacity,
        },
        list,
    )
    .map_err(|source| LaunchError::Backend {
        index,
        path: path.clone(),
        source,
    })?;
    Ok(vec![Box::new(SwapDevice {
        svc: svc.clone(),
        index,
        socket,
        metrics: backend.metrics(),
        handle: backend,
        stages: metrics,
    })])
}

impl Device for SwapDevice {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        format!("disk{}", self.index)
    }

    fn qemu_args(&self) -> Vec<String> {
        let mut a = blk::qemu_args(self.index, &self.socket, QUEUES, QUEUE_SIZE);
        if self.svc.shared() {
            let region = self.svc.store().region();
            a.extend([
                "-object".into(),
                format!(
                    "memory-backend-file,id={MEM_ID},mem-path={},size={},share=on",
                    region.qemu_path().display(),
                    region.layout().region_size
                ),
                "-device".into(),
                format!("ivshmem-plain,id={REGION_ID},memdev={MEM_ID}"),
            ]);
        }
        a.extend(self.svc.mem_qemu_args());
        a
    }

    fn kernel_args(&self) -> Vec<String> {
        let mut a = vec![format!("vmsight.swap={SERIAL}")];
        if self.svc.spec().grow > 0 {
            a.push(crate::swap::mem::KERNEL_ARG.into());
        }
        a
    }

    fn stopped(&self) -> Option<String> {
        self.handle.is_finished().then(|| {
            format!(
                "the backend of the swap disk {} stopped",
                self.svc.path().display()
            )
        })
    }

    fn metrics(&self) -> DeviceMetrics {
        let svc = self.svc.clone();
        let m = self.metrics.clone();
        let capacity = svc.spec().size;
        DeviceMetrics {
            kind: ENTRY.kind,
            id: self.id(),
            disk: Some(self.index),
            samples: Arc::new(move || {
                let mut v = blk::block_samples(&m, capacity);
                v.extend(samples(&svc.report()));
                v
            }),
            stages: self.stages.clone(),
        }
    }

    fn finish(self: Box<Self>) -> DeviceReport {
        let error = blk::backend_error(self.handle, self.svc.path());
        let report = self.svc.report();
        self.svc.shutdown();
        let ds = blk::disk_stats(self.svc.path().to_owned(), &self.metrics, &self.stages);
        DeviceReport {
            disk: Some(ds),
            swap: Some(report),
            error,
            ..DeviceReport::default()
        }
    }
}

/// The swap counters as metric samples (names in docs/metrics.md).
fn samples(r: &SwapReport) -> Vec<Sample> {
    let c = |name: &'static str, help: &'static str, v: u64| Sample::counter(name, help, v);
    let g = |name: &'static str, help: &'static str, v: u64| Sample::gauge(name, help, v);
    let mut v = vec![
        g(
            "swap_cache_limit_pages",
            "Swap cache size granted, pages.",
            r.cache_limit_pages,
        ),
        g(
            "swap_cache_used_pages",
            "Pages in the swap cache.",
            r.cache_used_pages,
        ),
        g(
            "swap_cache_resident_bytes",
            "Host memory held by the swap cache.",
            r.cache_resident_bytes,
        ),
        g(
            "swap_bypass_active",
            "1 when the guest module bypasses the swap disk.",
            u64::from(r.bypass_active),
        ),
        c(
            "swap_evictions_total",
            "Pages moved from the swap cache to the swap file.",
            r.evictions,
        ),
        c(
            "swap_lock_timeouts_total",
            "Swap requests failed on a lock the guest held too long.",
            r.lock_timeouts,
        ),
    ];
    for (path, n) in [("block", r.block_reads), ("bypass", r.bypass_loads)] {
        v.push(c("swap_in_pages_total", "Pages swapped in, by path.", n).with("path", path));
    }
    for (path, n) in [("block", r.block_writes), ("bypass", r.bypass_stores)] {
        v.push(c("swap_out_pages_total", "Pages swapped out, by path.", n).with("path", path));
    }
    for (src, n) in [
        ("cache", r.cache_hits + r.bypass_loads),
        ("file", r.cache_misses),
    ] {
        v.push(
            c(
                "swap_in_served_total",
                "Pages swapped in, by where they came from.",
                n,
            )
            .with("from", src),
        );
    }
    if let (Some(i), Some(o)) = (r.guest_pswpin, r.guest_pswpout) {
        v.push(g(
            "swap_guest_pswpin",
            "The guest's own pswpin (SymSpy).",
            i,
        ));
        v.push(g(
            "swap_guest_pswpout",
            "The guest's own pswpout (SymSpy).",
            o,
        ));
    }
    if let Some(m) = &r.mem {
        v.push(g(
            "swap_mem_plugged_bytes",
            "Guest memory vmsight added (virtio-mem).",
            m.plugged_bytes,
        ));
        v.push(c(
            "swap_mem_added_bytes_total",
            "Guest memory added over the run.",
            m.added_bytes,
        ));
        v.push(c(
            "swap_mem_removed_bytes_total",
            "Guest memory removed over the run.",
            m.removed_bytes,
        ));
    }
    v
}
