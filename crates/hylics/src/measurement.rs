//! What the controller is told about one control interval: when it ran, the response times of
//! the tasks that completed in it, and how many tasks arrived.

use serde::{Deserialize, Serialize};

use crate::queueing::arrival_rate_from_count;

/// One interval's data (or part of it: measurements of the same interval merge).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// Start of the interval, seconds (any fixed origin).
    pub start_secs: f64,
    /// End of the interval, seconds.
    pub t_secs: f64,
    /// Response times of the tasks that completed in the interval, seconds. Values that are
    /// not finite and non-negative are ignored by every statistic.
    #[serde(default)]
    pub response_times_secs: Vec<f64>,
    /// Tasks that arrived in the interval.
    #[serde(default)]
    pub arrivals: u64,
}

impl Measurement {
    /// An interval with no completions and no arrivals.
    pub fn empty(start_secs: f64, t_secs: f64) -> Self {
        Self {
            start_secs,
            t_secs,
            response_times_secs: Vec::new(),
            arrivals: 0,
        }
    }

    /// An interval whose arrivals are given as timestamps; those in `[start, t)` are counted.
    pub fn with_arrival_times(
        start_secs: f64,
        t_secs: f64,
        response_times_secs: Vec<f64>,
        arrival_times_secs: &[f64],
    ) -> Self {
        let arrivals = arrival_times_secs
            .iter()
            .filter(|&&a| a >= start_secs && a < t_secs)
            .count() as u64;
        Self {
            start_secs,
            t_secs,
            response_times_secs,
            arrivals,
        }
    }

    /// Adds `other`'s tasks to this one; the interval becomes the union of both spans.
    pub fn merge(&mut self, other: Measurement) {
        self.start_secs = self.start_secs.min(other.start_secs);
        self.t_secs = self.t_secs.max(other.t_secs);
        self.response_times_secs.extend(other.response_times_secs);
        self.arrivals += other.arrivals;
    }

    /// The valid response times (finite, non-negative).
    pub fn valid_response_times(&self) -> impl Iterator<Item = f64> + '_ {
        self.response_times_secs
            .iter()
            .copied()
            .filter(|r| r.is_finite() && *r >= 0.0)
    }

    /// How many tasks with a valid response time completed.
    pub fn completed(&self) -> usize {
        self.valid_response_times().count()
    }

    /// R(k): the mean valid response time, `None` when no task completed (never NaN).
    pub fn mean_response(&self) -> Option<f64> {
        let (sum, n) = self
            .valid_response_times()
            .fold((0.0, 0usize), |(s, n), r| (s + r, n + 1));
        (n > 0).then(|| sum / n as f64)
    }

    /// λ(t): arrivals over the interval's length, `None` for an empty span.
    pub fn arrival_rate(&self) -> Option<f64> {
        arrival_rate_from_count(self.arrivals, self.start_secs, self.t_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_skip_invalid_values_and_never_produce_nan() {
        let m = Measurement {
            start_secs: 0.0,
            t_secs: 10.0,
            response_times_secs: vec![1.0, f64::NAN, 3.0, -1.0, f64::INFINITY],
            arrivals: 5,
        };
        assert_eq!(m.completed(), 2);
        assert_eq!(m.mean_response(), Some(2.0));
        assert_eq!(m.arrival_rate(), Some(0.5));
        let e = Measurement::empty(10.0, 10.0);
        assert_eq!(e.mean_response(), None);
        assert_eq!(e.arrival_rate(), None);
    }

    #[test]
    fn merge_unions_spans_and_tasks() {
        let mut a = Measurement::with_arrival_times(0.0, 5.0, vec![1.0], &[1.0, 2.0, 7.0]);
        assert_eq!(a.arrivals, 2);
        a.merge(Measurement {
            start_secs: 5.0,
            t_secs: 10.0,
            response_times_secs: vec![3.0],
            arrivals: 3,
        });
        assert_eq!((a.start_secs, a.t_secs, a.arrivals), (0.0, 10.0, 5));
        assert_eq!(a.mean_response(), Some(2.0));
    }
}
