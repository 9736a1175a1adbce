#!/usr/bin/env bash
# Builds the host tools vmsight runs but Debian bookworm does not package, from crates.io:
#   virtiofsd           the virtio-fs daemon that serves a VM's shared in-memory file system
#                       (Hylics, `vmsight run --shared-mem`), from the virtio-fs project;
#   vhost-device-vsock  rust-vmm's vhost-user vsock device (hybrid vsock over Unix sockets),
#                       the guest <-> vmsight control channel of Hylics.
# They are installed under the vmsight cache ($VMSIGHT_CACHE or ~/.cache/vmsight) in
# tools/<hash of this recipe>/bin, and tools/current points there; vmsight looks for them in
# tools/current/bin first. Idempotent: a second run with the same recipe only checks.
# The build needs libseccomp-dev and libcap-ng-dev (scripts/setup-host.sh installs them).
set -euo pipefail

VIRTIOFSD_VERSION=1.14.0
VSOCK_VERSION=0.3.0

log() { printf '[tools] %s\n' "$*" >&2; }

cache=${VMSIGHT_CACHE:-$HOME/.cache/vmsight}
recipe_hash=$(sha256sum "$0" | cut -c1-16)
dir=$cache/tools/$recipe_hash
cargo=$(command -v cargo || echo "$HOME/.cargo/bin/cargo")

if [ ! -x "$dir/bin/virtiofsd" ] || [ ! -x "$dir/bin/vhost-device-vsock" ]; then
    log "building virtiofsd $VIRTIOFSD_VERSION and vhost-device-vsock $VSOCK_VERSION from crates.io into $dir"
    tmp=$dir.partial
    rm -rf "$tmp"
    mkdir -p "$tmp"
    "$cargo" install --quiet --locked --root "$tmp" "virtiofsd@$VIRTIOFSD_VERSION"
    "$cargo" install --quiet --locked --root "$tmp" "vhost-device-vsock@$VSOCK_VERSION"
    rm -rf "$dir"
    mv "$tmp" "$dir"
fi
"$dir/bin/virtiofsd" --version >&2
"$dir/bin/vhost-device-vsock" --version >&2
ln -sfn "$recipe_hash" "$cache/tools/current"
log "tools ready in $cache/tools/current/bin"
