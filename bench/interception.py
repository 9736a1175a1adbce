#!/usr/bin/env python3
"""Interception overhead (issue 3; Sky Table 4 on vmsight).

Each workload runs in the default guest in five configurations, in the same run, several
repetitions, timed inside the guest (wall clock around the workload only):
  no-plugin   vmsight run --no-plugin                    (plain TCG, nothing loaded)
  plugin-idle vmsight run                                (plugin loaded, nothing monitored)
  monitored   vmsight run --trace wl --trace-out /dev/null  (the workload is monitored)
  strace      vmsight run --no-plugin, workload under `strace -f -o /dev/null` in the guest
The workload runs as /tmp/wl (a copy of dash) so it can be monitored by name; its inputs are
prepared before the timer starts. Prints a Markdown table: overhead % vs no-plugin and the
ratio of strace's overhead to vmsight's.

  bench/interception.py [--reps N] [--only cp,find,...] [--out PATH]

Every run (workload, configuration, repetition: guest seconds, and for `monitored` the calls
traced) goes to bench/results/interception.json (--out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import results as bench_results  # noqa: E402

WORKLOADS = {
    # name: (prep, timed script)
    "cp-200MB": ("dd if=/dev/urandom of=/root/src bs=1M count=200 status=none; sync",
                 "cp /root/src /root/dst && sync"),
    "find-50k": ("mkdir -p /root/tree && cd /root/tree && for d in $(seq 1 100); do mkdir d$d; "
                 "(cd d$d && seq 1 500 | xargs touch); done; sync",
                 "find /root/tree -name nothing-matches"),
    "tar-200MB": ("mkdir -p /root/data && for i in $(seq 1 20); do dd if=/dev/urandom of=/root/data/f$i "
                  "bs=1M count=10 status=none; done; sync",
                  "tar cf /root/out.tar /root/data && sync"),
    "gpg-200MB": ("dd if=/dev/urandom of=/root/secret bs=1M count=200 status=none; mkdir -p -m 700 /root/.gnupg; gpgconf --launch gpg-agent; sync",
                  "gpg --batch --yes --pinentry-mode loopback --passphrase pw --symmetric -o /root/secret.gpg /root/secret"),
    "pread-4k": ("head -c 4096 /dev/urandom > /root/small",
                 "preadloop /root/small 200000"),
    "getppid": ("true", "getppid_loop 1000000"),
}

CONFIGS = ["no-plugin", "plugin-idle", "monitored", "strace"]


def guest_script(prep, work, config):
    run = f"/tmp/wl -c '{work}'"
    if config == "strace":
        run = f"strace -f -o /dev/null {run}"
    return (f"set -e; cp /bin/dash /tmp/wl; {prep}\n"
            f"s=$(date +%s%N); {run}; e=$(date +%s%N); echo TIME $((e-s))")


def run_one(name, config):
    prep, work = WORKLOADS[name]
    args = [VMSIGHT, "run", "--vcpus", "2", "--mem", "2G"]
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "stats.json")
        args += ["--stats-json", stats]
        if config in ("no-plugin", "strace"):
            args.append("--no-plugin")
        if config == "monitored":
            args += ["--trace", "wl", "--trace-out", "/dev/null"]
        args += ["--", "sh", "-c", guest_script(prep, work, config)]
        p = subprocess.run(args, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{name}/{config} failed ({p.returncode}): {p.stderr[-2000:]}")
        ns = int([l for l in p.stdout.splitlines() if l.startswith("TIME ")][-1].split()[1])
        st = json.load(open(stats))
        return ns / 1e9, st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="")
    bench_results.add_out_option(ap, "interception")
    a = ap.parse_args()
    rec = bench_results.Recorder("interception", a, out=a.out, keys=["workload", "config"],
                                 baseline="no-plugin")
    names = [n for n in WORKLOADS if not a.only or n in a.only.split(",")]
    res = {n: {c: [] for c in CONFIGS} for n in names}
    extra = {n: {} for n in names}
    for rep in range(a.reps):
        for n in names:
            for c in CONFIGS:
                t, st = run_one(n, c)
                res[n][c].append(t)
                one = rec.rep(workload=n, config=c, rep=rep, guest_s=t)
                if c == "monitored":
                    tr = st.get("trace") or {}
                    extra[n] = {"entries": tr.get("entries"), "peak_pending_tasks": (tr.get("tracker") or {}).get("peak_pending_tasks")}
                    one.update(traced_calls=extra[n]["entries"], peak_pending_tasks=extra[n]["peak_pending_tasks"])
                print(f"[rep {rep}] {n} {c}: {t:.3f}s", file=sys.stderr)
    print(f"\n### Interception overhead ({time.strftime('%Y-%m-%d')}, medians of {a.reps} runs, 2 vCPUs, TCG)\n")
    print("| workload | no plugin (s) | plugin, nothing monitored | monitored by vmsight | strace -f in guest | strace overhead / vmsight overhead | syscalls traced |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        m = {c: statistics.median(res[n][c]) for c in CONFIGS}
        base = m["no-plugin"]
        ov = {c: (m[c] / base - 1) * 100 for c in CONFIGS}
        ratio = (ov["strace"] / ov["monitored"]) if ov["monitored"] > 0.05 else float("inf")
        print(f"| {n} | {base:.2f} | {m['plugin-idle']:.2f} ({ov['plugin-idle']:+.1f}%) | {m['monitored']:.2f} ({ov['monitored']:+.1f}%) "
              f"| {m['strace']:.2f} ({ov['strace']:+.1f}%) | {ratio:.1f}x | {extra[n].get('entries')} |")
    print("\nraw:", json.dumps(res))
    rec.write(summary={"traced": extra})


if __name__ == "__main__":
    main()
