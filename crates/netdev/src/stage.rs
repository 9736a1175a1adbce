//! The packet pipeline: stages every frame passes through between the virtqueues and the tap.
//!
//! Like the block pipeline, stages are ordered by position: frames from the guest visit them
//! first to last, frames to the guest last to first, so a stage placed after another sees
//! what the guest sent after the other has, and what the guest receives before the other
//! does (a capture stage placed before FoxyVegas records the rewritten ACKs the guest gets).
//! Stages run on the device's worker thread, one frame at a time: no locks, no allocation
//! on the fast path unless a stage needs it.

use crate::packet::{Direction, Frame};

/// What happens to a frame after a stage has seen it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// On to the next stage (the stage may have changed the frame).
    Pass,
    /// Dropped here (counted as this stage's drop).
    Drop,
}

/// One stage of the packet pipeline.
pub trait NetStage: Send {
    /// Sees one frame going in `dir`; `now_ns` is the monotonic clock when the device took
    /// the frame (the same clock for both directions).
    fn on_frame(&mut self, dir: Direction, frame: &mut Frame, now_ns: u64) -> Verdict;

    /// Called at least every [`TICK_NS`] while the device runs (expiry, flushing).
    fn tick(&mut self, _now_ns: u64) {}

    /// Called once when the device stops (flush files, final counters).
    fn finish(&mut self) {}
}

/// How often the worker calls [`NetStage::tick`].
pub const TICK_NS: u64 = 200_000_000;

/// The stages of one device in pipeline order, with their names.
#[derive(Default)]
pub struct NetPipeline {
    stages: Vec<(&'static str, Box<dyn NetStage>)>,
    /// Frames dropped by each stage (same order).
    drops: Vec<u64>,
}

impl std::fmt::Debug for NetPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.stages.iter().map(|(n, _)| n))
            .finish()
    }
}

impl NetPipeline {
    /// A pipeline of `stages`, first to last in the direction from the guest.
    pub fn new(stages: Vec<(&'static str, Box<dyn NetStage>)>) -> Self {
        let drops = vec![0; stages.len()];
        Self { stages, drops }
    }

    /// Stage names in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.stages.iter().map(|(n, _)| *n).collect()
    }

    /// Runs `frame` through the stages in `dir`'s order; stops at the first drop.
    pub fn run(&mut self, dir: Direction, frame: &mut Frame, now_ns: u64) -> Verdict {
        let n = self.stages.len();
        for k in 0..n {
            let i = match dir {
                Direction::FromGuest => k,
                Direction::ToGuest => n - 1 - k,
            };
            if self.stages[i].1.on_frame(dir, frame, now_ns) == Verdict::Drop {
                self.drops[i] += 1;
                return Verdict::Drop;
            }
        }
        Verdict::Pass
    }

    /// Ticks every stage.
    pub fn tick(&mut self, now_ns: u64) {
        for (_, s) in &mut self.stages {
            s.tick(now_ns);
        }
    }

    /// Finishes every stage.
    pub fn finish(&mut self) {
        for (_, s) in &mut self.stages {
            s.finish();
        }
    }

    /// Frames dropped per stage.
    pub fn drops(&self) -> Vec<(&'static str, u64)> {
        self.names().into_iter().zip(self.drops.clone()).collect()
    }
}

/// The monotonic clock stages are given (nanoseconds).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Tag(u8, bool);
    impl NetStage for Tag {
        fn on_frame(&mut self, _dir: Direction, f: &mut Frame, _now: u64) -> Verdict {
            f.data.push(self.0);
            if self.1 {
                Verdict::Drop
            } else {
                Verdict::Pass
            }
        }
    }

    #[test]
    fn from_guest_runs_in_order_and_to_guest_in_reverse() {
        let mut p = NetPipeline::new(vec![
            ("a", Box::new(Tag(1, false))),
            ("b", Box::new(Tag(2, false))),
        ]);
        let mut f = Frame::default();
        assert_eq!(p.run(Direction::FromGuest, &mut f, 0), Verdict::Pass);
        assert_eq!(f.data, [1, 2]);
        let mut g = Frame::default();
        p.run(Direction::ToGuest, &mut g, 0);
        assert_eq!(g.data, [2, 1]);
    }

    #[test]
    fn a_drop_stops_the_frame_and_is_counted_for_its_stage() {
        let mut p = NetPipeline::new(vec![
            ("a", Box::new(Tag(1, true))),
            ("b", Box::new(Tag(2, false))),
        ]);
        let mut f = Frame::default();
        assert_eq!(p.run(Direction::FromGuest, &mut f, 0), Verdict::Drop);
        assert_eq!(f.data, [1]);
        assert_eq!(p.drops(), vec![("a", 1), ("b", 0)]);
    }
}
