//! Counters gathered at the end of a run: plugin (per vCPU), disks, timings.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use std::sync::{Arc, Mutex};
use vmsight_blockdev::{BlockMetrics, MetricsSnapshot};

use vmsight_ring::ChannelHost;

use crate::trace::TraceSummary;

use crate::accel::Accel;

/// One vCPU's plugin counters.
#[derive(Debug, Clone, Serialize)]
pub struct VcpuStats {
    pub vcpu: u32,
    pub syscalls: u64,
    pub callbacks: u64,
    pub records: u64,
    pub dropped: u64,
    /// Monitored TGIDs dropped because another process reused them (the monitored one was
    /// killed without `exit_group`).
    pub stale_tgids: u64,
    /// 32-bit system calls (`int 0x80`, `sysenter`) executed in user mode (any task): counted,
    /// not traced.
    pub compat_syscalls: u64,
    /// Return callbacks (`sysretq`/`iretq` while a monitored or unknown task ran): the
    /// vCPU-side cost of interception beyond the entry callbacks.
    pub return_callbacks: u64,
    /// Return callbacks that came back to kernel mode (ignored after the register reads).
    pub kernel_returns: u64,
    /// CR3-write callbacks (context switches while a filter is set).
    pub cr3_writes: u64,
    /// Current-task lookups in guest memory (the vCPU's monitoring state was unknown).
    pub classifications: u64,
    /// DATA records (buffer contents or checksums) produced.
    pub data_records: u64,
}

/// One disk's backend counters.
#[derive(Debug, Clone, Serialize)]
pub struct DiskStats {
    pub path: PathBuf,
    pub metrics: MetricsSnapshot,
    /// Snapshots of the disk's block stages that report one, under each stage's key
    /// (`cache`, `model`, ...: see the stage registry), flattened into the disk's object.
    #[serde(flatten)]
    pub stages: std::collections::BTreeMap<String, serde_json::Value>,
    /// One summary line per reporting stage, for the text output.
    #[serde(skip)]
    pub stage_lines: Vec<String>,
    /// The write tap of this disk, if it had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tap: Option<vmsight_blockdev::tap::TapSnapshot>,
    /// File-update inference on this disk, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<crate::stream::InferStats>,
}

impl DiskStats {
    pub fn from_metrics(path: PathBuf, m: &BlockMetrics) -> DiskStats {
        DiskStats {
            path,
            metrics: m.snapshot(),
            stages: Default::default(),
            stage_lines: Vec::new(),
            tap: None,
            stream: None,
        }
    }
}

/// One NIC's counters at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct NetStats {
    /// `net0`.
    pub id: String,
    pub tap: String,
    pub metrics: vmsight_netdev::NetSnapshot,
    /// Snapshots of the NIC's packet stages, under each stage's key.
    #[serde(flatten)]
    pub stages: std::collections::BTreeMap<String, serde_json::Value>,
    #[serde(skip)]
    pub stage_lines: Vec<String>,
}

/// Everything `vmsight run --stats` prints.
#[derive(Debug, Clone, Serialize)]
pub struct RunStats {
    pub name: String,
    pub accel: Accel,
    pub accel_reason: String,
    /// `major.minor.micro` of the QEMU that ran (the same as `qemu.version`).
    pub qemu_version: String,
    /// The QEMU that ran: kind (`system`, `trixie`, `path`), version, plugin API it speaks.
    pub qemu: vmsight_proto::layout::QemuInfo,
    /// The TCG plugin API in use: the QEMU's, when the plugin was loaded.
    pub plugin_api: Option<u32>,
    /// From `vmsight run` to the guest init reporting `ready`.
    pub boot_seconds: Option<f64>,
    /// The guest kernel's own uptime at `ready`.
    pub guest_uptime_at_ready: Option<f64>,
    pub run_seconds: f64,
    /// vmsight stopped QEMU because the guest had synced and reported `down` but QEMU was
    /// still running [`crate::supervisor::POWEROFF_TIMEOUT`] later (a guest kernel hung in its device shutdown).
    pub poweroff_forced: bool,
    /// `None` when the plugin was not loaded (KVM, or `--no-plugin`).
    pub plugin_attached: Option<bool>,
    /// Whether the plugin instrumented translated code (`None` when not loaded); `false`: it
    /// was dormant, so nothing was counted (`--count-syscalls`, docs/plugin.md).
    pub plugin_translates: Option<bool>,
    pub vcpus: Vec<VcpuStats>,
    /// Records drained from the ring at exit.
    pub records_drained: u64,
    pub disks: Vec<DiskStats>,
    /// NICs (vmsight's network devices).
    pub nics: Vec<NetStats>,
    /// The shared in-memory file system (`--shared-mem`), as it was at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<vmsight_proto::hylics::ShareInfo>,
    /// Hylics' send offload (with a share).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<crate::hylics::offload::OffloadSnapshot>,
    /// Hylics' share-size controller (`--hylics-slo`), at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub controller: Option<vmsight_proto::hylics::ControllerStatus>,
    /// The symbiotic interface's counters (`--symbiotic`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symbiotic: Option<vmsight_proto::sym::SymCounters>,
    /// The swap disk, its cache and the bypass (`--swap`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap: Option<vmsight_proto::swap::SwapReport>,
    /// Classification counters of `--insights`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insights: Option<vmsight_insight::ClassCounters>,
    /// Syscall tracing counters, when `--trace` was on.
    pub trace: Option<TraceSummary>,
    /// vmsight's own memory at exit (guest RAM is QEMU's shared memfd and shows as shmem).
    pub memory: ProcessMemory,
}

/// Resident memory of the vmsight process, from /proc/self/status (KiB).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProcessMemory {
    /// Peak resident set, all kinds.
    pub peak_rss_kib: u64,
    /// Private anonymous memory (heap, stacks): what vmsight itself allocates.
    pub anon_kib: u64,
    /// File-backed pages (the vmsight binary and libraries).
    pub file_kib: u64,
    /// Shared memory: the plugin channel and mapped guest RAM, shared with QEMU.
    pub shmem_kib: u64,
}

impl ProcessMemory {
    pub fn read_self() -> ProcessMemory {
        let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| -> u64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        ProcessMemory {
            peak_rss_kib: field("VmHWM:"),
            anon_kib: field("RssAnon:"),
            file_kib: field("RssFile:"),
            shmem_kib: field("RssShmem:"),
        }
    }
}

impl RunStats {
    #[allow(clippy::too_many_arguments)]
    pub fn collect(
        name: &str,
        accel: Accel,
        accel_reason: &str,
        qemu: vmsight_proto::layout::QemuInfo,
        plugin_api: Option<u32>,
        boot: Option<Duration>,
        guest_uptime: Option<f64>,
        run: Duration,
        channel: Option<&Arc<Mutex<ChannelHost>>>,
        disks: Vec<DiskStats>,
        trace: Option<TraceSummary>,
    ) -> RunStats {
        let guard = channel.and_then(|c| c.lock().ok());
        let channel: Option<&ChannelHost> = guard.as_deref();
        let vcpus = channel
            .map(|c| {
                let n = c.plugin_status().vcpus as usize;
                c.counters()
                    .into_iter()
                    .enumerate()
                    .take(n.max(1))
                    .map(|(i, v)| VcpuStats {
                        vcpu: i as u32,
                        syscalls: v.syscalls,
                        callbacks: v.callbacks,
                        records: v.records_written,
                        dropped: v.records_dropped,
                        stale_tgids: v.stale_tgids,
                        compat_syscalls: v.compat_syscalls,
                        return_callbacks: v.return_callbacks,
                        kernel_returns: v.kernel_returns,
                        cr3_writes: v.cr3_writes,
                        classifications: v.classifications,
                        data_records: v.data_records,
                    })
                    .collect()
            })
            .unwrap_or_default();
        RunStats {
            name: name.to_string(),
            accel,
            accel_reason: accel_reason.to_string(),
            qemu_version: qemu.version.clone(),
            qemu,
            plugin_api,
            boot_seconds: boot.map(|d| d.as_secs_f64()),
            guest_uptime_at_ready: guest_uptime,
            run_seconds: run.as_secs_f64(),
            poweroff_forced: false,
            plugin_attached: channel.map(|c| c.plugin_attached()),
            plugin_translates: channel.map(|c| {
                c.plugin_status().flags & vmsight_ring::layout::plugin_flags::TRANSLATES != 0
            }),
            vcpus,
            records_drained: trace.as_ref().map(|t| t.records).unwrap_or(0),
            disks,
            nics: Vec::new(),
            share: None,
            offload: None,
            controller: None,
            symbiotic: None,
            swap: None,
            insights: None,
            trace,
            memory: ProcessMemory::read_self(),
        }
    }

    pub fn total_syscalls(&self) -> u64 {
        self.vcpus.iter().map(|v| v.syscalls).sum()
    }
}

impl fmt::Display for RunStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "vmsight stats for VM {}", self.name)?;
        writeln!(
            f,
            "  qemu {} ({}), {}, accel {} ({})",
            self.qemu.version,
            self.qemu.kind,
            match self.plugin_api {
                Some(api) => format!("plugin API {api}"),
                None => format!(
                    "plugin not loaded (this QEMU speaks plugin API {})",
                    self.qemu.plugin_api
                ),
            },
            self.accel,
            self.accel_reason
        )?;
        match self.boot_seconds {
            Some(b) => writeln!(
                f,
                "  boot to guest init: {b:.2}s (guest uptime {}), total run: {:.2}s",
                self.guest_uptime_at_ready
                    .map(|u| format!("{u:.2}s"))
                    .unwrap_or_else(|| "unknown".into()),
                self.run_seconds
            )?,
            None => writeln!(
                f,
                "  guest never reported ready; total run: {:.2}s",
                self.run_seconds
            )?,
        }
        if self.poweroff_forced {
            writeln!(
                f,
                "  poweroff: forced (the guest synced and asked to power off, but QEMU was \
                 still running {} s later)",
                crate::supervisor::POWEROFF_TIMEOUT.as_secs()
            )?;
        }
        match self.plugin_attached {
            None => writeln!(f, "  plugin: not loaded")?,
            Some(false) => writeln!(f, "  plugin: loaded but never attached to the channel")?,
            Some(true) if self.plugin_translates == Some(false) => writeln!(
                f,
                "  plugin: dormant (nothing asked of it: no code instrumented, syscalls not \
                 counted; --count-syscalls counts them)"
            )?,
            Some(true) => {
                writeln!(f, "  plugin: user-mode syscall instructions per vCPU")?;
                for v in &self.vcpus {
                    writeln!(
                        f,
                        "    vcpu{}: syscalls={} callbacks={} records={} dropped={}",
                        v.vcpu, v.syscalls, v.callbacks, v.records, v.dropped
                    )?;
                    writeln!(
                        f,
                        "      returns={} (to kernel {}) cr3_writes={} classifications={} \
                         data_records={}",
                        v.return_callbacks,
                        v.kernel_returns,
                        v.cr3_writes,
                        v.classifications,
                        v.data_records
                    )?;
                }
                writeln!(f, "    total: syscalls={}", self.total_syscalls())?;
                let compat: u64 = self.vcpus.iter().map(|v| v.compat_syscalls).sum();
                if compat > 0 {
                    writeln!(
                        f,
                        "    32-bit system calls (int 0x80, sysenter): {compat}, not traced"
                    )?;
                }
                let stale: u64 = self.vcpus.iter().map(|v| v.stale_tgids).sum();
                if stale > 0 {
                    writeln!(f, "    monitored PIDs reused after an unseen exit: {stale}")?;
                }
            }
        }
        writeln!(
            f,
            "  vmsight memory: {} KiB private, {} KiB file, {} KiB shared (channel, guest RAM views); peak RSS {} KiB",
            self.memory.anon_kib, self.memory.file_kib, self.memory.shmem_kib, self.memory.peak_rss_kib
        )?;
        if let Some(c) = &self.insights {
            let fmt = |m: &std::collections::BTreeMap<u8, vmsight_insight::Tally>| {
                m.iter()
                    .map(|(k, t)| format!("class {k}: {} ({} KiB)", t.requests, t.bytes / 1024))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            writeln!(
                f,
                "  insights: write chunks data={} (by page {}) unknown={} metadata={}; read chunks data={} (by page {}) unknown={} metadata={}; late matches={}",
                c.write_chunks_data,
                c.write_chunks_by_page,
                c.write_chunks_unknown,
                c.write_chunks_metadata,
                c.read_chunks_data,
                c.read_chunks_by_page,
                c.read_chunks_unknown,
                c.read_chunks_metadata,
                c.late_matches
            )?;
            if c.copy_calls + c.copy_reads + c.copy_reads_late > 0 {
                writeln!(
                    f,
                    "    copies without a user buffer: {} calls ({} mapped to disk ranges, {} not); {} reads hinted, {} late; {} chunks expected in destinations, {} matched",
                    c.copy_calls,
                    c.copy_ranges_mapped,
                    c.copy_ranges_unmapped,
                    c.copy_reads,
                    c.copy_reads_late,
                    c.copy_expected_chunks,
                    c.copy_write_chunks
                )?;
            }
            if c.lookups_answered() + c.lookup_failures > 0 {
                writeln!(
                    f,
                    "    lookups of what no seen syscall said: cwd {} from the profile, {} by symcall; fd {} from the profile, {} by symcall; {} unanswered",
                    c.lookups_task_profile,
                    c.lookups_task_symcall,
                    c.lookups_fd_profile,
                    c.lookups_fd_symcall,
                    c.lookup_failures
                )?;
            }
            if c.forks_adopted > 0 {
                writeln!(
                    f,
                    "    new processes given their parent's fds at their first call (before the fork's return): {}",
                    c.forks_adopted
                )?;
            }
            writeln!(f, "    writes by class: {}", fmt(&c.writes))?;
            writeln!(f, "    reads by class: {}", fmt(&c.reads))?;
        }
        for n in &self.nics {
            writeln!(f, "  {} (tap {}): {}", n.id, n.tap, n.metrics)?;
            for line in &n.stage_lines {
                writeln!(f, "    {line}")?;
            }
        }
        if let Some(s) = &self.share {
            writeln!(
                f,
                "  share {} (host {}): {} KiB of {} KiB used, {} files, {} resizes, cache {}",
                s.guest_path,
                s.host_path,
                s.used_bytes / 1024,
                s.size_bytes / 1024,
                s.files,
                s.resizes,
                s.cache
            )?;
        }
        if let Some(o) = &self.offload {
            writeln!(
                f,
                "  send offload: {} requests, {} files sent, {} KiB sent by the host, {} failed, {} bad requests, {} turned away",
                o.requests,
                o.files_sent,
                o.bytes_sent / 1024,
                o.failures,
                o.bad_requests,
                o.busy
            )?;
        }
        if let Some(c) = &self.controller {
            writeln!(f, "  {}", crate::hylics::control::summary(c))?;
        }
        if let Some(r) = &self.swap {
            writeln!(f, "  {}", r.summary())?;
        }
        if let Some(c) = &self.symbiotic {
            writeln!(
                f,
                "  symbiotic: {} hellos ({} accepted, {} refused); symcalls {} doorbell, {} sync \
                 (guest woken at once {} times with all vCPUs idle, {} with none in the kernel; \
                 {} after waiting), \
                 {} timed out, {} refused as busy; guest doorbells {} call ({} spurious), {} \
                 state; SymSpy read {} times, {} problems",
                c.hellos,
                c.accepted,
                c.refused,
                c.calls_doorbell,
                c.calls_sync,
                c.sync_wakes_idle,
                c.sync_wakes_user,
                c.sync_wakes_waited,
                c.timeouts,
                c.busy,
                c.doorbells_call,
                c.doorbells_spurious,
                c.doorbells_state,
                c.spy_reads,
                c.spy_problems
            )?;
        }
        for (i, d) in self.disks.iter().enumerate() {
            let m = &d.metrics;
            writeln!(
                f,
                "  disk{i} {}: reads={} ({} KiB) writes={} ({} KiB) flushes={} discards={} errors={}",
                d.path.display(),
                m.reads,
                m.bytes_read / 1024,
                m.writes,
                m.bytes_written / 1024,
                m.flushes,
                m.discards,
                m.errors.total()
            )?;
            for line in &d.stage_lines {
                writeln!(f, "    {line}")?;
            }
            if let Some(t) = &d.tap {
                writeln!(
                    f,
                    "    write tap: {} events, {} KiB copied, {} writes queued without bytes, peak queue {} KiB",
                    t.events,
                    t.bytes / 1024,
                    t.writes_without_data,
                    t.peak_queued_bytes / 1024
                )?;
            }
            if let Some(st) = &d.stream {
                let kinds: Vec<String> = st
                    .events_by_kind
                    .iter()
                    .map(|(k, n)| format!("{k}={n}"))
                    .collect();
                writeln!(
                    f,
                    "    file events: {} ({}); {} jbd2 transactions, {} pending blocks ({} claimed, {} expired, {} evicted by the cap), {} data writes dropped in {} overloads",
                    st.events,
                    kinds.join(" "),
                    st.txns_applied,
                    st.pending_blocks,
                    st.pending_claimed,
                    st.pending_expired,
                    st.pending_evicted,
                    st.dropped_data_writes,
                    st.overload_episodes
                )?;
                writeln!(f, "    {}", index_line(st))?;
            }
        }
        Ok(())
    }
}

/// The `--stats` line of a disk's index: eager, or lazy with its loads and the share of the
/// tree loaded.
fn index_line(st: &crate::stream::InferStats) -> String {
    let ix = &st.index;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    if !ix.lazy {
        return format!(
            "index: in memory, {:.1} MiB for {} inodes",
            mib(ix.resident_bytes),
            ix.inodes
        );
    }
    format!(
        "index: lazy, {:.1} MiB resident (peak {:.1} MiB), {} sections loaded ({} evicted, {} ms), {:.1}% of {} inodes loaded{}",
        mib(ix.resident_bytes),
        mib(ix.peak_resident_bytes),
        ix.sections_loaded,
        ix.sections_evicted,
        ix.load_ns / 1_000_000,
        100.0 * ix.inodes_loaded as f64 / ix.inodes.max(1) as f64,
        ix.inodes,
        if ix.load_errors > 0 {
            format!(", {} failed loads", ix.load_errors)
        } else {
            String::new()
        }
    )
}
