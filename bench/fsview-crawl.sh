#!/usr/bin/env bash
# Crawl speed, index size and peak memory of the ext4 crawler (issues 5, 32): cold (page cache
# of the image dropped), warm twice, and once more turned into a lazy index (its resident bytes
# after start-up). The image is the default guest root disk, or with --files a synthetic one at
# Gamma-Ray's scale (its 6 GB image). The reference is Gamma-Ray's published numbers (323 B/file
# raw, ~20 s per 6 GB), which cannot be re-run here.
#
#   bench/fsview-crawl.sh [--files N --gib G] [--out PATH]
#
#   --files N --gib G  crawl an ext4 image of N regular files holding G GiB (directories of 40,
#                      log-normal sizes; bench/lib/trees.py), built once with mkfs.ext4 -d and
#                      kept in ~/.cache/vmsight/bench/ (about G * 1.1 GiB)
#
# Every crawl (time, inodes, index bytes, peak RSS of the whole run and of the crawl alone, before
# the serialisation) goes to bench/results/fsview-crawl.json
# (--files: fsview-crawl-scale.json; --out).
set -euo pipefail
# shellcheck source=bench/lib/args.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
FILES='' GIB='' rest=()
while [ $# -gt 0 ]; do
    case $1 in
        --files) FILES=$2; shift 2 ;;
        --gib) GIB=$2; shift 2 ;;
        *) rest+=("$1"); shift ;;
    esac
done
bench_start fsview-crawl.sh 15 ${rest[@]+"${rest[@]}"}
ARGV=("$0" ${FILES:+--files "$FILES"} ${GIB:+--gib "$GIB"} ${rest[@]+"${rest[@]}"})
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}
VARIANT=
if [ -n "$FILES" ] || [ -n "$GIB" ]; then
    if [ -z "$FILES" ] || [ -z "$GIB" ]; then echo "fsview-crawl.sh: --files and --gib go together" >&2; exit 2; fi
    # The recipe hash names the cached image: a new generator or mkfs call makes a new one.
    key=$(cat bench/lib/trees.py "$0" | sha256sum | cut -c1-12)
    CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/vmsight/bench
    IMG=$CACHE/crawl-$FILES-${GIB}g-$key.img
    if [ ! -f "$IMG" ]; then
        mkdir -p "$CACHE"
        rm -f "$CACHE"/crawl-"$FILES"-"${GIB}"g-*.img
        TREE=$(mktemp -d "${TMPDIR:-/tmp}/crawl-tree.XXXXXX")
        trap 'rm -rf "$TREE"' EXIT
        echo "== building $IMG: $FILES files, $GIB GiB" >&2
        python3 bench/lib/trees.py dir "$TREE" "$FILES" "$GIB"
        size_mib=$(python3 -c "print(int($GIB * 1024 * 1.15 + 1024))")
        mkfs.ext4 -q -F -b 4096 -N $((FILES * 11 / 10 + FILES / 40 + 1000)) -d "$TREE" "$IMG.tmp" "${size_mib}M"
        mv "$IMG.tmp" "$IMG"
        rm -rf "$TREE"
    fi
    VARIANT=scale
else
    IMG="$("$VMSIGHT" image info --json | jq -r .dir)/rootfs.img"
fi
cargo build --release -q -p vmsight-fsview --example crawl
REC=$(mktemp)
LAZY=$(mktemp -u "${TMPDIR:-/tmp}/crawl-lazy.XXXXXX")
trap 'rm -f "$REC" "$LAZY"; [ -z "${TREE:-}" ] || rm -rf "$TREE"' EXIT
field() { printf "%s\n" "$out" | sed -n "s/^$1/\\1/p" | head -n1; }  # field SED-PATTERN: \1 of it
rep=0
for run in cold warm warm lazy; do
    if [ "$run" = cold ]; then dd if="$IMG" iflag=nocache count=0 status=none; sync; echo 1 > /proc/sys/vm/drop_caches; fi
    echo "== $run"
    extra=()
    [ "$run" = lazy ] && extra=(--lazy "$LAZY")
    out=$(/usr/bin/time -f 'peak rss: %M KiB' target/release/examples/crawl "$IMG" "${extra[@]}" 2>&1)
    printf "%s\n" "$out" | grep -v '^  ' | sed -n 1,14p
    printf '{"config": "%s", "rep": %d, "crawl_s": %s, "inodes": %s, "index_bytes": %s, "index_bytes_per_inode": %s, "serialised_bytes": %s, "serialised_bytes_per_inode": %s, "peak_rss_kib": %s, "crawl_peak_rss_kib": %s, "lazy_start_bytes_per_inode": %s, "lazy_engine_bytes_per_inode": %s}\n' \
        "$run" "$rep" "$(field 'crawl time: *\([0-9.]*\) s.*')" "$(field 'in use: *\([0-9]*\) inodes.*')" \
        "$(field 'index size: *\([0-9]*\) bytes.*')" "$(field 'index size: .*, \([0-9.]*\) bytes per inode.*')" \
        "$(field 'serialised: *\([0-9]*\) bytes.*')" "$(field 'serialised: .*, \([0-9.]*\) bytes per inode.*')" \
        "$(field 'peak rss: \([0-9]*\) KiB')" "$(field 'crawl peak: *\([0-9]*\) KiB.*')" "$(field 'lazy start: .*, \([0-9.]*\) bytes per inode.*')" \
        "$(field 'lazy engine: .*, \([0-9.]*\) bytes per inode.*')" \
        | sed 's/: ,/: null,/g; s/: }/: null}/' >> "$REC"
    if [ "$run" = warm ]; then rep=$((rep + 1)); fi
done
python3 bench/lib/results.py --bench fsview-crawl ${VARIANT:+--variant "$VARIANT"} ${OUT:+--out "$OUT"} \
    --baseline cold --date "$START" --load-before "$LOAD0" --elapsed $((SECONDS - T0)) \
    --param "image=$IMG" ${FILES:+--param "files=$FILES"} ${GIB:+--param "gib=$GIB"} --from-stdin -- "${ARGV[@]}" < "$REC"
