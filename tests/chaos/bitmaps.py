"""Persistent dirty bitmaps of a chaos disk, as QEMU reads them: their flags from `qemu-img
info`, their dirty ranges through `qemu-nbd -B` and `qemu-img map` (a dirty range reads as
one without data). A bitmap stored by a clean close must cover every block written since it
was added; one the process died with must be marked `in-use` (QEMU then trusts none of it).
"""

import json
import os
import subprocess
import time

# The bitmaps the bitmap disk carries: name -> enabled (records writes).
BITMAPS = {"b0": True, "b1": False}


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def add_all(img):
    """Adds the BITMAPS to `img` (offline), as an operator would with qemu-img."""
    for name, enabled in BITMAPS.items():
        p = run(["qemu-img", "bitmap", "--add"] + ([] if enabled else ["--disable"])
                + ["-f", "qcow2", img, name])
        if p.returncode:
            raise RuntimeError(f"qemu-img bitmap --add {name}: {p.stdout}")


def flags(img):
    """{name: flags} of the bitmaps `qemu-img info` lists for `img`."""
    p = run(["qemu-img", "info", "-U", "--output=json", "-f", "qcow2", img])
    if p.returncode:
        raise RuntimeError(f"qemu-img info {img}: {p.stdout}")
    data = (json.loads(p.stdout).get("format-specific") or {}).get("data") or {}
    return {b["name"]: b.get("flags", []) for b in data.get("bitmaps", [])}


def dirty_ranges(img, name):
    """The dirty byte ranges [(start, length)] of bitmap `name` of `img`."""
    sock = f"{img}.{name}.sock"
    if os.path.exists(sock):
        os.unlink(sock)
    nbd = subprocess.Popen(["qemu-nbd", "-r", "-f", "qcow2", "-B", name, "-k", sock, img],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.time() + 20
        while not os.path.exists(sock):
            if nbd.poll() is not None:
                raise RuntimeError(f"qemu-nbd -B {name}: {nbd.stderr.read().decode()}")
            if time.time() > end:
                raise RuntimeError("qemu-nbd did not start")
            time.sleep(0.02)
        opts = (f"driver=nbd,server.type=unix,server.path={sock},"
                f"x-dirty-bitmap=qemu:dirty-bitmap:{name}")
        p = run(["qemu-img", "map", "--output=json", "--image-opts", opts])
        if p.returncode:
            raise RuntimeError(f"qemu-img map of bitmap {name}: {p.stdout}")
    finally:
        nbd.kill()
        nbd.wait()
        if os.path.exists(sock):
            os.unlink(sock)
    return [(e["start"], e["length"]) for e in json.loads(p.stdout) if e.get("data") is False]


def uncovered(img, name, touched, block):
    """The blocks of `touched` ({lba: kind}) that bitmap `name` does not mark dirty."""
    ranges = sorted(dirty_ranges(img, name))
    out, k = [], 0
    for lba in sorted(touched):
        off = lba * block
        while k < len(ranges) and ranges[k][0] + ranges[k][1] <= off:
            k += 1
        if k == len(ranges) or ranges[k][0] > off:
            out.append((lba, touched[lba]))
    return out


def check_stored(img, touched, block, stale=()):
    """After a clean close: every bitmap stored (no `in-use`), an enabled one covers every
    block touched since it was added, a disabled one marks nothing; except the `stale` ones,
    in use (inconsistent) when the image was opened, which must still say so. Returns what
    is wrong."""
    bad = []
    have = flags(img)
    for name, enabled in BITMAPS.items():
        if name not in have:
            bad.append(f"bitmap {name} is gone")
            continue
        if name in stale:
            if "in-use" not in have[name]:
                bad.append(f"bitmap {name} was in use (inconsistent) when the image was "
                           f"opened, and was stored as consistent: {have[name]}")
            continue
        if "in-use" in have[name]:
            bad.append(f"bitmap {name} still in use after a clean close: {have[name]}")
            continue
        if enabled:
            miss = uncovered(img, name, touched, block)
            if miss:
                bad.append(f"bitmap {name} misses {len(miss)} touched blocks, first "
                           f"{miss[:4]}")
        elif dirty_ranges(img, name):
            bad.append(f"disabled bitmap {name} marks {dirty_ranges(img, name)[:4]}")
    return bad


def after_kill(img, touched, block, stale=()):
    """After a SIGKILL: each bitmap marked `in-use`, or stored and consistent (the kill came
    while the bdev was deleted). Returns (what is wrong, names in use)."""
    have = flags(img)
    bad, in_use = [], []
    for name in BITMAPS:
        if name not in have:
            bad.append(f"bitmap {name} is gone")
        elif "in-use" in have[name]:
            in_use.append(name)
    stored = [n for n in BITMAPS if n in have and n not in in_use]
    if stored:
        bad += [b for b in check_stored(img, touched, block, stale)
                if any(b.startswith(f"bitmap {n} ") or b.startswith(f"disabled bitmap {n} ")
                       for n in stored)]
    return bad, in_use


def renew(img, names):
    """Removes the in-use bitmaps `names` of `img` and adds them afresh (offline), as an
    operator starts a new backup chain after a crash."""
    for name in names:
        p = run(["qemu-img", "bitmap", "--remove", "-f", "qcow2", img, name])
        if p.returncode:
            raise RuntimeError(f"qemu-img bitmap --remove {name}: {p.stdout}")
        enabled = BITMAPS[name]
        p = run(["qemu-img", "bitmap", "--add"] + ([] if enabled else ["--disable"])
                + ["-f", "qcow2", img, name])
        if p.returncode:
            raise RuntimeError(f"qemu-img bitmap --add {name}: {p.stdout}")
