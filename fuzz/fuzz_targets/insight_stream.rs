//! Syscall events and block requests through the insight engine.
//! See docs/fuzzing.md; the stable driver is `crates/insight/tests/fuzz_insight_stream.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_insight::fuzzing::insight_stream(data);
});
