#!/usr/bin/env python3
"""FoxyIdle benchmarks (issues 11 and 33, FoxyTechnique §5, Table 3 and Figs. 7/8/9).

Table 3 shape: `grep -r submit_bio` (foreground) and `updatedb` (background, Debian's plocate)
over two separate trees of real files from the host, on an extra disk with the HDD model, guest
caches dropped before each job. grep's tree is /usr/include (then /usr/share/perl,
/usr/lib/python3) cut to --fg-mib; updatedb's is the same sources cut to --bg-mib, or with
--bg-tree wide the host's /usr cut to files of at most 16 KiB (many directories per MiB, so
that updatedb is the long job, as in the paper: updatedb 87.6 s, grep 14.3 s standalone).
Rows, each in a fresh guest (interleaved over --reps repetitions):
  standalone        grep alone, then updatedb alone (one guest, caches dropped in between)
  concurrent        both at once, nothing marked
  foxyidle-N        both at once, updatedb marked background (--background updatedb), interval N ms
  ionice+bfq        both at once, no FoxyIdle, the guest's own idle class: bfq on the disk and
                    `ionice -c3 updatedb`
  --schedulers [LIST] repeats concurrent and foxyidle-I (I in --sched-intervals) under each guest
  scheduler (default none,mq-deadline,bfq,kyber; the other rows keep the guest's default,
  mq-deadline). --figs adds the Fig. 7/8 rows (sequential foreground dd of a --seq-mib file vs
  a sequential background dd of another; --rand-reads random 4 KiB reads vs the sequential
  background), each with concurrent, foxyidle-I for every --intervals, ionice+bfq and, with
  --schedulers, the sweep under each scheduler; --no-table3 runs only those.
Prints a Markdown table: medians of the guest-timed job times, each relative to its standalone
time, the foreground's disk utilisation and guest CPUs busy, the held reads, the timer error
and host CPU seconds (getrusage of vmsight + QEMU) per run.

  bench/foxyidle.py [--tree-mib 64 | --fg-mib N --bg-mib N] [--bg-tree same|wide]
                    [--intervals 5,10,15,20] [--reps 1] [--schedulers [LIST]]
                    [--sched-intervals 15] [--configs NAMES] [--figs] [--no-table3]
                    [--rand-reads 3000] [--seq-mib 64] [--model hdd[:KEY=VALUE,...]] [--verbose]
                    [--out PATH]
                    [--plot-with RESULTS,...] [--no-plot] [--plot-only RESULTS,...]

Each job's line also carries the guest's own view of it (read around the job in the guest):
the disk's utilisation (/proc/diskstats io_ticks / wall time) and the guest CPUs busy (user +
system + irq ticks / wall time), which say which of the two bounds the job; and, per run, the
idle stage's timer error (Fig. 9: how long after the calculated end of a preemption interval
the stage's timer started held reads) from the stats.

Every run (job times, utilisation, host CPU, held reads, the timer-error histogram) goes to
bench/results/foxyidle.json (--out). The figures (docs/figures/foxyidle-{table3,fig7,fig8,
fig9}.svg: relative times against the interval per guest scheduler, and the timer error per
interval) are drawn from it, pooled with --plot-with's files.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from peers import children_cpu_s, run_vmsight  # noqa: E402
import figures  # noqa: E402
import results as bench_results  # noqa: E402

CACHE = os.path.join(os.environ.get("VMSIGHT_CACHE", os.path.expanduser("~/.cache/vmsight")), "bench")
SOURCES = ["/usr/include", "/usr/share/perl", "/usr/lib/python3"]


def copy_tree(dst, limit, sources=SOURCES, max_file=None):
    """Copies real files from sources into dst until `limit` bytes (only files of at most
    max_file bytes, if given); returns (bytes, files)."""
    total = files = 0
    for src in sources:
        for root, dirs, names in os.walk(src):
            dirs.sort()
            for n in sorted(names):
                p = os.path.join(root, n)
                if not os.path.isfile(p) or os.path.islink(p):
                    continue
                size = os.path.getsize(p)
                if max_file is not None and size > max_file:
                    continue
                if total + size > limit:
                    return total, files
                out = os.path.join(dst, os.path.relpath(p, "/"))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copyfile(p, out)
                total += size
                files += 1
    return total, files


# --bg-tree wide: updatedb's tree is the host's /usr cut to files of at most 16 KiB, i.e. many
# directories and files per MiB, so that updatedb (whose cost is a read per directory and inode
# block, not file contents) is the long job, as in the paper (updatedb 101 s, grep 14 s).
WIDE_SOURCES = ["/usr"]
WIDE_MAX_FILE = 16 << 10


def tree_image(fg_mib, bg_mib, seq_mib, wide=False):
    """An ext4 image with the grep tree t1 (fg_mib) and the updatedb tree t2 (bg_mib; the same
    sources as t1, or the wide tree) and two sequential files (seq1, seq2); cached by sizes."""
    os.makedirs(CACHE, exist_ok=True)
    name = f"{fg_mib}-{seq_mib}" if fg_mib == bg_mib else f"{fg_mib}-{bg_mib}-{seq_mib}"
    name += "-wide" if wide else ""
    img = os.path.join(CACHE, f"foxyidle-tree-{name}.img")
    if os.path.exists(img):
        return img
    with tempfile.TemporaryDirectory(prefix="foxyidle-tree-") as d:
        n, files = copy_tree(os.path.join(d, "t1"), fg_mib << 20)
        if wide:
            n2, files2 = copy_tree(os.path.join(d, "t2"), bg_mib << 20, WIDE_SOURCES, WIDE_MAX_FILE)
        else:
            n2, files2 = copy_tree(os.path.join(d, "t2"), bg_mib << 20)
        for name in ("seq1", "seq2"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(os.urandom(seq_mib << 20))
        # Room for what was copied (blocks, as du counts them) plus a margin, and an inode for
        # every file and directory (the wide tree has more than mkfs's default ratio gives).
        used = int(subprocess.run(["du", "-sm", d], capture_output=True, text=True, check=True).stdout.split()[0])
        inodes = sum(len(ds) + len(fs) for _r, ds, fs in os.walk(d))
        size = used + used // 4 + 128
        tmp = img + ".tmp"
        with open(tmp, "wb") as f:
            f.truncate(size << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-N", str(inodes + inodes // 4 + 1024), "-d", d, tmp], check=True)
        os.rename(tmp, img)
        print(f"# trees: grep {files} files {n >> 20} MiB, updatedb {files2} files {n2 >> 20} MiB",
              file=sys.stderr)
    return img


PREP = ("set -e; mount -o ro /dev/vdb /mnt; cp $(readlink -f $(command -v updatedb)) /tmp/updatedb; "
        "cp /bin/grep /tmp/grep; cp /bin/dd /tmp/bgdd; S=/sys/block/vdb/queue/scheduler; ")
GREP = "/tmp/grep -r submit_bio /mnt/t1 > /dev/null || true"
UPDB = "/tmp/updatedb -l 0 -U /mnt/t2 -o /tmp/db"
SEQ_FG = "dd if=/mnt/seq1 of=/dev/null bs=64k status=none"


def rand_fg(reads):
    """The Fig. 8 foreground: `reads` random 4 KiB reads of seq1."""
    return ("python3 -c \"import os,random;f=os.open('/mnt/seq1',os.O_RDONLY);s=os.fstat(f).st_size;"
            f"r=random.Random(1);[os.pread(f,4096,r.randrange(s//4096)*4096) for _ in range({reads})]\"")


SEQ_BG = "dd if=/mnt/seq2 of=/dev/null bs=64k status=none"


# The guest's own view of a job, read around it: /proc/diskstats' io_ticks of vdb (ms the disk
# had a request in flight) and /proc/stat's busy CPU ticks (user, nice, system, irq, softirq;
# USER_HZ 100). util = io_ms / wall says whether the disk was the bottleneck; cpu = busy / wall
# (in CPUs) whether the guest's CPUs were.
SNAP = ("$(awk '$3==\"vdb\" {print $13}' /proc/diskstats) "
        "$(awk '/^cpu / {print $2+$3+$4+$7+$8}' /proc/stat)")


def timed(name, cmd):
    """Shell that runs cmd and prints `name seconds io_ms busy_ticks`."""
    return (f"( set -- {SNAP}; a=$(date +%s.%N); {cmd}; b=$(date +%s.%N); set -- $1 $2 {SNAP}; "
            f"awk \"BEGIN {{ print \\\"{name}\\\", $b - $a, $3 - $1, $4 - $2 }}\" )")


def scheduler(s):
    return f"modprobe {s} 2>/dev/null || true; echo {s} > $S; " if s else ""


def guest_script(kind, sched, fg, bg, bg_prefix=""):
    drop = "sync; echo 3 > /proc/sys/vm/drop_caches; "
    if kind == "standalone":
        return PREP + scheduler(sched) + drop + timed("FG", fg) + "; " + drop + timed("BG", bg)
    return (PREP + scheduler(sched) + drop + timed("BG", bg_prefix + bg) + " & " + timed("FG", fg) + "; wait")


def parse_times(out):
    """{"FG": (wall s, disk util, guest CPUs busy), "BG": ...} from the guest's lines."""
    t = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] in ("FG", "BG"):
            wall, io_ms, busy = (float(x) for x in parts[1:])
            t[parts[0]] = (wall, io_ms / 1e3 / wall if wall else 0.0, busy / 100 / wall if wall else 0.0)
    return t


def timer_buckets(stats):
    """[[bucket middle µs, count], ...] of the idle stage's timer error over every disk (the
    overflow bucket, >= 100 ms, counted at 100.05 ms)."""
    out = []
    for d in stats.get("disks", []):
        h = (d.get("idle") or {}).get("timer_error") or {}
        out += [[(b["low_us"] + min(b["high_us"], b["low_us"] + 100)) / 2, b["count"]]
                for b in h.get("buckets", [])]
    return sorted(out)


def timer_error(stats):
    """(releases, median ms, p95 ms) of the idle stage's timer error over every disk."""
    buckets = timer_buckets(stats)
    count = sum(n for _mid, n in buckets)

    def q(frac):
        rank, seen = max(1, -(-frac * count // 1)), 0
        for mid, n in buckets:
            seen += n
            if seen >= rank:
                return mid / 1e3
        return None
    return (count, q(0.5), q(0.95)) if count else (0, None, None)


def run_row(img, row, verbose, model="hdd"):
    extra = ["--stage", f"disk-model:{model}"]
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
    releases, te50, te95 = timer_error(r["stats"])
    # The disk model's own count: requests it served and how many were not contiguous with the
    # one before (a seek), which says how sequential the mix reaching the disk was.
    models = [d.get("model") or {} for d in r["stats"].get("disks", [])]
    requests, seeks = sum(m.get("requests", 0) for m in models), sum(m.get("seeks", 0) for m in models)
    (fg, fg_util, fg_cpu), (bg, bg_util, bg_cpu) = t["FG"], t["BG"]
    if verbose:
        print(f"# {row['name']}: fg {fg:.2f} s (disk {fg_util:.2f}, cpu {fg_cpu:.2f}) bg {bg:.2f} s "
              f"(disk {bg_util:.2f}, cpu {bg_cpu:.2f}) held {held} timer {releases}/{te50} ms host cpu {cpu:.1f} s "
              f"model {requests} requests {seeks} seeks",
              file=sys.stderr)
    return {"fg": fg, "bg": bg, "fg_util": fg_util, "fg_cpu": fg_cpu, "bg_util": bg_util, "bg_cpu": bg_cpu,
            "cpu": cpu, "held": held, "timer_releases": releases, "timer_err_p50_ms": te50,
            "timer_err_p95_ms": te95, "timer_buckets": timer_buckets(r["stats"]),
            "model_requests": requests, "model_seeks": seeks}


def rows_for(intervals, schedulers, sched_intervals, figs, table3=True, rand_reads=3000):
    """The rows to run: Table 3's (unless table3 is false), then each figure's (if figs)."""
    rows = []
    t3 = {"fg": GREP, "bg": UPDB, "bg_comm": "updatedb"}
    if table3:
        rows += [dict(t3, name="standalone", kind="standalone"), dict(t3, name="concurrent", kind="concurrent")]
        rows += [dict(t3, name=f"foxyidle-{i}", kind="concurrent", interval=i) for i in intervals]
        rows.append(dict(t3, name="ionice+bfq", kind="concurrent", sched="bfq", bg_prefix="ionice -c3 "))
        for s in schedulers:
            rows.append(dict(t3, name=f"concurrent/{s}", kind="concurrent", sched=s))
            rows += [dict(t3, name=f"foxyidle-{i}/{s}", kind="concurrent", sched=s, interval=i)
                     for i in sched_intervals]
    for fig, fg in (("fig7-seq", SEQ_FG), ("fig8-rand", rand_fg(rand_reads))) if figs else ():
        base = {"fg": fg, "bg": SEQ_BG, "bg_comm": "dd"}
        if fig == "fig7-seq":
            # Both jobs are dd: mark the background one by its own copy's name.
            base = {"fg": fg, "bg": SEQ_BG.replace("dd ", "/tmp/bgdd "), "bg_comm": "bgdd"}
        rows.append(dict(base, name=f"{fig}/standalone", kind="standalone"))
        rows.append(dict(base, name=f"{fig}/concurrent", kind="concurrent"))
        rows += [dict(base, name=f"{fig}/foxyidle-{i}", kind="concurrent", interval=i) for i in intervals]
        rows.append(dict(base, name=f"{fig}/ionice+bfq", kind="concurrent", sched="bfq", bg_prefix="ionice -c3 "))
        # The interval sweep under each guest scheduler (Figs. 7/8 x the guest's policies).
        for s in schedulers:
            rows.append(dict(base, name=f"{fig}/concurrent/{s}", kind="concurrent", sched=s))
            rows += [dict(base, name=f"{fig}/foxyidle-{i}/{s}", kind="concurrent", sched=s, interval=i)
                     for i in intervals]
    return rows


def baseline_of(name):
    """The standalone row a row is compared with: its figure's, or Table 3's."""
    return name.split("/")[0] + "/standalone" if name.startswith("fig") else "standalone"


def ints(text):
    return [int(x) for x in text.split(",") if x]


FIGURES = figures.FIGURES


def sweep_points(reps, group):
    """{scheduler: {interval: (fg ratio, bg ratio)}} of a group's medians against its standalone
    row; interval 0 is concurrent execution (no FoxyIdle), scheduler "default" the guest's own
    (mq-deadline) and "ionice+bfq" the guest's idle class."""
    by = {}
    for r in reps:
        if r.get("group") == group:
            by.setdefault(r["config"], []).append(r)
    if "standalone" not in by:
        return {}
    med = {c: (statistics.median(x["fg_s"] for x in v), statistics.median(x["bg_s"] for x in v))
           for c, v in by.items()}
    fg0, bg0 = med["standalone"]
    out = {}
    for c, (fg, bg) in med.items():
        name, _, sched = c.partition("/")
        if name == "standalone":
            continue
        if name == "ionice+bfq":
            out.setdefault("ionice+bfq", {})[0] = (fg / fg0, bg / bg0)
            continue
        interval = 0 if name == "concurrent" else int(name.split("-")[1])
        out.setdefault(sched or "default", {})[interval] = (fg / fg0, bg / bg0)
    return out


def plot(res_paths):
    """Figs. 7/8 (relative times against the interval, per guest scheduler) and Fig. 9 (the
    timer error per interval) from results files (their repetitions pooled; each row's ratios
    against the standalone row of its own file), as SVG under docs/figures."""
    plt = figures.pyplot(__file__, ",".join(res_paths))
    if plt is None:
        return
    docs = [json.load(open(p)) for p in res_paths]
    commits = ",".join(sorted({d["commit"] for d in docs}))
    for group, fig, what in (("fig7-seq", "foxyidle-fig7", "Fig 7: sequential fg, sequential bg"),
                             ("fig8-rand", "foxyidle-fig8", "Fig 8: random fg, sequential bg"),
                             ("table3", "foxyidle-table3", "Table 3: grep fg, updatedb bg")):
        pts = {}
        for d in docs:
            for sched, by_iv in sweep_points(d["reps"], group).items():
                pts.setdefault(sched, {}).update(by_iv)
        if not pts:
            continue
        f, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for k, (ax, job) in enumerate(zip(axes, ("foreground", "background"))):
            for sched, by_iv in sorted(pts.items()):
                xs = sorted(by_iv)
                if sched == "ionice+bfq":
                    ax.axhline(by_iv[0][k], linestyle=":", color="grey", label="guest ionice -c3 + bfq")
                    continue
                ax.plot(xs, [by_iv[x][k] for x in xs], marker="o", label=f"FoxyIdle, guest {sched}")
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set_xlabel("preemption interval (ms; 0 = concurrent, no FoxyIdle)")
            ax.set_ylabel(f"{job} time / standalone")
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=6)
        f.suptitle(f"FoxyIdle {what} (medians, commit {commits})", fontsize=8)
        f.tight_layout()
        out = os.path.join(FIGURES, fig + ".svg")
        f.savefig(out, metadata={"Date": None})
        plt.close(f)
        print(f"wrote {out}", file=sys.stderr)
    # Fig. 9: the timer error of every interval-end release, per interval (all groups and
    # schedulers of the file pooled), from the stage's histogram (bucket middles).
    per_iv = {}
    for r in (r for d in docs for r in d["reps"]):
        name = r["config"].split("/")[0]
        if name.startswith("foxyidle-"):
            vals = per_iv.setdefault(int(name.split("-")[1]), [])
            for mid_us, n in r.get("timer_error_us") or []:
                vals += [mid_us / 1e3] * int(n)
    per_iv = {k: v for k, v in per_iv.items() if v}
    if per_iv:
        f, ax = plt.subplots(figsize=(6, 3.6))
        ks = sorted(per_iv)
        ax.boxplot([per_iv[k] for k in ks], labels=[str(k) for k in ks], showfliers=False)
        ax.set_xlabel("preemption interval (ms)")
        ax.set_ylabel("timer error (ms): release - calculated end")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"FoxyIdle Fig 9: timer error, {sum(map(len, per_iv.values()))} releases "
                     f"(commit {commits})", fontsize=8)
        out = os.path.join(FIGURES, "foxyidle-fig9.svg")
        f.savefig(out, metadata={"Date": None})
        plt.close(f)
        print(f"wrote {out}", file=sys.stderr)



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree-mib", type=int, default=64, help="size of each tree (both jobs)")
    ap.add_argument("--fg-mib", type=int, help="size of grep's tree (default --tree-mib)")
    ap.add_argument("--bg-mib", type=int, help="size of updatedb's tree (default --tree-mib)")
    ap.add_argument("--bg-tree", choices=["same", "wide"], default="same",
                    help="updatedb's tree: the same sources as grep's, or wide (/usr's files <= 16 KiB)")
    ap.add_argument("--seq-mib", type=int, default=64)
    ap.add_argument("--model", default="hdd",
                    help="the disk model (e.g. hdd:mbps=40: under TCG a dd of the 150 MB/s default is CPU-bound)")
    ap.add_argument("--intervals", default="5,10,15,20")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--schedulers", nargs="?", const="none,mq-deadline,bfq,kyber", default="",
                    help="guest schedulers for the concurrent and FoxyIdle rows (all four without a list)")
    ap.add_argument("--sched-intervals", default="15", help="FoxyIdle intervals of the scheduler rows")
    ap.add_argument("--configs", help="only these rows (comma-separated names) and the standalone rows they compare with")
    ap.add_argument("--figs", action="store_true")
    ap.add_argument("--rand-reads", type=int, default=3000, help="random 4 KiB reads of Fig. 8's foreground")
    ap.add_argument("--no-table3", action="store_true", help="only the figures' rows (with --figs)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="do not draw docs/figures/foxyidle-*.svg")
    ap.add_argument("--plot-with", metavar="RESULTS,...", default="",
                    help="other results files whose rows join this run's in the figures")
    ap.add_argument("--plot-only", metavar="RESULTS,...", help="only draw the figures from these results files")
    bench_results.add_out_option(ap, "foxyidle")
    a = ap.parse_args()
    if a.plot_only:
        plot(a.plot_only.split(","))
        return
    fg_mib, bg_mib = a.fg_mib or a.tree_mib, a.bg_mib or a.tree_mib
    # Rows: the Table 3 rows (group table3) and each figure's rows (group fig7-seq, fig8-rand),
    # each against its group's standalone row, as printed.
    rec = bench_results.Recorder("foxyidle", a, out=a.out, keys=["group", "config"], baseline="standalone")
    img = tree_image(fg_mib, bg_mib, a.seq_mib, a.bg_tree == "wide")
    rows = rows_for(ints(a.intervals), [x for x in a.schedulers.split(",") if x], ints(a.sched_intervals), a.figs,
                    not a.no_table3, a.rand_reads)
    if a.configs:
        keep = set(a.configs.split(","))
        kept = [r for r in rows if r["name"] in keep]
        groups = {baseline_of(r["name"]) for r in kept}
        rows = [r for r in rows if r in kept or r["name"] in groups]
    results = {r["name"]: [] for r in rows}
    for rep in range(a.reps):
        for row in rows:  # interleaved: one of each configuration per repetition
            results[row["name"]].append(run_row(img, row, a.verbose, a.model))
            r = results[row["name"]][-1]
            fig, _, rest = row["name"].partition("/")
            group, config = (fig, rest) if fig.startswith("fig") else ("table3", row["name"])
            rec.rep(group=group, config=config, rep=rep, fg_s=r["fg"], bg_s=r["bg"], host_cpu_s=r["cpu"],
                    held=r["held"], fg_disk_util=r["fg_util"], fg_guest_cpus=r["fg_cpu"],
                    bg_disk_util=r["bg_util"], bg_guest_cpus=r["bg_cpu"], timer_releases=r["timer_releases"],
                    timer_err_p50_ms=r["timer_err_p50_ms"], timer_err_p95_ms=r["timer_err_p95_ms"],
                    timer_error_us=r["timer_buckets"], model_requests=r["model_requests"],
                    model_seeks=r["model_seeks"])
    keys = ("fg", "bg", "cpu", "held", "fg_util", "fg_cpu", "bg_util", "bg_cpu", "timer_releases")
    med = {k: {m: statistics.median(x[m] for x in v) for m in keys} for k, v in results.items()}
    for k, v in results.items():
        errs = [x["timer_err_p50_ms"] for x in v if x["timer_err_p50_ms"] is not None]
        med[k]["timer_err_p50_ms"] = statistics.median(errs) if errs else None
    print(f"machine load: {os.getloadavg()[0]:.2f}; date {time.strftime('%Y-%m-%d %H:%M')}; "
          f"reps {a.reps}; trees grep {fg_mib} MiB, updatedb {bg_mib} MiB ({a.bg_tree}); disk model {a.model}")
    print("| configuration | fg s | bg s | fg / standalone | bg / standalone | fg disk util | fg guest CPUs "
          "| held | timer error p50 ms | host CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        k = row["name"]
        base, m = med[baseline_of(k)], med[k]
        te = "-" if m["timer_err_p50_ms"] is None else f"{m['timer_err_p50_ms']:.2f}"
        print(f"| {k} | {m['fg']:.2f} | {m['bg']:.2f} | {m['fg'] / base['fg']:.2f}x | "
              f"{m['bg'] / base['bg']:.2f}x | {m['fg_util']:.2f} | {m['fg_cpu']:.2f} | {int(m['held'])} | {te} | "
              f"{m['cpu']:.1f} |")
    path = rec.write(summary={"medians": med})
    if not a.no_plot:
        plot([path or a.out] + [p for p in a.plot_with.split(",") if p])

if __name__ == "__main__":
    main()
