//! Hylics' memory controller (Hylics §5): how big a VM's shared in-memory file system (the
//! host tmpfs "share") should be so that the VM's tasks meet a response-time SLO τ with a
//! moderate amount of memory.
//!
//! The VM is abstracted as an M/G/1 processor-sharing queue whose mean service time E\[X|m\]
//! depends on the share size m ([`service`], measured offline). Two mechanisms set m:
//!
//! * the queueing-model predictor ([`queueing`], Eq. 1-2): from the arrival rate λ it computes
//!   the smallest m whose predicted response time `E[X|m]/(1 − λE[X|m])` is at most τ;
//! * the adaptive loop ([`rls`], Eq. 3-10): a recursive-least-squares model of the residual
//!   error y = R − τ as a function of the size change u = Δm, whose control law picks the Δm
//!   that cancels the predicted residual.
//!
//! [`Controller`] combines them as Algorithm 1 (or runs either alone, or neither), driven by
//! explicit measurements with no clock; every [`Decision`] is logged with its input
//! ([`LogRecord`]) and can be re-derived with [`replay()`]. [`cold_files_to_evict`] says which
//! files to move out when the share shrinks, and [`sim`] is a deterministic M/G/1/PS
//! simulator to evaluate the controller in closed loop (§6.4).
//!
//! Pure logic: no I/O beyond (de)serialization, no threads, no clocks.

#![warn(missing_docs)]

pub mod config;
pub mod controller;
pub mod decision;
pub mod evict;
pub mod measurement;
pub mod queueing;
pub mod replay;
pub mod rls;
pub mod service;
pub mod sim;

#[cfg(test)]
mod testutil;

pub use config::{ConfigError, ControllerConfig, Mode, UnknownMode, MIB};
pub use controller::Controller;
pub use decision::{Decision, FieldDifference, Reason};
pub use evict::{bytes_to_free, cold_files_to_evict, EvictionPlan, ShareFile};
pub use measurement::Measurement;
pub use queueing::{predicted_response, required_service, solve_m, Prediction};
pub use replay::{
    parse_json_lines, replay, to_json_lines, LogError, LogFile, LogHeader, LogRecord, ReplayError,
    LOG_VERSION,
};
pub use rls::{AdaptiveLoop, AdaptiveSettings, ControlLaw, ModelOrders, Observed, Rls, RlsError};
pub use service::{CurveError, CurveFile, ServiceCurve, ServicePoint};
