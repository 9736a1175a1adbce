//! Lock-free counters of one block backend, and their serialisable snapshot.
//!
//! Every counter is a relaxed `AtomicU64`: they are statistics, not synchronisation. The
//! launcher reads them live through [`crate::BackendHandle::metrics`] and serialises a
//! [`MetricsSnapshot`] (e.g. to JSON) for the CLI and the benchmarks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::request::{RequestKind, Timeline};

/// Live counters of one backend (one disk). All fields are monotonically increasing except
/// `in_flight`, which is a gauge.
#[derive(Debug, Default)]
pub struct BlockMetrics {
    /// Completed `VIRTIO_BLK_T_IN` requests (successful or not).
    pub reads: AtomicU64,
    /// Completed `VIRTIO_BLK_T_OUT` requests.
    pub writes: AtomicU64,
    /// Completed `VIRTIO_BLK_T_FLUSH` requests.
    pub flushes: AtomicU64,
    /// Completed `VIRTIO_BLK_T_DISCARD` requests.
    pub discards: AtomicU64,
    /// Completed `VIRTIO_BLK_T_WRITE_ZEROES` requests.
    pub write_zeroes: AtomicU64,
    /// Completed `VIRTIO_BLK_T_GET_ID` requests.
    pub get_ids: AtomicU64,
    /// Bytes successfully read from the image into guest memory.
    pub bytes_read: AtomicU64,
    /// Bytes successfully written from guest memory to the image.
    pub bytes_written: AtomicU64,
    /// Bytes successfully discarded (punched).
    pub bytes_discarded: AtomicU64,
    /// Bytes successfully zeroed by write-zeroes.
    pub bytes_zeroed: AtomicU64,
    /// Requests currently between the virtqueue and their used-ring entry (gauge).
    pub in_flight: AtomicU64,
    /// Requests completed with `VIRTIO_BLK_S_OK`.
    pub completed_ok: AtomicU64,
    /// Sum of the service times (available ring to used ring) of all completed requests, in ns.
    pub latency_ns_total: AtomicU64,
    /// Used-ring interrupts (call eventfd writes) sent to the guest.
    pub notifications: AtomicU64,
    /// Where the service time of the requests that reached the image went.
    pub hand_offs: HandOffCounters,
    /// Malformed chains that could not even carry a status byte; returned with used length 0.
    pub err_unusable_chain: AtomicU64,
    /// Malformed requests answered with `VIRTIO_BLK_S_IOERR` by validation.
    pub err_invalid_request: AtomicU64,
    /// Requests answered with `VIRTIO_BLK_S_UNSUPP` (unknown type, bad discard flags).
    pub err_unsupported: AtomicU64,
    /// Writes, discards or write-zeroes refused because the disk is read-only.
    pub err_read_only: AtomicU64,
    /// I/O errors from the backing file (pread/pwrite/fdatasync/fallocate failures).
    pub err_io: AtomicU64,
    /// Errors raised by a pipeline stage other than the backing file.
    pub err_stage: AtomicU64,
    /// Virtqueue-level errors (bad avail ring index, used ring not writable, ...).
    pub err_queue: AtomicU64,
}

impl BlockMetrics {
    /// A new set of counters, all zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one finished request of `kind` in the per-kind counter.
    pub(crate) fn count_kind(&self, kind: RequestKind) {
        let c = match kind {
            RequestKind::Read => &self.reads,
            RequestKind::Write => &self.writes,
            RequestKind::Flush => &self.flushes,
            RequestKind::Discard => &self.discards,
            RequestKind::WriteZeroes => &self.write_zeroes,
            RequestKind::GetId => &self.get_ids,
        };
        inc(c);
    }

    /// A consistent-enough copy of every counter (each one read atomically, not all together).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            reads: g(&self.reads),
            writes: g(&self.writes),
            flushes: g(&self.flushes),
            discards: g(&self.discards),
            write_zeroes: g(&self.write_zeroes),
            get_ids: g(&self.get_ids),
            bytes_read: g(&self.bytes_read),
            bytes_written: g(&self.bytes_written),
            bytes_discarded: g(&self.bytes_discarded),
            bytes_zeroed: g(&self.bytes_zeroed),
            in_flight: g(&self.in_flight),
            completed_ok: g(&self.completed_ok),
            latency_ns_total: g(&self.latency_ns_total),
            notifications: g(&self.notifications),
            hand_offs: HandOffTimes {
                requests: g(&self.hand_offs.requests),
                stages_ns: g(&self.hand_offs.stages_ns),
                queued_ns: g(&self.hand_offs.queued_ns),
                io_ns: g(&self.hand_offs.io_ns),
                completion_ns: g(&self.hand_offs.completion_ns),
            },
            errors: ErrorCounts {
                unusable_chain: g(&self.err_unusable_chain),
                invalid_request: g(&self.err_invalid_request),
                unsupported: g(&self.err_unsupported),
                read_only: g(&self.err_read_only),
                io: g(&self.err_io),
                stage: g(&self.err_stage),
                queue: g(&self.err_queue),
            },
        }
    }
}

/// The split of the service time (available ring to used ring) of the requests that reached
/// the image, summed over them: each request's four parts add up to its service time.
#[derive(Debug, Default)]
pub struct HandOffCounters {
    requests: AtomicU64,
    stages_ns: AtomicU64,
    queued_ns: AtomicU64,
    io_ns: AtomicU64,
    completion_ns: AtomicU64,
}

impl HandOffCounters {
    /// Adds one request that left the available ring at `popped` and is answered at `now`;
    /// ignored unless the terminal stage filled its timeline.
    pub(crate) fn record(&self, popped: Instant, t: &Timeline, now: Instant) {
        let (Some(terminal), Some(start), Some(end)) = (t.terminal, t.io_start, t.io_end) else {
            return;
        };
        let ns = |a: Instant, b: Instant| {
            u64::try_from(b.saturating_duration_since(a).as_nanos()).unwrap_or(u64::MAX)
        };
        inc(&self.requests);
        add(&self.stages_ns, ns(popped, terminal));
        add(&self.queued_ns, ns(terminal, start));
        add(&self.io_ns, ns(start, end));
        add(&self.completion_ns, ns(end, now));
    }
}

/// Snapshot of [`HandOffCounters`]: totals in ns over `requests` requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOffTimes {
    /// Requests counted (those that reached the image through the terminal stage).
    pub requests: u64,
    /// Available ring to the terminal stage: parsing and the stages above the image.
    pub stages_ns: u64,
    /// Terminal stage to the transfer's start: waiting for an I/O thread (the pool), or
    /// nothing (io_uring submits at once).
    pub queued_ns: u64,
    /// The transfer: the system call, or submission to reaped completion.
    pub io_ns: u64,
    /// End of the transfer to the used ring: completion hooks, the hop back, the status byte.
    pub completion_ns: u64,
}

/// Adds one to a counter.
pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Plain-data copy of [`BlockMetrics`], serialisable with serde.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub get_ids: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub bytes_discarded: u64,
    pub bytes_zeroed: u64,
    pub in_flight: u64,
    pub completed_ok: u64,
    pub latency_ns_total: u64,
    pub notifications: u64,
    /// The split of the service time (absent in snapshots from before it existed).
    #[serde(default)]
    pub hand_offs: HandOffTimes,
    pub errors: ErrorCounts,
}

/// Error counters by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCounts {
    pub unusable_chain: u64,
    pub invalid_request: u64,
    pub unsupported: u64,
    pub read_only: u64,
    pub io: u64,
    pub stage: u64,
    pub queue: u64,
}

impl ErrorCounts {
    /// Sum of all error counters.
    pub fn total(&self) -> u64 {
        self.unusable_chain
            + self.invalid_request
            + self.unsupported
            + self.read_only
            + self.io
            + self.stage
            + self.queue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_round_trips_through_json() {
        let m = BlockMetrics::new();
        m.count_kind(RequestKind::Read);
        add(&m.bytes_read, 4096);
        inc(&m.err_io);
        let snap = m.snapshot();
        assert_eq!(snap.reads, 1);
        assert_eq!(snap.bytes_read, 4096);
        assert_eq!(snap.errors.io, 1);
        assert_eq!(snap.errors.total(), 1);
        let json = serde_json::to_string(&snap).expect("serialise");
        let back: MetricsSnapshot = serde_json::from_str(&json).expect("deserialise");
        assert_eq!(back, snap);
    }
}
