//! The packet stage registry: every stage vmsight can put in a NIC's pipeline, in one table.
//!
//! Like the block registry (`crate::stages`): an entry names the stage, places it (`position`,
//! lower first: frames from the guest visit stages in increasing position, frames to the guest
//! in decreasing position), builds it from the VM configuration (or returns `None` when the VM
//! does not ask for it) and hands back what it reports. Adding a stage: a `NetStage` in
//! `vmsight_netdev::stages`, an entry here, listed in [`NET_STAGES`]. See ARCHITECTURE.md,
//! "Where to add a packet stage".

use std::sync::Arc;

use vmsight_netdev::stages::flows::{FlowMetrics, Flows, FlowsConfig, FlowsSnapshot};
use vmsight_netdev::stages::foxyvegas::{FoxyVegas, FoxyVegasMetrics, FoxyVegasSnapshot};
use vmsight_netdev::stages::pcap::{PcapConfig, PcapMetrics, PcapSnapshot, PcapStage};
use vmsight_netdev::stages::steer::{Steer, SteerControl, SteerSnapshot};
use vmsight_netdev::NetStage;

use super::NetSettings;
use crate::error::LaunchError;
use crate::stages::{Sample, Snapshotting, StageMetrics};

/// One registry entry.
pub struct NetStageEntry {
    pub name: &'static str,
    pub position: u16,
    pub summary: &'static str,
    pub build: fn(&NetCtx<'_>) -> Result<Option<BuiltNetStage>, LaunchError>,
}

/// What an entry may look at.
pub struct NetCtx<'a> {
    pub vm: &'a str,
    pub net: &'a NetSettings,
    /// Hylics' steering table (the socket scheme), when the VM has a share.
    pub steer: Option<&'a Arc<SteerControl>>,
}

/// A stage built for one NIC.
pub struct BuiltNetStage {
    pub stage: Box<dyn NetStage>,
    pub metrics: Option<Arc<dyn StageMetrics>>,
}

/// Every packet stage vmsight knows.
pub static NET_STAGES: &[&NetStageEntry] = &[&FLOWS, &PCAP, &FOXYVEGAS, &HYLICS_STEER];

/// Finds an entry by name.
pub fn entry(name: &str) -> Option<&'static NetStageEntry> {
    NET_STAGES.iter().copied().find(|e| e.name == name)
}

/// Builds the NIC's pipeline: the stages that apply, in position order.
#[allow(clippy::type_complexity)]
pub fn build(
    ctx: &NetCtx<'_>,
) -> Result<
    Vec<(
        &'static str,
        Box<dyn NetStage>,
        Option<Arc<dyn StageMetrics>>,
    )>,
    LaunchError,
> {
    let mut entries: Vec<&NetStageEntry> = NET_STAGES.to_vec();
    entries.sort_by_key(|e| e.position);
    let mut out = Vec::new();
    for e in entries {
        if let Some(b) = (e.build)(ctx)? {
            out.push((e.name, b.stage, b.metrics));
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// flows: per-flow counters, always on.

static FLOWS: NetStageEntry = NetStageEntry {
    name: "flows",
    position: 10,
    summary: "per-flow frames, bytes, segments and retransmissions (always on)",
    build: |_| {
        let (stage, metrics) = Flows::new(FlowsConfig::default());
        Ok(Some(BuiltNetStage {
            stage: Box::new(stage),
            metrics: Some(Arc::new(FlowReport(metrics))),
        }))
    },
};

struct FlowReport(Arc<FlowMetrics>);

impl Snapshotting for FlowReport {
    type Snapshot = FlowsSnapshot;
    const KEY: &'static str = "flows";

    fn take(&self) -> FlowsSnapshot {
        self.0.snapshot()
    }

    fn line(s: &FlowsSnapshot) -> String {
        format!(
            "flows: {} seen ({} active, {} expired, {} evicted); {} TCP retransmissions from the guest; {} non-IP, {} malformed frames",
            s.flows_total, s.flows_active, s.expired, s.evicted, s.retransmissions, s.non_ip_frames, s.malformed_frames
        )
    }

    fn samples_of(s: &FlowsSnapshot) -> Vec<Sample> {
        vec![
            Sample::counter("net_flows_total", "Flows seen by the NIC.", s.flows_total),
            Sample::gauge(
                "net_flows_active",
                "Flows in the NIC's flow table.",
                s.flows_active,
            ),
            Sample::counter(
                "net_tcp_retransmissions_total",
                "TCP segments the guest sent again.",
                s.retransmissions,
            ),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// pcap: `--net-pcap FILE`.

static PCAP: NetStageEntry = NetStageEntry {
    name: "pcap",
    position: 20,
    summary: "capture of every frame as the guest sends and receives it (--net-pcap FILE)",
    build: |ctx| {
        let Some(path) = &ctx.net.pcap else {
            return Ok(None);
        };
        let (stage, metrics) =
            PcapStage::create(PcapConfig::new(path)).map_err(|e| LaunchError::Net {
                vm: ctx.vm.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Some(BuiltNetStage {
            stage: Box::new(stage),
            metrics: Some(Arc::new(PcapReport(metrics))),
        }))
    },
};

struct PcapReport(Arc<PcapMetrics>);

impl Snapshotting for PcapReport {
    type Snapshot = PcapSnapshot;
    const KEY: &'static str = "pcap";

    fn take(&self) -> PcapSnapshot {
        self.0.snapshot()
    }

    fn line(s: &PcapSnapshot) -> String {
        format!(
            "pcap {}: {} frames captured, {} skipped, {} write errors",
            s.path, s.frames_captured, s.frames_skipped, s.write_errors
        )
    }

    fn samples_of(s: &PcapSnapshot) -> Vec<Sample> {
        vec![Sample::counter(
            "net_pcap_frames_total",
            "Frames written to the capture file.",
            s.frames_captured,
        )]
    }
}

// ---------------------------------------------------------------------------------------------
// foxyvegas: `--foxyvegas[=alpha,beta,gamma]`.

static FOXYVEGAS: NetStageEntry = NetStageEntry {
    name: "foxyvegas",
    position: 30,
    summary: "TCP Vegas for any guest congestion control: lowers the window of ACKs to the guest (--foxyvegas)",
    build: |ctx| {
        let Some(cfg) = &ctx.net.foxyvegas else {
            return Ok(None);
        };
        let log: Option<Box<dyn std::io::Write + Send>> = match &ctx.net.foxyvegas_log {
            Some(p) => Some(Box::new(std::fs::File::create(p).map_err(|e| {
                LaunchError::Net {
                    vm: ctx.vm.to_owned(),
                    reason: format!("cannot create the FoxyVegas log {}: {e}", p.display()),
                }
            })?)),
            None => None,
        };
        let (stage, metrics) = FoxyVegas::new(cfg.clone(), log);
        Ok(Some(BuiltNetStage {
            stage: Box::new(stage),
            metrics: Some(Arc::new(FoxyVegasReport(metrics))),
        }))
    },
};

struct FoxyVegasReport(Arc<FoxyVegasMetrics>);

impl Snapshotting for FoxyVegasReport {
    type Snapshot = FoxyVegasSnapshot;
    const KEY: &'static str = "foxyvegas";

    fn take(&self) -> FoxyVegasSnapshot {
        self.0.snapshot()
    }

    fn line(s: &FoxyVegasSnapshot) -> String {
        format!(
            "foxyvegas: {} flows ({} active, {} seen mid-connection), {} RTT samples, {} of {} ACKs rewritten, min base RTT {} us",
            s.flows_total, s.flows_active, s.flows_untracked_scale, s.rtt_samples, s.rewrites, s.acks_seen, s.min_base_rtt_us
        )
    }

    fn samples_of(s: &FoxyVegasSnapshot) -> Vec<Sample> {
        vec![
            Sample::counter(
                "foxyvegas_rewrites_total",
                "ACKs to the guest whose window FoxyVegas lowered.",
                s.rewrites,
            ),
            Sample::counter(
                "foxyvegas_rtt_samples_total",
                "RTT samples taken at the device.",
                s.rtt_samples,
            ),
            Sample::gauge(
                "foxyvegas_flows_active",
                "TCP flows FoxyVegas tracks.",
                s.flows_active,
            ),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// hylics-steer: Hylics' socket scheme (a share and an isolated network on vmsight's NIC).

/// Last from the guest, first towards it: a handed-over connection's frames leave the
/// pipeline before any other stage sees them (nothing of the host's sending is counted or
/// rewritten as the guest's).
static HYLICS_STEER: NetStageEntry = NetStageEntry {
    name: "hylics-steer",
    position: 1000,
    summary: "moves a TCP connection handed over by the guest (Hylics' socket scheme) to the host's socket and back",
    build: |ctx| {
        let Some(ctl) = ctx.steer else {
            return Ok(None);
        };
        Ok(Some(BuiltNetStage {
            stage: Box::new(Steer::new(ctl.clone())),
            metrics: Some(Arc::new(SteerReport(ctl.clone()))),
        }))
    },
};

struct SteerReport(Arc<SteerControl>);

impl Snapshotting for SteerReport {
    type Snapshot = SteerSnapshot;
    const KEY: &'static str = "hylics_steer";

    fn take(&self) -> SteerSnapshot {
        self.0.snapshot()
    }

    fn line(s: &SteerSnapshot) -> String {
        format!(
            "hylics-steer: {} hand-overs; {} frames to the host socket, {} from it; {} dropped while held, {} the frozen guest sent, {} stray",
            s.handovers, s.to_host, s.from_host, s.held_drops, s.guest_drops, s.stray
        )
    }

    fn samples_of(s: &SteerSnapshot) -> Vec<Sample> {
        vec![
            Sample::counter(
                "hylics_handovers_total",
                "TCP connections the guest handed to the host (socket scheme).",
                s.handovers,
            ),
            Sample::counter(
                "hylics_handover_frames_total",
                "Frames of handed-over connections between the host socket and the peer.",
                s.to_host + s.from_host,
            ),
        ]
    }
}
