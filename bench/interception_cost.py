#!/usr/bin/env python3
"""What interception with insights costs, in host CPU time and guest wall time (issue 17).

Every boot runs all workloads once, on an empty ext4 extra disk (host-made, 4 KiB blocks),
between marker lines; the host CPU time (utime + stime of `vmsight run`'s whole process tree:
vmsight, QEMU and its threads) is read from /proc when each marker arrives, the guest's own
wall time is printed beside it. Inputs are made before the first marker (untimed).

Workloads (the issue's "tar x of 100 000 files" and cp/find/tar/gpg):
  tarx    tar xf of a FILES-file source-like tree (read from a raw read-only extra disk) + sync
  find    find over the unpacked tree, page cache dropped first
  cp      cp of a 200 MiB file + sync (coreutils 9: copy_file_range)
  tar     tar cf of 20 x 10 MiB files + sync
  gpg     gpg --symmetric of 100 MiB
  db      MariaDB (Debian's mariadb-server) on a third extra disk: LOAD DATA of a TPC-H-shaped
          database of scale factor SF (part, supplier, partsupp as MyISAM tables, 0.35: 48 MiB
          of rows, 80 MiB of indexes), ENABLE KEYS, then TPC-H Q16, + sync; the same database,
          schema and query as bench/icache.py's DB row (generated and installed once per
          invocation by a prep guest; the server start is untimed)

Configurations, rotated within each repetition:
  no-plugin  `--no-plugin` (plain QEMU TCG, the baseline)
  insights   `--insights FILE`: every process's file syscalls intercepted, read/write buffers
             checksummed, every block request classified, the log written
  traced     `--trace wl --trace-out /dev/null`: only the workload (/tmp/wl and children)
             (`--configs` to add it)
  counting   `--count-syscalls`: the plugin translates (every user `syscall` counted inline)
             but makes no callback: what QEMU's generated code costs for a translating plugin,
             before vmsight does any work (`--configs` to add it)

Prints, per workload, the medians and the median of the per-repetition ratios to the
no-plugin boot of the same repetition.

  bench/interception_cost.py [--reps N] [--files N] [--sf SF] [--workloads tarx,...,db]
                             [--configs no-plugin,insights] [--out PATH]

Every boot's numbers (host CPU and guest seconds per workload) go to
bench/results/interception_cost.json (--out).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
sys.path.insert(0, os.path.dirname(__file__))
import icache  # noqa: E402  (the DB row's database, schema and query)
from trees import ext4, make_tree_tar  # noqa: E402
from vmproc import marked_run  # noqa: E402
import results as bench_results  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))

PREP = """set -e
mount /dev/vdb /mnt
cp /bin/dash /tmp/wl
mkdir -p /mnt/data /mnt/x -m 700 /root/.gnupg
dd if=/dev/urandom of=/mnt/src bs=1M count=200 status=none
for i in $(seq 1 20); do dd if=/dev/urandom of=/mnt/data/f$i bs=1M count=10 status=none; done
dd if=/dev/urandom of=/mnt/secret bs=1M count=100 status=none
gpgconf --launch gpg-agent
sync
"""
# name: (untimed set-up, timed command run by /tmp/wl, a copy of dash)
WORKLOADS = {
    "tarx": ("true", "tar xf /dev/vdc -C /mnt/x && sync"),
    "find": ("echo 3 > /proc/sys/vm/drop_caches", "find /mnt/x -name no-such-file"),
    "cp": ("true", "cp /mnt/src /mnt/dst && sync"),
    "tar": ("true", "tar cf /mnt/out.tar /mnt/data && sync"),
    "gpg": ("true", "gpg --batch --yes --pinentry-mode loopback --passphrase pw "
                    "--symmetric -o /mnt/secret.gpg /mnt/secret && sync"),
    "db": ("db_start", " && ".join(f"mariadb --defaults-file=/tmp/my.cnf tpch < /tmp/{q}.sql" for q in ("load", "index"))
           + " && mariadb --defaults-file=/tmp/my.cnf tpch < /tmp/q16.sql > /tmp/q16.out && sync"),
}
# The DB workload's untimed set-up: its disk (vdd: a copy of the installed datadir) at /srv,
# the .tbl files (vde) copied to /tmp/tbl, the server started and the schema created.
DB_PREP = ("mkdir -p /srv /data; mount /dev/vdd /srv; mount -o ro /dev/vde /data\n"
           "cp -r /data/tbl /tmp/tbl; umount /data\n"
           + icache.heredoc("/tmp/my.cnf", icache.MARIADB_CNF.replace("datadir=/mnt/db", "datadir=/srv/db"))
           + icache.heredoc("/tmp/schema.sql", icache.TPCH_SCHEMA)
           + icache.heredoc("/tmp/load.sql", icache.TPCH_LOAD)
           + icache.heredoc("/tmp/index.sql", icache.TPCH_INDEX)
           + icache.heredoc("/tmp/q16.sql", icache.TPCH_Q16) + """db_start() {
    mariadbd --defaults-file=/tmp/my.cnf & n=0
    until mariadb --defaults-file=/tmp/my.cnf -e 'select 1' >/dev/null 2>&1; do
        n=$((n + 1)); [ $n -lt 600 ] || { tail -n 30 /tmp/mysqld.err; exit 1; }
        sleep 0.2
    done
    mariadb --defaults-file=/tmp/my.cnf < /tmp/schema.sql
}
db_stop() {
    [ "$(wc -l < /tmp/q16.out)" -gt 1 ] || { echo "Q16 returned no rows"; exit 1; }
    mariadb --defaults-file=/tmp/my.cnf -e shutdown; wait; umount /srv
}
""")

CONFIGS = ["no-plugin", "insights", "traced", "counting"]


def guest_script(workloads):
    parts = [PREP] + ([DB_PREP] if "db" in workloads else [])
    for name in workloads:
        setup, work = WORKLOADS[name]
        parts.append(f"{setup}; echo BEGIN {name}; s=$(date +%s%N); /tmp/wl -c '{work}'; "
                     f"e=$(date +%s%N); echo END {name} $((e-s))")
    if "db" in workloads:
        parts.append("db_stop")
    parts.append("umount /mnt")
    return "\n".join(parts)


def flags(config, work):
    if config == "no-plugin":
        return ["--no-plugin"]
    if config == "insights":
        return ["--insights", os.path.join(work, "insights.jsonl")]
    if config == "counting":
        return ["--count-syscalls"]
    return ["--trace", "wl", "--trace-out", "/dev/null"]


def run_once(config, tree_tar, db, workloads, tmp):
    """One boot: per workload (host CPU seconds of the vmsight tree, guest wall seconds).
    `db`: (datadir template image, .tbl image) when the DB workload runs."""
    work = tempfile.mkdtemp(dir=tmp)
    disk = os.path.join(work, "x.img")
    ext4(disk, 4096)
    args = [VMSIGHT, "run", "--vcpus", "2", "--mem", "2G", "--disk", disk,
            "--disk", tree_tar + ",ro"] + flags(config, work)
    if db:
        # Every run starts from the installed datadir (sparse copy).
        datadir = os.path.join(work, "db.img")
        subprocess.run(["cp", "--sparse=always", db[0], datadir], check=True)
        args += ["--disk", datadir, "--disk", db[1] + ",ro"]
    args += ["--", "sh", "-c", guest_script(workloads)]
    try:
        return marked_run(args, len(workloads), config)
    finally:
        subprocess.run(["rm", "-rf", work])


def pct(x):
    return f"{(x - 1) * 100:+.1f}%"


def report(res, configs, reps, workloads):
    load = os.getloadavg()
    print(f"\n### Interception cost ({time.strftime('%Y-%m-%d')}, medians of {reps} "
          f"interleaved runs, 2 vCPUs, TCG, load after {load[0]:.2f})\n")
    others = [c for c in configs if c != "no-plugin"]
    head = "".join(f" {c} (s) | {c} overhead (paired) |" for c in others)
    print(f"| workload | metric | no plugin (s) |{head}")
    print("|---|---|---|" + "---|---|" * len(others))
    for n in workloads:
        for m, name in ((0, "host CPU"), (1, "guest wall")):
            base = res["no-plugin"][n]
            b = statistics.median(x[m] for x in base)
            row = f"| {n} | {name} | {b:.2f} |"
            for c in others:
                med = statistics.median(x[m] for x in res[c][n])
                paired = statistics.median(x[m] / y[m] for x, y in zip(res[c][n], base))
                row += f" {med:.2f} | {pct(med / b)} ({pct(paired)}) |"
            print(row)
    print("\nraw (cpu s, wall s):", res)
    # The medians of the per-repetition ratios to no-plugin, as printed in brackets.
    return {n: {c: {metric: statistics.median(x[m] / y[m] for x, y in zip(res[c][n], res["no-plugin"][n]))
                    for m, metric in ((0, "host_cpu_s"), (1, "guest_s"))} for c in others}
            for n in workloads}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--files", type=int, default=100000)
    ap.add_argument("--sf", type=float, default=0.35, help="the DB workload's TPC-H scale factor")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="a list of " + ",".join(WORKLOADS))
    ap.add_argument("--configs", default="no-plugin,insights")
    bench_results.add_out_option(ap, "interception_cost")
    a = ap.parse_args()
    configs = a.configs.split(",")
    workloads = a.workloads.split(",")
    if any(w not in WORKLOADS for w in workloads):
        sys.exit(f"--workloads: a list of {list(WORKLOADS)}")
    if "no-plugin" not in configs or any(c not in CONFIGS for c in configs):
        sys.exit(f"--configs: a list of {CONFIGS} that includes no-plugin")
    rec = bench_results.Recorder("interception_cost", a, out=a.out, keys=["workload", "config"],
                                 baseline="no-plugin")
    res = {c: {n: [] for n in workloads} for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-icost-") as tmp:
        tree = os.path.join(tmp, "tree.tar")
        total = make_tree_tar(tree, a.files)
        print(f"tree: {a.files} files, {total / 2**20:.0f} MiB of file data", file=sys.stderr)
        db, prep = None, {}
        if "db" in workloads:
            template, tbl, prep = icache.prep_mariadb(tmp, a.sf)
            db = (template, tbl)
            print(f"db: {prep.get('version', '?')}, TPC-H sf {a.sf}, .tbl "
                  f"{prep.get('tbl_bytes', 0) / 2**20:.0f} MiB", file=sys.stderr)
        for rep in range(a.reps):
            k = rep % len(configs)
            for c in configs[k:] + configs[:k]:
                for n, v in run_once(c, tree, db, workloads, tmp).items():
                    res[c][n].append(v)
                    rec.rep(workload=n, config=c, rep=rep, host_cpu_s=v[0], guest_s=v[1])
                print(f"[rep {rep}] {c}: " + ", ".join(
                    f"{n} cpu {res[c][n][-1][0]:.2f}s wall {res[c][n][-1][1]:.2f}s"
                    for n in workloads), file=sys.stderr)
    paired = report(res, configs, a.reps, workloads)
    rec.write(summary={"paired_ratio": paired, "tree_file_bytes": total, "db_prep": prep})


if __name__ == "__main__":
    main()
