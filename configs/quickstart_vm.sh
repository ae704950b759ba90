#!/usr/bin/env bash
# Boots a VM from a fresh qcow2 overlay over a golden image, end to end: the overlay is
# made with qemu-img, served by spdk_tgt with bdev_qcow2 preloaded (configs/vhost_blk_qcow2.json,
# its two image paths replaced by these) as vhost-user-blk controller vhost.0, and
# qemu-system-x86_64 boots from it. When the guest powers off (or --timeout passes), the
# target is stopped cleanly (every image flushed and closed) and the overlay checked with
# `qemu-img check`. The overlay stays in DIR.
#
#   configs/quickstart_vm.sh --base GOLDEN.qcow2 [--dir DIR] [--mem MIB] [--timeout SECS]
#       [--accel kvm|tcg] [--kernel VMLINUZ --initrd INITRD [--append ARGS]]
#
# Without --kernel the guest boots from the disk (a cloud image, say; its console is the
# serial port on stdout); with it, QEMU boots that kernel and initrd directly
# (console=ttyS0 and ARGS on its command line) with the overlay as /dev/vda. The golden
# image is opened read-only, but padded to whole 512-byte blocks first (an AIO bdev needs
# them; zeros past the end of a qcow2 file change nothing).
#
# Needs: spdk_tgt and spdk-rpc (or rpc.py; SPDK_RPC=path) on PATH, qemu-img,
# qemu-system-x86_64, and target/release/libbdev_qcow2.so built where SPDK is installed
# (BDEV_QCOW2_SO=path overrides). Hugepages when at least 1 GiB is free, else spdk_tgt
# runs with --no-huge. Exit status: QEMU's (124 on timeout), else 1 if the overlay is not
# clean.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
base= dir= kernel= initrd= append= mem=512 secs=600 accel=
while [ $# -gt 0 ]; do
  case "$1" in
  --base) base=$2; shift 2 ;;
  --dir) dir=$2; shift 2 ;;
  --kernel) kernel=$2; shift 2 ;;
  --initrd) initrd=$2; shift 2 ;;
  --append) append=$2; shift 2 ;;
  --mem) mem=$2; shift 2 ;;
  --timeout) secs=$2; shift 2 ;;
  --accel) accel=$2; shift 2 ;;
  -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
  *) echo "quickstart_vm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "quickstart_vm.sh: $*" >&2; exit 1; }
[ -n "$base" ] || die "--base GOLDEN.qcow2 is required"
[ -f "$base" ] || die "$base: no such file"
[ -z "$kernel" ] || [ -n "$initrd" ] || die "--kernel needs --initrd"
so=${BDEV_QCOW2_SO:-$repo/target/release/libbdev_qcow2.so}
[ -f "$so" ] || die "$so not built (cargo build --release -p bdev_qcow2, where SPDK is installed)"
rpc=${SPDK_RPC:-$(command -v spdk-rpc || command -v rpc.py || true)}
[ -n "$rpc" ] || die "spdk-rpc (or rpc.py) not on PATH; set SPDK_RPC"
for bin in spdk_tgt qemu-img qemu-system-x86_64; do
  command -v "$bin" >/dev/null || die "$bin not on PATH"
done
if [ -z "$accel" ]; then
  accel=tcg
  [ -w /dev/kvm ] && accel=kvm
fi

dir=${dir:-$(mktemp -d /var/tmp/quickstart.XXXXXX)}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
base=$(cd "$(dirname "$base")" && pwd)/$(basename "$base")
overlay=$dir/vm0.qcow2

# The overlay: qcow2 over the golden image, with (sparse) room to hold every cluster,
# since an AIO bdev does not grow its file.
truncate -s %512 "$base"
qemu-img create -q -f qcow2 -F qcow2 -b "$base" "$overlay"
vsize=$(qemu-img info "$overlay" | sed -n 's/^virtual size: .*(\([0-9]*\) bytes).*/\1/p')
[ -n "$vsize" ] || die "cannot read the virtual size of $overlay"
truncate -s $(((vsize + vsize / 64 + (16 << 20)) / 512 * 512)) "$overlay"

sed -e "s|/var/tmp/golden.qcow2|$base|" -e "s|/var/tmp/vm0.qcow2|$overlay|" \
  "$repo/configs/vhost_blk_qcow2.json" >"$dir/vhost.json"

free_mib=$(awk '/^HugePages_Free:/ {f=$2} /^Hugepagesize:/ {s=$2} END {print int(f*s/1024)}' /proc/meminfo)
if [ "$free_mib" -ge 1024 ]; then mem_args=(-s 512); else mem_args=(--no-huge -s 1024); fi

LD_PRELOAD=$so spdk_tgt -m 0x1 "${mem_args[@]}" --json "$dir/vhost.json" -S "$dir" \
  -r "$dir/spdk.sock" >"$dir/spdk_tgt.log" 2>&1 &
tgt=$!
stop_target() {
  kill -INT "$tgt" 2>/dev/null || return 0
  for _ in $(seq 600); do kill -0 "$tgt" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$tgt" 2>/dev/null && { kill -KILL "$tgt"; die "spdk_tgt did not stop within 60 s"; }
  wait "$tgt" || die "spdk_tgt exited with status $? (see $dir/spdk_tgt.log)"
}
trap 'kill -KILL $tgt 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  kill -0 "$tgt" 2>/dev/null || die "spdk_tgt exited while starting: $(tail -20 "$dir/spdk_tgt.log")"
  if [ -S "$dir/vhost.0" ] && "$rpc" -s "$dir/spdk.sock" -t 5 framework_wait_init >/dev/null 2>&1; then
    break
  fi
  sleep 0.2
done
[ -S "$dir/vhost.0" ] || die "no vhost socket after 60 s (see $dir/spdk_tgt.log)"
echo "quickstart: spdk_tgt serves $overlay (backing $base) on $dir/vhost.0" >&2

qemu=(qemu-system-x86_64 -accel "$accel" -m "${mem}M" -smp 1
  -object "memory-backend-file,id=mem,size=${mem}M,mem-path=/dev/shm,share=on"
  -numa node,memdev=mem
  -chardev "socket,id=vu0,path=$dir/vhost.0"
  -device vhost-user-blk-pci,chardev=vu0,bootindex=1
  -nographic -nodefaults -serial stdio -no-reboot)
[ "$accel" = kvm ] && qemu+=(-cpu host)
[ -n "$kernel" ] && qemu+=(-kernel "$kernel" -initrd "$initrd" -append "console=ttyS0 $append")
status=0
timeout "$secs" "${qemu[@]}" </dev/null || status=$?
stop_target
trap - EXIT
qemu-img check -q "$overlay" || { echo "quickstart: $overlay is not clean" >&2; exit 1; }
echo "quickstart: guest exited with status $status; $overlay is clean" >&2
exit "$status"
