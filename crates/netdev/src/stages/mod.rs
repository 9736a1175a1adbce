//! The packet stages vmsight ships. Each is one module; the launcher's net stage registry
//! (`vmsight_launcher::netstages`) decides which run on a device and in which order.

pub mod flows;
pub mod foxyvegas;
pub mod pcap;
pub mod steer;
