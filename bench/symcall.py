#!/usr/bin/env python3
"""SymCall latency (issue 15; the paper's §7.1: cold 35 us, warm 9 us on 2011 hardware).

  bench/symcall.py [--reps N] [--calls N] [--transports doorbell@system,doorbell@trixie,sync@trixie]
                   [--loads idle,syscalls,spin] [--skip overhead,burst] [--base-vmsight PATH]
                   [--out PATH]

Per transport (doorbell on QEMU 10, doorbell and sync on QEMU 11.1) and guest load (idle; a
getppid loop, i.e. a guest busy in the kernel; a user-mode spin that enters the kernel only on
timer ticks), in one VM per (transport, load, repetition), interleaved:

- cold: the first `echo` after the module is up (the handler's code not yet translated by TCG);
- warm: the median of N `echo` calls made back to back (`vmsight sym NAME call --repeat N`);
- floor: the median of N `ping` calls back to back, the transport's bare round trip with no
  handler work (on the doorbell transport answered in the module's hard interrupt handler);
- isolated: the median of 20 `echo` calls 50 ms apart (each from a new `vmsight sym` process),
  which pay for waking what slept in between (on the host: the plugin's arming thread);
- ratio warm/floor (goal for the doorbell: <= 2) and warm against the paper's 9 us (goal for
  the synchronous transport).

Latency is what vmsight measures from posting a call to seeing the answer (`latency_ns` of the
reply), so the control socket's cost is not in it. The same run measures a guest `getppid`
(ns per call, from a timed getppid loop) for scale, the cost of `--symbiotic` to that loop on
QEMU 11 (the synchronous transport instruments every kernel block), and 10 000 echo calls in a
row without a loss (`--repeat`, each answer checked). Host CPU seconds of QEMU + vmsight per VM
come from getrusage of the children.

With --base-vmsight PATH (another build's `vmsight`, its plugin next to it), every latency row
runs with that build too, as config `TRANSPORT base`, interleaved with this build's, and so does
the getppid loop with `--symbiotic` on QEMU 11 (`trixie+symbiotic base`): a change to the
transport is measured against the code before it in the same run, latency and cost.

Every VM's numbers (latencies, each isolated call, the distribution of the back-to-back calls
as p0..p100, the burst, the getppid runs) go to bench/results/symcall.json (--out); a second
table prints the warm distribution's percentiles, and bench/report.py draws it as a CDF per
row (the paper's Fig. 8).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
import peers  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(__file__), "..", "target", "release", "vmsight"))
LOADS = {
    "idle": "",
    "syscalls": "getppid_loop 1000000000 & getppid_loop 1000000000 &",
    "spin": "sh -c 'while :; do :; done' & sh -c 'while :; do :; done' &",
}
GETPPID_N = 2_000_000
# Per-VM fields too long for the progress line (they are in the results file).
QUIET = ("counters", "isolated_calls_us", "warm_percentiles_us", "floor_percentiles_us", "warm_stages_us",
         "floor_stages_us")
# The parts of a synchronous call's latency (`stages_us` of `--repeat --json`), in call order.
STAGES = ("post_to_ring", "ring_to_resume", "resume_to_take", "post_to_take", "handler", "return_to_seen")


def sh(*args, check=True, vmsight=None):
    r = subprocess.run([vmsight or VMSIGHT, *args], capture_output=True, text=True, timeout=900)
    if check and r.returncode not in (0, 1):
        raise RuntimeError(f"vmsight {' '.join(args)}: {r.stderr.strip()}")
    return r


def wait_active(name, secs=180, vmsight=None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < secs:
        r = sh("sym", name, "spy", "--json", check=False, vmsight=vmsight)
        if r.returncode == 0:
            s = json.loads(r.stdout)
            if s["guest_state"] == "active" and s["vmm_state"] == "accepted":
                return s
        time.sleep(0.5)
    raise RuntimeError(f"{name}: the symbiotic interface never became active")


def call(name, transport, fn, *args, vmsight=None):
    r = sh("sym", name, "call", fn, *map(str, args), "--transport", transport, "--json", vmsight=vmsight)
    j = json.loads(r.stdout)
    return j["reply"]["latency_ns"] / 1000.0


def start_vm(name, qemu, script, vmsight=None):
    argv = [vmsight or VMSIGHT, "run", "--name", name, "--qemu", qemu, "--symbiotic", "--vcpus", "2", "--mem", "1024M",
            "--", "sh", "-c", script]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_vm(p):
    try:
        p.stdin.write("go\n")
        p.stdin.flush()
        p.stdin.close()
    except OSError:
        pass
    try:
        p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def repeat(name, transport, fn, n, vmsight=None):
    """n calls back to back (one control request each); vmsight's median latency, us."""
    r = sh("sym", name, "call", fn, "1", "--transport", transport, "--repeat", str(n), "--json", vmsight=vmsight)
    b = json.loads(r.stdout)
    if b["ok"] != n:
        raise RuntimeError(f"{name}: {fn} x{n} over {transport}: {b}")
    return b


def latency_run(transport_at, load, calls, burst, vmsight=None):
    transport, qemu = transport_at.split("@")
    v = vmsight
    name = f"bsym{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
    script = f"{LOADS[load]} echo up; read x"
    c0 = peers.children_cpu_s()
    p = start_vm(name, qemu, script, vmsight=v)
    try:
        wait_active(name, vmsight=v)
        time.sleep(1)  # the load is running
        cold = call(name, transport, "echo", 1, 2, 3, 4, 5, vmsight=v)
        warm = repeat(name, transport, "echo", calls, vmsight=v)
        floor = repeat(name, transport, "ping", calls, vmsight=v)
        isolated = []
        for i in range(20):
            time.sleep(0.05)
            isolated.append(call(name, transport, "echo", i, vmsight=v))
        out = {"cold_us": cold, "warm_us": warm["latency_us"]["median"], "warm_p99_us": warm["latency_us"]["p99"],
               "floor_us": floor["latency_us"]["median"], "isolated_us": statistics.median(isolated),
               "isolated_calls_us": isolated,
               # The distributions (Fig. 8): p0, p1, ..., p100 of the back-to-back calls (builds
               # before the CLI reported them give none).
               "warm_percentiles_us": warm.get("percentiles_us") or [],
               "floor_percentiles_us": floor.get("percentiles_us") or [],
               # Where the synchronous calls' time went, per part: calls, p10/p50/p90/p99 (builds
               # before the CLI reported them, and the doorbell transport, give none).
               "warm_stages_us": warm.get("stages_us") or {},
               "floor_stages_us": floor.get("stages_us") or {}}
        if burst:
            b = repeat(name, transport, "echo", 10000, vmsight=v)
            out["burst"] = {k: b[k] for k in ("calls", "ok", "failed", "wrong", "wall_s")}
            out["burst"]["median_us"] = b["latency_us"]["median"]
        s = json.loads(sh("sym", name, "spy", "--json", vmsight=v).stdout)
        out["counters"] = s["counters"]
    finally:
        stop_vm(p)
    out["cpu_s"] = peers.children_cpu_s() - c0
    return out


def getppid_ns(qemu, symbiotic, vmsight=None):
    """ns per guest getppid (a timed loop in the guest: date +%s%N around it)."""
    script = f"a=$(date +%s%N); getppid_loop {GETPPID_N}; b=$(date +%s%N); echo ns=$(( (b - a) / {GETPPID_N} ))"
    extra = ["--qemu", qemu] + (["--symbiotic"] if symbiotic else [])
    c0 = peers.children_cpu_s()
    r = subprocess.run([vmsight or VMSIGHT, "run", "--vcpus", "2", "--mem", "1024M", *extra, "--", "sh", "-c", script],
                       capture_output=True, text=True, timeout=900)
    cpu = peers.children_cpu_s() - c0
    for line in r.stdout.splitlines():
        if line.startswith("ns="):
            return int(line[3:]), cpu
    raise RuntimeError(f"getppid run failed: {r.stderr[-500:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--transports", default="doorbell@system,doorbell@trixie,sync@trixie")
    ap.add_argument("--loads", default="idle,syscalls,spin")
    ap.add_argument("--skip", default="")
    ap.add_argument("--base-vmsight", default=None,
                    help="another build's vmsight: every latency row also runs with it (config 'T base')")
    bench_results.add_out_option(ap, "symcall")
    a = ap.parse_args()
    # Rows: latency per transport (config) and guest load; getppid per QEMU (config "trixie",
    # "trixie+symbiotic", "system"), against QEMU 11 without --symbiotic.
    rec = bench_results.Recorder("symcall", a, out=a.out, keys=["part", "config", "load"], baseline="trixie")
    skip = set(filter(None, a.skip.split(",")))
    transports = [(t, t, None) for t in a.transports.split(",")]
    if a.base_vmsight:
        base = os.path.abspath(a.base_vmsight)
        transports = [x for t, _, _ in transports for x in ((t, t, None), (f"{t} base", t, base))]
    loads = a.loads.split(",")
    res = {}
    overhead = {}
    with open("/proc/loadavg") as f:
        print(f"# load before: {f.read().strip()}", flush=True)
    for rep in range(a.reps):
        for t, transport_at, vmsight in transports:
            for load in loads:
                burst = "burst" not in skip and rep == 0 and load == "syscalls"
                r = latency_run(transport_at, load, a.calls, burst, vmsight=vmsight)
                res.setdefault((t, load), []).append(r)
                print(f"rep {rep} {t} {load}: "
                      f"{json.dumps({k: v for k, v in r.items() if k not in QUIET})}",
                      flush=True)
                burst_fields = {f"burst_{k}": v for k, v in r.get("burst", {}).items()}
                rec.rep(part="latency", config=t, load=load, rep=rep, host_cpu_s=r["cpu_s"],
                        **{k: v for k, v in r.items() if k not in ("burst", "cpu_s")}, **burst_fields)
        if "overhead" not in skip:
            runs = [("trixie", False, None), ("trixie", True, None), ("system", False, None)]
            if a.base_vmsight:
                runs.append(("trixie", True, os.path.abspath(a.base_vmsight)))
            for qemu, symb, vmsight in runs:
                ns, cpu = getppid_ns(qemu, symb, vmsight=vmsight)
                label = (qemu, symb if vmsight is None else "True (base)")
                overhead.setdefault(label, []).append((ns, cpu))
                config = qemu + ("+symbiotic" if symb else "") + (" base" if vmsight else "")
                rec.rep(part="getppid", config=config, rep=rep, getppid_ns=ns, host_cpu_s=cpu)
                print(f"rep {rep} getppid {config}: {ns} ns/call, cpu {cpu:.1f} s", flush=True)
    with open("/proc/loadavg") as f:
        print(f"# load after: {f.read().strip()}")
    med = statistics.median
    print("\n| transport | guest load | cold us | warm us (median of back-to-back calls) | warm p99 us | floor: ping us | warm/floor | isolated call us (median, 50 ms apart) | warm vs paper's 9 us | guest rung at once: all idle / none in the kernel / after waiting (sync, median per VM) | host CPU s per VM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (t, load), rs in res.items():
        warm = med(r["warm_us"] for r in rs)
        floor = med(r["floor_us"] for r in rs)
        # Counters of builds before they existed read as 0.
        woke = " / ".join(f"{med(r['counters'].get(k, 0) for r in rs):.0f}"
                          for k in ("sync_wakes_idle", "sync_wakes_user", "sync_wakes_waited"))
        print(f"| {t} | {load} | {med(r['cold_us'] for r in rs):.0f} | {warm:.1f} | "
              f"{med(r['warm_p99_us'] for r in rs):.0f} | {floor:.1f} | {warm / floor:.2f} | "
              f"{med(r['isolated_us'] for r in rs):.0f} | {warm / 9.0:.2f}x | {woke} | "
              f"{med(r['cpu_s'] for r in rs):.1f} |")
    if any(r["warm_percentiles_us"] for rs in res.values() for r in rs):
        print("\n| transport | guest load | warm p1 us | p10 | p25 | p50 | p75 | p90 | p99 | max (medians over VMs) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for (t, load), rs in res.items():
            ps = [r["warm_percentiles_us"] for r in rs if r["warm_percentiles_us"]]
            if ps:
                cells = " | ".join(f"{med(p[i] for p in ps):.1f}" for i in (1, 10, 25, 50, 75, 90, 99, 100))
                print(f"| {t} | {load} | {cells} |")
    if any(r["warm_stages_us"] for rs in res.values() for r in rs):
        print("\n| transport | guest load | " + " | ".join(f"{k} us (p50; calls)" for k in STAGES)
              + " | (warm calls, medians over VMs) |")
        print("|---|---|" + "---|" * (len(STAGES) + 1))
        for (t, load), rs in res.items():
            st = [r["warm_stages_us"] for r in rs if r["warm_stages_us"]]
            if not st:
                continue
            cells = []
            for k in STAGES:
                have = [x[k] for x in st if k in x]
                cells.append(f"{med(h['p50'] for h in have):.1f}; {med(h['calls'] for h in have):.0f}" if have else "-")
            print(f"| {t} | {load} | " + " | ".join(cells) + " | |")
    bursts = [(t, r["burst"]) for (t, _), rs in res.items() for r in rs if "burst" in r]
    if bursts:
        print("\n| transport | calls in a row | answered correctly | failed | wrong | median us | wall s |")
        print("|---|---|---|---|---|---|---|")
        for t, b in bursts:
            print(f"| {t} | {b['calls']} | {b['ok']} | {b['failed']} | {b['wrong']} | {b['median_us']:.1f} | {b['wall_s']:.1f} |")
    if overhead:
        print("\n| QEMU | --symbiotic | guest getppid ns (median) | host CPU s (median) |")
        print("|---|---|---|---|")
        for (q, s), v in overhead.items():
            print(f"| {q} | {s} | {med(x[0] for x in v)} | {med(x[1] for x in v):.1f} |")
    rec.write(summary={"warm_over_floor": {f"{t}/{load}": med(r["warm_us"] for r in rs) / med(r["floor_us"] for r in rs)
                                           for (t, load), rs in res.items()}})


if __name__ == "__main__":
    main()
