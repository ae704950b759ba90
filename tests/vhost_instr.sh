#!/usr/bin/env bash
# Instructions per request on the server side of vhost-user-blk: spdk_tgt with our module
# vs spdk_tgt with SPDK's passthru over a copy of the same file (the limit of the vhost
# path), both under valgrind's callgrind, the same client (bdevperf with SPDK's virtio-user
# initiator on core 1, page-aligned buffers, not under valgrind) doing the same workload.
# IOPS on a shared 2-core machine move by tens of per cent between minutes; a count does
# not, so this shows what our side of the vhost path costs that passthru does not.
#
# The count covers the whole reactor (vhost's virtqueue poller, the bdev layer, our bdev or
# the passthru, the AIO bdev, every poller's idle passes) over a window of WIN seconds that
# starts once the client runs; requests are the window's vhost-blk completions
# (blk_request_complete_cb calls). It also prints the reactor iterations per request (the
# count includes every poller's idle passes: a server that is not saturated, e.g. because a
# loaded machine slows the client, runs more of them per request) and, per request, the
# functions whose inclusive cost differs most between the two servers.
#
#   tests/vhost_instr.sh                           # randread 4096 QD32, 1 GiB image on tmpfs
#   ARGS="-q 1 -o 4096 -w randread" tests/vhost_instr.sh
#   ARGS="-q 32 -o 512 -w randread" WIN=8 tests/vhost_instr.sh
#   CACHE=1 tests/vhost_instr.sh                   # and simulated cache misses per request
#   CACHE=1 KEEP=/tmp/vi tests/vhost_instr.sh      # keeps each server's callgrind output
#                                                  # (ours.out, pt.out): misses per source
#                                                  # line with callgrind_annotate --show=D1mr
#
# CACHE=1 runs callgrind with its cache simulation (--cache-sim=yes; the machine's VM has no
# hardware counters for perf stat): per request, the server's L1 data misses (reads, writes)
# and last-level misses, and the functions whose inclusive L1 read misses differ most.
#
# Needs SPDK (spdk_tgt, bdevperf, spdk-rpc or rpc.py), valgrind, qemu-img, cc; prints SKIPPED
# without them. Run it under `flock /tmp/spdk-app.lock` (one SPDK application pair at a time).
set -euo pipefail
cd "$(dirname "$0")/.."

for b in spdk_tgt bdevperf valgrind callgrind_annotate callgrind_control qemu-img cc; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done
RPC=${SPDK_RPC:-$(command -v spdk-rpc || command -v rpc.py || true)}
[ -n "$RPC" ] || { echo "SKIPPED: rpc.py not found (set SPDK_RPC)"; exit 0; }
pkg-config --exists spdk_bdev 2>/dev/null || { echo "SKIPPED: SPDK not installed"; exit 0; }

cargo build --release -q -p bdev_qcow2
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
ARGS=${ARGS:--q 32 -o 4096 -w randread}
WIN=${WIN:-6}
SIZE=${SIZE:-1G}
WORK=$(mktemp -d /tmp/vhost_instr.XXXXXX)
IMG=$(mktemp -d /dev/shm/vhost_instr.XXXXXX)
SP=
CP=
cleanup() {
  for p in $SP $CP; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK" "$IMG"
}
trap cleanup EXIT

cat >"$WORK/align.c" <<'EOF'
#include <stddef.h>
struct spdk_bdev;
size_t spdk_bdev_get_buf_align(const struct spdk_bdev *bdev) { (void)bdev; return 4096; }
EOF
cc -O2 -shared -fPIC -o "$WORK/align.so" "$WORK/align.c"
qemu-img create -q -f qcow2 -o preallocation=falloc "$IMG/ours.qcow2" "$SIZE"
cp "$IMG/ours.qcow2" "$IMG/pt.qcow2"

# count KIND: runs server KIND under callgrind with the client; leaves $WORK/KIND.tree (the
# window's calling tree) and prints the instructions per request.
count() {
  local kind=$1 bdev d=$WORK/$1
  mkdir -p "$d/vhost"
  if [ "$kind" = ours ]; then
    bdev='{"method": "bdev_qcow2_create", "params": {"name": "d0", "base_bdev": "aio0"}}'
  else
    bdev='{"method": "bdev_passthru_create", "params": {"name": "d0", "base_bdev_name": "aio0"}}'
  fi
  cat >"$d/server.json" <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
 {"method": "bdev_aio_create", "params": {"filename": "$IMG/$kind.qcow2", "name": "aio0", "block_size": 512}},
 $bdev,
 {"method": "bdev_wait_for_examine"}]}]}
EOF
  # Started without a wrapper, so that $! is valgrind's own process (callgrind_control's).
  # shellcheck disable=SC2086
  LD_PRELOAD="$SO" valgrind --tool=callgrind ${CACHE:+--cache-sim=yes} --callgrind-out-file="$d/cg.out" \
    spdk_tgt -m 0x1 --no-huge -s 1024 -S "$d/vhost" -r "$d/spdk.sock" --json "$d/server.json" \
    >"$d/server.log" 2>&1 &
  SP=$!
  for _ in $(seq 300); do
    "$RPC" -s "$d/spdk.sock" -t 5 framework_wait_init >/dev/null 2>&1 && break
    sleep 0.3
  done
  "$RPC" -s "$d/spdk.sock" -t 60 vhost_create_blk_controller --cpumask 0x1 d0 d0 >/dev/null
  cat >"$d/client.json" <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
 {"method": "bdev_virtio_attach_controller", "params": {"name": "V", "trtype": "user",
  "traddr": "$d/vhost/d0", "dev_type": "blk", "vq_count": 2, "vq_size": 256}}]}]}
EOF
  # shellcheck disable=SC2086
  env LD_PRELOAD="$WORK/align.so" bdevperf -m 0x2 -g -s 1024 --json "$d/client.json" \
    -t $((WIN + 60)) $ARGS >"$d/client.log" 2>&1 &
  CP=$!
  # Connecting to a server under valgrind takes a while: count from 2 s after the run began.
  for _ in $(seq 600); do grep -qs "Running I/O" "$d/client.log" && break; sleep 0.5; done
  grep -q "Running I/O" "$d/client.log" || { tail "$d/client.log"; echo "client did not start" >&2; exit 1; }
  sleep 2
  callgrind_control -z "$SP" >/dev/null
  sleep "$WIN"
  callgrind_control -d "$SP" >/dev/null
  kill -9 "$CP" "$SP" 2>/dev/null || true
  wait "$CP" "$SP" 2>/dev/null || true
  CP= SP=
  local out
  out=$(ls -t "$d"/cg.out.* | head -1)
  [ -z "${KEEP:-}" ] || { mkdir -p "$KEEP" && cp "$out" "$KEEP/$kind.out"; }
  callgrind_annotate --auto=no --inclusive=yes --tree=calling --threshold=100 --show=Ir \
    "$out" 2>/dev/null >"$d.tree"
  if [ -n "${CACHE:-}" ]; then
    callgrind_annotate --auto=no --inclusive=yes --tree=calling --threshold=100 --show=D1mr \
      "$out" 2>/dev/null >"$d.d1tree"
    # Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw, the whole window.
    awk '/^summary:/ {$1 = ""; print; exit}' "$out" >"$d.totals"
  fi
  local n total
  n=$(grep -E "> +[^ ]*vhost_blk.c:blk_request_complete_cb \(" "$d.tree" |
    sed -E 's/.*\(([0-9,]+)x\).*/\1/' | tr -d , | awk '{s += $1} END {print s + 0}')
  total=$(awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}' "$d.tree")
  [ "$n" -gt 0 ] || { echo "no request completed in the window" >&2; exit 1; }
  echo "$n" >"$d.n"
  # Reactor iterations (each takes one look at the reactor's event ring): idle passes of
  # every poller are part of the count, so compare runs whose iterations per request match.
  grep -E "\* .*reactor.c:reactor_run " -A8 "$d.tree" | grep -E "> .*spdk_ring_dequeue" |
    sed -E 's/.*\(([0-9,]+)x\).*/\1/' | tr -d , | head -1 >"$d.it"
  awk -v t="$total" -v n="$n" 'BEGIN {printf "%.0f", t / n}'
}

q=$(count ours)
p=$(count pt)
printf 'vhost-user-blk server, %s, %s s window: instructions per request: ours %d passthru %d ratio %.3f\n' \
  "$ARGS" "$WIN" "$q" "$p" "$(awk -v a="$q" -v b="$p" 'BEGIN {print a / b}')"
for k in ours pt; do
  awk -v k="$k" -v i="$(cat "$WORK/$k.it")" -v n="$(cat "$WORK/$k.n")" \
    'BEGIN {printf "%s: %d requests in the window, %.2f reactor iterations per request\n", k, n, i / n}'
done
# Inclusive cost per request of each function (its "*" line in the calling tree of TREE),
# side by side; the largest differences (at least MIN) first.
per_fn() {
  awk -v n="$(cat "$WORK/$1.n")" '/^ *[0-9,]+ .*\)  \*  / {v = $1; gsub(",", "", v)
      f = $0; sub(/.*\)  \*  /, "", f); sub(/ .*/, "", f); sub(/.*:/, "", f); c[f] += v / n}
    END {for (f in c) printf "%s %.1f\n", f, c[f]}' "$WORK/$1.$2" | sort
}
diffs() {
  join -a1 -a2 -e 0 -o 0,1.2,2.2 <(per_fn ours "$1") <(per_fn pt "$1") |
    awk -v m="$2" '{d = $2 - $3; a = d < 0 ? -d : d; if (a >= m) printf "%.1f %8.1f %8.1f %+8.1f  %s\n", a, $2, $3, d, $1}' |
    sort -k1,1gr | cut -d' ' -f2- | head -30
}
diffs tree 20 | { echo "    ours passthru     diff  function (inclusive instructions, per request)"; cat; }
if [ -n "${CACHE:-}" ]; then
  for k in ours pt; do
    awk -v k="$k" -v n="$(cat "$WORK/$k.n")" '{printf "%s per request: L1 data misses %.2f (reads %.2f, writes %.2f), LL data misses %.2f, L1 instruction misses %.2f\n", k, ($5 + $6) / n, $5 / n, $6 / n, ($8 + $9) / n, $4 / n}' "$WORK/$k.totals"
  done
  diffs d1tree 0.3 | { echo "    ours passthru     diff  function (inclusive L1 data read misses, per request)"; cat; }
fi
