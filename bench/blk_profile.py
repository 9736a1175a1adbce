#!/usr/bin/env python3
"""Where one qd1 request's host time goes in the disk backend: vmsight against
qemu-storage-daemon (issue 34, step 1).

  bench/blk_profile.py [--reps N] [--jobs randread,randwrite] [--runtime S] [--window S]
                       [--perf] [--out PATH]

Per configuration (--configs, any of bench/foundation.py's: qsd, qsd-uring, vmsight,
vmsight-uring, ...; interleaved in each repetition), a guest runs fio with one
4 KiB job at queue depth 1 on an extra disk (a 1 GiB file of random data; O_DIRECT, libaio) for --runtime seconds. After the
boot and fio's ramp (--settle seconds after launch) the backend process (qemu-storage-daemon, or
vmsight with its threads) is measured for --window seconds from /proc: its CPU time and the
context switches of all its threads, divided by the requests fio completed in that time (fio's
IOPS times the window). With --perf, `perf record -g` samples the backend over the same window
and the top symbols are printed. QEMU is the same (the system QEMU) for both. For vmsight, the
fio disk's own timestamps split each request's service time (available ring to used ring) at
its hand-offs: stages (to the terminal stage), queued (waiting for an I/O thread), io (the
transfer), completion (back to the used ring); averaged over the whole run's requests.

Results (every repetition) go to bench/results/blk-profile.json (--out).
"""
import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import foundation  # noqa: E402
import peers  # noqa: E402
import results as bench_results  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def backend_pid(config):
    """The newest backend process (qemu-storage-daemon, or `vmsight run`): this script runs one
    VM at a time."""
    pattern = "qemu-storage-daemon" if config.startswith("qsd") else "vmsight run"
    out = subprocess.run(["pgrep", "-n", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def ctx_switches(pid):
    """Voluntary and involuntary context switches summed over the process's threads."""
    vol = invol = 0
    for st in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(st) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol += int(line.split()[1])
        except OSError:
            pass
    return vol, invol


def threads(pid):
    return len(glob.glob(f"/proc/{pid}/task/*"))


def measure(config, a, out, perf_file):
    """Runs in a thread beside the VM: waits --settle, then samples the backend for --window."""
    time.sleep(a.settle)
    pid = backend_pid(config)
    if pid is None:
        out["error"] = "no backend process found"
        return
    perf = None
    if a.perf:
        perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-q", "-p", str(pid), "-o", perf_file,
                                 "--", "sleep", str(a.window)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c0, (v0, i0), t0 = cpu_ticks(pid), ctx_switches(pid), time.monotonic()
    time.sleep(a.window)
    c1, (v1, i1), t1 = cpu_ticks(pid), ctx_switches(pid), time.monotonic()
    out.update(window_s=t1 - t0, cpu_s=(c1 - c0) / CLK_TCK, ctx_vol=v1 - v0, ctx_invol=i1 - i0, threads=threads(pid))
    if perf:
        perf.wait()


def top_symbols(perf_file, n=12):
    r = subprocess.run(["perf", "report", "-i", perf_file, "--stdio", "--no-children", "--sort", "dso,sym",
                        "--percent-limit", "1.5", "-g", "none"], capture_output=True, text=True)
    rows = [line.strip() for line in r.stdout.splitlines() if line.strip() and not line.startswith("#")]
    return rows[:n]


def one_run(config, job, a, disk, work):
    script = (f"fio --name={job} --filename=/dev/vdb --direct=1 --ioengine=libaio --rw={job} --bs=4k "
              f"--iodepth=1 --runtime={a.runtime} --ramp_time=2 --time_based --size=1G --group_reporting "
              f"--output-format=json")
    perf_file = os.path.join(work, f"perf-{config}-{job}.data")
    sample = {}
    th = threading.Thread(target=measure, args=(config, a, sample, perf_file), daemon=True)
    th.start()
    r = foundation.run(config, ["sh", "-c", script], disks=[disk])
    th.join()
    fio = foundation.parse_fio(r["stdout"]).get(job)
    if not fio or "cpu_s" not in sample:
        raise RuntimeError(f"{config} {job}: fio {fio}, sample {sample}; stderr {r['stderr'][-400:]}")
    reqs = fio["iops"] * sample["window_s"]
    res = {"iops": fio["iops"], "requests_in_window": reqs, **sample,
           "backend_cpu_us_per_req": sample["cpu_s"] * 1e6 / reqs,
           "ctx_per_req": (sample["ctx_vol"] + sample["ctx_invol"]) / reqs,
           "host_cpu_s": r["cpu_s"]}
    res.update(hand_offs(r))
    if a.perf and os.path.exists(perf_file):
        res["top_symbols"] = top_symbols(perf_file)
    return res


HAND_OFFS = ("stages", "queued", "io", "completion")


def hand_offs(r):
    """Mean microseconds per request in each part of the fio disk's service time (vmsight only)."""
    disks = (r.get("stats") or {}).get("disks") or []
    m = disks[1].get("metrics", {}) if len(disks) > 1 else {}
    h = m.get("hand_offs") or {}
    n = h.get("requests", 0)
    if not n:
        return {}
    out = {f"{p}_us": h[f"{p}_ns"] / n / 1e3 for p in HAND_OFFS}
    out["service_us"] = m["latency_ns_total"] / max(m["completed_ok"], 1) / 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", default="randread,randwrite")
    ap.add_argument("--configs", default="qsd,vmsight")
    ap.add_argument("--runtime", type=int, default=40, help="fio seconds (default 40)")
    ap.add_argument("--settle", type=float, default=22, help="seconds after launch before measuring (default 22)")
    ap.add_argument("--window", type=float, default=10, help="seconds measured (default 10)")
    ap.add_argument("--perf", action="store_true", help="also perf-record the backend over the window")
    bench_results.add_out_option(ap, "blk-profile")
    a = ap.parse_args()
    if a.settle + a.window > a.runtime:
        sys.exit("blk_profile.py: --settle + --window must fit in --runtime")
    rec = bench_results.Recorder("blk-profile", a, out=a.out, keys=["config", "job"], baseline="qsd")
    configs, jobs = a.configs.split(","), a.jobs.split(",")
    with open("/proc/loadavg") as f:
        print(f"# load before: {f.read().strip()}", flush=True)
    res = {}
    with tempfile.TemporaryDirectory(prefix="blk-profile-") as work:
        # Filled, as bench/foundation.py's: reads of a sparse file's holes never reach the disk.
        disk = os.path.join(work, "data.img")
        subprocess.run(["dd", "if=/dev/urandom", f"of={disk}", "bs=1M", "count=1024", "status=none"], check=True)
        for rep in range(a.reps):
            for job in jobs:
                for config in configs:
                    r = one_run(config, job, a, disk, work)
                    res.setdefault((config, job), []).append(r)
                    rec.rep(config=config, job=job, rep=rep, **{k: v for k, v in r.items() if k != "top_symbols"},
                            top_symbols=r.get("top_symbols", []))
                    print(f"rep {rep} {config} {job}: iops {r['iops']:.0f}, backend {r['backend_cpu_us_per_req']:.1f} "
                          f"us CPU and {r['ctx_per_req']:.2f} context switches per request, {r['threads']} threads",
                          flush=True)
                    for s in r.get("top_symbols", []):
                        print(f"    {s}")
    with open("/proc/loadavg") as f:
        print(f"# load after: {f.read().strip()}")
    med = statistics.median
    print("\n| job (4 KiB, qd1) | config | IOPS | backend CPU us per request | context switches per request | threads | host CPU s (QEMU + backend) |")
    print("|---|---|---|---|---|---|---|")
    for (config, job), rs in res.items():
        print(f"| {job} | {config} | {med(r['iops'] for r in rs):.0f} | {med(r['backend_cpu_us_per_req'] for r in rs):.1f} | "
              f"{med(r['ctx_per_req'] for r in rs):.2f} | {med(r['threads'] for r in rs):.0f} | "
              f"{med(r['host_cpu_s'] for r in rs):.1f} |")
    split = [(k, rs) for k, rs in res.items() if "io_us" in rs[0]]
    if split:
        print("\n| job (4 KiB, qd1) | config | service us per request | stages | queued | io | completion |")
        print("|---|---|---|---|---|---|---|")
        for (config, job), rs in split:
            print(f"| {job} | {config} | {med(r['service_us'] for r in rs):.1f} | "
                  + " | ".join(f"{med(r[p + '_us'] for r in rs):.1f}" for p in HAND_OFFS) + " |")
    rec.write()


if __name__ == "__main__":
    main()
