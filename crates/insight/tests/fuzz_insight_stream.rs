//! The insight engine's record stream fuzz target on stable Rust: the committed corpus, then
//! fixed-seed proptest over mutations and random inputs (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_insight::fuzzing::{
    encode, insight_stream, syscall, Op, Sums, COMPLETED, COPY, LOGGED, METADATA, READ_DATA,
    WRITE_DATA,
};
use vmsight_insight::VMSIGHT_HINT_MAGIC;

const TARGET: &str = "insight_stream";
const ALL: u32 = WRITE_DATA | READ_DATA | METADATA | COPY | LOGGED | COMPLETED;
const AT_FDCWD: u64 = (-100i64) as u64;

fn entry(
    tid: u8,
    comm: u8,
    nr: u64,
    args: [u64; 6],
    data: Vec<(u8, &[u8])>,
    io: Option<Sums>,
) -> Op {
    Op::Entry {
        tid,
        comm,
        nr: syscall(nr),
        args,
        data: data.into_iter().map(|(a, b)| (a, b.to_vec())).collect(),
        io,
    }
}

fn ret(tid: u8, rax: u64) -> Op {
    Op::Return {
        tid,
        rax,
        late: None,
    }
}

fn sums(fd: u8, read: bool, chunks: &[u8]) -> Sums {
    Sums {
        fd,
        read,
        append: false,
        pos_chunk: 0,
        len: chunks.len() as u32 * 4096,
        inode: 1,
        chunks: chunks.to_vec(),
    }
}

/// `openat(AT_FDCWD, path, flags)` by `tid` returning `fd`.
fn open(tid: u8, path: &[u8], flags: u64, fd: u64) -> Vec<Op> {
    vec![
        entry(
            tid,
            4,
            257,
            [AT_FDCWD, 0x7000, flags, 0o644, 0, 0],
            vec![(1, path)],
            None,
        ),
        ret(tid, fd),
    ]
}

fn block_write(sector: u32, chunks: &[u8], journal: bool) -> Op {
    Op::BlockWrite {
        disk: 0,
        sector,
        chunks: chunks.to_vec(),
        short: 0,
        journal,
    }
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let end = [Op::Advance { ms: 5_000 }, Op::Flush];
    let write_matched = [
        open(0, b"/data/file.bin", 0x41, 3),
        vec![
            entry(
                0,
                4,
                1,
                [3, 0x8000, 8192, 0, 0, 0],
                vec![],
                Some(sums(3, false, &[1, 2])),
            ),
            ret(0, 8192),
            block_write(2048, &[1, 2], false),
            block_write(8, &[9], true),
        ],
        end.to_vec(),
    ]
    .concat();
    let read_matched = [
        open(1, b"/data/in.txt", 0, 4),
        vec![
            Op::BlockRead {
                disk: 0,
                sector: 4096,
                chunks: vec![3, 4],
                short: 0,
            },
            entry(1, 4, 0, [4, 0x9000, 8192, 0, 0, 0], vec![], None),
            Op::Return {
                tid: 1,
                rax: 8192,
                late: Some(sums(4, true, &[3, 4])),
            },
        ],
        end.to_vec(),
    ]
    .concat();
    let copy = [
        open(2, b"/data/src", 0, 3),
        open(2, b"/data/dst", 0x41, 4),
        vec![
            entry(2, 0, 326, [3, 0, 4, 0, 65536, 0], vec![], None),
            Op::BlockRead {
                disk: 0,
                sector: 0,
                chunks: vec![6, 7],
                short: 0,
            },
            ret(2, 65536),
            block_write(100, &[6, 7], false),
        ],
        end.to_vec(),
    ]
    .concat();
    let hint = [
        open(0, b"/db/wal", 0x441, 5),
        vec![
            entry(
                0,
                4,
                1,
                [5, 0x8000, 4096, VMSIGHT_HINT_MAGIC, 2, 0],
                vec![],
                Some(sums(5, false, &[5])),
            ),
            ret(0, 4096),
            block_write(512, &[5], false),
            Op::Discard {
                disk: 1,
                sector: 0,
                sectors: 8,
            },
        ],
        end.to_vec(),
    ]
    .concat();
    let process_life = vec![
        entry(0, 5, 56, [0x11, 0, 0, 0, 0, 0], vec![], None),
        ret(0, 101),
        entry(
            1,
            2,
            59,
            [0x7000, 0, 0, 0, 0, 0],
            vec![(0, b"/usr/bin/gpg")],
            None,
        ),
        ret(1, 0),
        entry(
            1,
            2,
            80,
            [0x7000, 0, 0, 0, 0, 0],
            vec![(0, b"/tmp/../home/./u")],
            None,
        ),
        ret(1, 0),
        entry(1, 2, 33, [0, 7, 0, 0, 0, 0], vec![], None),
        ret(1, 7),
        entry(
            1,
            2,
            82,
            [0x7000, 0x7100, 0, 0, 0, 0],
            vec![(0, b"a.txt"), (1, b"a.txt.gpg")],
            None,
        ),
        ret(1, 0),
        entry(1, 2, 87, [0x7000, 0, 0, 0, 0, 0], vec![(0, b"a.txt")], None),
        ret(1, (-2i64) as u64),
        entry(1, 2, 231, [0, 0, 0, 0, 0, 0], vec![], None),
        Op::Flush,
    ];
    let partial = [
        open(3, b"/log/app.log", 0x441, 6),
        vec![
            entry(
                3,
                5,
                1,
                [6, 0x8000, 100, 0, 0, 0],
                vec![(16, &[b'x'; 100][..])],
                Some(Sums {
                    append: true,
                    len: 100,
                    chunks: vec![],
                    ..sums(6, false, &[])
                }),
            ),
            ret(3, 100),
            Op::BlockWrite {
                disk: 0,
                sector: 64,
                chunks: vec![8],
                short: 3996,
                journal: false,
            },
        ],
        end.to_vec(),
    ]
    .concat();
    vec![
        ("write-matched", encode(&write_matched)),
        ("read-matched", encode(&read_matched)),
        ("copy-file-range", encode(&copy)),
        ("hinted-write-and-discard", encode(&hint)),
        ("process-life", encode(&process_life)),
        ("partial-append", encode(&partial)),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), insight_stream);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_neither_panic_nor_write_bad_log_lines() {
    driver::corpus_and_mutations(TARGET, insight_stream, ALL, ALL, 18_000, 2048);
}
