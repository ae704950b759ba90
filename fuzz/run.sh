#!/usr/bin/env bash
# Fuzzes the qcow2 engine: builds the cargo-fuzz targets, seeds their corpora with images
# made by qemu-img/qemu-io, runs each target for a given time and reports executions,
# corpus size and crashes per target.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 1800 s, image_ops, parse and luks)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and qemu-utils. The toolchain is stable Rust:
# RUSTC_BOOTSTRAP=1 lets it take the nightly flags cargo-fuzz passes (sanitizer coverage).
# Runs at the lowest CPU priority, one job. Environment: FUZZ_SANITIZER (default none: the
# engine is free of unsafe code; `address` for ASan), FUZZ_RSS_MB (default 2048; it counts the in-memory corpus too),
# FUZZ_TIMEOUT (seconds per input before it counts as a hang, default 10).
#
# Corpora are in fuzz/corpus/TARGET (not committed: regenerated from the seeds made here),
# crash inputs in fuzz/artifacts/TARGET, logs in fuzz/corpus/logs. Exit status 1 when any
# target crashed. Minimize a crash with
#   RUSTC_BOOTSTRAP=1 cargo fuzz tmin -s none -a TARGET fuzz/artifacts/TARGET/crash-…
# and turn it into a test in bdev_qcow2/engine/tests/fuzz_regressions.rs.
set -euo pipefail

secs=${1:-1800}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(image_ops parse luks)

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cd "$root"
export RUSTC_BOOTSTRAP=1
san=${FUZZ_SANITIZER:-none}
fuzz_flags=(-s "$san" --debug-assertions)

command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: cargo install cargo-fuzz" >&2; exit 1; }
command -v qemu-img >/dev/null || { echo "qemu-img missing: apt-get install qemu-utils" >&2; exit 1; }

echo "== build"
for t in "${targets[@]}"; do
    CARGO_BUILD_JOBS=1 nice -n 19 cargo fuzz build "${fuzz_flags[@]}" "$t" >/dev/null
done

# ---------------------------------------------------------------------------------------
# Seed images: small (1–4 MiB virtual, at most 1 MiB of file), one per feature.
# ---------------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
img=$work/img
mkdir -p "$img"

q() { qemu-io -f qcow2 "$@" >/dev/null; }
mk() { # mk NAME SIZE OPTIONS...
    local name=$1 size=$2
    shift 2
    qemu-img create -q -f qcow2 "$@" "$img/$name.qcow2" "$size"
}
data() { # data NAME: a few writes, zeroes and a discard
    q -c 'write -P 0x11 0 64k' -c 'write -P 0x22 200k 8k' -c 'write -z 512k 64k' \
        -c 'write -P 0x33 700k 4k' -c 'discard 0 32k' "$img/$1.qcow2"
}

echo "== seeds"
for cs in 512 4k 64k; do
    mk "v3-$cs" 1M -o cluster_size=$cs && data "v3-$cs"
    mk "v2-$cs" 1M -o cluster_size=$cs,compat=0.10 && data "v2-$cs"
done
mk v3-2m 4M -o cluster_size=2M # metadata only: 2 MiB clusters make big files
for cs in 16k 64k; do
    mk "ext-$cs" 1M -o cluster_size=$cs,extended_l2=on && data "ext-$cs"
    q -c 'write -P 0x44 4k 1k' -c 'write -z 9k 2k' "$img/ext-$cs.qcow2"
done
for rb in 1 8 64; do
    mk "rb$rb" 1M -o refcount_bits=$rb,cluster_size=4k && data "rb$rb"
done
for ct in zlib zstd; do
    mk "comp-$ct" 1M -o cluster_size=4k,compression_type=$ct
    q -c 'write -c -P 0x55 0 4k' -c 'write -c -P 0x66 64k 8k' -c 'write -P 0x77 128k 4k' \
        "$img/comp-$ct.qcow2"
done
mk snap 1M -o cluster_size=4k && data snap
qemu-img snapshot -c first "$img/snap.qcow2"
q -c 'write -P 0x88 0 8k' "$img/snap.qcow2"
qemu-img snapshot -c second "$img/snap.qcow2"
mk base 1M -o cluster_size=4k && data base
mk overlay 1M -o cluster_size=4k -b base.qcow2 -F qcow2
q -c 'write -P 0x99 4k 4k' "$img/overlay.qcow2"
mk overlay-raw 1M -o cluster_size=4k,extended_l2=off -b /etc/passwd -F raw
mk bitmaps 1M -o cluster_size=4k && data bitmaps
qemu-img bitmap --add "$img/bitmaps.qcow2" bm0
qemu-img bitmap --add -g 64k "$img/bitmaps.qcow2" bm1
qemu-img bitmap --add --disable "$img/bitmaps.qcow2" bm2
q -c 'write -P 0xaa 300k 4k' "$img/bitmaps.qcow2"
mk lazy 1M -o cluster_size=4k,lazy_refcounts=on
# `abort` leaves the dirty bit set: the engine must repair before writing.
bash -c 'qemu-io -f qcow2 -c "write -P 0xbb 0 12k" -c abort "$1"; true' _ "$img/lazy.qcow2" >/dev/null 2>&1
mk prealloc 768k -o cluster_size=4k,preallocation=metadata
for f in "$img"/*.qcow2; do
    [ "$(stat -c %s "$f")" -le $((1 << 20)) ] || rm -f "$f"
done
echo "   $(ls "$img" | wc -l) images"

# image_ops seeds: configuration byte, count byte (top bit: writable), 6-byte operations
# (kind, at u16, len u16, parameter; see bdev_qcow2/engine/src/fuzzing.rs), then the image.
ro_script='\x05\x04\x02\x00\x00\x00\x80\x00\x02\x10\x00\x00\x40\x00\x02\x80\x00\x01\x00\x00\x08\x00\x00\x00\x00\x00'
rw_script='\xa5\x88\x03\x00\x03\x00\x11\xab\x04\x01\x00\x01\x00\x00\x05\x02\x00\x00\x40\x01\x06\x00\x00\x00\x00\x00\x02\x00\x00\x01\x00\x00\x07\x00\x00\x00\x00\x00\x08\x00\x00\x00\x00\x02\x02\x00\x00\x00\x80\x00'
small_script='\x7a\x87\x03\x00\x01\x00\x01\x5a\x04\x00\x00\x00\x08\x00\x05\x00\x03\x00\x02\x00\x09\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x02\x00\x00\x00\x10\x00\x08\x00\x00\x00\x00\x01'
mkdir -p fuzz/corpus/image_ops fuzz/corpus/parse fuzz/corpus/logs
for f in "$img"/*.qcow2; do
    n=$(basename "$f" .qcow2)
    { printf "$ro_script"; cat "$f"; } >"fuzz/corpus/image_ops/seed-$n-ro"
    { printf "$rw_script"; cat "$f"; } >"fuzz/corpus/image_ops/seed-$n-rw"
    { printf "$small_script"; cat "$f"; } >"fuzz/corpus/image_ops/seed-$n-small"
done

# parse seeds: selector, two big-endian u64 parameters, bytes (see fuzzing.rs `parse`).
python3 - "$img" fuzz/corpus/parse <<'EOF'
import os, struct, sys
src, out = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(src)):
    b = open(os.path.join(src, name), 'rb').read()
    stem = name[:-6]
    size = len(b)
    cb = struct.unpack('>I', b[20:24])[0]
    cs = 1 << cb
    version = struct.unpack('>I', b[4:8])[0]
    l1_size, l1_off = struct.unpack('>IQ', b[36:48])
    rt_off = struct.unpack('>Q', b[48:56])[0]
    nb_snap, snap_off = struct.unpack('>IQ', b[60:72])
    incompat = struct.unpack('>Q', b[72:80])[0] if version == 3 else 0
    ext = bool(incompat & 16)
    refcount_order = struct.unpack('>I', b[96:100])[0] if version == 3 else 4
    sel_bits = (cb - 9) | (3 << 8)
    def seed(kind, sel, p0, body):
        with open(os.path.join(out, f'seed-{stem}-{kind}'), 'wb') as f:
            f.write(bytes([sel]) + struct.pack('>QQ', p0, size) + body[:65536])
    seed('header', 0, 3 << 8, b[:min(cs, 65536)])
    if nb_snap:
        seed('snapshots', 1, (nb_snap << 32) | sel_bits, b[snap_off:])
    l2_off = struct.unpack('>Q', b[l1_off:l1_off + 8])[0] & 0x00ff_ffff_ffff_fe00 if l1_size else 0
    if l2_off:
        flags = sel_bits | (0x400 if ext else 0) | (0x800 if version == 3 else 0)
        seed('l2', 2, flags, b[l2_off:l2_off + cs])
    # The bitmap directory, with the disk's size as the device size.
    at = struct.unpack('>I', b[100:104])[0] if version == 3 else 72
    while version == 3 and at + 8 <= len(b):
        kind, length = struct.unpack('>II', b[at:at + 8])
        if kind == 0:
            break
        if kind == 0x23852875 and length == 24:
            nb, _, dsize, doff = struct.unpack('>IIQQ', b[at + 8:at + 32])
            vsize = struct.unpack('>Q', b[24:32])[0]
            with open(os.path.join(out, f'seed-{stem}-bitmaps'), 'wb') as f:
                f.write(bytes([4]) + struct.pack('>QQ', (nb << 32) | sel_bits, vsize)
                        + b[doff:doff + dsize])
        at += 8 + (length + 7) // 8 * 8
    seed('l1', 2, sel_bits | 0x800, b[l1_off:l1_off + 8 * l1_size])
    seed('reftable', 2, sel_bits, b[rt_off:rt_off + cs])
    rb_off = struct.unpack('>Q', b[rt_off:rt_off + 8])[0]
    if rb_off:
        seed('refblock', 3, (refcount_order << 2) | (min(cb, 12) - 9), b[rb_off:rb_off + cs])
EOF
# luks seeds: the LUKS areas of images qemu-img encrypted (low PBKDF2 cost), two ciphers.
mkdir -p fuzz/corpus/luks
for mode in "" ",encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv"; do
    enc="$work/enc.qcow2"
    qemu-img create -q -f qcow2 --object secret,id=s,data=fuzz \
        -o "encrypt.format=luks,encrypt.key-secret=s,encrypt.iter-time=1$mode" "$enc" 1M
    python3 - "$enc" fuzz/corpus/luks "${#mode}" <<'PY'
import struct, sys
b = open(sys.argv[1], 'rb').read()
pos = struct.unpack('>I', b[100:104])[0]  # header_length
while pos + 8 <= len(b):
    t, l = struct.unpack('>II', b[pos:pos + 8])
    if t == 0:
        break
    if t == 0x0537be77:
        o, n = struct.unpack('>QQ', b[pos + 8:pos + 24])
        open(f"{sys.argv[2]}/seed-{sys.argv[3]}", 'wb').write(b[o:o + n])
    pos += 8 + (l + 7) // 8 * 8
PY
done
echo "   $(ls fuzz/corpus/image_ops | wc -l) image_ops inputs, $(ls fuzz/corpus/parse | wc -l) parse inputs, $(ls fuzz/corpus/luks | wc -l) luks inputs"

# ---------------------------------------------------------------------------------------
# Fuzz
# ---------------------------------------------------------------------------------------
declare -A max_len=([image_ops]=1100000 [parse]=70000)
status=0
summary=()
for t in "${targets[@]}"; do
    art=fuzz/artifacts/$t
    mkdir -p "$art"
    before=$(ls "$art" | wc -l)
    log=fuzz/corpus/logs/$t.log
    echo "== $t: ${secs}s"
    set +e
    nice -n 19 cargo fuzz run "${fuzz_flags[@]}" "$t" "fuzz/corpus/$t" -- \
        -max_len="${max_len[$t]:-1100000}" -max_total_time="$secs" \
        -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb="${FUZZ_RSS_MB:-2048}" \
        -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    rate=$(grep -oE 'exec/s: [0-9]+' "$log" | tail -1 | sed 's/exec\/s: //')
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
    files=$(ls "fuzz/corpus/$t" | wc -l)
    bytes=$(du -sh "fuzz/corpus/$t" | cut -f1)
    crashes=$(( $(ls "$art" | wc -l) - before ))
    line="$t: ${execs:-?} executions (${rate:-?}/s), corpus $files files ($bytes), peak RSS ${rss:-?} MiB, $crashes new crash(es), libFuzzer exit $rc"
    echo "   $line"
    if [ "$crashes" -gt 0 ] || [ "$rc" -ne 0 ]; then
        status=1
        ls -t "$art" | head -n "$(( crashes > 0 ? crashes : 1 ))" | sed "s|^|   artifact: $art/|"
        grep -m3 -E 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | sed 's/^/   /'
    fi
    summary+=("$line")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
