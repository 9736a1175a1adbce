//! vhost-user-blk disks: one vmsight block backend per disk (root first), its pipeline built
//! from the stage registry.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vmsight_blockdev::{spawn_backend_on, BackendHandle, Backing, BlockMetrics, DiskConfig};
use vmsight_dedup::{DedupHandle, DedupStage, Volume, VolumeOptions};

use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::error::LaunchError;
use crate::qemu::chardev_socket;
use crate::stages::{self, DiskCtx, Sample, StageMetrics};

use crate::stats::DiskStats;
use crate::vm::prepare::DiskPlan;

/// Virtqueue size of every disk (QEMU's `queue-size`, the backend's `queue_size`).
pub const QUEUE_SIZE: u16 = 256;

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "vhost-user-blk",
    start,
};

/// QEMU's arguments for disk `index` served on `socket`.
pub fn qemu_args(index: usize, socket: &Path, num_queues: u16, queue_size: u16) -> Vec<String> {
    vec![
        "-chardev".into(),
        chardev_socket(&format!("disk{index}"), socket),
        "-device".into(),
        format!(
            "vhost-user-blk-pci,id=disk{index},chardev=disk{index},num-queues={num_queues},queue-size={queue_size}"
        ),
    ]
}

/// A disk being served.
pub struct BlkDevice {
    plan: DiskPlan,
    socket: std::path::PathBuf,
    handle: BackendHandle,
    metrics: Arc<BlockMetrics>,
    stages: Vec<(&'static str, Arc<dyn StageMetrics>)>,
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    env.prep
        .disks
        .iter()
        .map(|d| start_disk(env, d).map(|b| Box::new(b) as Box<dyn Device>))
        .collect()
}

fn start_disk(env: &DeviceEnv<'_>, d: &DiskPlan) -> Result<BlkDevice, LaunchError> {
    let socket = env.prep.rt.paths().disk_socket(d.index);
    let mut ctx = DiskCtx {
        index: d.index,
        path: &d.path,
        read_only: d.read_only,
        capacity_bytes: std::fs::metadata(&d.path).map(|m| m.len()).unwrap_or(0),
        cfg: env.cfg,
        options: None,
        insight: env.insight,
        stream: env.streams.iter().find(|s| s.index == d.index),
        dedup: None,
        idle: env.idle,
    };
    let volume = match &d.dedup {
        Some(spec) => Some(open_volume(&ctx, spec, env.insight.is_some())?),
        None => None,
    };
    let (backing, handle) = match volume {
        Some((stage, handle)) => {
            ctx.capacity_bytes = handle.capacity_bytes();
            crate::disksource::register(&d.path, handle.clone());
            let backing = Backing::Stage {
                terminal: Box::new(stage),
                capacity_bytes: handle.capacity_bytes(),
            };
            (backing, Some(handle))
        }
        None => (Backing::Image, None),
    };
    ctx.dedup = handle.as_ref();
    let built = stages::assemble(&ctx, &env.cfg.stages)?;
    let backend = spawn_backend_on(
        DiskConfig {
            path: d.path.clone(),
            read_only: d.read_only,
            serial: d.serial.clone(),
            num_queues: d.num_queues,
            queue_size: QUEUE_SIZE,
            direct_io: d.direct || built.direct_io,
            io_threads: d.io_threads,
            io_engine: d.io_engine,
        },
        &socket,
        backing,
        built.stages,
    )
    .map_err(|source| LaunchError::Backend {
        index: d.index,
        path: d.path.clone(),
        source,
    })?;
    Ok(BlkDevice {
        plan: d.clone(),
        socket,
        metrics: backend.metrics(),
        handle: backend,
        stages: built.metrics,
    })
}

/// Opens the dedup volume of disk `ctx` as its pipeline's terminal, modelled like the disk
/// model stage would model the disk.
fn open_volume(
    ctx: &DiskCtx<'_>,
    spec: &crate::config::DedupSpec,
    insights: bool,
) -> Result<(DedupStage, DedupHandle), LaunchError> {
    let opts = VolumeOptions {
        meta_cache: spec.meta_cache,
        flush_every: spec.flush_every,
        model: stages::diskmodel::requested(ctx)?,
        hints: spec.hints && insights,
        ..VolumeOptions::default()
    };
    let volume = Volume::open(ctx.path, opts).map_err(|e| ctx.build_error("dedup", e))?;
    DedupStage::start(volume).map_err(|e| ctx.build_error("dedup", e))
}

impl Device for BlkDevice {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        format!("disk{}", self.plan.index)
    }

    fn qemu_args(&self) -> Vec<String> {
        qemu_args(
            self.plan.index,
            &self.socket,
            self.plan.num_queues,
            QUEUE_SIZE,
        )
    }

    fn stopped(&self) -> Option<String> {
        self.handle
            .is_finished()
            .then(|| format!("the backend of {} stopped", self.plan.path.display()))
    }

    fn metrics(&self) -> DeviceMetrics {
        let m = self.metrics.clone();
        let capacity = self.handle.capacity_bytes();
        DeviceMetrics {
            kind: ENTRY.kind,
            id: self.id(),
            disk: Some(self.plan.index),
            samples: Arc::new(move || block_samples(&m, capacity)),
            stages: self.stages.clone(),
        }
    }

    fn finish(self: Box<Self>) -> DeviceReport {
        let error = backend_error(self.handle, &self.plan.path);
        if self.plan.dedup.is_some() {
            crate::disksource::unregister(&self.plan.path);
        }
        let ds = disk_stats(self.plan.path.clone(), &self.metrics, &self.stages);
        DeviceReport {
            disk: Some(ds),
            error,
            ..DeviceReport::default()
        }
    }
}

/// Waits for a disk's backend to end (QEMU is gone) and names the disk in its error, if it
/// failed.
pub(super) fn backend_error(handle: BackendHandle, path: &Path) -> Option<String> {
    handle.frontend_gone();
    handle
        .wait()
        .err()
        .map(|e| format!("{}: {e}", path.display()))
}

/// A disk's end-of-run statistics: the backend's counters and each stage's snapshot and summary.
pub(super) fn disk_stats(
    path: PathBuf,
    metrics: &BlockMetrics,
    stages: &[(&'static str, Arc<dyn StageMetrics>)],
) -> DiskStats {
    let mut ds = DiskStats::from_metrics(path, metrics);
    for (_, m) in stages {
        ds.stages.insert(m.key().to_owned(), m.snapshot());
        ds.stage_lines.push(m.summary());
    }
    ds
}

/// The backend's counters as metric samples (names in docs/metrics.md).
pub(super) fn block_samples(m: &BlockMetrics, capacity: u64) -> Vec<Sample> {
    let s = m.snapshot();
    let mut v = Vec::new();
    for (kind, n, bytes) in [
        ("read", s.reads, Some(s.bytes_read)),
        ("write", s.writes, Some(s.bytes_written)),
        ("discard", s.discards, Some(s.bytes_discarded)),
        ("write_zeroes", s.write_zeroes, Some(s.bytes_zeroed)),
        ("flush", s.flushes, None),
        ("get_id", s.get_ids, None),
    ] {
        v.push(
            Sample::counter("block_requests_total", "Block requests completed.", n)
                .with("kind", kind),
        );
        if let Some(b) = bytes {
            v.push(
                Sample::counter(
                    "block_bytes_total",
                    "Bytes of successful block requests.",
                    b,
                )
                .with("kind", kind),
            );
        }
    }
    let e = &s.errors;
    for (cause, n) in [
        ("unusable_chain", e.unusable_chain),
        ("invalid_request", e.invalid_request),
        ("unsupported", e.unsupported),
        ("read_only", e.read_only),
        ("io", e.io),
        ("stage", e.stage),
        ("queue", e.queue),
    ] {
        v.push(
            Sample::counter("block_errors_total", "Failed requests and queue errors.", n)
                .with("error", cause),
        );
    }
    v.push(Sample::counter(
        "block_completed_ok_total",
        "Requests answered VIRTIO_BLK_S_OK.",
        s.completed_ok,
    ));
    v.push(Sample::gauge(
        "block_in_flight_requests",
        "Requests between the avail ring and the used ring.",
        s.in_flight,
    ));
    v.push(Sample::seconds(
        "block_service_seconds_total",
        "Sum of service times, avail to used.",
        s.latency_ns_total,
    ));
    let h = &s.hand_offs;
    v.push(Sample::counter(
        "block_timed_requests_total",
        "Requests that reached the image, whose service time is split by part.",
        h.requests,
    ));
    for (part, ns) in [
        ("stages", h.stages_ns),
        ("queued", h.queued_ns),
        ("io", h.io_ns),
        ("completion", h.completion_ns),
    ] {
        v.push(
            Sample::seconds(
                "block_service_part_seconds_total",
                "Service time of the requests that reached the image, by part: stages (avail \
                 ring to the terminal stage), queued (waiting for an I/O thread), io (the \
                 transfer), completion (transfer end to used ring).",
                ns,
            )
            .with("part", part),
        );
    }
    v.push(Sample::counter(
        "block_notifications_total",
        "Interrupts sent to the guest.",
        s.notifications,
    ));
    v.push(Sample::gauge(
        "block_capacity_bytes",
        "Size of the disk.",
        capacity,
    ));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_arguments_name_the_socket_queues_and_queue_size() {
        let a = qemu_args(1, Path::new("/r/disk1.sock"), 2, 256);
        assert_eq!(a[0], "-chardev");
        assert_eq!(a[1], "socket,id=disk1,path=/r/disk1.sock");
        assert_eq!(a[2], "-device");
        assert_eq!(
            a[3],
            "vhost-user-blk-pci,id=disk1,chardev=disk1,num-queues=2,queue-size=256"
        );
    }
}
