#!/bin/bash
# Makes a scratch copy of the default guest image's root disk with /t.sh (runs the command given
# after vmcmd= on the kernel command line, then powers off) and /tree.sh (a small fork/exec tree).
# usage: prepare-rootfs.sh [WORKDIR=/tmp/pv]
set -euo pipefail
W=${1:-/tmp/pv}
here=$(cd "$(dirname "$0")" && pwd)
IMG=${IMG:-$(ls -d /root/.cache/vmsight/images/*/ | head -1)}
mkdir -p "$W"
cp --sparse=always "$IMG/rootfs.img" "$W/root.img"
for f in t.sh tree.sh; do
  debugfs -w -R "write $here/$f /$f" "$W/root.img"
  debugfs -w -R "sif /$f mode 0100755" "$W/root.img"
done
cp "$here/run.sh" "$here/bench.sh" "$W/"
echo "$W/root.img ready; cd $W && ./run.sh ..."
