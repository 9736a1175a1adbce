//! The classifier stage: attaches a [`RequestInsight`] to every read and write request and
//! logs it (Sky §3.4, §6.1).
//!
//! Writes are classified before they go down (later stages, e.g. the cache, see the class);
//! reads go down first (the data is only there afterwards) and get the best-known insight.

use std::ops::Range;
use std::sync::Arc;

use vmsight_blockdev::insight::RequestInsight;
use vmsight_blockdev::pipeline::{Next, Stage, StageError, Status};
use vmsight_blockdev::request::{Request, RequestKind};

use crate::engine::InsightEngine;

/// Largest request read into one scratch buffer (virtio-blk requests are bounded by the
/// backend's limits; this is only a guard).
const MAX_SCRATCH: u64 = 64 << 20;

/// The classifier stage of one disk.
pub struct Classifier {
    engine: InsightEngine,
    disk: u32,
    /// Byte ranges of the file system's journal on this disk (optional, e.g. from the ext4
    /// crawl); writes overlapping them are flagged `journal`.
    journal: Vec<Range<u64>>,
    scratch: Vec<u8>,
}

impl Classifier {
    /// A classifier stage for disk `disk` (index of `--disk`, 0 = root) sharing `engine`.
    pub fn stage(engine: InsightEngine, disk: u32, journal: Vec<Range<u64>>) -> Box<dyn Stage> {
        Box::new(Self::build(engine, disk, journal))
    }

    fn build(engine: InsightEngine, disk: u32, journal: Vec<Range<u64>>) -> Self {
        Self {
            engine,
            disk,
            journal,
            scratch: Vec::new(),
        }
    }

    fn in_journal(&self, off: u64, len: u64) -> bool {
        let end = off.saturating_add(len);
        self.journal.iter().any(|r| r.start < end && off < r.end)
    }

    /// Copies the request's data into the scratch buffer; `false` if the guest memory is
    /// gone or the request is implausibly large (the request still proceeds, unclassified).
    fn load(&mut self, req: &Request<'_>) -> bool {
        if req.len > MAX_SCRATCH {
            return false;
        }
        self.scratch.resize(req.len as usize, 0);
        req.read_data(0, &mut self.scratch).is_ok()
    }
}

impl Stage for Classifier {
    fn name(&self) -> &str {
        "classifier"
    }

    fn process(
        &mut self,
        req: &mut Request<'_>,
        next: &mut dyn Next,
    ) -> Result<Status, StageError> {
        match req.kind {
            RequestKind::Write => {
                let off = req.offset();
                let journal = self.in_journal(off, req.len);
                let insight = if self.load(req) {
                    self.engine
                        .lock()
                        .classify_write(self.disk, off, &self.scratch, journal)
                } else {
                    let mut m = RequestInsight::metadata();
                    m.journal = journal;
                    m
                };
                req.insights = Some(Arc::new(insight));
                next.run(req)
            }
            RequestKind::Read => {
                let status = next.run(req)?;
                if status == Status::Ok && self.load(req) {
                    let off = req.offset();
                    let insight = self
                        .engine
                        .lock()
                        .classify_read(self.disk, off, &self.scratch);
                    req.insights = Some(Arc::new(insight));
                }
                Ok(status)
            }
            RequestKind::Discard | RequestKind::WriteZeroes => {
                {
                    let mut g = self.engine.lock();
                    for r in &req.ranges {
                        g.log_discard(self.disk, r.offset(), r.bytes());
                    }
                }
                next.run(req)
            }
            _ => next.run(req),
        }
    }
}

#[cfg(test)]
mod tests;
