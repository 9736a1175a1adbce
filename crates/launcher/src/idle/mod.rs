//! FoxyIdle's attribution (FoxyTechnique §5, done at submission rather than by CR3): which
//! guest process submitted each block request, known when the request reaches the backend.
//!
//! The plugin pushes a tag per bio into the block-tag channel (`blocktag.shm`, see
//! `vmsight_ring::blocktag`) from the guest kernel's `blk_mq_submit_bio` entry, before the
//! request exists. The idle stage of each disk asks [`Attributor::verdict`] when a request
//! arrives: the channel is drained right there (the tags of the request were pushed before
//! the guest could post it, so no waiting is needed), the tags go to per-disk tables
//! ([`tags::TagTable`]) and the request takes the tags it overlaps. Background marks live in
//! [`marks::Marks`]; guest declarations arrive through the same channel.
//!
//! A request is background only if every tag it took is a background process's; a kernel
//! thread's (writeback, journal) belongs to nobody; no tag at all is an attribution miss,
//! treated as foreground (a wrong hint costs performance, never data).

pub mod marks;
pub mod tags;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmsight_blockdev::request::{Request, RequestKind};
use vmsight_blockdev::stages::idle::{Attribution, Owner, Verdict};
use vmsight_proto::control::IdleMark;
use vmsight_ring::blocktag::{BlockTag, Declaration};
use vmsight_ring::layout::plugin_flags;
use vmsight_ring::{ChannelHost, Record};

use crate::error::LaunchError;
use crate::trace::TraceTarget;
use marks::{MarkError, Marks, Source};
use tags::{disk_index, TagTable};

/// Records per vCPU ring of the block-tag channel (a bio is one record; the backend drains
/// at every request, so the ring only needs to cover one burst of submissions).
pub const RING_RECORDS: u32 = 4096;

/// Attribution counters of one disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttributionSnapshot {
    /// The plugin hooks the guest's block submission (false: every request is a miss).
    pub available: bool,
    /// Tags received for this disk.
    pub tags: u64,
    /// Read/write requests that took at least one tag.
    pub matched: u64,
    /// Read/write requests without any tag (attribution misses).
    pub misses: u64,
    /// Tags of this disk that expired or overflowed unconsumed.
    pub expired: u64,
    /// Tags the plugin dropped because the ring was full (all disks).
    pub dropped: u64,
    /// Background declarations received from guest programs (all disks).
    pub declarations: u64,
}

#[derive(Default)]
struct DiskState {
    table: TagTable,
    tags: u64,
    matched: u64,
    misses: u64,
}

/// One per-request line of `--idle-log`.
#[derive(Debug, Serialize)]
pub struct LogLine {
    pub disk: usize,
    pub sector: u64,
    pub sectors: u64,
    pub op: String,
    pub owner: Owner,
    /// Submitter's TGID (0: none or a kernel thread).
    pub tgid: u32,
    /// Microseconds the idle stage held the request.
    pub held_us: u64,
}

/// The VM's attribution: the block-tag channel, the per-disk tag tables and the marks.
pub struct Attributor {
    host: Mutex<Option<ChannelHost>>,
    shm: Option<PathBuf>,
    disks: Mutex<BTreeMap<usize, DiskState>>,
    marks: RwLock<Marks>,
    declarations: AtomicU64,
    log: Option<Mutex<std::io::LineWriter<std::fs::File>>>,
}

impl std::fmt::Debug for Attributor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attributor")
            .field("shm", &self.shm)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Attributor {
    /// Creates the block-tag channel at `shm` (`None`: no plugin, nothing is attributed),
    /// the per-request log and the initial marks (`@cmd` is marked later, when the guest
    /// reports the command's PID).
    pub fn create(
        shm: Option<&Path>,
        vcpus: u32,
        marks: &[TraceTarget],
        log: Option<&Path>,
    ) -> Result<Arc<Self>, LaunchError> {
        let host = match shm {
            Some(p) => Some(
                vmsight_ring::Channel::create(p, vcpus, RING_RECORDS)
                    .map_err(|e| LaunchError::Channel(e.to_string()))?,
            ),
            None => None,
        };
        let log = match log {
            Some(p) => Some(Mutex::new(std::io::LineWriter::new(
                std::fs::File::create(p).map_err(|e| {
                    LaunchError::Config(format!("cannot create the idle log {}: {e}", p.display()))
                })?,
            ))),
            None => None,
        };
        let mut m = Marks::default();
        for t in marks.iter().filter(|t| **t != TraceTarget::Command) {
            // Only @cmd can fail, and it is filtered out.
            let _ = m.add(t, Source::Run);
        }
        Ok(Arc::new(Self {
            host: Mutex::new(host),
            shm: shm.map(Path::to_owned),
            disks: Mutex::new(BTreeMap::new()),
            marks: RwLock::new(m),
            declarations: AtomicU64::new(0),
            log,
        }))
    }

    /// The channel file the plugin attaches (`blk=`).
    pub fn channel_path(&self) -> Option<&Path> {
        self.shm.as_deref()
    }

    /// Starts keeping tags for disk `index` (tags of other disks are dropped at once).
    pub fn register_disk(&self, index: usize) {
        lock(&self.disks).entry(index).or_default();
    }

    /// The plugin attached and hooks the block submission path.
    pub fn available(&self) -> bool {
        lock(&self.host)
            .as_ref()
            .is_some_and(|h| h.plugin_status().flags & plugin_flags::BLOCK_TAGS != 0)
    }

    /// Marks `target` background.
    pub fn mark(&self, target: &TraceTarget, source: Source) -> Result<(), MarkError> {
        self.marks
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .add(target, source)
    }

    /// Removes a mark.
    pub fn unmark(&self, target: &TraceTarget) -> Result<(), MarkError> {
        self.marks
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(target)
    }

    /// Every mark.
    pub fn marks(&self) -> Vec<IdleMark> {
        self.marks
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .list()
    }

    /// Moves every pushed record into the tables (and declarations into the marks).
    fn drain(&self) {
        let mut records: Vec<Record> = Vec::new();
        if let Some(h) = lock(&self.host).as_mut() {
            h.drain(|r| records.push(*r));
        }
        if records.is_empty() {
            return;
        }
        let now = vmsight_ring::monotonic_ns();
        let mut disks = lock(&self.disks);
        for r in &records {
            if let Some(t) = BlockTag::from_record(r) {
                let Some(d) = disk_index(&t.disk_name).and_then(|i| disks.get_mut(&i)) else {
                    continue;
                };
                d.tags += 1;
                d.table.push(t, r.timestamp_ns);
            } else if let Some(decl) = Declaration::from_record(r) {
                self.declare(&decl);
            }
        }
        for d in disks.values_mut() {
            d.table.expire(now);
        }
    }

    fn declare(&self, d: &Declaration) {
        self.declarations.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            "guest process {} ({}) declared itself {}",
            d.tgid,
            vmsight_ring::comm_to_string(&d.comm),
            if d.background {
                "background"
            } else {
                "foreground"
            }
        );
        self.marks
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .declare(d.tgid, d.background);
    }

    /// The owner of a read or write request on disk `disk`.
    pub fn verdict(&self, disk: usize, req: &Request) -> Verdict {
        let write = match req.kind {
            RequestKind::Read => false,
            RequestKind::Write => true,
            _ => {
                return Verdict {
                    owner: Owner::Nobody,
                    tgid: 0,
                }
            }
        };
        self.drain();
        let end = req.sector.saturating_add(req.len >> 9);
        let tags = {
            let mut disks = lock(&self.disks);
            let Some(d) = disks.get_mut(&disk) else {
                return Verdict {
                    owner: Owner::Unknown,
                    tgid: 0,
                };
            };
            let tags = d.table.take(req.sector, end, write);
            if tags.is_empty() {
                d.misses += 1;
            } else {
                d.matched += 1;
            }
            tags
        };
        let marks = self.marks.read().unwrap_or_else(PoisonError::into_inner);
        combine(&tags, &marks)
    }

    /// Logs a request the idle stage started.
    pub fn started(&self, disk: usize, req: &Request, v: &Verdict, held: Duration) {
        let Some(log) = &self.log else { return };
        let line = LogLine {
            disk,
            sector: req.sector,
            sectors: req.len >> 9,
            op: if req.kind == RequestKind::Write {
                "write".into()
            } else {
                "read".into()
            },
            owner: v.owner,
            tgid: v.tgid,
            held_us: u64::try_from(held.as_micros()).unwrap_or(u64::MAX),
        };
        if let Ok(text) = serde_json::to_string(&line) {
            let _ = writeln!(lock(log), "{text}");
        }
    }

    /// Counters of disk `disk`.
    pub fn snapshot(&self, disk: usize) -> AttributionSnapshot {
        let (dropped, available) = match lock(&self.host).as_ref() {
            Some(h) => (
                h.totals().records_dropped,
                h.plugin_status().flags & plugin_flags::BLOCK_TAGS != 0,
            ),
            None => (0, false),
        };
        let disks = lock(&self.disks);
        let d = disks.get(&disk);
        AttributionSnapshot {
            available,
            tags: d.map_or(0, |d| d.tags),
            matched: d.map_or(0, |d| d.matched),
            misses: d.map_or(0, |d| d.misses),
            expired: d.map_or(0, |d| d.table.expired),
            dropped,
            declarations: self.declarations.load(Ordering::Relaxed),
        }
    }
}

/// One request's owner from the tags it took: background only if every tag is a background
/// process's; a kernel thread's tags belong to nobody; no tags is unknown.
fn combine(tags: &[BlockTag], marks: &Marks) -> Verdict {
    let mut fg = None;
    let mut bg = None;
    let mut nobody = false;
    for t in tags {
        if t.kernel_thread() {
            nobody = true;
        } else if marks.background(t) {
            bg.get_or_insert(t.tgid);
        } else {
            fg.get_or_insert(t.tgid);
        }
    }
    let (owner, tgid) = match (fg, bg, nobody) {
        (Some(p), _, _) => (Owner::Foreground, p),
        (None, Some(p), false) => (Owner::Background, p),
        (None, Some(p), true) => (Owner::Foreground, p),
        (None, None, true) => (Owner::Nobody, 0),
        (None, None, false) => (Owner::Unknown, 0),
    };
    Verdict { owner, tgid }
}

/// The attribution of one disk, as the idle stage sees it.
pub struct DiskAttribution {
    pub attributor: Arc<Attributor>,
    pub disk: usize,
}

impl Attribution for DiskAttribution {
    fn classify(&self, req: &Request) -> Verdict {
        self.attributor.verdict(self.disk, req)
    }

    fn started(&self, req: &Request, v: &Verdict, held: Duration) {
        self.attributor.started(self.disk, req, v, held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_ring::blocktag::PF_KTHREAD;

    fn tag(tgid: u32, kthread: bool) -> BlockTag {
        BlockTag {
            tgid,
            task_flags: if kthread { PF_KTHREAD } else { 0 },
            ..BlockTag::default()
        }
    }

    #[test]
    fn a_request_is_background_only_if_all_its_tags_are() {
        let mut m = Marks::default();
        m.add(&TraceTarget::Pid(10), Source::Cli).expect("mark");
        let v = |tags: &[BlockTag]| combine(tags, &m);
        assert_eq!(v(&[tag(10, false)]).owner, Owner::Background);
        assert_eq!(v(&[tag(10, false)]).tgid, 10);
        assert_eq!(
            v(&[tag(10, false), tag(20, false)]).owner,
            Owner::Foreground
        );
        assert_eq!(v(&[tag(20, false)]).tgid, 20);
        assert_eq!(v(&[tag(10, false), tag(0, true)]).owner, Owner::Foreground);
        assert_eq!(v(&[tag(0, true)]).owner, Owner::Nobody);
        assert_eq!(v(&[]).owner, Owner::Unknown);
    }
}
