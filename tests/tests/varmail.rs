//! varmail's own count checked against the disk: `varmail` counts the 4 KiB data chunks its
//! durable writes touch; the write stream the virtual disk really received (`--record-writes`)
//! must contain that many data blocks. (The accuracy check of vmsight, tests/insights.rs, no
//! longer compares totals with this count: it judges every block against the file system's own
//! block map, and prints the count for reference.)
//!
//! The oracle is content-based and independent of vmsight's classifier: varmail writes
//! pseudo-random bytes, so a written 4 KiB block whose first 32 bytes hold at least 20
//! distinct values is file data, while ext2/ext4/XFS metadata (inode tables, bitmaps, directory
//! blocks, journals) is far more regular. The heuristic misses tail chunks holding fewer than
//! ~32 bytes and takes a few XFS log blocks for data, hence the 1% tolerance. btrfs is not
//! checked: its checksum tree items look random and small files are inlined in metadata.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use vmsight_tests::*;

/// Data-like 4 KiB blocks in a `--record-writes` recording (format: `VMSWREC1`, then frames
/// `kind u8, seq u64, ns u64, offset u64, len u64` followed by `len` bytes for kind 1).
fn data_like_blocks(rec: &[u8]) -> u64 {
    assert_eq!(&rec[..8], b"VMSWREC1", "not a recording");
    let mut p = 8;
    let mut n = 0;
    let u64_at = |p: usize| u64::from_le_bytes(rec[p..p + 8].try_into().unwrap());
    while p + 33 <= rec.len() {
        let kind = rec[p];
        let len = u64_at(p + 25) as usize;
        p += 33;
        if kind != 1 {
            continue;
        }
        let data = &rec[p..p + len];
        p += len;
        for block in data.chunks(4096) {
            let head = &block[..block.len().min(32)];
            let mut seen = [false; 256];
            head.iter().for_each(|b| seen[*b as usize] = true);
            if seen.iter().filter(|s| **s).count() >= 20 {
                n += 1;
            }
        }
    }
    assert_eq!(p, rec.len(), "recording ends mid-frame");
    n
}

#[test]
fn varmail_data_chunks_match_the_data_blocks_the_disk_receives() {
    let dir = tempfile::tempdir().unwrap();
    let fss = ["ext4", "ext2", "xfs"];
    let mut args: Vec<String> = vec!["run".into()];
    for (i, _) in fss.iter().enumerate() {
        let img = dir.path().join(format!("d{i}.img"));
        std::fs::File::create(&img)
            .unwrap()
            .set_len(512 << 20)
            .unwrap();
        args.push("--disk".into());
        args.push(img.display().to_string());
        args.push("--record-writes".into());
        args.push(format!(
            "{}:{}",
            i + 1,
            dir.path().join(format!("d{i}.rec")).display()
        ));
    }
    // mkfs runs before varmail and is part of the recording, but writes no random data.
    let mut script = String::from("set -e; modprobe xfs\n");
    for (i, fs) in fss.iter().enumerate() {
        let dev = format!("/dev/vd{}", (b'b' + i as u8) as char);
        script.push_str(&format!(
            "mkfs.{fs} -q {f} {dev} > /dev/null; mkdir -p /mnt/{i}; mount {dev} /mnt/{i}\n\
             varmail -d /mnt/{i}/vm -n 300 -o 5000 -s {seed} | grep ^data_chunks\n\
             umount /mnt/{i}\n",
            f = if fs.starts_with("ext") { "-F" } else { "-f" },
            seed = i + 7
        ));
    }
    args.extend(["--".into(), "sh".into(), "-c".into(), script]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = run(&argv);
    assert_eq!(r.code, Some(0), "{r:?}");
    let counts: Vec<u64> = r
        .stdout
        .lines()
        .map(|l| l.strip_prefix("data_chunks ").unwrap().parse().unwrap())
        .collect();
    assert_eq!(counts.len(), fss.len(), "{r:?}");
    for (i, fs) in fss.iter().enumerate() {
        let rec = std::fs::read(dir.path().join(format!("d{i}.rec"))).unwrap();
        let on_disk = data_like_blocks(&rec);
        let truth = counts[i];
        assert!(
            truth > 1000,
            "{fs}: varmail wrote too little to compare: {truth}"
        );
        let diff = on_disk.abs_diff(truth) as f64 / truth as f64;
        assert!(
            diff < 0.01,
            "{fs}: varmail counted {truth} data chunks, the disk received {on_disk} data blocks"
        );
    }
}
