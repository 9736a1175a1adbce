#!/usr/bin/env python3
"""Boots a built guest image with plain QEMU and checks the host <-> guest protocol.

A stand-alone smoke test for the image recipe (docs/guest-protocol.md), independent of the
vmsight launcher. Not part of the recipe hash (crates/image embeds only the build inputs).

  guest/boot-test.py IMAGE_DIR [--cmd 'SHELL TEXT'] [--stdin TEXT] [--expect-exit N]
  guest/boot-test.py IMAGE_DIR --interactive 'LINE'   # no fw_cfg command: types LINE on ttyS0

Prints the ctl lines with their time since QEMU started, the command's stdout/stderr, the QEMU
exit status and the e2fsck -fn result of the used root-disk copy. Exit status 0 if all checks
pass.
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time


def connect(path, deadline):
    while True:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def reader(sock, sink, on_line=None):
    buf = b""
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        sink.append(data)
        if on_line:
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                on_line(line.decode(errors="replace"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("image")
    ap.add_argument("--cmd", help="shell text run as the guest command (fw_cfg opt/vmsight/cmd)")
    ap.add_argument("--stdin", default=None, help="bytes sent on vmsight.stdin after 'ready'")
    ap.add_argument("--stdin-early", action="store_true",
                    help="send --stdin right after connecting, before 'ready' (still closed after it)")
    ap.add_argument("--interactive", help="no command: type this line on the serial console")
    ap.add_argument("--expect-exit", type=int, default=None)
    ap.add_argument("--expect-stdout", default=None)
    ap.add_argument("--no-stdin-port", action="store_true")
    ap.add_argument("--smp", default="2")
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="vmsight-boot-")
    img = a.image
    root = os.path.join(work, "root.img")
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", os.path.join(img, "rootfs.img"), root], check=True)
    sock = lambda n: os.path.join(work, n + ".sock")
    qemu = [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", a.smp,
        "-m", a.mem, "-machine", "q35", "-nodefaults", "-no-user-config", "-display", "none",
        "-no-reboot", "-kernel", os.path.join(img, "vmlinuz"),
        "-initrd", os.path.join(img, "initrd.img"),
        "-append", "console=ttyS0 root=/dev/vda rw nokaslr panic=-1 "
                   "init=/usr/lib/vmsight/init vmsight.name=boottest",
        "-chardev", f"socket,id=con,path={sock('console')},server=on,wait=off,"
                    f"logfile={os.path.join(work, 'console.log')}",
        "-serial", "chardev:con",
        "-drive", f"if=virtio,file={root},format=raw",
        "-device", "virtio-serial-pci",
    ]
    ports = ["ctl", "stdout", "stderr"] + ([] if a.no_stdin_port else ["stdin"])
    for p in ports:
        qemu += ["-chardev", f"socket,id={p},path={sock(p)},server=on,wait=off",
                 "-device", f"virtserialport,chardev={p},name=vmsight.{p}"]
    if a.interactive is None:
        cmd = os.path.join(work, "cmd.sh")
        with open(cmd, "w") as f:
            f.write("cd /root || exit 1\n" + (a.cmd or "true") + "\n")
        qemu += ["-fw_cfg", f"name=opt/vmsight/cmd,file={cmd}"]

    t0 = time.monotonic()
    proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL)
    deadline = t0 + 10
    socks = {p: connect(sock(p), deadline) for p in ports + ["console"]}
    out = {p: [] for p in socks}
    ctl_lines = []
    ready = threading.Event()

    def on_ctl(line):
        ctl_lines.append((time.monotonic() - t0, line))
        print(f"[{time.monotonic() - t0:7.2f}s] ctl: {line}", flush=True)
        if line.startswith("ready"):
            ready.set()

    def on_console(line):
        if "login" in line or "root@" in line or "vmsight-init" in line or "vmsight-initramfs" in line:
            print(f"[{time.monotonic() - t0:7.2f}s] console: {line.rstrip()}", flush=True)

    threads = []
    for p, s in socks.items():
        cb = on_ctl if p == "ctl" else on_console if p == "console" else None
        t = threading.Thread(target=reader, args=(s, out[p], cb), daemon=True)
        t.start()
        threads.append(t)

    if a.stdin_early and a.stdin is not None and "stdin" in socks:
        socks["stdin"].sendall(a.stdin.encode())
    if a.interactive is not None:
        # Wait for the shell prompt on ttyS0, then type.
        while time.monotonic() - t0 < a.timeout and b"root@" not in b"".join(out["console"]):
            time.sleep(0.1)
        print(f"[{time.monotonic() - t0:7.2f}s] shell prompt seen; typing {a.interactive!r}", flush=True)
        socks["console"].sendall(a.interactive.encode() + b"\n")
    elif "stdin" in socks:
        if ready.wait(a.timeout):
            if a.stdin is not None and not a.stdin_early:
                socks["stdin"].sendall(a.stdin.encode())
            # EOF for the command's stdin: half-close. A full close (or SHUT_RDWR) is a HUP for
            # QEMU, which then drops the connection at once, with any data it has not read yet.
            socks["stdin"].shutdown(socket.SHUT_WR)

    try:
        rc = proc.wait(timeout=max(1, a.timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        print("TIMEOUT: QEMU killed", flush=True)
    total = time.monotonic() - t0
    for t in threads:
        t.join(timeout=2)

    stdout = b"".join(out["stdout"]).decode(errors="replace")
    stderr = b"".join(out["stderr"]).decode(errors="replace")
    print(f"--- stdout ---\n{stdout}--- stderr ---\n{stderr}--- end ---")
    print(f"QEMU exit status {rc}, total {total:.2f}s")
    fsck = subprocess.run(["e2fsck", "-fn", root], capture_output=True, text=True)
    print(f"e2fsck -fn: status {fsck.returncode}")
    if fsck.returncode != 0:
        print(fsck.stdout + fsck.stderr)

    ok = rc == 0 and fsck.returncode == 0
    if a.interactive is None:
        exits = [l for _, l in ctl_lines if l.startswith("exit ")]
        if a.expect_exit is not None:
            ok = ok and exits == [f"exit {a.expect_exit}"]
        if a.expect_stdout is not None:
            ok = ok and stdout == a.expect_stdout.encode().decode("unicode_escape")
        ok = ok and any(l.startswith("ready ") for _, l in ctl_lines)
    if not ok:
        with open(os.path.join(work, "console.log"), errors="replace") as f:
            print("--- console (tail) ---\n" + "".join(f.readlines()[-40:]))
    print("RESULT:", "PASS" if ok else "FAIL")
    if a.keep or not ok:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
