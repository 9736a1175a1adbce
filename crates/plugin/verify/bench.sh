#!/bin/bash
# Per-syscall cost of a guest getppid loop without the plugin and with it (records=off/on/peek).
# Interleaved rounds: each round boots once per configuration; prints min/median per config.
# usage: K=vmlinuz INITRD=initrd.gz T=$CARGO_TARGET_DIR [ROUNDS=6] bench.sh
set -u
K=${K:?path of the guest kernel}
INITRD=${INITRD:?initramfs from make-initramfs.sh}
T=${T:-${CARGO_TARGET_DIR:-target}}
P=$T/release/libvmsight_plugin.so
D=$T/release/examples/dump
WORK=$(mktemp -d)
Q=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 512M -machine q35 -nodefaults
   -display none -no-reboot -serial stdio -kernel $K -initrd $INITRD
   -append 'console=ttyS0 panic=-1 rdinit=/init quiet')
ROUNDS=${ROUNDS:-6}
CFGS=${CFGS:-"none records=off records=on records=on,peek=on"}
rm -f $WORK/res.txt
for r in $(seq $ROUNDS); do
  for cfg in $CFGS; do
    if [ "$cfg" = none ]; then out=$("${Q[@]}" 2>&1)
    else out=$($D $WORK/b.shm --vcpus 2 -- "${Q[@]}" -plugin $P,shm=$WORK/b.shm,$cfg 2>&1); fi
    for v in $(echo "$out" | grep -o 'per_syscall=[0-9.]*' | cut -d= -f2); do echo "$cfg $v" >> $WORK/res.txt; done
  done
done
python3 - "$WORK/res.txt" <<'PY'
import statistics, collections, sys
d = collections.OrderedDict()
for l in open(sys.argv[1]):
    k, v = l.split(); d.setdefault(k, []).append(float(v))
base = None
for k, vals in d.items():
    mn, md = min(vals), statistics.median(vals)
    if base is None: base = (mn, md)
    print(f"{k:20s} n={len(vals):2d} min={mn:.3f} median={md:.3f} us/syscall  overhead vs none: min {mn-base[0]:+.3f} median {md-base[1]:+.3f}")
PY
rm -rf "$WORK"
