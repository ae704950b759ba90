#!/usr/bin/env bash
# Instructions per request, our qcow2 bdev vs SPDK's passthru, counted by valgrind's
# callgrind in bdevperf on one core (QD32, malloc base, image fully allocated). Unlike IOPS,
# a count does not move with the other tenants of a shared machine, so it shows what a
# change to the request path costs or saves even where `tests/spdk_bench.sh`'s ratios
# drift by several per cent between runs.
#
#   tests/spdk_instr.sh                          # randread/randwrite, 4096 and 512 B
#   WORKLOADS="randread:512" SECS=3 tests/spdk_instr.sh
#   CREATE_EXTRA=',"prefetch":false' tests/spdk_instr.sh   # more bdev_qcow2_create params
#   FILL="randwrite 4096 3" tests/spdk_instr.sh  # an aged image: see below
#   FRESH=1 CLUSTER=4096 MB=256 WORKLOADS="randwrite:4096" tests/spdk_instr.sh
#                                                # a fresh image being filled (first writes,
#                                                # and overwrites while the owner holds the
#                                                # slices dirty); CLUSTER: its cluster size
#   KEEP=/tmp/cg tests/spdk_instr.sh             # keeps each run's callgrind output there
#                                                # (q-randwrite-512.out, ...) for callgrind_annotate
#   OVERLAY=1 WORKLOADS="randread:4096" tests/spdk_instr.sh
#                                                # our bdev a fresh overlay over a malloc
#                                                # golden bdev (bdev_qcow2_overlay_create):
#                                                # every read goes to the golden image;
#                                                # CREATE_EXTRA goes to the overlay's create
#                                                # (',"backing_cache_size":0': cache off)
#   ZEROED=1 tests/spdk_instr.sh                 # our bdev counted from the measured run's
#                                                # start (as FILL does, after 1 s of random
#                                                # 4 KiB reads instead of a fill): no set-up
#                                                # in its output, for tests/read_path.py
#
# With FILL ("WORKLOAD IOSIZE SECONDS"), our image is not preallocated but filled in the
# guest's own order first (e.g. random 4 KiB writes, QD32), then front to back for what
# that left, in the same bdevperf process (`-z`, driven by bdevperf.py); the counters are
# zeroed (callgrind_control) before the measured run, so the fill is not counted.
#
# Per request it prints the instructions of the whole I/O cycle (bdevperf's completion
# callback, our bdev or the passthru, the malloc bdev and the accel copy: everything the
# accel poller runs, plus our bdev's own pollers: every channel's and the metadata owner's
# poller runs through `ffi::thread::run_poller`, less their `finish` at the end of the run)
# and the ratio qcow2/passthru, per request bdevperf completed (tests/instr_cycle.py), then the
# same less the data copy's memcpy (its count depends on the buffers' addresses). Needs an
# installed SPDK (bdevperf, pkg-config spdk_bdev) and valgrind; prints SKIPPED without them.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf valgrind callgrind_annotate; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done

cargo build --release -q -p bdev_qcow2
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
DIR=$(mktemp -d)
# (and a filled run's bdevperf, if the script stops while it runs)
trap 'kill "${ZPID:-}" 2>/dev/null || true; rm -rf "$DIR"' EXIT
MB=${MB:-64}

# count KIND WORKLOAD IOSIZE: instructions per request of one bdevperf run under callgrind.
count() {
  local kind=$1 w=$2 o=$3 calls pre=full
  { [ -n "${FILL:-}" ] || [ -n "${FRESH:-}" ]; } && pre=off
  if [ "$kind" = q ] && [ -n "${OVERLAY:-}" ]; then
    calls="{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"g0\",\"num_blocks\":$((MB * 2048)),\"block_size\":512}},
{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m0\",\"num_blocks\":$((MB * 256 + 8192)),\"block_size\":512}},
{\"method\":\"bdev_qcow2_overlay_create\",\"params\":{\"name\":\"X\",\"base_bdev\":\"m0\",\"backing_bdev\":\"g0\"${CREATE_EXTRA:-}}}"
  elif [ "$kind" = q ]; then
    calls="{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m0\",\"num_blocks\":$((MB * 2048 + 8192)),\"block_size\":512}},
{\"method\":\"bdev_qcow2_format\",\"params\":{\"base_bdev\":\"m0\",\"size\":$((MB << 20)),\"preallocation\":\"$pre\"${CLUSTER:+,\"cluster_size\":$CLUSTER}}},
{\"method\":\"bdev_qcow2_create\",\"params\":{\"name\":\"X\",\"base_bdev\":\"m0\"${CREATE_EXTRA:-}}}"
  else
    calls="{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m1\",\"num_blocks\":$((MB * 2048)),\"block_size\":512}},
{\"method\":\"bdev_passthru_create\",\"params\":{\"name\":\"X\",\"base_bdev_name\":\"m1\"}}"
  fi
  printf '{"subsystems":[{"subsystem":"bdev","config":[%s,{"method":"bdev_wait_for_examine"}]}]}' \
    "$calls" >"$DIR/$kind.json"
  if { [ -n "${FILL:-}" ] || [ -n "${ZEROED:-}" ]; }; then
    KIND=$kind filled_run "$w" "$o" >/dev/null
  else
    timeout 600 env LD_PRELOAD="$SO" valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$DIR/$kind.out" \
      bdevperf -u --no-huge -s 1024 --json "$DIR/$kind.json" -m 0x1 -T X -q 32 -o "$o" -w "$w" \
      -t "${SECS:-5}" >"$DIR/$kind.log" 2>&1
  fi
  # (filled_run checks its own results.)
  if { false || { [ -z "${FILL:-}" ] && [ -z "${ZEROED:-}" ]; }; } &&
    awk -v f="$(awk '$1 == "X" && $2 == ":" {print $6; exit}' "$DIR/$kind.log")" 'BEGIN {exit !(f != "0.00")}'; then
    cat "$DIR/$kind.log"
    echo "failed I/O" >&2
    exit 1
  fi
  [ -z "${KEEP:-}" ] || { mkdir -p "$KEEP" && cp "$DIR/$kind.out" "$KEEP/$kind-$w-$o.out"; }
  # The cycle per request completed and its data copy (tests/instr_cycle.py says what it
  # counts, and why the copy is shown apart).
  python3 tests/instr_cycle.py "$DIR/$kind.out" | cut -d' ' -f1,3
}

# filled_run WORKLOAD IOSIZE: our image filled by FILL (if set), then the measured run,
# counted alone into $DIR/q.out; prints the requests it completed.
filled_run() {
  local py=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py}
  rm -f "$DIR/z.sock"
  # Started without a wrapper, so that $! is valgrind's own process (callgrind_control's).
  LD_PRELOAD="$SO" valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$DIR/all.out" \
    bdevperf -u --no-huge -s 1024 --json "$DIR/$KIND.json" -r "$DIR/z.sock" -z -m 0x1 -T X \
    -q 32 -o 4096 -w randread -t 1 >"$DIR/q.log" 2>&1 &
  ZPID=$!
  for _ in $(seq 300); do [ -S "$DIR/z.sock" ] && break; sleep 0.2; done
  perform() { timeout 300 /usr/bin/python3 "$py" -s "$DIR/z.sock" -t 290 perform_tests "$@"; }
  if [ -n "${FILL:-}" ]; then
    set -- "$1" "$2" $FILL
    perform -w "$3" -o "$4" -t "$5" -q 32 >/dev/null
    perform -w write -o 1048576 -t 4 -q 8 >/dev/null
  else
    # The socket answers before the bdev's set-up is over (the image's opening runs on our
    # data-path pollers, which the cycle counts): a first run waits for it. Random reads,
    # whatever the workload: they allocate nothing (FRESH counts first writes).
    perform -w randread -o 4096 -t 1 -q 32 >/dev/null
  fi
  callgrind_control -z "$ZPID" >/dev/null
  perform -w "$1" -o "$2" -t "${SECS:-5}" -q 32 >"$DIR/q.res"
  callgrind_control -d "$ZPID" >/dev/null
  kill "$ZPID" 2>/dev/null || true
  wait "$ZPID" 2>/dev/null || true
  mv "$(ls -t "$DIR"/all.out?* | head -1)" "$DIR/$KIND.out"
  /usr/bin/python3 -c '
import json, sys
rs = [r for r in json.load(open(sys.argv[1]))["results"] if "iops" in r]
if any(r.get("io_failed", 0) for r in rs):
    sys.exit("failed I/O")
print("%.0f" % sum(r["iops"] * r["runtime"] for r in rs))' "$DIR/q.res"
}

for wo in ${WORKLOADS:-randread:4096 randread:512 randwrite:4096 randwrite:512}; do
  w=${wo%%:*} o=${wo#*:}
  q=$(count q "$w" "$o")
  p=$(count p "$w" "$o")
  # (Less the copy: the cycle without the data copy's memcpy, whose count moves with where
  # the buffers lie, not with the code.)
  awk -v w="$w" -v o="$o" -v q="$q" -v p="$p" 'BEGIN {
    split(q, a, " "); split(p, b, " ")
    printf "%-9s %5s B QD32, one core, malloc: instructions per request: qcow2 %d passthru %d ratio %.3f; less the copy: qcow2 %d passthru %d ratio %.3f\n",
      w, o, a[1], b[1], a[1] / b[1], a[1] - a[2], b[1] - b[2], (a[1] - a[2]) / (b[1] - b[2]) }'
done
