"""The runs of tests/bootstorm_bench.sh (which builds the module and the golden images and
says what is measured). For each golden image and each N: spdk_tgt with N fresh overlays of
the golden image, each on its own malloc bdev, exported as the N namespaces of one
NVMe-oF/TCP subsystem; replay.py boots them all at once; shared cache on and off alternate
(on off, off on, ...), ROUNDS pairs; the medians are printed side by side.

    python3 bench.py --module SO --dir DIR --trace CSV --images raw:golden.raw,qcow2:...
"""

import argparse
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "chaos"))
from target import Target  # noqa: E402

NQN = "nqn.2016-06.io.spdk:bootstorm"
STORE_NQN = "nqn.2016-06.io.spdk:golden"
HERE = os.path.dirname(os.path.abspath(__file__))


def slow_base(a, image):
    """The golden image's slow base `dg`: an aio bdev, bdev_delay and QoS on it."""
    bdev = [
        {"method": "bdev_aio_create",
         "params": {"name": "ag", "filename": image, "block_size": 512}},
        {"method": "bdev_delay_create",
         "params": {"name": "dg", "base_bdev_name": "ag",
                    "avg_read_latency": a.lat, "p99_read_latency": a.lat,
                    "avg_write_latency": a.lat, "p99_write_latency": a.lat}},
    ]
    if a.mbps:
        bdev.append({"method": "bdev_set_qos_limit",
                     "params": {"name": "dg", "r_mbytes_per_sec": a.mbps}})
    return bdev


def listener(nqn, port):
    return {"method": "nvmf_subsystem_add_listener",
            "params": {"nqn": nqn, "listen_address": {
                "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                "trsvcid": str(port)}}}


def store_config(a, image, path):
    """The image store's spdk_tgt (base nvmf): `dg` exported over NVMe-oF/TCP."""
    nvmf = [
        {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
        {"method": "nvmf_create_subsystem",
         "params": {"nqn": STORE_NQN, "allow_any_host": True, "serial_number": "GOLDEN0001"}},
        {"method": "nvmf_subsystem_add_ns",
         "params": {"nqn": STORE_NQN, "namespace": {"bdev_name": "dg", "nsid": 1}}},
        listener(STORE_NQN, a.port + 1),
    ]
    with open(path, "w") as f:
        json.dump({"subsystems": [{"subsystem": "bdev", "config": slow_base(a, image)},
                                  {"subsystem": "nvmf", "config": nvmf}]}, f)


def config(a, image, fmt, n, shared, path):
    """spdk_tgt's JSON config: the slow base (here, or base nvmf: attached from the image
    store as `sg` n1), a read-only qcow2 bdev `golden` on it for a qcow2 image, N overlays
    vm<i>."""
    if a.base == "nvmf":
        base = "sgn1"
        bdev = [{"method": "bdev_nvme_attach_controller",
                 "params": {"name": "sg", "trtype": "tcp", "adrfam": "ipv4",
                            "traddr": "127.0.0.1", "trsvcid": str(a.port + 1),
                            "subnqn": STORE_NQN}}]
    else:
        base = "dg"
        bdev = slow_base(a, image)
    golden = base if fmt == "raw" else "golden"
    if fmt != "raw":
        bdev.append({"method": "bdev_qcow2_create",
                     "params": {"name": "golden", "base_bdev": base, "read_only": True}})
    for i in range(n):
        m = f"m{i}"
        bdev.append({"method": "bdev_malloc_create",
                     "params": {"name": m, "num_blocks": 16384, "block_size": 512}})
        bdev.append({"method": "bdev_qcow2_format",
                     "params": {"base_bdev": m, "backing_bdev": golden}})
        params = {"name": f"vm{i}", "base_bdev": m, "backing_bdev": golden}
        params["backing_cache_size"] = (256 << 20) if shared else 0
        bdev.append({"method": "bdev_qcow2_create", "params": params})
    bdev.append({"method": "bdev_wait_for_examine"})
    nvmf = [
        {"method": "nvmf_create_transport",
         "params": {"trtype": "TCP", "num_shared_buffers": 2047, "max_queue_depth": 128}},
        {"method": "nvmf_create_subsystem",
         "params": {"nqn": NQN, "allow_any_host": True, "max_namespaces": max(n, 1),
                    "serial_number": "BOOTSTORM0001"}},
    ]
    for i in range(n):
        nvmf.append({"method": "nvmf_subsystem_add_ns",
                     "params": {"nqn": NQN, "namespace": {"bdev_name": f"vm{i}", "nsid": i + 1}}})
    nvmf.append(listener(NQN, a.port))
    with open(path, "w") as f:
        json.dump({"subsystems": [{"subsystem": "bdev", "config": bdev},
                                  {"subsystem": "nvmf", "config": nvmf}]}, f)


def bytes_read(tgt, name):
    return tgt.call("bdev_get_iostat", {"names": [name]})["bdevs"][0]["bytes_read"]


def run(a, image, fmt, n, shared):
    """One storm: (wall s, golden bytes read, cache memory bytes, replayer CPU s)."""
    cfg = os.path.join(a.dir, "tgt.json")
    config(a, image, fmt, n, shared, cfg)
    # Each overlay takes its malloc bdev (8 MiB) and a prefetch ring (5 MiB) of DMA memory.
    mem = a.mem.split() or ["--no-huge", "-s", str(2048 + 24 * n)]
    tgt = Target(a.dir, a.module, mem, a.cores)
    store = tgt
    if a.base == "nvmf":
        # The image store: a second spdk_tgt on the other core, its own socket.
        sdir = os.path.join(a.dir, "store")
        os.makedirs(sdir, exist_ok=True)
        store_config(a, image, os.path.join(sdir, "store.json"))
        store = Target(sdir, a.module, a.mem.split() or ["--no-huge", "-s", "1024"],
                       a.store_cores)
    with open(a.lock, "w") as lock:
        # Other SPDK applications on this machine: one at a time, for the run only.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if store is not tgt:
                store.start(os.path.join(sdir, "store.json"))
            tgt.start(cfg)
            before = bytes_read(store, "dg")
            prof = None
            if a.perf:
                # Where the target's core goes during the storm (perf report -i the file).
                side = "on" if shared else "off"
                prof = subprocess.Popen(
                    ["perf", "record", "-q", "-g", "-p", str(tgt.proc.pid), "-o",
                     os.path.join(a.perf, f"{fmt}-{n}-{side}.data")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
            host = [a.replayer] if a.replayer else [sys.executable, os.path.join(HERE, "replay.py")]
            out = subprocess.run(
                host + ["--port", str(a.port), "--nqn", NQN, "--boots", str(n),
                        "--qd", str(a.qd), "--trace", a.trace],
                check=True, capture_output=True, text=True, timeout=900)
            r = json.loads(out.stdout)
            if prof:
                prof.send_signal(signal.SIGINT)
                prof.wait()
            golden = bytes_read(store, "dg") - before
            stats = tgt.call("bdev_qcow2_get_stats", {"name": "vm0"})
            cache = stats[0].get("backing_cache") or {}
            mem = cache.get("memory_bytes", 0)
        except subprocess.CalledProcessError as e:
            sys.exit(f"replay failed: {e.stderr}\n{tgt.tail()}")
        finally:
            tgt.kill()
            store.kill()
    return r["wall"], golden, mem, r["cpu"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--images", required=True, help="fmt:path,...")
    ap.add_argument("--ns", default="1 8 32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--lat", type=int, default=500, help="golden read latency, us")
    ap.add_argument("--mbps", type=int, default=100, help="golden read MB/s (QoS), 0: none")
    ap.add_argument("--off-max", type=int, default=1 << 30,
                    help="run the sharing-off side only up to this N (off is N times slower)")
    ap.add_argument("--cores", default="0x1")
    ap.add_argument("--base", default="delay", choices=["delay", "nvmf"],
                    help="the slow base here, or in a second spdk_tgt over NVMe-oF/TCP")
    ap.add_argument("--store-cores", default="0x2")
    ap.add_argument("--mem", default="", help="spdk_tgt's memory options (default: by N)")
    ap.add_argument("--port", type=int, default=4437)
    ap.add_argument("--lock", default="/tmp/spdk-run.lock")
    ap.add_argument("--perf", default="", help="a directory: perf record the target there")
    ap.add_argument("--replayer", default="",
                    help="the host's binary (bootstorm_replay); default: replay.py")
    a = ap.parse_args()
    where = "" if a.base == "delay" else f", exported by spdk_tgt -m {a.store_cores} over NVMe-oF/TCP"
    print(f"   golden base: aio file, bdev_delay {a.lat} us reads, QoS {a.mbps} MB/s reads{where};"
          f" spdk_tgt -m {a.cores}; {os.path.basename(a.replayer) or 'replay.py'} QD{a.qd} per boot; {a.rounds} alternating pair(s)")
    print(f"   {'image':6} {'N':>4} | {'wall s on':>9} {'off':>7} {'x1 on':>6} {'x1 off':>6}"
          f" | {'golden MiB on':>13} {'off':>7} {'x1 on':>6} {'x1 off':>6}"
          f" | {'cache MiB':>9} | {'replay cpu s on':>15} {'off':>5}")
    for spec in a.images.split(","):
        fmt, image = spec.split(":", 1)
        one = None
        for n in (int(x) for x in a.ns.split()):
            res = {True: [], False: []}
            sides = (True, False) if n <= a.off_max else (True,)
            for r in range(a.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for shared in order:
                    res[shared].append(run(a, image, fmt, n, shared))
            # Not run (n above OFF_MAX): NaN.
            med = {s: [statistics.median(x[k] for x in res[s]) if res[s] else float("nan")
                       for k in range(4)] for s in res}
            if one is None:
                one = med
            on, off = med[True], med[False]
            print(f"   {fmt:6} {n:4} | {on[0]:9.2f} {off[0]:7.2f} {on[0] / one[True][0]:6.2f}"
                  f" {off[0] / one[False][0]:6.2f} | {on[1] / 2**20:13.1f} {off[1] / 2**20:7.1f}"
                  f" {on[1] / max(one[True][1], 1):6.2f} {off[1] / max(one[False][1], 1):6.2f}"
                  f" | {on[2] / 2**20:9.1f} | {on[3]:15.2f} {off[3]:5.2f}", flush=True)
            time.sleep(0.2)


if __name__ == "__main__":
    main()
