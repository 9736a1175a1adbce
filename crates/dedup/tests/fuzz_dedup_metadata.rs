//! The dedup metadata fuzz target on stable Rust: the committed corpus, then proptest over
//! mutations and random inputs from a fresh seed (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_dedup::format::JOURNAL_LIST;
use vmsight_dedup::fuzzing::{
    dedup_metadata, encode_dedup, l2p_word, MetaOp, DD_CLEAN, DD_CORRUPT, DD_NOT_VOLUME,
    DD_PROBLEMS, DD_REPLAYED,
};

const TARGET: &str = "dedup_metadata";
const ALL: u32 = DD_NOT_VOLUME | DD_CORRUPT | DD_CLEAN | DD_PROBLEMS | DD_REPLAYED;

const EMPTY: u8 = 0;
const CHECKPOINTED: u8 = 1;
const JOURNAL: u8 = 2;

fn word(area: u8, page: u16, word: u16, value: u64) -> MetaOp {
    MetaOp::Word {
        area,
        page,
        word,
        value,
    }
}

fn superblock(slot: u8, logical: u16, physical: u32, buckets: u16, generation: u64) -> MetaOp {
    MetaOp::Superblock {
        slot,
        logical,
        physical,
        buckets,
        generation,
    }
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let (page, w) = l2p_word(3);
    let scribble = |page: u16| MetaOp::Scribble {
        page,
        offset: 0,
        bytes: vec![0xff; 64],
    };
    // 512 logical blocks, 768 chunks, 16 index pages: 521 metadata pages.
    let regrown = vec![
        superblock(0, 256, 768, 16, 50),
        superblock(1, 256, 768, 16, 51),
        MetaOp::Resize {
            data: false,
            pages: 521,
        },
        MetaOp::Resize {
            data: true,
            pages: 768,
        },
    ];
    vec![
        ("empty-volume", encode_dedup(EMPTY, &[])),
        ("checkpointed-volume", encode_dedup(CHECKPOINTED, &[])),
        ("commits-in-the-journal", encode_dedup(JOURNAL, &[])),
        (
            "map-entry-beyond-the-chunks",
            encode_dedup(CHECKPOINTED, &[word(2, page, w, 1_000_000)]),
        ),
        (
            "both-superblocks-scribbled",
            encode_dedup(CHECKPOINTED, &[scribble(0), scribble(1)]),
        ),
        (
            "resealed-journal-names-a-superblock",
            encode_dedup(
                JOURNAL,
                &[word(1, 0, JOURNAL_LIST as u16 / 8, 0), MetaOp::Reseal],
            ),
        ),
        (
            "reference-counts-zeroed",
            encode_dedup(CHECKPOINTED, &[word(3, 0, 0, 0)]),
        ),
        (
            "superblocks-disagree",
            encode_dedup(CHECKPOINTED, &[superblock(0, 744, 2000, 20, 100)]),
        ),
        ("another-geometry", encode_dedup(CHECKPOINTED, &regrown)),
        (
            "truncated-metadata-file",
            encode_dedup(
                JOURNAL,
                &[MetaOp::Resize {
                    data: false,
                    pages: 100,
                }],
            ),
        ),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), dedup_metadata);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_open_a_consistent_volume_or_say_why_not() {
    driver::corpus_and_mutations(TARGET, dedup_metadata, ALL, ALL, 30_000, 4096);
}
