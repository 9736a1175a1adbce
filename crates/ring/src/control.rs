//! The control area: monitor filters written by vmsight and read by the plugin, and the
//! plugin's report of what it applied and which processes it monitors.
//!
//! Both halves are seqlocks over atomics: the single writer makes the sequence odd, stores the
//! fields, and makes it even again; a reader retries (a bounded number of times) while the
//! sequence is odd or changed under it. Every field is an atomic, so a torn or scribbled area
//! yields a rejected or odd-looking snapshot, never undefined behaviour; counts read back are
//! clamped to the array sizes.
//!
//! ```text
//! CONTROL_OFFSET + 0     FilterArea  (vmsight writes)
//!   +0   seq u64 (odd while writing)   +8 generation u64 (bumped by every set_filters)
//!   +16  monitor_all u32  +20 n_tgids u32  +24 n_comms u32  +28 reserved u32
//!   +32  tgids [u32; 256]
//!   +1056 comms [[u8; 16]; 16] (stored as pairs of native-endian u64)
//! CONTROL_OFFSET + 4096  ReportArea  (the plugin writes)
//!   +0   applied_generation u64 (filters generation the plugin has applied)
//!   +8   seq u64 (odd while writing)   +16 n_tgids u32   +20 overflow u32 (1: list incomplete)
//!   +24  tgids [u32; 1000]             (processes currently monitored)
//! ```

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Most TGIDs a filter can name.
pub const MAX_FILTER_TGIDS: usize = 256;
/// Most command names a filter can name.
pub const MAX_FILTER_COMMS: usize = 16;
/// Size of a guest `comm` (`TASK_COMM_LEN`, NUL included).
pub const COMM_LEN: usize = 16;
/// Most monitored TGIDs the plugin lists in its report (more are flagged as overflow).
pub const MAX_REPORTED_TGIDS: usize = 1000;
/// Retries of a seqlock reader before it gives up (the writer holds the lock for
/// microseconds; giving up means "try again later", never blocking a vCPU).
const READ_RETRIES: usize = 64;

/// Errors of [`MonitorFilters`] validation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FilterError {
    /// Too many TGIDs.
    #[error("A monitor filter can name at most {MAX_FILTER_TGIDS} TGIDs, not {0}")]
    TooManyTgids(usize),
    /// Too many command names.
    #[error("A monitor filter can name at most {MAX_FILTER_COMMS} commands, not {0}")]
    TooManyComms(usize),
    /// A command name that cannot match a guest `comm`.
    #[error(
        "The command name {0:?} cannot match a guest comm: it must be 1 to 15 bytes without \
         NUL (the kernel truncates comm to 15 bytes)."
    )]
    BadComm(String),
    /// TGID 0 is the idle task and never makes syscalls.
    #[error("TGID 0 cannot be monitored")]
    ZeroTgid,
}

/// What vmsight wants monitored. A task is monitored if `monitor_all` is set, or its TGID or
/// an ancestor's TGID is in `tgids`, or its `comm` equals one of `comms` exactly (a matching
/// process's TGID is then monitored, so its children follow).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MonitorFilters {
    /// Monitor every process.
    pub monitor_all: bool,
    /// Process IDs (TGIDs) to monitor, with their descendants.
    pub tgids: Vec<u32>,
    /// Command names (`comm`, NUL-padded to 16 bytes; see [`MonitorFilters::comm`]).
    pub comms: Vec<[u8; COMM_LEN]>,
}

impl MonitorFilters {
    /// A filter that monitors nothing (no interception cost at all).
    pub fn none() -> Self {
        Self::default()
    }

    /// A filter that monitors every process.
    pub fn all() -> Self {
        Self {
            monitor_all: true,
            ..Self::default()
        }
    }

    /// Converts a command name to the NUL-padded 16-byte form the kernel stores.
    pub fn comm(name: &str) -> Result<[u8; COMM_LEN], FilterError> {
        let b = name.as_bytes();
        if b.is_empty() || b.len() >= COMM_LEN || b.contains(&0) {
            return Err(FilterError::BadComm(name.to_string()));
        }
        let mut out = [0u8; COMM_LEN];
        out[..b.len()].copy_from_slice(b);
        Ok(out)
    }

    /// Adds a command name (exact match on the guest `comm`).
    pub fn with_comm(mut self, name: &str) -> Result<Self, FilterError> {
        self.comms.push(Self::comm(name)?);
        self.validate()?;
        Ok(self)
    }

    /// Adds a TGID (the process and its descendants).
    pub fn with_tgid(mut self, tgid: u32) -> Result<Self, FilterError> {
        self.tgids.push(tgid);
        self.validate()?;
        Ok(self)
    }

    /// True if nothing is monitored (the plugin then disables all tracking callbacks).
    pub fn is_empty(&self) -> bool {
        !self.monitor_all && self.tgids.is_empty() && self.comms.is_empty()
    }

    /// Checks the limits of the control area.
    pub fn validate(&self) -> Result<(), FilterError> {
        if self.tgids.len() > MAX_FILTER_TGIDS {
            return Err(FilterError::TooManyTgids(self.tgids.len()));
        }
        if self.comms.len() > MAX_FILTER_COMMS {
            return Err(FilterError::TooManyComms(self.comms.len()));
        }
        if self.tgids.contains(&0) {
            return Err(FilterError::ZeroTgid);
        }
        for c in &self.comms {
            if c[0] == 0 || c[COMM_LEN - 1] != 0 {
                return Err(FilterError::BadComm(comm_to_string(c)));
            }
        }
        Ok(())
    }

    /// True if `comm` (as read from a task, NUL-padded) equals one of the filter's names.
    pub fn comm_matches(&self, comm: &[u8; COMM_LEN]) -> bool {
        let key = comm_key(comm);
        self.comms.iter().any(|c| comm_key(c) == key)
    }
}

/// The bytes of a `comm` up to its first NUL (the kernel always NUL-terminates, but a torn
/// read may not be).
pub fn comm_key(c: &[u8; COMM_LEN]) -> &[u8] {
    let n = c.iter().position(|&b| b == 0).unwrap_or(COMM_LEN);
    &c[..n]
}

/// A `comm` as text (lossy UTF-8, up to the first NUL).
pub fn comm_to_string(c: &[u8; COMM_LEN]) -> String {
    String::from_utf8_lossy(comm_key(c)).into_owned()
}

/// What the plugin reports back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MonitorReport {
    /// Filter generation the plugin has applied (0: none yet).
    pub applied_generation: u64,
    /// Processes the plugin currently monitors (filter TGIDs, matched commands, children).
    pub tgids: Vec<u32>,
    /// True if more processes are monitored than the list holds.
    pub overflow: bool,
}

/// The filter half of the control area (vmsight writes, the plugin reads).
#[repr(C)]
pub struct FilterArea {
    /// Seqlock sequence: odd while vmsight writes.
    pub seq: AtomicU64,
    /// Bumped by every `set_filters`; 0 = never set.
    pub generation: AtomicU64,
    /// Non-zero: monitor every process.
    pub monitor_all: AtomicU32,
    /// Valid entries of `tgids`.
    pub n_tgids: AtomicU32,
    /// Valid entries of `comms`.
    pub n_comms: AtomicU32,
    /// Zero.
    pub reserved: AtomicU32,
    /// TGIDs to monitor.
    pub tgids: [AtomicU32; MAX_FILTER_TGIDS],
    /// Command names, 16 bytes each as two native-endian words.
    pub comms: [[AtomicU64; 2]; MAX_FILTER_COMMS],
}

/// The report half of the control area (the plugin writes, vmsight reads).
#[repr(C)]
pub struct ReportArea {
    /// Filter generation the plugin has applied.
    pub applied_generation: AtomicU64,
    /// Seqlock sequence of the TGID list: odd while the plugin writes.
    pub seq: AtomicU64,
    /// Valid entries of `tgids`.
    pub n_tgids: AtomicU32,
    /// 1 if the plugin monitors more processes than `tgids` holds.
    pub overflow: AtomicU32,
    /// Monitored TGIDs.
    pub tgids: [AtomicU32; MAX_REPORTED_TGIDS],
}

const _: () = assert!(std::mem::size_of::<FilterArea>() <= 4096);
const _: () = assert!(std::mem::size_of::<ReportArea>() <= 4096);

fn comm_words(c: &[u8; COMM_LEN]) -> [u64; 2] {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&c[..8]);
    b.copy_from_slice(&c[8..]);
    [u64::from_ne_bytes(a), u64::from_ne_bytes(b)]
}

fn words_comm(w: [u64; 2]) -> [u8; COMM_LEN] {
    let mut out = [0u8; COMM_LEN];
    out[..8].copy_from_slice(&w[0].to_ne_bytes());
    out[8..].copy_from_slice(&w[1].to_ne_bytes());
    out
}

impl FilterArea {
    /// Stores `f` under the seqlock and bumps the generation; returns the new generation.
    /// Single writer only (the caller holds `&mut` on the host side). `f` must be valid.
    pub(crate) fn write(&self, f: &MonitorFilters) -> u64 {
        let r = Ordering::Relaxed;
        let s = self.seq.load(r);
        let s = s | 1; // an odd value left by a crashed writer stays "writing" until now
        self.seq.store(s, r);
        fence(Ordering::Release);
        self.monitor_all.store(u32::from(f.monitor_all), r);
        let nt = f.tgids.len().min(MAX_FILTER_TGIDS);
        let nc = f.comms.len().min(MAX_FILTER_COMMS);
        for (slot, &t) in self.tgids.iter().zip(&f.tgids[..nt]) {
            slot.store(t, r);
        }
        for (slot, c) in self.comms.iter().zip(&f.comms[..nc]) {
            let w = comm_words(c);
            slot[0].store(w[0], r);
            slot[1].store(w[1], r);
        }
        self.n_tgids.store(nt as u32, r);
        self.n_comms.store(nc as u32, r);
        let g = self.generation.load(r).wrapping_add(1).max(1);
        self.generation.store(g, r);
        self.seq.store(s.wrapping_add(1), Ordering::Release);
        g
    }

    /// The current generation (one relaxed load: the plugin's cheap "did anything change").
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A consistent snapshot `(generation, filters)`, or `None` if the writer kept the lock
    /// for all retries. Counts are clamped, so a scribbled area gives bounded garbage.
    pub(crate) fn read(&self) -> Option<(u64, MonitorFilters)> {
        let r = Ordering::Relaxed;
        for _ in 0..READ_RETRIES {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let g = self.generation.load(r);
            let all = self.monitor_all.load(r) != 0;
            let nt = (self.n_tgids.load(r) as usize).min(MAX_FILTER_TGIDS);
            let nc = (self.n_comms.load(r) as usize).min(MAX_FILTER_COMMS);
            let tgids: Vec<u32> = self.tgids[..nt].iter().map(|t| t.load(r)).collect();
            let comms: Vec<[u8; COMM_LEN]> = self.comms[..nc]
                .iter()
                .map(|w| words_comm([w[0].load(r), w[1].load(r)]))
                .collect();
            fence(Ordering::Acquire);
            if self.seq.load(r) == s1 {
                return Some((
                    g,
                    MonitorFilters {
                        monitor_all: all,
                        tgids,
                        comms,
                    },
                ));
            }
        }
        None
    }
}

impl ReportArea {
    /// Publishes the monitored TGIDs. The caller serialises writers.
    pub(crate) fn write_tgids(&self, tgids: &[u32]) {
        let r = Ordering::Relaxed;
        let s = self.seq.load(r) | 1;
        self.seq.store(s, r);
        fence(Ordering::Release);
        let n = tgids.len().min(MAX_REPORTED_TGIDS);
        for (slot, &t) in self.tgids.iter().zip(&tgids[..n]) {
            slot.store(t, r);
        }
        self.n_tgids.store(n as u32, r);
        self.overflow
            .store(u32::from(tgids.len() > MAX_REPORTED_TGIDS), r);
        self.seq.store(s.wrapping_add(1), Ordering::Release);
    }

    /// A consistent snapshot, or `None` if the writer kept the lock for all retries.
    pub(crate) fn read(&self) -> Option<MonitorReport> {
        let r = Ordering::Relaxed;
        for _ in 0..READ_RETRIES {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let n = (self.n_tgids.load(r) as usize).min(MAX_REPORTED_TGIDS);
            let tgids = self.tgids[..n].iter().map(|t| t.load(r)).collect();
            let overflow = self.overflow.load(r) != 0;
            fence(Ordering::Acquire);
            if self.seq.load(r) == s1 {
                return Some(MonitorReport {
                    applied_generation: self.applied_generation.load(Ordering::Acquire),
                    tgids,
                    overflow,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeroed<T>() -> Box<T> {
        // SAFETY: used only for FilterArea/ReportArea, which consist solely of atomics, for
        // which the all-zero bit pattern is valid.
        unsafe { Box::new(std::mem::zeroed()) }
    }

    #[test]
    fn comm_conversion_and_matching() {
        let c = MonitorFilters::comm("getppid_loop").expect("valid");
        assert_eq!(&c[..12], b"getppid_loop");
        assert!(c[12..].iter().all(|&b| b == 0));
        assert!(MonitorFilters::comm("").is_err());
        assert!(MonitorFilters::comm("0123456789abcdef").is_err()); // 16 bytes
        assert!(MonitorFilters::comm("0123456789abcde").is_ok()); // 15 bytes
        assert!(MonitorFilters::comm("a\0b").is_err());
        let f = MonitorFilters::none().with_comm("sh").expect("valid");
        assert!(f.comm_matches(&MonitorFilters::comm("sh").expect("valid")));
        assert!(!f.comm_matches(&MonitorFilters::comm("bash").expect("valid")));
        assert!(!f.comm_matches(&MonitorFilters::comm("s").expect("valid")));
        // An unterminated (torn) comm compares on all 16 bytes.
        assert!(!f.comm_matches(&[b's'; COMM_LEN]));
    }

    #[test]
    fn validation_limits() {
        let mut f = MonitorFilters::none();
        f.tgids = (1..=MAX_FILTER_TGIDS as u32).collect();
        assert!(f.validate().is_ok());
        f.tgids.push(9999);
        assert_eq!(f.validate(), Err(FilterError::TooManyTgids(257)));
        let f = MonitorFilters {
            tgids: vec![0],
            ..Default::default()
        };
        assert_eq!(f.validate(), Err(FilterError::ZeroTgid));
        assert!(MonitorFilters::none().is_empty());
        assert!(!MonitorFilters::all().is_empty());
    }

    #[test]
    fn filter_seqlock_round_trip_and_generation() {
        let a = zeroed::<FilterArea>();
        assert_eq!(a.read().map(|(g, f)| (g, f.is_empty())), Some((0, true)));
        let f = MonitorFilters::none()
            .with_tgid(42)
            .and_then(|f| f.with_comm("ls"))
            .expect("valid");
        assert_eq!(a.write(&f), 1);
        assert_eq!(a.generation(), 1);
        assert_eq!(a.read(), Some((1, f.clone())));
        assert_eq!(a.write(&MonitorFilters::all()), 2);
        let (g, got) = a.read().expect("snapshot");
        assert_eq!(g, 2);
        assert!(got.monitor_all && got.tgids.is_empty() && got.comms.is_empty());
    }

    #[test]
    fn reader_gives_up_on_a_stuck_writer_and_clamps_counts() {
        let a = zeroed::<FilterArea>();
        a.seq.store(7, Ordering::Relaxed); // odd forever: a writer died mid-update
        assert_eq!(a.read(), None);
        // The next write recovers.
        assert_eq!(a.write(&MonitorFilters::all()), 1);
        assert!(a.read().is_some());
        a.n_tgids.store(u32::MAX, Ordering::Relaxed);
        a.n_comms.store(u32::MAX, Ordering::Relaxed);
        let (_, f) = a.read().expect("snapshot");
        assert_eq!(f.tgids.len(), MAX_FILTER_TGIDS);
        assert_eq!(f.comms.len(), MAX_FILTER_COMMS);
    }

    #[test]
    fn concurrent_reader_never_sees_a_torn_filter() {
        let a: &'static FilterArea = Box::leak(zeroed::<FilterArea>());
        let writer = std::thread::spawn(move || {
            for i in 1..20_000u32 {
                // Every TGID of one version equals the version: a torn read would mix them.
                let f = MonitorFilters {
                    monitor_all: false,
                    tgids: vec![i; 1 + (i as usize % 8)],
                    comms: Vec::new(),
                };
                a.write(&f);
            }
        });
        let mut seen = 0;
        while !writer.is_finished() {
            if let Some((_, f)) = a.read() {
                if let Some(&first) = f.tgids.first() {
                    assert!(f.tgids.iter().all(|&t| t == first), "torn: {:?}", f.tgids);
                    assert_eq!(f.tgids.len(), 1 + (first as usize % 8));
                    seen += 1;
                }
            }
        }
        writer.join().expect("writer");
        // How many consistent snapshots the reader got depends on scheduling (possibly none
        // on a loaded machine); once the writer is quiescent, a read must succeed and show the
        // last version whole.
        let _ = seen;
        let (_, last) = a.read().expect("a quiescent area reads");
        assert_eq!(last.tgids, vec![19_999u32; 1 + (19_999 % 8)]);
    }

    #[test]
    fn report_round_trip_and_overflow() {
        let a = zeroed::<ReportArea>();
        a.write_tgids(&[1, 2, 3]);
        let r = a.read().expect("snapshot");
        assert_eq!(r.tgids, vec![1, 2, 3]);
        assert!(!r.overflow);
        let many: Vec<u32> = (0..MAX_REPORTED_TGIDS as u32 + 5).collect();
        a.write_tgids(&many);
        let r = a.read().expect("snapshot");
        assert_eq!(r.tgids.len(), MAX_REPORTED_TGIDS);
        assert!(r.overflow);
    }
}
