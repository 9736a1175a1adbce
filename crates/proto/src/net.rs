//! How a VM's NIC is attached, written by `vmsight run` to `net.json` and read by
//! `vmsight net` (exec in the VM's namespace, info).

use serde::{Deserialize, Serialize};

/// The NIC of a running VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetInfo {
    /// `isolated`, `tap` or `bridge`.
    pub mode: String,
    /// The network namespace vmsight made for the VM (`ip netns` name), in isolated mode.
    pub netns: Option<String>,
    /// The tap carrying the NIC's frames on the host side.
    pub tap: String,
    /// The bridge the tap is attached to (bridge mode).
    pub bridge: Option<String>,
    /// The guest's MAC address.
    pub mac: String,
    pub mtu: u16,
    /// The host end's address with prefix (`10.0.2.1/24`), when vmsight assigned one.
    pub host_addr: Option<String>,
    /// The guest's address with prefix, when vmsight configured one.
    pub guest_addr: Option<String>,
    /// The guest's default gateway.
    pub gateway: Option<String>,
    /// Checksum and segmentation offloads offered to the guest.
    pub offloads: bool,
    /// Packet stages in pipeline order.
    pub stages: Vec<String>,
}
