//! A timer thread for stages that act on time (the disk model's delays, an idle scheduler).
//!
//! Hand-written rather than pulling in an async runtime: the pipeline is callback-based and
//! needs only "run this closure at that instant", a binary heap and one condition variable.
//! Callbacks run on the timer's thread and must not block (they complete or forward an
//! [`crate::pipeline::Io`]).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::pipeline::StageError;

type Callback = Box<dyn FnOnce() + Send>;

struct Entry {
    at: Instant,
    seq: u64,
    f: Callback,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at && self.seq == other.seq
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    /// Reversed: the heap's top is the earliest deadline (FIFO among equal deadlines).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Entry>,
    seq: u64,
    /// Fire everything now and from now on (shutdown).
    immediate: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

/// A timer thread. Dropping it fires every pending callback at once and joins the thread.
pub struct Timer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Timer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timer")
            .field("pending", &self.pending())
            .finish()
    }
}

impl Timer {
    /// Starts a timer thread named `vmsight-<name>`.
    pub fn new(name: &str) -> Result<Self, StageError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vmsight-{name}"))
            .stack_size(256 << 10)
            .spawn(move || run(&s2))
            .map_err(|e| StageError::Stage {
                stage: name.to_owned(),
                reason: format!("cannot start its timer thread: {e}"),
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Runs `f` on the timer thread at `at` (at once if `at` has passed or the timer was
    /// released).
    pub fn at(&self, at: Instant, f: impl FnOnce() + Send + 'static) {
        let mut st = self.lock();
        let seq = st.seq;
        st.seq += 1;
        st.heap.push(Entry {
            at,
            seq,
            f: Box::new(f),
        });
        drop(st);
        self.shared.cv.notify_one();
    }

    /// Fires every pending callback now, and every later one as soon as it is added.
    pub fn release(&self) {
        self.lock().immediate = true;
        self.shared.cv.notify_one();
    }

    /// Callbacks not yet run.
    pub fn pending(&self) -> usize {
        self.lock().heap.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        {
            let mut st = self.lock();
            st.immediate = true;
            st.stop = true;
        }
        self.shared.cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The timer thread: sleep until the earliest deadline, run what is due (outside the lock).
fn run(shared: &Shared) {
    let mut st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let now = Instant::now();
        let due = st
            .heap
            .peek()
            .map(|e| st.immediate || e.at <= now)
            .unwrap_or(false);
        if due {
            if let Some(e) = st.heap.pop() {
                drop(st);
                (e.f)();
                st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
            }
            continue;
        }
        if st.stop {
            return;
        }
        st = match st.heap.peek().map(|e| e.at) {
            Some(at) => {
                shared
                    .cv
                    .wait_timeout(st, at.saturating_duration_since(now))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => shared.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn callbacks_run_in_deadline_order_and_not_before_their_deadline() {
        let t = Timer::new("test-timer").expect("timer");
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        for (i, ms) in [30u64, 10, 20].into_iter().enumerate() {
            let tx = tx.clone();
            t.at(start + Duration::from_millis(ms), move || {
                let _ = tx.send((i, Instant::now()));
            });
        }
        let got: Vec<_> = (0..3).map(|_| rx.recv().expect("fired")).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        // A lower bound only: a callback never runs before its deadline.
        for (i, at) in got {
            let ms = [30u64, 10, 20][i];
            assert!(at.duration_since(start) >= Duration::from_millis(ms));
        }
    }

    #[test]
    fn release_fires_pending_callbacks_at_once() {
        let t = Timer::new("test-timer").expect("timer");
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        t.at(Instant::now() + Duration::from_secs(3600), move || {
            let _ = tx.send(1);
        });
        t.release();
        assert_eq!(rx.recv().expect("fired"), 1);
        t.at(Instant::now() + Duration::from_secs(3600), move || {
            let _ = tx2.send(2);
        });
        assert_eq!(rx.recv().expect("fired"), 2);
    }

    #[test]
    fn drop_runs_every_pending_callback_exactly_once() {
        let (tx, rx) = mpsc::channel();
        {
            let t = Timer::new("test-timer").expect("timer");
            for i in 0..5 {
                let tx = tx.clone();
                t.at(Instant::now() + Duration::from_secs(3600), move || {
                    let _ = tx.send(i);
                });
            }
        }
        drop(tx);
        let mut got: Vec<i32> = rx.iter().collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
    }
}
