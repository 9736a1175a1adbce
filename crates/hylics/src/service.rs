//! E\[X|m\]: the mean service time of a task as a function of the share size m.
//!
//! Hylics §5.2 measures E\[X|m\] offline: a lightweight workload (no queueing) runs with the
//! share set to several sizes, and the mean response time at each size is taken as the mean
//! service time. A [`ServiceCurve`] holds those measurements as `(m_bytes, service_secs)`
//! points and answers two questions for the queueing predictor ([`crate::queueing`]):
//!
//! * [`ServiceCurve::service`]: E\[X|m\] for any m, by piecewise-linear interpolation between
//!   the measured points, clamped to the first (last) point's value below (above) the range;
//! * [`ServiceCurve::smallest_m_meeting`]: the smallest m within the measured range whose
//!   E\[X|m\] is at most a target service time (the inverse Eq. 2 needs).
//!
//! The JSON form, written by the measurement script and read back here, is
//! `{"points":[{"m_bytes":67108864,"service_secs":2.0}, ...]}` ([`CurveFile`]); a curve is
//! validated whenever it is built, including when it is deserialized inside a larger document.

use serde::{Deserialize, Serialize};

/// One offline measurement: the mean service time observed with a share of `m_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServicePoint {
    /// Share size, bytes.
    pub m_bytes: u64,
    /// Mean service time measured at that size, seconds.
    pub service_secs: f64,
}

/// The on-disk (JSON) form of a service curve, exactly as the measurement script writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurveFile {
    /// The measurements, sorted by strictly increasing `m_bytes`.
    pub points: Vec<ServicePoint>,
}

/// Why a service curve was rejected.
#[derive(Debug, thiserror::Error)]
pub enum CurveError {
    /// No points at all.
    #[error("a service curve needs at least one point")]
    Empty,
    /// The points are not sorted by strictly increasing share size.
    #[error(
        "service curve point {index}: m_bytes {m_bytes} is not greater than the previous point's {previous}"
    )]
    NotIncreasing {
        /// Index of the offending point.
        index: usize,
        /// Its share size.
        m_bytes: u64,
        /// The previous point's share size.
        previous: u64,
    },
    /// A service time that is not a finite number greater than zero.
    #[error(
        "service curve point {index} (m_bytes {m_bytes}): service time {service_secs} s is not a finite positive number"
    )]
    BadServiceTime {
        /// Index of the offending point.
        index: usize,
        /// Its share size.
        m_bytes: u64,
        /// The rejected service time.
        service_secs: f64,
    },
    /// The JSON text could not be parsed as a [`CurveFile`].
    #[error("parsing the service curve JSON: {source}")]
    Json {
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
}

/// A validated E\[X|m\] curve: at least one point, strictly increasing m, finite positive times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "CurveFile", into = "CurveFile")]
pub struct ServiceCurve {
    points: Vec<ServicePoint>,
}

impl ServiceCurve {
    /// Validates `points` and builds the curve.
    pub fn new(points: Vec<ServicePoint>) -> Result<Self, CurveError> {
        validate_points(&points)?;
        Ok(Self { points })
    }

    /// Parses and validates the JSON form ([`CurveFile`]).
    pub fn from_json(text: &str) -> Result<Self, CurveError> {
        let file: CurveFile =
            serde_json::from_str(text).map_err(|source| CurveError::Json { source })?;
        Self::new(file.points)
    }

    /// The JSON form ([`CurveFile`]), pretty-printed.
    pub fn to_json(&self) -> Result<String, CurveError> {
        serde_json::to_string_pretty(&CurveFile::from(self.clone()))
            .map_err(|source| CurveError::Json { source })
    }

    /// The measured points, in increasing m.
    pub fn points(&self) -> &[ServicePoint] {
        &self.points
    }

    /// The smallest measured share size.
    pub fn min_m(&self) -> u64 {
        self.first().m_bytes
    }

    /// The largest measured share size.
    pub fn max_m(&self) -> u64 {
        self.last().m_bytes
    }

    /// E\[X|m\] in seconds: linear between the two points around `m_bytes`, clamped outside.
    pub fn service(&self, m_bytes: u64) -> f64 {
        let (first, last) = (self.first(), self.last());
        if m_bytes <= first.m_bytes {
            return first.service_secs;
        }
        if m_bytes >= last.m_bytes {
            return last.service_secs;
        }
        // first.m < m < last.m, so 1 <= upper <= len - 1.
        let upper = self.points.partition_point(|p| p.m_bytes <= m_bytes);
        interpolate(self.points[upper - 1], self.points[upper], m_bytes)
    }

    /// The smallest m in `[min_m, max_m]` with E\[X|m\] <= `target_secs`, or `None` when no
    /// measured size is fast enough. Segments are searched in increasing m, so a curve that
    /// is not monotone (noisy measurements) still yields the smallest such m.
    pub fn smallest_m_meeting(&self, target_secs: f64) -> Option<u64> {
        if target_secs.is_nan() {
            return None;
        }
        let first = self.first();
        if first.service_secs <= target_secs {
            return Some(first.m_bytes);
        }
        self.points
            .windows(2)
            .find(|w| w[1].service_secs <= target_secs)
            .map(|w| self.crossing(w[0], w[1], target_secs))
    }

    /// The smallest integer m in `(lo.m, hi.m]` whose interpolated service time is at most
    /// `target`, given `lo.service > target >= hi.service`.
    fn crossing(&self, lo: ServicePoint, hi: ServicePoint, target: f64) -> u64 {
        let span = (hi.m_bytes - lo.m_bytes) as f64;
        let frac = (lo.service_secs - target) / (lo.service_secs - hi.service_secs);
        let offset = (frac * span).ceil().clamp(1.0, span) as u64;
        let mut m = lo.m_bytes + offset;
        // Rounding can leave the estimate one byte off either way; settle it exactly.
        while m < hi.m_bytes && self.service(m) > target {
            m += 1;
        }
        while m > lo.m_bytes + 1 && self.service(m - 1) <= target {
            m -= 1;
        }
        m
    }

    fn first(&self) -> ServicePoint {
        // Validated non-empty at construction.
        self.points[0]
    }

    fn last(&self) -> ServicePoint {
        self.points[self.points.len() - 1]
    }
}

impl TryFrom<CurveFile> for ServiceCurve {
    type Error = CurveError;

    fn try_from(file: CurveFile) -> Result<Self, Self::Error> {
        Self::new(file.points)
    }
}

impl From<ServiceCurve> for CurveFile {
    fn from(curve: ServiceCurve) -> Self {
        CurveFile {
            points: curve.points,
        }
    }
}

/// Checks the three rules of a curve: non-empty, strictly increasing m, finite positive times.
fn validate_points(points: &[ServicePoint]) -> Result<(), CurveError> {
    if points.is_empty() {
        return Err(CurveError::Empty);
    }
    for (index, p) in points.iter().enumerate() {
        if !(p.service_secs.is_finite() && p.service_secs > 0.0) {
            return Err(CurveError::BadServiceTime {
                index,
                m_bytes: p.m_bytes,
                service_secs: p.service_secs,
            });
        }
        if index > 0 && p.m_bytes <= points[index - 1].m_bytes {
            return Err(CurveError::NotIncreasing {
                index,
                m_bytes: p.m_bytes,
                previous: points[index - 1].m_bytes,
            });
        }
    }
    Ok(())
}

/// Linear interpolation of the service time at `m` between `lo` and `hi` (`lo.m <= m <= hi.m`).
fn interpolate(lo: ServicePoint, hi: ServicePoint, m: u64) -> f64 {
    let t = (m - lo.m_bytes) as f64 / (hi.m_bytes - lo.m_bytes) as f64;
    lo.service_secs + t * (hi.service_secs - lo.service_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn pt(m_bytes: u64, service_secs: f64) -> ServicePoint {
        ServicePoint {
            m_bytes,
            service_secs,
        }
    }

    fn decreasing() -> ServiceCurve {
        ServiceCurve::new(vec![
            pt(64 * MIB, 2.0),
            pt(128 * MIB, 1.0),
            pt(1024 * MIB, 0.5),
        ])
        .unwrap()
    }

    #[test]
    fn rejects_empty_unsorted_and_bad_times() {
        assert!(matches!(ServiceCurve::new(vec![]), Err(CurveError::Empty)));
        assert!(matches!(
            ServiceCurve::new(vec![pt(2, 1.0), pt(2, 0.5)]),
            Err(CurveError::NotIncreasing { index: 1, .. })
        ));
        assert!(matches!(
            ServiceCurve::new(vec![pt(3, 1.0), pt(2, 0.5)]),
            Err(CurveError::NotIncreasing { index: 1, .. })
        ));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                ServiceCurve::new(vec![pt(1, 1.0), pt(2, bad)]),
                Err(CurveError::BadServiceTime { index: 1, .. })
            ));
        }
    }

    #[test]
    fn a_single_point_is_a_constant_curve() {
        let c = ServiceCurve::new(vec![pt(100, 1.5)]).unwrap();
        assert_eq!(c.service(0), 1.5);
        assert_eq!(c.service(u64::MAX), 1.5);
        assert_eq!(c.smallest_m_meeting(1.5), Some(100));
        assert_eq!(c.smallest_m_meeting(1.4), None);
    }

    #[test]
    fn interpolates_between_points_and_clamps_outside() {
        let c = decreasing();
        assert_eq!(c.service(0), 2.0);
        assert_eq!(c.service(64 * MIB), 2.0);
        assert_eq!(c.service(96 * MIB), 1.5);
        assert_eq!(c.service(128 * MIB), 1.0);
        assert!((c.service(576 * MIB) - 0.75).abs() < 1e-12);
        assert_eq!(c.service(2048 * MIB), 0.5);
    }

    #[test]
    fn smallest_m_meeting_inverts_the_interpolation() {
        let c = decreasing();
        assert_eq!(c.smallest_m_meeting(3.0), Some(64 * MIB));
        assert_eq!(c.smallest_m_meeting(1.5), Some(96 * MIB));
        assert_eq!(c.smallest_m_meeting(1.0), Some(128 * MIB));
        assert_eq!(c.smallest_m_meeting(0.75), Some(576 * MIB));
        assert_eq!(c.smallest_m_meeting(0.5), Some(1024 * MIB));
        assert_eq!(c.smallest_m_meeting(0.49), None);
        assert_eq!(c.smallest_m_meeting(f64::NAN), None);
    }

    #[test]
    fn smallest_m_meeting_takes_the_first_crossing_of_a_noisy_curve() {
        let c =
            ServiceCurve::new(vec![pt(10, 2.0), pt(20, 0.9), pt(30, 1.2), pt(40, 0.5)]).unwrap();
        // 2.0 → 0.9 crosses 1.05 at m ≈ 18.6; 1.2 → 0.5 crosses it again at m ≈ 32.
        assert_eq!(c.smallest_m_meeting(1.05), Some(19));
        assert_eq!(c.smallest_m_meeting(1.0), Some(20));
    }

    #[test]
    fn json_round_trip_and_validation_on_deserialize() {
        let c = decreasing();
        let text = c.to_json().unwrap();
        assert_eq!(ServiceCurve::from_json(&text).unwrap(), c);
        let parsed: ServiceCurve = serde_json::from_str(
            r#"{"points":[{"m_bytes":1,"service_secs":2.0},{"m_bytes":5,"service_secs":1.0}]}"#,
        )
        .unwrap();
        assert_eq!(parsed.max_m(), 5);
        assert!(matches!(
            ServiceCurve::from_json(r#"{"points":[]}"#),
            Err(CurveError::Empty)
        ));
        assert!(matches!(
            ServiceCurve::from_json("not json"),
            Err(CurveError::Json { .. })
        ));
        assert!(serde_json::from_str::<ServiceCurve>(r#"{"points":[]}"#).is_err());
    }

    fn arb_curve() -> impl Strategy<Value = ServiceCurve> {
        prop::collection::vec((1u64..1 << 30, 0.01f64..10.0), 1..8).prop_map(|raw| {
            let mut m = 0u64;
            let points = raw
                .into_iter()
                .map(|(step, s)| {
                    m += step;
                    pt(m, s)
                })
                .collect();
            ServiceCurve::new(points).unwrap()
        })
    }

    proptest! {
        #[test]
        fn service_stays_within_the_measured_range(c in arb_curve(), m in 0u64..1 << 34) {
            let lo = c.points().iter().map(|p| p.service_secs).fold(f64::INFINITY, f64::min);
            let hi = c.points().iter().map(|p| p.service_secs).fold(0.0, f64::max);
            let s = c.service(m);
            prop_assert!(s >= lo - 1e-12 && s <= hi + 1e-12);
        }

        #[test]
        fn smallest_m_meeting_is_minimal(c in arb_curve(), target in 0.01f64..10.0) {
            match c.smallest_m_meeting(target) {
                Some(m) => {
                    prop_assert!(c.service(m) <= target);
                    prop_assert!(m >= c.min_m() && m <= c.max_m());
                    if m > c.min_m() {
                        prop_assert!(c.service(m - 1) > target);
                    }
                }
                None => prop_assert!(c.points().iter().all(|p| p.service_secs > target)),
            }
        }
    }
}
