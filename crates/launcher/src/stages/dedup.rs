//! Registry entry of iDedup's hint stage (Sky §8) and the dedup volume's report. A disk given
//! as `--disk VOL,dedup` is served by the volume itself (the pipeline's terminal, built by
//! `devices/blk.rs`); this entry puts the `dedup-hints` stage first on such a disk, above the
//! classifier, so that copy-hinted reads reach the volume's hint cache, and reports the
//! volume's counters under `dedup`.

use std::sync::Arc;

use vmsight_dedup::{DedupHandle, DedupHints, DedupSnapshot};

use super::{BuiltStage, DiskCtx, OptionsError, Sample, Snapshotting, StageEntry};
use crate::error::LaunchError;

pub static ENTRY: StageEntry = StageEntry {
    name: "dedup-hints",
    position: 5,
    summary: "feeds copy hints to a dedup volume's hint cache (disks given as VOL,dedup)",
    options: "",
    requested: false,
    check: |_| Err(OptionsError("is enabled by --disk VOL,dedup".into())),
    build,
};

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    Ok(ctx.dedup.map(|h| BuiltStage {
        stage: DedupHints::stage(h.hints()),
        metrics: Some(Arc::new(Metrics(h.clone()))),
        direct_io: false,
    }))
}

struct Metrics(DedupHandle);

impl Snapshotting for Metrics {
    type Snapshot = DedupSnapshot;
    const KEY: &'static str = "dedup";

    fn take(&self) -> DedupSnapshot {
        self.0.snapshot()
    }

    fn line(s: &DedupSnapshot) -> String {
        let c = &s.counters;
        format!(
            "dedup: {} blocks written, ratio {:.2} ({} MiB saved); hints {} unique, {} copy reads, \
             {} hint-cache hits; index {} lookups ({} hits), {} inserts; metadata {} pages read, \
             {} written, {} commits, {} checkpoints; {:.1} s in the stage, {:.1} s modelled ({})",
            c.blocks_written,
            s.dedup_ratio,
            s.saved_bytes >> 20,
            c.unique_hints,
            s.copy_hints,
            c.hint_hits,
            c.index_lookups,
            c.index_hits,
            c.index_inserts,
            s.meta_pages_read,
            s.meta_pages_written,
            s.meta_commits,
            s.meta_checkpoints,
            s.stage_ns as f64 / 1e9,
            s.modelled_ns as f64 / 1e9,
            s.model
        )
    }

    fn samples_of(s: &DedupSnapshot) -> Vec<Sample> {
        let c = &s.counters;
        vec![
            Sample::counter(
                "dedup_blocks_written_total",
                "Logical blocks written.",
                c.blocks_written,
            ),
            Sample::counter(
                "dedup_unique_hints_total",
                "Block writes with a unique hint (no lookup, no insertion).",
                c.unique_hints,
            ),
            Sample::counter(
                "dedup_copy_hints_total",
                "Blocks of reads hinted as copies.",
                s.copy_hints,
            ),
            Sample::counter(
                "dedup_hint_cache_hits_total",
                "Block writes that found their chunk in the hint cache.",
                c.hint_hits,
            ),
            Sample::counter(
                "dedup_index_lookups_total",
                "On-disk hash index lookups.",
                c.index_lookups,
            ),
            Sample::counter(
                "dedup_index_hits_total",
                "Index lookups that found the content.",
                c.index_hits,
            ),
            Sample::counter(
                "dedup_index_inserts_total",
                "Hash index insertions.",
                c.index_inserts,
            ),
            Sample::counter(
                "dedup_meta_pages_read_total",
                "Metadata pages read from the metadata file (cache misses).",
                s.meta_pages_read,
            ),
            Sample::counter(
                "dedup_meta_pages_written_total",
                "Metadata pages written (journal and in place).",
                s.meta_pages_written,
            ),
            Sample::counter(
                "dedup_commits_total",
                "Metadata commits (journal records).",
                s.meta_commits,
            ),
            Sample::counter(
                "dedup_checkpoints_total",
                "Checkpoints (committed metadata written in place).",
                s.meta_checkpoints,
            ),
            Sample::counter(
                "dedup_meta_readahead_pages_total",
                "Metadata pages read ahead of sequential misses.",
                s.meta_readahead_pages,
            ),
            Sample::seconds(
                "dedup_stage_seconds_total",
                "Time requests spent in the dedup stage.",
                s.stage_ns,
            ),
            Sample::gauge(
                "dedup_mapped_blocks",
                "Logical blocks that map to a chunk.",
                s.mapped_blocks,
            ),
            Sample::gauge(
                "dedup_used_chunks",
                "Physical chunks in use.",
                s.used_chunks,
            ),
            Sample::gauge(
                "dedup_saved_bytes",
                "Bytes saved by sharing chunks.",
                s.saved_bytes,
            ),
        ]
    }
}
