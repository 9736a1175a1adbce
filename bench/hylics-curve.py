#!/usr/bin/env python3
"""Measures E[X|m] for Hylics' share-size controller (paper §5.2): the mean service time of a
task as a function of the share's size m, offline, with a workload light enough that tasks do
not queue. Writes the curve JSON `vmsight run --hylics-slo TAU,curve=FILE` reads.

One VM runs with a share of the largest size. For each size, largest first, the host resizes
the share (`vmsight hylics NAME resize`), then the guest runs the workload command; every line
it prints with `response=SECONDS` is one task. The mean per size is E[X|m] at that size.

  bench/hylics-curve.py --sizes 8,16,32,64,128 --out curve.json
      [--cmd 'GUEST COMMAND'] [--prepare 'GUEST COMMAND'] [--verbose] [--results PATH]

--cmd defaults to the synthetic workload the controller's test and benchmark use
(`hylics-workload` with a declared curve, at 1 task/s for 30 s, reports off); the script then
also prints the measured/declared ratio per size, a check of the method (tasks overlap a little
at 1/s: expect a few percent above 1). For a real workload, give a command that runs tasks one
at a time on files in /hylics and prints `response=SECONDS` per task; --prepare runs once
before the first size (e.g. to copy the data set into the share).

Every task's response time per size, the means and the curve go to
bench/results/hylics-curve.json (--results; --out is the curve file).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(__file__), "..", "target", "release", "vmsight"))
DECLARED = [(8, 0.036), (16, 0.02), (32, 0.012), (64, 0.008), (128, 0.006)]
DEFAULT_CMD = ("hylics-workload --curve " + ",".join(f"{m}:{s}" for m, s in DECLARED)
               + " --rate 1 --duration 30 --no-report --seed 3")
GUEST = r"""
{prepare}
for s in {sizes}; do
  echo "===SIZE $s"
  read go
  {cmd}
  echo "===END $s"
done
"""
RESPONSE = re.compile(r"response=([0-9.eE+-]+)")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import results as bench_results  # noqa: E402


def declared(m):
    for (m0, x0), (m1, x1) in zip(DECLARED, DECLARED[1:]):
        if m <= m1:
            return x0 + (x1 - x0) * (max(m, m0) - m0) / (m1 - m0)
    return DECLARED[-1][1]


def measure(a, sizes):
    name = f"bcurve-{os.getpid()}"
    script = GUEST.format(prepare=a.prepare or ":", sizes=" ".join(map(str, sizes)), cmd=a.cmd)
    proc = subprocess.Popen([VMSIGHT, "run", "--name", name, "--net", "none", "--shared-mem",
                             f"{max(sizes)}M", "--", "sh", "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples, size = {}, None
    for line in proc.stdout:
        line = line.strip()
        if a.verbose:
            print(f"  {line}", file=sys.stderr)
        if line.startswith("===SIZE "):
            size = int(line.split()[1])
            r = subprocess.run([VMSIGHT, "hylics", name, "resize", f"{size}M"], capture_output=True, text=True)
            if r.returncode != 0:
                proc.kill()
                sys.exit(f"resize to {size} MiB failed: {r.stderr.strip()}")
            samples[size] = []
            proc.stdin.write("go\n")
            proc.stdin.flush()
        elif line.startswith("===END"):
            size = None
        elif size is not None and (m := RESPONSE.search(line)):
            samples[size].append(float(m.group(1)))
    err = proc.stderr.read()
    if proc.wait() != 0:
        sys.exit(f"vmsight run failed ({proc.returncode}): {err[-2000:]}")
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,16,32,64,128", help="share sizes in MiB")
    ap.add_argument("--cmd", default=DEFAULT_CMD, help="guest command printing response=SECONDS per task")
    ap.add_argument("--prepare", default="", help="guest command run once before the sizes")
    ap.add_argument("--out", default="curve.json")
    ap.add_argument("--verbose", action="store_true")
    bench_results.add_out_option(ap, "hylics-curve", flag="--results")
    a = ap.parse_args()
    rec = bench_results.Recorder("hylics-curve", a, out=a.results, keys=["share_mib"])
    sizes = sorted({int(s) for s in a.sizes.split(",")}, reverse=True)
    load0 = os.getloadavg()[0]
    samples = measure(a, sizes)
    points = []
    print(f"\nbench/hylics-curve.py --sizes {a.sizes}; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    synthetic = a.cmd == DEFAULT_CMD
    print("| share (MiB) | tasks | E[X|m] measured (s) | declared (s) | measured / declared |" if synthetic
          else "| share (MiB) | tasks | E[X|m] measured (s) |")
    print("|---|---|---|---|---|" if synthetic else "|---|---|---|")
    for m in sorted(samples):
        xs = samples[m]
        if not xs:
            sys.exit(f"no task reported response= at {m} MiB")
        mean = statistics.mean(xs)
        points.append({"m_bytes": m << 20, "service_secs": mean})
        row = f"| {m} | {len(xs)} | {mean:.5f} |"
        one = rec.rep(share_mib=m, rep=0, tasks=len(xs), mean_s=mean, response_s=xs)
        if synthetic:
            row += f" {declared(m):.5f} | {mean / declared(m):.3f} |"
            one.update(declared_s=declared(m), measured_over_declared=mean / declared(m))
        print(row)
    with open(a.out, "w") as f:
        json.dump({"points": points}, f, indent=1)
    print(f"\nwrote {a.out}")
    rec.write(summary={"curve": {"points": points}, "curve_file": a.out})


if __name__ == "__main__":
    main()
