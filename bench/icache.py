#!/usr/bin/env python3
"""iCache benchmarks (issue 4, Sky §7 and §9): priority vs LRU cache, same size, same disk model.

Workloads (each in a fresh guest per configuration, timed inside the guest):
  find    unpack a source-like tree (FILES files, from a tar on a read-only extra disk) into a
          fresh ext4 (made on the host, so the classifier knows the journal), sync, drop the
          guest's caches, then `find` for a name that does not exist (Sky §7.2.1)
  sqlite  load two base tables (writes hinted class 4 by the LD_PRELOAD shim), build large
          secondary indexes (hinted class 0, lowest), drop caches, then run a Q16-shaped join
          over the base tables that uses no secondary index (Sky §7.2.2): a scan of partsupp
          (stored in random part order) with a primary-key lookup of part per row
Configurations per disk model (hdd, ssd; the model applies to every extra disk):
  nocache       no cache, no interception
  lru           LRU cache, no interception (the bcache baseline of Sky)
  lru+insights  LRU cache with --insights (interception overhead, same policy)
  priority      priority cache with --insights (Sky's iCache)
Prints a Markdown table: phase times, the speedup of priority over lru, hit rates by class.

  bench/icache.py [--files N] [--cache-mib M] [--rows R] [--only find,sqlite] [--models hdd,ssd]
                  [--configs nocache,lru,lru+insights,priority] [--reps N] [--verbose] [--out PATH]

Every run (phase times in the guest, host wall time, the cache's counters) goes to
bench/results/icache.json (--out).
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
PRELOAD = "LD_PRELOAD=/usr/local/lib/libvmsight-preload.so"


FIND_SCRIPT = """set -e
mount /dev/vdb /mnt
t0=$(date +%s.%N); tar xf /dev/vdc -C /mnt; sync; t1=$(date +%s.%N)
# Checkpoint the journal (freeze/thaw), so every metadata block is at its home location
# before find, whatever the timing of jbd2's own checkpoints: the same state in every run.
fsfreeze -f /mnt; fsfreeze -u /mnt
echo 3 > /proc/sys/vm/drop_caches
t2=$(date +%s.%N); find /mnt -name no-such-file-anywhere; t3=$(date +%s.%N)
echo "files $(find /mnt -type f | wc -l)"
umount /mnt
echo "T unpack $t0 $t1"; echo "T find $t2 $t3"
"""


def sqlite_script(rows):
    load = f"""PRAGMA page_size=4096;
CREATE TABLE part(p_partkey INTEGER PRIMARY KEY, p_brand TEXT, p_type TEXT, p_size INT, p_pad TEXT);
CREATE TABLE partsupp(ps_partkey INT, ps_suppkey INT, ps_cost REAL, ps_pad TEXT);
BEGIN;
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < {rows})
INSERT INTO part SELECT x, 'Brand#'||(x%50), 'TYPE'||(x%150), x%50, hex(randomblob(40)) FROM c;
WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x+1 FROM c WHERE x < {4 * rows - 1})
INSERT INTO partsupp SELECT (x*7919)%{rows}+1, (x*31)%1000, (x%977)*1.5, hex(randomblob(24)) FROM c;
COMMIT;"""
    index = """CREATE INDEX i1 ON partsupp(ps_pad, ps_cost);
CREATE INDEX i2 ON part(p_pad, p_type);
CREATE INDEX i3 ON partsupp(ps_cost, ps_pad);
CREATE INDEX i4 ON part(p_type, p_pad);"""
    query = """SELECT p_brand, p_type, p_size, count(DISTINCT ps_suppkey) AS n
FROM partsupp NOT INDEXED JOIN part ON p_partkey = ps_partkey
WHERE p_brand <> 'Brand#45' AND p_size IN (49, 14, 23, 45, 19, 3, 36, 9)
GROUP BY p_brand, p_type, p_size ORDER BY n DESC LIMIT 3;"""
    return f"""set -e
mount /dev/vdb /mnt; mkdir /mnt/db
cat > /tmp/load.sql <<'EOF'
{load}
EOF
cat > /tmp/index.sql <<'EOF'
{index}
EOF
cat > /tmp/query.sql <<'EOF'
{query}
EOF
t0=$(date +%s.%N)
VMSIGHT_HINTS='/mnt/db/*=4' {PRELOAD} sqlite3 /mnt/db/t.db < /tmp/load.sql; sync
t1=$(date +%s.%N)
VMSIGHT_HINTS='/mnt/db/*=0' {PRELOAD} sqlite3 /mnt/db/t.db < /tmp/index.sql; sync
t2=$(date +%s.%N)
echo 3 > /proc/sys/vm/drop_caches
t3=$(date +%s.%N)
{PRELOAD} sqlite3 /mnt/db/t.db < /tmp/query.sql
t4=$(date +%s.%N)
echo "dbsize $(stat -c %s /mnt/db/t.db)"
umount /mnt
echo "T load $t0 $t1"; echo "T index $t1 $t2"; echo "T query $t3 $t4"
"""


def run(config, model, cache_mib, disks, script):
    with tempfile.TemporaryDirectory(prefix="bench-icache-") as work:
        st = os.path.join(work, "stats.json")
        args = [VMSIGHT, "run", "--stats-json", st, "--disk-model", model]
        for d in disks:
            args += ["--disk", d]
        if config != "nocache":
            args += ["--cache-size", str(cache_mib),
                     "--cache-policy", "priority" if config == "priority" else "lru"]
        if config in ("lru+insights", "priority"):
            args += ["--insights", os.path.join(work, "ins.jsonl")]
        args += ["--", "sh", "-c", script]
        t0 = time.monotonic()
        p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if p.returncode != 0:
            sys.exit(f"{config}/{model} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        times = {}
        for line in p.stdout.splitlines():
            w = line.split()
            if len(w) == 4 and w[0] == "T":
                times[w[1]] = float(w[3]) - float(w[2])
        s = json.load(open(st))
        disk = s["disks"][1]
        return {"times": times, "wall": wall, "cache": disk.get("cache"),
                "model": (disk.get("model") or {}).get("model", "none"), "stdout": p.stdout}


def hit_rates(cache):
    """Whole-run read hit rate, hits by the class of the cached block, misses.

    A read's class is only known after the disk returned its data (the classifier matches the
    content), so misses are counted in class 0; hits count under the cached block's class."""
    if not cache:
        return "-"
    hits, misses = cache["hits"], cache["misses"]
    if hits + misses == 0:
        return "no reads"
    by = ", ".join(f"c{c['class']} {c['hits']}" for c in cache["classes"] if c["hits"])
    return f"{100.0 * hits / (hits + misses):.0f}% of {hits + misses} blocks (hits: {by or 'none'})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100000)
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--rows", type=int, default=100000)
    ap.add_argument("--only", default="find,sqlite")
    ap.add_argument("--models", default="hdd,ssd")
    ap.add_argument("--configs", default="nocache,lru,lru+insights,priority")
    ap.add_argument("--reps", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--verbose", action="store_true", help="print every run's cache counters")
    bench_results.add_out_option(ap, "icache")
    a = ap.parse_args()
    rec = bench_results.Recorder("icache", a, out=a.out, keys=["workload", "model", "config"],
                                 baseline="lru")
    speedups = {}
    configs = a.configs.split(",")
    print(f"# bench/icache.py --files {a.files} --cache-mib {a.cache_mib} --rows {a.rows} --reps {a.reps}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} host CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-icache-") as tmp:
        tar = os.path.join(tmp, "tree.tar")
        if "find" in a.only:
            total = make_tree_tar(tar, a.files)
            print(f"tree: {a.files} files, {total / 2**20:.0f} MiB of file data, tar {os.path.getsize(tar) / 2**20:.0f} MiB")
        for wl in a.only.split(","):
            for model in a.models.split(","):
                rows = {}
                runs = {c: [] for c in configs}
                # Repetitions interleave the configurations, so slow phases of a shared
                # machine spread over all of them.
                for rep in range(a.reps):
                    for config in configs:
                        img = os.path.join(tmp, "target.img")
                        ext4(img, 4096)
                        if wl == "find":
                            r = run(config, model, a.cache_mib, [img, tar + ",ro"], FIND_SCRIPT)
                        else:
                            r = run(config, model, a.cache_mib, [img], sqlite_script(a.rows))
                        runs[config].append(r)
                        os.unlink(img)
                        cache = r["cache"] or {}
                        rec.rep(workload=wl, model=model, config=config, rep=rep,
                                **{f"{p}_s": t for p, t in r["times"].items()}, total_s=sum(r["times"].values()),
                                wall_s=r["wall"], cache_hits=cache.get("hits"), cache_misses=cache.get("misses"),
                                cache_class_hits={f"c{c['class']}": c["hits"] for c in cache.get("classes", [])},
                                cache=r["cache"], model_desc=r["model"])
                        print(f"  {wl}/{model}/{config}: {r['times']} wall {r['wall']:.0f}s", file=sys.stderr)
                        if a.verbose:
                            print(f"    cache: {json.dumps(r['cache'])}", file=sys.stderr)
                for config, rs in runs.items():
                    # Median per phase; the cache counters of the last run.
                    times = {p: statistics.median(r["times"][p] for r in rs) for p in rs[0]["times"]}
                    rows[config] = dict(rs[-1], times=times)
                phases = list(next(iter(rows.values()))["times"].keys())
                print(f"\n### {wl}, disk model {model}: {next(iter(rows.values()))['model']}")
                print(f"cache {a.cache_mib} MiB per disk where used; times in s (inside the guest), "
                      f"median of {a.reps}\n")
                print("| config | " + " | ".join(phases) + " | total | read hit rate by class |")
                print("|---|" + "---:|" * (len(phases) + 1) + "---|")
                for config, r in rows.items():
                    t = r["times"]
                    print(f"| {config} | " + " | ".join(f"{t[p]:.2f}" for p in phases)
                          + f" | {sum(t.values()):.2f} | {hit_rates(r['cache'])} |")
                if "lru" in rows and "priority" in rows:
                    lru, pri = rows["lru"]["times"], rows["priority"]["times"]
                    ratios = ", ".join(f"{p} {lru[p] / pri[p]:.2f}x" for p in phases if pri[p] > 0)
                    print(f"\nspeedup priority vs lru: {ratios}, total "
                          f"{sum(lru.values()) / sum(pri.values()):.2f}x")
                    speedups[f"{wl}/{model}"] = dict({p: lru[p] / pri[p] for p in phases if pri[p] > 0},
                                                     total=sum(lru.values()) / sum(pri.values()))
                if "lru" in rows and "lru+insights" in rows:
                    l0, l1 = rows["lru"]["times"], rows["lru+insights"]["times"]
                    ov = ", ".join(f"{p} {100 * (l1[p] / l0[p] - 1):+.0f}%" for p in phases if l0[p] > 0)
                    print(f"interception overhead (lru+insights vs lru): {ov}")
                sys.stdout.flush()
    rec.write(summary={"speedup_priority_vs_lru": speedups})


if __name__ == "__main__":
    main()
