#!/bin/sh
# Starts spdk_tgt with bdev_qcow2 preloaded (LD_PRELOAD on spdk_tgt alone). Arguments go to
# spdk_tgt. Without hugepages in the container, set SPDK_MEM_ARGS="--no-huge -s 2048".
set -eu
mkdir -p /var/tmp/spdk
exec env LD_PRELOAD=/usr/lib/bdev_qcow2/libbdev_qcow2.so \
    spdk_tgt ${SPDK_MEM_ARGS:-} "$@"
