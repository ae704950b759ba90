#!/usr/bin/env bash
# The main job on an embedded default: builds a sample qcow2 chain with qemu-img/qemu-io
# (a compressed zstd base, an extended-L2 overlay with zeroed and discarded ranges, and an
# internal snapshot), then reads it through our engine with `qcow2 info`, `map` and
# `convert`, and checks every result against qemu-img.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p qcow2_tool
Q=$PWD/target/release/qcow2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"

qemu-img create -q -f qcow2 src.qcow2 256M
qemu-io -f qcow2 -c 'write -P 0x11 0 64M' -c 'write -P 0x22 100M 8M' src.qcow2 >/dev/null
qemu-img convert -c -O qcow2 -o compression_type=zstd src.qcow2 base.qcow2
qemu-img create -q -f qcow2 -o backing_file=base.qcow2,backing_fmt=qcow2,extended_l2=on top.qcow2
qemu-io -f qcow2 -c 'write -P 0x33 4k 8k' -c 'write -z 1M 1M' -c 'discard 100M 64k' \
  -c 'write -P 0x44 200M 3M' top.qcow2 >/dev/null
qemu-img snapshot -c demo top.qcow2

echo "== qcow2 info top.qcow2"
"$Q" info top.qcow2
echo "== qcow2 map --output=json --allow-backing top.qcow2"
"$Q" map --output=json --allow-backing top.qcow2 | tee ours.json
qemu-img map --output=json top.qcow2 > theirs.json
cmp ours.json theirs.json && echo "map --output=json: identical to qemu-img"

echo "== qcow2 convert -O raw --allow-backing top.qcow2 top.raw"
start=$(date +%s.%N)
"$Q" convert -O raw --allow-backing top.qcow2 ours.raw
mid=$(date +%s.%N)
qemu-img convert -O raw top.qcow2 theirs.raw
end=$(date +%s.%N)
cmp ours.raw theirs.raw && echo "convert: byte-identical to qemu-img convert"
python3 -c "import sys; a,b,c=map(float,sys.argv[1:]); print(f'convert time ours/qemu-img: {(b-a)/(c-b):.2f}')" "$start" "$mid" "$end"
echo "== without --allow-backing the backing file is never opened:"
"$Q" convert -O raw top.qcow2 x.raw || true
