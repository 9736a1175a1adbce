#!/usr/bin/env bash
# Builds (once) a disk image holding a library of raw video segments for the Hylics transcoding
# workload (bench/hylics_media.py) and prints its path: SEGMENTS files /seg-NNN.y4m, each
# SECONDS s of Debian ffmpeg's testsrc2 pattern at 1280x720 (the paper's 720p), 25 fps, yuv420p
# (69 MB each, every segment a different stretch of the pattern). Raw video, so that reading a
# segment from a disk costs about what the paper measured relative to the transcoding (4.02 s
# from the disk against 3.32 s from memory) under TCG (docs/benchmarks.md says how this was
# scaled).
# ffmpeg runs natively on the host from the media disk's root (bench/media-disk.sh, mounted
# read-only through a loop device), so nothing is installed on the host. Cached in
# ~/.cache/vmsight/bench, keyed by a hash of this script.
#
#   bench/video-library.sh [--out PATH]
#
# The build (seconds, image size; or that the image was cached) goes to
# bench/results/video-library.json when the image is built or --out is given.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib/args.sh
. "$HERE/lib/args.sh"
bench_start video-library.sh 16 "$@"

SEGMENTS=40
SECONDS_PER_SEGMENT=2
CACHE=${VMSIGHT_CACHE:-$HOME/.cache/vmsight}/bench
HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
OUT_IMG=$CACHE/video-library-$HASH.img

record() { # cached(true|false): writes the results file
    printf '{"config": "%s", "rep": 0, "cached": %s, "wall_s": %d, "image_bytes": %d, "image": "%s"}\n' \
        "$( [ "$1" = true ] && echo cached || echo built )" "$1" $((SECONDS - T0)) \
        "$(stat -c %s "$OUT_IMG")" "$OUT_IMG" |
        python3 "$HERE/lib/results.py" --bench video-library ${OUT:+--out "$OUT"} --date "$START" \
            --load-before "$LOAD0" --elapsed $((SECONDS - T0)) --param "segments=$SEGMENTS" \
            --param "segment_secs=$SECONDS_PER_SEGMENT" --param "hash=$HASH" --from-stdin -- "${ARGV[@]}"
}

if [ -f "$OUT_IMG" ]; then
    if [ -n "$OUT" ]; then record true; fi
    echo "$OUT_IMG"
    exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "video-library.sh: needs root (loop mount)" >&2; exit 1; }
MEDIA=$("$HERE/media-disk.sh")
mkdir -p "$CACHE"
TMP=$(mktemp -d "$CACHE/video-library.XXXXXX")
cleanup() {
    umount "$TMP/media" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
mkdir "$TMP/media" "$TMP/lib"
mount -o loop,ro "$MEDIA" "$TMP/media"
echo "video-library.sh: $SEGMENTS segments of $SECONDS_PER_SEGMENT s (raw 1280x720) with $MEDIA's ffmpeg" >&2
for ((i = 0; i < SEGMENTS; i++)); do
    start=$((i * SECONDS_PER_SEGMENT))
    # ffmpeg writes to stdout (pipe:1) so the chroot needs no bind mount.
    chroot "$TMP/media" ffmpeg -hide_banner -loglevel error -nostdin -f lavfi \
        -i "testsrc2=size=1280x720:rate=25:duration=$((start + SECONDS_PER_SEGMENT))" \
        -ss "$start" -pix_fmt yuv420p -f yuv4mpegpipe pipe:1 >"$TMP/lib/$(printf 'seg-%03d.y4m' "$i")"
done
size_mb=$(( $(du -sm "$TMP/lib" | cut -f1) * 9 / 8 + 32 ))
mkfs.ext4 -q -F -L videos -d "$TMP/lib" "$TMP/videos.img" "${size_mb}M"
mv "$TMP/videos.img" "$OUT_IMG"
record false
echo "$OUT_IMG"
