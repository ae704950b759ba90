#!/usr/bin/env bash
# The golden row of tests/prefetch_bench.sh in instructions: an empty overlay (qcow2 on an
# aio bdev) over a raw golden bdev that a second spdk_tgt serves over NVMe-oF/TCP on
# loopback, 4 KiB sequential reads at QD1, bdevperf under callgrind (the target outside
# it), counted for SECS seconds after a 1 s warm-up. Prints the pass of our channel poller
# and the request's cycle (tests/golden_instr.py says why those two), which the machine's
# load does not move, where the row's IOPS move by several per cent between runs.
#
#   tests/golden_instr.sh                               # prefetch ring off
#   PREFETCH=on SECS=3 tests/golden_instr.sh
#   CREATE_EXTRA=',"backing_cache_size":0' tests/golden_instr.sh
#   BDEV_QCOW2_SO=/path/libbdev_qcow2.so KEEP=/tmp/cg.out tests/golden_instr.sh
#   CACHE=1 tests/golden_instr.sh                       # and simulated cache misses per request
#
# CACHE=1 runs callgrind with its cache simulation (--cache-sim=yes; the machine's VM has no
# hardware counters for perf stat): bdevperf's L1 data misses (reads, writes), last-level
# data misses and L1 instruction misses per request, the reactor's idle passes included.
#
# Runs SPDK applications: wrap it in `flock /tmp/spdk-run.lock` on a shared machine. Needs
# an installed SPDK (bdevperf, spdk_tgt, bdevperf.py), valgrind and qemu-img; prints
# SKIPPED without them. Builds the module in release mode unless BDEV_QCOW2_SO is given.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf spdk_tgt valgrind callgrind_control qemu-img; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done
RPC_PY=${RPC_PY:-$(command -v spdk-rpc || command -v rpc.py || echo /opt/spdk-src/scripts/rpc.py)}
BP_PY=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py}
[ -f "$BP_PY" ] || { echo "SKIPPED: bdevperf.py not found (set BDEVPERF_PY)"; exit 0; }

if [ -z "${BDEV_QCOW2_SO:-}" ]; then
  cargo build --release -q -p bdev_qcow2
fi
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
MB=${MB:-512}
NQN=nqn.2016-06.io.spdk:golden
PORT=${PORT:-4437}
DIR=$(mktemp -d)
TGT_PID=
ZPID=
cleanup() {
  [ -n "$ZPID" ] && kill -9 "$ZPID" 2>/dev/null
  [ -n "$TGT_PID" ] && kill "$TGT_PID" 2>/dev/null && wait "$TGT_PID" 2>/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT

# The target's golden malloc in hugepages when enough are free, else in ordinary memory.
free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge $((MB + 1024)) ] && grep -q hugetlbfs /proc/mounts; then TMEM=(); else TMEM=(--no-huge -s $((MB + 1024))); fi
spdk_tgt "${TMEM[@]}" --disable-cpumask-locks -m 0x1 -r "$DIR/tgt.sock" >"$DIR/tgt.log" 2>&1 &
TGT_PID=$!
for _ in $(seq 100); do [ -S "$DIR/tgt.sock" ] && break; sleep 0.2; done
rpc() { timeout 60 "$RPC_PY" -s "$DIR/tgt.sock" "$@" >/dev/null; }
rpc framework_wait_init
rpc bdev_malloc_create -b golden "$MB" 512
rpc nvmf_create_transport -t TCP
rpc nvmf_create_subsystem "$NQN" -a -s GOLDEN0001
rpc nvmf_subsystem_add_ns "$NQN" golden
rpc nvmf_subsystem_add_listener "$NQN" -t tcp -f ipv4 -a 127.0.0.1 -s "$PORT"

qemu-img create -q -u -f qcow2 -b golden.raw -F raw "$DIR/overlay.qcow2" "${MB}M"
truncate -s %512 "$DIR/overlay.qcow2"
pf=false
[ "${PREFETCH:-off}" = on ] && pf=true
printf '%s\n' '{"subsystems":[{"subsystem":"bdev","config":[' \
  "{\"method\":\"bdev_nvme_attach_controller\",\"params\":{\"name\":\"nvme0\",\"trtype\":\"tcp\",\"adrfam\":\"ipv4\",\"traddr\":\"127.0.0.1\",\"trsvcid\":\"$PORT\",\"subnqn\":\"$NQN\"}}," \
  "{\"method\":\"bdev_aio_create\",\"params\":{\"name\":\"ov\",\"filename\":\"$DIR/overlay.qcow2\",\"block_size\":512}}," \
  "{\"method\":\"bdev_qcow2_create\",\"params\":{\"name\":\"q0\",\"base_bdev\":\"ov\",\"backing_bdev\":\"nvme0n1\",\"prefetch\":$pf${CREATE_EXTRA:-}}}," \
  '{"method":"bdev_wait_for_examine"}]}]}' >"$DIR/overlay.json"

# Started without a wrapper, so that $! is valgrind's own process (callgrind_control's).
LD_PRELOAD="$SO" valgrind --tool=callgrind ${CACHE:+--cache-sim=yes} --callgrind-out-file="$DIR/all.out" \
  bdevperf -u --no-huge -s 1024 --disable-cpumask-locks -r "$DIR/bp.sock" -z \
  --json "$DIR/overlay.json" -m 0x2 -T q0 -q 1 -o 4096 -w read -t 1 >"$DIR/bp.log" 2>&1 &
ZPID=$!
for _ in $(seq 300); do [ -S "$DIR/bp.sock" ] && break; sleep 0.2; done
perform() { timeout 300 /usr/bin/python3 "$BP_PY" -s "$DIR/bp.sock" -t 290 perform_tests "$@"; }
# (The first run also waits for the overlay's opening, which our pollers run.)
perform -w read -o 4096 -t 1 -q 1 >/dev/null
callgrind_control -z "$ZPID" >/dev/null
perform -w read -o 4096 -t "${SECS:-5}" -q 1 >"$DIR/res.json"
callgrind_control -d "$ZPID" >/dev/null
kill "$ZPID" 2>/dev/null || true
wait "$ZPID" 2>/dev/null || true
ZPID=
out=$(ls -t "$DIR"/all.out?* | head -1)
[ -z "${KEEP:-}" ] || cp "$out" "$KEEP"
/usr/bin/python3 -c 'import json, sys
rs = [r for r in json.load(open(sys.argv[1]))["results"] if "iops" in r]
if any(r.get("io_failed", 0) for r in rs):
    sys.exit("failed I/O")' "$DIR/res.json"
res=$(python3 tests/golden_instr.py "$out")
echo "golden row (ring ${PREFETCH:-off}), 4 KiB seq read QD1 under callgrind: $res"
if [ -n "${CACHE:-}" ]; then
  # The summary's events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw.
  n=${res#requests }
  awk -v n="${n%% *}" '/^summary:/ {printf "per request: L1 data misses %.2f (reads %.2f, writes %.2f), LL data misses %.2f, L1 instruction misses %.2f\n", ($6 + $7) / n, $6 / n, $7 / n, ($9 + $10) / n, $5 / n; exit}' "$out"
fi
