//! Registry entry of the disk model: `--stage disk-model:hdd|ssd[:PARAMS]`, or the legacy
//! `--disk-model`. Extra disks only: the model stands for a workload's disk and opens the image
//! with O_DIRECT so the host page cache cannot hide the modelled device; the root disk is
//! vmsight's boot image, which a modelled HDD would only slow down.

use std::sync::Arc;

use vmsight_blockdev::stages::{DiskModel, DiskModelConfig, DiskModelMetrics, DiskModelSnapshot};

use super::{BuiltStage, DiskCtx, OptionsError, Sample, Snapshotting, StageEntry};
use crate::error::LaunchError;

pub static ENTRY: StageEntry = StageEntry {
    name: "disk-model",
    position: 40,
    summary: "delays completions so the image behaves like an HDD or a SATA SSD (extra disks)",
    options: "hdd|ssd[:KEY=VALUE,...] (see docs/icache.md for the parameters)",
    requested: true,
    check,
    build,
};

fn parse(options: &str) -> Result<DiskModelConfig, OptionsError> {
    options
        .parse::<DiskModelConfig>()
        .map_err(|e| OptionsError(e.to_string()))
}

fn check(options: &str) -> Result<(), OptionsError> {
    parse(options).map(|_| ())
}

/// The model requested for disk `ctx` (a dedup volume models its data and metadata I/O
/// itself, so it asks here instead of getting the stage).
pub(crate) fn requested(ctx: &DiskCtx<'_>) -> Result<DiskModelConfig, LaunchError> {
    let options = ctx.cfg.stages.iter().find(|r| r.name == ENTRY.name);
    match options {
        Some(r) if ctx.index > 0 => parse(&r.options).map_err(|e| ctx.build_error(ENTRY.name, e)),
        _ => Ok(DiskModelConfig::None),
    }
}

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    let Some(options) = ctx.extra_disk_options() else {
        return Ok(None);
    };
    let cfg = parse(options).map_err(|e| ctx.build_error(ENTRY.name, e))?;
    if cfg == DiskModelConfig::None || ctx.dedup.is_some() {
        return Ok(None);
    }
    let (stage, m) =
        DiskModel::stage(cfg, ctx.capacity_bytes).map_err(|e| ctx.build_error(ENTRY.name, e))?;
    Ok(Some(BuiltStage {
        stage,
        metrics: Some(Arc::new(Metrics(m))),
        direct_io: true,
    }))
}

struct Metrics(Arc<DiskModelMetrics>);

impl Snapshotting for Metrics {
    type Snapshot = DiskModelSnapshot;
    const KEY: &'static str = "model";

    fn take(&self) -> DiskModelSnapshot {
        self.0.snapshot()
    }

    fn line(m: &DiskModelSnapshot) -> String {
        format!(
            "disk model: {} ({} requests, {} seeks, {:.1} s modelled busy)",
            m.model,
            m.requests,
            m.seeks,
            m.modelled_busy_ns as f64 / 1e9
        )
    }

    fn samples_of(m: &DiskModelSnapshot) -> Vec<Sample> {
        vec![
            Sample::counter(
                "disk_model_requests_total",
                "Requests modelled.",
                m.requests,
            ),
            Sample::counter("disk_model_seeks_total", "Modelled head moves.", m.seeks),
            Sample::seconds(
                "disk_model_busy_seconds_total",
                "Modelled busy time.",
                m.modelled_busy_ns,
            ),
            Sample::seconds(
                "disk_model_held_seconds_total",
                "Time completions were held past the host I/O.",
                m.slept_ns,
            ),
            Sample::counter(
                "disk_model_overruns_total",
                "Requests whose host I/O outlasted the model.",
                m.overruns,
            ),
            Sample::counter(
                "disk_model_read_bytes_total",
                "Bytes read from the modelled disk.",
                m.read_bytes,
            ),
            Sample::counter(
                "disk_model_written_bytes_total",
                "Bytes written to the modelled disk.",
                m.write_bytes,
            ),
        ]
    }
}
