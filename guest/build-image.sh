#!/usr/bin/env bash
# Builds the default vmsight guest image from Debian bookworm packages only.
#
#   build-image.sh [--force] OUT_DIR
#
# Produces in OUT_DIR: vmlinuz, initrd.img, rootfs.img (sparse raw ext4), System.map, config,
# vmlinux.btf (the kernel's raw BTF, input of the kernel profile) and manifest.json. The root
# file system also gets vmsight_sym.ko (guest/sym, the symbiotic interface's module), built here
# against the kernel's headers package.
# All work happens in OUT_DIR.tmp, which is renamed to OUT_DIR at the very end, so OUT_DIR is
# either absent or complete. Re-running with an existing OUT_DIR does nothing unless --force.
#
# Environment:
#   VMSIGHT_RECIPE_HASH  recorded in manifest.json (computed by the vmsight-image crate)
#   VMSIGHT_DEB_CACHE    optional directory where downloaded .debs are kept between builds
#   VMSIGHT_KEEP_TMP=1   keep OUT_DIR.tmp after a failure, for debugging
#
# Needs root (debootstrap, mknod, file ownership in the root file system). The Debian mirror is
# taken from this machine's apt configuration, never hard-coded.
set -euo pipefail
# Progress and errors go to stderr only (the vmsight-image crate streams it); noisy tool output
# goes to OUT_DIR.tmp/build.log, whose tail is shown on failure.
exec 1>&2

SUITE=bookworm
ROOTFS_SIZE=4G
# mariadb-server-core and mariadb-client-core are bookworm's MariaDB 10.11 server (mariadbd,
# mariadb-install-db, the system tables' SQL) and client (mariadb, my_print_defaults): the iCache
# DB benchmark (bench/icache.py, workload mariadb) starts mariadbd by hand, as minbase has no init
# system. Not mariadb-server: it only adds the init/systemd glue, Galera and perl tools, and
# its maintainer scripts start a server.
ROOTFS_PACKAGES=(coreutils findutils tar gzip gnupg strace inotify-tools fio sqlite3
    python3-minimal procps util-linux e2fsprogs bonnie++ postmark kmod iproute2
    xfsprogs btrfs-progs plocate iperf3 tcpdump curl iputils-ping
    mariadb-server-core mariadb-client-core)
# Load order matters: each module needs the previous ones.
INITRAMFS_MODULES=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
    virtio_blk)

log() { printf '[build-image] %s\n' "$*"; }
die() { printf '[build-image] error: %s\n' "$*"; exit 1; }

FORCE=0
if [ "${1:-}" = "--force" ]; then FORCE=1; shift; fi
[ $# -eq 1 ] || die "usage: build-image.sh [--force] OUT_DIR"
[ -n "$1" ] || die "OUT_DIR must not be empty"
RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=$(realpath -m -- "$1")
TMP="$OUT.tmp"
START_TIME=$(date +%s)

if [ -f "$OUT/manifest.json" ] && [ $FORCE -eq 0 ]; then
    log "$OUT is already built (use --force to rebuild)"
    exit 0
fi
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, mknod and root-owned files need it)"

need_cmd() {
    local cmd=$1 pkg=$2
    command -v "$cmd" >/dev/null || die "'$cmd' not found; install the Debian package '$pkg'"
}
need_cmd apt-get apt
need_cmd dpkg-deb dpkg
need_cmd debootstrap debootstrap
need_cmd mkfs.ext4 e2fsprogs
need_cmd e2fsck e2fsprogs
need_cmd depmod kmod
need_cmd cpio cpio
need_cmd gzip gzip
need_cmd gcc gcc
need_cmd make make
need_cmd modinfo kmod
need_cmd objcopy binutils
need_cmd readelf binutils
need_cmd ar binutils
need_cmd ldconfig libc-bin
need_cmd sha256sum coreutils
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || die "static libc missing; install the Debian package 'libc6-dev'"
for f in "$RECIPE_DIR/init" "$RECIPE_DIR/initramfs-init" "$RECIPE_DIR/sym/Kbuild" \
    "$RECIPE_DIR/sym/vmsight_sym.c" "$RECIPE_DIR/sym/vmsight_sym_v99.c" \
    "$RECIPE_DIR/sym/vmsight_sym_swap.c" "$RECIPE_DIR/sym/vmsight_sym_abi.h"; do
    [ -f "$f" ] || die "recipe file $f is missing"
done

# The first "URIs:" (deb822) or "deb" line that serves the main Debian archive (same logic as
# scripts/setup-host.sh; repeated because this script is embedded in the vmsight binary and runs
# from a temporary directory, where the repository's scripts are not available).
debian_mirror() {
    local uri=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri=$(awk '/^URIs:/ {for (i=2;i<=NF;i++) print $i}' /etc/apt/sources.list.d/*.sources \
              | grep -v -- '-security' | head -n1 || true)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1=="deb" && $0 !~ /security/ { for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; exit} }' \
              /etc/apt/sources.list || true)
    fi
    [ -n "$uri" ] || return 1
    printf '%s\n' "$uri"
}
MIRROR=$(debian_mirror) || die "cannot find a Debian mirror in the apt configuration (/etc/apt/sources.list.d/*.sources or /etc/apt/sources.list)"

# Unmounts anything left below $TMP (a failed debootstrap can leave proc/sys mounted inside the
# target) before deleting it: rm -rf must never descend into a live /proc or /sys.
cleanup_tmp() {
    [ -e "$TMP" ] || return 0
    local m
    for m in $(awk -v p="$TMP/" 'index($2, p) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    if awk -v p="$TMP/" 'index($2, p) == 1 {found=1} END {exit !found}' /proc/mounts; then
        die "cannot unmount file systems below $TMP; remove it by hand"
    fi
    rm -rf --one-file-system -- "$TMP"
}
on_exit() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        if [ -f "$TMP/build.log" ]; then
            log "last lines of $TMP/build.log:"
            tail -n 25 "$TMP/build.log" | sed 's/^/    /'
        fi
        if [ "${VMSIGHT_KEEP_TMP:-0}" = 1 ]; then
            log "build failed; keeping $TMP"
        else
            cleanup_tmp || true
        fi
    fi
}
trap on_exit EXIT

cleanup_tmp
mkdir -p "$TMP"/{pkgs,kernel,busybox,rootfs,initramfs,out,headers,sym}
BUILD_LOG="$TMP/build.log"
: >"$BUILD_LOG"
run() { "$@" >>"$BUILD_LOG" 2>&1; }

DEBS="$TMP/pkgs"
if [ -n "${VMSIGHT_DEB_CACHE:-}" ]; then
    mkdir -p "$VMSIGHT_DEB_CACHE/debootstrap"
    DEBS=$(realpath -- "$VMSIGHT_DEB_CACHE")
fi

# pick_kbuild NAME KERNEL_VER MIN_VER: KERNEL_VER when apt has NAME at it, else the newest
# version apt has that is >= MIN_VER and of KERNEL_VER's upstream release; fails without one.
pick_kbuild() {
    local name=$1 kver=$2 min=$3 v best=
    for v in $(apt-cache madison "$name" 2>/dev/null | awk '{print $3}'); do
        if [ "$v" = "$kver" ]; then echo "$v"; return 0; fi
        [ "${v%-*}" = "${kver%-*}" ] && dpkg --compare-versions "$v" ge "$min" || continue
        if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v; fi
    done
    [ -n "$best" ] && echo "$best"
}

# apt-get download as root warns that the _apt sandbox user cannot write here; run unsandboxed.
apt_download() {
    (cd "$DEBS" && apt-get -q -o APT::Sandbox::User=root download "$@") >>"$BUILD_LOG" 2>&1 ||
        die "apt-get download $* failed (is the package list current? try 'apt-get update')"
}
# The .deb of PKG at version VER in $DEBS (apt encodes ':' of an epoch as %3a).
deb_path() {
    local f="$DEBS/${1}_${2//:/%3a}_amd64.deb"
    [ -f "$f" ] || die "downloaded package $f not found"
    printf '%s\n' "$f"
}
candidate() {
    apt-cache policy "$1" | awk '/Candidate:/ {print $2}'
}

# --- kernel ----------------------------------------------------------------------------------
log "resolving the kernel package"
META=linux-image-cloud-amd64
META_VER=$(candidate "$META")
[ -n "$META_VER" ] && [ "$META_VER" != "(none)" ] ||
    die "package $META is unknown to apt; run 'apt-get update' (bookworm main must be configured)"
apt_download "$META=$META_VER"
META_DEB=$(deb_path "$META" "$META_VER")
# "Depends: linux-image-6.1.0-NN-cloud-amd64 (= 6.1.x-y)": the ABI is resolved, not hard-coded.
KPKG_DEP=$(dpkg-deb -f "$META_DEB" Depends)
KPKG=$(printf '%s\n' "$KPKG_DEP" | grep -oE 'linux-image-6\.1\.[^ ,()]*-cloud-amd64' | head -n1 || true)
[ -n "$KPKG" ] || die "cannot find a linux-image-6.1.*-cloud-amd64 dependency in '$KPKG_DEP'"
KPKG_VER=$(printf '%s\n' "$KPKG_DEP" | sed -n "s/.*$KPKG (= \([^)]*\)).*/\1/p")
[ -n "$KPKG_VER" ] || KPKG_VER=$(candidate "$KPKG")
KVER=${KPKG#linux-image-}
log "kernel $KVER (package $KPKG $KPKG_VER)"
BUSYBOX_VER=$(candidate busybox-static)
[ -n "$BUSYBOX_VER" ] && [ "$BUSYBOX_VER" != "(none)" ] || die "package busybox-static is unknown to apt"

log "downloading $KPKG, its -dbg package (for the real System.map) and busybox-static"
for spec in "$KPKG=$KPKG_VER" "$KPKG-dbg=$KPKG_VER" "busybox-static=$BUSYBOX_VER"; do
    name=${spec%%=*} ver=${spec#*=}
    if [ -f "$DEBS/${name}_${ver//:/%3a}_amd64.deb" ]; then continue; fi
    apt_download "$spec"
done
KDEB=$(deb_path "$KPKG" "$KPKG_VER")
KDBG_DEB=$(deb_path "$KPKG-dbg" "$KPKG_VER")
BB_DEB=$(deb_path busybox-static "$BUSYBOX_VER")

dpkg-deb -x "$KDEB" "$TMP/kernel"
KBOOT="$TMP/kernel/boot"
for f in "vmlinuz-$KVER" "config-$KVER"; do
    [ -f "$KBOOT/$f" ] || die "$KPKG does not contain boot/$f"
done
[ -d "$TMP/kernel/lib/modules/$KVER" ] || die "$KPKG does not contain lib/modules/$KVER"
cp "$KBOOT/vmlinuz-$KVER" "$TMP/out/vmlinuz"
cp "$KBOOT/config-$KVER" "$TMP/out/config"

# Debian's image package ships a one-line placeholder System.map; the real one is in the -dbg
# package, early in its data archive. tar stops after the first match, so dpkg-deb gets SIGPIPE:
# its status is ignored and the result is checked instead.
log "extracting the real System.map from $KPKG-dbg"
{ dpkg-deb --fsys-tarfile "$KDBG_DEB" 2>/dev/null || true; } |
    tar -xO --occurrence=1 "./usr/lib/debug/boot/System.map-$KVER" >"$TMP/out/System.map" ||
    die "cannot extract usr/lib/debug/boot/System.map-$KVER from $KDBG_DEB"
[ "$(wc -l <"$TMP/out/System.map")" -gt 1000 ] || die "System.map from $KDBG_DEB looks truncated"

# --- vmlinux and BTF (like the kernel's scripts/extract-vmlinux) -----------------------------
log "extracting vmlinux from vmlinuz and dumping its .BTF section"
VMLINUX="$TMP/kernel/vmlinux"
is_elf() { [ "$(head -c 4 "$1" | od -An -tx1 | tr -d ' \n')" = "7f454c46" ]; }
try_decompress() { # MAGIC(grep -P) COMMAND...
    local magic=$1 off; shift
    command -v "$1" >/dev/null || return 1
    for off in $(LC_ALL=C grep -obUaP "$magic" "$TMP/out/vmlinuz" | cut -d: -f1); do
        # Decompressors complain about the trailing data after the payload; only the result counts.
        tail -c +$((off + 1)) "$TMP/out/vmlinuz" | "$@" >"$VMLINUX" 2>/dev/null || true
        if [ -s "$VMLINUX" ] && is_elf "$VMLINUX"; then return 0; fi
    done
    return 1
}
try_decompress '\x02\x21\x4c\x18' lz4 -dc ||
    try_decompress '\x28\xb5\x2f\xfd' zstd -dcq ||
    try_decompress '\x1f\x8b\x08' gzip -dc ||
    try_decompress '\xfd\x37\x7a\x58\x5a\x00' xz -dcq ||
    try_decompress '\x42\x5a\x68' bzip2 -dcq ||
    try_decompress '\x5d\x00\x00\x00' xz -dcq --format=lzma ||
    try_decompress '\x89\x4c\x5a' lzop -dc ||
    die "cannot extract vmlinux from vmlinuz (CONFIG_KERNEL_$(grep -oE '^CONFIG_KERNEL_(GZIP|XZ|LZ4|ZSTD|BZIP2|LZMA|LZO)=y' "$TMP/out/config" | sed 's/CONFIG_KERNEL_//;s/=y//') compressed; install the matching decompressor, e.g. the Debian package 'lz4')"
SECTIONS=$(readelf -SW "$VMLINUX") || die "readelf cannot read the extracted vmlinux"
grep -q ' \.BTF ' <<<"$SECTIONS" || die "vmlinux has no .BTF section (CONFIG_DEBUG_INFO_BTF off?)"
objcopy --dump-section ".BTF=$TMP/out/vmlinux.btf" "$VMLINUX" /dev/null ||
    die "objcopy cannot dump .BTF from vmlinux"
# System.map must describe this very kernel: its __start_BTF must be the .BTF section address.
btf_addr=$(awk '$2 == ".BTF" {print $4} $3 == ".BTF" {print $5}' <<<"$SECTIONS" | head -n1)
map_addr=$(awk '$3 == "__start_BTF" {print $1}' "$TMP/out/System.map")
[ -n "$btf_addr" ] && [ "$btf_addr" = "$map_addr" ] ||
    die "System.map does not match vmlinuz (__start_BTF $map_addr, .BTF section at $btf_addr)"
rm -f "$VMLINUX"

# --- vmsight_sym (the symbiotic interface's guest module, guest/sym) --------------------------
# Built against this kernel's headers package: linux-headers-$KVER plus what it depends on
# (linux-headers-<abi>-common and linux-kbuild-6.1 at the same version), unpacked into
# $TMP/headers, never installed. The headers' Makefile includes the -common tree by absolute
# /usr/src path; that include is pointed at the unpacked copy. Two modules come out of the one
# source: vmsight_sym.ko and vmsight_sym_v99.ko (built for interface version 99, which must be
# refused: the version negotiation test).
HPKG="linux-headers-$KVER"
log "building vmsight_sym.ko against $HPKG $KPKG_VER"
apt-cache show "$HPKG=$KPKG_VER" >/dev/null 2>&1 ||
    die "$HPKG version $KPKG_VER (the headers of kernel $KPKG $KPKG_VER) is not available from apt, so the vmsight_sym module cannot be built; run 'apt-get update' (bookworm and bookworm-security main must be configured)"
if [ ! -f "$DEBS/${HPKG}_${KPKG_VER//:/%3a}_amd64.deb" ]; then apt_download "$HPKG=$KPKG_VER"; fi
HDEB=$(deb_path "$HPKG" "$KPKG_VER")
HDEP=$(dpkg-deb -f "$HDEB" Depends)
HCOMMON=$(printf '%s\n' "$HDEP" | grep -oE 'linux-headers-[^ ,()]*-common' | head -n1 || true)
HCOMMON_VER=$(printf '%s\n' "$HDEP" | sed -n "s/.*$HCOMMON (= \([^)]*\)).*/\1/p")
HKBUILD=$(printf '%s\n' "$HDEP" | grep -oE 'linux-kbuild-[0-9.]+' | head -n1 || true)
[ -n "$HCOMMON" ] && [ -n "$HCOMMON_VER" ] && [ -n "$HKBUILD" ] ||
    die "cannot find the -common headers and linux-kbuild dependencies of $HPKG in '$HDEP'"
# The headers need linux-kbuild (>= their version): the same version when apt has it, else the
# newest of the same upstream release (Debian's security archive can carry a newer revision of
# linux-kbuild, e.g. 6.1.192-3, before the kernel image of that revision; its modpost and
# fixdep build modules of the -2 kernel alike).
HKBUILD_MIN=$(printf '%s\n' "$HDEP" | sed -n "s/.*$HKBUILD (>= \([^)]*\)).*/\1/p")
HKBUILD_VER=$(pick_kbuild "$HKBUILD" "$KPKG_VER" "${HKBUILD_MIN:-$KPKG_VER}") ||
    die "no $HKBUILD of kernel $KPKG_VER's upstream release (>= ${HKBUILD_MIN:-$KPKG_VER}) is available from apt (it has: $(apt-cache madison "$HKBUILD" | awk '{print $3}' | tr '\n' ' ')); the vmsight_sym module cannot be built; run 'apt-get update'"
[ "$HKBUILD_VER" = "$KPKG_VER" ] || log "using $HKBUILD $HKBUILD_VER (apt has no $KPKG_VER)"
for spec in "$HCOMMON=$HCOMMON_VER:all" "$HKBUILD=$HKBUILD_VER:amd64"; do
    pv=${spec%:*} arch=${spec##*:}
    name=${pv%%=*} ver=${pv#*=}
    if [ -f "$DEBS/${name}_${ver//:/%3a}_${arch}.deb" ]; then continue; fi
    apt-cache show "$name=$ver" >/dev/null 2>&1 ||
        die "$name version $ver (needed by $HPKG) is not available from apt; the vmsight_sym module cannot be built"
    apt_download "$name=$ver"
done
for deb in "$HDEB" "$DEBS/${HCOMMON}_${HCOMMON_VER//:/%3a}_all.deb" \
    "$DEBS/${HKBUILD}_${HKBUILD_VER//:/%3a}_amd64.deb"; do
    [ -f "$deb" ] || die "downloaded package $deb not found"
    dpkg-deb -x "$deb" "$TMP/headers" || die "cannot unpack $deb"
done
KHDR="$TMP/headers/usr/src/linux-headers-$KVER"
[ -f "$KHDR/Makefile" ] && [ -f "$KHDR/Module.symvers" ] || die "$HPKG has no usr/src/linux-headers-$KVER/{Makefile,Module.symvers}"
sed -i "s|^include /usr/src/|include $TMP/headers/usr/src/|" "$KHDR/Makefile"
inc=$(sed -n 's/^include //p' "$KHDR/Makefile" | head -n1)
[ -n "$inc" ] && [ -f "$inc" ] || die "the headers' Makefile includes '$inc', which is not in the unpacked headers"
# Debian builds modules of this kernel with the compiler named in .kernelvariables (gcc-12).
KCC=$(grep -oE 'gcc-[0-9]+' "$KHDR/.kernelvariables" | head -n1 || true)
[ -n "$KCC" ] || KCC=gcc
command -v "$KCC" >/dev/null || die "'$KCC' not found (kernel $KVER's modules are built with it); install the Debian package '$KCC'"
cp "$RECIPE_DIR"/sym/Kbuild "$RECIPE_DIR"/sym/*.c "$RECIPE_DIR"/sym/*.h "$TMP/sym/"
SYM_OUT="$TMP/sym/make.log"
if ! env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -C "$KHDR" M="$TMP/sym" modules >"$SYM_OUT" 2>&1; then
    cat "$SYM_OUT" >>"$BUILD_LOG"
    die "building vmsight_sym.ko failed: $(grep -m1 -E 'error' "$SYM_OUT" || tail -n1 "$SYM_OUT")"
fi
cat "$SYM_OUT" >>"$BUILD_LOG"
if grep -q 'warning:' "$SYM_OUT"; then
    log "warnings while building vmsight_sym.ko:"
    grep -A3 'warning:' "$SYM_OUT" | sed 's/^/    /'
fi
for m in vmsight_sym vmsight_sym_v99; do
    [ -f "$TMP/sym/$m.ko" ] || die "the build produced no $m.ko"
    vm=$(modinfo -F vermagic "$TMP/sym/$m.ko")
    [ "${vm%% *}" = "$KVER" ] || die "$m.ko has vermagic '$vm', not kernel $KVER"
done
SYM_ABI=$(sed -n 's/^#define VSYM_ABI_VERSION \([0-9]*\)$/\1/p' "$TMP/sym/vmsight_sym_abi.h")
rm -rf --one-file-system -- "$TMP/headers"

# --- root file system ------------------------------------------------------------------------
ROOT="$TMP/rootfs"
INCLUDE=$(IFS=,; echo "${ROOTFS_PACKAGES[*]}")
log "debootstrap $SUITE minbase (+ ${#ROOTFS_PACKAGES[@]} packages) from $MIRROR"
DBS_OPTS=(--variant=minbase "--include=$INCLUDE")
if [ -n "${VMSIGHT_DEB_CACHE:-}" ]; then DBS_OPTS+=("--cache-dir=$DEBS/debootstrap"); fi
run debootstrap "${DBS_OPTS[@]}" "$SUITE" "$ROOT" "$MIRROR" ||
    die "debootstrap failed (see the log above)"

log "installing kernel modules, busybox, init and helper programs"
mkdir -p "$ROOT/lib/modules" "$ROOT/boot"
cp -a "$TMP/kernel/lib/modules/$KVER" "$ROOT/lib/modules/"
cp -a "$KBOOT/." "$ROOT/boot/"
cp "$TMP/out/System.map" "$ROOT/boot/System.map-$KVER"
# The symbiotic interface's module (guest/init loads it with vmsight.sym=1); depmod indexes it.
for m in vmsight_sym vmsight_sym_v99; do
    install -D -m 644 "$TMP/sym/$m.ko" "$ROOT/lib/modules/$KVER/extra/$m.ko"
done
run depmod -b "$ROOT" "$KVER" || die "depmod failed for $KVER"

dpkg-deb -x "$BB_DEB" "$TMP/busybox"
BUSYBOX=$(find "$TMP/busybox" -type f -name busybox -path '*bin/busybox' | head -n1)
[ -n "$BUSYBOX" ] || die "busybox-static does not contain bin/busybox"
install -D -m 755 "$BUSYBOX" "$ROOT/usr/lib/vmsight/busybox"
install -m 755 "$RECIPE_DIR/init" "$ROOT/usr/lib/vmsight/init"

# minbase has no init system, hence no poweroff/reboot/halt. These wrappers ask vmsight's init
# (PID 1) to shut down cleanly (it syncs and remounts / read-only) with the signals BusyBox init
# uses; with -f they power off at once like the real commands.
for pair in poweroff:USR2 reboot:TERM halt:USR1; do
    name=${pair%%:*} sig=${pair#*:}
    for d in usr/sbin sbin usr/bin bin; do
        if [ -e "$ROOT/$d/$name" ] && [ ! -L "$ROOT/$d/$name" ]; then continue 2; fi
    done
    cat >"$ROOT/usr/local/sbin/$name" <<EOF
#!/bin/sh
# vmsight: minbase has no init system; ask vmsight's init (PID 1) to $name cleanly.
case "\${1:-}" in
    -f|--force) sync; exec /usr/lib/vmsight/busybox $name -f ;;
esac
exec kill -$sig 1
EOF
    chmod 755 "$ROOT/usr/local/sbin/$name"
done

# libvmsight (application hints, docs/insights.md): header, shared and static library, and the
# LD_PRELOAD shim, which carries its own copy of the hint calls so it needs no other library.
LIB="$RECIPE_DIR/lib"
for f in vmsight.h vmsight.c preload.c hylics.h hylics.c; do
    [ -f "$LIB/$f" ] || die "recipe file $LIB/$f is missing"
done
install -D -m 644 "$LIB/vmsight.h" "$ROOT/usr/local/include/vmsight.h"
mkdir -p "$ROOT/usr/local/lib"
run gcc -O2 -fPIC -shared -Wall -Wextra -Wl,-soname,libvmsight.so.1 \
    -o "$ROOT/usr/local/lib/libvmsight.so.1" "$LIB/vmsight.c" || die "compiling libvmsight.so failed"
ln -sf libvmsight.so.1 "$ROOT/usr/local/lib/libvmsight.so"
run gcc -O2 -Wall -Wextra -c -o "$TMP/vmsight.o" "$LIB/vmsight.c" || die "compiling libvmsight.a failed"
run ar rcs "$ROOT/usr/local/lib/libvmsight.a" "$TMP/vmsight.o" || die "ar failed for libvmsight.a"
run gcc -O2 -fPIC -shared -Wall -Wextra -fvisibility=hidden \
    -o "$ROOT/usr/local/lib/libvmsight-preload.so" "$LIB/preload.c" "$LIB/vmsight.c" -ldl ||
    die "compiling libvmsight-preload.so failed"
# libhylics (Hylics' send offload over vsock, docs/hylics.md).
install -D -m 644 "$LIB/hylics.h" "$ROOT/usr/local/include/hylics.h"
run gcc -O2 -fPIC -shared -Wall -Wextra -Wl,-soname,libhylics.so.1 \
    -o "$ROOT/usr/local/lib/libhylics.so.1" "$LIB/hylics.c" || die "compiling libhylics.so failed"
ln -sf libhylics.so.1 "$ROOT/usr/local/lib/libhylics.so"
run ldconfig -r "$ROOT" || die "ldconfig failed in the root file system"

# Helper programs are static unless their source has a "// build: dynamic FLAGS..." line (then
# they link against the guest's libraries, e.g. libvmsight.so, which the host's bookworm libc
# matches).
shopt -s nullglob
for src in "$RECIPE_DIR"/progs/*.c; do
    prog=$(basename "$src" .c)
    build=$(sed -n 's|^// build: ||p' "$src" | head -n1)
    if [ "${build%% *}" = dynamic ]; then
        # shellcheck disable=SC2086 # FLAGS are words
        run gcc -O2 -Wall -Wextra -I"$LIB" -o "$ROOT/usr/local/bin/$prog" "$src" \
            -L"$ROOT/usr/local/lib" ${build#dynamic} || die "compiling $src failed"
    else
        run gcc -O2 -static -Wall -Wextra -I"$LIB" -o "$ROOT/usr/local/bin/$prog" "$src" ||
            die "compiling $src failed"
    fi
done
shopt -u nullglob

log "configuring the root file system"
sed -i 's/^root:[^:]*:/root::/' "$ROOT/etc/shadow"
echo vmsight >"$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tvmsight\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
    >"$ROOT/etc/hosts"
echo '/dev/vda / ext4 rw,errors=remount-ro 0 1' >"$ROOT/etc/fstab"
rm -f "$ROOT/etc/resolv.conf"
# What "apt-get clean" does, without running the guest's apt on the host.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/archives/partial/* \
    "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/log/bootstrap.log
mkdir -p "$ROOT/var/lib/apt/lists/partial"

# Package versions for the manifest, before the tree becomes a disk image.
ROOT_PKGS=$(dpkg-query --admindir="$ROOT/var/lib/dpkg" -W -f '${Package}\t${Version}\n' | LC_ALL=C sort)

log "creating rootfs.img ($ROOTFS_SIZE, sparse ext4)"
run mkfs.ext4 -q -L vmsight-root -d "$ROOT" "$TMP/out/rootfs.img" "$ROOTFS_SIZE" ||
    die "mkfs.ext4 -d failed (e2fsprogs >= 1.43 needed)"
run e2fsck -fn "$TMP/out/rootfs.img" || die "e2fsck found problems in the new rootfs.img"

# --- initramfs -------------------------------------------------------------------------------
log "creating initrd.img"
IR="$TMP/initramfs"
mkdir -p "$IR"/{bin,dev,proc,sys,newroot,lib/modules}
install -m 755 "$BUSYBOX" "$IR/bin/busybox"
for applet in $("$IR/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$IR/bin/$applet"
done
install -m 755 "$RECIPE_DIR/initramfs-init" "$IR/init"
# The kernel opens /dev/console for /init before anything can mount devtmpfs.
mknod -m 600 "$IR/dev/console" c 5 1
mknod -m 666 "$IR/dev/null" c 1 3
for m in "${INITRAMFS_MODULES[@]}"; do
    ko=$(find "$TMP/kernel/lib/modules/$KVER/kernel" -name "$m.ko*" | head -n1)
    [ -n "$ko" ] || die "module $m not found in $KPKG"
    case "$ko" in # BusyBox insmod takes plain .ko files only
        *.ko) cp "$ko" "$IR/lib/modules/$m.ko" ;;
        *.ko.xz) xz -dc "$ko" >"$IR/lib/modules/$m.ko" ;;
        *.ko.zst) zstd -dcq "$ko" >"$IR/lib/modules/$m.ko" ;;
        *.ko.gz) gzip -dc "$ko" >"$IR/lib/modules/$m.ko" ;;
        *) die "module $ko has an unknown compression" ;;
    esac
done
printf '%s\n' "${INITRAMFS_MODULES[@]}" >"$IR/lib/modules/order"
(cd "$IR" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) |
    gzip -9 -n >"$TMP/out/initrd.img"

# --- manifest --------------------------------------------------------------------------------
json_str() { # JSON string literal of $1
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
}
file_entry() {
    local f="$TMP/out/$1" sum=""
    # Hashing the 4 GiB sparse rootfs.img would read 4 GiB of mostly holes (about 30 s here).
    if [ "$1" != rootfs.img ]; then sum=$(sha256sum "$f" | cut -d' ' -f1); fi
    printf '    %s: {"size": %s, "allocated": %s, "sha256": %s}' "$(json_str "$1")" \
        "$(stat -c %s "$f")" "$(($(stat -c %b "$f") * $(stat -c %B "$f")))" "$(json_str "$sum")"
}
{
    echo '{'
    echo '  "format": 1,'
    echo "  \"recipe_hash\": $(json_str "${VMSIGHT_RECIPE_HASH:-unknown}"),"
    echo "  \"suite\": $(json_str "$SUITE"),"
    echo "  \"kernel_version\": $(json_str "$KVER"),"
    echo "  \"kernel_package\": $(json_str "$KPKG"),"
    echo "  \"kernel_package_version\": $(json_str "$KPKG_VER"),"
    echo "  \"busybox_version\": $(json_str "$BUSYBOX_VER"),"
    echo "  \"build_date\": $(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)"),"
    echo "  \"build_seconds\": $(($(date +%s) - START_TIME)),"
    sym_entry() { # NAME: path, size and sha256 of lib/modules/$KVER/extra/NAME.ko
        local rel="lib/modules/$KVER/extra/$1.ko"
        printf '{"path": %s, "size": %s, "sha256": %s}' "$(json_str "/$rel")" \
            "$(stat -c %s "$ROOT/$rel")" "$(json_str "$(sha256sum "$ROOT/$rel" | cut -d' ' -f1)")"
    }
    echo "  \"sym_module\": {\"abi\": ${SYM_ABI:-0}, \"vermagic\": $(json_str "$(modinfo -F vermagic "$ROOT/lib/modules/$KVER/extra/vmsight_sym.ko")"),"
    echo "    \"module\": $(sym_entry vmsight_sym),"
    echo "    \"abi_test_module\": $(sym_entry vmsight_sym_v99)},"
    echo '  "files": {'
    first=1
    for f in vmlinuz initrd.img rootfs.img System.map config vmlinux.btf; do
        [ $first -eq 1 ] || echo ','
        first=0
        file_entry "$f"
    done
    echo
    echo '  },'
    echo '  "packages": {'
    first=1
    while IFS=$'\t' read -r name ver; do
        [ $first -eq 1 ] || echo ','
        first=0
        printf '    %s: %s' "$(json_str "$name")" "$(json_str "$ver")"
    done <<<"$ROOT_PKGS"
    echo
    echo '  }'
    echo '}'
} >"$TMP/out/manifest.json"

# --- publish ---------------------------------------------------------------------------------
mv "$BUILD_LOG" "$TMP/out/build.log"
if [ -e "$OUT" ]; then
    rm -rf --one-file-system -- "$OUT.old"
    mv -- "$OUT" "$OUT.old"
fi
mv -- "$TMP/out" "$OUT"
rm -rf --one-file-system -- "$OUT.old"
cleanup_tmp
log "done in $(($(date +%s) - START_TIME)) s: $OUT (kernel $KVER)"
