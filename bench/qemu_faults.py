#!/usr/bin/env python3
"""How often each QEMU configuration hits the TCG section race (issue 31, docs/launcher.md).

QEMU 10 resolves an MMIO access through the section *index* its TLB entry holds, in the
address space's *current* memory map; when another vCPU changes the map (a guest turns a PCI
BAR's decoding off or on) the index can name another section, or none, until the vCPU's own
TLB flush. Seen as two faults: QEMU aborting in `iotlb_to_section` and a guest vCPU whose
timer stops for good (its EOI went elsewhere, the timer vector stays in service).

Two modes, each run two VMs at a time (both of the same configuration, as when two test VMs
faulted together), configurations interleaved pair by pair:

  boot    the faults as they come: boot, a short disk and interrupt workload (4 MiB written
          with fsync, a sync, 100 short sleeps), power off. Rare (about 1 in 200 boots).
  stress  the race made frequent, to compare configurations in minutes: on vCPU 0 the guest
          turns the memory decoding of its NIC (00:03.0, a BAR below the others) off and on
          TOGGLES times; on vCPU 1 it reads a constant register (AHCI's version, 00:1f.2
          BAR5, above the NIC's BAR) in a loop and counts every read that returns anything
          else: an MMIO read that reached the wrong section. A third task sleeps 200 us at a
          time on vCPU 1, so its timer EOIs race too.

Each run is classified from vmsight's own report: `abort` (QEMU's iotlb_to_section
assertion), `stall` (a vCPU timer stuck in service, or the guest's RCU report of one), `other`
(any other failure, named in the JSON) or `ok`. Host CPU time of the whole vmsight tree
(vmsight, QEMU) is recorded beside wall time.

Configurations: qemu10 (the system QEMU 10.0, multi-threaded TCG; the guest runs its local
APIC in xAPIC mode: "x2apic: IRQ remapping doesn't support X2APIC mode"), qemu10-x2apic (the
same with an Intel IOMMU remapping interrupts, so the guest enables x2APIC and its EOIs are MSR
writes, not MMIO), qemu10-single (--tcg-threads single), qemu11 (QEMU 11.1 of the trixie
root, `make qemu11`).

  bench/qemu_faults.py --mode stress --runs 4
  bench/qemu_faults.py --mode boot --runs 600 --stop-after 3 --configs qemu10,qemu11
  bench/qemu_faults.py --mode boot --configs qemu11 --runs 100000 --minutes 30

Writes bench/results/qemu_faults-MODE.json (commit, command, date, load, every run) and prints
a Markdown table: runs, faults, fault rate, and for a configuration without a fault the 95 %
upper bound of its rate (3/n). The file has the fields of every bench's results
(bench/lib/results.py, bench/README.md); its runs are listed both as `runs` (as before) and as
`reps` (as in every results file).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))

# QEMU 10 with an Intel IOMMU remapping interrupts in x2APIC (EIM) mode: the guest kernel then
# runs its local APIC in x2APIC mode (EOI by MSR instead of an MMIO write). vmsight has no
# option for extra QEMU arguments, so the configuration runs QEMU through this wrapper.
X2APIC_WRAPPER = """#!/bin/sh
exec qemu-system-x86_64 -device intel-iommu,intremap=on,eim=on "$@"
"""
X2APIC_QEMU = os.path.join(tempfile.gettempdir(), f"vmsight-qemu-faults-{os.getuid()}",
                           "qemu-system-x86_64")
sys.path.insert(0, os.path.join(REPO, "bench", "lib"))
import results as bench_results  # noqa: E402

CONFIGS = {
    "qemu10": ["--qemu", "system", "--tcg-threads", "multi"],
    "qemu10-x2apic": ["--qemu", X2APIC_QEMU, "--tcg-threads", "multi"],
    "qemu10-single": ["--qemu", "system", "--tcg-threads", "single"],
    "qemu11": ["--qemu", "trixie"],
}

BOOT_WORKLOAD = (
    "dd if=/dev/zero of=/root/f bs=64k count=64 conv=fsync status=none && sync && "
    "i=0; while [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done; echo ok"
)

STRESS_WORKLOAD = r"""
N=$1
taskset -c 1 python3 -c '
import time, os
while not os.path.exists("/tmp/stop"):
    time.sleep(0.0002)' &
taskset -c 1 python3 - <<'PY' &
import mmap, os, ctypes
fd = os.open('/sys/bus/pci/devices/0000:00:1f.2/resource5', os.O_RDWR | os.O_SYNC)
m = mmap.mmap(fd, 4096)
w = ctypes.c_uint32.from_buffer(m, 0x10)
want = w.value
bad = reads = 0
while not os.path.exists('/tmp/stop'):
    for _ in range(1000):
        if w.value != want:
            bad += 1
    reads += 1000
print('READER reads=%d misdirected=%d want=%#x' % (reads, bad, want), flush=True)
PY
sleep 1
taskset -c 0 python3 - "$N" <<'PY'
import os, sys
n = int(sys.argv[1])
f = os.open('/sys/bus/pci/devices/0000:00:03.0/config', os.O_RDWR)
cmd = int.from_bytes(os.pread(f, 2, 4), 'little')
off, on = (cmd & ~2).to_bytes(2, 'little'), (cmd | 2).to_bytes(2, 'little')
for i in range(n):
    os.pwrite(f, off, 4)
    os.pwrite(f, on, 4)
print('TOGGLER toggles=%d' % n, flush=True)
PY
touch /tmp/stop; wait
"""

ABORT = "iotlb_to_section"
STALL_SIGNS = ("timer interrupt is stuck in service", "did not fire (an RCU stall)")


def classify(code, stderr):
    """ok / abort / stall / other, from vmsight's exit status and its stderr."""
    if ABORT in stderr:
        return "abort"
    if any(s in stderr for s in STALL_SIGNS):
        return "stall"
    return "ok" if code == 0 else "other"


def one_run(config, mode, idx, toggles, timeout):
    """One VM: its class, wall and host CPU seconds, and what its workload printed."""
    name = f"qf-{os.getpid()}-{config}-{idx}"
    if mode == "boot":
        cmd = ["sh", "-c", BOOT_WORKLOAD]
    else:
        cmd = ["sh", "-c", STRESS_WORKLOAD, "sh", str(toggles)]
    args = [VMSIGHT, "run", "--name", name, "--boot-timeout", "300"] + CONFIGS[config]
    args += ["--"] + cmd
    t0 = time.time()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, p.terminate)
    timer.start()
    out, err = p.communicate()
    timer.cancel()
    wall = time.time() - t0
    r = {"config": config, "run": idx, "exit": p.returncode, "wall_s": round(wall, 2),
         "class": classify(p.returncode, err)}
    m = re.search(r"READER reads=(\d+) misdirected=(\d+)", out)
    if m:
        r["reads"], r["misdirected"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"TOGGLER toggles=(\d+)", out)
    if m:
        r["toggles"] = int(m.group(1))
    if r["class"] != "ok":
        r["stderr_tail"] = err.strip().splitlines()[-12:]
    return r


def run_pair(config, mode, idx, toggles, timeout):
    """Two VMs of `config` at once; their results and the pair's host CPU seconds."""
    before = os.times()
    results = [None, None]

    def go(k):
        results[k] = one_run(config, mode, idx + k, toggles, timeout)

    threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                          - before.children_system)
    for r in results:
        r["pair_host_cpu_s"] = round(cpu, 2)
    return results


def summary(runs, config):
    rs = [r for r in runs if r["config"] == config]
    n = len(rs)
    faults = {c: sum(r["class"] == c for r in rs) for c in ("abort", "stall", "other")}
    mis = sum(r.get("misdirected", 0) for r in rs)
    reads = sum(r.get("reads", 0) for r in rs)
    toggles = sum(r.get("toggles", 0) for r in rs)
    return {"runs": n, **faults, "misdirected": mis, "reads": reads, "toggles": toggles,
            "wall_s_median": sorted(r["wall_s"] for r in rs)[n // 2] if n else None}


def write_x2apic_wrapper():
    """The QEMU wrapper of configuration qemu10-x2apic, in a directory of this user only."""
    os.makedirs(os.path.dirname(X2APIC_QEMU), mode=0o700, exist_ok=True)
    with open(X2APIC_QEMU, "w") as f:
        f.write(X2APIC_WRAPPER)
    os.chmod(X2APIC_QEMU, 0o700)


SESSION_FIELDS = ("commit", "command", "date", "load_before")


def resume(out, fresh):
    """The earlier document at `out`, its sessions listed, ready to take more runs."""
    with open(out) as f:
        old = json.load(f)
    sessions = old.pop("sessions", None) or [
        {k: old.get(k) for k in SESSION_FIELDS + ("minutes",)}]
    sessions.append({k: fresh[k] for k in SESSION_FIELDS})
    old.pop("dirty", None)
    # This session's header (commit, command, date, load, host, params); the runs carry on.
    old.update({k: v for k, v in fresh.items() if k not in ("runs", "reps")})
    old["runs"] = old.get("runs") or old.get("reps") or []
    old["reps"] = old["runs"]
    old["sessions"] = sessions
    old["minutes_before"] = old.get("minutes") or 0
    return old


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["boot", "stress"], default="stress")
    ap.add_argument("--configs", default="qemu10,qemu10-single,qemu11")
    ap.add_argument("--runs", type=int, default=4, help="VMs per configuration (even)")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop a configuration after this many faulted runs (0: never)")
    ap.add_argument("--toggles", type=int, default=20000, help="stress: BAR toggles per VM")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one VM may take")
    ap.add_argument("--minutes", type=float, default=0,
                    help="start no new pair after this many minutes (0: no limit)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in the output file and add to them (--runs "
                         "counts the total per configuration); each session is listed")
    a = ap.parse_args()
    configs = a.configs.split(",")
    if "qemu10-x2apic" in configs:
        write_x2apic_wrapper()
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"qemu_faults: unknown configuration {c} (known: {', '.join(CONFIGS)})")
    out = a.out or bench_results.default_path("qemu_faults", a.mode)
    doc = bench_results.header("qemu_faults", a)
    doc.update({"mode": a.mode, "keys": ["config"], "metrics": bench_results.QEMU_FAULTS_METRICS,
                "toggles_per_vm": a.toggles if a.mode == "stress" else None, "runs": []})
    doc["reps"] = doc["runs"]  # the same list: `runs` as before, `reps` as in every results file
    if a.resume and os.path.exists(out):
        doc = resume(out, doc)
    done = {c: sum(r["config"] == c for r in doc["runs"]) for c in configs}
    faulted = {c: sum(r["config"] == c and r["class"] != "ok" for r in doc["runs"])
               for c in configs}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    started = time.time()
    while not (a.minutes and time.time() - started > a.minutes * 60):
        active = [c for c in configs if done[c] < a.runs
                  and not (a.stop_after and faulted[c] >= a.stop_after)]
        if not active:
            break
        for c in active:
            for r in run_pair(c, a.mode, done[c], a.toggles, a.timeout):
                doc["runs"].append(r)
                faulted[c] += r["class"] != "ok"
                extra = (f" misdirected {r['misdirected']}/{r['reads']}"
                         if "reads" in r else "")
                print(f"{c} run {r['run']}: {r['class']} (exit {r['exit']}, "
                      f"{r['wall_s']} s){extra}", flush=True)
            done[c] += 2
        doc["summary"] = {c: summary(doc["runs"], c)
                          for c in sorted({r["config"] for r in doc["runs"]})}
        doc["load_after"] = bench_results.loadavg()
        bench_results.write_json(out, doc)
    doc["minutes"] = round(doc.get("minutes_before", 0) + (time.time() - started) / 60, 1)
    doc.pop("minutes_before", None)
    doc["load_after"] = bench_results.loadavg()
    doc.setdefault("summary", {})
    lines = [f"\n{a.mode}: up to {a.runs} VMs per configuration, two at a time, "
             f"{doc['minutes']} min; {out}\n",
             "| configuration | VMs | aborts | stalls | other | faulted VMs | rate (95 % bound "
             "if none) | misdirected reads | toggles |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in doc["summary"]:
        s = doc["summary"][c]
        bad = s["abort"] + s["stall"] + s["other"]
        rate = f"{bad / s['runs']:.3f}" if bad else f"0 (< {3 / s['runs']:.3f})"
        lines.append(f"| {c} | {s['runs']} | {s['abort']} | {s['stall']} | {s['other']} | {bad} | "
                     f"{rate} | {s['misdirected']} of {s['reads']} | {s['toggles']} |")
    print("\n".join(lines))
    doc["tables"] = bench_results.parse_tables("\n".join(lines))
    bench_results.write_json(out, doc)


if __name__ == "__main__":
    main()
