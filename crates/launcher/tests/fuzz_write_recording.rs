//! The write-recording reader and `vmsight replay` fuzz target on stable Rust: the committed
//! corpus, then fixed-seed proptest over mutations and random inputs (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_blockdev::tap::{TapEvent, TapKind};
use vmsight_launcher::fuzzing::{
    encode_recording, write_recording, BASE_IMAGE_SIZE, READ_ALL, READ_REFUSED, REFUSED_BEYOND,
    REFUSED_DAMAGED, REPLAYED,
};

const TARGET: &str = "write_recording";
const ALL: u32 = READ_ALL | READ_REFUSED | REPLAYED | REFUSED_BEYOND | REFUSED_DAMAGED;

fn events(kinds: Vec<TapKind>) -> Vec<TapEvent> {
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| TapEvent {
            seq: i as u64 + 1,
            observed_ns: 1_000 * i as u64,
            kind,
        })
        .collect()
}

fn write(offset: u64, data: Vec<u8>) -> TapKind {
    TapKind::Write {
        offset,
        len: data.len() as u64,
        data: Some(data),
    }
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let good = encode_recording(&events(vec![
        write(1 << 20, vec![0x5a; 4096]),
        TapKind::WriteZeroes {
            offset: (1 << 20) + 4096,
            len: 8192,
        },
        TapKind::Discard {
            offset: BASE_IMAGE_SIZE - 4096,
            len: 4096,
        },
        write(1024, vec![0; 512]),
        TapKind::Flush,
    ]));
    let mut truncated = good.clone();
    truncated.truncate(good.len() - 40);
    let mut huge_write = encode_recording(&events(vec![TapKind::Flush]));
    huge_write.extend_from_slice(&encode_recording(&events(vec![write(0, vec![1; 8])]))[8..]);
    let len_at = huge_write.len() - 8 - 8;
    huge_write[len_at..len_at + 8].copy_from_slice(&(1u64 << 29).to_le_bytes());
    let mut unknown_kind = good.clone();
    unknown_kind[8] = 9;
    vec![
        ("replayable", good),
        ("cut-inside-a-frame", truncated),
        (
            "write-zeroes-past-the-image",
            encode_recording(&events(vec![
                TapKind::Flush,
                TapKind::WriteZeroes {
                    offset: 4096,
                    len: u64::MAX - 4095,
                },
            ])),
        ),
        (
            "discard-overflowing",
            encode_recording(&events(vec![TapKind::Discard {
                offset: u64::MAX - 10,
                len: 100,
            }])),
        ),
        (
            "write-without-bytes",
            encode_recording(&events(vec![TapKind::Write {
                offset: 0,
                len: 4096,
                data: None,
            }])),
        ),
        ("claims-a-512-mib-write", huge_write),
        ("unknown-kind", unknown_kind),
        ("not-a-recording", b"VMSWREC0".to_vec()),
        ("empty-recording", encode_recording(&[])),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), write_recording);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_neither_panic_nor_replay_a_damaged_recording() {
    driver::corpus_and_mutations(TARGET, write_recording, ALL, ALL, 10_000, 512);
}
