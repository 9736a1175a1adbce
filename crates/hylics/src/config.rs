//! The controller's configuration: mode, SLO, thresholds of Algorithm 1 and the model inputs.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::rls::{AdaptiveSettings, ModelOrders, RlsError};
use crate::service::ServiceCurve;

/// One MiB, the default unit of u(k) inside the estimator.
pub const MIB: u64 = 1 << 20;

/// Which parts of Algorithm 1 run (the schemes compared in §6.4, plus a static baseline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The share keeps its initial size; decisions only record measurements.
    Static,
    /// The RLS loop only (Algorithm 1 lines 11-19): "adaptive only".
    AdaptiveOnly,
    /// The queueing predictor only (lines 5-10): "queueing prediction".
    QueueingOnly,
    /// Both, as Algorithm 1.
    Combined,
}

impl Mode {
    /// All modes, in the order they are usually compared.
    pub const ALL: [Mode; 4] = [
        Mode::Static,
        Mode::AdaptiveOnly,
        Mode::QueueingOnly,
        Mode::Combined,
    ];

    /// Whether the queueing predictor runs (lines 6-10).
    pub fn uses_predictor(self) -> bool {
        matches!(self, Mode::QueueingOnly | Mode::Combined)
    }

    /// Whether the RLS loop runs (lines 11-19).
    pub fn uses_adaptive(self) -> bool {
        matches!(self, Mode::AdaptiveOnly | Mode::Combined)
    }

    /// The name used in JSON and on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Static => "static",
            Mode::AdaptiveOnly => "adaptive_only",
            Mode::QueueingOnly => "queueing_only",
            Mode::Combined => "combined",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A mode name that is none of [`Mode::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown Hylics controller mode {0:?} (static, adaptive_only, queueing_only, combined)")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s || m.name().replace('_', "-") == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// Everything the controller needs; all sizes in bytes, all times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerConfig {
    /// Which parts of Algorithm 1 run.
    pub mode: Mode,
    /// τ, the reference delay (the SLO on the mean response time).
    pub tau_secs: f64,
    /// R_thresh: a change of the measured R of at least this much between two intervals
    /// triggers the queueing predictor (line 6).
    pub r_thresh_secs: f64,
    /// m_thresh: an RLS adjustment smaller than this is not applied (line 14); in
    /// [`Mode::QueueingOnly`] it also suppresses predictor changes smaller than this.
    pub m_thresh_bytes: u64,
    /// ci_minthresh: the shortest control interval (line 16).
    pub ci_min_secs: f64,
    /// ci_maxthresh: the longest control interval (line 18).
    pub ci_max_secs: f64,
    /// The first control interval.
    pub ci_initial_secs: f64,
    /// Smallest share the controller may set.
    pub m_min_bytes: u64,
    /// Largest share the controller may set.
    pub m_max_bytes: u64,
    /// The share's size when the controller starts.
    pub m_initial_bytes: u64,
    /// f0 in F(−1) = f0·I (must be > 0).
    pub f0: f64,
    /// θ(−1), `[−a1, …, −a_nA, b0, …, b_nB]` with y in seconds and u in `rls_unit_bytes`
    /// (see [`crate::rls`] for the sign convention). b0 should carry the expected sign of
    /// ∂R/∂m (negative: more memory, faster tasks), or the loop starts by pushing the wrong way.
    pub theta0: Vec<f64>,
    /// nA, nB (the paper: 1, 0).
    #[serde(default)]
    pub orders: ModelOrders,
    /// The unit of u(k) = Δm inside the estimator, so θ is well scaled (default 1 MiB).
    #[serde(default = "default_unit")]
    pub rls_unit_bytes: u64,
    /// |b0| below this means "b0 ≈ 0": the control law is not applied.
    #[serde(default = "default_b0_min")]
    pub b0_min: f64,
    /// Extension: RLS forgetting factor λf in (0, 1] (default 1: the paper's Eq. 8).
    #[serde(default = "default_forgetting")]
    pub forgetting: f64,
    /// Extension: if set (< 0, s per `rls_unit_bytes`), b0 is projected onto `b0 ≤ b0_max`
    /// after every update (default: off, as in the paper). See [`crate::rls`].
    #[serde(default)]
    pub b0_max: Option<f64>,
    /// Extension: whether the RLS step (lines 11-19) also runs in an interval where the
    /// queueing predictor reset m (default true: Algorithm 1 as printed). When false, such an
    /// interval still updates θ (lines 11-12) but applies no Δm on top of m̂, and ci halves.
    #[serde(default = "default_true")]
    pub adaptive_after_reset: bool,
    /// E\[X|m\], measured offline.
    pub curve: ServiceCurve,
}

fn default_unit() -> u64 {
    MIB
}

fn default_b0_min() -> f64 {
    1e-9
}

fn default_forgetting() -> f64 {
    1.0
}

fn default_true() -> bool {
    true
}

/// Why a configuration was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A time, threshold or gain that must be a finite positive number is not.
    #[error("{field} = {value} must be a finite positive number")]
    NotPositive {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// `ci_min_secs > ci_max_secs`, or the initial interval lies outside them.
    #[error("control interval bounds: need ci_min {min} <= ci_initial {initial} <= ci_max {max}")]
    IntervalBounds {
        /// ci_min_secs.
        min: f64,
        /// ci_initial_secs.
        initial: f64,
        /// ci_max_secs.
        max: f64,
    },
    /// `m_min_bytes > m_max_bytes`, or the initial size lies outside them.
    #[error("share size bounds: need m_min {min} <= m_initial {initial} <= m_max {max} bytes")]
    SizeBounds {
        /// m_min_bytes.
        min: u64,
        /// m_initial_bytes.
        initial: u64,
        /// m_max_bytes.
        max: u64,
    },
    /// `rls_unit_bytes` is zero.
    #[error("rls_unit_bytes must be at least 1")]
    ZeroUnit,
    /// The estimator rejected θ(−1), f0 or the orders.
    #[error("adaptive loop: {0}")]
    Rls(#[from] RlsError),
}

impl ControllerConfig {
    /// Checks every field; the controller refuses a configuration that fails.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("tau_secs", self.tau_secs)?;
        positive("r_thresh_secs", self.r_thresh_secs)?;
        positive("ci_min_secs", self.ci_min_secs)?;
        positive("ci_max_secs", self.ci_max_secs)?;
        positive("ci_initial_secs", self.ci_initial_secs)?;
        positive("f0", self.f0)?;
        if !(self.b0_min.is_finite() && self.b0_min >= 0.0) {
            return Err(ConfigError::NotPositive {
                field: "b0_min",
                value: self.b0_min,
            });
        }
        self.validate_bounds()?;
        if self.rls_unit_bytes == 0 {
            return Err(ConfigError::ZeroUnit);
        }
        Ok(())
    }

    /// The adaptive loop's settings from this configuration.
    pub fn adaptive_settings(&self) -> AdaptiveSettings {
        AdaptiveSettings {
            orders: self.orders,
            theta0: self.theta0.clone(),
            f0: self.f0,
            b0_min: self.b0_min,
            forgetting: self.forgetting,
            b0_max: self.b0_max,
        }
    }

    fn validate_bounds(&self) -> Result<(), ConfigError> {
        let (min, initial, max) = (self.ci_min_secs, self.ci_initial_secs, self.ci_max_secs);
        if !(min <= initial && initial <= max) {
            return Err(ConfigError::IntervalBounds { min, initial, max });
        }
        let (min, initial, max) = (self.m_min_bytes, self.m_initial_bytes, self.m_max_bytes);
        if !(min <= initial && initial <= max) {
            return Err(ConfigError::SizeBounds { min, initial, max });
        }
        Ok(())
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::NotPositive { field, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print() {
        for m in Mode::ALL {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
        }
        assert_eq!("adaptive-only".parse::<Mode>(), Ok(Mode::AdaptiveOnly));
        assert!("dynamic".parse::<Mode>().is_err());
        assert_eq!(
            serde_json::to_string(&Mode::QueueingOnly).unwrap(),
            "\"queueing_only\""
        );
    }
}
