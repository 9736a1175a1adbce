#!/usr/bin/env bash
# What the insights cannot see, measured (issue 17; docs/insights.md "Limits"): the same 4 MiB
# written sequentially in 64 KiB blocks with end_fsync by fio in the guest, through io_uring,
# pwrite64 (psync) and pwritev2 (pvsync2), each into its own file of an extra ext4 disk with
# 4 KiB blocks. Prints, per file, the 4 KiB chunks vmsight's insight log classified as data, of
# the file's blocks (debugfs on the host). The psync and pvsync2 files are the baseline of the
# same run.
#
#   bench/insight_gaps.sh [--out PATH]   (VMSIGHT=path/to/vmsight to use another binary)
#
# Every file's counts go to bench/results/insight_gaps.json (--out).
set -euo pipefail
# shellcheck source=bench/lib/args.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
bench_start insight_gaps.sh 11 "$@"
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
truncate -s 64M "$tmp/d.img"
mkfs.ext4 -q -F -b 4096 "$tmp/d.img"
fio_job() { # name engine
    echo "fio --name=$1 --filename=/mnt/v/$1 --rw=write --bs=64k --size=4m --ioengine=$2 \
--iodepth=4 --end_fsync=1 --output-format=terse > /dev/null"
}
"$VMSIGHT" run --disk "$tmp/d.img" --insights "$tmp/ins.jsonl" --insight-target @cmd -- sh -c \
    "set -e; mkdir -p /mnt/v; mount /dev/vdb /mnt/v
$(fio_job io_uring io_uring); $(fio_job psync psync); $(fio_job pvsync2 pvsync2)
umount /mnt/v" > /dev/null
{
    echo "| file (fio ioengine) | data chunks recognised | blocks of the file |"
    echo "|---|---|---|"
    for f in io_uring psync pvsync2; do
        blocks=$(debugfs -R "blocks /$f" "$tmp/d.img" 2> /dev/null | wc -w)
        data=$(jq -r --arg f "/mnt/v/$f" \
            'select(.op == "write" and .disk == 1 and .content == "data" and .file == $f) | .len' \
            "$tmp/ins.jsonl" | awk '{n += $1 / 4096} END {print n + 0}')
        echo "| $f | $data | $blocks |"
        printf '{"config": "%s", "rep": 0, "data_chunks": %s, "file_blocks": %s}\n' "$f" "$data" "$blocks" \
            >> "$tmp/reps"
    done
} | tee "$tmp/table"
cat "$tmp/reps" "$tmp/table" | python3 bench/lib/results.py --bench insight_gaps ${OUT:+--out "$OUT"} \
    --baseline psync --date "$START" --load-before "$LOAD0" --elapsed $((SECONDS - T0)) \
    --from-stdin -- "${ARGV[@]}"
