#!/usr/bin/env python3
"""SwapBypass (SymCall paper §6-§7.2 shape): a 256 MB guest with 512 MB of swap, running
workloads bigger than its memory, with its swap served five ways.

  bench/swapbypass.py [--reps 3] [--quick] [--workloads stream:300,gups:256,memperf:256]
                      [--configs hdd,ramdisk,zram,ideal,bypass]
                      [--cache-sizes 0,64M,128M,256M,512M] [--mem 256M] [--swap-size 512M]
                      [--ideal-mem 1G] [--timeout 1800] [--data canonical|random] [--nohuge]
                      [--zram-comp ALG] [--args NAME=ARGS ...] [--vcpus N] [--latency]
                      [--guest-prefix CMD] [--json FILE] [--out PATH]

Configurations, one VM (2 vCPUs) per configuration, workload and repetition, interleaved
within each repetition:
  hdd      --swap SWAP,cache=0 --disk-model hdd: every swap I/O reaches the swap file through a
           model of a hard disk (the paper's disk-model baseline)
  ramdisk  --swap SWAP,cache=SWAP: the whole swap disk in vmsight's host swap cache, reached
           through the guest's block path (the paper's RAM-disk baseline)
  zram     no --swap; the guest makes compressed in-memory swap of SWAP itself (zram, the
           kernel's default compressor unless --zram-comp): what a guest can do alone
  ideal    --mem IDEAL, no swap: the workload fits in memory
  bypass   --symbiotic --swap SWAP,cache=C for every C in --cache-sizes (the paper's x-axis):
           the guest module swaps through shared memory without block I/O; pages beyond the
           host cache C go to the swap file
  grow     --symbiotic --swap SWAP,cache=SWAP,grow=IDEAL-MEM: the bypass, and vmsight adds
           guest memory through virtio-mem while the guest thrashes (not in the default list
           of the paper's configurations, which is --configs' default plus grow)
Workloads (guest/progs; every one validates its data at the end, so a page that swap brought
back wrong fails the run): `stream MIB` (STREAM's four kernels over three arrays of MIB/3),
`gups MIB` (HPCC RandomAccess), `memperf MIB` (an ECT-memperf sweep of working sets and
strides). The guest command prints /proc/vmstat's pswpin/pswpout and the swap lines of
/proc/meminfo before and after the workload.
Data: --data canonical (the default) starts the workloads from their benchmarks' own values,
as the paper ran them (STREAM's constant arrays, HPCC's table[i] = i, memperf's words their
index: the programs' `--canonical`); --data
random from hashes that do not compress. Only zram cares: canonical STREAM pages are one value
repeated, which zram stores as a single word (its best case), while with random data every
page zram stores still takes a whole page of guest memory, so it cannot hold a working set
bigger than memory at all (expect the OOM killer or a timeout). SwapBypass, the RAM disk and
the disk model move the same bytes either way.

Measured per run: the wall time of `vmsight run` on the host (boot included), the workload's
own seconds as it prints them (inside the guest, without boot, fills and checks: the speedups
use these), the host CPU seconds of vmsight + QEMU (getrusage of the children), the guest's
pswpin/pswpout deltas and vmsight's swap counters (`--stats-json`, key `swap`; a counter the
running vmsight does not report is left blank). A run that exceeds --timeout is killed and
shown as ">T"; the script goes on.
Where the time goes, per run (the breakdown table): the guest's vCPU seconds over the workload
by kind (/proc/stat: user, system, idle), kswapd0's, the TLB shootdowns the vCPUs took, and the
symbiotic module's own time (its swap_stats: stores and loads from lock to unlock, the 4 KiB
copies alone). System time minus the module's is the guest kernel's own swap path (faults,
reclaim, the swap cache; with ramdisk also the block path). --latency adds the summed
durations of every swap-in fault and direct reclaim (ftrace hist triggers on a kprobe of
do_swap_page and the vmscan tracepoints); the probes slow the run, so use it for the breakdown,
not for speedups.
Then, per workload: each bypass cache size's speedup over ramdisk, hdd and zram and its ratio
to ideal, and the paper's goals with met/missed: Stream 11.5x over the RAM disk and 32.4x over
the disk model, GUPS 15.4x (no baseline is named for it: checked against both), memperf
30.9x over the bypass with a 128 MiB cache (Fig. 11's caption), and within 1.2x of ideal once the host
cache covers the working set (C >= the workload's MiB). Against a baseline that timed out only
a bound in wall-time terms is known (timeout / the bypass run's wall time), shown as ">Nx".

--quick is a smoke run: 1 repetition, a 128 MB guest (vmsight's smallest) with 256 MB of swap,
192 MiB workloads and caches 0,32M,64M,128M,256M (explicit options still win). VMSIGHT names the vmsight binary
(default target/release/vmsight).

Every run (as --json has it) and the medians go to bench/results/swapbypass.json (--out).
"""
import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
import figures  # noqa: E402
import peers  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target",
                                                 "release", "vmsight"))
# The workload's own timing field (in-guest seconds, without boot, fills and checks).
GUEST_SECONDS = {"stream": "seconds", "gups": "seconds", "memperf": "total_seconds", "swap-check": None}
# The paper's speedups (§7.2, Fig. 11): (workload, baseline, factor). Stream's are over the RAM
# disk and the disk model; GUPS' is checked against both; memperf's is "measured over the 128MB
# swap disk cache configuration" (Fig. 11's caption): the bypass with a 128 MiB cache.
GOALS = [("stream", "ramdisk", 11.5), ("stream", "hdd", 32.4),
         ("gups", "ramdisk", 15.4), ("gups", "hdd", 15.4),
         ("memperf", "bypass-128M", 30.9)]
IDEAL_GOAL = 1.2
SWAP_FIELDS = ["guest_pswpin", "guest_pswpout", "bypass_stores", "bypass_loads", "bypass_load_misses",
               "block_reads", "block_writes", "cache_hits", "cache_misses", "evictions", "cache_limit_pages",
               "cache_used_pages"]
STATS_PLACEHOLDER = "STATS.json"
VCPUS = 2  # --vcpus


def parse_mib(s):
    """'512M' -> 512, '1G' -> 1024, '64' -> 64 (MiB), '0' -> 0."""
    m = re.fullmatch(r"(\d+)([MmGg]?)(i?[Bb])?", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in MiB (like 512M or 1G): {s!r}")
    n = int(m.group(1))
    return n * 1024 if m.group(2) in ("G", "g") else n


def size_text(mib):
    return "0" if mib == 0 else (f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M")


def check_vmsight(need_swap):
    """Fails loudly unless VMSIGHT is a vmsight whose `run` has the options used here."""
    if not (os.path.isfile(VMSIGHT) and os.access(VMSIGHT, os.X_OK)):
        sys.exit(f"swapbypass.py: no vmsight binary at {VMSIGHT}: build it (cargo build --release) "
                 "or point VMSIGHT at one")
    r = subprocess.run([VMSIGHT, "run", "--help"], capture_output=True, text=True)
    missing = [o for o in (["--swap"] if need_swap else []) + ["--stats-json", "--mem"] if o not in r.stdout]
    if r.returncode != 0 or missing:
        sys.exit(f"swapbypass.py: {VMSIGHT} run --help does not offer {', '.join(missing) or 'its options'} "
                 f"(exit status {r.returncode}): this vmsight has no SwapBypass swap disk")


# --- configurations ------------------------------------------------------------------------

def configs(a):
    """[(key, label, cache text, vmsight options, mem MiB, guest prefix script)] in run order."""
    swap = size_text(a.swap_size)
    out = []
    for name in a.configs:
        if name == "hdd":
            out.append(("hdd", "hdd", "0", ["--swap", f"{swap},cache=0", "--disk-model", "hdd"], a.mem, ""))
        elif name == "ramdisk":
            out.append(("ramdisk", "ramdisk", swap, ["--swap", f"{swap},cache={swap}"], a.mem, ""))
        elif name == "zram":
            comp = f"echo {a.zram_comp} > /sys/block/zram0/comp_algorithm && " if a.zram_comp else ""
            prefix = (f"{{ modprobe zram && {comp}echo {swap} > /sys/block/zram0/disksize && "
                      "mkswap /dev/zram0 >/dev/null && swapon /dev/zram0; } || "
                      "{ echo 'swapbench: zram setup failed' >&2; exit 98; }; "
                      "echo swapbench zram $(cat /sys/block/zram0/comp_algorithm); ")
            out.append(("zram", "zram", "-", [], a.mem, prefix))
        elif name == "ideal":
            out.append(("ideal", "ideal", "-", [], a.ideal_mem, ""))
        elif name == "grow":
            grow = max(2, a.ideal_mem - a.mem) // 2 * 2
            out.append(("grow", "grow", swap,
                        ["--symbiotic", "--swap", f"{swap},cache={swap},grow={grow}M"], a.mem, ""))
        elif name == "bypass":
            for c in a.cache_sizes:
                out.append((f"bypass-{size_text(c)}", "bypass", size_text(c),
                            ["--symbiotic", "--swap", f"{swap},cache={size_text(c)}"], a.mem, ""))
        elif name == "bypass-bio":
            # The bypass without rw_page: swap-ins through the swap cache with readahead, a clean
            # page keeping its slot (the module's swap_rw_page=0; docs/swapbypass.md).
            for c in a.cache_sizes:
                out.append((f"bypass-bio-{size_text(c)}", "bypass-bio", size_text(c),
                            ["--symbiotic", "--swap", f"{swap},cache={size_text(c)}",
                             "--append", "vmsight_sym.swap_rw_page=0"], a.mem, ""))
        else:
            sys.exit(f"swapbypass.py: unknown configuration {name!r} "
                     "(hdd, ramdisk, zram, ideal, bypass, bypass-bio, grow)")
    return out


# Where the guest's time goes, read around the workload: the CPU line of /proc/stat (user,
# nice, system, idle, iowait, irq, softirq ticks of USER_HZ, summed over the vCPUs), kswapd0's
# utime and stime (ticks), the TLB shootdown interrupts the vCPUs took (/proc/interrupts) and
# the module's swap_stats, whose store_ns, load_ns and copy_ns
# time the bypass's own work (the lock, the index, the 4 KiB copy). With the bypass, system
# time minus the module's is the kernel's own swap path: faults, reclaim, the swap cache.
TIME_PROBE = ("echo swapbench cpu $(head -n1 /proc/stat); "
              "echo swapbench tlb $(awk '/^ *TLB:/ { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i } "
              "END { print s + 0 }' /proc/interrupts); "
              "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = kswapd0 ] && "
              "echo swapbench kswapd $(cut -d' ' -f14,15 $p/stat); done; "
              "[ -r /sys/module/vmsight_sym/parameters/swap_stats ] && "
              "echo swapbench symswap $(tr '\\n' ' ' < /sys/module/vmsight_sym/parameters/swap_stats)")


# --latency: the guest kernel's own accounting of where the fault side's time goes, from
# ftrace hist triggers (no trace buffer): the summed duration of every swap-in fault
# (do_swap_page, a kprobe and a kretprobe) and of every direct reclaim (the vmscan
# tracepoints), per the trace clock `mono`. The probes cost time themselves, so a run with
# them is only for the breakdown, never for the speedups.
LATENCY_SETUP = (
    "T=/sys/kernel/tracing; [ -d $T/events ] || mount -t tracefs nodev $T 2>/dev/null; "
    "{ echo mono > $T/trace_clock && "
    "echo 'swb_fault u64 lat' >> $T/synthetic_events && echo 'swb_dreclaim u64 lat' >> $T/synthetic_events && "
    "echo 'p:swb_sw do_swap_page' >> $T/kprobe_events && echo 'r:swb_swr do_swap_page' >> $T/kprobe_events && "
    "echo 'hist:keys=common_pid:t0=common_timestamp' >> $T/events/kprobes/swb_sw/trigger && "
    "echo 'hist:keys=common_pid:lat=common_timestamp-$t0:onmatch(kprobes.swb_sw).trace(swb_fault,$lat)' "
    ">> $T/events/kprobes/swb_swr/trigger && "
    "echo 'hist:keys=common_pid:vals=hitcount,lat' >> $T/events/synthetic/swb_fault/trigger && "
    "echo 'hist:keys=common_pid:t1=common_timestamp' >> "
    "$T/events/vmscan/mm_vmscan_direct_reclaim_begin/trigger && "
    "echo 'hist:keys=common_pid:lat=common_timestamp-$t1:onmatch(vmscan.mm_vmscan_direct_reclaim_begin)"
    ".trace(swb_dreclaim,$lat)' >> $T/events/vmscan/mm_vmscan_direct_reclaim_end/trigger && "
    "echo 'hist:keys=common_pid:vals=hitcount,lat' >> $T/events/synthetic/swb_dreclaim/trigger && "
    "echo 1 > $T/tracing_on; } || { echo 'swapbench: the latency probes could not be set up' >&2; exit 96; }; ")
# Sums the hist files' totals: "Totals: Hits: N Entries: M" and per entry "lat: NS".
LATENCY_DUMP = (
    "for e in swb_fault swb_dreclaim; do echo swapbench latency $e "
    "$(awk '/hitcount:/ { for (i = 1; i < NF; i++) { if ($i == \"hitcount:\") h += $(i + 1); "
    "if ($i == \"lat:\") l += $(i + 1) } } END { printf \"%d %.0f\", h, l }' "
    "$T/events/synthetic/$e/hist); done; ")
SYM_TIME_KEYS = ("store_ns", "load_ns", "copy_ns", "stores", "loads")


def guest_script(prefix, workload_cmd, zram, latency=False):
    """The guest command: swap statistics and the time probe around the workload (with
    LATENCY also the fault and direct-reclaim sums); the workload's exit status."""
    vm = 'echo swapbench vmstat $(grep -E "^pswp(in|out) " /proc/vmstat)'
    mi = 'echo swapbench meminfo $(grep -E "^(MemTotal|SwapTotal|SwapFree):" /proc/meminfo)'
    after = f"{vm}; {mi}; {TIME_PROBE}; " + (
        "echo swapbench zram_mm_stat $(cat /sys/block/zram0/mm_stat); " if zram else "")
    setup, dump = (LATENCY_SETUP, LATENCY_DUMP) if latency else ("", "")
    return f"{prefix}{vm}; {mi}; {setup}{TIME_PROBE}; {workload_cmd}; rc=$?; {dump}{after}exit $rc"


def vm_argv(cfg, stats, script):
    _, _, _, opts, mem, _ = cfg
    return [VMSIGHT, "run", "--mem", f"{mem}M", "--vcpus", str(VCPUS), "--stats-json", stats, *opts,
            "--", "sh", "-c", script]


# --- one run -------------------------------------------------------------------------------

def run_vm(argv, timeout):
    """Runs argv in its own process group; returns (status, stdout, stderr, wall s, CPU s,
    timed out). On timeout the group gets SIGTERM, then SIGKILL 30 s later."""
    c0 = peers.children_cpu_s()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, errors="replace", start_new_session=True)
    timed_out = False

    def kill(sig):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            kill(signal.SIGKILL)
            out, err = p.communicate()
    except BaseException:  # ^C: the VM is in its own process group, so stop it here
        kill(signal.SIGKILL)
        p.wait()
        raise
    wall = time.monotonic() - t0
    return p.returncode, out, err, wall, peers.children_cpu_s() - c0, timed_out


def kv(line):
    """'prog a=1 b=x' -> {'a': 1.0, 'b': 'x'}."""
    d = {}
    for tok in line.split()[1:]:
        if "=" not in tok:
            d.setdefault("tag", tok)  # swap-check's OK or BAD
        else:
            k, v = tok.split("=", 1)
            try:
                d[k] = float(v)
            except ValueError:
                d[k] = v
    return d


def parse_output(prog, stdout):
    vmstat, meminfo, res, zram = [], [], None, {}
    cpu, kswapd, sym, latency, tlb = [], [], [], {}, []
    for line in stdout.splitlines():
        w = line.split()
        if line.startswith("swapbench cpu cpu ") and len(w) >= 10:
            cpu.append([int(x) for x in w[3:10]])
        elif line.startswith("swapbench tlb ") and len(w) == 3:
            tlb.append(int(w[2]))
        elif line.startswith("swapbench kswapd ") and len(w) == 4:
            kswapd.append(int(w[2]) + int(w[3]))
        elif line.startswith("swapbench latency ") and len(w) == 5:
            latency[w[2]] = {"count": int(w[3]), "s": int(w[4]) / 1e9}
        elif line.startswith("swapbench symswap "):
            # KEY VALUE pairs after a state line of one or more words: looked up by key.
            sym.append({k: w[i + 1] for i, k in enumerate(w[:-1]) if k in SYM_TIME_KEYS})
        elif line.startswith("swapbench vmstat"):
            vmstat.append({w[i]: int(w[i + 1]) for i in range(2, len(w) - 1, 2)})
        elif line.startswith("swapbench meminfo"):
            meminfo.append({w[i].rstrip(":"): int(w[i + 1]) for i in range(2, len(w) - 2, 3)})
        elif line.startswith("swapbench zram_mm_stat") and len(w) >= 4:
            # orig_data_size compr_data_size mem_used_total mem_limit mem_used_max same_pages ...
            zram.update(orig_kib=int(w[2]) // 1024, compr_kib=int(w[3]) // 1024)
            if len(w) >= 8:
                zram.update(mem_used_max_kib=int(w[6]) // 1024, same_pages=int(w[7]))
        elif line.startswith("swapbench zram "):
            zram["comp_algorithm"] = " ".join(w[2:])
        elif line.startswith(prog + " ") and "=" in line:
            res = kv(line)
    out = {"result": res, "zram": zram or None,
           "meminfo_before": meminfo[0] if meminfo else None}
    out["breakdown"] = time_breakdown(cpu, kswapd, sym)
    if out["breakdown"] is not None and len(tlb) >= 2:
        out["breakdown"]["tlb_shootdowns"] = tlb[-1] - tlb[0]
    if out["breakdown"] is not None and latency:
        b = out["breakdown"]
        for name, key in (("swb_fault", "swapin_fault"), ("swb_dreclaim", "direct_reclaim")):
            if name in latency:
                b[key + "_s"], b[key + "s"] = latency[name]["s"], latency[name]["count"]
    if len(vmstat) >= 2:
        out["pswpin"] = vmstat[-1].get("pswpin", 0) - vmstat[0].get("pswpin", 0)
        out["pswpout"] = vmstat[-1].get("pswpout", 0) - vmstat[0].get("pswpout", 0)
    return out


def time_breakdown(cpu, kswapd, sym):
    """The guest's vCPU seconds over the workload by kind, kswapd's, and the module's own
    (None without both probes). USER_HZ is 100 on Debian's kernels."""
    if len(cpu) < 2:
        return None
    d = [b - a for a, b in zip(cpu[0], cpu[-1])]
    out = {"user_s": (d[0] + d[1]) / 100, "system_s": d[2] / 100, "idle_s": (d[3] + d[4]) / 100,
           "irq_s": (d[5] + d[6]) / 100}
    if len(kswapd) >= 2:
        out["kswapd_s"] = (kswapd[-1] - kswapd[0]) / 100
    if len(sym) >= 2:
        for k in SYM_TIME_KEYS:
            try:
                v = int(sym[-1][k]) - int(sym[0][k])
            except (KeyError, ValueError):
                continue
            out[k.replace("_ns", "_s") if k.endswith("_ns") else "module_" + k] = (
                v / 1e9 if k.endswith("_ns") else v)
        if "store_s" in out and "load_s" in out:
            out["kernel_path_s"] = out["system_s"] - out["store_s"] - out["load_s"]
    return out


def valid(prog, res):
    if not res:
        return False
    if prog == "gups":
        return res.get("errors") == 0
    if prog == "swap-check":
        return res.get("tag") == "OK"
    return res.get("valid") == 1


def one_run(cfg, wl, rep, a, shown):
    key, label, cache, _, mem, prefix = cfg
    prog, mib, extra = wl
    cmd = " ".join([prog, str(mib), *extra])
    script = guest_script(prefix + (f"{a.guest_prefix}; " if a.guest_prefix else ""), cmd, label == "zram",
                          a.latency)
    work = tempfile.mkdtemp(prefix="bench-swapbypass-")
    try:
        stats_path = os.path.join(work, "stats.json")
        argv = vm_argv(cfg, stats_path, script)
        if (key, prog) not in shown:
            shown.add((key, prog))
            print(f"# {prog} {key}: {shlex.join(vm_argv(cfg, STATS_PLACEHOLDER, script))}", flush=True)
        status, out, err, wall, cpu, timed_out = run_vm(argv, a.timeout)
        stats = {}
        if os.path.exists(stats_path):
            try:
                with open(stats_path) as f:
                    stats = json.load(f)
            except (OSError, ValueError) as e:
                print(f"# {prog} {key}: unreadable --stats-json file: {e}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "Usage: vmsight" in err or "unexpected argument" in err:
        sys.exit(f"swapbypass.py: vmsight rejected the command line of {key}:\n{err.strip()[-2000:]}")
    parsed = parse_output(prog, out)
    res = parsed["result"]
    field = GUEST_SECONDS.get(prog)
    r = {"workload": prog, "mib": mib, "config": key, "kind": label, "cache": cache, "mem_mib": mem, "rep": rep,
         "status": status, "timed_out": timed_out, "wall_s": wall, "cpu_s": cpu,
         "guest_s": res.get(field) if res and field else None,
         "ok": not timed_out and status == 0 and valid(prog, res),
         "result": res, "pswpin": parsed.get("pswpin"), "pswpout": parsed.get("pswpout"),
         "meminfo_before": parsed["meminfo_before"], "zram": parsed["zram"], "breakdown": parsed["breakdown"],
         "swap": stats.get("swap") if isinstance(stats.get("swap"), dict) else None,
         "boot_seconds": stats.get("boot_seconds"), "stats": stats,
         "stdout_tail": out[-2000:], "stderr_tail": err[-2000:]}
    swap_total = (parsed["meminfo_before"] or {}).get("SwapTotal")
    note = ""
    if timed_out:
        note = f" TIMED OUT after {a.timeout:.0f} s"
    elif status == 127 or f"{prog}: not found" in err:
        note = f" FAILED (status {status}): is `{prog}` in the guest image? (vmsight image build)"
    elif status == 96 and "latency probes" in err:
        note = " FAILED: the guest's ftrace could not set up the latency probes (--latency)"
    elif status == 98 and "zram setup failed" in err:
        note = " FAILED: the guest could not set up zram swap"
    elif not r["ok"]:
        note = f" FAILED (status {status}, result {res})"
    if label != "ideal" and swap_total == 0:
        note += " WARNING: the guest had no swap"
    sw = r["swap"] or {}
    def f(x):
        return fmt(x, 2) or "-"
    print(f"rep {rep} {prog} {key}: wall {wall:.1f} s, guest {f(r['guest_s'])} s, cpu {cpu:.1f} s, "
          f"pswpin {f(r['pswpin'])} pswpout {f(r['pswpout'])}, bypass loads {f(sw.get('bypass_loads'))} "
          f"stores {f(sw.get('bypass_stores'))}, block reads {f(sw.get('block_reads'))} "
          f"writes {f(sw.get('block_writes'))}{note}", flush=True)
    if not r["ok"] and not timed_out:
        tail = "\n".join(("stderr: " + err.strip()[-800:]).splitlines()[-8:])
        print(f"#   {tail}", flush=True)
    return r


# --- summary -------------------------------------------------------------------------------

def fmt(x, nd=1):
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def med(values):
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def summarize(runs):
    """Medians of one (workload, config): timeouts count as infinitely slow, failures not at
    all (a config whose every run failed has no time)."""
    ok = [r for r in runs if r["ok"]]
    slow = [r for r in runs if r["timed_out"]]
    s = {"runs": len(runs), "ok": len(ok), "timed_out": len(slow), "failed": len(runs) - len(ok) - len(slow)}
    counted = ok + slow
    s["wall_s"] = med([math.inf if r["timed_out"] else r["wall_s"] for r in counted])
    s["guest_s"] = med([math.inf if r["timed_out"] else r["guest_s"] for r in counted])
    s["cpu_s"] = med([r["cpu_s"] for r in runs])
    for k in ("pswpin", "pswpout"):
        s[k] = med([r[k] for r in counted])
    for k in SWAP_FIELDS:
        s[k] = med([(r["swap"] or {}).get(k) for r in counted])
    return s


def show_time(x, timeout):
    if x is None:
        return "FAIL"
    if math.isinf(x):
        return f">{timeout:.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def ratio(num, den):
    """num / den with timeouts (inf) and failures (None): None when unknown."""
    if num is None or den is None or den == 0 or math.isinf(den):
        return None
    return num / den


def report(a, cfgs, results):
    summary = {}
    for prog, mib, _ in a.workloads:
        rows = {c[0]: summarize([r for r in results if r["workload"] == prog and r["config"] == c[0]]) for c in cfgs}
        summary[prog] = rows
        print(f"\n### {prog} {mib} (guest {size_text(a.mem)}, swap {size_text(a.swap_size)}; medians of "
              f"{a.reps} repetition(s); in-guest s = the workload's own timing)\n")
        print("| config | cache | runs ok | wall s | in-guest s | host CPU s | pswpin | pswpout | bypass loads "
              "| bypass stores | bypass load misses | block reads | block writes | cache hits | cache misses "
              "| evictions |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key, label, cache, _, _, _ in cfgs:
            s = rows[key]
            cells = [key, cache, f"{s['ok']}/{s['runs']}", show_time(s["wall_s"], a.timeout),
                     "" if not GUEST_SECONDS[prog] else
                     show_time(s["guest_s"], a.timeout) if s["ok"] or s["timed_out"] else "FAIL",
                     fmt(s["cpu_s"]), fmt(s["pswpin"], 0), fmt(s["pswpout"], 0)]
            cells += [fmt(s[k], 0) for k in ("bypass_loads", "bypass_stores", "bypass_load_misses", "block_reads",
                                             "block_writes", "cache_hits", "cache_misses", "evictions")]
            print("| " + " | ".join(cells) + " |")

        byp = [(c[0], parse_mib(c[2])) for c in cfgs if c[1] in ("bypass", "grow")]
        kinds = {c[0]: c[1] for c in cfgs}
        if not byp or not GUEST_SECONDS[prog]:
            continue  # (swap-check prints no timing of its own: the table above is all)
        base = dict(rows)  # any config can be a goal's baseline (memperf's is bypass-128M)
        print(f"\n| {prog}: bypass config | in-guest s | speedup over ramdisk | over hdd | over zram | "
              "/ ideal |")
        print("|---|---|---|---|---|---|")
        for key, cache_mib in byp:
            g = rows[key]["guest_s"]
            cells = [key, show_time(g, a.timeout) if g is not None else "FAIL"]
            for b in ("ramdisk", "hdd", "zram"):
                cells.append(speedup_text(base.get(b), rows[key], a.timeout))
            ideal = base.get("ideal")
            r = ratio(g, ideal["guest_s"]) if ideal else None
            cells.append(f"{r:.2f}x" if r is not None else "")
            print("| " + " | ".join(cells) + " |")

        goals = [(b, f) for w, b, f in GOALS if w == prog]
        if goals or "ideal" in base:
            print(f"\n| {prog}: paper's goal | best measured | config | met |")
            print("|---|---|---|---|")
        # Only the bypass alone (the paper's mechanism) counts toward the paper's goals; the
        # growth through virtio-mem adds guest memory, a different mechanism, and is shown
        # in the tables above beside the ideal, never here.
        paper = [(k, c) for k, c in byp if kinds[k] == "bypass"]
        for b, f in goals:
            best, at = None, None
            for key, cache_mib in paper:
                if key == b:
                    continue
                sp = speedup_value(base.get(b), rows[key], a.timeout)
                if sp is not None and (best is None or sp[0] > best[0]):
                    best, at = sp, key
            if best is None:
                print(f"| >= {f}x over {b} | unknown | | unknown |")
            else:
                v, bound = best
                shown = f">{v:.1f}x (wall, {b} timed out)" if bound else f"{v:.1f}x"
                met = "met" if v >= f else ("unknown" if bound else "missed")
                print(f"| >= {f}x over {b} | {shown} | {at} | {met} |")
        if "ideal" in base:
            for key, cache_mib in byp:
                if cache_mib < mib or kinds[key] != "bypass":
                    continue
                r = ratio(rows[key]["guest_s"], base["ideal"]["guest_s"])
                met = "unknown" if r is None else ("met" if r <= IDEAL_GOAL else "missed")
                print(f"| within {IDEAL_GOAL}x of ideal (cache covers the {mib} MiB) | "
                      f"{'' if r is None else f'{r:.2f}x'} | {key} | {met} |")
    return summary


BREAKDOWN_COLS = [("user_s", "user"), ("system_s", "system"), ("idle_s", "idle"), ("kswapd_s", "kswapd"),
                  ("store_s", "module stores"), ("load_s", "module loads"), ("copy_s", "of which copies"),
                  ("kernel_path_s", "kernel swap path"), ("swapin_fault_s", "swap-in faults"),
                  ("direct_reclaim_s", "direct reclaim")]


def report_breakdown(a, cfgs, results):
    """Per workload and config, the medians of where the guest's vCPU seconds went over the
    workload (/proc/stat, kswapd, the module's own timing, --latency's sums), the kernel swap
    path's microseconds per page swapped in and out, and the TLB shootdowns."""
    out = {}
    for prog, mib, _ in a.workloads:
        rows = {}
        for key, *_ in cfgs:
            runs = [r for r in results if r["workload"] == prog and r["config"] == key and r.get("breakdown")]
            if runs:
                keys = {k for r in runs for k in r["breakdown"]}
                rows[key] = {k: med([r["breakdown"].get(k) for r in runs]) for k in keys}
                rows[key]["guest_s"] = med([r["guest_s"] for r in runs])
                rows[key]["pages"] = med([(r["pswpin"] or 0) + (r["pswpout"] or 0) for r in runs
                                          if r["pswpin"] is not None])
        if not rows:
            continue
        out[prog] = rows
        print(f"\n### {prog} {mib}: where the guest's vCPU seconds go over the workload ({a.vcpus} vCPUs; "
              "medians; kernel swap path = system - module stores - module loads)\n")
        print("| config | in-guest s | " + " | ".join(h + " s" for _, h in BREAKDOWN_COLS)
              + " | kernel path us per page in+out | TLB shootdowns |")
        print("|---|---|" + "---|" * (len(BREAKDOWN_COLS) + 2))
        for key, row in rows.items():
            per = (row["kernel_path_s"] * 1e6 / row["pages"]
                   if row.get("kernel_path_s") is not None and row.get("pages") else None)
            cells = [key, fmt(row["guest_s"], 1)] + [fmt(row.get(k), 1) for k, _ in BREAKDOWN_COLS]
            cells += [fmt(per, 1), fmt(row.get("tlb_shootdowns"), 0)]
            print("| " + " | ".join(cells) + " |")
    return out


def speedup_value(base, s, timeout):
    """(speedup of s over base in in-guest seconds, is_lower_bound); a timed-out base gives a
    bound in wall-time terms (timeout / s's wall); None when unknown."""
    if base is None or s["guest_s"] is None or math.isinf(s["guest_s"]) or base["guest_s"] is None:
        return None
    if math.isinf(base["guest_s"]):
        if s["wall_s"] is None or math.isinf(s["wall_s"]):
            return None
        return timeout / s["wall_s"], True
    return base["guest_s"] / s["guest_s"], False


def speedup_text(base, s, timeout):
    v = speedup_value(base, s, timeout)
    if v is None:
        return ""
    return f">{v[0]:.1f}x (wall)" if v[1] else f"{v[0]:.2f}x"


def report_again(res_path):
    """The tables of a results file, from its parameters and repetitions (no VM runs)."""
    with open(res_path) as f:
        doc = json.load(f)
    p = doc["params"]
    a = argparse.Namespace(**{**p, "workloads": [tuple(w) for w in p["workloads"]]})
    a.vcpus = p.get("vcpus", 2)
    cfgs = configs(a)
    runs = doc["reps"]
    report(a, cfgs, runs)
    report_breakdown(a, cfgs, runs)


# --- figures -------------------------------------------------------------------------------

def plot(res_path):
    """Fig. 9's shape (each workload's in-guest time against the bypass's cache size, the RAM
    disk, the ideal and the growth as lines) and where the vCPU seconds went, from a results
    file (its `reps`, or a --json file's `runs`), as SVG under docs/figures."""
    plt = figures.pyplot(__file__, res_path)
    if plt is None:
        return
    with open(res_path) as f:
        doc = json.load(f)
    runs = [r for r in doc.get("reps") or doc.get("runs") or [] if r.get("ok")]
    progs = [p for p in ("stream", "gups", "memperf") if any(r["workload"] == p for r in runs)]
    if not progs:
        return
    tag = f"commit {doc.get('commit', '?')}, {doc.get('date', '')[:10]}"

    f, axes = plt.subplots(1, len(progs), figsize=(4.2 * len(progs), 3.6), squeeze=False)
    for ax, prog in zip(axes[0], progs):
        rs = [r for r in runs if r["workload"] == prog]
        byp = sorted({parse_mib(r["cache"]) for r in rs if r["kind"] == "bypass"})
        xs = [c for c in byp if any(r["kind"] == "bypass" and parse_mib(r["cache"]) == c for r in rs)]
        ys = [med([r["guest_s"] for r in rs if r["kind"] == "bypass" and parse_mib(r["cache"]) == c]) for c in xs]
        ax.plot(xs, ys, marker="o", color="C0", label="bypass (cache size)")
        for c in xs:
            pts = [r["guest_s"] for r in rs if r["kind"] == "bypass" and parse_mib(r["cache"]) == c]
            ax.scatter([c] * len(pts), pts, s=8, color="C0", alpha=0.5)
        for kind, color, name in (("ramdisk", "C3", "RAM disk (paper's baseline)"),
                                  ("ideal", "C2", "ideal (1 GiB, no swap)"),
                                  ("grow", "C1", "bypass + virtio-mem (not the paper's)")):
            v = med([r["guest_s"] for r in rs if r["kind"] == kind])
            if v is not None:
                ax.axhline(v, color=color, linestyle="--", linewidth=1, label=f"{name}: {v:.1f} s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs or [1])
        ax.set_xticklabels([f"{c}M" for c in xs] or [""])
        ax.set_xlabel("bypass cache (MiB)")
        ax.set_ylabel("in-guest seconds (median)")
        ax.set_title(f"{prog} {rs[0]['mib']} MiB, 256 MB guest")
        ax.legend(fontsize=6)
    f.suptitle(f"SwapBypass, Fig. 9 shape ({tag})", fontsize=9)
    f.tight_layout()
    out = os.path.join(figures.FIGURES, "swapbypass-fig9.svg")
    f.savefig(out)
    plt.close(f)
    print(f"figure: {out}")

    parts = [("user_s", "user", "C0"), ("kernel_path_s", "guest kernel: system - module (RAM disk: + block path)", "C3"),
             ("module_s", "module: lock, index, copy", "C1"), ("idle_s", "idle (waiting)", "0.8")]
    f, ax = plt.subplots(figsize=(8, 0.5 + 0.35 * 3 * len(progs)))
    labels, y = [], 0
    for prog in progs:
        for key in ("ramdisk", "bypass-512M", "ideal"):
            rs = [r for r in runs if r["workload"] == prog and r["config"] == key and r.get("breakdown")]
            if not rs:
                continue
            b = {k: med([r["breakdown"].get(k) for r in rs]) for k in ("user_s", "system_s", "idle_s",
                                                                         "store_s", "load_s")}
            module = (b["store_s"] or 0) + (b["load_s"] or 0)
            vals = {"user_s": b["user_s"] or 0, "kernel_path_s": (b["system_s"] or 0) - module,
                    "module_s": module, "idle_s": b["idle_s"] or 0}
            left = 0.0
            for k, name, color in parts:
                ax.barh(y, vals[k], left=left, color=color, label=name if y == 0 else None)
                left += vals[k]
            labels.append(f"{prog} {key}")
            y += 1
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    vcpus = (doc.get("params") or doc.get("args") or {}).get("vcpus", 2)
    ax.set_xlabel(f"guest vCPU seconds over the workload ({vcpus} vCPUs; medians)")
    ax.set_title(f"SwapBypass: where the guest's time goes ({tag})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    f.tight_layout()
    out = os.path.join(figures.FIGURES, "swapbypass-breakdown.svg")
    f.savefig(out)
    plt.close(f)
    print(f"figure: {out}")


# --- main ----------------------------------------------------------------------------------

def parse_workloads(text, mib_default, extra_args, nohuge, canonical):
    out = []
    for item in filter(None, text.split(",")):
        name, _, mib = item.partition(":")
        if name not in GUEST_SECONDS:
            sys.exit(f"swapbypass.py: unknown workload {name!r} (stream, gups, memperf, swap-check)")
        m = int(mib) if mib else mib_default[name]
        extra = shlex.split(extra_args.get(name, "")) + (["--nohuge"] if nohuge else [])
        if canonical and name != "swap-check":
            extra.append("--canonical")
        out.append((name, m, extra))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, help="repetitions (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 rep, 128 MB guest, 192 MiB workloads")
    ap.add_argument("--workloads", help="NAME[:MIB],... (default stream:300,gups:256,memperf:256)")
    ap.add_argument("--configs", default="hdd,ramdisk,zram,ideal,bypass,grow")
    ap.add_argument("--cache-sizes", help="bypass host cache sizes (default 0,64M,128M,256M,512M)")
    ap.add_argument("--mem", type=parse_mib, help="guest memory (default 256M; --quick 128M)")
    ap.add_argument("--swap-size", type=parse_mib, help="swap size (default 512M; --quick 256M)")
    ap.add_argument("--ideal-mem", type=parse_mib, default=1024, help="the ideal guest's memory (default 1G)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    ap.add_argument("--data", choices=("canonical", "random"), default="canonical",
                    help="the workloads' start values: the benchmarks' own (compressible) or random")
    ap.add_argument("--nohuge", action="store_true", help="pass --nohuge to the workloads (no THP)")
    ap.add_argument("--zram-comp", default="", help="zram compressor (default: the kernel's, lzo-rle)")
    ap.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                    help="extra arguments for one workload, e.g. 'gups=--updates-per-word 0.03125'")
    ap.add_argument("--latency", action="store_true",
                    help="also sum the guest's swap-in fault and direct-reclaim durations (ftrace hist "
                         "triggers; the probes slow the run: for the breakdown only)")
    ap.add_argument("--vcpus", type=int, default=2, help="the guests' vCPUs (default 2)")
    ap.add_argument("--guest-prefix", default="",
                    help="a shell command the guest runs before each workload's probes, e.g. "
                         "'echo 1 > /sys/module/vmsight_sym/parameters/swap_copy_page'")
    ap.add_argument("--no-plot", action="store_true", help="do not draw docs/figures/swapbypass-*.svg")
    ap.add_argument("--plot-only", metavar="RESULTS", help="only draw the figures from this results file")
    ap.add_argument("--report-only", metavar="RESULTS",
                    help="only print the tables (goals, breakdown) of this results file's repetitions")
    ap.add_argument("--json", help="write every run's raw results (and the medians) to this file")
    bench_results.add_out_option(ap, "swapbypass")
    a = ap.parse_args()
    if a.plot_only:
        plot(a.plot_only)
        return
    if a.report_only:
        report_again(a.report_only)
        return
    # The VMs run in process groups of their own (so a timeout can stop QEMU too); a SIGTERM
    # must unwind through run_vm to stop the current one, as ^C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("swapbypass.py: terminated"))
    q = a.quick
    a.reps = a.reps if a.reps is not None else (1 if q else 3)
    a.mem = a.mem if a.mem is not None else (128 if q else 256)
    a.swap_size = a.swap_size if a.swap_size is not None else (256 if q else 512)
    try:
        a.cache_sizes = [parse_mib(c) for c in (a.cache_sizes or ("0,32M,64M,128M,256M" if q else
                                                                  "0,64M,128M,256M,512M")).split(",")]
    except argparse.ArgumentTypeError as e:
        sys.exit(f"swapbypass.py: --cache-sizes: {e}")
    extra = {}
    for item in a.args:
        name, eq, rest = item.partition("=")
        if not eq:
            sys.exit(f"swapbypass.py: --args takes NAME=ARGS, not {item!r}")
        extra[name] = rest
    mib_default = ({"stream": 192, "gups": 192, "memperf": 192, "swap-check": 192} if q else
                   {"stream": 300, "gups": 256, "memperf": 256, "swap-check": 300})
    a.workloads = parse_workloads(a.workloads or "stream,gups,memperf", mib_default, extra, a.nohuge,
                                  a.data == "canonical")
    a.configs = [c for c in a.configs.split(",") if c]
    global VCPUS
    VCPUS = a.vcpus
    if a.reps < 1 or a.timeout <= 0 or not a.workloads or a.vcpus < 1:
        sys.exit("swapbypass.py: --reps, --timeout and --vcpus must be positive, --workloads not empty")
    cfgs = configs(a)
    check_vmsight(any(c[1] in ("hdd", "ramdisk", "bypass", "bypass-bio") for c in cfgs))
    rec = bench_results.Recorder(
        "swapbypass", a, out=a.out, keys=["workload", "config"], baseline="ramdisk",
        metrics=["guest_s", "wall_s", "cpu_s", "pswpin", "pswpout", "swap.bypass_loads", "swap.bypass_stores",
                 "swap.block_reads", "swap.block_writes", "swap.evictions"])

    with open("/proc/loadavg") as f:
        print(f"# load before: {f.read().strip()}", flush=True)
    print(f"# vmsight {VMSIGHT}; {a.reps} repetition(s); timeout {a.timeout:.0f} s per run", flush=True)
    results, shown = [], set()

    def dump(summary=None):
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items()}, "runs": results, "summary": summary}, f,
                          indent=1)

    for rep in range(a.reps):
        for wl in a.workloads:
            for cfg in cfgs:
                results.append(one_run(cfg, wl, rep, a, shown))
                dump()
    with open("/proc/loadavg") as f:
        print(f"# load after: {f.read().strip()}", flush=True)
    summary = report(a, cfgs, results)
    breakdown = report_breakdown(a, cfgs, results)
    dump(dict(summary, breakdown=breakdown))
    for r in results:
        rec.add(r)
    path = rec.write(summary={"by_workload": summary, "breakdown": breakdown})
    if not a.no_plot:
        plot(path or a.out)


if __name__ == "__main__":
    main()
