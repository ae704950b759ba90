"""spdk_tgt with our module preloaded, its JSON-RPC socket, SIGKILL and restart."""

import json
import os
import signal
import socket
import subprocess
import threading
import time


class RpcError(Exception):
    pass


class Target:
    def __init__(self, workdir, module, mem_args, cores):
        self.workdir = workdir
        self.module = module
        self.mem_args = mem_args
        self.cores = cores
        self.sock = os.path.join(workdir, "tgt.sock")
        self.log = os.path.join(workdir, "tgt.log")
        self.proc = None
        self._id = 0
        self._lock = threading.Lock()  # a timer's SIGKILL never reaches a reaped pid

    def start(self, config):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        env = dict(os.environ, LD_PRELOAD=self.module)
        args = ["spdk_tgt", "-m", self.cores, "-r", self.sock, "--json", config]
        args += self.mem_args
        with open(self.log, "ab") as log:
            log.write(f"\n=== {' '.join(args)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"spdk_tgt exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                self.call("framework_wait_init", timeout=30)
                return
            except (OSError, RpcError):
                if time.time() > deadline:
                    raise RuntimeError(f"spdk_tgt did not start:\n{self.tail()}")
                time.sleep(0.2)

    def tail(self, n=60):
        try:
            with open(self.log, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def call(self, method, params=None, timeout=60):
        """One JSON-RPC call; RpcError when the target answers an error, OSError when the
        socket fails (the target died)."""
        self._id += 1
        req = {"jsonrpc": "2.0", "method": method, "id": self._id}
        if params is not None:
            req["params"] = params
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.sock)
            s.sendall(json.dumps(req).encode())
            buf = b""
            dec = json.JSONDecoder()
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    raise OSError(f"{method}: connection closed")
                buf += chunk
                try:
                    resp, _ = dec.raw_decode(buf.decode())
                    break
                except ValueError:
                    continue
        if "error" in resp:
            raise RpcError(f"{method} {params}: {resp['error']}")
        return resp.get("result")

    def save_config(self, path):
        """Writes the target's config to `path` atomically (a kill mid-save leaves the old)."""
        # rpc.py's save_config, which is a client-side loop over the subsystems.
        cfg = {"subsystems": [
            {"subsystem": sub["subsystem"],
             "config": self.call("framework_get_config", {"name": sub["subsystem"]})}
            for sub in self.call("framework_get_subsystems")]}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cfg, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def kill_now(self):
        """SIGKILL without waiting (from a timer)."""
        with self._lock:
            if self.proc and self.proc.returncode is None:
                os.kill(self.proc.pid, signal.SIGKILL)

    def kill(self):
        with self._lock:
            if self.proc and self.proc.returncode is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            if self.proc:
                self.proc.wait()
                # A killed spdk_tgt leaves its trace file (4 MiB of /dev/shm, i.e. RAM).
                try:
                    os.unlink(f"/dev/shm/spdk_tgt_trace.pid{self.proc.pid}")
                except OSError:
                    pass
            self.proc = None

    def stop(self):
        """A clean stop (SIGTERM): returns spdk_tgt's exit status."""
        if not self.proc:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            return "hung"
        self.proc = None
        return rc
