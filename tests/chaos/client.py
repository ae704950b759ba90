"""One client thread per disk: random writes, reads, flushes, write-zeroes and deallocates
over NVMe/TCP, one at a time, each recorded in the disk's model before it is sent and after
it completes, until the target dies or the driver says stop."""

import contextlib
import threading
import time

from model import BLOCK, ZERO
from nvme_tcp import Controller, LinkError, NvmeError

CHUNK = 128 << 10


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = {}
        self.bytes_verified = 0
        self.wrong_blocks = 0

    def op(self, kind, n=1):
        with self.lock:
            self.ops[kind] = self.ops.get(kind, 0) + n

    def verified(self, nbytes, bad):
        with self.lock:
            self.bytes_verified += nbytes
            self.wrong_blocks += bad


def connect(port, nqn, deadline_s=30):
    """Connects, retrying while the target's listener comes up."""
    end = time.time() + deadline_s
    while True:
        try:
            return Controller("127.0.0.1", port, nqn)
        except (LinkError, NvmeError):
            if time.time() > end:
                raise
            time.sleep(0.2)


def read_all(ctrl):
    out = bytearray()
    step = min(CHUNK, ctrl.max_bytes) // BLOCK
    lba = 0
    while lba < ctrl.blocks:
        n = min(step, ctrl.blocks - lba)
        out += ctrl.read(lba, n)
        lba += n
    return bytes(out)


class Worker(threading.Thread):
    def __init__(self, ctrl, disk, rng, gens, stats, errors, stop, lo=0, hi=None):
        super().__init__(daemon=True)
        self.lo, self.hi = lo, hi  # the blocks this client owns (hi None: to the end)
        self.ctrl, self.disk, self.rng, self.gens = ctrl, disk, rng, gens
        self.stats, self.errors, self.stop = stats, errors, stop
        self.want_blocks = 0  # set by the driver after a resize
        self.link_lost = False
        # Held around each command: the driver takes it to pause this client.
        self.gate = threading.Lock()
        self.hold = False
        self.tolerate_errors = False

    @contextlib.contextmanager
    def paused(self):
        """No command of this client runs inside the block. Left by an OSError (the target
        died under the driver's RPC), the client stays held until it is stopped: a command
        it sent then would count its blocks as touched though no bdev could take them (with
        the bdev deleted, its bitmaps were stored without them)."""
        self.hold = True
        try:
            with self.gate:
                yield
        except OSError:
            raise
        except BaseException:
            self.hold = False
            raise
        self.hold = False

    def run(self):
        try:
            while not self.stop.is_set() and not self.errors:
                with self.gate:
                    # A pause that took the gate first and failed leaves the client held:
                    # not one more command (this thread may have waited on the gate).
                    if not self.hold:
                        self._one()
                while self.hold and not self.stop.is_set():  # let the driver take the gate
                    time.sleep(0.005)
        except LinkError:
            self.link_lost = True
        except Exception as e:  # a bug in the test itself: fail loudly
            self.errors.append(f"disk {self.disk.index}: client crashed: {e!r}")
        finally:
            self.ctrl.close()

    def _range(self):
        r = self.rng
        most = min(CHUNK, self.ctrl.max_bytes) // BLOCK
        n = r.choice((1, 7, 8, 8, 16, 32, 64, 128, r.randint(1, most), most))
        end = self.disk.blocks if self.hi is None else self.hi
        n = min(n, end - self.lo)
        lba = r.randrange(self.lo, end - n + 1)
        if r.random() < 0.6:  # 4 KiB aligned, as guests mostly write
            lba = max(self.lo, lba & ~7)
        return lba, n

    def _grow(self):
        if self.want_blocks > self.disk.blocks:
            blocks = self.ctrl.refresh()
            if blocks > self.disk.blocks:
                self.disk.grow(blocks)
                self.stats.op("resize_seen")

    def _one(self):
        self._grow()
        r, d, c = self.rng.random(), self.disk, self.ctrl
        lba, n = self._range()
        try:
            if r < 0.40:
                gen = next(self.gens)
                d.begin_write(lba, n, gen)
                try:
                    c.write(lba, self.disk.pattern.blocks(d.index, lba, n, gen))
                except NvmeError:
                    d.failed_write(lba, n, gen)
                    raise
                d.end_write(lba, n, gen)
                self.stats.op("write")
            elif r < 0.70:
                data = c.read(lba, n)
                bad = d.check_read(lba, data)
                self.stats.verified(len(data), len(bad))
                for lba_bad, why in bad[:4]:
                    self.errors.append(f"disk {d.index}: read at block {lba_bad}: {why}")
                self.stats.op("read")
            elif r < 0.82:
                blocks = d.blocks
                c.flush()
                d.flushed(self.lo, self.hi, blocks)
                self.stats.op("flush")
            elif r < 0.91:
                d.begin_write(lba, n, ZERO)
                try:
                    c.write_zeroes(lba, n)
                except NvmeError:
                    d.failed_write(lba, n, ZERO)
                    raise
                d.end_write(lba, n, ZERO)
                self.stats.op("write_zeroes")
            else:
                d.begin_deallocate(lba, n)
                try:
                    c.deallocate(lba, n)
                finally:
                    d.end_deallocate(lba, n)
                self.stats.op("deallocate")
        except NvmeError as e:
            if self.tolerate_errors:  # errors injected under the bdev: the model allows both
                self.stats.op("io_errors")
            else:
                self.errors.append(f"disk {d.index}: {e} (lba {lba}, {n} blocks)")


class Group:
    """The clients of one disk, told and paused together."""

    def __init__(self, workers):
        self.workers = workers

    @contextlib.contextmanager
    def paused(self):
        with contextlib.ExitStack() as stack:
            for w in self.workers:
                stack.enter_context(w.paused())
            yield

    def resized(self, blocks):
        for w in self.workers:
            w.want_blocks = blocks

    def tolerate_errors(self):
        for w in self.workers:
            w.tolerate_errors = True

    def tolerating_errors(self):
        """Whether errors were injected under this disk in this life."""
        return any(w.tolerate_errors for w in self.workers)
