//! Registry entry of the insight classifier (Sky §3.4, §6.1): first on every disk when
//! `--insights` is on, so every later stage (the cache) sees each request's class.

use super::{BuiltStage, DiskCtx, StageEntry};
use crate::error::LaunchError;

pub static ENTRY: StageEntry = StageEntry {
    name: "classifier",
    position: 10,
    summary: "attaches a storage insight (data/metadata, size class, hints) to every request",
    options: "",
    requested: false,
    check: |_| Ok(()),
    build,
};

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    // Its counters are VM-wide (the insight engine's), reported as `insights`.
    Ok(ctx.insight.map(|engine| BuiltStage {
        stage: vmsight_insight::Classifier::stage(
            engine.clone(),
            ctx.index as u32,
            super::journal_ranges(ctx.path),
        ),
        metrics: None,
        direct_io: false,
    }))
}
