#!/bin/bash
# Builds the verification initramfs: busybox-static /init that runs /getppid twice, then powers off.
# usage: make-initramfs.sh OUT_DIR   (writes OUT_DIR/initrd.gz)
set -euo pipefail
out=${1:?usage: make-initramfs.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,proc,dev,sys} "$out"
gcc -O2 -static -o "$root/getppid" "$here/getppid.c"
cp /bin/busybox "$root/bin/busybox"
cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev 2>/dev/null
echo "INIT: start"
/getppid 1000000
/getppid 1000000
echo "INIT: done"
/bin/busybox poweroff -f
INIT
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1) > "$out/initrd.gz"
echo "$out/initrd.gz"
