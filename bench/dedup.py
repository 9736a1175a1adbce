#!/usr/bin/env python3
"""iDedup vs the unhinted dedup volume (the dm-dedup baseline) vs a plain disk (Sky Fig. 8, 9,
Table 7).

For every disk model (hdd, ssd) and metadata cache (1 % and 10 % of the workload's peak
metadata) and every workload, three systems run in the same round, interleaved:
  unhinted  --disk VOL,dedup (no --insights: no interception, no hints)
  hinted    --disk VOL,dedup --insights ... --insight-target @cmd (copy and unique hints)
  plain     --disk RAW (the same ext4 image, no dedup) with the same disk model
Workloads (each on a fresh volume holding a fresh ext4 file system with 4 KiB blocks):
  cp   time `cp` of a file of random data to a new file (Sky 8.2.1; Sky uses 500 MB). Sky's
       warm-up copy of the file onto the fresh file system is done on the host: the file goes
       into the image (`mkfs.ext4 -d`) and `vmsight dedup create --from` stores and indexes
       every chunk of it, the state a guest-side warm-up copy leaves (and the same image is
       the plain disk); the guest starts with cold caches.
  gpg  time `gpg -c` of a file of random data (Sky 8.2.2), set up the same way
The time is measured in the guest around the command (sync included); host CPU time is the
getrusage of vmsight and QEMU over the whole run. The peak metadata of a workload is measured
once with a cache as large as the metadata (cold misses = pages touched) on the unhinted
system; the caches are 1 % and 10 % of it (at least 8 pages).

Usage: bench/dedup.py [--mib 16] [--reps 1] [--models hdd,ssd] [--caches 1,10]
                      [--workloads cp,gpg] [--json out.json] [--out PATH]

Every run (seconds, CPU, modelled disk time, the volume's counters) goes to
bench/results/dedup.json (--out), with the medians; --json still writes the bare list of runs.
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
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(ROOT, "target", "release", "vmsight"))
sys.path.insert(0, os.path.join(ROOT, "bench", "lib"))
import results as bench_results  # noqa: E402
VOL_MIB = 256  # the volume and file system size; main() raises it for --mib above 32


def sh(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)


def fresh_fs(tmp, src):
    """A fresh ext4 image holding `src` (a directory with the workload's input file)."""
    raw = os.path.join(tmp, "fs.img")
    if os.path.exists(raw):
        os.remove(raw)
    with open(raw, "wb") as f:
        f.truncate(VOL_MIB << 20)
    # 4 KiB file-system blocks: 1 KiB blocks (mke2fs's default below 512 MiB) would split
    # chunks and make every volume read-modify-write (docs/dedup.md, limits).
    sh(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", src, raw])
    return raw


def input_dir(tmp, mib):
    """A directory with the workload's input: `data`, `mib` MiB of random bytes."""
    src = os.path.join(tmp, "input")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "data"), "wb") as f:
        f.write(os.urandom(mib << 20))
    return src


def fresh_volume(tmp, src):
    raw = fresh_fs(tmp, src)
    vol = os.path.join(tmp, "vol")
    shutil.rmtree(vol, ignore_errors=True)
    sh([VMSIGHT, "dedup", "create", vol, "--size", f"{VOL_MIB}MiB", "--from", raw])
    return vol


def script(workload):
    # MARK lines let the host snapshot the stage's counters around the timed command (the
    # guest waits outside the timed region while the host reads them).
    t = ("echo MARK {name}-start; sleep 2; s=$(date +%s.%N); {cmd}; sync; e=$(date +%s.%N); "
         "echo TIME {name} $s $e; echo MARK {name}-end; sleep 2")
    cmd = {
        "cp": "cp /mnt/data /mnt/copy",
        "gpg": "gpg --batch --yes --pinentry-mode loopback --passphrase x -c -o /mnt/data.gpg /mnt/data",
    }[workload]
    return "; ".join(["mount /dev/vdb /mnt", t.format(cmd=cmd, name="main"), "umount /mnt"])


def run_vm(tmp, src, system, model, cache_mib, workload):
    st = os.path.join(tmp, "stats.json")
    if system.startswith("plain"):
        disk = fresh_fs(tmp, src)
    else:
        vol = fresh_volume(tmp, src)
        disk = f"{vol},dedup" + (f",meta-cache={cache_mib}KiB" if cache_mib else ",meta-cache=100%")
    args = [VMSIGHT, "run", "--disk", disk, "--disk-model", model, "--stats-json", st]
    if system in ("hinted", "plain-insights"):
        args += ["--insights", os.path.join(tmp, "ins.log"), "--insight-target", "@cmd"]
    args += ["--", "sh", "-c", script(workload)]
    name = f"dedup-bench-{os.getpid()}"
    args[2:2] = ["--name", name]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    times, marks = {}, {}
    for line in p.stdout:
        w = line.split()
        if len(w) == 4 and w[0] == "TIME":
            times[w[1]] = float(w[3]) - float(w[2])
        elif len(w) == 2 and w[0] == "MARK":
            marks[w[1]] = live_disk(name)
    err = p.stderr.read()
    p.wait()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{system} {workload} failed ({p.returncode}): {err[-2000:]}")
    stats = json.load(open(st))["disks"][1]
    timed = None
    if "main-start" in marks and "main-end" in marks:
        a, b = marks["main-start"], marks["main-end"]
        timed = delta(a.get("dedup") or a.get("model") or {}, b.get("dedup") or b.get("model") or {})
    return {
        "system": system, "model": model, "workload": workload, "cache_kib": cache_mib,
        "seconds": times.get("main"),
        "cpu_seconds": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "dedup": stats.get("dedup"),
        "timed": timed,
    }


def live_disk(name):
    """The counters of the running VM's bench disk (control socket): `dedup` on a dedup
    volume, `model` (the disk model stage) on a plain disk."""
    out = sh([VMSIGHT, "stats", name, "--json"]).stdout
    return json.loads(out)["disks"][1]


def delta(a, b):
    """Counter differences b - a (numbers only)."""
    return {k: b[k] - a[k] for k in b
            if isinstance(b[k], (int, float)) and not isinstance(b[k], bool) and k in a}


def peak_pages(tmp, src, workload):
    r = run_vm(tmp, src, "unhinted", "none", 0, workload)
    return r["dedup"]["meta_cache_misses"]


def modelled_s(r):
    """Modelled disk time of the timed command: the dedup stage's (data + metadata) or the
    plain disk's model stage."""
    t = r["timed"] or {}
    return (t.get("modelled_ns") or t.get("modelled_busy_ns") or 0) / 1e9


def report(wl, model, pct, cache_kib, rows):
    med = {s: statistics.median(x["seconds"] for x in v) for s, v in rows.items()}
    cpu = {s: statistics.median(x["cpu_seconds"] for x in v) for s, v in rows.items()}
    mod = {s: statistics.median(modelled_s(x) for x in v) for s, v in rows.items()}
    line = [f"{wl:4} {model} cache {pct:>4}% ({cache_kib} KiB):"]
    line += [f"{s} {med[s]:.2f}s (cpu {cpu[s]:.1f}s, disk {mod[s]:.2f}s)" for s in rows]
    if "unhinted" in med and "hinted" in med:
        line.append(f"speedup {med['unhinted'] / med['hinted']:.2f}x")
    if "hinted" in med and "plain" in med:
        line.append(f"hinted/plain {med['hinted'] / med['plain']:.3f}x")
    for s in ("unhinted", "hinted"):
        if s in rows:
            t = rows[s][-1]["timed"] or {}
            line.append(
                f"{s}: lookups {t.get('index_lookups')} hint-hits {t.get('hint_hits')} "
                f"unique {t.get('unique_hints')} copy-reads {t.get('copy_hints')} "
                f"meta-reads {t.get('meta_pages_read')} commits {t.get('meta_commits')}")
    print(" | ".join(line), flush=True)
    out = {"seconds": med, "cpu_seconds": cpu, "modelled_disk_s": mod}
    if "unhinted" in med and "hinted" in med:
        out["speedup"] = med["unhinted"] / med["hinted"]
    if "hinted" in med and "plain" in med:
        out["hinted_over_plain"] = med["hinted"] / med["plain"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--models", default="hdd,ssd")
    ap.add_argument("--caches", default="1,10")
    ap.add_argument("--workloads", default="cp,gpg")
    ap.add_argument("--systems", default="unhinted,hinted,plain",
                    help="also: plain-insights (a plain disk with the same interception)")
    ap.add_argument("--json")
    bench_results.add_out_option(ap, "dedup")
    a = ap.parse_args()
    global VOL_MIB
    # The input and its copy (or its .gpg) side by side, plus ext4's journal and tables.
    VOL_MIB = max(VOL_MIB, 2 * a.mib + 192)
    systems = a.systems.split(",")
    results = []
    rec = bench_results.Recorder(
        "dedup", a, out=a.out, keys=["workload", "model", "cache_pct", "system"], baseline={"system": "plain"},
        metrics=["seconds", "cpu_seconds", "modelled_disk_s", "timed.index_lookups", "timed.hint_hits",
                 "timed.unique_hints", "timed.copy_hints", "timed.meta_pages_read", "timed.meta_commits"])
    summary = {}
    with tempfile.TemporaryDirectory(prefix="vmsight-dedup-bench-") as tmp:
        for wl in a.workloads.split(","):
            src = input_dir(tmp, a.mib)
            peak = peak_pages(tmp, src, wl)
            print(f"# {wl}: peak metadata {peak} pages ({peak * 4} KiB)", flush=True)
            summary[f"{wl}/peak_metadata_pages"] = peak
            for model in a.models.split(","):
                for pct in [float(c) for c in a.caches.split(",")]:
                    cache_kib = max(8, int(peak * pct / 100 + 0.999)) * 4
                    rows = {s: [] for s in systems}
                    for rep in range(a.reps):
                        for system in systems:
                            r = run_vm(tmp, src, system, model, cache_kib, wl)
                            r["cache_pct"] = pct
                            rows[system].append(r)
                            results.append(r)
                            rec.add(dict(r, rep=rep, modelled_disk_s=modelled_s(r)))
                    summary[f"{wl}/{model}/{pct:g}%"] = report(wl, model, pct, cache_kib, rows)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    rec.write(summary=summary)


if __name__ == "__main__":
    main()
