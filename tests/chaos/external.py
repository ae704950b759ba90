"""External snapshots of a chaos disk (bdev_qcow2_snapshot_external) and what a kill leaves
of them. The new overlay records the old image's bdev name as its backing file; a symlink of
that name next to the images lets qemu-img follow the chain. A kill after the switch but
before the config was saved leaves a config that still serves the old image while the
newest writes are in the overlay: the overlay is then adopted into the config, as an
operator would (RPC.md, bdev_qcow2_snapshot_external)."""

import json
import os
import subprocess


class Pending:
    """An external snapshot asked for and not yet in a saved config."""

    def __init__(self, file, aio, snap, old_file, old_base):
        self.file, self.aio, self.snap = file, aio, snap
        self.old_file, self.old_base = old_file, old_base


def prepare(wd, name, k, old_file, old_base, size):
    """The new overlay's file (sparse, `size` bytes) and the symlink qemu-img follows from it
    to the old image; returns the Pending snapshot."""
    file = f"{name}-x{k}.qcow2"
    with open(os.path.join(wd, file), "wb") as f:
        f.truncate(size)
    snap = f"{name}_x{k}"
    link = os.path.join(wd, snap)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(old_file, link)
    return Pending(file, f"aio_{name}_x{k}", snap, old_file, old_base)


def creates(cfg):
    for sub in cfg["subsystems"]:
        for call in sub.get("config") or []:
            yield sub, call


def current(cfg, name):
    """(base bdev, backing bdev, image file) of bdev `name` in the saved config `cfg`."""
    files = {c["params"]["name"]: c["params"]["filename"] for _, c in creates(cfg)
             if c["method"] == "bdev_aio_create"}
    for _, c in creates(cfg):
        p = c.get("params", {})
        if c["method"] == "bdev_qcow2_create" and p.get("name") == name:
            base = p["base_bdev"]
            return base, p.get("backing_bdev"), os.path.basename(files.get(base, ""))
    raise RuntimeError(f"no bdev_qcow2_create of {name} in the saved config")


def switched(wd, pend):
    """Whether the overlay of `pend` was formatted: a qcow2 image naming the old bdev."""
    p = subprocess.run(["qemu-img", "info", "-U", "--output=json", "-f", "qcow2",
                        os.path.join(wd, pend.file)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        return False
    return json.loads(p.stdout).get("backing-filename") == pend.snap


def adopt(cfg, wd, name, pend):
    """Rewrites `cfg` so that bdev `name` serves the overlay of `pend` over the old image,
    read-only as bdev `pend.snap`."""
    for sub, c in creates(cfg):
        p = c.get("params", {})
        if c["method"] != "bdev_qcow2_create" or p.get("name") != name:
            continue
        calls = sub["config"]
        at = calls.index(c)
        old = dict(p)
        p["base_bdev"], p["backing_bdev"] = pend.aio, pend.snap
        ro = {"name": pend.snap, "base_bdev": pend.old_base, "read_only": True}
        if old.get("backing_bdev"):
            ro["backing_bdev"] = old["backing_bdev"]
        new = [{"method": "bdev_qcow2_create", "params": ro}]
        if not any(x["method"] == "bdev_aio_create" and x["params"]["name"] == pend.aio
                   for x in calls):
            new.insert(0, {"method": "bdev_aio_create", "params": {
                "name": pend.aio, "filename": os.path.join(wd, pend.file),
                "block_size": 512}})
        calls[at:at] = new
        return
    raise RuntimeError(f"no bdev_qcow2_create of {name} in the saved config")
