#!/bin/bash
# Boots the default image (root disk /tmp/pv/root.img from prepare-rootfs.sh, snapshot mode) running
# "GUEST CMD" via /t.sh; with plugin args, under the dump tool (extra dump args follow).
# usage: run.sh "PLUGIN_ARGS|none" "GUEST CMD" [dump args...]   (env: IMG, T, QEXTRA)
IMG=${IMG:-$(ls -d /root/.cache/vmsight/images/*/ | head -1)}
T=${T:-/work/target-plugin}
PARGS=$1; CMD=$2; shift 2
Q=(qemu-system-x86_64 -machine q35,vmport=off,hpet=off -accel tcg,thread=multi,tb-size=256 -cpu max -smp 2 -m 1024M
   -nodefaults -no-user-config -display none -no-reboot -serial stdio
   -kernel $IMG/vmlinuz -initrd $IMG/initrd.img
   -drive file=/tmp/pv/root.img,if=virtio,format=raw,snapshot=on
   $QEXTRA -append "console=ttyS0 root=/dev/vda rw nokaslr panic=-1 quiet init=/t.sh vmcmd=$CMD")
if [ "$PARGS" = none ]; then exec "${Q[@]}"; fi
SHM=/dev/shm/pv$$.shm
exec $T/release/examples/dump $SHM --vcpus 2 "$@" -- "${Q[@]}" -plugin $T/release/libvmsight_plugin.so,shm=$SHM,$PARGS
