//! The stable-Rust driver of the fuzz targets, shared by the `tests/fuzz_*.rs` files of the
//! crates (each includes this file with `#[path]`; see docs/fuzzing.md).
//!
//! For a target it (a) runs every committed seed in `fuzz/corpus/<target>/` through the entry
//! point and (b) runs proptest over byte mutations of those seeds and over random inputs, from
//! a fresh random seed each run (so every `make test` tries new inputs). The seed is written
//! to `<target dir>/vmsight-fuzz-seeds/<target>.txt` (`make test` prints them); a failure
//! names it and saves the failing input under `<target dir>/vmsight-fuzz-failures/`, to be
//! committed to the corpus once fixed. `VMSIGHT_FUZZ_SEED=N` replays seed N,
//! `VMSIGHT_FUZZ_CASES=N` changes the number of proptest cases, and
//! `VMSIGHT_FUZZ_WRITE_SEEDS=1` rewrites the corpus from the target's seed generator.

use std::path::PathBuf;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// The committed corpus of `target`.
pub fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// The committed seeds of `target`, sorted by name; panics if there are none.
pub fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read the corpus {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let bytes = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            (name, bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "the corpus {} is empty", dir.display());
    out
}

/// A target's entry point: it panics on a broken promise and returns bits saying what the
/// input reached (target-specific), so a driver can check that the run engaged every path.
pub type Entry = fn(&[u8]) -> u32;

/// Writes the generated seeds into the corpus when `VMSIGHT_FUZZ_WRITE_SEEDS=1`, and checks
/// that each of them is committed (by name) and runs through `entry`. Returns the union of
/// the outcome bits.
pub fn check_seeds(target: &str, seeds: Vec<(&str, Vec<u8>)>, entry: Entry) -> u32 {
    let dir = corpus_dir(target);
    if std::env::var("VMSIGHT_FUZZ_WRITE_SEEDS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(&dir).expect("corpus directory");
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(name), bytes).expect("write seed");
        }
    }
    let mut seen = 0;
    for (name, bytes) in &seeds {
        seen |= entry(bytes);
        assert!(
            dir.join(name).is_file(),
            "seed {name} of {target} is not in {}: run the test with VMSIGHT_FUZZ_WRITE_SEEDS=1",
            dir.display()
        );
    }
    seen
}

/// Runs every committed seed through `entry`; returns how many and the union of the outcome
/// bits.
pub fn run_corpus(target: &str, entry: Entry) -> (usize, u32) {
    let seeds = corpus(target);
    let mut seen = 0;
    for (name, bytes) in &seeds {
        eprintln!("{target}: seed {name} ({} bytes)", bytes.len());
        seen |= entry(bytes);
    }
    (seeds.len(), seen)
}

/// One edit of a seed.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Flip bit `bit` of the byte at `at`.
    Flip { at: usize, bit: u8 },
    /// Overwrite the byte at `at`.
    Set { at: usize, byte: u8 },
    /// Overwrite 8 bytes at `at` with an interesting little-endian value.
    Word { at: usize, value: u64 },
    /// Insert bytes at `at`.
    Insert { at: usize, bytes: Vec<u8> },
    /// Remove up to `len` bytes at `at`.
    Remove { at: usize, len: usize },
    /// Copy `len` bytes from `from` over `at`.
    Copy { from: usize, at: usize, len: usize },
    /// Cut the input at `at`.
    Truncate { at: usize },
}

/// Values that break length and offset arithmetic.
const INTERESTING: [u64; 12] = [
    0,
    1,
    0x7f,
    0xff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (any::<usize>(), prop::sample::select(&INTERESTING[..]), any::<bool>()).prop_map(
            |(at, v, neg)| Mutation::Word { at, value: if neg { v.wrapping_neg() } else { v } }
        ),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..256).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => (any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(from, at, len)| Mutation::Copy { from, at, len }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

/// Applies `m` to `b` (positions wrap around the input's length).
pub fn apply(b: &mut Vec<u8>, m: &Mutation) {
    let n = b.len();
    let pos = |at: usize| if n == 0 { 0 } else { at % n };
    match m {
        Mutation::Flip { at, bit } if n > 0 => b[pos(*at)] ^= 1 << bit,
        Mutation::Set { at, byte } if n > 0 => b[pos(*at)] = *byte,
        Mutation::Word { at, value } if n > 0 => {
            let at = pos(*at);
            let len = (n - at).min(8);
            b[at..at + len].copy_from_slice(&value.to_le_bytes()[..len]);
        }
        Mutation::Insert { at, bytes } => {
            let at = if n == 0 { 0 } else { at % (n + 1) };
            b.splice(at..at, bytes.iter().copied());
        }
        Mutation::Remove { at, len } if n > 0 => {
            let at = pos(*at);
            b.drain(at..(at + len).min(n));
        }
        Mutation::Copy { from, at, len } if n > 0 => {
            let (from, at) = (pos(*from), pos(*at));
            let len = (*len).min(n - from).min(n - at);
            b.copy_within(from..from + len, at);
        }
        Mutation::Truncate { at } => b.truncate(pos(*at)),
        _ => {}
    }
}

/// The number of proptest cases: `VMSIGHT_FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("VMSIGHT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This run's proptest seed: `VMSIGHT_FUZZ_SEED` (a number) to replay one, else a fresh one
/// from the clock and the process id.
pub fn seed() -> u64 {
    if let Some(n) = std::env::var("VMSIGHT_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // splitmix64 of the time and pid: nearby starts give unrelated seeds.
    let mut z = nanos ^ (u64::from(std::process::id()) << 32);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The proptest generator for `target` and seed `n`: 32 bytes from both.
fn rng(target: &str, n: u64) -> TestRng {
    let mut seed = [0u8; 32];
    for (i, b) in target.bytes().chain(n.to_le_bytes()).enumerate() {
        seed[i % 32] ^= b.rotate_left(i as u32 % 8);
    }
    TestRng::from_seed(RngAlgorithm::ChaCha, &seed)
}

/// `<target dir>/<name>`: `CARGO_TARGET_DIR`, else the workspace's `target/`.
fn target_path(name: &str) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"))
        .join(name)
}

/// Writes `bytes` to `<target dir>/<dir>/<file>` and returns the path (a failure to write is
/// reported in the path's place: the seed is in the test's own message as well).
fn record(dir: &str, file: &str, bytes: &[u8]) -> String {
    let dir = target_path(dir);
    let path = dir.join(file);
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, bytes)) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(not saved: {}: {e})", path.display()),
    }
}

/// Runs `cases(default_cases)` proptest cases over `entry`: mutations of the committed seeds
/// (two in three) and random inputs of up to `max_random` bytes. Returns the union of the
/// outcome bits.
pub fn run_mutations(target: &str, entry: Entry, default_cases: u32, max_random: usize) -> u32 {
    let seeds: Vec<Vec<u8>> = corpus(target).into_iter().map(|(_, b)| b).collect();
    let n = cases(default_cases);
    let config = Config {
        cases: n,
        failure_persistence: None,
        rng_algorithm: RngAlgorithm::ChaCha,
        // A failure is reported with the input that failed; shrinking a slow target would
        // take longer than the test.
        max_shrink_iters: 64,
        ..Config::default()
    };
    let n_seed = seed();
    record(
        "vmsight-fuzz-seeds",
        &format!("{target}.txt"),
        format!("{target}: seed {n_seed}, {n} cases (replay: VMSIGHT_FUZZ_SEED={n_seed})\n")
            .as_bytes(),
    );
    let mut runner = TestRunner::new_with_rng(config, rng(target, n_seed));
    let k = seeds.len();
    let mutated = (0..k, prop::collection::vec(mutation(), 1..8)).prop_map(move |(i, ms)| {
        let mut b = seeds[i].clone();
        for m in &ms {
            apply(&mut b, m);
        }
        b
    });
    let strategy = prop_oneof![
        2 => mutated,
        1 => prop::collection::vec(any::<u8>(), 0..max_random),
    ];
    let started = Instant::now();
    let seen = std::cell::Cell::new(0u32);
    let result = runner.run(&strategy, |input| {
        seen.set(seen.get() | entry(&input));
        Ok(())
    });
    if let Err(e) = result {
        let saved = match &e {
            proptest::test_runner::TestError::Fail(_, input) => record(
                "vmsight-fuzz-failures",
                &format!("{target}-{n_seed}.bin"),
                input,
            ),
            proptest::test_runner::TestError::Abort(_) => "(no input: aborted)".to_string(),
        };
        panic!(
            "{target}: {e}\nproptest seed {n_seed} (replay: VMSIGHT_FUZZ_SEED={n_seed}); the \
             failing input is saved at {saved}: commit it to fuzz/corpus/{target}/ with the fix"
        );
    }
    eprintln!(
        "{target}: seed {n_seed}, {n} proptest cases in {:.1?}, outcomes {:#b}",
        started.elapsed(),
        seen.get()
    );
    seen.get()
}

/// The test every target runs: its committed corpus (at least 5 seeds) must reach every outcome
/// bit in `corpus_wants`, then `default_cases` mutations ([`run_mutations`]) every bit in `all`,
/// so a run that only ever hits error paths fails.
pub fn corpus_and_mutations(
    target: &str,
    entry: Entry,
    corpus_wants: u32,
    all: u32,
    default_cases: u32,
    max_random: usize,
) {
    let (n, seen) = run_corpus(target, entry);
    assert!(n >= 5, "{target}: {n} seeds");
    assert_eq!(
        seen & corpus_wants,
        corpus_wants,
        "{target}: outcomes reached by the corpus: {seen:#b}"
    );
    let seen = run_mutations(target, entry, default_cases, max_random);
    assert_eq!(
        seen, all,
        "{target}: outcomes reached by the mutations: {seen:#b}"
    );
}
