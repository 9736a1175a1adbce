//! vmsight's network device on real guests (issue 12), checked against independent oracles:
//! sha256 of transfers on both ends; tcpdump in the guest against tcpdump on the host end of
//! the link for the windows FoxyVegas rewrites (and, without it, that no window changes);
//! hand-made truncated frames from both sides dropped and counted, the guest still reachable.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;
use vmsight_tests::*;

/// An HTTP server for the host end: GET serves the file argv[1], PUT prints the sha256 of the
/// body. argv[2], argv[3]: address and port.
const HOST_SERVER: &str = r#"
import hashlib, http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def do_GET(self):
        data = open(sys.argv[1], "rb").read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_PUT(self):
        n = int(self.headers["Content-Length"]); h = hashlib.sha256()
        while n > 0:
            b = self.rfile.read(min(n, 1 << 20))
            if not b:
                break
            h.update(b); n -= len(b)
        print("PUT", h.hexdigest(), flush=True)
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((sys.argv[2], int(sys.argv[3])), H).serve_forever()
"#;

/// The guest's side of the transfers: 64 MiB down, 64 MiB up, each sha256 printed.
const TRANSFER_SCRIPT: &str = r#"
set -e
i=0; until curl -s -o /dev/null http://10.0.2.1:8080/; do i=$((i+1)); [ $i -lt 300 ] || exit 9; sleep 0.2; done
curl -sf http://10.0.2.1:8080/blob | sha256sum | cut -d' ' -f1 | sed 's/^/DOWN /'
head -c 64M /dev/urandom > /tmp/up
sha256sum /tmp/up | cut -d' ' -f1 | sed 's/^/UP /'
curl -sf -T /tmp/up http://10.0.2.1:8080/up
echo ===DONE
"#;

/// Waits until VM `name`'s network exists (its namespace is made before QEMU starts).
fn wait_for_net(name: &str) {
    wait_until("the VM's network", 120, || {
        run(&["net", name, "info"]).code == Some(0)
    });
}

/// `vmsight net NAME exec ARGS...` in the background, stdout piped.
fn net_exec(name: &str, args: &[&str]) -> Bg {
    Bg(vmsight()
        .args(["net", name, "exec"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("vmsight net exec"))
}

fn sha256_file(p: &Path) -> String {
    use sha2::Digest;
    let data = std::fs::read(p).unwrap();
    format!("{:x}", sha2::Sha256::digest(&data))
}

fn line_value<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in {lines:?}"))
}

/// Runs the transfers in one VM named after `tag` (tests run in parallel: names must differ)
/// with `extra` options; returns the stats JSON.
fn transfers(tag: &str, extra: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let blob = dir.path().join("blob");
    let data: Vec<u8> = (0..64u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&blob, &data).unwrap();
    let stats = dir.path().join("stats.json");
    let name = vm_name(&format!("xfer-{tag}"));
    let mut args = vec!["--name", &name, "--stats-json", stats.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", TRANSFER_SCRIPT]);
    let vm = LiveVm::start(&args);
    wait_for_net(&name);
    let mut server = net_exec(
        &name,
        &[
            "python3",
            "-c",
            HOST_SERVER,
            blob.to_str().unwrap(),
            "10.0.2.1",
            "8080",
        ],
    );
    let puts = collect_lines(&mut server.0);
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert_eq!(
        line_value(&out, "DOWN "),
        sha256_file(&blob),
        "download intact"
    );
    let up = line_value(&out, "UP ").to_owned();
    wait_until("the host's upload hash", 30, || {
        !puts.lock().unwrap().is_empty()
    });
    assert_eq!(
        puts.lock().unwrap()[0],
        format!("PUT {up}"),
        "upload intact"
    );
    serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap()
}

fn nic(stats: &Value) -> &Value {
    &stats["nics"][0]
}

#[test]
fn transfers_both_ways_are_intact_with_the_capture_and_the_capture_opens_in_tcpdump() {
    let dir = tempfile::tempdir().unwrap();
    let pcap = dir.path().join("cap.pcap");
    let stats = transfers("pcap", &["--net-pcap", pcap.to_str().unwrap()]);
    let m = &nic(&stats)["metrics"];
    assert!(m["tx_bytes"].as_u64().unwrap() > 64 << 20, "{m}");
    assert!(m["rx_bytes"].as_u64().unwrap() > 64 << 20, "{m}");
    assert_eq!(nic(&stats)["foxyvegas"], Value::Null, "FoxyVegas was off");
    let out = Command::new("tcpdump")
        .args(["-nn", "-r"])
        .arg(&pcap)
        .arg("tcp port 8080")
        .output()
        .expect("tcpdump must be installed (make setup)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let to_guest = text
        .lines()
        .filter(|l| l.contains("10.0.2.1.8080 > 10.0.2.15."))
        .count();
    let from_guest = text
        .lines()
        .filter(|l| l.contains("> 10.0.2.1.8080:"))
        .count();
    assert!(
        to_guest > 100 && from_guest > 100,
        "{to_guest} {from_guest}"
    );
}

#[test]
fn transfers_both_ways_are_intact_with_foxyvegas_and_without_capture() {
    let stats = transfers("fv", &["--foxyvegas"]);
    let fv = &nic(&stats)["foxyvegas"];
    assert!(fv["flows_total"].as_u64().unwrap() >= 2, "{fv}");
    assert!(fv["rtt_samples"].as_u64().unwrap() > 0, "{fv}");
    assert_eq!(nic(&stats)["pcap"], Value::Null, "the capture was off");
}

// ---------------------------------------------------------------------------------------------
// FoxyVegas under a bottleneck: what the guest sees against what the receiver sent.

/// A receiver namespace behind a 2000 KB/s bottleneck with a 6000 KB queue, linked to the
/// VM's namespace; removed on drop.
struct Bottleneck {
    ns: String,
}

impl Bottleneck {
    fn new(vm: &str) -> Bottleneck {
        // Unique per test process and call (tests run in parallel threads of one process);
        // veth names must fit in 15 bytes.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}{n}", std::process::id() % 1_000_000);
        let ns = format!("vst-rcv-{id}");
        let (a, b) = (format!("vsa{id}"), format!("vsb{id}"));
        let vmns = format!("vmsight-{vm}");
        let bn = Bottleneck { ns: ns.clone() };
        for cmd in [
            format!("ip netns add {ns}"),
            format!("ip link add {a} type veth peer name {b}"),
            format!("ip link set {a} netns {vmns}"),
            format!("ip link set {b} netns {ns}"),
            format!("ip -n {vmns} addr add 10.0.3.1/24 dev {a}"),
            format!("ip -n {vmns} link set {a} up"),
            format!("ip -n {ns} addr add 10.0.3.2/24 dev {b}"),
            format!("ip -n {ns} link set {b} up"),
            format!("ip -n {ns} link set lo up"),
            format!("ip -n {ns} route add 10.0.2.0/24 via 10.0.3.1"),
            format!("ip netns exec {vmns} sysctl -qw net.ipv4.ip_forward=1"),
            format!("tc -n {vmns} qdisc add dev {a} root tbf rate 16mbit burst 32kb limit 6000kb"),
        ] {
            let st = Command::new("sh").arg("-c").arg(&cmd).status().unwrap();
            assert!(st.success(), "{cmd}");
        }
        bn
    }
}

impl Drop for Bottleneck {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// The guest sends for 8 s through the bottleneck with iperf3 while tcpdump records the
/// receiver's segments as the guest gets them and `ss -ti` samples the connections' RTT every
/// 0.2 s; then it prints iperf3's received throughput (bits/s) and, once the queue has
/// drained, the RTT of 11 pings over the idle path (the base RTT, guest included).
const SENDER_SCRIPT: &str = r#"
tcpdump -i eth0 -nn -S -U -c 6000 -w /tmp/acks.pcap 'tcp and src host 10.0.3.2' 2>/dev/null &
td=$!
(while [ ! -e /tmp/sent ]; do ss -tin dst 10.0.3.2 | tr -s ' \t' ' ' | sed -n 's/^ *\(.*bytes_acked.*\)/SS \1/p'; sleep 0.2; done) &
sampler=$!
sleep 1
i=0; until iperf3 -c 10.0.3.2 -t 8 -J > /tmp/iperf.json 2>&1; do i=$((i+1)); [ $i -lt 100 ] || exit 9; sleep 0.3; done
touch /tmp/sent; wait $sampler
sleep 1; ping -c 11 -i 0.2 10.0.3.2 | sed -n 's/.*time=\([0-9.]*\) ms/PING \1/p'
python3 -c "import json; print('THROUGHPUT', json.load(open('/tmp/iperf.json'))['end']['sum_received']['bits_per_second'])"
sleep 1; kill -INT $td; wait $td
tcpdump -nn -S -r /tmp/acks.pcap 2>/dev/null | sed 's/^/G /'
echo ===DONE
"#;

/// The bottleneck's rate (the `tbf` qdisc of [`Bottleneck`]), bits/s.
const BOTTLENECK_BPS: f64 = 16e6;

/// What the guest measured of its own transfer: `ss -ti` samples of the data connection (the
/// one that carried more than 1 MB) and iperf3's received throughput.
#[derive(Debug)]
struct GuestView {
    /// Smoothed RTT of each sample, ms.
    rtt_ms: Vec<f64>,
    /// The smallest `minrtt` the kernel saw on the connection, ms.
    min_rtt_ms: f64,
    /// Median RTT of pings over the idle path after the transfer: the base RTT, ms.
    base_rtt_ms: f64,
    throughput_bps: f64,
}

impl GuestView {
    fn parse(out: &[String]) -> GuestView {
        let field = |l: &str, key: &str| -> Option<f64> {
            let rest = &l[l.find(key)? + key.len()..];
            rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .next()?
                .parse()
                .ok()
        };
        let data: Vec<&str> = out
            .iter()
            .filter_map(|l| l.strip_prefix("SS "))
            .filter(|l| field(l, "bytes_acked:").is_some_and(|b| b > 1e6))
            .collect();
        let rtt_ms: Vec<f64> = data.iter().filter_map(|l| field(l, " rtt:")).collect();
        let min_rtt_ms = data
            .iter()
            .filter_map(|l| field(l, "minrtt:"))
            .fold(f64::INFINITY, f64::min);
        let throughput_bps = line_value(out, "THROUGHPUT ").parse().unwrap();
        let pings: Vec<f64> = out
            .iter()
            .filter_map(|l| l.strip_prefix("PING ")?.parse().ok())
            .collect();
        assert!(pings.len() >= 5, "too few pings answered: {pings:?}");
        GuestView {
            rtt_ms,
            min_rtt_ms,
            base_rtt_ms: median(pings),
            throughput_bps,
        }
    }

    fn rtt_p50_ms(&self) -> f64 {
        median(self.rtt_ms.clone())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One ACK as tcpdump printed it: (client port, ack, TS val) -> window field.
type Acks = BTreeMap<(u16, u64, u64), u64>;

/// Parses tcpdump lines `... 10.0.3.2.5201 > 10.0.2.15.PORT: Flags [.], ack A, win W,
/// options [nop,nop,TS val V ecr E], length 0`.
fn parse_acks<'a>(lines: impl Iterator<Item = &'a str>) -> Acks {
    let mut out = Acks::new();
    for l in lines {
        let field = |key: &str| -> Option<u64> {
            let rest = &l[l.find(key)? + key.len()..];
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        };
        let port = l
            .split(" > 10.0.2.15.")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .and_then(|p| p.parse().ok());
        if let (Some(port), Some(ack), Some(win), Some(ts)) =
            (port, field(", ack "), field(", win "), field("TS val "))
        {
            out.insert((port, ack, ts), win);
        }
    }
    out
}

/// One bottleneck experiment: the guest's and the host end's ACKs, the rewrite log, the
/// stats and the guest's own measurements.
struct BottleneckRun {
    guest: Acks,
    host: Acks,
    records: Vec<Value>,
    stats: Value,
    view: GuestView,
}

/// Runs the bottleneck experiment with FoxyVegas on or off.
fn bottleneck_run(foxyvegas: bool) -> BottleneckRun {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let log = dir.path().join("rewrites.jsonl");
    let hostcap = dir.path().join("host.pcap");
    let name = vm_name(if foxyvegas { "fv" } else { "nofv" });
    let mut args = vec!["--name", &name, "--stats-json", stats.to_str().unwrap()];
    if foxyvegas {
        args.extend_from_slice(&["--foxyvegas", "--foxyvegas-log", log.to_str().unwrap()]);
    }
    args.extend_from_slice(&["--", "sh", "-c", SENDER_SCRIPT]);
    let vm = LiveVm::start(&args);
    wait_for_net(&name);
    let bn = Bottleneck::new(&name);
    let _server = Bg(Command::new("ip")
        .args(["netns", "exec", &bn.ns, "iperf3", "-s", "-B", "10.0.3.2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let hostdump = net_exec(
        &name,
        &[
            "tcpdump",
            "-i",
            "vmtap0",
            "-nn",
            "-S",
            "-U",
            "-w",
            hostcap.to_str().unwrap(),
            "tcp and src host 10.0.3.2",
        ],
    );
    let (code, out, err) = vm.finish();
    drop(hostdump);
    assert_eq!(code, Some(0), "{out:?} {err}");
    let guest = parse_acks(out.iter().filter_map(|l| l.strip_prefix("G ")));
    let host_text = Command::new("tcpdump")
        .args(["-nn", "-S", "-r"])
        .arg(&hostcap)
        .output()
        .unwrap();
    let host = parse_acks(String::from_utf8_lossy(&host_text.stdout).lines());
    let records: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stats: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert!(
        guest.len() > 100 && host.len() > 100,
        "{} {}",
        guest.len(),
        host.len()
    );
    let view = GuestView::parse(&out);
    assert!(view.rtt_ms.len() >= 10, "too few ss samples: {view:?}");
    BottleneckRun {
        guest,
        host,
        records,
        stats,
        view,
    }
}

/// FoxyVegas's rewrites are exactly the windows the guest saw lowered (its capture against
/// the host end's, both ways), and nothing else changed.
fn rewrites_are_exactly_the_windows_the_guest_saw_lowered(run: &BottleneckRun) {
    let (guest, host, records, stats) = (&run.guest, &run.host, &run.records, &run.stats);
    let fv = &nic(stats)["foxyvegas"];
    assert!(
        fv["rewrites"].as_u64().unwrap() > 0,
        "the rewrite engaged: {fv}"
    );
    assert_eq!(fv["rewrites"].as_u64().unwrap(), records.len() as u64);
    let logged: BTreeSet<(u16, u64, u64)> = records
        .iter()
        .map(|r| {
            let port = r["guest"]
                .as_str()
                .unwrap()
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            (
                port,
                r["ack"].as_u64().unwrap(),
                r["new_field"].as_u64().unwrap(),
            )
        })
        .collect();
    for r in records {
        assert!(
            r["new_field"].as_u64() < r["old_field"].as_u64(),
            "never grows: {r}"
        );
        assert_eq!(
            r["window_bytes"].as_u64().unwrap(),
            r["new_field"].as_u64().unwrap() << r["shift"].as_u64().unwrap()
        );
    }
    // Every ACK both captures hold: a window the guest saw lowered is one the stage logged,
    // and every other window is the receiver's own.
    let mut lowered = 0;
    let mut common = 0;
    for (key, gwin) in guest {
        let Some(hwin) = host.get(key) else { continue };
        common += 1;
        if gwin != hwin {
            lowered += 1;
            assert!(gwin < hwin, "a window grew: {key:?} {hwin} -> {gwin}");
            assert!(
                logged.contains(&(key.0, key.1, *gwin)),
                "a changed window the stage did not log: {key:?} {hwin} -> {gwin}"
            );
        }
    }
    assert!(
        lowered > 0,
        "the guest saw lowered windows ({common} ACKs in both captures)"
    );
    // Every logged rewrite whose ACK both captures hold is what the guest saw.
    for (port, ack, new) in &logged {
        let seen: Vec<u64> = guest
            .iter()
            .filter(|((p, a, _), _)| p == port && a == ack)
            .filter(|(k, _)| host.contains_key(k))
            .map(|(_, w)| *w)
            .collect();
        assert!(
            seen.is_empty() || seen.contains(new),
            "rewrite to {new} of ack {ack} not seen by the guest: {seen:?}"
        );
    }
}

/// Without FoxyVegas no window changes on the way to the guest.
fn no_window_changed(run: &BottleneckRun) {
    let (guest, host) = (&run.guest, &run.host);
    assert!(run.records.is_empty());
    assert_eq!(nic(&run.stats)["foxyvegas"], Value::Null);
    let common: Vec<_> = guest.iter().filter(|(k, _)| host.contains_key(k)).collect();
    assert!(common.len() > 100, "{} ACKs in both captures", common.len());
    for (k, w) in common {
        assert_eq!(host[k], *w, "window of {k:?} changed");
    }
}

/// The guest's transfer through a 16 Mbit/s bottleneck with a 6 MB queue, once without and
/// once with FoxyVegas (one after the other, so they do not share the CPU). The oracle is the
/// guest's own view: `ss -ti`'s smoothed RTT of the data connection and iperf3's received
/// throughput. Without FoxyVegas the guest's loss-based congestion control fills the queue:
/// its RTT climbs to hundreds of ms (a full 6 MB queue drains in 3 s). With it the windows
/// the guest gets keep the queue short: the guest's RTT at most a fifth of the RTT without
/// (measured: 12-15x lower), while the link stays as busy (at least 0.9x the throughput
/// without). A stage that lowered windows too far loses throughput (a window of about 8
/// segments gave 0.73x); one that lowered none lets the queue fill.
#[test]
fn under_a_bottleneck_foxyvegas_keeps_the_queue_short_at_the_throughput_without_it() {
    let without = bottleneck_run(false);
    no_window_changed(&without);
    let with = bottleneck_run(true);
    rewrites_are_exactly_the_windows_the_guest_saw_lowered(&with);
    let (w, wo) = (&with.view, &without.view);
    eprintln!(
        "without: RTT p50 {:.1} ms (base {:.2} ms, min {:.2} ms), {:.2} Mbit/s; with: RTT p50 \
         {:.1} ms (base {:.2} ms, min {:.2} ms), {:.2} Mbit/s",
        wo.rtt_p50_ms(),
        wo.base_rtt_ms,
        wo.min_rtt_ms,
        wo.throughput_bps / 1e6,
        w.rtt_p50_ms(),
        w.base_rtt_ms,
        w.min_rtt_ms,
        w.throughput_bps / 1e6
    );
    let dev = |k: &str| {
        median(
            with.records
                .iter()
                .map(|r| r[k].as_f64().unwrap())
                .collect(),
        )
    };
    eprintln!(
        "with, at the device (rewrite log medians): RTT {:.0} us, base {:.0} us, window {} \
         segments of {} bytes",
        dev("rtt_us"),
        dev("base_rtt_us"),
        dev("cwnd_segments"),
        dev("mss")
    );
    // Without: the queue filled (the RTT is dominated by queueing, not the path).
    assert!(
        wo.rtt_p50_ms() >= 100.0 && wo.rtt_p50_ms() >= 20.0 * wo.min_rtt_ms,
        "without FoxyVegas the bottleneck queue did not fill: {wo:?}"
    );
    // With: the queue stays short, at the throughput without. The paper's "within a few
    // times the base RTT" is not reached here (docs/foxyvegas.md, "Limits"): the guest sees
    // 12-20x its idle-path RTT, so the bound is against the queue without FoxyVegas.
    assert!(
        w.rtt_p50_ms() <= 0.2 * wo.rtt_p50_ms(),
        "with FoxyVegas the guest's RTT is not 5x below the RTT without: {w:?} vs {wo:?}"
    );
    assert!(
        w.throughput_bps >= 0.9 * wo.throughput_bps,
        "with FoxyVegas the throughput fell below 0.9x: {:.2} vs {:.2} Mbit/s",
        w.throughput_bps / 1e6,
        wo.throughput_bps / 1e6
    );
    // Both ran at the link's rate, so "0.9x" compares full links.
    assert!(
        wo.throughput_bps >= 0.8 * BOTTLENECK_BPS,
        "the bottleneck, not the guest, must limit the transfer: {wo:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Hostile frames.

/// Sends `n` IPv4 frames whose header claims 1000 bytes in 60 from interface argv[1].
const TRUNCATED_FRAMES: &str = r#"
import socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[1], 0))
f = bytearray(60)
f[0:6] = b"\xff" * 6; f[6:12] = b"\x02\x00\x00\x00\x00\x09"; f[12:14] = b"\x08\x00"
f[14] = 0x45; f[16:18] = (1000).to_bytes(2, "big"); f[23] = 6
for _ in range(int(sys.argv[2])):
    s.send(bytes(f))
print("SENT", sys.argv[2], flush=True)
"#;

#[test]
fn truncated_frames_from_the_guest_and_from_the_tap_are_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let name = vm_name("bad");
    let script = format!(
        "echo ===READY; read x; python3 -c '{TRUNCATED_FRAMES}' eth0 2; ping -c 2 -W 5 10.0.2.1 >/dev/null && echo PING-OK; echo ===DONE"
    );
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--stats-json",
        stats.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    vm.wait_line("===READY");
    let from_tap = run(&[
        "net",
        &name,
        "exec",
        "python3",
        "-c",
        TRUNCATED_FRAMES,
        "vmtap0",
        "3",
    ]);
    assert_eq!(from_tap.code, Some(0), "{from_tap:?}");
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert!(out.iter().any(|l| l == "SENT 2"), "{out:?}");
    assert!(
        out.iter().any(|l| l == "PING-OK"),
        "the guest is still reachable: {out:?}"
    );
    let stats: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    let m = &nic(&stats)["metrics"];
    assert_eq!(m["rx_malformed"].as_u64(), Some(3), "{m}");
    assert_eq!(m["tx_malformed"].as_u64(), Some(2), "{m}");
}
