//! Foundation behaviour, checked on a real Debian guest booted under vmsight (QEMU 10, TCG,
//! vhost-user-blk disks, the vmsight plugin).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmsight_tests::*;

#[test]
fn command_output_and_exit_status_come_back() {
    let r = guest_sh(&[], "echo to-stdout; echo to-stderr >&2; exit 7");
    assert_eq!(r.code, Some(7), "{r:?}");
    assert_eq!(r.stdout, "to-stdout\n", "{r:?}");
    assert!(r.stderr.contains("to-stderr"), "{r:?}");
}

#[test]
fn arguments_reach_the_guest_unchanged() {
    let r = run(&[
        "run", "--", "printf", "[%s]\\n", "a b", "it's", "$HOME", "*",
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(r.stdout, "[a b]\n[it's]\n[$HOME]\n[*]\n", "{r:?}");
}

#[test]
fn two_vcpus_are_online() {
    let r = guest_sh(&["--vcpus", "2"], "nproc; uname -r");
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("2"), "{r:?}");
    assert!(
        lines.next().unwrap_or("").ends_with("cloud-amd64"),
        "stock cloud kernel: {r:?}"
    );
}

/// `vmsight run -- sh -c SCRIPT` with `input` on its stdin, which is then closed.
fn run_with_stdin(script: &str, input: &[u8]) -> Run {
    let mut child = vmsight()
        .args(["run", "--", "sh", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vmsight");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).expect("feed stdin");
    drop(stdin);
    Run::from(child.wait_with_output().expect("wait"))
}

#[test]
fn stdin_is_forwarded_to_the_command() {
    let r = run_with_stdin("wc -c; cat /proc/cmdline >&2", &[b'x'; 100_000]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(r.stdout.trim(), "100000", "{r:?}");
}

/// A command that opens `/dev/stdin` again by its path (a script read by path, `cat
/// /dev/stdin`) works as over a host pipe: the guest init gives the command a pipe it fills
/// from the stdin port, which can be opened only once (EBUSY). The oracle: Python runs the
/// script only if it could read it through `/dev/stdin`, and prints a SHA-256 the host checks;
/// the guest's own `/proc/self/fd/0` shows the pipe.
#[test]
fn stdin_is_a_pipe_that_the_command_can_open_again_by_path() {
    use sha2::{Digest, Sha256};
    let r = run_with_stdin(
        "readlink /proc/self/fd/0 >&2; python3 /dev/stdin",
        b"import hashlib\nprint('RAN', hashlib.sha256(b'vmsight stdin').hexdigest())\n",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let want = format!("RAN {:x}", Sha256::digest(b"vmsight stdin"));
    assert_eq!(r.stdout.trim(), want, "{r:?}");
    assert!(
        r.stderr.lines().any(|l| l.starts_with("pipe:[")),
        "the command's stdin is a pipe: {r:?}"
    );
}

#[test]
fn synced_data_on_an_extra_disk_reaches_the_host_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("data.img");
    make_ext4(&img, 64);
    let disk = format!("{},serial=datadisk", img.display());
    let r = guest_sh(
        &["--disk", &disk],
        "set -e; cat /sys/block/vdb/serial; echo; mount /dev/vdb /mnt; \
         seq 1 20000 > /mnt/numbers.txt; echo hello-from-guest > /mnt/hello; sync; umount /mnt",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.starts_with("datadisk"), "serial via GET_ID: {r:?}");
    assert_eq!(debugfs(&img, "cat /hello"), "hello-from-guest\n");
    let numbers = debugfs(&img, "cat /numbers.txt");
    let expected: String = (1..=20000).map(|i| format!("{i}\n")).collect();
    assert!(
        numbers == expected,
        "numbers.txt differs ({} bytes)",
        numbers.len()
    );
    let (clean, out) = fsck_clean(&img);
    assert!(clean, "e2fsck -fn: {out}");
}

#[test]
fn a_read_only_disk_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ro.img");
    make_ext4(&img, 16);
    let before = std::fs::read(&img).unwrap();
    let disk = format!("{},ro", img.display());
    let r = guest_sh(
        &["--disk", &disk],
        "cat /sys/block/vdb/ro; \
         if dd if=/dev/zero of=/dev/vdb bs=4096 count=1 oflag=direct 2>/dev/null; then echo WROTE; else echo REFUSED; fi; \
         mount -o ro /dev/vdb /mnt && ls /mnt && umount /mnt",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("1"), "{r:?}");
    assert_eq!(lines.next(), Some("REFUSED"), "{r:?}");
    assert!(r.stdout.contains("lost+found"), "{r:?}");
    assert!(
        std::fs::read(&img).unwrap() == before,
        "read-only image changed"
    );
}

#[test]
fn guest_poweroff_exits_zero() {
    let r = run(&["run", "--", "poweroff"]);
    assert_eq!(r.code, Some(0), "{r:?}");
}

/// The guest kernel's report of a CPU whose timer stopped firing (docs/launcher.md, Limits)
/// makes vmsight log QEMU's own state of that vCPU's local APIC, once per CPU, and ends
/// nothing. The line is written into the kernel log here (a real stall is rare), and the state
/// comes from QEMU (`info lapic`), not from vmsight.
#[test]
fn a_guest_timer_stall_report_puts_qemus_local_apic_state_of_that_vcpu_in_the_log() {
    let line = r"rcu: \tPossible timer handling issue on cpu=1 timer-softirq=4\n";
    let r = guest_sh(
        &[],
        &format!("printf '{line}' > /dev/kmsg; printf '{line}' > /dev/kmsg; sleep 3; echo alive"),
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("alive"), "{r:?}");
    let reports = r
        .stderr
        .matches("the timer of its CPU 1 did not fire")
        .count();
    assert_eq!(reports, 1, "once per CPU: {r:?}");
    assert!(
        r.stderr.contains("dumping local APIC state for CPU 1"),
        "{r:?}"
    );
    // The timer's LVT entry and its counts, as QEMU's monitor prints them.
    assert!(r.stderr.contains("LVTT"), "{r:?}");
    assert!(r.stderr.contains("initial_count = "), "{r:?}");
}

#[test]
fn a_guest_panic_exits_nonzero_with_the_panic_text() {
    let r = guest_sh(&[], "echo c > /proc/sysrq-trigger; sleep 30");
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("guest kernel panic"), "{r:?}");
    assert!(r.stderr.contains("Kernel panic - not syncing"), "{r:?}");
    assert!(r.stderr.contains("sysrq"), "{r:?}");
}

fn syscalls_for(n: u64, dir: &Path) -> u64 {
    let stats = dir.join(format!("stats-{n}.json"));
    let r = run(&[
        "run",
        "--vcpus",
        "2",
        "--count-syscalls",
        "--stats-json",
        stats.to_str().unwrap(),
        "--",
        "getppid_loop",
        &n.to_string(),
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(v["plugin_attached"], true, "{v}");
    assert_eq!(v["plugin_translates"], true, "{v}");
    v["vcpus"]
        .as_array()
        .expect("vcpus")
        .iter()
        .map(|c| c["syscalls"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn plugin_counts_the_syscalls_of_a_known_program() {
    let dir = tempfile::tempdir().unwrap();
    let n = 500_000u64;
    let base = syscalls_for(0, dir.path());
    let with = syscalls_for(n, dir.path());
    assert!(base > 1_000, "boot and init make syscalls too: {base}");
    let diff = with as i64 - base as i64;
    let lo = (n as f64 * 0.98) as i64;
    let hi = (n as f64 * 1.05) as i64;
    assert!(
        (lo..=hi).contains(&diff),
        "getppid_loop {n} added {diff} syscalls (baseline {base}, with {with})"
    );
}

/// With nothing asked of it, the plugin is loaded and attached but registers no translation
/// callback: not one of the guest's syscalls is counted, while `--count-syscalls` in the same
/// guest counts at least the ones the program itself made.
#[test]
fn a_plugin_with_nothing_to_do_stays_dormant_and_counts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let n = 20_000u64;
    let run_with = |extra: &[&str], name: &str| {
        let stats = dir.path().join(name);
        let mut args = vec!["run", "--stats-json", stats.to_str().unwrap()];
        args.extend_from_slice(extra);
        let n = n.to_string();
        args.extend_from_slice(&["--", "getppid_loop", &n]);
        let r = run(&args);
        assert_eq!(r.code, Some(0), "{r:?}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        assert_eq!(v["plugin_attached"], true, "the plugin was loaded: {v}");
        let total: u64 = v["vcpus"]
            .as_array()
            .expect("vcpus")
            .iter()
            .map(|c| c["syscalls"].as_u64().unwrap_or(0))
            .sum();
        (v["plugin_translates"].clone(), total)
    };
    let (translates, counted) = run_with(&[], "dormant.json");
    assert_eq!(translates, false, "nothing was asked of the plugin");
    assert_eq!(
        counted, 0,
        "a dormant plugin instruments nothing, so counts nothing"
    );
    let (translates, counted) = run_with(&["--count-syscalls"], "counting.json");
    assert_eq!(translates, true);
    assert!(
        counted >= n,
        "getppid_loop {n} made at least {n} syscalls: {counted}"
    );
}

#[test]
fn root_disk_writes_persist_only_with_persist() {
    let name = vm_name("persist");
    let r = guest_sh(
        &["--name", &name, "--persist"],
        "echo kept > /root/marker; sync",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let r = guest_sh(&["--name", &name, "--persist"], "cat /root/marker");
    assert_eq!(r.stdout, "kept\n", "{r:?}");
    let r = guest_sh(
        &["--name", &name],
        "cat /root/marker 2>/dev/null || echo absent",
    );
    assert_eq!(r.stdout, "absent\n", "a fresh copy must not see it: {r:?}");
    // Clean up the persistent disk.
    let cache = std::env::var_os("VMSIGHT_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").unwrap()).join(".cache/vmsight"));
    let _ = std::fs::remove_file(cache.join("persist").join(format!("{name}.img")));
}

fn runtime_dir(name: &str) -> std::path::PathBuf {
    let base = std::env::var_os("VMSIGHT_RUNTIME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/run/vmsight".into());
    base.join(name)
}

fn wait_for_ready(name: &str, timeout: Duration) -> serde_json::Value {
    let start = Instant::now();
    let f = runtime_dir(name).join("vm.json");
    loop {
        if let Ok(d) = std::fs::read(&f) {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d) {
                return v;
            }
        }
        assert!(start.elapsed() < timeout, "VM {name} never appeared");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn pid_alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn sigterm_leaves_no_orphan_processes_or_sockets() {
    let name = vm_name("sigterm");
    let child = vmsight()
        .args(["run", "--name", &name, "--", "sleep", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rec = wait_for_ready(&name, Duration::from_secs(60));
    let qemu_pid = rec["qemu_pid"].as_u64().expect("qemu pid");
    assert!(pid_alive(qemu_pid));
    // Let the guest boot properly, so the stop happens mid-run.
    std::thread::sleep(Duration::from_secs(5));
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while pid_alive(qemu_pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!pid_alive(qemu_pid), "QEMU {qemu_pid} outlived vmsight");
    assert!(!runtime_dir(&name).exists(), "runtime dir left behind");
}

#[test]
fn sigkill_of_vmsight_takes_qemu_and_virtiofsd_down_even_after_they_changed_user() {
    let name = vm_name("sigkill");
    // With a share: virtiofsd runs too. As root (make test), both run as the VM's own
    // identity, a change of user that clears the parent-death signal (docs/security.md).
    let mut child = vmsight()
        .args([
            "run",
            "--name",
            &name,
            "--shared-mem",
            "8M",
            "--",
            "sleep",
            "600",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let rec = wait_for_ready(&name, Duration::from_secs(60));
    let qemu_pid = rec["qemu_pid"].as_u64().expect("qemu pid");
    // QEMU changes user at the end of its start-up, before the guest runs: wait for it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let uid = |pid: u64| {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                l.strip_prefix("Uid:")
                    .map(|u| u.split_whitespace().next().map(str::to_owned))
            })
            .flatten()
    };
    while uid(qemu_pid).as_deref() == Some("0") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = Command::new("pgrep")
        .args(["-P", &child.id().to_string(), "-x", "virtiofsd"])
        .output()
        .unwrap();
    let daemons: Vec<u64> = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(daemons.len(), 1, "virtiofsd serves the share");
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let alive = || pid_alive(qemu_pid) || daemons.iter().any(|d| pid_alive(*d));
    while alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !pid_alive(qemu_pid),
        "QEMU {qemu_pid} (uid {:?}) outlived a SIGKILLed vmsight",
        uid(qemu_pid)
    );
    assert!(
        !daemons.iter().any(|d| pid_alive(*d)),
        "virtiofsd {daemons:?} outlived a SIGKILLed vmsight"
    );
    // SIGKILL left the runtime directory (and its megabytes of tmpfs) behind; the next VM,
    // whatever its name, removes it.
    let other = vm_name("after-sigkill");
    let r = guest_sh(&["--name", &other], "hostname");
    assert_eq!(r.stdout.trim(), other, "{r:?}");
    assert!(
        !runtime_dir(&name).exists(),
        "the stale runtime directory of {name} is still there"
    );
}

#[test]
fn two_vms_cannot_write_one_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("shared.img");
    make_ext4(&img, 16);
    let name = vm_name("lock-a");
    let disk = img.display().to_string();
    let mut a = vmsight()
        .args([
            "run", "--name", &name, "--disk", &disk, "--", "sleep", "600",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_ready(&name, Duration::from_secs(60));
    let b = run(&["run", "--disk", &disk, "--", "true"]);
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(a.id() as i32, libc::SIGTERM) };
    let _ = a.wait();
    assert_eq!(b.code, Some(1), "{b:?}");
    assert!(
        b.stderr.contains("lock") || b.stderr.contains("in use"),
        "{b:?}"
    );
    assert_eq!(b.stderr.trim().lines().count(), 1, "one-line error: {b:?}");
}

#[test]
fn several_disks_keep_their_order_and_serials() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    make_ext4(&a, 16);
    make_ext4(&b, 32);
    let da = format!("{},serial=first", a.display());
    let db = format!("{},serial=second,ro", b.display());
    let r = guest_sh(
        &["--disk", &da, "--disk", &db],
        "for d in vdb vdc; do echo $d $(cat /sys/block/$d/serial) $(cat /sys/block/$d/size) $(cat /sys/block/$d/ro); done",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(r.stdout, "vdb first 32768 0\nvdc second 65536 1\n", "{r:?}");
}

#[test]
fn a_qemu_failure_exits_nonzero_with_qemus_reason() {
    // A file that is not a kernel: QEMU refuses it at start-up.
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("not-a-kernel");
    std::fs::write(&bogus, vec![0x5au8; 4096]).unwrap();
    let r = run(&["run", "--kernel", bogus.to_str().unwrap(), "--", "true"]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(r.stderr.contains("QEMU failed"), "{r:?}");
    assert!(!r.stderr.trim().is_empty());
}

/// A guest that never reaches vmsight's init (here PID 1 is a shell waiting on the console)
/// is stopped at `--boot-timeout` with status 125 and the console's last lines.
#[test]
fn a_guest_that_never_reports_ready_is_stopped_at_the_boot_timeout() {
    let start = Instant::now();
    let r = run(&[
        "run",
        "--boot-timeout",
        "10",
        "--append",
        "init=/bin/sh",
        "--",
        "true",
    ]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(
        r.stderr
            .contains("the guest did not report ready within 10 s (--boot-timeout)"),
        "{r:?}"
    );
    assert!(r.stderr.contains("last console lines:"), "{r:?}");
    assert!(start.elapsed() >= Duration::from_secs(10), "{r:?}");
}
