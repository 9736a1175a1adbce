#!/usr/bin/env python3
"""vmsight's network device against QEMU's own user-space virtio-net (issue 12).

Both NICs sit on the same host side: the VM's isolated namespace and its tap (vmsight opens
the tap; with `--net isolated,device=qemu` QEMU gets it as `-netdev tap,fd=N,vhost=off`; the host
has no /dev/vhost-net). Same guest, same offloads (on by default, `--offload off` to compare
plain frames). Per configuration and repetition (interleaved), in one fresh guest:
  tx   iperf3 guest -> host end (10.0.2.1), --secs seconds
  rx   iperf3 host end -> guest (-R)
  rr   100 ICMP echoes at 20 ms (request/response latency through the device), median
Host CPU: utime+stime of QEMU and vmsight (all threads, /proc/PID/stat) over each iperf3 run,
per GB moved. Prints a Markdown table of medians and the vmsight/QEMU ratios.

  bench/net.py [--reps 3] [--secs 10] [--offload on|off] [--verbose] [--out PATH]

Every run (throughput both ways, host CPU per direction, every ping RTT) goes to
bench/results/net.json (--out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from vmproc import TICK, cpu_ticks  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(__file__), "..", "target", "release", "vmsight"))

GUEST = r"""
i=0; until iperf3 -c 10.0.2.1 -t 1 >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 200 ] || exit 9; sleep 0.3; done
echo PHASE tx; iperf3 -c 10.0.2.1 -t {secs} -f m > /tmp/tx.txt; echo PHASE end
echo PHASE rx; iperf3 -c 10.0.2.1 -t {secs} -f m -R > /tmp/rx.txt; echo PHASE end
for k in tx rx; do awk -v k=$k '/receiver/ {{print "BPS", k, $7 * 1000000}}' /tmp/$k.txt; done
ping -c 100 -i 0.02 10.0.2.1 | sed -n 's/.*time=\([0-9.]*\) ms/RTT \1/p'
"""


def qemu_pid(vmsight_pid):
    out = subprocess.run(["pgrep", "-P", str(vmsight_pid)], capture_output=True, text=True).stdout.split()
    for p in out:
        try:
            if "qemu" in open(f"/proc/{p}/comm").read():
                return int(p)
        except OSError:
            pass
    return None


def run_one(config, a, rep):
    name = f"bnet-{config}-{os.getpid()}-{rep}"
    net = "isolated" + (",device=qemu" if config == "qemu" else "") + f",offload={a.offload}"
    proc = subprocess.Popen([VMSIGHT, "run", "--name", name, "--net", net, "--", "sh", "-c",
                             GUEST.format(secs=a.secs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = None
    for _ in range(600):
        if subprocess.run([VMSIGHT, "net", name, "info"], capture_output=True).returncode == 0:
            server = subprocess.Popen([VMSIGHT, "net", name, "exec", "iperf3", "-s", "-B", "10.0.2.1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            break
        time.sleep(0.1)
    res = {"cpu": {}, "bps": {}, "rtt": []}
    phase, start = None, 0
    for line in proc.stdout:
        line = line.strip()
        if a.verbose:
            print(f"  [{config}] {line}", file=sys.stderr)
        if line.startswith("PHASE "):
            pids = [proc.pid] + [p for p in [qemu_pid(proc.pid)] if p]
            if line == "PHASE end":
                res["cpu"][phase] = (cpu_ticks(pids) - start) / TICK
            else:
                phase, start = line.split()[1], cpu_ticks(pids)
        elif line.startswith("BPS "):
            _, k, v = line.split()
            res["bps"][k] = float(v)
        elif line.startswith("RTT "):
            res["rtt"].append(float(line.split()[1]))
    err = proc.stderr.read()
    proc.wait()
    if server:
        server.terminate()
        server.wait()
    if proc.returncode != 0 or len(res["bps"]) != 2:
        sys.exit(f"{config} run failed ({proc.returncode}): {err[-2000:]}")
    return res


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--secs", type=int, default=10)
    ap.add_argument("--offload", choices=["on", "off"], default="on")
    ap.add_argument("--verbose", action="store_true")
    bench_results.add_out_option(ap, "net")
    a = ap.parse_args()
    rec = bench_results.Recorder("net", a, out=a.out, baseline="qemu")
    configs = ["vmsight", "qemu"]
    runs = {c: [] for c in configs}
    for rep in range(a.reps):
        for c in (configs if rep % 2 == 0 else configs[::-1]):
            r = run_one(c, a, rep)
            runs[c].append(r)
            gb = {k: r["bps"][k] * a.secs / 8e9 for k in ("tx", "rx")}
            rec.rep(config=c, rep=rep, tx_mbit_s=r["bps"]["tx"] / 1e6, rx_mbit_s=r["bps"]["rx"] / 1e6,
                    rtt_p50_ms=med(r["rtt"]), host_cpu_tx_s=r["cpu"].get("tx"), host_cpu_rx_s=r["cpu"].get("rx"),
                    cpu_s_per_gb_tx=r["cpu"].get("tx", float("nan")) / gb["tx"] if gb["tx"] else None,
                    cpu_s_per_gb_rx=r["cpu"].get("rx", float("nan")) / gb["rx"] if gb["rx"] else None,
                    rtt_ms=r["rtt"])
            print(f"rep {rep} {c}: tx {r['bps']['tx']/1e6:.0f} rx {r['bps']['rx']/1e6:.0f} Mbit/s, "
                  f"rtt p50 {med(r['rtt']):.3f} ms", file=sys.stderr)

    def stat(c, f):
        return med([f(r) for r in runs[c]])

    rows = []
    for c in configs:
        tx = stat(c, lambda r: r["bps"]["tx"])
        rx = stat(c, lambda r: r["bps"]["rx"])
        gb_tx = lambda r: r["bps"]["tx"] * a.secs / 8e9  # noqa: E731
        gb_rx = lambda r: r["bps"]["rx"] * a.secs / 8e9  # noqa: E731
        cpu_tx = stat(c, lambda r: r["cpu"].get("tx", float("nan")) / gb_tx(r))
        cpu_rx = stat(c, lambda r: r["cpu"].get("rx", float("nan")) / gb_rx(r))
        rtt = stat(c, lambda r: med(r["rtt"]))
        rows.append((c, tx, rx, rtt, cpu_tx, cpu_rx))
    load = os.getloadavg()[0]
    print(f"\nbench/net.py --reps {a.reps} --secs {a.secs} --offload {a.offload}; load {load:.2f}\n")
    print("| NIC | guest->host Mbit/s | host->guest Mbit/s | ping RTT p50 ms | CPU s/GB tx | CPU s/GB rx |")
    print("|---|---|---|---|---|---|")
    for c, tx, rx, rtt, ct, cr in rows:
        print(f"| {c} | {tx/1e6:.0f} | {rx/1e6:.0f} | {rtt:.3f} | {ct:.2f} | {cr:.2f} |")
    v, q = rows[0], rows[1]
    print(f"| vmsight / QEMU | {v[1]/q[1]:.2f}x | {v[2]/q[2]:.2f}x | {v[3]/q[3]:.2f}x | {v[4]/q[4]:.2f}x | {v[5]/q[5]:.2f}x |")
    print("\n" + json.dumps({c: runs[c] for c in configs}))
    rec.write(summary={"medians": {c: dict(zip(("tx_bit_s", "rx_bit_s", "rtt_p50_ms", "cpu_s_per_gb_tx",
                                                 "cpu_s_per_gb_rx"), row[1:])) for c, row in zip(configs, rows)}})


if __name__ == "__main__":
    main()
