//! ext4 images and write streams (jbd2 transactions) through the crawler and the inference engine.
//! See docs/fuzzing.md; the stable driver is `crates/fsview/tests/fuzz_ext4_journal.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmsight_fsview::fuzzing::ext4_journal(data);
});
