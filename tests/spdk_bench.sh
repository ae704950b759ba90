#!/usr/bin/env bash
# Side-by-side bdevperf figures for the SPDK module: our qcow2 bdev and SPDK's passthru bdev
# over the same fully allocated image file (two AIO bdevs on it), on one core; prints IOPS
# and the ratio qcow2/passthru for each workload, measured both in the same bdevperf run
# ("together", sharing the core) and in alternating runs of one bdev each ("alone").
#
#   tests/spdk_bench.sh                       # image in a temporary directory
#   BENCH_DIR=/dev/shm/qb tests/spdk_bench.sh # image in RAM (tmpfs): shows our CPU cost best
#   SIZE=4G TIME=10 tests/spdk_bench.sh
#   SKIP_AIO=1 tests/spdk_bench.sh            # only the malloc figures
#   SKIP_OVERLAY=1 tests/spdk_bench.sh        # without the lone-overlay figures
#   SKIP_LVOL=1 tests/spdk_bench.sh           # without the thin-lvol comparison
#   SKIP_2CORE=1 tests/spdk_bench.sh          # without the two-core (-m 0x3 -C) figures
#   SKIP_WRITABLE=1 tests/spdk_bench.sh       # without the writable-vs-passthru figures
#   SKIP_NVMF=1 tests/spdk_bench.sh           # without the zero-offload figure (NVMe-oF)
#   FIRST_LAT="20 80" tests/spdk_bench.sh     # delay-bdev latencies (µs) for first writes
#   ROUNDS=5 tests/spdk_bench.sh              # processes (rounds), fresh vs full (3)
#   FRESH_CLUSTERS=4096 tests/spdk_bench.sh   # cluster sizes of fresh vs full (4096 65536)
#   PAIRS=20 PAIR_SECS=2 tests/spdk_bench.sh  # interleaved qcow2/passthru runs per figure
#   AGED=1 tests/spdk_bench.sh                # also images filled by random 4 KiB writes
#   SKIP_FRESH=1 SKIP_PREALLOC=1 tests/spdk_bench.sh  # only the aged malloc figures
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
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
SIZE=${SIZE:-1G}
TIME=${TIME:-5}
DIR=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$DIR"
trap 'rm -f "$DIR/full.qcow2" "$DIR/golden.raw" "$DIR/overlay.qcow2"' EXIT

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
      --json "${PERF_JSON:-$DIR/perf.json}" -m 0x1 -q 32 -o "$o" -w "$w" -t "$TIME" "$@" >"$out" 2>&1; then
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

if [ -z "${SKIP_AIO:-}" ]; then
  echo "base: $img (${SIZE}, fully allocated), one core, 0 failures"
  run randread 4096
  run randread 512
  run read 65536
fi

# --- One VM on a golden image ---------------------------------------------------------------
# An empty qcow2 overlay (aio bdev ov) whose backing bdev is a raw golden image (aio bdev g0),
# as an operator gives one VM a thin disk on a shared base, against passthru on the golden
# file itself (aio bdev g1): every read goes through the overlay to the golden bdev. Alone,
# alternating processes (passthru, overlay, passthru, overlay); means compared.
overlay_run() {
  local w=$1 o=$2 out=$DIR/bdevperf.txt qa=0 pa=0
  for _ in 1 2; do
    PERF_JSON=$DIR/overlay.json bench "$out" "$w" "$o" -T p0
    pa=$(awk -v a="$pa" -v b="$(iops "$out" p0)" 'BEGIN {print a + b / 2}')
    PERF_JSON=$DIR/overlay.json bench "$out" "$w" "$o" -T q0
    qa=$(awk -v a="$qa" -v b="$(iops "$out" q0)" 'BEGIN {print a + b / 2}')
  done
  awk -v w="$w" -v o="$o" -v qa="$qa" -v pa="$pa" 'BEGIN {
    printf "%-9s %6s B QD32 | alone: overlay %8.0f passthru on the golden image %8.0f IOPS ratio %.3f\n",
      w, o, qa, pa, qa / pa }'
}

if [ -z "${SKIP_OVERLAY:-}" ]; then
  golden=$DIR/golden.raw
  qemu-img create -q -f raw -o preallocation=falloc "$golden" "$SIZE"
  qemu-img create -q -u -f qcow2 -b "$golden" -F raw "$DIR/overlay.qcow2" "$SIZE"
  truncate -s %512 "$DIR/overlay.qcow2"
  printf '{"subsystems":[{"subsystem":"bdev","config":[
{"method":"bdev_aio_create","params":{"name":"g0","filename":"%s","block_size":512}},
{"method":"bdev_aio_create","params":{"name":"g1","filename":"%s","block_size":512}},
{"method":"bdev_aio_create","params":{"name":"ov","filename":"%s","block_size":512}},
{"method":"bdev_qcow2_create","params":{"name":"q0","base_bdev":"ov","backing_bdev":"g0"}},
{"method":"bdev_passthru_create","params":{"name":"p0","base_bdev_name":"g1"}},
{"method":"bdev_wait_for_examine"}]}]}' "$golden" "$golden" "$DIR/overlay.qcow2" >"$DIR/overlay.json"
  echo "one VM: an empty overlay over a raw golden image ($golden, ${SIZE}), one core, 0 failures"
  overlay_run randread 4096
  overlay_run read 65536
  rm -f "$golden" "$DIR/overlay.qcow2"
fi

# --- Writable bdevs on a malloc base -------------------------------------------------------
# A malloc bdev forgets everything when bdevperf exits, so each image is formatted
# (bdev_qcow2_format), filled and measured inside one `bdevperf -z` process, driven by
# bdevperf.py perform_tests. The passthru baseline runs in its own process on an identical
# malloc bdev (raw: it needs no image), so these ratios are "alone", alternating processes.
BDEVPERF_PY=${BDEVPERF_PY:-/opt/spdk-src/examples/bdev/bdevperf/bdevperf.py}
if [ ! -f "$BDEVPERF_PY" ]; then
  echo "SKIPPED (malloc figures): bdevperf.py not found (set BDEVPERF_PY)"
  exit 0
fi

# zbench NAME CONFIG-CALLS: starts `bdevperf -z` on one core over the calls, job on bdev NAME
# (NAME empty: on every bdev nothing else claimed, at each perform_tests).
zbench_start() {
  local name=$1 calls=$2
  printf '{"subsystems":[{"subsystem":"bdev","config":[%s,{"method":"bdev_wait_for_examine"}]}]}' \
    "$calls" >"$DIR/z.json"
  rm -f "$DIR/z.sock"
  # Long enough for section 2's seven rows of PAIRS pairs of runs (and their RPCs) in one
  # process.
  timeout -k 5 $((600 + ${PAIRS:-30} * 7 * (2 * ${PAIR_SECS:-1} + 2))) env LD_PRELOAD="$SO" bdevperf -u "${ZMEM[@]}" --json "$DIR/z.json" \
    -r "$DIR/z.sock" -z -m "${ZMASK:-0x1}" ${ZMULTI:-} ${name:+-T "$name"} -q 32 -o 4096 -w randread -t "$TIME" >"$DIR/z.log" 2>&1 &
  ZPID=$!
  for _ in $(seq 100); do [ -S "$DIR/z.sock" ] && break; sleep 0.2; done
}
# zrun WORKLOAD IOSIZE SECS [QD]: one perform_tests; prints the IOPS of all its jobs (one
# per core with -C; fails on errors).
zrun() {
  local out
  out=$(timeout 120 /usr/bin/python3 "$BDEVPERF_PY" -s "$DIR/z.sock" -t 100 perform_tests \
    -w "$1" -o "$2" -t "$3" -q "${4:-32}")
  echo "$out" | /usr/bin/python3 -c '
import json, sys
rs = [r for r in json.load(sys.stdin)["results"] if "iops" in r]
for r in rs:
    if r.get("io_failed", 0) or r.get("io_timeout", 0):
        sys.exit("failed I/O: %s" % r)
print("%.0f" % sum(r["iops"] for r in rs))'
}
# zrpc ARGS: rpc.py (with our plugin) on the running `bdevperf -z`.
zrpc() {
  PYTHONPATH=$PWD/configs/rpc_plugin timeout 60 /usr/bin/python3 \
    "${RPC_PY:-/opt/spdk-src/scripts/rpc.py}" -s "$DIR/z.sock" --plugin bdev_qcow2_rpc "$@" >/dev/null
}
# Hugepages when 2 GiB are free (the malloc bdevs below take up to 1.3 GiB), else 3 GiB of
# ordinary memory.
if [ "${free_mb%.*}" -ge 2048 ] && grep -q hugetlbfs /proc/mounts; then ZMEM=(); else ZMEM=(--no-huge -s 3072); fi
trap 'kill "${ZPID:-}" 2>/dev/null || true; rm -f "$DIR/full.qcow2" "$DIR/golden.raw" "$DIR/overlay.qcow2"' EXIT
zbench_stop() {
  kill "$ZPID" 2>/dev/null || true
  wait "$ZPID" 2>/dev/null || true
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }

MALLOC=1280 # MiB
if [ -z "${SKIP_WRITABLE:-}" ] && [ -z "${SKIP_FRESH:-}" ]; then
# 1. First writes vs overwrites, 1 GiB image: fresh, then filled sequentially, then the same
#    run again; ROUNDS (3) processes. With 4 KiB clusters every write of a 1 s run
#    that lands on a new cluster allocates one (about half of them); with 64 KiB clusters
#    (the default) the first ~16 k writes allocate one and write their 4 KiB alone (the
#    format zeroed the malloc: a zeroed tail).
#    Each round prints its own line (FRESH_ROUND); the summary gives the medians of both
#    sides and of the rounds' ratios, with the ratios' quartiles. ZMASK=0x3 ZMULTI=-C runs
#    one job per core on two cores.
for cs in ${FRESH_CLUSTERS:-4096 65536}; do
  : >"$DIR/fresh.txt"
  for r in $(seq "${ROUNDS:-3}"); do
    zbench_start q0 "{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m0\",\"num_blocks\":$((MALLOC * 2048)),\"block_size\":512}},
{\"method\":\"bdev_qcow2_format\",\"params\":{\"base_bdev\":\"m0\",\"size\":1073741824,\"cluster_size\":$cs}},
{\"method\":\"bdev_qcow2_create\",\"params\":{\"name\":\"q0\",\"base_bdev\":\"m0\"}}"
    fresh=$(zrun randwrite 4096 1)
    zrun write 1048576 4 8 >/dev/null
    full=$(zrun randwrite 4096 1)
    zbench_stop
    echo "$fresh $full" >>"$DIR/fresh.txt"
    echo "FRESH_ROUND $((cs / 1024))K $r: fresh $fresh full $full ratio $(ratio "$fresh" "$full")"
  done
  set -- $(/usr/bin/python3 - "$DIR/fresh.txt" <<'PY'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
r = sorted(f / a for f, a in rows)
qs = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
print("%.0f %.0f %.3f %.3f %.3f" % (statistics.median(f for f, _ in rows),
      statistics.median(a for _, a in rows), statistics.median(r), qs[0], qs[2]))
PY
)
  echo "malloc, qcow2 $((cs / 1024))K clusters, 1 GiB, ${ZMASK:-0x1}${ZMULTI:+ $ZMULTI}: randwrite 4096 B QD32 1 s: fresh image $1 IOPS, fully allocated $2 IOPS, ratio $3 (median of ${ROUNDS:-3} rounds; quartiles $4-$5)"
done
fi

# 2. Writable qcow2 (64 KiB clusters, 512 MiB, fully allocated) vs passthru on the same
#    kind of base, then the same image reopened read-only vs passthru. On one core, then on
#    two cores with one job per core on the bdev (-m 0x3 -C): the second core's channel
#    serves reads and overwrites on its own replica.
#    Interleaved in one `bdevperf -z` process: it holds the image on malloc m0 and an
#    identical raw malloc m1, and the job's bdev X is either our bdev on m0 or SPDK's
#    passthru on m1, swapped by RPC between runs of PAIR_SECS (1) s, in the order q p p q
#    q p ... for PAIRS (30) pairs per workload. Both sides thus share the process, its
#    memory and the same minutes of a shared machine, whose speed drifts by tens of per
#    cent over seconds; the figure is the median of the pairs' ratios, with the quartiles
#    (IOPS are the medians of each side). Our bdev is created afresh for each of its runs,
#    so each starts with a cold slice cache: 16 slice loads for this image, a few dozen
#    of the millions of requests in a run.
#    Fully allocated two ways (ZPRE): formatted with preallocation "full" (the clusters in
#    guest order, as an operator preallocates), then written once like the passthru's base;
#    or ("off") allocated by that write, 1 MiB sequential writes at QD8 — from one job on
#    one core (guest order again), but from two jobs racing over the same range with -C,
#    which interleaves their allocations: a fragmented layout (hundreds of extents), whose
#    look-ups load the L2 entry where a linear slice needs none.
# use_q [--read-only] / use_p: X becomes our bdev on m0 / passthru on m1 (XNOW says which
# it is: "q", "q --read-only" or "p").
drop_x() {
  case "$XNOW" in
    q*) zrpc bdev_qcow2_delete X ;;
    p) zrpc bdev_passthru_delete X ;;
  esac
  XNOW=
}
use_q() {
  [ "$XNOW" = "q${1:+ $1}" ] && return
  drop_x
  zrpc bdev_qcow2_create -b X --base-bdev m0 "$@"
  XNOW="q${1:+ $1}"
}
use_p() {
  [ "$XNOW" = p ] && return
  drop_x
  zrpc bdev_passthru_create -b m1 -p X
  XNOW=p
}
# pairs W O [--read-only]: PAIRS interleaved pairs; prints "q_median p_median ratio_median q1 q3".
pairs() {
  local w=$1 o=$2 i q p
  shift 2
  : >"$DIR/pairs.txt"
  for i in $(seq "${PAIRS:-30}"); do
    if [ $((i % 2)) = 1 ]; then
      use_q "$@"; q=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
      use_p; p=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
    else
      use_p; p=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
      use_q "$@"; q=$(zrun "$w" "$o" "${PAIR_SECS:-1}")
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
interleaved_vs_passthru() {
  local label=$1 w o wo
  zbench_start X "{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m0\",\"num_blocks\":$((640 * 2048)),\"block_size\":512}},
{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m1\",\"num_blocks\":$((512 * 2048)),\"block_size\":512}},
{\"method\":\"bdev_qcow2_format\",\"params\":{\"base_bdev\":\"m0\",\"size\":536870912,\"preallocation\":\"${ZPRE:-full}\"}},
{\"method\":\"bdev_qcow2_create\",\"params\":{\"name\":\"X\",\"base_bdev\":\"m0\"}}"
  XNOW=q
  # ZFILL (e.g. "randwrite 4096 3"): a first fill in the guest's own order (QD32), before
  # the sequential pass allocates whatever it left.
  [ -n "${ZFILL:-}" ] && zrun $ZFILL >/dev/null
  zrun write 1048576 3 8 >/dev/null
  use_p
  zrun write 1048576 3 8 >/dev/null # the same first touch of the malloc memory as m0 had
  for w in randread randwrite; do for o in 4096 512; do
    set -- $(pairs $w $o)
    echo "malloc, writable qcow2 (filled) vs passthru, $label QD32: $w $o B: qcow2 $1 passthru $2 IOPS, ratio $3 (median of ${PAIRS:-30} interleaved pairs; quartiles $4-$5)"
  done; done
  for wo in "randread 4096" "randread 512" "read 65536"; do
    set -- $(pairs $wo --read-only) $wo
    echo "malloc, read-only qcow2 (filled) vs passthru, $label QD32: $6 $7 B: qcow2 $1 passthru $2 IOPS, ratio $3 (median of ${PAIRS:-30} interleaved pairs; quartiles $4-$5)"
  done
  zbench_stop
}
if [ -z "${SKIP_WRITABLE:-}" ]; then
  if [ -z "${SKIP_PREALLOC:-}" ]; then
    interleaved_vs_passthru "one core, preallocated"
    if [ -z "${SKIP_2CORE:-}" ] && [ "$(nproc)" -ge 2 ]; then
      ZMASK=0x3 ZMULTI=-C interleaved_vs_passthru "two cores (-C), preallocated"
    fi
  fi
  # Aged layouts made in place: two racing sequential writers, and random 4 KiB first
  # writes (then the sequential pass fills the rest); tests/aged_bench.sh has QEMU's.
  if [ -z "${SKIP_2CORE:-}" ] && [ "$(nproc)" -ge 2 ]; then
    ZPRE=off ZMASK=0x3 ZMULTI=-C interleaved_vs_passthru "two cores (-C), filled by two writers"
  fi
  if [ -n "${AGED:-}" ]; then
    ZPRE=off ZFILL="randwrite 4096 3" interleaved_vs_passthru "one core, filled by random 4 KiB writes"
    if [ -z "${SKIP_2CORE:-}" ] && [ "$(nproc)" -ge 2 ]; then
      ZPRE=off ZFILL="randwrite 4096 3" ZMASK=0x3 ZMULTI=-C interleaved_vs_passthru "two cores (-C), filled by random 4 KiB writes"
    fi
  fi
fi

# 3. Zero offload on an nvme bdev: spdk_tgt on core 0 exports a malloc namespace over
#    NVMe-oF/TCP on 127.0.0.1; bdevperf on core 1 attaches it (bdev_nvme_attach_controller),
#    formats a fresh 1 GiB image with 64 KiB clusters on it and runs 4 KiB random writes
#    (QD32, 2 s: first writes, then overwrites) with `zero_offload` on and off, in
#    alternating processes (ZO_PAIRS pairs, default 6, after one pair not counted). On, a
#    partial first write leaves the rest of its cluster to Write Zeroes commands; off, it
#    writes the cluster whole.
if [ -z "${SKIP_NVMF:-}" ] && command -v spdk_tgt >/dev/null && [ "$(nproc)" -ge 2 ]; then
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  nqn=nqn.2016-06.io.spdk:qcow2-bench
  rm -f "$DIR/tgt.sock"
  timeout -k 5 1200 spdk_tgt --no-huge -s 4096 -m 0x1 --disable-cpumask-locks -r "$DIR/tgt.sock" >"$DIR/tgt.log" 2>&1 &
  TPID=$!
  for _ in $(seq 100); do [ -S "$DIR/tgt.sock" ] && break; sleep 0.2; done
  trpc() { timeout 60 /usr/bin/python3 "${RPC_PY:-/opt/spdk-src/scripts/rpc.py}" -s "$DIR/tgt.sock" "$@" >/dev/null; }
  trpc bdev_malloc_create -b m0 1100 512
  trpc nvmf_create_transport -t TCP
  trpc nvmf_create_subsystem "$nqn" -a -s QCOW2BENCH01
  trpc nvmf_subsystem_add_ns "$nqn" m0
  trpc nvmf_subsystem_add_listener "$nqn" -t tcp -f ipv4 -a 127.0.0.1 -s "$port"
  : >"$DIR/zo.txt"
  # A first run, not counted, touches the target's malloc (page faults) where the images go.
  for i in $(seq 0 "${ZO_PAIRS:-6}"); do
    line=""
    for zo in true false; do
      printf '{"subsystems":[{"subsystem":"bdev","config":[
{"method":"bdev_nvme_attach_controller","params":{"name":"nvme0","trtype":"tcp","adrfam":"ipv4","traddr":"127.0.0.1","trsvcid":"%s","subnqn":"%s"}},
{"method":"bdev_qcow2_format","params":{"base_bdev":"nvme0n1","size":1073741824,"cluster_size":65536}},
{"method":"bdev_qcow2_create","params":{"name":"X","base_bdev":"nvme0n1","zero_offload":%s}},
{"method":"bdev_wait_for_examine"}]}]}' "$port" "$nqn" "$zo" >"$DIR/zo.json"
      timeout -k 5 120 env LD_PRELOAD="$SO" bdevperf -u --no-huge -s 1024 --disable-cpumask-locks \
        --json "$DIR/zo.json" -m 0x2 -T X -q 32 -o 4096 -w randwrite -t 2 >"$DIR/zo.out" 2>&1 ||
        { cat "$DIR/zo.out"; echo "bdevperf failed" >&2; exit 1; }
      line="$line $(iops "$DIR/zo.out" X)"
    done
    [ "$i" = 0 ] || echo "$line" >>"$DIR/zo.txt"
  done
  kill "$TPID" 2>/dev/null || true
  wait "$TPID" 2>/dev/null || true
  /usr/bin/python3 - "$DIR/zo.txt" <<'PY'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
r = sorted(a / b for a, b in rows)
qs = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
print("zero offload, qcow2 (64 KiB clusters, 1 GiB, fresh) on an nvme bdev (NVMe-oF/TCP "
      "loopback to a malloc namespace), randwrite 4096 B QD32 2 s: on %.0f off %.0f IOPS "
      "(means), ratio on/off %.3f (median of %d alternating pairs; quartiles %.3f-%.3f)"
      % (statistics.mean(a for a, _ in rows), statistics.mean(b for _, b in rows),
         statistics.median(r), len(r), qs[0], qs[2]))
PY
fi

# 4. First writes: a fresh thin-provisioned lvol vs a freshly formatted qcow2 image, both
#    with 64 KiB clusters (LVS_CLUSTER), each in its own process, QD32 for 1 s:
#    - sequential 64 KiB writes on 8 GiB volumes (FIRST_GIB) over a malloc of 9 GiB of
#      ordinary memory: a 1 s run stays below the end of the volume, so every write
#      allocates one new cluster (pure first writes); on the bare malloc and over a delay
#      bdev with NVMe-like write latency (FIRST_LAT, µs; default "20 80"), where the
#      allocation's metadata writes cost what they cost on a device;
#    - 4 KiB random writes on the same 8 GiB volumes, bare and with the same latencies:
#      most of a 1 s run's writes are first writes to their cluster (131072 of them). Both
#      write the 4 KiB alone: a thin lvol on an lvstore made with --clear-method none
#      trusts the malloc to read as zeros (it does not: the malloc was written first, see
#      below); the qcow2 format zeroes its base first (--zero-base, also through the delay
#      bdev) and records it, so its first writes into clusters never written need no zeros;
#    - 4 KiB random writes on 1 GiB volumes on the bare malloc: the first write to each
#      cluster allocates it, the rest (most of a 1 s run: ~16 k clusters, ~0.5 M writes)
#      overwrite.
[ -n "${SKIP_LVOL:-}" ] && exit 0
LVS_CLUSTER=${LVS_CLUSTER:-65536}
# first_writes KIND LAT_US WORKLOAD IOSIZE [QCOW2-PARAMS]: IOPS of one fresh lvol (KIND=lvol),
# qcow2 image (KIND=qcow2) of VOL_MIB, or of the base itself (KIND=raw: the bound, nothing
# allocated), on a malloc of VOL_MIB + 256 MiB. The malloc is written once
# first, so neither side pays the first touch of the memory (page faults); the lvstore is
# created without clearing (the malloc is zeroed already).
VOL_MIB=1024
first_writes() {
  zbench_start "" "{\"method\":\"bdev_malloc_create\",\"params\":{\"name\":\"m0\",\"num_blocks\":$(((VOL_MIB + 256) * 2048)),\"block_size\":512}}"
  zrun write 1048576 $((VOL_MIB / 2048 + 2)) 8 >/dev/null
  local base=m0
  if [ "$2" != 0 ]; then
    zrpc bdev_delay_create -b m0 -d d0 -r "$2" -t "$2" -w "$2" -n "$2"
    base=d0
  fi
  if [ "$1" = raw ]; then
    : # the base itself: the same writes with no allocation at all (the bound)
  elif [ "$1" = lvol ]; then
    zrpc bdev_lvol_create_lvstore "$base" lvs0 -c "$LVS_CLUSTER" --clear-method none
    zrpc bdev_lvol_create -l lvs0 -t l0 "$VOL_MIB"
  else
    zrpc bdev_qcow2_format "$base" -s $((VOL_MIB << 20)) --cluster-size "$LVS_CLUSTER" --zero-base ${5:-}
    zrpc bdev_qcow2_create -b q0 --base-bdev "$base"
  fi
  zrun "$3" "$4" 1
  zbench_stop
}
SAVED_ZMEM=("${ZMEM[@]}")
ZMEM=(--no-huge -s $((${FIRST_GIB:-8} * 1024 + 2048)))
VOL_MIB=$((${FIRST_GIB:-8} * 1024))
for lat in 0 ${FIRST_LAT:-20 80}; do
  l=$(first_writes lvol "$lat" write "$LVS_CLUSTER")
  q=$(first_writes qcow2 "$lat" write "$LVS_CLUSTER")
  r=$(first_writes raw "$lat" write "$LVS_CLUSTER")
  echo "first writes, sequential $LVS_CLUSTER B (one new cluster each), $VOL_MIB MiB volumes, QD32 1 s, malloc + ${lat} µs latency: qcow2 $q IOPS, thin lvol $l IOPS, ratio qcow2/lvol $(ratio "$q" "$l"); the base itself (no allocation) $r IOPS: qcow2/base $(ratio "$q" "$r"), lvol/base $(ratio "$l" "$r")"
  # 4 KiB random writes over the same fresh volumes: most of a 1 s run's writes land in a
  # cluster not written before (131072 clusters), as a guest's first random writes do.
  l=$(first_writes lvol "$lat" randwrite 4096)
  q=$(first_writes qcow2 "$lat" randwrite 4096)
  echo "first writes, random 4096 B, $VOL_MIB MiB volumes, QD32 1 s, malloc + ${lat} µs latency: qcow2 $q IOPS, thin lvol $l IOPS, ratio qcow2/lvol $(ratio "$q" "$l")"
done
ZMEM=("${SAVED_ZMEM[@]}")
VOL_MIB=1024
lvol=$(first_writes lvol 0 randwrite 4096)
for v in "64 KiB clusters|" "64 KiB clusters, extended L2|--extended-l2"; do
  q=$(first_writes qcow2 0 randwrite 4096 "${v#*|}")
  echo "fresh volumes, randwrite 4096 B QD32 1 s (first writes, then overwrites), malloc: qcow2 (${v%%|*}) $q IOPS, thin lvol ($LVS_CLUSTER B clusters) $lvol IOPS, ratio qcow2/lvol $(ratio "$q" "$lvol")"
done
