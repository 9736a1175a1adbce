#!/usr/bin/env bash
# The end of `make test`: how many guest runs the test harness ran a second time, and why
# (tests/src/lib.rs, `rerun_reason`: a guest vCPU timer stuck in service before the guest was
# ready, QEMU 10's TCG section race). One is tolerated, more fail the suite: a platform fault
# seen twice in one run is no longer rare, and a rerun must never hide a real failure.
#
#   scripts/test-reruns.sh DIR      (DIR: the harness's record directory, one file per rerun)
set -euo pipefail
dir=${1:?usage: test-reruns.sh DIR}
shopt -s nullglob
files=("$dir"/*.txt)
n=${#files[@]}
echo "vmsight-tests: reruns: $n (records in $dir)"
for f in "${files[@]}"; do
    echo "  $(sed -n 's/^command: //p' "$f" | head -1)"
    echo "    $(sed -n 's/^reason: //p' "$f" | head -1)"
done
if [ "$n" -gt 1 ]; then
    echo "vmsight-tests: more than one rerun in one run of the suite: failing" >&2
    exit 1
fi
