//! vhost-user-net: the VM's NIC, served by vmsight's network backend through the packet
//! stage registry, with its host side (namespace, tap) made here and removed with it.

use std::sync::Arc;

use vmsight_netdev::{spawn_net_backend, NetConfig, NetHandle, NetMetrics, NetPipeline, Offloads};
use vmsight_proto::net::NetInfo;

use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::error::LaunchError;
use crate::net::host::{self, HostNet};
use crate::net::stages::{self as netstages, NetCtx};
use crate::net::{NetMode, NicDevice};
use crate::qemu::chardev_socket;
use crate::stages::{Sample, StageMetrics};
use crate::stats::NetStats;

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "vhost-user-net",
    start,
};

/// QEMU's id of the NIC.
const ID: &str = "net0";

/// The VM's NIC being served.
pub struct NetDeviceRun {
    /// Hylics' host namespace for handed-over connections (dropped before `host`).
    handover: Option<crate::hylics::handover::HostSide>,
    host: HostNet,
    socket: std::path::PathBuf,
    handle: Option<NetHandle>,
    metrics: Arc<NetMetrics>,
    stages: Vec<(&'static str, Arc<dyn StageMetrics>)>,
    info: std::path::PathBuf,
}

/// The host namespace of Hylics' socket scheme: it looks like the guest (MAC, address,
/// gateway) and its frames go out of the VM's tap.
fn handover_host(
    vm: &str,
    host: &host::HostNet,
    tap: &vmsight_netdev::Tap,
    ctl: &Arc<vmsight_netdev::stages::steer::SteerControl>,
) -> Result<crate::hylics::handover::HostSide, LaunchError> {
    let err = |reason: String| LaunchError::Net {
        vm: vm.to_owned(),
        reason,
    };
    let vm_tap = tap
        .try_clone()
        .map_err(|e| err(format!("cannot dup the tap: {e}")))?;
    let spec = &host.spec;
    let guest = crate::net::spec::ISOLATED_GUEST;
    let ns = host
        .netns
        .as_ref()
        .ok_or_else(|| err("the socket scheme needs the VM's own namespace".into()))?;
    crate::hylics::handover::HostSide::start(
        &crate::hylics::handover::HostSideSpec {
            vm,
            guest_mac: &host.mac,
            guest_cidr: guest.to_string(),
            gateway: spec.host.map(|h| h.addr.to_string()),
            mtu: spec.mtu,
            vm_netns: ns.name(),
            vm_tap_name: &host.tap_name,
        },
        vm_tap,
        ctl.clone(),
    )
    .map_err(|e| err(e.to_string()))
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let settings = &env.cfg.net;
    if !settings.enabled() {
        return Ok(Vec::new());
    }
    let vm = env.cfg.name.as_str();
    let Some(mut host) = host::setup(&settings.spec, vm)? else {
        return Ok(Vec::new());
    };
    if settings.spec.device == NicDevice::Qemu {
        return Ok(vec![Box::new(QemuNic::new(
            host,
            &env.prep.rt.paths().net_info(),
        )?)]);
    }
    let steer = env.hylics.and_then(|h| h.steer.as_ref());
    let built = netstages::build(&NetCtx {
        vm,
        net: settings,
        steer,
    })?;
    let mut stages = Vec::new();
    let mut pipeline = Vec::new();
    for (name, stage, metrics) in built {
        pipeline.push((name, stage));
        if let Some(m) = metrics {
            stages.push((name, m));
        }
    }
    let paths = env.prep.rt.paths();
    let socket = paths.net_socket();
    let mut cfg = NetConfig::new(ID);
    cfg.offloads = Offloads {
        enabled: settings.spec.offloads,
    };
    let tap = host.tap.take().ok_or_else(|| LaunchError::Net {
        vm: vm.to_owned(),
        reason: "the tap was already taken".into(),
    })?;
    let handover = match steer {
        Some(ctl) => Some(handover_host(vm, &host, &tap, ctl)?),
        None => None,
    };
    let handle =
        spawn_net_backend(&cfg, &socket, tap, NetPipeline::new(pipeline)).map_err(|source| {
            LaunchError::NetDevice {
                vm: vm.to_owned(),
                source,
            }
        })?;
    let run = NetDeviceRun {
        metrics: handle.metrics(),
        info: paths.net_info(),
        handle: Some(handle),
        host,
        socket,
        stages,
        handover,
    };
    run.write_info()?;
    Ok(vec![Box::new(run)])
}

impl NetDeviceRun {
    fn write_info(&self) -> Result<(), LaunchError> {
        let stages = self
            .handle
            .as_ref()
            .map(|h| h.stage_names().iter().map(|s| s.to_string()).collect())
            .unwrap_or_default();
        write_info(&self.host, &self.info, stages)
    }
}

/// `net.json` for `vmsight net NAME ...`.
fn write_info(
    host: &HostNet,
    path: &std::path::Path,
    stages: Vec<String>,
) -> Result<(), LaunchError> {
    {
        let spec = &host.spec;
        let (mode, bridge) = match &spec.mode {
            NetMode::Isolated => ("isolated", None),
            NetMode::Tap(_) => ("tap", None),
            NetMode::Bridge(b) => ("bridge", Some(b.clone())),
            NetMode::None => ("none", None),
        };
        let info = NetInfo {
            mode: mode.into(),
            netns: host.netns.as_ref().map(|n| n.name().to_owned()),
            tap: host.tap_name.clone(),
            bridge,
            mac: host.mac.clone(),
            mtu: spec.mtu,
            host_addr: spec
                .host
                .filter(|_| mode == "isolated")
                .map(|h| h.to_string()),
            guest_addr: spec.guest.map(|g| g.to_string()),
            gateway: spec.gateway.map(|g| g.to_string()),
            offloads: spec.offloads,
            stages,
        };
        let json = serde_json::to_vec_pretty(&info).map_err(std::io::Error::other)?;
        std::fs::write(path, json)?;
        Ok(())
    }
}

/// The baseline NIC: QEMU's own user-space virtio-net on the same host side (`vhost=off`:
/// the host has no /dev/vhost-net), no packet stages.
pub struct QemuNic {
    host: HostNet,
    /// Kept open (and inherited by QEMU) until the VM is gone.
    tap: vmsight_netdev::Tap,
    info: std::path::PathBuf,
}

impl QemuNic {
    fn new(mut host: HostNet, info: &std::path::Path) -> Result<QemuNic, LaunchError> {
        let tap = host.tap.take().ok_or_else(|| LaunchError::Net {
            vm: String::new(),
            reason: "the tap was already taken".into(),
        })?;
        tap.set_inheritable()
            .map_err(|source| LaunchError::NetDevice {
                vm: String::new(),
                source,
            })?;
        write_info(&host, info, vec!["(QEMU virtio-net)".into()])?;
        Ok(QemuNic {
            host,
            tap,
            info: info.to_owned(),
        })
    }
}

impl Device for QemuNic {
    fn kind(&self) -> &'static str {
        "virtio-net (QEMU)"
    }

    fn id(&self) -> String {
        ID.into()
    }

    fn qemu_args(&self) -> Vec<String> {
        use std::os::fd::AsRawFd;
        let spec = &self.host.spec;
        let off = if spec.offloads { "on" } else { "off" };
        vec![
            "-netdev".into(),
            format!("tap,id={ID},fd={},vhost=off", self.tap.as_raw_fd()),
            "-device".into(),
            format!(
                "virtio-net-pci,netdev={ID},id={ID}dev,mac={},host_mtu={},csum={off},guest_csum={off},gso={off},host_tso4={off},host_tso6={off},guest_tso4={off},guest_tso6={off}",
                self.host.mac, spec.mtu
            ),
        ]
    }

    fn kernel_args(&self) -> Vec<String> {
        self.host.spec.guest_cmdline().into_iter().collect()
    }

    fn stopped(&self) -> Option<String> {
        None
    }

    fn metrics(&self) -> DeviceMetrics {
        DeviceMetrics {
            kind: "virtio-net (QEMU)",
            id: self.id(),
            disk: None,
            samples: Arc::new(Vec::new),
            stages: Vec::new(),
        }
    }

    fn finish(self: Box<Self>) -> DeviceReport {
        let _ = std::fs::remove_file(&self.info);
        DeviceReport::default()
    }
}

impl Device for NetDeviceRun {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        ID.into()
    }

    fn qemu_args(&self) -> Vec<String> {
        let size = vmsight_netdev::DEFAULT_QUEUE_SIZE;
        vec![
            "-chardev".into(),
            chardev_socket(ID, &self.socket),
            "-netdev".into(),
            format!("vhost-user,id={ID},chardev={ID}"),
            "-device".into(),
            format!(
                "virtio-net-pci,netdev={ID},id={ID}dev,mac={},host_mtu={},rx_queue_size={size},tx_queue_size={size}",
                self.host.mac, self.host.spec.mtu
            ),
        ]
    }

    fn kernel_args(&self) -> Vec<String> {
        self.host.spec.guest_cmdline().into_iter().collect()
    }

    fn stopped(&self) -> Option<String> {
        self.handle
            .as_ref()
            .filter(|h| h.is_finished())
            .map(|_| "the network backend stopped".to_owned())
    }

    fn metrics(&self) -> DeviceMetrics {
        let m = self.metrics.clone();
        DeviceMetrics {
            kind: ENTRY.kind,
            id: self.id(),
            disk: None,
            samples: Arc::new(move || net_samples(&m)),
            stages: self.stages.clone(),
        }
    }

    fn finish(mut self: Box<Self>) -> DeviceReport {
        let error = self
            .handle
            .take()
            .and_then(|h| {
                h.frontend_gone();
                h.wait().err()
            })
            .map(|e| format!("{ID}: {e}"));
        // The device is gone: the host namespace and its forwarding thread go too.
        drop(self.handover.take());
        let mut ns = NetStats {
            id: ID.into(),
            tap: self.host.tap_name.clone(),
            metrics: self.metrics.snapshot(),
            stages: Default::default(),
            stage_lines: Vec::new(),
        };
        for (_, m) in &self.stages {
            ns.stages.insert(m.key().to_owned(), m.snapshot());
            ns.stage_lines.push(m.summary());
        }
        let _ = std::fs::remove_file(&self.info);
        // The namespace goes with `self.host` (QEMU and the backend are gone).
        DeviceReport {
            net: Some(ns),
            error,
            ..DeviceReport::default()
        }
    }
}

/// The NIC's counters as metric samples (names in docs/metrics.md).
fn net_samples(m: &NetMetrics) -> Vec<Sample> {
    let s = m.snapshot();
    let mut v = Vec::new();
    for (dir, frames, bytes) in [
        ("tx", s.tx_frames, s.tx_bytes),
        ("rx", s.rx_frames, s.rx_bytes),
    ] {
        v.push(
            Sample::counter("net_frames_total", "Frames through the NIC.", frames)
                .with("direction", dir),
        );
        v.push(
            Sample::counter("net_bytes_total", "Frame bytes through the NIC.", bytes)
                .with("direction", dir),
        );
    }
    for (why, n) in [
        ("tx_malformed", s.tx_malformed),
        ("rx_malformed", s.rx_malformed),
        ("rx_too_big", s.rx_too_big),
        ("rx_bad_buffer", s.rx_bad_buffers),
        ("tap_write_error", s.tap_write_errors),
        ("stage_tx", s.tx_stage_drops),
        ("stage_rx", s.rx_stage_drops),
    ] {
        v.push(
            Sample::counter("net_dropped_total", "Frames the NIC dropped, by reason.", n)
                .with("reason", why),
        );
    }
    v
}
