//! Hylics vsock requests, one JSON object per line from the guest.
//! See docs/fuzzing.md; the stable driver is `crates/launcher/tests/fuzz_hylics_request.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_launcher::fuzzing::hylics_request(data);
});
