//! The asynchronous pipeline of stages between the virtqueue and the backing file.
//!
//! A validated [`Request`] enters the pipeline wrapped in an [`Io`]: an owned, in-flight
//! request that knows where it is in the chain of stages and who waits for it. Each
//! [`Stage`] receives the `Io` and decides what happens next, now or later, on any thread:
//!
//! * [`Io::forward`] passes it to the next stage;
//! * [`Io::forward_then`] passes it on and asks to see it again when the stages below have
//!   completed it (the hook gets the `Io` back and completes it, possibly later: a delay);
//! * [`Io::complete`] answers it here (a cache hit, a refusal);
//! * keeping the `Io` (in a queue, a timer) holds it; nothing else waits for it meanwhile.
//!
//! ```text
//! virtqueue -> request.rs (parse + validate) -> stage 0 -> stage 1 -> ... -> terminal stage
//!     ^                                            hooks run on the way back up   |
//!     +------------------ used ring <--- done <----------------------------------+
//! ```
//!
//! Every request is completed exactly once: an `Io` dropped without being forwarded or
//! completed completes itself with an error naming the stage that dropped it. No lock is held
//! while a request waits or while I/O runs: stages keep their own state behind short critical
//! sections, and requests of one queue complete out of order.
//!
//! Stages written in the synchronous style (call `next.run(req)` and look at the result) are
//! still supported through [`Serialized`]: the stage runs on its own thread, one request at a
//! time, and its calls below go through the asynchronous stages without blocking anyone else.
//! The iCache uses it; see ARCHITECTURE.md for when to choose which.

use std::fmt;
use std::io;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use tracing::warn;

use crate::request::Request;

/// The virtio-blk status byte written back to the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// `VIRTIO_BLK_S_OK`.
    Ok,
    /// `VIRTIO_BLK_S_IOERR`.
    IoErr,
    /// `VIRTIO_BLK_S_UNSUPP`.
    Unsupp,
}

impl Status {
    /// The byte value defined by the virtio specification.
    pub fn as_u8(self) -> u8 {
        match self {
            Status::Ok => virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK as u8,
            Status::IoErr => virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8,
            Status::Unsupp => virtio_bindings::virtio_blk::VIRTIO_BLK_S_UNSUPP as u8,
        }
    }
}

/// An error raised inside the pipeline. The device turns it into `VIRTIO_BLK_S_IOERR` for the
/// guest, counts it in the metrics and logs it; it never stops the backend.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The backing file failed.
    #[error("{op} on the disk image failed: {source}")]
    Io {
        /// What was attempted ("pread", "pwrite", "fdatasync", "fallocate", ...).
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// A guest buffer could not be accessed (the guest unmapped or never mapped it).
    #[error("guest memory at {addr:#x} (+{len} bytes) is not accessible")]
    GuestMemory {
        /// Guest-physical address.
        addr: u64,
        /// Length of the access.
        len: u64,
    },
    /// A stage refused or failed the request for its own reason.
    #[error("stage {stage} failed: {reason}")]
    Stage {
        /// The stage's name.
        stage: String,
        /// Sentence describing what went wrong.
        reason: String,
    },
    /// A stage let go of the request without completing it (a bug in the stage, or the
    /// backend stopped while the stage held it).
    #[error("stage {stage} dropped the request without completing it")]
    Dropped {
        /// The stage's name.
        stage: String,
    },
}

/// What a request's trip through (part of) the pipeline produced.
pub type IoResult = Result<Status, StageError>;

/// Called once when a request leaves the pipeline.
type Done = Box<dyn FnOnce(Request, IoResult) + Send>;
/// Called once on the way back up, at the stage that registered it.
type HookFn = Box<dyn FnOnce(Io, IoResult) + Send>;

/// One step of the block pipeline (classifier, cache, dedup, write tap, delay scheduler, the
/// file itself).
///
/// `submit` must not block: it forwards, completes, or keeps the [`Io`] to finish later from
/// a timer or another thread. A stage must not panic on any request: everything reaching it
/// has been validated against the disk geometry, but the guest may change its buffers at any
/// time.
pub trait Stage: Send + Sync {
    /// Short name used in logs and metrics (e.g. `"classifier"`).
    fn name(&self) -> &str;

    /// Takes one request.
    fn submit(&self, io: Io);

    /// The backend is stopping: pass on or fail every request held now and hold no new ones.
    /// Called front to back before in-flight requests are drained. The default does nothing.
    fn release(&self) {}

    /// Called once after every in-flight request completed, front to back, with the stages
    /// below still usable through `lower`: a stage holding state that must reach the image
    /// (e.g. a write-back cache's dirty blocks) writes it here. The default does nothing.
    fn shutdown(&self, lower: &Lower) -> Result<(), StageError> {
        let _ = lower;
        Ok(())
    }
}

/// The ordered stages of one disk; the last one is the terminal.
struct Chain {
    stages: Vec<Box<dyn Stage>>,
}

/// A registered completion hook: which stage asked, and what to run.
struct Hook {
    pos: usize,
    f: HookFn,
}

/// Everything an in-flight request carries.
struct IoState {
    req: Request,
    pos: usize,
    chain: Arc<Chain>,
    hooks: Vec<Hook>,
    done: Option<Done>,
}

/// An in-flight request at one stage. See the module documentation.
pub struct Io {
    state: Option<Box<IoState>>,
}

impl fmt::Debug for Io {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            Some(s) => f
                .debug_struct("Io")
                .field("stage", &s.pos)
                .field("request", &s.req)
                .finish(),
            None => f.write_str("Io(finished)"),
        }
    }
}

impl Io {
    fn state(&self) -> &IoState {
        match &self.state {
            Some(s) => s,
            // Every method that empties `state` consumes `self`.
            None => unreachable!("an Io is used after it was forwarded or completed"),
        }
    }

    /// The request.
    pub fn request(&self) -> &Request {
        &self.state().req
    }

    /// The request, to annotate or modify.
    pub fn request_mut(&mut self) -> &mut Request {
        match &mut self.state {
            Some(s) => &mut s.req,
            None => unreachable!("an Io is used after it was forwarded or completed"),
        }
    }

    /// The stages below the one holding this request (to issue requests of its own).
    pub fn lower(&self) -> Lower {
        let s = self.state();
        Lower {
            chain: s.chain.clone(),
            pos: s.pos + 1,
        }
    }

    /// Name of the stage holding the request.
    pub fn stage_name(&self) -> &str {
        let s = self.state();
        s.chain.stages.get(s.pos).map_or("pipeline", |st| st.name())
    }

    /// Passes the request to the next stage.
    pub fn forward(mut self) {
        if let Some(mut st) = self.state.take() {
            st.pos += 1;
            dispatch(st);
        }
    }

    /// Passes the request on; `hook` gets it back (at this stage) with the result of the
    /// stages below and must complete it, now or later.
    pub fn forward_then(mut self, hook: impl FnOnce(Io, IoResult) + Send + 'static) {
        if let Some(mut st) = self.state.take() {
            st.hooks.push(Hook {
                pos: st.pos,
                f: Box::new(hook),
            });
            st.pos += 1;
            dispatch(st);
        }
    }

    /// Completes the request here with `result`; the stages above see it on the way up.
    pub fn complete(mut self, result: IoResult) {
        if let Some(st) = self.state.take() {
            unwind(st, result);
        }
    }
}

impl Drop for Io {
    fn drop(&mut self) {
        if let Some(st) = self.state.take() {
            let stage = st
                .chain
                .stages
                .get(st.pos)
                .map_or("pipeline", |s| s.name())
                .to_owned();
            warn!(%stage, "a request was dropped without being completed; failing it");
            unwind(st, Err(StageError::Dropped { stage }));
        }
    }
}

/// Hands the request to the stage at its position (or fails it past the end).
fn dispatch(st: Box<IoState>) {
    let chain = st.chain.clone();
    match chain.stages.get(st.pos) {
        Some(stage) => stage.submit(Io { state: Some(st) }),
        None => unwind(
            st,
            Err(StageError::Stage {
                stage: "pipeline".into(),
                reason: "the request ran past the last stage (no terminal)".into(),
            }),
        ),
    }
}

/// Runs the next completion hook up the chain, or the final completion.
fn unwind(mut st: Box<IoState>, result: IoResult) {
    match st.hooks.pop() {
        Some(h) => {
            st.pos = h.pos;
            (h.f)(Io { state: Some(st) }, result);
        }
        None => {
            if let Some(done) = st.done.take() {
                done(st.req, result);
            }
        }
    }
}

/// The stages from some position to the end, for requests a stage issues itself.
#[derive(Clone)]
pub struct Lower {
    chain: Arc<Chain>,
    pos: usize,
}

impl fmt::Debug for Lower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lower").field("from", &self.pos).finish()
    }
}

impl Lower {
    /// Sends `req` through the stages below; `done` runs once with the result, on whichever
    /// thread completes it (possibly this one, before `submit` returns).
    pub fn submit(&self, req: Request, done: impl FnOnce(Request, IoResult) + Send + 'static) {
        dispatch(Box::new(IoState {
            req,
            pos: self.pos,
            chain: self.chain.clone(),
            hooks: Vec::new(),
            done: Some(Box::new(done)),
        }));
    }

    /// Sends `req` through the stages below and waits for the result. For threads that may
    /// block (a [`Serialized`] stage's thread, shutdown); never call it from `submit` or a
    /// hook.
    pub fn run(&self, req: &mut Request) -> IoResult {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(req.take(), move |r, res| {
            let _ = tx.send((r, res));
        });
        match rx.recv() {
            Ok((r, res)) => {
                *req = r;
                res
            }
            // Completion is guaranteed (Io's Drop); only a leaked Io gets here.
            Err(_) => Err(StageError::Stage {
                stage: "pipeline".into(),
                reason: "a request below was lost without completion".into(),
            }),
        }
    }
}

/// An ordered list of stages ending with a terminal stage.
pub struct Pipeline {
    chain: Arc<Chain>,
}

impl fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stage_names())
            .finish()
    }
}

impl Pipeline {
    /// A pipeline whose terminal is a synchronous [`Terminal`] run inline (tests, RAM disks).
    pub fn new(terminal: Box<dyn Terminal>) -> Self {
        Self::with_terminal(Box::new(Inline::new(terminal)))
    }

    /// A pipeline whose terminal is an asynchronous stage (e.g. [`crate::file::FileStage`]).
    pub fn with_terminal(terminal: Box<dyn Stage>) -> Self {
        Self {
            chain: Arc::new(Chain {
                stages: vec![terminal],
            }),
        }
    }

    /// Appends a stage in front of the terminal; it runs after every stage pushed before it.
    /// Only possible before the first request: later calls are refused with an error.
    pub fn push(&mut self, stage: Box<dyn Stage>) -> Result<(), StageError> {
        let name = stage.name().to_owned();
        let chain = Arc::get_mut(&mut self.chain).ok_or(StageError::Stage {
            stage: name,
            reason: "stages can only be added before the pipeline runs".into(),
        })?;
        let at = chain.stages.len().saturating_sub(1);
        chain.stages.insert(at, stage);
        Ok(())
    }

    /// Names of the stages in order, the terminal last.
    pub fn stage_names(&self) -> Vec<String> {
        self.chain
            .stages
            .iter()
            .map(|s| s.name().to_owned())
            .collect()
    }

    /// Sends `req` through every stage; `done` runs once with the result.
    pub fn submit(&self, req: Request, done: impl FnOnce(Request, IoResult) + Send + 'static) {
        self.lower_from(0).submit(req, done);
    }

    /// Sends `req` through every stage and waits for the result (tests, tools).
    pub fn run(&self, req: &mut Request) -> IoResult {
        self.lower_from(0).run(req)
    }

    fn lower_from(&self, pos: usize) -> Lower {
        Lower {
            chain: self.chain.clone(),
            pos,
        }
    }

    /// Asks every stage to let go of the requests it holds (see [`Stage::release`]).
    pub fn release(&self) {
        for s in &self.chain.stages {
            s.release();
        }
    }

    /// Calls [`Stage::shutdown`] on every stage, front to back, each with the stages after it
    /// as its `lower`. Every stage is called even if an earlier one failed; the first error is
    /// returned. Call it after in-flight requests have completed.
    pub fn shutdown(&self) -> Result<(), StageError> {
        let mut first_err = None;
        for (i, s) in self.chain.stages.iter().enumerate() {
            if let Err(e) = s.shutdown(&self.lower_from(i + 1)) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

// ---------------------------------------------------------------------------------------------
// Synchronous stages and terminals.

/// The rest of the pipeline as seen from a [`SyncStage`].
pub trait Next {
    /// Runs the remaining stages on `req` and returns their status.
    fn run(&mut self, req: &mut Request) -> IoResult;
}

/// A stage written in the synchronous style: it calls `next.run(req)` (any number of times,
/// also with requests of its own) and returns a status. Wrapped in [`Serialized`] it runs on
/// its own thread, one request at a time, so it may keep state in `&mut self` without locks.
/// Choose it for logic that needs several dependent I/Os per request (a cache filling and
/// writing back blocks); prefer [`Stage`] for everything that can decide from one request.
pub trait SyncStage: Send {
    /// Short name used in logs and metrics.
    fn name(&self) -> &str;

    /// Handles one request.
    fn process(&mut self, req: &mut Request, next: &mut dyn Next) -> IoResult;

    /// Like [`Stage::shutdown`].
    fn shutdown(&mut self, next: &mut dyn Next) -> Result<(), StageError> {
        let _ = next;
        Ok(())
    }
}

/// A synchronous end of a pipeline (e.g. an in-memory disk for tests).
pub trait Terminal: Send {
    /// Short name used in logs.
    fn name(&self) -> &str;

    /// Performs the I/O described by `req`.
    fn execute(&mut self, req: &mut Request) -> IoResult;
}

/// [`Next`] over the stages below, waiting for each result.
struct BlockingNext {
    lower: Lower,
}

impl Next for BlockingNext {
    fn run(&mut self, req: &mut Request) -> IoResult {
        self.lower.run(req)
    }
}

/// A [`Terminal`] as the last stage, executed inline under a lock. Only for terminals that do
/// not wait (RAM); the image file uses [`crate::file::FileStage`].
struct Inline {
    name: String,
    terminal: Mutex<Box<dyn Terminal>>,
}

impl Inline {
    fn new(terminal: Box<dyn Terminal>) -> Self {
        Self {
            name: terminal.name().to_owned(),
            terminal: Mutex::new(terminal),
        }
    }
}

impl Stage for Inline {
    fn name(&self) -> &str {
        &self.name
    }

    fn submit(&self, mut io: Io) {
        let req = io.request_mut();
        let now = Some(Instant::now());
        (req.timeline.terminal, req.timeline.io_start) = (now, now);
        let result = self
            .terminal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .execute(req);
        req.timeline.io_end = Some(Instant::now());
        io.complete(result);
    }
}

/// What a [`Serialized`] stage's thread is asked to do.
enum Msg {
    Io(Io),
    Shutdown(Lower, mpsc::SyncSender<Result<(), StageError>>),
}

/// Runs a [`SyncStage`] on a thread of its own: requests queue in a channel (not behind a
/// lock) and are processed one at a time; the stage's calls below go through the asynchronous
/// stages, so only requests for this stage wait for it.
pub struct Serialized {
    name: String,
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for Serialized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Serialized")
            .field("name", &self.name)
            .finish()
    }
}

impl Serialized {
    /// Starts the stage's thread. Fails only if the thread cannot be created.
    pub fn new<S: SyncStage + 'static>(stage: S) -> Result<Self, StageError> {
        let name = stage.name().to_owned();
        let (tx, rx) = mpsc::channel::<Msg>();
        let thread = std::thread::Builder::new()
            .name(format!("vmsight-{name}"))
            .spawn(move || serve_serialized(stage, rx))
            .map_err(|e| StageError::Stage {
                stage: name.clone(),
                reason: format!("cannot start its thread: {e}"),
            })?;
        Ok(Self {
            name,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn send(&self, msg: Msg) -> Result<(), Msg> {
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        match tx.as_ref() {
            Some(tx) => tx.send(msg).map_err(|e| e.0),
            None => Err(msg),
        }
    }
}

/// The loop of a [`Serialized`] stage's thread.
fn serve_serialized<S: SyncStage>(mut stage: S, rx: mpsc::Receiver<Msg>) {
    for msg in rx {
        match msg {
            Msg::Io(mut io) => {
                let mut next = BlockingNext { lower: io.lower() };
                let result = stage.process(io.request_mut(), &mut next);
                io.complete(result);
            }
            Msg::Shutdown(lower, reply) => {
                let result = stage.shutdown(&mut BlockingNext { lower });
                let _ = reply.send(result);
            }
        }
    }
}

impl Stage for Serialized {
    fn name(&self) -> &str {
        &self.name
    }

    fn submit(&self, io: Io) {
        if let Err(Msg::Io(io)) = self.send(Msg::Io(io)) {
            io.complete(Err(StageError::Stage {
                stage: self.name.clone(),
                reason: "the stage's thread has stopped".into(),
            }));
        }
    }

    fn shutdown(&self, lower: &Lower) -> Result<(), StageError> {
        let (tx, rx) = mpsc::sync_channel(1);
        if self.send(Msg::Shutdown(lower.clone(), tx)).is_err() {
            return Ok(());
        }
        rx.recv().unwrap_or_else(|_| {
            Err(StageError::Stage {
                stage: self.name.clone(),
                reason: "the stage's thread ended during shutdown".into(),
            })
        })
    }
}

impl Drop for Serialized {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has served what is queued.
        drop(
            self.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() && t.join().is_err() {
                warn!(stage = %self.name, "the stage's thread panicked");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
