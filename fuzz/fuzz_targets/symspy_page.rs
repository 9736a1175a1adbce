//! The guest module's SymSpy page, as vmsight reads a stable copy of it.
//! See docs/fuzzing.md; the stable driver is `crates/launcher/tests/fuzz_symspy_page.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_launcher::fuzzing::symspy_page(data);
});
