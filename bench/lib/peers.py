"""Runs the default guest on peer configurations with the same guest protocol vmsight uses.

The peers are plain QEMU with its own virtio-blk (`-drive ...,cache=none,aio=threads`) and QEMU
with qemu-storage-daemon exporting the disks over vhost-user-blk. Both boot the same kernel,
initramfs, root image copy, vCPUs and memory as vmsight, and talk to the guest init through the
same virtio-serial ports (docs/guest-protocol.md), so the guest does exactly the same work.
"""
import json
import resource
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))


def image_info():
    out = subprocess.run([VMSIGHT, "image", "info", "--json"], check=True, capture_output=True, text=True)
    info = json.loads(out.stdout)
    d = info["dir"]
    return {"kernel": os.path.join(d, "vmlinuz"), "initrd": os.path.join(d, "initrd.img"),
            "rootfs": os.path.join(d, "rootfs.img")}


def sparse_copy(src, dst):
    subprocess.run(["cp", "--reflink=auto", "--sparse=always", src, dst], check=True)


def shell_quote(w):
    return "'" + w.replace("'", "'\\''") + "'"


class Listener:
    """Host end of one guest channel: accept QEMU's connection, collect bytes."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.data = bytearray()
        self.events = []  # (monotonic time, line) for ctl
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.sock.accept()
        buf = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            self.data += chunk
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self.events.append((time.monotonic(), line.decode(errors="replace")))


def run_peer(kind, argv, vcpus=2, mem_mib=1024, extra_disks=(), timeout=1800):
    """Boots the default guest on a peer config (`qemu-virtio` or `qsd`, both with aio=threads;
    `qemu-virtio-uring` and `qsd-uring` with aio=io_uring) and runs argv.

    Returns dict(stdout, stderr, status, t_ready, t_exit, qemu_rss_kib, helper_rss_kib,
    helper_anon_kib, helper_own_kib): peaks sampled every 0.2 s; `own` is RssAnon + RssFile
    (the process's private memory and its mapped code and files, not the guest RAM it maps).
    """
    info = image_info()
    aio = "io_uring" if kind.endswith("-uring") else "threads"
    kind = kind.removesuffix("-uring")
    work = tempfile.mkdtemp(prefix=f"peer-{kind}-")
    procs = []
    try:
        # The clock starts before the root disk copy: vmsight makes the same fresh copy.
        t0 = time.monotonic()
        root = os.path.join(work, "root.img")
        sparse_copy(info["rootfs"], root)
        disks = [root] + list(extra_disks)
        socks = {n: Listener(os.path.join(work, f"{n}.sock")) for n in ("ctl", "out", "err", "in", "con")}
        cmd = os.path.join(work, "cmd.sh")
        with open(cmd, "w") as f:
            f.write("#!/bin/sh\ncd /root 2>/dev/null || cd /\nexec " + " ".join(shell_quote(a) for a in argv) + "\n")
        args = ["qemu-system-x86_64", "-name", "guest=peer", "-machine", "q35,memory-backend=mem,vmport=off,hpet=off",
                "-accel", "tcg,thread=multi,tb-size=256", "-cpu", "max", "-smp", str(vcpus), "-m", f"{mem_mib}M",
                "-object", f"memory-backend-memfd,id=mem,size={mem_mib}M,share=on",
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                "-kernel", info["kernel"], "-initrd", info["initrd"],
                "-append", "console=ttyS0 root=/dev/vda rw nokaslr panic=-1 init=/usr/lib/vmsight/init vmsight.name=peer",
                "-chardev", f"socket,id=console,path={socks['con'].path}", "-serial", "chardev:console",
                "-device", "pvpanic", "-device", "virtio-serial-pci,id=vser,max_ports=8"]
        for cid, port in (("ctl", "vmsight.ctl"), ("out", "vmsight.stdout"), ("err", "vmsight.stderr"), ("in", "vmsight.stdin")):
            args += ["-chardev", f"socket,id={cid},path={socks[cid].path}",
                     "-device", f"virtserialport,bus=vser.0,chardev={cid},name={port}"]
        args += ["-fw_cfg", f"name=opt/vmsight/cmd,file={cmd}"]
        if kind == "qemu-virtio":
            for i, d in enumerate(disks):
                args += ["-drive", f"if=none,id=d{i},file={d},format=raw,cache=none,aio={aio}",
                         "-device", f"virtio-blk-pci,drive=d{i},num-queues={2 if i == 0 else 1}"]
        elif kind == "qsd":
            qsd = ["qemu-storage-daemon"]
            for i, d in enumerate(disks):
                s = os.path.join(work, f"qsd{i}.sock")
                qsd += ["--blockdev", f"driver=file,node-name=f{i},filename={d},cache.direct=on,aio={aio}",
                        "--export", f"type=vhost-user-blk,id=e{i},node-name=f{i},addr.type=unix,addr.path={s},writable=on,num-queues={2 if i == 0 else 1}"]
                args += ["-chardev", f"socket,id=d{i},path={s}",
                         "-device", f"vhost-user-blk-pci,id=d{i},chardev=d{i},num-queues={2 if i == 0 else 1}"]
            p = subprocess.Popen(qsd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(p)
            for i in range(len(disks)):
                s = os.path.join(work, f"qsd{i}.sock")
                for _ in range(500):
                    if os.path.exists(s):
                        break
                    time.sleep(0.01)
        else:
            raise ValueError(kind)
        q = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(q)
        rss = {"qemu": 0, "helper": 0, "anon": 0, "own": 0}

        def sample():
            while q.poll() is None:
                rss["qemu"] = max(rss["qemu"], rss_kib(q.pid))
                if kind == "qsd":
                    sample_helper(rss, procs[0].pid)
                time.sleep(0.2)
        threading.Thread(target=sample, daemon=True).start()
        try:
            q.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            q.kill()
            raise
        t_exit = time.monotonic() - t0
        for s in socks.values():
            s.thread.join(timeout=5)
        t_ready, status = None, None
        for t, line in socks["ctl"].events:
            if line.startswith("ready") and t_ready is None:
                t_ready = t - t0
            if line.startswith("exit"):
                status = int(line.split()[1])
        return {"stdout": socks["out"].data.decode(errors="replace"), "stderr": socks["err"].data.decode(errors="replace"),
                "status": status, "t_ready": t_ready, "t_exit": t_exit,
                "qemu_rss_kib": rss["qemu"], "helper_rss_kib": rss["helper"], "helper_anon_kib": rss["anon"],
                "helper_own_kib": rss["own"],
                "qemu_stderr": q.stderr.read().decode(errors="replace") if q.stderr else ""}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)


def memory_kib(pid):
    """VmRSS, RssAnon and RssFile of pid (KiB) from one read of /proc/PID/status; {} if gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def sample_helper(peaks, pid):
    """Raises peaks["helper"], ["anon"] and ["own"] (RssAnon + RssFile) to pid's current values."""
    m = memory_kib(pid)
    if m:
        peaks["helper"] = max(peaks["helper"], m.get("VmRSS", 0))
        peaks["anon"] = max(peaks["anon"], m.get("RssAnon", 0))
        peaks["own"] = max(peaks["own"], m.get("RssAnon", 0) + m.get("RssFile", 0))


def rss_kib(pid, field="VmRSS:"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children_cpu_s():
    """User + system CPU seconds of every waited-for descendant so far (getrusage)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_vmsight(argv, extra=(), vcpus=2, mem_mib=1024, disks=(), timeout=1800, disk_opts=",direct"):
    """Runs argv under `vmsight run`; returns the same dict as run_peer."""
    work = tempfile.mkdtemp(prefix="bench-vmsight-")
    try:
        stats = os.path.join(work, "stats.json")
        args = [VMSIGHT, "run", "--vcpus", str(vcpus), "--mem", f"{mem_mib}M", "--stats-json", stats, *extra]
        for d in disks:
            args += ["--disk", d + disk_opts]
        args += ["--", *argv]
        t0 = time.monotonic()
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        rss = {"helper": 0, "qemu": 0, "anon": 0, "own": 0}

        def sample():
            while p.poll() is None:
                sample_helper(rss, p.pid)
                try:
                    kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
                except OSError:
                    kids = []
                for k in kids:
                    rss["qemu"] = max(rss["qemu"], rss_kib(int(k)))
                time.sleep(0.2)
        threading.Thread(target=sample, daemon=True).start()
        out, err = p.communicate(timeout=timeout)
        t_exit = time.monotonic() - t0
        st = json.load(open(stats)) if os.path.exists(stats) else {}
        return {"stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace"), "status": p.returncode,
                "t_ready": st.get("boot_seconds"), "t_exit": t_exit, "qemu_rss_kib": rss["qemu"],
                "helper_rss_kib": rss["helper"], "helper_anon_kib": rss["anon"], "helper_own_kib": rss["own"],
                "stats": st}
    finally:
        shutil.rmtree(work, ignore_errors=True)
