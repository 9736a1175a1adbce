"""Inputs several benchmarks share: a source-tree-like tar and an empty ext4 image."""
import io
import random
import subprocess
import tarfile


def make_tree_tar(path, files, seed=1):
    """A source-tree-like tar: dirs of ~40 files, sizes log-normal (median 2 KiB, capped).
    Returns the bytes of file data."""
    rng = random.Random(seed)
    total = 0
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        per_dir = 40
        for i in range(files):
            d = f"src/d{i // (per_dir * 50)}/s{(i // per_dir) % 50}"
            size = min(int(rng.lognormvariate(7.6, 1.1)), 256 * 1024)
            data = rng.randbytes(size)
            ti = tarfile.TarInfo(f"{d}/f{i}.c")
            ti.size = size
            tar.addfile(ti, io.BytesIO(data))
            total += size
    return total


def ext4(path, mib, inodes=None):
    """A sparse file of `mib` MiB holding an empty ext4 with 4 KiB blocks (and at least
    `inodes` inodes: mkfs.ext4 gives one per 16 KiB, 262 144 on 4 GiB)."""
    with open(path, "wb") as f:
        f.truncate(mib << 20)
    n = ["-N", str(inodes)] if inodes else []
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", *n, path], check=True)


def make_tree_dir(root, files, total_bytes, seed=1):
    """A file tree under `root` for crawler benchmarks at Gamma-Ray's scale: `files` regular
    files in directories of 40 (50 of them per parent), sizes log-normal (sigma 1.6, the long
    tail of a real image: most files small, a few hundred MiB-sized ones) scaled so they add up
    to `total_bytes`, each capped at 256 MiB. The bytes are slices of one random buffer: the
    crawler reads metadata only. Returns the bytes written."""
    import os
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0, 1.6) for _ in range(files)]
    scale = total_bytes / sum(raw)
    buf = rng.randbytes(8 << 20)
    total = 0
    for i, r in enumerate(raw):
        d = os.path.join(root, f"d{i // 2000}", f"s{(i // 40) % 50}")
        if i % 40 == 0:
            os.makedirs(d, exist_ok=True)
        size = min(int(r * scale), 256 << 20)
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            left, off = size, (i * 4099) % len(buf)
            while left > 0:
                n = min(left, len(buf) - off)
                f.write(buf[off:off + n])
                left, off = left - n, 0
        total += size
    return total


if __name__ == "__main__":
    # python3 bench/lib/trees.py dir ROOT FILES GIB: the tree fsview-crawl.sh --files crawls.
    import sys
    if len(sys.argv) != 5 or sys.argv[1] != "dir":
        sys.exit("usage: trees.py dir ROOT FILES GIB")
    n = make_tree_dir(sys.argv[2], int(sys.argv[3]), int(float(sys.argv[4]) * 2**30))
    print(f"{sys.argv[3]} files, {n / 2**30:.2f} GiB")
