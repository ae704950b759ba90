#!/usr/bin/env bash
# Boot storm (issue #46): N fresh overlays of one golden image boot at once, each replaying
# the same boot read trace, the overlays' shared read cache of the golden image on against
# off (backing_cache_size: 0) in the same run, alternating (on off, off on, ...), medians.
#
# The trace: tests/bootstorm/boot_trace.csv, recorded from a real Linux guest by
# tests/bootstorm/record_trace.sh (a guest reading every file of an ext4 root: 2,066 reads,
# 134 MiB of a 272 MiB disk; offset,length per line).
# The golden image: an ext4 filesystem of this host's libraries (real, compressible data)
# as large as the trace reaches, as raw, as plain qcow2 and as a zstd-compressed qcow2
# (`qemu-img convert -c -o compression_type=zstd`), an aio bdev on a file in /dev/shm under
# bdev_delay (LAT µs reads) with QoS (MBPS MB/s reads): a slow image store whose bandwidth
# limits a boot. A qcow2 golden image is a read-only qcow2 bdev on it. BASE=nvmf: that slow
# base is in a second spdk_tgt (core 1, as a real image store would be) and reaches the
# overlays' spdk_tgt over NVMe-oF/TCP on loopback (bdev_nvme_attach_controller).
# Each overlay: a qcow2 bdev on its own malloc bdev, backing_bdev the golden bdev, exported
# as a namespace of one NVMe-oF/TCP subsystem of spdk_tgt (CORES, default one core).
# The replayer: tests/bootstorm/replay (bootstorm_replay, a compiled NVMe/TCP host: one
# controller and one thread per boot, QD reads in flight per boot) on the other core;
# REPLAY=py: tests/bootstorm/replay.py, the same host in asyncio Python (slower: with it the
# host is the floor).
# Per image and N: wall time of all N boots and that against one boot (x1), the golden
# base's bytes read (bdev_get_iostat of the delay bdev) and that against one boot's, the
# shared cache's memory (bdev_qcow2_get_stats backing_cache.memory_bytes), the replayer's
# CPU seconds.
#
#   tests/bootstorm_bench.sh
#   NS="1 8 32 128" ROUNDS=1 IMAGES="raw zstd" tests/bootstorm_bench.sh
#   LAT=500 MBPS=100 QD=8 tests/bootstorm_bench.sh
#   BASE=nvmf IMAGES="raw zstd" tests/bootstorm_bench.sh    # the golden image over NVMe-oF/TCP
#   MBPS=20 NS="1 32" OFF_MAX=1 IMAGES=raw tests/bootstorm_bench.sh  # a base slow enough that
#                                                           # one boot outlasts the floor below
#   LAT=0 MBPS=0 IMAGES=raw tests/bootstorm_bench.sh        # no slow base: the replayer's and
#                                                           # the target's own floor
#   PERF=/tmp/p LAT=0 MBPS=0 NS=32 ROUNDS=1 IMAGES=raw tests/bootstorm_bench.sh
#                                                           # perf record the target's storm
#
# Each spdk_tgt run takes /tmp/spdk-run.lock (LOCK) for its life only. Needs an installed
# SPDK (spdk_tgt, pkg-config spdk_bdev), qemu-img and mke2fs (SKIPPED without them). Builds
# the module in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

for b in spdk_tgt qemu-img mke2fs; do
  if ! command -v "$b" >/dev/null && [ ! -x "/sbin/$b" ]; then
    echo "SKIPPED: $b not found"
    exit 0
  fi
done
if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi

TRACE=${TRACE:-tests/bootstorm/boot_trace.csv}
DIR=$(mktemp -d -p /dev/shm)
trap 'rm -rf "$DIR"' EXIT

cargo build --release -q -p bdev_qcow2 -p bootstorm_replay
SO=$PWD/target/release/libbdev_qcow2.so
REPLAYER=$PWD/target/release/bootstorm_replay
[ "${REPLAY:-rust}" = py ] && REPLAYER=

# The golden image: the trace's disk size (its last byte read, whole MiB), an ext4
# filesystem of shared libraries filling most of it.
mib=$(awk -F, '{e = $1 + $2; if (e > m) m = e} END {printf "%d", (m + 1048575) / 1048576}' "$TRACE")
mkdir -p "$DIR/root"
find /usr/lib/x86_64-linux-gnu -maxdepth 1 -type f -name '*.so*' -size -8M -printf '%s %p\n' | sort -k2 |
  awk -v max=$(((mib * 7 / 10) << 20)) '{t += $1; if (t > max) exit; print $2}' |
  xargs -r cp -t "$DIR/root"
mke2fs -q -t ext4 -d "$DIR/root" "$DIR/golden.raw" "${mib}M"
rm -rf "$DIR/root"
images=
for f in ${IMAGES:-raw qcow2 zstd}; do
  case $f in
  raw) ;;
  qcow2) qemu-img convert -q -f raw -O qcow2 "$DIR/golden.raw" "$DIR/golden.qcow2" ;;
  zstd) qemu-img convert -q -c -f raw -O qcow2 -o compression_type=zstd "$DIR/golden.raw" "$DIR/golden-zstd.qcow2" ;;
  esac
  case $f in
  raw) images+="${images:+,}raw:$DIR/golden.raw" ;;
  qcow2) images+="${images:+,}qcow2:$DIR/golden.qcow2" ;;
  zstd) images+="${images:+,}zstd:$DIR/golden-zstd.qcow2" ;;
  esac
done

echo "== boot storm: $(wc -l <"$TRACE") reads of $(awk -F, '{b += $2} END {printf "%.0f", b / 1048576}' "$TRACE") MiB per boot (${TRACE##*/}), golden image ${mib} MiB" \
  "(qcow2 $(du -m "$DIR/golden.qcow2" 2>/dev/null | cut -f1) MiB, zstd $(du -m "$DIR/golden-zstd.qcow2" 2>/dev/null | cut -f1) MiB)"
python3 tests/bootstorm/bench.py --module "$SO" --dir "$DIR" --trace "$TRACE" --images "$images" \
  --ns "${NS:-1 8 32}" --rounds "${ROUNDS:-3}" --qd "${QD:-8}" --lat "${LAT:-500}" \
  --mbps "${MBPS:-100}" --cores "${CORES:-0x1}" --base "${BASE:-delay}" \
  --off-max "${OFF_MAX:-1073741824}" \
  --lock "${LOCK:-/tmp/spdk-run.lock}" --replayer "$REPLAYER" --perf "${PERF:-}"
