#!/usr/bin/env bash
# First writes on two cores (#48): bdevperf 4 KiB random writes, QD32, `-m 0x3 -C` (a job
# on each core, neither on the md thread), into a fresh qcow2 image on an AIO file (made
# with fallocate: the image zeroes ahead by punching, so a first write is the guest's
# bytes alone, which the cores write themselves; ARCHITECTURE §5, §8), against
# SPDK's passthru over a raw file of the same size in the same directory; each round runs
# a fresh image and a fresh raw file, alternating, and the script prints each round's IOPS
# and the median ratio. With BASE_SO, a second build of the module (e.g. main's) runs in
# the same rounds, alternating with ours: "ours/base" compares the two on the same load.
#
#   flock /tmp/spdk-run.lock tests/first_write_bench.sh
#   BENCH_DIR=/dev/shm/fw ROUNDS=5 SECS=3 SIZE=16G CLUSTER=65536 tests/first_write_bench.sh
#   BASE_SO=/tmp/main.so tests/first_write_bench.sh
#
# Needs bdevperf, qemu-img; prints SKIPPED without them. Builds the module in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

for b in bdevperf qemu-img; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done
if [ -z "${BDEV_QCOW2_SO:-}" ]; then cargo build --release -q -p bdev_qcow2; fi
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
DIR=${BENCH_DIR:-/dev/shm/first_write_bench.$$}
SIZE=${SIZE:-16G}
SECS=${SECS:-3}
ROUNDS=${ROUNDS:-5}
CLUSTER=${CLUSTER:-65536}
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT

# One bdevperf run of 4 KiB random writes on two cores over config $2; prints the IOPS
# summed over both cores' rows of bdev $3 (fails on a failed request).
run() {
  local so=$1 cfg=$2 bdev=$3 out=$DIR/out
  if ! timeout -k 5 $((SECS + 90)) env ${so:+LD_PRELOAD="$so"} bdevperf --json "$cfg" \
      -m 0x3 -C -q 32 -o 4096 -w randwrite -t "$SECS" >"$out" 2>&1; then
    cat "$out" >&2
    echo "bdevperf failed" >&2
    exit 1
  fi
  awk -v b="$bdev" '$1 == b && $2 == ":" {s += $4; if ($6 != "0.00") bad = 1}
    END {if (bad) exit 1; printf "%.0f\n", s}' "$out" || { cat "$out" >&2; exit 1; }
}

config() {
  local file=$1 kind=$2
  local top
  if [ "$kind" = qcow2 ]; then
    top='{"method": "bdev_qcow2_create", "params": {"name": "q0", "base_bdev": "b0"}}'
  else
    top='{"method": "bdev_passthru_create", "params": {"name": "p0", "base_bdev_name": "b0"}}'
  fi
  cat <<JSON
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_aio_create", "params": {"name": "b0", "filename": "$file", "block_size": 512, "fallocate": true}},
  $top,
  {"method": "bdev_wait_for_examine"}]}]}
JSON
}

# A fresh image (its file grown to the image's size plus room for its metadata: the AIO
# bdev's size is fixed when it is created) and a fresh raw file.
fresh() {
  rm -f "$DIR/img.qcow2" "$DIR/raw.img"
  qemu-img create -q -f qcow2 -o cluster_size="$CLUSTER" "$DIR/img.qcow2" "$SIZE"
  truncate -s "$(($(numfmt --from=iec "$SIZE") * 17 / 16))" "$DIR/img.qcow2"
  truncate -s "$SIZE" "$DIR/raw.img"
}

config "$DIR/img.qcow2" qcow2 >"$DIR/q.json"
config "$DIR/raw.img" passthru >"$DIR/p.json"
declare -a R_OURS R_BASE R_OB
echo "load: $(uptime)"
for r in $(seq "$ROUNDS"); do
  fresh; ours=$(run "$SO" "$DIR/q.json" q0)
  fresh; raw=$(run "" "$DIR/p.json" p0)
  line="round $r: ours $ours passthru $raw ratio $(awk -v a="$ours" -v b="$raw" 'BEGIN {printf "%.3f", a / b}')"
  R_OURS+=("$(awk -v a="$ours" -v b="$raw" 'BEGIN {print a / b}')")
  if [ -n "${BASE_SO:-}" ]; then
    fresh; base=$(run "$BASE_SO" "$DIR/q.json" q0)
    R_BASE+=("$(awk -v a="$base" -v b="$raw" 'BEGIN {print a / b}')")
    R_OB+=("$(awk -v a="$ours" -v b="$base" 'BEGIN {print a / b}')")
    line="$line | base $base ratio $(awk -v a="$base" -v b="$raw" 'BEGIN {printf "%.3f", a / b}')"
  fi
  echo "$line"
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {printf "%.3f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo "median ours/passthru: $(median "${R_OURS[@]}") (rounds: $ROUNDS, ${SIZE} image, $CLUSTER-byte clusters, ${SECS} s, -m 0x3 -C QD32 4 KiB randwrite)"
if [ -n "${BASE_SO:-}" ]; then
  echo "median base/passthru: $(median "${R_BASE[@]}")"
  echo "median ours/base:     $(median "${R_OB[@]}")"
fi
echo "load: $(uptime)"
