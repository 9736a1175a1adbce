//! The vhost-user-net device: features, the RX and TX virtqueues, and the glue to the tap
//! through the packet pipeline.
//!
//! One worker thread serves both queues, the tap and a tick timer. The tap is registered
//! edge-triggered: the worker reads it until it is empty or the guest has no receive buffer
//! left; in the second case the frame in hand waits (nothing is lost, the tap queues the
//! rest) until the guest posts buffers and kicks the RX queue.
//!
//! Receive buffers are published to the used ring in one step per frame (all the buffers of
//! a mergeable frame, then the index): `Queue::add_used` would expose the first buffer of a
//! frame before the others, and a guest polling on another vCPU would find `num_buffers`
//! buffers promised and fewer there.

use std::io::{Read, Write};
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tracing::{debug, error, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_F_MRG_RXBUF,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};
use vmm_sys_util::timerfd::TimerFd;

use crate::metrics::{add, inc, NetMetrics};
use crate::packet::{Direction, Frame, VnetHdr, MAX_FRAME_LEN, VNET_HDR_LEN};
use crate::stage::{now_ns, NetPipeline, Verdict, TICK_NS};
use crate::tap::{Tap, TapOffloads};

/// Guest memory as the vhost-user crates hand it to us.
pub(crate) type GuestMem = GuestMemoryAtomic<GuestMemoryMmap>;
/// The vring type used by this backend.
pub(crate) type Vring = VringRwLock<GuestMem>;

/// Receive queue index.
pub const RX_QUEUE: u16 = 0;
/// Transmit queue index.
pub const TX_QUEUE: u16 = 1;
/// One queue pair.
pub const NUM_QUEUES: usize = 2;
/// Worker event of the tap (ids up to `NUM_QUEUES` are the queues' and the exit event's).
pub(crate) const TAP_EVENT: u16 = 3;
/// Worker event of the tick timer.
pub(crate) const TICK_EVENT: u16 = 4;
/// Ethernet header length: the shortest frame the device passes on.
const ETH_HDR_LEN: usize = 14;
/// The legacy header, without `num_buffers` (neither VERSION_1 nor MRG_RXBUF).
const LEGACY_HDR_LEN: usize = 10;

/// What the device offers beyond the data path basics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offloads {
    /// Checksum and TSO offloads in both directions (handled end to end by the tap: the
    /// host kernel computes and segments what the guest left undone, and hands the guest
    /// unsegmented frames with partial checksums).
    pub enabled: bool,
}

/// The worker's mutable state (one worker thread: the lock is never contended).
struct Worker {
    pipeline: NetPipeline,
    /// A frame read from the tap that the guest had no room for yet.
    pending: Option<Frame>,
    /// The tap may have more frames (edge-triggered: cleared only at `WouldBlock`).
    tap_readable: bool,
    buf: Vec<u8>,
    last_tick: u64,
}

/// The vhost-user-net backend of one NIC.
pub(crate) struct NetDevice {
    tap: Tap,
    offloads: Offloads,
    queue_size: u16,
    mem: vmsight_vhostd::MemorySlot,
    acked: AtomicU64,
    event_idx: AtomicBool,
    worker: Mutex<Worker>,
    tick: Mutex<TimerFd>,
    tick_fd: i32,
    metrics: Arc<NetMetrics>,
}

/// Why a frame could not be placed in the guest's receive buffers.
enum Placed {
    Done,
    /// Not enough buffers posted: the frame waits.
    NoBuffers,
    /// The frame is larger than a buffer and buffers cannot be merged: dropped.
    TooBig,
}

impl NetDevice {
    pub(crate) fn new(
        tap: Tap,
        offloads: Offloads,
        queue_size: u16,
        pipeline: NetPipeline,
        metrics: Arc<NetMetrics>,
    ) -> std::io::Result<Self> {
        let mut tick = TimerFd::new()?;
        let period = std::time::Duration::from_nanos(TICK_NS);
        tick.reset(period, Some(period))?;
        let tick_fd = tick.as_raw_fd();
        Ok(Self {
            tap,
            offloads,
            queue_size,
            mem: vmsight_vhostd::MemorySlot::default(),
            acked: AtomicU64::new(0),
            event_idx: AtomicBool::new(false),
            worker: Mutex::new(Worker {
                pipeline,
                pending: None,
                tap_readable: true,
                buf: vec![0; VNET_HDR_LEN + MAX_FRAME_LEN],
                last_tick: now_ns(),
            }),
            tick: Mutex::new(tick),
            tick_fd,
            metrics,
        })
    }

    /// The tap's file descriptor (registered with the worker).
    pub(crate) fn tap_fd(&self) -> i32 {
        self.tap.as_raw_fd()
    }

    /// The tick timer's file descriptor (registered with the worker).
    pub(crate) fn tick_fd(&self) -> i32 {
        self.tick_fd
    }

    /// Virtio feature bits offered to the driver.
    pub(crate) fn virtio_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX)
            | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1u64 << VIRTIO_NET_F_MRG_RXBUF);
        if self.offloads.enabled {
            for bit in [
                VIRTIO_NET_F_CSUM,
                VIRTIO_NET_F_GUEST_CSUM,
                VIRTIO_NET_F_GUEST_TSO4,
                VIRTIO_NET_F_GUEST_TSO6,
                VIRTIO_NET_F_GUEST_ECN,
                VIRTIO_NET_F_HOST_TSO4,
                VIRTIO_NET_F_HOST_TSO6,
                VIRTIO_NET_F_HOST_ECN,
            ] {
                f |= 1u64 << bit;
            }
        }
        f
    }

    fn has(&self, bit: u32) -> bool {
        self.acked.load(Ordering::Relaxed) & (1u64 << bit) != 0
    }

    /// Bytes of the virtio-net header the guest uses.
    fn guest_hdr_len(&self) -> usize {
        if self.has(VIRTIO_F_VERSION_1) || self.has(VIRTIO_NET_F_MRG_RXBUF) {
            VNET_HDR_LEN
        } else {
            LEGACY_HDR_LEN
        }
    }

    fn memory(&self) -> Option<GuestMem> {
        self.mem.get()
    }

    fn worker(&self) -> std::sync::MutexGuard<'_, Worker> {
        self.worker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets stages expire state when due (called on every event and by the timer).
    fn maybe_tick(&self, w: &mut Worker) {
        let now = now_ns();
        if now.saturating_sub(w.last_tick) >= TICK_NS {
            w.last_tick = now;
            w.pipeline.tick(now);
        }
    }

    /// Stops the stages (flush captures and logs).
    pub(crate) fn finish(&self) {
        self.worker().pipeline.finish();
    }

    // ---------------------------------------------------------------------------------------
    // TX: guest -> tap.

    /// Drains the TX queue: every chain becomes a frame that goes through the stages to the
    /// tap, or is counted as malformed; every chain is returned to the guest.
    pub(crate) fn process_tx(&self, vring: &Vring) {
        let Some(atomic) = self.memory() else {
            warn!("TX queue kicked before the guest memory table was set");
            inc(&self.metrics.queue_errors);
            return;
        };
        let guard = atomic.memory();
        let mem: &GuestMemoryMmap = &guard;
        let mut w = self.worker();
        loop {
            if let Err(e) = vring.disable_notification() {
                debug!(error = %e, "cannot disable TX notifications");
            }
            let chains: Vec<_> = {
                let mut state = vring.get_mut();
                match state.get_queue_mut().iter(mem) {
                    Ok(iter) => iter.collect(),
                    Err(e) => {
                        error!(error = %e, "TX virtqueue is corrupt; ignoring this kick");
                        inc(&self.metrics.queue_errors);
                        return;
                    }
                }
            };
            let mut used = false;
            for chain in chains {
                let head = chain.head_index();
                match self.read_tx_frame(chain, mem) {
                    Some(mut frame) => self.send(&mut w, &mut frame),
                    None => inc(&self.metrics.tx_malformed),
                }
                if let Err(e) = vring.add_used(head, 0) {
                    error!(error = %e, "cannot return a TX chain");
                    inc(&self.metrics.queue_errors);
                }
                used = true;
            }
            if used {
                self.signal(vring);
            }
            match vring.enable_notification() {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    debug!(error = %e, "cannot enable TX notifications");
                    break;
                }
            }
        }
        self.maybe_tick(&mut w);
    }

    /// The frame in a TX chain, or `None` when the chain is not one.
    fn read_tx_frame(
        &self,
        chain: DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> Option<Frame> {
        let hdr_len = self.guest_hdr_len();
        let mut r = chain.reader(mem).ok()?;
        let total = r.available_bytes();
        if total < hdr_len + ETH_HDR_LEN || total > hdr_len + MAX_FRAME_LEN {
            debug!(total, "malformed TX chain (length)");
            return None;
        }
        let mut hdr = [0u8; VNET_HDR_LEN];
        r.read_exact(&mut hdr[..hdr_len]).ok()?;
        let hdr = VnetHdr::parse(&hdr);
        let mut data = vec![0u8; total - hdr_len];
        r.read_exact(&mut data).ok()?;
        if !hdr.is_sane(data.len()) || !crate::packet::well_formed(&data) {
            debug!(?hdr, "malformed TX frame (virtio-net header or IP headers)");
            return None;
        }
        Some(Frame {
            hdr: VnetHdr {
                num_buffers: 0,
                ..hdr
            },
            data,
        })
    }

    fn send(&self, w: &mut Worker, frame: &mut Frame) {
        if w.pipeline.run(Direction::FromGuest, frame, now_ns()) == Verdict::Drop {
            inc(&self.metrics.tx_stage_drops);
            return;
        }
        match self.tap.write(&frame.hdr.to_bytes(), &frame.data) {
            Ok(_) => {
                inc(&self.metrics.tx_frames);
                add(&self.metrics.tx_bytes, frame.data.len());
            }
            Err(e) => {
                debug!(error = %e, "tap write failed");
                inc(&self.metrics.tap_write_errors);
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // RX: tap -> guest.

    /// The tap has frames (or the guest posted buffers): moves frames to the guest until the
    /// tap is empty or the guest has no room.
    pub(crate) fn process_rx(&self, vring: &Vring, tap_event: bool) {
        let mut w = self.worker();
        if tap_event {
            w.tap_readable = true;
        }
        let ready = vring.get_ref().get_queue().ready() && vring.get_ref().is_enabled();
        let Some(atomic) = self.memory().filter(|_| ready) else {
            // The frames wait in the tap until the queue is set up.
            return;
        };
        let guard = atomic.memory();
        let mem: &GuestMemoryMmap = &guard;
        let mut notify = false;
        loop {
            if w.pending.is_none() && !self.next_rx_frame(&mut w) {
                break;
            }
            let Some(frame) = w.pending.take() else {
                break;
            };
            match self.place(vring, mem, &frame) {
                Ok((Placed::Done, n)) => {
                    notify |= n;
                    inc(&self.metrics.rx_frames);
                    add(&self.metrics.rx_bytes, frame.data.len());
                }
                Ok((Placed::TooBig, _)) => inc(&self.metrics.rx_too_big),
                Ok((Placed::NoBuffers, _)) => {
                    w.pending = Some(frame);
                    inc(&self.metrics.rx_no_buffers);
                    // Ask for a kick when the guest adds buffers; go on only if it added some
                    // meanwhile (the buffers already there are too few for this frame).
                    match self.ask_for_buffers(vring, mem) {
                        Ok(true) => continue,
                        _ => break,
                    }
                }
                Err(()) => {
                    inc(&self.metrics.queue_errors);
                    break;
                }
            }
        }
        if notify {
            match vring.signal_used_queue() {
                Ok(()) => inc(&self.metrics.notifications),
                Err(e) => debug!(error = %e, "cannot signal the RX queue"),
            }
        }
        self.maybe_tick(&mut w);
    }

    /// After a frame did not fit: asks the guest to kick the RX queue when it adds a buffer
    /// beyond those it has posted now, and returns whether it added one in the meantime.
    ///
    /// `enable_notification` alone would ask for a kick at the first buffer not yet taken
    /// (with EVENT_IDX, `avail_event = next_avail`), which the guest has already passed: no
    /// kick would come, and its "more buffers are there" answer would be true forever.
    fn ask_for_buffers(&self, vring: &Vring, mem: &GuestMemoryMmap) -> Result<bool, ()> {
        let mut st = vring.get_mut();
        let q = st.get_queue_mut();
        let before = q.avail_idx(mem, Ordering::Acquire).map_err(|_| ())?;
        if self.event_idx.load(Ordering::Relaxed) {
            let at = GuestAddress(q.used_ring())
                .checked_add(4 + 8 * u64::from(q.size()))
                .ok_or(())?;
            mem.store(u16::to_le(before.0), at, Ordering::Release)
                .map_err(|_| ())?;
        } else {
            q.enable_notification(mem).map_err(|_| ())?;
        }
        fence(Ordering::SeqCst);
        let after = q.avail_idx(mem, Ordering::Acquire).map_err(|_| ())?;
        Ok(after != before)
    }

    /// Reads frames from the tap until one passes the stages (into `w.pending`); false when
    /// the tap is empty.
    fn next_rx_frame(&self, w: &mut Worker) -> bool {
        while w.tap_readable {
            let n = match self.tap.read(&mut w.buf) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    w.tap_readable = false;
                    return false;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!(error = %e, tap = self.tap.name(), "tap read failed");
                    inc(&self.metrics.tap_read_errors);
                    w.tap_readable = false;
                    return false;
                }
            };
            let Some(mut frame) = self.rx_frame(&w.buf[..n]) else {
                inc(&self.metrics.rx_malformed);
                continue;
            };
            if w.pipeline.run(Direction::ToGuest, &mut frame, now_ns()) == Verdict::Drop {
                inc(&self.metrics.rx_stage_drops);
                continue;
            }
            w.pending = Some(frame);
            return true;
        }
        false
    }

    /// Checks a frame read from the tap: long enough, a header the guest accepted.
    fn rx_frame(&self, bytes: &[u8]) -> Option<Frame> {
        if bytes.len() < VNET_HDR_LEN + ETH_HDR_LEN {
            return None;
        }
        let (h, data) = bytes.split_at(VNET_HDR_LEN);
        let hdr = VnetHdr::parse(h.try_into().ok()?);
        if !hdr.is_sane(data.len())
            || !self.guest_accepts(&hdr)
            || !crate::packet::well_formed(data)
        {
            return None;
        }
        Some(Frame {
            hdr,
            data: data.to_vec(),
        })
    }

    /// Whether the guest negotiated what the header asks of it.
    fn guest_accepts(&self, h: &VnetHdr) -> bool {
        let csum = !h.needs_csum() || self.has(VIRTIO_NET_F_GUEST_CSUM);
        let gso = match h.gso_type & !crate::packet::GSO_ECN {
            crate::packet::GSO_NONE => true,
            crate::packet::GSO_TCPV4 => self.has(VIRTIO_NET_F_GUEST_TSO4),
            crate::packet::GSO_TCPV6 => self.has(VIRTIO_NET_F_GUEST_TSO6),
            _ => false,
        };
        let ecn = h.gso_type & crate::packet::GSO_ECN == 0 || self.has(VIRTIO_NET_F_GUEST_ECN);
        csum && gso && ecn
    }

    /// Writes `frame` into the guest's receive buffers and publishes them; the flag says
    /// whether the guest wants an interrupt. `Err` when the queue is unusable.
    fn place(
        &self,
        vring: &Vring,
        mem: &GuestMemoryMmap,
        frame: &Frame,
    ) -> Result<(Placed, bool), ()> {
        let hdr_len = self.guest_hdr_len();
        let mergeable = self.has(VIRTIO_NET_F_MRG_RXBUF);
        let total = hdr_len + frame.data.len();
        let mut st = vring.get_mut();
        let q = st.get_queue_mut();
        let mut used: Vec<(u16, u32)> = Vec::new();
        let mut first: Option<virtio_queue::Writer<'_>> = None;
        let mut off = 0usize;
        let mut hdr = frame.hdr;
        hdr.num_buffers = 1;
        let hdr_bytes = hdr.to_bytes();
        while off < total {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                // Not enough buffers: give back the ones taken for this frame.
                for _ in 0..used.len() {
                    q.go_to_previous_position();
                }
                return Ok((Placed::NoBuffers, false));
            };
            let head = chain.head_index();
            let mut w = match chain.writer(mem) {
                Ok(w) if w.available_bytes() > 0 => w,
                _ => {
                    // Unusable buffer: returned empty, before this frame's buffers (the
                    // guest drops a zero-length buffer as a length error).
                    inc(&self.metrics.rx_bad_buffers);
                    self.publish(q, mem, &[(head, 0)])?;
                    continue;
                }
            };
            let room = w.available_bytes();
            if !mergeable && room < total {
                q.go_to_previous_position();
                return Ok((Placed::TooBig, false));
            }
            // The first buffer must hold the whole header (num_buffers is rewritten there).
            if used.is_empty() && room < hdr_len {
                inc(&self.metrics.rx_bad_buffers);
                self.publish(q, mem, &[(head, 0)])?;
                continue;
            }
            let n = room.min(total - off);
            if used.is_empty() {
                first = Some(w.clone());
            }
            if write_range(&mut w, &hdr_bytes[..hdr_len], &frame.data, off, n).is_err() {
                inc(&self.metrics.rx_bad_buffers);
                for _ in 0..used.len() {
                    q.go_to_previous_position();
                }
                self.publish(q, mem, &[(head, 0)])?;
                return Ok((Placed::NoBuffers, false));
            }
            used.push((head, u32::try_from(n).unwrap_or(u32::MAX)));
            off += n;
        }
        if used.len() > 1 {
            hdr.num_buffers = u16::try_from(used.len()).unwrap_or(u16::MAX);
            let b = hdr.to_bytes();
            if let Some(mut w) = first {
                if w.write_all(&b[..hdr_len]).is_err() {
                    return Err(());
                }
            }
        }
        let notify = self.publish(q, mem, &used)?;
        Ok((Placed::Done, notify))
    }

    /// Adds `entries` to the used ring and then moves the used index past all of them (one
    /// release store); returns whether the guest asked for an interrupt.
    fn publish(
        &self,
        q: &mut virtio_queue::Queue,
        mem: &GuestMemoryMmap,
        entries: &[(u16, u32)],
    ) -> Result<bool, ()> {
        let size = q.size();
        if size == 0 || entries.iter().any(|(h, _)| *h >= size) {
            return Err(());
        }
        let used = GuestAddress(q.used_ring());
        let old = Wrapping(q.next_used());
        for (i, (head, len)) in entries.iter().enumerate() {
            let idx = old + Wrapping(u16::try_from(i).map_err(|_| ())?);
            let slot = u64::from(idx.0 % size);
            let mut elem = [0u8; 8];
            elem[..4].copy_from_slice(&u32::from(*head).to_le_bytes());
            elem[4..].copy_from_slice(&len.to_le_bytes());
            let addr = used.checked_add(4 + slot * 8).ok_or(())?;
            mem.write_slice(&elem, addr).map_err(|_| ())?;
        }
        let new = old + Wrapping(u16::try_from(entries.len()).map_err(|_| ())?);
        let idx_addr = used.checked_add(2).ok_or(())?;
        mem.store(u16::to_le(new.0), idx_addr, Ordering::Release)
            .map_err(|_| ())?;
        q.set_next_used(new.0);
        // The guest's interrupt suppression is read after the index is visible.
        fence(Ordering::SeqCst);
        let avail = GuestAddress(q.avail_ring());
        if self.event_idx.load(Ordering::Relaxed) {
            let at = avail.checked_add(4 + 2 * u64::from(size)).ok_or(())?;
            let event: u16 = mem.load(at, Ordering::Acquire).map_err(|_| ())?;
            let event = Wrapping(u16::from_le(event));
            // vring_need_event: the guest asked to be told once the index passes `event`.
            Ok((new - event - Wrapping(1)) < (new - old))
        } else {
            let flags: u16 = mem.load(avail, Ordering::Acquire).map_err(|_| ())?;
            Ok(u16::from_le(flags) & 1 == 0)
        }
    }

    fn signal(&self, vring: &Vring) {
        match vring.needs_notification() {
            Ok(false) => {}
            Ok(true) | Err(_) => match vring.signal_used_queue() {
                Ok(()) => inc(&self.metrics.notifications),
                Err(e) => debug!(error = %e, "cannot signal the used queue"),
            },
        }
    }

    /// Runs the stages' periodic work (timer event).
    fn on_tick(&self) {
        if let Ok(mut t) = self.tick.lock() {
            let _ = t.wait();
        }
        let mut w = self.worker();
        let now = now_ns();
        w.last_tick = now;
        w.pipeline.tick(now);
    }
}

/// Writes bytes `off..off + n` of the header followed by the frame.
fn write_range(
    w: &mut impl Write,
    hdr: &[u8],
    data: &[u8],
    off: usize,
    n: usize,
) -> std::io::Result<()> {
    let end = off + n;
    if off < hdr.len() {
        w.write_all(&hdr[off..end.min(hdr.len())])?;
    }
    if end > hdr.len() {
        let from = off.max(hdr.len()) - hdr.len();
        w.write_all(&data[from..end - hdr.len()])?;
    }
    Ok(())
}

impl VhostUserBackend for NetDevice {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.queue_size)
    }

    fn features(&self) -> u64 {
        self.virtio_features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        self.acked.store(features, Ordering::Relaxed);
        let o = TapOffloads {
            csum: self.has(VIRTIO_NET_F_GUEST_CSUM),
            tso4: self.has(VIRTIO_NET_F_GUEST_TSO4),
            tso6: self.has(VIRTIO_NET_F_GUEST_TSO6),
            ecn: self.has(VIRTIO_NET_F_GUEST_ECN),
        };
        if let Err(e) = self.tap.set_offloads(o) {
            warn!(error = %e, "cannot set the tap's offloads; the guest gets plain frames");
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::empty()
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
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
        vmsight_vhostd::seccomp::install_once(vmsight_vhostd::seccomp::ThreadClass::NetWorker);
        tracing::trace!(device_event, ?evset, "worker event");
        if !evset.contains(EventSet::IN) {
            debug!(device_event, ?evset, "ignoring unexpected event set");
            return Ok(());
        }
        let (Some(rx), Some(tx)) = (
            vrings.get(usize::from(RX_QUEUE)),
            vrings.get(usize::from(TX_QUEUE)),
        ) else {
            return Ok(());
        };
        match device_event {
            RX_QUEUE => self.process_rx(rx, false),
            TX_QUEUE => self.process_tx(tx),
            TAP_EVENT => self.process_rx(rx, true),
            TICK_EVENT => self.on_tick(),
            other => debug!(other, "event for an unknown source"),
        }
        // Never return an error: it would end the worker thread for the whole device.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixDatagram;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor as SD;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    const MEM_SIZE: usize = 0x10_0000;
    const BUF: u64 = 0x4_0000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory")
    }

    /// A device whose "tap" is one end of a SOCK_SEQPACKET pair (one message per frame, as a
    /// tap), the other end returned for the test.
    fn device(features: u64) -> (NetDevice, std::os::unix::net::UnixDatagram) {
        let (a, b) = seqpacket_pair();
        let tap = Tap::from_fd(a, "test0");
        let dev = NetDevice::new(
            tap,
            Offloads { enabled: true },
            16,
            NetPipeline::default(),
            Arc::new(NetMetrics::default()),
        )
        .expect("device");
        dev.acked_features(features);
        (dev, b)
    }

    fn seqpacket_pair() -> (OwnedFd, UnixDatagram) {
        let mut fds = [0i32; 2];
        // SAFETY: socketpair writes two descriptors into `fds`, which has room for them.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "socketpair");
        // SAFETY: both descriptors were just created and are owned by nobody else.
        unsafe {
            use std::os::fd::FromRawFd;
            (
                OwnedFd::from_raw_fd(fds[0]),
                UnixDatagram::from_raw_fd(fds[1]),
            )
        }
    }

    fn vring(m: &GuestMemoryMmap, q: &MockSplitQueue<'_, GuestMemoryMmap>) -> Vring {
        let vring = Vring::new(GuestMemoryAtomic::new(m.clone()), 16).expect("vring");
        vring.set_queue_size(16);
        vring
            .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
            .expect("queue info");
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        vring
    }

    fn modern() -> u64 {
        (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_NET_F_MRG_RXBUF)
            | (1u64 << VIRTIO_NET_F_GUEST_CSUM)
    }

    /// An Ethernet frame of `len` bytes (the local experimental ethertype 0x88b5, payload
    /// pattern).
    fn eth(len: usize) -> Vec<u8> {
        let mut f: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        f[12] = 0x88;
        f[13] = 0xb5;
        f
    }

    #[test]
    fn truncated_ip_frames_from_either_side_are_dropped_and_counted() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        // An IPv4 header claiming 1000 bytes in a 60-byte frame.
        let mut f = eth(60);
        f[12] = 0x08;
        f[13] = 0x00;
        f[14] = 0x45;
        f[16..18].copy_from_slice(&1000u16.to_be_bytes());
        let q = MockSplitQueue::new(&m, 16);
        m.write_slice(&VnetHdr::default().to_bytes(), GuestAddress(BUF))
            .expect("hdr");
        m.write_slice(&f, GuestAddress(BUF + 12)).expect("frame");
        q.add_desc_chains(&[RawDescriptor::from(SD::new(BUF, 72, 0, 0))], 0)
            .expect("chain");
        let v = vring(&m, &q);
        dev.process_tx(&v);
        assert_eq!(dev.metrics.snapshot().tx_malformed, 1);
        let rq = MockSplitQueue::new(&m, 16);
        post_rx(&rq, 0, 1, 2048);
        send_to_tap(&peer, VnetHdr::default(), &f);
        let rv = vring(&m, &rq);
        dev.process_rx(&rv, true);
        assert_eq!(dev.metrics.snapshot().rx_malformed, 1);
        assert_eq!(rq.used().idx().load(), 0, "nothing reached the guest");
    }

    fn used(q: &MockSplitQueue<'_, GuestMemoryMmap>, i: u16) -> (u32, u32) {
        let e = q.used().ring().ref_at(usize::from(i)).expect("elem").load();
        (e.id(), e.len())
    }

    #[test]
    fn a_guest_frame_reaches_the_tap_with_its_header() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        let frame = eth(100);
        let hdr = VnetHdr::default().to_bytes();
        m.write_slice(&hdr, GuestAddress(BUF)).expect("hdr");
        m.write_slice(&frame, GuestAddress(BUF + 0x100))
            .expect("frame");
        let next = VRING_DESC_F_NEXT as u16;
        q.add_desc_chains(
            &[
                RawDescriptor::from(SD::new(BUF, 12, next, 1)),
                RawDescriptor::from(SD::new(BUF + 0x100, 100, 0, 0)),
            ],
            0,
        )
        .expect("chain");
        let v = vring(&m, &q);
        dev.process_tx(&v);
        let mut got = [0u8; 256];
        let n = peer.recv(&mut got).expect("a frame on the tap");
        assert_eq!(n, 112);
        assert_eq!(&got[..12], &hdr);
        assert_eq!(&got[12..112], &frame[..]);
        assert_eq!(q.used().idx().load(), 1);
        assert_eq!(used(&q, 0), (0, 0));
        let s = dev.metrics.snapshot();
        assert_eq!((s.tx_frames, s.tx_bytes, s.tx_malformed), (1, 100, 0));
    }

    #[test]
    fn malformed_tx_chains_are_counted_returned_and_not_sent() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        let wr = VRING_DESC_F_WRITE as u16;
        let bad_gso = VnetHdr {
            gso_type: 7,
            gso_size: 100,
            ..VnetHdr::default()
        };
        m.write_slice(&bad_gso.to_bytes(), GuestAddress(BUF + 0x1000))
            .expect("hdr");
        q.add_desc_chains(
            &[
                // Too short for a header and an Ethernet header.
                RawDescriptor::from(SD::new(BUF, 20, 0, 0)),
                // Only writable bytes.
                RawDescriptor::from(SD::new(BUF, 200, wr, 0)),
                // Longer than any frame.
                RawDescriptor::from(SD::new(BUF, 70_000, 0, 0)),
                // Outside guest memory.
                RawDescriptor::from(SD::new(0x1000_0000, 100, 0, 0)),
                // An unknown GSO type.
                RawDescriptor::from(SD::new(BUF + 0x1000, 100, 0, 0)),
            ],
            0,
        )
        .expect("chains");
        let v = vring(&m, &q);
        dev.process_tx(&v);
        assert_eq!(q.used().idx().load(), 5, "every chain is returned");
        assert_eq!(dev.metrics.snapshot().tx_malformed, 5);
        let mut got = [0u8; 64];
        assert!(peer.recv(&mut got).is_err(), "nothing reached the tap");
    }

    #[test]
    fn a_corrupt_avail_index_is_counted_not_fatal() {
        let (dev, _peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        // The avail index jumps by more than the queue size.
        m.write_obj(u16::to_le(1000), q.avail_addr().unchecked_add(2))
            .expect("idx");
        let v = vring(&m, &q);
        dev.process_tx(&v);
        assert_eq!(dev.metrics.snapshot().queue_errors, 1);
    }

    /// Posts `n` writable RX buffers of `len` bytes each, starting at descriptor `first`.
    fn post_rx(q: &MockSplitQueue<'_, GuestMemoryMmap>, first: u16, n: u16, len: u32) {
        let wr = VRING_DESC_F_WRITE as u16;
        let descs: Vec<RawDescriptor> = (0..n)
            .map(|i| {
                let d = first + i;
                RawDescriptor::from(SD::new(BUF + u64::from(d) * 0x1000, len, wr, 0))
            })
            .collect();
        q.add_desc_chains(&descs, first).expect("rx chains");
    }

    fn send_to_tap(peer: &UnixDatagram, hdr: VnetHdr, frame: &[u8]) {
        let mut b = hdr.to_bytes().to_vec();
        b.extend_from_slice(frame);
        peer.send(&b).expect("send");
    }

    #[test]
    fn a_tap_frame_fills_one_buffer_with_num_buffers_one() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        post_rx(&q, 0, 2, 2048);
        let frame = eth(60);
        send_to_tap(&peer, VnetHdr::default(), &frame);
        let v = vring(&m, &q);
        dev.process_rx(&v, true);
        assert_eq!(q.used().idx().load(), 1);
        assert_eq!(used(&q, 0), (0, 72));
        let mut got = [0u8; 72];
        m.read_slice(&mut got, GuestAddress(BUF)).expect("read");
        assert_eq!(
            VnetHdr::parse(got[..12].try_into().expect("12")).num_buffers,
            1
        );
        assert_eq!(&got[12..], &frame[..]);
        assert_eq!(dev.metrics.snapshot().rx_frames, 1);
    }

    #[test]
    fn a_large_frame_is_merged_over_buffers_published_together() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        post_rx(&q, 0, 4, 1024);
        let frame = eth(3000);
        send_to_tap(&peer, VnetHdr::default(), &frame);
        let v = vring(&m, &q);
        dev.process_rx(&v, true);
        assert_eq!(q.used().idx().load(), 3);
        assert_eq!(used(&q, 0), (0, 1024));
        assert_eq!(used(&q, 1), (1, 1024));
        assert_eq!(used(&q, 2), (2, 3012 - 2048));
        let mut all = Vec::new();
        for i in 0..3u64 {
            let mut b = vec![0u8; 1024];
            m.read_slice(&mut b, GuestAddress(BUF + i * 0x1000))
                .expect("read");
            all.extend_from_slice(&b);
        }
        assert_eq!(
            VnetHdr::parse(all[..12].try_into().expect("12")).num_buffers,
            3
        );
        assert_eq!(&all[12..3012], &frame[..]);
    }

    #[test]
    fn without_buffers_the_frame_waits_and_arrives_after_the_kick() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        let v = vring(&m, &q);
        let frame = eth(200);
        send_to_tap(&peer, VnetHdr::default(), &frame);
        dev.process_rx(&v, true);
        assert_eq!(q.used().idx().load(), 0);
        assert!(dev.metrics.snapshot().rx_no_buffers >= 1);
        post_rx(&q, 0, 1, 2048);
        dev.process_rx(&v, false);
        assert_eq!(q.used().idx().load(), 1);
        assert_eq!(used(&q, 0), (0, 212));
        assert_eq!(dev.metrics.snapshot().rx_frames, 1);
    }

    #[test]
    fn a_frame_larger_than_the_posted_buffers_waits_without_spinning() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        dev.set_event_idx(true);
        let q = MockSplitQueue::new(&m, 16);
        let v = vring(&m, &q);
        v.set_queue_event_idx(true);
        // 2 buffers of 1 KiB for a 3000-byte frame: it cannot be placed yet.
        post_rx(&q, 0, 2, 1024);
        send_to_tap(&peer, VnetHdr::default(), &eth(3000));
        dev.process_rx(&v, true);
        assert_eq!(q.used().idx().load(), 0);
        // The guest is asked to kick at its next buffer (avail_event = its avail index).
        let event: u16 = m
            .read_obj(q.used_addr().unchecked_add(4 + 8 * 16))
            .expect("avail_event");
        assert_eq!(event, 2);
        post_rx(&q, 2, 2, 1024);
        dev.process_rx(&v, false);
        assert_eq!(q.used().idx().load(), 3, "placed once enough buffers came");
    }

    #[test]
    fn bad_tap_frames_and_oversized_frames_are_dropped_and_counted() {
        // Legacy guest: no mergeable buffers, no checksum offload.
        let (dev, peer) = device(1u64 << VIRTIO_F_VERSION_1);
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        post_rx(&q, 0, 2, 1024);
        // Shorter than a header and an Ethernet header.
        peer.send(&[0u8; 20]).expect("send");
        // A partial checksum the guest did not negotiate.
        send_to_tap(
            &peer,
            VnetHdr {
                flags: crate::packet::FLAG_NEEDS_CSUM,
                csum_start: 34,
                csum_offset: 16,
                ..VnetHdr::default()
            },
            &eth(100),
        );
        // Larger than one buffer, and buffers cannot be merged.
        send_to_tap(&peer, VnetHdr::default(), &eth(1500));
        // A good one after all that.
        send_to_tap(&peer, VnetHdr::default(), &eth(64));
        let v = vring(&m, &q);
        dev.process_rx(&v, true);
        let s = dev.metrics.snapshot();
        assert_eq!(s.rx_malformed, 2);
        assert_eq!(s.rx_too_big, 1);
        assert_eq!(s.rx_frames, 1);
        assert_eq!(q.used().idx().load(), 1);
        assert_eq!(used(&q, 0), (0, 76));
    }

    #[test]
    fn unusable_rx_buffers_are_returned_empty() {
        let (dev, peer) = device(modern());
        let m = mem();
        dev.update_memory(GuestMemoryAtomic::new(m.clone()))
            .expect("mem");
        let q = MockSplitQueue::new(&m, 16);
        q.add_desc_chains(
            &[
                // Read-only: not a receive buffer.
                RawDescriptor::from(SD::new(BUF, 1024, 0, 0)),
                // Outside guest memory.
                RawDescriptor::from(SD::new(0x1000_0000, 1024, VRING_DESC_F_WRITE as u16, 0)),
            ],
            0,
        )
        .expect("chains");
        post_rx(&q, 2, 1, 2048);
        send_to_tap(&peer, VnetHdr::default(), &eth(100));
        let v = vring(&m, &q);
        dev.process_rx(&v, true);
        assert_eq!(q.used().idx().load(), 3);
        assert_eq!(used(&q, 0), (0, 0));
        assert_eq!(used(&q, 1), (1, 0));
        assert_eq!(used(&q, 2), (2, 112));
        assert_eq!(dev.metrics.snapshot().rx_bad_buffers, 2);
    }

    #[test]
    fn offloads_are_offered_only_when_enabled() {
        let (dev, _p) = device(0);
        let f = dev.virtio_features();
        assert_ne!(f & (1 << VIRTIO_NET_F_HOST_TSO4), 0);
        assert_ne!(f & (1 << VIRTIO_NET_F_MRG_RXBUF), 0);
        assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
    }
}
