//! `vmsight run` options and CLI commands checked for their effect in real guests, each against
//! an oracle independent of vmsight: the guest's own clock, sysfs, /proc/interrupts and
//! sha256sum; on the host /proc (fds, their flags, process tree), the host page cache
//! (mincore), debugfs and the image bytes.
//!
//! * `--disk-model`: a guest-timed write takes at least the modelled transfer time;
//! * `--stream-data`: write events carry exactly the guest's bytes, and none without it;
//! * `--disk …,queues=N`: the guest gets N queues and vmsight serves each of them;
//! * `--disk …,direct`: the image is written through an `O_DIRECT` descriptor;
//! * `--insight-paths`: only files under the listed paths get their data classified;
//! * `vmsight ps`, `vmsight stats`, `vmsight report` against a running VM or its insight log.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sha2::{Digest, Sha256};
use vmsight_tests::oracle::json_file;
use vmsight_tests::*;

// ---------------------------------------------------------------------------------------------
// Helpers

/// A sparse raw image of `mib` MiB.
fn raw_image(path: &Path, mib: u64) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
}

/// A raw image of `mib` MiB with ext4 of 4 KiB blocks, inode tables and journal initialised
/// (no lazy-init zeroing by the guest later).
fn ext4_image(path: &Path, mib: u64) {
    raw_image(path, mib);
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096"])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(path)
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success(), "mkfs.ext4 failed");
}

fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The words after `key` on the guest output line starting with `key `.
fn field<'a>(out: &'a str, key: &str) -> Vec<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {key:?} line in the guest output {out:?}"))
        .split_whitespace()
        .collect()
}

fn field_u64(out: &str, key: &str) -> u64 {
    field(out, key)[0].parse().unwrap()
}

/// Bytes written according to a `/sys/block/vdX/stat` line (field 7: sectors written).
fn stat_written_bytes(stat: &[&str]) -> u64 {
    stat[6].parse::<u64>().unwrap() * 512
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Bytes `[off, off + len)` of a host file.
fn file_range(path: &Path, off: u64, len: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, off)
        .unwrap();
    buf
}

/// Standard base64 (padded) of the `data_b64` event field.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?}"),
        }
    };
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for quad in s.as_bytes().chunks(4) {
        let data: Vec<u8> = quad.iter().copied().filter(|&c| c != b'=').collect();
        let n = data.iter().fold(0u32, |acc, &c| (acc << 6) | val(c)) << (6 * (4 - data.len()));
        out.extend_from_slice(&n.to_be_bytes()[1..data.len()]);
    }
    out
}

/// Host processes whose parent is `ppid` and whose `comm` is `comm`, from /proc.
fn children_named(ppid: u32, comm: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split at the last ')'.
        let Some((head, tail)) = stat.rsplit_once(')') else {
            continue;
        };
        let name = head.split_once('(').map(|(_, n)| n).unwrap_or("");
        let parent = tail.split_whitespace().nth(1).and_then(|x| x.parse().ok());
        if name == comm && parent == Some(ppid) {
            pids.push(pid);
        }
    }
    pids
}

/// (fd, flags of /proc/PID/fdinfo/FD) of every descriptor of `pid` open on `file`.
fn fds_on(pid: u32, file: &Path) -> Vec<(u32, u32)> {
    let want = file.canonicalize().unwrap();
    let mut fds = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        if std::fs::read_link(e.path()).ok().as_deref() != Some(want.as_path()) {
            continue;
        }
        let fd: u32 = e.file_name().to_string_lossy().parse().unwrap();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        fds.push((fd, flags));
    }
    fds
}

/// Pages of `[off, off + len)` of `file` resident in the host page cache (mincore(2)).
fn resident_pages(file: &Path, off: u64, len: u64) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).unwrap();
    let page = 4096usize;
    let pages = (len as usize).div_ceil(page);
    // SAFETY: a fresh read-only shared mapping of a range inside the file (checked by the
    // caller's sizes); it is only passed to mincore and unmapped below, never dereferenced.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            off as libc::off_t,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "mmap {}", file.display());
    let mut vec = vec![0u8; pages];
    // SAFETY: `addr` is the mapping above, `len` its length, `vec` holds one byte per page.
    let rc = unsafe { libc::mincore(addr, len as usize, vec.as_mut_ptr()) };
    // SAFETY: unmapping exactly the mapping made above.
    unsafe { libc::munmap(addr, len as usize) };
    assert_eq!(rc, 0, "mincore {}", file.display());
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Disk byte offsets of the 4 KiB data blocks of `path` on the ext4 `img`, from debugfs.
fn file_blocks(img: &Path, path: &str) -> Vec<u64> {
    let blocks: Vec<u64> = debugfs(img, &format!("blocks {path}"))
        .split_whitespace()
        .map(|b| b.parse::<u64>().unwrap() * 4096)
        .collect();
    assert!(!blocks.is_empty(), "debugfs lists no blocks of {path}");
    blocks
}

// ---------------------------------------------------------------------------------------------
// --disk-model

/// The modelled HDD's media rate, MB/s (10^6 bytes): slow enough that the bound is far above
/// the host's own I/O time.
const MODEL_MBPS: u64 = 4;
/// Bytes the guest writes sequentially to the modelled disk.
const MODEL_BYTES: u64 = 4 << 20;

/// The modelled disk serves one request at a time, each for at least len / rate (a contiguous
/// request skips seek and rotation, nothing is cheaper), and holds every completion until its
/// modelled end: the guest's own clock must see the whole write take at least
/// MODEL_BYTES / rate. The model's counters must show it engaged on the extra disk (requests
/// held) and nowhere on the root disk, which `--disk-model` does not model.
#[test]
fn disk_model_makes_guest_writes_take_at_least_the_modelled_transfer_time() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("model.img");
    raw_image(&img, 64);
    let st = dir.path().join("stats.json");
    let model = format!("hdd:mbps={MODEL_MBPS}");
    let script = format!(
        "set -e; s=$(date +%s%N); \
         dd if=/dev/zero of=/dev/vdb bs=256k count={} oflag=direct status=none; \
         e=$(date +%s%N); echo elapsed_ns $((e - s)); echo stat $(cat /sys/block/vdb/stat)",
        MODEL_BYTES / (256 << 10)
    );
    let r = guest_sh(
        &[
            "--disk",
            p(&img),
            "--disk-model",
            &model,
            "--stats-json",
            p(&st),
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let elapsed = field_u64(&r.stdout, "elapsed_ns");
    let bound = MODEL_BYTES * 1_000_000_000 / (MODEL_MBPS * 1_000_000);
    println!("guest-timed write of {MODEL_BYTES} bytes: {elapsed} ns, model bound {bound} ns");
    assert!(
        elapsed >= bound,
        "the guest wrote {MODEL_BYTES} bytes in {elapsed} ns, below the modelled {bound} ns"
    );
    let guest_writes: u64 = field(&r.stdout, "stat")[4].parse().unwrap();
    let v = json_file(&st);
    let disk = &v["disks"][1];
    let m = &disk["model"];
    assert!(
        m["model"]
            .as_str()
            .unwrap()
            .contains(&format!("{MODEL_MBPS} MB/s")),
        "{m}"
    );
    assert!(
        m["requests"].as_u64().unwrap() >= guest_writes,
        "the model saw fewer requests than the guest's {guest_writes} writes: {m}"
    );
    assert!(
        m["slept_ns"].as_u64().unwrap() > 0,
        "no completion held: {m}"
    );
    assert!(m["modelled_busy_ns"].as_u64().unwrap() >= bound, "{m}");
    assert!(
        disk["metrics"]["bytes_written"].as_u64().unwrap() >= MODEL_BYTES,
        "{disk}"
    );
    // Counter check only: the root disk has no model.
    assert!(
        v["disks"][0].get("model").is_none(),
        "the root disk is modelled: {}",
        v["disks"][0]
    );
}

// ---------------------------------------------------------------------------------------------
// --stream-data

/// The `write` events of `path` in an `--events` file.
fn write_events(events: &Path, path: &str) -> Vec<Value> {
    json_lines(&std::fs::read_to_string(events).unwrap())
        .into_iter()
        .filter(|e| e["type"] == "write" && e["path"] == path)
        .collect()
}

/// Boots a guest that writes `/srv/f` (random bytes) on a streamed ext4 disk; returns the
/// guest's (sha256, size) of the file and its write events.
fn stream_file_write(extra: &[&str]) -> (String, u64, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("srv.img");
    ext4_image(&img, 64);
    let events = dir.path().join("events.jsonl");
    let disk = format!("{},mount=/srv", img.display());
    let mut args = vec!["--disk", &disk, "--events", p(&events)];
    args.extend_from_slice(extra);
    let r = guest_sh(
        &args,
        "set -e; mount /dev/vdb /srv; head -c 300000 /dev/urandom > /srv/f; sync; \
         echo sha $(sha256sum < /srv/f); echo size $(stat -c %s /srv/f); umount /srv",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let sha = field(&r.stdout, "sha")[0].to_string();
    let size = field_u64(&r.stdout, "size");
    (sha, size, write_events(&events, "/srv/f"))
}

/// With `--stream-data` the `write` events of a file carry its bytes: put together by their
/// ranges they cover the file and hash to what sha256sum in the guest printed. Without the
/// option the same workload gives `write` events with no bytes.
#[test]
fn stream_data_puts_exactly_the_guest_s_written_bytes_in_write_events() {
    let (sha, size, writes) = stream_file_write(&["--stream-data"]);
    assert!(!writes.is_empty(), "no write event for /srv/f");
    let mut file = vec![0u8; size as usize];
    let mut covered = vec![false; size as usize];
    for e in &writes {
        let (s, t) = (
            e["range"][0].as_u64().unwrap() as usize,
            e["range"][1].as_u64().unwrap() as usize,
        );
        let data = base64_decode(e["data_b64"].as_str().unwrap_or_else(|| panic!("{e}")));
        assert_eq!(data.len(), t - s, "bytes of {e}");
        file[s..t].copy_from_slice(&data);
        covered[s..t].iter_mut().for_each(|c| *c = true);
    }
    let holes = covered.iter().filter(|c| !**c).count();
    assert_eq!(holes, 0, "{holes} bytes of /srv/f in no write event");
    assert_eq!(
        sha256_hex(&file),
        sha,
        "streamed bytes differ from the file"
    );

    let (_, _, writes) = stream_file_write(&[]);
    assert!(!writes.is_empty(), "no write event for /srv/f");
    for e in &writes {
        assert!(
            e.get("data_b64").is_none(),
            "bytes without --stream-data: {e}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// queues=N

/// Guest script: for every queue K of `dev` (virtio device `virtioN`), writes 1 MiB at K MiB
/// from the first CPU of the queue's `cpu_list` (taskset), and prints the queue's interrupt
/// count (the MSI-X vector `virtioN-req.K`, summed over CPUs) before and after, with the
/// sha256 of what it wrote.
fn per_queue_script(dev: &str) -> String {
    format!(
        r#"v=$(basename $(readlink /sys/block/{dev}/device))
irqs() {{ grep " $v-req.$1\$" /proc/interrupts | awk '{{s=0; for (i=2; i<=NF; i++) if ($i ~ /^[0-9]+$/) s+=$i; print s}}'; }}
for q in $(ls /sys/block/{dev}/mq); do
  cpu=$(cut -d, -f1 /sys/block/{dev}/mq/$q/cpu_list | cut -d- -f1)
  head -c 1048576 /dev/urandom > /tmp/q$q
  before=$(irqs $q)
  taskset -c $cpu dd if=/tmp/q$q of=/dev/{dev} bs=64k seek=$((q * 16)) oflag=direct status=none
  echo queue $q cpu $cpu irqs $before $(irqs $q) sha $(sha256sum < /tmp/q$q)
done"#
    )
}

/// One `queue` line of [`per_queue_script`]: (queue, irqs before, irqs after, sha256).
fn queue_lines(out: &str) -> Vec<(u64, u64, u64, String)> {
    out.lines()
        .filter_map(|l| l.strip_prefix("queue "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (
                w[0].parse().unwrap(),
                w[4].parse().unwrap(),
                w[5].parse().unwrap(),
                w[7].to_string(),
            )
        })
        .collect()
}

/// `queues=N` sets the number of virtqueues the guest gets: with the default 2 vCPUs (the guest
/// uses at most one queue per CPU, and the default is 2 queues), `queues=1` gives one blk-mq
/// queue and `queues=2` two. On the 2-queue disk the guest writes from a CPU of each queue; the
/// queue's own completion interrupt counter in the guest rises (vmsight completed requests on
/// that virtqueue) and each write is on the host image. vmsight itself has no per-queue
/// counters (its block counters are per disk), so the per-queue evidence is the guest's.
#[test]
fn queues_option_sets_the_guest_s_queue_count_and_every_queue_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one.img");
    let two = dir.path().join("two.img");
    raw_image(&one, 16);
    raw_image(&two, 16);
    let st = dir.path().join("stats.json");
    let script = format!(
        "set -e; echo nqueues $(ls /sys/block/vdb/mq | wc -l) $(ls /sys/block/vdc/mq | wc -l)\n{}",
        per_queue_script("vdc")
    );
    let r = guest_sh(
        &[
            "--disk",
            &format!("{},queues=1", one.display()),
            "--disk",
            &format!("{},queues=2", two.display()),
            "--stats-json",
            p(&st),
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(field(&r.stdout, "nqueues"), ["1", "2"], "{r:?}");
    let queues = queue_lines(&r.stdout);
    println!("(queue, irqs before, irqs after, sha256): {queues:?}");
    assert_eq!(
        queues.iter().map(|q| q.0).collect::<Vec<_>>(),
        [0, 1],
        "{r:?}"
    );
    for (q, before, after, sha) in &queues {
        assert!(
            after > before,
            "queue {q} got no completion interrupt: {r:?}"
        );
        let on_host = file_range(&two, q << 20, 1 << 20);
        assert_eq!(&sha256_hex(&on_host), sha, "the write through queue {q}");
    }
    let m = &json_file(&st)["disks"][2]["metrics"];
    assert!(m["bytes_written"].as_u64().unwrap() >= 2 << 20, "{m}");
}

// ---------------------------------------------------------------------------------------------
// ,direct

/// `--disk PATH,direct`: vmsight holds a read-write `O_DIRECT` descriptor on the image, the
/// guest's synced writes reach the file without passing through the host page cache (none of
/// their pages is resident afterwards), and their bytes are on the image. A disk without
/// `direct` in the same VM has no `O_DIRECT` descriptor and its written pages are cached.
/// (vmsight also keeps a buffered descriptor on a direct image, for requests O_DIRECT cannot
/// take: crates/blockdev/src/file.rs.)
#[test]
fn direct_disk_is_written_through_o_direct_and_reaches_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let direct = dir.path().join("direct.img");
    let buffered = dir.path().join("buffered.img");
    raw_image(&direct, 64);
    raw_image(&buffered, 64);
    let name = vm_name("direct");
    let d = format!("{},direct", direct.display());
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--disk",
        &d,
        "--disk",
        p(&buffered),
        "--",
        "sh",
        "-c",
        "set -e; head -c 1048576 /dev/urandom > /tmp/x; \
         for d in vdb vdc; do dd if=/tmp/x of=/dev/$d bs=64k seek=16 conv=fsync status=none; done; \
         sync; echo sha $(sha256sum < /tmp/x); echo READY; read _",
    ]);
    let sha_line = vm.wait_prefix("sha ");
    vm.wait_line("READY");
    let pid = vm.pid();
    let o_direct = libc::O_DIRECT as u32;
    let rw = |flags: u32| flags & libc::O_ACCMODE as u32 == libc::O_RDWR as u32;
    let dfds = fds_on(pid, &direct);
    assert!(
        dfds.iter().any(|&(_, f)| f & o_direct != 0 && rw(f)),
        "no read-write O_DIRECT descriptor on the direct image: {dfds:?}"
    );
    let bfds = fds_on(pid, &buffered);
    assert!(!bfds.is_empty());
    assert!(
        bfds.iter().all(|&(_, f)| f & o_direct == 0),
        "O_DIRECT on the buffered image: {bfds:?}"
    );
    // Before anything on the host reads the files: where the guest wrote, the direct image has
    // nothing in the page cache, the buffered one everything.
    let (off, len) = (1u64 << 20, 1u64 << 20);
    assert_eq!(
        resident_pages(&direct, off, len),
        0,
        "direct writes were cached"
    );
    // The control: buffered writes leave their pages cached (> 0 rather than all 256, so host
    // memory pressure cannot fail the test).
    assert!(
        resident_pages(&buffered, off, len) > 0,
        "buffered writes not cached"
    );
    let sha = sha_line.split_whitespace().nth(1).unwrap();
    assert_eq!(sha256_hex(&file_range(&direct, off, len)), sha);
    assert_eq!(sha256_hex(&file_range(&buffered, off, len)), sha);
    vm.send("");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
}

// ---------------------------------------------------------------------------------------------
// ,io=io_uring

/// The completion counters of every io_uring instance `pid` has open (`CqHead` in the ring's
/// fdinfo: completions the process has consumed).
fn uring_completions(pid: u32) -> Vec<u64> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let target = std::fs::read_link(e.path()).unwrap_or_default();
        if target.to_string_lossy() != "anon_inode:[io_uring]" {
            continue;
        }
        let fd = e.file_name().to_string_lossy().into_owned();
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")) else {
            continue;
        };
        let head = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("CqHead:"))
            .map(|v| v.trim().parse::<u64>().unwrap());
        out.push(head.expect("CqHead in an io_uring's fdinfo"));
    }
    out
}

/// `--disk PATH,io=io_uring` (with and without `direct`): the guest's writes of every size,
/// its O_DIRECT writes and a write-zeroes reach the images byte for byte (sha256 in the guest
/// against the host's view of the images), reads after dropping the guest's cache return the
/// same bytes, and the requests went through the rings: vmsight holds one io_uring per such
/// disk and each has completed at least as many operations as the guest's requests that reach
/// it (the kernel's own counter in the ring's fdinfo). A threads disk in the same VM adds no
/// ring.
#[test]
fn io_uring_disks_carry_the_guests_reads_and_writes_to_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let direct = dir.path().join("direct.img");
    let buffered = dir.path().join("buffered.img");
    let threads = dir.path().join("threads.img");
    for f in [&direct, &buffered, &threads] {
        raw_image(f, 64);
    }
    let name = vm_name("uring");
    let d1 = format!("{},io=io_uring,direct", direct.display());
    let d2 = format!("{},io=io_uring", buffered.display());
    let d3 = format!("{},io=threads", threads.display());
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--disk",
        &d1,
        "--disk",
        &d2,
        "--disk",
        &d3,
        "--",
        "sh",
        "-c",
        "set -e; head -c 4194304 /dev/urandom > /tmp/x; \
         for d in vdb vdc vdd; do \
           dd if=/tmp/x of=/dev/$d bs=4k count=256 conv=fsync status=none; \
           dd if=/tmp/x of=/dev/$d bs=1M skip=1 seek=1 count=3 oflag=direct status=none; \
           dd if=/tmp/x of=/dev/$d bs=512 count=7 seek=8200 skip=8200 conv=fsync status=none; \
         done; sync; echo 3 > /proc/sys/vm/drop_caches; \
         echo sha $(sha256sum < /tmp/x); \
         for d in vdb vdc vdd; do echo back $d $(head -c 4194304 /dev/$d | sha256sum); done; \
         for d in vdb vdc; do echo stat $d $(cat /sys/block/$d/stat); done; \
         for d in vdb vdc vdd; do blkdiscard -z -o 8388608 -l 1048576 /dev/$d; \
           echo zero $d $(dd if=/dev/$d bs=1M skip=8 count=1 status=none | tr -d '\\000' | wc -c); done; \
         echo READY; read _",
    ]);
    let sha_line = vm.wait_prefix("sha ");
    let sha = sha_line.split_whitespace().nth(1).unwrap().to_owned();
    for dev in ["vdb", "vdc", "vdd"] {
        let back = vm.wait_prefix(&format!("back {dev} "));
        assert!(
            back.contains(&sha),
            "{dev} read back differs: {back} vs {sha}"
        );
    }
    // The guest kernel's own count of the reads, writes and flushes it completed per disk
    // (/sys/block/vdX/stat fields 1, 5 and 16), taken before the write-zeroes below (which
    // the stat counts as writes and vmsight serves beside the ring).
    let mut guest = Vec::new();
    for dev in ["vdb", "vdc"] {
        let l = vm.wait_prefix(&format!("stat {dev} "));
        let f: Vec<u64> = l
            .split_whitespace()
            .skip(2)
            .map(|v| v.parse().unwrap())
            .collect();
        guest.push(f[0] + f[4] + f.get(15).copied().unwrap_or(0));
    }
    for dev in ["vdb", "vdc", "vdd"] {
        let zero = vm.wait_prefix(&format!("zero {dev} "));
        assert!(
            zero.ends_with(" 0"),
            "{dev}: write-zeroes left bytes: {zero}"
        );
    }
    vm.wait_line("READY");
    let rings = uring_completions(vm.pid());
    for img in [&direct, &buffered, &threads] {
        assert_eq!(
            sha256_hex(&file_range(img, 0, 4 << 20)),
            sha,
            "{}",
            img.display()
        );
        assert!(
            file_range(img, 8 << 20, 1 << 20).iter().all(|&b| b == 0),
            "{}: the zeroed range is not zero on the image",
            img.display()
        );
    }
    // Two io_uring disks, two rings, which completed at least one operation per request the
    // guest completed on those disks (a short transfer takes more).
    assert_eq!(rings.len(), 2, "io_uring instances in vmsight: {rings:?}");
    assert!(
        rings.iter().sum::<u64>() >= guest.iter().sum::<u64>()
            && rings.iter().min() >= guest.iter().min(),
        "ring completions {rings:?} against the guest's requests {guest:?}"
    );
    let o_direct = libc::O_DIRECT as u32;
    assert!(fds_on(vm.pid(), &direct)
        .iter()
        .any(|&(_, f)| f & o_direct != 0));
    vm.send("");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
}

// ---------------------------------------------------------------------------------------------
// --insight-paths

/// `--insight-paths /mnt/a,/mnt/c`: the data of files under the listed directories is
/// classified (`data`, the file named), the same writes to files elsewhere are not (their
/// blocks are `metadata` with no file) — including `/mnt/ab`, whose name only starts like a
/// listed path. Which disk blocks belong to which file comes from debugfs on the host.
#[test]
fn insight_paths_classify_the_data_of_listed_paths_only() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ins.img");
    ext4_image(&img, 128);
    let log = dir.path().join("ins.jsonl");
    let files = ["/a/f", "/c/h", "/ab/g", "/b/g"];
    let listed = |f: &str| f.starts_with("/a/") || f.starts_with("/c/");
    let writes: String = files
        .iter()
        .map(|f| format!("dd if=/dev/urandom of=/mnt{f} bs=64k count=8 status=none; sync; "))
        .collect();
    let r = guest_sh(
        &[
            "--disk",
            p(&img),
            "--insights",
            p(&log),
            "--insight-paths",
            "/mnt/a,/mnt/c",
        ],
        &format!(
            "set -e; mount /dev/vdb /mnt; mkdir /mnt/a /mnt/b /mnt/c /mnt/ab; {writes}\
             umount /mnt; echo done"
        ),
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut owner: HashMap<u64, &str> = HashMap::new();
    for f in files {
        for b in file_blocks(&img, f) {
            owner.insert(b, f);
        }
    }
    let records: Vec<Value> = json_lines(&std::fs::read_to_string(&log).unwrap())
        .into_iter()
        .filter(|r| r["op"] == "write" && r["disk"] == 1)
        .collect();
    let mut blocks_seen: BTreeMap<&str, usize> = BTreeMap::new();
    for rec in &records {
        let off = rec["offset"].as_u64().unwrap();
        let n = rec["len"].as_u64().unwrap().div_ceil(4096);
        for k in 0..n {
            let Some(&f) = owner.get(&(off + k * 4096)) else {
                continue;
            };
            *blocks_seen.entry(f).or_default() += 1;
            if listed(f) {
                assert_eq!(rec["content"], "data", "{f}: {rec}");
                assert_eq!(rec["file"], format!("/mnt{f}"), "{rec}");
            } else {
                assert_ne!(rec["content"], "data", "unlisted {f} classified: {rec}");
                assert!(rec["file"].is_null(), "unlisted {f} named: {rec}");
            }
        }
    }
    for f in files {
        assert_eq!(
            blocks_seen.get(f).copied().unwrap_or(0),
            128,
            "block writes of {f}: {blocks_seen:?}"
        );
    }
    // Every record that names a file, block or file record (unlink, truncate: a shell's
    // `> /dev/null` truncates /dev/null), names a listed one.
    for rec in json_lines(&std::fs::read_to_string(&log).unwrap()) {
        if let Some(file) = rec["file"].as_str() {
            assert!(
                file.starts_with("/mnt/a/") || file.starts_with("/mnt/c/"),
                "a record names an unlisted file: {rec}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// vmsight ps, vmsight stats

/// `vmsight ps` lists the running VMs: the entry of this test's VM names the `vmsight run`
/// process (the host's /proc: our child), QEMU (that process's child `qemu-system-x86`), its
/// start time and the disk images, each open in the vmsight process; once the VM is gone it
/// is no longer listed. (`vmsight ps` lists VMs, not guest processes.)
#[test]
fn ps_lists_the_running_vm_with_its_processes_and_disks() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ps.img");
    raw_image(&img, 16);
    let name = vm_name("ps");
    let t0 = now_unix();
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--disk",
        p(&img),
        "--",
        "sh",
        "-c",
        "echo READY; read _",
    ]);
    vm.wait_line("READY");
    let pid = vm.pid();
    let qemu = children_named(pid, "qemu-system-x86");
    assert_eq!(qemu.len(), 1, "QEMU children of vmsight: {qemu:?}");

    let r = run(&["ps", "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let list: Vec<Value> = serde_json::from_str(&r.stdout).unwrap();
    let e = list
        .iter()
        .find(|e| e["name"] == name.as_str())
        .unwrap_or_else(|| panic!("{name} not listed: {r:?}"));
    assert_eq!(e["pid"], pid, "{e}");
    assert_eq!(e["qemu_pid"], qemu[0], "{e}");
    let started = e["started_unix"].as_u64().unwrap();
    assert!((t0..=now_unix()).contains(&started), "{e}");
    let disks: Vec<PathBuf> = e["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| PathBuf::from(d.as_str().unwrap()))
        .collect();
    assert_eq!(disks.len(), 2, "{e}");
    assert_eq!(disks[1], img, "{e}");
    for d in &disks {
        assert!(
            !fds_on(pid, d).is_empty(),
            "{} not open in vmsight",
            d.display()
        );
    }
    let text = run(&["ps"]);
    let line = text
        .stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
        .unwrap_or_else(|| panic!("{name} not in {text:?}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        (words[1], words[2]),
        (pid.to_string().as_str(), qemu[0].to_string().as_str()),
        "{line}"
    );
    assert!(line.ends_with(&format!(",{}", img.display())), "{line}");

    vm.send("");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    let after: Vec<Value> = serde_json::from_str(&run(&["ps", "--json"]).stdout).unwrap();
    assert!(
        after.iter().all(|e| e["name"] != name.as_str()),
        "{name} still listed after it ended: {after:?}"
    );
}

/// `vmsight stats NAME` of a running VM: the streamed extra disk's write-tap bytes lie between
/// what the guest's /sys/block/vdb/stat said it had written before the query and after it
/// (then synced), and its file events are the one file the guest created (one `create`); the
/// text form names the same count.
#[test]
fn stats_of_a_running_vm_match_the_guest_s_own_disk_counters() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("stats.img");
    ext4_image(&img, 64);
    let name = vm_name("stats");
    let disk = format!("{},mount=/srv", img.display());
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--disk",
        &disk,
        "--",
        "sh",
        "-c",
        "set -e; mount /dev/vdb /srv; head -c 2000000 /dev/urandom > /srv/f; sync; \
         echo stat1 $(cat /sys/block/vdb/stat); echo READY; read _; sync; \
         echo stat2 $(cat /sys/block/vdb/stat); umount /srv",
    ]);
    let stat1 = vm.wait_prefix("stat1 ");
    vm.wait_line("READY");
    let r = run(&["stats", &name, "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let text = run(&["stats", &name]);
    assert_eq!(text.code, Some(0), "{text:?}");
    vm.send("");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    let stat2 = out
        .iter()
        .find_map(|l| l.strip_prefix("stat2 "))
        .unwrap_or_else(|| panic!("no stat2 in {out:?}"));

    let reply: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    let d = reply["disks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["disk"] == 1)
        .unwrap_or_else(|| panic!("no disk 1: {reply}"));
    assert_eq!(d["streaming"], true, "{d}");
    let tap =
        d["tap"]["bytes"].as_u64().unwrap() + d["tap"]["bytes_without_data"].as_u64().unwrap();
    let lo = stat_written_bytes(&stat1.split_whitespace().skip(1).collect::<Vec<_>>());
    let hi = stat_written_bytes(&stat2.split_whitespace().collect::<Vec<_>>());
    assert!(lo >= 2_000_000, "the guest wrote {lo} bytes");
    assert!(
        (lo..=hi).contains(&tap),
        "vmsight stats: {tap} bytes written; the guest: {lo} before, {hi} after: {d}"
    );
    let by_kind: BTreeMap<String, u64> = d["inference"]["events_by_kind"]
        .as_array()
        .unwrap()
        .iter()
        .map(|kv| (kv[0].as_str().unwrap().to_string(), kv[1].as_u64().unwrap()))
        .collect();
    assert_eq!(by_kind.get("create"), Some(&1), "{d}");
    let events = d["inference"]["events"].as_u64().unwrap();
    assert!(
        text.stdout
            .lines()
            .any(|l| l == format!("disk1: file events {events}")),
        "{text:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// vmsight report

/// `vmsight report` of a run's insight log, against the guest's own view: the writes it
/// counts for the extra disk are the bytes /sys/block/vdb/stat says the guest wrote; its data
/// bytes are the two files the guest wrote (1 MiB + 512 KiB), whose 384 blocks are born; the
/// guest's one `rm` is one unlink, it ends the lifetime of exactly the removed file's 256
/// blocks, and the kept file's 128 are still alive.
#[test]
fn report_of_an_insight_log_matches_what_the_guest_wrote_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("report.img");
    ext4_image(&img, 128);
    let log = dir.path().join("ins.jsonl");
    let r = guest_sh(
        &["--disk", p(&img), "--insights", p(&log)],
        "set -e; mount /dev/vdb /mnt; \
         dd if=/dev/urandom of=/mnt/gone bs=64k count=16 status=none; \
         dd if=/dev/urandom of=/mnt/kept bs=64k count=8 status=none; sync; \
         rm /mnt/gone; sync; umount /mnt; echo stat $(cat /sys/block/vdb/stat)",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let written = stat_written_bytes(&field(&r.stdout, "stat"));
    let rep = run(&["report", p(&log), "--json", "--fs", "1=ext4"]);
    assert_eq!(rep.code, Some(0), "{rep:?}");
    let v: Value = serde_json::from_str(&rep.stdout).unwrap();
    println!(
        "{}",
        serde_json::to_string_pretty(&v["filesystems"]).unwrap()
    );
    println!("unlinks {} lifetimes {}", v["unlinks"], v["lifetimes"]);
    let fs = v["filesystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["disk"] == 1)
        .unwrap_or_else(|| panic!("no disk 1 in {}", v["filesystems"]));
    let n = |k: &str| fs[k].as_u64().unwrap();
    assert_eq!(
        n("metadata_write_bytes") + n("data_write_bytes") + n("mixed_write_bytes"),
        written,
        "the report's writes of disk 1 differ from the guest's: {fs}"
    );
    assert_eq!(n("data_write_bytes"), (1 << 20) + (512 << 10), "{fs}");
    assert_eq!(v["unlinks"], 1, "{}", v["unlinks"]);
    let life = &v["lifetimes"];
    assert_eq!(life["born"], 256 + 128, "{life}");
    assert_eq!(life["ended"]["unlink"], 256, "{life}");
    assert_eq!(life["alive"], 128, "{life}");
}

/// Single-threaded TCG with a plugin that instruments code is refused before QEMU starts,
/// in one line (the plugin's per-vCPU state lives on TCG's vCPU threads: traces would miss
/// calls, docs/launcher.md).
#[test]
fn single_threaded_tcg_with_tracing_is_a_one_line_error() {
    let r = run(&[
        "run",
        "--qemu",
        "system",
        "--tcg-threads",
        "single",
        "--trace",
        "--",
        "true",
    ]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.one_line_error()
            .starts_with("vmsight: --tcg-threads single cannot be used with tracing"),
        "{r:?}"
    );
}
