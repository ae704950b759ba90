#!/usr/bin/env python3
"""Checks that MODULE.so is a working bdev_qcow2: loaded into spdk_tgt, it must register the
bdev_qcow2_* RPCs and make a qcow2 bdev. Exporting symbols with the right names is not enough.

    check_module.py MODULE.so [--spdk-tgt PATH] [--mem-mb N] [--timeout SECONDS]

Starts `spdk_tgt -u --no-huge` (no PCI, no hugepages) with LD_PRELOAD=MODULE.so and a private
RPC socket, then over JSON-RPC: `rpc_get_methods` must list the module's methods; on a malloc
bdev, `bdev_qcow2_format` then `bdev_qcow2_create` must give a bdev of the formatted size with
the module's product name and qcow2 info, and `bdev_qcow2_delete` must remove it. Stops the
target with SIGTERM and requires a clean exit.

Exit status: 0 the module works, 1 it does not (the reason is printed), 2 the check could not
run (no spdk_tgt, bad arguments). It starts an SPDK application: on a machine where several
people run SPDK, take the turn first (e.g. `flock /tmp/spdk-run.lock check_module.py ...`).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REQUIRED_METHODS = ("bdev_qcow2_create", "bdev_qcow2_format", "bdev_qcow2_delete")
# What a bdev made by this module says about itself (src/ffi/node.rs).
PRODUCT_NAME = "QCOW2 disk"
BLOCK = 512
BASE_BYTES = 16 << 20
IMAGE_BYTES = 8 << 20


class NotWorking(Exception):
    """The module failed the check; the message says how."""


class Rpc:
    """A JSON-RPC 2.0 client on SPDK's unix socket (one request at a time)."""

    def __init__(self, path, timeout):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.next_id = 1
        self.buf = b""

    def call(self, method, params=None):
        """The call's result; raises RpcError with SPDK's error if the call failed."""
        req = {"jsonrpc": "2.0", "method": method, "id": self.next_id}
        self.next_id += 1
        if params is not None:
            req["params"] = params
        self.sock.sendall(json.dumps(req).encode())
        decoder = json.JSONDecoder()
        while True:
            text = self.buf.decode(errors="replace").lstrip()
            try:
                resp, end = decoder.raw_decode(text)
                self.buf = text[end:].encode()
                break
            except ValueError:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise NotWorking(f"{method}: spdk_tgt closed the RPC connection")
                self.buf += chunk
        if "error" in resp:
            raise RpcError(method, resp["error"])
        return resp.get("result")

    def close(self):
        self.sock.close()


class RpcError(NotWorking):
    def __init__(self, method, error):
        super().__init__(f"{method} failed: {error.get('message')} (code {error.get('code')})")


class Target:
    """spdk_tgt with the module preloaded, killed by close() if still running."""

    def __init__(self, spdk_tgt, module, mem_mb, workdir):
        self.sock = os.path.join(workdir, "spdk.sock")
        self.log_path = os.path.join(workdir, "spdk_tgt.log")
        env = dict(os.environ, LD_PRELOAD=module)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [spdk_tgt, "-m", "0x1", "-u", "--no-huge", "-s", str(mem_mb), "-r", self.sock],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            lines = f.read().splitlines()
        return "\n".join(lines[-40:])

    def connect(self, timeout):
        """An Rpc once the target has initialized; NotWorking if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NotWorking(f"spdk_tgt exited with status {self.proc.returncode} "
                                 f"before serving RPCs:\n{self.log()}")
            if os.path.exists(self.sock):
                try:
                    rpc = Rpc(self.sock, timeout)
                    rpc.call("framework_wait_init")
                    return rpc
                except (ConnectionError, FileNotFoundError):
                    pass
            time.sleep(0.1)
        raise NotWorking(f"spdk_tgt did not serve RPCs within {timeout} s:\n{self.log()}")

    def stop(self, timeout):
        """SIGTERM; NotWorking unless it exits cleanly within `timeout`."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise NotWorking(f"spdk_tgt did not stop within {timeout} s:\n{self.log()}")
        if status != 0:
            raise NotWorking(f"spdk_tgt exited with status {status} on SIGTERM:\n{self.log()}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def check_methods(rpc):
    methods = set(rpc.call("rpc_get_methods"))
    missing = [m for m in REQUIRED_METHODS if m not in methods]
    if missing:
        raise NotWorking(f"rpc_get_methods does not list {', '.join(missing)}: the module "
                         "registered no bdev_qcow2 RPCs")
    print(f"ok: rpc_get_methods lists {', '.join(REQUIRED_METHODS)}")


def check_bdev(rpc):
    rpc.call("bdev_malloc_create",
             {"name": "check_base", "num_blocks": BASE_BYTES // BLOCK, "block_size": BLOCK})
    # Other modules examine a new bdev (and may hold it meanwhile) before it can be claimed.
    rpc.call("bdev_wait_for_examine")
    rpc.call("bdev_qcow2_format", {"base_bdev": "check_base", "size": IMAGE_BYTES})
    rpc.call("bdev_qcow2_create", {"name": "check_qcow2", "base_bdev": "check_base"})
    bdevs = rpc.call("bdev_get_bdevs", {"name": "check_qcow2"})
    if len(bdevs) != 1:
        raise NotWorking(f"bdev_get_bdevs check_qcow2: {bdevs}")
    b = bdevs[0]
    size = b.get("num_blocks", 0) * b.get("block_size", 0)
    if size != IMAGE_BYTES:
        raise NotWorking(f"check_qcow2 has {size} bytes, formatted as {IMAGE_BYTES}: {b}")
    if b.get("product_name") != PRODUCT_NAME:
        raise NotWorking(f"check_qcow2's product_name is {b.get('product_name')!r}, "
                         f"not {PRODUCT_NAME!r}")
    if "qcow2" not in b.get("driver_specific", {}):
        raise NotWorking(f"check_qcow2 has no qcow2 driver_specific info: {b}")
    print(f"ok: bdev_qcow2_format + bdev_qcow2_create made a {IMAGE_BYTES >> 20} MiB "
          f"{PRODUCT_NAME!r} bdev on a malloc bdev")
    rpc.call("bdev_qcow2_delete", {"name": "check_qcow2"})
    names = [x["name"] for x in rpc.call("bdev_get_bdevs")]
    if "check_qcow2" in names:
        raise NotWorking("check_qcow2 still listed after bdev_qcow2_delete")
    print("ok: bdev_qcow2_delete removed it")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", help="the module's shared object (libbdev_qcow2.so)")
    ap.add_argument("--spdk-tgt", default=shutil.which("spdk_tgt"),
                    help="spdk_tgt to run (default: from PATH)")
    ap.add_argument("--mem-mb", type=int, default=1024, help="spdk_tgt -s, MiB (default 1024)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per step (default 60)")
    args = ap.parse_args()
    if not args.spdk_tgt or not os.access(args.spdk_tgt, os.X_OK):
        print("cannot check: spdk_tgt not found (put it on PATH or pass --spdk-tgt)",
              file=sys.stderr)
        return 2
    if not os.path.isfile(args.module):
        print(f"cannot check: {args.module} is not a file", file=sys.stderr)
        return 2
    module = os.path.abspath(args.module)
    with tempfile.TemporaryDirectory(prefix="check_module.") as workdir:
        tgt = Target(args.spdk_tgt, module, args.mem_mb, workdir)
        try:
            rpc = tgt.connect(args.timeout)
            check_methods(rpc)
            check_bdev(rpc)
            rpc.close()
            tgt.stop(args.timeout)
        except (NotWorking, OSError) as e:
            print(f"FAILED: {module}: {e}", file=sys.stderr)
            return 1
        finally:
            tgt.close()
    print(f"PASSED: {module} registers bdev_qcow2 in {args.spdk_tgt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
