#!/usr/bin/env bash
# Deep chains of qcow2 bdevs (issue #48): 4 KiB random reads QD32 on one core (bdevperf)
# through a writable qcow2 bdev over a chain of D images, all data in the bottom image
# (SIZE, preallocated) under D-2 empty read-only qcow2 overlays; each image an AIO bdev on
# a file in /dev/shm and a qcow2 bdev over the one below. D=2 (the overlay straight over
# the data image: one bdev hop, as before) against the deep ones, in one run, alternating
# (2 D D 2 ...), ROUNDS rounds, medians.
#
# Per depth: the chain's files made by qemu-img (s), spdk's open of the whole config (the
# D AIO and qcow2 bdevs; s, until bdev_get_bdevs answers for the top), the first pass of
# reads (WARM s, every 64 KiB unit touched once: the layer index filled), then TIME s of
# reads after it (IOPS), and the target's resident memory (VmRSS, MiB).
#
#   tests/deep_chain_bench.sh
#   DEPTHS="2 100 500 1000" ROUNDS=3 TIME=5 tests/deep_chain_bench.sh
#   SIZE=1G tests/deep_chain_bench.sh
#
# Each bdevperf run takes /tmp/spdk-run.lock (LOCK) for its life only. Needs an installed
# SPDK (bdevperf, bdevperf.py, pkg-config spdk_bdev) and qemu-img (SKIPPED without them).
# Builds the module in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! pkg-config --exists spdk_bdev 2>/dev/null; then
  echo "SKIPPED: SPDK not installed (pkg-config spdk_bdev not found)"
  exit 0
fi
for b in bdevperf bdevperf.py qemu-img qemu-io; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done

DEPTHS=${DEPTHS:-"2 100 1000"}
ROUNDS=${ROUNDS:-3}
TIME=${TIME:-5}
WARM=${WARM:-3}
SIZE=${SIZE:-256M}
LOCK=${LOCK:-/tmp/spdk-run.lock}
DIR=$(mktemp -d -p /dev/shm)
trap 'rm -rf "$DIR"' EXIT

cargo build --release -q -p bdev_qcow2
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
# One open file per AIO bdev.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

# Every AIO bdev's channel is a kernel AIO context of 128 events (SPDK's io_setup). A layer
# takes its base's channel on a thread when a read there first reaches it, and the first
# pass reaches every layer on bdevperf's job thread, at most once more on the app thread
# (the owner's and the read-only bdevs' own reads): D = 1,000 needs up to 2 x 1,000 x 128
# of fs.aio-max-nr (65,536 by default: about 500 contexts).
# Raised when we may (root); otherwise the deeper depths are left out.
max_d=$(echo $DEPTHS | tr ' ' '\n' | sort -n | tail -1)
need=$((max_d * 2 * 128 + 16384))
if [ "$(cat /proc/sys/fs/aio-max-nr)" -lt "$need" ]; then
  if ! echo "$need" >/proc/sys/fs/aio-max-nr 2>/dev/null; then
    keep=$(( ($(cat /proc/sys/fs/aio-max-nr) - 16384) / 256 ))
    echo "fs.aio-max-nr too low for depth $max_d and not writable: depths above $keep left out" >&2
    DEPTHS=$(for d in $DEPTHS; do [ "$d" -le "$keep" ] && echo "$d"; done | tr '\n' ' ')
  fi
fi

free_mb=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
if [ "${free_mb%.*}" -ge 1024 ] && grep -q hugetlbfs /proc/mounts; then MEM=(-s 1024); else MEM=(--no-huge -s 2048); fi

now() { date +%s.%N; }

# make_chain D: the files of a chain of D images in $DIR/dD and its config; prints seconds.
make_chain() {
  local d=$1 dir=$DIR/d$1 t0
  t0=$(now)
  mkdir -p "$dir"
  qemu-img create -q -f qcow2 -o preallocation=falloc "$dir/l0.qcow2" "$SIZE"
  local i
  for ((i = 1; i < d; i++)); do
    # -u and the size: qemu-img would open the whole chain below for each new layer.
    qemu-img create -q -f qcow2 -u -b "$dir/l$((i - 1)).qcow2" -F qcow2 "$dir/l$i.qcow2" "$SIZE"
  done
  for f in "$dir"/l*.qcow2; do truncate -s %512 "$f"; done
  # The top (l$((d-1))) is the writable bdev q0; every image below a read-only qcow2 bdev.
  python3 - "$dir" "$d" >"$dir/cfg.json" <<'EOF'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
calls = []
for i in range(n):
    calls.append({"method": "bdev_aio_create",
                  "params": {"filename": f"{d}/l{i}.qcow2", "name": f"a{i}", "block_size": 512}})
    p = {"name": "q0" if i == n - 1 else f"l{i}", "base_bdev": f"a{i}"}
    if i > 0:
        p["backing_bdev"] = f"l{i - 1}"
    if i < n - 1:
        p["read_only"] = True
    calls.append({"method": "bdev_qcow2_create", "params": p})
calls.append({"method": "bdev_wait_for_examine"})
print(json.dumps({"subsystems": [{"subsystem": "bdev", "config": calls}]}))
EOF
  echo "$(now) - $t0" | bc
}

# iops OUT: the IOPS of q0 in bdevperf.py's answer.
iops() {
  python3 -c '
import json, sys
t = open(sys.argv[1]).read()
r = json.loads(t[t.index("{"):])
print(round(sum(j["iops"] for j in r["results"] if j["job"].startswith("q0") or "q0" in json.dumps(j))))
' "$1"
}

median() { tr ' ' '\n' | { grep -v '^$' || true; } | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

# run D: one bdevperf process over the chain of D; prints "open_s warm_iops iops rss_mib".
run() {
  local d=$1 dir=$DIR/d$1 sock=$DIR/bp.sock log=$DIR/bp.log t0 opened pid
  rm -f "$sock"
  t0=$(now)
  LD_PRELOAD="$SO" bdevperf -u "${MEM[@]}" -r "$sock" --json "$dir/cfg.json" -m 0x1 \
    -q 32 -o 4096 -w randread -t "$WARM" -T q0 -z >"$log" 2>&1 &
  pid=$!
  until [ -S "$sock" ] && spdk-rpc -s "$sock" -t 600 bdev_get_bdevs -b q0 >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "bdevperf died" >&2; exit 1; }
    sleep 0.05
  done
  opened=$(echo "$(now) - $t0" | bc)
  # One run of WARM + TIME s on one channel of q0 (each perform_tests builds its jobs'
  # channels anew: a second run would measure a fresh channel, its layers opened again and
  # the index empty, while the first one's AIO contexts (up to 2 x D) are destroyed, each
  # io_destroy waiting an RCU grace period on the reactor). bdevperf prints the average
  # IOPS since the start every second; second k read k*v[k] - (k-1)*v[k-1]. The first WARM
  # seconds are the first pass (every unit touched once: the layer index fills), the
  # median of the next TIME the reads after it.
  bdevperf.py -s "$sock" -t 600 perform_tests -t "$((WARM + TIME))" >"$DIR/all.json"
  local warm hot rss
  local vals
  vals=$(tr '\r' '\n' <"$log" | awk '/^ *[0-9.]+ IOPS,/ {k++; print int(k * $1 - (k - 1) * p); p = $1}')
  warm=$(echo "$vals" | sed -n "1,${WARM}p" | awk '{s += $1} END {print (NR ? int(s / NR) : 0)}')
  hot=$(echo "$vals" | sed -n "$((WARM + 1)),$((WARM + TIME))p" | median)
  rss=$(awk '/VmRSS/ {printf "%d", $2 / 1024}' /proc/"$pid"/status)
  echo "$opened $warm $hot $rss"
  # SIGKILL: a clean exit puts up to 2 x D AIO contexts, each io_destroy waiting an RCU
  # grace period (seconds at D = 1,000, with the lock held); the hugepages are unlinked.
  kill -9 "$pid"
  wait "$pid" 2>/dev/null || true
}

declare -A made
for d in $DEPTHS; do
  made[$d]=$(make_chain "$d")
done

declare -A OPEN WARMS HOT RSS
order=()
for ((r = 0; r < ROUNDS; r++)); do
  if ((r % 2 == 0)); then order=($DEPTHS); else order=($(echo $DEPTHS | tr ' ' '\n' | tac)); fi
  for d in "${order[@]}"; do
    read -r o w h m < <( (flock 9 && run "$d") 9>"$LOCK")
    OPEN[$d]+="$o "; WARMS[$d]+="$w "; HOT[$d]+="$h "; RSS[$d]+="$m "
    echo "round $r depth $d: open ${o}s, first pass $w IOPS, after it $h IOPS, RSS ${m} MiB" >&2
  done
done

base=$(echo "${HOT[2]:-}" | median)
printf '%-6s %-10s %-10s %-12s %-12s %-8s %-8s\n' depth files_s open_s first_IOPS IOPS ratio RSS_MiB
for d in $DEPTHS; do
  h=$(echo "${HOT[$d]}" | median)
  ratio=-
  if [ -n "$base" ] && [ "$base" != 0 ]; then ratio=$(echo "scale=2; $h / $base" | bc); fi
  printf '%-6s %-10.2f %-10.2f %-12s %-12s %-8s %-8s\n' "$d" "${made[$d]}" \
    "$(echo "${OPEN[$d]}" | median)" "$(echo "${WARMS[$d]}" | median)" "$h" "$ratio" \
    "$(echo "${RSS[$d]}" | median)"
  echo "  depth $d per round: IOPS ${HOT[$d]}" >&2
done
