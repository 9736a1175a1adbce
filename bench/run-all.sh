#!/usr/bin/env bash
# Runs the benchmarks listed in bench/benches.tsv, one after another, each with the options of
# the docs/benchmarks.md table it reproduces; each writes bench/results/NAME.json. A benchmark
# that fails (or writes no results file) does not stop the others; the end lists the failed
# ones and the exit status is 1 if there was one. `make bench` runs this, then bench/report.py.
#
#   bench/run-all.sh              every benchmark, in the file's order
#   bench/run-all.sh NAME...      only these (make bench BENCH=NAME)
#   bench/run-all.sh list         the names and commands (make bench BENCH=list)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
TABLE=bench/benches.tsv

names=() cmds=()
while IFS=$'\t' read -r name cmd; do
    case $name in ''|'#'*) continue ;; esac
    names+=("$name") cmds+=("$cmd")
done < "$TABLE"

case ${1:-} in
    -h|--help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
    list)
        for i in "${!names[@]}"; do printf '%-22s %s\n' "${names[$i]}" "${cmds[$i]}"; done
        exit 0 ;;
esac

# The indexes of the benchmarks to run.
todo=()
if [ $# -eq 0 ]; then
    todo=("${!names[@]}")
else
    for want in "$@"; do
        found=
        for i in "${!names[@]}"; do [ "${names[$i]}" = "$want" ] && found=$i; done
        if [ -z "$found" ]; then
            echo "run-all.sh: no benchmark named '$want' in $TABLE; known: ${names[*]}" >&2
            exit 2
        fi
        todo+=("$found")
    done
fi

failed=() n=0
for i in "${todo[@]}"; do
    n=$((n + 1))
    name=${names[$i]} cmd=${cmds[$i]} out=bench/results/${names[$i]}.json
    start=$(date +%s)
    echo "=== [$n/${#todo[@]}] $name: $cmd ($(date -u +%H:%M:%SZ), load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    bash -c "$cmd"
    rc=$?
    took=$(( $(date +%s) - start ))
    if [ $rc -ne 0 ]; then
        echo "=== $name: FAILED (exit status $rc) after ${took} s" >&2
        failed+=("$name (exit status $rc)")
    elif [ ! -f "$out" ] || [ "$(stat -c %Y "$out")" -lt "$start" ]; then
        echo "=== $name: FAILED: it wrote no $out" >&2
        failed+=("$name (no $out)")
    else
        echo "=== $name: ok in ${took} s, $out" >&2
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "run-all.sh: ${#failed[@]} of ${#todo[@]} benchmarks failed:" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "run-all.sh: all ${#todo[@]} benchmarks ran; results in bench/results/" >&2
