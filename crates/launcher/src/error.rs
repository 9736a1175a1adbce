//! Errors of the launcher, one variant per way a run can fail.

use std::path::PathBuf;

/// Why a VM could not be started or did not end cleanly.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("--tcg-threads single cannot be used with tracing, insights, syscall counting, FoxyIdle or the synchronous symcall transport: the plugin keeps its per-vCPU state on TCG's vCPU threads (use --tcg-threads auto or multi)")]
    TcgSingleWithPlugin,
    #[error("QEMU was not found: looked for `{0}` (install QEMU 10 with `make setup`, or choose one with --qemu or VMSIGHT_QEMU)")]
    QemuNotFound(String),
    #[error("QEMU at {path} is version {found}; vmsight needs QEMU 10 or newer")]
    QemuTooOld { path: PathBuf, found: String },
    #[error("cannot run {path} --version: {source}")]
    QemuVersion {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU at {path} does not run: `--version` {status}: {stderr}")]
    QemuBroken {
        path: PathBuf,
        status: std::process::ExitStatus,
        /// The first line QEMU (or the loader) printed on stderr.
        stderr: String,
    },
    /// `--qemu trixie` (or auto's fallback), but scripts/build-qemu-trixie.sh has not run.
    #[error("the QEMU 11 trixie root is not built: run `make qemu11` (scripts/build-qemu-trixie.sh); {path} does not exist")]
    TrixieMissing { path: PathBuf },
    /// `--qemu auto` found neither a system QEMU 10 or newer nor the trixie root.
    #[error("no usable QEMU: {system}, and the QEMU 11 trixie root is not built (install QEMU 10 with `make setup`, or build QEMU 11 with `make qemu11`)")]
    NoUsableQemu { system: String },
    /// The plugin would be loaded into a QEMU whose plugin API it does not speak.
    #[error("{qemu} speaks TCG plugin API {api}, but the vmsight plugin supports only API {supported} (QEMU 10.0 and 11): run with --no-plugin, or choose another QEMU with --qemu (`make qemu11` builds QEMU 11 for --qemu trixie)")]
    PluginApi {
        qemu: String,
        api: u32,
        supported: String,
    },
    #[error("the kernel {0} does not exist or is not readable")]
    KernelMissing(PathBuf),
    #[error("the initrd {0} does not exist or is not readable")]
    InitrdMissing(PathBuf),
    #[error("the disk image {path} cannot be opened: {reason}")]
    DiskUnusable { path: PathBuf, reason: String },
    #[error("the vmsight plugin was not found at {0} (build it with `cargo build --release -p vmsight-plugin`, or set VMSIGHT_PLUGIN)")]
    PluginMissing(PathBuf),
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// The requested accelerator cannot be used.
    #[error("invalid VM configuration: {0}")]
    Accel(#[from] crate::accel::AccelError),
    /// The event outputs (bus, Redis, events file) could not be opened.
    #[error("cannot open the file-event outputs: {0}")]
    Delivery(#[from] crate::stream::DeliveryError),
    #[error(transparent)]
    Invalid(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Metrics(#[from] vmsight_metrics::MetricsError),
    #[error("a VM named {0:?} is already running (its runtime directory {1} is in use)")]
    NameInUse(String, PathBuf),
    #[error("cannot prepare the runtime directory {path}: {source}")]
    RuntimeDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot copy the root disk {from} to {to}: {source}")]
    RootCopy {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on {path}: {source}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start QEMU: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("disk {index} ({path}): {source}")]
    Backend {
        index: usize,
        path: PathBuf,
        #[source]
        source: vmsight_blockdev::BlockError,
    },
    #[error("stage {stage}: {reason}")]
    Stage { stage: String, reason: String },
    #[error("disk {index} ({path}): stage {stage}: {reason}")]
    StageBuild {
        index: usize,
        path: PathBuf,
        stage: &'static str,
        reason: String,
    },
    #[error("VM {vm}: network: {reason}")]
    Net { vm: String, reason: String },
    #[error("VM {vm}: network device: {source}")]
    NetDevice {
        vm: String,
        #[source]
        source: vmsight_netdev::NetError,
    },
    /// The symbiotic interface could not be set up (its errors name the VM).
    #[error(transparent)]
    Sym(Box<crate::sym::SymError>),
    #[error("VM {vm}: swap disk: {source}")]
    Swap {
        vm: String,
        #[source]
        source: vmsight_swap::SwapError,
    },
    #[error("VM {vm}: shared in-memory file system: {source}")]
    Share {
        vm: String,
        #[source]
        source: crate::hylics::ShareError,
    },
    #[error("VM {vm}: --hylics-slo: {source}")]
    Slo {
        vm: String,
        #[source]
        source: crate::hylics::SloError,
    },
    #[error("VM {vm}: {source}")]
    Controller {
        vm: String,
        #[source]
        source: crate::hylics::ControlError,
    },
    #[error("VM {vm}: {source}")]
    Confine {
        vm: String,
        #[source]
        source: crate::confine::ConfineError,
    },
    #[error("VM {vm}: {source}")]
    Daemon {
        vm: String,
        #[source]
        source: crate::daemon::DaemonError,
    },
    #[error("cannot set up the plugin channel: {0}")]
    Channel(String),
    #[error("QMP: {0}")]
    Qmp(String),
    #[error("guest image: {0}")]
    Image(#[from] vmsight_image::ImageError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl From<crate::sym::SymError> for LaunchError {
    fn from(e: crate::sym::SymError) -> LaunchError {
        // Boxed: the symbiotic errors are large and rare.
        LaunchError::Sym(Box::new(e))
    }
}
