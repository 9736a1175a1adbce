//! The end of a run: the guest init takes the network down before the kernel shuts its devices
//! down, and vmsight stops a VM that does not end once the guest has synced and asked to power
//! off (docs/guest-protocol.md, "Shutdown").
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use vmsight_tests::*;

fn stats_of(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The kernel itself transmits on every console message once netconsole is loaded, so a NIC
/// still up during `device_shutdown` would send on a virtio queue the kernel has just broken
/// (the path where Debian 6.1's virtio_net can spin forever). The guest's own console is the
/// oracle: the kernel logs each refused send as "Unexpected TXQ (0) queue failure".
#[test]
fn nothing_transmits_while_the_guest_kernel_shuts_its_devices_down() {
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let stats = dir.path().join("stats.json");
    let r = guest_sh(
        &[
            "--console-log",
            console.to_str().unwrap(),
            "--stats-json",
            stats.to_str().unwrap(),
        ],
        "dev=$(ls /sys/class/net | grep -vx lo | head -1); \
         modprobe netconsole \"netconsole=6665@10.0.2.15/$dev,6666@10.0.2.2/ff:ff:ff:ff:ff:ff\" \
         && echo netconsole-on-$dev",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.starts_with("netconsole-on-"), "{r:?}");
    let log = std::fs::read_to_string(&console).unwrap();
    assert!(
        log.contains("netconsole: network logging started"),
        "netconsole was not running: {log}"
    );
    let v = stats_of(&stats);
    let tx = v["nics"][0]["metrics"]["tx_frames"].as_u64().unwrap_or(0);
    assert!(
        tx >= 2,
        "the kernel sent its console messages on the NIC: {tx} frames: {v}"
    );
    let shutdown = log
        .split("vmsight-init: poweroff")
        .nth(1)
        .unwrap_or_else(|| panic!("the init never began its poweroff: {log}"));
    assert!(
        shutdown.contains("reboot: Power down"),
        "the kernel powered off: {shutdown}"
    );
    assert!(
        !shutdown.contains("queue failure"),
        "the kernel transmitted during device shutdown: {shutdown}"
    );
    assert_eq!(v["poweroff_forced"], false, "{v}");
}

/// QEMU run with `-no-shutdown` pauses at the guest's poweroff instead of exiting, as a guest
/// kernel hung in its device shutdown leaves a VM. After the init reported `down` (synced,
/// `/` read-only), vmsight waits its poweroff deadline (20 s), stops QEMU, says so, and returns
/// the command's own status.
#[test]
fn a_vm_that_does_not_end_after_the_guest_synced_is_stopped_with_the_commands_status() {
    let dir = tempfile::tempdir().unwrap();
    let qemu = dir.path().join("qemu-no-shutdown");
    std::fs::write(
        &qemu,
        "#!/bin/sh\n\
         case \"$1\" in --version) exec qemu-system-x86_64 \"$@\" ;; esac\n\
         exec qemu-system-x86_64 \"$@\" -no-shutdown\n",
    )
    .unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let stats = dir.path().join("stats.json");
    let start = Instant::now();
    let r = guest_sh(
        &[
            "--qemu",
            qemu.to_str().unwrap(),
            "--stats-json",
            stats.to_str().unwrap(),
        ],
        "echo done-here; exit 3",
    );
    let took = start.elapsed();
    assert_eq!(r.code, Some(3), "the command's status stands: {r:?}");
    assert_eq!(r.stdout, "done-here\n", "{r:?}");
    assert!(
        r.stderr.contains("asked to power off") && r.stderr.contains("stopped it"),
        "vmsight says it stopped the VM: {r:?}"
    );
    assert!(
        took >= Duration::from_secs(20),
        "the deadline was waited out: {took:?}"
    );
    let v = stats_of(&stats);
    assert_eq!(v["poweroff_forced"], true, "{v}");
}

/// `halt` leaves the kernel halted and QEMU running; vmsight ends the VM after the deadline
/// and reports a normal end (status 0), naming what the guest asked for.
#[test]
fn a_guest_that_halts_is_ended_after_the_deadline() {
    let start = Instant::now();
    let r = run(&["run", "--", "halt"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("asked to halt") && r.stderr.contains("a halted guest stays halted"),
        "{r:?}"
    );
    assert!(start.elapsed() >= Duration::from_secs(20), "{r:?}");
}
