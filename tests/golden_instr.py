#!/usr/bin/env python3
"""The golden row's costs that the machine's load does not move, from a callgrind run of
bdevperf (used by tests/golden_instr.sh).

At QD1 over NVMe/TCP the reactor spins while each read is in flight, so instructions per
request follow how long the round trip took, not the code. Two figures do not: the pass of
our channel poller (`ffi::thread::run_poller`, inclusive, per call: while a read is in
flight it runs on about every other reactor pass, and a longer pass delays noticing the
completion and sending the next read), and the cycle (`bdev_nvme_readv_done`, inclusive,
per request: our completion, bdevperf's, its next read through our bdev to the NVMe/TCP
submission).

Usage: golden_instr.py CALLGRIND_OUT  ->  "requests R poller-pass P cycle C"
"""
import collections
import re
import sys

POLLER = "bdev_qcow2::ffi::thread::run_poller"
CYCLE = "bdev_nvme_readv_done"
REQUEST = "bdevperf_complete"


def main():
    names = {}
    inclusive = collections.Counter()
    calls = collections.Counter()
    fn = cfn = None
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.rstrip("\n")
            if line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) >= 2:
                    # A cost line: the function's own, or (after calls=) its call's.
                    inclusive[fn] += int(parts[1])
                continue
            m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?$", line)
            if m:
                if m.group(3) is not None:
                    names[m.group(2)] = m.group(3)
                name = names.get(m.group(2))
                if m.group(1) == "fn":
                    fn = name
                else:
                    cfn = name
            elif line.startswith("calls="):
                calls[cfn] += int(line[6:].split()[0])
    if not calls[REQUEST]:
        sys.exit("no completed requests in " + sys.argv[1])
    print("requests %d poller-pass %.0f cycle %.0f" % (
        calls[REQUEST], inclusive[POLLER] / max(calls[POLLER], 1),
        inclusive[CYCLE] / calls[REQUEST]))


main()
