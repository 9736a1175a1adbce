//! vhost-user-vsock: the guest <-> vmsight control channel of Hylics, served by rust-vmm's
//! vhost-device-vsock (hybrid vsock over Unix sockets), with vmsight's send-offload service
//! on host port 5100 (`crate::hylics::offload`). Present when the VM has a share
//! (`--shared-mem`).

use std::sync::Arc;

use vmsight_proto::hylics::GUEST_CID;
use vmsight_proto::layout::{VSOCK_LOG, VSOCK_UDS};

use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::daemon::{find_tool, Daemon, DaemonError, DaemonSlot};
use crate::error::LaunchError;
use crate::hylics::offload::{OffloadCtx, OffloadMetrics, OffloadService};
use crate::hylics::ShareController;
use crate::net::NetMode;
use crate::qemu::vhost_user_pci;
use crate::stages::Sample;

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "vhost-user-vsock",
    start,
};

/// QEMU's id of the device.
const ID: &str = "vsock0";
/// Environment variable naming the vhost-device-vsock binary to use.
pub const VSOCK_ENV: &str = "VMSIGHT_VSOCK_DEVICE";

/// The vsock device and the services behind it.
pub struct VsockDevice {
    socket: std::path::PathBuf,
    daemon: DaemonSlot,
    offload: Option<OffloadService>,
    metrics: Arc<OffloadMetrics>,
    controller: Option<Arc<ShareController>>,
}

/// The vhost-device-vsock to run.
pub fn find() -> Result<std::path::PathBuf, DaemonError> {
    find_tool("vhost-device-vsock", VSOCK_ENV, &[])
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let Some(hylics) = env.hylics else {
        return Ok(Vec::new());
    };
    let vm = env.cfg.name.as_str();
    let err = |source| LaunchError::Daemon {
        vm: vm.to_owned(),
        source,
    };
    let paths = env.prep.rt.paths();
    let socket = paths.file(vmsight_proto::layout::VSOCK_SOCKET);
    let uds = paths.file(VSOCK_UDS);
    let args = vec![
        format!("--guest-cid={GUEST_CID}"),
        format!("--socket={}", socket.display()),
        format!("--uds-path={}", uds.display()),
    ];
    let daemon = Daemon::start(
        "vhost-device-vsock",
        &find().map_err(err)?,
        &args,
        &socket,
        &env.prep.rt.join(VSOCK_LOG),
    )
    .map_err(err)?;
    let netns = (env.cfg.net.spec.mode == NetMode::Isolated)
        .then(|| vmsight_netdev::tap::netns_path(&crate::net::host::netns_name(vm)));
    let offload = OffloadService::start(
        &uds,
        OffloadCtx {
            share_dir: hylics.share.dir().to_owned(),
            netns,
            controller: hylics.controller.clone(),
            vm: vm.to_owned(),
            steer: hylics.steer.clone(),
        },
    )
    .map_err(|e| LaunchError::Listen {
        path: uds.clone(),
        source: e.into_io(),
    })?;
    Ok(vec![Box::new(VsockDevice {
        socket,
        daemon: DaemonSlot::new(daemon),
        metrics: offload.metrics(),
        offload: Some(offload),
        controller: hylics.controller.clone(),
    })])
}

impl Device for VsockDevice {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        ID.into()
    }

    fn qemu_args(&self) -> Vec<String> {
        vhost_user_pci(ID, &self.socket, "vhost-user-vsock-pci", "")
    }

    fn stopped(&self) -> Option<String> {
        self.daemon.stopped()
    }

    fn metrics(&self) -> DeviceMetrics {
        let m = self.metrics.clone();
        let c = self.controller.clone();
        DeviceMetrics {
            kind: ENTRY.kind,
            id: self.id(),
            disk: None,
            samples: Arc::new(move || {
                let mut s = offload_samples(&m);
                if let Some(c) = &c {
                    s.extend(controller_samples(c));
                }
                s
            }),
            stages: Vec::new(),
        }
    }

    fn finish(mut self: Box<Self>) -> DeviceReport {
        if let Some(s) = self.offload.take() {
            s.stop();
        }
        DeviceReport {
            offload: Some(self.metrics.snapshot()),
            controller: self.controller.as_ref().map(|c| c.stop()),
            error: self.daemon.stop(ID),
            ..DeviceReport::default()
        }
    }
}

/// The send offload's counters as metric samples (names in docs/metrics.md).
fn offload_samples(m: &OffloadMetrics) -> Vec<Sample> {
    let s = m.snapshot();
    vec![
        Sample::counter(
            "hylics_offload_requests_total",
            "Send-offload requests from the guest.",
            s.requests,
        ),
        Sample::counter(
            "hylics_offload_bytes_total",
            "Bytes the host sent on the guest's behalf.",
            s.bytes_sent,
        ),
        Sample::counter(
            "hylics_offload_failures_total",
            "Send-offload requests that failed.",
            s.failures,
        ),
    ]
}

/// The share-size controller's state as metric samples (names in docs/metrics.md).
fn controller_samples(c: &ShareController) -> Vec<Sample> {
    let s = c.status();
    vec![
        Sample::gauge(
            "hylics_controller_target_bytes",
            "Share size the controller wants.",
            s.target_bytes,
        ),
        Sample::counter(
            "hylics_controller_decisions_total",
            "Control intervals decided.",
            s.decisions,
        ),
        Sample::counter(
            "hylics_controller_tasks_total",
            "Task completions the guest reported.",
            s.tasks,
        ),
        Sample::gauge(
            "hylics_controller_response_microseconds",
            "Mean response time of the last interval with tasks, microseconds.",
            (s.last_r_secs.unwrap_or(0.0) * 1e6) as u64,
        ),
        Sample::counter(
            "hylics_controller_refused_shrinks_total",
            "Shrinks refused because the share held more than the target.",
            s.refused_shrinks,
        ),
    ]
}
