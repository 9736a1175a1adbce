//! vmsight's network device: a vhost-user-net backend that moves frames between the guest's
//! virtqueues and a tap, through a pipeline of packet stages (flow metrics, capture,
//! FoxyVegas).
//!
//! Data path (one worker thread per device):
//! ```text
//!  guest TX queue -> validate chain -> Frame -> stages (first..last) -> tap write
//!  tap read -> validate -> Frame -> stages (last..first) -> guest RX buffers (mergeable)
//! ```
//! The virtio-net header travels with each frame unchanged between the guest and the tap
//! (`IFF_VNET_HDR`), so checksum and TSO offloads are handled end to end by the two kernels.

mod device;
pub mod error;
pub mod fuzzing;
pub mod metrics;
pub mod packet;
pub mod stage;
pub mod stages;
pub mod tap;

use std::path::Path;
use std::sync::Arc;

use tracing::info;
use vmm_sys_util::epoll::EventSet;

pub use device::{Offloads, NUM_QUEUES, RX_QUEUE, TX_QUEUE};
pub use error::NetError;
pub use metrics::{NetMetrics, NetSnapshot};
pub use packet::{Direction, Frame, TcpSegment, VnetHdr};
pub use stage::{NetPipeline, NetStage, Verdict};
pub use tap::Tap;

use device::{NetDevice, TAP_EVENT, TICK_EVENT};

/// Default (and largest accepted) virtqueue size.
pub const DEFAULT_QUEUE_SIZE: u16 = 256;

/// One NIC to serve.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Name in logs and thread names (`net0`).
    pub id: String,
    /// Largest virtqueue size accepted (QEMU's `rx_queue_size`/`tx_queue_size` must not
    /// exceed it).
    pub queue_size: u16,
    /// Offer checksum and segmentation offloads.
    pub offloads: Offloads,
}

impl NetConfig {
    /// A NIC with offloads and 256-entry queues.
    pub fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            queue_size: DEFAULT_QUEUE_SIZE,
            offloads: Offloads { enabled: true },
        }
    }
}

/// A NIC being served.
#[derive(Debug)]
pub struct NetHandle {
    served: vmsight_vhostd::Served,
    metrics: Arc<NetMetrics>,
    tap: String,
    stages: Vec<&'static str>,
}

impl NetHandle {
    /// Live counters.
    pub fn metrics(&self) -> Arc<NetMetrics> {
        self.metrics.clone()
    }

    /// The tap's interface name.
    pub fn tap_name(&self) -> &str {
        &self.tap
    }

    /// The stages in pipeline order.
    pub fn stage_names(&self) -> &[&'static str] {
        &self.stages
    }

    /// Whether the serving thread has ended (QEMU disconnected or a stop).
    pub fn is_finished(&self) -> bool {
        self.served.is_finished()
    }

    /// Asks the backend to stop; returns at once.
    pub fn shutdown(&self) {
        self.served.stop();
    }

    /// Once QEMU is gone: stops waiting for it if it never connected, so that
    /// [`wait`](Self::wait) returns.
    pub fn frontend_gone(&self) {
        self.served.stop_if_never_connected();
    }

    /// Waits for the backend to end (stages are finished: captures flushed).
    pub fn wait(mut self) -> Result<(), NetError> {
        self.served.join().map_err(|e| NetError::Daemon {
            path: self.served.socket().to_owned(),
            reason: e.to_string(),
        })
    }
}

impl Drop for NetHandle {
    fn drop(&mut self) {
        if !self.served.joined() {
            self.served.stop();
            let _ = self.served.join();
        }
    }
}

/// Binds `socket` (QEMU can connect when this returns) and serves the NIC on `tap` through
/// `pipeline` in a background thread.
pub fn spawn_net_backend(
    cfg: &NetConfig,
    socket: &Path,
    tap: Tap,
    pipeline: NetPipeline,
) -> Result<NetHandle, NetError> {
    if !cfg.queue_size.is_power_of_two() || cfg.queue_size < 4 {
        return Err(NetError::Daemon {
            path: socket.to_owned(),
            reason: format!(
                "queue_size is {}; it must be a power of two between 4 and 32768",
                cfg.queue_size
            ),
        });
    }
    let metrics = Arc::new(NetMetrics::default());
    let stages = pipeline.names();
    let tap_name = tap.name().to_owned();
    let device = Arc::new(
        NetDevice::new(tap, cfg.offloads, cfg.queue_size, pipeline, metrics.clone()).map_err(
            |e| NetError::Daemon {
                path: socket.to_owned(),
                reason: format!("cannot create the tick timer: {e}"),
            },
        )?,
    );
    let tap_fd = device.tap_fd();
    let tick_fd = device.tick_fd();
    let finisher = device.clone();
    let served = vmsight_vhostd::serve(
        &format!("vmsight-{}", cfg.id),
        device,
        socket,
        vmsight_vhostd::Connection::Relay,
        |daemon| {
            let handlers = daemon.get_epoll_handlers();
            let h = handlers.first().ok_or("the daemon has no worker")?;
            h.register_listener(
                tap_fd,
                EventSet::IN | EventSet::EDGE_TRIGGERED,
                u64::from(TAP_EVENT),
            )
            .map_err(|e| format!("cannot watch the tap: {e}"))?;
            h.register_listener(tick_fd, EventSet::IN, u64::from(TICK_EVENT))
                .map_err(|e| format!("cannot watch the tick timer: {e}"))
        },
        move || finisher.finish(),
    )
    .map_err(|e| match e {
        vmsight_vhostd::ServeError::SocketInUse { path } => NetError::SocketInUse { path },
        other => NetError::Daemon {
            path: socket.to_owned(),
            reason: other.to_string(),
        },
    })?;
    info!(
        socket = %socket.display(),
        tap = %tap_name,
        stages = ?stages,
        offloads = cfg.offloads.enabled,
        "vhost-user-net backend listening"
    );
    Ok(NetHandle {
        served,
        metrics,
        tap: tap_name,
        stages,
    })
}
