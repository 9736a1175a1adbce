//! The classifier stage: attaches a [`RequestInsight`] to every read and write request and
//! logs it (Sky §3.4, §6.1).
//!
//! Writes are classified before they go down (later stages, e.g. the cache, see the class);
//! reads go down first (the data is only there afterwards) and get the best-known insight.

use std::ops::Range;
use std::sync::Arc;

use vmsight_blockdev::insight::RequestInsight;
use vmsight_blockdev::pipeline::{Io, Stage, Status};
use vmsight_blockdev::request::{Request, RequestKind};

use crate::engine::InsightEngine;
use crate::pages::PageOwner;

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
        }
    }

    fn in_journal(&self, off: u64, len: u64) -> bool {
        let end = off.saturating_add(len);
        self.journal.iter().any(|r| r.start < end && off < r.end)
    }

    /// Classifies a write before it goes down (later stages, e.g. the cache, see the class).
    fn classify_write(&self, req: &Request) -> RequestInsight {
        let off = req.offset();
        let journal = self.in_journal(off, req.len);
        match load(req) {
            Some(data) => {
                // The request's pages are listed only if a chunk no checksum matched asks.
                let src = self.engine.page_owners();
                let mut gpas: Option<Vec<Option<u64>>> = None;
                let mut owner = |i: usize| {
                    let src = src?;
                    let gpas = gpas
                        .get_or_insert_with(|| crate::pages::chunk_pages(&req.segments, req.len));
                    Some(src.owner(gpas.get(i).copied().flatten()?))
                };
                self.engine
                    .lock()
                    .classify_write_owned(self.disk, off, &data, journal, &mut owner)
            }
            None => {
                let mut m = RequestInsight::metadata();
                m.journal = journal;
                m
            }
        }
    }
}

impl Classifier {
    /// The owners of a read request's pages (empty without a page source): a block read
    /// fills the guest page cache's own pages, locked until the read completes.
    fn read_owners(&self, req: &Request) -> Vec<Option<PageOwner>> {
        let Some(src) = self.engine.page_owners() else {
            return Vec::new();
        };
        crate::pages::chunk_pages(&req.segments, req.len)
            .into_iter()
            .map(|gpa| Some(src.owner(gpa?)))
            .collect()
    }
}

/// Copies the request's data; `None` if the guest memory is gone or the request is
/// implausibly large (the request still proceeds, unclassified).
fn load(req: &Request) -> Option<Vec<u8>> {
    if req.len > MAX_SCRATCH {
        return None;
    }
    let mut buf = vec![0u8; req.len as usize];
    req.read_data(0, &mut buf).ok().map(|()| buf)
}

impl Stage for Classifier {
    fn name(&self) -> &str {
        "classifier"
    }

    fn submit(&self, mut io: Io) {
        match io.request().kind {
            RequestKind::Write => {
                let insight = self.classify_write(io.request());
                io.request_mut().insights = Some(Arc::new(insight));
                io.forward();
            }
            RequestKind::Read => {
                // What the guest's page cache says the pages will hold goes down with the
                // request (the cache sees the class at the first access); the data is only
                // there once the stages below have read it, and is classified then.
                let owners = self.read_owners(io.request());
                if !owners.is_empty() {
                    let insight = self.engine.lock().read_owners_insight(self.disk, &owners);
                    io.request_mut().insights = Some(Arc::new(insight));
                }
                let engine = self.engine.clone();
                let disk = self.disk;
                io.forward_then(move |mut io, result| {
                    if matches!(result, Ok(Status::Ok)) {
                        if let Some(data) = load(io.request()) {
                            let off = io.request().offset();
                            let insight =
                                engine.lock().classify_read_owned(disk, off, &data, &owners);
                            io.request_mut().insights = Some(Arc::new(insight));
                        }
                    }
                    io.complete(result);
                });
            }
            RequestKind::Discard | RequestKind::WriteZeroes => {
                {
                    let mut g = self.engine.lock();
                    for r in &io.request().ranges {
                        g.log_discard(self.disk, r.offset(), r.bytes());
                    }
                }
                io.forward();
            }
            _ => io.forward(),
        }
    }
}

#[cfg(test)]
mod tests;
