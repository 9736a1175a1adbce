//! A lock-free histogram of short durations (timer errors, waits) with fixed buckets: 10 µs
//! wide below 1 ms, 100 µs wide from 1 ms to 100 ms, and one overflow bucket. Recording is one
//! relaxed atomic add; a snapshot lists only the buckets that were hit, so it stays small in
//! the stats JSON. Quantiles come from the snapshot at the resolution of its buckets.
//!
//! Hand-written rather than `hdrhistogram`: that crate's histograms need `&mut` to record (a
//! lock on the scheduler's hot path, or one histogram per thread and a merge), and 1 091
//! fixed atomic buckets cover every value this is used for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Values below this are in 10 µs buckets.
const FINE_END_US: u64 = 1_000;
const FINE_WIDTH_US: u64 = 10;
/// Values below this (and at least `FINE_END_US`) are in 100 µs buckets.
const COARSE_END_US: u64 = 100_000;
const COARSE_WIDTH_US: u64 = 100;
const FINE_BUCKETS: usize = (FINE_END_US / FINE_WIDTH_US) as usize;
const COARSE_BUCKETS: usize = ((COARSE_END_US - FINE_END_US) / COARSE_WIDTH_US) as usize;
/// Fine, coarse and one overflow bucket.
const BUCKETS: usize = FINE_BUCKETS + COARSE_BUCKETS + 1;

/// The bucket of a value in µs.
fn bucket_of(us: u64) -> usize {
    if us < FINE_END_US {
        (us / FINE_WIDTH_US) as usize
    } else if us < COARSE_END_US {
        FINE_BUCKETS + ((us - FINE_END_US) / COARSE_WIDTH_US) as usize
    } else {
        BUCKETS - 1
    }
}

/// The range `[low, high)` of a bucket in µs (`high` is `u64::MAX` for the overflow bucket).
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    let fine = FINE_BUCKETS as u64;
    let coarse = COARSE_BUCKETS as u64;
    if i < fine {
        (i * FINE_WIDTH_US, (i + 1) * FINE_WIDTH_US)
    } else if i < fine + coarse {
        let low = FINE_END_US + (i - fine) * COARSE_WIDTH_US;
        (low, low + COARSE_WIDTH_US)
    } else {
        (COARSE_END_US, u64::MAX)
    }
}

/// The live histogram.
#[derive(Debug)]
pub struct DurationHistogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    total_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for DurationHistogram {
    fn default() -> Self {
        Self {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            total_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

impl DurationHistogram {
    /// Counts one value.
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(ns / 1_000)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// A copy with only the buckets that were hit.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let buckets = self
            .buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let n = b.load(Ordering::Relaxed);
                (n > 0).then(|| {
                    let (low_us, high_us) = bucket_range(i);
                    HistogramBucket {
                        low_us,
                        high_us,
                        count: n,
                    }
                })
            })
            .collect();
        HistogramSnapshot {
            count: self.count.load(Ordering::Relaxed),
            total_ns: self.total_ns.load(Ordering::Relaxed),
            max_ns: self.max_ns.load(Ordering::Relaxed),
            buckets,
        }
    }
}

/// One bucket that was hit: values in `[low_us, high_us)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistogramBucket {
    /// Lowest value of the bucket, µs.
    pub low_us: u64,
    /// First value above the bucket, µs (`u64::MAX`: the overflow bucket, ≥ 100 ms).
    pub high_us: u64,
    /// Values counted in it.
    pub count: u64,
}

/// Serialisable copy of a [`DurationHistogram`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistogramSnapshot {
    /// Values recorded.
    pub count: u64,
    /// Their sum, ns.
    pub total_ns: u64,
    /// The largest, ns.
    pub max_ns: u64,
    /// The buckets that were hit, lowest first.
    pub buckets: Vec<HistogramBucket>,
}

impl HistogramSnapshot {
    /// The `q` quantile (0.0 to 1.0) by nearest rank, as the middle of its bucket in µs (the
    /// overflow bucket answers with the maximum); `None` when nothing was recorded.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for b in &self.buckets {
            seen += b.count;
            if seen >= rank {
                return Some(if b.high_us == u64::MAX {
                    self.max_ns as f64 / 1e3
                } else {
                    (b.low_us + b.high_us) as f64 / 2.0
                });
            }
        }
        Some(self.max_ns as f64 / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bucket_range_holds_the_values_mapped_to_it() {
        for i in 0..BUCKETS {
            let (low, high) = bucket_range(i);
            assert_eq!(bucket_of(low), i);
            if high != u64::MAX {
                assert_eq!(bucket_of(high - 1), i);
                assert_eq!(bucket_of(high), i + 1);
            }
        }
    }

    #[test]
    fn a_snapshot_lists_only_the_buckets_hit_with_count_sum_and_max() {
        let h = DurationHistogram::default();
        h.record(Duration::from_micros(5));
        h.record(Duration::from_micros(7));
        h.record(Duration::from_micros(1_234));
        h.record(Duration::from_secs(1));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.max_ns, 1_000_000_000);
        assert_eq!(s.total_ns, 5_000 + 7_000 + 1_234_000 + 1_000_000_000);
        let ranges: Vec<_> = s
            .buckets
            .iter()
            .map(|b| (b.low_us, b.high_us, b.count))
            .collect();
        assert_eq!(
            ranges,
            vec![(0, 10, 2), (1_200, 1_300, 1), (100_000, u64::MAX, 1)]
        );
    }

    #[test]
    fn quantiles_are_nearest_rank_at_bucket_resolution() {
        let h = DurationHistogram::default();
        assert_eq!(h.snapshot().quantile_us(0.5), None);
        for us in [100, 200, 300, 400, 5_000] {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.quantile_us(0.0), Some(105.0));
        assert_eq!(s.quantile_us(0.5), Some(305.0));
        assert_eq!(s.quantile_us(0.8), Some(405.0));
        assert_eq!(s.quantile_us(1.0), Some(5_050.0));
    }

    #[test]
    fn the_overflow_bucket_answers_with_the_maximum() {
        let h = DurationHistogram::default();
        h.record(Duration::from_millis(250));
        assert_eq!(h.snapshot().quantile_us(0.5), Some(250_000.0));
    }
}
