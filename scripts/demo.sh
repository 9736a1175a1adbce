#!/usr/bin/env bash
# The `make run` demo: boot the default Debian guest under vmsight, run a short workload in it,
# and show what vmsight saw (boot time, per-vCPU syscall counts from the plugin, disk counters).
set -euo pipefail
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}

echo "== vmsight image info"
"$VMSIGHT" image info
echo
echo "== vmsight run --stats -- <demo workload>   (QEMU 10, TCG, vhost-user-blk root disk, plugin)"
"$VMSIGHT" run --name demo --vcpus 2 --mem 1G --stats -- bash -c '
  echo "guest: $(uname -sr), $(nproc) vCPUs, $(free -m | awk "/Mem:/ {print \$2}") MiB RAM"
  echo "root fs: $(findmnt -n -o SOURCE,FSTYPE /)"
  mkdir -p /root/demo && cd /root/demo
  dd if=/dev/urandom of=blob bs=1M count=16 status=none
  sha256sum blob | cut -c1-16
  tar czf usr-share-doc.tgz /usr/share/doc 2>/dev/null && ls -l usr-share-doc.tgz | awk "{print \"tar of /usr/share/doc:\", \$5, \"bytes\"}"
  find / -xdev -type f | wc -l | xargs echo "files on the root fs:"
  getppid_loop 100000 && echo "ran 100000 getppid syscalls"
  sync
'

echo
echo "== vmsight run --trace: the command's syscalls, seen from outside the guest (no agent, no ptrace)"
"$VMSIGHT" run --name demo-trace --trace --trace-filter execve,openat,read,write,close,exit_group -- \
  sh -c 'head -c 64 /etc/os-release | tr a-z A-Z' 2>&1 | grep -v '^vmsight:' | tail -25
