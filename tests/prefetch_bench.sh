#!/usr/bin/env bash
# Prefetch ring figures, ring on vs off side by side: alternating runs (on, off, off, on,
# ...), each pair's ratio on/off, the median of the ratios (and the median IOPS of each
# side) reported.
#
# 1. SPDK bdevperf, one core, on a qcow2 bdev (64 KiB clusters, fully allocated) over a
#    delay bdev (bdev_delay_create, LAT µs average read latency) on a malloc base, for each
#    LAT in LATS: 4 KiB and 128 KiB sequential reads at QD1; two and four interleaved
#    sequential streams (one bdevperf job per stream, each reading its own region, QD1,
#    4 KiB), whose per-stream gain is compared with the single stream's; 4 KiB random
#    reads at QD32 (no harm), with the bytes the ring evicted unread against the bytes read.
#    Row `fast` (not in the default rows): 128 KiB sequential reads at QD8 on the malloc
#    base without a delay bdev, where the reader's own queue keeps ahead of the ring (it
#    must stop reading ahead, LATE_OFF: no harm).
#    Row `window` (not in the default rows): 1, 2 and 4 interleaved 128 KiB QD1 streams
#    over a delay bdev of WLAT µs (default 1000), where a stream served from the ring is
#    bound by its window (chunks in flight per base round trip), not by the core: does
#    detection keep interleaved streams apart there (each stream's gain against the
#    single stream's)?
#    After each streams row: each stream's gain as a share of the single stream's, and the
#    ring-on aggregate IOPS against the single stream's (about 1x: the streams share what
#    one stream already takes, the core; about Nx: they do not compete).
# 2. Golden image: a raw backing image on a malloc bdev exported over NVMe-oF/TCP on
#    loopback by a second spdk_tgt; an empty overlay (qcow2 on tmpfs, aio bdev) naming it
#    as backing_bdev; 4 KiB sequential reads at QD1 of the overlay.
# 3. `qcow2 perf --base-latency-us 50`: 4 KiB and 128 KiB sequential reads at QD1, the
#    sample image in PERF_DIR (default /dev/shm: memory under the added latency, like the
#    malloc base of section 1; on a disk, 128 KiB reads ahead run into its bandwidth).
#    Then the same on images `qemu-img convert -c` makes of ZMB MiB of text (default 128),
#    with 64 KiB and 2 MiB clusters (the ring's chunks decompress each cluster once; 2 MiB
#    clusters take its big record).
#
#   tests/prefetch_bench.sh
#   LATS="50" ROUNDS=3 TIME=3 tests/prefetch_bench.sh
#   SKIP_SPDK=1 / SKIP_GOLDEN=1 / SKIP_PERF=1 tests/prefetch_bench.sh
#   RT_REACTORS=1 SKIP_SPDK=1 SKIP_PERF=1 tests/prefetch_bench.sh   # the golden row with both
#                        # reactors SCHED_FIFO while measured (root; for a loaded machine)
#   ROWS="streams" tests/prefetch_bench.sh     # section 1 rows: seq streams streams128 rand fast window
#   CORES=2 ROWS="streams" tests/prefetch_bench.sh   # streams spread over two cores
#   RING_BYTES=$((10 << 20)) ROWS="window" tests/prefetch_bench.sh   # a larger ring
#   MAX_WINDOW=$((256 << 10)) ROWS="streams" tests/prefetch_bench.sh  # a smaller window
#
# Runs SPDK applications: wrap it in `flock /tmp/spdk-app.lock` on a shared machine. Needs
# an installed SPDK (bdevperf, spdk_tgt, pkg-config spdk_bdev) and qemu-img for sections 1
# and 2 (SKIPPED without them). Builds the module and the tool in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
TIME=${TIME:-3}
LATS=${LATS:-50 200}
MB=${MB:-512}
DIR=$(mktemp -d)
TGT_PID=
TGT_TID=
BP_PID=
cleanup() {
  # (A reactor left SCHED_FIFO would hold its core: RT_REACTORS.)
  [ -n "$TGT_TID" ] && chrt -o -p 0 "$TGT_TID" 2>/dev/null
  [ -n "$BP_PID" ] && kill -9 "$BP_PID" 2>/dev/null
  [ -n "$TGT_PID" ] && kill "$TGT_PID" 2>/dev/null && wait "$TGT_PID" 2>/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT

# median: the median of the numbers on stdin.
median() { sort -g | awk '{a[NR] = $1} END {if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# pairs NAME CMD...: runs `CMD on` and `CMD off` ROUNDS times alternating (on off, off on,
# ...); each prints one number (IOPS); prints NAME, the medians and the median ratio.
pairs() {
  local name=$1
  shift
  local r on off ratios=() ons=() offs=()
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then
      on=$("$@" on) off=$("$@" off)
    else
      off=$("$@" off) on=$("$@" on)
    fi
    ons+=("$on") offs+=("$off")
    ratios+=("$(awk -v a="$on" -v b="$off" 'BEGIN {printf "%.4f", a / b}')")
  done
  # The medians, for the rows that compare with an earlier one.
  PAIR_ON=$(printf '%s\n' "${ons[@]}" | median)
  PAIR_RATIO=$(printf '%s\n' "${ratios[@]}" | median)
  printf '%-46s on %10.0f  off %10.0f  ratio %7.2f  (ratios: %s)\n' "$name" \
    "$PAIR_ON" "$(printf '%s\n' "${offs[@]}" | median)" "$PAIR_RATIO" "${ratios[*]}"
}

have_spdk=1
if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED (SPDK sections): SPDK not installed (pkg-config spdk_bdev not found)"
  have_spdk=
fi
for b in bdevperf spdk_tgt qemu-img; do
  if [ -n "$have_spdk" ] && ! command -v "$b" >/dev/null; then
    echo "SKIPPED (SPDK sections): $b not found"
    have_spdk=
  fi
done

free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge 1536 ] && grep -q hugetlbfs /proc/mounts; then MEM=(); else MEM=(--no-huge -s 2048); fi

# --- 1. bdevperf over a delay bdev ----------------------------------------------------------
# config LAT PREFETCH: a bdevperf JSON config: malloc m0, formatted fully allocated, a delay
# bdev d0 on it, our bdev q0 on d0 (LAT 0: no delay bdev, q0 on m0).
config() {
  local lat=$1 pf=$2 f=$DIR/q-$1-$2.json base=d0 delay ring=
  # RING_BYTES: the ring's size per channel (default: the module's, 5 MiB).
  [ -n "${RING_BYTES:-}" ] && ring=",\"prefetch_ring_size\":$RING_BYTES"
  # MAX_WINDOW: each stream's largest window (default: the module's, 1 MiB).
  [ -n "${MAX_WINDOW:-}" ] && ring="$ring,\"prefetch_max_window\":$MAX_WINDOW"
  delay="{\"method\":\"bdev_delay_create\",\"params\":{\"name\":\"d0\",\"base_bdev_name\":\"m0\",\"avg_read_latency\":$lat,\"p99_read_latency\":$lat,\"avg_write_latency\":$lat,\"p99_write_latency\":$lat}},"
  if [ "$lat" = 0 ]; then base=m0 delay=; fi
  cat >"$f" <<EOF
{"subsystems":[{"subsystem":"bdev","config":[
{"method":"bdev_malloc_create","params":{"name":"m0","num_blocks":$(((MB + 16) * 2048)),"block_size":512}},
{"method":"bdev_qcow2_format","params":{"base_bdev":"m0","size":$((MB << 20)),"cluster_size":65536,"preallocation":"full"}},
$delay
{"method":"bdev_qcow2_create","params":{"name":"q0","base_bdev":"$base","prefetch":$([ "$pf" = on ] && echo true || echo false)$ring}},
{"method":"bdev_wait_for_examine"}]}]}
EOF
  echo "$f"
}

# run_bdevperf ARGS...: one bdevperf process (log in $DIR/last.log); failed I/O fails.
run_bdevperf() {
  if ! timeout -k 5 $((TIME + 120)) env LD_PRELOAD="$SO" bdevperf -u "${MEM[@]}" "$@" \
      >"$DIR/last.log" 2>&1; then
    cat "$DIR/last.log" >&2
    echo "bdevperf failed" >&2
    exit 1
  fi
  if awk '$2 == ":" && $1 != "Total" && NF >= 6 && $6 != "0.00" {bad = 1} END {exit !bad}' "$DIR/last.log"; then
    cat "$DIR/last.log" >&2
    echo "failed I/O" >&2
    exit 1
  fi
}

# bperf LAT WORKLOAD IOSIZE QD PREFETCH: IOPS of one job on q0.
bperf() {
  run_bdevperf --json "$(config "$1" "$5")" -m 0x1 -t "$TIME" -T q0 -q "$4" -o "$3" -w "$2"
  awk '$1 == "q0" && $2 == ":" {print $4; exit}' "$DIR/last.log"
}

# bstreams LAT N IOSIZE PREFETCH: N interleaved sequential streams on q0 (one bdevperf job
# each, reading its own region, QD1), on CORES cores (default 1; job j on core j mod
# CORES, each core with its own channel and ring): the mean IOPS per stream.
bstreams() {
  local lat=$1 n=$2 o=$3 pf=$4 len=$((MB * 2048 / $2)) j cores=${CORES:-1}
  {
    printf '[global]\nfilename=q0\nbs=%s\niodepth=1\nrw=read\n' "$o"
    for j in $(seq 0 $((n - 1))); do
      printf '[job%s]\ncpumask=0x%x\noffset=%s\nlength=%s\n' "$j" $((1 << (j % cores))) \
        $((j * len)) "$len"
    done
  } >"$DIR/jobs.conf"
  run_bdevperf --json "$(config "$lat" "$pf")" -m "$(printf '0x%x' $(((1 << cores) - 1)))" \
    -t "$TIME" -j "$DIR/jobs.conf"
  # (bdevperf starts its Total row with a carriage return.)
  awk -v n="$n" '{sub(/\r/, "")} $1 == "Total" && $2 == ":" {printf "%.2f\n", $3 / n; exit}' "$DIR/last.log"
}

# ring_line: the closing summary's prefetch ring figures of q0 in the last run.
ring_line() { grep -o 'prefetch ring .*' "$DIR/last.log" | head -1; }

# ring_use: of the last run, the share of q0's requests the ring served whole, the bytes
# it read ahead and those it evicted unread (and their share of what it read ahead).
ring_use() {
  grep -o 'qcow2 bdev q0: .*' "$DIR/last.log" | head -1 | awk '{
    for (i = 1; i <= NF; i++) {
      if ($(i + 1) == "requests;") req = $i
      if ($(i + 1) == "bytes" && $(i + 2) == "read" && $(i + 3) == "ahead,") ahead = $i
      if ($i == "served" && $(i + 1) == "in") served = $(i + 2)
      if ($(i + 1) == "bytes" && $(i + 2) == "evicted") evicted = $i
    }
    printf "ring hits %.1f%% of requests, %.0f bytes read ahead, %.0f evicted unread (%.2f%%)",
      100 * served / (req ? req : 1), ahead, evicted, 100 * evicted / (ahead ? ahead : 1)
  }'
}

# streams_detail LAT N IOSIZE: one more run of N streams with the ring on: the aggregate
# IOPS (is the ring-on side bound by the core rather than by latency?) and how the ring did.
streams_detail() {
  local per
  per=$(bstreams "$1" "$2" "$3" on)
  echo "   $2 stream(s), ring on, ${CORES:-1} core(s): aggregate $(awk -v p="$per" -v n="$2" 'BEGIN {printf "%.0f", p * n}') IOPS; $(ring_use)"
}

# streams_rows LAT IOSIZE LABEL: the 1, 2 and 4 streams rows; after the 2 and 4 streams
# rows, each stream's gain as a share of the single stream's, and the ring-on aggregate
# (median per-stream IOPS times N) against the single stream's ring-on IOPS.
streams_rows() {
  local n one_ratio one_on
  for n in 1 2 4; do
    pairs "delay ${1}us: $n stream(s) $3 QD1, per stream" bstreams "$1" "$n" "$2"
    if [ "$n" = 1 ]; then
      one_ratio=$PAIR_RATIO one_on=$PAIR_ON
    else
      awk -v r="$PAIR_RATIO" -v r1="$one_ratio" -v on="$PAIR_ON" -v on1="$one_on" -v n="$n" 'BEGIN {
        printf "   %s streams: each %.0f%% of the single stream'"'"'s gain; ring-on aggregate %.2fx the single stream'"'"'s IOPS\n",
          n, 100 * r / r1, n * on / on1 }'
    fi
    streams_detail "$1" "$n" "$2"
  done
}

if [ -n "$have_spdk" ] && [ -z "${SKIP_SPDK:-}" ]; then
  cargo build --release -q -p bdev_qcow2
  SO=$PWD/target/release/libbdev_qcow2.so
  echo "== bdevperf, one core, qcow2 (64 KiB clusters, ${MB} MiB, fully allocated) over bdev_delay on malloc"
  echo "   ring on vs off, $ROUNDS alternating pairs of ${TIME} s runs, median ratio"
  rows=${ROWS:-seq streams streams128 rand}
  if [[ " $rows " == *" fast "* ]]; then
    pairs "no delay (malloc): 128 KiB seq read QD8" bperf 0 read 131072 8
    bperf 0 read 131072 8 on >/dev/null
    echo "   ring on: $(ring_line)"
  fi
  for lat in $LATS; do
    if [[ " $rows " == *" seq "* ]]; then
      pairs "delay ${lat}us: 4 KiB seq read QD1" bperf "$lat" read 4096 1
      pairs "delay ${lat}us: 128 KiB seq read QD1" bperf "$lat" read 131072 1
    fi
    if [[ " $rows " == *" streams "* ]]; then
      streams_rows "$lat" 4096 "4 KiB"
    fi
    # The same with 128 KiB reads, where one stream does not take the whole core.
    if [[ " $rows " == *" streams128 "* ]]; then
      streams_rows "$lat" 131072 "128 KiB"
    fi
    if [[ " $rows " == *" rand "* ]]; then
      pairs "delay ${lat}us: 4 KiB random read QD32" bperf "$lat" randread 4096 32
      iops=$(bperf "$lat" randread 4096 32 on)
      echo "   random read QD32, ring on: $(awk -v i="$iops" -v t="$TIME" 'BEGIN {printf "%.0f", i * t * 4096}') bytes read; $(ring_line)"
    fi
  done
  # Bound by the window, not the core: a slow base, large reads.
  if [[ " $rows " == *" window "* ]]; then
    streams_rows "${WLAT:-1000}" 131072 "128 KiB"
  fi
fi

# --- 2. Golden image over NVMe-oF/TCP -------------------------------------------------------
# golden PREFETCH: 4 KiB sequential reads at QD1 of an empty overlay whose backing bdev is
# the golden image, exported by the running spdk_tgt.
golden() {
  rm -f "$DIR/overlay.qcow2"
  qemu-img create -q -u -f qcow2 -b golden.raw -F raw "$DIR/overlay.qcow2" "${MB}M"
  truncate -s %512 "$DIR/overlay.qcow2"
  local pf=false
  [ "$1" = on ] && pf=true
  printf '%s\n' '{"subsystems":[{"subsystem":"bdev","config":[' \
    "{\"method\":\"bdev_nvme_attach_controller\",\"params\":{\"name\":\"nvme0\",\"trtype\":\"tcp\",\"adrfam\":\"ipv4\",\"traddr\":\"127.0.0.1\",\"trsvcid\":\"$PORT\",\"subnqn\":\"$NQN\"}}," \
    "{\"method\":\"bdev_aio_create\",\"params\":{\"name\":\"ov\",\"filename\":\"$DIR/overlay.qcow2\",\"block_size\":512}}," \
    "{\"method\":\"bdev_qcow2_create\",\"params\":{\"name\":\"q0\",\"base_bdev\":\"ov\",\"backing_bdev\":\"nvme0n1\",\"prefetch\":$pf}}," \
    '{"method":"bdev_wait_for_examine"}]}]}' >"$DIR/overlay.json"
  if [ -n "${RT_REACTORS:-}" ]; then
    golden_rt
    return
  fi
  run_bdevperf --json "$DIR/overlay.json" --disable-cpumask-locks -m 0x2 -t "$TIME" -T q0 -q 1 -o 4096 -w read
  awk '$1 == "q0" && $2 == ":" {print $4; exit}' "$DIR/last.log"
}

# reactor_tid PID NAME: the thread of process PID named NAME (an SPDK reactor: reactor_N).
reactor_tid() {
  local t
  for t in /proc/"$1"/task/*; do
    [ "$(cat "$t/comm" 2>/dev/null)" = "$2" ] && { basename "$t"; return; }
  done
}

# golden_rt: `golden`'s run with both reactors (the target's and bdevperf's) SCHED_FIFO for
# the measured seconds only (bdevperf -z, then perform_tests): other tenants' processes
# then cannot take the cores from the two pollers a QD1 round trip over TCP waits on.
golden_rt() {
  local py=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py} out bt
  # Run inside `pairs`'s command substitution, where the script's EXIT trap does not hold:
  # a failure here must not leave a reactor SCHED_FIFO.
  trap '[ -n "$BP_PID" ] && kill -9 "$BP_PID" 2>/dev/null; chrt -o -p 0 "$TGT_TID" 2>/dev/null' EXIT
  rm -f "$DIR/bp.sock"
  LD_PRELOAD="$SO" bdevperf -u "${MEM[@]}" --disable-cpumask-locks -r "$DIR/bp.sock" -z \
    --json "$DIR/overlay.json" -m 0x2 -T q0 -q 1 -o 4096 -w read -t "$TIME" >"$DIR/last.log" 2>&1 &
  BP_PID=$!
  for _ in $(seq 150); do [ -S "$DIR/bp.sock" ] && break; sleep 0.2; done
  timeout 60 "$RPC_PY" -s "$DIR/bp.sock" bdev_get_bdevs -b q0 -t 20000 >/dev/null
  bt=$(reactor_tid "$BP_PID" reactor_1)
  chrt -f -p 1 "$TGT_TID"
  chrt -f -p 1 "$bt"
  out=$(timeout $((TIME + 60)) /usr/bin/python3 "$py" -s "$DIR/bp.sock" -t $((TIME + 50)) perform_tests)
  chrt -o -p 0 "$bt"
  chrt -o -p 0 "$TGT_TID"
  kill -INT "$BP_PID"
  wait "$BP_PID" || true
  BP_PID=
  if [ "$BASHPID" = "$$" ]; then trap cleanup EXIT; else trap - EXIT; fi
  /usr/bin/python3 -c 'import json, sys
rs = [r for r in json.loads(sys.argv[1])["results"] if "iops" in r]
if any(r.get("io_failed", 0) for r in rs):
    sys.exit("failed I/O")
print("%.2f" % sum(r["iops"] for r in rs))' "$out"
}

if [ -n "$have_spdk" ] && [ -z "${SKIP_GOLDEN:-}" ]; then
  [ -n "${SO:-}" ] || { cargo build --release -q -p bdev_qcow2; SO=$PWD/target/release/libbdev_qcow2.so; }
  RPC_PY=${RPC_PY:-$(command -v spdk-rpc || command -v rpc.py || echo /opt/spdk-src/scripts/rpc.py)}
  NQN=nqn.2016-06.io.spdk:golden
  PORT=${PORT:-4431}
  spdk_tgt "${MEM[@]}" --disable-cpumask-locks -m 0x1 -r "$DIR/tgt.sock" >"$DIR/tgt.log" 2>&1 &
  TGT_PID=$!
  for _ in $(seq 100); do [ -S "$DIR/tgt.sock" ] && break; sleep 0.2; done
  rpc() { timeout 60 "$RPC_PY" -s "$DIR/tgt.sock" "$@" >/dev/null; }
  rpc framework_wait_init
  rpc bdev_malloc_create -b golden "$MB" 512
  rpc nvmf_create_transport -t TCP
  rpc nvmf_create_subsystem "$NQN" -a -s GOLDEN0001
  rpc nvmf_subsystem_add_ns "$NQN" golden
  rpc nvmf_subsystem_add_listener "$NQN" -t tcp -f ipv4 -a 127.0.0.1 -s "$PORT"
  TGT_TID=$(reactor_tid "$TGT_PID" reactor_0)
  echo "== golden image: empty overlay (aio bdev) over a ${MB} MiB malloc exported by a second spdk_tgt over NVMe-oF/TCP on loopback"
  pairs "golden: 4 KiB seq read QD1 of the overlay" golden
  kill "$TGT_PID" 2>/dev/null || true
  wait "$TGT_PID" 2>/dev/null || true
  TGT_PID=
  TGT_TID=
fi

# --- 3. qcow2 perf ---------------------------------------------------------------------------
# qperf IOSIZE PREFETCH: qcow2 perf on our host, sequential reads at QD1, 50 µs added to
# every device completion.
PERF_DIR=${PERF_DIR:-/dev/shm}
qperf() {
  TMPDIR=$PERF_DIR ./target/release/qcow2 perf -w read -q 1 -s "$1" -t "$TIME" --base-latency-us 50 \
    --sample-size "${MB}M" --prefetch "$2" --json ${ZIMG:+"$ZIMG"} |
    /usr/bin/python3 -c 'import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if r.get("target") == "qcow2":
        print(r["iops"])'
}

if [ -z "${SKIP_PERF:-}" ]; then
  cargo build --release -q -p qcow2_tool
  echo "== qcow2 perf --base-latency-us 50 (our io_uring host, one core; sample image on" \
    "$(df --output=fstype "$PERF_DIR" | tail -1) at $PERF_DIR)"
  pairs "qcow2 perf: 4 KiB seq read QD1" qperf 4096
  pairs "qcow2 perf: 128 KiB seq read QD1" qperf 131072
  # Text that deflate shrinks about 8x, a 4 KiB line of words per block.
  zdir=$(mktemp -d -p "$PERF_DIR")
  /usr/bin/python3 - "$zdir/text.raw" "${ZMB:-128}" <<'PY'
import random, sys
r = random.Random(1)
words = ["alpha", "beta", "gamma", "delta", "disk", "cluster", "qcow2", "guest", "block", "sector"]
with open(sys.argv[1], "wb") as f:
    for _ in range(int(sys.argv[2]) * 256):
        f.write(" ".join(r.choice(words) for _ in range(800)).encode()[:4096].ljust(4096, b"."))
PY
  for cs in 64k 2M; do
    qemu-img convert -q -c -f raw -O qcow2 -o cluster_size=$cs "$zdir/text.raw" "$zdir/z-$cs.qcow2"
    ZIMG=$zdir/z-$cs.qcow2 pairs "qcow2 perf, compressed ($cs clusters): 4 KiB seq read QD1" qperf 4096
    ZIMG=$zdir/z-$cs.qcow2 pairs "qcow2 perf, compressed ($cs clusters): 128 KiB seq read QD1" qperf 131072
  done
  rm -rf "$zdir"
fi
