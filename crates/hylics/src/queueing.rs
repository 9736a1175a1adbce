//! The queueing-model predictor: a Hylics VM as an M/G/1 processor-sharing queue (§5.1).
//!
//! For M/G/1/PS the mean response time depends on the service distribution only through its
//! mean (Eq. 1): `R = E[X] / (1 - ρ)` with load `ρ = λ E[X]`. Hylics makes the mean service
//! time a function of the share size m (Eq. 2):
//!
//! ```text
//! R(t) = E[X|m] / (1 - λ(t) E[X|m])          (finite only while λ(t) E[X|m] < 1)
//! ```
//!
//! Solving Eq. 2 for the reference delay τ gives the service time that would make R = τ:
//! `τ = s / (1 - λ s)  ⇔  s* = τ / (1 + λ τ)`. The predictor's size is then
//! `m̂ = smallest m with E[X|m] <= s*` ([`ServiceCurve::smallest_m_meeting`]), or the
//! largest measured m when no measured size is fast enough ([`solve_m`]).
//!
//! λ(t) is estimated from the arrivals in the last control interval: their count divided by
//! the interval's length ([`arrival_rate_from_count`], [`arrival_rate_from_times`]).

use serde::{Deserialize, Serialize};

use crate::service::ServiceCurve;

/// Eq. 2: the predicted mean response time for mean service time `service_secs` at arrival
/// rate `lambda` (tasks/s); `None` when the queue is unstable (`λ E[X|m] >= 1`) or an input is
/// not a finite non-negative number.
pub fn predicted_response(service_secs: f64, lambda: f64) -> Option<f64> {
    if !(is_non_negative(service_secs) && is_non_negative(lambda)) {
        return None;
    }
    let load = lambda * service_secs;
    (load < 1.0).then(|| service_secs / (1.0 - load))
}

/// Eq. 2 solved for the service time: `s* = τ / (1 + λ τ)`, the mean service time that makes
/// the predicted response time exactly `tau_secs`. `None` for a non-positive or non-finite τ or
/// a negative or non-finite λ.
pub fn required_service(tau_secs: f64, lambda: f64) -> Option<f64> {
    if !(tau_secs.is_finite() && tau_secs > 0.0 && is_non_negative(lambda)) {
        return None;
    }
    Some(tau_secs / (1.0 + lambda * tau_secs))
}

/// The predictor's answer for one (τ, λ) pair.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The arrival rate used, tasks/s.
    pub lambda: f64,
    /// `s* = τ / (1 + λ τ)`, seconds.
    pub required_service_secs: f64,
    /// m̂: the smallest measured m with E\[X|m\] <= s*, or the curve's largest m.
    pub m_hat_bytes: u64,
    /// Whether m̂ meets s* (false: even the largest measured m is too slow).
    pub meets: bool,
    /// Eq. 2 at m̂ (`None`: unstable even there).
    pub predicted_r_secs: Option<f64>,
}

/// Solves Eq. 2 for m given the reference delay `tau_secs` and the arrival rate `lambda`;
/// `None` when τ or λ is invalid (see [`required_service`]).
pub fn solve_m(curve: &ServiceCurve, tau_secs: f64, lambda: f64) -> Option<Prediction> {
    let required = required_service(tau_secs, lambda)?;
    let found = curve.smallest_m_meeting(required);
    let m_hat = found.unwrap_or_else(|| curve.max_m());
    Some(Prediction {
        lambda,
        required_service_secs: required,
        m_hat_bytes: m_hat,
        meets: found.is_some(),
        predicted_r_secs: predicted_response(curve.service(m_hat), lambda),
    })
}

/// λ(t) from a count of arrivals in `[start_secs, end_secs)`; `None` for an empty or
/// inverted interval.
pub fn arrival_rate_from_count(arrivals: u64, start_secs: f64, end_secs: f64) -> Option<f64> {
    let span = end_secs - start_secs;
    (span.is_finite() && span > 0.0).then(|| arrivals as f64 / span)
}

/// λ(t) from arrival timestamps: those in `[start_secs, end_secs)` over the interval's length.
pub fn arrival_rate_from_times(times: &[f64], start_secs: f64, end_secs: f64) -> Option<f64> {
    let inside = times
        .iter()
        .filter(|&&t| t >= start_secs && t < end_secs)
        .count();
    arrival_rate_from_count(inside as u64, start_secs, end_secs)
}

fn is_non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::ServicePoint;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn curve() -> ServiceCurve {
        ServiceCurve::new(vec![
            ServicePoint {
                m_bytes: 64 * MIB,
                service_secs: 2.0,
            },
            ServicePoint {
                m_bytes: 1024 * MIB,
                service_secs: 0.5,
            },
        ])
        .unwrap()
    }

    #[test]
    fn response_time_formula() {
        assert_eq!(predicted_response(1.0, 0.0), Some(1.0));
        assert_eq!(predicted_response(1.0, 0.5), Some(2.0));
        assert_eq!(predicted_response(2.0, 0.25), Some(4.0));
        assert_eq!(predicted_response(1.0, 1.0), None);
        assert_eq!(predicted_response(2.0, 0.6), None);
        assert_eq!(predicted_response(f64::NAN, 0.1), None);
        assert_eq!(predicted_response(1.0, -0.1), None);
    }

    #[test]
    fn required_service_inverts_the_formula() {
        let s = required_service(4.0, 0.5).unwrap();
        assert!((s - 4.0 / 3.0).abs() < 1e-12);
        assert!((predicted_response(s, 0.5).unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(required_service(0.0, 0.5), None);
        assert_eq!(required_service(4.0, f64::INFINITY), None);
    }

    #[test]
    fn solve_m_round_trips_through_the_curve() {
        let c = curve();
        let p = solve_m(&c, 4.0, 0.5).unwrap();
        assert!(p.meets);
        let r = p.predicted_r_secs.unwrap();
        assert!(r <= 4.0 + 1e-9 && r > 3.99, "r = {r}");
        let below = predicted_response(c.service(p.m_hat_bytes - 1), 0.5).unwrap();
        assert!(below > 4.0);
    }

    #[test]
    fn solve_m_falls_back_to_the_largest_m() {
        let c = curve();
        let p = solve_m(&c, 1.0, 2.5).unwrap();
        assert!(!p.meets);
        assert_eq!(p.m_hat_bytes, 1024 * MIB);
        assert_eq!(p.predicted_r_secs, None);
        assert_eq!(solve_m(&c, 100.0, 0.0).unwrap().m_hat_bytes, 64 * MIB);
    }

    #[test]
    fn arrival_rate_estimates() {
        assert_eq!(arrival_rate_from_count(30, 10.0, 40.0), Some(1.0));
        assert_eq!(arrival_rate_from_count(3, 10.0, 10.0), None);
        let times = [9.9, 10.0, 15.0, 39.9, 40.0];
        assert_eq!(arrival_rate_from_times(&times, 10.0, 40.0), Some(0.1));
    }

    proptest! {
        #[test]
        fn solving_then_predicting_hits_tau(tau in 0.6f64..20.0, lambda in 0.0f64..1.0) {
            let c = curve();
            let p = solve_m(&c, tau, lambda).unwrap();
            if p.meets && p.m_hat_bytes > c.min_m() {
                let r = p.predicted_r_secs.unwrap();
                prop_assert!(r <= tau * (1.0 + 1e-9));
                prop_assert!(r >= tau * 0.999);
            }
        }
    }
}
