#!/usr/bin/env bash
# Records the boot read trace tests/bootstorm_bench.sh replays: a Linux guest (Debian's
# kernel from /boot, a busybox initramfs) mounts an ext4 root disk read-only and reads
# every file on it, the way a boot reads its binaries, libraries and configuration, while
# QEMU logs each read the guest's virtio-blk driver submits (trace event
# virtio_blk_handle_read). The root filesystem is made of this host's own files: /etc,
# /usr/sbin, systemd and the shared libraries of /usr/lib/x86_64-linux-gnu up to ROOT_MB.
# Output: one read per line, "offset,length" in bytes, in submission order.
#
#   tests/bootstorm/record_trace.sh [OUT]   # default tests/bootstorm/boot_trace.csv
#   ROOT_MB=160 tests/bootstorm/record_trace.sh
#   KEEP=1 tests/bootstorm/record_trace.sh     # keep the work directory (disk, QEMU trace log)
#
# Needs qemu-system-x86_64 (TCG is enough), static busybox, cpio, mke2fs, a kernel in
# /boot with its modules.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-tests/bootstorm/boot_trace.csv}
ROOT_MB=${ROOT_MB:-160}
DIR=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$DIR"' EXIT

vmlinuz=$(ls /boot/vmlinuz-* | sort -V | tail -1)
ver=${vmlinuz#/boot/vmlinuz-}
mods=/lib/modules/$ver

# The root filesystem: configuration, sbin, systemd, then libraries until ROOT_MB.
mkdir -p "$DIR/root"
{
  find /etc /usr/sbin /usr/lib/systemd -type f -readable 2>/dev/null
  find /usr/lib/x86_64-linux-gnu -maxdepth 1 -type f -name '*.so*' | sort
} | while read -r f; do
  s=$(stat -c %s "$f")
  total=$(( ${total:-0} + s ))
  [ "$total" -gt $((ROOT_MB << 20)) ] && break
  mkdir -p "$DIR/root$(dirname "$f")"
  cp -p "$f" "$DIR/root$f" 2>/dev/null || true
done
mke2fs -q -t ext4 -d "$DIR/root" "$DIR/root.raw" $((ROOT_MB * 3 / 2 + 32))M

# The initramfs: busybox, virtio and ext4 modules (dependencies first), /init.
mkdir -p "$DIR/initrd/bin" "$DIR/initrd/lib/modules" "$DIR/initrd/proc" "$DIR/initrd/sys" \
  "$DIR/initrd/dev" "$DIR/initrd/mnt"
cp /bin/busybox "$DIR/initrd/bin/busybox"
: >"$DIR/initrd/modules"
for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk \
    crc32c_generic crc16 mbcache jbd2 ext4; do
  p=$(grep -E "(^|/)$m\.ko(\.[a-z]+)?:" "$mods/modules.dep" | cut -d: -f1)
  [ -n "$p" ] || continue # built in
  cp "$mods/$p" "$DIR/initrd/lib/modules/"
  echo "$(basename "$p")" >>"$DIR/initrd/modules"
done
cat >"$DIR/initrd/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod "/lib/modules/$m"; done
for i in $(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done
mount -t ext4 -o ro /dev/vda /mnt
echo "@@ MOUNTED $(find /mnt -type f | wc -l) files"
find /mnt -type f -exec cat {} + >/dev/null
echo "@@ READ $(cat /sys/block/vda/stat)"
umount /mnt
poweroff -f
INIT
chmod +x "$DIR/initrd/init"
(cd "$DIR/initrd" && find . | cpio -o -H newc --quiet >"$DIR/initrd.cpio")

timeout 900 qemu-system-x86_64 -accel tcg -m 512M -nographic -nodefaults -no-reboot \
  -serial stdio -kernel "$vmlinuz" -initrd "$DIR/initrd.cpio" \
  -append "console=ttyS0 quiet panic=-1" \
  -drive "file=$DIR/root.raw,format=raw,if=virtio,readonly=on" \
  -trace "virtio_blk_handle_read,file=$DIR/trace.log" | grep '@@' || true
# virtio_blk_handle_read vdev 0x... req 0x... sector N nsectors M
awk '/virtio_blk_handle_read/ {
  for (i = 1; i <= NF; i++) { if ($i == "sector") s = $(i + 1); if ($i == "nsectors") n = $(i + 1) }
  print s * 512 "," n * 512 }' "$DIR/trace.log" >"$OUT"
echo "$OUT: $(wc -l <"$OUT") reads, $(awk -F, '{b += $2} END {printf "%.1f MiB", b / 1048576}' "$OUT")," \
  "disk $(stat -c %s "$DIR/root.raw") bytes"
