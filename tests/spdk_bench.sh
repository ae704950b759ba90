#!/usr/bin/env bash
# Side-by-side bdevperf figures for the SPDK module: our qcow2 bdev and SPDK's passthru bdev
# over the same fully allocated image file (two AIO bdevs on it), on one core; prints IOPS
# and the ratio qcow2/passthru for each workload, measured both in the same bdevperf run
# ("together", sharing the core) and in alternating runs of one bdev each ("alone").
#
#   tests/spdk_bench.sh                       # image in a temporary directory
#   BENCH_DIR=/dev/shm/qb tests/spdk_bench.sh # image in RAM (tmpfs): shows our CPU cost best
#   SIZE=4G TIME=10 tests/spdk_bench.sh
#
# Needs an installed SPDK (bdevperf on PATH, pkg-config spdk_bdev) and qemu-img; prints
# SKIPPED and exits 0 without them. Builds the module in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf qemu-img; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done

cargo build --release -q -p bdev_qcow2
SO=$PWD/target/release/libbdev_qcow2.so
SIZE=${SIZE:-1G}
TIME=${TIME:-5}
DIR=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$DIR"
trap 'rm -f "$DIR/full.qcow2"' EXIT

img=$DIR/full.qcow2
qemu-img create -q -f qcow2 -o preallocation=falloc "$img" "$SIZE"
truncate -s %512 "$img"
sed "s#/var/tmp/full.qcow2#$img#" configs/bdevperf_qcow2_vs_passthru.json >"$DIR/perf.json"

free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge 1024 ] && grep -q hugetlbfs /proc/mounts; then MEM=(); else MEM=(--no-huge -s 2048); fi

# bdevperf_iops OUT BDEV: the IOPS column of BDEV's result row.
iops() { awk -v b="$2" '$1 == b && $2 == ":" {print $4}' "$1"; }
fails() { awk -v b="$2" '$1 == b && $2 == ":" {print $6}' "$1"; }

# bench OUT WORKLOAD IOSIZE [-T BDEV]: one bdevperf run (killed after TIME+60 s).
bench() {
  local out=$1 w=$2 o=$3
  shift 3
  if ! timeout -k 5 $((TIME + 60)) env LD_PRELOAD="$SO" bdevperf -u "${MEM[@]}" \
      --json "$DIR/perf.json" -m 0x1 -q 32 -o "$o" -w "$w" -t "$TIME" "$@" >"$out" 2>&1; then
    cat "$out"
    echo "bdevperf failed" >&2
    exit 1
  fi
  for b in q0 p0; do
    f=$(fails "$out" "$b")
    if [ -n "$f" ] && [ "$f" != "0.00" ]; then
      cat "$out"
      echo "$b: failed I/O" >&2
      exit 1
    fi
  done
}

run() {
  local w=$1 o=$2 out=$DIR/bdevperf.txt
  # Together: both bdevs in one run, sharing the core.
  bench "$out" "$w" "$o"
  local q p
  q=$(iops "$out" q0)
  p=$(iops "$out" p0)
  # Alone: one bdev per run, alternating passthru, qcow2, passthru, qcow2; means compared.
  local qa=0 pa=0
  for _ in 1 2; do
    bench "$out" "$w" "$o" -T p0
    pa=$(awk -v a="$pa" -v b="$(iops "$out" p0)" 'BEGIN {print a + b / 2}')
    bench "$out" "$w" "$o" -T q0
    qa=$(awk -v a="$qa" -v b="$(iops "$out" q0)" 'BEGIN {print a + b / 2}')
  done
  awk -v w="$w" -v o="$o" -v q="$q" -v p="$p" -v qa="$qa" -v pa="$pa" 'BEGIN {
    printf "%-9s %6s B QD32 | together: qcow2 %8.0f passthru %8.0f IOPS ratio %.3f | alone: qcow2 %8.0f passthru %8.0f IOPS ratio %.3f\n",
      w, o, q, p, q / p, qa, pa, qa / pa }'
}

echo "base: $img (${SIZE}, fully allocated), one core, 0 failures"
run randread 4096
run randread 512
run read 65536
