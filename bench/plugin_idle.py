#!/usr/bin/env python3
"""The plugin loaded with nothing monitored, against plain QEMU: host CPU time (issue 17).

Three configurations: no-plugin (`--no-plugin`), dormant (the plugin as `vmsight run` loads
it when nothing is asked of it: no translation callback) and counting (`--count-syscalls`:
a translation callback and an inline counter on each `syscall`, nothing monitored).

Wall time on this shared 2-core machine is too noisy to show a 1 % difference, so each
workload is measured as the host CPU time (utime + stime) of `vmsight run`'s whole process
tree (vmsight, QEMU and its threads) between two marker lines the guest prints around the
workload, read from /proc when each marker arrives. The guest's own wall time is printed
beside it. Configurations rotate run by run (each repetition boots all three, in a rotated
order), each boot runs all workloads once, inputs are made before the first marker. Besides
the medians the script prints the median of the per-repetition ratios to the no-plugin boot of
the same repetition (pairing cancels slow drifts of the machine's load).

Workloads:
  getppid     getppid_loop 3000000: syscall-bound, every `syscall` passes the plugin's inline
              counter (the only instrumentation left when nothing is monitored)
  find        find /usr -xdev four times: kernel-heavy (path walks, getdents, page cache)
  sha256      sha256sum of a 48 MiB file in the page cache, three times: user-heavy

  bench/plugin_idle.py [--reps N] [--out PATH]     (default 10 repetitions)

Every boot's numbers (host CPU and guest seconds per workload) go to
bench/results/plugin_idle.json (--out).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from vmproc import marked_run  # noqa: E402
import results as bench_results  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))

WORKLOADS = {
    "getppid": "getppid_loop 3000000",
    "find": "for i in 1 2 3 4; do find /usr -xdev > /dev/null; done",
    "sha256": "sha256sum /root/blob /root/blob /root/blob > /dev/null",
}
PREP = "head -c 50331648 /dev/urandom > /root/blob; cat /root/blob > /dev/null; sync"
CONFIGS = ["no-plugin", "dormant", "counting"]
FLAGS = {"no-plugin": ["--no-plugin"], "dormant": [], "counting": ["--count-syscalls"]}


def guest_script():
    parts = [f"set -e; {PREP}"]
    for name, work in WORKLOADS.items():
        parts.append(f"echo BEGIN {name}; s=$(date +%s%N); {work}; e=$(date +%s%N); "
                     f"echo END {name} $((e-s))")
    return "\n".join(parts)


def run_once(config):
    """One boot: per workload (host CPU seconds of the vmsight tree, guest wall seconds)."""
    args = [VMSIGHT, "run", "--vcpus", "2", "--mem", "1G"]
    args += FLAGS[config] + ["--", "sh", "-c", guest_script()]
    return marked_run(args, len(WORKLOADS), config)


def pct(x):
    return f"{(x - 1) * 100:+.1f}%"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    bench_results.add_out_option(ap, "plugin_idle")
    a = ap.parse_args()
    rec = bench_results.Recorder("plugin_idle", a, out=a.out, keys=["workload", "config"],
                                 baseline="no-plugin")
    res = {c: {n: [] for n in WORKLOADS} for c in CONFIGS}
    for rep in range(a.reps):
        k = rep % len(CONFIGS)
        for c in CONFIGS[k:] + CONFIGS[:k]:
            for n, v in run_once(c).items():
                res[c][n].append(v)
                rec.rep(workload=n, config=c, rep=rep, host_cpu_s=v[0], guest_s=v[1])
            print(f"[rep {rep}] {c}: " + ", ".join(
                f"{n} cpu {res[c][n][-1][0]:.2f}s wall {res[c][n][-1][1]:.2f}s" for n in WORKLOADS),
                file=sys.stderr)
    load = os.getloadavg()
    print(f"\n### Plugin loaded, nothing monitored ({time.strftime('%Y-%m-%d')}, "
          f"medians of {a.reps} interleaved runs, 2 vCPUs, TCG, load after {load[0]:.2f})\n")
    print("| workload | metric | no plugin (s) | dormant (s) | dormant overhead (paired) "
          "| counting (s) | counting overhead (paired) |")
    print("|---|---|---|---|---|---|---|")
    for n in WORKLOADS:
        for m, name in ((0, "host CPU"), (1, "guest wall")):
            med = {c: statistics.median(x[m] for x in res[c][n]) for c in CONFIGS}
            paired = {c: statistics.median(x[m] / b[m] for x, b in
                                           zip(res[c][n], res["no-plugin"][n]))
                      for c in CONFIGS}
            print(f"| {n} | {name} | {med['no-plugin']:.2f} "
                  f"| {med['dormant']:.2f} | {pct(med['dormant'] / med['no-plugin'])} "
                  f"({pct(paired['dormant'])}) "
                  f"| {med['counting']:.2f} | {pct(med['counting'] / med['no-plugin'])} "
                  f"({pct(paired['counting'])}) |")
    print("\nraw (cpu s, wall s):", res)
    # The medians of the per-repetition ratios to no-plugin, as printed in brackets.
    paired = {n: {c: {metric: statistics.median(x[m] / b[m] for x, b in zip(res[c][n], res["no-plugin"][n]))
                      for m, metric in ((0, "host_cpu_s"), (1, "guest_s"))} for c in CONFIGS}
              for n in WORKLOADS}
    rec.write(summary={"paired_ratio": paired})


if __name__ == "__main__":
    main()
