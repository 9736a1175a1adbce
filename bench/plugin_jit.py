#!/usr/bin/env python3
"""What a loaded plugin changes in QEMU's generated code: `info jit` after the same workload
with no plugin, the dormant plugin and the counting plugin (issue 17).

QEMU's HMP monitor is added through a `--qemu` wrapper script (vmsight itself keeps QMP);
after the workload (48 MiB of sha256sum three times, find /usr) the guest prints READY and
sleeps while the script asks `info jit`. Translation-block counts differ a little from boot
to boot; the average host code per block is what the plugin's instrumentation changes.

  bench/plugin_jit.py [--out PATH]

The counts of every configuration go to bench/results/plugin_jit.json (--out).
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))
QEMU = os.environ.get("QEMU", "qemu-system-x86_64")
WORKLOAD = ("dd if=/dev/urandom of=/tmp/f bs=1M count=48 2>/dev/null; "
            "for i in 1 2 3; do sha256sum /tmp/f >/dev/null; done; find /usr -xdev >/dev/null; "
            "echo READY; sleep 30")
CONFIGS = {"no-plugin": ["--no-plugin"], "dormant": [], "counting": ["--count-syscalls"]}
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import results as bench_results  # noqa: E402


def wrapper(tmp):
    sock = os.path.join(tmp, "hmp.sock")
    path = os.path.join(tmp, "qemu")
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
case "$*" in *--version*) exec {QEMU} "$@";; esac
exec {QEMU} "$@" -monitor unix:{sock},server=on,wait=off
""")
    os.chmod(path, 0o755)
    return path, sock


def hmp(sock, cmd):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(2)
    out = b""

    def drain():
        nonlocal out
        try:
            while True:
                d = s.recv(65536)
                if not d:
                    break
                out += d
        except socket.timeout:
            pass
    drain()
    out = b""
    s.sendall(cmd.encode() + b"\n")
    drain()
    return out.decode(errors="replace")


def jit(config):
    with tempfile.TemporaryDirectory() as tmp:
        qemu, sock = wrapper(tmp)
        p = subprocess.Popen([VMSIGHT, "run", "--qemu", qemu] + CONFIGS[config] +
                             ["--", "sh", "-c", WORKLOAD], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        for line in p.stdout:
            if line.strip() == "READY":
                break
        text = hmp(sock, "info jit")
        p.kill()
        p.wait()
        time.sleep(1)
    vals = {}
    for line in text.splitlines():
        if line.startswith("TB count"):
            vals["blocks"] = int(line.split()[2])
        elif line.startswith("TB avg host size"):
            vals["host_bytes"] = int(line.split()[4])
        elif line.startswith("TB avg target size"):
            vals["guest_bytes"] = int(line.split()[4])
    if len(vals) != 3:
        sys.exit(f"{config}: no info jit answer:\n{text}")
    return vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_results.add_out_option(ap, "plugin_jit")
    a = ap.parse_args()
    rec = bench_results.Recorder("plugin_jit", a, out=a.out, baseline="no-plugin")
    print("| configuration | translation blocks | guest bytes per block | host bytes per block |")
    print("|---|---|---|---|")
    for c in CONFIGS:
        v = jit(c)
        print(f"| {c} | {v['blocks']} | {v['guest_bytes']} | {v['host_bytes']} |")
        rec.rep(config=c, rep=0, **v)
    rec.write()


if __name__ == "__main__":
    main()
