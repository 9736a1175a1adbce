//! Guest and peer Ethernet frames through the NIC's flow table and FoxyVegas.
//! See docs/fuzzing.md; the stable driver is `crates/netdev/tests/fuzz_virtio_net_frames.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_netdev::fuzzing::virtio_net_frames(data);
});
