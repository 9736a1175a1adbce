#!/usr/bin/env bash
# Crawl speed and index size of the ext4 crawler (issue 5) on the default guest root disk,
# cold (page cache of the image dropped) and warm. The reference is Gamma-Ray's published
# numbers (323 B/file raw, ~20 s per 6 GB), which cannot be re-run here.
#
#   bench/fsview-crawl.sh [--out PATH]
#
# Every crawl (time, inodes, index bytes) goes to bench/results/fsview-crawl.json (--out).
set -euo pipefail
# shellcheck source=bench/lib/args.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
bench_start fsview-crawl.sh 8 "$@"
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}
IMG="$("$VMSIGHT" image info --json | jq -r .dir)/rootfs.img"
cargo build --release -q -p vmsight-fsview --example crawl
REC=$(mktemp)
trap 'rm -f "$REC"' EXIT
field() { printf "%s\n" "$out" | sed -n "s/^$1/\\1/p" | head -n1; }  # field SED-PATTERN: \1 of it
rep=0
for run in cold warm warm; do
    if [ "$run" = cold ]; then dd if="$IMG" iflag=nocache count=0 status=none; sync; echo 1 > /proc/sys/vm/drop_caches; fi
    echo "== $run"
    out=$(target/release/examples/crawl "$IMG"); printf "%s\n" "$out" | sed -n 1,8p
    printf '{"config": "%s", "rep": %d, "crawl_s": %s, "inodes": %s, "index_bytes": %s, "index_bytes_per_inode": %s, "serialised_bytes": %s, "serialised_bytes_per_inode": %s}\n' \
        "$run" "$rep" "$(field 'crawl time: *\([0-9.]*\) s.*')" "$(field 'in use: *\([0-9]*\) inodes.*')" \
        "$(field 'index size: *\([0-9]*\) bytes.*')" "$(field 'index size: .*, \([0-9.]*\) bytes per inode.*')" \
        "$(field 'serialised: *\([0-9]*\) bytes.*')" "$(field 'serialised: .*, \([0-9.]*\) bytes per inode.*')" \
        | sed 's/: ,/: null,/g; s/: }/: null}/' >> "$REC"
    if [ "$run" = warm ]; then rep=$((rep + 1)); fi
done
python3 bench/lib/results.py --bench fsview-crawl ${OUT:+--out "$OUT"} --baseline cold --date "$START" \
    --load-before "$LOAD0" --elapsed $((SECONDS - T0)) --param "image=$IMG" --from-stdin -- "${ARGV[@]}" < "$REC"
