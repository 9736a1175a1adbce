//! Command-line parsing and dispatch. Each subcommand is a thin layer over a library crate.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use vmsight_introspect::syscall::NameFilter;
use vmsight_launcher::accel::AccelRequest;
use vmsight_launcher::config::{generate_name, parse_mem_mib, DiskSpec, VmConfig};
use vmsight_launcher::trace::{TraceConfig, TraceTarget};
use vmsight_launcher::{runtime, Artifacts, EndReason};

/// vmsight: VMM-level introspection of unmodified guests on QEMU 10.
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
    /// Extra disk, served by vmsight's vhost-user-blk backend: PATH[,ro][,direct][,serial=ID][,queues=N]; `direct` bypasses the host page cache like QEMU cache=none.
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
    /// Do not load the vmsight TCG plugin.
    #[arg(long)]
    no_plugin: bool,
    /// Have the plugin push one record per syscall into the shared-memory ring.
    #[arg(long)]
    plugin_records: bool,
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
    /// Command to run in the guest as root; its stdout/stderr/exit status become vmsight's.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
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
                    let text = e.to_string();
                    let first = text
                        .lines()
                        .find(|l| !l.trim().is_empty())
                        .unwrap_or("invalid arguments")
                        .trim_start_matches("error: ");
                    eprintln!("vmsight: {first} (see `vmsight --help`)");
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
    };
    match res {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("vmsight: {msg}");
            1
        }
    }
}

fn cmd_run(a: RunArgs) -> Result<i32, String> {
    let name = a.name.clone().unwrap_or_else(generate_name);
    // The default image supplies whatever was not given explicitly.
    let need_image = a.kernel.is_none() || a.initrd.is_none() || a.root.is_none();
    let image = if need_image {
        Some(vmsight_image::default_image().map_err(|e| e.to_string())?)
    } else {
        None
    };
    let pick = |given: &Option<PathBuf>, f: fn(&vmsight_image::GuestImage) -> PathBuf| {
        given
            .clone()
            .or_else(|| image.as_ref().map(f))
            .unwrap_or_default()
    };
    let kernel = pick(&a.kernel, |i| i.kernel.clone());
    let initrd = pick(&a.initrd, |i| i.initrd.clone());
    let root_image = match (&a.root, a.persist) {
        (Some(r), _) => r.clone(),
        // --persist with the default image: a per-name persistent copy, made on first use.
        (None, true) => {
            let img = image.as_ref().ok_or("no default image")?;
            let p = vmsight_image::cache_dir()
                .map_err(|e| e.to_string())?
                .join("persist")
                .join(format!("{name}.img"));
            if !p.exists() {
                std::fs::create_dir_all(p.parent().unwrap_or(&p))
                    .map_err(|e| format!("cannot create {}: {e}", p.display()))?;
                runtime::sparse_copy(&img.rootfs, &p).map_err(|e| {
                    format!(
                        "cannot create the persistent root disk {}: {e}",
                        p.display()
                    )
                })?;
            }
            p
        }
        (None, false) => pick(&None, |i| i.rootfs.clone()),
    };
    let trace = if a.trace.is_some() || a.trace_json.is_some() || a.trace_out.is_some() {
        let target: TraceTarget = a.trace.as_deref().unwrap_or("@cmd").parse()?;
        let filter = match &a.trace_filter {
            Some(f) => NameFilter::parse(f)?,
            None => NameFilter::all(),
        };
        Some(TraceConfig {
            target,
            // With only --trace-json, keep stderr for the command's own output.
            text: a.trace.is_some() || a.trace_out.is_some(),
            out: a.trace_out.clone(),
            json: a.trace_json.clone(),
            filter,
        })
    } else {
        if a.trace_filter.is_some() {
            return Err("--trace-filter needs --trace, --trace-out or --trace-json".into());
        }
        None
    };
    let profile = image.as_ref().map(|i| i.profile.clone());
    let cfg = VmConfig {
        name,
        vcpus: a.vcpus,
        mem_mib: a.mem,
        kernel,
        initrd,
        root_image,
        persist: a.persist,
        append: a.append,
        disks: a.disks,
        command: if a.command.is_empty() {
            None
        } else {
            Some(a.command)
        },
        accel: match a.accel {
            AccelArg::Auto => AccelRequest::Auto,
            AccelArg::Tcg => AccelRequest::Tcg,
            AccelArg::Kvm => AccelRequest::Kvm,
        },
        plugin: !a.no_plugin,
        plugin_records: a.plugin_records,
        stats: a.stats,
        show_console: a.console,
        console_log: a.console_log,
        trace,
        profile,
        stream: vmsight_launcher::stream::StreamConfig {
            enabled: !a.no_stream,
            record: a.record_writes,
            queue_bytes: a.stream_queue_mb << 20,
        },
    };
    if cfg.command.is_none() && !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        return Err("no command given and stdin is not a terminal: use `vmsight run -- CMD ...`, or run it from a terminal for a console".into());
    }
    let arts = Artifacts {
        plugin: vmsight_launcher::vm::find_plugin(),
    };
    let outcome = vmsight_launcher::run(&cfg, &arts).map_err(|e| e.to_string())?;
    if a.stats {
        eprint!("{}", outcome.stats);
    }
    if let (Some(t), true) = (&outcome.stats.trace, a.stats) {
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
    if let Some(p) = &a.stats_json {
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

fn cmd_image(action: ImageCmd) -> Result<i32, String> {
    match action {
        ImageCmd::Build { force } => {
            let img = vmsight_image::build(force, |msg| eprintln!("vmsight image: {msg}"))
                .map_err(|e| e.to_string())?;
            println!("{}", vmsight_image::info(&img));
        }
        ImageCmd::Info { json } => {
            let img = vmsight_image::default_image().map_err(|e| e.to_string())?;
            let info = vmsight_image::info(&img);
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&info).map_err(|e| e.to_string())?
                );
            } else {
                println!("{info}");
            }
        }
    }
    Ok(0)
}

fn cmd_ps(json: bool) -> Result<i32, String> {
    let vms = runtime::list_running(&runtime::runtime_base());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&vms).map_err(|e| e.to_string())?
        );
        return Ok(0);
    }
    println!(
        "{:<20} {:>8} {:>8} {:<5} DISKS",
        "NAME", "PID", "QEMU", "ACCEL"
    );
    for v in vms {
        let disks: Vec<String> = v.disks.iter().map(|d| d.display().to_string()).collect();
        println!(
            "{:<20} {:>8} {:>8} {:<5} {}",
            v.name,
            v.pid,
            v.qemu_pid.map(|p| p.to_string()).unwrap_or_default(),
            v.accel,
            disks.join(",")
        );
    }
    Ok(0)
}
