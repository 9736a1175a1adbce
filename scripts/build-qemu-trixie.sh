#!/usr/bin/env bash
# Builds, once, a Debian trixie root holding QEMU 11.1 from trixie-backports, so that vmsight
# can run its guests on QEMU 11 on a bookworm host (`vmsight run --qemu trixie`, or
# VMSIGHT_QEMU=trixie; docs/platforms.md). Nothing is installed on the host: vmsight runs the
# root's qemu-system-x86_64 through the root's own loader and libraries, with the root's
# module and firmware directories.
#
# The root is cached under the vmsight cache ($VMSIGHT_CACHE or ~/.cache/vmsight) in
# qemu/trixie-<hash of this recipe>/root, next to an info.json, and qemu/trixie-current points
# there; older qemu/trixie-* roots are removed. It is built in a .partial directory and renamed
# when complete, under a lock, so an interrupted or concurrent run never leaves a half root.
# Idempotent: a second run with the same recipe only checks the binary's --version.
# Building needs root (debootstrap, chroot) and debootstrap (scripts/setup-host.sh installs it).
set -euo pipefail

SUITE=trixie
# The exact package version, from trixie-backports; change it (and so the recipe hash) to move.
QEMU_VERSION=1:11.1.3+ds-1~bpo13+1
QEMU_UPSTREAM=11.1.3
# What vmsight's guests use (crates/launcher/src/qemu.rs and the device registry).
NEED_DEVICES=(vhost-user-blk-pci vhost-user-fs-pci vhost-user-vsock-pci virtio-net-pci
              virtio-serial-pci virtserialport pvpanic ivshmem-doorbell ivshmem-plain
              virtio-mem-pci)
# -kernel boots through linuxboot_dma.bin; SeaBIOS is in usr/share/seabios; virtio-net-pci
# (--net ...,device=qemu) loads efi-virtio.rom. All must come from the root, never the host.
NEED_FILES=(usr/share/seabios/bios-256k.bin usr/share/qemu/linuxboot_dma.bin
            usr/share/qemu/kvmvapic.bin usr/share/qemu/efi-virtio.rom
            lib64/ld-linux-x86-64.so.2 usr/bin/qemu-system-x86_64)

log() { printf '[qemu11] %s\n' "$*" >&2; }
die() { printf '[qemu11] error: %s\n' "$*" >&2; exit 1; }

# debian_mirror: the first Debian archive of the host's apt configuration.
# shellcheck source=scripts/lib/debian-mirror.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/debian-mirror.sh"

cache=${VMSIGHT_CACHE:-$HOME/.cache/vmsight}
recipe_hash=$(sha256sum "$0" | cut -c1-16)
name=$SUITE-$recipe_hash
dir=$cache/qemu/$name
root=$dir/root

# Runs the root's QEMU the way vmsight does (crates/launcher/src/qemu.rs, `Qemu::trixie`).
qemu_in() {
    local r=$1
    shift
    QEMU_MODULE_DIR=$r/usr/lib/x86_64-linux-gnu/qemu \
        "$r/lib64/ld-linux-x86-64.so.2" \
        --library-path "$r/usr/lib/x86_64-linux-gnu:$r/lib/x86_64-linux-gnu" \
        "$r/usr/bin/qemu-system-x86_64" -L "$r/usr/share/qemu" -L "$r/usr/share/seabios" "$@"
}

# Unmounts whatever a failed debootstrap or chroot left under $1, then removes it without
# ever crossing into another file system.
remove_tree() {
    local d=$1 m
    [ -e "$d" ] || return 0
    while read -r m; do
        case $m in "$d"/*) umount -l "$m" 2>/dev/null || true ;; esac
    done < <(findmnt -rn -o TARGET | sort -r)
    rm -rf --one-file-system "$d"
}

# The first line of what the QEMU in root $1 prints for `--version` (captured whole first: a
# pipe into head could kill QEMU with SIGPIPE, which pipefail would report as a failure).
version_line() {
    local out
    out=$(qemu_in "$1" --version) || return 1
    printf '%s\n' "${out%%$'\n'*}"
}

# Everything a headless q35 TCG guest of vmsight needs is in root $1.
check_root() {
    local r=$1 f d out
    for f in "${NEED_FILES[@]}"; do
        [ -e "$r/$f" ] || die "$r/$f is missing from the root"
    done
    out=$(version_line "$r") || die "the root's QEMU does not run"
    case $out in
        *"version $QEMU_UPSTREAM "*) ;;
        *) die "the root's QEMU says \"$out\", expected version $QEMU_UPSTREAM" ;;
    esac
    out=$(qemu_in "$r" -device help)
    for d in "${NEED_DEVICES[@]}"; do
        grep -q "name \"$d\"" <<<"$out" || die "the root's QEMU has no -device $d"
    done
    out=$(qemu_in "$r" -netdev help)
    grep -qx 'vhost-user' <<<"$out" || die "the root's QEMU has no -netdev vhost-user"
    out=$(qemu_in "$r" -object help)
    grep -qw 'memory-backend-memfd' <<<"$out" || die "the root's QEMU has no memory-backend-memfd"
    out=$(qemu_in "$r" -machine help)
    grep -q '^q35 ' <<<"$out" || die "the root's QEMU has no q35 machine"
    out=$(qemu_in "$r" -accel help)
    grep -qx 'tcg' <<<"$out" || die "the root's QEMU has no TCG"
}

build() {
    [ "$(id -u)" -eq 0 ] || die "building the trixie root needs root (debootstrap, chroot): run as root or with sudo"
    command -v debootstrap >/dev/null || die "debootstrap is missing (make setup installs it)"
    local mirror tmp r logf include=() v
    mirror=$(debian_mirror)
    tmp=$dir.partial
    r=$tmp/root
    remove_tree "$tmp"
    mkdir -p "$tmp"
    logf=$tmp/build.log
    log "building a Debian $SUITE root with qemu-system-x86 $QEMU_VERSION from $mirror into $dir (log: $logf)"
    case $mirror in https:*) include=(--include=ca-certificates) ;; esac
    debootstrap --variant=minbase "${include[@]}" "$SUITE" "$r" "$mirror" >>"$logf" 2>&1 \
        || die "debootstrap $SUITE from $mirror failed; last lines of $logf: $(tail -n 5 "$logf")"
    cat >"$r/etc/apt/sources.list.d/backports.sources" <<SRC
Types: deb
URIs: $mirror
Suites: $SUITE-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    cp -L /etc/resolv.conf "$r/etc/resolv.conf"
    chroot "$r" apt-get update -q >>"$logf" 2>&1 || die "apt-get update in the root failed (see $logf)"
    # (`apt-cache show PKG=VERSION` succeeds even for a version that does not exist.)
    v=$(chroot "$r" apt-cache madison qemu-system-x86)
    if ! awk -F'|' -v want="$QEMU_VERSION" -v suite="$SUITE-backports" \
            '{ gsub(/ /, "", $2) } $2 == want && index($3, suite) { found = 1 } END { exit !found }' <<<"$v"; then
        v=$(awk -F'|' '{ gsub(/ /, "", $2); printf "%s%s", (NR > 1 ? ", " : ""), $2 }' <<<"$v")
        die "qemu-system-x86 $QEMU_VERSION is not in $SUITE-backports at $mirror (available: ${v:-nothing}); update QEMU_VERSION in $0"
    fi
    chroot "$r" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -t "$SUITE-backports" "qemu-system-x86=$QEMU_VERSION" >>"$logf" 2>&1 \
        || die "installing qemu-system-x86 $QEMU_VERSION failed; last lines of $logf: $(tail -n 5 "$logf")"
    # shellcheck disable=SC2016 # dpkg-query's own ${Version}, not the shell's
    v=$(chroot "$r" dpkg-query -W -f='${Version}' qemu-system-x86)
    [ "$v" = "$QEMU_VERSION" ] || die "installed qemu-system-x86 $v, not $QEMU_VERSION"
    # Only the binary, its libraries, modules and firmware are used: drop the rest.
    chroot "$r" apt-get clean
    rm -rf "$r"/var/lib/apt/lists/* "$r"/usr/share/doc "$r"/usr/share/man "$r"/usr/share/info \
           "$r"/usr/share/locale "$r"/var/cache/debconf/*-old "$r"/var/log/*.log
    check_root "$r"
    printf '{"version": "%s", "debian_version": "%s", "recipe": "%s"}\n' \
        "$QEMU_UPSTREAM" "$v" "$recipe_hash" >"$tmp/info.json"
    remove_tree "$dir"
    mv "$tmp" "$dir"
}

mkdir -p "$cache/qemu"
lock=$cache/qemu/.lock
exec 9>"$lock"
if ! flock -n 9; then
    log "another build holds $lock; waiting"
    flock 9
fi

if [ -f "$dir/info.json" ] && [ -x "$root/usr/bin/qemu-system-x86_64" ]; then
    line=$(version_line "$root") || die "the QEMU in $root does not run; remove $dir and run again"
else
    build
    log "built in ${SECONDS}s: $(du -sh "$dir" | cut -f1) in $dir"
    line=$(version_line "$root") || die "the QEMU in $root does not run"
fi
printf '%s\n' "$line" >&2
# Point trixie-current at this recipe's root (atomically: a new link renamed over the old).
ln -sfn "$name" "$cache/qemu/.trixie-current.new"
mv -T "$cache/qemu/.trixie-current.new" "$cache/qemu/trixie-current"
for old in "$cache"/qemu/"$SUITE"-*; do
    case ${old##*/} in "$SUITE-current" | "$name") continue ;; esac
    log "removing the older root $old"
    remove_tree "$old"
done
log "QEMU $QEMU_UPSTREAM ready in $cache/qemu/$SUITE-current/root"
