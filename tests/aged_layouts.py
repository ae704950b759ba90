#!/usr/bin/env python3
"""Builds qcow2 images with the layouts a guest's own writes leave, written by QEMU
(qemu-io, qemu-img), for tests/aged_bench.sh:

  linear      written front to back (the reference: every slice linear)
  random4k    every cluster allocated by one 4 KiB write, clusters in random order
  writers2/4  two / four sequential writers over their own regions, interleaved at random
  convert     `qemu-img convert -W` (out-of-order writes) of the random4k image
  rewrite     filled front to back, a quarter of its clusters discarded in random 1 MiB
              pieces, then written again in random order (freed clusters reused)

Usage: aged_layouts.py DIR SIZE_MIB [LAYOUT...]; prints one line per image with QEMU's
count of fragmented clusters.
"""
import json
import random
import subprocess
import sys

CLUSTER = 65536


def qemu_io(img, cmds):
    p = subprocess.run(["qemu-io", "-f", "qcow2", img], input="\n".join(cmds) + "\nquit\n",
                       text=True, capture_output=True, check=True)
    if "error" in p.stdout.lower() or "failed" in p.stdout.lower():
        sys.exit(f"qemu-io on {img}: {p.stdout[-500:]}")


def create(img, size):
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", img, str(size)], check=True)


def random4k(img, size, rng):
    create(img, size)
    clusters = list(range(size // CLUSTER))
    rng.shuffle(clusters)
    qemu_io(img, [f"write -P {c % 251} {c * CLUSTER + rng.randrange(16) * 4096} 4k"
                  for c in clusters])


def writers(n):
    def build(img, size, rng):
        create(img, size)
        region = size // n
        nxt = [k * region for k in range(n)]
        cmds = []
        live = list(range(n))
        while live:
            k = rng.choice(live)
            cmds.append(f"write -P {k + 1} {nxt[k]} 64k")
            nxt[k] += CLUSTER
            if nxt[k] >= (k + 1) * region:
                live.remove(k)
        qemu_io(img, cmds)
    return build


def convert(img, size, rng):
    src = img + ".src"
    random4k(src, size, rng)
    subprocess.run(["qemu-img", "convert", "-q", "-W", "-m", "16", "-f", "qcow2", "-O",
                    "qcow2", src, img], check=True)
    subprocess.run(["rm", "-f", src], check=True)


def linear(img, size, rng):
    create(img, size)
    qemu_io(img, [f"write -P 1 {off} 1M" for off in range(0, size, 1 << 20)])


def rewrite(img, size, rng):
    create(img, size)
    qemu_io(img, [f"write -P 1 {off} 1M" for off in range(0, size, 1 << 20)])
    pieces = list(range(size >> 20))
    rng.shuffle(pieces)
    gone = pieces[: len(pieces) // 4]
    qemu_io(img, [f"discard {p << 20} 1M" for p in gone])
    again = [p * (1 << 20) + c * CLUSTER for p in gone for c in range(16)]
    rng.shuffle(again)
    qemu_io(img, [f"write -P 2 {off} 64k" for off in again])


LAYOUTS = {"linear": linear, "random4k": random4k, "writers2": writers(2), "writers4": writers(4),
           "convert": convert, "rewrite": rewrite}


def main():
    d, size = sys.argv[1], int(sys.argv[2]) << 20
    for name in sys.argv[3:] or LAYOUTS:
        img = f"{d}/{name}.qcow2"
        LAYOUTS[name](img, size, random.Random(name))
        p = subprocess.run(["qemu-img", "check", "--output=json", img], capture_output=True,
                           text=True)
        r = json.loads(p.stdout)
        print(f"{name}: {img}: {r.get('allocated-clusters', 0)} clusters allocated, "
              f"{r.get('fragmented-clusters', 0)} fragmented (qemu-img check)")


main()
