"""The chaos test's model of every 512-byte block of a disk.

Each block written holds a tag: a magic, its disk, its LBA and the write's generation, then
a filler derived from the seed, so a read tells which write it holds. Values: ZERO (all
zero bytes), GOLDEN (the golden image's block, generation 1), or a write's generation (>= 2).

Per block the model keeps three sets of acceptable values:
- `cur`: what a read may return now (exact after a write; a deallocate adds ZERO/GOLDEN,
  since qcow2 may drop the clusters or keep them);
- `stable`: what survived the last completed flush;
- `pending`: every value written since (acknowledged or in flight), which a crash may or
  may not have kept.
After a crash a block must read a value in stable | pending."""

import random
import struct
import threading

BLOCK = 512
ZERO, GOLDEN = 0, 1
MAGIC = b"CHAOSBLK"
_HDR = struct.Struct("<8sIIQQ")  # magic, disk, reserved, lba, generation
_ZERO_BLOCK = bytes(BLOCK)


class Pattern:
    """Block contents for one seed."""

    def __init__(self, seed):
        rng = random.Random(f"filler-{seed}")
        self.noise = bytes(rng.getrandbits(8) for _ in range(8192))

    def block(self, disk, lba, gen):
        if gen == ZERO:
            return _ZERO_BLOCK
        off = (lba * 131 + gen * 977) % 4096
        return _HDR.pack(MAGIC, disk, 0, lba, gen) + self.noise[off:off + BLOCK - _HDR.size]

    def blocks(self, disk, lba, n, gen):
        return b"".join(self.block(disk, lba + i, gen) for i in range(n))

    def value(self, disk, lba, data):
        """The value a block holds, or None when it is no block we could have written."""
        if data == _ZERO_BLOCK:
            return ZERO
        magic, d, _, l, gen = _HDR.unpack_from(data)
        if magic != MAGIC or d != disk or l != lba or gen == ZERO:
            return None
        return gen if data == self.block(disk, lba, gen) else None


_Z = frozenset((ZERO,))
_G = frozenset((GOLDEN,))


class Disk:
    """The model of one disk (one bdev): `golden_blocks` leading blocks start as GOLDEN."""

    def __init__(self, index, blocks, golden_blocks, pattern):
        self.index = index
        self.pattern = pattern
        self.golden_blocks = golden_blocks
        self.stable = [_G if i < golden_blocks else _Z for i in range(blocks)]
        self.cur = list(self.stable)
        self.pending = {}
        self.flushed_blocks = blocks  # the size the last completed flush covered
        # Several clients share a disk, each in its own range of blocks.
        self.lock = threading.Lock()
        # Blocks each write, write-zeroes ("write") or deallocate ("deallocate") was sent
        # to since `untouch`: a persistent dirty bitmap must cover them.
        self.touched = {}

    @property
    def blocks(self):
        return len(self.cur)

    def _freed(self, lba):
        return frozenset((ZERO, GOLDEN)) if lba < self.golden_blocks else _Z

    def _pend(self, lba, values):
        with self.lock:
            self.pending.setdefault(lba, set()).update(values)

    def _touch(self, lba, n, kind):
        with self.lock:
            for i in range(lba, lba + n):
                self.touched.setdefault(i, kind)

    def untouch(self):
        with self.lock:
            self.touched = {}

    def begin_write(self, lba, n, gen):
        self._touch(lba, n, "write")
        for i in range(lba, lba + n):
            self._pend(i, (gen,))

    def end_write(self, lba, n, gen):
        s = frozenset((gen,))
        for i in range(lba, lba + n):
            self.cur[i] = s

    def failed_write(self, lba, n, gen):
        for i in range(lba, lba + n):
            self.cur[i] = self.cur[i] | {gen}

    def begin_deallocate(self, lba, n):
        self._touch(lba, n, "deallocate")
        for i in range(lba, lba + n):
            self._pend(i, self._freed(i))

    def end_deallocate(self, lba, n):
        for i in range(lba, lba + n):
            self.cur[i] = self.cur[i] | self._freed(i)

    def flushed(self, lo=0, hi=None, blocks=None):
        """A flush completed: what blocks lo..hi held when it was sent is stable, and so is
        the size (`blocks`) the disk had then. (Other clients' writes acknowledged before
        the flush was sent would be stable too; left pending, which is weaker but safe.)"""
        with self.lock:
            hi = len(self.cur) if hi is None else hi
            for i in [i for i in self.pending if lo <= i < hi]:
                self.stable[i] = self.cur[i]
                del self.pending[i]
            self.flushed_blocks = max(self.flushed_blocks,
                                      len(self.cur) if blocks is None else blocks)

    def grow(self, blocks):
        with self.lock:
            while len(self.cur) < blocks:
                self.cur.append(_Z)
                self.stable.append(_Z)

    def check_read(self, lba, data, after_crash=False):
        """Checks blocks read at `lba`; returns a list of (lba, what was wrong). After a
        crash the acceptable values are stable | pending and the block's state becomes
        what was read."""
        bad = []
        for k in range(len(data) // BLOCK):
            i = lba + k
            v = self.pattern.value(self.index, i, data[k * BLOCK:(k + 1) * BLOCK])
            if after_crash:
                ok = self.stable[i] | self.pending.get(i, set())
            else:
                ok = self.cur[i]
            if v is None or v not in ok:
                bad.append((i, f"read {describe(v)}, acceptable {sorted(ok)}"))
            if after_crash and v is not None:
                self.stable[i] = self.cur[i] = frozenset((v,))
        return bad

    def after_crash(self, blocks):
        """The disk came back with `blocks` blocks: returns what is wrong with its size."""
        bad = []
        if blocks < self.flushed_blocks:
            bad.append(f"size {blocks} blocks, but a flush completed at {self.flushed_blocks}")
        del self.cur[blocks:]
        del self.stable[blocks:]
        self.grow(blocks)
        return bad

    def settle(self):
        """After a crash's checks: nothing is pending any more."""
        self.pending.clear()
        self.flushed_blocks = len(self.cur)


def describe(v):
    return {None: "garbage", ZERO: "zeros", GOLDEN: "golden"}.get(v, f"generation {v}")
