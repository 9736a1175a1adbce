//! The device registry: every kind of device vmsight serves to QEMU, in one table.
//!
//! A [`DeviceEntry`] starts all devices of its kind for a VM in the devices phase, before
//! QEMU exists, so QEMU's connection cannot race them. Each running [`Device`] gives QEMU its
//! arguments, tells the supervisor when its backend stopped, reports metrics while the VM runs
//! and is torn down (joined, counters collected) after QEMU is gone. `vm::run`, the stats and
//! the metrics endpoint iterate over the devices without naming a kind.
//!
//! Adding a device: a module here with a `Device` implementation and its `ENTRY`, listed in
//! [`DEVICES`]. See ARCHITECTURE.md, "Where to add a device".

pub mod blk;
pub mod fs;
pub mod net;
pub mod swap;
pub mod sym;
pub mod vsock;

use std::sync::Arc;

use crate::config::VmConfig;
use crate::error::LaunchError;
use crate::stages::{Sample, StageMetrics};
use crate::stats::DiskStats;
use crate::stream::DiskStream;
use crate::vm::prepare::Prepared;

/// Every device kind, started in this order.
pub static DEVICES: &[&DeviceEntry] = &[
    &blk::ENTRY,
    &net::ENTRY,
    &fs::ENTRY,
    &vsock::ENTRY,
    &swap::ENTRY,
    &sym::ENTRY,
];

/// How an entry starts its devices.
pub type StartFn = fn(&DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError>;

/// One registry entry.
pub struct DeviceEntry {
    /// The device kind (QEMU's device model), e.g. `vhost-user-blk`.
    pub kind: &'static str,
    /// Starts every device of this kind the VM needs, listening before QEMU is spawned.
    pub start: StartFn,
}

impl std::fmt::Debug for DeviceEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEntry")
            .field("kind", &self.kind)
            .finish()
    }
}

/// What device entries may use when starting.
pub struct DeviceEnv<'a> {
    pub cfg: &'a VmConfig,
    pub prep: &'a Prepared,
    /// The insight engine, when `--insights` is on (block stages classify with it).
    pub insight: Option<&'a vmsight_insight::InsightEngine>,
    /// File-update streams of the writable disks (their write taps go into the pipelines).
    pub streams: &'a [DiskStream],
    /// FoxyIdle's attribution, when FoxyIdle is on (every disk gets an idle stage).
    pub idle: Option<&'a std::sync::Arc<crate::idle::Attributor>>,
    /// The VM's shared in-memory file system (and its controller), with `--shared-mem`.
    pub hylics: Option<&'a crate::hylics::Hylics>,
    /// The symbiotic interface, with `--symbiotic`.
    pub sym: Option<&'a std::sync::Arc<crate::sym::Symbiotic>>,
    /// The swap service, with `--swap`.
    pub swap: Option<&'a std::sync::Arc<crate::swap::SwapService>>,
}

/// A running device.
pub trait Device: Send {
    /// The kind, as in its entry.
    fn kind(&self) -> &'static str;
    /// Its id on QEMU's command line and in labels (e.g. `disk1`).
    fn id(&self) -> String;
    /// QEMU's arguments for this device (`-chardev ... -device ...`).
    fn qemu_args(&self) -> Vec<String>;
    /// Parameters for the guest kernel's command line (read by the guest's init), if any.
    fn kernel_args(&self) -> Vec<String> {
        Vec::new()
    }
    /// A description if its backend has stopped while the VM runs.
    fn stopped(&self) -> Option<String>;
    /// Handles to what the device reports while it runs (control socket, metrics endpoint).
    fn metrics(&self) -> DeviceMetrics;
    /// After QEMU is gone: joins the backend and returns its report.
    fn finish(self: Box<Self>) -> DeviceReport;
}

/// Live counters of one device, shareable with the services that report them.
#[derive(Clone)]
pub struct DeviceMetrics {
    pub kind: &'static str,
    /// The device's QEMU id (`disk1`).
    pub id: String,
    /// The disk index, for block devices.
    pub disk: Option<usize>,
    /// The device's own counters, read on demand.
    pub samples: Arc<dyn Fn() -> Vec<Sample> + Send + Sync>,
    /// Block stages in pipeline order with what they report (empty for other devices).
    pub stages: Vec<(&'static str, Arc<dyn StageMetrics>)>,
}

impl std::fmt::Debug for DeviceMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMetrics")
            .field("kind", &self.kind)
            .field("id", &self.id)
            .finish()
    }
}

/// What a device reports at the end of a run.
#[derive(Debug, Default)]
pub struct DeviceReport {
    /// Disk counters (block devices).
    pub disk: Option<DiskStats>,
    /// NIC counters (network devices).
    pub net: Option<crate::stats::NetStats>,
    /// The share at the end (the virtio-fs device).
    pub share: Option<vmsight_proto::hylics::ShareInfo>,
    /// The share-size controller at the end (the vsock device, `--hylics-slo`).
    pub controller: Option<vmsight_proto::hylics::ControllerStatus>,
    /// The send offload's counters (the vsock device).
    pub offload: Option<crate::hylics::offload::OffloadSnapshot>,
    /// The symbiotic interface's counters (the ivshmem-doorbell device).
    pub sym: Option<vmsight_proto::sym::SymCounters>,
    /// The swap disk and its cache (the swap device).
    pub swap: Option<vmsight_proto::swap::SwapReport>,
    /// The backend ended with an error.
    pub error: Option<String>,
}

/// Starts every registered device kind.
pub fn start_all(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let mut all = Vec::new();
    for e in DEVICES {
        all.extend((e.start)(env)?);
    }
    Ok(all)
}
