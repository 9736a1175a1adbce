//! The swap region fuzz target on stable Rust: the committed corpus, then proptest over
//! mutations and random inputs from a fresh seed (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_proto::sym::swapr::{Layout, SLOT_MAPPED, STATE_SHIFT};
use vmsight_proto::sym::SWAPHDR;
use vmsight_swap::fuzzing::{
    encode_swap, swap_region, SwapOp, SWAP_CACHE_READ, SWAP_CACHE_WRITE, SWAP_CORRUPT,
    SWAP_EVICTED, SWAP_FILE_WRITE, SWAP_REFUSED,
};

const TARGET: &str = "swap_region";
const ALL: u32 = SWAP_CACHE_READ
    | SWAP_CACHE_WRITE
    | SWAP_FILE_WRITE
    | SWAP_CORRUPT
    | SWAP_EVICTED
    | SWAP_REFUSED;

/// The seeds' disk: 16 pages, at most 4 slots (the input's bytes 14 and 3).
const PAGES: u8 = 14;
const SLOTS: u8 = 3;

fn layout() -> Layout {
    Layout::new(2 + u64::from(PAGES), 1 + u64::from(SLOTS)).expect("layout")
}

fn write(page: u16, tag: u8) -> SwapOp {
    SwapOp::Write { page, tag }
}

fn read(page: u16) -> SwapOp {
    SwapOp::Read { page }
}

/// The guest writes the 32-bit `value` at region byte `off`.
fn word(off: u64, value: u32) -> SwapOp {
    SwapOp::Word {
        word: (off / 4) as u32,
        value,
    }
}

/// The guest writes slot `slot`'s state word (`state`, `page`).
fn meta(slot: u64, state: u64, page: u32) -> Vec<SwapOp> {
    let off = layout().meta_off + slot * 8;
    vec![
        word(off, page),
        word(off + 4, (state << (STATE_SHIFT - 32)) as u32),
    ]
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let l = layout();
    let hdr = |f: &str| SWAPHDR.at(f) as u64;
    let fill: Vec<SwapOp> = (0..5).map(|p| write(p, p as u8 + 1)).collect();
    let mut plain = fill.clone();
    plain.extend((0..6).map(read));
    plain.extend([SwapOp::Discard { page: 1 }, read(1), write(1, 9), read(1)]);
    let mut resize = fill.clone();
    resize.extend([
        SwapOp::Evict { want: 3 },
        SwapOp::Resize { pages: 1 },
        SwapOp::Trim { max: 7 },
        SwapOp::Resize { pages: SLOTS + 2 },
        SwapOp::Resize { pages: 4 },
        write(7, 7),
        read(0),
    ]);
    let mut index = fill.clone();
    index.extend([
        word(l.index_off, 99),
        read(0),
        word(l.index_off + 4, 3),
        read(1),
        word(hdr("free_top"), 1000),
        write(9, 9),
        SwapOp::Discard { page: 2 },
    ]);
    index.extend(meta(2, 7, 2));
    index.extend([read(2), write(2, 2)]);
    let mut stack = vec![SwapOp::Resize { pages: 2 }];
    stack.extend([word(l.stack_off, 7777), write(3, 3), write(4, 4), read(3)]);
    let mut far = fill[..2].to_vec();
    far.extend(meta(0, SLOT_MAPPED, u32::MAX));
    far.extend([SwapOp::Evict { want: 4 }, read(0), write(0, 1)]);
    let tail = l.region_size - 64;
    let scribbles = vec![
        SwapOp::Scribble {
            offset: 0,
            bytes: vec![0xff; 200],
        },
        write(1, 1),
        SwapOp::Scribble {
            offset: tail as u32,
            bytes: vec![0xee; 100],
        },
        read(1),
        SwapOp::Evict { want: 1 },
    ];
    let beyond = vec![
        write(u16::MAX, 1),
        read(u16::from(PAGES) + 3),
        SwapOp::Discard { page: 16 },
        write(15, 5),
    ];
    let enc = |ops: &[SwapOp]| encode_swap(PAGES, SLOTS, 4, ops);
    vec![
        ("writes-reads-discards", enc(&plain)),
        ("evict-resize-trim", enc(&resize)),
        ("scribbled-index-and-states", enc(&index)),
        ("scribbled-free-stack", enc(&stack)),
        ("mapped-slot-claims-a-far-page", enc(&far)),
        ("scribbled-header-and-padding", enc(&scribbles)),
        ("pages-beyond-the-disk", enc(&beyond)),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), swap_region);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_keep_every_access_inside_the_region_and_the_disk() {
    driver::corpus_and_mutations(TARGET, swap_region, ALL, ALL, 20_000, 4096);
}
