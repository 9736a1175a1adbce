//! Write recordings through the reader and `vmsight replay`.
//! See docs/fuzzing.md; the stable driver is `crates/launcher/tests/fuzz_write_recording.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_launcher::fuzzing::write_recording(data);
});
