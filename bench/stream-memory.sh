#!/usr/bin/env bash
# vmsight's own (private) memory during a write-heavy run, with file-update streaming on and,
# as the baseline in the same run, with --no-stream. Workload on an extra 1 GiB ext4 disk:
# 300 MiB of random data with dd, then an untar of the guest's /usr/share (~13 000 files).
# Peak RssAnon of the vmsight process, sampled every 0.1 s; medians of --reps runs, interleaved.
#   bench/stream-memory.sh [--reps N] [--out PATH]
# Every run's peak goes to bench/results/stream-memory.json (--out).
set -euo pipefail
ARGV=("$0" "$@")
START=$(date -u +%Y-%m-%dT%H:%M:%SZ) LOAD0=$(cut -d' ' -f1-3 /proc/loadavg) T0=$SECONDS
REPS=3
OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --reps) REPS=$2; shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    -h|--help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "stream-memory.sh: unknown option $1 (--reps N, --out PATH)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
WORK='mount /dev/vdb /mnt && dd if=/dev/urandom of=/mnt/f bs=1M count=300 2>/dev/null && sync && tar -C /usr -cf - share | tar -C /mnt -xf - && sync'

peak_anon() { # $@: extra vmsight options; prints peak RssAnon KiB
  rm -f "$TMP/d.img"; truncate -s 1G "$TMP/d.img"; mkfs.ext4 -q -F "$TMP/d.img"
  "$VMSIGHT" run --name bench-mem "$@" --disk "$TMP/d.img" -- sh -c "$WORK" >"$TMP/out" 2>&1 &
  local pid=$! peak=0 a
  while kill -0 "$pid" 2>/dev/null; do
    a=$(awk '/^RssAnon:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ -n "$a" ] && [ "$a" -gt "$peak" ] && peak=$a
    sleep 0.1
  done
  wait "$pid" || { cat "$TMP/out" >&2; return 1; }
  echo "$peak"
}

median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

: >"$TMP/on"; : >"$TMP/off"; : >"$TMP/reps"
for r in $(seq 1 "$REPS"); do
  on=$(peak_anon); off=$(peak_anon --no-stream)
  echo "[rep $r] streaming on: $on KiB, --no-stream: $off KiB" >&2
  echo "$on" >>"$TMP/on"; echo "$off" >>"$TMP/off"
  printf '{"config": "stream", "rep": %d, "peak_anon_kib": %s}\n{"config": "no-stream", "rep": %d, "peak_anon_kib": %s}\n' \
    $((r - 1)) "$on" $((r - 1)) "$off" >>"$TMP/reps"
done
on=$(median <"$TMP/on"); off=$(median <"$TMP/off")
{
echo "| configuration | peak private memory (MiB) |"
echo "|---|---|"
awk -v a="$on" -v b="$off" 'BEGIN {
  printf "| streaming on | %.1f |\n| --no-stream (baseline) | %.1f |\n| streaming on / baseline | %.2fx |\n", a/1024, b/1024, a/b }'
} | tee "$TMP/table"
cat "$TMP/reps" "$TMP/table" | python3 bench/lib/results.py --bench stream-memory ${OUT:+--out "$OUT"} \
  --baseline no-stream --date "$START" --load-before "$LOAD0" --elapsed $((SECONDS - T0)) --param "reps=$REPS" \
  --from-stdin -- "${ARGV[@]}"
