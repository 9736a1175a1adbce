//! Algorithm 1 of Hylics §5.1: the share-size controller.
//!
//! The controller has no clock and no threads. The driver (vmsight's launcher, or
//! [`crate::sim`]) feeds it task data with [`Controller::observe`] as it arrives and calls
//! [`Controller::step`] when the control interval [`Controller::ci_secs`] expires; the
//! returned [`Decision`] says which size to give the share and when to call again.
//!
//! # One step (Algorithm 1 lines 5-19)
//!
//! ```text
//!  5  R(k) ← mean response time of the tasks completed in the interval
//!  6  if ΔR = |R(k) − R(k−1)| ≥ R_thresh            (the first measured interval counts as one)
//!  7      λ ← arrivals / interval length
//!  8      m̂ ← smallest m with E[X|m] ≤ τ/(1+λτ)      (Eq. 2 solved for m, see queueing)
//!  9      m ← m̂
//! 11-12  update F, θ (Eq. 8-9) with φ(k−1) and y(k) = R(k) − τ
//! 13  Δm ← u(k) solving φ(k)ᵀθ(k) = 0 (Eq. 10)
//! 14  if |Δm| ≥ m_thresh: m ← m + Δm; ci ← max(ci/2, ci_min)
//! 18  else ci ← min(2·ci, ci_max)
//! ```
//!
//! Conventions this implementation fixes where the paper is silent:
//!
//! * y(k) = R(k) − τ, the paper's residual error Δτ; u(k) = the total change of m applied at
//!   step k (a queueing reset plus the RLS step, after clamping), in `rls_unit_bytes`, so the
//!   estimator sees the input the system actually got.
//! * ΔR is the change of R between consecutive intervals with data (§5.2: "whenever there is
//!   a large spike in the response time, the queueing model predictor is recalculated").
//! * Every size is clamped to `[m_min, m_max]` ([`Reason::Clamped`]).
//! * An interval without completed tasks has no R(k): the decision is [`Reason::NoData`], m is
//!   unchanged, the estimator is not touched, ci doubles (no adjustment was made).
//! * Optional extensions, all off by default: an RLS forgetting factor and a sign constraint
//!   on b0 ([`crate::rls`]), and `adaptive_after_reset = false`, which skips the Δm of lines
//!   13-19 in an interval where the predictor just reset m (θ is still updated), so the
//!   correction for the old m's residual is not added on top of m̂.
//! * [`Mode::AdaptiveOnly`] runs lines 11-19 only. [`Mode::QueueingOnly`] runs lines 5-10 only,
//!   ignores a predicted change smaller than m_thresh and applies the ci rule of lines 14-19 to
//!   the predictor's change. [`Mode::Static`] never changes m or ci.

use crate::config::{ConfigError, ControllerConfig, Mode};
use crate::decision::{Decision, Reason};
use crate::measurement::Measurement;
use crate::queueing::{predicted_response, solve_m};
use crate::replay::LogRecord;
use crate::rls::{AdaptiveLoop, ControlLaw, Observed};

/// The Hylics share-size controller (Algorithm 1).
#[derive(Debug, Clone)]
pub struct Controller {
    config: ControllerConfig,
    adaptive: AdaptiveLoop,
    m_bytes: u64,
    ci_secs: f64,
    k: u64,
    /// R of the last interval with data, for ΔR.
    prev_r: Option<f64>,
    /// Data observed since the last step.
    pending: Option<Measurement>,
    /// When the last step happened (the start of the current interval).
    last_step_secs: Option<f64>,
}

impl Controller {
    /// A controller in its initial state (line 3: F = f0·I, θ = θ(−1)).
    pub fn new(config: ControllerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let adaptive = AdaptiveLoop::new(config.adaptive_settings())?;
        Ok(Self {
            m_bytes: config.m_initial_bytes,
            ci_secs: config.ci_initial_secs,
            adaptive,
            config,
            k: 0,
            prev_r: None,
            pending: None,
            last_step_secs: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// The share size the controller currently wants, bytes.
    pub fn m_bytes(&self) -> u64 {
        self.m_bytes
    }

    /// The current control interval: call [`Controller::step`] this long after the last step.
    pub fn ci_secs(&self) -> f64 {
        self.ci_secs
    }

    /// How many decisions have been made.
    pub fn k(&self) -> u64 {
        self.k
    }

    /// The current estimate θ.
    pub fn theta(&self) -> &[f64] {
        self.adaptive.theta()
    }

    /// Adds data of the current interval (e.g. one task's report); it is used by the next
    /// [`Controller::step`].
    pub fn observe(&mut self, measurement: Measurement) {
        match &mut self.pending {
            Some(p) => p.merge(measurement),
            None => self.pending = Some(measurement),
        }
    }

    /// The control interval expired at `now_secs`: merge `measurement` with the observed data
    /// and decide (Algorithm 1 lines 5-19).
    pub fn step(&mut self, now_secs: f64, measurement: Measurement) -> Decision {
        self.step_logged(now_secs, measurement).decision
    }

    /// Like [`Controller::step`], also returning the merged interval data, i.e. the log record
    /// [`crate::replay::replay`] re-runs.
    pub fn step_logged(&mut self, now_secs: f64, measurement: Measurement) -> LogRecord {
        let input = self.close_interval(now_secs, measurement);
        let decision = self.decide(&input);
        self.k += 1;
        self.last_step_secs = Some(input.t_secs);
        LogRecord { input, decision }
    }

    /// The interval's data: everything observed plus `measurement`, spanning from the last
    /// step (or, at the first step, the data's own start) to `now_secs`.
    fn close_interval(&mut self, now_secs: f64, measurement: Measurement) -> Measurement {
        let mut input = match self.pending.take() {
            Some(mut observed) => {
                observed.merge(measurement);
                observed
            }
            None => measurement,
        };
        if let Some(start) = self.last_step_secs {
            input.start_secs = start;
        }
        input.t_secs = now_secs;
        input
    }

    /// One pass of the loop body for the closed interval `input`.
    fn decide(&mut self, input: &Measurement) -> Decision {
        let r = input.mean_response();
        let lambda = input.arrival_rate();
        let mut decision = Decision {
            t_secs: input.t_secs,
            mode: self.config.mode,
            k: self.k,
            tasks: input.completed(),
            measured_r_secs: r,
            lambda,
            ci_secs: self.ci_secs,
            next_ci_secs: self.ci_secs,
            m_before_bytes: self.m_bytes,
            m_after_bytes: self.m_bytes,
            delta_m_rls_bytes: None,
            m_hat_bytes: None,
            predicted_r_secs: None,
            theta: Vec::new(),
            reasons: Vec::new(),
        };
        match (self.config.mode, r) {
            (Mode::Static, _) => decision.reasons.push(Reason::Static),
            (_, None) => {
                decision.reasons.push(Reason::NoData);
                self.lengthen_interval();
            }
            (_, Some(r)) => self.control(r, lambda, &mut decision),
        }
        decision.m_after_bytes = self.m_bytes;
        decision.next_ci_secs = self.ci_secs;
        decision.theta = self.adaptive.theta().to_vec();
        decision.predicted_r_secs =
            lambda.and_then(|l| predicted_response(self.config.curve.service(self.m_bytes), l));
        decision
    }

    /// Lines 6-19 for an interval with measured R = `r`.
    fn control(&mut self, r: f64, lambda: Option<f64>, decision: &mut Decision) {
        let m_start = self.m_bytes;
        let spike = self
            .prev_r
            .is_none_or(|prev| (r - prev).abs() >= self.config.r_thresh_secs);
        self.prev_r = Some(r);
        if self.config.mode.uses_predictor() {
            if spike {
                self.queueing_reset(lambda, decision);
            } else if !self.config.mode.uses_adaptive() {
                decision.reasons.push(Reason::WithinThresholds);
            }
        }
        if self.config.mode.uses_adaptive() {
            self.adaptive_step(r, m_start, decision);
        } else if self.m_bytes != m_start {
            self.shorten_interval();
        } else {
            self.lengthen_interval();
        }
    }

    /// Lines 7-9: estimate λ, solve Eq. 2 for m̂, set m ← m̂.
    fn queueing_reset(&mut self, lambda: Option<f64>, decision: &mut Decision) {
        let cfg = &self.config;
        let Some(prediction) = lambda.and_then(|l| solve_m(&cfg.curve, cfg.tau_secs, l)) else {
            decision.reasons.push(Reason::NoArrivalRate);
            return;
        };
        decision.m_hat_bytes = Some(prediction.m_hat_bytes);
        if !prediction.meets {
            decision.reasons.push(Reason::PredictorCannotMeet);
        }
        let target = self.clamp(prediction.m_hat_bytes as f64, decision);
        let small = target.abs_diff(self.m_bytes) < self.config.m_thresh_bytes;
        if self.config.mode == Mode::QueueingOnly && small {
            decision.reasons.push(Reason::WithinThresholds);
            return;
        }
        self.m_bytes = target;
        decision.reasons.push(Reason::QueueingReset);
    }

    /// Lines 11-19: update θ, solve Eq. 10 for Δm, apply it if large enough, adapt ci. The
    /// input recorded for the estimator is the step's whole change of m since `m_start`.
    fn adaptive_step(&mut self, r: f64, m_start: u64, decision: &mut Decision) {
        match self.adaptive.observe(r - self.config.tau_secs) {
            Err(_) => decision.reasons.push(Reason::EstimatorError),
            Ok(Observed::Updated {
                projected: true, ..
            }) => decision.reasons.push(Reason::B0Projected),
            Ok(_) => {}
        }
        let unit = self.config.rls_unit_bytes as f64;
        let reset = self.m_bytes != m_start;
        match self.adaptive.control() {
            _ if reset && !self.config.adaptive_after_reset => self.shorten_interval(),
            ControlLaw::B0Zero { .. } => {
                decision.reasons.push(Reason::B0Zero);
                self.lengthen_interval();
            }
            ControlLaw::Input(u) => self.apply_delta(u * unit, decision),
        }
        let applied = (self.m_bytes as f64 - m_start as f64) / unit;
        self.adaptive.applied(applied);
    }

    /// Lines 14-19 for a proposed change of `delta` bytes.
    fn apply_delta(&mut self, delta: f64, decision: &mut Decision) {
        decision.delta_m_rls_bytes = Some(delta);
        if delta.abs() >= self.config.m_thresh_bytes as f64 {
            self.m_bytes = self.clamp(self.m_bytes as f64 + delta, decision);
            decision.reasons.push(Reason::AdaptiveStep);
            self.shorten_interval();
        } else {
            decision.reasons.push(Reason::WithinThresholds);
            self.lengthen_interval();
        }
    }

    /// `bytes` rounded and clamped to `[m_min, m_max]`, noting a clamp in the decision.
    fn clamp(&self, bytes: f64, decision: &mut Decision) -> u64 {
        let (lo, hi) = (self.config.m_min_bytes, self.config.m_max_bytes);
        let rounded = bytes.round();
        let clamped = if rounded.is_nan() || rounded <= lo as f64 {
            lo
        } else if rounded >= hi as f64 {
            hi
        } else {
            rounded as u64
        };
        if clamped as f64 != rounded && !decision.reasons.contains(&Reason::Clamped) {
            decision.reasons.push(Reason::Clamped);
        }
        clamped
    }

    /// Line 16: ci ← max(ci/2, ci_min).
    fn shorten_interval(&mut self) {
        self.ci_secs = (self.ci_secs / 2.0).max(self.config.ci_min_secs);
    }

    /// Line 18: ci ← min(2·ci, ci_max).
    fn lengthen_interval(&mut self) {
        self.ci_secs = (self.ci_secs * 2.0).min(self.config.ci_max_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MIB;
    use crate::testutil::test_config;

    /// An interval of `len` seconds ending at `t` in which `n` tasks took `r` seconds each and
    /// `arrivals` tasks arrived.
    fn interval(t: f64, len: f64, r: f64, n: usize, arrivals: u64) -> Measurement {
        Measurement {
            start_secs: t - len,
            t_secs: t,
            response_times_secs: vec![r; n],
            arrivals,
        }
    }

    /// A controller whose estimator practically never moves (f0 ≈ 0), so Δm = −θ1·y/b0 with
    /// θ = [1, −0.05 s/MiB]: Δm = 20 MiB per second of error.
    fn frozen(mode: Mode) -> Controller {
        let mut cfg = test_config(mode);
        cfg.f0 = 1e-12;
        Controller::new(cfg).unwrap()
    }

    #[test]
    fn rejects_invalid_configurations() {
        let mut cfg = test_config(Mode::Combined);
        cfg.ci_initial_secs = 500.0;
        assert!(matches!(
            Controller::new(cfg),
            Err(ConfigError::IntervalBounds { .. })
        ));
        let mut cfg = test_config(Mode::Combined);
        cfg.m_initial_bytes = 1;
        assert!(matches!(
            Controller::new(cfg),
            Err(ConfigError::SizeBounds { .. })
        ));
        let mut cfg = test_config(Mode::Combined);
        cfg.tau_secs = f64::NAN;
        assert!(matches!(
            Controller::new(cfg),
            Err(ConfigError::NotPositive {
                field: "tau_secs",
                ..
            })
        ));
        let mut cfg = test_config(Mode::Combined);
        cfg.theta0 = vec![1.0];
        assert!(matches!(Controller::new(cfg), Err(ConfigError::Rls(_))));
    }

    #[test]
    fn static_never_changes_m_or_ci() {
        let mut c = Controller::new(test_config(Mode::Static)).unwrap();
        for (i, r) in [50.0, 0.1, 3.0, 9.0].into_iter().enumerate() {
            let t = 60.0 * (i + 1) as f64;
            let d = c.step(t, interval(t, 60.0, r, 10, 60));
            assert_eq!(d.m_after_bytes, 128 * MIB);
            assert_eq!(d.m_before_bytes, 128 * MIB);
            assert_eq!(d.next_ci_secs, 60.0);
            assert_eq!(d.reasons, [Reason::Static]);
        }
        let d = c.step(300.0, Measurement::empty(240.0, 300.0));
        assert_eq!(d.m_after_bytes, 128 * MIB);
    }

    #[test]
    fn queueing_only_jumps_to_m_hat_on_a_large_change() {
        let cfg = test_config(Mode::QueueingOnly);
        let expected = solve_m(&cfg.curve, cfg.tau_secs, 1.0).unwrap().m_hat_bytes;
        let mut c = Controller::new(cfg.clone()).unwrap();
        // First interval: counts as a spike; λ = 60/60 s.
        let d = c.step(60.0, interval(60.0, 60.0, 12.0, 40, 60));
        assert_eq!(d.m_hat_bytes, Some(expected));
        assert_eq!(d.m_after_bytes, expected);
        assert_eq!(d.reasons, [Reason::QueueingReset]);
        assert_eq!(d.next_ci_secs, 30.0);
        // A small change of R: the predictor is not consulted.
        let d = c.step(90.0, interval(90.0, 30.0, 11.0, 30, 15));
        assert_eq!(d.m_hat_bytes, None);
        assert_eq!(d.m_after_bytes, expected);
        assert_eq!(d.reasons, [Reason::WithinThresholds]);
        assert_eq!(d.next_ci_secs, 60.0);
        // A large change at half the rate: m̂ for λ = 0.5.
        let lower = solve_m(&cfg.curve, cfg.tau_secs, 0.5).unwrap().m_hat_bytes;
        let d = c.step(150.0, interval(150.0, 60.0, 2.0, 30, 30));
        assert_eq!(d.m_after_bytes, lower);
        assert!(lower < expected);
    }

    #[test]
    fn queueing_only_ignores_predicted_changes_below_m_thresh() {
        let mut cfg = test_config(Mode::QueueingOnly);
        cfg.m_initial_bytes = solve_m(&cfg.curve, cfg.tau_secs, 1.0).unwrap().m_hat_bytes + MIB;
        let mut c = Controller::new(cfg.clone()).unwrap();
        let d = c.step(60.0, interval(60.0, 60.0, 12.0, 40, 60));
        assert!(d.m_hat_bytes.is_some());
        assert_eq!(d.m_after_bytes, cfg.m_initial_bytes);
        assert_eq!(d.reasons, [Reason::WithinThresholds]);
    }

    #[test]
    fn ci_halves_after_an_adjustment_and_doubles_otherwise_within_bounds() {
        let mut c = frozen(Mode::AdaptiveOnly);
        let mut t = 0.0;
        let mut next = |c: &mut Controller, r: f64| {
            t += c.ci_secs();
            c.step(t, interval(t, c.ci_secs(), r, 10, 10))
        };
        // 5 s of error ⇒ Δm = 100 MiB ≥ m_thresh: adjust, ci 60 → 30 → 30 (ci_min).
        let cis: Vec<f64> = (0..2).map(|_| next(&mut c, 8.0).next_ci_secs).collect();
        assert_eq!(cis, [30.0, 30.0]);
        // 0.1 s of error ⇒ Δm = 2 MiB < m_thresh: ci 30 → 60 → 120 → 240 → 240 (ci_max).
        let cis: Vec<f64> = (0..4).map(|_| next(&mut c, 3.1).next_ci_secs).collect();
        assert_eq!(cis, [60.0, 120.0, 240.0, 240.0]);
        let d = next(&mut c, 8.0);
        assert_eq!((d.ci_secs, d.next_ci_secs), (240.0, 120.0));
    }

    #[test]
    fn thresholds_suppress_small_changes() {
        let mut c = frozen(Mode::AdaptiveOnly);
        // 0.5 s of error ⇒ Δm ≈ 10 MiB < 16 MiB: nothing happens.
        let d = c.step(60.0, interval(60.0, 60.0, 3.5, 10, 10));
        let dm = d.delta_m_rls_bytes.unwrap();
        assert!((dm - 10.0 * MIB as f64).abs() < 0.01 * MIB as f64, "{dm}");
        assert_eq!(d.m_after_bytes, 128 * MIB);
        assert_eq!(d.reasons, [Reason::WithinThresholds]);
        // 1 s of error ⇒ Δm ≈ 20 MiB: applied.
        let d = c.step(180.0, interval(180.0, 120.0, 4.0, 10, 10));
        assert_eq!(d.reasons, [Reason::AdaptiveStep]);
        let grown = d.m_after_bytes - 128 * MIB;
        assert!(grown.abs_diff(20 * MIB) < MIB / 100, "{grown}");
        // Combined: a change of R below R_thresh does not consult the predictor.
        let mut c = frozen(Mode::Combined);
        c.step(60.0, interval(60.0, 60.0, 3.2, 10, 10));
        let d = c.step(120.0, interval(120.0, 60.0, 3.3, 10, 10));
        assert_eq!(d.m_hat_bytes, None);
        assert_eq!(d.reasons, [Reason::WithinThresholds]);
    }

    #[test]
    fn adaptive_steps_are_clamped_to_the_bounds() {
        let mut c = frozen(Mode::AdaptiveOnly);
        let d = c.step(60.0, interval(60.0, 60.0, 100.0, 10, 10));
        assert_eq!(d.m_after_bytes, 1024 * MIB);
        assert_eq!(d.reasons, [Reason::Clamped, Reason::AdaptiveStep]);
        let d = c.step(90.0, interval(90.0, 30.0, 0.01, 10, 10));
        assert!(d.m_after_bytes < 1024 * MIB);
    }

    #[test]
    fn combined_resets_then_adds_the_adaptive_step() {
        let cfg = test_config(Mode::Combined);
        let m_hat = solve_m(&cfg.curve, cfg.tau_secs, 1.0).unwrap().m_hat_bytes;
        let mut c = frozen(Mode::Combined);
        let d = c.step(60.0, interval(60.0, 60.0, 4.0, 10, 60));
        assert_eq!(d.m_hat_bytes, Some(m_hat));
        assert_eq!(d.reasons, [Reason::QueueingReset, Reason::AdaptiveStep]);
        let dm = d.delta_m_rls_bytes.unwrap();
        assert_eq!(d.m_after_bytes, (m_hat as f64 + dm).round() as u64);
    }

    #[test]
    fn intervals_without_completions_change_nothing_and_produce_no_nan() {
        for mode in [Mode::AdaptiveOnly, Mode::QueueingOnly, Mode::Combined] {
            let mut c = Controller::new(test_config(mode)).unwrap();
            let d = c.step(60.0, Measurement::empty(0.0, 60.0));
            assert_eq!(d.reasons, [Reason::NoData]);
            assert_eq!(d.m_after_bytes, 128 * MIB);
            assert_eq!(d.measured_r_secs, None);
            assert_eq!(d.next_ci_secs, 120.0);
            let mut all = vec![d.t_secs, d.ci_secs, d.next_ci_secs];
            all.extend(d.lambda.iter().chain(&d.predicted_r_secs).chain(&d.theta));
            assert!(all.iter().all(|v| v.is_finite()), "{d:?}");
            assert!(!serde_json::to_string(&d).unwrap().contains("NaN"));
        }
    }

    #[test]
    fn b0_near_zero_means_no_control_action() {
        let mut cfg = test_config(Mode::AdaptiveOnly);
        cfg.theta0 = vec![1.0, 0.0];
        let mut c = Controller::new(cfg).unwrap();
        let d = c.step(60.0, interval(60.0, 60.0, 10.0, 10, 10));
        assert_eq!(d.reasons, [Reason::B0Zero]);
        assert_eq!(d.m_after_bytes, 128 * MIB);
        assert_eq!(d.delta_m_rls_bytes, None);
    }

    #[test]
    fn observed_data_merges_into_the_step() {
        let mut a = Controller::new(test_config(Mode::Combined)).unwrap();
        let mut b = Controller::new(test_config(Mode::Combined)).unwrap();
        a.observe(Measurement::with_arrival_times(
            0.0,
            20.0,
            vec![2.0],
            &[1.0, 5.0],
        ));
        a.observe(Measurement::with_arrival_times(
            20.0,
            40.0,
            vec![4.0],
            &[25.0],
        ));
        let rec = a.step_logged(60.0, Measurement::empty(40.0, 60.0));
        let d = b.step(60.0, interval(60.0, 60.0, 3.0, 2, 3));
        assert_eq!(rec.input.mean_response(), Some(3.0));
        assert_eq!(rec.input.arrivals, 3);
        assert_eq!(rec.decision, d);
        // The next interval starts where the last step ended.
        let rec = a.step_logged(90.0, interval(90.0, 10.0, 3.0, 1, 1));
        assert_eq!(rec.input.start_secs, 60.0);
    }
}
