#!/usr/bin/env bash
# Crawl speed and index size of the ext4 crawler (issue 5) on the default guest root disk,
# cold (page cache of the image dropped) and warm. The reference is Gamma-Ray's published
# numbers (323 B/file raw, ~20 s per 6 GB), which cannot be re-run here.
set -euo pipefail
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}
IMG="$("$VMSIGHT" image info --json | jq -r .dir)/rootfs.img"
cargo build --release -q -p vmsight-fsview --example crawl
for run in cold warm warm; do
    if [ "$run" = cold ]; then dd if="$IMG" iflag=nocache count=0 status=none; sync; echo 1 > /proc/sys/vm/drop_caches; fi
    echo "== $run"
    out=$(target/release/examples/crawl "$IMG"); printf "%s\n" "$out" | sed -n 1,8p
done
