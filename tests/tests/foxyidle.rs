//! FoxyIdle (issue 11) on real guests: who submitted each block request, checked against the
//! guest kernel's own `block:block_bio_queue` tracepoint (fired in the submitter's context,
//! with `options/record-tgid`), in both directions; background reads held on the HDD model
//! while foreground ones never are; the held reads return the right data (sha256 against the
//! host); and marking on a running VM (`vmsight idle`) and from the guest (libvmsight's
//! preload shim, the `vmsight-background` wrapper, with a child) both take effect.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;
use vmsight_tests::*;

const MIB: usize = 1 << 20;

/// A deterministic pseudo-random file (incompressible, distinct per seed).
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(b))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An ext4 image of `mib` MiB holding `files` (name, bytes), made with `mkfs.ext4 -d`.
fn image_with(dir: &Path, mib: u64, files: &[(&str, &[u8])]) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for (name, bytes) in files {
        std::fs::write(src.join(name), bytes).unwrap();
    }
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&src)
        .arg(&img)
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success(), "mkfs.ext4 -d failed");
    img
}

/// One line of `--idle-log`.
#[derive(Debug, Clone)]
struct Logged {
    disk: u64,
    sector: u64,
    sectors: u64,
    read: bool,
    owner: String,
    tgid: u32,
    held_us: u64,
}

fn idle_log(path: &Path) -> Vec<Logged> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Logged {
                disk: v["disk"].as_u64().unwrap(),
                sector: v["sector"].as_u64().unwrap(),
                sectors: v["sectors"].as_u64().unwrap(),
                read: v["op"] == "read",
                owner: v["owner"].as_str().unwrap().to_string(),
                tgid: v["tgid"].as_u64().unwrap() as u32,
                held_us: v["held_us"].as_u64().unwrap(),
            }
        })
        .collect()
}

/// A `block_bio_queue` event: (TGID, first sector, sectors), reads only, for device `dev`.
fn bio_events(trace: &str, dev: &str) -> Vec<(u32, u64, u64)> {
    let mut out = Vec::new();
    for line in trace.lines() {
        let Some((head, ev)) = line.split_once("block_bio_queue: ") else {
            continue;
        };
        // "   cat-215     (    215) [001] .....  12.3: block_bio_queue: 254,16 R 1024 + 256 [cat]"
        let tgid = head
            .split_once('(')
            .and_then(|(_, r)| r.split_once(')'))
            .and_then(|(t, _)| t.trim().parse::<u32>().ok());
        let f: Vec<&str> = ev.split_whitespace().collect();
        if f.len() < 5 || f[0] != dev || !f[1].contains('R') {
            continue;
        }
        if let (Some(t), Ok(s), Ok(n)) = (tgid, f[2].parse::<u64>(), f[4].parse::<u64>()) {
            out.push((t, s, n));
        }
    }
    out
}

/// The guest's own latency of each read request of device `dev` (seconds, from its
/// `block_rq_issue` to its `block_rq_complete` on the `mono` trace clock), by (first sector,
/// sectors). A sector range read twice keeps its first request.
fn guest_read_latencies(trace: &str, dev: &str) -> BTreeMap<(u64, u64), f64> {
    let mut out = BTreeMap::new();
    for r in guest_reads(trace, dev) {
        let first = out.entry((r.sector, r.sectors)).or_insert(f64::NAN);
        if first.is_nan() && !r.completed.is_nan() {
            *first = r.completed - r.issued;
        }
    }
    out.retain(|_, t| !t.is_nan());
    out
}

/// The oracle's submitter of each logged read of disk 1: the single TGID of the bios that
/// overlap it (`None` when none or several do).
fn oracle_owner(r: &Logged, bios: &[(u32, u64, u64)]) -> Option<u32> {
    let end = r.sector + r.sectors;
    let set: BTreeSet<u32> = bios
        .iter()
        .filter(|(_, s, n)| *s < end && s + n > r.sector)
        .map(|(t, _, _)| *t)
        .collect();
    (set.len() == 1).then(|| *set.iter().next().unwrap())
}

fn value_of<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} line in the guest output:\n{out}"))
        .trim()
}

/// The idle stage's counters of disk 1: in a control status disks carry their index
/// (`disk`); in `--stats-json` they are in disk order, root first.
fn disk1_idle(stats: &Value) -> Value {
    let disks = stats["disks"].as_array().unwrap();
    disks
        .iter()
        .find(|d| d["disk"] == 1)
        .or_else(|| disks.get(1).filter(|d| d.get("disk").is_none()))
        .map(|d| d["idle"].clone())
        .unwrap_or(Value::Null)
}

#[test]
fn attribution_matches_the_tracepoint_oracle_and_only_background_reads_are_held() {
    let dir = tempfile::tempdir().unwrap();
    let a = content(1, 32 * MIB);
    let b = content(2, 32 * MIB);
    let img = image_with(dir.path(), 160, &[("a", &a), ("b", &b)]);
    let log = dir.path().join("idle.jsonl");
    let stats = dir.path().join("stats.json");
    let name = vm_name("foxyidle-oracle");
    let script = "set -e; mount /dev/vdb /mnt; T=/sys/kernel/tracing; \
        mount -t tracefs nodev $T; echo 16384 > $T/buffer_size_kb; \
        echo 1 > $T/options/record-tgid; \
        echo mono > $T/trace_clock; \
        echo 1 > $T/events/block/block_bio_queue/enable; \
        echo 1 > $T/events/block/block_rq_issue/enable; \
        echo 1 > $T/events/block/block_rq_complete/enable; \
        cp /bin/cat /tmp/bgread; echo 3 > /proc/sys/vm/drop_caches; \
        /tmp/bgread /mnt/b | sha256sum > /tmp/b.sum & bg=$!; \
        cat /mnt/a | sha256sum > /tmp/a.sum; wait $bg; \
        echo 0 > $T/events/block/enable; \
        echo \"DEV $(cat /sys/block/vdb/dev | tr : ,)\"; \
        echo \"SUMA $(cut -d' ' -f1 /tmp/a.sum)\"; echo \"SUMB $(cut -d' ' -f1 /tmp/b.sum)\"; \
        grep -E 'block_(bio_queue|rq_issue|rq_complete)' $T/trace";
    let r = guest_sh(
        &hdd_idle_args(&name, &img, "bgread", &log, &stats, &[]),
        script,
    );
    assert_eq!(r.code, Some(0), "guest run failed: {}", r.stderr);
    // The held reads (and the others) returned the right data.
    assert_eq!(value_of(&r.stdout, "SUMA "), sha256_hex(&a));
    assert_eq!(value_of(&r.stdout, "SUMB "), sha256_hex(&b));

    let bios = bio_events(&r.stdout, value_of(&r.stdout, "DEV "));
    assert!(bios.len() > 50, "too few oracle events: {}", bios.len());
    let reads: Vec<Logged> = idle_log(&log)
        .into_iter()
        .filter(|l| l.disk == 1 && l.read)
        .collect();
    // Per oracle submitter: how many of its requests vmsight attributed to it (recall), and
    // per vmsight TGID how many the oracle agrees with (precision).
    let mut per: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let mut claimed: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for l in &reads {
        let Some(t) = oracle_owner(l, &bios) else {
            continue;
        };
        let e = per.entry(t).or_default();
        e.0 += 1;
        e.1 += u64::from(l.tgid == t);
        if l.tgid != 0 {
            let c = claimed.entry(l.tgid).or_default();
            c.0 += 1;
            c.1 += u64::from(l.tgid == t);
        }
    }
    let big: Vec<_> = per.iter().filter(|(_, (n, _))| *n >= 20).collect();
    assert!(
        big.len() >= 2,
        "expected two readers with >= 20 requests each in the oracle: {per:?}"
    );
    for (t, (n, ok)) in &big {
        let acc = *ok as f64 / *n as f64;
        assert!(acc >= 0.95, "TGID {t}: {ok}/{n} requests attributed right");
        let (cn, cok) = claimed[t];
        assert!(
            cok as f64 / cn as f64 >= 0.95,
            "TGID {t}: vmsight claims {cn} requests, the oracle agrees on {cok}"
        );
    }
    eprintln!("attribution per oracle TGID (requests, right): {per:?}");

    // The mechanism engaged: background reads were held, foreground ones never.
    let held: Vec<&Logged> = reads.iter().filter(|l| l.held_us > 0).collect();
    assert!(!held.is_empty(), "no read was held");
    assert!(
        held.iter().all(|l| l.owner == "background"),
        "a non-background read was held: {:?}",
        held.iter().find(|l| l.owner != "background")
    );
    // The guest saw each hold: a held read cannot complete in the guest before vmsight let it
    // go, so its latency on the guest's own clock (issue to completion, the trace's `mono`
    // clock) is at least the time vmsight held it.
    let latency = guest_read_latencies(&r.stdout, value_of(&r.stdout, "DEV "));
    let seen: Vec<(&&Logged, f64)> = held
        .iter()
        .filter_map(|l| latency.get(&(l.sector, l.sectors)).map(|t| (l, *t)))
        .collect();
    assert!(
        seen.len() * 2 >= held.len(),
        "the guest's trace has {} of the {} held reads",
        seen.len(),
        held.len()
    );
    for (l, t) in &seen {
        assert!(
            t * 1e6 >= l.held_us as f64,
            "a read held {} us took {:.0} us in the guest: {l:?}",
            l.held_us,
            t * 1e6
        );
    }
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let idle = disk1_idle(&s);
    assert!(idle["held"].as_u64().unwrap() > 0, "stats: {idle}");
    // The idle interval itself engaged (not only the background depth limit): foreground
    // completions opened preemption intervals that held background reads.
    assert!(
        idle["preemption_intervals"].as_u64().unwrap() > 0,
        "stats: {idle}"
    );
    assert!(idle["background"].as_u64().unwrap() > 0, "stats: {idle}");
    assert!(idle["foreground"].as_u64().unwrap() > 0, "stats: {idle}");
    assert_eq!(idle["attribution"]["available"], true, "stats: {idle}");
}

/// `vmsight run` options of an HDD-model extra disk `img` with FoxyIdle marking `background`,
/// its log to `log` and stats to `stats`, plus `extra`.
fn hdd_idle_args<'a>(
    name: &'a str,
    img: &'a Path,
    background: &'a str,
    log: &'a Path,
    stats: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "--name",
        name,
        "--disk",
        img.to_str().unwrap(),
        "--stage",
        "disk-model:hdd",
        "--background",
        background,
        "--idle-log",
        log.to_str().unwrap(),
        "--stats-json",
        stats.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args
}

/// Spawns `vmsight run` with piped stdin/stdout.
fn spawn_vm(args: &[&str]) -> std::process::Child {
    vmsight()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn marks_from_the_cli_and_from_the_guest_library_take_effect_and_nothing_is_held_unmarked() {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<Vec<u8>> = (0..4).map(|i| content(10 + i, 8 * MIB)).collect();
    let img = image_with(
        dir.path(),
        96,
        &[
            ("a", &files[0]),
            ("b", &files[1]),
            ("c", &files[2]),
            ("d", &files[3]),
        ],
    );
    let log = dir.path().join("idle.jsonl");
    let stats = dir.path().join("stats.json");
    let name = vm_name("foxyidle-marks");
    let preload = "VMSIGHT_BACKGROUND=1 LD_PRELOAD=/usr/local/lib/libvmsight-preload.so";
    let script = format!(
        "set -e; mount /dev/vdb /mnt; cp /bin/cat /tmp/reader; cp /bin/cat /tmp/clireader; \
         echo 3 > /proc/sys/vm/drop_caches; \
         /tmp/reader /mnt/a > /dev/null & echo \"P1 $!\"; wait; \
         echo ready; read go; \
         /tmp/clireader /mnt/b > /dev/null & echo \"P2 $!\"; wait; \
         {preload} /tmp/reader /mnt/c > /dev/null & echo \"P3 $!\"; wait; \
         vmsight-background sh -c '/tmp/reader /mnt/d > /dev/null & echo \"P5 $!\"; wait' & \
         echo \"P4 $!\"; wait; echo done"
    );
    let mut child = spawn_vm(&[
        "run",
        "--name",
        &name,
        "--disk",
        img.to_str().unwrap(),
        "--idle",
        "--idle-log",
        log.to_str().unwrap(),
        "--stats-json",
        stats.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let mut out = String::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        out.push_str(&line);
        out.push('\n');
        if line == "ready" {
            break;
        }
    }
    assert!(out.contains("ready"), "the guest never got ready: {out}");
    // Nothing is marked yet: nothing was held, nothing was background.
    let st = run(&["stats", &name, "--json"]);
    assert_eq!(st.code, Some(0), "{}", st.stderr);
    let v: Value = serde_json::from_str(&st.stdout).unwrap();
    let idle = disk1_idle(&v);
    assert_eq!(idle["held"], 0, "held before any mark: {idle}");
    assert_eq!(idle["background"], 0, "background before any mark: {idle}");
    assert!(idle["foreground"].as_u64().unwrap() > 0, "{idle}");
    // Mark on the running VM, then list.
    let add = run(&["idle", &name, "add", "clireader"]);
    assert_eq!(add.code, Some(0), "{}", add.stderr);
    assert!(
        add.stdout.contains("comm:clireader (cli)"),
        "{}",
        add.stdout
    );
    let bad = run(&["idle", &name, "remove", "nosuchproc"]);
    assert_ne!(bad.code, Some(0));
    assert!(bad.stderr.contains("not marked"), "{}", bad.stderr);
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    for line in lines {
        out.push_str(&line.unwrap());
        out.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "guest run failed; output:\n{out}");
    assert!(out.contains("done"), "{out}");

    let pid = |k: &str| value_of(&out, k).parse::<u32>().unwrap();
    let reads: Vec<Logged> = idle_log(&log)
        .into_iter()
        .filter(|l| l.disk == 1 && l.read)
        .collect();
    let share = |tgid: u32| {
        let mine: Vec<&Logged> = reads.iter().filter(|l| l.tgid == tgid).collect();
        let bg = mine.iter().filter(|l| l.owner == "background").count();
        (mine.len(), bg)
    };
    let (n1, bg1) = share(pid("P1 "));
    assert!(
        n1 >= 10 && bg1 == 0,
        "unmarked reader: {n1} requests, {bg1} background"
    );
    for (what, k) in [
        ("vmsight idle add", "P2 "),
        ("preload shim", "P3 "),
        ("child of vmsight-background", "P5 "),
    ] {
        let (n, bg) = share(pid(k));
        assert!(n >= 10, "{what}: only {n} requests attributed to it");
        assert!(
            bg as f64 >= 0.95 * n as f64,
            "{what}: {bg} of {n} requests background"
        );
    }
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let idle = disk1_idle(&s);
    assert!(
        idle["attribution"]["declarations"].as_u64().unwrap() >= 2,
        "{idle}"
    );
}

/// One read request of the guest's trace: its command (from `block_rq_issue`), first sector,
/// sectors, and issue and completion times (seconds, the trace's `mono` clock).
#[derive(Debug, Clone)]
struct GuestRead {
    comm: String,
    sector: u64,
    sectors: u64,
    issued: f64,
    completed: f64,
}

/// The guest's read requests of device `dev`, in issue order, each paired with its
/// completion (`block_rq_complete` of the same sector range).
fn guest_reads(trace: &str, dev: &str) -> Vec<GuestRead> {
    let mut reads: Vec<GuestRead> = Vec::new();
    for line in trace.lines() {
        let (issue, head, ev) = if let Some((h, e)) = line.split_once("block_rq_issue: ") {
            (true, h, e)
        } else if let Some((h, e)) = line.split_once("block_rq_complete: ") {
            (false, h, e)
        } else {
            continue;
        };
        let Some(ts) = head
            .split_whitespace()
            .last()
            .and_then(|t| t.trim_end_matches(':').parse::<f64>().ok())
        else {
            continue;
        };
        // "254,16 R 4096 () 1024 + 8 [dd]" / "254,16 R () 1024 + 8 [0]"
        let f: Vec<&str> = ev.split_whitespace().collect();
        let Some(plus) = f.iter().position(|w| *w == "+") else {
            continue;
        };
        if f.first() != Some(&dev) || !f.get(1).is_some_and(|r| r.contains('R')) || plus < 1 {
            continue;
        }
        let (Ok(sector), Some(Ok(sectors))) = (
            f[plus - 1].parse::<u64>(),
            f.get(plus + 1).map(|n| n.parse::<u64>()),
        ) else {
            continue;
        };
        if issue {
            let comm = f.last().unwrap().trim_matches(|c| c == '[' || c == ']');
            reads.push(GuestRead {
                comm: comm.to_string(),
                sector,
                sectors,
                issued: ts,
                completed: f64::NAN,
            });
        } else if let Some(r) = reads
            .iter_mut()
            .find(|r| r.sector == sector && r.sectors == sectors && r.completed.is_nan())
        {
            r.completed = ts;
        }
    }
    reads
}

/// The preemption interval seen from inside the guest. The guest reads one block with a
/// foreground `dd`, then, once that read has completed, one block with a background copy of
/// `dd`, ten times. FoxyIdle may start a background read only when the interval has passed
/// since the last foreground completion on the host, and that completion came after the
/// foreground read's issue in the guest; so each background read must complete, on the guest's
/// own clock, at least the interval after the foreground read before it was issued: a
/// physical lower bound, whatever the host's speed. A scheduler that ignores the interval
/// (only the background depth limit, or nothing) completes them within the time of starting
/// `dd` and two disk reads, far below 500 ms.
#[test]
fn a_background_read_after_a_foreground_one_completes_no_sooner_than_the_interval_in_the_guest() {
    const INTERVAL_MS: u64 = 500;
    let dir = tempfile::tempdir().unwrap();
    let a = content(21, 4 * MIB);
    let b = content(22, 4 * MIB);
    let img = image_with(dir.path(), 48, &[("a", &a), ("b", &b)]);
    let log = dir.path().join("idle.jsonl");
    let stats = dir.path().join("stats.json");
    let name = vm_name("foxyidle-interval");
    let script = "set -e; mount /dev/vdb /mnt; T=/sys/kernel/tracing; \
        mount -t tracefs nodev $T; echo mono > $T/trace_clock; \
        cp /bin/dd /tmp/bgdd; cat /mnt/a /mnt/b > /dev/null; \
        echo 1 > $T/events/block/block_rq_issue/enable; \
        echo 1 > $T/events/block/block_rq_complete/enable; \
        i=0; while [ $i -lt 10 ]; do \
          dd if=/mnt/a of=/dev/null bs=4k count=1 skip=$((i*64)) iflag=direct status=none; \
          /tmp/bgdd if=/mnt/b of=/dev/null bs=4k count=1 skip=$((i*64)) iflag=direct status=none; \
          i=$((i+1)); done; \
        echo 0 > $T/events/block/enable; \
        echo \"DEV $(cat /sys/block/vdb/dev | tr : ,)\"; \
        grep -E 'block_rq_(issue|complete)' $T/trace";
    let interval = INTERVAL_MS.to_string();
    let r = guest_sh(
        &hdd_idle_args(
            &name,
            &img,
            "bgdd",
            &log,
            &stats,
            &["--idle-interval", &interval],
        ),
        script,
    );
    assert_eq!(r.code, Some(0), "guest run failed: {}", r.stderr);
    let reads = guest_reads(&r.stdout, value_of(&r.stdout, "DEV "));
    let mut pairs = 0;
    for (i, bg) in reads.iter().enumerate().filter(|(_, r)| r.comm == "bgdd") {
        assert!(!bg.completed.is_nan(), "no completion in the trace: {bg:?}");
        // The foreground read this one followed: the last `dd` read completed before it.
        let Some(fg) = reads[..i]
            .iter()
            .rev()
            .find(|f| f.comm == "dd" && f.completed <= bg.issued)
        else {
            continue;
        };
        pairs += 1;
        // The guest's TSC-based clock may run off the host's by its calibration error;
        // 1 % of the interval covers it.
        let gap_ms = (bg.completed - fg.issued) * 1e3;
        assert!(
            gap_ms >= INTERVAL_MS as f64 * 0.99,
            "a background read completed {gap_ms:.1} ms after the foreground read before it \
             was issued, inside the {INTERVAL_MS} ms interval:\n fg {fg:?}\n bg {bg:?}"
        );
    }
    assert!(
        pairs >= 10,
        "only {pairs} foreground/background pairs in the trace: {reads:?}"
    );
    // The mechanism engaged: the background data reads were held by the stage (a background
    // `dd` starts well within 500 ms of the foreground one's completion), and those holds
    // came from preemption intervals.
    let held = idle_log(&log)
        .into_iter()
        .filter(|l| l.disk == 1 && l.read && l.owner == "background" && l.held_us > 0)
        .count();
    assert!(held >= 10, "only {held} background reads were held");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let idle = disk1_idle(&s);
    assert!(
        idle["preemption_intervals"].as_u64().unwrap() >= 10,
        "stats: {idle}"
    );
    assert_eq!(idle["interval_ms"], INTERVAL_MS, "stats: {idle}");
}
