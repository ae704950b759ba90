#!/usr/bin/env bash
# Chaos soak: spdk_tgt with libbdev_qcow2.so serves qcow2 bdevs (plain on an error bdev,
# extended L2 over a golden image, an overlay of a compressed golden image, one with
# persistent bitmaps) over NVMe/TCP on 127.0.0.1 to a client of ours (tests/chaos/) that
# writes, reads, flushes, write-zeroes and deallocates against a model of every block,
# while a driver issues life-cycle RPCs (snapshot create/delete, external snapshot, resize,
# bdev delete/re-create, bdev_error injection, stream) and SIGKILLs spdk_tgt at random
# moments; after each kill: qemu-img check (leaks allowed), QEMU's view against the model,
# bitmaps in use or covering every write, restart from the config the target saved, its
# view equal to QEMU's.
#
#   tests/chaos.sh                          # 60 s, a random seed
#   SEED=1234 DURATION=3600 tests/chaos.sh  # an hour's soak
#
# Environment: SEED (printed; a failing seed replays its operations, RPCs and lives between
# kills, though not the threads' timing), DURATION (seconds, default 60),
# BDEV_QCOW2_SO (default target/release or target/debug libbdev_qcow2.so), CORES (spdk_tgt
# -m, default 0x3), SIZE_MIB (each disk, default 32), MAX_CYCLE (most seconds between kills,
# default 6), MEM_ARGS (default: hugepages when 1 GiB is free, else --no-huge -s 2048),
# KEEP=1 keeps the work directory. Ends with a CHAOS line of figures; exits non-zero on a
# finding. Like the SPDK tests it needs the cores to itself: run one SPDK application at a time
# (it takes no lock itself; wrap it in flock where others share the machine).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

if ! command -v spdk_tgt >/dev/null || ! command -v qemu-img >/dev/null; then
    echo "SKIPPED: spdk_tgt or qemu-img not on PATH"
    exit 0
fi
so=${BDEV_QCOW2_SO:-}
if [ -z "$so" ]; then
    for c in "$root/target/release/libbdev_qcow2.so" "$root/target/debug/libbdev_qcow2.so"; do
        if [ -f "$c" ]; then so=$c; break; fi
    done
fi
if [ -z "$so" ] || [ ! -f "$so" ]; then
    echo "SKIPPED: libbdev_qcow2.so not built (cargo build -p bdev_qcow2, or set BDEV_QCOW2_SO)"
    exit 0
fi

python3 "$root/tests/chaos/model_check.py"
seed=${SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
if [ -z "${MEM_ARGS+x}" ]; then
    free_mib=$(awk '/HugePages_Free/ {f=$2} /Hugepagesize/ {s=$2} END {print f*s/1024}' /proc/meminfo)
    if [ "${free_mib%.*}" -ge 1024 ] && grep -q hugetlbfs /proc/mounts; then
        MEM_ARGS=""
    else
        MEM_ARGS="--no-huge -s 2048"
    fi
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
wd=$(mktemp -d "${TMPDIR:-/tmp}/chaos.XXXXXX")
echo "chaos: SEED=$seed DURATION=${DURATION:-60} module $so workdir $wd"

rc=0
python3 "$root/tests/chaos/chaos.py" --seed "$seed" --duration "${DURATION:-60}" \
    --workdir "$wd" --module "$so" --port "$port" --cores "${CORES:-0x3}" \
    --mem-args "$MEM_ARGS" --size-mib "${SIZE_MIB:-32}" --max-cycle "${MAX_CYCLE:-6}" || rc=$?
if [ "$rc" -eq 0 ] && [ -z "${KEEP:-}" ]; then
    rm -rf "$wd"
else
    echo "chaos: work directory kept: $wd (replay: SEED=$seed)"
fi
exit "$rc"
