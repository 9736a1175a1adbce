//! A dedup volume whose metadata file was damaged, opened and read back.
//! See docs/fuzzing.md; the stable driver is `crates/dedup/tests/fuzz_dedup_metadata.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_dedup::fuzzing::dedup_metadata(data);
});
