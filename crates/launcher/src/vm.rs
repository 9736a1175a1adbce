//! One VM's whole life: prepare, start backends and QEMU, supervise, shut down, clean up.
//!
//! Ordering matters and is the point of this module:
//! 1. everything QEMU will connect to (disk backends, channel sockets) is listening first;
//! 2. QEMU starts in its own process group and dies with vmsight (PR_SET_PDEATHSIG);
//! 3. one event loop decides how the run ended (command exit, poweroff, panic, QEMU failure,
//!    backend failure, signal);
//! 4. QEMU is gone before the backends are joined, and the runtime directory and working copies
//!    are removed by their guards whatever happened.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vmsight_blockdev::stages::{
    CacheMetrics, DiskModel, DiskModelConfig, DiskModelMetrics, ICache,
};
use vmsight_blockdev::tap::WriteTap;
use vmsight_blockdev::{spawn_backend_with, BackendHandle, DiskConfig, Stage};

use crate::accel::{self, Accel, AccelChoice};
use crate::config::VmConfig;
use crate::error::LaunchError;
use crate::guestio::{self, ConsoleTail};
use crate::qemu::{self, PlannedDisk, QemuPlan};
use crate::qmp::{self, Qmp};
use crate::runtime::{self, RuntimeDir, VmRecord, WorkingCopy};
use crate::stats::{DiskStats, RunStats};
use crate::supervisor::{Effect, Flow, LateFacts, Supervisor};

/// Counters of the optional stages of one disk, read at the end of the run.
#[derive(Default)]
struct StageMetrics {
    cache: Option<Arc<CacheMetrics>>,
    model: Option<Arc<DiskModelMetrics>>,
}

/// Virtqueue size of every disk (QEMU's `queue-size`, the backend's `queue_size`).
const QUEUE_SIZE: u16 = 256;

pub use crate::supervisor::{EndReason, Event};

/// The result of a run.
#[derive(Debug)]
pub struct RunOutcome {
    pub reason: EndReason,
    pub stats: RunStats,
}

/// Paths of vmsight's own artefacts the launcher needs.
#[derive(Debug, Clone)]
pub struct Artifacts {
    pub plugin: PathBuf,
}

/// Finds `libvmsight_plugin.so`: `$VMSIGHT_PLUGIN`, else next to the running executable.
pub fn find_plugin() -> PathBuf {
    if let Some(p) = std::env::var_os("VMSIGHT_PLUGIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    dir.join("libvmsight_plugin.so")
}

fn check_readable(path: &std::path::Path) -> bool {
    std::fs::File::open(path).is_ok() && path.is_file()
}

/// QEMU's stderr, kept for error reports and written to `qemu.log`.
fn spawn_stderr_collector(
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

/// Runs a VM to completion.
pub fn run(cfg: &VmConfig, arts: &Artifacts) -> Result<RunOutcome, LaunchError> {
    let t0 = Instant::now();
    cfg.validate().map_err(LaunchError::Config)?;
    let AccelChoice {
        accel,
        reason: accel_reason,
    } = accel::choose(cfg.accel).map_err(LaunchError::Config)?;
    tracing::info!("accelerator: {accel} ({accel_reason})");
    let (qemu_bin, qemu_version) = qemu::find_qemu()?;
    if !check_readable(&cfg.kernel) {
        return Err(LaunchError::KernelMissing(cfg.kernel.clone()));
    }
    if !check_readable(&cfg.initrd) {
        return Err(LaunchError::InitrdMissing(cfg.initrd.clone()));
    }
    if !check_readable(&cfg.root_image) {
        return Err(LaunchError::DiskUnusable {
            path: cfg.root_image.clone(),
            reason: "the root image does not exist or is not readable".into(),
        });
    }
    for d in &cfg.disks {
        if let Err(e) = std::fs::OpenOptions::new()
            .read(true)
            .write(!d.read_only)
            .open(&d.path)
        {
            return Err(LaunchError::DiskUnusable {
                path: d.path.clone(),
                reason: e.to_string(),
            });
        }
    }
    let use_plugin = cfg.plugin && accel == Accel::Tcg;
    if use_plugin && !arts.plugin.is_file() {
        return Err(LaunchError::PluginMissing(arts.plugin.clone()));
    }
    // Insights need monitored processes: without --trace, monitor the insight target
    // silently (no text, no JSON).
    let trace_cfg: Option<crate::trace::TraceConfig> = cfg.trace.clone().or_else(|| {
        cfg.insights.as_ref().map(|s| crate::trace::TraceConfig {
            target: s.target.clone(),
            out: None,
            text: false,
            json: None,
            filter: vmsight_introspect::syscall::NameFilter::all(),
        })
    });
    let trace_profile = match &trace_cfg {
        None => None,
        Some(_) if !use_plugin => {
            return Err(LaunchError::Config(format!(
                "syscall tracing needs the TCG plugin, which is {}",
                if cfg.plugin {
                    "not available under KVM"
                } else {
                    "disabled by --no-plugin"
                }
            )))
        }
        Some(t) => {
            if t.target == crate::trace::TraceTarget::Command && cfg.command.is_none() {
                return Err(LaunchError::Config(
                    "--trace @cmd needs a command (`vmsight run --trace -- CMD ...`)".into(),
                ));
            }
            match &cfg.profile {
                Some(p) if p.is_file() => Some(p.clone()),
                Some(p) => {
                    return Err(LaunchError::Config(format!(
                        "the kernel profile {} does not exist",
                        p.display()
                    )))
                }
                None => return Err(LaunchError::Config(
                    "syscall tracing needs the guest kernel's profile (the default image has one)"
                        .into(),
                )),
            }
        }
    };
    let hold = trace_cfg
        .as_ref()
        .is_some_and(|t| t.target == crate::trace::TraceTarget::Command);

    let rt = RuntimeDir::create(&runtime::runtime_base(), &cfg.name)?;
    let root = if cfg.persist {
        WorkingCopy::in_place(&cfg.root_image)
    } else {
        let to = vmsight_image::cache_dir()?
            .join("vms")
            .join(&cfg.name)
            .join("root.img");
        WorkingCopy::create(&cfg.root_image, &to)?
    };

    // Disk backends listen before QEMU exists, so its connection cannot race them.
    // (image, read-only, serial, queues, O_DIRECT); the root disk is always disk0 = /dev/vda.
    let mut disk_paths = vec![(
        root.path.clone(),
        false,
        "vmsight-root".to_string(),
        2u16,
        false,
    )];
    for (i, d) in cfg.disks.iter().enumerate() {
        disk_paths.push((
            d.path.clone(),
            d.read_only,
            d.serial
                .clone()
                .unwrap_or_else(|| format!("vmsight-disk{}", i + 1)),
            d.num_queues.unwrap_or(1),
            d.direct,
        ));
    }
    let insight = match &cfg.insights {
        Some(s) => {
            let (log, writer) = vmsight_insight::InsightLog::create(&s.file).map_err(|e| {
                LaunchError::Config(format!(
                    "cannot create the insight log {}: {e}",
                    s.file.display()
                ))
            })?;
            let icfg = vmsight_insight::InsightConfig {
                paths: s.paths.clone(),
                ..Default::default()
            };
            Some((vmsight_insight::InsightEngine::new(icfg, log), writer))
        }
        None => None,
    };
    if let Some((n, _)) = cfg
        .stream
        .record
        .iter()
        .find(|(n, _)| *n >= disk_paths.len())
    {
        return Err(LaunchError::Config(format!(
            "--record-writes names disk {n}, but there are only {} disks (0 = root)",
            disk_paths.len()
        )));
    }
    // File-update streaming: one delivery per VM (bus socket for `vmsight watch`, Redis, file).
    let delivery = Arc::new(
        crate::stream::Delivery::open(
            cfg.stream.host.clone(),
            &cfg.name,
            Some(&rt.join(vmsight_events::EVENTS_SOCKET)),
            cfg.stream.redis.as_deref(),
            cfg.stream.events_file.as_deref(),
            cfg.stream.data,
        )
        .map_err(LaunchError::Config)?,
    );
    let mut backends: Vec<(PathBuf, BackendHandle, StageMetrics)> = Vec::new();
    let mut cache_metrics: Vec<(usize, Arc<CacheMetrics>)> = Vec::new();
    let mut streams: Vec<crate::stream::DiskStream> = Vec::new();
    let mut planned = Vec::new();
    for (i, (path, ro, serial, queues, direct)) in disk_paths.iter().enumerate() {
        let sock = rt.join(&format!("disk{i}.sock"));
        let mut stages: Vec<Box<dyn Stage>> = Vec::new();
        let mut stage_metrics = StageMetrics::default();
        let extra = i > 0;
        if let Some((engine, _)) = &insight {
            // First stage: every later stage (the cache) sees the request's insight.
            stages.push(vmsight_insight::Classifier::stage(
                engine.clone(),
                i as u32,
                journal_ranges(path),
            ));
        }
        if extra {
            if let Some(c) = &cfg.storage.cache {
                let (stage, m) = ICache::stage(*c).map_err(|e| {
                    LaunchError::Config(format!("disk {i} ({}): {e}", path.display()))
                })?;
                stages.push(stage);
                cache_metrics.push((i, m.clone()));
                stage_metrics.cache = Some(m);
            }
        }
        if !*ro {
            // The tap sits last, next to the image: it sees exactly what the image receives.
            let ds = crate::stream::DiskStream::new(i, path, &cfg.stream);
            stages.push(Box::new(WriteTap::new(ds.queue())));
            streams.push(ds);
        }
        let model = extra && !matches!(cfg.storage.model, DiskModelConfig::None);
        if model {
            let capacity = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            let (stage, m) = DiskModel::stage(cfg.storage.model, capacity)
                .map_err(|e| LaunchError::Config(format!("disk {i} ({}): {e}", path.display())))?;
            stages.push(stage);
            stage_metrics.model = Some(m);
        }
        let handle = spawn_backend_with(
            DiskConfig {
                path: path.clone(),
                read_only: *ro,
                serial: serial.clone(),
                num_queues: *queues,
                queue_size: QUEUE_SIZE,
                // A modelled disk must not be hidden by the host page cache.
                direct_io: *direct || model,
                io_threads: vmsight_blockdev::file::DEFAULT_IO_THREADS,
            },
            &sock,
            stages,
        )
        .map_err(|source| LaunchError::Backend {
            index: i,
            path: path.clone(),
            source,
        })?;
        backends.push((path.clone(), handle, stage_metrics));
        planned.push(PlannedDisk {
            socket: sock,
            num_queues: *queues,
            queue_size: QUEUE_SIZE,
        });
    }

    for ds in streams.iter_mut() {
        if cfg.stream.enabled {
            // Crawl before the guest runs: from here on every write is diffed against it.
            match crate::stream::make_engine(&ds.image, cfg.stream.data) {
                Ok(engine) => {
                    if let Ok(mut slot) = ds.slot.write() {
                        slot.0 = Some(engine);
                    }
                }
                Err(e) => {
                    tracing::info!("no file-update streaming for disk {}: {e}", ds.index);
                    if ds.index > 0
                        && (cfg.stream.events_file.is_some() || cfg.stream.redis.is_some())
                    {
                        eprintln!(
                            "vmsight: disk {} ({}) is not streamed: {e}",
                            ds.index,
                            ds.image.display()
                        );
                    }
                }
            }
        }
        let prefix = if ds.index == 0 {
            String::new()
        } else {
            cfg.disks
                .get(ds.index - 1)
                .and_then(|d| d.mount.clone())
                .unwrap_or_else(|| format!("/@disk{}", ds.index))
        };
        let sink = crate::stream::EngineSink::new(
            ds.slot.clone(),
            delivery.clone(),
            ds.queue(),
            &ds.image.clone(),
            prefix,
            cfg.stream.data,
            ds.attach.clone(),
            ds.infer.clone(),
        );
        ds.start(&cfg.stream, vec![Box::new(sink)])
            .map_err(|e| LaunchError::Config(format!("disk {}: {e}", ds.index)))?;
    }
    // The live read-only view (`vmsight mount`) shows the root disk's file system.
    let _view = match streams.iter().find(|d| d.index == 0) {
        Some(d) => Some(
            vmsight_view::ViewServer::bind(rt.join(vmsight_view::VIEW_SOCKET), d.slot.clone())
                .map_err(|e| LaunchError::Config(format!("cannot start the view server: {e}")))?,
        ),
        None => None,
    };
    let control = ControlState {
        streams: streams
            .iter()
            .map(|d| StreamHandles {
                index: d.index,
                queue: d.queue(),
                attach: d.attach.clone(),
                slot: d.slot.clone(),
                infer: d.infer.clone(),
            })
            .collect(),
        caches: cache_metrics.clone(),
        insight: insight.as_ref().map(|(e, _)| e.clone()),
    };
    let _control = crate::control::ControlServer::bind(
        &rt.join("control.sock"),
        Arc::new(move |req: &serde_json::Value| control.request(req)),
    )
    .map_err(|e| LaunchError::Config(format!("cannot start the control socket: {e}")))?;

    let channel = if use_plugin {
        let shm = rt.join("plugin.shm");
        let mut host = vmsight_ring::Channel::create(&shm, cfg.vcpus, 1 << 14)
            .map_err(|e| LaunchError::Channel(e.to_string()))?;
        if let Some(t) = &trace_cfg {
            crate::trace_records::set_target(&mut host, &t.target, None)
                .map_err(LaunchError::Channel)?;
        }
        Some((shm, Arc::new(Mutex::new(host))))
    } else {
        None
    };

    let (tx, rx): (Sender<Event>, Receiver<Event>) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let tail = Arc::new(Mutex::new(ConsoleTail::default()));
    let console_writer: Arc<Mutex<Option<std::os::unix::net::UnixStream>>> = Arc::default();
    let interactive = cfg.command.is_none();

    let console_log = std::fs::File::create(rt.join("console.log")).ok();
    let user_log = match &cfg.console_log {
        Some(p) => Some(std::fs::File::create(p)?),
        None => None,
    };
    let log = user_log.or(console_log);
    let live: Option<Box<dyn Write + Send>> = if interactive {
        Some(Box::new(std::io::stdout()))
    } else if cfg.show_console {
        Some(Box::new(std::io::stderr()))
    } else {
        None
    };
    let mut pumps = Vec::new();
    pumps.push(guestio::spawn_console_reader(
        guestio::listen(&rt.join("console.sock"))?,
        stop.clone(),
        tail.clone(),
        log,
        live,
        console_writer.clone(),
        tx.clone(),
    )?);
    let ctl_writer: Arc<Mutex<Option<std::os::unix::net::UnixStream>>> = Arc::default();
    pumps.push(guestio::spawn_ctl_reader(
        guestio::listen(&rt.join("ctl.sock"))?,
        stop.clone(),
        tx.clone(),
        ctl_writer.clone(),
    )?);
    pumps.push(guestio::spawn_output_pump(
        "vmsight-stdout",
        guestio::listen(&rt.join("stdout.sock"))?,
        stop.clone(),
        Box::new(std::io::stdout()),
    )?);
    pumps.push(guestio::spawn_output_pump(
        "vmsight-stderr",
        guestio::listen(&rt.join("stderr.sock"))?,
        stop.clone(),
        Box::new(std::io::stderr()),
    )?);
    let feed_stdin = !interactive && !std::io::IsTerminal::is_terminal(&std::io::stdin());
    // Not joined: it may sit in a read of the host's stdin, which must not delay the exit.
    let (stdin_go, stdin_go_rx) = mpsc::channel();
    let _stdin = guestio::spawn_stdin_feeder(
        guestio::listen(&rt.join("stdin.sock"))?,
        stop.clone(),
        feed_stdin,
        stdin_go_rx,
    )?;

    let command_file = match &cfg.command {
        Some(argv) => {
            let p = rt.join("cmd.sh");
            std::fs::write(&p, qemu::command_script(argv))?;
            Some(p)
        }
        None => None,
    };
    let plan = QemuPlan {
        name: cfg.name.clone(),
        accel,
        vcpus: cfg.vcpus,
        mem_mib: cfg.mem_mib,
        kernel: cfg.kernel.clone(),
        initrd: cfg.initrd.clone(),
        cmdline: qemu::kernel_cmdline(&cfg.name, &cfg.append),
        qmp_socket: rt.join("qmp.sock"),
        console_socket: rt.join("console.sock"),
        ctl_socket: rt.join("ctl.sock"),
        stdout_socket: rt.join("stdout.sock"),
        stderr_socket: rt.join("stderr.sock"),
        stdin_socket: rt.join("stdin.sock"),
        command_file,
        disks: planned,
        plugin: channel.as_ref().map(|(shm, _)| qemu::PluginPlan {
            library: arts.plugin.clone(),
            shm: shm.clone(),
            records: cfg.plugin_records || trace_cfg.is_some(),
            profile: trace_profile.clone(),
        }),
        hold,
    };

    let args = qemu::build_args(&plan);
    tracing::debug!("{} {}", qemu_bin.display(), args.join(" "));
    std::fs::write(
        rt.join("qemu.cmdline"),
        format!("{} {}\n", qemu_bin.display(), args.join(" ")),
    )?;

    // Signals are routed into the event loop before QEMU exists, so none is missed.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])?;
    let sig_handle = signals.handle();
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for s in signals.forever() {
                if tx.send(Event::Signal(s)).is_err() {
                    break;
                }
            }
        });
    }

    let mut cmd = Command::new(&qemu_bin);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: the closure runs in the forked child before exec and only calls async-signal-safe
    // functions (setpgid, prctl, getppid, kill).
    unsafe {
        cmd.pre_exec(|| {
            // Own process group: a terminal's Ctrl-C reaches vmsight, which stops QEMU in order.
            libc::setpgid(0, 0);
            // If vmsight dies, even by SIGKILL, QEMU goes with it: no orphans.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() == 1 {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(LaunchError::Spawn)?;
    let qemu_pid = child.id();
    // After QEMU exists: process tracking reads guest RAM through QEMU's memfd. Records the
    // plugin pushed in the meantime wait in the ring.
    let trace = match (&trace_cfg, &channel, &trace_profile) {
        (Some(t), Some((_, host)), Some(profile)) => {
            let extra: Vec<Box<dyn vmsight_introspect::syscall::SyscallObserver>> = insight
                .iter()
                .map(|(e, _)| {
                    Box::new(e.clone()) as Box<dyn vmsight_introspect::syscall::SyscallObserver>
                })
                .collect();
            match crate::trace_records::start_session(host.clone(), t, qemu_pid, profile, extra) {
                Ok(s) => Some(s),
                Err(e) => {
                    // QEMU is already running; report and carry on rather than orphan it.
                    eprintln!("vmsight: tracing is off: cannot open the trace output: {e}");
                    None
                }
            }
        }
        _ => None,
    };
    let qemu_log = std::fs::File::create(rt.join("qemu.log")).ok();
    let (qemu_stderr, stderr_thread) = match child.stderr.take() {
        Some(e) => {
            let (l, h) = spawn_stderr_collector(e, qemu_log);
            (l, Some(h))
        }
        None => (Arc::default(), None),
    };
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let st = child.wait();
            let _ = tx.send(Event::QemuExited(st));
        });
    }
    rt.write_record(&VmRecord {
        name: cfg.name.clone(),
        pid: std::process::id(),
        qemu_pid: Some(qemu_pid),
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        disks: disk_paths.iter().map(|d| d.0.clone()).collect(),
        accel: accel.to_string(),
    })?;

    let (qtx, qrx) = qmp::event_channel();
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for ev in qrx {
                if tx.send(Event::Qmp(ev)).is_err() {
                    break;
                }
            }
        });
    }
    let qmp = match Qmp::connect(&rt.join("qmp.sock"), Duration::from_secs(20), qtx) {
        Ok(q) => Some(q),
        Err(e) => {
            tracing::warn!("QMP unavailable: {e}");
            None
        }
    };

    let raw_guard = if interactive {
        crate::term::RawMode::enter(console_writer.clone(), tx.clone())
    } else {
        None
    };

    // The supervising loop: the supervisor decides, this loop carries out its effects.
    let mut supervisor = Supervisor::new(t0);
    let ctx = LoopCtx {
        qmp: &qmp,
        qemu_pid,
        stdin_go: &stdin_go,
        ctl_writer: &ctl_writer,
        trace_cfg: trace_cfg.as_ref(),
        channel: channel.as_ref().map(|(_, h)| h),
    };
    let ending = loop {
        let ev = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(ev) => ev,
            Err(RecvTimeoutError::Timeout) => Event::Tick,
            Err(RecvTimeoutError::Disconnected) => {
                Event::QemuExited(Err(std::io::Error::other("the event channel closed")))
            }
        };
        let ev = match (&ev, backends.iter().find(|(_, b, _)| b.is_finished())) {
            (Event::Tick, Some((p, _, _))) => {
                Event::BackendStopped(format!("the backend of {} stopped", p.display()))
            }
            _ => ev,
        };
        match supervisor.on_event(ev, Instant::now()) {
            Flow::Continue(effects) => {
                for e in effects {
                    ctx.apply(e);
                }
            }
            Flow::End(ending) => break ending,
        }
    };
    drop(raw_guard);
    let run_time = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    sig_handle.close();

    // QEMU is gone: its sockets are closed, so the pumps reach EOF and finish.
    for p in pumps {
        let _ = p.join();
    }
    if let Some(h) = stderr_thread {
        let _ = h.join();
    }
    let mut disk_stats = Vec::new();
    let mut backend_error: Option<String> = None;
    for (i, (path, b, sm)) in backends.into_iter().enumerate() {
        let metrics = b.metrics();
        let res = b.wait();
        if let Err(e) = res {
            backend_error.get_or_insert_with(|| format!("{}: {e}", path.display()));
        }
        let mut ds = DiskStats::from_metrics(path, &metrics);
        ds.cache = sm.cache.map(|m| m.snapshot());
        ds.model = sm.model.map(|m| m.snapshot());
        // The backend is gone, so its tap pushes no more: drain and stop the consumer.
        if let Some(pos) = streams.iter().position(|s| s.index == i) {
            let (tap, infer) = streams.swap_remove(pos).finish();
            ds.tap = Some(tap);
            ds.stream = infer;
        }
        disk_stats.push(ds);
    }
    let trace_summary = trace.map(|t| t.finish());
    // The trace (the insight engine's syscall feed) and the disks (its block feed) are done:
    // finish the insight log.
    let insight_counters = insight.map(|(engine, writer)| {
        let counters = engine.counters();
        engine.lock().close_log();
        drop(engine);
        if let Err(e) = writer.finish() {
            eprintln!("vmsight: the insight log is incomplete: {e}");
        }
        counters
    });
    // Late console lines (the panic message can trail the ctl events) are in `tail` now.
    let late = LateFacts {
        panic_text: tail.lock().ok().and_then(|t| t.panic_text()),
        qemu_stderr: qemu_stderr.lock().map(|v| v.clone()).unwrap_or_default(),
        console_tail: tail_lines(&tail_text(&tail), 5),
        backend_error,
    };
    let mut stats = RunStats::collect(
        &cfg.name,
        accel,
        &accel_reason,
        &qemu_version,
        ending.boot_time,
        ending.guest_uptime,
        run_time,
        channel.as_ref().map(|(_, h)| h),
        disk_stats,
        trace_summary,
    );
    stats.insights = insight_counters;
    let end = ending.reason(&late);
    Ok(RunOutcome { reason: end, stats })
}

/// What the supervising loop needs to carry out the supervisor's effects.
struct LoopCtx<'a> {
    qmp: &'a Option<Qmp>,
    qemu_pid: u32,
    stdin_go: &'a Sender<()>,
    ctl_writer: &'a Mutex<Option<std::os::unix::net::UnixStream>>,
    trace_cfg: Option<&'a crate::trace::TraceConfig>,
    channel: Option<&'a Arc<Mutex<vmsight_ring::ChannelHost>>>,
}

impl LoopCtx<'_> {
    fn apply(&self, effect: Effect) {
        match effect {
            Effect::StartStdin => {
                let _ = self.stdin_go.send(());
                tracing::info!("guest ready");
            }
            Effect::LetCommandRun(pid) => self.let_command_run(pid),
            Effect::RequestQuit => self.request_quit(),
            Effect::KillQemu => {
                // SAFETY: kill(2) on QEMU's pid, our own child, not reaped before the loop ends.
                unsafe { libc::kill(self.qemu_pid as i32, libc::SIGKILL) };
            }
        }
    }

    /// Monitors the command's PID and tells the held guest command to go.
    fn let_command_run(&self, pid: u32) {
        if let (Some(t), Some(host)) = (self.trace_cfg, self.channel) {
            if let Ok(mut h) = host.lock() {
                if let Err(e) = crate::trace_records::set_target(&mut h, &t.target, Some(pid)) {
                    tracing::warn!("cannot set the monitor filter: {e}");
                }
            }
        }
        tracing::info!("guest command has PID {pid}; letting it run");
        if let Ok(mut w) = self.ctl_writer.lock() {
            if let Some(s) = w.as_mut() {
                if let Err(e) = s.write_all(b"go\n") {
                    tracing::warn!("cannot send go to the guest: {e}");
                }
            }
        }
    }

    /// QMP `quit`, else SIGTERM.
    fn request_quit(&self) {
        let ok = self
            .qmp
            .as_ref()
            .map(|q| q.execute("quit", None, Duration::from_secs(5)).is_ok())
            .unwrap_or(false);
        if !ok {
            // SAFETY: plain kill(2) on QEMU's pid, which this process spawned and has not reaped.
            unsafe { libc::kill(self.qemu_pid as i32, libc::SIGTERM) };
        }
    }
}

/// What the control socket can see and do (`vmsight stream NAME`, `vmsight stats NAME`).
struct ControlState {
    streams: Vec<StreamHandles>,
    caches: Vec<(usize, Arc<CacheMetrics>)>,
    insight: Option<vmsight_insight::InsightEngine>,
}

struct StreamHandles {
    index: usize,
    queue: Arc<vmsight_blockdev::tap::TapQueue>,
    attach: Arc<std::sync::atomic::AtomicBool>,
    slot: Arc<std::sync::RwLock<crate::stream::EngineSlot>>,
    infer: Arc<Mutex<crate::stream::InferStats>>,
}

impl StreamHandles {
    fn ready(&self) -> bool {
        self.slot.read().map(|s| s.0.is_some()).unwrap_or(false)
    }
}

impl ControlState {
    fn status(&self) -> serde_json::Value {
        let disks: Vec<serde_json::Value> = self
            .streams
            .iter()
            .map(|h| {
                serde_json::json!({
                    "disk": h.index,
                    "streaming": h.ready(),
                    "tap": h.queue.snapshot(),
                    "inference": h.infer.lock().ok().map(|s| s.clone()),
                    "cache": self.caches.iter().find(|(i, _)| *i == h.index).map(|(_, m)| m.snapshot()),
                })
            })
            .collect();
        serde_json::json!({
            "disks": disks,
            "insights": self.insight.as_ref().map(|e| e.counters()),
        })
    }

    fn request(&self, req: &serde_json::Value) -> Result<serde_json::Value, String> {
        match req.get("cmd").and_then(serde_json::Value::as_str) {
            Some("status") => Ok(self.status()),
            Some("stream-start") => {
                let mut started = Vec::new();
                for h in &self.streams {
                    if !h.ready() {
                        h.queue.set_enabled(true);
                        h.attach.store(true, Ordering::Release);
                        started.push(h.index);
                    }
                }
                // Wait (bounded) for the crawls, so the caller knows when events flow; a
                // disk without a readable file system never becomes ready.
                let deadline = Instant::now() + Duration::from_secs(30);
                while Instant::now() < deadline
                    && self
                        .streams
                        .iter()
                        .any(|h| started.contains(&h.index) && !h.ready())
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let mut v = self.status();
                v["attached"] = serde_json::json!(started);
                Ok(v)
            }
            Some(other) => Err(format!(
                "unknown command {other:?} (known: status, stream-start)"
            )),
            None => Err("the request has no command".into()),
        }
    }
}

/// Byte ranges of the ext3/ext4 journal on the disk at `path` (empty if there is none or the
/// disk has no file system vmsight can read): the classifier marks writes there so the
/// priority cache does not keep them (Sky §7).
fn journal_ranges(path: &std::path::Path) -> Vec<std::ops::Range<u64>> {
    let Ok(src) = vmsight_fsview::FileSource::open(path) else {
        return Vec::new();
    };
    let part = vmsight_fsview::read_partitions(&src)
        .ok()
        .and_then(|t| t.partitions.first().cloned());
    let Ok(index) = vmsight_fsview::Index::crawl(&src, part.as_ref()) else {
        return Vec::new();
    };
    let fs = index.fs_info();
    let bs = u64::from(fs.block_size);
    index
        .file_extents(8) // the ext3/ext4 journal inode
        .into_iter()
        .map(|e| {
            let start = fs.partition_start + e.disk_block * bs;
            start..start + u64::from(e.len) * bs
        })
        .collect()
}

fn tail_text(t: &Arc<Mutex<ConsoleTail>>) -> String {
    t.lock().map(|t| t.text()).unwrap_or_default()
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
