#!/usr/bin/env python3
"""Sky §6 (information gathering), reproduced: Table 5 (data/metadata accuracy per file system),
Figure 4 (block lifetimes of a synthetic workload, Sky's way and a block device's naive way) and
Figure 5 (block-lifetime CDFs of file-system workloads).

Parts (--parts, default all):
  accuracy   Table 5. varmail (the guest's filebench-varmail-shaped program, which counts the
             4 KiB data chunks it makes the file system write: its `data_chunks`) on an extra
             disk formatted in the guest with each file system (ext2, ext3, ext4, XFS, btrfs).
             vmsight's count is the 4 KiB blocks its insight log calls data on that disk after
             the start mark (a one-block write to a second extra disk once mkfs and mount are
             done). Error = (vmsight - varmail) / varmail, Sky's misclassification error (Sky
             reports its absolute value). File systems rotate in each repetition.
  fig4       Figure 4. The guest writes 80 MB in 20 files of 4 MiB (sync), sleeps 30 s, deletes
             them (sync). `vmsight report --json` gives both curves from the same log: Sky's
             (a block dies at an overwrite, an unlink, a truncate or a discard) and the naive
             one (only an overwrite ends a life), which sees every block still alive.
  fig5       Figure 5. Block-lifetime CDFs of four workloads on an ext4 extra disk, from
             Debian's postmark and bonnie++ and the guest's varmail, plus a tar x / rm -r cycle
             (Sky used four Filebench workloads; Filebench is not packaged by Debian).

Every run's numbers go to bench/results/sky_insights.json (--out); the plots of Figures 4 and 5
to docs/figures/sky-fig4.svg and docs/figures/sky-fig5.svg (matplotlib; skipped with a message when
it is missing).

  bench/sky_insights.py [--parts accuracy,fig4,fig5] [--reps 3] [--fs ext2,ext3,ext4,xfs,btrfs]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import figures  # noqa: E402
import results as bench_results  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))
# Paper figures live apart from docs/plots, which bench/report.py owns (one plot per results file).
PLOTS = figures.FIGURES
MARK = "dd if=/dev/zero of=/dev/vdc bs=4096 count=1 oflag=direct status=none"
VARMAIL = "varmail -d /mnt/v/vm -n 300 -o 20000 -s 11 -j"
# Sky Table 5 (Linux rows): misclassification error in percent.
SKY_TABLE5 = {"ext2": None, "ext3": 0.0, "ext4": 0.0, "xfs": 0.0, "btrfs": 3.9}


def mkfs(fs):
    module = "ext4" if fs.startswith("ext") else fs
    force = "-F" if fs.startswith("ext") else "-f"
    return (f"modprobe {module}; mkfs.{fs} -q {force} /dev/vdb > /dev/null; "
            "mkdir -p /mnt/v; mount /dev/vdb /mnt/v")


def run_vm(script, tmp, mib=1024):
    """One boot with an empty extra disk (vdb) and a mark disk (vdc), insights on. Returns
    (stdout, insight log path)."""
    disk, mark, log = (os.path.join(tmp, n) for n in ("d.img", "mark.img", "ins.jsonl"))
    for p, size in ((disk, mib), (mark, 16)):
        with open(p, "wb") as f:
            f.truncate(size << 20)
    args = [VMSIGHT, "run", "--vcpus", "2", "--mem", "1G", "--disk", disk, "--disk", mark,
            "--insights", log, "--insight-target", "@cmd", "--", "sh", "-c", script]
    p = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError(f"vmsight run failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout, log


def data_blocks_after_mark(log):
    """4 KiB blocks of disk 1 written after the mark that the log calls data, and the
    records' content totals."""
    recs = [json.loads(l) for l in open(log) if l.strip()]
    writes = [r for r in recs if r.get("op") == "write"]
    start = min(r["ts_ns"] for r in writes if r["disk"] == 2)
    blocks = {"data": 0, "metadata": 0, "mixed": 0}
    for r in writes:
        if r["disk"] == 1 and r["ts_ns"] > start:
            blocks[r["content"]] = blocks.get(r["content"], 0) + (r["len"] + 4095) // 4096
    return blocks


def accuracy_once(fs, tmp):
    script = f"set -e; {mkfs(fs)}\n{MARK}\n{VARMAIL}\nsync; umount /mnt/v"
    out, log = run_vm(script, tmp)
    summary = next(json.loads(l) for l in out.splitlines() if l.startswith("{"))
    b = data_blocks_after_mark(log)
    truth = summary["data_chunks"]
    return {"varmail_data_chunks": truth, "vmsight_data_blocks": b["data"],
            "metadata_blocks": b["metadata"], "mixed_blocks": b["mixed"],
            "error_pct": (b["data"] - truth) * 100.0 / truth}


def report_json(log):
    p = subprocess.run([VMSIGHT, "report", "--json", log], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"vmsight report failed: {p.stderr[-1000:]}")
    return json.loads(p.stdout)


def lifetimes(summary):
    """The numbers of one LifetimeSummary a repetition keeps."""
    p50 = (summary.get("all") or {}).get("p50_ns")
    return {"born": summary["born"], "alive": summary["alive"],
            "ended": sum(summary["ended"].values()),
            "p50_s": p50 / 1e9 if p50 is not None else None,
            "cdf": summary["cdf_fine"]}


FIG4 = """set -e; {mkfs}
mkdir /mnt/v/syn
for i in $(seq 1 20); do dd if=/dev/urandom of=/mnt/v/syn/f$i bs=1M count=4 status=none; done
sync; sleep 30
rm -r /mnt/v/syn; sync; umount /mnt/v"""

FIG5 = {
    "varmail": VARMAIL,
    "postmark": ("cd /mnt/v && printf 'set location /mnt/v/pm\\nset number 2000\\n"
                 "set transactions 20000\\nset size 512 65536\\nrun\\nquit\\n' > /tmp/pm.cfg "
                 "&& mkdir -p /mnt/v/pm && postmark /tmp/pm.cfg > /dev/null"),
    "bonnie": "bonnie++ -q -d /mnt/v -s 256 -r 128 -n 8:65536:1024 -u root > /dev/null",
    "tar-rm": ("for i in 1 2 3; do mkdir -p /mnt/v/t && tar xf /root/usr.tar -C /mnt/v/t "
               "&& sync && sleep 5 && rm -r /mnt/v/t && sync; done"),
}
# Untimed set-up before the file system is made: the tar-rm source, /usr/share of the guest.
FIG5_PREP = {"tar-rm": "tar cf /root/usr.tar -C /usr share"}


def fig5_once(w, tmp):
    prep = FIG5_PREP.get(w, "true")
    script = f"set -e; {prep}; {mkfs('ext4')}\n{MARK}\n{FIG5[w]}\nsync; cd /; umount /mnt/v"
    _, log = run_vm(script, tmp, mib=2048)
    return report_json(log)


def plot(res_path):
    """Figures 4 and 5 from the results file (SVG under docs/figures)."""
    plt = figures.pyplot(__file__, res_path)
    if plt is None:
        return
    doc = json.load(open(res_path))
    for fig, part in (("sky-fig4", "fig4"), ("sky-fig5", "fig5")):
        reps = [r for r in doc["reps"] if r.get("part") == part]
        if not reps:
            continue
        f, ax = plt.subplots(figsize=(6, 4))
        for r in reps:
            curves = ([("Sky (overwrite, unlink, truncate, discard)", r["cdf"]),
                       ("naive (overwrites only)", r["naive_cdf"])] if part == "fig4"
                      else [(r["workload"], r["cdf"])])
            for label, cdf in curves:
                label = "%s (rep %d)" % (label, r["rep"])
                ax.step([p[0] for p in cdf], [p[1] for p in cdf], where="post", label=label,
                        alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("block lifetime (s)")
        ax.set_ylabel("fraction of blocks written")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
        what = ("Sky Fig 4: 80 MB written, deleted after 30 s" if part == "fig4"
                else "Sky Fig 5: workloads on ext4")
        ax.set_title("%s (commit %s)" % (what, doc["commit"]), fontsize=8)
        out = os.path.join(PLOTS, fig + ".svg")
        f.savefig(out, metadata={"Date": None})
        plt.close(f)
        print(f"wrote {out}", file=sys.stderr)


def rec_reps(rec):
    """The repetitions recorded so far."""
    return list(rec.reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="accuracy,fig4,fig5")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fs", default="ext2,ext3,ext4,xfs,btrfs")
    ap.add_argument("--workloads", default=",".join(FIG5))
    ap.add_argument("--plot-only", metavar="RESULTS", help=argparse.SUPPRESS)
    bench_results.add_out_option(ap, "sky_insights")
    a = ap.parse_args()
    if a.plot_only:
        plot(a.plot_only)
        return
    parts = a.parts.split(",")
    fss = a.fs.split(",")
    workloads = a.workloads.split(",")
    rec = bench_results.Recorder("sky_insights", a, out=a.out, keys=["part", "fs", "workload"])
    acc = {fs: [] for fs in fss}
    with tempfile.TemporaryDirectory(prefix="bench-sky-") as tmp:
        for rep in range(a.reps):
            if "accuracy" in parts:
                k = rep % len(fss)
                for fs in fss[k:] + fss[:k]:
                    r = accuracy_once(fs, tempfile.mkdtemp(dir=tmp))
                    acc[fs].append(r)
                    rec.rep(part="accuracy", fs=fs, workload="varmail", rep=rep, **r)
                    print(f"[rep {rep}] {fs}: {r}", file=sys.stderr)
            if "fig4" in parts:
                _, log = run_vm(FIG4.format(mkfs=mkfs("ext4")), tempfile.mkdtemp(dir=tmp))
                j = report_json(log)
                sky, naive = lifetimes(j["lifetimes"]), lifetimes(j["lifetimes_naive"])
                rec.rep(part="fig4", fs="ext4", workload="synthetic-80MB", rep=rep,
                        born=sky["born"], sky_alive=sky["alive"], sky_ended=sky["ended"],
                        sky_p50_s=sky["p50_s"], naive_alive=naive["alive"],
                        naive_ended=naive["ended"], cdf=sky["cdf"], naive_cdf=naive["cdf"],
                        unlinks=j["unlinks"])
                print(f"[rep {rep}] fig4: Sky p50 {sky['p50_s']} s, {sky['ended']} of "
                      f"{sky['born']} ended; naive {naive['ended']} ended", file=sys.stderr)
            if "fig5" in parts:
                k = rep % len(workloads)
                for w in workloads[k:] + workloads[:k]:
                    j = fig5_once(w, tempfile.mkdtemp(dir=tmp))
                    lt = lifetimes(j["lifetimes"])
                    rec.rep(part="fig5", fs="ext4", workload=w, rep=rep, born=lt["born"],
                            alive=lt["alive"], ended=lt["ended"], p50_s=lt["p50_s"],
                            cdf=lt["cdf"], data_bytes=j["content"].get("data", {}).get("write_bytes", 0),
                            metadata_bytes=j["content"].get("metadata", {}).get("write_bytes", 0))
                    print(f"[rep {rep}] fig5 {w}: {lt['born']} born, {lt['ended']} ended, "
                          f"p50 {lt['p50_s']} s", file=sys.stderr)
    summary = {}
    if acc and "accuracy" in parts:
        print(f"\n### Sky Table 5: data misclassification per file system "
              f"({time.strftime('%Y-%m-%d')}, varmail -n 300 -o 20000, {a.reps} reps, medians)\n")
        print("| file system | varmail data chunks | vmsight data blocks | error (vmsight) | "
              "every rep | Sky's error |")
        print("|---|---|---|---|---|---|")
        for fs in fss:
            rs = acc[fs]
            err = statistics.median(r["error_pct"] for r in rs)
            sky = SKY_TABLE5.get(fs)
            reps_text = ", ".join("%+.2f" % r["error_pct"] for r in rs)
            sky_text = "—" if sky is None else "%s %%" % sky
            print(f"| {fs} | {statistics.median(r['varmail_data_chunks'] for r in rs):.0f} | "
                  f"{statistics.median(r['vmsight_data_blocks'] for r in rs):.0f} | "
                  f"{err:+.2f} % | {reps_text} | {sky_text} |")
            summary[fs] = {"error_pct_median": err}
    fig = {}
    for part in ("fig4", "fig5"):
        rows = [r for r in rec_reps(rec) if r["part"] == part]
        if not rows:
            continue
        print(f"\n### Sky {'Figure 4' if part == 'fig4' else 'Figure 5'}: block lifetimes "
              f"({a.reps} reps, medians; plot docs/figures/sky-{part}.svg)\n")
        if part == "fig4":
            print("| curve | blocks born | ended | still alive at the end | median lifetime |")
            print("|---|---|---|---|---|")
            m = lambda k: statistics.median(r[k] for r in rows if r[k] is not None)
            print(f"| Sky | {m('born'):.0f} | {m('sky_ended'):.0f} | {m('sky_alive'):.0f} | "
                  f"{m('sky_p50_s'):.1f} s |")
            print(f"| naive (overwrites only) | {m('born'):.0f} | {m('naive_ended'):.0f} | "
                  f"{m('naive_alive'):.0f} | — |")
            fig[part] = {"sky_p50_s": m("sky_p50_s"), "naive_alive": m("naive_alive")}
        else:
            print("| workload | blocks born | ended | alive at the end | median lifetime of "
                  "the ended | CDF at 1 s / 10 s / 100 s |")
            print("|---|---|---|---|---|---|")
            for w in workloads:
                rs = [r for r in rows if r["workload"] == w]
                if not rs:
                    continue
                at = lambda s: statistics.median(
                    next(p[1] for p in r["cdf"] if p[0] == s) for r in rs)
                p50 = [r["p50_s"] for r in rs if r["p50_s"] is not None]
                print(f"| {w} | {statistics.median(r['born'] for r in rs):.0f} | "
                      f"{statistics.median(r['ended'] for r in rs):.0f} | "
                      f"{statistics.median(r['alive'] for r in rs):.0f} | "
                      f"{statistics.median(p50) if p50 else float('nan'):.2f} s | "
                      f"{at(1.0):.2f} / {at(10.0):.2f} / {at(100.0):.2f} |")
    path = rec.write(summary={"accuracy": summary, **fig})
    plot(path)


if __name__ == "__main__":
    main()
