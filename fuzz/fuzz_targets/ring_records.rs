//! The plugin channel: pushes, scribbles and re-attaches, then the trace session decodes the rings.
//! See docs/fuzzing.md; the stable driver is `crates/launcher/tests/fuzz_ring_records.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_launcher::fuzzing::ring_records(data);
});
