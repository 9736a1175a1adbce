//! What the controller decided at the end of one control interval, and why.
//!
//! A [`Decision`] is one JSON line in a controller log. It is deterministic given the
//! configuration and the sequence of inputs, which is what [`crate::replay`] checks.

use serde::{Deserialize, Serialize};

use crate::config::Mode;

/// Why the share size is what it is after a decision (several may apply, in the order they
/// happened).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// [`Mode::Static`]: the size never changes.
    Static,
    /// No task completed in the interval: R(k) is undefined, nothing changes.
    NoData,
    /// ΔR >= R_thresh and the predictor set m ← m̂ (Algorithm 1 lines 6-10).
    QueueingReset,
    /// The predictor ran but even the curve's largest m cannot meet τ at the estimated λ.
    PredictorCannotMeet,
    /// The predictor should have run but λ could not be estimated (zero-length interval).
    NoArrivalRate,
    /// |Δm| >= m_thresh: the RLS adjustment was applied (lines 14-16).
    AdaptiveStep,
    /// The proposed change was below m_thresh (line 18), or (queueing only) ΔR < R_thresh.
    WithinThresholds,
    /// |b0| ≈ 0: the control law (Eq. 10) is undefined, no adaptive action.
    B0Zero,
    /// The sign constraint (extension) moved b0 back to `b0_max`.
    B0Projected,
    /// The estimator rejected the update (non-finite values); θ was left unchanged.
    EstimatorError,
    /// A proposed size was clamped to `[m_min, m_max]`.
    Clamped,
}

/// One control decision (Algorithm 1, one pass of the loop body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// When the interval ended (the decision's time), seconds.
    pub t_secs: f64,
    /// The controller's mode.
    pub mode: Mode,
    /// Sequence number of the decision, from 0.
    pub k: u64,
    /// Tasks with a valid response time in the interval.
    pub tasks: usize,
    /// R(k), the mean response time (`None`: no task completed).
    pub measured_r_secs: Option<f64>,
    /// λ(t), the arrival rate over the interval (`None`: zero-length interval).
    pub lambda: Option<f64>,
    /// The control interval ci that just expired.
    pub ci_secs: f64,
    /// The next control interval (after lines 16/18).
    pub next_ci_secs: f64,
    /// Share size during the interval.
    pub m_before_bytes: u64,
    /// Share size to apply now.
    pub m_after_bytes: u64,
    /// Δm proposed by the control law (Eq. 10), bytes, before thresholds and clamping.
    pub delta_m_rls_bytes: Option<f64>,
    /// m̂ from the predictor, if it was recomputed in this interval.
    pub m_hat_bytes: Option<u64>,
    /// Eq. 2 at `m_after_bytes` and `lambda` (`None`: unstable or λ unknown).
    pub predicted_r_secs: Option<f64>,
    /// θ after this decision's update, `[−a1, …, −a_nA, b0, …, b_nB]` (u in the configured unit).
    pub theta: Vec<f64>,
    /// Why, in order.
    pub reasons: Vec<Reason>,
}

/// How close two logged floating-point values must be to count as equal (relative). Replay
/// recomputes bit-identical values; the tolerance only absorbs JSON float parsing.
pub const FLOAT_TOLERANCE: f64 = 1e-9;

/// A field on which two decisions differ, with both values rendered for the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDifference {
    /// The field's name.
    pub field: &'static str,
    /// The value in the first decision (the log).
    pub left: String,
    /// The value in the second decision (the replay).
    pub right: String,
}

impl Decision {
    /// The first field on which `self` and `other` differ (floats within
    /// [`FLOAT_TOLERANCE`]), or `None` if they match.
    pub fn first_difference(&self, other: &Decision) -> Option<FieldDifference> {
        let checks: [(&'static str, bool); 15] = [
            ("t_secs", close(self.t_secs, other.t_secs)),
            ("mode", self.mode == other.mode),
            ("k", self.k == other.k),
            ("tasks", self.tasks == other.tasks),
            (
                "measured_r_secs",
                close_opt(self.measured_r_secs, other.measured_r_secs),
            ),
            ("lambda", close_opt(self.lambda, other.lambda)),
            ("ci_secs", close(self.ci_secs, other.ci_secs)),
            ("next_ci_secs", close(self.next_ci_secs, other.next_ci_secs)),
            (
                "m_before_bytes",
                self.m_before_bytes == other.m_before_bytes,
            ),
            ("m_after_bytes", self.m_after_bytes == other.m_after_bytes),
            (
                "delta_m_rls_bytes",
                close_opt(self.delta_m_rls_bytes, other.delta_m_rls_bytes),
            ),
            ("m_hat_bytes", self.m_hat_bytes == other.m_hat_bytes),
            (
                "predicted_r_secs",
                close_opt(self.predicted_r_secs, other.predicted_r_secs),
            ),
            ("theta", close_slices(&self.theta, &other.theta)),
            ("reasons", self.reasons == other.reasons),
        ];
        let field = checks.iter().find(|(_, same)| !same)?.0;
        Some(FieldDifference {
            field,
            left: self.render(field),
            right: other.render(field),
        })
    }

    /// One field rendered as JSON (for difference messages).
    fn render(&self, field: &str) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get(field).map(|f| f.to_string()))
            .unwrap_or_default()
    }
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= FLOAT_TOLERANCE * a.abs().max(b.abs()).max(1.0)
}

fn close_opt(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => close(a, b),
        (None, None) => true,
        _ => false,
    }
}

fn close_slices(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| close(*x, *y))
}
