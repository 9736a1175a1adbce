//! Phase 4, spawn QEMU: the command line from the plan, QEMU in its own process group tied to
//! vmsight's life, its stderr collected, the trace session (it reads guest RAM through QEMU's
//! memfd, so it starts after QEMU), the VM record for `vmsight ps`, and QMP.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vmsight_introspect::memory::{KeptRam, QemuRam};

/// How long a starting QEMU may take to create its RAM's memfd (`QemuRam::preopen`).
const RAM_WAIT: std::time::Duration = std::time::Duration::from_secs(20);
use vmsight_proto::layout;

use crate::config::VmConfig;
use crate::devices::Device;
use crate::error::LaunchError;
use crate::qemu::{self, QemuPlan};
use crate::qmp::{self, Qmp};
use crate::runtime::VmRecord;
use crate::supervisor::Event;
use crate::trace::TraceSession;

use super::prepare::Prepared;
use super::services::{Insight, Services};
use super::Artifacts;

/// The running QEMU and what watches it.
pub struct Qemu {
    pub pid: u32,
    /// QEMU's last stderr lines (also written to `qemu.log`).
    pub stderr: Arc<Mutex<Vec<String>>>,
    pub stderr_thread: Option<JoinHandle<()>>,
    pub trace: Option<TraceSession>,
    /// Guest RAM opened for the threads that read it (`QemuRam::preopen`), while tracing.
    pub ram: Option<vmsight_introspect::memory::KeptRam>,
    pub qmp: Option<Qmp>,
    /// Kills QEMU if vmsight dies once QEMU changed user (`crate::confine::ExitGuard`).
    pub exit_guard: Option<crate::confine::ExitGuard>,
}

/// Runs phase 4.
pub fn spawn(
    cfg: &VmConfig,
    arts: &Artifacts,
    prep: &Prepared,
    devices: &[Box<dyn Device>],
    svc: &Services,
    insight: Option<&Insight>,
) -> Result<Qemu, LaunchError> {
    let args = qemu::build_args(&plan(cfg, arts, prep, devices, svc)?);
    // The whole command: environment, loader and firmware directories (trixie) included.
    let line = prep.qemu.exec.shell_line(&args);
    tracing::debug!("{line}");
    crate::runtime::write_private(&prep.rt.join(layout::QEMU_CMDLINE), format!("{line}\n"))?;
    let mut child = start_process(prep, &args)?;
    let pid = child.id();
    // Before the wait thread can reap QEMU: its pid is still its own.
    let exit_guard = match &prep.identity {
        Some(_) => Some(crate::confine::ExitGuard::start(pid).map_err(LaunchError::Spawn)?),
        None => None,
    };
    let ram = QemuRam {
        pid,
        ram_size: Some(cfg.mem_mib << 20),
    };
    let (trace, kept_ram) = match start_trace(prep, svc, insight, ram) {
        Some((t, k)) => (Some(t), k),
        None => (None, None),
    };
    let (stderr, stderr_thread) = match child.stderr.take() {
        Some(e) => {
            let (l, h) = collect_stderr(
                e,
                crate::runtime::create_private(&prep.rt.join(layout::QEMU_LOG)).ok(),
            );
            (l, Some(h))
        }
        None => (Arc::default(), None),
    };
    let tx = svc.tx.clone();
    std::thread::Builder::new()
        .name("vmsight-qemu-wait".into())
        .spawn(move || {
            let st = child.wait();
            let _ = tx.send(Event::QemuExited(st));
        })?;
    prep.rt.write_record(&VmRecord {
        name: cfg.name.clone(),
        pid: std::process::id(),
        qemu_pid: Some(pid),
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        disks: prep.disks.iter().map(|d| d.path.clone()).collect(),
        accel: prep.accel.to_string(),
        qemu: Some(prep.qemu.info()),
        plugin_api: prep.use_plugin.then(|| prep.qemu.plugin_api()),
    })?;
    let qmp = connect_qmp(prep, svc)?;
    Ok(Qemu {
        pid,
        stderr,
        stderr_thread,
        trace,
        ram: kept_ram,
        qmp,
        exit_guard,
    })
}

/// Everything QEMU's command line depends on.
fn plan(
    cfg: &VmConfig,
    arts: &Artifacts,
    prep: &Prepared,
    devices: &[Box<dyn Device>],
    svc: &Services,
) -> Result<QemuPlan, LaunchError> {
    let rt = &prep.rt;
    let command_file = match &cfg.command {
        Some(argv) => {
            let p = rt.join(layout::COMMAND_SCRIPT);
            crate::runtime::write_private(&p, qemu::command_script(argv))?;
            Some(p)
        }
        None => None,
    };
    let plugin = svc.channel.as_ref().map(|(shm, _)| qemu::PluginPlan {
        library: arts.plugin.clone(),
        shm: shm.clone(),
        records: cfg.plugin_records || prep.trace.is_some(),
        profile: (prep.trace.is_some() || prep.idle_tags || crate::sym::sync::wanted(cfg, prep))
            .then(|| prep.guest.profile.clone())
            .flatten(),
        blk: svc
            .idle
            .as_ref()
            .and_then(|a| a.channel_path().map(Path::to_owned)),
        symsync: crate::sym::sync::wanted(cfg, prep),
        count: cfg.count_syscalls,
    });
    let tcg_threads = tcg_threads(
        cfg,
        prep,
        plugin.as_ref().is_some_and(qemu::PluginPlan::translates),
    )?;
    Ok(QemuPlan {
        name: cfg.name.clone(),
        accel: prep.accel,
        tcg_threads,
        vcpus: cfg.vcpus,
        mem_mib: cfg.mem_mib,
        hotplug_mib: cfg.swap.as_ref().map_or(0, |s| s.grow >> 20),
        kernel: prep.guest.kernel.clone(),
        initrd: prep.guest.initrd.clone(),
        cmdline: qemu::kernel_cmdline(
            &cfg.name,
            &devices
                .iter()
                .flat_map(|d| d.kernel_args())
                .chain(cfg.append.iter().cloned())
                .collect::<Vec<_>>(),
        ),
        qmp_socket: rt.join(layout::QMP_SOCKET),
        console_socket: rt.join(layout::CONSOLE_SOCKET),
        ctl_socket: rt.join(layout::CTL_SOCKET),
        stdout_socket: rt.join(layout::STDOUT_SOCKET),
        stderr_socket: rt.join(layout::STDERR_SOCKET),
        stdin_socket: rt.join(layout::STDIN_SOCKET),
        command_file,
        devices: devices.iter().map(|d| d.qemu_args()).collect(),
        plugin,
        hold: prep.hold,
        confine: qemu::QemuConfine {
            sandbox: cfg.qemu_sandbox,
            run_with: prep
                .identity
                .as_ref()
                .map(|id| crate::confine::run_with_arg(id, &rt.join(layout::QEMU_JAIL))),
        },
    })
}

/// Starts QEMU in its own process group; it dies with vmsight, even on SIGKILL.
fn start_process(prep: &Prepared, args: &[String]) -> Result<std::process::Child, LaunchError> {
    let mut cmd = prep.qemu.exec.command();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    crate::child::tie_to_vmsight(&mut cmd);
    // QEMU creates sockets of its own in the runtime directory (QMP): its owner's only,
    // whatever umask vmsight was started with.
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls umask, which is
    // async-signal-safe and cannot fail.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o077);
            Ok(())
        });
    }
    cmd.spawn().map_err(LaunchError::Spawn)
}

/// The trace session (process tracking reads guest RAM through QEMU's memfd; records the
/// plugin pushed in the meantime wait in the ring).
fn start_trace(
    prep: &Prepared,
    svc: &Services,
    insight: Option<&Insight>,
    ram: QemuRam,
) -> Option<(TraceSession, Option<KeptRam>)> {
    let (t, (_, host), profile) = (
        prep.trace.as_ref()?,
        svc.channel.as_ref()?,
        prep.guest.profile.as_ref()?,
    );
    // The threads that read guest memory (the channel's reader, the disks' workers) give up
    // the right to open QEMU's files (docs/security.md): open its RAM for them now.
    let kept = ram
        .preopen(RAM_WAIT)
        .map_err(|e| tracing::warn!("guest memory is opened at the first lookup instead: {e}"))
        .ok();
    if let Some((engine, _)) = insight {
        // Before the first record: a process's first event already asks for its cwd.
        engine.set_lookup(Some(insight_lookup(ram, profile, svc.sym.as_ref())));
        // Block writes no checksum matched: what the guest kernel says owns their pages.
        engine.set_page_owners(std::sync::Arc::new(crate::lookup::ProfilePages::new(
            ram,
            profile.to_path_buf(),
        )));
    }
    let extra: Vec<Box<dyn vmsight_introspect::syscall::SyscallObserver>> = insight
        .iter()
        .map(|(e, _)| Box::new(e.clone()) as Box<dyn vmsight_introspect::syscall::SyscallObserver>)
        .collect();
    match crate::trace_records::start_session(host.clone(), t, ram, profile, extra) {
        Ok(s) => Some((s, kept)),
        Err(e) => {
            // QEMU is already running; report and carry on rather than orphan it.
            eprintln!("vmsight: tracing is off: cannot open the trace output: {e}");
            None
        }
    }
}

/// The source the insight engine asks for what it did not see (a process's working
/// directory, inherited fds; docs/insights.md, "Lookups"): guest kernel memory read with the
/// kernel profile, or with `--symbiotic` the guest module's `task_info`/`fd_path` symcalls,
/// falling back to the profile reader.
fn insight_lookup(
    ram: QemuRam,
    profile: &Path,
    sym: Option<&std::sync::Arc<crate::sym::Symbiotic>>,
) -> Box<dyn vmsight_insight::Lookup> {
    let profile = Box::new(crate::lookup::ProfileLookup::new(
        ram,
        profile.to_path_buf(),
    ));
    match sym {
        Some(s) => Box::new(crate::sym::lookup::SymLookup::new(s.clone(), profile)),
        None => profile,
    }
}

/// QMP, with its events forwarded to the supervisor.
fn connect_qmp(prep: &Prepared, svc: &Services) -> Result<Option<Qmp>, LaunchError> {
    let (qtx, qrx) = qmp::event_channel();
    let tx = svc.tx.clone();
    std::thread::Builder::new()
        .name("vmsight-qmp-events".into())
        .spawn(move || {
            for ev in qrx {
                if tx.send(Event::Qmp(ev)).is_err() {
                    break;
                }
            }
        })?;
    match Qmp::connect(
        &prep.rt.join(layout::QMP_SOCKET),
        Duration::from_secs(20),
        qtx,
    ) {
        Ok(q) => Ok(Some(q)),
        Err(e) => {
            tracing::warn!("QMP unavailable: {e}");
            Ok(None)
        }
    }
}

/// QEMU's stderr, kept for error reports and written to `qemu.log`.
fn collect_stderr(
    stderr: std::process::ChildStderr,
    log: Option<std::fs::File>,
) -> (Arc<Mutex<Vec<String>>>, JoinHandle<()>) {
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let l2 = lines.clone();
    let h = std::thread::spawn(move || {
        let mut log = log;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(f) = log.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            if let Ok(mut v) = l2.lock() {
                v.push(line);
                if v.len() > 200 {
                    v.remove(0);
                }
            }
        }
    });
    (lines, h)
}

/// The TCG thread mode for this VM's QEMU (`--tcg-threads`, `auto` resolved by its version and
/// by whether the plugin instruments translated code), said in the log when `auto` chose
/// single-threaded TCG. An explicit `single` with an instrumenting plugin is refused: the
/// plugin keeps its per-vCPU state on the vCPU threads, and traces would miss calls.
fn tcg_threads(
    cfg: &VmConfig,
    prep: &Prepared,
    plugin_translates: bool,
) -> Result<qemu::TcgThreads, LaunchError> {
    if cfg.tcg_threads == qemu::TcgThreads::Single && plugin_translates {
        return Err(LaunchError::TcgSingleWithPlugin);
    }
    let mode = cfg
        .tcg_threads
        .resolve(prep.qemu.version, plugin_translates);
    if cfg.tcg_threads == qemu::TcgThreads::Auto && mode == qemu::TcgThreads::Single {
        tracing::info!(
            "QEMU {} has QEMU 10's TCG section race: its vCPUs run single-threaded \
             (--tcg-threads multi to override; docs/launcher.md)",
            prep.qemu.version_string()
        );
    }
    Ok(mode)
}
