#!/usr/bin/env python3
"""Which of our source files and functions one request runs, from a callgrind run of bdevperf.

    KEEP=/tmp/cg WORKLOADS=randread:4096 CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
        tests/spdk_instr.sh                      # a run of our bdev, with line tables
    tests/read_path.py /tmp/cg/q-randread-4096.out [--list]

Line tables (`debug = "line-tables-only"`) change no machine code; they let callgrind
attribute every instruction, inlined ones too, to the source line it came from. A line of
our crates (paths under `bdev_qcow2/`) counts as run per request when it runs under SPDK's
calls into our bdev for a request (`submit_request`, a direct child's `child_done`, and
what they call: the submission and completion of a request, not our pollers) and its
instructions there over the run reach 0.9 per request bdevperf completed (a line run once
per request costs at least one instruction each time; 0.9 for the requests a run's end
leaves in flight). Lines a request runs only sometimes (a read-ahead's slice tail, an
eighth of random reads) stay out. Its function is
the `fn` of our source that encloses the line (closures belong to theirs), so functions
inlined into others count as well as those called. Prints the files and functions so
found, with their instructions per request; `--list` names them.

`--entries` counts from every entry SPDK makes into our library instead (each function of
ours called by a function with no line of ours: the request's submission and child
completion, and also the messages between threads, the pollers and the base's completions
of the engine's device operations): what a request runs on any thread, such as an
allocating write, which a channel sends to the metadata owner and the owner runs as a
task. Lines our pollers run per poll count too when the polls reach the threshold. For an
allocating write, a fresh image whose every write allocates one cluster:

    CARGO_PROFILE_RELEASE_DEBUG=line-tables-only CARGO_TARGET_DIR=target/lines \
        cargo build --release -p bdev_qcow2
    BDEV_QCOW2_SO=target/lines/release/libbdev_qcow2.so FRESH=1 ZEROED=1 CLUSTER=4096 \
        MB=256 CREATE_EXTRA=',"alloc_granule":0' KEEP=/tmp/cg WORKLOADS=write:4096 SECS=3 \
        tests/spdk_instr.sh
    tests/read_path.py /tmp/cg/q-write-4096.out --entries --list
"""
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from instr_cycle import blocks  # noqa: E402

# The source tree the run was built from (SRC_ROOT: another checkout, for a "before").
ROOT = os.environ.get("SRC_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = re.compile(r"(^|/)bdev_qcow2/(engine|spdk|tool)/src/")
# Where a request enters our code: `fn_table.submit_request`, a direct child's completion.
ROOTS = re.compile(r"bdev_qcow2::ffi::bdev_io::(submit_request|child_done)$")
FN = re.compile(r"^(\s*)(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?"
                r"(extern\s+\"C\"\s+)?fn\s+(\w+)")


def parse(path):
    """Self cost per (function, file, line) and the functions each function calls, from a
    callgrind output (positions: `line`, as tests/spdk_instr.sh writes them, or `instr
    line` from a run with `--dump-instr=yes`, kept for per-instruction listings)."""
    names = {}
    cost = defaultdict(int)
    calls = defaultdict(set)
    objs = {}
    fl = fi = fn = cfn = ob = None
    # One position per kind the header names, each compressed against its own last value;
    # the line is the last of them.
    npos = 1
    last = [0]
    skip_next = False

    def name(kind, rest):
        m = re.match(r"\((\d+)\)(?:\s+(.*))?$", rest)
        if not m:
            return rest
        key = (kind, m.group(1))
        if m.group(2) is not None:
            names[key] = m.group(2)
        return names.get(key, "?")

    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                for i, p in enumerate(parts[:npos]):
                    if p == "*":
                        continue
                    last[i] = last[i] + int(p, 0) if p[0] in "+-" else int(p, 0)
                pos = last[npos - 1]
                if skip_next:
                    skip_next = False
                    continue
                if len(parts) > npos and fi is not None:
                    cost[(fn, fi, pos)] += int(parts[npos])
                continue
            if line.startswith("positions:"):
                npos = len(line.split()) - 1
                last = [0] * npos
                continue
            key, _, rest = line.partition("=")
            if key == "fl":
                fl = fi = name("fl", rest)
            elif key in ("fi", "fe"):
                fi = name("fl", rest)
            elif key == "fn":
                fi = fl
                fn = name("fn", rest)
                objs[fn] = ob
            elif key in ("cfl", "cfi"):
                name("fl", rest)
            elif key == "cfn":
                cfn = name("fn", rest)
            elif key == "ob":
                ob = name("ob", rest)
            elif key == "cob":
                name("ob", rest)
            elif key == "calls":
                calls[fn].add(cfn)
                skip_next = True
    return cost, calls, objs


def request_functions(calls, entries=None):
    """The functions a request runs: SPDK's calls into our bdev for a request (its
    submission, a direct child's completion) and everything they call; with `entries` (the
    functions with a line of ours), every function of ours a function without one calls."""
    if entries is None:
        roots = [f for f in calls if ROOTS.search(f)]
    else:
        roots = sorted({g for f, gs in calls.items() if f not in entries
                        for g in gs if g in entries})
    seen, todo = set(roots), list(roots)
    while todo:
        for g in calls.get(todo.pop(), ()):
            if g not in seen:
                seen.add(g)
                todo.append(g)
    return seen


def source_path(f):
    m = OURS.search(f)
    return os.path.join(ROOT, f[m.start() + (1 if f[m.start()] == "/" else 0):])


def enclosing_fn(src_lines, line):
    """The `fn` whose body holds 1-based `line`: the nearest one above it that is indented
    less (as much, for a closing brace or the `fn` line itself)."""
    if not 0 < line <= len(src_lines):
        return None  # code without a line (the compiler's own): the file's, no function's
    text = src_lines[line - 1]
    if text.lstrip().startswith("#[derive("):
        return "derive:%d" % line
    t = len(text) - len(text.lstrip())
    closing = text.lstrip().startswith("}")
    for i in range(line - 1, -1, -1):
        m = FN.match(src_lines[i])
        if m and (len(m.group(1)) < t or (len(m.group(1)) <= t and (closing or i == line - 1))):
            return "%s:%d" % (m.group(8), i + 1)
    return "?"


def requests(path):
    n = 0
    for (_, text), rows in blocks(path, "caller"):
        if re.search(r"bdevperf\.c:bdevperf_complete ", text):
            for _, _, t in rows:
                m = re.search(r"\(([\d,]+)x\)", t)
                if m:
                    n += int(m.group(1).replace(",", ""))
    return n


def main():
    path = sys.argv[1]
    n = requests(path)
    if n == 0:
        sys.exit("no completed requests in " + path)
    files, fns = defaultdict(int), defaultdict(int)
    srcs = {}
    cost, calls, objs = parse(path)
    entries = None
    if "--entries" in sys.argv:
        entries = {fn for (fn, f, _) in cost if OURS.search(f)}
    on_path = request_functions(calls, entries)
    for (fn, f, line), c in cost.items():
        if fn not in on_path or not OURS.search(f) or c < 0.9 * n:
            continue
        sp = source_path(f)
        if sp not in srcs:
            try:
                srcs[sp] = open(sp).read().split("\n")
            except OSError:
                srcs[sp] = []
        rel = os.path.relpath(sp, ROOT)
        files[rel] += c
        fn = enclosing_fn(srcs[sp], line)
        if fn is not None:
            fns[(rel, fn)] += c
    print("%d files, %d functions of ours per request (%d requests)" % (len(files), len(fns), n))
    # Every instruction of our library (its object, standard library code inlined into it
    # included) under those calls: the request's own code, which does not poll.
    ours = {objs.get(f) for f in calls if ROOTS.search(f)}
    lib = sum(c for (fn, _, _), c in cost.items() if fn in on_path and objs.get(fn) in ours)
    print("%.1f instructions of our library per request under those calls" % (lib / n))
    if "--list" in sys.argv:
        for f in sorted(files, key=files.get, reverse=True):
            print("%6.1f %s" % (files[f] / n, f))
            for (g, fn), c in sorted(fns.items(), key=lambda kv: -kv[1]):
                if g == f:
                    print("%6.1f     %s" % (c / n, fn))


if __name__ == "__main__":
    main()
