//! The M/G/1/PS queue, simulated event by event with a virtual-time clock.
//!
//! Under processor sharing every task present receives the same service rate, so all of
//! them have received the same amount of work since the system last emptied, up to their
//! arrival offsets. The queue keeps that common "virtual work" V (dV/dt = rate/n with n tasks
//! present) and each task's finishing point V_arrival + W in a min-heap: the next completion
//! is the heap's head, due after `(finish − V)·n/rate` seconds.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::rng::SplitMix64;
use super::workload::{RateSchedule, Workload};
use crate::measurement::Measurement;
use crate::service::ServiceCurve;

/// Why a simulation could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A rate is negative or not finite, or an alternating period is not positive.
    #[error("invalid arrival schedule {0:?}")]
    Schedule(RateSchedule),
    /// The duration is not a finite positive number.
    #[error("simulation duration {0} s must be a finite positive number")]
    Duration(f64),
    /// The controller's configuration is invalid.
    #[error("controller configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
}

#[derive(Debug, Clone, Copy)]
struct Job {
    finish_v: f64,
    arrival_secs: f64,
    id: u64,
}

impl PartialEq for Job {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Job {}

impl PartialOrd for Job {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Job {
    fn cmp(&self, other: &Self) -> Ordering {
        self.finish_v
            .total_cmp(&other.finish_v)
            .then(self.id.cmp(&other.id))
    }
}

/// A simulated M/G/1/PS queue whose service speed follows the share size.
#[derive(Debug, Clone)]
pub struct PsQueue {
    schedule: RateSchedule,
    curve: ServiceCurve,
    rng: SplitMix64,
    now: f64,
    m_bytes: u64,
    /// Work completed per second by the whole server: 1/E[X|m].
    speed: f64,
    /// Work each present task has received since the system last emptied.
    virtual_work: f64,
    jobs: BinaryHeap<Reverse<Job>>,
    next_arrival: f64,
    next_id: u64,
    /// Every completion since the last [`PsQueue::take_completions`].
    completions: Vec<Completion>,
}

/// One completed task, for analyses that need completion times (the controller does not).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Completion {
    /// When the task completed, seconds.
    pub t_secs: f64,
    /// Its response time, seconds.
    pub response_secs: f64,
}

impl PsQueue {
    /// An empty queue at time 0 with the share at `m_bytes`.
    pub fn new(workload: &Workload, m_bytes: u64) -> Result<Self, SimError> {
        if !workload.schedule.is_valid() {
            return Err(SimError::Schedule(workload.schedule.clone()));
        }
        let mut queue = Self {
            schedule: workload.schedule.clone(),
            curve: workload.true_curve.clone(),
            rng: SplitMix64::new(workload.seed),
            now: 0.0,
            m_bytes,
            speed: 1.0 / workload.true_curve.service(m_bytes),
            virtual_work: 0.0,
            jobs: BinaryHeap::new(),
            next_arrival: 0.0,
            next_id: 0,
            completions: Vec::new(),
        };
        queue.next_arrival = queue.draw_arrival_after(0.0);
        Ok(queue)
    }

    /// The simulated time, seconds.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// The share size the server runs with.
    pub fn m_bytes(&self) -> u64 {
        self.m_bytes
    }

    /// Tasks in the system (in service, all of them, under PS).
    pub fn in_system(&self) -> usize {
        self.jobs.len()
    }

    /// The completions since the last call (oldest first).
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completions)
    }

    /// Resizes the share: from now on the server runs at 1/E[X|m].
    pub fn set_m(&mut self, m_bytes: u64) {
        self.m_bytes = m_bytes;
        self.speed = 1.0 / self.curve.service(m_bytes);
    }

    /// Simulates up to `t_end_secs` and returns what happened since the current time: the
    /// response times of the tasks that completed and the number of arrivals.
    pub fn run_until(&mut self, t_end_secs: f64) -> Measurement {
        let mut out = Measurement::empty(self.now, t_end_secs);
        loop {
            let done = self.next_completion_secs();
            let next = done.min(self.next_arrival);
            if next > t_end_secs || next.is_nan() {
                self.advance(t_end_secs.max(self.now));
                return out;
            }
            self.advance(next);
            if done <= self.next_arrival {
                self.complete(&mut out);
            } else {
                self.arrive();
                out.arrivals += 1;
            }
        }
    }

    fn next_completion_secs(&self) -> f64 {
        match self.jobs.peek() {
            Some(Reverse(job)) => {
                let left = (job.finish_v - self.virtual_work).max(0.0);
                self.now + left * self.jobs.len() as f64 / self.speed
            }
            None => f64::INFINITY,
        }
    }

    fn advance(&mut self, t: f64) {
        if !self.jobs.is_empty() {
            self.virtual_work += (t - self.now) * self.speed / self.jobs.len() as f64;
        }
        self.now = t;
    }

    fn complete(&mut self, out: &mut Measurement) {
        if let Some(Reverse(job)) = self.jobs.pop() {
            let response_secs = self.now - job.arrival_secs;
            out.response_times_secs.push(response_secs);
            self.completions.push(Completion {
                t_secs: self.now,
                response_secs,
            });
        }
        if self.jobs.is_empty() {
            // Keep V small so finishing points keep their precision.
            self.virtual_work = 0.0;
        }
    }

    fn arrive(&mut self) {
        let work = self.rng.exponential(1.0);
        self.jobs.push(Reverse(Job {
            finish_v: self.virtual_work + work,
            arrival_secs: self.now,
            id: self.next_id,
        }));
        self.next_id += 1;
        self.next_arrival = self.draw_arrival_after(self.now);
    }

    /// The next arrival of the non-homogeneous Poisson process after `from`: exponential gaps
    /// at the current rate, restarted at every rate change (exact, by memorylessness).
    fn draw_arrival_after(&mut self, from: f64) -> f64 {
        let mut t = from;
        loop {
            let rate = self.schedule.rate_at(t);
            let change = self.schedule.next_change_after(t);
            if rate > 0.0 {
                let candidate = t + self.rng.exponential(1.0 / rate);
                if candidate < change {
                    return candidate;
                }
            }
            if !change.is_finite() {
                return f64::INFINITY;
            }
            t = change;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queueing::predicted_response;
    use crate::service::ServicePoint;

    fn constant_curve(service_secs: f64) -> ServiceCurve {
        ServiceCurve::new(vec![ServicePoint {
            m_bytes: 1,
            service_secs,
        }])
        .unwrap()
    }

    fn mean_response(schedule: RateSchedule, service: f64, seed: u64, secs: f64) -> (f64, u64) {
        let w = Workload {
            schedule,
            true_curve: constant_curve(service),
            seed,
        };
        let mut q = PsQueue::new(&w, 1).unwrap();
        let m = q.run_until(secs);
        (m.mean_response().unwrap(), m.arrivals)
    }

    /// The simulator reproduces Eq. 1 (M/M/1/PS: R = E[X]/(1−ρ)) to within sampling error.
    #[test]
    fn matches_the_mg1ps_mean_response_time() {
        for (lambda, service) in [(0.5, 1.0), (1.0, 0.75), (0.125, 3.32)] {
            let secs = 400_000.0 / lambda;
            let (r, arrivals) = mean_response(
                RateSchedule::Constant {
                    rate_per_sec: lambda,
                },
                service,
                42,
                secs,
            );
            let expected = predicted_response(service, lambda).unwrap();
            assert!(
                (r / expected - 1.0).abs() < 0.03,
                "λ={lambda} R={r} expected {expected}"
            );
            let rate = arrivals as f64 / secs;
            assert!((rate / lambda - 1.0).abs() < 0.01);
        }
    }

    #[test]
    fn alternating_schedule_averages_its_rates() {
        let secs = 200_000.0;
        let (_, arrivals) = mean_response(
            RateSchedule::Alternating {
                first_rate: 0.125,
                second_rate: 0.25,
                half_period_secs: 600.0,
            },
            1.0,
            3,
            secs,
        );
        let rate = arrivals as f64 / secs;
        assert!((rate - 0.1875).abs() < 0.005, "{rate}");
    }

    #[test]
    fn same_seed_same_run_and_arrivals_do_not_depend_on_m() {
        let w = Workload {
            schedule: RateSchedule::Constant { rate_per_sec: 1.0 },
            true_curve: ServiceCurve::new(vec![
                ServicePoint {
                    m_bytes: 1,
                    service_secs: 0.9,
                },
                ServicePoint {
                    m_bytes: 100,
                    service_secs: 0.3,
                },
            ])
            .unwrap(),
            seed: 9,
        };
        let mut a = PsQueue::new(&w, 1).unwrap();
        let mut b = PsQueue::new(&w, 1).unwrap();
        let mut c = PsQueue::new(&w, 100).unwrap();
        let (ma, mb, mc) = (a.run_until(500.0), b.run_until(500.0), c.run_until(500.0));
        assert_eq!(ma, mb);
        assert_eq!(ma.arrivals, mc.arrivals);
        assert!(mc.mean_response().unwrap() < ma.mean_response().unwrap());
    }
}
