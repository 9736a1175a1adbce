//! A deterministic discrete-event simulator of a Hylics VM, to evaluate the controller.
//!
//! The VM is modelled exactly as the controller's queueing model assumes (§5.1), so the
//! simulator is an M/G/1/PS queue:
//!
//! * arrivals are Poisson at rate λ(t), constant ([`RateSchedule::Constant`], the paper's
//!   workload #1) or switching periodically between two rates
//!   ([`RateSchedule::Alternating`], workload #2);
//! * each task brings an amount of work W ~ Exp(1); with the share at size m the server
//!   completes work at rate 1/E\[X|m\] (E\[X|m\] from the workload's *true* curve, which may
//!   differ from the curve the controller was configured with, to model measurement error),
//!   so a task alone has an exponential service time of mean E\[X|m\], and a change of m
//!   speeds up or slows down the tasks in service at once;
//! * processor sharing: the n tasks present each receive 1/n of the server.
//!
//! Randomness comes from a seeded SplitMix64 ([`SplitMix64`]); arrivals and work sizes are
//! drawn in arrival order and do not depend on m, so every mode sees the same task sequence
//! for the same seed (common random numbers). [`run_closed_loop`] couples the simulator to a
//! [`crate::Controller`].

mod closed_loop;
mod queue;
mod rng;
mod workload;

pub use closed_loop::{
    run_closed_loop, window_error, ClosedLoopRun, RunSummary, TrajectoryPoint, ERROR_WINDOW_SECS,
};
pub use queue::SimError;
pub use queue::{Completion, PsQueue};
pub use rng::SplitMix64;
pub use workload::{RateSchedule, Workload};

#[cfg(test)]
mod tests;
