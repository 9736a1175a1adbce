//! virtio-blk descriptor chains through the queue and the request parser.
//! See docs/fuzzing.md; the stable driver is `crates/blockdev/tests/fuzz_virtio_blk_request.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_blockdev::fuzzing::virtio_blk_request(data);
});
