//! The iCache, the insight classification and the view work for every disk of a VM, the root
//! disk (`/dev/vda`, disk 0) included (issue 17):
//! * the root disk's own iCache serves a re-read of a root-disk file after the guest dropped
//!   its page cache (hits counted for disk 0 in `--stats-json` and `vmsight stats`), and the
//!   guest reads the right bytes (sha256 against the host's copy of the same content);
//! * root-disk writes are classified per 4 KiB block: every block of the files written (FIEMAP
//!   in the guest) is data of the right file at the right offset, and nothing else is called
//!   data of those files;
//! * `vmsight mount` shows the root disk at `DIR/<host>/<vm>/`, an extra disk at its guest
//!   mount point (`mount=/mnt/data`), hiding the root disk's directory there, and a disk
//!   without `mount=` at `@disk2`, each equal to the guest's own `find` and `sha256sum`.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};
use vmsight_tests::oracle::{
    fiemap_map, find_listing, guest_sh_with_insights, json_file, judge_file_blocks, line_diff,
    section, sh_out, whole_seconds, InsightRun,
};
use vmsight_tests::*;

// ---------------------------------------------------------------------------------------------
// 1. The iCache on the root disk

/// Bytes of the root-disk file read back through the cache.
const BIG: usize = 16 << 20;

/// The file's content: the first 16 MiB of `seq 1 3000000`, which the host can make too.
fn seq_bytes() -> Vec<u8> {
    let mut v = Vec::with_capacity(BIG + 16);
    let mut i = 1u64;
    while v.len() < BIG {
        v.extend_from_slice(format!("{i}\n").as_bytes());
        i += 1;
    }
    v.truncate(BIG);
    v
}

fn hex_sha256(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes the file on the root disk, then reads it three times: from the page cache, and
/// twice from the disk after dropping the page cache.
const ICACHE_SCRIPT: &str = r#"
set -e
seq 1 3000000 | head -c 16777216 > /root/big
sync
echo BEGIN sums
sha256sum /root/big | cut -d' ' -f1
echo 3 > /proc/sys/vm/drop_caches
sha256sum /root/big | cut -d' ' -f1
echo 3 > /proc/sys/vm/drop_caches
sha256sum /root/big | cut -d' ' -f1
echo END sums
echo ===WAIT
read x
"#;

/// The `disks` entry of disk `disk` in a `vmsight stats --json` reply.
fn status_disk(reply: &Value, disk: u64) -> Value {
    let disks = reply["disks"]
        .as_array()
        .unwrap_or_else(|| panic!("no disks in {reply}"));
    disks
        .iter()
        .find(|d| d["disk"] == disk)
        .unwrap_or_else(|| panic!("no disk {disk} in {reply}"))
        .clone()
}

#[test]
fn the_icache_serves_root_disk_reads() {
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("stats.json");
    let name = vm_name("icache-root");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--stats-json",
        st.to_str().unwrap(),
        "--stage",
        "icache:size=64,policy=lru",
        "--",
        "sh",
        "-c",
        ICACHE_SCRIPT,
    ]);
    vm.wait_line("===WAIT");
    // Live: `vmsight stats` names the root disk's cache.
    let live = run(&["stats", &name, "--json"]);
    assert_eq!(live.code, Some(0), "{live:?}");
    let reply: Value = serde_json::from_str(live.stdout.trim()).unwrap();
    let live_cache = status_disk(&reply, 0)["cache"].clone();
    println!("vmsight stats, disk 0 cache: {live_cache}");
    assert!(live_cache["hits"].as_u64().unwrap() > 0, "{reply}");
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");

    // The guest read the right bytes every time.
    let want = hex_sha256(&seq_bytes());
    let text = out.join("\n") + "\n";
    let sums: Vec<&str> = section(&text, "sums").lines().collect();
    assert_eq!(sums, [want.as_str(); 3], "sha256 of /root/big in the guest");

    // The re-reads after drop_caches came from the root disk's cache: at least one whole
    // re-read of the 16 MiB (4096 blocks) was a hit.
    let s = json_file(&st);
    let disks = s["disks"].as_array().unwrap();
    assert_eq!(disks.len(), 1, "one disk: {s}");
    let cache = &disks[0]["cache"];
    let (hits, misses) = (
        cache["hits"].as_u64().unwrap(),
        cache["misses"].as_u64().unwrap(),
    );
    println!(
        "disk 0 ({}) cache: hits={hits} misses={misses} resident={} KiB",
        disks[0]["path"],
        cache["resident_bytes"].as_u64().unwrap() / 1024
    );
    assert!(hits >= (BIG / 4096) as u64, "{cache}");
    assert_eq!(cache["size_bytes"].as_u64(), Some(64 << 20), "{cache}");
}

// ---------------------------------------------------------------------------------------------
// 2. Root-disk writes classified per block

/// (name, bytes) of the files written on the root disk: a partial last block, several sizes
/// (size classes), contents from /dev/urandom (no two chunks alike).
const FILES: &[(&str, u64)] = &[
    ("a", 10_000),
    ("b", 65_536),
    ("c", 1 << 20),
    ("d", 3 << 20),
    ("e", 8 << 20),
];

fn classify_script() -> String {
    let mut s = String::from("set -e\nmkdir -p /root/cls\nsync\n");
    for (n, size) in FILES {
        // One file per sync: no request of the guest's can hold blocks of two of them.
        s.push_str(&format!(
            "head -c {size} /dev/urandom > /root/cls/{n}\nsync\n"
        ));
    }
    s.push_str("echo BEGIN fiemap\nfilefrag -v /root/cls/*\necho END fiemap\n");
    s.push_str("echo BEGIN bs\nstat -f -c %S /\necho END bs\n");
    // The journal's blocks (inode 8), from the file system itself.
    s.push_str(
        "echo BEGIN journal\ndebugfs -R 'blocks <8>' /dev/vda 2>/dev/null\necho END journal\n",
    );
    s
}

/// Disk blocks of the root file system's journal, from `debugfs -R 'blocks <8>'` (in file
/// system blocks, which are the 4 KiB of the insight log: checked with `stat -f`).
fn journal_blocks(stdout: &str) -> BTreeSet<u64> {
    assert_eq!(
        section(stdout, "bs").trim(),
        "4096",
        "root file system block size"
    );
    section(stdout, "journal")
        .split_whitespace()
        .map(|b| b.parse().unwrap())
        .collect()
}

#[test]
fn root_disk_writes_are_classified_as_data_per_block() {
    let InsightRun {
        run: r,
        records,
        stats,
    } = guest_sh_with_insights(&classify_script());
    // dash runs each `head > file` through vfork: the child writes before the parent's
    // return, so its fds come from the fork's entry (this test once failed when the return
    // was seen after the child's first write and the child had exited by then).
    let adopted = stats["insights"]["forks_adopted"].as_u64().unwrap();
    println!("root disk: {adopted} vfork children adopted their parent's fds");
    assert!(adopted >= FILES.len() as u64, "{adopted}");
    // The truth: /root is on /dev/vda itself (root=/dev/vda, no partition table).
    let truth = fiemap_map(section(&r.stdout, "fiemap"), 0);
    let ours: BTreeSet<String> = FILES
        .iter()
        .map(|(n, _)| format!("/root/cls/{n}"))
        .collect();
    let want_blocks: u64 = FILES.iter().map(|(_, s)| s.div_ceil(4096)).sum();
    assert_eq!(
        truth.len() as u64,
        want_blocks,
        "FIEMAP blocks of the files"
    );
    assert!(truth.values().all(|b| ours.contains(&b.file)));

    let writes: Vec<Value> = records
        .into_iter()
        .filter(|r| r["op"] == "write" && r["disk"] == 0)
        .collect();
    // Every block of the files: its last write is data of the right file at the right offset;
    // nothing else is called data of those files.
    let j = judge_file_blocks(&writes, &truth, &ours);
    println!(
        "root disk: {} write records, {} file blocks (truth), {} blocks attributed to the files, \
         {} missed, {} spurious",
        writes.len(),
        truth.len(),
        j.attributed,
        j.missed.len(),
        j.spurious.len()
    );
    let missed: Vec<String> = j.missed.iter().map(|m| format!("{m:?}")).collect();
    assert!(
        missed.is_empty(),
        "{} missed:\n{}",
        missed.len(),
        missed[..missed.len().min(10)].join("\n")
    );
    assert!(
        j.spurious.is_empty(),
        "{} spurious:\n{}",
        j.spurious.len(),
        j.spurious[..j.spurious.len().min(10)].join("\n")
    );
    // The classification engaged: metadata writes of disk 0 were told apart too.
    let metadata = writes.iter().filter(|r| r["content"] == "metadata").count();
    println!("root disk: {metadata} metadata write records");
    assert!(metadata > 0);

    // The root disk's journal writes are flagged as such, and only they.
    let journal = journal_blocks(&r.stdout);
    assert!(journal.len() > 1000, "journal blocks: {}", journal.len());
    let (mut flagged, mut wrong) = (0, Vec::new());
    for rec in &writes {
        let off = rec["offset"].as_u64().unwrap();
        let blocks: Vec<u64> = (0..rec["len"].as_u64().unwrap().div_ceil(4096))
            .map(|k| off / 4096 + k)
            .collect();
        let in_journal = blocks.iter().all(|b| journal.contains(b));
        let outside = blocks.iter().all(|b| !journal.contains(b));
        let said = rec["journal"] == true;
        flagged += usize::from(said);
        if (said && !in_journal) || (!said && !outside) {
            wrong.push(rec.to_string());
        }
    }
    println!(
        "root disk: {flagged} journal write records, {} misflagged",
        wrong.len()
    );
    assert!(flagged > 0);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 3. The view of every disk

const VIEW_SCRIPT: &str = r#"
set -e
mkdir -p /mnt/data /mnt/other /root/viewtest/sub
echo hidden > /mnt/data/hidden-on-root
sync
mount /dev/vdb /mnt/data
mount /dev/vdc /mnt/other
mkdir -p /mnt/data/d1/d2
echo one > /mnt/data/one.txt
head -c 300000 /dev/urandom > /mnt/data/d1/r300k
ln -s one.txt /mnt/data/link
echo deep > /mnt/data/d1/d2/deep
chmod 600 /mnt/data/d1/r300k
echo other > /mnt/other/o.txt
echo rootfile > /root/viewtest/r.txt
head -c 70000 /dev/urandom > /root/viewtest/sub/r70k
sync
for t in /mnt/data /mnt/other /root/viewtest; do
  echo "===FIND $t"
  find $t -printf '%P %s %m %U %G %T@ %y %l\n' | sort
  echo "===SUM $t"
  (cd $t && find . -type f -print0 | sort -z | xargs -0 sha256sum)
done
echo ===HOSTNAME
cat /etc/hostname
echo ===WAIT
read x
echo ===BYE
"#;

/// A tree as the guest saw it: its `find` listing (whole seconds, sorted) and its sums.
struct Tree {
    find: Vec<String>,
    sums: Vec<String>,
}

fn guest_tree(vm: &LiveVm, path: &str, next: &str) -> Tree {
    let mut find: Vec<String> = vm
        .section(&format!("===FIND {path}"), &format!("===SUM {path}"))
        .iter()
        .map(|l| whole_seconds(l))
        .collect();
    find.sort();
    let sums = vm.section(&format!("===SUM {path}"), next);
    Tree { find, sums }
}

/// Compares the view of `dir` with the guest's tree until they are equal (the view follows
/// the guest's committed state and the kernel caches attributes for 1 s; bounded), then
/// asserts equality both ways.
fn assert_view_equals(dir: &Path, guest: &Tree, what: &str) {
    let (mut find, mut sums) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        find = find_listing(dir);
        sums = sh_out("find . -type f -print0 | sort -z | xargs -0 sha256sum", dir);
        if find == guest.find && sums == guest.sums {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("view of {what} ({}): {} entries", dir.display(), find.len());
    for l in &find {
        println!("  {l}");
    }
    let diff = line_diff(&guest.find, &find);
    assert!(
        diff.is_empty(),
        "{what}: find listings differ:\n{}",
        diff.join("\n")
    );
    assert_eq!(sums, guest.sums, "{what}: sha256 of every file");
}

fn names_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_view_shows_every_disk_at_its_guest_mount_point() {
    let dir = tempfile::tempdir().unwrap();
    let (data, other) = (dir.path().join("data.img"), dir.path().join("other.img"));
    make_ext4(&data, 64);
    make_ext4(&other, 64);
    let name = vm_name("view-disks");
    let data_arg = format!("{},mount=/mnt/data", data.display());
    let other_arg = other.display().to_string();
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--disk",
        &data_arg,
        "--disk",
        &other_arg,
        "--",
        "bash",
        "-c",
        VIEW_SCRIPT,
    ]);
    vm.wait_line("===WAIT");
    let data_tree = guest_tree(&vm, "/mnt/data", "===FIND /mnt/other");
    let other_tree = guest_tree(&vm, "/mnt/other", "===FIND /root/viewtest");
    let root_tree = guest_tree(&vm, "/root/viewtest", "===HOSTNAME");
    let hostname = vm.section("===HOSTNAME", "===WAIT");
    assert!(data_tree.find.len() >= 8, "{:?}", data_tree.find);
    assert!(
        !data_tree
            .find
            .iter()
            .any(|l| l.starts_with("hidden-on-root")),
        "the guest's mount hides the root disk's file"
    );

    let mnt = tempfile::tempdir().unwrap();
    let mut mount = mount_view(mnt.path(), &name);
    let top = mnt.path().join("h").join(&name);
    wait_until("the view to show /mnt/data/one.txt", 60, || {
        top.join("mnt/data/one.txt").exists()
    });
    assert_view_equals(&top.join("mnt/data"), &data_tree, "disk 1 at /mnt/data");
    assert_view_equals(&top.join("@disk2"), &other_tree, "disk 2 at @disk2");
    assert_view_equals(
        &top.join("root/viewtest"),
        &root_tree,
        "the root disk's /root/viewtest",
    );
    // The root disk itself, beside the mount points.
    let view_hostname = std::fs::read_to_string(top.join("etc/hostname")).unwrap();
    assert_eq!(
        view_hostname.lines().collect::<Vec<_>>(),
        hostname,
        "/etc/hostname"
    );
    let names = names_in(&top);
    println!("view of {}: {names:?}", top.display());
    assert!(
        ["@disk2", "etc", "mnt", "root"]
            .iter()
            .all(|n| names.contains(*n)),
        "{names:?}"
    );
    assert!(names_in(&top.join("mnt")).contains("data"));
    assert!(!top.join("mnt/data/hidden-on-root").exists());

    unmount_view(mnt.path(), &mut mount);
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert!(out.iter().any(|l| l == "===BYE"), "{out:?}");
}
