"""Gamma-Ray's own workloads (DS-VMI §V-B) as the benchmarks run them in the guest, shared by
bench/filestream.py and bench/stream_lazy.py: Debian's postmark with the paper's configuration,
and a software install of real Debian packages."""
import hashlib
import os
import shutil
import subprocess

# PostMark with the configuration Gamma-Ray used (after its reference [37]): file sizes 512 B
# to 328 072 B, 4 KiB reads and writes, 5000 files, 20 000 transactions (2.9 GB written in the
# paper); Debian's postmark 1.53. `location` is filled in by the caller.
POSTMARK_CONF = """set location {location}
set size 512 328072
set read 4096
set write 4096
set number 5000
set transactions 20000
run
quit
"""

# Software install (Gamma-Ray installs server packages downloaded in advance with apt-get):
# real Debian packages, downloaded on the host (cached), installed with `dpkg -i` from a
# read-only disk. The guest has no network, so the sets are packages whose dependencies the
# guest image already satisfies (documentation, fonts, data); what dpkg does (unpack thousands
# of files, fsync, rename them into place, update its database) is the same.
INSTALL_SETS = {
    "small": ["vim-runtime", "iso-codes", "docutils-doc", "git-man"],
    "paper": ["vim-runtime", "iso-codes", "docutils-doc", "git-man", "linux-doc-6.1",
              "python3.11-doc", "libjs-jquery", "libjs-underscore", "fonts-noto-core",
              "openjdk-17-doc", "libjs-jquery-ui", "libjs-jquery-ui-theme-base"],
}


def postmark_script(location):
    """Guest shell lines that run postmark in `location` (created) with the paper's config."""
    conf = POSTMARK_CONF.format(location=location).strip()
    return f"mkdir -p {location}\ncat > /tmp/postmark.conf <<'PM'\n{conf}\nPM\npostmark /tmp/postmark.conf >/tmp/pm.out"


def fetch_debs(names):
    """Downloads `names` with the host's apt (its own sources; nothing here names a mirror)
    into a cache directory keyed by the list; returns the directory."""
    key = hashlib.sha256(" ".join(sorted(names)).encode()).hexdigest()[:16]
    cache = os.path.join(os.path.expanduser(os.environ.get("VMSIGHT_CACHE", "~/.cache/vmsight")),
                         "bench", "debs", key)
    if not os.path.isdir(cache):
        part = cache + ".part"
        shutil.rmtree(part, ignore_errors=True)
        os.makedirs(part)
        subprocess.run(["apt-get", "download", *names], cwd=part, check=True, capture_output=True)
        os.rename(part, cache)
    return cache


def debs_disk(tmp, install_set):
    """A read-only ext4 image in `tmp` holding the packages of `install_set`; returns
    (path, bytes of .deb files). The guest mounts it and runs `dpkg -i` on them."""
    src = fetch_debs(INSTALL_SETS[install_set])
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    img = os.path.join(tmp, f"debs-{install_set}.img")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", src, img, f"{size // 2**20 + 64}M"], check=True,
                   capture_output=True)
    return img, size
