//! Vectored I/O (`readv`, `writev`, `preadv`, `pwritev`, `preadv2`, `pwritev2`) is checksummed
//! like plain reads and writes: every 4 KiB block the guest wrote through them is classified
//! data, with its file and file offset, and nothing else on the disk is; their block reads are
//! data too. The oracle is the file system itself (debugfs block maps on the host) and the
//! guest's own sha256 of what it wrote and read back.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use std::process::Command;

use vmsight_tests::{file_blocks, fsck_clean, guest_sh};

/// The guest's workload: three 64 KiB files written only with vectored calls whose buffers
/// cross 4 KiB boundaries at odd places, then read back with vectored calls after the page
/// cache was dropped. It prints `sha NAME HEX` for what it wrote and `back NAME HEX` for what
/// it read.
const WORKLOAD: &str = r#"
import hashlib, os, random
random.seed(17)
D = "/mnt/v/"
K = 16384
def bufs(sizes):
    return [random.randbytes(n) for n in sizes]
def done(name, parts):
    print("sha", name, hashlib.sha256(b"".join(parts)).hexdigest(), flush=True)
# a: writev at the file position, four calls of 16 KiB split 1000/7192/4096/4096.
fd = os.open(D + "a", os.O_WRONLY | os.O_CREAT, 0o644)
whole = []
for _ in range(4):
    b = bufs([1000, 7192, 4096, 4096]); assert os.writev(fd, b) == K; whole += b
os.fsync(fd); os.close(fd); done("a", whole)
# b: pwritev at 48K, 32K, 16K, 0 (the file position never moves), split 3000/5192/8192.
fd = os.open(D + "b", os.O_WRONLY | os.O_CREAT, 0o644)
parts = {}
for off in (3 * K, 2 * K, K, 0):
    b = bufs([3000, 5192, 8192]); assert os.pwritev(fd, b, off) == K; parts[off] = b
os.fsync(fd); os.close(fd); done("b", [x for off in sorted(parts) for x in parts[off]])
# c: pwritev2 at offset -1 (the file position) twice, then RWF_APPEND with offset 0, which
# the kernel turns into appends at the file's size.
fd = os.open(D + "c", os.O_WRONLY | os.O_CREAT, 0o644)
whole = []
for off, flags in ((-1, 0), (-1, 0), (0, os.RWF_APPEND), (0, os.RWF_APPEND)):
    b = bufs([8192, 100, 8092]); assert os.pwritev(fd, b, off, flags) == K; whole += b
os.fsync(fd); os.close(fd); done("c", whole)
os.sync()
open("/proc/sys/vm/drop_caches", "w").write("3\n")
def back(name, parts):
    print("back", name, hashlib.sha256(b"".join(parts)).hexdigest(), flush=True)
# Read back: readv at the position, preadv backwards, preadv2 at -1.
fd = os.open(D + "a", os.O_RDONLY)
got = []
for _ in range(4):
    b = [bytearray(5000), bytearray(K - 5000)]; assert os.readv(fd, b) == K; got += b
os.close(fd); back("a", got)
fd = os.open(D + "b", os.O_RDONLY)
parts = {}
for off in (3 * K, 2 * K, K, 0):
    b = [bytearray(4096), bytearray(1), bytearray(K - 4097)]
    assert os.preadv(fd, b, off) == K; parts[off] = b
os.close(fd); back("b", [x for off in sorted(parts) for x in parts[off]])
fd = os.open(D + "c", os.O_RDONLY)
got = []
for _ in range(4):
    b = [bytearray(100), bytearray(K - 100)]; assert os.preadv(fd, b, -1, 0) == K; got += b
os.close(fd); back("c", got)
"#;

/// Per 4 KiB disk block of disk 1: the content of the last `op` record covering it, with the
/// record's file and the block's file offset when the record names them.
type Blocks = BTreeMap<u64, (String, Option<String>, Option<u64>)>;

fn classified_blocks(log: &Path, op: &str) -> Blocks {
    let mut out = Blocks::new();
    for line in std::fs::read_to_string(log).unwrap().lines() {
        let r: Value = serde_json::from_str(line).unwrap();
        if r["op"] != op || r["disk"] != 1 {
            continue;
        }
        let (off, len) = (r["offset"].as_u64().unwrap(), r["len"].as_u64().unwrap());
        for i in 0..len.div_ceil(4096) {
            let file = r["file"].as_str().map(str::to_owned);
            let foff = r["file_offset"].as_u64().map(|o| o + i * 4096);
            let content = r["content"].as_str().unwrap().to_owned();
            out.insert(off / 4096 * 4096 + i * 4096, (content, file, foff));
        }
    }
    out
}

/// A raw ext4 image with 4 KiB blocks (mkfs picks 1 KiB for small ones), so file blocks and
/// vmsight's 4 KiB chunks coincide.
fn make_ext4_4k(path: &Path, mib: u64) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096"])
        .arg(path)
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success(), "mkfs.ext4 failed");
}

fn guest_hashes(stdout: &str, tag: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == tag).then_some(())?;
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .collect()
}

#[test]
fn vectored_writes_and_reads_are_classified_data_block_by_block() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v.img");
    make_ext4_4k(&img, 64);
    let log = dir.path().join("ins.jsonl");
    let script = format!(
        "set -e; mkdir -p /mnt/v; mount /dev/vdb /mnt/v\n\
         python3 - <<'PY'\n{WORKLOAD}\nPY\n\
         umount /mnt/v"
    );
    let r = guest_sh(
        &[
            "--disk",
            img.to_str().unwrap(),
            "--insights",
            log.to_str().unwrap(),
            "--insight-target",
            "@cmd",
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let (wrote, read) = (
        guest_hashes(&r.stdout, "sha"),
        guest_hashes(&r.stdout, "back"),
    );
    assert_eq!(wrote.len(), 3, "{}", r.stdout);
    assert_eq!(wrote, read, "the guest read back what it wrote");
    let (clean, fsck) = fsck_clean(&img);
    assert!(clean, "{fsck}");

    // The truth: the files' blocks on the image, in file order.
    let mut truth = BTreeMap::new();
    for name in ["a", "b", "c"] {
        let blocks = file_blocks(&img, &format!("/{name}"));
        assert_eq!(blocks.len(), 16, "{name}: {blocks:?}");
        for (k, b) in blocks.into_iter().enumerate() {
            truth.insert(b, (format!("/mnt/v/{name}"), k as u64 * 4096));
        }
    }
    let writes = classified_blocks(&log, "write");
    let reads = classified_blocks(&log, "read");
    let mut missed = Vec::new();
    for (b, (file, foff)) in &truth {
        let want = ("data".to_owned(), Some(file.clone()), Some(*foff));
        if writes.get(b) != Some(&want) {
            missed.push(format!("write {b}: {:?}, want {want:?}", writes.get(b)));
        }
        if reads.get(b).map(|x| x.0.as_str()) != Some("data") {
            missed.push(format!("read {b}: {:?}", reads.get(b)));
        }
    }
    assert!(
        missed.is_empty(),
        "file blocks not classified data: {missed:#?}"
    );
    // Nothing spurious: every block classified data (or part of a mixed request) is a block
    // of the three files.
    let spurious: Vec<_> = writes
        .iter()
        .chain(&reads)
        .filter(|(b, x)| x.0 != "metadata" && !truth.contains_key(b))
        .collect();
    assert!(spurious.is_empty(), "data outside the files: {spurious:?}");
}
