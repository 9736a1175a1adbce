//! The VM's network: what `--net`, `--net-pcap` and `--foxyvegas` ask for ([`NetSettings`]),
//! the host side ([`host`]: namespace, tap, bridge) and the packet stage registry
//! ([`stages`]). The device itself is `crate::devices::net`.

pub mod host;
pub mod spec;
pub mod stages;

use std::path::PathBuf;

pub use spec::{NetMode, NetSpec, NetSpecError, NicDevice};
use vmsight_netdev::stages::foxyvegas::FoxyVegasConfig;

/// The VM's NIC and its packet stages.
#[derive(Debug, Clone)]
pub struct NetSettings {
    pub spec: NetSpec,
    /// `--net-pcap FILE`: capture every frame, both directions.
    pub pcap: Option<PathBuf>,
    /// `--foxyvegas[=alpha,beta,gamma]`.
    pub foxyvegas: Option<FoxyVegasConfig>,
    /// `--foxyvegas-log FILE`: one JSON line per rewritten ACK.
    pub foxyvegas_log: Option<PathBuf>,
}

impl Default for NetSettings {
    fn default() -> Self {
        Self {
            spec: NetSpec::none(),
            pcap: None,
            foxyvegas: None,
            foxyvegas_log: None,
        }
    }
}

impl NetSettings {
    /// Whether the VM gets a NIC.
    pub fn enabled(&self) -> bool {
        self.spec.mode != NetMode::None
    }
}
