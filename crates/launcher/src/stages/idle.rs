//! Registry entry of FoxyIdle's idle scheduler: on every disk when FoxyIdle is on
//! (`--background`, `--idle`, `--idle-interval`, `--idle-max-hold`; docs/foxyidle.md). It goes
//! after the classifier and above the iCache: the iCache serves one request at a time on its
//! own thread, so a read held below it would hold every foreground request queued behind it.
//! (The price: a background read the cache could serve also waits for the idle disk.)

use std::sync::Arc;

use serde::Serialize;
use vmsight_blockdev::stages::idle::{IdleMetrics, IdleScheduler, IdleSnapshot};

use super::{BuiltStage, DiskCtx, OptionsError, Sample, Snapshotting, StageEntry};
use crate::error::LaunchError;
use crate::idle::{AttributionSnapshot, Attributor, DiskAttribution};

pub static ENTRY: StageEntry = StageEntry {
    name: "idle",
    position: 15,
    summary: "FoxyIdle: holds background processes' reads until the disk has been free of \
              foreground work for the preemption interval",
    options: "",
    requested: false,
    check: |_| Err(OptionsError("enabled by --background or --idle".into())),
    build,
};

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    let (Some(attributor), Some(settings)) = (ctx.idle, ctx.cfg.idle.as_ref()) else {
        return Ok(None);
    };
    attributor.register_disk(ctx.index);
    let attribution = Arc::new(DiskAttribution {
        attributor: attributor.clone(),
        disk: ctx.index,
    });
    let (stage, m) = IdleScheduler::stage(settings.scheduler, attribution)
        .map_err(|e| ctx.build_error(ENTRY.name, e))?;
    Ok(Some(BuiltStage {
        stage,
        metrics: Some(Arc::new(Metrics {
            idle: m,
            attributor: attributor.clone(),
            disk: ctx.index,
        })),
        direct_io: false,
    }))
}

struct Metrics {
    idle: Arc<IdleMetrics>,
    attributor: Arc<Attributor>,
    disk: usize,
}

/// The scheduler's counters and the disk's attribution counters.
#[derive(Serialize)]
struct Snapshot {
    #[serde(flatten)]
    idle: IdleSnapshot,
    attribution: AttributionSnapshot,
}

impl Snapshotting for Metrics {
    type Snapshot = Snapshot;
    const KEY: &'static str = "idle";

    fn take(&self) -> Snapshot {
        Snapshot {
            idle: self.idle.snapshot(),
            attribution: self.attributor.snapshot(self.disk),
        }
    }

    fn line(s: &Snapshot) -> String {
        let i = &s.idle;
        let a = &s.attribution;
        format!(
            "idle ({} ms): {} held ({:.1} s total, max {:.1} ms) in {} intervals{}; requests \
             fg {} bg {} bg-writes {} nobody {} unknown {}; attribution {}: {} tags, {} misses, \
             {} dropped",
            i.interval_ms,
            i.held,
            i.hold_ns_total as f64 / 1e9,
            i.hold_ns_max as f64 / 1e6,
            i.preemption_intervals,
            timer_error_part(&i.timer_error),
            i.foreground,
            i.background,
            i.background_writes,
            i.nobody,
            i.unknown,
            if a.available { "on" } else { "UNAVAILABLE" },
            a.tags,
            a.misses,
            a.dropped
        )
    }

    fn samples_of(s: &Snapshot) -> Vec<Sample> {
        let i = &s.idle;
        let a = &s.attribution;
        let by_owner = |owner: &'static str, v: u64| {
            Sample::counter("idle_requests_total", "Read/write requests by owner.", v)
                .with("owner", owner)
        };
        vec![
            by_owner("foreground", i.foreground),
            by_owner("background", i.background),
            by_owner("background_write", i.background_writes),
            by_owner("nobody", i.nobody),
            by_owner("unknown", i.unknown),
            Sample::counter("idle_held_total", "Background reads held.", i.held),
            Sample::seconds(
                "idle_held_seconds_total",
                "Time background reads were held.",
                i.hold_ns_total,
            ),
            Sample::seconds("idle_held_max_seconds", "Longest hold.", i.hold_ns_max),
            Sample::counter(
                "idle_preemption_intervals_total",
                "Preemption intervals that held background reads.",
                i.preemption_intervals,
            ),
            Sample::counter(
                "idle_max_hold_releases_total",
                "Held reads started by the starvation guard.",
                i.max_hold_releases,
            ),
            Sample::gauge("idle_held", "Background reads held now.", i.held_now),
            Sample::counter(
                "idle_timer_releases_total",
                "Timer callbacks that started held reads at the end of an interval.",
                i.timer_error.count,
            ),
            Sample::seconds(
                "idle_timer_error_seconds_total",
                "Sum of how late those callbacks were after the interval's end.",
                i.timer_error.total_ns,
            ),
            Sample::counter("idle_tags_total", "Block tags received.", a.tags),
            Sample::counter(
                "idle_attribution_misses_total",
                "Read/write requests without a tag.",
                a.misses,
            ),
            Sample::counter(
                "idle_tags_dropped_total",
                "Tags the plugin dropped (ring full).",
                a.dropped,
            ),
        ]
    }
}

/// `, timer error median 0.12 ms (p95 0.40, max 1.3) over N` when the timer released reads.
fn timer_error_part(h: &vmsight_blockdev::histogram::HistogramSnapshot) -> String {
    let (Some(p50), Some(p95)) = (h.quantile_us(0.5), h.quantile_us(0.95)) else {
        return String::new();
    };
    format!(
        ", timer error median {:.2} ms (p95 {:.2}, max {:.1}) over {}",
        p50 / 1e3,
        p95 / 1e3,
        h.max_ns as f64 / 1e6,
        h.count
    )
}
