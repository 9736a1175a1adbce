#!/usr/bin/env python3
"""FoxyVegas under a bottleneck (issue 12; FoxyTechnique §4, Table 2 shape).

Topology (every namespace made by vmsight or by this script, removed at the end):

  sender guest ── vmsight NIC (FoxyVegas on/off) ── ns vmsight-fvs ──veth, tbf── ns vmsight-fvr ── receiver guest
  10.0.2.15                                         10.0.2.1   10.0.9.1     10.0.9.2  10.0.5.1       10.0.5.15

The bottleneck is a tbf on the sender namespace's veth toward the receiver: --rate KB/s (2000)
with a --queue KB queue (6000). The host has no netem, so the delay is added outside the device
under test, in the receiver *guest* (`tc qdisc ... netem delay --delay-ms` on its egress, i.e. on
the ACK path); the receiver guest runs `iperf3 -s` for the whole benchmark.

For each congestion control (the sender guest's `net.ipv4.tcp_congestion_control`) and with
FoxyVegas off and on (interleaved), a fresh sender guest runs `iperf3 -c 10.0.5.15 -t --secs`
and samples `ss -ti` every 0.2 s (the guest kernel's own smoothed RTT of the data connection,
the one with the most bytes acked: queueing delay included). Reported per row (median of --reps): throughput at the receiver (KB/s),
retransmissions, the guest's RTT p50/p99 over the samples, the connection's minimum RTT as
the guest measured it (`ss` minrtt: the base the p99 is compared with, guest-side delays
included like the p99's) and p99/min, also over the samples after the first 2 s (the guest's
smoothed RTT starts from the handshake's sample and decays with a 1/8 gain, so its first
samples are not queueing delay), and with FoxyVegas the ACKs rewritten. The paper sent 400 MB
per run (--mb 400); --secs scales that down (20 s = 40 MB at 2000 KB/s).

Each sample is `ss -tmi` of the connection, so every run also reports its largest number of
bytes in flight beside what can cap it: the receiver's advertised window and the sender's
send buffer. With the guests' default socket-buffer maxima the bytes in flight stop near 3 MB,
below the 6000 KB queue, and no packet is ever lost; --tcp-mem MIB raises both guests' maxima
so that loss-based controls overflow the queue, as in the paper. The per-sample window trace
(the binding window min(cwnd x MSS, the peer's window), cwnd x MSS, bytes in flight, the
peer's window) is kept for Fig 3. With FoxyVegas on, its
rewrite log gives FoxyVegas's own view (Fig 3/4): the RTT it measures at the device and its
Vegas window over time, beside the guest's.

  bench/foxyvegas.py [--ccs cubic,reno,bic,bbr,vegas,westwood|all] [--secs 20 | --mb 400]
                     [--tcp-mem MIB] [--sender-sysctl KEY=VALUE,...] [--reps 1] [--rate 2000]
                     [--queue 6000] [--delay-ms 10] [--foxyvegas-params ALPHA,BETA,GAMMA]
                     [--verbose] [--out PATH]

Every run (throughput, retransmissions, RTT percentiles and every RTT sample, ACKs rewritten)
goes to bench/results/foxyvegas.json (--out).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from vmproc import wait_net  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(__file__), "..", "target", "release", "vmsight"))
# `ss` sampling period in the sender guest, and the start left out of the steady-state p99.
SAMPLE_S = 0.2
WARMUP_S = 2.0
ALL_CCS = "bic,cubic,reno,htcp,highspeed,hybla,westwood,scalable,vegas,illinois,yeah,veno,bbr"

# Socket-buffer maxima, raised in both guests when --tcp-mem is given (MiB): Linux's defaults
# (tcp_wmem 4 MiB, tcp_rmem 6 MiB, about half of the receive buffer advertised as window) cap
# the bytes in flight near 3 MB, below the 6000 KB queue, so without this the queue never
# overflows and loss-based controls never lose a packet.
TCP_MEM = r"""
m=$(({mib} * 1048576))
sysctl -qw net.core.rmem_max=$m net.core.wmem_max=$m
sysctl -qw net.ipv4.tcp_rmem="4096 131072 $m" net.ipv4.tcp_wmem="4096 16384 $m"
"""

RECEIVER = r"""
{tcp_mem}
modprobe sch_netem
tc qdisc add dev eth0 root netem delay {delay}ms limit 100000
echo RECEIVER-UP
iperf3 -s
"""

# Every sample is `ss -tmin --oneline` of the data connection (the one with the most bytes
# acked; iperf3's control connection goes to the same address), prefixed with the guest's
# uptime: RTT, minimum RTT, cwnd, MSS, unacked segments, the peer's window (snd_wnd) and the
# socket memory (skmem: w = bytes queued in the socket, tb = send buffer size).
SENDER = r"""
{tcp_mem}
modprobe tcp_{cc} 2>/dev/null; sysctl -qw net.ipv4.tcp_congestion_control={cc}
i=0; until ping -c 1 -W 1 10.0.5.15 >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 120 ] || exit 9; done
iperf3 -c 10.0.5.15 {amount} -C {cc} -f k > /tmp/ip.txt 2>&1 &
ip=$!
while kill -0 $ip 2>/dev/null; do
  t=$(cut -d' ' -f1 /proc/uptime)
  ss -tminHO dst 10.0.5.15 | awk -v t=$t '{{b=0; for (i=1;i<=NF;i++) if ($i ~ /^bytes_acked:/) b=substr($i,13)+0; if (b>m) {{ m=b; best=$0 }} }} END {{ if (best!="") print "SS", t, best }}'
  sleep {sample}
done
awk '/sender/ {{print "RETR", $9}} /receiver/ {{print "KBPS", $7}}' /tmp/ip.txt
"""


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def link(a):
    """veth between the sender's and the receiver's namespaces, routes, the bottleneck."""
    s, r = "vmsight-fvs", "vmsight-fvr"
    for c in [
        "ip link add fvs0 type veth peer name fvr0",
        f"ip link set fvs0 netns {s}", f"ip link set fvr0 netns {r}",
        f"ip -n {s} addr add 10.0.9.1/30 dev fvs0", f"ip -n {s} link set fvs0 up",
        f"ip -n {r} addr add 10.0.9.2/30 dev fvr0", f"ip -n {r} link set fvr0 up",
        f"ip -n {s} route add 10.0.5.0/24 via 10.0.9.2",
        f"ip -n {r} route add 10.0.2.0/24 via 10.0.9.1",
        f"ip netns exec {s} sysctl -qw net.ipv4.ip_forward=1",
        f"ip netns exec {r} sysctl -qw net.ipv4.ip_forward=1",
        f"tc -n {s} qdisc add dev fvs0 root tbf rate {a.rate * 8}kbit burst 32kb limit {a.queue}kb",
    ]:
        sh(c)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def parse_ss(line):
    """One `SS UPTIME <ss -tminHO line>` sample: {t, rtt, minrtt (ms), cwnd, mss, unacked,
    snd_wnd, wq (skmem w: bytes queued in the socket), tb (send buffer), retrans}; absent
    fields are None."""
    w = line.split()
    d = {"t": float(w[1]), "rtt": None, "minrtt": None, "cwnd": None, "mss": None,
         "unacked": 0, "snd_wnd": None, "wq": None, "tb": None, "retrans": 0}
    for f in w[2:]:
        k, _, v = f.partition(":")
        if k == "rtt":
            d["rtt"] = float(v.split("/")[0])
        elif k == "minrtt":
            d["minrtt"] = float(v)
        elif k in ("cwnd", "mss", "unacked", "snd_wnd"):
            d[k] = int(v)
        elif k == "retrans":
            d["retrans"] = int(v.split("/")[-1])
        elif f.startswith("skmem:("):
            # r rb t tb f w o bl d: w = bytes queued in the socket, tb = send buffer size.
            m = dict((k2, int(v2)) for k2, v2 in re.findall(r"([a-z]+)(\d+)", f[7:-1]))
            d["wq"], d["tb"] = m.get("w"), m.get("tb")
    return d


def sender_run(a, cc, foxy, tmp):
    stats = os.path.join(tmp, f"s-{cc}-{foxy}.json")
    args = [VMSIGHT, "run", "--name", "fvs", "--stats-json", stats]
    rwlog = os.path.join(tmp, f"rw-{cc}.jsonl")
    if foxy:
        args += [f"--foxyvegas={a.foxyvegas_params}" if a.foxyvegas_params else "--foxyvegas",
                 "--foxyvegas-log", rwlog]
    amount = f"-n {a.mb}M" if a.mb else f"-t {a.secs}"
    args += ["--", "sh", "-c", SENDER.format(cc=cc, amount=amount, sample=SAMPLE_S,
                                             tcp_mem=tcp_mem(a) + sender_sysctls(a))]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_net(VMSIGHT, "fvs")
    link(a)
    out, err = p.communicate()
    if p.returncode != 0:
        sys.exit(f"sender {cc} foxy={foxy} failed: {err[-1500:]}")
    ss = [parse_ss(line) for line in out.splitlines() if line.startswith("SS ")]
    ss = [x for x in ss if x["rtt"] is not None]
    rtts = [x["rtt"] for x in ss]
    # The guest's own minimum RTT of the connection (ss minrtt): the base the p99 is compared
    # with, measured the same way as the p99 (guest-side delays included).
    minrtts = [x["minrtt"] for x in ss if x["minrtt"] is not None]
    kbps = [float(line.split()[1]) for line in out.splitlines() if line.startswith("KBPS ")]
    retr = [int(line.split()[1]) for line in out.splitlines() if line.startswith("RETR ") and line.split()[1].isdigit()]
    st = json.load(open(stats))
    fv = st["nics"][0].get("foxyvegas") or {}
    # Bytes in flight (unacked segments x MSS) against what could cap them: the peer's
    # window and the send buffer. The window trace (Fig 3): window_sample per sample.
    inflight = [x["unacked"] * (x["mss"] or 0) for x in ss]
    t0 = ss[0]["t"] if ss else 0.0
    dev_rtts, dev_window = device_view(rwlog) if foxy else ([], [])
    return {"kBps": (kbps[0] / 8) if kbps else float("nan"), "retr": retr[0] if retr else -1,
            "rtt50": pct(rtts, 50), "rtt99": pct(rtts, 99), "samples": len(rtts),
            # The guest's smoothed RTT starts from the handshake's sample and decays with a
            # 1/8 gain; the p99 after the first WARMUP_S seconds leaves that start out.
            "rtt99w": pct(rtts[int(WARMUP_S / SAMPLE_S):], 99), "first": rtts[:3],
            "minrtt": min(minrtts) if minrtts else float("nan"),
            "inflight_max": max(inflight, default=0),
            "snd_wnd_max": max((x["snd_wnd"] or 0 for x in ss), default=0),
            "tb_max": max((x["tb"] or 0 for x in ss), default=0),
            "rewrites": fv.get("rewrites", 0), "base_rtt_us": fv.get("lowest_base_rtt_us", 0),
            "rtts": rtts, "dev_rtts": dev_rtts, "dev_window": dev_window,
            "dev_rtt50": pct(dev_rtts, 50), "dev_rtt99": pct(dev_rtts, 99),
            "window": [window_sample(x, t0) for x in ss]}


def window_sample(x, t0):
    """[seconds, window, cwnd x MSS, bytes in flight, peer window]: the window that binds the
    sender is the smaller of its congestion window and the peer's window (which FoxyVegas
    lowers), as the paper's Fig 3 plots it."""
    cwnd = (x["cwnd"] or 0) * (x["mss"] or 0)
    peer = x["snd_wnd"]
    return [round(x["t"] - t0, 2), min(cwnd, peer) if peer else cwnd, cwnd,
            x["unacked"] * (x["mss"] or 0), peer]


def device_view(path, keep=2000):
    """FoxyVegas's own view of the data flow, from its rewrite log (one line per rewritten
    ACK; the file is removed): the RTT it measured at the device (ms) and its Vegas window
    (bytes) over time (s from the first line), each thinned evenly to about `keep` samples.
    The flow is the one with the most lines (iperf3's control connection has few)."""
    rows = {}
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                rows.setdefault((r["guest"], r["peer"]), []).append(r)
        os.unlink(path)
    except (OSError, ValueError, KeyError):
        return [], []
    flow = max(rows.values(), key=len, default=[])
    step = max(1, len(flow) // keep)
    flow = flow[::step]
    t0 = flow[0]["t_ns"] if flow else 0
    rtts = [r["rtt_us"] / 1000 for r in flow if r.get("rtt_us")]
    window = [[round((r["t_ns"] - t0) / 1e9, 3), r["cwnd_segments"] * r["mss"]] for r in flow]
    return rtts, window


def tcp_mem(a):
    return TCP_MEM.format(mib=a.tcp_mem) if a.tcp_mem else ""


def sender_sysctls(a):
    """`sysctl -w` lines for --sender-sysctl KEY=VALUE,... (the sender guest only)."""
    return "".join(f"sysctl -qw {kv}\n" for kv in a.sender_sysctl.split(",") if kv)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ccs", default="cubic,reno,bic,bbr,vegas,westwood")
    ap.add_argument("--secs", type=int, default=20)
    ap.add_argument("--mb", type=int, default=0,
                    help="send this many MB per run instead of --secs (the paper: 400)")
    ap.add_argument("--tcp-mem", type=int, default=0, metavar="MIB",
                    help="raise both guests' TCP socket-buffer maxima to MIB (0: the guests' "
                         "defaults, which cap the bytes in flight near 3 MB)")
    ap.add_argument("--sender-sysctl", default="", metavar="KEY=VALUE,...",
                    help="sysctls for the sender guest, e.g. net.ipv4.tcp_sack=0,"
                         "net.ipv4.tcp_recovery=0 to take SACK and RACK out of loss recovery")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--rate", type=int, default=2000, help="bottleneck KB/s")
    ap.add_argument("--queue", type=int, default=6000, help="bottleneck queue KB")
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--foxyvegas-params", default="", metavar="ALPHA,BETA,GAMMA",
                    help="FoxyVegas's thresholds in segments (vmsight's default 2,4,1)")
    ap.add_argument("--verbose", action="store_true")
    bench_results.add_out_option(ap, "foxyvegas")
    a = ap.parse_args()
    rec = bench_results.Recorder("foxyvegas", a, out=a.out, keys=["cc", "config"], baseline="off")
    ccs = (ALL_CCS if a.ccs == "all" else a.ccs).split(",")
    tmp = tempfile.mkdtemp(prefix="bench-fv-")
    rcv = subprocess.Popen([VMSIGHT, "run", "--name", "fvr",
                            "--net", "isolated,ip=10.0.5.15/24,gw=10.0.5.1,host=10.0.5.1/24",
                            "--", "sh", "-c", RECEIVER.format(delay=a.delay_ms, tcp_mem=tcp_mem(a))],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in rcv.stdout:
        if line.strip() == "RECEIVER-UP":
            break
    # Keep draining the receiver's output (iperf3 -s reports every run): a full pipe would
    # block the VM's stdout and its shutdown.
    threading.Thread(target=lambda: [None for _ in rcv.stdout], daemon=True).start()
    rows = {}
    try:
        for rep in range(a.reps):
            for cc in ccs:
                for foxy in ([False, True] if rep % 2 == 0 else [True, False]):
                    r = sender_run(a, cc, foxy, tmp)
                    rows.setdefault((cc, foxy), []).append(r)
                    rec.rep(cc=cc, config="on" if foxy else "off", rep=rep, kBps=r["kBps"], retr=r["retr"],
                            rtt_p50_ms=r["rtt50"], rtt_p99_ms=r["rtt99"], rtt_p99_after_warmup_ms=r["rtt99w"],
                            min_rtt_ms=r["minrtt"], samples=r["samples"], rewrites=r["rewrites"],
                            base_rtt_us=r["base_rtt_us"], rtt_samples_ms=r["rtts"],
                            inflight_max_bytes=r["inflight_max"], snd_wnd_max_bytes=r["snd_wnd_max"],
                            send_buffer_max_bytes=r["tb_max"],
                            device_rtt_p50_ms=r["dev_rtt50"], device_rtt_p99_ms=r["dev_rtt99"],
                            window_trace=r["window"], device_window_trace=r["dev_window"],
                            device_rtt_samples_ms=r["dev_rtts"])
                    print(f"{cc:10} foxy={int(foxy)}: {r['kBps']:.0f} KB/s retr {r['retr']} "
                          f"rtt p50 {r['rtt50']:.1f} p99 {r['rtt99']:.1f} (after {WARMUP_S:.0f} s {r['rtt99w']:.1f}) "
                          f"min {r['minrtt']:.1f} ms ({r['samples']} samples, first {r['first']}) "
                          f"rewrites {r['rewrites']}; in flight max {r['inflight_max'] / 1000:.0f} KB, "
                          f"peer window max {r['snd_wnd_max'] / 1000:.0f} KB, send buffer max "
                          f"{r['tb_max'] / 1000:.0f} KB", file=sys.stderr)
    finally:
        rcv.terminate()
        rcv.wait()
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print(f"\nbench/foxyvegas.py --ccs {a.ccs} --secs {a.secs} --mb {a.mb} --tcp-mem {a.tcp_mem} "
          f"--sender-sysctl '{a.sender_sysctl}' "
          f"--reps {a.reps} --rate {a.rate} --queue {a.queue} --delay-ms {a.delay_ms} "
          f"--foxyvegas-params '{a.foxyvegas_params}'; "
          f"load {os.getloadavg()[0]:.2f}\n")
    print("| cc | KB/s off | KB/s on | on/off | retr off | retr on | RTT p50 off | RTT p50 on | RTT p99 off | RTT p99 on | p99 on after warm-up | min RTT on | p99/min on (after warm-up) | rewrites | in flight max KB off | on | device RTT p50 on | p99 on |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cc in ccs:
        off, on = rows[(cc, False)], rows[(cc, True)]
        print(f"| {cc} | {med(off,'kBps'):.0f} | {med(on,'kBps'):.0f} | {med(on,'kBps')/med(off,'kBps'):.2f}x | "
              f"{med(off,'retr'):.0f} | {med(on,'retr'):.0f} | {med(off,'rtt50'):.1f} | {med(on,'rtt50'):.1f} | "
              f"{med(off,'rtt99'):.1f} | {med(on,'rtt99'):.1f} | {med(on,'rtt99w'):.1f} | {med(on,'minrtt'):.1f} | "
              f"{statistics.median(r['rtt99'] / r['minrtt'] for r in on):.2f}x "
              f"({statistics.median(r['rtt99w'] / r['minrtt'] for r in on):.2f}x) | {med(on,'rewrites'):.0f} | "
              f"{med(off,'inflight_max') / 1000:.0f} | {med(on,'inflight_max') / 1000:.0f} | "
              f"{med(on,'dev_rtt50'):.1f} | {med(on,'dev_rtt99'):.1f} |")
    base = [r["base_rtt_us"] for rs in rows.values() for r in rs if r["base_rtt_us"]]
    if base:
        print(f"\nbase RTT at the device (FoxyVegas, min over flows): median {statistics.median(base)/1000:.1f} ms; "
              "RTT columns are the sender guest's smoothed RTT (ss -ti), ms")
    rec.write(summary={"device_base_rtt_ms_median": statistics.median(base) / 1000 if base else None})


if __name__ == "__main__":
    main()
