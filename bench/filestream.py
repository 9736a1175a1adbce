#!/usr/bin/env python3
"""File-update streaming benchmarks (issue 5, Gamma-Ray §V): event latency, guest slowdown,
index size and crawl speed. Baselines run in the same invocation; results are printed as
Markdown with ratios. Nothing is asserted.

  bench/filestream.py [--reps N] [--lines N] [--skip latency,slowdown,crawl] [--mem MIB] [--disk-gib N]
                      [--install-set small|paper] [--out PATH]

- latency: a guest appends lines carrying its CLOCK_REALTIME (ns) to a file, with `sync` after
  each line and without (default writeback); a `vmsight watch --json --data` subscriber on the
  host notes when each line first shows up in a `write` event. The guest-host clock offset is
  measured first with stdin/stdout round trips (the sample with the smallest round trip wins)
  and subtracted. Reports p50/p99/max.
- slowdown: the same guest workloads with streaming (default), with `--no-stream` (the
  baseline: the tap is installed but idle) and with `--stream-queue-mb 1` (overload control
  drops data writes when the queue fills), in a guest with `--mem` MiB of RAM (default 512) so
  the big workloads exceed it as in Gamma-Ray §V-B: bonnie++ with its default sizes (a file of
  twice the guest's RAM, -f), Debian's postmark 1.53 with Gamma-Ray's configuration (5000 files
  of 512 B-328 KB, 20 000 transactions, 4 KiB reads and writes), an Andrew-like phase workload
  (untar a source tree, stat, grep, byte-compile it with python3 -m compileall: the guest has
  no C compiler, so Andrew's Make phase is a stand-in) and a software install: `dpkg -i` of
  real Debian packages (`--install-set small|paper`, downloaded on the host with its own apt
  sources and cached, given to the guest on a read-only disk; documentation, fonts and data
  packages, since the guest has no network to fetch server packages' dependencies) onto the
  root disk. Guest-side wall time.
- crawl: bench/fsview-crawl.sh on the default root image, plus a crawl of an image made with
  `mkfs.ext4 -d` from the host's /usr/share (bytes per inode, seconds per GB of used space).

Every measurement (each line's latency, each workload's time per configuration and repetition,
each crawl) goes to bench/results/filestream.json (--out).
"""
import argparse
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
import gammaray  # noqa: E402
import peers  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = peers.VMSIGHT


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


# --------------------------------------------------------------------------------------------
# Latency

LAT_SCRIPT = r"""
set -e
mkdir -p /srv/lat
echo READY
for i in $(seq 1 {rounds}); do read x; date +%s%N; done
for i in $(seq 1 {lines}); do echo "L sync $i $(date +%s%N)" >> /srv/lat/sync.log; sync; sleep 0.2; done
for i in $(seq 1 {lines}); do echo "L async $i $(date +%s%N)" >> /srv/lat/async.log; sleep 0.2; done
# Default writeback: wait for the kernel's own flush (dirty_expire 30 s, commit 5 s).
sleep {settle}
echo DONE
"""

LINE_RE = re.compile(rb"L (sync|async) (\d+) (\d+)\n")


def latency_run(a):
    """Runs the latency benchmark and returns rows of (mode, n, p50, p99, max) in ms, the guest
    clock offset and its error (ms), and every line's latency per mode (ms)."""
    name = f"bench-lat-{os.getpid()}"
    rounds = 15
    script = LAT_SCRIPT.format(rounds=rounds, lines=a.lines, settle=40)
    vm = subprocess.Popen([VMSIGHT, "run", "--name", name, "--stream-data", "--", "bash", "-c", script],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    cond = threading.Condition()

    def reader():
        for line in vm.stdout:
            with cond:
                lines.append((time.time_ns(), line.decode(errors="replace").strip()))
                cond.notify_all()
    threading.Thread(target=reader, daemon=True).start()

    def expect(pred, timeout):
        deadline = time.time() + timeout
        with cond:
            while True:
                while lines:
                    t, l = lines.pop(0)
                    if pred(l):
                        return t, l
                left = deadline - time.time()
                if left <= 0 or vm.poll() is not None:
                    raise RuntimeError("guest did not answer; stderr: " + vm.stderr.read(4000).decode(errors="replace"))
                cond.wait(min(left, 1))

    expect(lambda l: l == "READY", 300)
    watch = subprocess.Popen([VMSIGHT, "watch", "--json", "--data", "--vm", name, "*:*:/srv/lat/*"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = {}  # (mode, i) -> (host receive ns, guest stamp ns)

    def watcher():
        for raw in watch.stdout:
            t = time.time_ns()
            try:
                m = json.loads(raw)
            except ValueError:
                continue
            d = m.get("data_b64")
            if m.get("type") != "write" or not d:
                continue
            for mode, i, g in LINE_RE.findall(base64.b64decode(d)):
                first.setdefault((mode.decode(), int(i)), (t, int(g)))
    threading.Thread(target=watcher, daemon=True).start()
    time.sleep(2)  # the watch picks the VM up within its 1 s rescan
    best = None
    for _ in range(rounds):
        t0 = time.time_ns()
        vm.stdin.write(b"x\n")
        vm.stdin.flush()
        t1, g = expect(lambda l: l.isdigit(), 60)
        rtt = t1 - t0
        off = int(g) - (t0 + t1) // 2
        if best is None or rtt < best[0]:
            best = (rtt, off)
    rtt, offset = best
    expect(lambda l: l == "DONE", 900)
    vm.stdin.close()
    vm.wait()
    time.sleep(1)
    watch.terminate()
    watch.wait()
    rows, lats = [], {}
    for mode in ("sync", "async"):
        lat = [(t - (g - offset)) / 1e6 for (m, _), (t, g) in first.items() if m == mode]
        lats[mode] = lat
        rows.append((mode, len(lat), a.lines, pct(lat, 50), pct(lat, 99), max(lat) if lat else None))
    return rows, offset / 1e6, rtt / 2e6, lats


# --------------------------------------------------------------------------------------------
# Slowdown

SLOW_SCRIPT = r"""
set -e
mount /dev/vdb /mnt
mkdir -p /media/debs; mount -o ro /dev/vdc /media/debs
sync
t() {{ date +%s%N; }}
ram=$(awk '/^MemTotal/ {{print int($2 / 1024)}}' /proc/meminfo)
echo "guest RAM $ram MiB; bonnie++ file $((2 * ram)) MiB"
s=$(t); bonnie++ -d /mnt -s $((2 * ram)) -r $ram -f -u root -q >/dev/null 2>&1; sync; e=$(t); echo "RESULT bonnie $((e-s))"
rm -rf /mnt/Bonnie.*
s=$(t); {postmark}; sync; e=$(t); echo "RESULT postmark $((e-s))"
grep -i "written" /tmp/pm.out | head -2
s=$(t); mkdir /mnt/andrew
tar -C /usr/lib/python3.11 --exclude=__pycache__ -cf - email json http logging xml urllib asyncio unittest concurrent multiprocessing importlib | tar -C /mnt/andrew -xf -
find /mnt/andrew -type f -exec stat -c '%s %Y' {{}} + >/dev/null
grep -r 'def ' /mnt/andrew >/dev/null
python3 -m compileall -q /mnt/andrew >/dev/null
sync; e=$(t); echo "RESULT andrew $((e-s))"
s=$(t); dpkg -i /media/debs/*.deb >/tmp/dpkg.out; sync; e=$(t); echo "RESULT install $((e-s))"
echo "installed $(ls /media/debs/*.deb | wc -l) packages, $(cat /var/lib/dpkg/info/*.list 2>/dev/null | wc -l) dpkg list lines"
"""

WORKLOADS = ["bonnie", "postmark", "andrew", "install"]
CONFIGS = {"no-stream": ["--no-stream"], "stream": [], "stream-q1": ["--stream-queue-mb", "1"]}


def slowdown(a, tmp, rec):
    script = SLOW_SCRIPT.format(postmark=gammaray.postmark_script("/mnt/pm"))
    debs, deb_bytes = gammaray.debs_disk(tmp, a.install_set)
    print(f"software install: {len(gammaray.INSTALL_SETS[a.install_set])} packages, "
          f"{deb_bytes / 2**20:.0f} MiB of .deb",
          file=sys.stderr)
    res = {c: {w: [] for w in WORKLOADS} for c in CONFIGS}
    drops = {c: [] for c in CONFIGS}
    nobytes = {c: [] for c in CONFIGS}
    for rep in range(a.reps):
        for c, extra in CONFIGS.items():
            img = os.path.join(tmp, "slow.img")
            if os.path.exists(img):
                os.unlink(img)
            subprocess.run(["truncate", "-s", f"{a.disk_gib}G", img], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True)
            r = peers.run_vmsight(["bash", "-c", script], extra=extra, disks=[img, debs + ",ro"],
                                  mem_mib=a.mem, timeout=7200)
            if r["status"] != 0:
                raise RuntimeError(f"{c}: {r['stderr'][-2000:]}")
            got = dict((m.group(1), int(m.group(2)) / 1e9)
                       for m in re.finditer(r"RESULT (\w+) (\d+)", r["stdout"]))
            for w in WORKLOADS:
                res[c][w].append(got.get(w))
            disks = r["stats"].get("disks", [])
            d = sum(((x.get("stream") or {}).get("dropped_data_bytes", 0)) for x in disks)
            nob = sum(((x.get("tap") or {}).get("bytes_without_data", 0)) for x in disks)
            drops[c].append(d)
            nobytes[c].append(nob)
            for w in WORKLOADS:
                rec.rep(part="slowdown", workload=w, config=c, rep=rep, guest_s=got.get(w))
            rec.rep(part="slowdown", workload="(whole run)", config=c, rep=rep, wall_s=r["t_exit"],
                    dropped_data_bytes=d, bytes_without_data=nob)
            print(f"[rep {rep}] {c}: " + ", ".join(f"{w} {got.get(w, 0):.1f}s" for w in WORKLOADS)
                  + f", dropped {d / 2**20:.1f} MiB, queued without bytes {nob / 2**20:.1f} MiB", file=sys.stderr)
    return res, drops, nobytes


# --------------------------------------------------------------------------------------------
# Crawl

CRAWL_RE = {
    "time": re.compile(r"crawl time:\s+([\d.]+) s"),
    "inodes": re.compile(r"in use:\s+(\d+) inodes"),
    "mem": re.compile(r"index size:\s+(\d+) bytes in memory, ([\d.]+) bytes per inode"),
    "ser": re.compile(r"serialised:\s+(\d+) bytes, ([\d.]+) bytes per inode"),
}


def crawl_example():
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "vmsight-fsview", "--example", "crawl"],
                   check=True, cwd=peers.REPO)
    tdir = os.environ.get("CARGO_TARGET_DIR", os.path.join(peers.REPO, "target"))
    return os.path.join(tdir, "release", "examples", "crawl")


def crawl_one(exe, img, cold):
    if cold:
        subprocess.run(["dd", f"if={img}", "iflag=nocache", "count=0", "status=none"], check=True)
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    out = subprocess.run([exe, img], check=True, capture_output=True, text=True).stdout
    r = {}
    for k, rx in CRAWL_RE.items():
        m = rx.search(out)
        r[k] = m.groups() if m else None
    return r


def used_bytes(img):
    out = subprocess.run(["dumpe2fs", "-h", img], capture_output=True, text=True).stdout
    bc = int(re.search(r"Block count:\s+(\d+)", out).group(1))
    fb = int(re.search(r"Free blocks:\s+(\d+)", out).group(1))
    bs = int(re.search(r"Block size:\s+(\d+)", out).group(1))
    return (bc - fb) * bs


def crawl(tmp):
    exe = crawl_example()
    rows = []
    root = os.path.join(peers.image_info()["rootfs"])
    usr = os.path.join(tmp, "usr.img")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", "/usr/share", usr, "2G"], check=True, capture_output=True)
    for label, img in (("guest root image", root), ("host /usr/share (mkfs.ext4 -d)", usr)):
        used = used_bytes(img)
        for cold in (True, False):
            r = crawl_one(exe, img, cold)
            t = float(r["time"][0])
            rows.append((label, "cold" if cold else "warm", int(r["inodes"][0]), used / 1e9, t,
                         t / (used / 1e9), float(r["mem"][1]), float(r["ser"][1])))
    os.unlink(usr)
    return rows


# --------------------------------------------------------------------------------------------

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--skip", default="")
    ap.add_argument("--mem", type=int, default=512,
                    help="guest RAM (MiB) for the slowdown runs; bonnie++ writes twice that (its default)")
    ap.add_argument("--disk-gib", type=int, default=8, help="the slowdown runs' extra disk (sparse)")
    ap.add_argument("--install-set", choices=sorted(gammaray.INSTALL_SETS), default="small",
                    help="packages installed by the software-install workload")
    bench_results.add_out_option(ap, "filestream")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    rec = bench_results.Recorder("filestream", a, out=a.out, keys=["part", "workload", "config"],
                                 baseline="no-stream")
    summary = {}
    raw = {}
    print(f"\n### File-update streaming ({time.strftime('%Y-%m-%d')}, `bench/filestream.py --reps {a.reps} "
          f"--lines {a.lines}`)\n")
    with tempfile.TemporaryDirectory(prefix="bench-filestream-") as tmp:
        if "latency" not in skip:
            rows, off, err, lats = latency_run(a)
            raw["latency"] = rows
            for mode, n, total, p50, p99, mx in rows:
                rec.rep(part="latency", workload="append", config=mode, rep=0, lines_seen=n, lines_written=total,
                        p50_ms=p50, p99_ms=p99, max_ms=mx, latency_ms=lats[mode], clock_offset_ms=off,
                        clock_offset_err_ms=err)
            print(f"Latency from a guest append to the `write` event at a `vmsight watch --json --data` subscriber "
                  f"(guest clock offset {off:.1f} ms subtracted, +-{err:.1f} ms):\n")
            print("| guest | lines seen / written | p50 (ms) | p99 (ms) | max (ms) |")
            print("|---|---|---|---|---|")
            for mode, n, total, p50, p99, mx in rows:
                label = "`sync` after each line" if mode == "sync" else "default writeback (no sync)"
                f = (lambda v: f"{v:.0f}" if v is not None else "-")
                print(f"| {label} | {n} / {total} | {f(p50)} | {f(p99)} | {f(mx)} |")
            print()
        if "slowdown" not in skip:
            res, drops, nobytes = slowdown(a, tmp, rec)
            raw["slowdown"] = res
            raw["drops"] = drops
            raw["without_bytes"] = nobytes
            print(f"Guest wall time per workload (s, median of {a.reps}) and slowdown against `--no-stream`:\n")
            print("| workload | no-stream | stream | stream, queue 1 MiB | slowdown | slowdown, queue 1 MiB |")
            print("|---|---|---|---|---|---|")
            sl = {"stream": [], "stream-q1": []}
            for w in WORKLOADS:
                b = med(res["no-stream"][w])
                vals = {c: med(res[c][w]) for c in CONFIGS}
                cells = []
                for c in ("stream", "stream-q1"):
                    if b and vals[c]:
                        s = vals[c] / b - 1
                        sl[c].append(s)
                        cells.append(f"{s * 100:+.1f}%")
                    else:
                        cells.append("-")
                print(f"| {w} | " + " | ".join(f"{vals[c]:.2f}" if vals[c] else "-" for c in CONFIGS)
                      + " | " + " | ".join(cells) + " |")
            for c, label in (("stream", "streaming"), ("stream-q1", "streaming, queue 1 MiB")):
                if sl[c]:
                    summary[f"{c}_slowdown"] = {"average": statistics.mean(sl[c]), "worst": max(sl[c])}
                    print(f"\n{label}: average slowdown {statistics.mean(sl[c]) * 100:+.1f}%, "
                          f"worst {max(sl[c]) * 100:+.1f}%; data dropped per run (MiB): "
                          f"{[round(d / 2**20, 1) for d in drops[c]]}, queued without bytes (re-read from the "
                          f"image) per run (MiB): {[round(d / 2**20, 1) for d in nobytes[c]]}")
            print()
        if "crawl" not in skip:
            rows = crawl(tmp)
            raw["crawl"] = rows
            print("Crawl (`examples/crawl`, release build):\n")
            print("| image | cache | inodes | used GB | crawl (s) | s per used GB | index B/inode in memory | serialised B/inode |")
            print("|---|---|---|---|---|---|---|---|")
            for label, cache, ino, gb, t, tpg, mem, ser in rows:
                print(f"| {label} | {cache} | {ino} | {gb:.2f} | {t:.3f} | {tpg:.3f} | {mem:.1f} | {ser:.1f} |")
                rec.rep(part="crawl", workload=label, config=cache, rep=0, inodes=ino, used_gb=gb, crawl_s=t,
                        s_per_used_gb=tpg, index_bytes_per_inode=mem, serialised_bytes_per_inode=ser)
            print("\nGamma-Ray (paper, not re-runnable here): 323 B/file raw, 34 B compressed, ~20 s for 6 GB.")
    print("\nraw:", json.dumps(raw))
    rec.write(summary=summary)


if __name__ == "__main__":
    main()
