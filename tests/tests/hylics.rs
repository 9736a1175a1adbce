//! Hylics' shared in-memory file system on real guests (issue 13, part 1), checked against
//! independent oracles: sha256sum on both sides of the share, the guest's own `mount` table
//! and `df`, the errors the guest's writes get at the limit (ENOSPC), the host's mount table,
//! and what each VM's virtiofsd can reach (`/proc/PID/root` of the sandboxed daemon).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use vmsight_tests::*;

/// sha256 of a host file, by the host's own sha256sum.
fn sha256_host(path: &Path) -> String {
    let o = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(o.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&o.stdout)[..64].to_owned()
}

/// The value after `key ` on the first stdout line that starts with it.
fn field(lines: &[String], key: &str) -> String {
    let prefix = format!("{key} ");
    lines
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key:?} line in {lines:?}"))
        .to_owned()
}

/// `vmsight hylics NAME path`.
fn share_path(name: &str) -> PathBuf {
    let r = run(&["hylics", name, "path"]);
    assert_eq!(r.code, Some(0), "hylics path: {}", r.stderr);
    PathBuf::from(r.stdout.trim())
}

/// Whether `dir` is a mount point in the host's mount table.
fn host_mounted(dir: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.to_str().unwrap()))
}

/// The PID of the virtiofsd serving `dir`.
fn virtiofsd_of(vm: &str) -> u32 {
    let pids = |args: &[&str]| -> Vec<u32> {
        let o = Command::new("pgrep").args(args).output().unwrap();
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    // The VM's vmsight started it (its `vm.json` names vmsight's pid).
    let rec = vmsight_launcher::runtime::list_running(&vmsight_launcher::runtime::runtime_base())
        .into_iter()
        .find(|r| r.name == vm)
        .unwrap_or_else(|| panic!("VM {vm} is not running"));
    let daemon = pids(&["-P", &rec.pid.to_string(), "-x", "virtiofsd"])
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no virtiofsd serves VM {vm}"));
    // The sandboxed child (virtiofsd forks into its namespaces).
    pids(&["-P", &daemon.to_string(), "-x", "virtiofsd"])
        .into_iter()
        .max()
        .unwrap_or_else(|| panic!("virtiofsd {daemon} has no sandboxed process"))
}

/// Names in a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The guest side: write a file, wait for the host's file, check the share across sync and a
/// remount, hit the limit, wait for a resize, fill beyond the old limit.
const SHARE_SCRIPT: &str = r#"
set -u
mount | grep -q ' on /hylics type virtiofs' && echo MOUNTED
df -k /hylics | awk 'NR==2 {print "DF", $2}'
head -c 8M /dev/urandom > /hylics/from-guest.bin
sync
echo "G $(sha256sum /hylics/from-guest.bin | cut -c1-64)"
echo ===WROTE
read go
echo "H $(sha256sum /hylics/from-host.bin | cut -c1-64)"
umount /hylics && mount -t virtiofs vmsight-hylics /hylics && echo REMOUNTED
echo "G2 $(sha256sum /hylics/from-guest.bin | cut -c1-64)"
echo "H2 $(sha256sum /hylics/from-host.bin | cut -c1-64)"
if dd if=/dev/zero of=/hylics/fill bs=1M count=80 2>/tmp/err; then echo FILL ok; else echo "FILL $(tr "\n" " " < /tmp/err)"; fi
rm -f /hylics/fill
echo ===FULL
read go
df -k /hylics | awk 'NR==2 {print "DF2", $2}'
dd if=/dev/zero of=/hylics/fill bs=1M count=80 2>/tmp/err && sync && echo FILL2 ok
echo "G3 $(sha256sum /hylics/from-guest.bin | cut -c1-64)"
echo ===DONE
"#;

#[test]
fn the_share_holds_the_same_bytes_on_both_sides_across_remount_and_resize() {
    let name = vm_name("share");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--net",
        "none",
        "--shared-mem",
        "64M",
        "--stats-json",
        &format!("/tmp/{name}.json"),
        "--",
        "sh",
        "-c",
        SHARE_SCRIPT,
    ]);
    vm.wait_line("===WROTE");
    let dir = share_path(&name);
    assert!(host_mounted(&dir), "{} is not a mount point", dir.display());
    {
        use std::os::unix::fs::MetadataExt;
        let parent = std::fs::metadata(dir.parent().unwrap()).unwrap();
        assert_eq!(
            parent.mode() & 0o777,
            0o700,
            "other host users must not reach the share"
        );
    }

    // Guest -> host: the same bytes.
    let seen = vm.seen().to_vec();
    assert!(seen.contains(&"MOUNTED".to_owned()), "{seen:?}");
    // The guest's df sees the 64 MiB limit (tmpfs rounds nothing here).
    assert_eq!(field(&seen, "DF"), (64 * 1024).to_string(), "{seen:?}");
    assert_eq!(
        field(&seen, "G"),
        sha256_host(&dir.join("from-guest.bin")),
        "the guest's file differs on the host"
    );

    // Host -> guest.
    let blob: Vec<u8> = (0..5u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(dir.join("from-host.bin"), &blob).unwrap();
    let host_sha = sha256_host(&dir.join("from-host.bin"));
    vm.send("go");
    vm.wait_line("===FULL");
    let seen = vm.seen().to_vec();
    assert_eq!(
        field(&seen, "H"),
        host_sha,
        "the host's file differs in the guest"
    );
    assert!(seen.contains(&"REMOUNTED".to_owned()), "{seen:?}");
    assert_eq!(
        field(&seen, "G2"),
        field(&seen, "G"),
        "lost across umount/mount"
    );
    assert_eq!(field(&seen, "H2"), host_sha, "lost across umount/mount");
    // At the limit the guest's write fails with ENOSPC.
    let fill = field(&seen, "FILL");
    assert!(fill.contains("No space left on device"), "FILL {fill}");

    // Shrinking below the 13 MiB in use is refused; growing works.
    let r = run(&["hylics", &name, "resize", "4M"]);
    assert_ne!(r.code, Some(0), "a shrink below the use must fail");
    assert!(r.stderr.contains("in use"), "{}", r.stderr);
    let r = run(&["hylics", &name, "resize", "128M"]);
    assert_eq!(r.code, Some(0), "resize: {}", r.stderr);
    let info = run(&["hylics", &name, "info", "--json"]);
    let info: Value = serde_json::from_str(&info.stdout).unwrap();
    assert_eq!(info["size_bytes"], 128u64 << 20);
    assert_eq!(info["resizes"], 1);
    assert_eq!(info["guest_path"], "/hylics");
    vm.send("go");
    vm.wait_line("===DONE");
    let (code, seen, err) = vm.finish();
    assert_eq!(code, Some(0), "stderr: {err}");
    assert_eq!(field(&seen, "DF2"), (128 * 1024).to_string(), "{seen:?}");
    assert!(seen.contains(&"FILL2 ok".to_owned()), "{seen:?}");
    assert_eq!(field(&seen, "G3"), field(&seen, "G"));

    // The stats report the share; the mount is gone with the VM.
    let stats: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("/tmp/{name}.json")).unwrap())
            .unwrap();
    let _ = std::fs::remove_file(format!("/tmp/{name}.json"));
    assert_eq!(stats["share"]["size_bytes"], 128u64 << 20, "{stats}");
    assert_eq!(stats["share"]["resizes"], 1);
    assert!(
        !host_mounted(&dir),
        "the share is still mounted after the VM"
    );
    assert!(!dir.exists(), "the share's directory outlived the VM");
}

/// Two VMs at once: each sees only its own share, and each virtiofsd's whole world (its root
/// after the sandbox's pivot_root) is its VM's tmpfs.
#[test]
fn a_vm_sees_only_its_own_share_and_its_daemon_nothing_else() {
    const SCRIPT: &str = r#"
echo "mine-$1" > "/hylics/only-$1"
sync
echo ===WROTE
read go
echo "LS $(ls -A /hylics | tr '\n' ' ')"
echo "UP $(ls -A /hylics/.. | grep -c .)"
echo ===DONE
"#;
    let a = vm_name("share-a");
    let b = vm_name("share-b");
    let start = |name: &str, tag: &str| {
        LiveVm::start(&[
            "--name",
            name,
            "--net",
            "none",
            "--mem",
            "256",
            "--shared-mem",
            "16M",
            "--",
            "sh",
            "-c",
            SCRIPT,
            "sh",
            tag,
        ])
    };
    let mut va = start(&a, "a");
    let mut vb = start(&b, "b");
    va.wait_line("===WROTE");
    vb.wait_line("===WROTE");
    let (da, db) = (share_path(&a), share_path(&b));
    assert_ne!(da, db);
    // The host's view of each share: only that VM's file.
    assert_eq!(names(&da), ["only-a"]);
    assert_eq!(names(&db), ["only-b"]);
    // Each daemon's root is its share: nothing of the host, nothing of the other VM.
    for (vm, own) in [(&a, "only-a"), (&b, "only-b")] {
        let pid = virtiofsd_of(vm);
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        assert_eq!(
            names(&root),
            [own],
            "virtiofsd {pid} reaches more than its share"
        );
    }
    va.send("go");
    vb.send("go");
    va.wait_line("===DONE");
    vb.wait_line("===DONE");
    let (ca, la, ea) = va.finish();
    let (cb, lb, eb) = vb.finish();
    assert_eq!(ca, Some(0), "{ea}");
    assert_eq!(cb, Some(0), "{eb}");
    // The guests see the same: their own file only.
    assert_eq!(field(&la, "LS").trim(), "only-a");
    assert_eq!(field(&lb, "LS").trim(), "only-b");
    // `..` of the mount point is the guest's own root, not anything of the host.
    assert!(field(&la, "UP").parse::<u32>().unwrap() > 5);
}

/// `vmsight ARGS` fails and its stderr says `says`.
fn fails_with(args: &[&str], says: &str) {
    let r = run(args);
    assert_ne!(r.code, Some(0), "{args:?} succeeded");
    assert!(r.stderr.contains(says), "{args:?}: {}", r.stderr);
}

#[test]
fn bad_share_requests_get_clear_errors() {
    let share = |opt: &'static str| ["run", "--shared-mem", opt, "--", "true"];
    fails_with(&share("4K"), "out of range");
    fails_with(&share("4K"), "--shared-mem");
    fails_with(&share("64M,path=/etc"), "system directory");
    fails_with(&share("64M,cache=maybe"), "unknown cache mode");
    fails_with(&["hylics", "no-such-vm-here", "path"], "no running VM");
    // The controller: needs a share, a valid SLO, and a curve for the predictor.
    fails_with(&["run", "--hylics-slo", "1", "--", "true"], "--shared-mem");
    for (slo, says) in [
        ("--hylics-slo=1,mode=fast", "unknown Hylics controller mode"),
        ("--hylics-slo=-2", "not a time"),
        ("--hylics-slo=1", "curve=FILE"),
    ] {
        fails_with(&["run", "--shared-mem", "64M", slo, "--", "true"], says);
    }
    // A log that is not one, or a missing one, does not replay.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.log");
    std::fs::write(&bad, "{\"k\":1}\n").unwrap();
    fails_with(&["hylics-replay", bad.to_str().unwrap()], "line 1");
    fails_with(
        &["hylics-replay", "/nonexistent/decisions.log"],
        "/nonexistent/decisions.log",
    );
}

/// A TCP receiver for the VM's namespace: prints `GOT <sha256> <bytes>` per connection.
const RECEIVER: &str = r#"
import hashlib, socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("LISTENING", flush=True)
while True:
    c, _ = srv.accept()
    h = hashlib.sha256(); n = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        h.update(b); n += len(b)
    print("GOT", h.hexdigest(), n, flush=True)
    c.close()
"#;

/// The guest side of the send offload: a file in the share sent by the host (whole, then a
/// range), the guest NIC's transmit counter around it, hostile requests.
const OFFLOAD_SCRIPT: &str = r#"
head -c 16M /dev/urandom > /hylics/video.bin
sync
echo "SHA $(sha256sum /hylics/video.bin | cut -c1-64)"
tx0=$(cat /sys/class/net/eth0/statistics/tx_bytes)
i=0; until hylics-send 10.0.2.1:9000 /hylics/video.bin > /tmp/n 2>/tmp/e; do i=$((i+1)); [ $i -lt 100 ] || { cat /tmp/e; exit 9; }; sleep 0.3; done
tx1=$(cat /sys/class/net/eth0/statistics/tx_bytes)
echo "SENT $(cat /tmp/n)"
echo "TXDELTA $((tx1 - tx0))"
echo "RANGE $(hylics-send 10.0.2.1:9000 video.bin 1000 5000)"
echo "RANGESHA $(tail -c +1001 /hylics/video.bin | head -c 5000 | sha256sum | cut -c1-64)"
echo "HEADSHA $(head -c 100 /hylics/video.bin | sha256sum | cut -c1-64)"
hylics-send 10.0.2.1:9000 ../../../etc/passwd 2>/tmp/e; echo "ESCAPE $? $(cat /tmp/e)"
hylics-send 127.0.0.1:22 video.bin 2>/tmp/e; echo "LOOPBACK $? $(cat /tmp/e)"
python3 -c '
import socket
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
s.connect((2, 5100))
s.sendall(b"x" * 10000 + b"\n")
print("JUNK", s.recv(200).decode().strip())
'
echo "AFTER $(hylics-send 10.0.2.1:9000 video.bin 0 100)"
echo ===DONE
"#;

/// A VM with a 64 MiB share and the isolated network running `script`, stats to `stats_path`.
fn start_with_share(name: &str, stats_path: &str, script: &str) -> LiveVm {
    LiveVm::start(&[
        "--name",
        name,
        "--shared-mem",
        "64M",
        "--stats-json",
        stats_path,
        "--",
        "sh",
        "-c",
        script,
    ])
}

#[test]
fn the_host_sends_a_share_file_for_the_guest_and_the_payload_skips_the_guest_nic() {
    let name = vm_name("offload");
    let stats_path = format!("/tmp/{name}.json");
    let mut vm = start_with_share(&name, &stats_path, OFFLOAD_SCRIPT);
    wait_until("the VM's network", 120, || {
        run(&["net", &name, "info"]).code == Some(0)
    });
    let mut rx = Bg(vmsight()
        .args([
            "net", &name, "exec", "python3", "-c", RECEIVER, "10.0.2.1", "9000",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap());
    let got = collect_lines(&mut rx.0);
    vm.wait_line("===DONE");
    let (code, seen, err) = vm.finish();
    assert_eq!(code, Some(0), "stderr: {err}; stdout {seen:?}");
    wait_until("the receiver's reports", 30, || {
        got.lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("GOT "))
            .count()
            >= 3
    });
    let got: Vec<String> = got
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("GOT "))
        .cloned()
        .collect();

    // The whole file: the receiver's sha256 is the guest's.
    let sha = field(&seen, "SHA");
    assert_eq!(got[0], format!("GOT {sha} {}", 16 << 20), "{got:?}");
    assert_eq!(field(&seen, "SENT"), (16u64 << 20).to_string());
    // The payload did not cross the guest's NIC: its transmit counter moved by far less than
    // the 16 MiB sent (only the retries' and the guest's own chatter).
    let tx: u64 = field(&seen, "TXDELTA").parse().unwrap();
    assert!(
        tx < 1 << 20,
        "the guest's NIC sent {tx} bytes during the offload"
    );
    // A range: 5000 bytes from offset 1000, and later the first 100 bytes, each against the
    // guest's own sha256 of that range.
    assert_eq!(field(&seen, "RANGE"), "5000");
    assert_eq!(
        got[1],
        format!("GOT {} 5000", field(&seen, "RANGESHA")),
        "{got:?}"
    );
    assert_eq!(
        got[2],
        format!("GOT {} 100", field(&seen, "HEADSHA")),
        "{got:?}"
    );
    // Hostile requests are refused with a reason, and the service still works afterwards.
    let esc = field(&seen, "ESCAPE");
    assert!(
        esc.starts_with("1 ") && esc.contains("cannot open"),
        "ESCAPE {esc}"
    );
    let lo = field(&seen, "LOOPBACK");
    assert!(
        lo.starts_with("1 ") && lo.contains("not allowed"),
        "LOOPBACK {lo}"
    );
    let junk = field(&seen, "JUNK");
    assert!(
        junk.contains("\"ok\":false") && junk.contains("bad request"),
        "JUNK {junk}"
    );
    assert_eq!(field(&seen, "AFTER"), "100");
    // The counters agree with what the receiver got.
    let stats: Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&stats_path);
    let o = &stats["offload"];
    assert_eq!(o["bytes_sent"], (16u64 << 20) + 5000 + 100, "{o}");
    assert_eq!(o["files_sent"], 3, "{o}");
    assert_eq!(o["bad_requests"], 1, "{o}");
    assert!(o["failures"].as_u64().unwrap() >= 2, "{o}");
}

/// E[X|m] of the synthetic workload (MiB, seconds), as `hylics-workload --curve` and the
/// controller's `curve=` file both take it: piecewise linear, 36 ms at 8 MiB to 6 ms at 128 MiB.
const CURVE: [(u64, f64); 5] = [
    (8, 0.036),
    (16, 0.02),
    (32, 0.012),
    (64, 0.008),
    (128, 0.006),
];
/// Arrival rate of the workload (Poisson), tasks per second.
const RATE: f64 = 20.0;
/// The response-time SLO.
const TAU: f64 = 0.05;
/// How long the workload admits tasks, seconds.
const WORKLOAD_SECS: f64 = 90.0;

/// Writes [`CURVE`] as the controller's `curve=` file in `dir`.
fn write_curve(dir: &std::path::Path) -> std::path::PathBuf {
    let curve = dir.join("curve.json");
    let points: Vec<Value> = CURVE
        .iter()
        .map(|(m, s)| serde_json::json!({"m_bytes": m << 20, "service_secs": s}))
        .collect();
    std::fs::write(&curve, serde_json::json!({ "points": points }).to_string()).unwrap();
    curve
}

/// The oracle, independent of the controller's own inversion: the smallest size (in steps of
/// 1/16 MiB) at which an M/G/1/PS queue with the curve's service time meets τ:
/// E[X|m] / (1 - λ E[X|m]) <= τ.
fn oracle_mib() -> f64 {
    oracle_mib_at(RATE, 1.0)
}

/// [`oracle_mib`] for arrival rate `rate` and service times `scale` times the curve's.
fn oracle_mib_at(rate: f64, scale: f64) -> f64 {
    let x = |m: f64| {
        let w = CURVE.windows(2).find(|w| m <= w[1].0 as f64).unwrap();
        let (m0, x0, m1, x1) = (w[0].0 as f64, w[0].1, w[1].0 as f64, w[1].1);
        scale * (x0 + (x1 - x0) * (m - m0) / (m1 - m0))
    };
    (8 * 16..=128 * 16)
        .map(|s| s as f64 / 16.0)
        .find(|&m| {
            let xm = x(m);
            rate * xm < 1.0 && xm / (1.0 - rate * xm) <= TAU
        })
        .unwrap()
}

/// The guest: three 8 MiB files in the share (the oldest two colder), a loop that moves out
/// what the controller advises, and the synthetic workload reporting every task.
fn controller_script() -> String {
    let curve: Vec<String> = CURVE.iter().map(|(m, s)| format!("{m}:{s}")).collect();
    format!(
        r#"
set -u
for i in 1 2 3; do head -c 8M /dev/urandom > /hylics/cold$i.bin; done
touch -d '-3 hours' /hylics/cold1.bin; touch -d '-2 hours' /hylics/cold2.bin
(cd /hylics && sha256sum cold*.bin) > /tmp/sums
(while :; do hylics-evict /var/tmp/evicted | sed 's/^/EVICT /'; sleep 1; done) &
hylics-workload --curve {} --rate {RATE} --duration {WORKLOAD_SECS} --seed 7
kill $!
echo "LEFT $(ls /hylics | tr '\n' ' ')"
cd /var/tmp/evicted && for f in *; do grep " $f\$" /tmp/sums | sha256sum -c - | sed 's/^/CHK /'; done
echo ===DONE
"#,
        curve.join(",")
    )
}

/// `vmsight run` of VM `name` with a 64 MiB share, no network, the controller `slo`, the
/// `extra` options, and `sh -c script`.
fn run_with_slo(name: &str, slo: &str, extra: &[&str], script: &str) -> Run {
    let mut args = vec![
        "run",
        "--name",
        name,
        "--net",
        "none",
        "--shared-mem",
        "64M",
        "--hylics-slo",
        slo,
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    run(&args)
}

/// One `task ...` line of hylics-workload.
struct Task {
    arrive: f64,
    response: f64,
    m_mib: f64,
}

fn tasks(lines: &[String]) -> Vec<Task> {
    let num = |l: &str, k: &str| -> f64 {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {l}"))
            .parse()
            .unwrap()
    };
    lines
        .iter()
        .filter(|l| l.starts_with("task "))
        .map(|l| Task {
            arrive: num(l, "arrive="),
            response: num(l, "response="),
            m_mib: num(l, "m="),
        })
        .collect()
}

/// The controller sizes the share of a guest whose workload has a known E[X|m]: it converges
/// to the size the M/G/1/PS model says meets τ, it shrinks only after the guest moved the
/// coldest files out on its advice (nothing lost), the guest's statvfs sees exactly the sizes
/// it decided, every task the workload reported reached it, and its log replays.
#[test]
fn the_controller_sizes_the_share_to_the_slo_of_a_workload_with_known_service_times() {
    let name = vm_name("hctl");
    let dir = tempfile::tempdir().unwrap();
    let curve = write_curve(dir.path());
    let log = dir.path().join("decisions.log");
    let stats_path = dir.path().join("stats.json");
    let slo = format!(
        "{TAU},curve={},ci=4:16,log={}",
        curve.display(),
        log.display()
    );
    let r = run_with_slo(
        &name,
        &slo,
        &["--stats-json", stats_path.to_str().unwrap()],
        &controller_script(),
    );
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    let lines: Vec<String> = r.stdout.lines().map(str::to_owned).collect();
    assert!(lines.contains(&"===DONE".to_owned()), "{}", r.stdout);
    let tasks = tasks(&lines);
    let summary = field(&lines, "summary");
    assert!(summary.contains("report_failures=0"), "{summary}");
    assert!(
        summary.contains(&format!("tasks={} ", tasks.len())),
        "{summary}"
    );

    // Every task the workload reported reached the controller, and nothing else did.
    let stats: Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    let c = &stats["controller"];
    assert_eq!(c["tasks"], tasks.len(), "{c}");
    assert_eq!(c["arrivals"], tasks.len(), "{c}");
    assert_eq!(c["rejected_reports"], 0, "{c}");

    // The log replays, and each logged response time is one of the workload's own.
    let replay = run(&["hylics-replay", log.to_str().unwrap()]);
    assert_eq!(replay.code, Some(0), "replay: {}", replay.stderr);
    assert!(replay.stderr.contains("reproduced"), "{}", replay.stderr);
    let file = vmsight_hylics::LogFile::parse(&std::fs::read_to_string(&log).unwrap()).unwrap();
    let mut own: Vec<f64> = tasks.iter().map(|t| t.response).collect();
    own.sort_by(f64::total_cmp);
    let mut logged: Vec<f64> = file
        .records
        .iter()
        .flat_map(|r| r.input.response_times_secs.iter().copied())
        .collect();
    logged.sort_by(f64::total_cmp);
    // Both sides are whole microseconds, rounded apart by at most 1 µs. Sorted greedy matching
    // is exact for equal-width windows as long as the skip and the check use the same
    // arithmetic (a window edge computed two ways once let a match slip).
    const TOL: f64 = 2e-6;
    let mut i = 0;
    for v in &logged {
        while i < own.len() && v - own[i] > TOL {
            i += 1;
        }
        assert!(
            i < own.len() && own[i] - v <= TOL,
            "logged response {v} is no task of the workload (workload responses \
             nearby: {:?}; {} logged, {} reported)",
            &own[i.saturating_sub(3)..(i + 3).min(own.len())],
            logged.len(),
            own.len()
        );
        i += 1;
    }
    // Every task is in the log: the last, partial interval is logged when the VM stops.
    assert_eq!(logged.len(), own.len(), "logged vs reported responses");

    // The shrink waited for the guest: refused while the 24 MiB of files were there, the two
    // coldest files moved out intact, the warm one stayed.
    assert!(c["refused_shrinks"].as_u64().unwrap() >= 1, "{c}");
    let evicted = lines
        .iter()
        .filter(|l| l.starts_with("EVICT moved 2 files"))
        .count();
    assert_eq!(evicted, 1, "{lines:?}");
    assert_eq!(field(&lines, "LEFT").trim(), "cold3.bin");
    let checks: Vec<&String> = lines.iter().filter(|l| l.starts_with("CHK ")).collect();
    assert_eq!(
        checks.iter().map(|l| l.as_str()).collect::<Vec<_>>(),
        ["CHK cold1.bin: OK", "CHK cold2.bin: OK"]
    );

    // The guest saw the sizes the controller set (its own statvfs), and went below the 24 MiB
    // the files had held.
    let decided: Vec<f64> = std::iter::once(64.0)
        .chain(
            file.records
                .iter()
                .map(|r| r.decision.m_after_bytes as f64 / (1 << 20) as f64),
        )
        .collect();
    for t in &tasks {
        assert!(
            decided.iter().any(|m| (m - t.m_mib).abs() < 0.01),
            "the guest saw {} MiB, which the controller never set ({decided:?})",
            t.m_mib
        );
    }
    assert!(tasks.iter().any(|t| t.m_mib < 24.0));

    // Convergence: over the second half of the intervals with tasks, the share averaged within
    // a factor of two of the oracle's size, and the workload's own mean response time (second
    // half of its run) within a factor of two of τ. The start (64 MiB) was 4.7x the oracle with
    // R at a fifth of τ.
    let m_star = oracle_mib();
    let late_m = late_mean_mib(&file);
    assert!(
        (m_star / 2.0..=m_star * 2.0).contains(&late_m),
        "late mean size {late_m:.1} MiB, oracle {m_star} MiB"
    );
    let late_r = late_mean_response(&tasks, WORKLOAD_SECS);
    assert!(
        (TAU / 2.0..=TAU * 2.0).contains(&late_r),
        "late mean response {late_r:.4} s, tau {TAU}"
    );
    eprintln!(
        "oracle {m_star} MiB; late mean size {late_m:.1} MiB; late mean response {late_r:.4} s (tau {TAU}); {} decisions",
        file.records.len()
    );
}

/// The guest side of the socket scheme: a server that writes a header itself, has the host
/// send a file of the share on the same connection, writes a trailer itself and closes; the
/// guest's own tcpdump records every segment its NIC passes, and its counters the bytes.
const SOCKET_SCRIPT: &str = r#"
head -c 8M /dev/urandom > /hylics/file.bin
sync
echo "WANT $( (printf 'HEADER\n'; cat /hylics/file.bin; printf 'TRAILER\n') | sha256sum | cut -c1-64)"
tcpdump -i eth0 -nn -S -l 'tcp port 8080' > /tmp/td.txt 2>/dev/null &
td=$!
sleep 2
tx0=$(cat /sys/class/net/eth0/statistics/tx_bytes)
hylics-sockserve 8080 /hylics/file.bin > /tmp/srv.out 2>&1 &
srv=$!
until grep -q LISTENING /tmp/srv.out; do sleep 0.1; done
echo ===LISTENING
wait $srv; echo "SRVEXIT $?"
tx1=$(cat /sys/class/net/eth0/statistics/tx_bytes)
sleep 1; kill -INT $td; wait $td
sed 's/^/SRV /' /tmp/srv.out
echo "TXDELTA $((tx1 - tx0))"
sed 's/^/TD /' /tmp/td.txt
python3 -c '
import json, socket
tcp = {"local": "10.0.2.15:1", "remote": "10.0.2.1:1", "snd_seq": 1, "rcv_seq": 1, "mss": 1460,
       "tstamp": True, "sack": True, "wscale": True, "snd_wscale": 7, "rcv_wscale": 7, "ts_val": 1,
       "snd_wl1": 1, "snd_wnd": 1, "max_window": 1, "rcv_wnd": 1, "rcv_wup": 1}
def conn():
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.connect((2, 5100)); return s.makefile("rw")
def req(f, o):
    f.write(json.dumps(o) + "\n"); f.flush(); return f.readline().strip()
def hold_all(f):
    return [req(f, {"op": "sock-hold", "local": "10.0.2.15:1", "remote": "10.0.2.1:%d" % (i + 1)}) for i in range(65)]
f = conn()
print("NOHOLD", req(f, {"op": "sock-send", "path": "file.bin", "tcp": tcp}))
print("BADADDR", req(f, {"op": "sock-hold", "local": "nowhere", "remote": "10.0.2.1:1"}))
r = hold_all(f)
print("HELD", sum("\"ok\":true" in x for x in r), r[-1])
f.close()
import time; time.sleep(1)
f = conn(); r = hold_all(f)
print("HELD2", sum("\"ok\":true" in x for x in r))
'
echo ===DONE
"#;

/// The client, in the VM's namespace: reads to the end, sends a request line after the first
/// MiB (while the host holds the connection), shuts its side down once it has everything,
/// and reports what it got and how the connection ended.
const SOCKET_CLIENT: &str = r#"
import hashlib, json, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
want = int(sys.argv[3]); h = hashlib.sha256(); n = 0; mid = False; eof = False; err = None
try:
    while True:
        d = s.recv(1 << 16)
        if not d:
            eof = True
            break
        h.update(d); n += len(d)
        if not mid and n >= 1 << 20:
            s.sendall(b"MID-TRANSFER\n"); mid = True
        if n == want:
            s.shutdown(socket.SHUT_WR)
except OSError as e:
    err = repr(e)
print("CLIENT", json.dumps({"bytes": n, "sha256": h.hexdigest(), "eof": eof, "error": err}), flush=True)
"#;

/// One tcpdump line's direction, flags, sequence range and length.
struct Seg {
    from_guest: bool,
    flags: String,
    seq: Option<(u64, u64)>,
    len: u64,
}

fn segments(lines: &[String]) -> Vec<Seg> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("TD "))
        .filter(|l| l.contains(" IP "))
        .map(|l| {
            let after = |k: &str| {
                l.split(k)
                    .nth(1)
                    .map(|r| r.split([',', ' ']).next().unwrap())
            };
            Seg {
                from_guest: l.contains("IP 10.0.2.15.8080 >"),
                flags: after("Flags [")
                    .unwrap_or("")
                    .trim_end_matches(']')
                    .to_owned(),
                seq: after("seq ").and_then(|r| {
                    let (a, b) = r.split_once(':')?;
                    Some((a.parse().ok()?, b.parse().ok()?))
                }),
                len: after("length ")
                    .and_then(|v| v.trim_end_matches(':').parse().ok())
                    .unwrap_or(0),
            }
        })
        .collect()
}

/// The socket scheme: on one connection the guest writes a header, the host sends an 8 MiB
/// file of the share for it (the connection handed over with TCP_REPAIR and back), the guest
/// writes a trailer and closes. The client gets header + file + trailer intact, in order, on
/// one connection that ends with a FIN; the bytes it sent meanwhile reach the guest's
/// application; the guest's own tcpdump shows the payload never crossed its NIC and the
/// trailer's sequence number right after the file's last byte.
#[test]
fn a_connection_handed_to_the_host_and_back_carries_header_file_and_trailer_in_order() {
    let name = vm_name("hsock");
    let stats_path = format!("/tmp/{name}.json");
    let mut vm = start_with_share(&name, &stats_path, SOCKET_SCRIPT);
    vm.wait_line("===LISTENING");
    const FILE: u64 = 8 << 20;
    let want = (7 + FILE + 8).to_string();
    let client = run(&[
        "net",
        &name,
        "exec",
        "python3",
        "-c",
        SOCKET_CLIENT,
        "10.0.2.15",
        "8080",
        &want,
    ]);
    assert_eq!(client.code, Some(0), "client: {}", client.stderr);
    vm.wait_line("===DONE");
    let (code, seen, err) = vm.finish();
    assert_eq!(code, Some(0), "stderr: {err}; stdout {seen:?}");
    let stats: Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&stats_path);

    // The client: everything, in order, and a clean end (FIN, no reset).
    let got: Value = serde_json::from_str(
        client
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("CLIENT "))
            .unwrap_or_else(|| panic!("no CLIENT line: {}", client.stdout)),
    )
    .unwrap();
    assert_eq!(got["bytes"].to_string(), want, "{got}");
    assert_eq!(got["sha256"], field(&seen, "WANT").as_str(), "{got}");
    assert_eq!(got["eof"], true, "{got}");
    assert!(got["error"].is_null(), "{got}");

    // The guest's application: the host sent the whole file, the bytes the client sent while
    // the host held the connection were handed back, and the socket closed cleanly.
    assert_eq!(field(&seen, "SRVEXIT"), "0", "{seen:?}");
    assert_eq!(field(&seen, "SRV SENT"), FILE.to_string());
    assert_eq!(
        field(&seen, "SRV READ"),
        "13",
        "MID-TRANSFER\\n reached the guest"
    );
    assert!(seen.contains(&"SRV CLOSED".to_owned()), "{seen:?}");

    // The guest's NIC (its own tcpdump and counters): the guest sent the header and the
    // trailer, nothing of the file, and the trailer starts right after the file's last byte.
    let segs = segments(&seen);
    let data: Vec<&Seg> = segs.iter().filter(|s| s.from_guest && s.len > 0).collect();
    assert_eq!(
        data.iter().map(|s| s.len).collect::<Vec<_>>(),
        [7, 8],
        "guest data segments in {:?}",
        seen.iter()
            .filter(|l| l.starts_with("TD "))
            .collect::<Vec<_>>()
    );
    let (h0, h1) = data[0].seq.unwrap();
    let (t0, _) = data[1].seq.unwrap();
    assert_eq!(h1 - h0, 7);
    assert_eq!(t0, (h1 + FILE) % (1 << 32), "the trailer's sequence number");
    assert!(
        segs.iter().any(|s| s.from_guest && s.flags.contains('F')),
        "the guest's FIN"
    );
    assert!(
        !segs.iter().any(|s| s.flags.contains('R')),
        "no reset on the guest's NIC"
    );
    let tx: u64 = field(&seen, "TXDELTA").parse().unwrap();
    assert!(tx < 64 << 10, "the guest's NIC sent {tx} bytes");

    // vmsight's side agrees: one hand-over, the file's frames went through the host socket.
    // Hostile requests: a send on a connection not held first, an address that is none, and
    // more holds than the table takes are refused with a reason; a guest connection's holds
    // are released when it closes (the second round gets the whole table again).
    assert!(field(&seen, "NOHOLD").contains("did not hold"), "{seen:?}");
    assert!(field(&seen, "BADADDR").contains("not an IPv4"), "{seen:?}");
    let held = field(&seen, "HELD");
    assert!(
        held.starts_with("64 ") && held.contains("at most 64"),
        "HELD {held}"
    );
    assert_eq!(field(&seen, "HELD2"), "64");
    let steer = &stats["nics"][0]["hylics_steer"];
    assert_eq!(steer["handovers"], 1 + 64 + 64, "{stats}");
    // A frame carries at most 64 KiB (TSO), so 8 MiB took at least 128 frames from the host.
    assert!(
        steer["from_host"].as_u64().unwrap() >= FILE / 65536,
        "{steer}"
    );
    assert_eq!(steer["stray"], 0, "{steer}");
}

/// `writeback=on,threads=2`: the VM's virtiofsd runs with the writeback cache and a thread pool
/// (its own command line says so), and 4 KiB writes gathered by the guest's writeback cache,
/// and rewritten in place before the flush, reach the host byte for byte (sha256sum on both
/// sides), as does a file the host wrote, read back by the guest.
#[test]
fn small_writes_through_the_writeback_cache_reach_the_host_intact() {
    const SCRIPT: &str = r#"
echo up; read go
dd if=/dev/urandom of=/hylics/small.bin bs=4k count=2048 2>/dev/null
dd if=/dev/urandom of=/hylics/small.bin bs=4k count=64 seek=100 conv=notrunc 2>/dev/null
sync
echo "G $(sha256sum /hylics/small.bin | cut -c1-64)"
echo ===WROTE
read go
echo "H $(sha256sum /hylics/from-host.bin | cut -c1-64)"
"#;
    let name = vm_name("share-wb");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--net",
        "none",
        "--shared-mem",
        "64M,writeback=on,threads=2",
        "--",
        "sh",
        "-c",
        SCRIPT,
    ]);
    vm.wait_line("up");
    let dir = share_path(&name);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", virtiofsd_of(&name))).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert!(args.iter().any(|a| a == "--writeback"), "{args:?}");
    assert!(args.iter().any(|a| a == "--thread-pool-size=2"), "{args:?}");
    vm.send("go");
    vm.wait_line("===WROTE");
    let guest = field(vm.seen(), "G");
    assert_eq!(sha256_host(&dir.join("small.bin")), guest);
    assert_eq!(
        std::fs::metadata(dir.join("small.bin")).unwrap().len(),
        8 << 20
    );
    let host_file = dir.join("from-host.bin");
    let bytes: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&host_file, &bytes).unwrap();
    let want = sha256_host(&host_file);
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert_eq!(field(&out, "H"), want, "{out:?}");
}

/// A VM with a 32 MiB share and `extra` options whose command waits for a line on stdin once
/// it printed "up".
fn share_vm_waiting(name: &str, extra: &[&str]) -> LiveVm {
    let mut args = vec!["--name", name, "--net", "none", "--shared-mem", "32M"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", "echo up; read line"]);
    let mut vm = LiveVm::start(&args);
    vm.wait_line("up");
    vm
}

/// `vmsight hylics NAME controller` reaches a running controller (it was once refused as an
/// unknown control command) and says why when a VM has none.
#[test]
fn the_controller_command_answers_while_the_vm_runs() {
    let dir = tempfile::tempdir().unwrap();
    let curve = write_curve(dir.path());
    let slo = format!("{TAU},curve={}", curve.display());
    let name = vm_name("hctl-cmd");
    let mut vm = share_vm_waiting(&name, &["--hylics-slo", &slo]);
    let r = run(&["hylics", &name, "controller", "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let c: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(c["tau_secs"], TAU, "{c}");
    assert_eq!(c["share_bytes"], 32u64 << 20, "{c}");
    vm.send("done");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");

    let name = vm_name("hctl-none");
    let mut vm = share_vm_waiting(&name, &[]);
    let r = run(&["hylics", &name, "controller"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.one_line_error().contains("has no Hylics controller"),
        "{r:?}"
    );
    vm.send("done");
    assert_eq!(vm.finish().0, Some(0));
}

/// The reports a script makes through `hylics-report` (one line each on its stdin) reach the
/// controller, counted by its own status (the oracle: what the guest sent, as the tool echoes
/// it); malformed lines are refused by the tool and never reach vmsight; and without a
/// controller every valid report fails but the tool goes on to the end of its input.
#[test]
fn a_scripts_task_reports_reach_the_controller_and_bad_lines_do_not() {
    const SCRIPT: &str = "echo up; read go; \
        printf 'arrive\\narrive\\narrive\\n\\ndone 0.5\\ndone 1.25\\nbogus\\ndone -3\\ndone nan\\n' \
        | hylics-report; echo \"rc=$?\"; read line";
    let dir = tempfile::tempdir().unwrap();
    let curve = write_curve(dir.path());
    let slo = format!("{TAU},curve={}", curve.display());
    for (controller, summary) in [
        (true, "reports 5 failed 0 bad 3"),
        (false, "reports 5 failed 5 bad 3"),
    ] {
        let name = vm_name(if controller { "hrep" } else { "hrep-none" });
        let mut args = vec!["--name", &name, "--net", "none", "--shared-mem", "32M"];
        if controller {
            args.extend_from_slice(&["--hylics-slo", &slo]);
        }
        args.extend_from_slice(&["--", "sh", "-c", SCRIPT]);
        let mut vm = LiveVm::start(&args);
        vm.wait_line("up");
        vm.send("go");
        vm.wait_line("rc=1");
        assert!(
            vm.seen().iter().any(|l| l == summary),
            "controller {controller}: {:?}",
            vm.seen()
        );
        if controller {
            wait_until("the controller counting 3 arrivals and 2 tasks", 60, || {
                let r = run(&["hylics", &name, "controller", "--json"]);
                let c: Value = serde_json::from_str(&r.stdout).unwrap_or_default();
                c["arrivals"] == 3 && c["tasks"] == 2 && c["rejected_reports"] == 0
            });
        }
        vm.send("done");
        let (code, out, err) = vm.finish();
        assert_eq!(code, Some(0), "{out:?} {err}");
        if !controller {
            let said = err.matches("hylics-report: a report failed").count()
                + out
                    .iter()
                    .filter(|l| l.contains("hylics-report: a report failed"))
                    .count();
            assert_eq!(said, 1, "the first failure is said once: {out:?} {err}");
        }
    }
}

/// How much slower the guest's tasks really are than the controller's curve says.
const WRONG_BY: f64 = 1.4;
/// Arrival rate of the wrong-model workload, tasks per second.
const WRONG_RATE: f64 = 12.0;
/// How long the wrong-model workload admits tasks, seconds.
const WRONG_SECS: f64 = 120.0;

/// One controller on a guest whose tasks take [`WRONG_BY`] times the controller's curve: the
/// workload's task lines and the controller's log.
fn wrong_model_run(mode: &str) -> (Vec<Task>, vmsight_hylics::LogFile) {
    let name = vm_name(&format!("hwrong-{}", &mode[..1]));
    let dir = tempfile::tempdir().unwrap();
    let curve = write_curve(dir.path());
    let log = dir.path().join("decisions.log");
    let slo = format!(
        "{TAU},mode={mode},curve={},ci=4:16,min=8M,max=128M,log={}",
        curve.display(),
        log.display()
    );
    let truth: Vec<String> = CURVE
        .iter()
        .map(|(m, s)| format!("{m}:{}", s * WRONG_BY))
        .collect();
    let script = format!(
        "hylics-workload --curve {} --rate {WRONG_RATE} --duration {WRONG_SECS} --seed 11",
        truth.join(",")
    );
    let r = run_with_slo(&name, &slo, &[], &script);
    assert_eq!(r.code, Some(0), "{mode}: stderr: {}", r.stderr);
    let lines: Vec<String> = r.stdout.lines().map(str::to_owned).collect();
    assert!(
        field(&lines, "summary").contains("report_failures=0"),
        "{mode}: {}",
        r.stdout
    );
    let file = vmsight_hylics::LogFile::parse(&std::fs::read_to_string(&log).unwrap()).unwrap();
    (tasks(&lines), file)
}

/// The time-weighted mean share size (MiB) over the second half of the intervals with tasks.
fn late_mean_mib(file: &vmsight_hylics::LogFile) -> f64 {
    let busy: Vec<_> = file
        .records
        .iter()
        .filter(|r| r.decision.tasks > 0)
        .collect();
    let late = &busy[busy.len() / 2..];
    let span: f64 = late
        .iter()
        .map(|r| r.input.t_secs - r.input.start_secs)
        .sum();
    late.iter()
        .map(|r| (r.input.t_secs - r.input.start_secs) * r.decision.m_before_bytes as f64)
        .sum::<f64>()
        / span
        / (1 << 20) as f64
}

/// The workload's own mean response time over the second half of its `secs`-long run,
/// seconds.
fn late_mean_response(tasks: &[Task], secs: f64) -> f64 {
    let late: Vec<f64> = tasks
        .iter()
        .filter(|t| t.arrive >= secs / 2.0)
        .map(|t| t.response)
        .collect();
    late.iter().sum::<f64>() / late.len() as f64
}

/// The case Hylics' RLS loop is for (paper §5.3): the controller's E[X|m] is wrong, the guest's
/// tasks really take 1.4x what it says. The oracle is the M/G/1/PS answer for the true service
/// times (independent of the controller's inversion) and the workload's own response times.
/// The queueing predictor alone holds the size the wrong model gives, below the true one, and
/// misses τ; the combined controller (predictor + RLS) corrects it: its late share is nearer
/// the true size than the model's, its late response time is lower, and its log has the RLS
/// steps that did it (`adaptive_step`), which the queueing-only log never has. A combined
/// controller whose RLS loop does nothing behaves as the queueing-only one and fails this.
#[test]
fn with_a_model_wrong_by_1_4x_the_combined_controller_corrects_the_size_and_queueing_only_does_not()
{
    let m_true = oracle_mib_at(WRONG_RATE, WRONG_BY);
    let m_model = oracle_mib_at(WRONG_RATE, 1.0);
    assert!(m_true > 1.3 * m_model, "{m_true} vs {m_model}");
    // Both at once: the workload's response times are model times (hylics-workload), so the
    // two VMs sharing the CPU does not change them.
    let ((q_tasks, q_log), (c_tasks, c_log)) = std::thread::scope(|s| {
        let q = s.spawn(|| wrong_model_run("queueing_only"));
        let c = s.spawn(|| wrong_model_run("combined"));
        (q.join().unwrap(), c.join().unwrap())
    });
    let steps = |f: &vmsight_hylics::LogFile| {
        f.records
            .iter()
            .filter(|r| {
                r.decision
                    .reasons
                    .contains(&vmsight_hylics::Reason::AdaptiveStep)
            })
            .count()
    };
    let (q_m, c_m) = (late_mean_mib(&q_log), late_mean_mib(&c_log));
    let (q_r, c_r) = (
        late_mean_response(&q_tasks, WRONG_SECS),
        late_mean_response(&c_tasks, WRONG_SECS),
    );
    eprintln!(
        "true size {m_true} MiB, the model's {m_model} MiB; late mean share: queueing-only \
         {q_m:.1} MiB, combined {c_m:.1} MiB; late mean response: queueing-only {q_r:.4} s, \
         combined {c_r:.4} s (tau {TAU}); adaptive steps: {} and {}",
        steps(&q_log),
        steps(&c_log)
    );
    assert_eq!(steps(&q_log), 0, "queueing-only took an RLS step");
    assert!(
        steps(&c_log) >= 1,
        "the combined controller took no RLS step"
    );
    let mid = (m_true + m_model) / 2.0;
    assert!(
        q_m < mid,
        "queueing-only ended at {q_m:.1} MiB, not at the wrong model's {m_model} MiB"
    );
    assert!(
        q_r > TAU,
        "queueing-only met tau ({q_r:.4} s) with the wrong model's size"
    );
    assert!(
        c_m > mid,
        "combined ended at {c_m:.1} MiB, nearer the wrong model's {m_model} MiB than the true \
         {m_true} MiB"
    );
    assert!(
        c_r < q_r,
        "combined's response {c_r:.4} s is not below queueing-only's {q_r:.4} s"
    );
}
