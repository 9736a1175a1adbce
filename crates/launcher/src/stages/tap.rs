//! Registry entry of the write tap: every writable disk gets one (file-update streaming reads
//! its queue; with `--no-stream` it stays idle until `vmsight stream` attaches). It sits after
//! the cache and before the disk model: it sees exactly what goes to the image.

use vmsight_blockdev::tap::WriteTap;

use super::{BuiltStage, DiskCtx, StageEntry};
use crate::error::LaunchError;

pub static ENTRY: StageEntry = StageEntry {
    name: "write-tap",
    position: 30,
    summary: "copies completed writes to the disk's file-update stream (writable disks)",
    options: "",
    requested: false,
    check: |_| Ok(()),
    build,
};

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    // Its counters are reported by the stream service, which owns the queue.
    Ok(ctx.stream.filter(|_| !ctx.read_only).map(|s| BuiltStage {
        stage: Box::new(WriteTap::new(s.queue())),
        metrics: None,
        direct_io: false,
    }))
}
