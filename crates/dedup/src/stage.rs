//! The dedup volume as the last stage of a disk's pipeline.
//!
//! One worker thread (`vmsight-dedup`) owns the [`Volume`] and serves requests one at a time,
//! in arrival order, as dm-dedup's single target does: a write's lookups, insertions and
//! metadata I/O are dependent steps. With a disk model, the worker sleeps until the modelled
//! disk has done every data and metadata I/O of the request before it completes it, so the
//! guest sees the modelled time. A volume with uncommitted changes commits after two idle
//! seconds, and at shutdown.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use serde::Serialize;
use vmsight_blockdev::insight::{DedupHint, RequestInsight};
use vmsight_blockdev::{Io, IoResult, Lower, Request, RequestKind, Stage, StageError, Status};

use crate::error::{DedupError, Result};
use crate::hints::Hints;
use crate::volume::{Volume, VolumeCounters, VolumeInfo};

/// Idle time after which uncommitted changes are committed.
const IDLE_COMMIT: Duration = Duration::from_secs(2);

/// Everything the stage reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DedupSnapshot {
    /// The disk model under the volume.
    pub model: String,
    /// Metadata cache size in pages (4 KiB).
    pub meta_cache_pages: usize,
    /// Whether hints are used.
    pub hints: bool,
    /// Requests served and the time they spent in the stage (queueing excluded), ns.
    pub requests: u64,
    pub stage_ns: u64,
    /// Work counters (hints, lookups, insertions, commits).
    #[serde(flatten)]
    pub counters: VolumeCounters,
    /// Blocks of reads the classifier hinted as copies, and how many entered the hint cache.
    pub copy_hints: u64,
    pub copy_hint_promoted: u64,
    /// Entries in the hint cache now.
    pub hint_cache_entries: u64,
    /// Metadata cache hits and misses (a miss reads a page), pages written by commits.
    pub meta_cache_hits: u64,
    pub meta_cache_misses: u64,
    pub meta_commits: u64,
    /// Checkpoints (committed pages written in place), and pages read ahead of sequential
    /// misses.
    pub meta_checkpoints: u64,
    pub meta_readahead_pages: u64,
    /// Misses on table pages known to be empty (served without a read).
    pub meta_empty_misses: u64,
    pub meta_pages_read: u64,
    pub meta_pages_written: u64,
    /// Data chunks read and written on the data file.
    pub data_chunks_read: u64,
    pub data_chunks_written: u64,
    /// Modelled service time and seeks of all I/O (data and metadata), ns.
    pub modelled_ns: u64,
    pub modelled_seeks: u64,
    /// Space.
    pub logical_blocks: u64,
    pub mapped_blocks: u64,
    pub used_chunks: u64,
    pub index_entries: u64,
    pub dedup_ratio: f64,
    pub saved_bytes: u64,
}

enum Msg {
    Io(Io),
    Read {
        offset: u64,
        len: usize,
        reply: Sender<Result<Vec<u8>>>,
    },
    Gc(Sender<Result<u64>>),
    Stop(Sender<Result<()>>),
}

/// A handle on a served volume for the rest of vmsight: stats, reads for the file-system
/// crawl, online garbage collection.
#[derive(Clone)]
pub struct DedupHandle {
    tx: Sender<Msg>,
    snapshot: Arc<Mutex<DedupSnapshot>>,
    hints: Hints,
    capacity: u64,
    path: std::path::PathBuf,
}

impl DedupHandle {
    /// The latest counters.
    pub fn snapshot(&self) -> DedupSnapshot {
        let mut s = self
            .snapshot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        s.copy_hints = self.hints.copy_hinted_blocks.load(Ordering::Relaxed);
        s.copy_hint_promoted = self.hints.promoted.load(Ordering::Relaxed);
        s.hint_cache_entries = self.hints.lock().cached() as u64;
        s
    }

    /// The hint state (for the hint stage).
    pub fn hints(&self) -> Hints {
        self.hints.clone()
    }

    /// Logical size in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    fn stopped(&self) -> DedupError {
        DedupError::Stopped {
            path: self.path.clone(),
        }
    }

    /// Reads logical bytes through the worker (queued behind guest requests, so it sees
    /// every write completed before it).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (tx, rx) = bounded(1);
        self.tx
            .send(Msg::Read {
                offset,
                len: buf.len(),
                reply: tx,
            })
            .map_err(|_| self.stopped())?;
        let data = rx.recv().map_err(|_| self.stopped())??;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Garbage-collects the running volume; returns the chunks freed.
    pub fn gc(&self) -> Result<u64> {
        let (tx, rx) = bounded(1);
        self.tx.send(Msg::Gc(tx)).map_err(|_| self.stopped())?;
        rx.recv().map_err(|_| self.stopped())?
    }
}

/// The terminal stage.
pub struct DedupStage {
    tx: Sender<Msg>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DedupStage {
    /// Serves `volume` from a worker thread; returns the stage and a handle.
    pub fn start(volume: Volume) -> Result<(Self, DedupHandle)> {
        let (tx, rx) = unbounded();
        let capacity = volume.geometry().logical_bytes();
        let path = volume.dir().to_owned();
        let hints = volume.hints();
        let snapshot = Arc::new(Mutex::new(DedupSnapshot::default()));
        let mut worker = Worker {
            volume,
            snapshot: snapshot.clone(),
            requests: 0,
            stage_ns: 0,
            dirty: false,
        };
        worker.publish();
        let thread = std::thread::Builder::new()
            .name("vmsight-dedup".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                worker.run(&rx)
            })
            .map_err(|source| DedupError::Io {
                path: path.clone(),
                op: "starting the dedup worker thread".into(),
                source,
            })?;
        let handle = DedupHandle {
            tx: tx.clone(),
            snapshot,
            hints,
            capacity,
            path,
        };
        Ok((
            Self {
                tx,
                thread: Mutex::new(Some(thread)),
            },
            handle,
        ))
    }

    fn stop(&self) -> std::result::Result<(), StageError> {
        let (tx, rx) = bounded(1);
        let sent = self.tx.send(Msg::Stop(tx)).is_ok();
        let result = if sent { rx.recv().ok() } else { None };
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
        match result {
            Some(Err(e)) => Err(stage_error(&e)),
            _ => Ok(()),
        }
    }
}

impl Stage for DedupStage {
    fn name(&self) -> &str {
        "dedup"
    }

    fn submit(&self, io: Io) {
        // A stopped worker drops the Io with the message, which fails it (never a hang).
        let _ = self.tx.send(Msg::Io(io));
    }

    fn shutdown(&self, _lower: &Lower) -> std::result::Result<(), StageError> {
        self.stop()
    }
}

impl Drop for DedupStage {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn stage_error(e: &DedupError) -> StageError {
    StageError::Stage {
        stage: "dedup".into(),
        reason: e.to_string(),
    }
}

struct Worker {
    volume: Volume,
    snapshot: Arc<Mutex<DedupSnapshot>>,
    requests: u64,
    stage_ns: u64,
    dirty: bool,
}

impl Worker {
    fn run(&mut self, rx: &Receiver<Msg>) {
        loop {
            match rx.recv_timeout(IDLE_COMMIT) {
                Ok(Msg::Io(io)) => self.serve(io),
                Ok(Msg::Read { offset, len, reply }) => {
                    let mut buf = vec![0u8; len];
                    let r = self.volume.read(offset, &mut buf).map(|()| buf);
                    let _ = reply.send(r);
                }
                Ok(Msg::Gc(reply)) => {
                    let _ = reply.send(self.volume.gc());
                    self.publish();
                }
                Ok(Msg::Stop(reply)) => {
                    let r = self.volume.commit();
                    self.publish();
                    let _ = reply.send(r);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => self.idle_commit(),
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = self.volume.commit();
                    return;
                }
            }
        }
    }

    fn idle_commit(&mut self) {
        if !self.dirty {
            return;
        }
        match self.volume.commit() {
            Ok(()) => self.dirty = false,
            Err(e) => tracing::warn!(error = %e, "dedup: idle commit failed"),
        }
        self.publish();
    }

    fn serve(&mut self, mut io: Io) {
        let t0 = Instant::now();
        let kind = io.request().kind;
        let result = self.execute(io.request_mut());
        self.volume.wait_model();
        self.requests += 1;
        self.stage_ns += t0.elapsed().as_nanos() as u64;
        if kind.is_mutating() {
            self.dirty = true;
        }
        if kind == RequestKind::Flush {
            self.dirty = false;
        }
        if let Err(e) = &result {
            tracing::warn!(error = %e, ?kind, "dedup: request failed");
        }
        self.publish();
        io.complete(result);
    }

    fn execute(&mut self, req: &mut Request) -> IoResult {
        let v = &mut self.volume;
        let hints_on = v.options().hints;
        let r = match req.kind {
            RequestKind::Read => {
                let mut buf = vec![0u8; req.len as usize];
                v.read(req.offset(), &mut buf)
                    .map_err(|e| stage_error(&e))?;
                req.write_data(0, &buf)?;
                return Ok(Status::Ok);
            }
            RequestKind::Write => {
                let mut buf = vec![0u8; req.len as usize];
                req.read_data(0, &mut buf)?;
                let insight = req
                    .insights
                    .as_ref()
                    .and_then(|i| i.downcast_ref::<RequestInsight>())
                    .filter(|_| hints_on);
                let hint = |i: usize| insight.map_or(DedupHint::None, |x| x.dedup_hint_of_block(i));
                v.write(req.offset(), &buf, &hint)
            }
            RequestKind::Flush => v.flush(),
            RequestKind::Discard | RequestKind::WriteZeroes => {
                let zero = req.kind == RequestKind::WriteZeroes;
                req.ranges
                    .iter()
                    .try_for_each(|r| v.discard(r.offset(), r.bytes(), zero))
            }
            _ => return Ok(Status::Unsupp),
        };
        r.map(|()| Status::Ok).map_err(|e| stage_error(&e))
    }

    fn publish(&mut self) {
        let v = &mut self.volume;
        let info: VolumeInfo = v.info();
        let (modelled_ns, modelled_seeks) = v.modelled();
        let d = v.disk_counters();
        let m = v.meta_counters();
        let s = DedupSnapshot {
            model: format!("{}", v.options().model),
            meta_cache_pages: info.meta_cache_pages,
            hints: v.options().hints,
            requests: self.requests,
            stage_ns: self.stage_ns,
            counters: v.counters,
            copy_hints: 0,
            copy_hint_promoted: 0,
            hint_cache_entries: 0,
            meta_cache_hits: m.hits,
            meta_cache_misses: m.misses,
            meta_commits: m.commits,
            meta_checkpoints: m.checkpoints,
            meta_readahead_pages: m.readahead_pages,
            meta_empty_misses: m.empty_misses,
            meta_pages_read: d.meta_reads,
            meta_pages_written: d.meta_writes,
            data_chunks_read: d.data_reads,
            data_chunks_written: d.data_writes,
            modelled_ns,
            modelled_seeks,
            logical_blocks: info.logical_blocks,
            mapped_blocks: info.mapped_blocks,
            used_chunks: info.used_chunks,
            index_entries: info.index_entries,
            dedup_ratio: info.dedup_ratio,
            saved_bytes: info.saved_bytes,
        };
        *self.snapshot.lock().unwrap_or_else(PoisonError::into_inner) = s;
    }
}
