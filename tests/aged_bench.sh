#!/usr/bin/env bash
# Aged images: the layouts a guest's own writes leave (tests/aged_layouts.py, written by
# qemu-io and qemu-img: a linear reference written front to back, random 4 KiB fill, two and four interleaved sequential writers,
# `qemu-img convert -W` of a fragmented image, discard then rewrite), served by our bdev
# and compared with SPDK's passthru over the same disk as a raw file (`qemu-img convert -O
# raw`: the same data at the guest's offsets, the guest's size; AIO bdevs on tmpfs).
#
# For each layout, writable image, QD32:
#  - instructions per request executed by the layer itself, our module or SPDK's passthru
#    (callgrind in bdevperf on one core; self cost of the layer's functions), for randread
#    and randwrite at 512 B and 4 KiB, and their difference: what the layout costs on top
#    of the rest of the cycle, which is the same for both (tests/spdk_instr.sh counts the
#    whole cycle on a malloc base, for an image formatted in place);
#  - IOPS of interleaved pairs in one `bdevperf -z` process (qcow2 then passthru, or the
#    reverse, PAIR_SECS s each, PAIRS pairs): the median of the pairs' ratios and its
#    quartiles, on one core and on two cores (-C).
#
#   tests/aged_bench.sh                              # everything
#   LAYOUTS="random4k writers2" SKIP_PAIRS=1 tests/aged_bench.sh
#   SKIP_INSTR=1 PAIRS=10 PAIR_SECS=1 tests/aged_bench.sh
#   SIZE_MIB=1024 BENCH_DIR=/dev/shm/aged tests/aged_bench.sh
#   BASELINE_SO=/tmp/main.so tests/aged_bench.sh     # counts also with another build
#   Q_ARGS=--no-prefetch SKIP_INSTR=1 tests/aged_bench.sh  # more bdev_qcow2_create options
#
# Needs an installed SPDK (bdevperf, pkg-config spdk_bdev), qemu-img and qemu-io, and for
# the counts valgrind; prints SKIPPED and exits 0 without them. Run it alone on the machine
# (`flock /tmp/spdk-app.lock tests/aged_bench.sh` where several share it).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf qemu-img qemu-io; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done

cargo build --release -q -p bdev_qcow2
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
# A BENCH_DIR given is kept, with its images: a later run reuses those it holds (build them
# outside the SPDK lock with `tests/aged_layouts.py DIR SIZE_MIB LAYOUT...`).
DIR=${BENCH_DIR:-$(mktemp -d -p /dev/shm)}
mkdir -p "$DIR"
if [ -n "${BENCH_DIR:-}" ]; then
  trap 'kill "${ZPID:-}" 2>/dev/null || true; rm -f "$DIR"/work.* "$DIR"/cg.*' EXIT
else
  trap 'kill "${ZPID:-}" 2>/dev/null || true; rm -rf "$DIR"' EXIT
fi
LAYOUTS=${LAYOUTS:-linear random4k writers2 writers4 convert rewrite}
BDEVPERF_PY=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py}

missing=
for l in $LAYOUTS; do [ -f "$DIR/$l.qcow2" ] || missing="$missing $l"; done
# shellcheck disable=SC2086
[ -z "$missing" ] || python3 tests/aged_layouts.py "$DIR" "${SIZE_MIB:-1024}" $missing

# config FILE IMAGE RAW: qcow2 bdev "q" on an AIO bdev over IMAGE, passthru "p" on one over RAW.
config() {
  printf '{"subsystems":[{"subsystem":"bdev","config":[
{"method":"bdev_aio_create","params":{"name":"a0","filename":"%s","block_size":512}},
{"method":"bdev_aio_create","params":{"name":"a1","filename":"%s","block_size":512}},
%s
{"method":"bdev_wait_for_examine"}]}]}' "$2" "$3" "$4" >"$1"
}

# work LAYOUT: a fresh copy of the image to run on, with room past its end for the clusters
# it does not have yet (a bdev holds more than the image, and cannot grow).
work() {
  cp "$DIR/$1.qcow2" "$DIR/work.qcow2"
  truncate -s +256M "$DIR/work.qcow2"
}

# count LAYOUT KIND WORKLOAD IOSIZE [SO]: instructions per request of one bdevperf run (our
# module from SO, default the one just built).
count() {
  local l=$1 kind=$2 w=$3 o=$4 so=${5:-$SO} bdev
  work "$l"
  if [ "$kind" = q ]; then
    bdev='{"method":"bdev_qcow2_create","params":{"name":"X","base_bdev":"a0"}},'
  else
    bdev='{"method":"bdev_passthru_create","params":{"name":"X","base_bdev_name":"a1"}},'
  fi
  config "$DIR/c.json" "$DIR/work.qcow2" "$DIR/work.qcow2" "$bdev"
  timeout 900 env LD_PRELOAD="$so" valgrind --tool=callgrind --callgrind-out-file="$DIR/cg.out" \
    bdevperf -u --no-huge -s 1024 --json "$DIR/c.json" -m 0x1 -T X -q 32 -o "$o" -w "$w" \
    -t "${SECS:-4}" >"$DIR/cg.log" 2>&1 || { cat "$DIR/cg.log"; exit 1; }
  local n layer
  n=$(awk '$1 == "X" && $2 == ":" {print $3 * $4; exit}' "$DIR/cg.log")
  if awk -v f="$(awk '$1 == "X" && $2 == ":" {print $6; exit}' "$DIR/cg.log")" 'BEGIN {exit !(f != "0.00")}'; then
    cat "$DIR/cg.log"; echo "failed I/O" >&2; exit 1
  fi
  # The layer's own instructions (self cost): every function of our module, or of SPDK's
  # passthru. The rest of the cycle (bdevperf, the bdev layer, the AIO bdev) is the same
  # code on both sides, but its count moves with how often the reactor polls in vain,
  # which callgrind's slowed-down clock changes from run to run.
  local pat="vbdev_passthru"
  [ "$kind" = q ] && pat="$(basename "$so")\\]"
  layer=$(callgrind_annotate --auto=no --threshold=100 "$DIR/cg.out" 2>/dev/null |
    grep -E "$pat" | awk '{gsub(",", "", $1); s += $1} END {print s}')
  awk -v c="$layer" -v n="$n" 'BEGIN {printf "%.0f", c / n}'
}

if [ -z "${SKIP_INSTR:-}" ] && command -v valgrind >/dev/null; then
  for l in $LAYOUTS; do
    for wo in ${WORKLOADS:-randread:512 randwrite:512 randread:4096 randwrite:4096}; do
      w=${wo%%:*} o=${wo#*:}
      q=$(count "$l" q "$w" "$o")
      p=$(count "$l" p "$w" "$o")
      b=
      [ -n "${BASELINE_SO:-}" ] && b=$(count "$l" q "$w" "$o" "$BASELINE_SO")
      awk -v l="$l" -v w="$w" -v o="$o" -v q="$q" -v p="$p" -v b="$b" 'BEGIN {
        printf "aged %-9s %-9s %5s B QD32 one core: instructions per request in the layer itself: qcow2 %d passthru %d, qcow2 - passthru %d", l, w, o, q, p, q - p
        if (b != "") printf " (baseline qcow2 %d, - passthru %d)", b, b - p
        printf "\n" }'
    done
  done
fi

[ -n "${SKIP_PAIRS:-}" ] && exit 0
if [ ! -f "$BDEVPERF_PY" ]; then
  echo "SKIPPED (pairs): bdevperf.py not found (set BDEVPERF_PY)"
  exit 0
fi
zrun() {
  local out
  out=$(timeout 120 /usr/bin/python3 "$BDEVPERF_PY" -s "$DIR/z.sock" -t 100 perform_tests \
    -w "$1" -o "$2" -t "$3" -q 32)
  echo "$out" | /usr/bin/python3 -c '
import json, sys
rs = [r for r in json.load(sys.stdin)["results"] if "iops" in r]
for r in rs:
    if r.get("io_failed", 0) or r.get("io_timeout", 0):
        sys.exit("failed I/O: %s" % r)
print("%.0f" % sum(r["iops"] for r in rs))'
}
zrpc() {
  PYTHONPATH=$PWD/configs/rpc_plugin timeout 60 /usr/bin/python3 \
    "${RPC_PY:-/opt/spdk-src/scripts/rpc.py}" -s "$DIR/z.sock" --plugin bdev_qcow2_rpc "$@" >/dev/null
}
# shellcheck disable=SC2086
use_q() { [ "$XNOW" = q ] && return; drop_x; zrpc bdev_qcow2_create -b X --base-bdev a0 ${Q_ARGS:-}; XNOW=q; }
use_p() { [ "$XNOW" = p ] && return; drop_x; zrpc bdev_passthru_create -b a1 -p X; XNOW=p; }
drop_x() {
  case "$XNOW" in q) zrpc bdev_qcow2_delete X ;; p) zrpc bdev_passthru_delete X ;; esac
  XNOW=
}
# pairs W O: prints "q_median p_median ratio_median q1 q3" of PAIRS interleaved pairs.
pairs() {
  local w=$1 o=$2 i q p
  : >"$DIR/pairs.txt"
  for i in $(seq "${PAIRS:-10}"); do
    if [ $((i % 2)) = 1 ]; then
      use_q; q=$(zrun "$w" "$o" "${PAIR_SECS:-1}"); use_p; p=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
    else
      use_p; p=$(zrun "$w" "$o" "${PAIR_SECS:-1}"); use_q; q=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
    fi
    echo "$q $p" >>"$DIR/pairs.txt"
  done
  /usr/bin/python3 - "$DIR/pairs.txt" <<'PY'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
r = sorted(q / p for q, p in rows)
qs = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
print("%.0f %.0f %.3f %.3f %.3f" % (statistics.median(q for q, _ in rows),
      statistics.median(p for _, p in rows), statistics.median(r), qs[0], qs[2]))
PY
}
for l in $LAYOUTS; do
  for cores in 1 2; do
    work "$l"
    # The passthru serves the guest's disk as a raw file: the image's data at the guest's
    # offsets, as sparse as the image is, and the guest's size. (A copy of the qcow2 file
    # itself is a quarter larger, the room past its end reading as holes, which tmpfs
    # serves from the zero page: passthru's random reads there cost less than reads of
    # data, and they were a fifth of its reads.)
    qemu-img convert -q -f qcow2 -O raw "$DIR/work.qcow2" "$DIR/work.raw"
    config "$DIR/z.json" "$DIR/work.qcow2" "$DIR/work.raw" ""
    rm -f "$DIR/z.sock"
    if [ "$cores" = 2 ]; then mask=(-m 0x3 -C); else mask=(-m 0x1); fi
    timeout -k 5 1800 env LD_PRELOAD="$SO" bdevperf -u --no-huge -s 2048 --json "$DIR/z.json" \
      -r "$DIR/z.sock" -z "${mask[@]}" -T X -q 32 -o 4096 -w randread -t 1 >"$DIR/z.log" 2>&1 &
    ZPID=$!
    for _ in $(seq 100); do [ -S "$DIR/z.sock" ] && break; sleep 0.2; done
    XNOW=
    for wo in ${PAIR_WORKLOADS:-randread:4096 randread:512 randwrite:4096 randwrite:512}; do
      set -- $(pairs "${wo%%:*}" "${wo#*:}")
      echo "aged $l, $cores core(s), ${wo%%:*} ${wo#*:} B QD32: qcow2 $1 passthru $2 IOPS, ratio $3 (median of ${PAIRS:-10} interleaved pairs; quartiles $4-$5)"
    done
    drop_x
    kill "$ZPID" 2>/dev/null || true
    wait "$ZPID" 2>/dev/null || true
  done
done
