//! Every way a guest program writes a file is classified as that file's data, per 4 KiB block
//! (issue 32): `write()` calls larger than the plugin's per-call checksum cap, one `writev`
//! of 8 MiB, stores into a shared file mapping (`mmap` + `msync`), and io_uring (fio). The
//! plugin checksums only the first `sumcap` (1 MiB) of a call and sees no buffer at all for
//! mmap and io_uring; those blocks are classified by page ownership, the guest kernel's own
//! `struct page` (docs/insights.md). The oracle is the guest's FIEMAP (`filefrag -v`) of the
//! files after they are on disk, in both directions: every block of the files is data of the
//! right file at the right offset, and no write record calls any other block data of them.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use vmsight_tests::oracle::{fiemap_map, guest_sh_with_insights, judge_file_blocks, section};

/// The files and how each is written (all on the root disk, under /root/wp).
const FILES: &[(&str, &str)] = &[
    ("big", "four write() calls of 2 MiB"),
    ("vec", "one writev of 4 x 2 MiB"),
    (
        "mapped",
        "4 MiB stored through a shared mapping, msync, fsync",
    ),
    (
        "uring",
        "4 MiB by fio through io_uring, 64 KiB blocks, iodepth 4",
    ),
];

const SCRIPT: &str = r#"
set -e
mkdir -p /root/wp
sync
python3 - <<'PY'
import mmap, os
M = 1 << 20
def new(name):
    return os.open("/root/wp/" + name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
fd = new("big")
for _ in range(4):
    assert os.write(fd, os.urandom(2 * M)) == 2 * M
os.fsync(fd); os.close(fd)
fd = new("vec")
assert os.writev(fd, [os.urandom(2 * M) for _ in range(4)]) == 8 * M
os.fsync(fd); os.close(fd)
fd = new("mapped")
os.ftruncate(fd, 4 * M)
m = mmap.mmap(fd, 4 * M)
m[:] = os.urandom(4 * M)
m.flush(); os.fsync(fd); m.close(); os.close(fd)
PY
fio --name=uring --filename=/root/wp/uring --rw=write --bs=64k --size=4m \
    --ioengine=io_uring --iodepth=4 --end_fsync=1 --output-format=terse > /dev/null
sync
echo BEGIN fiemap
filefrag -v /root/wp/*
echo END fiemap
"#;

#[test]
fn large_vectored_mmap_and_io_uring_writes_are_data_per_block() {
    let ir = guest_sh_with_insights(SCRIPT);
    let r = &ir.run;
    let truth = fiemap_map(section(&r.stdout, "fiemap"), 0);
    let path = |n: &str| format!("/root/wp/{n}");
    let ours: BTreeSet<String> = FILES.iter().map(|(n, _)| path(n)).collect();
    let mut per_file: BTreeMap<&str, u64> = BTreeMap::new();
    for b in truth.values() {
        *per_file.entry(b.file.as_str()).or_default() += 1;
    }
    let want: BTreeMap<&str, u64> = [
        ("big", 2048u64),
        ("mapped", 1024),
        ("uring", 1024),
        ("vec", 2048),
    ]
    .iter()
    .map(|&(n, b)| (ours.get(&path(n)).unwrap().as_str(), b))
    .collect();
    assert_eq!(per_file, want, "FIEMAP blocks per file");

    let writes: Vec<Value> = ir
        .records
        .into_iter()
        .filter(|r| r["op"] == "write" && r["disk"] == 0)
        .collect();
    let j = judge_file_blocks(&writes, &truth, &ours);
    for (n, how) in FILES {
        let m = j.missed.iter().filter(|(f, ..)| *f == path(n)).count();
        println!(
            "{}: {how}: {} blocks, {m} missed",
            path(n),
            want[path(n).as_str()]
        );
    }
    println!("{} spurious", j.spurious.len());
    let mut first: Vec<String> = Vec::new();
    for (n, _) in FILES {
        let p = path(n);
        first.extend(
            j.missed
                .iter()
                .filter(|(f, ..)| *f == p)
                .take(3)
                .map(|m| format!("{m:?}")),
        );
    }
    assert!(
        j.missed.is_empty(),
        "missed blocks, first of each file:\n{}",
        first.join("\n")
    );
    assert!(
        j.spurious.is_empty(),
        "{} spurious:\n{}",
        j.spurious.len(),
        j.spurious[..j.spurious.len().min(10)].join("\n")
    );

    // The mechanism engaged: at least the blocks no syscall checksummed (mmap, io_uring, and
    // all but the first MiB of each 2 MiB call) were classified by page ownership.
    let ins = &ir.stats["insights"];
    let by_page = ins["write_chunks_by_page"].as_u64().unwrap();
    println!("insights: {ins}");
    assert!(by_page >= 2048 + 4 * 256 + 7 * 256, "{ins}");
    // And it did not call metadata data: the file system's own writes stayed metadata.
    let metadata = writes.iter().filter(|r| r["content"] == "metadata").count();
    assert!(metadata > 0, "no metadata write records");
}

/// `O_DIRECT` through io_uring: the buffers are fio's anonymous memory, named in the
/// submission ring, so no syscall checksum covers them and no page names a file.
const DIRECT_SCRIPT: &str = r#"
set -e
mkdir -p /root/wp
sync
echo MARK > /dev/null
fio --name=direct --filename=/root/wp/direct --rw=write --bs=64k --size=4m \
    --ioengine=io_uring --iodepth=4 --direct=1 --output-format=terse > /dev/null
sync
echo BEGIN fiemap
filefrag -v /root/wp/direct
echo END fiemap
"#;

#[test]
fn direct_io_from_anonymous_memory_is_unknown_never_metadata() {
    let ir = guest_sh_with_insights(DIRECT_SCRIPT);
    let r = &ir.run;
    let truth = fiemap_map(section(&r.stdout, "fiemap"), 0);
    assert_eq!(truth.len(), 1024, "FIEMAP blocks of /root/wp/direct");
    let writes: Vec<Value> = ir
        .records
        .into_iter()
        .filter(|r| r["op"] == "write" && r["disk"] == 0)
        .collect();
    // The last write of every block of the file: unknown (not metadata, and not data of a
    // file nobody can name).
    let mut last: BTreeMap<u64, &Value> = BTreeMap::new();
    let mut sorted: Vec<&Value> = writes.iter().collect();
    sorted.sort_by_key(|r| r["ts_ns"].as_u64().unwrap());
    for rec in &sorted {
        let off = rec["offset"].as_u64().unwrap();
        for k in 0..rec["len"].as_u64().unwrap().div_ceil(4096) {
            last.insert(off / 4096 + k, rec);
        }
    }
    let wrong: Vec<String> = truth
        .keys()
        .filter(|b| last.get(b).is_none_or(|r| r["content"] != "unknown"))
        .map(|b| format!("block {b}: {:?}", last.get(b)))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of 1024 blocks not unknown, first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    // Nothing else is unknown: every unknown block is one of the file's.
    let stray: Vec<u64> = last
        .iter()
        .filter(|(b, r)| r["content"] == "unknown" && !truth.contains_key(b))
        .map(|(b, _)| *b)
        .collect();
    assert!(
        stray.is_empty(),
        "unknown blocks outside the file: {stray:?}"
    );
    // The mechanism: the pages were seen as anonymous memory, and counted unknown.
    let ins = &ir.stats["insights"];
    println!("insights: {ins}");
    assert!(
        ins["write_chunks_anonymous"].as_u64().unwrap() >= 1024,
        "{ins}"
    );
    assert!(
        ins["write_chunks_unknown"].as_u64().unwrap() >= 1024,
        "{ins}"
    );
}
