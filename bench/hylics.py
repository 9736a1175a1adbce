#!/usr/bin/env python3
"""Hylics (issue 13): the shared in-memory file system and the send offload, against the
guest's own paths, in the same run.

Part "fs" (paper Fig. 12-14 shape): in one guest with `--shared-mem`, fio sequential and random
reads and writes across block sizes on /hylics (host tmpfs over virtio-fs) and on the root
virtual disk (ext4 on vmsight's vhost-user-blk). Writes end with fsync, the guest's page cache
is dropped before every read job, so both paths reach the host (tmpfs pages vs the image file).
`--share-configs 'default;writeback=on;...'` runs one VM per set of share options (virtiofsd's
writeback cache, thread pool, cache policy: `--shared-mem SIZE,OPTS`), interleaved per
repetition; medians. In the first VM of each repetition the host first runs the same fio jobs
itself on the share's tmpfs and on a directory of its own disk (paper Fig. 15/16: the in-memory
FS at the hypervisor level).

Part "stream" (paper Fig. 17/19/20 shape): a CPU-bound job in the guest (`--compute gzip`:
`gzip -6` of a generated text file; `ffmpeg`: Debian's ffmpeg transcoding its synthetic testsrc
video with x264; `pigz`: parallel gzip; ffmpeg and pigz come from a media disk that
bench/media-disk.sh builds from Debian packages, so the default image stays lean) and a
file stream from the guest's share to a client in the VM's namespace, in seven configurations:
  compute        the computation alone
  stream-guest   the guest streams the file itself (sendfile over its virtio-net)
  stream-hylics  the host streams it for the guest (hylics-send, module scheme)
  stream-socket  the client connects to the guest, which hands the connection to the host for
                 the file (hylics-sockserve, socket scheme)
  both-guest     computation + guest-sent stream (interference)
  both-hylics    computation + host-sent stream (Hylics, module)
  both-socket    computation + host-sent stream (Hylics, socket)
`--vcpus` and `--threads` (ffmpeg's `-threads`, pigz's `-p`) vary the guest's vCPUs and the
computation's threads (paper Fig. 18).
Reported: computation time, streaming throughput at the client, and host CPU time (utime +
stime of vmsight, QEMU and the device daemons) per configuration; ratios to the
no-interference runs.

Part "control" (paper §6.4 / Table 3 shape, scaled to minutes): the share-size controller in
each mode against a synthetic workload with known E[X|m]; see bench/lib/hylics_control.py.

  bench/hylics.py [--parts fs,stream,control] [--reps 3] [--size-mb 64] [--stream-mb 256]
                  [--share-configs 'default;OPTS;...'] [--vcpus 2] [--threads 2]
                  [--control-secs 120] [--verbose] [--out PATH]

Every run (each fio job's MiB/s, each stream configuration's times, throughput and host CPU,
each controller run's errors and share sizes) goes to bench/results/hylics.json for the
default parts, else hylics-PARTS[-COMPUTE].json (e.g. hylics-control.json,
hylics-stream-ffmpeg.json), or to --out.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from vmproc import TICK, cpu_ticks, descendants, wait_net  # noqa: E402
import results as bench_results  # noqa: E402

VMSIGHT = os.environ.get("VMSIGHT", os.path.join(os.path.dirname(__file__), "..", "target", "release", "vmsight"))
BLOCK_SIZES = ["4k", "64k", "1m"]
JOBS = [("seq-write", "write"), ("seq-read", "read"), ("rand-write", "randwrite"), ("rand-read", "randread")]

FS_GUEST = r"""
mkdir -p /root/bench
echo READY; read go
for dir in {dirs}; do
  for bs in {sizes}; do
    for job in {jobs}; do
      rw=${{job#*:}}; name=${{job%%:*}}
      case $rw in *read) sync; echo 3 > /proc/sys/vm/drop_caches ;; esac
      out=$(fio --name=b --directory=$dir --filename=fio.dat --size={size}m --bs=$bs --rw=$rw \
            --ioengine=psync --end_fsync=1 --invalidate=1 --output-format=terse --terse-version=3 2>&1) || {{ echo "FIOERR $out"; exit 9; }}
      case $rw in *read) kb=$(echo "$out" | cut -d';' -f7) ;; *) kb=$(echo "$out" | cut -d';' -f48) ;; esac
      echo "FS $dir $bs $name $kb"
    done
    rm -f $dir/fio.dat
  done
done
"""

STREAM_GUEST = r"""
seq 1 {seq} > /tmp/text
head -c {mb}M /dev/urandom > /hylics/stream.bin
sync
i=0; until hylics-send 10.0.2.1:9001 /hylics/stream.bin 0 1 >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 200 ] || exit 9; sleep 0.2; done
{media}
compute() {{ s=$(date +%s.%N); {job}; e=$(date +%s.%N); echo "COMPUTE $(echo "$e - $s" | awk '{{print $1 - $3}}')"; }}
guest_send() {{ python3 -c '
import socket, sys
f = open("/hylics/stream.bin", "rb"); s = socket.create_connection(("10.0.2.1", int(sys.argv[1])))
s.sendfile(f); s.close()' $1; }}
hylics() {{ hylics-send 10.0.2.1:$1 /hylics/stream.bin >/dev/null || echo "HYLICS-FAILED"; }}
sock() {{ hylics-sockserve $1 /hylics/stream.bin > /tmp/sock.$1 2>&1 || {{ cat /tmp/sock.$1; echo "HYLICS-FAILED"; }}; }}
compute > /dev/null  # warm-up: the job's binaries and libraries into the page cache
for c in {configs}; do
  echo "PHASE $c"
  case $c in
    compute) compute ;;
    stream-guest) guest_send {ports[stream-guest]} ;;
    stream-hylics) hylics {ports[stream-hylics]} ;;
    both-guest) guest_send {ports[both-guest]} & p=$!; compute; wait $p ;;
    both-hylics) hylics {ports[both-hylics]} & p=$!; compute; wait $p ;;
    stream-socket) sock {ports[stream-socket]} ;;
    both-socket) sock {ports[both-socket]} & p=$!; compute; wait $p ;;
  esac
  echo "PHASE end"
  sleep 1
done
"""

RECEIVER = r"""
import socket, sys, time
srv = socket.create_server(("10.0.2.1", int(sys.argv[1])))
while True:
    c, _ = srv.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.monotonic()
        n += len(b)
    t1 = time.monotonic()
    print("RECV", n, (t1 - t0) if t0 else 0.0, flush=True)
    c.close()
"""


def fio_terse_mib_s(out, rw):
    """MiB/s of a fio --output-format=terse --terse-version=3 run (read or write side)."""
    fields = out.strip().splitlines()[-1].split(";")
    return float(fields[6] if rw.endswith("read") else fields[47]) / 1024.0


def host_fio(directory, size_mb):
    """The guest's fio jobs run by the host itself in `directory` (paper Fig. 15/16: the
    in-memory FS at the hypervisor level)."""
    res = {}
    for bs in BLOCK_SIZES:
        for name, rw in JOBS:
            out = subprocess.run(["fio", "--name=b", f"--directory={directory}", "--filename=fio.dat",
                                  f"--size={size_mb}m", f"--bs={bs}", f"--rw={rw}", "--ioengine=psync",
                                  "--end_fsync=1", "--invalidate=1", "--output-format=terse",
                                  "--terse-version=3"], capture_output=True, text=True, check=True).stdout
            res[(bs, name)] = fio_terse_mib_s(out, rw)
        os.unlink(os.path.join(directory, "fio.dat"))
    return res


def run_fs(a, rep, opts, host_job):
    """One VM whose share has the options `opts` ("" for the defaults): the guest's fio jobs on
    /hylics and on its root disk; with `host_job`, first the same jobs by the host on the share's
    tmpfs and on a directory of the host disk the images live on."""
    dirs = ["/hylics", "/root/bench"] if rep % 2 == 0 else ["/root/bench", "/hylics"]
    script = FS_GUEST.format(dirs=" ".join(dirs), sizes=" ".join(BLOCK_SIZES), size=a.size_mb,
                             jobs=" ".join(f"{n}:{rw}" for n, rw in JOBS))
    name = f"bhy-fs-{os.getpid()}"
    share = f"{a.size_mb * 2 + 64}M" + (f",{opts}" if opts else "")
    proc = subprocess.Popen([VMSIGHT, "run", "--name", name, "--net", "none", "--shared-mem", share,
                             "--mem", "1G", "--", "sh", "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "READY":
            break
    if host_job:
        share_dir = subprocess.run([VMSIGHT, "hylics", name, "path"], capture_output=True, text=True,
                                   check=True).stdout.strip()
        for (bs, job), v in host_fio(share_dir, a.size_mb).items():
            res[("host-tmpfs", bs, job)] = v
        disk_dir = os.path.join(os.path.expanduser(os.environ.get("VMSIGHT_CACHE", "~/.cache/vmsight")), "bench")
        os.makedirs(disk_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=disk_dir) as d:
            for (bs, job), v in host_fio(d, a.size_mb).items():
                res[("host-disk", bs, job)] = v
    proc.stdin.write("go\n")
    proc.stdin.flush()
    rest, err = proc.communicate()
    lines += rest.splitlines(keepends=True)
    if proc.returncode != 0:
        sys.exit(f"fs run failed ({proc.returncode}): {''.join(lines)[-1500:]} {err[-1500:]}")
    for line in lines:
        if line.startswith("FS "):
            _, d, bs, job, kb = line.split()
            res[(d, bs, job)] = float(kb) / 1024.0
            if a.verbose:
                print(f"  rep {rep} [{opts or 'default'}] {d} {bs} {job} {float(kb)/1024:.1f} MiB/s", file=sys.stderr)
    return res


# One receiver port per streaming configuration: the guest's PHASE lines reach the host with
# a delay, so the receiver's report is matched by port, not by time.
PORTS = {"stream-guest": 9002, "stream-hylics": 9003, "both-guest": 9004, "both-hylics": 9005,
         "stream-socket": 9006, "both-socket": 9007}
CONFIGS = ["compute", "stream-guest", "stream-hylics", "stream-socket", "both-guest", "both-hylics",
           "both-socket"]

# The socket scheme's client: connects to the guest's hylics-sockserve (retrying until it
# listens), reads header + file + trailer, then ends its side; reports like RECEIVER.
SOCK_CLIENT = r"""
import socket, sys, time
port, want = int(sys.argv[1]), int(sys.argv[2])
for _ in range(600):
    try:
        c = socket.create_connection(("10.0.2.15", port), timeout=120); break
    except OSError:
        time.sleep(0.05)
n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.monotonic()
    n += len(b)
    if n == want:
        c.shutdown(socket.SHUT_WR)
t1 = time.monotonic()
print("RECV", n, (t1 - t0) if t0 else 0.0, flush=True)
"""


def run_stream(a, rep):
    configs = list(CONFIGS)
    if rep % 2:
        configs = configs[::-1]
    name = f"bhy-st-{os.getpid()}"
    media, job = COMPUTE[a.compute]
    script = STREAM_GUEST.format(seq=a.seq, mb=a.stream_mb, configs=" ".join(configs), ports=PORTS,
                                 media=media, job=job.format(secs=a.ffmpeg_secs, threads=a.threads))
    disk = ["--disk", f"{a.media_disk},ro"] if a.compute != "gzip" else []
    proc = subprocess.Popen([VMSIGHT, "run", "--name", name, "--shared-mem", f"{a.stream_mb + 64}M",
                             "--mem", "1G", "--vcpus", str(a.vcpus), *disk, "--", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_net(VMSIGHT, name)
    recv = {}
    rx = {}
    for port in [9001, *(p for c, p in PORTS.items() if not c.endswith("-socket"))]:
        recv[port] = subprocess.Popen([VMSIGHT, "net", name, "exec", "python3", "-c", RECEIVER, str(port)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        rx[port] = []
        threading.Thread(target=lambda p=port: [rx[p].append(l.split()) for l in recv[p].stdout
                                                 if l.startswith("RECV ")], daemon=True).start()
    res = {}
    phase, cpu0 = None, 0.0
    for line in proc.stdout:
        line = line.strip()
        if a.verbose:
            print(f"  [{rep}] {line}", file=sys.stderr)
        if line.startswith("PHASE "):
            pids = descendants(proc.pid)
            if line == "PHASE end":
                res[phase]["cpu"] = cpu_ticks(pids) / TICK - cpu0
                res[phase]["wall"] = time.monotonic() - res[phase]["t0"]
            else:
                phase = line.split()[1]
                res[phase] = {"t0": time.monotonic()}
                cpu0 = cpu_ticks(pids) / TICK
                if phase.endswith("-socket"):
                    start_sock_client(name, phase, a.stream_mb, recv, rx)
        elif line.startswith("COMPUTE "):
            res[phase]["compute"] = float(line.split()[1])
        elif line == "HYLICS-FAILED":
            sys.exit(f"hylics-send failed in {phase}")
    err = proc.stderr.read()
    proc.wait()
    time.sleep(0.5)
    for c, port in PORTS.items():
        if rx[port]:
            n, secs = int(rx[port][-1][1]), float(rx[port][-1][2])
            res[c]["mbps"] = n / secs / 1e6 if secs > 0 else float("nan")
            res[c]["bytes"] = n
    for r in recv.values():
        r.terminate()
        r.wait()
    if proc.returncode != 0:
        sys.exit(f"stream run failed ({proc.returncode}): {err[-2000:]}")
    return res


# The computation job: gzip (in the default image), or Debian's ffmpeg (x264 transcoding of its
# synthetic testsrc video, paper Fig. 17/20) or pigz (paper Fig. 19) from the media disk
# (bench/media-disk.sh), mounted read-only and entered with chroot.
MEDIA = ("mkdir -p /media && mount -o ro /dev/vdb /media && "
         "for d in dev proc tmp; do mount --bind /$d /media/$d; done")
COMPUTE = {
    "gzip": ("", "gzip -6 -c /tmp/text > /dev/null"),
    "ffmpeg": (MEDIA, "chroot /media ffmpeg -hide_banner -loglevel error -f lavfi "
               "-i testsrc=duration={secs}:size=640x360:rate=25 -c:v libx264 -preset veryfast "
               "-threads {threads} -f null /dev/null"),
    "pigz": (MEDIA, "chroot /media pigz -p {threads} -6 -c /tmp/text > /dev/null"),
}


def start_sock_client(name, phase, mb, recv, rx):
    port = PORTS[phase]
    want = 7 + (mb << 20) + 8  # hylics-sockserve's "HEADER\n" + file + "TRAILER\n"
    recv[port] = subprocess.Popen([VMSIGHT, "net", name, "exec", "python3", "-c", SOCK_CLIENT, str(port), str(want)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rx[port] = []
    threading.Thread(target=lambda p=port: [rx[p].append(l.split()) for l in recv[p].stdout
                                             if l.startswith("RECV ")], daemon=True).start()


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report_fs(a, rec, load0):
    """Part fs: every share configuration (interleaved) against the virtual disk, and the host's
    own view of the tmpfs and of its disk."""
    configs = a.share_configs.split(";")
    runs = {c: [] for c in configs}
    for rep in range(a.reps):
        for i, c in enumerate(configs if rep % 2 == 0 else configs[::-1]):
            runs[c].append(run_fs(a, rep, "" if c == "default" else c, host_job=i == 0))
    label = {"/hylics": "hylics", "/root/bench": "disk", "host-tmpfs": "host-tmpfs", "host-disk": "host-disk"}
    for c, rs in runs.items():
        for rep, r in enumerate(rs):
            for (d, bs, job), mib_s in r.items():
                config = label[d] if d != "/hylics" or c == "default" else f"hylics[{c}]"
                rec.rep(part="fs", workload=job, bs=bs, config=config, rep=rep, mib_s=mib_s)

    def med_of(d, bs, job, only=None):
        return med([r[(d, bs, job)] for c, rs in runs.items() if only in (None, c) for r in rs
                    if (d, bs, job) in r])

    print(f"\nbench/hylics.py --parts fs --reps {a.reps} --size-mb {a.size_mb} --share-configs "
          f"'{a.share_configs}'; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| job | bs | virtual disk MiB/s | " + " | ".join(f"/hylics [{c}] MiB/s (x disk)" for c in configs)
          + " | host: tmpfs MiB/s | host: its disk MiB/s |")
    print("|---|---|---|" + "---|" * len(configs) + "---|---|")
    for job, _ in JOBS:
        for bs in BLOCK_SIZES:
            disk = med_of("/root/bench", bs, job)
            cells = [f"{med_of('/hylics', bs, job, c):.1f} ({med_of('/hylics', bs, job, c) / disk:.2f}x)"
                     for c in configs]
            print(f"| {job} | {bs} | {disk:.1f} | " + " | ".join(cells)
                  + f" | {med_of('host-tmpfs', bs, job):.0f} | {med_of('host-disk', bs, job):.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="fs,stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mb", type=int, default=64, help="fio file size per job")
    ap.add_argument("--stream-mb", type=int, default=256, help="streamed file size")
    ap.add_argument("--seq", type=int, default=3000000, help="lines of the text gzip compresses")
    ap.add_argument("--control-secs", type=int, default=120, help="workload length per controller run")
    ap.add_argument("--control-workloads", default="12", help="controller workloads: 1 constant, 2 alternating, 3 wrong model")
    ap.add_argument("--compute", choices=sorted(COMPUTE), default="gzip", help="the stream part's computation")
    ap.add_argument("--ffmpeg-secs", type=int, default=4, help="length of the video ffmpeg transcodes")
    ap.add_argument("--vcpus", type=int, default=2, help="the stream part's guest vCPUs (paper Fig. 18)")
    ap.add_argument("--threads", type=int, default=2, help="threads of ffmpeg or pigz (paper Fig. 18)")
    ap.add_argument("--share-configs", default="default",
                    help="part fs: the share's options to compare, ';'-separated (e.g. "
                         "'default;writeback=on;threads=4'; see --shared-mem)")
    ap.add_argument("--verbose", action="store_true")
    bench_results.add_out_option(ap, "hylics", variant_note="[-PARTS[-COMPUTE]]")
    a = ap.parse_args()
    variant = None
    if a.parts != "fs,stream" or a.compute != "gzip":
        variant = "+".join(a.parts.split(","))
        if a.compute != "gzip" and "stream" in a.parts:
            variant += f"-{a.compute}"
        if (a.vcpus, a.threads) != (2, 2) and "stream" in a.parts:
            variant += f"-{a.vcpus}v{a.threads}t"
    rec = bench_results.Recorder("hylics", a, out=a.out, variant=variant,
                                 keys=["part", "workload", "bs", "config"], baseline="disk")
    summary = {}
    if a.compute != "gzip" and "stream" in a.parts:
        a.media_disk = subprocess.run(["bash", os.path.join(os.path.dirname(__file__), "media-disk.sh")],
                                      check=True, capture_output=True, text=True).stdout.strip()
    parts = a.parts.split(",")
    load0 = os.getloadavg()[0]
    if "fs" in parts:
        report_fs(a, rec, load0)
    if "stream" in parts:
        runs = [run_stream(a, rep) for rep in range(a.reps)]
        for rep, r in enumerate(runs):
            for c in CONFIGS:
                v = r.get(c, {})
                rec.rep(part="stream", workload=a.compute, config=c, rep=rep, compute_s=v.get("compute"),
                        stream_mb_s=v.get("mbps"), host_cpu_s=v.get("cpu"), wall_s=v.get("wall"),
                        stream_bytes=v.get("bytes"))
        print(f"\nbench/hylics.py --parts stream --reps {a.reps} --stream-mb {a.stream_mb} --seq {a.seq} "
              f"--compute {a.compute} --ffmpeg-secs {a.ffmpeg_secs} --vcpus {a.vcpus} --threads {a.threads}; "
              f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
        print("| configuration | computation s | stream MB/s at the client | host CPU s | wall s |")
        print("|---|---|---|---|---|")
        rows = {}
        for c in CONFIGS:
            rows[c] = {k: med([r[c].get(k, float("nan")) for r in runs]) for k in ["compute", "mbps", "cpu", "wall"]}
            v = rows[c]
            print(f"| {c} | {v['compute']:.2f} | {v['mbps']:.1f} | {v['cpu']:.2f} | {v['wall']:.2f} |")
        c0, sg, sh = rows["compute"]["compute"], rows["stream-guest"]["mbps"], rows["stream-hylics"]["mbps"]
        print(f"\ncomputation time under interference: guest-sent {rows['both-guest']['compute'] / c0:.2f}x, "
              f"Hylics {rows['both-hylics']['compute'] / c0:.2f}x of alone")
        so = rows["stream-socket"]["mbps"]
        print(f"computation time under interference: Hylics-socket {rows['both-socket']['compute'] / c0:.2f}x of alone")
        print(f"stream throughput under interference: guest-sent {rows['both-guest']['mbps'] / sg:.2f}x of its alone, "
              f"Hylics {rows['both-hylics']['mbps'] / sh:.2f}x of its alone, Hylics-socket "
              f"{rows['both-socket']['mbps'] / so:.2f}x of its alone; Hylics alone / guest alone {sh / sg:.2f}x, "
              f"Hylics-socket alone / guest alone {so / sg:.2f}x")
        summary["stream"] = {
            "medians": rows,
            "compute_under_interference": {c: rows[f"both-{c}"]["compute"] / c0 for c in ("guest", "hylics", "socket")},
            "stream_under_interference": {"guest": rows["both-guest"]["mbps"] / sg,
                                          "hylics": rows["both-hylics"]["mbps"] / sh,
                                          "socket": rows["both-socket"]["mbps"] / so},
            "alone_over_guest_alone": {"hylics": sh / sg, "socket": so / sg}}
    if "control" in parts:
        import hylics_control
        record_control_runs(hylics_control, rec, a.control_secs, a.control_workloads)
        hylics_control.run(VMSIGHT, a.reps, a.control_secs, a.verbose, a.control_workloads)
    rec.write(summary=summary)


def record_control_runs(hylics_control, rec, secs, which):
    """Records every controller run: hylics_control.run keeps them to itself, so its run_one
    is wrapped (the same calls, the same results) to copy each result into the record."""
    run_one = hylics_control.run_one
    names = {spec: name for name, spec in hylics_control.workloads(secs, which).items()}
    count = {}

    def recorded(vmsight, mode, wl, secs, tmp, verbose):
        r = run_one(vmsight, mode, wl, secs, tmp, verbose)
        key = (names.get(wl), mode)
        count[key] = count.get(key, -1) + 1
        rec.rep(part="control", workload=names.get(wl), config=mode, rep=count[key], error_s=r["err"],
                error_over_tau=r["err"] / hylics_control.TAU, mean_response_s=r["r"], mean_share_mib=r["mean_m"],
                peak_share_mib=r["peak_m"], replayed=r["replayed"], tasks=r["tasks"], decisions=r["decisions"])
        return r
    hylics_control.run_one = recorded


if __name__ == "__main__":
    main()
