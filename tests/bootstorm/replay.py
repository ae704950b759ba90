"""Replays a boot read trace on N namespaces of one NVMe-oF/TCP subsystem at once: one
controller per boot (an admin queue and one I/O queue, as a VM's initiator would have),
each boot reading namespace i + 1 in the trace's order with QD reads in flight. Reads
larger than the target's largest transfer are split. The data is received and dropped.

Prints one JSON line: wall seconds from the common start to the last boot's end, each
boot's seconds, the bytes read, and this process's CPU seconds (user + system) for the
replay, so that its own cost can be told from the target's.

    python3 replay.py --port 4420 --nqn NQN --boots 8 --qd 8 --trace boot_trace.csv

PDU layouts and constants from tests/chaos/nvme_tcp.py (stdlib only, no digests)."""

import argparse
import asyncio
import json
import os
import resource
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "chaos"))
from nvme_tcp import (  # noqa: E402
    C2H_DATA, CAPSULE_CMD, CAPSULE_RESP, F_SUCCESS, FC_CONNECT, FC_PROPERTY_GET,
    FC_PROPERTY_SET, HOSTNQN, IC_REQ, IC_RESP, OP_FABRICS, OP_READ, PSDT_SGL,
    REG_CC, REG_CSTS, SGL_IN_CAPSULE, SGL_TRANSPORT,
)

BLOCK = 512
MAX_IO = 128 << 10  # SPDK's NVMe/TCP default max_io_size


class AQueue:
    """One NVMe/TCP connection with many commands in flight, matched by CID."""

    async def open(self, addr, port):
        self.reader, self.writer = await asyncio.open_connection(addr, port)
        self.writer.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer.write(struct.pack("<BBBBIHBBI", IC_REQ, 0, 128, 0, 128, 0, 0, 0, 0)
                          .ljust(128, b"\0"))
        ptype, _, _ = await self._pdu()
        if ptype != IC_RESP:
            raise RuntimeError(f"expected ICResp, got {ptype}")
        self.pending = {}
        self.free = list(range(1, 1024))
        self.task = asyncio.create_task(self._recv_loop())
        return self

    async def _pdu(self):
        ch = await self.reader.readexactly(8)
        ptype, flags, _hlen, pdo, plen = struct.unpack("<BBBBI", ch)
        return ptype, flags, ch + await self.reader.readexactly(plen - 8)

    async def _recv_loop(self):
        try:
            while True:
                ch = await self.reader.readexactly(8)
                ptype, flags, hlen, pdo, plen = struct.unpack("<BBBBI", ch)
                if ptype == C2H_DATA:
                    hdr = await self.reader.readexactly(hlen - 8)
                    cid = struct.unpack_from("<H", hdr, 0)[0]
                    await self.reader.readexactly(plen - hlen)  # the data, dropped
                    if flags & F_SUCCESS:
                        self._done(cid, 0, 0)
                elif ptype == CAPSULE_RESP:
                    rest = await self.reader.readexactly(plen - 8)
                    dw0, _dw1, _sqhd, _sqid, cid, status = struct.unpack_from("<IIHHHH", rest, 0)
                    self._done(cid, dw0, status >> 1)
                else:
                    raise RuntimeError(f"unexpected PDU type {ptype}")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"connection lost: {e}"))

    def _done(self, cid, dw0, status):
        fut = self.pending.pop(cid, None)
        if fut is None or fut.done():
            return
        self.free.append(cid)
        if status:
            fut.set_exception(RuntimeError(f"status {status:#x}"))
        else:
            fut.set_result(dw0)

    def command(self, sqe, data_out=b"", read_len=0):
        cid = self.free.pop()
        sqe = bytearray(sqe)
        sqe[1] = PSDT_SGL
        struct.pack_into("<H", sqe, 2, cid)
        fut = asyncio.get_running_loop().create_future()
        self.pending[cid] = fut
        if data_out:
            struct.pack_into("<QI3xB", sqe, 24, 0, len(data_out), SGL_IN_CAPSULE)
            self.writer.write(struct.pack("<BBBBI", CAPSULE_CMD, 0, 72, 72, 72 + len(data_out))
                              + bytes(sqe) + data_out)
        else:
            struct.pack_into("<QI3xB", sqe, 24, 0, read_len, SGL_TRANSPORT)
            self.writer.write(struct.pack("<BBBBI", CAPSULE_CMD, 0, 72, 0, 72) + bytes(sqe))
        return fut

    def close(self):
        self.task.cancel()
        self.writer.close()


def fabrics(fctype):
    sqe = bytearray(64)
    sqe[0] = OP_FABRICS
    sqe[4] = fctype
    return sqe


async def connect(q, nqn, qid, sqsize, cntlid):
    sqe = fabrics(FC_CONNECT)
    struct.pack_into("<HHHBxI", sqe, 40, 0, qid, sqsize - 1, 0, 0)
    data = bytearray(1024)
    data[0:16] = os.urandom(16)
    struct.pack_into("<H", data, 16, cntlid)
    data[256:256 + len(nqn)] = nqn.encode()
    data[512:512 + len(HOSTNQN)] = HOSTNQN.encode()
    return (await q.command(sqe, bytes(data))) & 0xFFFF


async def controller(addr, port, nqn, qd):
    """An enabled controller's (admin queue, I/O queue)."""
    admin = await AQueue().open(addr, port)
    cntlid = await connect(admin, nqn, 0, 32, 0xFFFF)
    sqe = fabrics(FC_PROPERTY_SET)
    struct.pack_into("<B3xIQ", sqe, 40, 0, REG_CC, (4 << 20) | (6 << 16) | 1)
    await admin.command(sqe)
    for _ in range(1000):
        sqe = fabrics(FC_PROPERTY_GET)
        struct.pack_into("<B3xI", sqe, 40, 0, REG_CSTS)
        if await admin.command(sqe) & 1:
            break
        await asyncio.sleep(0.001)
    io = await AQueue().open(addr, port)
    await connect(io, nqn, 1, max(qd * 2, 32), cntlid)
    return admin, io


def read(io, nsid, off, length):
    sqe = bytearray(64)
    sqe[0] = OP_READ
    struct.pack_into("<I", sqe, 4, nsid)
    struct.pack_into("<QI", sqe, 40, off // BLOCK, length // BLOCK - 1)
    return io.command(sqe, read_len=length)


async def boot(io, nsid, trace, qd, start):
    """Replays `trace` on namespace `nsid`, QD reads in flight; its seconds from `start`."""
    it = iter(trace)

    async def worker():
        for off, length in it:
            parts = [read(io, nsid, o, min(MAX_IO, off + length - o))
                     for o in range(off, off + length, MAX_IO)]
            await asyncio.gather(*parts)

    await asyncio.gather(*(worker() for _ in range(qd)))
    return time.monotonic() - start


def load(path):
    trace = []
    with open(path) as f:
        for line in f:
            off, length = (int(x) for x in line.split(","))
            # Whole blocks: the trace's reads are in 512-byte sectors already.
            trace.append((off - off % BLOCK, -(-length // BLOCK) * BLOCK))
    return trace


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--nqn", required=True)
    ap.add_argument("--boots", type=int, required=True)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--trace", required=True)
    a = ap.parse_args()
    trace = load(a.trace)
    ctrls = [await controller(a.addr, a.port, a.nqn, a.qd) for _ in range(a.boots)]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    times = await asyncio.gather(*(boot(io, i + 1, trace, a.qd, start)
                                   for i, (_, io) in enumerate(ctrls)))
    wall = time.monotonic() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    for admin, io in ctrls:
        io.close()
        admin.close()
    print(json.dumps({
        "wall": round(wall, 4), "boots": [round(t, 4) for t in times],
        "bytes": a.boots * sum(n for _, n in trace),
        "cpu": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 3)}))


if __name__ == "__main__":
    asyncio.run(main())
