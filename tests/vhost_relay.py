#!/usr/bin/env python3
"""A relay on a vhost-user control socket, for tests/vhost_bench.sh.

Listens on LISTEN, connects each client to SERVER, and forwards every message (with the file
descriptors it carries) both ways. Only the control channel passes here: guest memory,
virtqueues and eventfds are shared directly between client and server, so the relay costs
nothing per I/O. It corrects two things that make SPDK's virtio-user initiator an unfair
client of QEMU's vhost-user-blk export:

- the initiator asks for 256 bytes of device config, which QEMU refuses (the client then
  fails with "get_config failed"): the request is shortened to CONFIG_LEN bytes and the reply
  padded back with zeros;
- QEMU reports a maximum segment size of 0, which the initiator rounds up to one block (every
  request cut into 512-byte segments): a size_max of 0 is replaced by SIZE_MAX, the size
  SPDK's own vhost target reports.

Usage: vhost_relay.py LISTEN SERVER [CONFIG_LEN] [SIZE_MAX]
"""

import array
import os
import socket
import struct
import sys
import threading

GET_CONFIG = 24
HEADER = struct.Struct("<III")  # request, flags, payload size
CONFIG_HEADER = struct.Struct("<III")  # offset, size, flags
MAX_FDS = 16


def recv_exact(sock, n, fds):
    """n bytes from sock, collecting the descriptors that arrive with them into fds."""
    buf = b""
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(
            n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4)
        )
        if not data:
            raise EOFError
        for level, kind, body in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(body[: len(body) - len(body) % 4])
                fds.extend(a)
        buf += data
    return buf


def send(sock, data, fds):
    anc = []
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def rewrite(msg, to_server, config_len, size_max):
    request, flags, size = HEADER.unpack_from(msg)
    if request != GET_CONFIG or size < CONFIG_HEADER.size:
        return msg
    offset, length, cflags = CONFIG_HEADER.unpack_from(msg, HEADER.size)
    region = msg[HEADER.size + CONFIG_HEADER.size :]
    if to_server:
        length = min(length, config_len)
        region = region[:length]
    else:
        region = bytearray(region) + bytes(max(0, 256 - len(region)))
        length = len(region)
        if len(region) >= 12 and struct.unpack_from("<I", region, 8)[0] == 0:
            struct.pack_into("<I", region, 8, size_max)
        region = bytes(region)
    payload = CONFIG_HEADER.pack(offset, length, cflags) + region
    return HEADER.pack(request, flags, len(payload)) + payload


def pump(src, dst, to_server, config_len, size_max):
    try:
        while True:
            fds = []
            head = recv_exact(src, HEADER.size, fds)
            size = HEADER.unpack(head)[2]
            body = recv_exact(src, size, fds) if size else b""
            send(dst, rewrite(head + body, to_server, config_len, size_max), fds)
            for fd in fds:
                os.close(fd)
    except (EOFError, OSError):
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main():
    listen, server = sys.argv[1], sys.argv[2]
    config_len = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    size_max = int(sys.argv[4]) if len(sys.argv) > 4 else 65536
    if os.path.exists(listen):
        os.unlink(listen)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(listen)
    lsock.listen(4)
    while True:
        client, _ = lsock.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.connect(server)
        for a, b, to_server in ((client, up, True), (up, client, False)):
            threading.Thread(
                target=pump, args=(a, b, to_server, config_len, size_max), daemon=True
            ).start()


if __name__ == "__main__":
    main()
