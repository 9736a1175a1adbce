#!/usr/bin/env bash
# Boots short guests two at a time, again and again, and keeps the vmsight log of every run
# that failed, took long, or reported a stalled vCPU timer. It is how the rare TCG timer stall
# of docs/launcher.md ("Limits") was caught: about one run in a few hundred stalls.
#
#   scripts/boot-loop.sh [--pairs N] [--out DIR] [-- extra vmsight run options]
#   scripts/boot-loop.sh --pairs 300 -- --no-plugin
#
# Stops after N pairs (default 200), or earlier when DIR/STOP exists. Prints one line per kept
# run and a summary at the end. Needs the default guest image (`make image`).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VMSIGHT=${VMSIGHT:-$ROOT/target/release/vmsight}
PAIRS=200
OUT=${TMPDIR:-/tmp}/vmsight-boot-loop
while [ $# -gt 0 ]; do
    case "$1" in
        --pairs) PAIRS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "boot-loop: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -x "$VMSIGHT" ] || { echo "boot-loop: $VMSIGHT is missing; run make build" >&2; exit 2; }
mkdir -p "$OUT"
rm -f "$OUT/STOP"
touch "$OUT/.started"   # runs kept from now on are newer than this

# One guest; keeps its log if it failed, ran over 90 s, or saw the stall.
one() {
    local tag=$1 pair=$2; shift 2
    local t0 rc=0 took
    t0=$(date +%s)
    timeout 400 "$VMSIGHT" run --name "bl-$$-$tag" --boot-timeout 200 "$@" \
        -- sh -c 'sync; sleep 2; echo ok' >"$OUT/$tag.out" 2>"$OUT/$tag.err" || rc=$?
    took=$(( $(date +%s) - t0 ))
    if [ "$rc" -ne 0 ] || [ "$took" -gt 90 ] || grep -q "did not fire" "$OUT/$tag.err"; then
        cp "$OUT/$tag.err" "$OUT/kept-$pair-$tag.err"
        echo "pair $pair $tag: exit $rc after ${took}s -> $OUT/kept-$pair-$tag.err"
    fi
}

pair=0
while [ "$pair" -lt "$PAIRS" ] && [ ! -e "$OUT/STOP" ]; do
    pair=$((pair + 1))
    one a "$pair" "$@" &
    one b "$pair" "$@" &
    wait
done
kept_now() { find "$OUT" -name 'kept-*.err' -newer "$OUT/.started"; }
kept=$(kept_now | wc -l)
stalls=$(kept_now | xargs -r grep -l "did not fire" | wc -l)
echo "boot-loop: $pair pairs ($((pair * 2)) boots), $kept kept runs, $stalls with a timer stall"
