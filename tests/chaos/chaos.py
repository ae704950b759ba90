"""The chaos driver: spdk_tgt with our module serves qcow2 bdevs over NVMe/TCP; client
threads load them (client.py) against a model of every block (model.py); meanwhile this
driver issues life-cycle RPCs at random and SIGKILLs spdk_tgt at random moments. After each
kill: `qemu-img check` (leaks allowed, no corruption), QEMU's view of every image checked
against the model, spdk_tgt restarted from the config it saved, and its view compared with
QEMU's byte for byte. Run by tests/chaos.sh."""

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bitmaps  # noqa: E402
import external  # noqa: E402
from client import Group, Stats, Worker, connect, read_all  # noqa: E402
from model import BLOCK, GOLDEN, Disk, Pattern  # noqa: E402
from target import RpcError, Target  # noqa: E402

MIB = 1 << 20


class Spec:
    """One exported qcow2 bdev. `golden`: an overlay on that golden image (a read-only qcow2
    bdev; `compress`: its clusters compressed with that type); `streams`: the driver
    streams it; `bitmaps`: it carries persistent dirty bitmaps; `external`: the driver takes
    external snapshots of it (its image file, base and backing then change)."""

    def __init__(self, index, name, cluster, extended_l2=False, golden=None, compress=None,
                 error=False, streams=False, bitmaps=False, external=False):
        self.index, self.name, self.cluster = index, name, cluster
        self.extended_l2, self.golden, self.compress = extended_l2, golden, compress
        self.error, self.streams, self.bitmaps, self.external = error, streams, bitmaps, external
        # With `error`, the image sits on an error bdev (bdev_error) over its AIO bdev.
        self.base = f"EE_aio_{name}" if error else f"aio_{name}"
        self.backing = golden
        self.file = f"{name}.qcow2"
        self.nqn = f"nqn.2016-06.io.spdk:chaos-{name}"


SPECS = [Spec(0, "plain", 65536, error=True),
         Spec(1, "overlay", 16384, extended_l2=True, golden="golden", streams=True),
         Spec(2, "zoverlay", 65536, golden="zgolden", compress="zstd", external=True),
         Spec(3, "bitmap", 65536, bitmaps=True)]
MAX_EXTERNAL = 5  # external snapshots per disk (each one deepens the chain)


def run(cmd, ok=(0,)):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}")
    return p


def extend(path, size):
    with open(path, "r+b") as f:
        f.truncate(max(size, os.path.getsize(path)))


def make_golden(wd, s, size, pattern):
    """The golden image under `s`: its disk's GOLDEN blocks, compressed with `s.compress`
    (qemu-img convert -c) if set."""
    raw = os.path.join(wd, f"{s.golden}.raw")
    with open(raw, "wb") as f:
        f.write(pattern.blocks(s.index, 0, size // BLOCK, GOLDEN))
    img = os.path.join(wd, f"{s.golden}.qcow2")
    cmd = ["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2"]
    if s.compress:
        cmd += ["-c", "-o", f"compression_type={s.compress}"]
    run(cmd + [raw, img])
    os.unlink(raw)
    if s.compress:
        p = run(["qemu-img", "check", "-f", "qcow2", img])
        if "compressed clusters" not in p.stdout:
            raise RuntimeError(f"{img} holds no compressed cluster:\n{p.stdout}")
    extend(img, 64 * MIB)


def make_images(wd, size, pattern):
    for s in SPECS:
        if s.golden:
            make_golden(wd, s, size, pattern)
        opts = f"cluster_size={s.cluster}" + (",extended_l2=on" if s.extended_l2 else "")
        cmd = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts]
        if s.golden:
            cmd += ["-b", f"{s.golden}.qcow2", "-F", "qcow2"]
        img = os.path.join(wd, s.file)
        run(cmd + [img, str(size)])
        if s.bitmaps:
            bitmaps.add_all(img)
        # Room on the base for the image to grow (AIO bdevs have the file's size).
        extend(img, 512 * MIB)


def initial_config(wd, port):
    bdev = []
    for g in [s.golden for s in SPECS if s.golden]:
        bdev += [{"method": "bdev_aio_create",
                  "params": {"name": f"aio_{g}", "filename": os.path.join(wd, f"{g}.qcow2"),
                             "block_size": 512}},
                 {"method": "bdev_qcow2_create",
                  "params": {"name": g, "base_bdev": f"aio_{g}", "read_only": True}}]
    nvmf = [{"method": "nvmf_create_transport", "params": {"trtype": "TCP"}}]
    for s in SPECS:
        bdev.append({"method": "bdev_aio_create",
                     "params": {"name": f"aio_{s.name}", "block_size": 512,
                                "filename": os.path.join(wd, s.file)}})
        if s.error:
            bdev.append({"method": "bdev_error_create", "params": {"base_name": f"aio_{s.name}"}})
        p = {"name": s.name, "base_bdev": s.base}
        if s.golden:
            p["backing_bdev"] = s.golden
        bdev.append({"method": "bdev_qcow2_create", "params": p})
        nvmf += [
            {"method": "nvmf_create_subsystem",
             "params": {"nqn": s.nqn, "allow_any_host": True,
                        "serial_number": f"CHAOS{s.index:015d}", "model_number": "bdev_qcow2"}},
            {"method": "nvmf_subsystem_add_ns",
             "params": {"nqn": s.nqn, "namespace": {"bdev_name": s.name}}},
            {"method": "nvmf_subsystem_add_listener",
             "params": {"nqn": s.nqn, "listen_address": {
                 "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                 "trsvcid": str(port)}}}]
    bdev.append({"method": "bdev_wait_for_examine"})
    cfg = {"subsystems": [{"subsystem": "bdev", "config": bdev},
                          {"subsystem": "nvmf", "config": nvmf}]}
    path = os.path.join(wd, "initial.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


class Chaos:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.wd = a.workdir
        self.pattern = Pattern(a.seed)
        size = a.size_mib * MIB
        self.max_blocks = 2 * size // BLOCK
        self.base_blocks = size // BLOCK
        self.disks = [Disk(s.index, size // BLOCK, size // BLOCK if s.golden else 0,
                           self.pattern) for s in SPECS]
        self.snapshots = [[] for _ in SPECS]
        self.records = [{} for _ in SPECS]  # snapshot name -> the model's cur when taken
        self.streaming = False  # a bdev_qcow2_stream job runs on the golden overlay
        self.streamed = False  # the overlay's header no longer names golden.qcow2
        self.pending_ext = {}  # disk -> an external snapshot not yet in a saved config
        self.ext_done = [0] * len(SPECS)
        self.ext_seq = itertools.count(1)
        self.stale_bitmaps = set()  # left in use after a kill: must stay marked so
        self.gens = itertools.count(2)
        self.stats = Stats()
        self.errors = []
        self.cycles = self.kills = 0
        self.saved = os.path.join(self.wd, "config.json")
        self.target = Target(self.wd, a.module, a.mem_args.split(), a.cores)

    def fail(self, msg):
        self.errors.append(msg)

    def save(self):
        self.target.save_config(self.saved)

    def check_images(self):
        """Target dead: qemu-img check, then QEMU's view of each image against the model."""
        raws = []
        for s, d in zip(SPECS, self.disks):
            if s.external:
                self.external_after_kill(s)
            img = os.path.join(self.wd, s.file)
            p = run(["qemu-img", "check", "-f", "qcow2", img], ok=(0, 1, 2, 3))
            if p.returncode not in (0, 3):
                self.fail(f"cycle {self.cycles}: qemu-img check {s.name}: exit {p.returncode}\n"
                          f"{p.stdout}")
            if "leaked" in p.stdout:
                self.stats.op("leaky_checks")
            if s.streams:
                self.header_after_kill(s, img)
            if s.bitmaps:
                self.bitmaps_after_kill(s, d, img)
            self.check_snapshots(s, img)
            raw = os.path.join(self.wd, f"{s.name}.raw")
            run(["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", img, raw])
            with open(raw, "rb") as f:
                data = f.read()
            os.unlink(raw)
            for why in d.after_crash(len(data) // BLOCK):
                self.fail(f"cycle {self.cycles}: {s.name}: {why}")
            bad = d.check_read(0, data, after_crash=True)
            self.stats.verified(len(data), len(bad))
            for lba, why in bad[:8]:
                self.fail(f"cycle {self.cycles}: {s.name} (qemu-img's view) block {lba}: {why}")
            raws.append(data)
        return raws

    def connect_and_verify(self, raws):
        """Target up: every disk read whole over NVMe/TCP, equal to QEMU's view (after a
        crash) or to the model."""
        ctrls = []
        for s, d in zip(SPECS, self.disks):
            c = connect(self.a.port, s.nqn)
            data = read_all(c)
            if raws is not None:
                if data != raws[s.index]:
                    first = next((i for i in range(0, min(len(data), len(raws[s.index])), BLOCK)
                                  if data[i:i + BLOCK] != raws[s.index][i:i + BLOCK]), None)
                    self.fail(f"cycle {self.cycles}: {s.name}: spdk_tgt reads {len(data)} bytes, "
                              f"qemu-img {len(raws[s.index])}; first difference at block "
                              f"{None if first is None else first // BLOCK}")
                self.stats.verified(len(data), 0)
                d.settle()
            else:
                bad = d.check_read(0, data)
                self.stats.verified(len(data), len(bad))
                for lba, why in bad[:8]:
                    self.fail(f"cycle {self.cycles}: {s.name} block {lba}: {why}")
            ctrls.append(c)
            ctrls += [connect(self.a.port, s.nqn) for _ in range(self.a.clients - 1)]
        return ctrls

    def resync_snapshots(self):
        for s in SPECS:
            lst = self.target.call("bdev_qcow2_snapshot_list", {"name": s.name})
            self.snapshots[s.index] = [x["name"] for x in lst]
            for name in set(self.records[s.index]) - set(self.snapshots[s.index]):
                self.fail(f"cycle {self.cycles}: {s.name}: snapshot {name} is gone")

    def lifecycle(self, groups):
        """One random life-cycle RPC; False when the target died under it."""
        r = self.rng.random()
        i = self.rng.randrange(len(SPECS))
        s, snaps, w = SPECS[i], self.snapshots[i], groups[i]
        if self.streaming and not self.poll_stream():
            return False
        busy = s.streams and self.streaming
        if self.rng.random() < self.a.rpc_kill:
            # Kill within the RPC that follows, wherever it is then.
            threading.Timer(self.rng.uniform(0, 0.03), self.target.kill_now).start()
            self.stats.op("kills_in_rpc")
        try:
            if r < 0.30 and len(snaps) < 6:
                self.snapshot_create(i, w)
            elif r < 0.55 and snaps:
                name = snaps.pop(self.rng.randrange(len(snaps)))
                self.records[i].pop(name, None)
                self.target.call("bdev_qcow2_snapshot_delete", {"name": s.name, "snapshot": name})
                self.stats.op("snapshot_delete")
            elif r < 0.75 and r >= 0.62 and s.external and self.ext_done[i] < MAX_EXTERNAL:
                self.snapshot_external(i)
            elif r < 0.75:
                blocks = self.disks[i].blocks + self.rng.choice((1, 2, 4)) * MIB // BLOCK
                if blocks > self.max_blocks:
                    return True
                self.target.call("bdev_qcow2_resize", {"name": s.name, "size": blocks * BLOCK})
                w.resized(blocks)
                self.stats.op("resize")
            elif r < 0.85:
                if busy:
                    return True  # a bdev is not deleted under its own stream here
                self.recreate(s, w)
            elif r < 0.95 and s.streams and not (self.streamed or self.streaming):
                rate = self.rng.choice((4, 16, 64)) * MIB
                self.target.call("bdev_qcow2_stream", {"name": s.name, "rate_limit": rate})
                self.streaming = True
                self.stats.op("stream")
            elif r < 0.92 and s.error:
                io = self.rng.choice(("write", "read", "flush", "unmap", "all"))
                w.tolerate_errors()  # before: the first failure may beat the RPC's answer
                self.target.call("bdev_error_inject_error", {
                    "name": s.base, "io_type": io, "error_type": "failure",
                    "num": self.rng.randint(1, 16)})
                self.stats.op("inject_errors")
            else:
                self.target.call("bdev_qcow2_get_stats", {"name": s.name})
                self.stats.op("get_stats")
            if self.rng.random() < self.a.rpc_kill / 2:
                # Killed after the RPC's answer, before the config is saved: the restart
                # comes from a config that predates the operation.
                self.target.kill_now()
                self.stats.op("kills_before_save")
                return False
            self.save()
            self.pending_ext.clear()
        except RpcError as e:
            if busy and ("-16" in str(e) or "busy" in str(e).lower()):
                self.stats.op("busy_while_streaming")
            elif s.error and w.tolerating_errors() and "'code': -5" in str(e):
                # The base fails the metadata writes as injected: the operation fails, and
                # the image must stay consistent (checked after the kill).
                self.stats.op("rpc_failed_by_injected_errors")
            else:
                self.fail(f"cycle {self.cycles}: {e}")
        except OSError:
            return False
        return True

    def poll_stream(self):
        """Saves the config once the stream is done (it then drops backing_bdev)."""
        s = next(x for x in SPECS if x.streams)
        try:
            st = self.target.call("bdev_qcow2_get_stats", {"name": s.name})
        except OSError:
            return False
        job = ((st[0].get("owner") or {}).get("stream") or {}) if st else {}
        if job.get("state") == "failed":
            self.fail(f"cycle {self.cycles}: stream failed: {job}")
        if job.get("state") == "done":
            self.stream_finished()
            try:
                self.save()
            except OSError:
                return False
            self.stats.op("stream_done")
        return True

    def stream_finished(self):
        """The overlay's header dropped its backing file. Internal snapshots taken before
        share the header: where they read through to the golden image they now read zeros
        (QEMU's block-stream does the same; qemu-img reads them so)."""
        if not self.streamed:
            s = next(x for x in SPECS if x.streams)
            for rec in self.records[s.index].values():
                for i, ok in enumerate(rec):
                    if GOLDEN in ok:
                        rec[i] = ok | {0}
        self.streaming, self.streamed = False, True

    def header_after_kill(self, s, img):
        """A stream may have dropped the backing file after the config was last saved: the
        restart's create is then given a backing_bdev the image no longer names, which it
        releases (RPC.md, bdev_qcow2_stream); counted, and the config left as saved."""
        info = json.loads(run(["qemu-img", "info", "--output=json", "-U", img]).stdout)
        if "backing-filename" in info:
            self.streaming = False  # the job died with the process
            return
        self.stream_finished()
        with open(self.saved) as f:
            cfg = json.load(f)
        for sub in cfg["subsystems"]:
            for call in sub.get("config") or []:
                p = call.get("params", {})
                if call["method"] == "bdev_qcow2_create" and p.get("name") == s.name \
                        and "backing_bdev" in p:
                    self.stats.op("restart_with_streamed_backing")

    def bitmaps_after_kill(self, s, d, img):
        """Each bitmap marked in use, or stored and covering what was written; in-use ones
        are renewed offline (an operator's new backup chain) and recorded from now on."""
        bad, in_use = bitmaps.after_kill(img, d.touched, BLOCK, self.stale_bitmaps)
        for why in bad:
            self.fail(f"cycle {self.cycles}: {s.name}: {why}")
        self.stats.op("bitmaps_in_use_after_kill", len(in_use))
        self.stats.op("bitmaps_checked_after_kill", len(bitmaps.BITMAPS))
        if in_use and self.rng.random() < 0.3:
            # Left in use: the bdev opens them inconsistent, and must not store them as
            # consistent at its next clean close.
            self.stale_bitmaps |= set(in_use)
            self.stats.op("bitmaps_left_in_use", len(in_use))
        elif in_use:
            bitmaps.renew(img, in_use)
            self.stale_bitmaps -= set(in_use)
            if any(bitmaps.BITMAPS[n] for n in in_use):
                d.untouch()

    def bitmaps_stored(self, s):
        """The bdev closed cleanly (deleted, or the target stopped): its bitmaps are stored
        and the enabled one covers every block touched since it was added."""
        d = self.disks[s.index]
        img = os.path.join(self.wd, s.file)
        for why in bitmaps.check_stored(img, d.touched, BLOCK, self.stale_bitmaps):
            self.fail(f"cycle {self.cycles}: {s.name} after a clean close: {why}")
        self.stats.op("bitmaps_checked_stored", len(bitmaps.BITMAPS))
        if not self.stale_bitmaps:
            self.stats.op("bitmap_blocks_checked", len(d.touched))

    def snapshot_external(self, i):
        """The disk's image becomes a read-only bdev under a new overlay on a new file."""
        s = SPECS[i]
        pend = external.prepare(self.wd, s.name, next(self.ext_seq), s.file, s.base,
                                512 * MIB)
        self.target.call("bdev_aio_create", {"name": pend.aio, "block_size": 512,
                                             "filename": os.path.join(self.wd, pend.file)})
        self.pending_ext[i] = pend
        try:
            self.target.call("bdev_qcow2_snapshot_external", {
                "name": s.name, "base_bdev": pend.aio, "snapshot_name": pend.snap})
        except RpcError:
            self.pending_ext.pop(i, None)
            raise
        self.switched_external(i, pend)
        self.stats.op("snapshot_external")

    def switched_external(self, i, pend):
        s = SPECS[i]
        s.file, s.base, s.backing = pend.file, pend.aio, pend.snap
        self.ext_done[i] += 1
        # Internal snapshots stay with the old image.
        self.snapshots[i], self.records[i] = [], {}

    def external_after_kill(self, s):
        """The saved config serves the image the disk has: an external snapshot killed
        before its config was saved is adopted (external.py); the disk's file, base and
        backing follow the config."""
        with open(self.saved) as f:
            cfg = json.load(f)
        pend = self.pending_ext.pop(s.index, None)
        if pend and external.current(cfg, s.name)[0] != pend.aio \
                and external.switched(self.wd, pend):
            external.adopt(cfg, self.wd, s.name, pend)
            with open(self.saved, "w") as f:
                json.dump(cfg, f, indent=1)
            self.switched_external(s.index, pend)
            self.stats.op("external_adopted_after_kill")
            print(f"CHAOS NOTE: cycle {self.cycles}: {s.name}: the config saved before the "
                  f"external snapshot {pend.snap} ended: its overlay adopted", flush=True)
        s.base, s.backing, s.file = external.current(cfg, s.name)

    def snapshot_create(self, i, w):
        """Half the snapshots are taken with the client paused, and what the model says the
        disk holds then is recorded, to check the snapshot against after each kill."""
        name = f"c{self.cycles}-{self.rng.randrange(1 << 30)}"
        params = {"name": SPECS[i].name, "snapshot": name}
        if self.rng.random() < 0.5:
            with w.paused():
                self.target.call("bdev_qcow2_snapshot_create", params)
                self.records[i][name] = list(self.disks[i].cur)
            self.stats.op("snapshot_create_recorded")
        else:
            self.target.call("bdev_qcow2_snapshot_create", params)
        self.snapshots[i].append(name)
        self.stats.op("snapshot_create")

    def recreate(self, s, w):
        """The bdev deleted and created again under its NVMe-oF namespace."""
        with w.paused():
            self.target.call("nvmf_subsystem_remove_ns", {"nqn": s.nqn, "nsid": 1})
            self.target.call("bdev_qcow2_delete", {"name": s.name})
            if s.bitmaps:
                self.bitmaps_stored(s)
            p = {"name": s.name, "base_bdev": s.base}
            if s.backing and not (s.streams and self.streamed):
                p["backing_bdev"] = s.backing
            self.target.call("bdev_qcow2_create", p)
            self.target.call("nvmf_subsystem_add_ns",
                             {"nqn": s.nqn, "namespace": {"bdev_name": s.name, "nsid": 1}})
        self.stats.op("delete_recreate")

    def check_snapshots(self, s, img):
        """Each recorded snapshot holds what the model said the disk held when it was taken."""
        for name, rec in self.records[s.index].items():
            raw = os.path.join(self.wd, "snap.raw")
            p = run(["qemu-img", "convert", "-q", "-f", "qcow2", "-l", f"snapshot.name={name}",
                     "-O", "raw", img, raw], ok=(0, 1))
            if p.returncode:
                self.fail(f"cycle {self.cycles}: {s.name}: snapshot {name} unreadable:\n{p.stdout}")
                continue
            with open(raw, "rb") as f:
                data = f.read()
            os.unlink(raw)
            snap = Disk(s.index, 0, 0, self.pattern)
            snap.cur = rec + [frozenset((0,))] * max(0, len(data) // BLOCK - len(rec))
            bad = snap.check_read(0, data[:len(snap.cur) * BLOCK])
            self.stats.verified(len(data), len(bad))
            self.stats.op("snapshot_checks")
            for lba, why in bad[:8]:
                self.fail(f"cycle {self.cycles}: {s.name} snapshot {name} block {lba}: {why}")

    def cycle(self, ctrls, final=False):
        """One life of the target under load and life-cycle RPCs, ended by a SIGKILL; the
        `final` one is load alone for a moment, ended by stopping the clients."""
        stop = threading.Event()
        workers, per = [], self.a.clients
        for k, c in enumerate(ctrls):
            d = self.disks[k // per]
            j = k % per
            lo = (j * self.base_blocks // per) & ~127
            hi = None if j == per - 1 else ((j + 1) * self.base_blocks // per) & ~127
            rng = random.Random(f"{self.a.seed}-{self.cycles}-{k}")
            workers.append(Worker(c, d, rng, self.gens, self.stats, self.errors, stop, lo, hi))
        groups = [Group(workers[i * per:(i + 1) * per]) for i in range(len(SPECS))]
        for w in workers:
            w.start()
        if final:
            time.sleep(2)
            stop.set()
        else:
            life = self.rng.uniform(0.3, self.a.max_cycle)
            killer = threading.Timer(life, self.target.kill_now)
            killer.start()
            end = time.time() + life
            while time.time() < end and not self.errors:
                time.sleep(self.rng.uniform(0.05, 0.8))
                if time.time() < end and self.rng.random() < self.a.rpc_rate:
                    if not self.lifecycle(groups):
                        break
            killer.cancel()
            self.target.kill()
            self.kills += 1
            stop.set()
        for w in workers:
            w.join(60)
            if w.is_alive():
                self.fail(f"cycle {self.cycles}: client of disk {w.disk.index} hung")
        self.cycles += 1

    def run(self):
        os.makedirs(self.wd, exist_ok=True)
        make_images(self.wd, self.a.size_mib * MIB, self.pattern)
        self.target.start(initial_config(self.wd, self.a.port))
        self.save()
        ctrls = self.connect_and_verify(None)
        deadline = time.time() + self.a.duration
        while not self.errors:
            self.cycle(ctrls)
            raws = self.check_images()
            if self.errors:
                break
            self.target.start(self.saved)
            self.resync_snapshots()
            ctrls = self.connect_and_verify(raws)
            if time.time() > deadline:
                break
        if self.target.proc and not self.errors:
            # Load for a moment, then a clean stop: bitmaps stored and covering the writes,
            # every image checked and read as the model says.
            self.cycle(ctrls, final=True)
        else:
            for c in ctrls:
                c.close()
        if self.target.proc:
            rc = self.target.stop()
            if rc != 0:
                self.fail(f"spdk_tgt's clean stop exited {rc}:\n{self.target.tail()}")
            else:
                for s in SPECS:
                    if s.bitmaps:
                        self.bitmaps_stored(s)
                self.check_images()
        self.report()
        return 1 if self.errors else 0

    def report(self):
        st = self.stats
        ops = " ".join(f"{k}={v}" for k, v in sorted(st.ops.items()))
        print(f"CHAOS seed={self.a.seed} cycles={self.cycles} kills={self.kills} {ops} "
              f"bytes_verified={st.bytes_verified} wrong_blocks={st.wrong_blocks} "
              f"errors={len(self.errors)}", flush=True)
        for e in self.errors[:20]:
            print(f"CHAOS ERROR: {e}", flush=True)
        if self.errors:
            print(f"CHAOS FAILED: replay with SEED={self.a.seed}; workdir {self.wd}; "
                  f"target log {self.target.log}\n{self.target.tail(30)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--workdir", required=True)
    p.add_argument("--module", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cores", default="0x3")
    p.add_argument("--mem-args", default="")
    p.add_argument("--size-mib", type=int, default=32)
    p.add_argument("--max-cycle", type=float, default=6.0, help="longest life between kills, s")
    p.add_argument("--clients", type=int, default=2, help="connections per disk")
    p.add_argument("--rpc-kill", type=float, default=0.1,
                   help="chance that a life-cycle RPC is cut by a kill")
    p.add_argument("--rpc-rate", type=float, default=0.8)
    a = p.parse_args()
    print(f"CHAOS seed={a.seed} duration={a.duration}s workdir={a.workdir}", flush=True)
    c = Chaos(a)
    try:
        rc = c.run()
    finally:
        c.target.kill()
    sys.exit(rc)


if __name__ == "__main__":
    main()
