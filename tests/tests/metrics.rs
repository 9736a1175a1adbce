//! `vmsight run --metrics`, checked end to end: a real Prometheus server (Debian's
//! `prometheus` package) scrapes a running VM while its guest writes to an extra disk, and the
//! block counters read back through Prometheus' HTTP API must cover what the guest's own `dd`
//! says it wrote. A missing `prometheus` binary fails the test (scripts/setup-host.sh installs
//! it). Metric names and labels: docs/metrics.md.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::time::Duration;

use vmsight_metrics::harness::{free_loopback_port, Prometheus, QuerySample};
use vmsight_tests::*;

/// Upper bound for Prometheus to scrape and answer (it scrapes every second).
const WAIT: Duration = Duration::from_secs(60);
/// What the guest writes to its extra disk, in MiB.
const WRITE_MIB: u64 = 16;

/// The bytes count of dd's `N bytes (...) copied` line.
fn dd_bytes(output: &str) -> Option<u64> {
    let line = output
        .lines()
        .find(|l| l.contains(" bytes") && l.contains("copied"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// The single sample of `query` once `done` accepts its value.
fn wait_value(prometheus: &Prometheus, query: &str, done: impl Fn(f64) -> bool) -> QuerySample {
    let samples = prometheus
        .wait_for(query, WAIT, |s| s.len() == 1 && done(s[0].value))
        .unwrap_or_else(|e| panic!("{e}"));
    samples[0].clone()
}

#[test]

fn guest_writes_show_up_in_prometheus_while_the_vm_runs() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("data.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .unwrap();
    let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port().unwrap()));
    // Scrapes every second; the target is down until vmsight listens.
    let prometheus = Prometheus::start(&[metrics]).unwrap_or_else(|e| panic!("{e}"));
    let name = vm_name("metrics");
    // Write, report dd's own count, then keep the VM up until stdin closes.
    let script = format!(
        "set -e; dd if=/dev/urandom of=/dev/vdb bs=1M count={WRITE_MIB} oflag=direct conv=fsync \
         2>/tmp/dd.err; sync; cat /tmp/dd.err; \
         echo \"VDA_READ_SECTORS $(awk '{{print $3}}' /sys/block/vda/stat)\"; echo WRITTEN; \
         read _ || true"
    );
    let mut child = vmsight()
        .args(["run", "--name", &name, "--metrics", &metrics.to_string()])
        .args(["--disk", img.to_str().unwrap(), "--", "sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vmsight");
    let stdin = child.stdin.take().unwrap();
    let mut guest_out = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        guest_out.push_str(&line);
        guest_out.push('\n');
        if line == "WRITTEN" {
            break;
        }
    }
    if !guest_out.ends_with("WRITTEN\n") {
        drop(stdin);
        let r = Run::from(child.wait_with_output().unwrap());
        panic!("the guest did not finish writing: stdout {guest_out:?}, {r:?}");
    }
    let written = dd_bytes(&guest_out).unwrap_or_else(|| panic!("no dd count in {guest_out:?}"));
    assert_eq!(written, WRITE_MIB << 20, "{guest_out}");

    // The guest's own count of what it read from its root disk so far (512-byte sectors).
    let root_read: f64 = guest_out
        .lines()
        .find_map(|l| l.strip_prefix("VDA_READ_SECTORS "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no root disk count in {guest_out:?}"))
        * 512.0;

    // The VM is still running: its counters come through Prometheus, each bounded on both
    // sides by what the guest itself did.
    let vm = format!("vm=\"{name}\"");
    let w = written as f64;
    // Exactly dd's bytes reached the raw disk (no file system, O_DIRECT), nothing else wrote.
    let bytes = wait_value(
        &prometheus,
        &format!("vmsight_block_bytes_total{{{vm},disk=\"1\",kind=\"write\"}}"),
        |v| v >= w,
    );
    assert_eq!(bytes.value, w, "written bytes: {bytes:?}");
    assert_eq!(bytes.label("vm"), Some(name.as_str()));
    // At least one request per MiB dd wrote, at most one per 4 KiB page.
    let requests = wait_value(
        &prometheus,
        &format!("vmsight_block_requests_total{{{vm},disk=\"1\",kind=\"write\"}}"),
        |v| v >= WRITE_MIB as f64,
    );
    assert!(requests.value <= w / 4096.0, "write requests: {requests:?}");
    // The root disk (disk 0) served at least what the guest counted as read before it printed
    // the count, and not far more (the guest is idle since, waiting on stdin).
    let root = wait_value(
        &prometheus,
        &format!("vmsight_block_bytes_total{{{vm},disk=\"0\",kind=\"read\"}}"),
        |v| v >= root_read,
    );
    assert!(
        root_read > 0.0 && root.value <= root_read + f64::from(16u32 << 20),
        "root disk reads: vmsight {root:?}, the guest {root_read} bytes"
    );
    // The guest waits on stdin: nothing is in flight on the disk it wrote.
    wait_value(
        &prometheus,
        &format!("vmsight_block_in_flight_requests{{{vm},disk=\"1\"}}"),
        |v| v == 0.0,
    );
    wait_value(&prometheus, "vmsight_metrics_rejected_samples", |v| {
        v == 0.0
    });

    drop(stdin);
    let r = Run::from(child.wait_with_output().unwrap());
    assert_eq!(r.code, Some(0), "{r:?}");
}

#[test]
fn dd_counts_are_parsed_from_gnu_and_busybox_output() {
    let gnu = "16+0 records in\n16+0 records out\n16777216 bytes (17 MB, 16 MiB) copied, 0.5 s, 33 MB/s\n";
    let busybox =
        "16+0 records in\n16+0 records out\n16777216 bytes (16.0MB) copied, 0.5 seconds, 32MB/s\n";
    assert_eq!(dd_bytes(gnu), Some(16 << 20));
    assert_eq!(dd_bytes(busybox), Some(16 << 20));
    assert_eq!(dd_bytes("dd: error writing '/dev/vdb'"), None);
}
