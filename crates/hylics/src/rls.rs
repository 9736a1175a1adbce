//! The adaptive loop: a recursive-least-squares (RLS) estimator of the residual-error model
//! and the control law that cancels the predicted residual (Hylics §5.1, Eq. 3-10).
//!
//! # Model and sign convention
//!
//! Eq. 3-4 with delay d = 1:
//!
//! ```text
//! A(q⁻¹) y(k) = q⁻¹ B(q⁻¹) u(k),   A = 1 + a1 q⁻¹ + … + a_nA q⁻ⁿᴬ,   B = b0 + b1 q⁻¹ + … + b_nB q⁻ⁿᴮ
//! ⇔ y(k+1) = −a1 y(k) − … − a_nA y(k−nA+1) + b0 u(k) + … + b_nB u(k−nB)
//! ```
//!
//! The estimator's parameter vector θ absorbs the signs of A, so that the model is a plain
//! inner product `y(k+1) = θᵀ φ(k)` with the regressor of Eq. 6:
//!
//! ```text
//! φ(k) = [y(k), …, y(k−nA+1), u(k), …, u(k−nB)]ᵀ
//! θ    = [−a1, …, −a_nA, b0, …, b_nB]ᵀ            (dimension nA + nB + 1)
//! ```
//!
//! So for the first-order system `y(k+1) = a·y(k) + b·u(k)` the estimate converges to
//! `θ = [a, b]` (i.e. `a1 = −a`, `b0 = b`). Hylics uses nA = 1, nB = 0 (§5.2).
//!
//! # Estimator (Eq. 7-9)
//!
//! θ minimises `Σ_i [y(i) − θᵀ φ(i−1)]²` (Eq. 7), computed recursively from `F(−1) = f0·I`:
//!
//! ```text
//! F(k−1) = F(k−2) − F(k−2) φ(k−1) φ(k−1)ᵀ F(k−2) / [1 + φ(k−1)ᵀ F(k−2) φ(k−1)]   (Eq. 8)
//! θ(k)   = θ(k−1) + F(k−1) φ(k−1) [y(k) − φ(k−1)ᵀ θ(k−1)]                        (Eq. 9)
//! ```
//!
//! # Control law (Eq. 10)
//!
//! `φ(k)ᵀ θ(k) = y*(k+1)` with `y*(k+1) = 0` is solved for the only unknown in φ(k), u(k):
//!
//! ```text
//! u(k) = [y* − Σ_{i<nA} θ_i y(k−i) − Σ_{1≤j≤nB} θ_{nA+j} u(k−j)] / b0,    b0 = θ_nA
//! ```
//!
//! When `|b0|` is below a floor the law is undefined and no action is taken
//! ([`ControlLaw::B0Zero`]).
//!
//! # Extensions (off by default, so the defaults are exactly Eq. 8-9)
//!
//! * A forgetting factor `0 < λf ≤ 1` ([`AdaptiveSettings::forgetting`]):
//!   `F(k−1) = [F − Fφφᵀ F / (λf + φᵀ F φ)] / λf`, which is Eq. 8 for λf = 1. It discounts
//!   old samples so θ can follow an operating point that moves (b0 = ∂R/∂m changes by orders
//!   of magnitude between a lightly and a heavily loaded VM).
//! * A sign constraint on b0 ([`AdaptiveSettings::b0_max`]): after each update, b0 is
//!   projected onto `b0 ≤ b0_max < 0` (parameter projection onto a set known to hold the true
//!   value: more memory never makes tasks slower). Without it, a single interval in which R
//!   rose while m grew (a backlog draining) can flip the sign of b0; the control law then
//!   shrinks m whenever R is too high, and once m sits at its lower bound the applied input is
//!   0, so the estimator never sees the evidence that would flip it back.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Model orders of Eq. 3-4 (the delay d is fixed at 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelOrders {
    /// nA: how many past outputs the model uses (≥ 1).
    pub n_a: usize,
    /// nB: how many past inputs beyond the current one (≥ 0).
    pub n_b: usize,
}

impl ModelOrders {
    /// The paper's choice (§5.2): nA = 1, nB = 0.
    pub const HYLICS: ModelOrders = ModelOrders { n_a: 1, n_b: 0 };

    /// `nA + nB + 1`, the length of θ and φ.
    pub fn dim(self) -> usize {
        self.n_a + self.n_b + 1
    }
}

impl Default for ModelOrders {
    fn default() -> Self {
        Self::HYLICS
    }
}

/// Why an estimator could not be built or updated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RlsError {
    /// nA = 0: the model needs at least one past output.
    #[error("model order nA must be at least 1")]
    ZeroOutputOrder,
    /// A vector of the wrong length.
    #[error("{what} has {got} entries, the model (nA + nB + 1) needs {expected}")]
    Dimension {
        /// Which vector.
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// The initial gain f0 is not a finite positive number.
    #[error("initial gain f0 = {f0} must be a finite positive number")]
    BadGain {
        /// The rejected value.
        f0: f64,
    },
    /// The forgetting factor is not in (0, 1].
    #[error("forgetting factor {forgetting} must be in (0, 1]")]
    BadForgetting {
        /// The rejected value.
        forgetting: f64,
    },
    /// The sign constraint on b0 is not a finite negative number.
    #[error("b0_max = {b0_max} must be a finite negative number")]
    BadB0Max {
        /// The rejected value.
        b0_max: f64,
    },
    /// A non-finite number in the input or in the result of an update (which was discarded).
    #[error("{what} is not finite; the estimator was left unchanged")]
    NonFinite {
        /// What was not finite.
        what: &'static str,
    },
}

/// The RLS estimator of Eq. 8-9: parameter vector θ and adaption gain matrix F.
#[derive(Debug, Clone, PartialEq)]
pub struct Rls {
    theta: Vec<f64>,
    /// Row-major `dim × dim`.
    gain: Vec<f64>,
    /// λf; 1 is Eq. 8.
    forgetting: f64,
}

impl Rls {
    /// θ(−1) = `theta0`, F(−1) = `f0`·I, no forgetting (exactly Eq. 8-9).
    pub fn new(theta0: Vec<f64>, f0: f64) -> Result<Self, RlsError> {
        Self::with_forgetting(theta0, f0, 1.0)
    }

    /// Like [`Rls::new`] with forgetting factor `forgetting` in (0, 1].
    pub fn with_forgetting(theta0: Vec<f64>, f0: f64, forgetting: f64) -> Result<Self, RlsError> {
        if !(f0.is_finite() && f0 > 0.0) {
            return Err(RlsError::BadGain { f0 });
        }
        if !(forgetting > 0.0 && forgetting <= 1.0) {
            return Err(RlsError::BadForgetting { forgetting });
        }
        if theta0.iter().any(|v| !v.is_finite()) {
            return Err(RlsError::NonFinite { what: "theta0" });
        }
        let dim = theta0.len();
        let mut gain = vec![0.0; dim * dim];
        for i in 0..dim {
            gain[i * dim + i] = f0;
        }
        Ok(Self {
            theta: theta0,
            gain,
            forgetting,
        })
    }

    /// The current estimate θ.
    pub fn theta(&self) -> &[f64] {
        &self.theta
    }

    /// The current adaption gain F, row-major.
    pub fn gain(&self) -> &[f64] {
        &self.gain
    }

    /// Projects θ's `index`-th component onto `(-∞, bound]`; true if it had to move.
    pub fn project_upper(&mut self, index: usize, bound: f64) -> bool {
        match self.theta.get_mut(index) {
            Some(v) if *v > bound => {
                *v = bound;
                true
            }
            _ => false,
        }
    }

    /// One step: Eq. 8 with regressor `phi` = φ(k−1), then Eq. 9 with output `y` = y(k).
    /// Returns the a-priori prediction error `y(k) − φ(k−1)ᵀ θ(k−1)`.
    pub fn update(&mut self, phi: &[f64], y: f64) -> Result<f64, RlsError> {
        let dim = self.theta.len();
        if phi.len() != dim {
            return Err(RlsError::Dimension {
                what: "regressor φ",
                expected: dim,
                got: phi.len(),
            });
        }
        if !y.is_finite() || phi.iter().any(|v| !v.is_finite()) {
            return Err(RlsError::NonFinite {
                what: "regressor or output",
            });
        }
        let gain = next_gain(&self.gain, phi, self.forgetting);
        let error = y - dot(phi, &self.theta);
        let step = mat_vec(&gain, phi);
        let theta: Vec<f64> = self
            .theta
            .iter()
            .zip(&step)
            .map(|(t, s)| t + s * error)
            .collect();
        if theta.iter().chain(&gain).any(|v| !v.is_finite()) {
            return Err(RlsError::NonFinite {
                what: "updated estimate",
            });
        }
        self.theta = theta;
        self.gain = gain;
        Ok(error)
    }
}

/// Eq. 8: `F − F φ φᵀ F / (1 + φᵀ F φ)` (divided by λf, with λf in place of the 1, when
/// forgetting), symmetrised against rounding drift.
fn next_gain(gain: &[f64], phi: &[f64], forgetting: f64) -> Vec<f64> {
    let dim = phi.len();
    let f_phi = mat_vec(gain, phi);
    let denom = forgetting + dot(phi, &f_phi);
    let mut next = vec![0.0; dim * dim];
    for i in 0..dim {
        for j in 0..dim {
            // F symmetric ⇒ (F φ φᵀ F)_ij = (Fφ)_i (Fφ)_j.
            next[i * dim + j] = (gain[i * dim + j] - f_phi[i] * f_phi[j] / denom) / forgetting;
        }
    }
    for i in 0..dim {
        for j in (i + 1)..dim {
            let mean = 0.5 * (next[i * dim + j] + next[j * dim + i]);
            next[i * dim + j] = mean;
            next[j * dim + i] = mean;
        }
    }
    next
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn mat_vec(m: &[f64], v: &[f64]) -> Vec<f64> {
    let dim = v.len();
    (0..dim)
        .map(|i| dot(&m[i * dim..(i + 1) * dim], v))
        .collect()
}

/// The outcome of the control law (Eq. 10).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlLaw {
    /// The input u(k) that makes the predicted y(k+1) equal the target.
    Input(f64),
    /// `|b0|` is below the floor: u(k) is undefined, take no action.
    B0Zero {
        /// The estimate of b0 that was too small.
        b0: f64,
    },
}

/// Eq. 10 for given θ and histories: solve `φ(k)ᵀ θ = target` for u(k).
///
/// `ys` holds y(k), y(k−1), … (newest first), `past_us` holds u(k−1), u(k−2), … (newest
/// first); entries the histories lack are taken as 0.
pub fn control_law(
    theta: &[f64],
    orders: ModelOrders,
    ys: &[f64],
    past_us: &[f64],
    target: f64,
    b0_min: f64,
) -> ControlLaw {
    let b0 = theta.get(orders.n_a).copied().unwrap_or(0.0);
    if !(b0.abs() >= b0_min && b0.is_finite()) {
        return ControlLaw::B0Zero { b0 };
    }
    let from_outputs: f64 = (0..orders.n_a)
        .map(|i| theta.get(i).copied().unwrap_or(0.0) * ys.get(i).copied().unwrap_or(0.0))
        .sum();
    let from_inputs: f64 = (1..=orders.n_b)
        .map(|j| {
            let th = theta.get(orders.n_a + j).copied().unwrap_or(0.0);
            th * past_us.get(j - 1).copied().unwrap_or(0.0)
        })
        .sum();
    ControlLaw::Input((target - from_outputs - from_inputs) / b0)
}

/// How an [`AdaptiveLoop`] is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveSettings {
    /// nA, nB.
    pub orders: ModelOrders,
    /// θ(−1).
    pub theta0: Vec<f64>,
    /// f0 in F(−1) = f0·I.
    pub f0: f64,
    /// `|b0|` below this: no control action ([`ControlLaw::B0Zero`]).
    pub b0_min: f64,
    /// λf in (0, 1]; 1 is the paper's Eq. 8.
    pub forgetting: f64,
    /// If set (< 0), b0 is projected onto `b0 ≤ b0_max` after every update.
    pub b0_max: Option<f64>,
}

impl AdaptiveSettings {
    /// The paper's estimator: given orders, θ(−1) and f0, no forgetting, no projection.
    pub fn paper(orders: ModelOrders, theta0: Vec<f64>, f0: f64, b0_min: f64) -> Self {
        Self {
            orders,
            theta0,
            f0,
            b0_min,
            forgetting: 1.0,
            b0_max: None,
        }
    }
}

/// The whole adaptive loop: the estimator plus the y/u histories that form φ.
///
/// Per sample k: [`AdaptiveLoop::observe`] y(k) (updates θ with φ(k−1) once the histories are
/// long enough), [`AdaptiveLoop::control`] for u(k), then [`AdaptiveLoop::applied`] with the
/// input actually applied (after thresholds and clamping), which becomes part of φ(k).
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveLoop {
    orders: ModelOrders,
    rls: Rls,
    b0_min: f64,
    b0_max: Option<f64>,
    /// y(k), y(k−1), … newest first, at most nA entries.
    ys: VecDeque<f64>,
    /// u(k−1), u(k−2), … newest first, at most nB + 1 entries.
    us: VecDeque<f64>,
    /// An output was observed and its input not yet recorded.
    awaiting_input: bool,
}

/// What [`AdaptiveLoop::observe`] did with a sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Observed {
    /// θ was updated; the a-priori prediction error.
    Updated {
        /// `y(k) − φ(k−1)ᵀ θ(k−1)`.
        prediction_error: f64,
        /// Whether the sign constraint moved b0.
        projected: bool,
    },
    /// The histories are not yet long enough to form φ(k−1); θ unchanged.
    WarmingUp,
}

impl AdaptiveLoop {
    /// A loop starting from θ = `theta0`, F = `f0`·I.
    pub fn new(settings: AdaptiveSettings) -> Result<Self, RlsError> {
        let AdaptiveSettings {
            orders,
            theta0,
            f0,
            b0_min,
            forgetting,
            b0_max,
        } = settings;
        if orders.n_a == 0 {
            return Err(RlsError::ZeroOutputOrder);
        }
        if theta0.len() != orders.dim() {
            return Err(RlsError::Dimension {
                what: "theta0",
                expected: orders.dim(),
                got: theta0.len(),
            });
        }
        if let Some(b0_max) = b0_max.filter(|b| !(b.is_finite() && *b < 0.0)) {
            return Err(RlsError::BadB0Max { b0_max });
        }
        let mut rls = Rls::with_forgetting(theta0, f0, forgetting)?;
        if let Some(bound) = b0_max {
            rls.project_upper(orders.n_a, bound);
        }
        Ok(Self {
            orders,
            rls,
            b0_min,
            b0_max,
            ys: VecDeque::new(),
            us: VecDeque::new(),
            awaiting_input: false,
        })
    }

    /// The current estimate θ = [−a1, …, −a_nA, b0, …, b_nB].
    pub fn theta(&self) -> &[f64] {
        self.rls.theta()
    }

    /// The estimator.
    pub fn rls(&self) -> &Rls {
        &self.rls
    }

    /// Takes y(k): Eq. 8-9 with φ(k−1) when the histories are full, then records y(k).
    /// If the previous sample's input was never recorded it is taken as 0. On an estimator
    /// error y(k) is still recorded and θ is left unchanged.
    pub fn observe(&mut self, y: f64) -> Result<Observed, RlsError> {
        if self.awaiting_input {
            self.applied(0.0);
        }
        let outcome = match self.previous_regressor() {
            Some(phi) => self
                .rls
                .update(&phi, y)
                .map(|prediction_error| Observed::Updated {
                    prediction_error,
                    projected: self.project_b0(),
                }),
            None => Ok(Observed::WarmingUp),
        };
        push_bounded(&mut self.ys, y, self.orders.n_a);
        self.awaiting_input = true;
        outcome
    }

    /// Applies the sign constraint on b0, if configured; true if b0 moved.
    fn project_b0(&mut self) -> bool {
        self.b0_max
            .is_some_and(|bound| self.rls.project_upper(self.orders.n_a, bound))
    }

    /// Eq. 10 with y*(k+1) = 0 for the latest observed sample.
    pub fn control(&self) -> ControlLaw {
        let ys: Vec<f64> = self.ys.iter().copied().collect();
        let us: Vec<f64> = self.us.iter().copied().collect();
        control_law(self.theta(), self.orders, &ys, &us, 0.0, self.b0_min)
    }

    /// Records u(k), the input actually applied after the latest observation.
    pub fn applied(&mut self, u: f64) {
        push_bounded(&mut self.us, u, self.orders.n_b + 1);
        self.awaiting_input = false;
    }

    /// φ(k−1) = [y(k−1), …, y(k−nA), u(k−1), …, u(k−1−nB)], if the histories are full.
    fn previous_regressor(&self) -> Option<Vec<f64>> {
        let full = self.ys.len() == self.orders.n_a && self.us.len() == self.orders.n_b + 1;
        full.then(|| self.ys.iter().chain(&self.us).copied().collect())
    }
}

fn push_bounded(queue: &mut VecDeque<f64>, value: f64, cap: usize) {
    queue.push_front(value);
    queue.truncate(cap);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random excitation in [-1, 1).
    fn excitation(k: u64) -> f64 {
        let mut x = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    #[test]
    fn rejects_bad_construction() {
        assert_eq!(Rls::new(vec![0.0], 0.0), Err(RlsError::BadGain { f0: 0.0 }));
        assert!(matches!(
            AdaptiveLoop::new(AdaptiveSettings::paper(
                ModelOrders::HYLICS,
                vec![1.0],
                1.0,
                1e-9
            )),
            Err(RlsError::Dimension {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert_eq!(
            AdaptiveLoop::new(AdaptiveSettings::paper(
                ModelOrders { n_a: 0, n_b: 0 },
                vec![1.0],
                1.0,
                1e-9
            )),
            Err(RlsError::ZeroOutputOrder)
        );
        let mut rls = Rls::new(vec![0.0, 0.0], 1.0).unwrap();
        assert!(matches!(
            rls.update(&[1.0], 1.0),
            Err(RlsError::Dimension { .. })
        ));
        assert!(matches!(
            rls.update(&[1.0, f64::NAN], 1.0),
            Err(RlsError::NonFinite { .. })
        ));
    }

    #[test]
    fn identifies_a_first_order_system() {
        let (a, b) = (0.8, -0.05);
        let mut rls = Rls::new(vec![0.0, 0.0], 1e6).unwrap();
        let mut y = 1.0;
        for k in 0..200 {
            let u = 10.0 * excitation(k);
            let next = a * y + b * u;
            rls.update(&[y, u], next).unwrap();
            y = next;
        }
        let th = rls.theta();
        assert!((th[0] - a).abs() < 1e-6, "θ = {th:?}");
        assert!((th[1] - b).abs() < 1e-6, "θ = {th:?}");
    }

    #[test]
    fn gain_stays_symmetric_and_shrinks() {
        let mut rls = Rls::new(vec![0.0, 0.0, 0.0], 10.0).unwrap();
        for k in 0..50 {
            let phi = [excitation(k), excitation(k + 100), excitation(k + 200)];
            rls.update(&phi, excitation(k + 300)).unwrap();
        }
        let f = rls.gain();
        for i in 0..3 {
            assert!(f[i * 3 + i] > 0.0 && f[i * 3 + i] < 10.0);
            for j in 0..3 {
                assert_eq!(f[i * 3 + j], f[j * 3 + i]);
            }
        }
    }

    #[test]
    fn control_law_solves_for_the_input() {
        let theta = [0.5, -0.1, 0.2];
        let orders = ModelOrders { n_a: 1, n_b: 1 };
        // 0.5·2 − 0.1·u + 0.2·3 = 0  ⇒  u = 16
        match control_law(&theta, orders, &[2.0], &[3.0], 0.0, 1e-9) {
            ControlLaw::Input(u) => assert!((u - 16.0).abs() < 1e-9, "u = {u}"),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            control_law(&[1.0, 0.0], ModelOrders::HYLICS, &[2.0], &[], 0.0, 1e-9),
            ControlLaw::B0Zero { b0: 0.0 }
        );
    }

    /// Closed loop on `y(k+1) = a·y(k) + b·u(k)` from a deliberately wrong start (but with the
    /// right sign of b): the estimate converges to (a, b) and the output is driven to 0.
    #[test]
    fn adaptive_loop_identifies_and_regulates_a_synthetic_plant() {
        let (a, b) = (0.9, -0.02);
        let mut ctl = AdaptiveLoop::new(AdaptiveSettings::paper(
            ModelOrders::HYLICS,
            vec![0.5, -0.1],
            100.0,
            1e-9,
        ))
        .unwrap();
        let mut y = 5.0;
        for k in 0..60 {
            ctl.observe(y).unwrap();
            let u = match ctl.control() {
                ControlLaw::Input(u) => u,
                ControlLaw::B0Zero { .. } => 0.0,
            };
            // A small dither keeps the regressor persistently exciting.
            let u = u + 0.5 * excitation(k);
            ctl.applied(u);
            y = a * y + b * u;
        }
        let th = ctl.theta();
        assert!((th[0] - a).abs() < 1e-3, "θ = {th:?}");
        assert!((th[1] - b).abs() < 1e-3, "θ = {th:?}");
        assert!(y.abs() < 0.05, "y = {y}");
    }

    #[test]
    fn adaptive_loop_drives_the_output_to_zero_without_dither() {
        let (a, b) = (1.0, -0.02);
        let mut ctl = AdaptiveLoop::new(AdaptiveSettings::paper(
            ModelOrders::HYLICS,
            vec![1.0, -0.05],
            100.0,
            1e-9,
        ))
        .unwrap();
        let mut y = 5.0;
        for _ in 0..20 {
            ctl.observe(y).unwrap();
            let u = match ctl.control() {
                ControlLaw::Input(u) => u,
                ControlLaw::B0Zero { .. } => 0.0,
            };
            ctl.applied(u);
            y = a * y + b * u;
        }
        assert!(y.abs() < 1e-6, "y = {y}");
    }

    #[test]
    fn observe_warms_up_then_updates() {
        let mut ctl = AdaptiveLoop::new(AdaptiveSettings::paper(
            ModelOrders::HYLICS,
            vec![1.0, -1.0],
            1.0,
            1e-9,
        ))
        .unwrap();
        assert_eq!(ctl.observe(1.0), Ok(Observed::WarmingUp));
        ctl.applied(0.5);
        assert!(matches!(ctl.observe(0.5), Ok(Observed::Updated { .. })));
        // Forgetting to record an input counts as u = 0.
        assert!(matches!(ctl.observe(0.2), Ok(Observed::Updated { .. })));
    }
}

#[cfg(test)]
mod extension_tests {
    use super::*;

    #[test]
    fn forgetting_tracks_a_parameter_change() {
        let run = |forgetting: f64| {
            let mut rls = Rls::with_forgetting(vec![0.0, 0.0], 100.0, forgetting).unwrap();
            for k in 0..400u64 {
                let b = if k < 200 { -0.1 } else { -0.01 };
                let (y, u) = ((k % 7) as f64 - 3.0, (k % 5) as f64 - 2.0);
                rls.update(&[y, u], 0.5 * y + b * u).unwrap();
            }
            rls.theta()[1]
        };
        assert!((run(0.9) + 0.01).abs() < 1e-6);
        assert!((run(1.0) + 0.01).abs() > 1e-3);
        assert!(matches!(
            Rls::with_forgetting(vec![0.0], 1.0, 0.0),
            Err(RlsError::BadForgetting { .. })
        ));
    }

    #[test]
    fn sign_constraint_keeps_b0_negative() {
        let mut settings =
            AdaptiveSettings::paper(ModelOrders::HYLICS, vec![1.0, 0.5], 100.0, 1e-9);
        settings.b0_max = Some(-0.01);
        let mut ctl = AdaptiveLoop::new(settings.clone()).unwrap();
        assert_eq!(ctl.theta()[1], -0.01);
        ctl.observe(1.0).unwrap();
        ctl.applied(100.0);
        // R rose although m grew: unconstrained, b0 would turn positive.
        let out = ctl.observe(3.0).unwrap();
        assert!(matches!(
            out,
            Observed::Updated {
                projected: true,
                ..
            }
        ));
        assert_eq!(ctl.theta()[1], -0.01);
        assert!(matches!(ctl.control(), ControlLaw::Input(u) if u > 0.0));
        settings.b0_max = Some(0.1);
        assert!(matches!(
            AdaptiveLoop::new(settings),
            Err(RlsError::BadB0Max { .. })
        ));
    }
}
