//! Phase 3, services: everything that runs beside the devices while the VM lives.
//!
//! File-update streaming (crawl each writable disk, then follow its write tap), the view
//! server (`vmsight mount`, every streamed disk at its guest mount point), the control socket
//! (`vmsight stats`, `vmsight stream`), the metrics endpoint (`--metrics`), the plugin's
//! shared-memory channel, the guest I/O pumps (console, ctl, stdout, stderr, stdin) and
//! signal routing. All of it listens before QEMU
//! is spawned, so no guest byte and no signal is lost.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmsight_insight::InsightEngine;

use vmsight_proto::layout;

use crate::config::VmConfig;
use crate::devices::Device;
use crate::error::LaunchError;
use crate::guestio::{self, ConsoleTail};
use crate::stream::{Delivery, DiskStream};
use crate::supervisor::Event;

use super::control_state::{ControlFeatures, ControlState};
use super::prepare::Prepared;

/// The insight engine and the writer thread of its log, when `--insights` is on.
pub type Insight = (InsightEngine, vmsight_insight::log::LogWriter);

/// A guest socket's writer half, shared between its reader and whoever writes to the guest.
pub type SharedStream = Arc<Mutex<Option<std::os::unix::net::UnixStream>>>;

/// The plugin's shared-memory file and the host side of the channel.
pub type PluginChannel = (PathBuf, Arc<Mutex<vmsight_ring::ChannelHost>>);

/// The running services.
pub struct Services {
    /// Events for the supervisor.
    pub tx: Sender<Event>,
    pub rx: Receiver<Event>,
    /// Set when the run is over: the pumps stop.
    pub stop: Arc<AtomicBool>,
    /// The last console lines (panic text, failure reports).
    pub tail: Arc<Mutex<ConsoleTail>>,
    /// The console socket, for the interactive terminal.
    pub console_writer: SharedStream,
    /// The ctl socket, to tell a held command to go.
    pub ctl_writer: SharedStream,
    pub pumps: Vec<JoinHandle<()>>,
    /// Starts forwarding vmsight's stdin to the guest.
    pub stdin_go: Sender<()>,
    /// The plugin's shared-memory channel (file, host side), when the plugin is loaded.
    pub channel: Option<PluginChannel>,
    pub signals: signal_hook::iterator::Handle,
    /// The command is interactive (no command given).
    pub interactive: bool,
    /// FoxyIdle's attribution (its channel goes to the plugin), when FoxyIdle is on.
    pub idle: Option<Arc<crate::idle::Attributor>>,
    /// The symbiotic interface (`--symbiotic`): the insight engine's lookups call through it.
    pub sym: Option<Arc<crate::sym::Symbiotic>>,
    _view: Option<vmsight_view::ViewServer>,
    _control: crate::control::ControlServer,
    _metrics: Option<vmsight_metrics::MetricsServer>,
    _stdin: JoinHandle<()>,
}

/// The insight engine and its log, when `--insights` asks for them.
pub fn insight_engine(cfg: &VmConfig) -> Result<Option<Insight>, LaunchError> {
    let Some(s) = &cfg.insights else {
        return Ok(None);
    };
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
    Ok(Some((InsightEngine::new(icfg, log), writer)))
}

/// FoxyIdle's attribution, when `--background`/`--idle*` ask for it: the block-tag channel
/// (when the plugin can tag requests), the initial marks and the per-request log.
pub fn idle_attributor(
    cfg: &VmConfig,
    prep: &Prepared,
) -> Result<Option<Arc<crate::idle::Attributor>>, LaunchError> {
    let Some(idle) = &cfg.idle else {
        return Ok(None);
    };
    let shm = prep.idle_tags.then(|| prep.rt.join(layout::BLOCKTAG_SHM));
    crate::idle::Attributor::create(
        shm.as_deref(),
        cfg.vcpus,
        &idle.background,
        idle.log.as_deref(),
    )
    .map(Some)
}

/// The VM's shared in-memory file system (a tmpfs in its runtime directory), when
/// `--shared-mem` asks for one (the virtio-fs device serves it), and its controller with
/// `--hylics-slo` (the vsock device feeds it).
pub fn hylics(
    cfg: &VmConfig,
    prep: &Prepared,
) -> Result<Option<crate::hylics::Hylics>, LaunchError> {
    let Some(spec) = &cfg.share else {
        return Ok(None);
    };
    let vm = || cfg.name.clone();
    let paths = prep.rt.paths();
    let share = crate::hylics::Share::create(
        &paths.share_dir(),
        &paths.hylics_info(),
        spec,
        prep.identity.as_ref().map(|id| (id.uid, id.gid)),
    )
    .map(Arc::new)
    .map_err(|source| LaunchError::Share { vm: vm(), source })?;
    let controller = match &cfg.slo {
        None => None,
        Some(slo) => {
            let config = slo
                .config(share.size())
                .map_err(|source| LaunchError::Slo { vm: vm(), source })?;
            let c = crate::hylics::ShareController::start(config, share.clone(), slo.log_path())
                .map_err(|source| LaunchError::Controller { vm: vm(), source })?;
            Some(c)
        }
    };
    // The socket scheme steers connections through vmsight's NIC in an isolated network.
    let net = &cfg.net.spec;
    let steer = (cfg.net.enabled()
        && net.mode == crate::net::NetMode::Isolated
        && net.device == crate::net::spec::NicDevice::Vmsight)
        .then(vmsight_netdev::stages::steer::SteerControl::new);
    Ok(Some(crate::hylics::Hylics {
        share,
        controller,
        steer,
    }))
}

/// The symbiotic interface's region and state, with `--symbiotic` (the ivshmem-doorbell
/// device serves it; the control socket and the insight engine's lookups call through it).
pub fn symbiotic(
    cfg: &VmConfig,
    prep: &Prepared,
) -> Result<Option<Arc<crate::sym::Symbiotic>>, LaunchError> {
    if !cfg.symbiotic {
        return Ok(None);
    }
    let hints: Vec<crate::sym::spy::DiskHint> = prep
        .disks
        .iter()
        .map(|d| crate::sym::spy::disk_hint(cfg, d))
        .collect();
    Ok(Some(crate::sym::Symbiotic::new(
        &cfg.name,
        &hints,
        cfg.swap.is_some(),
    )?))
}

/// The swap disk's service (swap file, cache, evictor), with `--swap`; its region is shared
/// with the guest module when the symbiotic interface is on.
pub fn swap(
    cfg: &VmConfig,
    prep: &Prepared,
    sym: Option<&Arc<crate::sym::Symbiotic>>,
) -> Result<Option<Arc<crate::swap::SwapService>>, LaunchError> {
    let Some(spec) = &cfg.swap else {
        return Ok(None);
    };
    let dir = vmsight_image::cache_dir()?.join("vms").join(&cfg.name);
    let svc = Arc::new(crate::swap::SwapService::create(
        &cfg.name,
        spec,
        &dir,
        prep.rt.path(),
        sym.cloned(),
    )?);
    svc.start_mem()?;
    Ok(Some(svc))
}

/// A file-update stream (tap queue) per writable disk; consumers start with the services.
pub fn disk_streams(cfg: &VmConfig, prep: &Prepared) -> Vec<DiskStream> {
    prep.disks
        .iter()
        .filter(|d| !d.read_only)
        .map(|d| DiskStream::new(d.index, &d.path, &cfg.stream))
        .collect()
}

/// The feature services created before the devices that phase 3 hands on (FoxyIdle's
/// attribution, Hylics' share, the symbiotic interface).
pub struct Features {
    pub idle: Option<Arc<crate::idle::Attributor>>,
    pub hylics: Option<crate::hylics::Hylics>,
    pub sym: Option<Arc<crate::sym::Symbiotic>>,
    pub swap: Option<Arc<crate::swap::SwapService>>,
}

/// Runs phase 3.
pub fn start(
    cfg: &VmConfig,
    prep: &Prepared,
    devices: &[Box<dyn Device>],
    streams: &mut [DiskStream],
    insight: Option<&InsightEngine>,
    features: Features,
) -> Result<Services, LaunchError> {
    let Features {
        idle,
        hylics,
        sym,
        swap,
    } = features;
    let delivery = Arc::new(Delivery::open(
        cfg.stream.host.clone(),
        &cfg.name,
        Some(&prep.rt.join(layout::EVENTS_SOCKET)),
        cfg.stream.redis.as_deref(),
        cfg.stream.events_file.as_deref(),
        cfg.stream.data,
    )?);
    for ds in streams.iter_mut() {
        start_stream(cfg, ds, &delivery)?;
    }
    // Copies without a user buffer are followed to their blocks through the disks' indexes.
    if let Some(engine) = insight {
        engine.set_file_blocks(Arc::new(crate::copymap::CopyMap::for_vm(cfg, streams)));
    }
    let view = view_server(cfg, prep, streams)?;
    let channel = plugin_channel(cfg, prep)?;
    if let Some(s) = &sym {
        crate::sym::sync::offer(s, prep, channel.as_ref().map(|(_, c)| c));
    }
    let control = ControlState::new(
        streams,
        devices,
        insight.cloned(),
        channel.as_ref().map(|(_, c)| c.clone()),
        ControlFeatures {
            idle: idle.clone(),
            hylics,
            sym: sym.clone(),
            swap,
        },
    );
    let metrics = super::metrics::serve(cfg, devices, streams)?;
    let control = crate::control::ControlServer::serve(
        &prep.rt.paths().control_socket(),
        Arc::new(move |req| control.request(req)),
    )
    .map_err(|e| LaunchError::Config(format!("cannot start the control socket: {e}")))?;
    let (tx, rx) = mpsc::channel();
    let signals = route_signals(&tx)?;
    let io = start_guest_io(cfg, prep, &tx)?;
    Ok(Services {
        tx,
        rx,
        stop: io.stop,
        tail: io.tail,
        console_writer: io.console_writer,
        ctl_writer: io.ctl_writer,
        pumps: io.pumps,
        stdin_go: io.stdin_go,
        channel,
        signals,
        interactive: cfg.command.is_none(),
        idle,
        sym,
        _view: view,
        _control: control,
        _metrics: metrics,
        _stdin: io.stdin,
    })
}

/// Where the guest mounts disk `index`: `/` for the root disk, an extra disk's `mount=`, or
/// `/@diskN` when it has none (the prefix of its paths in events and in the view).
fn mount_point(disks: &[crate::config::DiskSpec], index: usize) -> String {
    match index {
        0 => "/".into(),
        i => disks
            .get(i - 1)
            .and_then(|d| d.mount.clone())
            .unwrap_or_else(|| format!("/@disk{i}")),
    }
}

/// The live read-only view (`vmsight mount`): every streamed disk's file system at its guest
/// mount point. A disk appears once it is crawled (at once, or after `vmsight stream`).
fn view_server(
    cfg: &VmConfig,
    prep: &Prepared,
    streams: &[DiskStream],
) -> Result<Option<vmsight_view::ViewServer>, LaunchError> {
    if streams.is_empty() {
        return Ok(None);
    }
    let disks = streams
        .iter()
        .map(|d| vmsight_view::ServedDisk {
            disk: d.index as u32,
            mount: mount_point(&cfg.disks, d.index),
            source: d.slot.clone(),
        })
        .collect();
    vmsight_view::ViewServer::bind_disks(prep.rt.join(layout::VIEW_SOCKET), disks)
        .map(Some)
        .map_err(|e| LaunchError::Config(format!("cannot start the view server: {e}")))
}

/// Crawls one disk (before the guest runs: from here on every write is diffed against it)
/// and starts its consumer.
fn start_stream(
    cfg: &VmConfig,
    ds: &mut DiskStream,
    delivery: &Arc<Delivery>,
) -> Result<(), LaunchError> {
    let lazy = crate::stream::LazyPlan::for_disk(&cfg.stream, &cfg.name, ds.index);
    if cfg.stream.enabled {
        match crate::stream::make_engine(&ds.image, cfg.stream.data, lazy.as_ref()) {
            Ok(engine) => {
                if let Ok(mut slot) = ds.slot.write() {
                    slot.0 = Some(engine);
                }
            }
            Err(e) => {
                tracing::info!("no file-update streaming for disk {}: {e}", ds.index);
                // Nothing would use the copies: keep the tap idle unless the stream is
                // recorded (`vmsight stream` can still attach it later).
                if !cfg.stream.record.iter().any(|(n, _)| *n == ds.index) {
                    ds.queue().set_enabled(false);
                }
                if ds.index > 0 && (cfg.stream.events_file.is_some() || cfg.stream.redis.is_some())
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
    let prefix = match mount_point(&cfg.disks, ds.index) {
        root if root == "/" => String::new(),
        m => m,
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
    )
    .with_lazy(lazy);
    ds.start(&cfg.stream, vec![Box::new(sink)])
        .map_err(|e| LaunchError::Config(format!("disk {}: {e}", ds.index)))
}

/// Records per vCPU ring (128 bytes each: 8 MiB per vCPU). The trace thread drains every
/// 5 ms; the slack covers a guest's fastest syscall loop while that thread waits for a core on
/// a loaded host (with 16 384, CI's loaded host dropped records).
const RING_RECORDS: u32 = 1 << 16;

/// The plugin's shared-memory channel, with the monitor filter of the trace target.
fn plugin_channel(cfg: &VmConfig, prep: &Prepared) -> Result<Option<PluginChannel>, LaunchError> {
    if !prep.use_plugin {
        return Ok(None);
    }
    let shm = prep.rt.join(layout::PLUGIN_SHM);
    let mut host = vmsight_ring::Channel::create(&shm, cfg.vcpus, RING_RECORDS)
        .map_err(|e| LaunchError::Channel(e.to_string()))?;
    if let Some(t) = &prep.trace {
        crate::trace_records::set_target(&mut host, &t.target, None)
            .map_err(|e| LaunchError::Channel(e.to_string()))?;
    }
    Ok(Some((shm, Arc::new(Mutex::new(host)))))
}

/// SIGINT, SIGTERM and SIGHUP become supervisor events.
fn route_signals(tx: &Sender<Event>) -> Result<signal_hook::iterator::Handle, LaunchError> {
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])?;
    let handle = signals.handle();
    let tx = tx.clone();
    std::thread::Builder::new()
        .name("vmsight-signals".into())
        .spawn(move || {
            for s in signals.forever() {
                if tx.send(Event::Signal(s)).is_err() {
                    break;
                }
            }
        })?;
    Ok(handle)
}

/// The guest I/O pumps and what they share.
struct GuestIo {
    stop: Arc<AtomicBool>,
    tail: Arc<Mutex<ConsoleTail>>,
    console_writer: SharedStream,
    ctl_writer: SharedStream,
    pumps: Vec<JoinHandle<()>>,
    stdin_go: Sender<()>,
    stdin: JoinHandle<()>,
}

/// Listens on the console, ctl, stdout, stderr and stdin sockets QEMU connects to.
fn start_guest_io(
    cfg: &VmConfig,
    prep: &Prepared,
    tx: &Sender<Event>,
) -> Result<GuestIo, LaunchError> {
    let rt = &prep.rt;
    let stop = Arc::new(AtomicBool::new(false));
    let tail = Arc::new(Mutex::new(ConsoleTail::default()));
    let console_writer: SharedStream = Arc::default();
    let interactive = cfg.command.is_none();
    let console_log = crate::runtime::create_private(&rt.join(layout::CONSOLE_LOG)).ok();
    let user_log = match &cfg.console_log {
        Some(p) => Some(std::fs::File::create(p)?),
        None => None,
    };
    let live: Option<Box<dyn Write + Send>> = if interactive {
        Some(Box::new(std::io::stdout()))
    } else if cfg.show_console {
        Some(Box::new(std::io::stderr()))
    } else {
        None
    };
    let mut pumps = vec![guestio::spawn_console_reader(
        guestio::listen(&rt.join(layout::CONSOLE_SOCKET))?,
        cfg.vcpus,
        stop.clone(),
        tail.clone(),
        user_log.or(console_log),
        live,
        console_writer.clone(),
        tx.clone(),
    )?];
    let ctl_writer: SharedStream = Arc::default();
    pumps.push(guestio::spawn_ctl_reader(
        guestio::listen(&rt.join(layout::CTL_SOCKET))?,
        stop.clone(),
        tx.clone(),
        ctl_writer.clone(),
    )?);
    pumps.push(guestio::spawn_output_pump(
        "vmsight-stdout",
        guestio::listen(&rt.join(layout::STDOUT_SOCKET))?,
        stop.clone(),
        Box::new(std::io::stdout()),
    )?);
    pumps.push(guestio::spawn_output_pump(
        "vmsight-stderr",
        guestio::listen(&rt.join(layout::STDERR_SOCKET))?,
        stop.clone(),
        Box::new(std::io::stderr()),
    )?);
    let feed_stdin = !interactive && !std::io::IsTerminal::is_terminal(&std::io::stdin());
    // Not joined: it may sit in a read of the host's stdin, which must not delay the exit.
    let (stdin_go, stdin_go_rx) = mpsc::channel();
    let stdin = guestio::spawn_stdin_feeder(
        guestio::listen(&rt.join(layout::STDIN_SOCKET))?,
        stop.clone(),
        feed_stdin,
        stdin_go_rx,
    )?;
    Ok(GuestIo {
        stop,
        tail,
        console_writer,
        ctl_writer,
        pumps,
        stdin_go,
        stdin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disks_are_mounted_at_root_their_mount_option_or_at_disk_n() {
        let spec = |s: &str| s.parse::<crate::config::DiskSpec>().expect("disk spec");
        let disks = [spec("a.img,mount=/mnt/data/"), spec("b.img")];
        assert_eq!(mount_point(&disks, 0), "/");
        assert_eq!(mount_point(&disks, 1), "/mnt/data");
        assert_eq!(mount_point(&disks, 2), "/@disk2");
    }
}
