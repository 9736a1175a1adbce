#!/usr/bin/env python3
"""What vmsight's thread filters cost per system call (issue 35): the same calls timed on a
thread without a filter and under each thread class's filter (docs/security.md), in one
process per repetition, the classes in a rotated order.

  bench/seccomp_cost.py [--reps N] [--calls N] [--out PATH]

It builds and runs `crates/vhostd/examples/seccomp_cost.rs` (as root, the allow-listed classes
also drop their capabilities first, as in a VM). Each call returns at once (an empty eventfd's
`read`, the raw `clock_gettime`, `epoll_wait` of an empty set, `getrandom` of no bytes), so the
difference to `none` is the filter's own time. Results go to bench/results/seccomp_cost.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CLASSES = ["none", "deny", "vring", "net", "io", "channel"]
LABELS = {"none": "no filter", "deny": "deny list (guest services)",
          "vring": "allow list: disk vring worker", "net": "allow list: NIC vring worker",
          "io": "allow list: I/O pool", "channel": "allow list: plugin channel reader"}
CALLS = ["read", "clock_gettime", "epoll_wait", "getrandom"]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import results as bench_results  # noqa: E402


def build():
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "vmsight-vhostd", "--example",
                    "seccomp_cost"], cwd=REPO, check=True)
    return os.path.join(target, "release", "examples", "seccomp_cost")


def run(binary, calls, order):
    out = subprocess.run([binary, str(calls)] + order, check=True, capture_output=True,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2_000_000, help="calls timed per call kind")
    bench_results.add_out_option(ap, "seccomp_cost")
    a = ap.parse_args()
    binary = build()
    rec = bench_results.Recorder("seccomp_cost", a, out=a.out, baseline="none")
    by = {c: {k: [] for k in CALLS} for c in CLASSES}
    for rep in range(a.reps):
        order = CLASSES[rep % len(CLASSES):] + CLASSES[:rep % len(CLASSES)]
        for row in run(binary, a.calls, order):
            c = row.pop("config")
            rec.rep(config=c, rep=rep, **row)
            for k in CALLS:
                if f"{k}_ns" in row:
                    by[c][k].append(row[f"{k}_ns"])
        print(f"[rep {rep}] done ({' '.join(order)})", flush=True)
    base = {k: statistics.median(by["none"][k]) for k in CALLS}
    print(f"\n### Thread filters: ns per system call (medians of {a.reps}; in parentheses, "
          "added to the unfiltered call)\n")
    print("| filter | " + " | ".join(CALLS) + " |")
    print("|---|" + "---|" * len(CALLS))
    for c in CLASSES:
        cells = []
        for k in CALLS:
            xs = by[c][k]
            if not xs:
                cells.append("refused")
                continue
            m = statistics.median(xs)
            cells.append(f"{m:.0f}" if c == "none" else f"{m:.0f} ({m - base[k]:+.0f})")
        print(f"| {LABELS[c]} | " + " | ".join(cells) + " |")
    rec.write()


if __name__ == "__main__":
    main()
