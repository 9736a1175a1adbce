//! The virtio-blk request fuzz target on stable Rust: the committed corpus, then fixed-seed
//! proptest over mutations and random inputs (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_blockdev::fuzzing::{
    seeds, virtio_blk_request, REJECTED, UNUSABLE, VALID, VALID_RANGES,
};

const TARGET: &str = "virtio_blk_request";
const ALL: u32 = VALID | REJECTED | UNUSABLE | VALID_RANGES;

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), virtio_blk_request);
    assert_eq!(seen, ALL, "outcomes reached by the seeds");
}

#[test]
fn corpus_and_mutations_neither_panic_nor_break_the_parsers_promises() {
    driver::corpus_and_mutations(TARGET, virtio_blk_request, ALL, ALL, 800_000, 2048);
}
