//! vhost-user-fs: the VM's share (Hylics), served by virtiofsd from the tmpfs vmsight mounted
//! for the VM (`crate::hylics`).

use std::sync::Arc;

use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::daemon::DaemonSlot;
use crate::error::LaunchError;
use crate::hylics::spec::TAG;
use crate::hylics::virtiofsd;
use crate::hylics::Share;
use crate::qemu::vhost_user_pci;
use crate::stages::Sample;

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "vhost-user-fs",
    start,
};

/// QEMU's id of the device.
const ID: &str = "fs0";
/// virtqueue size (virtiofsd's default maximum).
const QUEUE_SIZE: u16 = 1024;

/// The share being served.
pub struct FsDevice {
    share: Arc<Share>,
    socket: std::path::PathBuf,
    daemon: DaemonSlot,
    guest_cmdline: String,
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let (Some(spec), Some(share)) = (&env.cfg.share, env.hylics.map(|h| &h.share)) else {
        return Ok(Vec::new());
    };
    let vm = env.cfg.name.as_str();
    let err = |source| LaunchError::Daemon {
        vm: vm.to_owned(),
        source,
    };
    let bin = virtiofsd::find().map_err(err)?;
    let paths = env.prep.rt.paths();
    let socket = paths.fs_socket();
    let log = env.prep.rt.join(vmsight_proto::layout::VIRTIOFSD_LOG);
    let daemon = match &env.prep.identity {
        Some(id) => virtiofsd::start_as(&bin, &socket, share.dir(), spec, &log, (id.uid, id.gid)),
        None => virtiofsd::start(&bin, &socket, share.dir(), spec, &log),
    }
    .map_err(err)?;
    Ok(vec![Box::new(FsDevice {
        share: share.clone(),
        socket,
        daemon: DaemonSlot::new(daemon),
        guest_cmdline: spec.guest_cmdline(),
    })])
}

impl Device for FsDevice {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        ID.into()
    }

    fn qemu_args(&self) -> Vec<String> {
        vhost_user_pci(
            ID,
            &self.socket,
            "vhost-user-fs-pci",
            &format!("tag={TAG},queue-size={QUEUE_SIZE}"),
        )
    }

    fn kernel_args(&self) -> Vec<String> {
        vec![self.guest_cmdline.clone()]
    }

    fn stopped(&self) -> Option<String> {
        self.daemon.stopped()
    }

    fn metrics(&self) -> DeviceMetrics {
        let share = self.share.clone();
        DeviceMetrics {
            kind: ENTRY.kind,
            id: self.id(),
            disk: None,
            samples: Arc::new(move || share_samples(&share)),
            stages: Vec::new(),
        }
    }

    fn finish(self: Box<Self>) -> DeviceReport {
        DeviceReport {
            share: Some(self.share.info()),
            error: self.daemon.stop(ID),
            ..DeviceReport::default()
        }
    }
}

/// The share's size and use as metric samples (names in docs/metrics.md).
fn share_samples(share: &Share) -> Vec<Sample> {
    let i = share.info();
    vec![
        Sample::gauge(
            "share_size_bytes",
            "Size limit of the VM's shared in-memory file system.",
            i.size_bytes,
        ),
        Sample::gauge(
            "share_used_bytes",
            "Bytes in use in the VM's shared in-memory file system.",
            i.used_bytes,
        ),
        Sample::gauge(
            "share_files",
            "Files and directories in the VM's shared in-memory file system.",
            i.files,
        ),
        Sample::counter(
            "share_resizes_total",
            "Resizes of the VM's shared in-memory file system.",
            i.resizes,
        ),
    ]
}
