//! Registry entry of the disk model: `--stage disk-model:hdd|ssd[:PARAMS]`, or the legacy
//! `--disk-model`. Extra disks only, opened with O_DIRECT so the host page cache cannot hide
//! the modelled device.

use std::sync::Arc;

use vmsight_blockdev::stages::{DiskModel, DiskModelConfig, DiskModelMetrics};

use super::{BuiltStage, DiskCtx, OptionsError, Sample, StageEntry, StageMetrics};
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

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    let (Some(options), true) = (ctx.options, ctx.index > 0) else {
        return Ok(None);
    };
    let err = |reason: String| LaunchError::StageBuild {
        index: ctx.index,
        path: ctx.path.to_owned(),
        stage: ENTRY.name,
        reason,
    };
    let cfg = parse(options).map_err(|e| err(e.0))?;
    if cfg == DiskModelConfig::None {
        return Ok(None);
    }
    let (stage, m) = DiskModel::stage(cfg, ctx.capacity_bytes).map_err(|e| err(e.to_string()))?;
    Ok(Some(BuiltStage {
        stage,
        metrics: Some(Arc::new(Metrics(m))),
        direct_io: true,
    }))
}

struct Metrics(Arc<DiskModelMetrics>);

impl StageMetrics for Metrics {
    fn key(&self) -> &'static str {
        "model"
    }

    fn snapshot(&self) -> serde_json::Value {
        serde_json::to_value(self.0.snapshot()).unwrap_or_default()
    }

    fn summary(&self) -> String {
        let m = self.0.snapshot();
        format!(
            "disk model: {} ({} requests, {} seeks, {:.1} s modelled busy)",
            m.model,
            m.requests,
            m.seeks,
            m.modelled_busy_ns as f64 / 1e9
        )
    }

    fn samples(&self) -> Vec<Sample> {
        let m = self.0.snapshot();
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
        ]
    }
}
