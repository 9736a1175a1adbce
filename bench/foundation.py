#!/usr/bin/env python3
"""Foundation benchmarks (issue 2): vmsight vs plain QEMU virtio-blk vs qemu-storage-daemon.

Same kernel, initramfs, root image, vCPUs and memory for every configuration, all in this run,
several repetitions; results are printed as a Markdown table with ratios to plain QEMU.

  bench/foundation.py [--reps N] [--fio-runtime S] [--skip fio,getppid,boot] [--configs a,b]
                      [--qemu system,trixie] [--fio-jobs randread-4k-qd1,...] [--out PATH]

Configurations: qemu-virtio (QEMU's virtio-blk, aio=threads, cache=none), qsd
(qemu-storage-daemon vhost-user-blk, aio=threads), qemu-virtio-uring and qsd-uring (the same
with aio=io_uring), vmsight, vmsight-uring (the fio disk with io=io_uring), vmsight-nonet
(`--net none`: the peers' virtual hardware, without vmsight's default NIC), vmsight-mttcg
(`--tcg-threads multi`: on QEMU 10 vmsight runs the vCPUs single-threaded by default, because
of QEMU 10's TCG section race (docs/launcher.md), while the peers run multi-threaded TCG as
plain QEMU does), vmsight-noplugin,
vmsight-io1 (vmsight with one I/O thread on the fio disk: the file stage's pool against serial
file I/O),
vmsight-traced (the workload's syscalls intercepted: --trace @cmd to /dev/null) and
vmsight-traced-ro (the same with VMSIGHT_PLUGIN_REDIRECT=off: on QEMU 11 the syscall callbacks
are then registered read-only instead of with register/PC write access), and
vmsight-unconfined (`--run-as self --qemu-sandbox off`, `VMSIGHT_SECCOMP=off`: QEMU and
virtiofsd keep vmsight's user, root, QEMU runs without its seccomp filter and vmsight's disk
threads without theirs; the cost of the least-privilege defaults,
docs/security.md), with vmsight-nosandbox (`--qemu-sandbox off`) and vmsight-root
(`--run-as self`) to split it.

--qemu runs every vmsight configuration on each listed QEMU (`vmsight run --qemu`; `trixie` is
QEMU 11.1 from `make qemu11`), interleaved in the same repetitions; they are reported as
CONFIG@QEMU with a QEMU 11 / QEMU 10 table. The peers (qemu-virtio, qsd) use the system QEMU.

Every repetition of every configuration (boot, getppid and fio runs: times, host CPU, memory,
each fio job) goes to bench/results/foundation.json (--out), with the medians (bench/README.md).
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
import peers  # noqa: E402
import results as bench_results  # noqa: E402

CONFIGS = ["qemu-virtio", "qsd", "vmsight", "vmsight-noplugin"]
PEERS = ["qemu-virtio", "qsd", "qemu-virtio-uring", "qsd-uring"]
ALL_CONFIGS = CONFIGS + ["qemu-virtio-uring", "qsd-uring", "vmsight-uring", "vmsight-nonet", "vmsight-mttcg", "vmsight-io1",
                         "vmsight-traced", "vmsight-traced-ro", "vmsight-unconfined", "vmsight-nosandbox",
                         "vmsight-root"]
# vmsight's --disk options for the fio disk, per configuration.
DISK_OPTS = {"vmsight-io1": ",direct,io_threads=1", "vmsight-uring": ",direct,io=io_uring"}
QEMUS = ["system", "trixie"]


def split(config):
    """`vmsight@trixie` -> ("vmsight", "trixie"); peers and plain names run on the system QEMU."""
    base, _, qemu = config.partition("@")
    return base, qemu or "system"


def run(config, argv, disks=()):
    """One run; adds `cpu_s`: host CPU seconds of QEMU + vmsight (or + qsd), from getrusage."""
    c0 = peers.children_cpu_s()
    base, qemu = split(config)
    if base in PEERS:
        r = peers.run_peer(base, argv, extra_disks=disks)
    else:
        extra = ["--qemu", qemu]
        if base == "vmsight-noplugin":
            extra.append("--no-plugin")
        if base == "vmsight-nonet":
            extra += ["--net", "none"]
        if base == "vmsight-mttcg":
            extra += ["--tcg-threads", "multi"]
        if base == "vmsight-unconfined":
            extra += ["--run-as", "self", "--qemu-sandbox", "off"]
        if base == "vmsight-nosandbox":
            extra += ["--qemu-sandbox", "off"]
        if base == "vmsight-root":
            extra += ["--run-as", "self"]
        if base.startswith("vmsight-traced"):
            extra += ["--trace", "@cmd", "--trace-out", "/dev/null"]
        opts = DISK_OPTS.get(base, ",direct")
        old = os.environ.get("VMSIGHT_PLUGIN_REDIRECT")
        old_seccomp = os.environ.get("VMSIGHT_SECCOMP")
        if base == "vmsight-unconfined":
            os.environ["VMSIGHT_SECCOMP"] = "off"
        if base == "vmsight-traced-ro":
            os.environ["VMSIGHT_PLUGIN_REDIRECT"] = "off"
        try:
            r = peers.run_vmsight(argv, extra=extra, disks=disks, disk_opts=opts)
        finally:
            if old is None:
                os.environ.pop("VMSIGHT_PLUGIN_REDIRECT", None)
            else:
                os.environ["VMSIGHT_PLUGIN_REDIRECT"] = old
            if old_seccomp is None:
                os.environ.pop("VMSIGHT_SECCOMP", None)
            else:
                os.environ["VMSIGHT_SECCOMP"] = old_seccomp
    r["cpu_s"] = peers.children_cpu_s() - c0
    return r


FIO_JOBS = [("randread", "4k", 1), ("randread", "4k", 32), ("randwrite", "4k", 1),
            ("randwrite", "4k", 32), ("read", "1M", 4), ("write", "1M", 4),
            ("read", "1M", 32), ("write", "1M", 32)]


def fio_script(runtime):
    lines = ["set -e"]
    for rw, bs, qd in FIO_JOBS:
        lines.append(f"fio --name={rw}-{bs}-qd{qd} --filename=/dev/vdb --direct=1 --ioengine=libaio "
                     f"--rw={rw} --bs={bs} --iodepth={qd} --runtime={runtime} --ramp_time=2 --time_based "
                     f"--size=1G --group_reporting --output-format=json")
    return "\n".join(lines)


def parse_fio(text):
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        j = text.find("{", i)
        if j < 0:
            break
        try:
            obj, end = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        out.append(obj)
        i = end
    res = {}
    for obj in out:
        job = obj["jobs"][0]
        name = job["jobname"]
        side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
        res[name] = {"iops": side["iops"], "mib_s": side["bw"] / 1024}
    return res


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fio-runtime", type=int, default=8)
    ap.add_argument("--skip", default="")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated, from: " + ", ".join(ALL_CONFIGS))
    ap.add_argument("--qemu", default="system",
                    help="comma-separated QEMUs for the vmsight configurations: " + ", ".join(QEMUS))
    ap.add_argument("--fio-jobs", default="",
                    help="comma-separated fio jobs (default all): " +
                    ", ".join(f"{rw}-{bs}-qd{qd}" for rw, bs, qd in FIO_JOBS))
    bench_results.add_out_option(ap, "foundation")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    unknown = set(configs) - set(ALL_CONFIGS)
    if unknown:
        sys.exit(f"unknown configurations: {', '.join(sorted(unknown))}")
    qemus = [q for q in a.qemu.split(",") if q]
    if not qemus or set(qemus) - set(QEMUS):
        sys.exit(f"--qemu takes a comma-separated list of {', '.join(QEMUS)}")
    if a.fio_jobs:
        wanted = set(a.fio_jobs.split(","))
        FIO_JOBS[:] = [j for j in FIO_JOBS if f"{j[0]}-{j[1]}-qd{j[2]}" in wanted]
        if len(FIO_JOBS) != len(wanted):
            sys.exit(f"unknown fio jobs in {a.fio_jobs}")
    # Peers once (system QEMU); each vmsight configuration on each QEMU (named CONFIG@QEMU when
    # more than the system QEMU is asked for).
    CONFIGS[:] = [c for c in configs if not c.startswith("vmsight")]
    for c in configs:
        if c.startswith("vmsight"):
            CONFIGS.extend(c if qemus == ["system"] else f"{c}@{q}" for q in qemus)
    skip = set(filter(None, a.skip.split(",")))
    # The tables' metrics (each fio job in the unit the table shows; the reps hold both).
    metrics = (["boot_ready_s", "boot_wall_s", "boot_host_cpu_s", "getppid_ns", "getppid_host_cpu_s"]
               + [f"fio_{rw}-{bs}-qd{qd}_{'mib_s' if bs == '1M' else 'iops'}" for rw, bs, qd in FIO_JOBS]
               + ["fio_host_cpu_s", "helper_anon_kib", "helper_own_kib", "helper_rss_kib", "qemu_rss_kib",
                  "fio_helper_anon_kib", "fio_helper_own_kib"])
    rec = bench_results.Recorder("foundation", a, out=a.out, metrics=metrics,
                                 baseline="qemu-virtio" if "qemu-virtio" in CONFIGS else None)
    results = {c: {"t_ready": [], "t_exit": [], "rss": [], "anon": [], "own": [], "fio_anon": [], "fio_own": [],
                   "qemu_rss": [], "getppid_ns": [], "getppid_cpu": [], "fio": [],
                   "boot_cpu": [], "fio_cpu": []} for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-foundation-") as tmp:
        disk = os.path.join(tmp, "fio.img")
        subprocess.run(["dd", "if=/dev/urandom", f"of={disk}", "bs=1M", "count=1024", "status=none"], check=True)
        for rep in range(a.reps):
            for c in CONFIGS:
                one = rec.rep(config=c, rep=rep)
                if "boot" not in skip:
                    r = run(c, ["true"])
                    assert r["status"] == 0, (c, r)
                    one.update(boot_ready_s=r["t_ready"], boot_wall_s=r["t_exit"], boot_host_cpu_s=r["cpu_s"],
                               helper_rss_kib=r["helper_rss_kib"], helper_anon_kib=r.get("helper_anon_kib"),
                               helper_own_kib=r.get("helper_own_kib"), qemu_rss_kib=r["qemu_rss_kib"])
                    results[c]["t_ready"].append(r["t_ready"])
                    results[c]["t_exit"].append(r["t_exit"])
                    results[c]["rss"].append(r["helper_rss_kib"])
                    results[c]["anon"].append(r.get("helper_anon_kib"))
                    results[c]["own"].append(r.get("helper_own_kib"))
                    results[c]["boot_cpu"].append(r["cpu_s"])
                    results[c]["qemu_rss"].append(r["qemu_rss_kib"])
                    print(f"[rep {rep}] {c}: boot to init {r['t_ready']:.2f}s, exit {r['t_exit']:.2f}s", file=sys.stderr)
                if "getppid" not in skip:
                    r = run(c, ["sh", "-c", "s=$(date +%s%N); getppid_loop 1000000; e=$(date +%s%N); echo $((e-s))"])
                    ns = int(r["stdout"].strip().splitlines()[-1])
                    one.update(getppid_ns=ns / 1e6, getppid_wall_s=r["t_exit"], getppid_host_cpu_s=r["cpu_s"])
                    results[c]["getppid_ns"].append(ns / 1e6)
                    results[c]["getppid_cpu"].append(r["cpu_s"])
                    print(f"[rep {rep}] {c}: getppid {ns/1e6:.1f} ns/call", file=sys.stderr)
                if "fio" not in skip:
                    r = run(c, ["sh", "-c", fio_script(a.fio_runtime)], disks=[disk])
                    assert r["status"] == 0, (c, r["stderr"][-2000:])
                    f = parse_fio(r["stdout"])
                    for job, v in f.items():
                        one[f"fio_{job}_iops"] = v["iops"]
                        one[f"fio_{job}_mib_s"] = v["mib_s"]
                    one.update(fio_wall_s=r["t_exit"], fio_host_cpu_s=r["cpu_s"],
                               fio_helper_anon_kib=r.get("helper_anon_kib"), fio_helper_own_kib=r.get("helper_own_kib"))
                    results[c]["fio"].append(f)
                    results[c]["fio_anon"].append(r.get("helper_anon_kib"))
                    results[c]["fio_own"].append(r.get("helper_own_kib"))
                    results[c]["fio_cpu"].append(r["cpu_s"])
                    print(f"[rep {rep}] {c}: " + ", ".join(f"{k} {v['iops']:.0f}" for k, v in f.items()), file=sys.stderr)
    rows = report(results, a)
    rec.write(summary={"table": {name: by for name, by, _ in rows}})


def report(results, a):
    base = "qemu-virtio"
    print(f"\n### Foundation benchmarks ({time.strftime('%Y-%m-%d')}, medians of {a.reps} runs)\n")
    peers_ = [p for p in PEERS + ["vmsight-io1", "vmsight-io1@system", "vmsight-unconfined", "vmsight-nosandbox",
                                  "vmsight-root"] if p in CONFIGS]
    # Ratio columns: vmsight (and vmsight-uring, when run) over each peer.
    mains = [m for m in ("vmsight", "vmsight@system", "vmsight-nonet", "vmsight-mttcg", "vmsight-uring",
                         "vmsight-uring@system")
             if m in CONFIGS]
    pairs = [(m, p) for m in mains for p in peers_]
    print("| metric | " + " | ".join(CONFIGS) + "".join(f" | {m} / {p}" for m, p in pairs) + " |")
    print("|---|" + "---|" * (len(CONFIGS) + len(pairs)))
    rows = []

    def row(name, vals, fmt, higher_better):
        cells = [fmt(v) if v is not None else "-" for v in vals]
        by = dict(zip(CONFIGS, vals))
        ratios = [f"{by[m] / by[p]:.2f}x" if by.get(m) and by.get(p) else "-" for m, p in pairs]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |")
        rows.append((name, by, fmt))

    row("boot to guest init (s)", [med(results[c]["t_ready"]) for c in CONFIGS], lambda v: f"{v:.2f}", False)
    row("boot + poweroff, wall (s)", [med(results[c]["t_exit"]) for c in CONFIGS], lambda v: f"{v:.2f}", False)
    row("boot + poweroff, host CPU (s)", [med(results[c]["boot_cpu"]) for c in CONFIGS], lambda v: f"{v:.2f}", False)
    row("getppid loop (ns/call)", [med(results[c]["getppid_ns"]) for c in CONFIGS], lambda v: f"{v:.0f}", False)
    row("getppid run (boot + 1M calls + poweroff), host CPU (s)", [med(results[c]["getppid_cpu"]) for c in CONFIGS],
        lambda v: f"{v:.2f}", False)
    for rw, bs, qd in FIO_JOBS:
        name = f"{rw}-{bs}-qd{qd}"
        key = "mib_s" if bs == "1M" else "iops"
        vals = [med([f[name][key] for f in results[c]["fio"] if name in f]) for c in CONFIGS]
        row(f"fio {name} ({'MiB/s' if key == 'mib_s' else 'IOPS'})", vals, lambda v: f"{v:.0f}", True)
    row("fio run (all jobs), host CPU (s)", [med(results[c]["fio_cpu"]) for c in CONFIGS], lambda v: f"{v:.1f}", False)
    def mib(key):
        return [med(results[c][key]) / 1024 if med(results[c][key]) else None for c in CONFIGS]

    # "Own" memory: RssAnon + RssFile, i.e. without the guest RAM the backend maps (RssShmem).
    row("boot: peak own memory (anon + file) of vmsight / qsd (MiB)", mib("own"), lambda v: f"{v:.1f}", False)
    row("fio: peak own memory (anon + file) of vmsight / qsd (MiB)", mib("fio_own"), lambda v: f"{v:.1f}", False)
    row("fio: peak private (anon) memory of vmsight / qsd (MiB)", mib("fio_anon"), lambda v: f"{v:.1f}", False)
    row("peak private (anon) memory of vmsight / qsd (MiB)", mib("anon"), lambda v: f"{v:.1f}", False)
    row("peak RSS of vmsight / qsd process (MiB)", mib("rss"), lambda v: f"{v:.1f}", False)
    row("peak RSS of QEMU (MiB)", mib("qemu_rss"), lambda v: f"{v:.1f}", False)
    qemu_table(rows)
    print("\nraw:", json.dumps(results))
    return rows


def qemu_table(rows):
    """QEMU 11 against QEMU 10 for every vmsight configuration run on both."""
    pairs = [c.split("@")[0] for c in CONFIGS if c.endswith("@trixie") and c.replace("@trixie", "@system") in CONFIGS]
    if not pairs:
        return
    print("\n| metric | " + " | ".join(f"{p}: QEMU 10 | {p}: QEMU 11 | {p}: 11 / 10" for p in pairs) + " |")
    print("|---|" + "---|---|---|" * len(pairs))
    for name, by, fmt in rows:
        cells = []
        for p in pairs:
            old, new = by.get(f"{p}@system"), by.get(f"{p}@trixie")
            cells += [fmt(old) if old is not None else "-", fmt(new) if new is not None else "-",
                      f"{new / old:.2f}x" if old and new else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
