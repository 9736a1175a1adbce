//! vmsight-ring: the shared-memory channel from the vmsight TCG plugin (inside QEMU) to vmsight.
//!
//! vmsight creates a file (normally `/run/vmsight/NAME/plugin.shm` on tmpfs) with
//! [`Channel::create`]; the plugin maps the same file with [`Channel::attach`]. The file holds a
//! header, per-vCPU counters and one single-producer/single-consumer ring of fixed-size
//! [`Record`]s per vCPU (layout in [`layout`]). The vCPU thread is the only producer of its
//! ring and never blocks: when the ring is full the record is dropped and counted. vmsight's
//! drain thread is the only consumer.
//!
//! The file is shared memory another process may scribble on, so neither side trusts what it
//! reads back: geometry is validated at attach and then computed locally, indices are masked,
//! and head/tail values that break the ring invariant are detected and resynchronised.
//!
//! The control area carries the other direction: vmsight sets [`MonitorFilters`] with
//! [`ChannelHost::set_filters`]; the plugin applies them, acknowledges the generation and
//! reports which processes it monitors ([`ChannelHost::plugin_report`]).
//!
//! ```no_run
//! use vmsight_ring::{Channel, MonitorFilters, Record};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut host = Channel::create("/run/vmsight/vm1/plugin.shm", 4, 65536)?;
//! host.set_filters(&MonitorFilters::none().with_comm("postgres")?)?;
//! // ... in QEMU, the plugin does:
//! let plugin = Channel::attach("/run/vmsight/vm1/plugin.shm")?;
//! let mut p = plugin.producer(0)?;
//! p.push(&Record::syscall_entry(0, 0, 0x1000, 0x401000, 39, [0; 6], 0));
//! // ... back in vmsight:
//! host.drain(|r| println!("vcpu {} nr {}", r.vcpu, r.syscall_nr()));
//! # Ok(()) }
//! ```

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub mod blocktag;
pub mod control;
pub mod layout;
mod map;
mod record;
pub mod redirect;

pub use control::{
    comm_to_string, FilterError, MonitorFilters, MonitorReport, COMM_LEN, MAX_FILTER_COMMS,
    MAX_FILTER_TGIDS, MAX_REPORTED_TGIDS,
};
use layout::{consumer_state, producer_state, Geometry, HEADER_SIZE, LAYOUT_VERSION, MAGIC};
use map::{CounterBlock, Mapping};
pub use record::{chunk_sum, data, flags, kind, ret, sums, syscall, Record, ReturnVia, SumsHeader};

/// Errors of creating or attaching a channel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation on the channel file failed.
    #[error("cannot {op} the channel file {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The channel file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The requested or recorded geometry is out of range.
    #[error("the channel geometry is invalid: {0}")]
    Geometry(#[source] layout::GeometryError),
    /// The file is too small to hold a header.
    #[error(
        "The channel file {path} is {size} bytes, smaller than a channel header ({HEADER_SIZE} \
         bytes); it is not a vmsight channel or it was truncated."
    )]
    TooSmall {
        /// The channel file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The magic number does not match.
    #[error(
        "The file {path} is not an initialised vmsight channel (magic {found:#018x}, expected \
         {MAGIC:#018x}); create it with Channel::create before starting QEMU."
    )]
    BadMagic {
        /// The channel file.
        path: PathBuf,
        /// The value found.
        found: u64,
    },
    /// The layout version does not match this build.
    #[error(
        "The channel file {path} has layout version {found}, but this build of vmsight-ring \
         understands only version {LAYOUT_VERSION}; rebuild the plugin and vmsight together."
    )]
    Version {
        /// The channel file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
    /// A header field disagrees with the layout this build computes.
    #[error("the channel file {path} has a corrupt header: {reason}")]
    Corrupt {
        /// The channel file.
        path: PathBuf,
        /// Which field is wrong.
        reason: String,
    },
    /// A vCPU index beyond the channel's slots.
    #[error("vCPU {vcpu} is out of range: the channel has {max_vcpus} vCPU slots")]
    VcpuOutOfRange {
        /// The index asked for.
        vcpu: u32,
        /// Slots in the channel.
        max_vcpus: u32,
    },
    /// Invalid monitor filters.
    #[error("cannot set the monitor filters: {0}")]
    Filters(#[from] FilterError),
    /// A second producer for the same ring was requested.
    #[error("vCPU {vcpu} already has a producer; each ring has exactly one")]
    ProducerTaken {
        /// The vCPU index.
        vcpu: u32,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Per-vCPU counters, one cell each in the counter block (indices are part of the layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    /// User-mode `syscall` instructions executed (from the plugin's inline scoreboard).
    Syscalls = 0,
    /// Syscall exec callbacks invoked (only while the vCPU's task is monitored or unknown).
    Callbacks = 1,
    /// Records pushed into the ring.
    RecordsWritten = 2,
    /// Records dropped because the ring was full.
    RecordsDropped = 3,
    /// `syscall` instructions instrumented at translation time.
    Instrumented = 4,
    /// Register reads that failed.
    RegReadErrors = 5,
    /// Guest memory reads that failed (fully or partly).
    MemReadErrors = 6,
    /// Internal errors (caught panics, missing state) in plugin callbacks.
    InternalErrors = 7,
    /// Syscall callbacks on monitored tasks (= entry records produced or dropped).
    MonitoredSyscalls = 8,
    /// Classifications: callbacks that looked up the current task because the vCPU's
    /// monitoring state was unknown (after a CR3 write or a filter/fork/exit change).
    Classifications = 9,
    /// CR3-write callbacks (only while some filter is set).
    Cr3Writes = 10,
    /// Return (`sysretq`/`iretq`) callbacks (only while monitored or unknown).
    ReturnCallbacks = 11,
    /// Guest kernel memory reads that failed (current task, task fields, iret frames).
    KernelReadErrors = 12,
    /// Return records produced (or dropped).
    Returns = 13,
    /// DATA records produced (or dropped).
    DataRecords = 14,
    /// Times this vCPU invalidated every vCPU's classification (filter change, monitored
    /// fork/clone, monitored exit_group).
    Invalidations = 15,
    /// `task->real_parent` hops walked by classifications.
    AncestorHops = 16,
    /// Classifications whose `current->mm->pgd` did not match CR3 (e.g. a PTI user CR3).
    Cr3Mismatches = 17,
    /// Return callbacks that returned to kernel mode (`iretq` with CS.RPL 0): ignored.
    KernelReturns = 18,
    /// vCPU redirections taken (`vmsight_proto::redirect`; plugin API v7 only).
    Redirects = 19,
    /// Kernel-triggered redirections the guest function declined ("not here") and that were
    /// retried at the next safe point (SymCall's synchronous transport).
    RedirectRetries = 20,
    /// Monitored TGIDs found on another process (the monitored one died without
    /// `exit_group`, e.g. killed by a signal, and its PID was reused): dropped from the set.
    StaleTgids = 21,
    /// 32-bit system calls (`int 0x80`, `sysenter`) executed in user mode by any task
    /// (counted inline, published with `Syscalls`): not traced.
    CompatSyscalls = 22,
}

/// A snapshot of one vCPU's counters (or their sum, see [`ChannelHost::totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VcpuCounters {
    /// See [`Counter::Syscalls`].
    pub syscalls: u64,
    /// See [`Counter::Callbacks`].
    pub callbacks: u64,
    /// See [`Counter::RecordsWritten`].
    pub records_written: u64,
    /// See [`Counter::RecordsDropped`].
    pub records_dropped: u64,
    /// See [`Counter::Instrumented`].
    pub instrumented: u64,
    /// See [`Counter::RegReadErrors`].
    pub reg_read_errors: u64,
    /// See [`Counter::MemReadErrors`].
    pub mem_read_errors: u64,
    /// See [`Counter::InternalErrors`].
    pub internal_errors: u64,
    /// See [`Counter::MonitoredSyscalls`].
    pub monitored_syscalls: u64,
    /// See [`Counter::Classifications`].
    pub classifications: u64,
    /// See [`Counter::Cr3Writes`].
    pub cr3_writes: u64,
    /// See [`Counter::ReturnCallbacks`].
    pub return_callbacks: u64,
    /// See [`Counter::KernelReadErrors`].
    pub kernel_read_errors: u64,
    /// See [`Counter::Returns`].
    pub returns: u64,
    /// See [`Counter::DataRecords`].
    pub data_records: u64,
    /// See [`Counter::Invalidations`].
    pub invalidations: u64,
    /// See [`Counter::AncestorHops`].
    pub ancestor_hops: u64,
    /// See [`Counter::Cr3Mismatches`].
    pub cr3_mismatches: u64,
    /// See [`Counter::KernelReturns`].
    pub kernel_returns: u64,
    /// See [`Counter::Redirects`].
    pub redirects: u64,
    /// See [`Counter::RedirectRetries`].
    pub redirect_retries: u64,
    /// See [`Counter::StaleTgids`].
    pub stale_tgids: u64,
    /// See [`Counter::CompatSyscalls`].
    pub compat_syscalls: u64,
}

impl VcpuCounters {
    fn read(block: &CounterBlock) -> Self {
        let g = |c: Counter| block.cells[c as usize].load(Ordering::Relaxed);
        Self {
            syscalls: g(Counter::Syscalls),
            callbacks: g(Counter::Callbacks),
            records_written: g(Counter::RecordsWritten),
            records_dropped: g(Counter::RecordsDropped),
            instrumented: g(Counter::Instrumented),
            reg_read_errors: g(Counter::RegReadErrors),
            mem_read_errors: g(Counter::MemReadErrors),
            internal_errors: g(Counter::InternalErrors),
            monitored_syscalls: g(Counter::MonitoredSyscalls),
            classifications: g(Counter::Classifications),
            cr3_writes: g(Counter::Cr3Writes),
            return_callbacks: g(Counter::ReturnCallbacks),
            kernel_read_errors: g(Counter::KernelReadErrors),
            returns: g(Counter::Returns),
            data_records: g(Counter::DataRecords),
            invalidations: g(Counter::Invalidations),
            ancestor_hops: g(Counter::AncestorHops),
            cr3_mismatches: g(Counter::Cr3Mismatches),
            kernel_returns: g(Counter::KernelReturns),
            redirects: g(Counter::Redirects),
            redirect_retries: g(Counter::RedirectRetries),
            stale_tgids: g(Counter::StaleTgids),
            compat_syscalls: g(Counter::CompatSyscalls),
        }
    }

    fn accumulate(&mut self, o: &Self) {
        // Wrapping: the values come from shared memory and may be garbage; summing must not
        // panic in debug builds.
        self.syscalls = self.syscalls.wrapping_add(o.syscalls);
        self.callbacks = self.callbacks.wrapping_add(o.callbacks);
        self.records_written = self.records_written.wrapping_add(o.records_written);
        self.records_dropped = self.records_dropped.wrapping_add(o.records_dropped);
        self.instrumented = self.instrumented.wrapping_add(o.instrumented);
        self.reg_read_errors = self.reg_read_errors.wrapping_add(o.reg_read_errors);
        self.mem_read_errors = self.mem_read_errors.wrapping_add(o.mem_read_errors);
        self.internal_errors = self.internal_errors.wrapping_add(o.internal_errors);
        self.monitored_syscalls = self.monitored_syscalls.wrapping_add(o.monitored_syscalls);
        self.classifications = self.classifications.wrapping_add(o.classifications);
        self.cr3_writes = self.cr3_writes.wrapping_add(o.cr3_writes);
        self.return_callbacks = self.return_callbacks.wrapping_add(o.return_callbacks);
        self.kernel_read_errors = self.kernel_read_errors.wrapping_add(o.kernel_read_errors);
        self.returns = self.returns.wrapping_add(o.returns);
        self.data_records = self.data_records.wrapping_add(o.data_records);
        self.invalidations = self.invalidations.wrapping_add(o.invalidations);
        self.ancestor_hops = self.ancestor_hops.wrapping_add(o.ancestor_hops);
        self.cr3_mismatches = self.cr3_mismatches.wrapping_add(o.cr3_mismatches);
        self.kernel_returns = self.kernel_returns.wrapping_add(o.kernel_returns);
        self.redirects = self.redirects.wrapping_add(o.redirects);
        self.redirect_retries = self.redirect_retries.wrapping_add(o.redirect_retries);
        self.stale_tgids = self.stale_tgids.wrapping_add(o.stale_tgids);
        self.compat_syscalls = self.compat_syscalls.wrapping_add(o.compat_syscalls);
    }
}

/// What the plugin reported about itself in the header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginStatus {
    /// One of [`layout::producer_state`].
    pub state: u32,
    /// PID of the QEMU process.
    pub pid: u32,
    /// QEMU plugin API version the plugin was built for.
    pub api_version: u32,
    /// vCPUs the plugin has seen initialised.
    pub vcpus: u32,
    /// Option bits ([`layout::plugin_flags`]).
    pub flags: u32,
    /// CLOCK_MONOTONIC ns of the last counter publication.
    pub heartbeat_ns: u64,
    /// How many times a plugin attached.
    pub attach_count: u64,
}

/// Entry points of both sides.
pub struct Channel;

impl Channel {
    /// vmsight side: creates (or truncates) the channel file at `path` with `max_vcpus` rings of
    /// `ring_records` records (a power of two) and initialises the header. The caller owns the
    /// file and removes it when the VM is gone; it must not recreate it while a QEMU still maps
    /// it (truncation would fault QEMU's accesses).
    pub fn create(
        path: impl AsRef<Path>,
        max_vcpus: u32,
        ring_records: u32,
    ) -> Result<ChannelHost> {
        let path = path.as_ref();
        let geometry = Geometry::new(max_vcpus, ring_records).map_err(Error::Geometry)?;
        let io = |op| {
            move |source| Error::Io {
                op,
                path: path.to_owned(),
                source,
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io("create"))?;
        file.set_len(geometry.total_size).map_err(io("resize"))?;
        let len = usize::try_from(geometry.total_size)
            .map_err(|_| Error::Geometry(layout::GeometryError::TooLarge(geometry.total_size)))?;
        let map = Mapping::map(&file, len, geometry).map_err(io("map"))?;
        let h = map.header();
        let r = Ordering::Relaxed;
        h.layout_version.store(LAYOUT_VERSION, r);
        h.record_size.store(layout::RECORD_SIZE as u32, r);
        h.max_vcpus.store(max_vcpus, r);
        h.ring_records.store(ring_records, r);
        h.header_size.store(HEADER_SIZE as u32, r);
        h.counter_stride.store(layout::COUNTER_STRIDE as u32, r);
        h.counters_offset.store(layout::COUNTERS_OFFSET, r);
        h.rings_offset.store(geometry.rings_offset, r);
        h.ring_stride.store(geometry.ring_stride, r);
        h.total_size.store(geometry.total_size, r);
        h.control_offset.store(layout::CONTROL_OFFSET, r);
        h.control_size.store(layout::CONTROL_SIZE, r);
        h.consumer_pid.store(std::process::id(), r);
        h.consumer_state.store(consumer_state::ALIVE, r);
        // Publish: a plugin that sees the magic (Acquire) sees every field above.
        h.magic.store(MAGIC, Ordering::Release);
        Ok(ChannelHost {
            map: Arc::new(map),
            tails: vec![0; max_vcpus as usize],
            path: path.to_owned(),
            corrupt_events: 0,
        })
    }

    /// Plugin side: maps an existing channel file and validates its header (magic, version,
    /// record size and the complete geometry against the file size).
    pub fn attach(path: impl AsRef<Path>) -> Result<ChannelPlugin> {
        let path = path.as_ref();
        let io = |op| {
            move |source| Error::Io {
                op,
                path: path.to_owned(),
                source,
            }
        };
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io("open"))?;
        let size = file.metadata().map_err(io("stat"))?.len();
        if size < HEADER_SIZE {
            return Err(Error::TooSmall {
                path: path.to_owned(),
                size,
            });
        }
        // Map only the header first: the geometry it claims is not trusted yet.
        let header_geometry = Geometry {
            max_vcpus: 0,
            ring_records: 0,
            rings_offset: 0,
            ring_stride: 0,
            total_size: HEADER_SIZE,
        };
        let head_map =
            Mapping::map(&file, HEADER_SIZE as usize, header_geometry).map_err(io("map"))?;
        let geometry = validate_header(path, head_map.header(), size)?;
        drop(head_map);
        let len = usize::try_from(geometry.total_size).map_err(|_| Error::Corrupt {
            path: path.to_owned(),
            reason: "the total size does not fit the address space".into(),
        })?;
        let map = Mapping::map(&file, len, geometry).map_err(io("map"))?;
        // The file may have changed between the two maps; validate the mapping we keep.
        let again = validate_header(path, map.header(), size)?;
        if again != geometry {
            return Err(Error::Corrupt {
                path: path.to_owned(),
                reason: "the header changed while attaching".into(),
            });
        }
        let h = map.header();
        h.producer_pid.store(std::process::id(), Ordering::Relaxed);
        h.attach_count.fetch_add(1, Ordering::Relaxed);
        h.producer_state
            .store(producer_state::RUNNING, Ordering::Release);
        let claimed = (0..geometry.max_vcpus)
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(ChannelPlugin {
            map: Arc::new(map),
            claimed,
            report_lock: std::sync::Mutex::new(()),
        })
    }
}

fn validate_header(path: &Path, h: &layout::Header, file_size: u64) -> Result<Geometry> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_owned(),
        reason,
    };
    let magic = h.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(Error::BadMagic {
            path: path.to_owned(),
            found: magic,
        });
    }
    let version = h.layout_version.load(Ordering::Relaxed);
    if version != LAYOUT_VERSION {
        return Err(Error::Version {
            path: path.to_owned(),
            found: version,
        });
    }
    let r = Ordering::Relaxed;
    let check = |name: &str, found: u64, want: u64| {
        if found == want {
            Ok(())
        } else {
            Err(corrupt(format!("{name} is {found}, expected {want}")))
        }
    };
    check(
        "record_size",
        h.record_size.load(r).into(),
        layout::RECORD_SIZE,
    )?;
    check("header_size", h.header_size.load(r).into(), HEADER_SIZE)?;
    check(
        "counter_stride",
        h.counter_stride.load(r).into(),
        layout::COUNTER_STRIDE,
    )?;
    check(
        "counters_offset",
        h.counters_offset.load(r),
        layout::COUNTERS_OFFSET,
    )?;
    check(
        "control_offset",
        h.control_offset.load(r),
        layout::CONTROL_OFFSET,
    )?;
    check("control_size", h.control_size.load(r), layout::CONTROL_SIZE)?;
    let g = Geometry::new(h.max_vcpus.load(r), h.ring_records.load(r))
        .map_err(|e| corrupt(e.to_string()))?;
    check("rings_offset", h.rings_offset.load(r), g.rings_offset)?;
    check("ring_stride", h.ring_stride.load(r), g.ring_stride)?;
    check("total_size", h.total_size.load(r), g.total_size)?;
    if file_size < g.total_size {
        return Err(corrupt(format!(
            "the header describes {} bytes but the file has only {file_size}",
            g.total_size
        )));
    }
    Ok(g)
}

/// vmsight's end of a channel: reads counters and drains the rings.
pub struct ChannelHost {
    map: Arc<Mapping>,
    /// Consumer indices kept locally: the copy in the file is only published for the producer,
    /// never read back, so a scribbled tail cannot confuse the consumer.
    tails: Vec<u64>,
    path: PathBuf,
    corrupt_events: u64,
}

impl ChannelHost {
    /// Path of the channel file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The channel's geometry.
    pub fn geometry(&self) -> Geometry {
        self.map.geometry
    }

    /// Live counters of every vCPU slot.
    pub fn counters(&self) -> Vec<VcpuCounters> {
        (0..self.map.geometry.max_vcpus)
            .filter_map(|v| self.map.counters(v))
            .map(VcpuCounters::read)
            .collect()
    }

    /// Sum of [`ChannelHost::counters`] over all vCPUs.
    pub fn totals(&self) -> VcpuCounters {
        let mut t = VcpuCounters::default();
        for c in self.counters() {
            t.accumulate(&c);
        }
        t
    }

    /// True once a plugin has attached (also after it finished).
    pub fn plugin_attached(&self) -> bool {
        self.map.header().producer_state.load(Ordering::Acquire) != producer_state::NONE
    }

    /// True once the plugin ran its exit hook: the counters are final.
    pub fn plugin_finished(&self) -> bool {
        self.map.header().producer_state.load(Ordering::Acquire) == producer_state::FINISHED
    }

    /// Everything the plugin reported in the header.
    pub fn plugin_status(&self) -> PluginStatus {
        let h = self.map.header();
        let r = Ordering::Relaxed;
        PluginStatus {
            state: h.producer_state.load(Ordering::Acquire),
            pid: h.producer_pid.load(r),
            api_version: h.plugin_api_version.load(r),
            vcpus: h.plugin_vcpus.load(r),
            flags: h.plugin_flags.load(r),
            heartbeat_ns: h.producer_heartbeat_ns.load(r),
            attach_count: h.attach_count.load(r),
        }
    }

    /// The vCPU redirection mailbox (see [`redirect`]).
    pub fn redirect_mailbox(&self) -> &redirect::Mailbox {
        self.map.mailbox()
    }

    /// A handle on the redirect mailbox that keeps the mapping alive on its own, for a caller
    /// that sleeps on it without holding whatever guards this `ChannelHost`.
    pub fn redirect_handle(&self) -> MailboxHandle {
        MailboxHandle(self.map.clone())
    }

    /// Sets what the plugin monitors (replacing the previous filters) and returns the new
    /// filter generation. The plugin picks the change up at its next callback on any vCPU
    /// (at the latest after `sync=N` syscalls or an idle vCPU); [`ChannelHost::plugin_report`]
    /// shows when it has applied it. Safe to call before QEMU starts: the plugin applies the
    /// filters at attach.
    pub fn set_filters(&mut self, filters: &MonitorFilters) -> Result<u64> {
        filters.validate()?;
        Ok(self.map.filters().write(filters))
    }

    /// The filters as currently stored in the control area, with their generation.
    pub fn filters(&self) -> Option<(u64, MonitorFilters)> {
        self.map.filters().read()
    }

    /// What the plugin reports: the filter generation it has applied and the processes it
    /// currently monitors. `None` if the plugin held its lock for the whole read (retry).
    pub fn plugin_report(&self) -> Option<MonitorReport> {
        self.map.report().read()
    }

    /// Waits (polling every millisecond) until the plugin has applied filter generation
    /// `generation` or `timeout` passes; returns whether it did.
    pub fn wait_filters_applied(&self, generation: u64, timeout: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        loop {
            if self.map.report().applied_generation.load(Ordering::Acquire) >= generation {
                return true;
            }
            if std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// How often a ring's head broke the invariant `tail <= head <= tail + capacity` (a
    /// misbehaving producer); each time the consumer skipped to the head.
    pub fn corrupt_events(&self) -> u64 {
        self.corrupt_events
    }

    /// Records waiting in all rings (as published by the producers; clamped per ring).
    pub fn pending(&self) -> u64 {
        let cap = u64::from(self.map.geometry.ring_records);
        (0..self.map.geometry.max_vcpus)
            .map(|v| {
                let head = self.map.head(v).map_or(0, |h| h.load(Ordering::Acquire));
                head.wrapping_sub(self.tails[v as usize]).min(cap)
            })
            .sum()
    }

    /// Consumes every record currently in the rings, calling `f` for each (ring by ring, in
    /// order within a ring), and returns how many were consumed. Never blocks.
    pub fn drain(&mut self, mut f: impl FnMut(&Record)) -> usize {
        let g = self.map.geometry;
        let cap = u64::from(g.ring_records);
        let mask = g.mask();
        let mut total = 0usize;
        for v in 0..g.max_vcpus {
            let (Some(head_a), Some(tail_a), Some(slots)) =
                (self.map.head(v), self.map.tail(v), self.map.slots(v))
            else {
                continue;
            };
            let mut tail = self.tails[v as usize];
            // Acquire pairs with the producer's Release store: the slots below head are written.
            let head = head_a.load(Ordering::Acquire);
            let avail = head.wrapping_sub(tail);
            if avail == 0 {
                continue;
            }
            if avail > cap {
                // The producer moved head backwards or more than a ring ahead: no slot can be
                // trusted to be in order. Skip to its head and carry on.
                self.corrupt_events += 1;
                self.tails[v as usize] = head;
                tail_a.store(head, Ordering::Release);
                continue;
            }
            // Publish progress in chunks so a producer on a full ring gets room early.
            const CHUNK: u64 = 256;
            while tail != head {
                let end = head.min(tail.wrapping_add(CHUNK));
                while tail != end {
                    let idx = (tail & mask) as usize;
                    // SAFETY: `idx <= mask < ring_records`, so the slot lies in this ring's
                    // slot array inside the mapping; Record is plain old data (any bits are
                    // valid) and the volatile copy never creates a reference to memory the
                    // producer may be writing.
                    let rec = unsafe { std::ptr::read_volatile(slots.add(idx)) };
                    f(&rec);
                    tail = tail.wrapping_add(1);
                }
                // Release: our reads of these slots happen before the producer may reuse them.
                tail_a.store(tail, Ordering::Release);
            }
            total += avail as usize;
            self.tails[v as usize] = tail;
        }
        total
    }
}

impl Drop for ChannelHost {
    fn drop(&mut self) {
        self.map
            .header()
            .consumer_state
            .store(consumer_state::CLOSED, Ordering::Release);
    }
}

/// The plugin's end of a channel.
pub struct ChannelPlugin {
    map: Arc<Mapping>,
    claimed: Vec<AtomicBool>,
    report_lock: std::sync::Mutex<()>,
}

impl ChannelPlugin {
    /// The validated geometry.
    pub fn geometry(&self) -> Geometry {
        self.map.geometry
    }

    /// Number of vCPU slots.
    pub fn max_vcpus(&self) -> u32 {
        self.map.geometry.max_vcpus
    }

    /// The vCPU redirection mailbox (see [`redirect`]).
    pub fn redirect_mailbox(&self) -> &redirect::Mailbox {
        self.map.mailbox()
    }

    /// The producer of `vcpu`'s ring. Each ring has exactly one producer for the lifetime of
    /// this `ChannelPlugin`; a second request fails.
    pub fn producer(&self, vcpu: u32) -> Result<Producer> {
        let max_vcpus = self.map.geometry.max_vcpus;
        let out_of_range = Error::VcpuOutOfRange { vcpu, max_vcpus };
        let claim = self.claimed.get(vcpu as usize).ok_or(out_of_range)?;
        if claim.swap(true, Ordering::AcqRel) {
            return Err(Error::ProducerTaken { vcpu });
        }
        let (Some(head_a), Some(tail_a), Some(slots)) = (
            self.map.head(vcpu),
            self.map.tail(vcpu),
            self.map.slots(vcpu),
        ) else {
            return Err(Error::VcpuOutOfRange { vcpu, max_vcpus });
        };
        let cap = u64::from(self.map.geometry.ring_records);
        // Continue where a previous producer (an earlier QEMU on the same file) stopped, unless
        // the indices break the invariant; then restart at the consumer's tail.
        let tail = tail_a.load(Ordering::Acquire);
        let mut head = head_a.load(Ordering::Relaxed);
        if head.wrapping_sub(tail) > cap {
            head = tail;
            head_a.store(head, Ordering::Release);
        }
        Ok(Producer {
            head_ptr: head_a as *const AtomicU64,
            tail_ptr: tail_a as *const AtomicU64,
            slots,
            head,
            cached_tail: tail,
            cap,
            mask: cap - 1,
            counters: self.counters(vcpu)?,
        })
    }

    /// A handle on `vcpu`'s counters, for code that is not the ring's producer (exit hooks).
    pub fn counters(&self, vcpu: u32) -> Result<CounterSink> {
        let block = self.map.counters(vcpu).ok_or(Error::VcpuOutOfRange {
            vcpu,
            max_vcpus: self.map.geometry.max_vcpus,
        })?;
        Ok(CounterSink {
            block: block as *const CounterBlock,
            _map: Arc::clone(&self.map),
        })
    }

    /// Records the plugin's API version and option bits ([`layout::plugin_flags`]).
    pub fn set_plugin_info(&self, api_version: u32, flags: u32) {
        let h = self.map.header();
        h.plugin_api_version.store(api_version, Ordering::Relaxed);
        h.plugin_flags.store(flags, Ordering::Relaxed);
    }

    /// Records how many vCPUs the plugin has seen (monotonic maximum).
    pub fn report_vcpus(&self, n: u32) {
        self.map
            .header()
            .plugin_vcpus
            .fetch_max(n, Ordering::Relaxed);
    }

    /// Stamps the heartbeat with the current CLOCK_MONOTONIC time.
    pub fn heartbeat(&self) {
        self.map
            .header()
            .producer_heartbeat_ns
            .store(monotonic_ns(), Ordering::Relaxed);
    }

    /// Marks the plugin finished: counters are final.
    pub fn finish(&self) {
        self.heartbeat();
        self.map
            .header()
            .producer_state
            .store(producer_state::FINISHED, Ordering::Release);
    }

    /// Current filter generation (one relaxed load; compare with the applied one to decide
    /// whether to call [`ChannelPlugin::read_filters`]).
    #[inline]
    pub fn filter_generation(&self) -> u64 {
        self.map.filters().generation()
    }

    /// A consistent snapshot `(generation, filters)` of the control area, or `None` if
    /// vmsight held the seqlock for all retries (try again later). Counts are clamped to the
    /// array sizes; entries are not otherwise validated.
    pub fn read_filters(&self) -> Option<(u64, MonitorFilters)> {
        self.map.filters().read()
    }

    /// Acknowledges that filter generation `generation` is applied.
    pub fn ack_filters(&self, generation: u64) {
        self.map
            .report()
            .applied_generation
            .store(generation, Ordering::Release);
    }

    /// Publishes the list of monitored TGIDs (at most [`MAX_REPORTED_TGIDS`]; more set the
    /// overflow flag). Serialised internally, so any thread may call it.
    pub fn report_monitored(&self, tgids: &[u32]) {
        let _g = self
            .report_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.map.report().write_tgids(tgids);
    }

    /// The consumer's state ([`layout::consumer_state`]).
    pub fn consumer_state(&self) -> u32 {
        self.map.header().consumer_state.load(Ordering::Acquire)
    }
}

/// A handle on one vCPU's counter block.
pub struct CounterSink {
    block: *const CounterBlock,
    /// Keeps the mapping alive as long as `block` is used.
    _map: Arc<Mapping>,
}

// SAFETY: the block is only accessed through atomics and the mapping is kept alive by the Arc.
unsafe impl Send for CounterSink {}
// SAFETY: as for Send; all methods take `&self` and use atomic operations only.
unsafe impl Sync for CounterSink {}

impl CounterSink {
    fn cell(&self, c: Counter) -> &AtomicU64 {
        // SAFETY: `block` was obtained from a bounds-checked accessor of the mapping `_map`
        // keeps alive; `c as usize < COUNTER_CELLS` by construction of `Counter`.
        unsafe { &(*self.block).cells[c as usize] }
    }

    /// Atomically adds `n` (safe from any thread).
    #[inline]
    pub fn add(&self, c: Counter, n: u64) {
        self.cell(c).fetch_add(n, Ordering::Relaxed);
    }

    /// Adds `n` with a plain load and store instead of a locked read-modify-write: several
    /// times cheaper, but only correct when the calling thread is the counter's only writer
    /// (the vCPU's own thread for the per-vCPU hot-path counters).
    #[inline]
    pub fn add_single_writer(&self, c: Counter, n: u64) {
        let cell = self.cell(c);
        cell.store(
            cell.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    /// Stores `v` (for counters mirrored from elsewhere, e.g. a QEMU scoreboard).
    #[inline]
    pub fn set(&self, c: Counter, v: u64) {
        self.cell(c).store(v, Ordering::Relaxed);
    }

    /// Raises the counter to `v` if it is lower (for mirrors updated from several threads).
    #[inline]
    pub fn set_max(&self, c: Counter, v: u64) {
        self.cell(c).fetch_max(v, Ordering::Relaxed);
    }

    /// Current value.
    #[inline]
    pub fn get(&self, c: Counter) -> u64 {
        self.cell(c).load(Ordering::Relaxed)
    }
}

/// The single producer of one vCPU's ring. Not `Sync`; `push` takes `&mut self`.
pub struct Producer {
    head_ptr: *const AtomicU64,
    tail_ptr: *const AtomicU64,
    slots: *mut Record,
    /// Next index to write; the copy in the file is only published, never read back.
    head: u64,
    /// Last tail seen; refreshed only when the ring looks full, so the common push touches
    /// no cache line the consumer writes.
    cached_tail: u64,
    cap: u64,
    mask: u64,
    counters: CounterSink,
}

// SAFETY: the raw pointers point into the mapping kept alive by `counters._map`; moving the
// producer to another thread keeps the single-producer property (it is not Clone/Sync).
unsafe impl Send for Producer {}

impl Producer {
    /// Pushes a copy of `rec`; never blocks. Returns false (and counts a drop) when the ring is
    /// full.
    #[inline]
    pub fn push(&mut self, rec: &Record) -> bool {
        if self.head.wrapping_sub(self.cached_tail) >= self.cap {
            // SAFETY: tail_ptr points to this ring's tail inside the live mapping.
            self.cached_tail = unsafe { &*self.tail_ptr }.load(Ordering::Acquire);
            // A scribbled tail ahead of head shows up as a huge difference: treat as full.
            if self.head.wrapping_sub(self.cached_tail) >= self.cap {
                self.counters.add_single_writer(Counter::RecordsDropped, 1);
                return false;
            }
        }
        let idx = (self.head & self.mask) as usize;
        // SAFETY: `idx <= mask < ring_records`, so the slot is inside this ring; the consumer
        // does not read it until the Release store of head below, and Record is plain data.
        unsafe { std::ptr::write_volatile(self.slots.add(idx), *rec) };
        self.head = self.head.wrapping_add(1);
        // SAFETY: head_ptr points to this ring's head inside the live mapping.
        unsafe { &*self.head_ptr }.store(self.head, Ordering::Release);
        self.counters.set(Counter::RecordsWritten, self.head);
        true
    }

    /// Free slots (refreshes the consumer's tail only when the cached copy says fewer than
    /// `want` are free). Use it to push an entry and its DATA records all or nothing.
    #[inline]
    pub fn free(&mut self, want: u64) -> u64 {
        let mut free = self
            .cap
            .saturating_sub(self.head.wrapping_sub(self.cached_tail));
        if free < want {
            // SAFETY: tail_ptr points to this ring's tail inside the live mapping.
            self.cached_tail = unsafe { &*self.tail_ptr }.load(Ordering::Acquire);
            free = self
                .cap
                .saturating_sub(self.head.wrapping_sub(self.cached_tail));
        }
        free
    }

    /// Records in the ring not yet consumed (as far as this producer knows).
    pub fn len(&self) -> u64 {
        // SAFETY: tail_ptr points to this ring's tail inside the live mapping.
        let tail = unsafe { &*self.tail_ptr }.load(Ordering::Acquire);
        self.head.wrapping_sub(tail).min(self.cap)
    }

    /// True if the ring holds no unconsumed record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This vCPU's counters (hot-path helpers: [`CounterSink::add_single_writer`]).
    #[inline]
    pub fn counters(&self) -> &CounterSink {
        &self.counters
    }
}

/// The redirect mailbox of a channel, usable apart from its [`ChannelHost`] (see
/// [`ChannelHost::redirect_handle`]).
#[derive(Clone)]
pub struct MailboxHandle(Arc<Mapping>);

impl MailboxHandle {
    pub fn mailbox(&self) -> &redirect::Mailbox {
        self.0.mailbox()
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock of [`Record::timestamp_ns`]).
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer; CLOCK_MONOTONIC is
    // always supported on Linux (vDSO, no syscall).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}
