"""Checks of the model alone (no SPDK): it accepts what may be read and flags what may not.
tests/chaos.sh runs it first."""

import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from client import Stats, Worker  # noqa: E402
from model import BLOCK, GOLDEN, ZERO, Disk, Pattern  # noqa: E402


def main():
    p = Pattern(1)

    def written(disk, gen, flush):
        d = Disk(disk, 64, 32 if disk == 1 else 0, p)
        d.begin_write(0, 4, gen)
        d.end_write(0, 4, gen)
        if flush:
            d.flushed()
        return d

    d = written(1, 5, False)
    assert d.check_read(0, p.blocks(1, 0, 4, 5)) == []
    assert d.check_read(0, p.blocks(1, 0, 4, GOLDEN)), "an overwritten block read old data"
    assert d.check_read(0, p.blocks(1, 0, 4, 5)[:-1] + b"x"), "a damaged block passed"
    assert d.check_read(0, p.blocks(0, 0, 4, 5)), "another disk's block passed"
    # Unflushed: after a crash the old data or the new.
    assert written(1, 5, False).check_read(0, p.blocks(1, 0, 4, GOLDEN), after_crash=True) == []
    assert written(1, 5, False).check_read(0, p.blocks(1, 0, 4, 5), after_crash=True) == []
    # Flushed: only the new.
    assert written(1, 5, True).check_read(0, p.blocks(1, 0, 4, GOLDEN), after_crash=True)
    assert written(1, 5, True).check_read(0, p.blocks(1, 0, 4, ZERO), after_crash=True)
    # A write in flight at the crash (never acknowledged) may have landed.
    d = written(1, 5, True)
    d.begin_write(0, 4, 6)
    assert d.check_read(0, p.blocks(1, 0, 4, 6), after_crash=True) == []
    # A deallocated block reads zeros, the golden image's (overlay) or what it held.
    d = written(0, 7, True)
    d.begin_deallocate(0, 8)
    d.end_deallocate(0, 8)
    assert d.check_read(0, p.blocks(0, 0, 4, 7)) == []
    assert d.check_read(0, p.blocks(0, 0, 4, ZERO)) == []
    assert d.check_read(0, p.blocks(0, 0, 4, GOLDEN)), "golden data on a disk without backing"
    # A resize a completed flush covered must survive.
    d = written(0, 7, True)
    d.grow(128)
    d.flushed(blocks=128)
    assert d.after_crash(64), "a flushed resize was lost and nobody noticed"
    # A bitmap must cover what was touched since it was added: writes and deallocates.
    d = written(0, 7, False)
    d.begin_deallocate(10, 2)
    assert sorted(d.touched.items()) == [(0, "write"), (1, "write"), (2, "write"), (3, "write"),
                                         (10, "deallocate"), (11, "deallocate")]
    d.untouch()
    assert d.touched == {}
    held_after_a_failed_pause(p)
    print("chaos model checks: ok")


def held_after_a_failed_pause(p):
    """A client paused by a driver whose RPC died with the target sends nothing more until
    it is stopped (a regression: it wrote once more, touching blocks no bitmap could record,
    and a soak flagged the stored bitmap)."""
    class Ctrl:
        max_bytes = 128 << 10

        def __init__(self):
            self.sent = 0

        def write(self, lba, data):
            self.sent += 1

        write_zeroes = deallocate = write

        def read(self, lba, n):
            self.sent += 1
            return bytes(n * BLOCK)

        def flush(self):
            self.sent += 1

        def close(self):
            pass

    stop, c, errors = threading.Event(), Ctrl(), []
    w = Worker(c, Disk(0, 64, 0, p), random.Random(1), iter(range(2, 10**9)), Stats(), errors,
               stop)
    w.disk.check_read = lambda lba, data: []
    w.start()
    try:
        with w.paused():
            raise RuntimeError("an RPC answered an error: the client goes on")
    except RuntimeError:
        pass
    sent = c.sent
    time.sleep(0.2)
    assert c.sent > sent, "a client stayed held after an RPC error"
    try:
        with w.paused():
            raise OSError("the target died under the RPC")
    except OSError:
        pass
    sent = c.sent
    time.sleep(0.2)
    assert c.sent == sent, "a client sent commands after its pause failed"
    stop.set()
    w.join(5)
    assert not w.is_alive() and not errors and sent > 0, (sent, errors)


if __name__ == "__main__":
    main()
