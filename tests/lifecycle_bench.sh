#!/usr/bin/env bash
# Figures for the online life-cycle RPCs: guest 4 KiB random reads at queue depth 32 on two
# cores (bdevperf -m 0x3 -C) over a fully allocated image, in alternating runs of the
# same bdevperf process: one untouched ("before"), one during which internal snapshots are
# taken and deleted back to back ("during"). Prints the IOPS of each run, the median ratio
# during/before, and the I/O pause bdev_qcow2_snapshot_create reported (median, max µs).
# Then one external snapshot (bdev_qcow2_snapshot_external onto a second AIO bdev) during a
# run: the pause it reported, and the IOPS of ROUNDS runs on the overlay (every read goes
# through to the old image, now the overlay's read-only backing bdev) against ROUNDS runs
# just before the switch. The switch is one-way, so those runs cannot alternate: before all
# come first, then after (the machine is shared and noisy; read the ratio with that in mind).
#
# Then the stream: a fresh overlay over a golden raw image of random data (STREAM_SIZE) per
# round, in a second bdevperf process: random reads of the overlay before the stream (they
# read through to the golden image), then during `bdev_qcow2_stream` (STREAM_RATE bytes/s,
# 0: unlimited); prints both, the median ratio, and how long each stream took (a stream
# shorter than the run leaves the rest of the run on the streamed image: it says so).
#
#   tests/lifecycle_bench.sh
#   SIZE=4G TIME=5 ROUNDS=5 STREAM_SIZE=2G STREAM_RATE=0 tests/lifecycle_bench.sh
#   SIZE=4G TIME=5 ROUNDS=5 tests/lifecycle_bench.sh
#   SO=/other/target/release/libbdev_qcow2.so tests/lifecycle_bench.sh   # another build
#
# Needs an installed SPDK (bdevperf on PATH, bdevperf.py, rpc.py) and qemu-img; prints
# SKIPPED and exits 0 without them. Builds the module in release mode. Run it under
# `flock /tmp/spdk-app.lock` where other SPDK applications may run.
set -euo pipefail
cd "$(dirname "$0")/.."

BDEVPERF_PY=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py}
RPC=${SPDK_RPC:-$(command -v spdk-rpc || command -v rpc.py || true)}
if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"; exit 0
fi
for b in bdevperf qemu-img; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done
[ -f "$BDEVPERF_PY" ] && [ -n "$RPC" ] || { echo "SKIPPED: bdevperf.py or rpc.py not found"; exit 0; }

# SO=/path/to/libbdev_qcow2.so measures that build instead (a baseline, say).
if [ -z "${SO:-}" ]; then
  cargo build --release -q -p bdev_qcow2
  SO=$PWD/target/release/libbdev_qcow2.so
fi
SIZE=${SIZE:-1G}
TIME=${TIME:-4}
ROUNDS=${ROUNDS:-3}
DIR=$(mktemp -d)
SOCK=$DIR/b.sock
trap 'kill $PID 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$DIR"' EXIT

img=$DIR/full.qcow2
qemu-img create -q -f qcow2 -o preallocation=falloc "$img" "$SIZE"
truncate -s %512 "$img"
# Room on the (fixed-size) AIO bdev for each snapshot's L1 copy and table.
truncate -s +64M "$img"
cat >"$DIR/cfg.json" <<JSON
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_aio_create", "params": {"filename": "$img", "name": "aio0", "block_size": 512}},
  {"method": "bdev_qcow2_create", "params": {"name": "q0", "base_bdev": "aio0"}},
  {"method": "bdev_wait_for_examine"}]}]}
JSON
free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge 1024 ] && grep -q hugetlbfs /proc/mounts; then MEM=(); else MEM=(--no-huge -s 2048); fi

LD_PRELOAD=$SO bdevperf -u "${MEM[@]}" --json "$DIR/cfg.json" -r "$SOCK" -z -m 0x3 -C -T q0 \
  -q 32 -o 4096 -w randread -t "$TIME" >"$DIR/bdevperf.log" 2>&1 &
PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
sleep 0.5
rpc() { PYTHONPATH=configs/rpc_plugin "$RPC" -s "$SOCK" -t 60 --plugin bdev_qcow2_rpc "$@"; }

# run: one perform_tests; prints the total IOPS.
run() {
  python3 "$BDEVPERF_PY" -s "$SOCK" -t $((TIME + 60)) perform_tests >"$DIR/perf.json" 2>&1
  python3 - "$DIR/perf.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
v = json.loads(text[text.index('{'):])
print(sum(r.get('iops', 0) for r in v.get('results', [])))
PY
}

pauses=()
ratios=()
n=0
for r in $(seq "$ROUNDS"); do
  before=$(run)
  : >"$DIR/pauses"
  ( while [ ! -f "$DIR/stop" ]; do
      n=$((n + 1))
      out=$(rpc bdev_qcow2_snapshot_create -b q0 -n "b$r-$n" 2>&1) || { echo "snapshot_create: $out" >&2; break; }
      python3 -c 'import json,sys; print(json.loads(sys.argv[1])["pause_us"])' "$out" >>"$DIR/pauses"
      rpc bdev_qcow2_snapshot_delete -b q0 -n "b$r-$n" >/dev/null
    done ) &
  LOOP=$!
  during=$(run)
  touch "$DIR/stop"; wait $LOOP; rm -f "$DIR/stop"
  mapfile -t ps <"$DIR/pauses"
  pauses+=("${ps[@]}")
  ratio=$(python3 -c "print(f'{$during / $before:.3f}')")
  ratios+=("$ratio")
  echo "round $r: before ${before%.*} IOPS, during snapshots ${during%.*} IOPS (ratio $ratio; ${#ps[@]} snapshots, pauses ${ps[*]} us)"
done
python3 - "${ratios[*]}" "${pauses[*]}" <<'PY'
import statistics, sys
r = [float(x) for x in sys.argv[1].split()]
p = [int(x) for x in sys.argv[2].split()]
print(f"median ratio during/before: {statistics.median(r):.3f}")
if p:
    print(f"snapshot create pause: median {statistics.median(p):.0f} us, max {max(p)} us over {len(p)} snapshots")
PY

# External snapshot: the overlay's AIO bdev, with room for every cluster of the disk.
ov=$DIR/overlay.qcow2
truncate -s "$SIZE" "$ov"
truncate -s +64M "$ov"
rpc bdev_aio_create "$ov" aio1 512 >/dev/null
before_ext=()
for r in $(seq "$ROUNDS"); do before_ext+=("$(run)"); done
( sleep 1; rpc bdev_qcow2_snapshot_external -b q0 --base-bdev aio1 >"$DIR/ext.json" 2>&1 ) &
SW=$!
during_ext=$(run)
wait $SW || { cat "$DIR/ext.json" >&2; exit 1; }
after_ext=()
for r in $(seq "$ROUNDS"); do after_ext+=("$(run)"); done
python3 - "$DIR/ext.json" "${before_ext[*]}" "$during_ext" "${after_ext[*]}" <<'PY'
import json, statistics, sys
ans = json.loads(open(sys.argv[1]).read())
b = [float(x) for x in sys.argv[2].split()]
d = float(sys.argv[3])
a = [float(x) for x in sys.argv[4].split()]
print(f"external snapshot: I/O paused {ans['pause_us']} us (old image now {ans['snapshot']})")
print(f"  before {' '.join(f'{x:.0f}' for x in b)} IOPS; run with the switch {d:.0f}; "
      f"after (overlay over the old image) {' '.join(f'{x:.0f}' for x in a)}")
print(f"  median after/before: {statistics.median(a) / statistics.median(b):.3f}")
PY
rpc spdk_kill_instance SIGTERM >/dev/null 2>&1 || true
wait $PID || true

# --- Stream: random reads during bdev_qcow2_stream against before it -------------------
STREAM_SIZE=${STREAM_SIZE:-1G}
STREAM_RATE=${STREAM_RATE:-0}
golden=$DIR/golden.raw
head -c "$(numfmt --from=iec "$STREAM_SIZE")" /dev/urandom >"$golden"
SOCK=$DIR/s.sock
cat >"$DIR/scfg.json" <<JSON
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_aio_create", "params": {"filename": "$golden", "name": "gold", "block_size": 512}},
  {"method": "bdev_wait_for_examine"}]}]}
JSON
LD_PRELOAD=$SO bdevperf -u "${MEM[@]}" --json "$DIR/scfg.json" -r "$SOCK" -z -m 0x3 -C \
  -q 32 -o 4096 -w randread -t "$TIME" >"$DIR/bdevperf-stream.log" 2>&1 &
PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
sleep 0.5
sratios=()
for r in $(seq "$ROUNDS"); do
  ov=$DIR/ov$r.qcow2
  qemu-img create -q -f qcow2 -o backing_file="$golden",backing_fmt=raw "$ov" "$STREAM_SIZE"
  truncate -s %512 "$ov"
  truncate -s +"$STREAM_SIZE" "$ov"; truncate -s +64M "$ov"
  rpc bdev_aio_create "$ov" ov$r 512 >/dev/null
  rpc bdev_qcow2_create -b q$r --base-bdev ov$r --backing-bdev gold >/dev/null
  # The first reads of the golden image warm whatever caches lie below it: not measured.
  [ "$r" != 1 ] || run >/dev/null
  before=$(run)
  rpc bdev_qcow2_stream -b q$r -r "$STREAM_RATE" >/dev/null
  t0=$(date +%s.%N)
  ( while :; do
      st=$(rpc bdev_qcow2_get_stats -b q$r | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["owner"]["stream"]["state"])')
      case $st in copying|dropping_backing|detaching) sleep 0.1 ;; *) break ;; esac
    done
    python3 -c "import time; print(f'{time.time() - $t0:.2f}')" >"$DIR/stream_s" ) &
  LOOP=$!
  during=$(run)
  wait $LOOP
  secs=$(cat "$DIR/stream_s")
  ratio=$(python3 -c "print(f'{$during / $before:.3f}')")
  sratios+=("$ratio")
  echo "stream round $r: before ${before%.*} IOPS, during the stream ${during%.*} IOPS (ratio $ratio; the stream of $STREAM_SIZE took ${secs} s of the ${TIME} s run)"
  rpc bdev_qcow2_delete q$r >/dev/null
  rpc bdev_aio_delete ov$r >/dev/null
  rm -f "$ov"
done
python3 -c "import statistics, sys; r = [float(x) for x in sys.argv[1].split()]; print(f'stream: median ratio during/before: {statistics.median(r):.3f}')" "${sratios[*]}"
rpc spdk_kill_instance SIGTERM >/dev/null 2>&1 || true
wait $PID || true
