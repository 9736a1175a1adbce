//! Command-line parsing and dispatch. Each subcommand is a thin layer over a library crate.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use vmsight_introspect::syscall::NameFilter;
use vmsight_launcher::accel::AccelRequest;
use vmsight_launcher::config::{generate_name, parse_mem_mib, DiskSpec, VmConfig};
use vmsight_launcher::qemu::QemuChoice;
use vmsight_launcher::stages::StageRequest;
use vmsight_launcher::trace::{TraceConfig, TraceTarget};
use vmsight_launcher::{runtime, Artifacts, EndReason};
use vmsight_proto::control::{ControlReply, ControlRequest, VmStatus};

/// vmsight: VMM-level introspection of unmodified guests on QEMU 10 or 11.
#[derive(Debug, Parser)]
#[command(name = "vmsight", version, about, long_about = None)]
struct Cli {
    /// More logging on stderr (-v info, -vv debug, -vvv trace); or set RUST_LOG.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Boot a guest under vmsight; run CMD in it (or give an interactive console) and power off.
    Run(Box<RunArgs>),
    /// Build or inspect the default guest image.
    Image {
        #[command(subcommand)]
        action: ImageCmd,
    },
    /// List the VMs running under vmsight on this host.
    Ps {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Summarise an insight log (`run --insights FILE`): per-class totals, metadata written per
    /// file system, block lifetimes (table, optional SVG CDF plot).
    Report(ReportArgs),
    /// Replay a write recording (`run --record-writes`) over the disk image it started from and
    /// print the file events as JSON lines, as a live run would have produced them.
    Replay(ReplayArgs),
    /// Live counters of a running VM: insight classes, iCache hits per class, file events.
    Stats(StatsArgs),
    /// Start file-update streaming on a running VM that was started without it (live attach),
    /// or show its streaming status.
    Stream(StreamArgs),
    /// Print file-system events of running VMs as they happen (channels host:vm:/path; see
    /// docs/filestream.md).
    Watch(WatchArgs),
    /// Mount a live read-only view of running VMs' file systems: DIR/<host>/<vm>/<path>, the
    /// root disk at DIR/<host>/<vm>/ and each extra disk at its guest mount point (--disk
    /// ...,mount=PATH; without it DIR/<host>/<vm>/@diskN).
    Mount(MountArgs),
    /// List the block stages of the stage registry: name, position, options, what it does.
    Stages,
    /// FoxyIdle's background marks of a running VM: add or remove a guest PID or command
    /// name, or list the marks (docs/foxyidle.md).
    Idle(crate::idle::IdleArgs),
    /// The network of a running VM: how its NIC is attached, or run a host command in its
    /// network namespace (docs/network.md).
    Net(crate::net::NetArgs),
    /// The shared in-memory file system of a running VM (`--shared-mem`, Hylics): its host
    /// directory, size and use, a new size, or its controller (docs/hylics.md).
    Hylics(crate::hylics::HylicsArgs),
    /// Re-run the decisions of a Hylics controller log (`--hylics-slo ...,log=FILE`) and
    /// check that each comes out the same (docs/hylics.md).
    HylicsReplay(crate::hylics::ReplayArgs),
    /// vCPU control of a running VM: run a guest function on a vCPU and restore it exactly
    /// (plugin API v7, QEMU 11.1; docs/platforms.md).
    Cpu(crate::cpu::CpuArgs),
    /// The symbiotic interface of a running VM (`--symbiotic`): the guest module's SymSpy
    /// page, and symcalls into it (docs/symbiotic.md).
    Sym(crate::sym::SymArgs),
    /// The swap disk of a running VM (`--swap`, SwapBypass): its cache in host memory, the
    /// guest module's bypass, and resizing the cache (docs/swapbypass.md).
    Swap(crate::swap::SwapArgs),
    /// Deduplicated volumes (iDedup): create, info, check, gc, export. Serve one with
    /// `vmsight run --disk VOL,dedup`.
    Dedup {
        #[command(subcommand)]
        action: crate::dedup::DedupCmd,
    },
}

#[derive(Debug, Subcommand)]
enum ImageCmd {
    /// Build the default guest image from Debian packages (cached by recipe hash).
    Build {
        /// Rebuild even if the cached image exists.
        #[arg(long)]
        force: bool,
    },
    /// Show the cached default image: paths, kernel, sizes, profile.
    Info {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum TcgThreadsArg {
    Auto,
    Multi,
    Single,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AccelArg {
    Auto,
    Tcg,
    Kvm,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Name of the VM (letters, digits, '-', '_'); generated when omitted.
    #[arg(long)]
    name: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    vcpus: u32,
    /// Guest RAM (MiB, or with M/G suffix), a shared memfd backend.
    #[arg(long, default_value = "1G", value_parser = parse_mem_mib)]
    mem: u64,
    /// Extra disk, served by vmsight's vhost-user-blk backend:
    /// PATH[,ro][,direct][,serial=ID][,queues=N][,io_threads=N][,mount=PATH]; `direct` bypasses
    /// the host page cache like QEMU cache=none; `mount` is the guest mount point (event paths).
    #[arg(long = "disk", value_name = "SPEC")]
    disks: Vec<DiskSpec>,
    /// Kernel to boot instead of the default image's.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initramfs to boot instead of the default image's.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Root disk image (raw ext4) instead of the default image's.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Extra kernel command-line arguments (repeatable).
    #[arg(long, value_name = "ARGS")]
    append: Vec<String>,
    /// Keep root-disk changes: boot the root image in place instead of a fresh copy.
    #[arg(long)]
    persist: bool,
    /// Accelerator: auto picks KVM only when a hardware KVM can run a stock kernel.
    #[arg(long, value_enum, default_value = "auto")]
    accel: AccelArg,
    /// Which QEMU runs the guest: `system` (qemu-system-x86_64 from PATH), `trixie` (QEMU 11
    /// in the Debian trixie root `make qemu11` builds), a binary's PATH, or `auto` (the system
    /// QEMU if the plugin can be loaded into it, else the trixie root). Default: $VMSIGHT_QEMU,
    /// which takes the same values, else auto (docs/platforms.md).
    #[arg(long, value_name = "auto|system|trixie|PATH")]
    qemu: Option<QemuChoice>,
    /// TCG's vCPU threads: `multi` (one host thread per vCPU), `single` (all vCPUs on one
    /// thread, in turn: slower for parallel guest work, but free of QEMU 10's TCG section race,
    /// docs/launcher.md; refused while the plugin traces, counts or feeds insights), or `auto`:
    /// single on QEMU 10 while the plugin is dormant, else multi.
    #[arg(long, value_enum, default_value = "auto")]
    tcg_threads: TcgThreadsArg,
    /// Who QEMU and virtiofsd run as: `auto` (when vmsight runs as root, an unprivileged
    /// uid and gid of the VM's own, from 1900000000 up, with no capability; else vmsight's
    /// user), `self` (vmsight's user: root keeps every capability), a user's name or UID:GID
    /// (root only). docs/security.md
    #[arg(long, value_name = "auto|self|USER|UID:GID", default_value = "auto")]
    run_as: vmsight_launcher::confine::RunAs,
    /// QEMU's own seccomp filter (`-sandbox`: no obsolete system calls, no fork or exec, no
    /// scheduler or affinity changes, no privilege raise). docs/security.md
    #[arg(long, value_enum, default_value = "on")]
    qemu_sandbox: OnOff,
    /// Do not load the vmsight TCG plugin.
    #[arg(long)]
    no_plugin: bool,
    /// Have the plugin push one record per syscall into the shared-memory ring.
    #[arg(long)]
    plugin_records: bool,
    /// Have the plugin count the guest's `syscall` instructions per vCPU (shown by --stats
    /// and --stats-json). Counting makes QEMU instrument translated code, which costs a few
    /// per cent (docs/benchmarks.md); without it, and without --trace, --insights or another
    /// feature that needs the plugin, the plugin stays dormant and costs nothing.
    #[arg(long)]
    count_syscalls: bool,
    /// Print plugin, disk and timing counters at exit (stderr).
    #[arg(long)]
    stats: bool,
    /// Also write the counters as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    stats_json: Option<PathBuf>,
    /// Copy the guest's serial console to stderr as it runs.
    #[arg(long)]
    console: bool,
    /// Save the guest's serial console to FILE.
    #[arg(long, value_name = "FILE")]
    console_log: Option<PathBuf>,
    /// Stop the VM (status 125, with the console's last lines) if its guest init has not
    /// reported `ready` this many seconds after the start; 0: no limit. Only for a command:
    /// an interactive console has no limit.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    boot_timeout: u64,
    /// Trace syscalls of TARGET and its descendants: `@cmd` (the command run; the default), a
    /// guest PID, or a command name (comm). Lines `pid tid name(args) = ret` go to stderr.
    #[arg(long, value_name = "TARGET", num_args = 0..=1, default_missing_value = "@cmd")]
    trace: Option<String>,
    /// Write the strace-style lines to FILE instead of stderr.
    #[arg(long, value_name = "FILE")]
    trace_out: Option<PathBuf>,
    /// Write one JSON object per completed syscall to FILE (implies --trace).
    #[arg(long, value_name = "FILE")]
    trace_json: Option<PathBuf>,
    /// Report only these syscalls (comma-separated names), e.g. openat,read,write.
    #[arg(long, value_name = "NAMES")]
    trace_filter: Option<String>,
    /// Classify every block request (data/metadata, file-size class, pattern, app hint) and
    /// write one JSON line per request to FILE (see docs/insights.md, `vmsight report`).
    #[arg(long, value_name = "FILE")]
    insights: Option<PathBuf>,
    /// Guest processes whose syscalls feed the insights: @cmd (default), a PID or a COMM.
    #[arg(long, value_name = "TARGET", default_value = "@cmd")]
    insight_target: String,
    /// Follow only files under these guest path prefixes (comma-separated).
    #[arg(long, value_name = "PATHS")]
    insight_paths: Option<String>,
    /// Give every disk, the root disk included, its own iCache of MIB MiB in host RAM (0: no
    /// cache).
    #[arg(long, value_name = "MIB", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1048576))]
    cache_size: u64,
    /// Cache eviction policy: lru (no hints) or priority (Sky's iCache: by class, then recency).
    #[arg(long, value_name = "POLICY", default_value = "priority")]
    cache_policy: vmsight_blockdev::stages::CachePolicy,
    /// Cache write policy: write-through or write-back (FLUSH writes dirty blocks back).
    #[arg(long, value_name = "MODE", default_value = "write-through")]
    cache_mode: vmsight_blockdev::stages::CacheMode,
    /// Make every extra disk (not the root disk) behave like an HDD or a SATA SSD (hdd, ssd,
    /// none, or hdd:rpm=..,seek_ms=..; see docs/icache.md); implies O_DIRECT on the image.
    /// The same as `--stage disk-model:MODEL`.
    #[arg(long, value_name = "MODEL", default_value = "none", value_parser = parse_disk_model)]
    disk_model: String,
    /// Add a block stage from the stage registry to the disks it applies to, with its options
    /// (repeatable), e.g. `--stage icache:size=64,policy=priority`; `vmsight stages` lists them.
    #[arg(long = "stage", value_name = "NAME[:OPTIONS]")]
    stages: Vec<StageRequest>,
    /// Serve Prometheus metrics of this VM at http://ADDR/metrics (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Write every file-update event as a JSON line to FILE (see docs/filestream.md).
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,
    /// Publish every file-update event to Redis, on channel host:vm:/path
    /// (e.g. redis://:PASSWORD@127.0.0.1:6379/).
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// Include the written bytes in `write` events (--events file and Redis).
    #[arg(long)]
    stream_data: bool,
    /// Do not stream file updates from boot on (the write taps stay idle until a live attach).
    #[arg(long)]
    no_stream: bool,
    /// Record the write stream of disk N (0 = root disk) to FILE (repeatable); see `vmsight replay`.
    #[arg(long = "record-writes", value_name = "N:FILE", value_parser = vmsight_launcher::stream::parse_record_spec)]
    record_writes: Vec<(usize, PathBuf)>,
    /// Most MiB of written data waiting in one disk's stream queue (beyond it writes are
    /// queued without their bytes and re-read from the image).
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    stream_queue_mb: u64,
    /// Keep only each disk's block map in memory; inodes, directories and names are read from
    /// a private file in the cache when writes touch them (Gamma-Ray's lazy loading).
    #[arg(long)]
    stream_lazy: bool,
    /// With --stream-lazy: most MiB of loaded index sections kept per disk.
    #[arg(long, value_name = "MIB", default_value_t = 8, requires = "stream_lazy", value_parser = clap::value_parser!(u64).range(1..=65536))]
    stream_lazy_cache_mb: u64,
    /// FoxyIdle: treat TARGET as a background process whose disk reads wait until the disk
    /// has been idle for the preemption interval (repeatable): @cmd (the command run), a
    /// guest PID or a command name; its children are background too (docs/foxyidle.md).
    #[arg(long = "background", value_name = "TARGET")]
    background: Vec<String>,
    /// Turn FoxyIdle on without marking anything yet (mark later with `vmsight idle` or from
    /// the guest with libvmsight).
    #[arg(long)]
    idle: bool,
    /// FoxyIdle's preemption interval in ms (default 15; implies --idle).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=10000))]
    idle_interval: Option<u64>,
    /// Start a background read anyway once it has waited MS ms (against starvation; implies
    /// --idle).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=3600000))]
    idle_max_hold: Option<u64>,
    /// Write one JSON line per read/write request FoxyIdle started (owner, TGID, hold time)
    /// to FILE (implies --idle).
    #[arg(long, value_name = "FILE")]
    idle_log: Option<PathBuf>,
    /// The VM's network (docs/network.md): `isolated` (the default when vmsight may create
    /// network namespaces: a namespace of the VM's own whose host end, 10.0.2.1, is the
    /// guest's gateway), `none`, `tap=NAME` or `bridge=NAME`; options after commas: ip=CIDR,
    /// gw=ADDR, host=CIDR (isolated), mtu=N, offload=on|off.
    #[arg(long, value_name = "MODE[,OPTS]")]
    net: Option<String>,
    /// Capture every frame the guest sends and receives to FILE (pcap, for tcpdump).
    #[arg(long, value_name = "FILE")]
    net_pcap: Option<PathBuf>,
    /// FoxyVegas (docs/foxyvegas.md): TCP Vegas behaviour for any guest congestion control, by
    /// lowering the window of ACKs to the guest; optional =ALPHA,BETA,GAMMA in segments
    /// (default 2,4,1).
    #[arg(long, value_name = "ALPHA,BETA,GAMMA", num_args = 0..=1, require_equals = true, default_missing_value = "")]
    foxyvegas: Option<String>,
    /// Write one JSON line per ACK FoxyVegas rewrote to FILE.
    #[arg(long, value_name = "FILE")]
    foxyvegas_log: Option<PathBuf>,
    /// A host in-memory file system of SIZE shared with the guest (Hylics, docs/hylics.md):
    /// a tmpfs served through virtio-fs by virtiofsd, mounted in the guest at /hylics;
    /// options after commas: path=DIR (the guest's mount point), cache=auto|always|never|metadata,
    /// writeback=on|off (the guest's FUSE writeback cache), threads=N (virtiofsd's workers).
    #[arg(long, value_name = "SIZE[,OPTS]")]
    shared_mem: Option<String>,
    /// Size the share to keep the mean task response time at TAU seconds (Hylics' controller,
    /// docs/hylics.md; the guest reports tasks through libhylics): options after commas:
    /// mode=static|adaptive_only|queueing_only|combined, curve=FILE (E[X|m]), min=SIZE,
    /// max=SIZE, ci=MIN:MAX, r-thresh=SECS, m-thresh=SIZE, b0=S_PER_MIB, b0-max=S_PER_MIB|off,
    /// log=FILE (JSON decisions; `vmsight hylics replay FILE` re-runs them).
    #[arg(long, value_name = "TAU[,OPTS]")]
    hylics_slo: Option<String>,
    /// The symbiotic interface (docs/symbiotic.md): announce it in fw_cfg, serve the
    /// ivshmem-doorbell device that shares a region with the guest module, and load the
    /// module `vmsight_sym` at boot; `vmsight sym NAME spy|call` then reads and calls it.
    #[arg(long)]
    symbiotic: bool,
    /// A swap disk of SIZE served by vmsight with a swap cache in host memory, formatted and
    /// enabled at boot (SwapBypass, docs/swapbypass.md); with --symbiotic the guest module
    /// swaps through the cache without block I/O. Options after commas: cache=SIZE (default:
    /// the whole swap; bare numbers are MiB), max-cache=SIZE, file=PATH, grow=SIZE (guest
    /// memory vmsight may add through virtio-mem while the guest thrashes).
    #[arg(long, value_name = "SIZE[,OPTS]")]
    swap: Option<String>,
    /// Command to run in the guest as root; its stdout/stderr/exit status become vmsight's.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

/// A clap error as one line: its first line, and when that ends in a colon (e.g. "the
/// following required arguments were not provided:") the items listed under it.
fn one_line(text: &str) -> String {
    let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
    let first = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .trim_end();
    if !first.ends_with(':') {
        return first.to_string();
    }
    let items: Vec<&str> = lines
        .take_while(|l| l.starts_with(' ') && !l.trim().is_empty())
        .map(str::trim)
        .collect();
    format!("{first} {}", items.join(", "))
}

/// One-line error and exit code 2 for bad usage; help and version print normally.
fn parse() -> Result<Cli, i32> {
    match Cli::try_parse() {
        Ok(c) => Ok(c),
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    Err(if e.use_stderr() { 2 } else { 0 })
                }
                _ => {
                    eprintln!(
                        "vmsight: {} (see `vmsight --help`)",
                        one_line(&e.to_string())
                    );
                    Err(2)
                }
            }
        }
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

pub fn main() -> i32 {
    let cli = match parse() {
        Ok(c) => c,
        Err(code) => return code,
    };
    init_logging(cli.verbose);
    let res = match cli.command {
        Cmd::Run(a) => cmd_run(*a),
        Cmd::Image { action } => cmd_image(action),
        Cmd::Ps { json } => cmd_ps(json),
        Cmd::Report(a) => cmd_report(a),
        Cmd::Watch(a) => cmd_watch(a),
        Cmd::Stream(a) => cmd_stream(a),
        Cmd::Stats(a) => cmd_stats(a),
        Cmd::Replay(a) => cmd_replay(a),
        Cmd::Mount(a) => cmd_mount(a),
        Cmd::Stages => cmd_stages(),
        Cmd::Idle(a) => crate::idle::run(a),
        Cmd::Net(a) => crate::net::run(a),
        Cmd::Hylics(a) => crate::hylics::run(a),
        Cmd::HylicsReplay(a) => crate::hylics::replay(a),
        Cmd::Cpu(a) => crate::cpu::run(a),
        Cmd::Sym(a) => crate::sym::run(a),
        Cmd::Swap(a) => crate::swap::run(a),
        Cmd::Dedup { action } => crate::dedup::run(action),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vmsight: {}", cause_chain(&e));
            1
        }
    }
}

/// Why a command failed. Library errors keep their cause chain; `main` prints it once.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    #[error(transparent)]
    Launch(#[from] vmsight_launcher::LaunchError),
    #[error(transparent)]
    Control(#[from] vmsight_launcher::control::ControlError),
    #[error(transparent)]
    RunArgs(#[from] RunArgsError),
    #[error(transparent)]
    Config(#[from] vmsight_launcher::config::ConfigError),
    #[error(transparent)]
    Dedup(#[from] vmsight_dedup::DedupError),
    #[error("cannot write to stdout")]
    Stdout(#[source] std::io::Error),
    #[error("no running VM named {0:?} (see `vmsight ps`)")]
    NoSuchVm(String),
    /// A failure already worded as one sentence by the library that reported it.
    #[error("{0}")]
    Other(String),
}

impl From<String> for CliError {
    fn from(s: String) -> Self {
        CliError::Other(s)
    }
}

impl From<&str> for CliError {
    fn from(s: &str) -> Self {
        CliError::Other(s.to_owned())
    }
}

/// The error and its causes as one line, each cause once: a cause whose text the message
/// already contains is not repeated (some messages quote their source).
fn cause_chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// Checks `--disk-model` early (a usage error, exit status 2) and keeps its text: it becomes
/// the options of a `disk-model` stage request.
fn parse_disk_model(s: &str) -> Result<String, vmsight_blockdev::stages::DiskModelError> {
    s.parse::<vmsight_blockdev::stages::DiskModelConfig>()
        .map(|_| s.to_owned())
}

/// Why `vmsight run`'s options do not make a VM configuration.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunArgsError {
    #[error("{option} needs {needs}")]
    Needs {
        option: &'static str,
        needs: &'static str,
    },
    #[error("{option}: {reason}")]
    Value {
        option: &'static str,
        reason: String,
    },
}

/// The validated configuration of `vmsight run`: only conversions, no library work (the
/// launcher resolves the default image, checks files and stages when it prepares the VM).
impl TryFrom<RunArgs> for VmConfig {
    type Error = RunArgsError;

    fn try_from(a: RunArgs) -> Result<Self, Self::Error> {
        let trace = trace_config(&a)?;
        let insights = insight_settings(&a)?;
        let stages = stage_requests(&a)?;
        let idle = idle_settings(&a)?;
        let net = net_settings(&a)?;
        let share = a
            .shared_mem
            .as_deref()
            .map(str::parse::<vmsight_launcher::hylics::ShareSpec>)
            .transpose()
            .map_err(|e| RunArgsError::Value {
                option: "--shared-mem",
                reason: e.to_string(),
            })?;
        if a.hylics_slo.is_some() && a.shared_mem.is_none() {
            return Err(RunArgsError::Needs {
                option: "--hylics-slo",
                needs: "a share to size (--shared-mem SIZE)",
            });
        }
        let slo = a
            .hylics_slo
            .as_deref()
            .map(str::parse::<vmsight_launcher::hylics::SloSpec>)
            .transpose()
            .map_err(|e| RunArgsError::Value {
                option: "--hylics-slo",
                reason: e.to_string(),
            })?;
        let boot_timeout = (a.boot_timeout > 0 && !a.command.is_empty())
            .then(|| std::time::Duration::from_secs(a.boot_timeout));
        let swap = a
            .swap
            .as_deref()
            .map(str::parse::<vmsight_launcher::swap::SwapSpec>)
            .transpose()
            .map_err(|e| RunArgsError::Value {
                option: "--swap",
                reason: e.to_string(),
            })?;
        Ok(VmConfig {
            name: a.name.unwrap_or_else(generate_name),
            vcpus: a.vcpus,
            mem_mib: a.mem,
            kernel: a.kernel,
            initrd: a.initrd,
            root_image: a.root,
            persist: a.persist,
            append: a.append,
            disks: a.disks,
            command: (!a.command.is_empty()).then_some(a.command),
            accel: match a.accel {
                AccelArg::Auto => AccelRequest::Auto,
                AccelArg::Tcg => AccelRequest::Tcg,
                AccelArg::Kvm => AccelRequest::Kvm,
            },
            qemu: a.qemu.unwrap_or_else(QemuChoice::from_env),
            tcg_threads: match a.tcg_threads {
                TcgThreadsArg::Auto => vmsight_launcher::qemu::TcgThreads::Auto,
                TcgThreadsArg::Multi => vmsight_launcher::qemu::TcgThreads::Multi,
                TcgThreadsArg::Single => vmsight_launcher::qemu::TcgThreads::Single,
            },
            run_as: a.run_as,
            qemu_sandbox: a.qemu_sandbox == OnOff::On,
            plugin: !a.no_plugin,
            plugin_records: a.plugin_records,
            count_syscalls: a.count_syscalls,
            stats: a.stats,
            show_console: a.console,
            console_log: a.console_log,
            boot_timeout,
            trace,
            profile: None,
            insights,
            stages,
            idle,
            net,
            share,
            slo,
            symbiotic: a.symbiotic,
            swap,
            metrics: a.metrics,
            stream: vmsight_launcher::stream::StreamConfig {
                enabled: !a.no_stream,
                record: a.record_writes,
                queue_bytes: a.stream_queue_mb << 20,
                events_file: a.events,
                redis: a.redis,
                data: a.stream_data,
                host: vmsight_events::host_name(),
                lazy: a.stream_lazy,
                lazy_cache_bytes: a.stream_lazy_cache_mb << 20,
            },
        })
    }
}

/// `--net`, `--net-pcap`, `--foxyvegas*`: without `--net`, an isolated network when vmsight
/// may make one, else none.
fn net_settings(a: &RunArgs) -> Result<vmsight_launcher::net::NetSettings, RunArgsError> {
    use vmsight_launcher::net::{NetSettings, NetSpec};
    let spec = match &a.net {
        Some(s) => s.parse::<NetSpec>().map_err(|e| RunArgsError::Value {
            option: "--net",
            reason: e.0,
        })?,
        None if vmsight_launcher::net::host::may_isolate() => NetSpec::isolated(),
        None => {
            tracing::info!("no network: an isolated network needs root (or --net tap=NAME)");
            NetSpec::none()
        }
    };
    let foxyvegas = a
        .foxyvegas
        .as_deref()
        .map(vmsight_netdev::stages::foxyvegas::FoxyVegasConfig::parse)
        .transpose()
        .map_err(|e| RunArgsError::Value {
            option: "--foxyvegas",
            reason: e.to_string(),
        })?;
    let settings = NetSettings {
        spec,
        pcap: a.net_pcap.clone(),
        foxyvegas,
        foxyvegas_log: a.foxyvegas_log.clone(),
    };
    if !settings.enabled() {
        for (given, option) in [
            (settings.pcap.is_some(), "--net-pcap"),
            (settings.foxyvegas.is_some(), "--foxyvegas"),
            (settings.foxyvegas_log.is_some(), "--foxyvegas-log"),
        ] {
            if given {
                return Err(RunArgsError::Needs {
                    option,
                    needs: "a network (--net isolated, tap=NAME or bridge=NAME)",
                });
            }
        }
    }
    if settings.spec.device == vmsight_launcher::net::NicDevice::Qemu
        && (settings.pcap.is_some() || settings.foxyvegas.is_some())
    {
        return Err(RunArgsError::Value {
            option: "--net",
            reason:
                "device=qemu has no packet stages (--net-pcap, --foxyvegas need vmsight's device)"
                    .into(),
        });
    }
    if settings.foxyvegas_log.is_some() && settings.foxyvegas.is_none() {
        return Err(RunArgsError::Needs {
            option: "--foxyvegas-log",
            needs: "--foxyvegas",
        });
    }
    Ok(settings)
}

fn trace_config(a: &RunArgs) -> Result<Option<TraceConfig>, RunArgsError> {
    if a.trace.is_none() && a.trace_json.is_none() && a.trace_out.is_none() {
        if a.trace_filter.is_some() {
            return Err(RunArgsError::Needs {
                option: "--trace-filter",
                needs: "--trace, --trace-out or --trace-json",
            });
        }
        return Ok(None);
    }
    let target: TraceTarget = a.trace.as_deref().unwrap_or("@cmd").parse().map_err(
        |e: vmsight_launcher::trace::TraceTargetError| RunArgsError::Value {
            option: "--trace",
            reason: e.to_string(),
        },
    )?;
    let filter = match &a.trace_filter {
        Some(f) => NameFilter::parse(f).map_err(|e| RunArgsError::Value {
            option: "--trace-filter",
            reason: e.to_string(),
        })?,
        None => NameFilter::all(),
    };
    Ok(Some(TraceConfig {
        target,
        // With only --trace-json, keep stderr for the command's own output.
        text: a.trace.is_some() || a.trace_out.is_some(),
        out: a.trace_out.clone(),
        json: a.trace_json.clone(),
        filter,
    }))
}

fn idle_settings(
    a: &RunArgs,
) -> Result<Option<vmsight_launcher::config::IdleSettings>, RunArgsError> {
    let on = a.idle
        || !a.background.is_empty()
        || a.idle_interval.is_some()
        || a.idle_max_hold.is_some()
        || a.idle_log.is_some();
    if !on {
        return Ok(None);
    }
    let background = a
        .background
        .iter()
        .map(|t| t.parse::<TraceTarget>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RunArgsError::Value {
            option: "--background",
            reason: e.to_string(),
        })?;
    let defaults = vmsight_blockdev::stages::idle::IdleConfig::default();
    let scheduler = vmsight_blockdev::stages::idle::IdleConfig {
        interval: a
            .idle_interval
            .map_or(defaults.interval, std::time::Duration::from_millis),
        max_hold: a.idle_max_hold.map(std::time::Duration::from_millis),
        ..defaults
    };
    scheduler.validate().map_err(|e| RunArgsError::Value {
        option: "--idle-max-hold",
        reason: e.to_string(),
    })?;
    Ok(Some(vmsight_launcher::config::IdleSettings {
        scheduler,
        background,
        log: a.idle_log.clone(),
    }))
}

fn insight_settings(
    a: &RunArgs,
) -> Result<Option<vmsight_launcher::config::InsightSettings>, RunArgsError> {
    let Some(file) = &a.insights else {
        if a.insight_paths.is_some() {
            return Err(RunArgsError::Needs {
                option: "--insight-paths",
                needs: "--insights FILE",
            });
        }
        return Ok(None);
    };
    let value = |option: &'static str| move |reason: String| RunArgsError::Value { option, reason };
    Ok(Some(vmsight_launcher::config::InsightSettings {
        file: file.clone(),
        target: a.insight_target.parse().map_err(
            |e: vmsight_launcher::trace::TraceTargetError| value("--insight-target")(e.to_string()),
        )?,
        paths: match &a.insight_paths {
            Some(l) => vmsight_insight::InsightConfig::parse_paths(l)
                .map_err(|e| value("--insight-paths")(e.to_string()))?,
            None => Vec::new(),
        },
    }))
}

/// `--stage` requests, plus the legacy cache and disk-model options as the same requests.
fn stage_requests(a: &RunArgs) -> Result<Vec<StageRequest>, RunArgsError> {
    let mut v = a.stages.clone();
    if a.cache_size > 0 {
        v.push(StageRequest {
            name: "icache".into(),
            options: format!(
                "size={},policy={},mode={}",
                a.cache_size, a.cache_policy, a.cache_mode
            ),
        });
    }
    if a.disk_model != "none" {
        v.push(StageRequest {
            name: "disk-model".into(),
            options: a.disk_model.clone(),
        });
    }
    Ok(v)
}

fn cmd_run(a: RunArgs) -> Result<i32, CliError> {
    let stats_json = a.stats_json.clone();
    let stats = a.stats;
    let cfg = VmConfig::try_from(a)?;
    if cfg.command.is_none() && !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        return Err("no command given and stdin is not a terminal: use `vmsight run -- CMD ...`, or run it from a terminal for a console".into());
    }
    let arts = Artifacts {
        plugin: vmsight_launcher::vm::find_plugin(),
    };
    let outcome = vmsight_launcher::run(&cfg, &arts)?;
    if stats {
        eprint!("{}", outcome.stats);
    }
    if let (Some(t), true) = (&outcome.stats.trace, stats) {
        eprintln!(
            "  trace: {} entries, {} returns, {} completed, {} restarted, {} signal deliveries, {} unmatched returns",
            t.entries,
            t.returns,
            t.tracker.completed,
            t.tracker.restarted,
            t.tracker.signal_deliveries,
            t.tracker.unmatched_returns
        );
    }
    if let Some(p) = &stats_json {
        let json = serde_json::to_string_pretty(&outcome.stats).map_err(|e| e.to_string())?;
        std::fs::write(p, json).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    if let Some(msg) = outcome.reason.error_message() {
        eprintln!("vmsight: {msg}");
    }
    if let EndReason::CommandExited(c) = outcome.reason {
        tracing::info!("guest command exited with {c}");
    }
    Ok(outcome.reason.exit_code())
}

fn cmd_stages() -> Result<i32, CliError> {
    let mut text = String::from("pos  stage        how              options\n");
    for e in vmsight_launcher::stages::ordered() {
        let how = if e.requested {
            "--stage"
        } else {
            "by its feature"
        };
        let opts = if e.options.is_empty() { "-" } else { e.options };
        text.push_str(&format!(
            "{:<4} {:<12} {:<16} {}\n     {}\n",
            e.position, e.name, how, opts, e.summary
        ));
    }
    print_stdout(&text)?;
    Ok(0)
}

fn cmd_image(action: ImageCmd) -> Result<i32, CliError> {
    match action {
        ImageCmd::Build { force } => {
            let img = vmsight_image::build(force, |msg| eprintln!("vmsight image: {msg}"))
                .map_err(|e| e.to_string())?;
            println!("{}", vmsight_image::info(&img));
        }
        ImageCmd::Info { json } => {
            let img = vmsight_image::default_image().map_err(|e| e.to_string())?;
            let info = vmsight_image::info(&img);
            let text = if json {
                serde_json::to_string_pretty(&info).map_err(|e| e.to_string())?
            } else {
                info.to_string()
            };
            print_stdout(&text)?;
        }
    }
    Ok(0)
}

fn cmd_ps(json: bool) -> Result<i32, CliError> {
    let vms = runtime::list_running(&runtime::runtime_base());
    if json {
        print_stdout(&serde_json::to_string_pretty(&vms).map_err(|e| e.to_string())?)?;
        return Ok(0);
    }
    let mut text = format!(
        "{:<20} {:>8} {:>8} {:<5} {:<16} {:>3} DISKS",
        "NAME", "PID", "QEMU", "ACCEL", "QEMU-VERSION", "API"
    );
    for v in vms {
        let disks: Vec<String> = v.disks.iter().map(|d| d.display().to_string()).collect();
        // Records of older vmsight versions have no QEMU fields.
        let version = v
            .qemu
            .as_ref()
            .map(|q| format!("{} ({})", q.version, q.kind))
            .unwrap_or_else(|| "-".into());
        text.push_str(&format!(
            "\n{:<20} {:>8} {:>8} {:<5} {:<16} {:>3} {}",
            v.name,
            v.pid,
            v.qemu_pid.map(|p| p.to_string()).unwrap_or_default(),
            v.accel,
            version,
            v.plugin_api
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            disks.join(",")
        ));
    }
    print_stdout(&text)?;
    Ok(0)
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// The insight log (JSON lines), or `-` for stdin.
    file: PathBuf,
    /// Also write the block-lifetime CDF plot as SVG to OUT.
    #[arg(long, value_name = "OUT")]
    svg: Option<PathBuf>,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// File-system type of a disk, for the per-file-system table: DISK=TYPE (repeatable),
    /// e.g. `--fs 0=ext4 --fs 1=xfs`.
    #[arg(long = "fs", value_name = "DISK=TYPE")]
    fs: Vec<String>,
}

fn cmd_report(a: ReportArgs) -> Result<i32, CliError> {
    let mut fs_types = std::collections::BTreeMap::new();
    for spec in &a.fs {
        let (disk, ty) = vmsight_report::parse_fs_spec(spec).map_err(|e| e.to_string())?;
        fs_types.insert(disk, ty);
    }
    let report = vmsight_report::build_from_path(&a.file, &fs_types).map_err(|e| e.to_string())?;
    if let Some(out) = &a.svg {
        std::fs::write(out, report.svg())
            .map_err(|e| format!("Cannot write the SVG plot {}: {e}.", out.display()))?;
    }
    if a.json {
        print_stdout(&report.json())?;
    } else {
        print_stdout(report.text().trim_end_matches('\n'))?;
    }
    Ok(0)
}

#[derive(Debug, Args)]
struct WatchArgs {
    /// Channel patterns `host:vm:/path/glob` (`*` within a path component, `**` across,
    /// `?` one character; `/etc/*` means `*:*:/etc/*`); none means everything.
    #[arg(value_name = "PATTERN")]
    patterns: Vec<String>,
    /// Only this VM.
    #[arg(long, value_name = "NAME")]
    vm: Option<String>,
    /// Include written bytes (`data_b64` in --json output).
    #[arg(long)]
    data: bool,
    /// Print one JSON message per line instead of readable lines.
    #[arg(long)]
    json: bool,
    /// Stop after N messages.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

fn cmd_watch(a: WatchArgs) -> Result<i32, CliError> {
    let patterns = a
        .patterns
        .iter()
        .map(|p| vmsight_events::Pattern::parse(p).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let opts = vmsight_events::WatchOptions {
        vm: a.vm,
        data: a.data,
        json: a.json,
        limit: a.count,
        ..Default::default()
    };
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, std::sync::Arc::clone(&opts.stop))
            .map_err(|e| format!("cannot install a signal handler: {e}"))?;
    }
    let stdout = std::io::stdout();
    match vmsight_events::watch(&patterns, &opts, &mut stdout.lock()) {
        Ok(_) => Ok(0),
        // The reader went away (`vmsight watch | head`): not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(format!("watch: {e}").into()),
    }
}

#[derive(Debug, Args)]
struct MountArgs {
    /// Mount point (an existing empty directory).
    dir: PathBuf,
    /// Show only this VM.
    #[arg(long, value_name = "NAME")]
    vm: Option<String>,
    /// Name of the host directory (default: this host's name, as in event channels).
    #[arg(long, value_name = "NAME")]
    host: Option<String>,
    /// Let other users use the mount (guest permissions still apply).
    #[arg(long)]
    allow_other: bool,
}

fn cmd_mount(a: MountArgs) -> Result<i32, CliError> {
    if !a.dir.is_dir() {
        return Err(format!("mount point {} is not a directory", a.dir.display()).into());
    }
    let mut opts = vmsight_view::MountOptions {
        vm: a.vm,
        allow_other: a.allow_other,
        ..Default::default()
    };
    if let Some(h) = a.host {
        if h.is_empty() || h.contains('/') {
            return Err(format!("--host {h:?}: a host name cannot be empty or contain '/'").into());
        }
        opts.host = h;
    }
    vmsight_view::mount(&a.dir, opts).map_err(|e| e.to_string())?;
    Ok(0)
}

#[derive(Debug, Args)]
struct StreamArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    /// Only print the streaming status (per disk: tap and inference counters).
    #[arg(long)]
    status: bool,
}

/// The control socket of running VM `name`.
pub(crate) fn control_socket(name: &str) -> Result<PathBuf, CliError> {
    vmsight_launcher::config::validate_name(name)?;
    let sock = vmsight_proto::layout::RuntimeLayout::from_env()
        .vm(name)
        .control_socket();
    if !sock.exists() {
        return Err(CliError::NoSuchVm(name.to_owned()));
    }
    Ok(sock)
}

#[derive(Debug, Args)]
struct StatsArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    /// Print the raw JSON status.
    #[arg(long)]
    json: bool,
    /// Repeat every SECS seconds until the VM ends.
    #[arg(long, value_name = "SECS")]
    watch: Option<f64>,
}

fn cmd_stats(a: StatsArgs) -> Result<i32, CliError> {
    let sock = control_socket(&a.name)?;
    loop {
        let reply = match vmsight_launcher::control::request(&sock, ControlRequest::Status) {
            Ok(r) => r,
            // The VM ended while we were watching it.
            Err(_) if a.watch.is_some() && !sock.exists() => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        let status = match &reply {
            ControlReply::Status(s) | ControlReply::StreamStarted { status: s, .. } => s,
            ControlReply::Refused(why) => return Err(CliError::Other(why.clone())),
            other => {
                return Err(CliError::Other(format!(
                    "the VM answered a status request with {other:?}"
                )))
            }
        };
        if a.json {
            print_stdout(&reply.to_line())?;
        } else {
            print_stdout(format_stats(status).trim_end_matches('\n'))?;
        }
        match a.watch {
            Some(secs) if secs > 0.0 => {
                std::thread::sleep(std::time::Duration::from_secs_f64(secs))
            }
            _ => return Ok(0),
        }
    }
}

/// Readable lines of a control `status` reply.
fn format_stats(v: &VmStatus) -> String {
    let mut out = String::new();
    let tally = |m: &serde_json::Value| -> String {
        m.as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, t)| format!("c{k}:{}", t["requests"]))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    };
    if let Some(ins) = v.insights.as_ref().filter(|i| !i.is_null()) {
        out.push_str(&format!(
            "insights: data chunks {} / unknown chunks {} / metadata chunks {} | writes by class {} | reads by class {}\n",
            ins["write_chunks_data"],
            ins["write_chunks_unknown"],
            ins["write_chunks_metadata"],
            tally(&ins["writes"]),
            tally(&ins["reads"])
        ));
    }
    for d in &v.disks {
        let mut line = format!("disk{}:", d.disk);
        if d.streaming {
            let events = d
                .inference
                .as_ref()
                .and_then(|i| i["events"].as_u64())
                .unwrap_or(0);
            line.push_str(&format!(" file events {events}"));
        }
        out.push_str(&line);
        out.push('\n');
        // One summary line per reporting stage (the stage registry's own words).
        for l in &d.stages {
            out.push_str(&format!("  {l}\n"));
        }
    }
    out
}

fn cmd_stream(a: StreamArgs) -> Result<i32, CliError> {
    let sock = control_socket(&a.name)?;
    let req = if a.status {
        ControlRequest::Status
    } else {
        ControlRequest::StreamStart
    };
    let (status, attached) = match vmsight_launcher::control::request(&sock, req)? {
        ControlReply::Status(s) => (s, None),
        ControlReply::StreamStarted { status, attached } => (status, Some(attached)),
        ControlReply::Refused(why) => return Err(CliError::Other(why)),
        other => {
            return Err(CliError::Other(format!(
                "the VM answered a stream request with {other:?}"
            )))
        }
    };
    for d in &status.disks {
        println!(
            "disk{}: {}; tap {} events, inference {} events",
            d.disk,
            if d.streaming {
                "streaming"
            } else {
                "not streaming"
            },
            d.tap["events"],
            d.inference
                .as_ref()
                .and_then(|i| i["events"].as_u64())
                .unwrap_or(0)
        );
    }
    if attached.is_some_and(|v| v.is_empty()) {
        println!("already streaming; nothing to attach");
    }
    Ok(0)
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// The disk image as it was when the recording started (it is not modified).
    base: PathBuf,
    /// The recording (`vmsight run --record-writes N:FILE`).
    recording: PathBuf,
    /// Guest mount point of the disk: prefix of the event paths.
    #[arg(long, value_name = "PATH", default_value = "")]
    mount: String,
    /// Include written bytes (`data_b64`).
    #[arg(long)]
    data: bool,
}

fn cmd_replay(a: ReplayArgs) -> Result<i32, CliError> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let s = vmsight_launcher::stream::replay(
        &a.base,
        &a.recording,
        a.mount.trim_end_matches('/'),
        a.data,
        &mut out,
    )
    .map_err(|e| e.to_string())?;
    eprintln!(
        "replayed {} writes: {} file events",
        s.tap_events, s.file_events
    );
    Ok(0)
}

/// Prints `text` and a newline; a reader that went away (`vmsight ... | head`) is not an error
/// (println! would panic on the broken pipe).
pub(crate) fn print_stdout(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(CliError::Stdout(e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn a_clap_error_listing_missing_arguments_names_them_on_its_one_line() {
        let text = "error: the following required arguments were not provided:\n  --stream-lazy\n  --x\n\nUsage: vmsight run --stream-lazy\n";
        assert_eq!(
            one_line(text),
            "the following required arguments were not provided: --stream-lazy, --x"
        );
        assert_eq!(
            one_line("error: invalid value 'x'\n\nmore"),
            "invalid value 'x'"
        );
        assert_eq!(one_line(""), "invalid arguments");
    }
}
