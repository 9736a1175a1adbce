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
    // Write, report dd's own count and the root disk's, then wait (Scraped adds the pause).
    let script = format!(
        "dd if=/dev/urandom of=/dev/vdb bs=1M count={WRITE_MIB} oflag=direct conv=fsync \
         2>/tmp/dd.err; sync; cat /tmp/dd.err; \
         echo \"VDA read_sectors=$(awk '{{print $3}}' /sys/block/vda/stat)\""
    );
    let vm = Scraped::start("metrics", &["--disk", img.to_str().unwrap()], &script);
    let written = dd_bytes(&vm.out).unwrap_or_else(|| panic!("no dd count in {:?}", vm.out));
    assert_eq!(written, WRITE_MIB << 20, "{}", vm.out);
    // The guest's own count of what it read from its root disk so far (512-byte sectors).
    let root_read = vm.guest("VDA ", "read_sectors") * 512.0;

    // The VM is still running: its counters come through Prometheus, each bounded on both
    // sides by what the guest itself did.
    let w = written as f64;
    // Exactly dd's bytes reached the raw disk (no file system, O_DIRECT), nothing else wrote.
    let bytes = wait_value(
        &vm.prometheus,
        &format!(
            "vmsight_block_bytes_total{{vm=\"{}\",disk=\"1\",kind=\"write\"}}",
            vm.name
        ),
        |v| v >= w,
    );
    assert_eq!(bytes.value, w, "written bytes: {bytes:?}");
    assert_eq!(bytes.label("vm"), Some(vm.name.as_str()));
    // At least one request per MiB dd wrote, at most one per 4 KiB page.
    vm.within(
        "vmsight_block_requests_total",
        "disk=\"1\",kind=\"write\"",
        WRITE_MIB as f64,
        w / 4096.0,
    );
    // The root disk (disk 0) served at least what the guest counted as read before it printed
    // the count, and not far more (the guest is idle since, waiting on stdin).
    assert!(root_read > 0.0, "{}", vm.out);
    vm.within(
        "vmsight_block_bytes_total",
        "disk=\"0\",kind=\"read\"",
        root_read,
        root_read + f64::from(16u32 << 20),
    );
    // The guest waits on stdin: nothing is in flight on the disk it wrote.
    vm.within("vmsight_block_in_flight_requests", "disk=\"1\"", 0.0, 0.0);
    wait_value(&vm.prometheus, "vmsight_metrics_rejected_samples", |v| {
        v == 0.0
    });
    vm.finish();
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

// ---------------------------------------------------------------------------------------------
// One Prometheus scrape target per feature area: the guest works, prints its own counts and
// waits on stdin; meanwhile each metric is read through Prometheus and must equal, or lie
// between two bounds of, what the guest or the host file system counted.

/// A running VM serving metrics, scraped by a real Prometheus, its guest paused after
/// printing `PAUSED`.
struct Scraped {
    prometheus: Prometheus,
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    /// The guest's output up to `PAUSED`.
    out: String,
    name: String,
}

impl Scraped {
    /// Starts `vmsight run --metrics ADDR ARGS -- sh -c SCRIPT; echo PAUSED; read` and waits
    /// for `PAUSED`.
    fn start(tag: &str, args: &[&str], script: &str) -> Scraped {
        Scraped::start_named(vm_name(tag), args, script)
    }

    /// [`Scraped::start`] with the VM's name chosen by the caller.
    fn start_named(name: String, args: &[&str], script: &str) -> Scraped {
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port().unwrap()));
        let prometheus = Prometheus::start(&[metrics]).unwrap_or_else(|e| panic!("{e}"));
        let script = format!("set -e\n{script}\necho PAUSED\nread _ || true\n");
        let mut child = vmsight()
            .args(["run", "--name", &name, "--metrics", &metrics.to_string()])
            .args(args)
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vmsight");
        let stdin = child.stdin.take();
        let mut out = String::new();
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            if line == "PAUSED" {
                return Scraped {
                    prometheus,
                    child,
                    stdin,
                    out,
                    name,
                };
            }
            out.push_str(&line);
            out.push('\n');
        }
        drop(stdin);
        let r = Run::from(child.wait_with_output().unwrap());
        panic!("the guest never paused: stdout {out:?}, {r:?}");
    }

    /// The number after `KEY=` on the guest's line starting with `prefix`.
    fn guest(&self, prefix: &str, key: &str) -> f64 {
        let line = self
            .out
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {}", self.out));
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
    }

    /// Waits until the metric `name{labels}` of this VM lies in `lo..=hi`; returns it.
    fn within(&self, name: &str, labels: &str, lo: f64, hi: f64) -> f64 {
        let sep = if labels.is_empty() { "" } else { "," };
        let q = format!("{name}{{vm=\"{}\"{sep}{labels}}}", self.name);
        let samples = self
            .prometheus
            .wait_for(&q, WAIT, |s| {
                s.len() == 1 && (lo..=hi).contains(&s[0].value)
            })
            .unwrap_or_else(|e| panic!("{q} never in {lo}..={hi}: {e}"));
        samples[0].value
    }

    /// Lets the guest finish; the VM must exit cleanly.
    fn finish(mut self) {
        self.stdin.take();
        let r = Run::from(self.child.wait_with_output().unwrap());
        assert_eq!(r.code, Some(0), "{r:?}");
    }
}

/// Dedup: 3 MiB of random data written twice to the raw dedup disk. The guest's
/// `/sys/block/vdb/stat` counts the sectors written; the host's allocated blocks of the
/// volume's sparse data file count the chunks stored.
#[test]
fn dedup_metrics_match_the_guests_writes_and_the_hosts_allocated_blocks() {
    let d = tempfile::tempdir().unwrap();
    let vol = d.path().join("vol");
    let r = run(&["dedup", "create", vol.to_str().unwrap(), "--size", "64MiB"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let disk = format!("{},dedup", vol.display());
    let vm = Scraped::start(
        "metrics-dedup",
        &["--disk", &disk],
        "head -c 3M /dev/urandom > /tmp/r\n\
         dd if=/tmp/r of=/dev/vdb bs=1M oflag=direct status=none\n\
         dd if=/tmp/r of=/dev/vdb bs=1M seek=3 oflag=direct status=none\n\
         sync\n\
         echo \"VDB written=$(awk '{print $7}' /sys/block/vdb/stat)\"",
    );
    let blocks = vm.guest("VDB ", "written") / 8.0;
    assert_eq!(blocks, 1536.0, "the guest wrote 6 MiB: {}", vm.out);
    vm.within("vmsight_dedup_blocks_written_total", "", blocks, blocks);
    vm.within("vmsight_dedup_mapped_blocks", "", blocks, blocks);
    // The second copy is stored once: 768 chunks, 3 MiB saved.
    let used = vm.within("vmsight_dedup_used_chunks", "", 768.0, 768.0);
    vm.within(
        "vmsight_dedup_saved_bytes",
        "",
        3.0 * 1048576.0,
        3.0 * 1048576.0,
    );
    // The host agrees: the data file holds the used chunks (plus at most 1 MiB of the host
    // file system's own extent blocks and the data not yet flushed from a commit).
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(vol.join("data")).unwrap().blocks() as f64 * 512.0;
    assert!(
        (used * 4096.0..=used * 4096.0 + 1048576.0).contains(&allocated),
        "{used} chunks in use, {allocated} bytes allocated to the data file"
    );
    vm.finish();
}

/// The Hylics share: three files in the guest's `/hylics`; the guest's own `df` (statfs) and
/// `find` count its size, use and files.
#[test]
fn share_metrics_match_the_guests_df_and_files() {
    let vm = Scraped::start(
        "metrics-share",
        &["--net", "none", "--shared-mem", "64M"],
        "for i in 1 2 3; do head -c 1M /dev/urandom > /hylics/f$i; done\n\
         sync\n\
         echo \"DF $(df -B1 --output=size,used /hylics | awk 'NR == 2 {print \"size=\" $1, \"used=\" $2}') \
         $(df --output=iused /hylics | awk 'NR == 2 {print \"inodes=\" $1}') \
         files=$(find /hylics -mindepth 1 | wc -l)\"",
    );
    let size = vm.guest("DF ", "size");
    assert_eq!(size, 64.0 * 1048576.0, "{}", vm.out);
    vm.within("vmsight_share_size_bytes", "", size, size);
    let used = vm.guest("DF ", "used");
    assert!(used >= 3.0 * 1048576.0, "{}", vm.out);
    vm.within("vmsight_share_used_bytes", "", used, used);
    let files = vm.guest("DF ", "files");
    assert_eq!(files, 3.0, "{}", vm.out);
    // tmpfs counts its root directory's inode too.
    let inodes = vm.guest("DF ", "inodes");
    vm.within("vmsight_share_files", "", files, inodes.max(files + 1.0));
    vm.within("vmsight_share_resizes_total", "", 0.0, 0.0);
    vm.finish();
}

/// SwapBypass: a 128 MiB guest with the module swaps about 160 MiB through `/dev/vmswap0`; its
/// `/proc/vmstat` counts the pages swapped in and out.
#[test]
fn swap_metrics_match_the_guests_vmstat() {
    let vm = Scraped::start(
        "metrics-swap",
        &["--mem", "128M", "--symbiotic", "--swap", "256M,cache=32M"],
        "swap-check 160 --rounds 2 > /tmp/sc 2>&1 || { cat /tmp/sc; exit 1; }\n\
         echo \"VMSTAT $(awk '/^pswp(in|out) / {printf \"%s=%s \", $1, $2}' /proc/vmstat)\"",
    );
    let (pin, pout) = (
        vm.guest("VMSTAT ", "pswpin"),
        vm.guest("VMSTAT ", "pswpout"),
    );
    assert!(pout > 1000.0, "the guest swapped: {}", vm.out);
    vm.within("vmsight_swap_bypass_active", "", 1.0, 1.0);
    // The guest's own counters, copied through SymSpy (the idle guest may still swap a few
    // pages after printing its counts: up to 256 more).
    vm.within("vmsight_swap_guest_pswpin", "", pin, pin + 256.0);
    vm.within("vmsight_swap_guest_pswpout", "", pout, pout + 256.0);
    // Every page the guest swapped went by the module (bypass) or by the disk (block); the
    // disk path also carries the swap header and the kernel's probing (at most 1024 pages),
    // and the idle guest may swap up to 256 pages more after printing its counts.
    let q = |path: &str, dir: &str| {
        format!(
            "sum(vmsight_swap_{dir}_pages_total{{vm=\"{}\",path=~\"{path}\"}})",
            vm.name
        )
    };
    for (dir, guest) in [("out", pout), ("in", pin)] {
        let all = vm
            .prometheus
            .wait_for(&q("bypass|block", dir), WAIT, |s| {
                s.len() == 1 && (guest..=guest + 1024.0 + 256.0).contains(&s[0].value)
            })
            .unwrap_or_else(|e| panic!("swap {dir} pages vs the guest's {guest}: {e}"));
        let bypass = vm.within(
            &format!("vmsight_swap_{dir}_pages_total"),
            "path=\"bypass\"",
            1.0,
            all[0].value,
        );
        // Swap-outs all go to the module; swap-ins of pages past the 32 MiB cache are read
        // from the disk by the module through the block path.
        if dir == "out" {
            assert!(
                bypass >= 0.9 * guest,
                "{dir}: {bypass} of the guest's {guest} pages bypassed"
            );
        }
    }
    vm.finish();
}

/// The guest's upload: 4 MiB over TCP to the host end (10.0.2.1:9000), then its NIC's own
/// counters.
const UPLOAD: &str = r#"python3 - <<'PY'
import socket, time
for _ in range(600):
    try:
        s = socket.create_connection(("10.0.2.1", 9000), timeout=5)
        break
    except OSError:
        time.sleep(0.2)
s.sendall(b"x" * (4 << 20))
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
PY
sleep 1
cd /sys/class/net/eth0/statistics
echo "NET tx=$(cat tx_packets) rx=$(cat rx_packets) tx_bytes=$(cat tx_bytes) rx_bytes=$(cat rx_bytes)""#;

/// The host end of [`UPLOAD`], in the VM's network namespace: reads to the end, answers one
/// byte.
const SINK: &str = "import socket\n\
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('10.0.2.1', 9000)); s.listen(1); c, _ = s.accept()\n\
while c.recv(65536): pass\n\
c.sendall(b'k'); c.close()\n";

/// The NIC with FoxyVegas: the guest uploads 4 MiB; its own interface counters (frames and
/// bytes each way) bound the NIC's and FoxyVegas's metrics.
#[test]
fn nic_and_foxyvegas_metrics_match_the_guests_interface_counters() {
    let name = vm_name("metrics-net");
    let sink = {
        let name = name.clone();
        std::thread::spawn(move || {
            wait_until("the VM's network", 120, || {
                run(&["net", &name, "info"]).code == Some(0)
            });
            run(&["net", &name, "exec", "python3", "-c", SINK])
        })
    };
    let vm = Scraped::start_named(name, &["--foxyvegas"], UPLOAD);
    let r = sink.join().unwrap();
    assert_eq!(r.code, Some(0), "the host end: {r:?}");
    let (tx, rx) = (vm.guest("NET ", "tx"), vm.guest("NET ", "rx"));
    let (txb, rxb) = (vm.guest("NET ", "tx_bytes"), vm.guest("NET ", "rx_bytes"));
    assert!(txb >= 4.0 * 1048576.0, "{}", vm.out);
    // The guest is idle after printing its counters, but its kernel may still answer an ARP
    // or neighbour probe: up to 8 frames each way may follow the printed counts.
    const SLACK: f64 = 8.0;
    let frames = vm.within(
        "vmsight_net_frames_total",
        "direction=\"tx\"",
        tx,
        tx + SLACK,
    );
    vm.within(
        "vmsight_net_frames_total",
        "direction=\"rx\"",
        rx,
        rx + SLACK,
    );
    vm.within(
        "vmsight_net_bytes_total",
        "direction=\"tx\"",
        txb,
        txb + SLACK * 1514.0,
    );
    vm.within(
        "vmsight_net_bytes_total",
        "direction=\"rx\"",
        rxb,
        rxb + SLACK * 1514.0,
    );
    // FoxyVegas sampled RTTs from the peer's ACKs (at most one per frame to the guest) and
    // rewrote at most every one of them; the upload's flow has ended or is the only one.
    vm.within("vmsight_foxyvegas_rtt_samples_total", "", 1.0, rx);
    vm.within("vmsight_foxyvegas_rewrites_total", "", 0.0, rx);
    vm.within("vmsight_foxyvegas_flows_active", "", 0.0, 1.0);
    vm.within("vmsight_net_flows_total", "", 1.0, frames);
    vm.finish();
}
