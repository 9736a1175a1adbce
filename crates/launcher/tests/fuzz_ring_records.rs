//! The ring attach and record decoding fuzz target on stable Rust: the committed corpus, then
//! fixed-seed proptest over mutations and random inputs (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_launcher::fuzzing::{
    encode_ring, ring_records, RingOp, ATTACHED, ATTACH_REFUSED, CORRUPT_INDICES, DATA, ENTRIES,
    RETURNS,
};
use vmsight_ring::layout::Geometry;
use vmsight_ring::{flags, Record, ReturnVia, SumsHeader};

const TARGET: &str = "ring_records";
const ALL: u32 = ENTRIES | RETURNS | DATA | ATTACHED | ATTACH_REFUSED | CORRUPT_INDICES;

fn push(vcpu: u8, record: Record) -> RingOp {
    RingOp::Push { vcpu, record }
}

/// An `openat(AT_FDCWD, path)` on `vcpu` at `ts`: entry, the path as a DATA piece, return.
fn openat(vcpu: u8, ts: u64, path: &[u8], fd: u64) -> Vec<RingOp> {
    let v = u32::from(vcpu);
    let mut entry = Record::syscall_entry(
        v,
        ts,
        0x1000,
        0x40_1000,
        257,
        [0, 0x7000, 0, 0, 0, 0],
        0x7ff0,
    );
    entry.set_task(
        0xffff_8880_0000_1000,
        100 + v,
        100,
        Some(b"cat\0\0\0\0\0\0\0\0\0\0\0\0\0"),
    );
    entry.set_data_count(1);
    let data = Record::data(v, ts, 0x1000, 0x7000, 1, 0, path, 0);
    let mut ret = Record::syscall_return(v, ts + 1000, 0x1000, ReturnVia::Sysret, 0, 0x40_1002, fd);
    ret.set_task(0xffff_8880_0000_1000, 100 + v, 100, None);
    vec![push(vcpu, entry), push(vcpu, data), push(vcpu, ret)]
}

/// A 4 KiB `write(fd, buf)` with its checksums at entry, then the return.
fn write_with_sums(vcpu: u8, ts: u64) -> Vec<RingOp> {
    let v = u32::from(vcpu);
    let mut entry = Record::syscall_entry(
        v,
        ts,
        0x1000,
        0x40_2000,
        1,
        [3, 0x8000, 8192, 0, 0, 0],
        0x7ff0,
    );
    entry.set_task(
        0xffff_8880_0000_2000,
        200,
        200,
        Some(b"dd\0\0\0\0\0\0\0\0\0\0\0\0\0\0"),
    );
    let h = SumsHeader {
        fd: 3,
        count: 2,
        pos_source: vmsight_ring::sums::POS_FPOS,
        read: false,
        append: false,
        valid: 0b11,
        pos: 0,
        len: 8192,
        first: 0,
        inode: 0xffff_8880_1234_0000,
        i_size: 8192,
    };
    let sums = Record::sums(v, ts, 0x1000, 0x8000, &h, &[0x1111, 0x2222], flags::FINAL);
    let mut ret = Record::syscall_return(v, ts + 500, 0x1000, ReturnVia::Iret, 0, 0x40_2002, 8192);
    ret.set_task(0xffff_8880_0000_2000, 200, 200, None);
    vec![push(vcpu, entry), push(vcpu, sums), push(vcpu, ret)]
}

/// Offset of `vcpu`'s head index in a channel of `vcpus` x `records`.
fn head_at(vcpus: u32, records: u32, vcpu: u32) -> u32 {
    Geometry::new(vcpus, records).unwrap().ring_at(vcpu) as u32
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let two_vcpus = [
        openat(0, 1_000, b"/etc/passwd\0", 3),
        write_with_sums(1, 2_000),
        openat(1, 3_000, b"/tmp/x\0", 4),
    ]
    .concat();
    let mut late = openat(0, 5_000, b"/late\0", 5);
    let mut late_data = Record::data(
        0,
        5_000,
        0x1000,
        0x7000,
        1,
        0,
        b"/late/again\0",
        flags::LATE,
    );
    late_data.flags |= flags::LATE;
    late.insert(2, push(0, late_data));
    let full: Vec<RingOp> = (0..6)
        .flat_map(|i| openat(0, 100 * i, b"/full\0", 3))
        .collect();
    let mut scribbled_head = openat(0, 1, b"/a\0", 3);
    scribbled_head.push(RingOp::Scribble {
        offset: head_at(1, 16, 0),
        bytes: u64::MAX.to_le_bytes().to_vec(),
    });
    let mut slot_garbage = write_with_sums(0, 10);
    let slots = head_at(1, 8, 0) + 256;
    slot_garbage.push(RingOp::Scribble {
        offset: slots + 8,
        bytes: vec![0xff; 120],
    });
    let header = vec![
        RingOp::Attach,
        RingOp::Scribble {
            offset: 24,
            bytes: 1_000_000u32.to_le_bytes().to_vec(),
        },
        RingOp::Attach,
        RingOp::Scribble {
            offset: 0,
            bytes: b"NOTARING".to_vec(),
        },
        RingOp::Attach,
    ];
    let bad_vcpu = vec![
        push(3, Record::syscall_entry(3, 1, 0, 0, 0, [0; 6], 0)),
        push(0, Record::default()),
    ];
    vec![
        ("two-vcpus-open-write-sums", encode_ring(2, 16, &two_vcpus)),
        ("late-data", encode_ring(1, 16, &late)),
        ("full-ring", encode_ring(1, 2, &full)),
        ("scribbled-head", encode_ring(1, 16, &scribbled_head)),
        ("garbage-in-a-slot", encode_ring(1, 8, &slot_garbage)),
        ("scribbled-header", encode_ring(1, 4, &header)),
        ("unknown-vcpu", encode_ring(1, 4, &bad_vcpu)),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), ring_records);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_neither_panic_nor_break_the_rings_promises() {
    driver::corpus_and_mutations(TARGET, ring_records, ALL, ALL, 50_000, 4096);
}
