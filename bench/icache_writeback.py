#!/usr/bin/env python3
"""The iCache in write-back mode (issue 32, item 4; Sky §6.2 suggests using block lifetimes to
schedule write-back from a cache to the slower disk): what write-back saves over write-through,
in guest time and in bytes that reach the modelled disk, on workloads whose blocks die young.

Each boot runs two of Sky's Figure 5 workloads (bench/sky_insights.py), whose blocks reach the
disk and die young, on an empty host-made ext4 extra disk (mounted `-o discard`, so freed
blocks reach the device as discards) with the HDD model under a cache of `--cache-mib`:
  varmail   the guest's filebench-varmail-shaped program (guest/progs/varmail.c: create, append
            and fsync, read, delete mail files), 300 files, 20 000 operations
  tar-rm    `--rounds` times: tar x of a source-like tree (`--files` files, from a raw read-only
            disk), sync, rm -r, sync
Configurations, rotated within each repetition:
  write-through  the cache writes every guest write through (the baseline)
  write-back     dirty blocks stay in RAM until a FLUSH, an eviction or shutdown; ext4 sends
                 a FLUSH at every journal commit (5 s) and every fsync, so no dirty block
                 outlives a commit
  write-back-nobarrier
                 the same with the guest mounted `-o nobarrier`: ext4 sends no FLUSH, so dirty
                 blocks stay until evicted and a block the guest frees before that dies in the
                 cache unwritten (`dirty_discarded`). This stands for a *persistent* cache
                 (Sky's "persistent cache device"), which may acknowledge flushes itself; with
                 vmsight's RAM cache it is NOT crash-safe, and is measured only to show what
                 lifetimes could save.

Prints per workload and configuration the medians of guest time and of MiB written to the
modelled disk (the disk model's counter, below the cache), the ratios to write-through, and the
dirty blocks written back / discarded unwritten.

  bench/icache_writeback.py [--reps N] [--cache-mib M] [--files N] [--rounds N]
                            [--configs write-through,write-back,write-back-nobarrier] [--out PATH]

Every boot's numbers go to bench/results/icache_writeback.json (--out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from trees import ext4, make_tree_tar  # noqa: E402
import results as bench_results  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))
CONFIGS = ["write-through", "write-back", "write-back-nobarrier"]
WORKLOADS = ["varmail", "tar-rm"]

def guest_script(rounds, nobarrier):
    opts = "discard,nobarrier" if nobarrier else "discard"
    return f"""set -e
mount -o {opts} /dev/vdb /mnt
mkdir /mnt/vm
sync
t() {{ date +%s%N; }}
s=$(t); varmail -d /mnt/vm -n 300 -o 20000 -s 11 >/dev/null; sync; e=$(t); echo "RESULT varmail $((e-s))"
rm -r /mnt/vm; sync
s=$(t)
for i in $(seq 1 {rounds}); do tar xf /dev/vdc -C /mnt; sync; rm -r /mnt/src; sync; done
e=$(t); echo "RESULT tar-rm $((e-s))"
echo MARK end
umount /mnt
"""


def run(config, a, disk, tar):
    with tempfile.TemporaryDirectory(prefix="bench-icwb-") as work:
        st = os.path.join(work, "stats.json")
        mode = "write-through" if config == "write-through" else "write-back"
        args = [VMSIGHT, "run", "--stats-json", st, "--disk-model", "hdd",
                "--cache-size", str(a.cache_mib), "--cache-policy", "lru", "--cache-mode", mode,
                "--disk", disk, "--disk", tar + ",ro",
                "--", "sh", "-c", guest_script(a.rounds, config.endswith("nobarrier"))]
        t0 = time.monotonic()
        p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if p.returncode != 0:
            sys.exit(f"{config} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        got = {}
        for line in p.stdout.splitlines():
            w = line.split()
            if len(w) == 3 and w[0] == "RESULT":
                got[w[1]] = int(w[2]) / 1e9
        s = json.load(open(st))
        d = s["disks"][1]
        cache, model = d.get("cache") or {}, d.get("model") or {}
        return {"guest_s": got, "wall_s": wall,
                "written_mib": model.get("write_bytes", 0) / 2**20,
                "read_mib": model.get("read_bytes", 0) / 2**20,
                "writebacks": cache.get("writebacks", 0),
                "dirty_discarded": cache.get("dirty_discarded", 0),
                "hits": cache.get("hits", 0), "misses": cache.get("misses", 0)}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    bench_results.add_out_option(ap, "icache_writeback")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"unknown configuration {c!r} (expected {', '.join(CONFIGS)})")
    rec = bench_results.Recorder("icache_writeback", a, out=a.out, keys=["workload", "config"],
                                 baseline="write-through")
    rows = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-icwb-") as tmp:
        tar = os.path.join(tmp, "tree.tar")
        mib = make_tree_tar(tar, a.files) / 2**20
        print(f"tree: {a.files} files, {mib:.0f} MiB of data", file=sys.stderr)
        for rep in range(a.reps):
            for c in configs:
                disk = os.path.join(tmp, "d.img")
                ext4(disk, 2048)
                r = run(c, a, disk, tar)
                os.unlink(disk)
                rows[c].append(r)
                for w in WORKLOADS:
                    rec.rep(workload=w, config=c, rep=rep, guest_s=r["guest_s"].get(w))
                rec.rep(workload="(whole run)", config=c, rep=rep, wall_s=r["wall_s"],
                        written_mib=r["written_mib"], read_mib=r["read_mib"],
                        writebacks=r["writebacks"], dirty_discarded=r["dirty_discarded"])
                print(f"[rep {rep}] {c}: " + ", ".join(f"{w} {r['guest_s'].get(w, 0):.1f}s" for w in WORKLOADS)
                      + f", written {r['written_mib']:.0f} MiB, written back {r['writebacks']}, "
                      f"dirty discarded {r['dirty_discarded']}", file=sys.stderr)
    print(f"\n### iCache write-back ({time.strftime('%Y-%m-%d')}, `bench/icache_writeback.py --reps {a.reps} "
          f"--cache-mib {a.cache_mib} --files {a.files} --rounds {a.rounds}`), HDD model, LRU\n")
    base = rows.get("write-through")
    print("| configuration | varmail (s) | tar-rm (s) | MiB written to the disk | vs write-through: time (varmail / tar-rm), bytes | dirty blocks written back | dirty blocks discarded unwritten |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        rs = rows[c]
        pm, tr = med(r["guest_s"].get("varmail") for r in rs), med(r["guest_s"].get("tar-rm") for r in rs)
        wr = med(r["written_mib"] for r in rs)
        ratio = "-"
        if base and c != "write-through":
            bpm = med(r["guest_s"].get("varmail") for r in base)
            btr = med(r["guest_s"].get("tar-rm") for r in base)
            bwr = med(r["written_mib"] for r in base)
            ratio = f"{pm / bpm:.2f}x / {tr / btr:.2f}x, {wr / bwr:.2f}x"
        print(f"| {c} | {pm:.1f} | {tr:.1f} | {wr:.0f} | {ratio} | "
              f"{med(r['writebacks'] for r in rs):.0f} | {med(r['dirty_discarded'] for r in rs):.0f} |")
    rec.write()


if __name__ == "__main__":
    main()
