#!/usr/bin/env bash
# vhost-user-blk side by side: the same qcow2 image served by spdk_tgt with our module, by
# qemu-storage-daemon (QEMU's qcow2 driver, an iothread, io_uring), and by SPDK's passthru
# bdev over a copy of the same file read as raw data (no qcow2 at all: the limit of the vhost
# path). Every server opens its file O_DIRECT and runs pinned to core 0; the client is
# bdevperf on core 1 with SPDK's virtio-user initiator (bdev_virtio_attach_controller,
# trtype user, dev_type blk).
#
# A fair client for QEMU's export needs three corrections, all applied to every server:
# - tests/vhost_relay.py sits on the control socket: the initiator's 256-byte config request
#   (which QEMU refuses: "get_config failed") is shortened, and a maximum segment size of 0
#   (which makes the initiator cut requests into 512-byte segments) becomes 64 KiB, what
#   SPDK's own target reports. Data never passes through the relay.
# - bdevperf's buffers are made page-aligned, as a guest's are (LD_PRELOAD of a one-line
#   spdk_bdev_get_buf_align; otherwise QEMU bounces every O_DIRECT request).
# - Each of ours and qsd reads a copy of the image of its own, and the copies are swapped
#   between runs, so that where a copy lies on the disk, or in the page cache, favours
#   neither. Passthru reads the copy ours read in the same run (a copy of its own where a
#   row writes).
# Each figure is the median of RUNS alternating runs (ours, qsd, passthru; then reversed).
#
# Cases: tmpfs (/dev/shm), disk (an ext4 file in /var/tmp), and disk-throttled: the ext4
# file with data really on the disk (the images fully written: a falloc'd or sparse image reads
# zeros without any disk I/O) and each server process, not the client, in a cgroup v1 blkio
# group that limits it on the disk to LIMIT_IOPS reads and writes per second and LIMIT_BPS
# bytes per second each way (default 3000 and 125 MiB/s: a cloud volume's baseline, far below
# what either server does on a CPU), so both servers are disk-bound. The disk I/Os and KiB each
# server issued per request (blkio.throttle.io_serviced and io_service_bytes, opening
# included) are printed under each row, from the run with the median I/Os per request.
# Without blkio (or permission to make a group) that case prints SKIPPED with the reason.
#
#   tests/vhost_bench.sh                        # tmpfs and disk
#   RUNS=4 TIME=5 SIZE=1G tests/vhost_bench.sh
#   CASES=tmpfs tests/vhost_bench.sh            # or CASES=disk, CASES=disk-throttled
#   ROWS="randread-4k qd1" tests/vhost_bench.sh # some rows only (names as printed)
#
# Case two-cores: tmpfs, two virtqueues in use, the client (bdevperf on cores 0 and 1, -C: one
# job per core, each on its own virtqueue; a third, which bdevperf's examine holds) and the server sharing both cores. spdk_tgt runs
# on cores 0-1 with the vhost controller's thread on core 1 (SPDK polls every queue of a
# vhost-blk session on that one thread; our owner and the md thread stay on core 0);
# qemu-storage-daemon runs on cores 0-1 with one iothread (QEMU 10.0's vhost-user-blk export
# takes one iothread: neither a list of iothreads nor iothread-vq-mapping exists for exports).
#
# Row l2-small: an L2SIZE (4 GiB) image with 64 KiB clusters, randread 4 KiB QD32, with
# qemu-storage-daemon's L2 cache set to a quarter of the image's L2 (l2-cache-size 128 KiB):
# what QEMU's default 32 MiB is on a 1 TiB image, where a random read then loads a 64 KiB L2
# table first three times in four. Ours runs at its defaults, which cache this image's whole
# L2 (on a 1 TiB image that takes l2_cache_size 128 MiB per core). No passthru in that row.
#
# Reading ours/pt: passthru completes every request in the order it came, so SPDK's initiator
# reuses its descriptors in order and the server's reads of them are prefetched by the CPU.
# Any request that completes out of order leaves that free list shuffled for the rest of the
# run; a guest's driver, over any real device, sees its order shuffled too. (Whether that
# is what ours pays in the tmpfs rows is not shown: warming each channel's slice cache so
# that no read waited did not change the server's simulated cache misses, PERFORMANCE.md §5;
# SPDK's split check on our bdev is most of its instructions over passthru, §4.)
#
# PROFILE=DIR: perf record -g of each server while its client runs, into
# DIR/CASE-ROW-SERVER-RUN.data (perf report -i ...). PROFILE_EVENTS=sched:sched_switch records
# where each server's threads leave the CPU instead (an off-CPU profile: blocking calls).
#
# PERF_STAT=EVENTS (e.g. cycles,instructions,cache-misses,L1-dcache-load-misses,LLC-load-misses):
# perf stat of each SPDK server (ours, pt) over a window inside its client's run (from
# half a second after its first request to a second before the end), divided by the
# requests the bdev completed in that window (bdev_get_iostat before and after): each
# event per request, printed under the row (medians). Per request, a busy-polling server's
# counts do not depend on how much of the core the machine's load leaves it.
# SERVERS: the servers to run (default "ours qsd pt"; e.g. "ours pt").
#
# OURS_OPTS: more parameters of bdev_qcow2_create, as JSON members (e.g. '"zero_ahead": false').
#
# Needs SPDK (spdk_tgt, bdevperf, rpc.py), qemu-storage-daemon, qemu-img, python3, cc; prints
# SKIPPED and exits 0 without them. Run it alone (one SPDK application pair at a time).
set -eEuo pipefail
trap 'echo "vhost_bench.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

for b in spdk_tgt bdevperf qemu-storage-daemon qemu-img python3 cc taskset; do
  command -v "$b" >/dev/null || { echo "SKIPPED: $b not found"; exit 0; }
done
RPC=${SPDK_RPC:-$(command -v spdk-rpc || command -v rpc.py || true)}
[ -n "$RPC" ] || { echo "SKIPPED: rpc.py not found (set SPDK_RPC)"; exit 0; }
pkg-config --exists spdk_bdev 2>/dev/null || { echo "SKIPPED: SPDK not installed"; exit 0; }

cargo build --release -q -p bdev_qcow2
SO=${BDEV_QCOW2_SO:-$PWD/target/release/libbdev_qcow2.so}
RUNS=${RUNS:-4}
TIME=${TIME:-5}
SIZE=${SIZE:-1G}
BIG=${BIG:-64G}
CASES=${CASES:-tmpfs disk}
ROWS=${ROWS:-randread-4k randread-512 seqread-128k overwrite-4k qd1 verify big-defaults alloc-write l2-small}
L2SIZE=${L2SIZE:-4G}
# Row alloc-write measures allocation only: its image (ALLOC_SIZE, 64 KiB clusters) is large
# enough that the run's random 4 KiB writes land on distinct clusters almost always — 256 GiB
# has 4 Mi clusters, and ALLOC_TIME seconds of up to 60 K writes/s take 180 K of them, of
# which about 2 % a second time — and small enough that both servers' default L2 caches
# (32 MiB each) hold all of its L2 tables, as they do for a 16 GiB image (on 1 TiB, QEMU
# would write evicted tables back and read them again). After each run the row checks the
# image with qemu-img check (clean, no leaks) and prints under the row the share of writes
# that allocated a cluster (allocated clusters / writes completed; the median run's).
# ALLOC_SIZE=16G gives the issue's first figure (#48), where a quarter of the writes land in
# a cluster an earlier one allocated. Its file has ALLOC_ROOM past the end for what they
# allocate (an AIO bdev does not grow; sparse: only what a server writes takes space — on
# tmpfs that is memory, up to 64 KiB per write where a server zeroes whole clusters, as both
# do there; each run's image is removed after it).
ALLOC_SIZE=${ALLOC_SIZE:-256G}
# 64G: at 200 K writes/s (ours on a quiet machine) 3 s allocate ~37 GiB of 64 KiB clusters.
ALLOC_ROOM=${ALLOC_ROOM:-64G}
ALLOC_TIME=${ALLOC_TIME:-3}
LIMIT_IOPS=${LIMIT_IOPS:-3000}
LIMIT_BPS=${LIMIT_BPS:-$((125 << 20))}
BLKIO=/sys/fs/cgroup/blkio
# Cores of the server (spdk_tgt mask, its vhost controller's mask, qsd's CPUs) and client.
SRV_MASK=0x1 VHOST_MASK=0x1 QSD_CPUS=0 CLI_MASK=0x2 CLI_ARGS= NO_LOCKS= VQS=2
read -r -a SERVERS <<<"${SERVERS:-ours qsd pt}"
serves() { [[ " ${SERVERS[*]} " == *" $1 "* ]]; }

WORK=$(mktemp -d /tmp/vhost_bench.XXXXXX)
SERVER_PID=
RELAY_PID=
CG=
THROTTLE=
cleanup() {
  for p in $SERVER_PID $RELAY_PID; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -z "$CG" ] || rmdir "$CG" 2>/dev/null || true
  rm -rf "$WORK" /dev/shm/vhost_bench /var/tmp/vhost_bench
}
trap cleanup EXIT

# Page-aligned client buffers.
cat >"$WORK/align.c" <<'EOF'
#include <stddef.h>
struct spdk_bdev;
size_t spdk_bdev_get_buf_align(const struct spdk_bdev *bdev) { (void)bdev; return 4096; }
EOF
cc -O2 -shared -fPIC -o "$WORK/align.so" "$WORK/align.c"

# The device a file lies on, as blkio names it (MAJ:MIN of the whole disk).
disk_of() {
  local dev
  dev=$(df --output=source "$1" | tail -1)
  dev=/dev/$(lsblk -no PKNAME "$dev" 2>/dev/null | head -1 || true)
  [ "$dev" != /dev/ ] || dev=$(df --output=source "$1" | tail -1)
  lsblk -dno MAJ:MIN "$dev" | tr -d ' '
}

# throttle_check DIR: finds the disk under DIR (sets THROTTLE to its MAJ:MIN) and checks a
# blkio group can limit it, or prints why not and returns 1.
throttle_check() {
  [ -w "$BLKIO/cgroup.procs" ] && [ -e "$BLKIO/blkio.throttle.read_iops_device" ] ||
    { echo "SKIPPED: no writable cgroup v1 blkio hierarchy at $BLKIO"; return 1; }
  THROTTLE=$(disk_of "$1") || true
  [ -n "$THROTTLE" ] || { echo "SKIPPED: no block device found under $1"; return 1; }
  local cg=$BLKIO/vhost_bench_check.$$
  mkdir "$cg" 2>/dev/null || { echo "SKIPPED: cannot make a blkio group under $BLKIO"; THROTTLE=; return 1; }
  if ! echo "$THROTTLE $LIMIT_IOPS" >"$cg/blkio.throttle.read_iops_device" 2>/dev/null; then
    rmdir "$cg"
    echo "SKIPPED: blkio refuses a limit on $THROTTLE"
    THROTTLE=
    return 1
  fi
  rmdir "$cg"
}

# A fresh blkio group for one server (its counters start at zero), limited on $THROTTLE.
throttle_group() {
  CG=$BLKIO/vhost_bench.$$
  mkdir "$CG"
  local f
  for f in read_iops write_iops; do echo "$THROTTLE $LIMIT_IOPS" >"$CG/blkio.throttle.${f}_device"; done
  for f in read_bps write_bps; do echo "$THROTTLE $LIMIT_BPS" >"$CG/blkio.throttle.${f}_device"; done
}

# Disk I/Os (reads and writes) the server's group issued, and their bytes.
throttle_ios() {
  local f
  for f in io_serviced io_service_bytes; do
    awk -v d="$THROTTLE" '$1 == d && $2 == "Total" {print $3}' "$CG/blkio.throttle.$f"
  done | paste -sd ' '
}

# LAUNCH: what runs a server in the blkio group when throttled (exec'd, so that $! is the
# server itself; a shell function run with & would be a subshell, deaf to SIGINT).
# shellcheck disable=SC2016
launcher() { LAUNCH=(); [ -z "$THROTTLE" ] || LAUNCH=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CG"); }

# server NAME FILE: starts server NAME on FILE pinned to core 0, its vhost socket at
# $WORK/server.sock; sets SERVER_PID. QSD_OPTS: more options of qsd's qcow2 node.
server() {
  local name=$1 file=$2 sock=$WORK/server.sock log=$WORK/server.log
  rm -f "$sock" "$WORK/spdk.sock"
  [ -z "$THROTTLE" ] || throttle_group
  launcher
  case $name in
  ours | pt)
    local bdev
    if [ "$name" = ours ]; then
      bdev='{"method": "bdev_qcow2_create", "params": {"name": "d0", "base_bdev": "aio0"'"${OURS_OPTS:+, $OURS_OPTS}"'}}'
    else
      bdev='{"method": "bdev_passthru_create", "params": {"name": "d0", "base_bdev_name": "aio0"}}'
    fi
    cat >"$WORK/server.json" <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
 {"method": "bdev_aio_create", "params": {"filename": "$file", "name": "aio0", "block_size": 512, "fallocate": $FALLOC}},
 $bdev,
 {"method": "bdev_wait_for_examine"}]}]}
EOF
    mkdir -p "$WORK/vhost"
    rm -f "$WORK/vhost/d0"
    # shellcheck disable=SC2086
    "${LAUNCH[@]}" env LD_PRELOAD="$SO" spdk_tgt -m "$SRV_MASK" $NO_LOCKS -s 1024 -S "$WORK/vhost" -r "$WORK/spdk.sock" \
      --json "$WORK/server.json" >"$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 150); do
      "$RPC" -s "$WORK/spdk.sock" -t 5 framework_wait_init >/dev/null 2>&1 && break
      sleep 0.2
    done
    "$RPC" -s "$WORK/spdk.sock" vhost_create_blk_controller --cpumask "$VHOST_MASK" d0 d0 >/dev/null
    ln -sf "$WORK/vhost/d0" "$sock"
    ;;
  qsd)
    "${LAUNCH[@]}" taskset -c "$QSD_CPUS" qemu-storage-daemon \
      --blockdev "driver=file,node-name=file0,filename=$file,cache.direct=on,aio=io_uring" \
      --blockdev "driver=qcow2,node-name=qcow0,file=file0${QSD_OPTS:-}" \
      --object iothread,id=io0 \
      --export "type=vhost-user-blk,id=exp0,node-name=qcow0,addr.type=unix,addr.path=$sock,writable=on,iothread=io0,num-queues=$VQS" \
      >"$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    ;;
  esac
  [ -S "$sock" ] || { cat "$log"; echo "server $name did not start" >&2; exit 1; }
}

stop_server() {
  kill -INT "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  # spdk_tgt leaves its trace history (3 MiB of memory) once a trace point fired.
  rm -f "/dev/shm/spdk_tgt_trace.pid$SERVER_PID"
  SERVER_PID=
  if [ -n "$CG" ]; then
    read -r DISK_IOS DISK_BYTES < <(throttle_ios)
    rmdir "$CG"
    CG=
  fi
}

# client OUT ARGS...: bdevperf on core 1 through the relay; sets IOPS and LAT_US.
client() {
  local out=$1
  shift
  rm -f "$WORK/relay.sock"
  python3 tests/vhost_relay.py "$WORK/relay.sock" "$WORK/server.sock" &
  RELAY_PID=$!
  local relay=$RELAY_PID
  for _ in $(seq 50); do [ -S "$WORK/relay.sock" ] && break; sleep 0.1; done
  cat >"$WORK/client.json" <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
 {"method": "bdev_virtio_attach_controller", "params": {"name": "V", "trtype": "user",
  "traddr": "$WORK/relay.sock", "dev_type": "blk", "vq_count": $VQS, "vq_size": 256}}]}]}
EOF
  # shellcheck disable=SC2086
  if ! timeout -k 5 $((RUN_TIME + 60)) env LD_PRELOAD="$WORK/align.so" bdevperf -m "$CLI_MASK" $NO_LOCKS -g -s 1024 \
      --json "$WORK/client.json" -t "$RUN_TIME" $CLI_ARGS "$@" >"$out" 2>&1; then
    kill "$relay" 2>/dev/null || true
    grep -v VHOST_CONFIG "$WORK/server.log" | tail -15; tail -25 "$out"
    echo "bdevperf failed" >&2
    exit 1
  fi
  kill "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true
  # bdevperf starts its summary lines with a carriage return.
  tr -d '\r' <"$out" >"$out.txt"
  if awk '$1 == "Total" && $2 == ":" && $5 != "0.00" {bad=1} END {exit !bad}' "$out.txt"; then
    cat "$out"
    echo "failed I/O" >&2
    exit 1
  fi
  read -r IOPS LAT_US < <(awk '$1 == "Total" && $2 == ":" {print $3, $(NF-2)}' "$out.txt")
  RELAY_PID=
}

# The bdevperf arguments of each row.
row_args() {
  case $1 in
  randread-4k) echo "-q 32 -o 4096 -w randread" ;;
  randread-512) echo "-q 32 -o 512 -w randread" ;;
  seqread-128k) echo "-q 8 -o 131072 -w read" ;;
  overwrite-4k) echo "-q 32 -o 4096 -w randwrite" ;;
  qd1) echo "-q 1 -o 4096 -w randread" ;;
  verify) echo "-q 32 -o 4096 -w verify" ;;
  big-defaults) echo "-q 32 -o 4096 -w randread" ;;
  alloc-write) echo "-q 32 -o 4096 -w randwrite" ;;
  l2-small) echo "-q 32 -o 4096 -w randread" ;;
  esac
}

# What a server's requests cost in CPU, whatever share of a core the machine's load leaves
# it: cpu_mark before a client's run, cpu_per_io SERVER after it prints µs of CPU per request
# completed. CPU time is the process's (utime + stime, its threads and io_uring workers
# included); for an SPDK server only the share of it its reactors spent in busy polls
# (framework_get_reactors' busy / (busy + idle) over the run): it polls the rest of its core.
# qemu-storage-daemon's figure includes its iothread's own adaptive polling.
proc_cpu() { awk '{print $14 + $15}' "/proc/$SERVER_PID/stat"; }
reactor_ticks() {
  "$RPC" -s "$WORK/spdk.sock" framework_get_reactors |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["reactors"]; print(sum(x["busy"] for x in r), sum(x["idle"] for x in r))'
}
cpu_mark() {
  CPU0=$(proc_cpu)
  TICKS0=
  [ "$s" = qsd ] || TICKS0=$(reactor_ticks)
}
cpu_per_io() {
  local cpu1 share=1 b0 i0 b1 i1
  cpu1=$(proc_cpu)
  if [ -n "$TICKS0" ]; then
    read -r b0 i0 <<<"$TICKS0"
    read -r b1 i1 < <(reactor_ticks)
    share=$(awk -v b=$((b1 - b0)) -v i=$((i1 - i0)) 'BEGIN {print b / (b + i)}')
  fi
  awk -v c=$((cpu1 - CPU0)) -v hz="$(getconf CLK_TCK)" -v f="$share" -v r="$IOPS" -v t="$RUN_TIME" \
    'BEGIN {printf "%.1f\n", c / hz * f / (r * t) * 1e6}'
}

# bdev_ops: requests bdev d0 of the SPDK server has completed.
bdev_ops() {
  "$RPC" -s "$WORK/spdk.sock" bdev_get_iostat -b d0 |
    python3 -c 'import json,sys; b=json.load(sys.stdin)["bdevs"][0]; print(b["num_read_ops"] + b["num_write_ops"])'
}

# stat_window OUT: perf stat (PERF_STAT) of the SPDK server over a window of its client's
# run; writes "event per-request" lines to OUT (nothing if the window could not be taken).
stat_window() {
  local out=$1 a b w
  : >"$out"
  for _ in $(seq 100); do
    [ "$(bdev_ops 2>/dev/null || echo 0)" -gt 0 ] && break
    sleep 0.1
  done
  sleep 0.5
  w=$(awk -v t="$RUN_TIME" 'BEGIN {w = t - 1.5; print (w < 0.5 ? 0.5 : w)}')
  a=$(bdev_ops) || return 0
  perf stat -x, -e "$PERF_STAT" -p "$SERVER_PID" -o "$out.raw" -- sleep "$w" 2>/dev/null || return 0
  b=$(bdev_ops) || return 0
  awk -F, -v n=$((b - a)) 'n > 0 && $1 ~ /^[0-9]+$/ {printf "%s %.1f\n", $3, $1 / n}' "$out.raw" >"$out"
}

# alloc_share IMAGE: the share of the run's writes that allocated a cluster (allocated data
# clusters / writes completed, from IOPS); fails unless qemu-img check finds the image clean.
# The image goes after it (on tmpfs it holds gigabytes of memory).
alloc_share() {
  local f=$1 out
  out=$(qemu-img check --output=json "$f") || { echo "$out" >&2; echo "alloc-write: $f not clean" >&2; exit 1; }
  rm -f "$f"
  echo "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.3f" % (j["allocated-clusters"] / (float(sys.argv[1]) * float(sys.argv[2]))))' "$IOPS" "$RUN_TIME"
}

median() { sort -g | awk '{v[NR]=$1} END {printf "%.1f\n", NR % 2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }

# image ROW DIR COPY: the image a row reads, fresh where the row needs it. Copies are
# written in full (cp would leave holes where the data is zeros, which read without disk I/O).
image() {
  local row=$1 dir=$2 copy=$3 f=$2/$3.qcow2
  case $row in
  alloc-write)
    # Room past the end: an AIO bdev does not grow (QEMU takes the zeros as free clusters).
    rm -f "$f"
    qemu-img create -q -f qcow2 "$f" "$ALLOC_SIZE"
    truncate -s "$ALLOC_ROOM" "$f"
    ;;
  big-defaults)
    [ -f "$f.big" ] || qemu-img create -q -f qcow2 -o preallocation=metadata "$f.big" "$BIG"
    f=$f.big
    ;;
  verify) rm -f "$f"; qemu-img create -q -f qcow2 -o preallocation="$PREALLOC" "$f" "$SIZE" ;;
  l2-small) f=$f.l2 ;; # made by l2_images
  overwrite-4k)
    # Passthru writes its copy as raw data: it gets a new one each time.
    [ "$copy" = P ] && rm -f "$f"
    [ -f "$f" ] || cp --sparse=never "$dir/master.qcow2" "$f"
    ;;
  *) [ -f "$f" ] || cp --sparse=never "$dir/master.qcow2" "$f" ;;
  esac
  truncate -s %512 "$f"
  # Written back now, not by the server's first reads (counted against its disk limit).
  sync "$f"
  echo "$f"
}

# l2_images DIR: copies A and B of the l2-small image, written in full, made one after the
# other from a master removed in between (at most two images' room at a time), or a line
# saying why the row is skipped (on tmpfs, memory is the room: 3 copies of 4 GiB do not fit
# beside everything else on a 24 GiB machine).
l2_images() {
  local dir=$1 need avail
  need=$(($(numfmt --from=iec "$L2SIZE") * 2 + (1 << 30)))
  avail=$(($(df --output=avail -k "$dir" | tail -1) * 1024))
  if [ "$(df --output=fstype "$dir" | tail -1)" = tmpfs ]; then
    avail=$(awk -v a="$avail" '$1 == "MemAvailable:" {m = $2 * 1024; printf "%.0f\n", (m < a ? m : a)}' /proc/meminfo)
  fi
  if [ "$avail" -lt "$need" ]; then
    echo "skipped: needs $((need >> 30)) GiB free in $dir, has $((avail >> 30)) GiB"
    return
  fi
  qemu-img create -q -f qcow2 -o preallocation="$PREALLOC" "$dir/l2.qcow2" "$L2SIZE"
  cp --sparse=never "$dir/l2.qcow2" "$dir/A.qcow2.l2"
  rm -f "$dir/l2.qcow2"
  cp --sparse=never "$dir/A.qcow2.l2" "$dir/B.qcow2.l2"
}

printf '%s\n' "vhost-user-blk, client bdevperf (virtio-user) on core 1, servers on core 0;" \
  "relay: config request shortened, size_max 0 -> 65536; client buffers 4 KiB aligned;" \
  "medians of $RUNS alternating runs of $TIME s; image $SIZE (big: $BIG, metadata preallocated; alloc-write: $ALLOC_SIZE, empty, runs of $ALLOC_TIME s)."
for case in $CASES; do
  # AIO bdevs with fallocate, as an operator makes them to have discards give space back
  # (their unmap punches a hole, so our bdev zeroes ahead of its allocator by punching);
  # tmpfs has no fallocate zero range, which neither server asks of it here.
  FALLOC=true
  case $case in
  tmpfs | two-cores) dir=/dev/shm/vhost_bench ;;
  *) dir=/var/tmp/vhost_bench ;;
  esac
  SRV_MASK=0x1 VHOST_MASK=0x1 QSD_CPUS=0 CLI_MASK=0x2 CLI_ARGS= NO_LOCKS= VQS=2
  if [ "$case" = two-cores ]; then
    # Both SPDK applications on cores 0-1: neither takes SPDK's per-core lock files.
    SRV_MASK=0x3 VHOST_MASK=0x2 QSD_CPUS=0,1 CLI_MASK=0x3 CLI_ARGS=-C NO_LOCKS=--disable-cpumask-locks
    # A virtqueue per job, and one that bdevperf's examine still holds when the jobs start.
    VQS=3
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  THROTTLE=
  PREALLOC=falloc
  echo
  if [ "$case" = disk-throttled ]; then
    if ! throttle_check "$dir"; then
      rm -rf "$dir"
      continue
    fi
    PREALLOC=full
  fi
  qemu-img create -q -f qcow2 -o preallocation="$PREALLOC" "$dir/master.qcow2" "$SIZE"
  echo "== $case ($(df -T "$dir" | awk 'NR == 2 {print $2}') at $dir); figures in IOPS (qd1: µs)"
  [ "$case" != two-cores ] || echo "servers and client share cores 0-1: spdk_tgt -m 0x3, vhost" \
    "thread on core 1, owner on core 0; qsd on 0-1, one iothread; bdevperf -m 0x3 -C (a job per" \
    "core, each on its own virtqueue; figures are both jobs' sum)"
  [ -z "$THROTTLE" ] || echo "each server limited on disk $THROTTLE to $LIMIT_IOPS IOPS and" \
    "$((LIMIT_BPS >> 20)) MiB/s each way (blkio); images fully written; under each row the" \
    "server's disk I/Os and KiB per request (opening included)"
  printf '%-14s %10s %10s %10s %9s %9s\n' row ours qsd passthru ours/qsd ours/pt
  for row in $ROWS; do
    if [ -n "$THROTTLE" ] && [ "$row" = big-defaults ]; then
      echo "big-defaults   skipped: its data is never written, so it is not read from the disk"
      continue
    fi
    if [ "$row" = l2-small ]; then
      why=$(l2_images "$dir")
      [ -z "$why" ] || { printf '%-14s %s\n' "$row" "$why"; continue; }
    fi
    RUN_TIME=$TIME
    [ "$row" != alloc-write ] || RUN_TIME=$ALLOC_TIME
    declare -A got=() ios=() share=() cpu=() stat=()
    for r in $(seq "$RUNS"); do
      if [ $((r % 2)) = 1 ]; then order=(ours qsd pt); else order=(pt qsd ours); fi
      for s in "${order[@]}"; do
        # Copies A and B swap between runs. Passthru reads the copy ours read in the same
        # run: the same file's pages (their place in the page cache moves tmpfs reads by
        # several per cent); where a row writes, it has a copy P of its own (it would write
        # raw data over a qcow2 copy the others read).
        if [ "$s" = qsd ]; then c=$([ $((r % 2)) = 1 ] && echo B || echo A); else
          c=$([ $((r % 2)) = 1 ] && echo A || echo B); fi
        if [ "$s" = pt ]; then
          case $row in overwrite-4k | verify | alloc-write) c=P ;; esac
        fi
        [ "$s" = pt ] && { [ "$row" = alloc-write ] || [ "$row" = l2-small ]; } && continue
        serves "$s" || continue
        f=$(image "$row" "$dir" "$c")
        QSD_OPTS=
        [ "$row" = l2-small ] && QSD_OPTS=,l2-cache-size=131072
        server "$s" "$f"
        perf_pid=
        if [ -n "${PROFILE:-}" ]; then
          mkdir -p "$PROFILE"
          # shellcheck disable=SC2086
          perf record -q -g ${PROFILE_EVENTS:+-e $PROFILE_EVENTS} -p "$SERVER_PID" -o "$PROFILE/$case-$row-$s-$r.data" -- sleep "$RUN_TIME" 2>/dev/null &
          perf_pid=$!
        fi
        stat_pid=
        if [ -n "${PERF_STAT:-}" ] && [ "$s" != qsd ]; then
          stat_window "$WORK/stat.txt" &
          stat_pid=$!
        fi
        cpu_mark
        # shellcheck disable=SC2046
        client "$WORK/out.txt" $(row_args "$row")
        [ -z "$perf_pid" ] || wait "$perf_pid" || true
        if [ -n "$stat_pid" ]; then
          wait "$stat_pid" || true
          while read -r ev v; do stat["$s $ev"]+="$v "; done <"$WORK/stat.txt"
        fi
        cpu[$s]+="$(cpu_per_io "$s") "
        stop_server
        if [ "$row" = qd1 ]; then got[$s]+="$LAT_US "; else got[$s]+="$IOPS "; fi
        [ "$row" != alloc-write ] || share[$s]+="$(alloc_share "$f") "
        [ -z "$THROTTLE" ] ||
          ios[$s]+="$(awk -v n="$DISK_IOS" -v b="$DISK_BYTES" -v r="$IOPS" -v t="$RUN_TIME" \
            'BEGIN {printf "%.2f/%.0fK", n / (r * t), b / (r * t) / 1024}') "

      done
    done
    m() { [ -n "${got[$1]:-}" ] && echo "${got[$1]}" | tr ' ' '\n' | grep . | median || echo -; }
    o=$(m ours) q=$(m qsd) p=$(m pt)
    if [ "$row" = qd1 ]; then
      rq=$(awk -v a="$o" -v b="$q" 'BEGIN {printf "%.2fx", b / a}')
      rp=$([ "$p" = - ] && echo - || awk -v a="$o" -v b="$p" 'BEGIN {printf "%.2fx", b / a}')
    else
      rq=$(awk -v a="$o" -v b="$q" 'BEGIN {printf "%.2fx", a / b}')
      rp=$([ "$p" = - ] && echo - || awk -v a="$o" -v b="$p" 'BEGIN {printf "%.2fx", a / b}')
    fi
    printf '%-14s %10s %10s %10s %9s %9s\n' "$row" "$o" "$q" "$p" "$rq" "$rp"
    if [ -n "$THROTTLE" ]; then
      # The run whose I/Os per request are the median.
      mi() { [ -n "${ios[$1]:-}" ] && echo "${ios[$1]}" | tr ' ' '\n' | grep . | sort -g |
        awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}' || echo -; }
      printf '%-14s %10s %10s %10s\n' "  I/Os,KiB/req" "$(mi ours)" "$(mi qsd)" "$(mi pt)"
    fi
    if [ "$row" = alloc-write ]; then
      ms() { echo "${share[$1]}" | tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
      printf '%-14s %10s %10s\n' "  allocating" "$(ms ours)" "$(ms qsd)"
    fi
    mc() { [ -n "${cpu[$1]:-}" ] && echo "${cpu[$1]}" | tr ' ' '\n' | grep . | median || echo -; }
    co=$(mc ours) cq=$(mc qsd) cp=$(mc pt)
    printf '%-14s %10s %10s %10s %9s %9s\n' "  cpu µs/req" "$co" "$cq" "$cp" \
      "$(awk -v a="$co" -v b="$cq" 'BEGIN {printf "%.2fx", b / a}')" \
      "$([ "$cp" = - ] && echo - || awk -v a="$co" -v b="$cp" 'BEGIN {printf "%.2fx", b / a}')"
    if [ -n "${PERF_STAT:-}" ]; then
      for ev in ${PERF_STAT//,/ }; do
        so=$([ -n "${stat[ours $ev]:-}" ] && echo "${stat[ours $ev]}" | tr ' ' '\n' | grep . | median || echo -)
        sp=$([ -n "${stat[pt $ev]:-}" ] && echo "${stat[pt $ev]}" | tr ' ' '\n' | grep . | median || echo -)
        printf '%-14s %10s %10s %10s %9s %9s\n' "  $ev/req" "$so" - "$sp" - \
          "$({ [ "$sp" = - ] || [ "$so" = - ]; } && echo - || awk -v a="$so" -v b="$sp" 'BEGIN {printf "%.2fx", (b > 0 ? a / b : 0)}')"
      done
    fi
    printf '%-14s %s\n' "  runs" "ours: ${got[ours]:-} qsd: ${got[qsd]:-}${got[pt]:+ pt: ${got[pt]}}"
    unset got ios share cpu stat
    # The big images of a row go with it (tmpfs holds them in memory).
    rm -f "$dir"/*.big "$dir"/*.l2
  done
  rm -rf "$dir"
done
