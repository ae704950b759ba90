"""A small NVMe/TCP host (stdlib only): one admin queue and one I/O queue, one command at a
time, no digests. Enough for the chaos test to write, read, flush, write-zeroes and
deallocate a namespace and to know exactly which of its commands completed.

Spec: NVMe over Fabrics TCP transport (PDU layouts), NVMe base (SQE/CQE, Identify, I/O
commands), NVMe over Fabrics (Connect, Property Get/Set)."""

import socket
import struct

# PDU types.
IC_REQ, IC_RESP, H2C_TERM, C2H_TERM = 0x00, 0x01, 0x02, 0x03
CAPSULE_CMD, CAPSULE_RESP, H2C_DATA, C2H_DATA, R2T = 0x04, 0x05, 0x06, 0x07, 0x09
# PDU flags.
F_LAST_PDU, F_SUCCESS = 0x04, 0x08
# SGL descriptor types: data in the capsule (offset), data moved by the transport.
SGL_IN_CAPSULE, SGL_TRANSPORT = 0x01, 0x5A
PSDT_SGL = 0x40

OP_FLUSH, OP_WRITE, OP_READ, OP_WRITE_ZEROES, OP_DSM = 0x00, 0x01, 0x02, 0x08, 0x09
OP_IDENTIFY, OP_FABRICS = 0x06, 0x7F
FC_PROPERTY_SET, FC_CONNECT, FC_PROPERTY_GET = 0x00, 0x01, 0x04
REG_CC, REG_CSTS = 0x14, 0x1C


class NvmeError(Exception):
    """A command completed with an error status (the command did complete)."""

    def __init__(self, what, status):
        super().__init__(f"{what}: status sct {status >> 8 & 7:#x} sc {status & 0xff:#x}")
        self.status = status


class LinkError(Exception):
    """The connection broke: the command in flight may or may not have run."""


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkError("connection closed by the target")
        got += k
    return bytes(buf)


class Queue:
    """One NVMe/TCP connection (one queue pair)."""

    def __init__(self, addr, port, timeout):
        try:
            self.sock = socket.create_connection((addr, port), timeout=timeout)
        except OSError as e:
            raise LinkError(f"connect {addr}:{port}: {e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.cid = 0
        self.maxh2c = 0
        self._icreq()

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _send(self, data):
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise LinkError(f"send: {e}") from e

    def _recv_pdu(self):
        try:
            ch = _recv_exact(self.sock, 8)
            ptype, flags, hlen, pdo, plen = struct.unpack("<BBBBI", ch)
            if plen < 8 or plen > (1 << 24):
                raise LinkError(f"bad PDU length {plen}")
            rest = _recv_exact(self.sock, plen - 8)
        except OSError as e:
            raise LinkError(f"recv: {e}") from e
        if ptype in (C2H_TERM, H2C_TERM):
            raise LinkError(f"target terminated the connection: {rest[:16].hex()}")
        return ptype, flags, hlen, pdo, ch + rest

    def _icreq(self):
        pdu = struct.pack("<BBBBIHBBI", IC_REQ, 0, 128, 0, 128, 0, 0, 0, 0).ljust(128, b"\0")
        self._send(pdu)
        ptype, _, _, _, pdu = self._recv_pdu()
        if ptype != IC_RESP:
            raise LinkError(f"expected ICResp, got PDU type {ptype}")
        _pfv, cpda, dgst, self.maxh2c = struct.unpack_from("<HBBI", pdu, 8)
        if cpda != 0 or dgst != 0:
            raise LinkError(f"target wants cpda {cpda} dgst {dgst}")

    def command(self, sqe, data_out=b"", in_capsule=True, read_len=0):
        """Sends one command (a 64-byte SQE without CID and SGL; both are filled here) and
        waits for its completion. Returns (dw0, dw1, data read)."""
        self.cid = (self.cid + 1) & 0xFFFF
        cid = self.cid
        sqe = bytearray(sqe)
        sqe[1] = PSDT_SGL
        struct.pack_into("<H", sqe, 2, cid)
        if data_out and in_capsule:
            struct.pack_into("<QI3xB", sqe, 24, 0, len(data_out), SGL_IN_CAPSULE)
            pdu = struct.pack("<BBBBI", CAPSULE_CMD, 0, 72, 72, 72 + len(data_out))
            self._send(pdu + bytes(sqe) + data_out)
        else:
            length = len(data_out) or read_len
            struct.pack_into("<QI3xB", sqe, 24, 0, length, SGL_TRANSPORT)
            self._send(struct.pack("<BBBBI", CAPSULE_CMD, 0, 72, 0, 72) + bytes(sqe))
        data = bytearray(read_len)
        while True:
            ptype, flags, hlen, pdo, pdu = self._recv_pdu()
            if ptype == CAPSULE_RESP:
                dw0, dw1, _sqhd, _sqid, rcid, status = struct.unpack_from("<IIHHHH", pdu, 8)
                if rcid != cid:
                    raise LinkError(f"completion for cid {rcid}, expected {cid}")
                status >>= 1
                if status:
                    raise NvmeError(f"opcode {sqe[0]:#x}", status)
                return dw0, dw1, bytes(data)
            if ptype == C2H_DATA:
                ccid, off, length = struct.unpack_from("<H2xII", pdu, 8)
                if ccid != cid or off + length > read_len:
                    raise LinkError("C2HData out of place")
                data[off:off + length] = pdu[pdo:pdo + length]
                if flags & F_SUCCESS:
                    return 0, 0, bytes(data)
            elif ptype == R2T:
                ccid, ttag, r2to, r2tl = struct.unpack_from("<HHII", pdu, 8)
                if ccid != cid or r2to + r2tl > len(data_out):
                    raise LinkError("R2T out of place")
                self._h2c(cid, ttag, data_out, r2to, r2tl)
            else:
                raise LinkError(f"unexpected PDU type {ptype}")

    def _h2c(self, cid, ttag, data, off, length):
        step = self.maxh2c or length
        end = off + length
        while off < end:
            n = min(step, end - off)
            flags = F_LAST_PDU if off + n == end else 0
            hdr = struct.pack("<BBBBIHHII4x", H2C_DATA, flags, 24, 24, 24 + n, cid, ttag, off, n)
            self._send(hdr + data[off:off + n])
            off += n


def _sqe(opcode, nsid=0):
    sqe = bytearray(64)
    sqe[0] = opcode
    struct.pack_into("<I", sqe, 4, nsid)
    return sqe


def _fabrics(fctype):
    sqe = bytearray(64)
    sqe[0] = OP_FABRICS
    sqe[4] = fctype
    return sqe


HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6368616f-732d-7465-7374-000000000001"


def _connect(q, subnqn, qid, sqsize, cntlid):
    sqe = _fabrics(FC_CONNECT)
    struct.pack_into("<HHHBxI", sqe, 40, 0, qid, sqsize - 1, 0, 0)
    data = bytearray(1024)
    data[0:16] = bytes.fromhex("6368616f732d74657374000000000001")
    struct.pack_into("<H", data, 16, cntlid)
    sub = subnqn.encode()
    data[256:256 + len(sub)] = sub
    host = HOSTNQN.encode()
    data[512:512 + len(host)] = host
    dw0, _, _ = q.command(sqe, bytes(data))
    return dw0 & 0xFFFF


class Controller:
    """A fabrics controller with namespace 1 on one I/O queue."""

    def __init__(self, addr, port, subnqn, timeout=30.0):
        self.admin = Queue(addr, port, timeout)
        self.io = None
        try:
            self.cntlid = _connect(self.admin, subnqn, 0, 32, 0xFFFF)
            self._prop_set(REG_CC, (4 << 20) | (6 << 16) | 1)
            for _ in range(1000):
                if self._prop_get(REG_CSTS) & 1:
                    break
            else:
                raise LinkError("CSTS.RDY never set")
            ctrl = self.identify(1, 0)
            ioccsz = struct.unpack_from("<I", ctrl, 1792)[0]
            self.in_capsule = max(0, ioccsz * 16 - 64)
            mdts = ctrl[77]
            self.max_bytes = (4096 << mdts) if mdts else 1 << 20
            self.io = Queue(addr, port, timeout)
            _connect(self.io, subnqn, 1, 128, self.cntlid)
            self.refresh()
        except Exception:
            self.close()
            raise

    def close(self):
        for q in (self.io, self.admin):
            if q:
                q.close()

    def _prop_set(self, off, value):
        sqe = _fabrics(FC_PROPERTY_SET)
        struct.pack_into("<B3xIQ", sqe, 40, 0, off, value)
        self.admin.command(sqe)

    def _prop_get(self, off):
        sqe = _fabrics(FC_PROPERTY_GET)
        struct.pack_into("<B3xI", sqe, 40, 0, off)
        dw0, _, _ = self.admin.command(sqe)
        return dw0

    def identify(self, cns, nsid):
        sqe = _sqe(OP_IDENTIFY, nsid)
        struct.pack_into("<I", sqe, 40, cns)
        return self.admin.command(sqe, read_len=4096)[2]

    def refresh(self):
        """Reads namespace 1's size (in blocks) and block size again."""
        ns = self.identify(0, 1)
        self.blocks = struct.unpack_from("<Q", ns, 0)[0]
        fmt = ns[26] & 0xF
        self.block_size = 1 << ns[128 + 4 * fmt + 2]
        return self.blocks

    def _rw(self, opcode, lba, nblocks):
        sqe = _sqe(opcode, 1)
        struct.pack_into("<QI", sqe, 40, lba, nblocks - 1)
        return sqe

    def write(self, lba, data):
        sqe = self._rw(OP_WRITE, lba, len(data) // self.block_size)
        self.io.command(sqe, data, in_capsule=len(data) <= self.in_capsule)

    def read(self, lba, nblocks):
        sqe = self._rw(OP_READ, lba, nblocks)
        return self.io.command(sqe, read_len=nblocks * self.block_size)[2]

    def flush(self):
        self.io.command(_sqe(OP_FLUSH, 1))

    def write_zeroes(self, lba, nblocks):
        self.io.command(self._rw(OP_WRITE_ZEROES, lba, nblocks))

    def deallocate(self, lba, nblocks):
        sqe = _sqe(OP_DSM, 1)
        struct.pack_into("<II", sqe, 40, 0, 1 << 2)
        rng = struct.pack("<IIQ", 0, nblocks, lba)
        self.io.command(sqe, rng, in_capsule=len(rng) <= self.in_capsule)
