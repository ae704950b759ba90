#!/usr/bin/env python3
"""Instructions per request of one callgrind run of bdevperf (used by tests/spdk_instr.sh).

The cycle is what the accel poller runs (bdevperf's completion and resubmission, our bdev or
the passthru, the malloc bdev, the copy) plus our data-path pollers (`ffi::thread::run_poller`)
less the teardown those run once at the end (`Polled>::finish`, called from them). Requests
are bdevperf's completions counted by callgrind (calls of `bdevperf_complete`), not its
IOPS times runtime, which leave out the requests of the run's first and last moments.

The data copy of each request (the accel module's `memcpy`, under `_sw_accel_copy_iovs`) is
in the cycle, and its count is not the code's: glibc's memcpy takes a different loop when its
source and destination are close modulo 4 KiB, so the same 4 KiB copy runs about 410 or about
480 instructions depending on where the malloc bdev's and bdevperf's buffers happen to lie
(two builds whose request paths differ by 6 instructions were measured 64 apart that way).
The third field is that copy per request, for comparing cycles less it.

Usage: instr_cycle.py CALLGRIND_OUT  ->  prints "INSTRUCTIONS_PER_REQUEST REQUESTS COPY_PER_REQUEST"
"""
import re
import subprocess
import sys

COST = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+([*<>])\s+(.*)$")


def blocks(path, tree):
    """The call-tree blocks of callgrind_annotate: (function line, [(mark, cost, text)])."""
    out = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--inclusive=yes", "--threshold=100",
         "--tree=" + tree, path],
        capture_output=True, text=True, check=True).stdout
    cur, rows = None, []
    for line in out.splitlines():
        m = COST.match(line)
        if not m:
            if cur is not None:
                yield cur, rows
            cur, rows = None, []
            continue
        cost, mark, text = int(m.group(1).replace(",", "")), m.group(2), m.group(3)
        if mark == "*":
            cur = (cost, text)
        else:
            rows.append((mark, cost, text))
    if cur is not None:
        yield cur, rows


def main():
    path = sys.argv[1]
    # callgrind_annotate prints a function once per source file its lines come from (the
    # file it is defined in holds the whole function; others hold the lines inlined from
    # them), and the same file under a relative and an absolute name (with or without the
    # " [obj]" suffix) depending on the working directory and the build's: each function
    # counts once, as its largest block (the whole function).
    accel = poller = 0
    finish = {}
    for (cost, text), rows in blocks(path, "calling"):
        if re.search(r"accel_sw\.c:accel_comp_poll( |$)", text):
            accel = max(accel, cost)
        elif re.search(r"\.rs:bdev_qcow2::ffi::thread::run_poller( |$)", text):
            poller = max(poller, cost)
            # The teardown a data-path poller runs once, at the end (`Polled>::finish`,
            # never inlined), whichever of the function's blocks lists the call.
            for m, c, t in rows:
                f = re.search(r":(\S*Polled>::finish)", t)
                if m == ">" and f:
                    finish[f.group(1)] = max(finish.get(f.group(1), 0), c)
    cycle = accel + poller - sum(finish.values())
    requests = copy = 0
    for (_, text), rows in blocks(path, "caller"):
        if re.search(r"bdevperf\.c:bdevperf_complete ", text):
            for _, _, t in rows:
                m = re.search(r"\(([\d,]+)x\)", t)
                if m:
                    requests += int(m.group(1).replace(",", ""))
        elif re.search(r":__memcpy\S* ", text):
            copy += sum(c for m, c, t in rows if m == "<" and ":_sw_accel_copy_iovs " in t)
    if requests == 0:
        sys.exit("no completed requests in " + path)
    print("%.0f %d %.0f" % (cycle / requests, requests, copy / requests))


if __name__ == "__main__":
    main()
