#!/usr/bin/env python3
"""Gamma-Ray's lazy loading of file-system metadata (DS-VMI §VI-B, Table V): vmsight's own
private memory at start-up and at its peak, with the streamed disks' indexes in memory (eager,
the default) and with `--stream-lazy`, and the share of the file tree the lazy index loaded.

  bench/stream_lazy.py [--reps N] [--workloads bonnie,postmark,andrew,install,update]
                       [--tree-files N | --tree DIR] [--configs eager,lazy] [--out PATH]

The guest gets an extra 8 GiB disk holding a large tree (by default 200 000 files of 0-4 KiB
with /usr/share-like names in 4 000 directories, made once per run with `mkfs.ext4 -d`; or a
copy of a host directory with --tree), mounted at /mnt; each run starts from a fresh copy of
it. One VM per workload, configuration and repetition, configurations interleaved:

- bonnie:   bonnie++ -s 512 -r 256 -n 8 -f in /mnt/bonnie (Table V's bonnie++)
- postmark: Debian's postmark with Gamma-Ray's configuration (bench/lib/gammaray.py) in /mnt/pm
- andrew:   untar a source tree into /mnt/andrew, stat, grep and byte-compile it
- install:  dpkg -i of real Debian packages (bench/lib/gammaray.py, `--install-set`, from a
            read-only disk) on the root disk (SW install)
- update:   append a line to every 50th file of the existing tree (day-to-day updates)

Per run: RssAnon of the vmsight process (its private memory; QEMU and guest RAM are not in
it) when the guest is up and about to start the workload ("start-up"), its maximum sampled
every 0.1 s ("peak"), the guest's time for the workload, and from --stats-json per disk the
index's resident and peak bytes, the sections loaded and evicted, the load time and the in-use
inodes whose section was loaded (over all inodes: the share of the tree loaded). The table
gives medians and lazy/eager ratios beside the paper's Table V. Nothing is asserted; every
run goes to bench/results/stream_lazy.json (--out).
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import gammaray  # noqa: E402
import peers  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = peers.VMSIGHT
CONFIGS = {"eager": [], "lazy": ["--stream-lazy"], "no-stream": ["--no-stream"]}
PAPER = {  # Table V: file tree loaded, old peak (MB), peak with lazy loading (MB)
    "bonnie": ("4.7%", 1043, 766),
    "andrew": ("17.2%", 630, 357),
    "postmark": ("5.2%", 739, 562),
    "install": ("11.3%", 708, 533),
}

PREPARE = {
    "postmark": "",
    "install": "mkdir -p /media/debs && mount -o ro /dev/vdc /media/debs",
}

WORK = {
    "bonnie": "mkdir /mnt/bonnie && bonnie++ -d /mnt/bonnie -s 512 -r 256 -n 8 -f -u root -q >/dev/null 2>&1",
    "postmark": gammaray.postmark_script("/mnt/pm"),
    "andrew": r"""mkdir /mnt/andrew
tar -C /usr/lib/python3.11 --exclude=__pycache__ -cf - email json http logging xml urllib asyncio unittest concurrent multiprocessing importlib | tar -C /mnt/andrew -xf -
find /mnt/andrew -type f -exec stat -c '%s %Y' {} + >/dev/null
grep -r 'def ' /mnt/andrew >/dev/null
python3 -m compileall -q /mnt/andrew >/dev/null""",
    "install": "dpkg -i /media/debs/*.deb >/dev/null",
    "update": "find /mnt/tree -type f | awk 'NR % 50 == 0' | while read -r f; do echo x >> \"$f\"; done",
}

SCRIPT = r"""set -e
mount /dev/vdb /mnt
{prepare}
sync
echo READY
sleep 3
s=$(date +%s%N)
{work}
sync
e=$(date +%s%N)
echo "RESULT $((e-s))"
sleep 2
"""

# /usr/share-like name parts: long, often repeated across directories.
PARTS = ["LC_MESSAGES", "index", "README", "changelog", "copyright", "symbolic", "scalable",
         "apps", "actions", "locale", "man1", "gcloud_alpha", "deployment-manager", "x-office",
         "document", "spreadsheet", "help-about", "16x16", "32x32", "48x48", "mimetypes"]


def make_tree(root, n_files, seed=7):
    """n_files files of 0-4 KiB in directories of 50, two levels deep, names from PARTS."""
    rng = random.Random(seed)
    per_dir = 50
    made = 0
    d = 0
    while made < n_files:
        top = os.path.join(root, f"{rng.choice(PARTS)}-{d // 40}")
        path = os.path.join(top, f"{rng.choice(PARTS)}_{d}")
        os.makedirs(path, exist_ok=True)
        for k in range(min(per_dir, n_files - made)):
            name = f"{rng.choice(PARTS)}-{rng.choice(PARTS)}.{k}.{rng.choice(['png', 'mo', 'gz', 'html'])}"
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"t" * rng.randint(0, 4096))
            made += 1
        d += 1


def make_image(tmp, a):
    """The populated disk: mkfs.ext4 -d of the tree (under /tree on the disk)."""
    src = os.path.join(tmp, "src")
    tree = os.path.join(src, "tree")
    if a.tree:
        os.makedirs(src)
        subprocess.run(["cp", "-a", a.tree, tree], check=True)
    else:
        os.makedirs(tree)
        make_tree(tree, a.tree_files)
    img = os.path.join(tmp, "populated.img")
    subprocess.run(["truncate", "-s", "8G", img], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", str(max(2 * a.tree_files, 500_000)), "-d", src, img],
                   check=True)
    shutil.rmtree(src)
    return img


def anon_kib(pid):
    return peers.rss_kib(pid, "RssAnon:")


def run_one(img, work, extra, timeout, debs=None):
    """One VM: returns (start-up KiB, peak KiB, guest seconds, --stats-json)."""
    with tempfile.TemporaryDirectory(prefix="bench-lazy-") as wd:
        stats = os.path.join(wd, "stats.json")
        disk = os.path.join(wd, "d.img")
        peers.sparse_copy(img, disk)
        script = SCRIPT.format(prepare=PREPARE.get(work, ""), work=WORK[work])
        args = [VMSIGHT, "run", "--name", f"bench-lazy-{os.getpid()}", "--mem", "1024M",
                "--stats-json", stats, *extra, "--disk", disk + ",direct",
                *(["--disk", debs + ",ro"] if debs else []), "--", "bash", "-c", script]
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        mem = {"peak": 0, "startup": None}

        def sample():
            while p.poll() is None:
                mem["peak"] = max(mem["peak"], anon_kib(p.pid))
                time.sleep(0.1)
        threading.Thread(target=sample, daemon=True).start()
        err = []
        threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True).start()
        watchdog = threading.Timer(timeout, p.kill)
        watchdog.start()
        guest_ns = None
        for line in p.stdout:
            if line.strip() == "READY" and mem["startup"] is None:
                mem["startup"] = anon_kib(p.pid)
            m = re.match(r"RESULT (\d+)", line)
            if m:
                guest_ns = int(m.group(1))
        watchdog.cancel()
        if p.wait() != 0 or guest_ns is None:
            raise RuntimeError(f"{work} {extra}: exit {p.returncode}: {''.join(err)[-2000:]}")
        st = json.load(open(stats)) if os.path.exists(stats) else {}
        return mem["startup"], mem["peak"], guest_ns / 1e9, st


def index_counters(st):
    """Sums of the streamed disks' index counters from --stats-json."""
    keys = ["index_resident_bytes", "index_peak_resident_bytes", "index_sections_loaded",
            "index_sections_evicted", "index_load_ns", "index_inodes", "index_inodes_loaded"]
    out = dict.fromkeys(keys, 0)
    for d in st.get("disks", []):
        ix = (d.get("stream") or {}).get("index") or {}
        for k in keys:
            out[k] += ix.get(k.removeprefix("index_"), 0) or 0
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def mib(k):
    return f"{k / 1024:.1f}" if k is not None else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per workload and configuration (default 3)")
    ap.add_argument("--workloads", default="bonnie,postmark,andrew,install,update")
    ap.add_argument("--configs", default="eager,lazy", help=f"of {','.join(CONFIGS)} (default eager,lazy)")
    ap.add_argument("--tree-files", type=int, default=200_000, help="files of the generated tree (default 200000)")
    ap.add_argument("--tree", default=None, metavar="DIR", help="copy this host directory instead of generating")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per VM (default 3600)")
    ap.add_argument("--install-set", choices=sorted(gammaray.INSTALL_SETS), default="small",
                    help="packages the install workload installs (default small)")
    bench_results.add_out_option(ap, "stream_lazy")
    a = ap.parse_args()
    works = [w for w in a.workloads.split(",") if w]
    configs = [c for c in a.configs.split(",") if c]
    for w in works:
        if w not in WORK:
            ap.error(f"unknown workload {w} (of {','.join(WORK)})")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c} (of {','.join(CONFIGS)})")
    rec = bench_results.Recorder("stream_lazy", a, out=a.out, keys=["workload", "config"], baseline="eager",
                                 metrics=["startup_anon_kib", "peak_anon_kib", "tree_loaded_pct",
                                          "index_peak_bytes", "guest_s"])
    res = {(w, c): [] for w in works for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-stream-lazy-") as tmp:
        t = time.monotonic()
        img = make_image(tmp, a)
        debs = gammaray.debs_disk(tmp, a.install_set)[0] if "install" in works else None
        print(f"populated disk made in {time.monotonic() - t:.0f} s", file=sys.stderr)
        for rep in range(a.reps):
            for w in works:
                order = configs if rep % 2 == 0 else configs[::-1]
                for c in order:
                    start, peak, guest_s, st = run_one(img, w, CONFIGS[c], a.timeout,
                                                       debs if w == "install" else None)
                    ix = index_counters(st)
                    loaded = 100.0 * ix["index_inodes_loaded"] / ix["index_inodes"] if ix["index_inodes"] else None
                    row = dict(workload=w, config=c, rep=rep, startup_anon_kib=start, peak_anon_kib=peak,
                               guest_s=guest_s, tree_loaded_pct=loaded,
                               index_resident_bytes=ix["index_resident_bytes"],
                               index_peak_bytes=ix["index_peak_resident_bytes"],
                               sections_loaded=ix["index_sections_loaded"],
                               sections_evicted=ix["index_sections_evicted"],
                               load_s=ix["index_load_ns"] / 1e9, inodes=ix["index_inodes"])
                    rec.rep(**row)
                    res[(w, c)].append(row)
                    print(f"[rep {rep}] {w} {c}: start-up {mib(start)} MiB, peak {mib(peak)} MiB, "
                          f"guest {guest_s:.1f} s, tree loaded {loaded if loaded is None else round(loaded, 1)}%, "
                          f"{ix['index_sections_loaded']} sections loaded", file=sys.stderr)

    def m(w, c, k):
        return med([r[k] for r in res.get((w, c), [])])

    print(f"\n### Lazy loading of file-system metadata ({time.strftime('%Y-%m-%d')}, "
          f"`bench/stream_lazy.py --reps {a.reps}`)\n")
    print("vmsight's private memory (RssAnon, MiB, medians) with the indexes in memory (eager) and "
          "with `--stream-lazy`; tree loaded = in-use inodes whose index section the lazy run loaded:\n")
    print("| workload | tree loaded | start-up eager | start-up lazy | lazy / eager | peak eager | peak lazy "
          "| lazy / eager | index peak eager / lazy (MiB) | guest s eager / lazy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for w in works:
        se, sl = m(w, "eager", "startup_anon_kib"), m(w, "lazy", "startup_anon_kib")
        pe, pl = m(w, "eager", "peak_anon_kib"), m(w, "lazy", "peak_anon_kib")
        tl = m(w, "lazy", "tree_loaded_pct")
        ie, il = m(w, "eager", "index_peak_bytes"), m(w, "lazy", "index_peak_bytes")
        ge, gl = m(w, "eager", "guest_s"), m(w, "lazy", "guest_s")
        summary[w] = {"startup_ratio": sl / se if se and sl else None,
                      "peak_ratio": pl / pe if pe and pl else None, "tree_loaded_pct": tl}
        f1 = (lambda v: f"{v:.1f}" if v is not None else "-")
        print(f"| {w} | {f1(tl)}% | {mib(se)} | {mib(sl)} | {ratio(sl, se)} | {mib(pe)} | {mib(pl)} | "
              f"{ratio(pl, pe)} | {f1(ie and ie / 2**20)} / {f1(il and il / 2**20)} | {f1(ge)} / {f1(gl)} |")
    if "no-stream" in configs:
        print("\nWithout streaming (`--no-stream`), medians (MiB): "
              + ", ".join(f"{w} start-up {mib(m(w, 'no-stream', 'startup_anon_kib'))}, "
                          f"peak {mib(m(w, 'no-stream', 'peak_anon_kib'))}" for w in works))
    print("\nGamma-Ray (paper, Table V; Redis and the inference engine, not re-runnable here):\n")
    print("| experiment | file tree loaded | old peak (MB) | peak (MB) | ratio |")
    print("|---|---|---|---|---|")
    for w, (tl, old, new) in PAPER.items():
        print(f"| {w} | {tl} | {old} | {new} | {new / old:.2f}x |")
    print("\nPaper: start-up 114 MB instead of 392 MB (0.29x).")
    rec.write(summary=summary)


if __name__ == "__main__":
    main()
