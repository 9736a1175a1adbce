//! Subscribing to syscall events: the API later components (insights, caches) build on.
//!
//! A [`SyscallObserver`] sees every entry of a monitored task as it is decoded and every
//! completed call once its return is known. The trace writers below are observers too.

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Arc, Mutex};

use super::event::EntryEvent;
use super::format::{strace_line, JsonRecord};
use super::tracker::Completed;

/// Receives syscall events in timestamp order, on the trace thread.
pub trait SyscallObserver: Send {
    /// A record as it leaves the rings, before the records of all vCPUs are put in order (up
    /// to the trace's hold-back, 20 ms, before [`Self::on_entry`]): for observers that must
    /// look at the guest while the task still lives.
    fn on_drained(&mut self, _ev: &Drained) {}
    /// A monitored task entered a syscall (arguments and captured strings are final).
    fn on_entry(&mut self, _entry: &EntryEvent) {}
    /// A call completed (or ended without returning).
    fn on_complete(&mut self, _call: &Completed) {}
    /// The trace is over; flush what is buffered.
    fn finish(&mut self) {}
}

/// A syscall record just taken from a ring (see [`SyscallObserver::on_drained`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// A task (kernel `task_struct` pointer, thread ID) entered syscall `nr`.
    Entry {
        task: u64,
        tid: u32,
        ts_ns: u64,
        nr: u64,
    },
    /// A task returned to user mode.
    Return { task: u64, tid: u32, ts_ns: u64 },
}

/// Why a `--trace-filter` list is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// Names that are not x86-64 syscalls.
    #[error("unknown syscall name(s) in the filter: {}", .0.join(", "))]
    Unknown(Vec<String>),
    /// The list names nothing.
    #[error("the syscall filter is empty")]
    Empty,
}

/// Which syscalls a writer reports (`--trace-filter`); `None` reports everything.
#[derive(Debug, Clone, Default)]
pub struct NameFilter(Option<HashSet<u64>>);

impl NameFilter {
    /// Parses `openat,read,...`; unknown names are an error naming them.
    pub fn parse(list: &str) -> Result<NameFilter, FilterError> {
        let mut set = HashSet::new();
        let mut unknown = Vec::new();
        for n in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match super::number(n) {
                Some(nr) => {
                    set.insert(nr);
                }
                None => unknown.push(n.to_string()),
            }
        }
        if !unknown.is_empty() {
            return Err(FilterError::Unknown(unknown));
        }
        if set.is_empty() {
            return Err(FilterError::Empty);
        }
        Ok(NameFilter(Some(set)))
    }

    pub fn all() -> NameFilter {
        NameFilter(None)
    }

    pub fn matches(&self, nr: u64) -> bool {
        self.0.as_ref().is_none_or(|s| s.contains(&nr))
    }
}

/// Writes strace-style lines (`pid tid name(args) = ret`).
pub struct StraceWriter {
    out: Box<dyn Write + Send>,
    filter: NameFilter,
}

impl StraceWriter {
    pub fn new(out: Box<dyn Write + Send>, filter: NameFilter) -> Self {
        StraceWriter { out, filter }
    }
}

impl SyscallObserver for StraceWriter {
    fn on_complete(&mut self, c: &Completed) {
        if self.filter.matches(c.entry.nr) {
            // A closed output (e.g. a pipe to `head`) must not stop the trace or the VM.
            let _ = writeln!(self.out, "{}", strace_line(c));
        }
    }

    fn finish(&mut self) {
        let _ = self.out.flush();
    }
}

/// A JSON-lines output shared by several observers (syscalls, process records).
#[derive(Clone)]
pub struct JsonSink(Arc<Mutex<Box<dyn Write + Send>>>);

impl JsonSink {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        JsonSink(Arc::new(Mutex::new(out)))
    }

    /// Writes any serialisable record as one line.
    pub fn write_value<T: serde::Serialize>(&self, v: &T) {
        if let (Ok(s), Ok(mut out)) = (serde_json::to_string(v), self.0.lock()) {
            let _ = writeln!(out, "{s}");
        }
    }

    pub fn flush(&self) {
        if let Ok(mut out) = self.0.lock() {
            let _ = out.flush();
        }
    }
}

/// Writes one JSON object per completed call (`--trace-json`).
pub struct JsonWriter {
    out: JsonSink,
    filter: NameFilter,
}

impl JsonWriter {
    pub fn new(out: JsonSink, filter: NameFilter) -> Self {
        JsonWriter { out, filter }
    }
}

impl SyscallObserver for JsonWriter {
    fn on_complete(&mut self, c: &Completed) {
        if self.filter.matches(c.entry.nr) {
            self.out.write_value(&JsonRecord::from_completed(c));
        }
    }

    fn finish(&mut self) {
        self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_and_reject_unknown_names() {
        let f = NameFilter::parse("openat, read").unwrap();
        assert!(f.matches(257) && f.matches(0) && !f.matches(1));
        assert_eq!(
            NameFilter::parse("openat,bogus,nope")
                .unwrap_err()
                .to_string(),
            "unknown syscall name(s) in the filter: bogus, nope"
        );
        assert!(matches!(NameFilter::parse(","), Err(FilterError::Empty)));
        assert!(NameFilter::all().matches(12345));
    }
}
