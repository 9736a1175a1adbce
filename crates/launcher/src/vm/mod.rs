//! One VM's whole life, in phases (ARCHITECTURE.md, "Lifecycle"):
//!
//! 1. [`prepare`]: validate, resolve the guest files, choose the accelerator and QEMU,
//!    runtime directory and root working copy;
//! 2. devices ([`crate::devices`]): every registered device starts and listens before QEMU
//!    exists, so its connection cannot race them;
//! 3. [`services`]: streaming, view, control socket, metrics, plugin channel, guest I/O
//!    pumps, signal routing;
//! 4. [`spawn`]: QEMU in its own process group tied to vmsight's life, trace session, QMP;
//! 5. supervise: the [`Supervisor`] decides on every event until QEMU is gone;
//! 6. teardown: QEMU is gone before devices are joined; streams drain, stats are collected,
//!    and the runtime directory and working copies are removed by their guards.

mod control_state;
mod metrics;
pub mod prepare;
mod services;
mod spawn;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::VmConfig;
use crate::devices::{self, Device, DeviceEnv};
use crate::error::LaunchError;
use crate::guestio::ConsoleTail;
use crate::qmp::Qmp;
use crate::stats::{DiskStats, NetStats, RunStats};
use crate::stream::DiskStream;
use crate::supervisor::{DownAction, Effect, Ending, Flow, LateFacts, Supervisor};

use prepare::Prepared;
use services::{Insight, Services};
use spawn::Qemu;

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

/// Runs a VM to completion.
pub fn run(cfg: &VmConfig, arts: &Artifacts) -> Result<RunOutcome, LaunchError> {
    let t0 = Instant::now();
    crate::child::private_umask();
    let phase = |name: &str| tracing::info!("phase {name} done at {:?}", t0.elapsed());
    let prep = prepare::prepare(cfg, arts)?;
    phase("prepare");
    let insight = services::insight_engine(cfg)?;
    let mut streams = services::disk_streams(cfg, &prep);
    let idle = services::idle_attributor(cfg, &prep)?;
    let hylics = services::hylics(cfg, &prep)?;
    let sym = services::symbiotic(cfg, &prep)?;
    let swap = services::swap(cfg, &prep, sym.as_ref())?;
    let devices = devices::start_all(&DeviceEnv {
        cfg,
        prep: &prep,
        insight: insight.as_ref().map(|(e, _)| e),
        streams: &streams,
        idle: idle.as_ref(),
        hylics: hylics.as_ref(),
        sym: sym.as_ref(),
        swap: swap.as_ref(),
    })?;
    phase("devices");
    let svc = services::start(
        cfg,
        &prep,
        &devices,
        &mut streams,
        insight.as_ref().map(|(e, _)| e),
        services::Features {
            idle,
            hylics,
            sym,
            swap,
        },
    )?;
    phase("services");
    let qemu = spawn::spawn(cfg, arts, &prep, &devices, &svc, insight.as_ref())?;
    phase("spawn");
    let ending = supervise(t0, cfg, &prep, &devices, &svc, &qemu);
    let run_time = t0.elapsed();
    Ok(teardown(
        cfg,
        &prep,
        Teardown {
            devices,
            streams,
            svc,
            qemu,
            insight,
            ending,
            run_time,
        },
    ))
}

/// Phase 5: feeds events to the supervisor and carries out its effects until QEMU is gone.
fn supervise(
    t0: Instant,
    cfg: &VmConfig,
    prep: &Prepared,
    devices: &[Box<dyn Device>],
    svc: &Services,
    qemu: &Qemu,
) -> Ending {
    let raw_guard = if svc.interactive {
        crate::term::RawMode::enter(svc.console_writer.clone(), svc.tx.clone())
    } else {
        None
    };
    let mut supervisor = Supervisor::new(t0).with_boot_timeout(cfg.boot_timeout);
    let ctx = LoopCtx {
        qmp: &qemu.qmp,
        events: &svc.tx,
        qemu_pid: qemu.pid,
        stdin_go: &svc.stdin_go,
        ctl_writer: &svc.ctl_writer,
        trace_cfg: prep.trace.as_ref(),
        channel: svc.channel.as_ref().map(|(_, h)| h),
        idle: svc.idle.as_ref(),
        idle_cmd: prep.hold
            && cfg
                .idle
                .as_ref()
                .is_some_and(|i| i.background.contains(&crate::trace::TraceTarget::Command)),
    };
    let ending = loop {
        let ev = match svc.rx.recv_timeout(Duration::from_millis(200)) {
            Ok(ev) => ev,
            Err(RecvTimeoutError::Timeout) => match devices.iter().find_map(|d| d.stopped()) {
                Some(what) => Event::BackendStopped(what),
                None => Event::Tick,
            },
            Err(RecvTimeoutError::Disconnected) => {
                Event::QemuExited(Err(std::io::Error::other("the event channel closed")))
            }
        };
        match supervisor.on_event(ev, Instant::now()) {
            Flow::Continue(effects) => effects.into_iter().for_each(|e| ctx.apply(e)),
            Flow::End(ending) => break ending,
        }
    };
    drop(raw_guard);
    ending
}

/// What teardown consumes.
struct Teardown {
    devices: Vec<Box<dyn Device>>,
    streams: Vec<DiskStream>,
    svc: Services,
    qemu: Qemu,
    insight: Option<Insight>,
    ending: Ending,
    run_time: Duration,
}

/// Phase 6: QEMU is gone; stop the pumps, join the devices, drain the streams, finish the
/// trace and the insight log, and work out the end reason. The runtime directory and working
/// copy go with `prep`'s guards when the caller returns.
fn teardown(cfg: &VmConfig, prep: &Prepared, t: Teardown) -> RunOutcome {
    let Teardown {
        devices,
        mut streams,
        svc,
        qemu,
        insight,
        ending,
        run_time,
    } = t;
    svc.stop.store(true, Ordering::Relaxed);
    svc.signals.close();
    // QEMU is gone: its sockets are closed, so the pumps reach EOF and finish.
    for p in svc.pumps {
        let _ = p.join();
    }
    if let Some(h) = qemu.stderr_thread {
        let _ = h.join();
    }
    // QEMU has exited: its guard has nothing left to kill.
    drop(qemu.exit_guard);
    let Finished {
        disks: disk_stats,
        nics: nic_stats,
        share: share_info,
        offload: offload_stats,
        controller: controller_status,
        symbiotic: sym_counters,
        swap: swap_report,
        error: backend_error,
    } = finish_devices(devices, &mut streams);
    let trace_summary = qemu.trace.map(|t| t.finish());
    drop(qemu.ram);
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
        panic_text: svc.tail.lock().ok().and_then(|t| t.panic_text()),
        qemu_stderr: qemu.stderr.lock().map(|v| v.clone()).unwrap_or_default(),
        console_tail: tail_lines(&tail_text(&svc.tail), CONSOLE_TAIL_LINES),
        backend_error,
    };
    let mut stats = RunStats::collect(
        &cfg.name,
        prep.accel,
        &prep.accel_reason,
        prep.qemu.info(),
        prep.use_plugin.then(|| prep.qemu.plugin_api()),
        ending.boot_time,
        ending.guest_uptime,
        run_time,
        svc.channel.as_ref().map(|(_, h)| h),
        disk_stats,
        trace_summary,
    );
    stats.poweroff_forced = ending.poweroff_forced();
    if stats.poweroff_forced {
        let action = ending.down_action().unwrap_or(DownAction::Poweroff);
        eprintln!(
            "vmsight: the guest synced its disks and asked to {}, but QEMU was still running {} \
             s later, so vmsight stopped it ({}: docs/guest-protocol.md)",
            action.verb(),
            crate::supervisor::POWEROFF_TIMEOUT.as_secs(),
            match action {
                DownAction::Halt => "a halted guest stays halted",
                _ => "a guest kernel can hang in its device shutdown",
            }
        );
    }
    stats.insights = insight_counters;
    stats.nics = nic_stats;
    stats.share = share_info;
    stats.offload = offload_stats;
    stats.controller = controller_status;
    stats.symbiotic = sym_counters;
    stats.swap = swap_report;
    RunOutcome {
        reason: ending.reason(&late),
        stats,
    }
}

/// What the devices reported at the end of a run.
struct Finished {
    disks: Vec<DiskStats>,
    nics: Vec<NetStats>,
    share: Option<vmsight_proto::hylics::ShareInfo>,
    offload: Option<crate::hylics::offload::OffloadSnapshot>,
    controller: Option<vmsight_proto::hylics::ControllerStatus>,
    symbiotic: Option<vmsight_proto::sym::SymCounters>,
    swap: Option<vmsight_proto::swap::SwapReport>,
    /// The first backend error.
    error: Option<String>,
}

/// Joins every device and merges each disk's stream counters (the backend is gone, so its
/// tap pushes no more: drain and stop the consumer).
fn finish_devices(devices: Vec<Box<dyn Device>>, streams: &mut Vec<DiskStream>) -> Finished {
    let mut disks = Vec::new();
    let mut nics = Vec::new();
    let mut share = None;
    let mut offload = None;
    let mut controller = None;
    let mut symbiotic = None;
    let mut swap = None;
    let mut error = None;
    for (i, d) in devices.into_iter().enumerate() {
        let report = d.finish();
        if let Some(e) = report.error {
            error.get_or_insert(e);
        }
        nics.extend(report.net);
        share = share.or(report.share);
        offload = offload.or(report.offload);
        controller = controller.or(report.controller);
        symbiotic = symbiotic.or(report.sym);
        swap = swap.or(report.swap);
        let Some(mut ds) = report.disk else {
            continue;
        };
        if let Some(pos) = streams.iter().position(|s| s.index == i) {
            let (tap, infer) = streams.swap_remove(pos).finish();
            ds.tap = Some(tap);
            ds.stream = infer;
        }
        disks.push(ds);
    }
    Finished {
        disks,
        nics,
        share,
        offload,
        controller,
        symbiotic,
        swap,
        error,
    }
}

/// What the supervising loop needs to carry out the supervisor's effects.
struct LoopCtx<'a> {
    qmp: &'a Option<Qmp>,
    /// The supervisor's event channel, for what an effect finds out (a stuck vCPU timer).
    events: &'a Sender<Event>,
    qemu_pid: u32,
    stdin_go: &'a Sender<()>,
    ctl_writer: &'a Mutex<Option<std::os::unix::net::UnixStream>>,
    trace_cfg: Option<&'a crate::trace::TraceConfig>,
    channel: Option<&'a Arc<Mutex<vmsight_ring::ChannelHost>>>,
    /// FoxyIdle's attribution, and whether the command is marked background (`@cmd`).
    idle: Option<&'a Arc<crate::idle::Attributor>>,
    idle_cmd: bool,
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
            Effect::DumpLocalApic(cpu) => self.dump_local_apic(cpu),
        }
    }

    /// Logs QEMU's view of the local APIC of the vCPU whose timer the guest says stopped
    /// firing (HMP `info lapic`, through QMP): the timer's LVT entry (masked? one-shot?), its
    /// initial and current count, and the pending and in-service vectors. When the timer's
    /// vector is stuck in service (QEMU 10's TCG section race lost its EOI), the vCPU takes no
    /// timer interrupt again: the supervisor is told, and stops the VM at once.
    /// docs/launcher.md ("Limits") describes the stall this is for.
    fn dump_local_apic(&self, cpu: u32) {
        let Some(q) = self.qmp.as_ref() else {
            return;
        };
        let args = serde_json::json!({ "command-line": format!("info lapic {cpu}") });
        match q.execute("human-monitor-command", Some(args), Duration::from_secs(5)) {
            Ok(v) => {
                let apic = v.as_str().unwrap_or_default().trim_end().to_string();
                tracing::warn!(
                    "the guest reports that the timer of its CPU {cpu} did not fire (an RCU \
                     stall); QEMU's local APIC of that vCPU:\n{apic}"
                );
                if crate::supervisor::timer_vector_in_service(&apic) {
                    let _ = self.events.send(Event::TimerStuck(cpu, apic));
                }
            }
            Err(e) => tracing::warn!(
                "the guest reports that the timer of its CPU {cpu} did not fire (an RCU stall); \
                 cannot read QEMU's local APIC state: {e}"
            ),
        }
    }

    /// Monitors the command's PID (or marks it background) and tells the held guest command
    /// to go.
    fn let_command_run(&self, pid: u32) {
        if let (Some(idle), true) = (self.idle, self.idle_cmd) {
            let target = crate::trace::TraceTarget::Pid(pid);
            if let Err(e) = idle.mark(&target, crate::idle::marks::Source::Run) {
                tracing::warn!("cannot mark the command background: {e}");
            }
        }
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

/// Console lines kept for the end reasons: enough to show a stalled guest kernel's report
/// (an RCU stall with its stack dump runs to a few dozen lines).
const CONSOLE_TAIL_LINES: usize = 40;

fn tail_text(t: &Arc<Mutex<ConsoleTail>>) -> String {
    t.lock().map(|t| t.text()).unwrap_or_default()
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
