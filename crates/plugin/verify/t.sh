#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs tmp /tmp
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
CMD=$(sed 's/.*vmcmd=//' /proc/cmdline)
echo "T: start: $CMD"
sh -c "$CMD"
echo "T: done rc=$?"
echo o > /proc/sysrq-trigger; sleep 5
poweroff -f
