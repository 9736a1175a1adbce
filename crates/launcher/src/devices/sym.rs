//! `ivshmem-doorbell`: the symbiotic interface's device (`--symbiotic`, docs/symbiotic.md).
//! vmsight serves the ivshmem protocol on `<rt>/sym.sock` and owns the shared region; QEMU
//! gets the device, the fw_cfg item announcing the interface, and the guest a kernel
//! parameter that makes its init load the module `vmsight_sym`.

use std::sync::Arc;

use vmsight_proto::layout::SYM_SOCKET;
use vmsight_proto::sym::FW_CFG_NAME;

use super::{Device, DeviceEntry, DeviceEnv, DeviceMetrics, DeviceReport};
use crate::error::LaunchError;
use crate::stages::Sample;
use crate::sym::serve::Server;
use crate::sym::{Symbiotic, DEVICE_VECTORS};

pub static ENTRY: DeviceEntry = DeviceEntry {
    kind: "ivshmem-doorbell",
    start,
};

/// QEMU's ids of the chardev and the device.
const CHARDEV: &str = "sym0";
const ID: &str = "sym0dev";
/// The guest init loads the module when it sees this on the kernel command line.
pub const KERNEL_ARG: &str = "vmsight.sym=1";

/// The running device.
pub struct SymDevice {
    sym: Arc<Symbiotic>,
    server: Option<Server>,
    socket: std::path::PathBuf,
}

fn start(env: &DeviceEnv<'_>) -> Result<Vec<Box<dyn Device>>, LaunchError> {
    let Some(sym) = env.sym else {
        return Ok(Vec::new());
    };
    let socket = env.prep.rt.join(SYM_SOCKET);
    let server = Server::start(sym.clone(), &socket).map_err(|e| {
        LaunchError::Config(format!(
            "VM {}: cannot listen on {}: {e}",
            env.cfg.name,
            socket.display()
        ))
    })?;
    Ok(vec![Box::new(SymDevice {
        sym: sym.clone(),
        server: Some(server),
        socket,
    })])
}

impl Device for SymDevice {
    fn kind(&self) -> &'static str {
        ENTRY.kind
    }

    fn id(&self) -> String {
        ID.into()
    }

    fn qemu_args(&self) -> Vec<String> {
        vec![
            "-chardev".into(),
            format!("socket,id={CHARDEV},path={}", self.socket.display()),
            "-device".into(),
            format!("ivshmem-doorbell,id={ID},chardev={CHARDEV},vectors={DEVICE_VECTORS}"),
            "-fw_cfg".into(),
            format!("name={FW_CFG_NAME},string={}", self.sym.announcement()),
        ]
    }

    fn kernel_args(&self) -> Vec<String> {
        vec![KERNEL_ARG.into()]
    }

    fn stopped(&self) -> Option<String> {
        self.server.as_ref().and_then(Server::stopped)
    }

    fn metrics(&self) -> DeviceMetrics {
        let sym = self.sym.clone();
        DeviceMetrics {
            kind: ENTRY.kind,
            id: ID.into(),
            disk: None,
            samples: Arc::new(move || samples(&sym)),
            stages: Vec::new(),
        }
    }

    fn finish(mut self: Box<Self>) -> DeviceReport {
        self.sym.shutdown();
        let error = self.server.take().and_then(Server::finish);
        DeviceReport {
            sym: Some(self.sym.counters()),
            error,
            ..DeviceReport::default()
        }
    }
}

fn samples(sym: &Symbiotic) -> Vec<Sample> {
    let c = sym.counters();
    let s = |name: &'static str, help: &'static str, v: u64| Sample::counter(name, help, v);
    vec![
        s(
            "sym_calls_doorbell_total",
            "symcalls answered over the doorbell transport",
            c.calls_doorbell,
        ),
        s(
            "sym_calls_sync_total",
            "symcalls answered over the synchronous transport",
            c.calls_sync,
        ),
        s(
            "sym_sync_wakes_idle_total",
            "guest wakes rung at once for a synchronous call: every vCPU was halted",
            c.sync_wakes_idle,
        ),
        s(
            "sym_sync_wakes_user_total",
            "guest wakes rung at once for a synchronous call: no vCPU was in the kernel",
            c.sync_wakes_user,
        ),
        s(
            "sym_sync_wakes_waited_total",
            "guest wakes rung for a synchronous call no running vCPU took in time",
            c.sync_wakes_waited,
        ),
        s(
            "sym_timeouts_total",
            "symcalls the guest did not answer in time",
            c.timeouts,
        ),
        s(
            "sym_doorbells_spurious_total",
            "guest doorbells that matched no call",
            c.doorbells_spurious,
        ),
        s(
            "sym_spy_problems_total",
            "problems found in the guest's SymSpy page",
            c.spy_problems,
        ),
    ]
}
