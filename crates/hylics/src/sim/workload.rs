//! Workloads: the arrival process and the system's true E[X|m].

use serde::{Deserialize, Serialize};

use crate::service::ServiceCurve;

/// How the Poisson arrival rate evolves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateSchedule {
    /// A constant rate (workload #1: mean inter-arrival 8 s is `rate_per_sec = 0.125`).
    Constant {
        /// λ, tasks/s.
        rate_per_sec: f64,
    },
    /// `first_rate` for `half_period_secs`, then `second_rate` for as long, and so on
    /// (workload #2: mean inter-arrival alternating between 8 s and 4 s).
    Alternating {
        /// λ during the first half of each period, tasks/s.
        first_rate: f64,
        /// λ during the second half, tasks/s.
        second_rate: f64,
        /// Length of each half, seconds.
        half_period_secs: f64,
    },
}

impl RateSchedule {
    /// λ at time `t_secs`.
    pub fn rate_at(&self, t_secs: f64) -> f64 {
        match *self {
            RateSchedule::Constant { rate_per_sec } => rate_per_sec,
            RateSchedule::Alternating {
                first_rate,
                second_rate,
                half_period_secs,
            } => {
                let half = (t_secs / half_period_secs).floor();
                if half.rem_euclid(2.0) == 0.0 {
                    first_rate
                } else {
                    second_rate
                }
            }
        }
    }

    /// The first time after `t_secs` at which the rate may change (infinite if never).
    pub fn next_change_after(&self, t_secs: f64) -> f64 {
        match *self {
            RateSchedule::Constant { .. } => f64::INFINITY,
            RateSchedule::Alternating {
                half_period_secs, ..
            } => ((t_secs / half_period_secs).floor() + 1.0) * half_period_secs,
        }
    }

    /// Whether every rate is finite and non-negative and the period (if any) positive.
    pub fn is_valid(&self) -> bool {
        let ok = |r: f64| r.is_finite() && r >= 0.0;
        match *self {
            RateSchedule::Constant { rate_per_sec } => ok(rate_per_sec),
            RateSchedule::Alternating {
                first_rate,
                second_rate,
                half_period_secs,
            } => {
                ok(first_rate)
                    && ok(second_rate)
                    && half_period_secs.is_finite()
                    && half_period_secs > 0.0
            }
        }
    }
}

/// A simulated workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// The arrival process.
    pub schedule: RateSchedule,
    /// The system's real E[X|m] (the controller may be configured with a different one).
    pub true_curve: ServiceCurve,
    /// Seed of the random sequence.
    pub seed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternating_rate_switches_every_half_period() {
        let s = RateSchedule::Alternating {
            first_rate: 0.125,
            second_rate: 0.25,
            half_period_secs: 600.0,
        };
        assert_eq!(s.rate_at(0.0), 0.125);
        assert_eq!(s.rate_at(599.9), 0.125);
        assert_eq!(s.rate_at(600.0), 0.25);
        assert_eq!(s.rate_at(1200.0), 0.125);
        assert_eq!(s.next_change_after(10.0), 600.0);
        assert_eq!(s.next_change_after(600.0), 1200.0);
        assert!(s.is_valid());
        assert!(!RateSchedule::Constant { rate_per_sec: -1.0 }.is_valid());
    }
}
