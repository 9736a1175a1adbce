"""What several benchmarks need about a running `vmsight run`: its process tree's CPU time and
when its network is up."""
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pids):
    """utime + stime of the processes (all their threads), in clock ticks."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def descendants(pid):
    """`pid` and every process below it (QEMU, device daemons)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        todo.extend(int(k) for k in kids)
    return out


def wait_net(vmsight, name):
    """Waits until VM `name` has its network (its namespace exists before QEMU starts)."""
    for _ in range(600):
        if subprocess.run([vmsight, "net", name, "info"], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    sys.exit(f"VM {name} has no network")


def marked_run(args, expect, what):
    """Runs `vmsight run` ARGS whose guest prints `BEGIN name` / `END name NS` around each of
    the `expect` workloads; returns {name: (host CPU seconds of the vmsight tree between the
    markers, guest wall seconds)}. Raises if the run fails or a workload is missing."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    out, begin = {}, {}
    for line in p.stdout:
        w = line.split()
        if len(w) >= 2 and w[0] == "BEGIN":
            begin[w[1]] = cpu_ticks(descendants(p.pid))
        elif len(w) == 3 and w[0] == "END":
            ticks = cpu_ticks(descendants(p.pid)) - begin[w[1]]
            out[w[1]] = (ticks / TICK, int(w[2]) / 1e9)
    err = p.stderr.read()
    if p.wait() != 0 or len(out) != expect:
        raise RuntimeError(f"{what} failed ({p.returncode}): {err[-2000:]}")
    return out
