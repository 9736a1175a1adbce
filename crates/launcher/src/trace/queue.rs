//! The decoded records waiting for delivery in timestamp order.
//!
//! Each vCPU's ring is already nearly in order (a late piece, stamped with its entry's time,
//! follows that call's return), so the queue keeps one ordered deque per vCPU, inserting a
//! record behind the few later ones before it, and merges the deques as it delivers, instead
//! of sorting every drain's records with everything held back.
//!
//! The order is the one a stable sort by (timestamp, late piece) of the records in the order
//! they were taken would give: ties go to the record taken first.

use std::collections::VecDeque;

use super::RawEvent;

/// A queued record and its place in the order.
struct Queued {
    /// (timestamp, late piece, sequence number in the order records were taken).
    key: (u64, bool, u64),
    ev: RawEvent,
}

/// Records waiting for delivery, per vCPU.
#[derive(Default)]
pub(super) struct Queue {
    /// One deque per vCPU, each ordered by key.
    vcpus: Vec<VecDeque<Queued>>,
    /// Records taken so far (the next sequence number).
    seq: u64,
    len: usize,
}

impl Queue {
    /// Queues `ev`, taken from `vcpu`'s ring after every record queued before.
    pub(super) fn push(&mut self, vcpu: usize, ev: RawEvent) {
        if self.vcpus.len() <= vcpu {
            self.vcpus.resize_with(vcpu + 1, VecDeque::new);
        }
        let key = (ev.ts(), ev.is_late(), self.seq);
        self.seq += 1;
        self.len += 1;
        let q = &mut self.vcpus[vcpu];
        let item = Queued { key, ev };
        if q.back().is_none_or(|b| b.key <= key) {
            q.push_back(item);
        } else {
            let at = q.partition_point(|x| x.key <= key);
            q.insert(at, item);
        }
    }

    /// The first record in order if its timestamp is at most `horizon`.
    pub(super) fn pop_until(&mut self, horizon: u64) -> Option<RawEvent> {
        let v = self.first()?;
        let q = &mut self.vcpus[v];
        if q.front()?.key.0 > horizon {
            return None;
        }
        self.len -= 1;
        q.pop_front().map(|x| x.ev)
    }

    /// The vCPU whose deque holds the first record in order.
    fn first(&self) -> Option<usize> {
        self.vcpus
            .iter()
            .enumerate()
            .filter_map(|(v, q)| q.front().map(|x| (x.key, v)))
            .min()
            .map(|(_, v)| v)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_introspect::syscall::{EntryEvent, ReturnEvent, ReturnVia};

    fn entry(vcpu: u32, ts: u64) -> RawEvent {
        RawEvent::Entry(EntryEvent {
            ts_ns: ts,
            vcpu,
            ..EntryEvent::default()
        })
    }

    fn ret(vcpu: u32, ts: u64) -> RawEvent {
        RawEvent::Return(ReturnEvent {
            ts_ns: ts,
            vcpu,
            cr3: 0,
            task: 0,
            tid: 0,
            tgid: 0,
            rip: 0,
            rax: 0,
            via: ReturnVia::Sysret,
        })
    }

    fn late(vcpu: u32, entry_ts: u64) -> RawEvent {
        RawEvent::Sums {
            vcpu,
            entry_ts,
            late: true,
            piece: crate::trace::Sums::default(),
        }
    }

    /// (kind, vCPU, timestamp) of a record.
    fn tag(e: &RawEvent) -> (char, u32, u64) {
        let c = match e {
            RawEvent::Entry(_) => 'e',
            RawEvent::Return(_) => 'r',
            _ => 'l',
        };
        (c, e.vcpu(), e.ts())
    }

    /// What a stable sort by (timestamp, late) of everything queued would deliver.
    fn sorted(taken: &[RawEvent]) -> Vec<(char, u32, u64)> {
        let mut v: Vec<&RawEvent> = taken.iter().collect();
        v.sort_by_key(|e| (e.ts(), e.is_late()));
        v.into_iter().map(tag).collect()
    }

    #[test]
    fn delivers_in_the_order_of_a_stable_sort_up_to_the_horizon() {
        let taken = vec![
            entry(0, 10),
            ret(0, 30),
            late(0, 10),
            entry(0, 40),
            entry(1, 20),
            ret(1, 30),
            late(1, 20),
            ret(1, 50),
            entry(2, 5),
            late(2, 5),
        ];
        let mut q = Queue::default();
        for e in &taken {
            q.push(e.vcpu() as usize, e.clone());
        }
        let mut out = Vec::new();
        while let Some(e) = q.pop_until(30) {
            out.push(tag(&e));
        }
        assert!(!q.is_empty());
        while let Some(e) = q.pop_until(u64::MAX) {
            out.push(tag(&e));
        }
        assert!(q.is_empty());
        assert_eq!(out, sorted(&taken));
        assert_eq!(out[..3], [('e', 2, 5), ('l', 2, 5), ('e', 0, 10)]);
    }

    #[test]
    fn records_taken_later_follow_equal_ones_held_back() {
        let mut q = Queue::default();
        q.push(1, ret(1, 100));
        q.push(0, entry(0, 200));
        assert!(q.pop_until(50).is_none());
        q.push(0, ret(0, 100));
        q.push(1, late(1, 100));
        let out: Vec<_> = std::iter::from_fn(|| q.pop_until(u64::MAX))
            .map(|e| tag(&e))
            .collect();
        assert_eq!(
            out,
            [('r', 1, 100), ('r', 0, 100), ('l', 1, 100), ('e', 0, 200)]
        );
    }
}
