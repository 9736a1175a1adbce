//! Counters of one network device, updated by its worker and read by anyone.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Live counters (relaxed atomics: each is exact, a snapshot is not a transaction).
#[derive(Debug, Default)]
pub struct NetMetrics {
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// TX chains that were not a frame: no readable bytes, shorter than a header plus an
    /// Ethernet header, longer than the largest frame, unreadable memory, a bad vnet header.
    pub tx_malformed: AtomicU64,
    /// Frames from the tap shorter than a vnet header plus an Ethernet header, or with a
    /// vnet header the guest could not accept.
    pub rx_malformed: AtomicU64,
    /// Frames dropped by a stage, per direction.
    pub tx_stage_drops: AtomicU64,
    pub rx_stage_drops: AtomicU64,
    /// Frames that did not fit in the guest's receive buffers (without mergeable buffers).
    pub rx_too_big: AtomicU64,
    /// RX chains the guest posted that could not be written (no writable bytes, bad memory).
    pub rx_bad_buffers: AtomicU64,
    /// Times the device had a frame for the guest and no receive buffer (back-pressure: the
    /// frame waits in the tap, nothing is lost).
    pub rx_no_buffers: AtomicU64,
    /// Tap writes that failed (the frame is lost, as on a wire).
    pub tap_write_errors: AtomicU64,
    /// Tap reads that failed with something other than "nothing waiting".
    pub tap_read_errors: AtomicU64,
    /// A virtqueue the guest corrupted (e.g. an avail index beyond the queue size).
    pub queue_errors: AtomicU64,
    /// Interrupts sent to the guest.
    pub notifications: AtomicU64,
}

/// A serialisable copy of [`NetMetrics`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetSnapshot {
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_malformed: u64,
    pub rx_malformed: u64,
    pub tx_stage_drops: u64,
    pub rx_stage_drops: u64,
    pub rx_too_big: u64,
    pub rx_bad_buffers: u64,
    pub rx_no_buffers: u64,
    pub tap_write_errors: u64,
    pub tap_read_errors: u64,
    pub queue_errors: u64,
    pub notifications: u64,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn add(c: &AtomicU64, n: usize) {
    c.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
}

impl NetMetrics {
    /// Reads every counter.
    pub fn snapshot(&self) -> NetSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        NetSnapshot {
            tx_frames: g(&self.tx_frames),
            tx_bytes: g(&self.tx_bytes),
            rx_frames: g(&self.rx_frames),
            rx_bytes: g(&self.rx_bytes),
            tx_malformed: g(&self.tx_malformed),
            rx_malformed: g(&self.rx_malformed),
            tx_stage_drops: g(&self.tx_stage_drops),
            rx_stage_drops: g(&self.rx_stage_drops),
            rx_too_big: g(&self.rx_too_big),
            rx_bad_buffers: g(&self.rx_bad_buffers),
            rx_no_buffers: g(&self.rx_no_buffers),
            tap_write_errors: g(&self.tap_write_errors),
            tap_read_errors: g(&self.tap_read_errors),
            queue_errors: g(&self.queue_errors),
            notifications: g(&self.notifications),
        }
    }
}

impl std::fmt::Display for NetSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tx {} frames {} B, rx {} frames {} B; malformed tx {} rx {}; stage drops tx {} rx {}; \
             rx too big {}, bad buffers {}, waits for buffers {}; tap errors w {} r {}",
            self.tx_frames,
            self.tx_bytes,
            self.rx_frames,
            self.rx_bytes,
            self.tx_malformed,
            self.rx_malformed,
            self.tx_stage_drops,
            self.rx_stage_drops,
            self.rx_too_big,
            self.rx_bad_buffers,
            self.rx_no_buffers,
            self.tap_write_errors,
            self.tap_read_errors
        )
    }
}
