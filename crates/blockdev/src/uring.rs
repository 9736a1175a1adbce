//! The image file as the terminal stage, through io_uring instead of a pool of I/O threads.
//!
//! Reads, writes and flushes are submitted to one io_uring per disk from the thread that hands
//! the request to this stage (normally the virtqueue's worker thread): no user-space hand-off
//! between the guest's kick and the system call. A completion that is ready when the
//! submission returns (a read from the host's page cache, a write the page cache absorbs) is
//! completed right there, on the same thread, before the worker goes back to its queue. Every
//! completion also signals an eventfd registered with the ring (for an inline one, the next wait
//! returns at once and finds nothing). `IORING_REGISTER_EVENTFD_ASYNC` would spare that, but it
//! signals only completions posted by io-wq workers, never the task work that completes an
//! O_DIRECT request, so requests waited forever with it. Who waits on the eventfd is the
//! owner's choice ([`Reaping`]):
//!
//! * [`Reaping::External`]: the disk's virtqueue worker adds it to its own epoll set and calls
//!   [`UringEvents::handle`] when it is readable, as qemu-storage-daemon's event loop does. The
//!   kernel posts an O_DIRECT request's completion as task work of the thread that submitted it,
//!   which interrupts that thread's `epoll_wait`; with the eventfd in the same epoll set the one
//!   wake-up both posts and handles the completion (a separate reaper thread would be a second
//!   wake-up).
//! * [`Reaping::Thread`]: a thread of the stage's own waits on it (a stage used without a
//!   device, the tests).
//!
//! ```text
//! submit(io):       lock ring, push SQE, io_uring_enter, take ready CQEs, unlock -> complete them
//! eventfd readable: lock ring, take CQEs, unlock -> complete / resubmit the rest
//! ```
//!
//! Discards, write-zeroes and requests with more than `IOV_MAX` buffers are rare and go to a
//! one-thread [`FileStage`] beside the ring, which keeps [`RawFile`]'s fallbacks for them (no
//! hole punching, no `ZERO_RANGE`). Short transfers are resubmitted for the rest; `EINVAL`
//! from an `O_DIRECT` request moves to buffered I/O exactly as the pool does; `EAGAIN` and
//! `EINTR` are retried a bounded number of times.
//!
//! The ring is behind a mutex held only to push submissions and take completions, never while
//! a request waits or a completion runs (a completion may submit again into this stage).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use slab::Slab;
use tracing::{debug, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::error::BlockError;
use crate::file::{advance, FileStage, RawFile, IOV_MAX};
use crate::pipeline::{Io, Stage, StageError, Status};
use crate::request::RequestKind;

/// Name of the io_uring image stage (the pool's is [`crate::file::FILE_STAGE`]).
pub const URING_STAGE: &str = "raw-file-uring";

/// Submission queue entries per disk; the completion queue has twice as many. Requests beyond
/// what the completion queue can hold wait in a queue of their own, so completions never
/// overflow.
const RING_ENTRIES: u32 = 256;
/// Times one request is resubmitted after `EAGAIN`/`EINTR` before it fails.
const MAX_RETRIES: u32 = 64;
/// How long dropping the stage waits for requests still in the ring.
const DROP_WAIT: Duration = Duration::from_secs(5);

/// What one ring operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Flush,
}

impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::Read => "preadv (io_uring)",
            OpKind::Write => "pwritev (io_uring)",
            OpKind::Flush => "fdatasync (io_uring)",
        }
    }
}

/// One request in the ring: the request itself and where its transfer stands.
struct Op {
    io: Io,
    kind: OpKind,
    /// The buffers still to transfer (advanced after a short transfer). The kernel reads this
    /// array while the operation is in the ring; the `Vec`'s buffer does not move meanwhile.
    iovs: Vec<libc::iovec>,
    /// Exhausted entries at the front of `iovs`.
    first: usize,
    /// File offset of the next byte to transfer.
    offset: u64,
    /// The operation in the ring uses the `O_DIRECT` descriptor.
    direct: bool,
    retries: u32,
}

// SAFETY: `Op` is not `Send` only because of the raw pointers in `iovs`. They point into guest
// memory that the request inside `io` keeps mapped (see `RawFile::guest_iovecs`); no Rust
// reference to that memory exists, and only the kernel dereferences the pointers, on whichever
// thread submitted them. Moving the `Op` between threads moves nothing they point to.
unsafe impl Send for Op {}

impl Op {
    fn remaining(&self) -> &[libc::iovec] {
        self.iovs.get(self.first..).unwrap_or(&[])
    }
}

/// The ring and what is in it.
struct Ring {
    uring: IoUring,
    /// Operations in the ring, keyed by their `user_data`.
    inflight: Slab<Op>,
    /// Operations waiting for room in the completion queue.
    waiting: VecDeque<Op>,
}

/// State shared by the submitting threads and whoever reaps (the queue worker or a reaper thread).
struct Shared {
    file: Arc<RawFile>,
    ring: Mutex<Ring>,
    /// Signalled by the kernel for completions that happen after submission returned.
    event: EventFd,
    stopping: AtomicBool,
    /// Most operations in the ring at once (the completion queue's size).
    capacity: usize,
}

/// Who handles the completions the kernel posts after submission returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaping {
    /// A thread of the stage's own.
    Thread,
    /// The caller, through the [`UringEvents`] that [`UringStage::new`] returns.
    External,
}

/// The completion side of a [`UringStage`] for an event loop that reaps it
/// ([`Reaping::External`]).
#[derive(Clone)]
pub struct UringEvents(Arc<Shared>);

impl std::fmt::Debug for UringEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEvents")
            .field("fd", &self.fd())
            .finish()
    }
}

impl UringEvents {
    /// The eventfd that becomes readable when completions wait (add it to an epoll set).
    pub fn fd(&self) -> RawFd {
        self.0.event.as_raw_fd()
    }

    /// Takes and handles every completion that is ready; never blocks.
    pub fn handle(&self) {
        self.0.handle_events();
    }

    /// Waits up to `timeout` for completions and handles them (for a drain after the event
    /// loop stopped). Returns whether any arrived.
    pub fn wait(&self, timeout: Duration) -> bool {
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        let ready = self.0.poll_event(ms);
        if ready {
            self.0.handle_events();
        }
        ready
    }
}

/// The image file served through io_uring. See the module documentation.
pub struct UringStage {
    shared: Arc<Shared>,
    fallback: FileStage,
    reaper: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UringStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringStage")
            .field("path", &self.shared.file.path())
            .finish()
    }
}

impl UringStage {
    /// Serves `file` through a new io_uring whose late completions are reaped as `reaping`
    /// says (the [`UringEvents`] are for [`Reaping::External`]; with a thread nobody needs
    /// them). Fails if the kernel refuses io_uring (too old, `kernel.io_uring_disabled`, a
    /// seccomp profile) with the reason.
    pub fn new(file: RawFile, reaping: Reaping) -> Result<(Self, UringEvents), BlockError> {
        let file = Arc::new(file);
        let unusable = |what: &str, e: io::Error| BlockError::Uring {
            path: file.path().to_owned(),
            reason: format!("{what}: {e}"),
        };
        let uring = IoUring::builder()
            .setup_cqsize(RING_ENTRIES * 2)
            .build(RING_ENTRIES)
            .map_err(|e| unusable("io_uring_setup failed", e))?;
        let event =
            EventFd::new(EFD_NONBLOCK).map_err(|e| unusable("cannot create its eventfd", e))?;
        uring
            .submitter()
            .register_eventfd(event.as_raw_fd())
            .map_err(|e| unusable("cannot register its eventfd", e))?;
        let capacity = uring.params().cq_entries() as usize;
        let shared = Arc::new(Shared {
            file: file.clone(),
            ring: Mutex::new(Ring {
                uring,
                inflight: Slab::with_capacity(capacity),
                waiting: VecDeque::new(),
            }),
            event,
            stopping: AtomicBool::new(false),
            capacity,
        });
        let fallback = FileStage::with_shared(file.clone(), 1)?;
        let reaper = match reaping {
            Reaping::External => None,
            Reaping::Thread => {
                let reaper_shared = shared.clone();
                let t = std::thread::Builder::new()
                    .name("vmsight-uring".into())
                    .stack_size(256 << 10)
                    .spawn(move || {
                        vmsight_vhostd::seccomp::install_once(
                            vmsight_vhostd::seccomp::ThreadClass::IoPool,
                        );
                        reaper_shared.reap_loop()
                    })
                    .map_err(|source| BlockError::Thread {
                        path: file.path().to_owned(),
                        source,
                    })?;
                Some(t)
            }
        };
        let events = UringEvents(shared.clone());
        Ok((
            Self {
                shared,
                fallback,
                reaper,
            },
            events,
        ))
    }
}

impl Stage for UringStage {
    fn name(&self) -> &str {
        URING_STAGE
    }

    fn submit(&self, mut io: Io) {
        let now = Some(Instant::now());
        let t = &mut io.request_mut().timeline;
        (t.terminal, t.io_start) = (now, now);
        let req = io.request();
        let kind = match req.kind {
            RequestKind::Read => OpKind::Read,
            RequestKind::Write => OpKind::Write,
            RequestKind::Flush if self.shared.file.is_read_only() => {
                return io.complete(Ok(Status::Ok));
            }
            RequestKind::Flush => OpKind::Flush,
            RequestKind::Discard | RequestKind::WriteZeroes | RequestKind::GetId => {
                return self.fallback.submit(io);
            }
        };
        if self.shared.file.is_read_only() && kind == OpKind::Write {
            // Validation already refuses these; this is a second line of defence.
            return io.complete(Ok(Status::IoErr));
        }
        let iovs = match kind {
            OpKind::Flush => Vec::new(),
            _ => match RawFile::guest_iovecs(io.request_mut()) {
                Ok(v) => v,
                Err(e) => return io.complete(Err(e)),
            },
        };
        if iovs.len() > IOV_MAX {
            return self.fallback.submit(io);
        }
        let offset = io.request().offset();
        let op = Op {
            io,
            kind,
            iovs,
            first: 0,
            offset,
            direct: false,
            retries: 0,
        };
        self.shared.run(vec![op]);
    }

    fn release(&self) {
        self.fallback.release();
    }
}

impl Drop for UringStage {
    fn drop(&mut self) {
        // The device drained every request before dropping its pipeline; wait (bounded) for
        // any a stage above issued on its own, then stop the reaper.
        let deadline = Instant::now() + DROP_WAIT;
        while Instant::now() < deadline {
            if self.shared.lock().inflight.is_empty() {
                break;
            }
            if self.reaper.is_some() {
                std::thread::sleep(Duration::from_millis(5));
            } else if self.shared.poll_event(5) {
                self.shared.handle_events();
            }
        }
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = self.shared.event.write(1);
        if let Some(t) = self.reaper.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        let left = self.shared.lock().inflight.len();
        if left > 0 {
            // Their `Io`s complete with an error when the slab drops; the kernel cancels the
            // operations when the ring closes (the guest memory they name stays mapped by QEMU).
            warn!(path = %self.shared.file.path().display(), left, "io_uring stage stopped with requests in flight");
        }
    }
}

/// What the kernel said about one operation.
struct Completion {
    op: Op,
    result: i32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Submits `ops`, then completes or resubmits whatever is ready, until nothing is left to
    /// do on this thread.
    fn run(&self, mut ops: Vec<Op>) {
        while !ops.is_empty() {
            let ready = self.submit_and_take(std::mem::take(&mut ops));
            for c in ready {
                if let Some(op) = self.finish(c) {
                    ops.push(op);
                }
            }
        }
    }

    /// Pushes `ops` into the ring (or its waiting queue), enters the kernel once, and takes the
    /// completions that are ready.
    fn submit_and_take(&self, ops: Vec<Op>) -> Vec<Completion> {
        let mut failed = Vec::new();
        let ready = {
            let mut ring = self.lock();
            ring.waiting.extend(ops);
            let mut ready = Vec::new();
            loop {
                let before = ring.waiting.len();
                self.fill(&mut ring, &mut failed);
                if let Err(e) = ring.uring.submit() {
                    // EBUSY/EAGAIN: the kernel is short of room; what is not submitted goes
                    // in with the next io_uring_enter (after the next completion).
                    if !matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) {
                        warn!(path = %self.file.path().display(), error = %e, "io_uring_enter failed");
                    }
                }
                ready.extend(self.take(&mut ring));
                // Completions taken here free room: go round while that lets waiting
                // requests in. Those still waiting after this go in when a completion that
                // is still in the ring arrives.
                if ring.waiting.is_empty() || ring.waiting.len() == before {
                    break;
                }
            }
            ready
        };
        for (op, e) in failed {
            op.io.complete(Err(StageError::Io {
                op: op.kind.name(),
                source: e,
            }));
        }
        ready
    }

    /// Moves waiting operations into the ring while the completion queue has room for them.
    fn fill(&self, ring: &mut Ring, failed: &mut Vec<(Op, io::Error)>) {
        while ring.inflight.len() < self.capacity {
            let Some(mut op) = ring.waiting.pop_front() else {
                return;
            };
            let entry = match self.entry(&mut op) {
                Ok(e) => e,
                Err(e) => {
                    failed.push((op, e));
                    continue;
                }
            };
            let key = ring.inflight.insert(op);
            let entry = entry.user_data(key as u64);
            let pushed = {
                let mut sq = ring.uring.submission();
                // SAFETY: the SQE names the iovec array and guest buffers of the `Op` stored
                // under `key` in `inflight`, where it stays (neither moved nor dropped) until
                // its completion is taken; the descriptors belong to `self.file`, which the
                // `Arc` keeps open as long as the ring exists.
                unsafe { sq.push(&entry) }.is_ok()
            };
            if !pushed {
                // The submission queue is full: enter the kernel to make room, then retry.
                let _ = ring.uring.submit();
                let mut sq = ring.uring.submission();
                // SAFETY: as above.
                if unsafe { sq.push(&entry) }.is_err() {
                    drop(sq);
                    let op = ring.inflight.remove(key);
                    ring.waiting.push_front(op);
                    return;
                }
            }
        }
    }

    /// The submission entry for the next part of `op`.
    fn entry(&self, op: &mut Op) -> io::Result<io_uring::squeue::Entry> {
        let direct = match op.kind {
            OpKind::Flush => None,
            _ => self.file.direct_fd_for(op.offset, op.remaining()),
        };
        op.direct = direct.is_some();
        let fd = types::Fd(direct.unwrap_or_else(|| self.file.buffered_fd()));
        let rest = op.remaining();
        let n = u32::try_from(rest.len()).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?;
        Ok(match op.kind {
            OpKind::Read => opcode::Readv::new(fd, rest.as_ptr(), n)
                .offset(op.offset)
                .build(),
            OpKind::Write => opcode::Writev::new(fd, rest.as_ptr(), n)
                .offset(op.offset)
                .build(),
            OpKind::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        })
    }

    /// Takes every completion the kernel has posted.
    fn take(&self, ring: &mut Ring) -> Vec<Completion> {
        let done: Vec<(u64, i32)> = ring
            .uring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut out = Vec::with_capacity(done.len());
        for (key, result) in done {
            match usize::try_from(key)
                .ok()
                .and_then(|k| ring.inflight.try_remove(k))
            {
                Some(op) => out.push(Completion { op, result }),
                None => warn!(key, "io_uring completion for an unknown operation"),
            }
        }
        out
    }

    /// Handles one completion: completes the request, or returns the operation to submit again
    /// (the rest of a short transfer, a retry, buffered I/O after `O_DIRECT` refused it).
    fn finish(&self, c: Completion) -> Option<Op> {
        let Completion { mut op, result } = c;
        op.io.request_mut().timeline.io_end = Some(Instant::now());
        if result < 0 {
            let errno = -result;
            if errno == libc::EINVAL && op.direct {
                self.file.direct_refused();
                return Some(op);
            }
            if matches!(errno, libc::EAGAIN | libc::EINTR) && op.retries < MAX_RETRIES {
                op.retries += 1;
                return Some(op);
            }
            op.io.complete(Err(StageError::Io {
                op: op.kind.name(),
                source: io::Error::from_raw_os_error(errno),
            }));
            return None;
        }
        if op.kind == OpKind::Flush {
            op.io.complete(Ok(Status::Ok));
            return None;
        }
        let n = result as usize;
        if n == 0 {
            // A transfer of nothing with bytes left: the image is shorter than the disk.
            op.io.complete(Err(StageError::Io {
                op: op.kind.name(),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the image ended early (was it truncated while in use?)",
                ),
            }));
            return None;
        }
        op.offset += n as u64;
        let first = op.first;
        if let Some(rest) = op.iovs.get_mut(first..) {
            op.first += advance(rest, n);
        }
        if op.remaining().iter().all(|v| v.iov_len == 0) {
            op.io.complete(Ok(Status::Ok));
            return None;
        }
        debug!(path = %self.file.path().display(), done = n, "short io_uring transfer; submitting the rest");
        Some(op)
    }

    /// Waits up to `ms` milliseconds (-1: forever) for the eventfd to become readable.
    fn poll_event(&self, ms: libc::c_int) -> bool {
        let mut poll = libc::pollfd {
            fd: self.event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `poll` is a valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut poll, 1, ms) };
        rc > 0
    }

    /// Clears the eventfd, takes every completion, handles them, and submits what they and
    /// the waiting queue leave to do.
    fn handle_events(&self) {
        let _ = self.event.read();
        let ready = {
            let mut ring = self.lock();
            self.take(&mut ring)
        };
        let mut again = Vec::new();
        for c in ready {
            if let Some(op) = self.finish(c) {
                again.push(op);
            }
        }
        // Resubmissions, and requests that waited for room in the completion queue.
        if !again.is_empty() || !self.lock().waiting.is_empty() {
            let ready = self.submit_and_take(again);
            let mut more = Vec::new();
            for c in ready {
                if let Some(op) = self.finish(c) {
                    more.push(op);
                }
            }
            self.run(more);
        }
    }

    /// The reaper thread ([`Reaping::Thread`]): handles completions until stopped.
    fn reap_loop(&self) {
        while !self.stopping.load(Ordering::SeqCst) {
            if self.poll_event(-1) {
                self.handle_events();
            }
        }
    }
}

/// Whether this kernel lets this process use io_uring (for choosing the engine by default).
pub fn available() -> bool {
    IoUring::new(2).is_ok()
}

#[cfg(test)]
mod tests;
