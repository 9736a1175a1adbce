//! Storage insights and the iCache checked in real guests (issue 4, Sky §6.1, §7):
//! * accuracy of the data/metadata classification against varmail's own count of the data
//!   chunks it makes durable (Sky Table 5), on ext4, ext2, XFS and btrfs;
//! * application hints (libvmsight, LD_PRELOAD shim) change exactly the tagged block requests,
//!   with the file → block mapping taken from the file system itself (debugfs on the host);
//! * data integrity through the cache for both policies and both write modes, with caches
//!   from 1 MiB, including a file system with 1 KiB blocks (sub-4 KiB cache writes);
//! * write-back crash consistency: `sync` + `fsfreeze` in the guest, SIGKILL of vmsight, then
//!   `e2fsck -fn` and file contents on the host.
//!
//! Every oracle is independent of vmsight: varmail's count, debugfs's block lists, sha256 in
//! the guest and on the host, e2fsck.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use vmsight_tests::*;

const PRELOAD: &str = "LD_PRELOAD=/usr/local/lib/libvmsight-preload.so";

/// A sparse raw image of `mib` MiB; formatted as ext4 with `block`-byte blocks when given.
fn image(path: &Path, mib: u64, ext4_block: Option<u32>) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    if let Some(b) = ext4_block {
        let st = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", &b.to_string(), "-L", "vmtest"])
            .arg(path)
            .status()
            .expect("mkfs.ext4 must be installed");
        assert!(st.success(), "mkfs.ext4 failed");
    }
}

fn stats(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Lines of the insight log.
fn insight_log(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// 4 KiB chunks a block record covers.
fn chunks(r: &Value) -> u64 {
    r["len"].as_u64().unwrap().div_ceil(4096)
}

// ---------------------------------------------------------------------------------------------
// 1. Accuracy (Sky Table 5)

struct Accuracy {
    /// varmail's own count of the 4 KiB data chunks it made durable.
    truth: u64,
    /// vmsight's count (`insights.write_chunks_data` of --stats-json).
    measured: u64,
    /// The same from the insight log: chunks of `data` write records of the disk, and of
    /// `mixed` ones (part data, part metadata).
    log_data: u64,
    log_mixed: u64,
    partial: u64,
}

impl Accuracy {
    fn error_pct(&self) -> f64 {
        self.measured.abs_diff(self.truth) as f64 * 100.0 / self.truth as f64
    }
}

/// One VM per file system, so vmsight's global chunk counters belong to that file system
/// alone (varmail only writes there; mkfs writes the block device, which is never data).
fn varmail_accuracy(fs: &str) -> Accuracy {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.img");
    image(&img, 1024, None);
    let log = dir.path().join("ins.jsonl");
    let st = dir.path().join("stats.json");
    let force = if fs.starts_with("ext") { "-F" } else { "-f" };
    let script = format!(
        "set -e; modprobe {m} 2>/dev/null || true
mkfs.{fs} -q {force} /dev/vdb > /dev/null; mkdir -p /mnt/v; mount /dev/vdb /mnt/v
varmail -d /mnt/v/vm -n 300 -o 20000 -s 11
umount /mnt/v",
        m = if fs == "ext2" { "ext2" } else { fs }
    );
    let r = guest_sh(
        &[
            "--disk",
            img.to_str().unwrap(),
            "--insights",
            log.to_str().unwrap(),
            "--insight-target",
            "@cmd",
            "--stats-json",
            st.to_str().unwrap(),
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{fs}: {r:?}");
    let field = |name: &str| -> u64 {
        r.stdout
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{fs}: no {name} in varmail's output: {r:?}"))
    };
    let truth = field("data_chunks ");
    let partial = field("partial_chunks ");
    assert!(truth > 5000, "{fs}: varmail wrote too little: {truth}");
    let measured = stats(&st)["insights"]["write_chunks_data"]
        .as_u64()
        .unwrap();
    let (mut log_data, mut log_mixed) = (0, 0);
    for rec in insight_log(&log) {
        if rec["op"] == "write" && rec["disk"] == 1 {
            match rec["content"].as_str() {
                Some("data") => log_data += chunks(&rec),
                Some("mixed") => log_mixed += chunks(&rec),
                _ => {}
            }
        }
    }
    let a = Accuracy {
        truth,
        measured,
        log_data,
        log_mixed,
        partial,
    };
    println!(
        "accuracy {fs}: varmail data_chunks {truth} (partial {partial}), vmsight data chunks \
         {measured} (log: {log_data} in data requests, {log_mixed} in mixed ones), \
         misclassification {:.3}%",
        a.error_pct()
    );
    a
}

fn assert_accurate(fs: &str) {
    let a = varmail_accuracy(fs);
    // The log and the counters are two views of the same classification.
    assert!(
        a.log_data <= a.measured && a.measured <= a.log_data + a.log_mixed,
        "{fs}: counters {} vs log {} data + {} mixed chunks",
        a.measured,
        a.log_data,
        a.log_mixed
    );
    assert!(
        a.error_pct() < 1.0,
        "{fs}: misclassification {:.3}% (varmail {} data chunks, {} of them partial; vmsight {})",
        a.error_pct(),
        a.truth,
        a.partial,
        a.measured
    );
}

#[test]
fn accuracy_ext4_varmail_under_one_percent() {
    assert_accurate("ext4");
}

#[test]
fn accuracy_ext2_varmail_under_one_percent() {
    assert_accurate("ext2");
}

#[test]
fn accuracy_xfs_varmail_under_one_percent() {
    assert_accurate("xfs");
}

/// btrfs is reported as measured (Sky: 3.9%): copy-on-write, checksums and inline extents make
/// it write less file data as data blocks than varmail counts. Asserted: vmsight never finds
/// more data than varmail wrote (a metadata block taken for data would be a false match).
#[test]
fn accuracy_btrfs_varmail_reported() {
    let a = varmail_accuracy("btrfs");
    assert!(
        a.measured <= a.truth,
        "btrfs: vmsight found {} data chunks, varmail wrote {}",
        a.measured,
        a.truth
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Hints change exactly the tagged requests

/// Disk byte offsets (4 KiB blocks) of the data blocks of `path` on the ext4 `img` (4 KiB
/// blocks), from debugfs: an oracle independent of vmsight's fd tables.
fn file_blocks(img: &Path, path: &str) -> Vec<u64> {
    let out = debugfs(img, &format!("blocks {path}"));
    let blocks: Vec<u64> = out
        .split_whitespace()
        .map(|b| b.parse::<u64>().unwrap() * 4096)
        .collect();
    assert!(!blocks.is_empty(), "debugfs lists no blocks of {path}");
    blocks
}

/// Writes a tagged and an untagged file with libvmsight and with the shim, then checks every
/// block write of the disk against the files' blocks. With `separate`, a `sync` between the two
/// files of each pair keeps the guest from merging their writeback into one request.
fn hints_tag_exactly(separate: bool) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("h.img");
    image(&img, 512, Some(4096));
    let log = dir.path().join("ins.jsonl");
    // Two files per mechanism: one tagged, one not. The libvmsight pair uses the same tool;
    // class 300 is outside 0..=255, so libvmsight issues that call without a hint. The shim
    // pair is written by one shell whose two redirections only one glob matches.
    let script = format!(
        "set -e; mount /dev/vdb /mnt; mkdir /mnt/t /mnt/p
hintwrite write /mnt/t/lib 3 300000 65536
{sep}
hintwrite write /mnt/p/lib 300 300000 65536
export VMSIGHT_HINTS='/mnt/t/*=6'
{PRELOAD} sh -c 'dd if=/dev/urandom of=/mnt/t/shim bs=65536 count=5 status=none; {sep} \
dd if=/dev/urandom bs=65536 count=5 status=none > /mnt/p/shim'
sync; umount /mnt; echo done",
        sep = if separate { "sync;" } else { "" }
    );
    let r = guest_sh(
        &[
            "--disk",
            img.to_str().unwrap(),
            "--insights",
            log.to_str().unwrap(),
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("done"), "{r:?}");

    // Which file every 4 KiB disk block belongs to, and the class it must carry.
    let files: [(&str, Option<u64>); 4] = [
        ("/t/lib", Some(3)),
        ("/p/lib", None),
        ("/t/shim", Some(6)),
        ("/p/shim", None),
    ];
    let mut owner: HashMap<u64, usize> = HashMap::new();
    for (i, (f, _)) in files.iter().enumerate() {
        for b in file_blocks(&img, f) {
            owner.insert(b, i);
        }
    }
    let records: Vec<Value> = insight_log(&log)
        .into_iter()
        .filter(|r| r["op"] == "write" && r["disk"] == 1)
        .collect();
    let mut seen: Vec<u64> = vec![0; files.len()];
    for rec in &records {
        let off = rec["offset"].as_u64().unwrap();
        let app = rec["app_class"].as_u64();
        let mut owners: Vec<usize> = (0..chunks(rec))
            .filter_map(|k| owner.get(&(off + k * 4096)).copied())
            .collect();
        owners.sort_unstable();
        owners.dedup();
        if owners.is_empty() {
            // Metadata, journal, directories: never hinted.
            assert_eq!(app, None, "untagged request carries a class: {rec}");
            continue;
        }
        for &i in &owners {
            seen[i] += 1;
        }
        let want: Vec<Option<u64>> = owners.iter().map(|&i| files[i].1).collect();
        assert!(
            want.iter().all(|w| *w == want[0]),
            "one request covers tagged and untagged files: {rec}"
        );
        assert_eq!(
            app,
            want[0],
            "request of {:?} has app_class {app:?}: {rec}",
            owners.iter().map(|&i| files[i].0).collect::<Vec<_>>()
        );
        if want[0].is_some() {
            assert_eq!(rec["content"], "data", "{rec}");
            assert_eq!(
                rec["class"].as_u64(),
                want[0],
                "the hint sets the class: {rec}"
            );
        }
    }
    for (i, (f, _)) in files.iter().enumerate() {
        assert!(seen[i] > 0, "no block write of {f} in the insight log");
    }
}

#[test]
fn hints_change_exactly_the_tagged_requests() {
    hints_tag_exactly(true);
}

/// Neighbouring files written back together become one block request; its blocks of the
/// untagged file must not get the tagged file's class. Fails today: the classifier gives the
/// whole request the first matched chunk's hint (/tmp/insight-bugs/01.md).
#[test]
fn hints_merged_request_tags_only_the_tagged_blocks() {
    hints_tag_exactly(false);
}

// ---------------------------------------------------------------------------------------------
// 3. Data integrity with every policy, mode and size

/// The mixed workload on directory `$1`: many small and a few big files, O_DIRECT writes
/// (straight into the cache), unaligned overwrites, appends, deletes, space reuse, truncate.
const WORKLOAD: &str = r#"work() {
  d=$1; mkdir -p $d/small $d/big $d/deep/a/b
  i=0; while [ $i -lt 200 ]; do head -c $(( (i * 7919) % 20000 + 1 )) /dev/urandom > $d/small/f$i; i=$((i+1)); done
  head -c 5000000 /dev/urandom > $d/big/b1
  head -c 3145728 /dev/urandom > $d/big/b2
  dd if=/dev/urandom of=$d/big/b3 bs=1M count=4 oflag=direct status=none
  dd if=/dev/urandom of=$d/big/b1 bs=1000 seek=777 count=300 conv=notrunc status=none
  dd if=/dev/urandom of=$d/big/b2 bs=513 seek=3 count=3000 conv=notrunc status=none
  dd if=/dev/urandom of=$d/big/b3 bs=4096 seek=100 count=50 conv=notrunc oflag=direct status=none
  head -c 70001 /dev/urandom >> $d/big/b1
  i=0; while [ $i -lt 200 ]; do head -c 3001 /dev/urandom >> $d/small/f$i; i=$((i+7)); done
  i=0; while [ $i -lt 200 ]; do rm $d/small/f$i; i=$((i+3)); done
  rm $d/big/b2
  head -c 2500000 /dev/urandom > $d/deep/a/b/c
  i=0; while [ $i -lt 40 ]; do head -c 1500 /dev/urandom > $d/deep/s$i; i=$((i+1)); done
  truncate -s 1234567 $d/big/b1
  sync
}
sums() { (cd $1 && find . -type f | sort | xargs sha256sum); }
"#;

/// sha256 of every file under `dir` on the host, keyed like the guest's `sums` ("./x/y").
fn host_sums(dir: &Path) -> BTreeMap<String, String> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    let mut out = BTreeMap::new();
    for chunk in files.chunks(200) {
        let o = Command::new("sha256sum").args(chunk).output().unwrap();
        assert!(o.status.success());
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            let (h, p) = l.split_once("  ").unwrap();
            let rel = Path::new(p).strip_prefix(dir).unwrap();
            out.insert(format!("./{}", rel.display()), h.to_string());
        }
    }
    out
}

/// Guest lines `SUM<tag> HASH  PATH` → map.
fn guest_sums(stdout: &str, tag: &str) -> BTreeMap<String, String> {
    let prefix = format!("SUM{tag} ");
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|l| {
            let (h, p) = l.split_once("  ").unwrap();
            (p.to_string(), h.to_string())
        })
        .collect()
}

/// `e2fsck -fn` clean, and every file the guest summed, dumped with debugfs, has that sha256.
fn check_image_on_host(img: &Path, want: &BTreeMap<String, String>, what: &str) {
    let (clean, out) = fsck_clean(img);
    assert!(clean, "{what}: e2fsck -fn: {out}");
    let dump = tempfile::tempdir().unwrap();
    let dirs: Vec<String> = ["small", "big", "deep"]
        .iter()
        .map(|d| format!("/{d}"))
        .collect();
    let o = Command::new("debugfs")
        .args([
            "-R",
            &format!("rdump {} {}", dirs.join(" "), dump.path().display()),
        ])
        .arg(img)
        .output()
        .unwrap();
    assert!(o.status.success(), "{what}: debugfs rdump: {o:?}");
    let got = host_sums(dump.path());
    assert!(
        want.len() > 150,
        "{what}: too few files summed: {}",
        want.len()
    );
    assert_eq!(
        &got, want,
        "{what}: files on the image differ from the guest's"
    );
}

/// Blocks a cache evicted for room (a `CacheSnapshot` of --stats-json or the control socket).
fn evictions(c: &Value) -> u64 {
    c["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["evictions"].as_u64().unwrap())
        .sum()
}

/// One VM with two host-made ext4 disks (4 KiB and 1 KiB blocks), each with its own cache of
/// `mib` MiB under `policy`/`mode`, and insights on (so `priority` sees real classes).
fn integrity(policy: &str, mode: &str, mib: u64) {
    let what = format!("{policy}/{mode}/{mib}MiB");
    let dir = tempfile::tempdir().unwrap();
    let imgs = [dir.path().join("a.img"), dir.path().join("b.img")];
    image(&imgs[0], 256, Some(4096));
    image(&imgs[1], 256, Some(1024));
    let st = dir.path().join("stats.json");
    let script = format!(
        "set -e
{WORKLOAD}
for n in b c; do
  dev=/dev/vd$n; mkdir -p /mnt/$n; mount $dev /mnt/$n
  work /mnt/$n
  sums /mnt/$n > /tmp/s1.$n
  echo 3 > /proc/sys/vm/drop_caches
  sums /mnt/$n > /tmp/s2.$n
  umount /mnt/$n; mount $dev /mnt/$n
  sums /mnt/$n > /tmp/s3.$n
  umount /mnt/$n
  cmp /tmp/s1.$n /tmp/s2.$n; cmp /tmp/s1.$n /tmp/s3.$n
  sed \"s/^/SUM$n /\" /tmp/s1.$n
done
echo done"
    );
    let log = dir.path().join("ins.jsonl");
    let r = guest_sh(
        &[
            "--disk",
            imgs[0].to_str().unwrap(),
            "--disk",
            imgs[1].to_str().unwrap(),
            "--cache-size",
            &mib.to_string(),
            "--cache-policy",
            policy,
            "--cache-mode",
            mode,
            "--insights",
            log.to_str().unwrap(),
            "--stats-json",
            st.to_str().unwrap(),
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{what}: {r:?}");
    assert!(r.stdout.contains("done"), "{what}: {r:?}");
    let s = stats(&st);
    for (i, img) in imgs.iter().enumerate() {
        let c = &s["disks"][i + 1]["cache"];
        println!("{what} disk {}: cache {c}", i + 1);
        // The workload must have gone through the cache and overflowed it.
        assert!(
            c["hits"].as_u64().unwrap() > 0,
            "{what}: no cache hits: {c}"
        );
        assert!(evictions(c) > 0, "{what}: the cache never evicted: {c}");
        if mode == "write-back" {
            assert!(c["writebacks"].as_u64().unwrap() > 0, "{what}: {c}");
        }
        let want = guest_sums(&r.stdout, ["b", "c"][i]);
        check_image_on_host(img, &want, &format!("{what} disk {}", i + 1));
    }
}

#[test]
fn integrity_priority_write_back_1mib() {
    integrity("priority", "write-back", 1);
}

#[test]
fn integrity_lru_write_back_3mib() {
    integrity("lru", "write-back", 3);
}

#[test]
fn integrity_priority_write_through_2mib() {
    integrity("priority", "write-through", 2);
}

#[test]
fn integrity_lru_write_through_1mib() {
    integrity("lru", "write-through", 1);
}

// ---------------------------------------------------------------------------------------------
// 4. Write-back crash consistency

fn control_status(name: &str) -> Value {
    let base = std::env::var_os("VMSIGHT_RUNTIME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/run/vmsight".into());
    let sock = base.join(name).join("control.sock");
    let mut conn = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    use std::io::Write;
    writeln!(conn, "{}", serde_json::json!({"cmd": "status"})).unwrap();
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    v
}

#[test]
fn write_back_sync_then_sigkill_leaves_a_clean_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("c.img");
    image(&img, 256, Some(4096));
    let name = vm_name("wbcrash");
    // `sync` makes the guest send FLUSH, which must write every dirty cache block to the image.
    // After it, ext4's metadata is safe in the journal but not necessarily checkpointed to its
    // home blocks, and `e2fsck -n` does not replay a journal (it would report the stale home
    // blocks). `fsfreeze -f` checkpoints the journal and clears the needs-recovery flag (and
    // flushes again), so the image is consistent in place — what a checker on the host needs.
    // The cache is big enough that nothing is evicted: only FLUSH writes dirty blocks back.
    let script = format!(
        "set -e
{WORKLOAD}
mount /dev/vdb /mnt
work /mnt
sums /mnt | sed 's/^/SUMc /'
fsfreeze -f /mnt
echo FROZEN
sleep 600"
    );
    let mut child = vmsight()
        .args([
            "run",
            "--name",
            &name,
            "--disk",
            img.to_str().unwrap(),
            "--cache-size",
            "256",
            "--cache-policy",
            "priority",
            "--cache-mode",
            "write-back",
            "--insights",
            dir.path().join("ins.jsonl").to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = String::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut frozen = false;
    for l in lines.by_ref() {
        let l = l.unwrap();
        stdout.push_str(&l);
        stdout.push('\n');
        if l == "FROZEN" {
            frozen = true;
            break;
        }
    }
    if !frozen {
        let out = child.wait_with_output().unwrap();
        panic!("no FROZEN marker: {stdout} {out:?}");
    }
    // Write-back really held dirty data that only FLUSH wrote down.
    let st = control_status(&name);
    let c = &st["disks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["disk"] == 1)
        .unwrap()["cache"];
    println!("cache at freeze: {c}");
    assert!(c["writebacks"].as_u64().unwrap() > 1000, "{c}");
    assert_eq!(evictions(c), 0, "{c}");
    child.kill().unwrap();
    child.wait().unwrap();
    let want = guest_sums(&stdout, "c");
    check_image_on_host(&img, &want, "write-back crash");
}
