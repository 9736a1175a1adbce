#!/usr/bin/env python3
"""iDedup vs the unhinted dedup volume (the dm-dedup baseline) vs a plain disk (Sky Fig. 8, 9,
Table 7).

For every disk model (hdd, ssd) and metadata cache (1 % and 10 % of the workload's peak
metadata) and every workload, three systems run in the same round, interleaved:
  unhinted  --disk VOL,dedup (no --insights: no interception, no hints)
  hinted    --disk VOL,dedup --insights ... --insight-target @cmd (copy and unique hints)
  plain     --disk RAW (the same ext4 image, no dedup) with the same disk model
Workloads (each on a fresh volume holding a fresh ext4 file system):
  cp   warm-up: copy a file of random data onto the file system (timed apart), drop the guest's
       caches, then time `cp` of that file to a new file (Sky 8.2.1; Sky uses 500 MB)
  gpg  time `gpg -c` of a file of random data (Sky 8.2.2)
The time is measured in the guest around the command (sync included); host CPU time is the
getrusage of vmsight and QEMU over the whole run. The peak metadata of a workload is measured
once with a cache as large as the metadata (cold misses = pages touched) on the unhinted
system; the caches are 1 % and 10 % of it (at least 8 pages).

Usage: bench/dedup.py [--mib 16] [--reps 1] [--models hdd,ssd] [--caches 1,10]
                      [--workloads cp,gpg] [--json out.json]
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMSIGHT = os.path.join(ROOT, "target", "release", "vmsight")
VOL_MIB = 256


def sh(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)


def fresh_fs(tmp):
    raw = os.path.join(tmp, "fs.img")
    if os.path.exists(raw):
        os.remove(raw)
    with open(raw, "wb") as f:
        f.truncate(VOL_MIB << 20)
    sh(["mkfs.ext4", "-q", "-F", raw])
    return raw


def fresh_volume(tmp):
    raw = fresh_fs(tmp)
    vol = os.path.join(tmp, "vol")
    shutil.rmtree(vol, ignore_errors=True)
    sh([VMSIGHT, "dedup", "create", vol, "--size", f"{VOL_MIB}MiB", "--from", raw])
    return vol


def script(workload, mib):
    t = "s=$(date +%s.%N); {cmd}; sync; e=$(date +%s.%N); echo TIME {name} $s $e"
    setup = f"mount /dev/vdb /mnt; head -c {mib}M /dev/urandom > /tmp/r; sync"
    if workload == "cp":
        return "; ".join([
            setup,
            t.format(cmd="cp /tmp/r /mnt/a", name="warmup"),
            "echo 3 > /proc/sys/vm/drop_caches",
            t.format(cmd="cp /mnt/a /mnt/b", name="main"),
            "umount /mnt",
        ])
    return "; ".join([
        setup,
        "cp /tmp/r /mnt/src; sync; echo 3 > /proc/sys/vm/drop_caches",
        t.format(
            cmd="gpg --batch --yes --pinentry-mode loopback --passphrase x -c -o /mnt/src.gpg /mnt/src",
            name="main"),
        "umount /mnt",
    ])


def run_vm(tmp, system, model, cache_mib, workload, mib):
    st = os.path.join(tmp, "stats.json")
    if system == "plain":
        disk = fresh_fs(tmp)
    else:
        vol = fresh_volume(tmp)
        disk = f"{vol},dedup" + (f",meta-cache={cache_mib}KiB" if cache_mib else ",meta-cache=100%")
    args = [VMSIGHT, "run", "--disk", disk, "--disk-model", model, "--stats-json", st]
    if system == "hinted":
        args += ["--insights", os.path.join(tmp, "ins.log"), "--insight-target", "@cmd"]
    args += ["--", "sh", "-c", script(workload, mib)]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(args, capture_output=True, text=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{system} {workload} failed ({p.returncode}): {p.stderr[-2000:]}")
    times = {}
    for line in p.stdout.splitlines():
        w = line.split()
        if len(w) == 4 and w[0] == "TIME":
            times[w[1]] = float(w[3]) - float(w[2])
    stats = json.load(open(st))["disks"][1]
    return {
        "system": system, "model": model, "workload": workload, "cache_kib": cache_mib,
        "seconds": times.get("main"), "warmup_seconds": times.get("warmup"),
        "cpu_seconds": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "dedup": stats.get("dedup"),
    }


def peak_pages(tmp, workload, mib):
    r = run_vm(tmp, "unhinted", "none", 0, workload, mib)
    return r["dedup"]["meta_cache_misses"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--models", default="hdd,ssd")
    ap.add_argument("--caches", default="1,10")
    ap.add_argument("--workloads", default="cp,gpg")
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="vmsight-dedup-bench-") as tmp:
        for wl in a.workloads.split(","):
            peak = peak_pages(tmp, wl, a.mib)
            print(f"# {wl}: peak metadata {peak} pages ({peak * 4} KiB)", flush=True)
            for model in a.models.split(","):
                for pct in [float(c) for c in a.caches.split(",")]:
                    cache_kib = max(8, int(peak * pct / 100 + 0.999)) * 4
                    rows = {"unhinted": [], "hinted": [], "plain": []}
                    for _ in range(a.reps):
                        for system in ("unhinted", "hinted", "plain"):
                            r = run_vm(tmp, system, model, cache_kib, wl, a.mib)
                            r["cache_pct"] = pct
                            rows[system].append(r)
                            results.append(r)
                    med = {s: statistics.median(x["seconds"] for x in v) for s, v in rows.items()}
                    cpu = {s: statistics.median(x["cpu_seconds"] for x in v) for s, v in rows.items()}
                    h = rows["hinted"][-1]["dedup"]
                    u = rows["unhinted"][-1]["dedup"]
                    print(
                        f"{wl:4} {model} cache {pct:>4}% ({cache_kib} KiB): "
                        f"unhinted {med['unhinted']:.2f}s  hinted {med['hinted']:.2f}s  plain {med['plain']:.2f}s  "
                        f"speedup {med['unhinted'] / med['hinted']:.2f}x  hinted/plain {med['hinted'] / med['plain']:.2f}x | "
                        f"cpu u/h/p {cpu['unhinted']:.1f}/{cpu['hinted']:.1f}/{cpu['plain']:.1f}s | "
                        f"lookups u/h {u['index_lookups']}/{h['index_lookups']} hint hits {h['hint_hits']} "
                        f"unique {h['unique_hints']} meta pages read u/h {u['meta_pages_read']}/{h['meta_pages_read']}",
                        flush=True,
                    )
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
