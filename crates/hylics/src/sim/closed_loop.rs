//! The closed loop: the simulated VM driven by a controller, interval by interval.

use serde::{Deserialize, Serialize};

use super::queue::{Completion, PsQueue, SimError};
use super::workload::Workload;
use crate::config::{ControllerConfig, Mode};
use crate::controller::Controller;
use crate::replay::LogRecord;

/// The window of [`RunSummary::window_error_secs`]: 10 minutes.
pub const ERROR_WINDOW_SECS: f64 = 600.0;

/// One control interval of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrajectoryPoint {
    /// Start of the interval, seconds.
    pub start_secs: f64,
    /// End of the interval, seconds.
    pub t_secs: f64,
    /// The share size during the interval.
    pub m_bytes: u64,
    /// Tasks completed in the interval.
    pub tasks: usize,
    /// Sum of their response times, seconds.
    pub response_sum_secs: f64,
    /// Their mean response time (`None`: none completed).
    pub mean_r_secs: Option<f64>,
}

/// Aggregates of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// The controller's mode.
    pub mode: Mode,
    /// Control intervals (decisions).
    pub intervals: usize,
    /// Tasks completed.
    pub tasks: usize,
    /// Mean of |R(k) − τ| over the control intervals with data (Table 3's aggregate error).
    /// Depends on the interval lengths the controller chose: short intervals hold few tasks,
    /// so their R(k) is noisier.
    pub aggregate_error_secs: Option<f64>,
    /// Mean of |R − τ| over fixed windows of [`ERROR_WINDOW_SECS`] (R: mean response time of
    /// the tasks completed in the window), comparable between modes whatever their ci.
    pub window_error_secs: Option<f64>,
    /// Mean response time over all completed tasks.
    pub mean_r_secs: Option<f64>,
    /// Largest share size used (including the initial one).
    pub peak_m_bytes: u64,
    /// Share size at the end.
    pub final_m_bytes: u64,
    /// Time-weighted mean share size.
    pub mean_m_bytes: f64,
}

/// Everything a closed-loop run produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosedLoopRun {
    /// The controller's log (replayable with [`crate::replay::replay`]).
    pub records: Vec<LogRecord>,
    /// Per-interval share size and response times.
    pub trajectory: Vec<TrajectoryPoint>,
    /// Every completed task.
    pub completions: Vec<Completion>,
    /// Aggregates.
    pub summary: RunSummary,
}

impl ClosedLoopRun {
    /// Mean response time of the tasks completed in intervals ending in `(from, to]`.
    pub fn mean_r_between(&self, from_secs: f64, to_secs: f64) -> Option<f64> {
        let (sum, n) = self
            .window(from_secs, to_secs)
            .fold((0.0, 0usize), |(s, n), p| {
                (s + p.response_sum_secs, n + p.tasks)
            });
        (n > 0).then(|| sum / n as f64)
    }

    /// Time-weighted mean share size over intervals ending in `(from, to]`.
    pub fn mean_m_between(&self, from_secs: f64, to_secs: f64) -> Option<f64> {
        let (weighted, span) = self
            .window(from_secs, to_secs)
            .fold((0.0, 0.0), |(w, s), p| {
                let len = p.t_secs - p.start_secs;
                (w + p.m_bytes as f64 * len, s + len)
            });
        (span > 0.0).then(|| weighted / span)
    }

    fn window(&self, from_secs: f64, to_secs: f64) -> impl Iterator<Item = &TrajectoryPoint> {
        self.trajectory
            .iter()
            .filter(move |p| p.t_secs > from_secs && p.t_secs <= to_secs)
    }
}

/// Runs `workload` for `duration_secs` under a controller built from `config`: at every
/// control interval the controller gets the interval's measurement and its new m is applied.
pub fn run_closed_loop(
    config: &ControllerConfig,
    workload: &Workload,
    duration_secs: f64,
) -> Result<ClosedLoopRun, SimError> {
    if !(duration_secs.is_finite() && duration_secs > 0.0) {
        return Err(SimError::Duration(duration_secs));
    }
    let mut controller = Controller::new(config.clone())?;
    let mut queue = PsQueue::new(workload, controller.m_bytes())?;
    let mut records = Vec::new();
    let mut trajectory = Vec::new();
    let mut completions = Vec::new();
    while queue.now() < duration_secs {
        let start = queue.now();
        let end = (start + controller.ci_secs()).min(duration_secs);
        let m_during = queue.m_bytes();
        let record = controller.step_logged(end, queue.run_until(end));
        trajectory.push(point(start, end, m_during, &record));
        queue.set_m(record.decision.m_after_bytes);
        completions.extend(queue.take_completions());
        records.push(record);
    }
    let mut summary = summarize(config, &trajectory, queue.m_bytes());
    summary.window_error_secs = window_error(&completions, config.tau_secs, ERROR_WINDOW_SECS);
    Ok(ClosedLoopRun {
        records,
        trajectory,
        completions,
        summary,
    })
}

fn point(start_secs: f64, t_secs: f64, m_bytes: u64, record: &LogRecord) -> TrajectoryPoint {
    let response_sum_secs = record.input.valid_response_times().sum();
    TrajectoryPoint {
        start_secs,
        t_secs,
        m_bytes,
        tasks: record.input.completed(),
        response_sum_secs,
        mean_r_secs: record.input.mean_response(),
    }
}

fn summarize(
    config: &ControllerConfig,
    trajectory: &[TrajectoryPoint],
    final_m: u64,
) -> RunSummary {
    let errors: Vec<f64> = trajectory
        .iter()
        .filter_map(|p| p.mean_r_secs)
        .map(|r| (r - config.tau_secs).abs())
        .collect();
    let tasks: usize = trajectory.iter().map(|p| p.tasks).sum();
    let response_sum: f64 = trajectory.iter().map(|p| p.response_sum_secs).sum();
    let span: f64 = trajectory.iter().map(|p| p.t_secs - p.start_secs).sum();
    let m_time: f64 = trajectory
        .iter()
        .map(|p| p.m_bytes as f64 * (p.t_secs - p.start_secs))
        .sum();
    let peak = trajectory
        .iter()
        .map(|p| p.m_bytes)
        .chain([final_m])
        .max()
        .unwrap_or(final_m);
    RunSummary {
        mode: config.mode,
        intervals: trajectory.len(),
        tasks,
        aggregate_error_secs: (!errors.is_empty())
            .then(|| errors.iter().sum::<f64>() / errors.len() as f64),
        window_error_secs: None,
        mean_r_secs: (tasks > 0).then(|| response_sum / tasks as f64),
        peak_m_bytes: peak,
        final_m_bytes: final_m,
        mean_m_bytes: if span > 0.0 {
            m_time / span
        } else {
            final_m as f64
        },
    }
}

/// Mean over the non-empty windows `[i·w, (i+1)·w)` of |mean response time in the window − τ|.
pub fn window_error(completions: &[Completion], tau_secs: f64, window_secs: f64) -> Option<f64> {
    let mut bins: Vec<(f64, usize)> = Vec::new();
    for c in completions {
        let index = (c.t_secs / window_secs).floor().max(0.0) as usize;
        if bins.len() <= index {
            bins.resize(index + 1, (0.0, 0));
        }
        bins[index].0 += c.response_secs;
        bins[index].1 += 1;
    }
    let errors: Vec<f64> = bins
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(sum, n)| (sum / *n as f64 - tau_secs).abs())
        .collect();
    (!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_error_averages_per_window_deviations() {
        let c = |t_secs, response_secs| Completion {
            t_secs,
            response_secs,
        };
        // Window 0: mean 2 (error 1); window 1 empty; window 2: mean 0.5 (error 0.5).
        let done = [c(1.0, 1.0), c(5.0, 3.0), c(25.0, 0.5)];
        assert_eq!(window_error(&done, 1.0, 10.0), Some(0.75));
        assert_eq!(window_error(&[], 1.0, 10.0), None);
    }
}
