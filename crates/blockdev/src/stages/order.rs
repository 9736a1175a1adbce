//! Flush ordering: the first stage of every disk.
//!
//! With several requests in flight a FLUSH could otherwise reach the image while writes the
//! guest submitted before it are still on their way. This stage holds each FLUSH until every
//! mutating request (write, discard, write-zeroes) that entered before it has completed, then
//! lets it go; reads and later writes are never held. So a FLUSH completes only after all
//! writes submitted (and therefore all completed) before it are durable, whatever the stages
//! below do with time.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use crate::pipeline::{Io, Stage};
use crate::request::RequestKind;

/// Name of the stage.
pub const NAME: &str = "flush-order";

#[derive(Default)]
struct State {
    next_seq: u64,
    /// Sequence numbers of mutations in flight.
    mutations: BTreeSet<u64>,
    /// FLUSHes waiting, with their sequence numbers (ascending).
    waiting: VecDeque<(u64, Io)>,
    /// After `release`: hold nothing.
    released: bool,
}

impl State {
    /// Removes and returns the FLUSHes no earlier mutation is still waiting for.
    fn ready(&mut self) -> Vec<Io> {
        let oldest = self.mutations.first().copied();
        let mut out = Vec::new();
        while let Some((seq, _)) = self.waiting.front() {
            if !self.released && oldest.is_some_and(|m| m < *seq) {
                break;
            }
            if let Some((_, io)) = self.waiting.pop_front() {
                out.push(io);
            }
        }
        out
    }
}

/// The flush-ordering stage. See the module documentation.
#[derive(Default)]
pub struct FlushOrder {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for FlushOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlushOrder")
    }
}

impl FlushOrder {
    /// A new stage.
    pub fn new() -> Self {
        Self::default()
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Stage for FlushOrder {
    fn name(&self) -> &str {
        NAME
    }

    fn submit(&self, io: Io) {
        let kind = io.request().kind;
        if kind.is_mutating() {
            let seq = {
                let mut st = lock(&self.state);
                let seq = st.next_seq;
                st.next_seq += 1;
                st.mutations.insert(seq);
                seq
            };
            let state = self.state.clone();
            io.forward_then(move |io, result| {
                let ready = {
                    let mut st = lock(&state);
                    st.mutations.remove(&seq);
                    st.ready()
                };
                io.complete(result);
                for f in ready {
                    f.forward();
                }
            });
        } else if kind == RequestKind::Flush {
            let go = {
                let mut st = lock(&self.state);
                let seq = st.next_seq;
                st.next_seq += 1;
                let earlier = st.mutations.first().is_some_and(|&m| m < seq);
                if earlier && !st.released {
                    st.waiting.push_back((seq, io));
                    None
                } else {
                    Some(io)
                }
            };
            if let Some(io) = go {
                io.forward();
            }
        } else {
            io.forward();
        }
    }

    fn release(&self) {
        let ready = {
            let mut st = lock(&self.state);
            st.released = true;
            st.ready()
        };
        for f in ready {
            f.forward();
        }
    }
}
