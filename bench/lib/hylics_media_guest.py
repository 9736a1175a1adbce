"""Hylics' transcoding service (paper §6.4), run in the guest by bench/hylics_media.py.

Runs inside the guest with the image's python3-minimal (no json, no shutil): arguments are
`key=value` words. Requests for video segments arrive as a Poisson process (rate R, or
alternating between R1 and R2 every HALF seconds: the paper's workloads #1 and #2); each
request picks one of the HOT segments in play (the set moves along the library every DRIFT
seconds) and transcodes it (ffmpeg in the
media disk's root, `chroot`), concurrently with the other requests in flight (processor sharing
by the guest's scheduler). Where the segment is read from and the result written to follows
the paper:
  share  the segment is in the share (Hylics' in-memory FS): read it there, write the result
         there;
  copy   not in the share, and it fits: read from the virtual disk and, on the way, into the
         share (a read-through cache; the next requests within the eviction window find it
         there), the result written to the share;
  disk   the share is full: read from the virtual disk, the result written to the virtual disk.
A segment not requested for `evict` seconds leaves the share (its copy on the disk stays:
the library disk is the standard file system the paper evicts to); every `advice` seconds
`hylics-evict` moves out what vmsight's controller advises when it wants the share smaller.
Arrivals and completions go to the controller through `hylics-report` (libhylics).

With `mode=service n=N` it only measures the service time of one transcoding at a time, N
segments each from the share and from the disk (see service_times).

Prints one line per task, `task ID seg=N via=share|copy|disk arrive=T done=T response=R`
(times in seconds since the start, from the guest's monotonic clock), `fail ID ...` for a
transcoding that failed, and at the end `summary tasks=N share=.. copy=.. disk=.. failed=..
evicted=.. advised=..`. Exit status 0 when no task failed.
"""
import bisect
import mmap
import os
import random
import subprocess
import sys
import threading
import time

ARGS = dict(a.split("=", 1) for a in sys.argv[1:])
ROOT = ARGS.get("root", "/media")            # the media disk's root (ffmpeg), mounted
SHARE = ARGS.get("share", "/hylics")         # the share, bound to ROOT/mnt
LIBRARY = ARGS.get("library", "/srv")        # segments, inside ROOT (the library disk)
SCRATCH = ARGS.get("scratch", "/home")       # the disk's writable directory, inside ROOT
DURATION = float(ARGS.get("duration", "60"))
RATES = [float(r) for r in ARGS.get("rates", "0.5").split(",")]
HALF = float(ARGS.get("half", "0")) or DURATION
HOT = int(ARGS.get("hot", "3"))               # segments requested at a time
DRIFT = float(ARGS.get("drift", "40"))         # seconds before the hot set moves on by one
EVICT_AFTER = float(ARGS.get("evict", "30"))
ADVICE_EVERY = float(ARGS.get("advice", "5"))
THREADS = ARGS.get("threads", "2")
SEED = int(ARGS.get("seed", "1"))
REPORT = ARGS.get("report", "1") == "1"
STAGED = ARGS.get("staged", "1") == "1"          # read the input whole before transcoding
WARMUP = ARGS.get("warmup", "1") == "1"          # one untimed transcoding first (loads ffmpeg)
MARGIN = 2 << 20                             # room kept for the result beside a copied segment
CHUNK = 1 << 20                              # every source is read in 1 MiB requests
DRAIN_SECS = 180.0

SEGMENTS = sorted(f for f in os.listdir(ROOT + LIBRARY) if f.endswith(".y4m"))
SHARE_DIR = "seg"                            # the share's copies: SHARE/seg/NAME

lock = threading.Lock()
last_request = {}                            # segment -> monotonic time of its last request
copying = set()                              # segments being read through into the share
counts = {"share": 0, "copy": 0, "disk": 0, "failed": 0, "evicted": 0, "advised": 0}
T0 = time.monotonic()


def now():
    return time.monotonic() - T0


class Reporter:
    """One hylics-report process for the whole run (a kept-open connection to vmsight)."""

    def __init__(self):
        self.proc = subprocess.Popen(["hylics-report"], stdin=subprocess.PIPE, text=True) if REPORT else None
        self.lock = threading.Lock()

    def line(self, text):
        if self.proc:
            with self.lock:
                self.proc.stdin.write(text + "\n")
                self.proc.stdin.flush()

    def close(self):
        if self.proc:
            self.proc.stdin.close()
            self.proc.wait()


def hot_set_picker(rng):
    """A request asks for one of the HOT segments in play, uniformly; the set moves on along the
    library by one segment every DRIFT seconds (a live channel's recent segments, each
    transsized on request): popular segments come back within the eviction window, and how many
    of them the share holds decides how many requests it serves."""
    return lambda t: SEGMENTS[(int(t // DRIFT) + rng.randrange(HOT)) % len(SEGMENTS)]


def share_path(seg):
    return os.path.join(SHARE, SHARE_DIR, seg)


def free_bytes():
    st = os.statvfs(SHARE)
    return st.f_bavail * st.f_frsize


def place(seg):
    """How this request reads its segment: ("share", fd) from the share's copy, held open so
    that an eviction meanwhile cannot take it away; ("copy", None) read through from the disk
    into the share; ("disk", None) from the disk, the share being full (or the segment being
    copied in by another request)."""
    with lock:
        last_request[seg] = time.monotonic()
        try:
            return "share", os.open(share_path(seg), os.O_RDONLY)
        except FileNotFoundError:
            pass
        size = os.path.getsize(ROOT + LIBRARY + "/" + seg)
        if seg in copying or free_bytes() < size + MARGIN:
            return "disk", None
        copying.add(seg)
    return "copy", None


def ffmpeg(src, out):
    return ["chroot", ROOT, "ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-i", src,
            "-vf", "scale=320:180", "-c:v", "libx264", "-preset", "veryfast", "-threads", THREADS,
            "-f", "mp4", out]


def read_disk(seg):
    """The segment's bytes from the library disk in 1 MiB chunks, with O_DIRECT: the guest's
    page cache must not turn the disk into memory (the paper's condition: a library far larger
    than the VM's RAM; here 2.8 GB against 1.5 GiB, but the hot segments would stay cached)."""
    fd = os.open(ROOT + LIBRARY + "/" + seg, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, CHUNK)        # page-aligned, as O_DIRECT needs
    try:
        while n := os.readv(fd, [buf]):
            yield buf[:n]
    finally:
        os.close(fd)
        buf.close()


def read_share(fd):
    """The share copy's bytes in 1 MiB chunks, from the descriptor `place` opened."""
    try:
        while chunk := os.read(fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


def chunks(seg, via, fd):
    """The segment's bytes in 1 MiB requests whatever the source (ffmpeg reading the share
    itself issues 32 KiB reads, each a virtio-fs round trip): from the share's copy (`fd`), or
    from the disk and, for "copy", on the way into the share (a read-through cache: the miss
    costs the disk read, not a copy first). A copy that fails (ENOSPC when the share shrank) or
    is not read to the end is dropped; the transcoding still gets every byte it reads."""
    into_share = via == "copy"
    tmp = share_path(seg) + f".part{threading.get_ident()}"
    dst = None
    if into_share:
        try:
            dst = open(tmp, "wb")
        except OSError:
            pass
    complete = False
    try:
        for chunk in read_share(fd) if via == "share" else read_disk(seg):
            if dst:
                try:
                    dst.write(chunk)
                except OSError:
                    dst.close()
                    os.unlink(tmp)
                    dst = None
            yield bytes(chunk)
        complete = True
    finally:
        if dst:
            try:
                dst.close()
                if not complete:
                    raise OSError("not read to the end")
                os.rename(tmp, share_path(seg))
            except OSError:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        if into_share:
            with lock:
                copying.discard(seg)


def transcode(task, seg, via, fd=None):
    """Runs ffmpeg for one request; the result goes where its input came from (the disk's
    scratch directory, or the share while it has room)."""
    on_share = via != "disk" and free_bytes() >= MARGIN
    out = f"/mnt/out-{task}.mp4" if on_share else f"{SCRATCH}/out-{task}.mp4"
    # Staged (default): the input is read whole before the transcoding starts, so that the
    # source's speed counts in full (a transcoder that needs random access to its input does the
    # same). Streamed (staged=0) the reads overlap the computation. Measured either way, the
    # source hardly matters under TCG: disk / share 1.03x staged, 1.04x streamed
    # (docs/benchmarks.md).
    data = list(chunks(seg, via, fd)) if STAGED else chunks(seg, via, fd)
    proc = subprocess.Popen(ffmpeg("pipe:0", out), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        for chunk in data:
            proc.stdin.write(chunk)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    del data
    err = proc.stderr.read().decode(errors="replace")
    proc.wait()
    rc = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
    try:
        os.unlink(os.path.join(SHARE, out[len("/mnt/"):]) if on_share else ROOT + out)
    except OSError:
        pass
    return rc


def serve(task, seg, arrive, reporter):
    via, fd = place(seg)
    rc = transcode(task, seg, via, fd)
    done = now()
    with lock:
        counts[via] += 1
    if rc.returncode != 0:
        with lock:
            counts["failed"] += 1
        print(f"fail {task} seg={seg} via={via} rc={rc.returncode} {rc.stderr.strip()[-300:]!r}", flush=True)
        return
    reporter.line(f"done {done - arrive:.6f}")
    print(f"task {task} seg={seg[4:7]} via={via} arrive={arrive:.3f} done={done:.3f} "
          f"response={done - arrive:.3f}", flush=True)


def evict_idle():
    """Segments of the share nobody asked for within EVICT_AFTER seconds leave it."""
    cutoff = time.monotonic() - EVICT_AFTER
    with lock:
        idle = [s for s, t in last_request.items() if t < cutoff and s not in copying]
    for seg in idle:
        try:
            os.unlink(share_path(seg))
            with lock:
                counts["evicted"] += 1
        except FileNotFoundError:
            pass
        with lock:
            last_request.pop(seg, None)


def follow_advice():
    """Moves out what the controller advises (it wants the share smaller than what is in it)."""
    out = subprocess.run(["hylics-evict", "/var/tmp/hylics-evicted"], capture_output=True, text=True)
    words = out.stdout.split()
    if out.returncode == 0 and len(words) > 1 and words[1] != "0":
        with lock:
            counts["advised"] += int(words[1])
    subprocess.run(["rm", "-rf", "/var/tmp/hylics-evicted"])


def housekeeping(stop):
    next_advice = 0.0
    while not stop.wait(1.0):
        evict_idle()
        if REPORT and now() >= next_advice:
            follow_advice()
            next_advice = now() + ADVICE_EVERY


def warm_up():
    """One transcoding from the disk before the clock starts: ffmpeg's binary and libraries come
    from the (modelled) media disk, and the first run's load would be counted as service."""
    rc = transcode("warmup", SEGMENTS[0], "disk")
    if rc.returncode != 0:
        sys.exit(f"warm-up transcoding failed ({rc.returncode}): {rc.stderr.strip()[-500:]}")


def service_times(n):
    """Mode `service`: one transcoding at a time, the same segments alternately from the share
    and from the disk (the paper's 3.32 s from memory against 4.02 s from the disk), no
    queueing. Prints `service via=share|disk seg=N secs=S` per transcoding."""
    for i in range(n):
        seg = SEGMENTS[i % len(SEGMENTS)]
        with open(ROOT + LIBRARY + "/" + seg, "rb") as fi, open(share_path(seg), "wb") as fo:
            while os.sendfile(fo.fileno(), fi.fileno(), None, CHUNK):
                pass
        for via in (("share", "disk") if i % 2 == 0 else ("disk", "share")):
            fd = os.open(share_path(seg), os.O_RDONLY) if via == "share" else None
            t0 = time.monotonic()
            rc = transcode(f"svc{i}", seg, via, fd)
            secs = time.monotonic() - t0
            if rc.returncode != 0:
                print(f"fail svc{i} seg={seg} via={via} {rc.stderr.strip()[-300:]!r}", flush=True)
                sys.exit(1)
            print(f"service via={via} seg={seg[4:7]} secs={secs:.3f}", flush=True)
        os.unlink(share_path(seg))


def main():
    global T0
    os.makedirs(os.path.join(SHARE, SHARE_DIR), exist_ok=True)
    if WARMUP:
        warm_up()
    if ARGS.get("mode") == "service":
        service_times(int(ARGS.get("n", "6")))
        return
    T0 = time.monotonic()
    rng = random.Random(SEED)
    pick = hot_set_picker(rng)
    reporter = Reporter()
    stop = threading.Event()
    keeper = threading.Thread(target=housekeeping, args=(stop,), daemon=True)
    keeper.start()
    workers, t, task = [], 0.0, 0
    while True:
        rate = RATES[int(t // HALF) % len(RATES)]
        t += rng.expovariate(rate)
        if t >= DURATION:
            break
        delay = t - now()
        if delay > 0:
            time.sleep(delay)
        reporter.line("arrive")
        w = threading.Thread(target=serve, args=(task, pick(t), now(), reporter))
        w.start()
        workers.append(w)
        task += 1
    deadline = time.monotonic() + DRAIN_SECS
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    keeper.join()
    reporter.close()
    print("summary tasks={} {}".format(task, " ".join(f"{k}={v}" for k, v in counts.items())), flush=True)
    sys.exit(1 if counts["failed"] or any(w.is_alive() for w in workers) else 0)


main()
