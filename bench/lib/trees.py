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


def ext4(path, mib):
    """A sparse file of `mib` MiB holding an empty ext4 with 4 KiB blocks."""
    with open(path, "wb") as f:
        f.truncate(mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", path], check=True)
