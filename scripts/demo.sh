#!/usr/bin/env bash
# The `make run` demo: boot the default Debian guest under vmsight, run a short workload in it,
# and show what vmsight saw (boot time, per-vCPU syscall counts from the plugin, disk counters).
set -euo pipefail
cd "$(dirname "$0")/.."
VMSIGHT=${VMSIGHT:-target/release/vmsight}

echo "== vmsight image info"
"$VMSIGHT" image info
echo
echo "== vmsight run --stats --count-syscalls -- <demo workload>   (QEMU 11.1 by default, TCG, vhost-user-blk root disk, plugin)"
"$VMSIGHT" run --name demo --vcpus 2 --mem 1G --stats --count-syscalls -- bash -c '
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

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
wait_vm() { # wait until VM $1 answers on its control socket (or its vmsight process ended)
  for _ in $(seq 1 300); do
    "$VMSIGHT" stats "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

echo
echo "== storage insights + iCache: varmail on an extra ext4 disk, classified block by block"
echo "   (live counters read from outside the guest every 2 s: vmsight stats NAME --watch 2,"
echo "    and once from the Prometheus endpoint of --metrics)"
truncate -s 512M "$TMP/data.img" && mkfs.ext4 -q -F "$TMP/data.img"
MPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$VMSIGHT" run --name demo-icache --disk "$TMP/data.img",mount=/mnt/data --metrics 127.0.0.1:$MPORT \
  --insights "$TMP/insights.jsonl" --stage icache:size=16,policy=priority --stats -- sh -c '
  mkdir -p /mnt/data && mount /dev/vdb /mnt/data && varmail -d /mnt/data/mail -o 4000 && sync' > "$TMP/icache.out" 2>&1 &
pid=$!
if wait_vm demo-icache $pid; then
  ( sleep 8
    echo "-- GET http://127.0.0.1:$MPORT/metrics, 8 s in (selected lines)"
    python3 - "$MPORT" <<'PY' || true
import re, sys, urllib.request
try:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
except OSError:
    sys.exit("   (the VM had already stopped)")
pat = re.compile(r'^vmsight_(block_bytes_total\{.*disk="1".*kind="(read|write)"|block_in_flight_requests|icache_(hits|misses)_total|stage_info)')
print("\n".join(l for l in text.splitlines() if pat.match(l)))
PY
  ) &
  mpid=$!
  "$VMSIGHT" stats demo-icache --watch 2 || true
  wait $mpid
fi
wait $pid || true
grep -E "data_chunks|insights:|writes by class|cache:" "$TMP/icache.out" || cat "$TMP/icache.out"
echo "-- vmsight report (per-class totals, metadata per file system, block lifetimes)"
"$VMSIGHT" report "$TMP/insights.jsonl" --fs 1=ext4 --svg "$TMP/lifetimes.svg" | head -40

echo
echo "== file-update streaming: events inferred from the disk's write stream alone (no agent)"
echo "   vmsight watch '*:demo-stream:/srv/**' prints them live"
truncate -s 256M "$TMP/srv.img" && mkfs.ext4 -q -F "$TMP/srv.img"
"$VMSIGHT" run --name demo-stream --disk "$TMP/srv.img",mount=/srv -- sh -c '
  mkdir -p /srv && mount /dev/vdb /srv && sleep 3
  mkdir -p /srv/www/img && echo "<h1>hello</h1>" > /srv/www/index.html && sync
  mv /srv/www/index.html /srv/www/home.html && chmod 640 /srv/www/home.html && sync
  ln -s home.html /srv/www/index.html && seq 1 1000 > /srv/www/log && sync
  rm -r /srv/www/img && sync && sleep 1' > "$TMP/stream.out" 2>&1 &
pid=$!
"$VMSIGHT" watch --vm demo-stream '/srv/**' &
wpid=$!
wait $pid || true
sleep 1; kill $wpid 2>/dev/null || true; wait $wpid 2>/dev/null || true

echo
echo "== iDedup: a copy deduplicated live on a dedup volume, hinted by the insight engine"
echo "   (vmsight stats --watch 1 shows the dedup stage from outside while the guest runs cp;
   a line when the counters change)"
mkdir -p "$TMP/dd-src" && head -c 16M /dev/urandom > "$TMP/dd-src/data"
truncate -s 256M "$TMP/dd.img" && mkfs.ext4 -q -F -b 4096 -d "$TMP/dd-src" "$TMP/dd.img"
"$VMSIGHT" dedup create "$TMP/vol" --size 256MiB --from "$TMP/dd.img"
"$VMSIGHT" dedup info "$TMP/vol" | grep -E "physical use|dedup ratio"
"$VMSIGHT" run --name demo-dedup --disk "$TMP/vol",dedup --insights "$TMP/dd-ins.jsonl" -- sh -c '
  mount /dev/vdb /mnt && sleep 2 && cp /mnt/data /mnt/copy && sync && sleep 2
  sha256sum /mnt/data /mnt/copy | cut -c1-16,65-; umount /mnt' > "$TMP/dedup.out" 2>&1 &
pid=$!
if wait_vm demo-dedup $pid; then
  "$VMSIGHT" stats demo-dedup --watch 1 2>/dev/null | grep --line-buffered "dedup:" | sed -u 's/^ *//' | uniq || true
fi
wait $pid || true
grep "/mnt/" "$TMP/dedup.out" || cat "$TMP/dedup.out"
echo "-- after the copy: 16 MiB more logical data, (almost) no more physical chunks"
"$VMSIGHT" dedup info "$TMP/vol" | grep -E "mapped|physical use|dedup ratio|space saved"
"$VMSIGHT" dedup check "$TMP/vol" | tail -1

echo
echo "== FoxyIdle: a background reader's disk reads held while a foreground reader uses the"
echo "   (HDD-modelled) disk; who submitted each request is seen by the plugin at bio submission"
mkdir -p "$TMP/fi-src" && head -c 24M /dev/urandom > "$TMP/fi-src/fg" && head -c 24M /dev/urandom > "$TMP/fi-src/bg"
truncate -s 128M "$TMP/fi.img" && mkfs.ext4 -q -F -d "$TMP/fi-src" "$TMP/fi.img"
"$VMSIGHT" run --name demo-idle --disk "$TMP/fi.img" --stage disk-model:hdd --background indexer --stats -- sh -c '
  mount /dev/vdb /mnt && cp /bin/cat /tmp/indexer && echo 3 > /proc/sys/vm/drop_caches
  ( /tmp/indexer /mnt/bg > /dev/null; echo "background indexer done" ) &
  cat /mnt/fg > /dev/null; echo "foreground cat done"; wait' 2>&1 | grep -E "done|idle \(" | sed 's/^ *//'

echo
echo "== vmsight's NIC and FoxyVegas: the guest sends to a receiver behind a 2000 KB/s bottleneck"
echo "   with a 6000 KB queue; FoxyVegas lowers the window of the ACKs the guest gets to a TCP Vegas"
echo "   window measured at the device, so the queue (and the RTT) stays short"
RCV="vmsight-demo-rcv"
if [ "$(id -u)" -ne 0 ]; then
  echo "(skipped: the receiver namespace and the bottleneck need root)"
  exit 0
fi
"$VMSIGHT" run --name demo-net --foxyvegas --stats -- sh -c '
  i=0; until ping -c 1 -W 1 10.0.3.2 >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 100 ] || exit 9; done
  iperf3 -c 10.0.3.2 -t 6 -f k > /tmp/ip.txt & p=$!
  sleep 4; ss -tin dst 10.0.3.2 | grep -o "rtt:[0-9.]*" | tail -1 | sed "s/^/guest TCP smoothed /"
  wait $p; grep -E "sender|receiver" /tmp/ip.txt' > "$TMP/net.out" 2>&1 &
pid=$!
for _ in $(seq 1 300); do "$VMSIGHT" net demo-net info >/dev/null 2>&1 && break; sleep 0.1; done
ip netns add "$RCV"
ip link add vdemo0 type veth peer name vdemo1
ip link set vdemo0 netns vmsight-demo-net && ip link set vdemo1 netns "$RCV"
ip -n vmsight-demo-net addr add 10.0.3.1/24 dev vdemo0 && ip -n vmsight-demo-net link set vdemo0 up
ip -n "$RCV" addr add 10.0.3.2/24 dev vdemo1 && ip -n "$RCV" link set vdemo1 up
ip -n "$RCV" route add 10.0.2.0/24 via 10.0.3.1
ip netns exec vmsight-demo-net sysctl -qw net.ipv4.ip_forward=1
tc -n vmsight-demo-net qdisc add dev vdemo0 root tbf rate 16mbit burst 32kb limit 6000kb
ip netns exec "$RCV" iperf3 -s -1 -B 10.0.3.2 >/dev/null 2>&1 &
wait $pid || true
ip netns del "$RCV" 2>/dev/null || true
grep -E "rtt:|sender|receiver|foxyvegas:|net0" "$TMP/net.out" | sed 's/^ *//'

echo
echo "== Hylics: a host in-memory file system shared with the guest at /hylics; the guest asks vmsight"
echo "   over vsock to send one of its files to a client, and the host sends it for the guest (sendfile)"
"$VMSIGHT" run --name demo-hylics --shared-mem 64M --stats -- sh -c '
  head -c 32M /dev/urandom > /hylics/video.bin
  echo "guest: sha256 of /hylics/video.bin $(sha256sum /hylics/video.bin | cut -c1-16)"
  tx0=$(cat /sys/class/net/eth0/statistics/tx_bytes)
  i=0; until n=$(hylics-send 10.0.2.1:9000 /hylics/video.bin 2>/dev/null); do
    i=$((i+1)); [ $i -lt 100 ] || exit 9; sleep 0.2; done
  tx=$(( $(cat /sys/class/net/eth0/statistics/tx_bytes) - tx0 ))
  echo "guest: hylics-send: the host sent $n bytes for me; my NIC sent $tx bytes meanwhile"' \
  > "$TMP/hy.out" 2>&1 &
pid=$!
for _ in $(seq 1 300); do "$VMSIGHT" net demo-hylics info >/dev/null 2>&1 && break; sleep 0.1; done
"$VMSIGHT" net demo-hylics exec python3 -c '
import hashlib, socket
s = socket.create_server(("10.0.2.1", 9000)); c, _ = s.accept(); h = hashlib.sha256(); n = 0
while (b := c.recv(1 << 20)):
    h.update(b); n += len(b)
print(f"client: received {n} bytes, sha256 {h.hexdigest()[:16]}")' &
rcv=$!
wait $pid || true
wait $rcv || true
grep -E "^guest:|^ *share |send offload" "$TMP/hy.out" | sed 's/^ *//'

echo
echo "== QEMU 11.1 (trixie root, plugin API 7): a vCPU taken at a guest syscall runs a guest function"
echo "   and comes back with every register restored (redirect-probe checks them itself)"
"$VMSIGHT" run --qemu trixie --name demo-q11 --trace @cmd --trace-out /dev/null -- redirect-probe \
  > "$TMP/rp.out" 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q " pid=" "$TMP/rp.out" && break; sleep 0.1; done
line=$(grep -m1 " pid=" "$TMP/rp.out")
field() { echo "$line" | sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }
"$VMSIGHT" cpu demo-q11 redirect --pid "$(field pid)" --entry "$(field fn)" --return "$(field ret)" \
  --arg 1 --arg 2 --arg 3 --arg 4 --arg 5 --arg 6 || true
wait $pid || true
grep "calls=" "$TMP/rp.out"

echo
echo "== Symbiotic interface (QEMU 11.1, --symbiotic): the guest module vmsight_sym shares a page"
echo "   (SymSpy, read live without exits) and answers symcalls, over the doorbell and, by vCPU"
echo "   redirection, the synchronous transport"
"$VMSIGHT" run --qemu trixie --symbiotic --name demo-sym -- sh -c \
  'cd /tmp; getppid_loop 2000000000 & sleep 120' > "$TMP/sym.out" 2>&1 &
pid=$!
for _ in $(seq 1 600); do # the module is up and the guest's loop runs on a vCPU
  "$VMSIGHT" sym demo-sym spy 2>/dev/null | grep -q "comm getppid_loop" && break; sleep 0.1
done
"$VMSIGHT" sym demo-sym spy | grep -E "^(interface|kernel|memory|cpu)"
gp=$("$VMSIGHT" sym demo-sym spy --json | python3 -c '
import json, sys
print(next(c["tgid"] for c in json.load(sys.stdin)["guest"]["cpus"] if c["comm"] == "getppid_loop"))' \
  2>/dev/null || echo 1)
"$VMSIGHT" sym demo-sym call task_info "$gp" --transport sync
"$VMSIGHT" sym demo-sym call echo 1 --repeat 1000 --transport sync
"$VMSIGHT" sym demo-sym call echo 1 --repeat 200 --transport doorbell
kill $pid 2>/dev/null; wait $pid 2>/dev/null || true

echo
echo "== SwapBypass (--swap, docs/swapbypass.md): a 128 MB guest runs STREAM over 160 MiB. With its"
echo "   swap on a disk behind an HDD model it thrashes; with the symbiotic module it swaps through"
echo "   vmsight's shared cache without block I/O, and vmsight adds memory (virtio-mem) while it thrashes"
"$VMSIGHT" run --name demo-swap --mem 128M --swap 256M,cache=0 --disk-model hdd -- sh -c \
  'timeout 15 stream 160 --iters 2 >/dev/null || echo "guest: swapping to the modelled HDD, STREAM is not done after 15 s"'
"$VMSIGHT" run --name demo-swap --mem 128M --symbiotic --swap 256M,grow=256M --stats -- sh -c \
  'stream 160 --iters 2 | sed "s/^/guest: /"; echo "guest: $(grep -E "^pswp(in|out) " /proc/vmstat | tr "\n" " ")"' \
  2>&1 | grep -E "^guest:|^  swap " | sed 's/^  //'
