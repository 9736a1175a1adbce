#!/usr/bin/env python3
"""FoxyIdle benchmarks (issue 11, FoxyTechnique §5, Table 3 and Figs. 7/8).

Table 3 shape: `grep -r submit_bio` (foreground) and `updatedb` (background, Debian's plocate)
over two separate copies of a tree of real files (the host's /usr/include and /usr/share/perl,
cut to --tree-mib), on an extra disk with the HDD model, guest caches dropped before each run.
Rows, each in a fresh guest (interleaved over --reps repetitions):
  standalone        grep alone, then updatedb alone (one guest, caches dropped in between)
  concurrent        both at once, nothing marked
  foxyidle-N        both at once, updatedb marked background (--background updatedb), interval N ms
  ionice+bfq        both at once, no FoxyIdle, the guest's own idle class: bfq on the disk and
                    `ionice -c3 updatedb`
  --schedulers repeats concurrent and foxyidle-15 under each guest scheduler (none,
  mq-deadline, bfq, kyber); --figs adds Fig. 7/8 rows (sequential foreground vs sequential
  background; random foreground vs sequential background; foreground file --seq-mib).
Prints a Markdown table: medians of the guest-timed job times, each relative to its standalone
time, and host CPU seconds (getrusage of vmsight + QEMU) per run.

  bench/foxyidle.py [--tree-mib 64] [--intervals 5,10,15,20] [--reps 1] [--schedulers]
                    [--figs] [--seq-mib 64] [--verbose] [--out PATH]

Every run (job times, host CPU, held reads) goes to bench/results/foxyidle.json (--out).
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from peers import children_cpu_s, run_vmsight  # noqa: E402
import results as bench_results  # noqa: E402

CACHE = os.path.join(os.environ.get("VMSIGHT_CACHE", os.path.expanduser("~/.cache/vmsight")), "bench")
SOURCES = ["/usr/include", "/usr/share/perl", "/usr/lib/python3"]


def copy_tree(dst, limit):
    """Copies real files from SOURCES into dst until `limit` bytes; returns (bytes, files)."""
    total = files = 0
    for src in SOURCES:
        for root, _dirs, names in os.walk(src):
            for n in sorted(names):
                p = os.path.join(root, n)
                if not os.path.isfile(p) or os.path.islink(p):
                    continue
                size = os.path.getsize(p)
                if total + size > limit:
                    return total, files
                out = os.path.join(dst, os.path.relpath(p, "/"))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copyfile(p, out)
                total += size
                files += 1
    return total, files


def tree_image(mib, seq_mib):
    """An ext4 image with two copies of the tree (t1 for grep, t2 for updatedb) and two
    sequential files (seq1, seq2); cached by size."""
    os.makedirs(CACHE, exist_ok=True)
    img = os.path.join(CACHE, f"foxyidle-tree-{mib}-{seq_mib}.img")
    if os.path.exists(img):
        return img
    with tempfile.TemporaryDirectory(prefix="foxyidle-tree-") as d:
        n, files = copy_tree(os.path.join(d, "t1"), mib << 20)
        shutil.copytree(os.path.join(d, "t1"), os.path.join(d, "t2"))
        for name in ("seq1", "seq2"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(os.urandom(seq_mib << 20))
        size = 2 * mib + 2 * seq_mib + 128 + mib // 2
        tmp = img + ".tmp"
        with open(tmp, "wb") as f:
            f.truncate(size << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", d, tmp], check=True)
        os.rename(tmp, img)
        print(f"# tree: {files} files, {n >> 20} MiB per copy", file=sys.stderr)
    return img


PREP = ("set -e; mount -o ro /dev/vdb /mnt; cp $(readlink -f $(command -v updatedb)) /tmp/updatedb; "
        "cp /bin/grep /tmp/grep; cp /bin/dd /tmp/bgdd; S=/sys/block/vdb/queue/scheduler; ")
GREP = "/tmp/grep -r submit_bio /mnt/t1 > /dev/null || true"
UPDB = "/tmp/updatedb -l 0 -U /mnt/t2 -o /tmp/db"
SEQ_FG = "dd if=/mnt/seq1 of=/dev/null bs=64k status=none"
RAND_FG = ("python3 -c \"import os,random;f=os.open('/mnt/seq1',os.O_RDONLY);s=os.fstat(f).st_size;"
           "r=random.Random(1);[os.pread(f,4096,r.randrange(s//4096)*4096) for _ in range(3000)]\"")
SEQ_BG = "dd if=/mnt/seq2 of=/dev/null bs=64k status=none"


def timed(name, cmd):
    """Shell that runs cmd and prints `name seconds`."""
    return f"( a=$(date +%s.%N); {cmd}; b=$(date +%s.%N); awk \"BEGIN {{ print \\\"{name}\\\", $b - $a }}\" )"


def scheduler(s):
    return f"modprobe {s} 2>/dev/null || true; echo {s} > $S; " if s else ""


def guest_script(kind, sched, fg, bg, bg_prefix=""):
    drop = "sync; echo 3 > /proc/sys/vm/drop_caches; "
    if kind == "standalone":
        return PREP + scheduler(sched) + drop + timed("FG", fg) + "; " + drop + timed("BG", bg)
    return (PREP + scheduler(sched) + drop + timed("BG", bg_prefix + bg) + " & " + timed("FG", fg) + "; wait")


def parse_times(out):
    t = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("FG", "BG"):
            t[parts[0]] = float(parts[1])
    return t


def run_row(img, row, verbose):
    extra = ["--stage", "disk-model:hdd"]
    if row.get("interval"):
        extra += ["--background", row["bg_comm"], "--idle-interval", str(row["interval"])]
    script = guest_script(row["kind"], row.get("sched"), row["fg"], row["bg"], row.get("bg_prefix", ""))
    cpu0 = children_cpu_s()
    r = run_vmsight(["sh", "-c", script], extra=extra, disks=[img + ",ro"], disk_opts="")
    cpu = children_cpu_s() - cpu0
    t = parse_times(r["stdout"])
    if r["status"] != 0 or "FG" not in t or "BG" not in t:
        sys.exit(f"run {row['name']} failed ({r['status']}): {r['stderr'][-2000:]}\n{r['stdout'][-2000:]}")
    held = 0
    for d in r["stats"].get("disks", []):
        held += (d.get("idle") or {}).get("held", 0)
    if verbose:
        print(f"# {row['name']}: fg {t['FG']:.2f} s bg {t['BG']:.2f} s held {held} cpu {cpu:.1f} s", file=sys.stderr)
    return {"fg": t["FG"], "bg": t["BG"], "cpu": cpu, "held": held}


def rows_for(intervals, schedulers, figs):
    table3 = {"fg": GREP, "bg": UPDB, "bg_comm": "updatedb"}
    rows = [dict(table3, name="standalone", kind="standalone"),
            dict(table3, name="concurrent", kind="concurrent")]
    rows += [dict(table3, name=f"foxyidle-{i}", kind="concurrent", interval=i) for i in intervals]
    rows.append(dict(table3, name="ionice+bfq", kind="concurrent", sched="bfq", bg_prefix="ionice -c3 "))
    for s in schedulers:
        rows.append(dict(table3, name=f"concurrent/{s}", kind="concurrent", sched=s))
        rows.append(dict(table3, name=f"foxyidle-15/{s}", kind="concurrent", sched=s, interval=15))
    if figs:
        for fig, fg in (("fig7-seq", SEQ_FG), ("fig8-rand", RAND_FG)):
            base = {"fg": fg, "bg": SEQ_BG, "bg_comm": "dd"}
            if fig == "fig7-seq":
                # Both jobs are dd: mark the background one by its own copy's name.
                base = {"fg": fg, "bg": SEQ_BG.replace("dd ", "/tmp/bgdd "), "bg_comm": "bgdd"}
            rows.append(dict(base, name=f"{fig}/standalone", kind="standalone"))
            rows.append(dict(base, name=f"{fig}/concurrent", kind="concurrent"))
            rows += [dict(base, name=f"{fig}/foxyidle-{i}", kind="concurrent", interval=i) for i in intervals]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree-mib", type=int, default=64)
    ap.add_argument("--seq-mib", type=int, default=64)
    ap.add_argument("--intervals", default="5,10,15,20")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--schedulers", action="store_true")
    ap.add_argument("--figs", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    bench_results.add_out_option(ap, "foxyidle")
    a = ap.parse_args()
    # Rows: the Table 3 rows (group table3) and each figure's rows (group fig7-seq, fig8-rand),
    # each against its group's standalone row, as printed.
    rec = bench_results.Recorder("foxyidle", a, out=a.out, keys=["group", "config"], baseline="standalone")
    img = tree_image(a.tree_mib, a.seq_mib)
    intervals = [int(x) for x in a.intervals.split(",") if x]
    rows = rows_for(intervals, ["none", "mq-deadline", "bfq", "kyber"] if a.schedulers else [], a.figs)
    results = {r["name"]: [] for r in rows}
    for rep in range(a.reps):
        for row in rows:  # interleaved: one of each configuration per repetition
            results[row["name"]].append(run_row(img, row, a.verbose))
            r = results[row["name"]][-1]
            fig, _, rest = row["name"].partition("/")
            group, config = (fig, rest) if fig.startswith("fig") else ("table3", row["name"])
            rec.rep(group=group, config=config, rep=rep, fg_s=r["fg"], bg_s=r["bg"], host_cpu_s=r["cpu"],
                    held=r["held"])
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("fg", "bg", "cpu", "held")}
           for k, v in results.items()}
    print(f"machine load: {os.getloadavg()[0]:.2f}; date {time.strftime('%Y-%m-%d %H:%M')}; "
          f"reps {a.reps}; tree {a.tree_mib} MiB per copy; HDD model")
    print("| configuration | fg s | bg s | fg / standalone | bg / standalone | held | host CPU s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        k = row["name"]
        base = med[k.split("/")[0] + "/standalone"] if k.startswith("fig") else med["standalone"]
        m = med[k]
        print(f"| {k} | {m['fg']:.2f} | {m['bg']:.2f} | {m['fg'] / base['fg']:.2f}x | "
              f"{m['bg'] / base['bg']:.2f}x | {int(m['held'])} | {m['cpu']:.1f} |")
    rec.write(summary={"medians": med})


if __name__ == "__main__":
    main()
