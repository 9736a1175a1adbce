//! The SymSpy page fuzz target on stable Rust: the committed corpus, then proptest over
//! mutations and random inputs from a fresh seed (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_launcher::fuzzing::{
    encode_spy, symspy_page, SpyOp, SPY_CLEAN, SPY_CPUS, SPY_PROBLEMS, SPY_REFUSED, SPY_SWAPS,
};
use vmsight_proto::sym::{CPU, GUEST, SWAP};

const TARGET: &str = "symspy_page";
const ALL: u32 = SPY_REFUSED | SPY_CLEAN | SPY_PROBLEMS | SPY_CPUS | SPY_SWAPS;

/// Writes `value` (`width` bytes) at the page offset `at`.
fn put(at: usize, width: u8, value: u64) -> SpyOp {
    SpyOp::Write {
        offset: at as u16,
        width,
        value,
    }
}

/// A guest field by name.
fn field(name: &str, width: u8, value: u64) -> SpyOp {
    put(GUEST.field(name).offset, width, value)
}

fn text(at: usize, s: &[u8]) -> SpyOp {
    SpyOp::Scribble {
        offset: at as u16,
        bytes: s.to_vec(),
    }
}

/// vCPU `i`'s task entry: its sequence, pid and command name.
fn cpu(i: usize, seq: u32, pid: u32, comm: &[u8]) -> Vec<SpyOp> {
    let base = GUEST.field("cpus").offset + i * CPU.size;
    vec![
        put(base + CPU.field("seq").offset, 4, u64::from(seq)),
        put(base + CPU.field("pid").offset, 4, u64::from(pid)),
        put(base + CPU.field("tgid").offset, 4, u64::from(pid)),
        text(base + CPU.field("comm").offset, comm),
    ]
}

/// Swap device `i`: size, use and path.
fn swap(i: usize, size: u64, used: u64, path: &[u8]) -> Vec<SpyOp> {
    let base = GUEST.field("swaps").offset + i * SWAP.size;
    vec![
        put(base + SWAP.field("size_kib").offset, 8, size),
        put(base + SWAP.field("used_kib").offset, 8, used),
        text(base + SWAP.field("path").offset, path),
    ]
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let strings = vec![
        text(GUEST.field("release").offset, b"6.1.0-56-cloud-amd64\0"),
        text(GUEST.field("version").offset, b"#1 SMP PREEMPT_DYNAMIC\0"),
        field("mem_total_kib", 8, 1 << 20),
        field("mem_free_kib", 8, 1 << 19),
        field("mem_available_kib", 8, 600_000),
    ];
    let mut full = vec![field("nr_cpus", 4, 2), field("nr_swap", 4, 1)];
    full.extend(strings.clone());
    full.extend(cpu(0, 2, 1, b"init\0"));
    full.extend(cpu(1, 4, 321, b"sh\0"));
    full.extend(swap(0, 1 << 20, 4096, b"/dev/vdb\0"));
    let mut problems = vec![field("nr_cpus", 4, 1000), field("nr_swap", 4, 99)];
    problems.extend([
        field("mem_total_kib", 8, 10),
        field("mem_free_kib", 8, 20),
        field("swap_total_kib", 8, 1),
        field("swap_free_kib", 8, 5),
        text(GUEST.field("release").offset, &[0xff; 64]),
    ]);
    problems.extend(swap(0, 1, 2, b"/dev/\xff\0"));
    let mut torn = vec![field("nr_cpus", 4, 2)];
    torn.extend(cpu(0, 3, 7, b"torn\0"));
    torn.extend(cpu(1, 0, 8, b"unwritten\0"));
    vec![
        ("full-page", encode_spy(1, 0, &full)),
        ("minimal-page", encode_spy(1, 0, &[field("nr_cpus", 4, 1)])),
        ("bounded-problems", encode_spy(1, 0, &problems)),
        ("torn-and-unwritten-cpus", encode_spy(1, 0, &torn)),
        ("bad-magic", encode_spy(0, 0, &[field("nr_cpus", 4, 1)])),
        ("short-page", encode_spy(3, 100, &full)),
        (
            "other-interface-version",
            encode_spy(1, 0, &[field("abi", 4, 999)]),
        ),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), symspy_page);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_neither_panic_nor_break_the_readers_promises() {
    driver::corpus_and_mutations(TARGET, symspy_page, ALL, ALL, 500_000, 4096);
}
