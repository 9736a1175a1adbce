//! The vhost-user-blk device: features, config space, queue handling with EVENT_IDX, and the
//! glue from descriptor chains through validation and the pipeline to the used ring.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{DescriptorChain, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::metrics::{add, inc, BlockMetrics};
use crate::pipeline::{IoResult, Pipeline, StageError, Status};
use crate::request::{
    self, Limits, Parsed, Request, RequestError, RequestKind, ID_BYTES, SECTOR_SIZE,
};
use crate::uring::UringEvents;

/// Guest memory as the vhost-user crates hand it to us.
pub(crate) type GuestMem = GuestMemoryAtomic<GuestMemoryMmap>;
/// The vring type used by this backend.
pub(crate) type Vring = VringRwLock<GuestMem>;

/// Size of `struct virtio_blk_config` up to and including `write_zeroes_may_unmap` + padding.
pub const CONFIG_SPACE_LEN: usize = 60;

/// Static description of the device, derived from the disk configuration.
#[derive(Debug, Clone)]
pub(crate) struct DeviceSpec {
    pub limits: Limits,
    pub num_queues: u16,
    pub queue_size: u16,
    pub serial: [u8; ID_BYTES],
}

/// Requests submitted to the pipeline and not yet completed, to drain at shutdown.
///
/// Entering and leaving are one atomic operation each: the mutex and condition variable are
/// touched only while somebody drains (`waiters > 0`), so the per-request path takes no lock.
#[derive(Default)]
pub(crate) struct Inflight {
    count: AtomicU64,
    /// Threads in `wait_idle`.
    waiters: AtomicU64,
    lock: Mutex<()>,
    idle: Condvar,
}

impl Inflight {
    fn enter(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    fn leave(&self) {
        let before = self
            .count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                Some(c.saturating_sub(1))
            })
            .unwrap_or(0);
        // SeqCst on both sides: either this sees the drainer's `waiters` or the drainer sees
        // the count reach 0 before it sleeps (it checks under `lock`, which we take to notify).
        if before <= 1 && self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.idle.notify_all();
        }
    }

    /// Waits until nothing is in flight or `timeout` passed; returns what is still in flight.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let left = self.count.load(Ordering::SeqCst);
            let now = Instant::now();
            if left == 0 || now >= deadline {
                drop(g);
                self.waiters.fetch_sub(1, Ordering::SeqCst);
                return left;
            }
            g = self
                .idle
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// How long a stopping backend waits for requests in flight before giving up on them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The vhost-user-blk backend of one disk.
pub(crate) struct BlockDevice {
    spec: DeviceSpec,
    config: [u8; CONFIG_SPACE_LEN],
    pipeline: Pipeline,
    metrics: Arc<BlockMetrics>,
    inflight: Arc<Inflight>,
    mem: vmsight_vhostd::MemorySlot,
    event_idx: AtomicBool,
    next_id: AtomicU64,
    /// The io_uring stage's completions and the worker event id they arrive under.
    uring: Option<(UringEvents, u16)>,
}

/// Where a completed request goes: the used ring of its queue.
struct UsedRing {
    vring: Vring,
    queue: u16,
    metrics: Arc<BlockMetrics>,
}

impl UsedRing {
    /// Adds `head` with `len` to the used ring and interrupts the guest if it wants one
    /// (EVENT_IDX aware). Callable from any thread, in any order.
    fn add(&self, head: u16, len: u32) {
        if let Err(e) = self.vring.add_used(head, len) {
            error!(queue = self.queue, error = %e, "cannot add to the used ring");
            inc(&self.metrics.err_queue);
            return;
        }
        match self.vring.needs_notification() {
            Ok(false) => {}
            Ok(true) | Err(_) => {
                if let Err(e) = self.vring.signal_used_queue() {
                    debug!(queue = self.queue, error = %e, "cannot signal the used queue");
                } else {
                    inc(&self.metrics.notifications);
                }
            }
        }
    }
}

/// Everything needed to answer one request when the pipeline is done with it.
struct Reply {
    metrics: Arc<BlockMetrics>,
    inflight: Arc<Inflight>,
    status_addr: GuestAddress,
    started: Instant,
}

impl Reply {
    /// Writes the status byte, counts the request and returns the used length.
    fn finish(self, req: &Request, result: IoResult) -> u32 {
        let (status, data_len) = outcome(&self.metrics, req, result);
        self.metrics.count_kind(req.kind);
        let used = write_status(
            &self.metrics,
            req.memory(),
            self.status_addr,
            status,
            data_len,
        );
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        let now = Instant::now();
        add(
            &self.metrics.latency_ns_total,
            u64::try_from(now.saturating_duration_since(self.started).as_nanos())
                .unwrap_or(u64::MAX),
        );
        self.metrics
            .hand_offs
            .record(self.started, &req.timeline, now);
        self.inflight.leave();
        used
    }
}

/// The status and data length the guest gets for a pipeline result; counts bytes and errors.
fn outcome(metrics: &BlockMetrics, req: &Request, result: IoResult) -> (Status, u32) {
    match result {
        Ok(Status::Ok) => {
            match req.kind {
                RequestKind::Read => add(&metrics.bytes_read, req.len),
                RequestKind::Write => add(&metrics.bytes_written, req.len),
                RequestKind::Discard => add(&metrics.bytes_discarded, req.len),
                RequestKind::WriteZeroes => add(&metrics.bytes_zeroed, req.len),
                RequestKind::Flush | RequestKind::GetId => {}
            }
            let data = match req.kind {
                RequestKind::Read => u32::try_from(req.len).unwrap_or(u32::MAX - 1),
                RequestKind::GetId => req.len.min(ID_BYTES as u64) as u32,
                _ => 0,
            };
            (Status::Ok, data)
        }
        Ok(other) => {
            if other == Status::Unsupp {
                inc(&metrics.err_unsupported);
            } else {
                inc(&metrics.err_stage);
            }
            (other, 0)
        }
        Err(e) => {
            match e {
                StageError::Io { .. } => inc(&metrics.err_io),
                _ => inc(&metrics.err_stage),
            }
            warn!(queue = req.queue, kind = ?req.kind, sector = req.sector, len = req.len, error = %e, "block request failed");
            (Status::IoErr, 0)
        }
    }
}

/// Writes the status byte and computes the used length (data bytes + status byte).
fn write_status(
    metrics: &BlockMetrics,
    mem: &GuestMemoryMmap,
    addr: GuestAddress,
    status: Status,
    data_len: u32,
) -> u32 {
    if mem.write_obj(status.as_u8(), addr).is_err() {
        // Validated as mapped during parsing; only a concurrent memory change gets here.
        inc(&metrics.err_unusable_chain);
        return 0;
    }
    if status == Status::Ok {
        inc(&metrics.completed_ok);
    }
    data_len.saturating_add(1)
}

impl BlockDevice {
    pub(crate) fn new(spec: DeviceSpec, pipeline: Pipeline, metrics: Arc<BlockMetrics>) -> Self {
        let config = config_space(&spec);
        Self {
            spec,
            config,
            pipeline,
            metrics,
            inflight: Arc::default(),
            mem: vmsight_vhostd::MemorySlot::default(),
            event_idx: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            uring: None,
        }
    }

    /// Handles the io_uring stage's completions when the worker sees `events` under its id.
    pub(crate) fn with_uring(mut self, uring: Option<(UringEvents, u16)>) -> Self {
        self.uring = uring;
        self
    }

    /// Waits (bounded) until no request is in flight; with an io_uring stage this thread reaps
    /// its completions meanwhile, the queue worker that did it having stopped. Returns what is
    /// still in flight.
    fn drain(&self) -> u64 {
        let Some((events, _)) = &self.uring else {
            return self.inflight.wait_idle(DRAIN_TIMEOUT);
        };
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        loop {
            let left = self.inflight.wait_idle(Duration::ZERO);
            if left == 0 || Instant::now() >= deadline {
                return left;
            }
            events.wait(Duration::from_millis(10));
        }
    }

    /// Stops the pipeline once no more requests can arrive: stages let go of what they hold,
    /// in-flight requests complete (bounded wait), then every stage writes out what it still
    /// keeps (e.g. a write-back cache's dirty blocks). Failures are logged, there is nobody
    /// left to tell.
    pub(crate) fn shutdown_pipeline(&self) {
        self.pipeline.release();
        let left = self.drain();
        if left > 0 {
            warn!(
                requests = left,
                "requests still in flight after the drain timeout"
            );
        }
        if let Err(e) = self.pipeline.shutdown() {
            warn!(error = %e, "a pipeline stage failed to shut down cleanly");
        }
    }

    /// Virtio feature bits offered to the driver.
    pub(crate) fn virtio_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX)
            | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_DISCARD)
            | (1u64 << VIRTIO_BLK_F_WRITE_ZEROES)
            | (1u64 << VIRTIO_BLK_F_MQ);
        if self.spec.limits.read_only {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        f
    }

    /// Takes one descriptor chain; `on_used(len)` runs exactly once with the used length to
    /// report, now (invalid chains, GET_ID) or when the pipeline completes the request, on
    /// whichever thread does.
    pub(crate) fn submit_chain<M>(
        &self,
        chain: DescriptorChain<M>,
        mem: &GuestMemoryMmap,
        queue: u16,
        on_used: impl FnOnce(u32) + Send + 'static,
    ) where
        M: std::ops::Deref,
        M::Target: vm_memory::GuestMemory,
    {
        let started = Instant::now();
        let (mut req, status_addr) = match request::parse(chain, mem, &self.spec.limits) {
            Parsed::Request { req, status } => (req, status),
            Parsed::Rejected { error, status } => {
                self.count_rejection(&error);
                debug!(queue, %error, "rejecting virtio-blk request");
                let st = error.status().unwrap_or(Status::IoErr);
                return on_used(write_status(&self.metrics, mem, status, st, 0));
            }
            Parsed::Unusable(error) => {
                inc(&self.metrics.err_unusable_chain);
                debug!(queue, %error, "returning unusable descriptor chain with length 0");
                return on_used(0);
            }
        };
        req.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        req.queue = queue;
        req.submitted_at = started;
        inc(&self.metrics.in_flight);
        self.inflight.enter();
        let reply = Reply {
            metrics: self.metrics.clone(),
            inflight: self.inflight.clone(),
            status_addr,
            started,
        };
        if req.kind == RequestKind::GetId {
            // Device identity, not storage: answered here, outside the pipeline.
            let result = self.answer_get_id(&req);
            return on_used(reply.finish(&req, result));
        }
        self.pipeline.submit(req, move |req, result| {
            on_used(reply.finish(&req, result));
        });
    }

    /// Writes the serial into a GET_ID request's buffer.
    fn answer_get_id(&self, req: &Request) -> IoResult {
        let n = usize::try_from(req.len).unwrap_or(ID_BYTES).min(ID_BYTES);
        let id = self.spec.serial.get(..n).unwrap_or(&[]);
        req.write_data(0, id)?;
        Ok(Status::Ok)
    }

    fn count_rejection(&self, error: &RequestError) {
        match error {
            RequestError::ReadOnly { .. } => inc(&self.metrics.err_read_only),
            e if e.status() == Some(Status::Unsupp) => inc(&self.metrics.err_unsupported),
            _ => inc(&self.metrics.err_invalid_request),
        }
    }

    /// Drains one vring: takes every available chain and submits it; completions reach the
    /// used ring (and the guest's interrupt) as each finishes, in any order. Never fails:
    /// guest-induced errors are counted and logged, so the worker thread survives any guest.
    pub(crate) fn process_vring(&self, vring: &Vring, queue: u16) {
        let atomic = self.mem.get();
        let Some(atomic) = atomic else {
            warn!(queue, "queue kicked before the guest memory table was set");
            inc(&self.metrics.err_queue);
            return;
        };
        let guard = atomic.memory();
        let mem: &GuestMemoryMmap = &guard;
        let used = Arc::new(UsedRing {
            vring: vring.clone(),
            queue,
            metrics: self.metrics.clone(),
        });
        loop {
            if let Err(e) = vring.disable_notification() {
                debug!(queue, error = %e, "cannot disable notifications");
            }
            let chains: Vec<_> = {
                let mut state = vring.get_mut();
                match state.get_queue_mut().iter(mem) {
                    Ok(iter) => iter.collect(),
                    Err(e) => {
                        // E.g. the avail index jumped by more than the queue size.
                        error!(queue, error = %e, "virtqueue is corrupt; ignoring this kick");
                        inc(&self.metrics.err_queue);
                        return;
                    }
                }
            };
            for chain in chains {
                let head = chain.head_index();
                let used = used.clone();
                self.submit_chain(chain, mem, queue, move |len| used.add(head, len));
            }
            match vring.enable_notification() {
                // More chains arrived while notifications were off: go round again.
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    debug!(queue, error = %e, "cannot enable notifications");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
impl BlockDevice {
    /// Submits one chain and waits for its used length (tests).
    pub(crate) fn handle_chain<M>(
        &self,
        chain: DescriptorChain<M>,
        mem: &GuestMemoryMmap,
        queue: u16,
    ) -> u32
    where
        M: std::ops::Deref,
        M::Target: vm_memory::GuestMemory,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        self.submit_chain(chain, mem, queue, move |len| {
            let _ = tx.send(len);
        });
        rx.recv().unwrap_or(u32::MAX)
    }
}

/// Serialises `struct virtio_blk_config` (little endian, virtio 1.x layout).
fn config_space(spec: &DeviceSpec) -> [u8; CONFIG_SPACE_LEN] {
    let mut c = [0u8; CONFIG_SPACE_LEN];
    let mut put = |off: usize, bytes: &[u8]| {
        if let Some(dst) = c.get_mut(off..off + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    };
    let l = &spec.limits;
    put(0, &l.capacity_sectors.to_le_bytes()); // capacity
    put(8, &0u32.to_le_bytes()); // size_max (feature not offered)
    let seg_max = u32::from(spec.queue_size.saturating_sub(2).max(1));
    put(12, &seg_max.to_le_bytes()); // seg_max
                                     // 16..20 geometry (not offered)
    put(20, &(SECTOR_SIZE as u32).to_le_bytes()); // blk_size
                                                  // 24 physical_block_exp, 25 alignment_offset, 26 min_io_size, 28 opt_io_size (not offered)
                                                  // 32 wce (CONFIG_WCE not offered), 33 unused
    put(34, &spec.num_queues.to_le_bytes()); // num_queues
    put(36, &l.max_discard_sectors.to_le_bytes());
    put(40, &l.max_discard_seg.to_le_bytes());
    put(44, &8u32.to_le_bytes()); // discard_sector_alignment: 4 KiB
    put(48, &l.max_write_zeroes_sectors.to_le_bytes());
    put(52, &l.max_write_zeroes_seg.to_le_bytes());
    put(56, &[1u8]); // write_zeroes_may_unmap
    c
}

impl VhostUserBackend for BlockDevice {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        usize::from(self.spec.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.spec.queue_size)
    }

    fn features(&self) -> u64 {
        self.virtio_features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // Bytes past our struct read as zero (newer fields we do not offer).
        let mut out = vec![0u8; size as usize];
        let start = offset as usize;
        for (i, b) in out.iter_mut().enumerate() {
            if let Some(v) = start.checked_add(i).and_then(|j| self.config.get(j)) {
                *b = *v;
            }
        }
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        // Only `wce` is writable in virtio-blk, and CONFIG_WCE is not offered.
        debug!(offset, len = buf.len(), "ignoring config space write");
        Ok(())
    }

    fn update_memory(&self, mem: GuestMem) -> std::io::Result<()> {
        self.mem.set(mem);
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        vmsight_vhostd::exit_event()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> std::io::Result<()> {
        // The worker's first event comes once QEMU set the device up: filter it from then on.
        vmsight_vhostd::seccomp::install_once(vmsight_vhostd::seccomp::ThreadClass::VringWorker);
        if evset != EventSet::IN {
            debug!(device_event, ?evset, "ignoring unexpected event set");
            return Ok(());
        }
        if let Some((events, id)) = &self.uring {
            if device_event == *id {
                events.handle();
                return Ok(());
            }
        }
        match vrings.get(usize::from(device_event)) {
            Some(vring) => self.process_vring(vring, device_event),
            None => debug!(device_event, "event for an unknown queue"),
        }
        // Never return an error: it would end the worker thread for the whole device.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::RawFile;
    use crate::request::tests::{header, limits, mem, r, w, DATA, HDR, STATUS};
    use std::io::{Read, Seek, SeekFrom, Write};
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_WRITE_ZEROES,
    };
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    #[test]
    fn a_drain_returns_once_every_request_left_and_says_what_is_left_on_timeout() {
        let f = Arc::new(Inflight::default());
        assert_eq!(f.wait_idle(Duration::ZERO), 0);
        f.enter();
        // Timed out with one in flight: says so, after at least the timeout.
        let t = Instant::now();
        assert_eq!(f.wait_idle(Duration::from_millis(20)), 1);
        assert!(t.elapsed() >= Duration::from_millis(20));
        for _ in 0..4000 {
            f.enter();
        }
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let f = f.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        f.leave();
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        let last = {
            let f = f.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                f.leave();
            })
        };
        // Woken by the last leave, long before the 30 s.
        assert_eq!(f.wait_idle(Duration::from_secs(30)), 0);
        for w in workers {
            w.join().expect("worker");
        }
        last.join().expect("last");
        assert_eq!(f.waiters.load(Ordering::SeqCst), 0);
    }

    /// A 512 KiB image (1024 sectors) whose sector N is filled with byte N % 251.
    fn image() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tempfile");
        for s in 0..1024u32 {
            f.write_all(&[(s % 251) as u8; 512]).expect("fill");
        }
        f.flush().expect("flush");
        f
    }

    fn device(path: &std::path::Path, read_only: bool) -> BlockDevice {
        let file = RawFile::open(path, read_only, false).expect("open");
        let mut l = limits();
        l.read_only = read_only;
        let mut serial = [0u8; ID_BYTES];
        serial[..9].copy_from_slice(b"serial-42");
        let spec = DeviceSpec {
            limits: l,
            num_queues: 2,
            queue_size: 16,
            serial,
        };
        BlockDevice::new(
            spec,
            Pipeline::new(Box::new(file)),
            Arc::new(BlockMetrics::new()),
        )
    }

    /// Runs one chain through the device; returns (used len, status byte).
    fn run(dev: &BlockDevice, m: &GuestMemoryMmap, descs: &[RawDescriptor]) -> (u32, u8) {
        m.write_obj(0xffu8, GuestAddress(STATUS))
            .expect("poison status");
        let q = MockSplitQueue::new(m, 16);
        let chain = q.build_desc_chain(descs).expect("chain");
        let used = dev.handle_chain(chain, m, 0);
        let st: u8 = m.read_obj(GuestAddress(STATUS)).expect("status");
        (used, st)
    }

    fn file_bytes(path: &std::path::Path, off: u64, len: usize) -> Vec<u8> {
        let mut f = std::fs::File::open(path).expect("open");
        f.seek(SeekFrom::Start(off)).expect("seek");
        let mut v = vec![0u8; len];
        f.read_exact(&mut v).expect("read");
        v
    }

    #[test]
    fn read_fills_guest_memory_and_reports_length() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 3);
        let (used, st) = run(&dev, &m, &[r(HDR, 16), w(DATA, 1024), w(STATUS, 1)]);
        assert_eq!((used, st), (1025, 0));
        let mut buf = vec![0u8; 1024];
        m.read_slice(&mut buf, GuestAddress(DATA)).expect("read");
        assert!(buf[..512].iter().all(|&b| b == 3));
        assert!(buf[512..].iter().all(|&b| b == 4));
        let s = dev.metrics.snapshot();
        assert_eq!(
            (s.reads, s.bytes_read, s.completed_ok, s.in_flight),
            (1, 1024, 1, 0)
        );
    }

    #[test]
    fn the_service_time_of_a_request_that_reached_the_image_is_split_into_its_hand_offs() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 3);
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), w(DATA, 1024), w(STATUS, 1)]),
            (1025, 0)
        );
        // GET_ID never reaches the image: it is served without a timeline and not counted.
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        assert_eq!(run(&dev, &m, &[r(HDR, 16), w(DATA, 20), w(STATUS, 1)]).1, 0);
        let s = dev.metrics.snapshot();
        let h = s.hand_offs;
        assert_eq!((s.completed_ok, h.requests), (2, 1), "{h:?}");
        let parts = h.stages_ns + h.queued_ns + h.io_ns + h.completion_ns;
        assert!(h.io_ns > 0 && parts <= s.latency_ns_total, "{h:?} {s:?}");
    }

    #[test]
    fn write_reaches_the_image() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 10);
        m.write_slice(&[0x5a; 512], GuestAddress(DATA))
            .expect("data");
        let (used, st) = run(&dev, &m, &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]);
        assert_eq!((used, st), (1, 0));
        assert!(file_bytes(img.path(), 10 * 512, 512)
            .iter()
            .all(|&b| b == 0x5a));
        assert_eq!(dev.metrics.snapshot().bytes_written, 512);
    }

    #[test]
    fn many_small_segments_are_batched() {
        // More segments than IOV_MAX exercises the preadv batching and short-transfer loop.
        let img = image();
        let file = RawFile::open(img.path(), false, false).expect("open");
        let mut l = limits();
        l.max_chain_len = 2048;
        let spec = DeviceSpec {
            limits: l,
            num_queues: 1,
            queue_size: 2048,
            serial: [0; ID_BYTES],
        };
        let dev = BlockDevice::new(
            spec,
            Pipeline::new(Box::new(file)),
            Arc::new(BlockMetrics::new()),
        );
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).expect("mem");
        header(&m, VIRTIO_BLK_T_IN, 0);
        let mut descs = vec![r(HDR, 16)];
        for i in 0..1030u64 {
            descs.push(w(0x40_0000 + i * 512, 256));
        }
        descs.push(w(STATUS, 1));
        let q = MockSplitQueue::new(&m, 2048);
        let chain = q.build_desc_chain(&descs).expect("chain");
        let used = dev.handle_chain(chain, &m, 0);
        assert_eq!(used, 1030 * 256 + 1);
        let b: u8 = m
            .read_obj(GuestAddress(0x40_0000 + 1029 * 512))
            .expect("byte");
        assert_eq!(b, ((1029 * 256 / 512) % 251) as u8);
    }

    /// Writes a virtio-blk header at `addr`.
    fn header_at(m: &GuestMemoryMmap, addr: u64, req_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&req_type.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(addr)).expect("header");
    }

    fn chained(descs: &[RawDescriptor], first: u16) -> Vec<RawDescriptor> {
        use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
        use virtio_queue::desc::split::Descriptor as SplitDescriptor;
        let n = descs.len();
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let d = SplitDescriptor::from(*d);
                let (flags, next) = if i + 1 < n {
                    (d.flags() | VRING_DESC_F_NEXT as u16, first + i as u16 + 1)
                } else {
                    (d.flags(), 0)
                };
                RawDescriptor::from(SplitDescriptor::new(d.addr().0, d.len(), flags, next))
            })
            .collect()
    }

    #[test]
    fn completions_out_of_order_reach_the_used_ring_with_their_status_and_length() {
        use crate::pipeline::tests::{wait_held, Hold, Shared};
        use vhost_user_backend::VringT;
        let img = image();
        let file = RawFile::open(img.path(), false, false).expect("open");
        let hold = Arc::new(Hold::sector(7));
        let mut pipeline = Pipeline::new(Box::new(file));
        pipeline.push(Box::new(Shared(hold.clone()))).expect("push");
        let spec = DeviceSpec {
            limits: limits(),
            num_queues: 1,
            queue_size: 16,
            serial: [0; ID_BYTES],
        };
        let dev = BlockDevice::new(spec, pipeline, Arc::new(BlockMetrics::new()));
        let m = mem();
        // Chain A (heads 0..3): read sector 7 (held). Chain B (3..6): read sector 2 (passes).
        header_at(&m, 0x1_0000, VIRTIO_BLK_T_IN, 7);
        header_at(&m, 0x1_1000, VIRTIO_BLK_T_IN, 2);
        let mut descs = chained(&[r(0x1_0000, 16), w(0x2_0000, 512), w(0x3_0000, 1)], 0);
        descs.extend(chained(
            &[r(0x1_1000, 16), w(0x2_1000, 1024), w(0x3_1000, 1)],
            3,
        ));
        m.write_obj(0xffu8, GuestAddress(0x3_0000)).expect("poison");
        m.write_obj(0xffu8, GuestAddress(0x3_1000)).expect("poison");
        let q = MockSplitQueue::new(&m, 16);
        q.add_desc_chains(&descs, 0).expect("chains");
        let atomic = GuestMemoryAtomic::new(m.clone());
        let vring = Vring::new(atomic.clone(), 16).expect("vring");
        vring
            .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
            .expect("queue info");
        vring.set_queue_size(16);
        vring.set_queue_ready(true);
        dev.update_memory(atomic).expect("memory");

        dev.process_vring(&vring, 0);
        wait_held(&hold, 1);
        // B is used first although A came first.
        assert_eq!(q.used().idx().load(), 1);
        let e = q.used().ring().ref_at(0).expect("elem").load();
        assert_eq!((e.id(), e.len()), (3, 1024 + 1));
        let st: u8 = m.read_obj(GuestAddress(0x3_1000)).expect("status");
        assert_eq!(st, 0);
        let st: u8 = m.read_obj(GuestAddress(0x3_0000)).expect("status");
        assert_eq!(st, 0xff, "A is not answered yet");
        let b: u8 = m.read_obj(GuestAddress(0x2_1000 + 512)).expect("data");
        assert_eq!(b, 3, "B read sectors 2 and 3");

        hold.let_go();
        assert_eq!(q.used().idx().load(), 2);
        let e = q.used().ring().ref_at(1).expect("elem").load();
        assert_eq!((e.id(), e.len()), (0, 512 + 1));
        let st: u8 = m.read_obj(GuestAddress(0x3_0000)).expect("status");
        assert_eq!(st, 0);
        let b: u8 = m.read_obj(GuestAddress(0x2_0000)).expect("data");
        assert_eq!(b, 7);
    }

    #[test]
    fn shutdown_completes_requests_held_in_flight_exactly_once() {
        use crate::pipeline::tests::{Hold, Shared};
        let img = image();
        let file = RawFile::open(img.path(), false, false).expect("open");
        let hold = Arc::new(Hold::sector(7));
        let mut pipeline = Pipeline::new(Box::new(file));
        pipeline.push(Box::new(Shared(hold.clone()))).expect("push");
        let dev = BlockDevice::new(
            DeviceSpec {
                limits: limits(),
                num_queues: 1,
                queue_size: 16,
                serial: [0; ID_BYTES],
            },
            pipeline,
            Arc::new(BlockMetrics::new()),
        );
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 7);
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..3 {
            let q = MockSplitQueue::new(&m, 16);
            let chain = q
                .build_desc_chain(&[r(HDR, 16), w(DATA, 512), w(STATUS, 1)])
                .expect("chain");
            let tx = tx.clone();
            dev.submit_chain(chain, &m, 0, move |len| {
                let _ = tx.send(len);
            });
        }
        assert_eq!(hold.held(), 3);
        assert!(rx.try_recv().is_err());
        dev.shutdown_pipeline();
        let lens: Vec<u32> = (0..3).map(|_| rx.recv().expect("completed")).collect();
        assert_eq!(lens, vec![513, 513, 513]);
        assert!(rx.try_recv().is_err(), "each request completes once");
        assert_eq!(dev.metrics.in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn invalid_request_gets_ioerr_and_length_one() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 5000);
        let (used, st) = run(&dev, &m, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        assert_eq!((used, st), (1, 1));
        assert_eq!(dev.metrics.snapshot().errors.invalid_request, 1);
    }

    #[test]
    fn unknown_request_gets_unsupp() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, 99, 0);
        assert_eq!(run(&dev, &m, &[r(HDR, 16), w(STATUS, 1)]), (1, 2));
        assert_eq!(dev.metrics.snapshot().errors.unsupported, 1);
    }

    #[test]
    fn unusable_chain_is_returned_with_length_zero() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        // Status descriptor readable: nothing may be written.
        let (used, st) = run(&dev, &m, &[r(HDR, 16), w(DATA, 512), r(STATUS, 1)]);
        assert_eq!((used, st), (0, 0xff));
        assert_eq!(dev.metrics.snapshot().errors.unusable_chain, 1);
    }

    #[test]
    fn get_id_returns_the_serial() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        m.write_slice(&[0xee; 32], GuestAddress(DATA))
            .expect("poison");
        let (used, st) = run(&dev, &m, &[r(HDR, 16), w(DATA, 32), w(STATUS, 1)]);
        assert_eq!((used, st), (21, 0));
        let mut id = [0u8; 21];
        m.read_slice(&mut id, GuestAddress(DATA)).expect("id");
        assert_eq!(&id[..9], b"serial-42");
        assert!(id[9..20].iter().all(|&b| b == 0), "zero padded");
        assert_eq!(id[20], 0xee, "nothing written past 20 bytes");
    }

    #[test]
    fn read_only_disk_refuses_writes_and_keeps_the_image() {
        let img = image();
        let dev = device(img.path(), true);
        assert_ne!(dev.virtio_features() & (1 << VIRTIO_BLK_F_RO), 0);
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        m.write_slice(&[0x77; 512], GuestAddress(DATA))
            .expect("data");
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]),
            (1, 1)
        );
        assert!(file_bytes(img.path(), 0, 512).iter().all(|&b| b == 0));
        assert_eq!(dev.metrics.snapshot().errors.read_only, 1);
        // Reads work.
        header(&m, VIRTIO_BLK_T_IN, 1);
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]),
            (513, 0)
        );
    }

    fn ranges(m: &GuestMemoryMmap, t: u32, sector: u64, n: u32, flags: u32) -> u32 {
        header(m, t, 0);
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&sector.to_le_bytes());
        b[8..12].copy_from_slice(&n.to_le_bytes());
        b[12..].copy_from_slice(&flags.to_le_bytes());
        m.write_slice(&b, GuestAddress(DATA)).expect("payload");
        16
    }

    #[test]
    fn write_zeroes_zeroes_the_range_with_and_without_unmap() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        let n = ranges(&m, VIRTIO_BLK_T_WRITE_ZEROES, 8, 8, 0);
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)]),
            (1, 0)
        );
        assert!(file_bytes(img.path(), 8 * 512, 4096)
            .iter()
            .all(|&b| b == 0));
        let n = ranges(&m, VIRTIO_BLK_T_WRITE_ZEROES, 16, 8, 1);
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)]),
            (1, 0)
        );
        assert!(file_bytes(img.path(), 16 * 512, 4096)
            .iter()
            .all(|&b| b == 0));
        // Neighbours untouched.
        assert!(file_bytes(img.path(), 24 * 512, 512)
            .iter()
            .all(|&b| b == 24));
        assert_eq!(dev.metrics.snapshot().bytes_zeroed, 8192);
    }

    #[test]
    fn discard_punches_a_hole() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        let n = ranges(&m, VIRTIO_BLK_T_DISCARD, 32, 64, 0);
        assert_eq!(
            run(&dev, &m, &[r(HDR, 16), r(DATA, n), w(STATUS, 1)]),
            (1, 0)
        );
        // On file systems with hole punching the range now reads as zeroes; elsewhere the
        // discard is a no-op. Either way the status is OK and neighbours are intact.
        assert!(file_bytes(img.path(), 96 * 512, 512)
            .iter()
            .all(|&b| b == 96));
        assert_eq!(dev.metrics.snapshot().discards, 1);
    }

    #[test]
    fn config_space_layout() {
        let img = image();
        let dev = device(img.path(), false);
        let c = dev.get_config(0, CONFIG_SPACE_LEN as u32);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().expect("8")), 1024);
        assert_eq!(
            u32::from_le_bytes(c[12..16].try_into().expect("4")),
            14,
            "seg_max"
        );
        assert_eq!(
            u32::from_le_bytes(c[20..24].try_into().expect("4")),
            512,
            "blk_size"
        );
        assert_eq!(
            u16::from_le_bytes(c[34..36].try_into().expect("2")),
            2,
            "num_queues"
        );
        assert_eq!(c[56], 1, "write_zeroes_may_unmap");
        // Partial and out-of-range reads are zero-padded, never panic.
        assert_eq!(dev.get_config(34, 2), vec![2, 0]);
        assert_eq!(dev.get_config(200, 4), vec![0; 4]);
        assert_eq!(dev.get_config(u32::MAX, 4), vec![0; 4]);
        assert_eq!(dev.virtio_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(
            dev.features() & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
            0
        );
        assert!(dev
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG));
    }

    #[test]
    fn vring_is_drained_and_used_ring_updated() {
        let img = image();
        let dev = device(img.path(), false);
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("memory");
        let q = MockSplitQueue::new(&m, 16);
        header(&m, VIRTIO_BLK_T_IN, 1);
        // Two chains: a valid read and an unusable one.
        let wr = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
        let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
        use virtio_queue::desc::split::Descriptor as SD;
        let descs = [
            RawDescriptor::from(SD::new(HDR, 16, next, 1)),
            RawDescriptor::from(SD::new(DATA, 512, wr | next, 2)),
            RawDescriptor::from(SD::new(STATUS, 1, wr, 0)),
            RawDescriptor::from(SD::new(HDR, 16, 0, 0)),
        ];
        q.add_desc_chains(&descs, 0).expect("chains");
        let vring = Vring::new(GuestMemoryAtomic::new(m.clone()), 16).expect("vring");
        vring.set_queue_size(16);
        vring
            .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
            .expect("queue info");
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        dev.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
            .expect("handle");
        assert_eq!(q.used().idx().load(), 2);
        let e0 = q.used().ring().ref_at(0).expect("e0").load();
        let e1 = q.used().ring().ref_at(1).expect("e1").load();
        assert_eq!((e0.id(), e0.len()), (0, 513));
        assert_eq!((e1.id(), e1.len()), (3, 0));
        // An event for a queue that does not exist is ignored.
        dev.handle_event(7, EventSet::IN, &[vring], 0)
            .expect("ignored");
    }
}
