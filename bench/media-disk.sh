#!/usr/bin/env bash
# Builds (once) a disk image holding a Debian bookworm root with ffmpeg and pigz, for the
# Hylics benchmark's computation jobs (bench/hylics.py --compute ffmpeg|pigz), and prints its
# path. The default guest image stays lean: the guest mounts this disk read-only and runs the
# tools through the disk's own loader and libraries. Cached in ~/.cache/vmsight/bench, keyed
# by a hash of this script; the Debian mirror comes from this machine's apt configuration.
#
#   bench/media-disk.sh [--out PATH]
#
# The build (seconds, image size; or that the image was cached) goes to
# bench/results/media-disk.json when the image is built or --out is given (a cached image
# without --out, as bench/hylics.py asks for it, leaves the results file alone).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib/args.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
bench_start media-disk.sh 13 "$@"
# shellcheck source=scripts/lib/debian-mirror.sh
. "$HERE/../scripts/lib/debian-mirror.sh"

PACKAGES=ffmpeg,pigz
CACHE=${VMSIGHT_CACHE:-$HOME/.cache/vmsight}/bench
HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
OUT_IMG=$CACHE/media-$HASH.img

record() { # cached(true|false): writes the results file
    printf '{"config": "%s", "rep": 0, "cached": %s, "wall_s": %d, "image_bytes": %d, "image": "%s"}\n' \
        "$( [ "$1" = true ] && echo cached || echo built )" "$1" $((SECONDS - T0)) \
        "$(stat -c %s "$OUT_IMG")" "$OUT_IMG" |
        python3 "$HERE/lib/results.py" --bench media-disk ${OUT:+--out "$OUT"} --date "$START" \
            --load-before "$LOAD0" --elapsed $((SECONDS - T0)) --param "packages=$PACKAGES" \
            --param "hash=$HASH" --from-stdin -- "${ARGV[@]}"
}

if [ -f "$OUT_IMG" ]; then
    if [ -n "$OUT" ]; then record true; fi
    echo "$OUT_IMG"
    exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "media-disk.sh: needs root (debootstrap)" >&2; exit 1; }
mkdir -p "$CACHE"
TMP=$(mktemp -d "$CACHE/media.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
MIRROR=$(debian_mirror)
echo "media-disk.sh: debootstrap bookworm minbase + $PACKAGES from $MIRROR" >&2
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$TMP/root" "$MIRROR" > "$TMP/log" 2>&1 ||
    { tail -20 "$TMP/log" >&2; exit 1; }
rm -rf "$TMP/root/var/cache/apt/archives"/*.deb
size_mb=$(( $(du -sm "$TMP/root" | cut -f1) * 5 / 4 + 64 ))
mkfs.ext4 -q -F -L media -d "$TMP/root" "$TMP/media.img" "${size_mb}M"
mv "$TMP/media.img" "$OUT_IMG"
record false
echo "$OUT_IMG"
