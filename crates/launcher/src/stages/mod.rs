//! The block stage registry: every stage vmsight can put in a disk's pipeline, in one table.
//!
//! An entry says what the stage is called, where it goes (`position`, lower first), which
//! disks get it and with which options (its `build` function returns `None` for a disk it does
//! not apply to), and what it reports (a [`StageMetrics`] handle with a typed snapshot, one
//! summary line and Prometheus samples). Everything that lists or reports stages — the
//! pipeline assembly in `vm`, `--stats`, `--stats-json`, the control socket, `vmsight stats`,
//! the metrics endpoint — iterates over [`STAGES`] and the handles it returns, and names no
//! stage.
//!
//! Adding a stage: write the stage (a `vmsight_blockdev::Stage`, or a `SyncStage` wrapped in
//! `Serialized`), add a module here with its `ENTRY` (options parsed from `--stage NAME:OPTS`
//! or derived from the VM configuration), and list the entry in [`STAGES`]. See
//! ARCHITECTURE.md, "Where to add a block stage".
//!
//! The flush-order stage is not listed: it is part of every disk's pipeline (blockdev puts it
//! first), not a choice.

mod classifier;
mod dedup;
pub(crate) mod diskmodel;
mod icache;
mod idle;
mod tap;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use vmsight_blockdev::Stage;

use crate::config::VmConfig;
use crate::error::LaunchError;
use crate::stream::DiskStream;

/// Every block stage vmsight knows, in no particular order (`position` orders them).
pub static STAGES: &[&StageEntry] = &[
    &dedup::ENTRY,
    &classifier::ENTRY,
    &icache::ENTRY,
    &tap::ENTRY,
    &idle::ENTRY,
    &diskmodel::ENTRY,
];

/// One registry entry.
pub struct StageEntry {
    /// The stage's name (`--stage NAME:...`, logs, stats, metric labels).
    pub name: &'static str,
    /// Place in the pipeline: lower runs first (sees requests first, completions last).
    pub position: u16,
    /// One line for `vmsight stages` and the docs.
    pub summary: &'static str,
    /// Syntax of the options after `--stage NAME:` (empty: the stage takes none).
    pub options: &'static str,
    /// Whether the stage is only enabled through `--stage` (or its legacy flags); stages
    /// enabled by other features (insights, streaming) refuse `--stage`.
    pub requested: bool,
    /// Checks the options of a `--stage` request when the VM is prepared.
    pub check: fn(&str) -> Result<(), OptionsError>,
    /// Builds the stage for one disk, or `None` when it does not apply to that disk.
    pub build: fn(&DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError>,
}

impl std::fmt::Debug for StageEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageEntry")
            .field("name", &self.name)
            .field("position", &self.position)
            .finish()
    }
}

/// Why a stage's options are not acceptable: one sentence naming the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionsError(pub String);

/// Everything an entry may look at when building its stage for one disk.
pub struct DiskCtx<'a> {
    /// Disk index: 0 is the root disk, then the `--disk` order.
    pub index: usize,
    /// The image served.
    pub path: &'a Path,
    pub read_only: bool,
    /// Image size in bytes.
    pub capacity_bytes: u64,
    /// The whole VM configuration.
    pub cfg: &'a VmConfig,
    /// Options of `--stage NAME:OPTS` for this entry, if it was requested.
    pub options: Option<&'a str>,
    /// The VM's insight engine, when `--insights` is on.
    pub insight: Option<&'a vmsight_insight::InsightEngine>,
    /// This disk's file-update stream, when it has one (writable disks).
    pub stream: Option<&'a DiskStream>,
    /// The dedup volume served as this disk, when it is one.
    pub dedup: Option<&'a vmsight_dedup::DedupHandle>,
    /// FoxyIdle's attribution, when FoxyIdle is on.
    pub idle: Option<&'a Arc<crate::idle::Attributor>>,
}

/// A stage built for one disk.
pub struct BuiltStage {
    pub stage: Box<dyn Stage>,
    /// What it reports, if anything.
    pub metrics: Option<Arc<dyn StageMetrics>>,
    /// The stage needs the image opened with O_DIRECT (a modelled disk must not be hidden by
    /// the host page cache).
    pub direct_io: bool,
}

impl DiskCtx<'_> {
    /// The error of `stage` failing to build for this disk.
    pub fn build_error(&self, stage: &'static str, reason: impl std::fmt::Display) -> LaunchError {
        LaunchError::StageBuild {
            index: self.index,
            path: self.path.to_owned(),
            stage,
            reason: reason.to_string(),
        }
    }

    /// The options of a requested stage that applies to extra disks only (`None` on the root
    /// disk or when the stage was not requested).
    pub fn extra_disk_options(&self) -> Option<&str> {
        self.options.filter(|_| self.index > 0)
    }
}

/// A stage's live counters with a serialisable snapshot; [`StageMetrics`] follows from it.
pub trait Snapshotting: Send + Sync {
    /// The typed snapshot.
    type Snapshot: serde::Serialize;
    /// Key of the snapshot in stats and control replies.
    const KEY: &'static str;
    /// Reads the counters.
    fn take(&self) -> Self::Snapshot;
    /// One human-readable line.
    fn line(s: &Self::Snapshot) -> String;
    /// Metric samples.
    fn samples_of(s: &Self::Snapshot) -> Vec<Sample>;
}

impl<T: Snapshotting> StageMetrics for T {
    fn key(&self) -> &'static str {
        T::KEY
    }

    fn snapshot(&self) -> serde_json::Value {
        serde_json::to_value(self.take()).unwrap_or_default()
    }

    fn summary(&self) -> String {
        T::line(&self.take())
    }

    fn samples(&self) -> Vec<Sample> {
        T::samples_of(&self.take())
    }
}

/// What a stage reports while it runs and at the end.
pub trait StageMetrics: Send + Sync {
    /// Key of the snapshot in a disk's `--stats-json` object and control-socket status.
    fn key(&self) -> &'static str;
    /// The stage's typed snapshot, serialised.
    fn snapshot(&self) -> serde_json::Value;
    /// One human-readable line (`--stats`, `vmsight stats`).
    fn summary(&self) -> String;
    /// Counters and gauges for the metrics endpoint.
    fn samples(&self) -> Vec<Sample>;
}

/// The kind of a metric sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleKind {
    Counter,
    Gauge,
}

/// One metric value of a stage (the VM, disk and stage labels are added by the caller).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name without the `vmsight_` prefix, e.g. `icache_hits_total`.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: SampleKind,
    /// Extra labels (e.g. the I/O class).
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

impl Sample {
    /// A counter without extra labels.
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> Self {
        Self {
            name,
            help,
            kind: SampleKind::Counter,
            labels: Vec::new(),
            value: value as f64,
        }
    }

    /// A gauge without extra labels.
    pub fn gauge(name: &'static str, help: &'static str, value: u64) -> Self {
        Self {
            kind: SampleKind::Gauge,
            ..Self::counter(name, help, value)
        }
    }

    /// A counter of seconds, given in nanoseconds.
    pub fn seconds(name: &'static str, help: &'static str, ns: u64) -> Self {
        Self {
            value: ns as f64 / 1e9,
            ..Self::counter(name, help, 0)
        }
    }

    /// Adds a label.
    pub fn with(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.labels.push((key, value.into()));
        self
    }
}

/// A `--stage NAME[:OPTIONS]` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRequest {
    pub name: String,
    pub options: String,
}

/// A `--stage` value without a stage name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a stage needs a name: --stage NAME[:OPTIONS] (`vmsight stages` lists them)")]
pub struct StageRequestError;

impl FromStr for StageRequest {
    type Err = StageRequestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, options) = s.split_once(':').unwrap_or((s, ""));
        if name.is_empty() {
            return Err(StageRequestError);
        }
        Ok(Self {
            name: name.to_owned(),
            options: options.to_owned(),
        })
    }
}

/// Finds an entry by name.
pub fn entry(name: &str) -> Option<&'static StageEntry> {
    STAGES.iter().copied().find(|e| e.name == name)
}

/// The entries in pipeline order.
pub fn ordered() -> Vec<&'static StageEntry> {
    let mut v: Vec<&'static StageEntry> = STAGES.to_vec();
    v.sort_by_key(|e| e.position);
    v
}

/// Checks every `--stage` request: a known, requestable stage, named once, with valid options.
pub fn check_requests(requests: &[StageRequest]) -> Result<(), LaunchError> {
    for (i, r) in requests.iter().enumerate() {
        let bad = |reason: String| LaunchError::Stage {
            stage: r.name.clone(),
            reason,
        };
        let Some(e) = entry(&r.name) else {
            let known: Vec<&str> = ordered()
                .iter()
                .filter(|e| e.requested)
                .map(|e| e.name)
                .collect();
            return Err(bad(format!(
                "there is no such stage (stages to request: {})",
                known.join(", ")
            )));
        };
        if !e.requested {
            return Err(bad(
                "it cannot be requested with --stage; it is enabled by its feature's own options"
                    .into(),
            ));
        }
        if requests[..i].iter().any(|o| o.name == r.name) {
            return Err(bad("it is requested twice".into()));
        }
        (e.check)(&r.options).map_err(|e| bad(e.0))?;
    }
    Ok(())
}

/// The stages of one disk, built from the registry in pipeline order.
pub struct DiskStages {
    pub stages: Vec<Box<dyn Stage>>,
    /// (stage name, what it reports), in pipeline order.
    pub metrics: Vec<(&'static str, Arc<dyn StageMetrics>)>,
    pub direct_io: bool,
}

/// Builds every stage that applies to the disk described by `ctx` (its `options` field is
/// filled per entry from `requests`).
pub fn assemble(ctx: &DiskCtx<'_>, requests: &[StageRequest]) -> Result<DiskStages, LaunchError> {
    let mut out = DiskStages {
        stages: Vec::new(),
        metrics: Vec::new(),
        direct_io: false,
    };
    for e in ordered() {
        let options = requests
            .iter()
            .find(|r| r.name == e.name)
            .map(|r| r.options.as_str());
        if e.requested && options.is_none() {
            continue;
        }
        let ctx = DiskCtx { options, ..*ctx };
        let Some(built) = (e.build)(&ctx)? else {
            continue;
        };
        out.stages.push(built.stage);
        if let Some(m) = built.metrics {
            out.metrics.push((e.name, m));
        }
        out.direct_io |= built.direct_io;
    }
    Ok(out)
}

/// Byte ranges of the ext3/ext4 journal on the disk at `path` (empty if there is none or the
/// disk has no file system vmsight can read): the classifier marks writes there so the
/// priority cache does not keep them (Sky §7).
pub(crate) fn journal_ranges(path: &std::path::Path) -> Vec<std::ops::Range<u64>> {
    let Ok(src) = crate::disksource::open(path) else {
        return Vec::new();
    };
    let part = vmsight_fsview::read_partitions(&*src)
        .ok()
        .and_then(|t| t.partitions.first().cloned());
    let Ok(index) = vmsight_fsview::Index::crawl(&*src, part.as_ref()) else {
        return Vec::new();
    };
    let fs = index.fs_info();
    let bs = u64::from(fs.block_size);
    index
        .file_extents(8) // the ext3/ext4 journal inode
        .into_iter()
        .map(|e| {
            let start = fs.partition_start + e.disk_block * bs;
            start..start + u64::from(e.len) * bs
        })
        .collect()
}

impl Clone for DiskCtx<'_> {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for DiskCtx<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_positions_order_the_pipeline() {
        let names: Vec<&str> = ordered().iter().map(|e| e.name).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            names.len(),
            "duplicate stage names: {names:?}"
        );
        assert_eq!(
            names,
            vec![
                "dedup-hints",
                "classifier",
                "idle",
                "icache",
                "write-tap",
                "disk-model"
            ]
        );
    }

    #[test]
    fn requests_are_checked_with_clear_errors() {
        let req = |s: &str| s.parse::<StageRequest>().expect("request");
        check_requests(&[req("icache:size=64,policy=priority"), req("disk-model:hdd")])
            .expect("valid");
        let e = check_requests(&[req("dedup")]).expect_err("unknown");
        assert!(e.to_string().contains("no such stage"), "{e}");
        assert!(e.to_string().contains("icache, disk-model"), "{e}");
        let e = check_requests(&[req("write-tap")]).expect_err("not requestable");
        assert!(e.to_string().contains("cannot be requested"), "{e}");
        let e = check_requests(&[req("icache:size=8"), req("icache:size=9")]).expect_err("twice");
        assert!(e.to_string().contains("twice"), "{e}");
        let e = check_requests(&[req("icache:size=x")]).expect_err("bad option");
        assert!(e.to_string().starts_with("stage icache: "), "{e}");
        assert!("".parse::<StageRequest>().is_err());
    }
}
