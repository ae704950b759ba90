#!/usr/bin/env bash
# bdevperf figures of an encrypted (LUKS, aes-256-xts-plain64) qcow2 bdev against a plain
# one over the same kind of base: two fully allocated images made by qemu-img (every cluster
# written, so reads decrypt), AIO bdevs on their files, one core. The encrypted bdev takes its
# passphrase from SPDK's keyring (keyring_file_add_key). ROUNDS alternating runs of one bdev
# each per workload; prints every run and the medians (PERFORMANCE.md §12).
#
#   BENCH_DIR=/dev/shm/qe tests/encrypted_bench.sh   # images in RAM (tmpfs): the CPU cost shows
#   SIZE=1G TIME=5 ROUNDS=3 tests/encrypted_bench.sh
#   BDEV_QCOW2_SO=a.so BDEV_QCOW2_SO2=b.so tests/encrypted_bench.sh   # two builds, alternating
#
# BDEV_QCOW2_SO: the module to load (not built then); BDEV_QCOW2_SO2: a second one, run in
# the same rounds (each round: plain and encrypted under the first, then under the second),
# each build's encrypted/plain ratio printed beside the other's.
#
# Needs an installed SPDK (bdevperf on PATH) and qemu-img; prints SKIPPED and exits 0
# without them. Builds the module in release mode. Run it under `flock /tmp/spdk-run.lock`
# where other SPDK applications may run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf qemu-img; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done

if [ -z "${BDEV_QCOW2_SO:-}" ]; then cargo build --release -q -p bdev_qcow2; fi
SOS=("${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}")
if [ -n "${BDEV_QCOW2_SO2:-}" ]; then SOS+=("$BDEV_QCOW2_SO2"); fi
SIZE=${SIZE:-1G}
TIME=${TIME:-5}
ROUNDS=${ROUNDS:-3}
DIR=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$DIR"
trap 'rm -f "$DIR/plain.qcow2" "$DIR/enc.qcow2" "$DIR/zero.raw"' EXIT

key=$DIR/enc.key
printf %s 'bench passphrase' >"$key"
chmod 600 "$key"
truncate -s "$SIZE" "$DIR/zero.raw"
# -S 0: every cluster allocated and written (an encrypted one with the cipher text of zeros).
qemu-img convert -q -S 0 -O qcow2 "$DIR/zero.raw" "$DIR/plain.qcow2"
qemu-img convert -q -S 0 --object "secret,id=s0,file=$key" -O qcow2 \
  -o encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=100 \
  "$DIR/zero.raw" "$DIR/enc.qcow2"
truncate -s %512 "$DIR/plain.qcow2" "$DIR/enc.qcow2"
cat >"$DIR/perf.json" <<JSON
{"subsystems": [
 {"subsystem": "keyring", "config": [
  {"method": "keyring_file_add_key", "params": {"name": "k0", "path": "$key"}}]},
 {"subsystem": "bdev", "config": [
  {"method": "bdev_aio_create", "params": {"name": "aio_p", "filename": "$DIR/plain.qcow2", "block_size": 512}},
  {"method": "bdev_aio_create", "params": {"name": "aio_e", "filename": "$DIR/enc.qcow2", "block_size": 512}},
  {"method": "bdev_qcow2_create", "params": {"name": "plain", "base_bdev": "aio_p"}},
  {"method": "bdev_qcow2_create", "params": {"name": "enc", "base_bdev": "aio_e", "key": "k0"}},
  {"method": "bdev_wait_for_examine"}]}]}
JSON

free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge 1024 ] && grep -q hugetlbfs /proc/mounts; then MEM=(); else MEM=(--no-huge -s 2048); fi

# row OUT BDEV FIELD: a column of BDEV's result row (4 IOPS, 5 MiB/s, 6 Fail/s, 8 avg µs).
row() { awk -v b="$2" -v f="$3" '$1 == b && $2 == ":" {print $f}' "$1"; }
median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

echo "bdevperf -m 0x1 -t $TIME, images of $SIZE on $DIR (AIO), ROUNDS=$ROUNDS alternating"
for k in "${!SOS[@]}"; do echo "build $k: ${SOS[$k]}"; done
printf '%-26s %-8s %10s %10s %10s\n' workload bdev IOPS MiB/s avg_us
for spec in "randread 4096 32" "randread 4096 1" "read 131072 32"; do
  set -- $spec
  w=$1 o=$2 q=$3
  declare -A I=() M=() L=()
  for r in $(seq "$ROUNDS"); do
    for k in "${!SOS[@]}"; do
    for b in plain enc; do
      out=$DIR/bp.$b.txt
      if ! timeout -k 5 $((TIME + 60)) env LD_PRELOAD="${SOS[$k]}" bdevperf -u "${MEM[@]}" \
          --json "$DIR/perf.json" -m 0x1 -q "$q" -o "$o" -w "$w" -t "$TIME" -T "$b" \
          >"$out" 2>&1; then
        cat "$out"; echo "bdevperf failed" >&2; exit 1
      fi
      f=$(row "$out" "$b" 6)
      [ "$f" = "0.00" ] || { cat "$out"; echo "$b: failed I/O" >&2; exit 1; }
      i=$(row "$out" "$b" 4) m=$(row "$out" "$b" 5) l=$(row "$out" "$b" 8)
      I[$k$b]+="$i " M[$k$b]+="$m " L[$k$b]+="$l "
      printf '%-26s %-8s %10s %10s %10s  (round %s)\n' "$w $o QD$q" "$k:$b" "$i" "$m" "$l" "$r"
    done
    done
  done
  for k in "${!SOS[@]}"; do
    declare -A MI=() ML=()
    for b in plain enc; do
      MI[$b]=$(tr ' ' '\n' <<<"${I[$k$b]}" | grep . | median)
      ML[$b]=$(tr ' ' '\n' <<<"${L[$k$b]}" | grep . | median)
      printf '%-26s %-8s %10s %10s %10s  median\n' "$w $o QD$q" "$k:$b" "${MI[$b]}" \
        "$(tr ' ' '\n' <<<"${M[$k$b]}" | grep . | median)" "${ML[$b]}"
    done
    # QD1: plain latency / encrypted latency; otherwise encrypted IOPS / plain IOPS.
    if [ "$q" = 1 ]; then
      r=$(awk -v a="${ML[plain]}" -v b="${ML[enc]}" 'BEGIN {printf "%.2f", a / b}')
    else
      r=$(awk -v a="${MI[enc]}" -v b="${MI[plain]}" 'BEGIN {printf "%.2f", a / b}')
    fi
    printf '%-26s %-8s ratio %s\n' "$w $o QD$q" "build $k" "$r"
    unset MI ML
  done
  unset I M L
done
