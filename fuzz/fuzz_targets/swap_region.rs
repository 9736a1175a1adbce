//! The swap region shared with the guest module, scribbled by the guest between vmsight's
//! operations. See docs/fuzzing.md; the stable driver is `crates/swap/tests/fuzz_swap_region.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_swap::fuzzing::swap_region(data);
});
