#!/usr/bin/env bash
# Installs everything vmsight needs on a Debian bookworm host: QEMU 10 from
# bookworm-backports, guest-image tools, FUSE, Redis and a Rust toolchain.
# Idempotent: a second run only checks. The Debian mirror is derived from the
# machine's own apt configuration, never hard-coded.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# debian_mirror: the first Debian archive of the apt configuration.
# shellcheck source=scripts/lib/debian-mirror.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/debian-mirror.sh"

ensure_backports() {
    local list=/etc/apt/sources.list.d/vmsight-backports.list
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        local mirror; mirror=$(debian_mirror)
        log "adding bookworm-backports from $mirror"
        echo "deb $mirror bookworm-backports main" | $SUDO tee "$list" >/dev/null
        NEED_UPDATE=1
    fi
}

PKGS=(debootstrap busybox-static e2fsprogs cpio gzip zstd xz-utils fuse3 libfuse3-dev pkg-config
      redis-server redis-tools prometheus python3 socat util-linux procps coreutils clang libclang-dev
      linux-base kmod dwarves file jq fio lz4 gcc libc6-dev binutils shellcheck gdisk fdisk
      iproute2 tcpdump iperf3 libseccomp-dev libcap-ng-dev python3-matplotlib passwd)
QEMU_PKGS=(qemu-system-x86 qemu-system-data qemu-utils qemu-block-extra)

NEED_UPDATE=0
ensure_backports
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
qemu_ok=0
if command -v qemu-system-x86_64 >/dev/null; then
    v=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -n1)
    if [ "${v:-0}" -ge 10 ]; then qemu_ok=1; fi
fi
if [ ${#missing[@]} -gt 0 ] || [ $qemu_ok -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing: ${missing[*]}"
        $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
    if [ $qemu_ok -eq 0 ]; then
        log "installing QEMU 10 from bookworm-backports"
        $SUDO apt-get install -y -q --no-install-recommends -t bookworm-backports "${QEMU_PKGS[@]}"
    fi
fi
qemu-system-x86_64 --version | head -n1 >&2

if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
    # Debian's own cargo is too old for the rust-vmm crates; rustup comes from Debian too.
    log "installing the Rust toolchain via Debian's rustup"
    $SUDO apt-get install -y -q --no-install-recommends rustup
    rustup default stable
fi
log "host ready"
