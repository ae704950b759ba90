#!/usr/bin/env python3
"""Unsafe gate: `unsafe` only in `ffi/` modules, in the crates that may hold any.

The engine forbids it at its root (`#![forbid(unsafe_code)]`). In the SPDK crate
(bdev_qcow2/spdk) and the tool (bdev_qcow2/tool) every `unsafe` block, fn, trait or impl
must lie under a `src/ffi/` directory (ARCHITECTURE.md, "Unsafe code"). Comments and
string literals are left out. Exits 1 with each offending file, else prints OK.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = ["bdev_qcow2/spdk", "bdev_qcow2/tool"]
FORBIDDING = {"bdev_qcow2/engine/src/lib.rs": "#![forbid(unsafe_code)]"}
DENYING = {
    "bdev_qcow2/spdk/src/lib.rs": "#![deny(unsafe_code)]",
    "bdev_qcow2/tool/src/lib.rs": "#![deny(unsafe_code)]",
}
LEX = re.compile(r'//[^\n]*|/\*.*?\*/|(?<!\w)b?r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"'
                 r"|'(?:\\(?:'|[^']+)|[^\\'])'", re.S)
UNSAFE = re.compile(r"\bunsafe\b")


def has_unsafe(path):
    return bool(UNSAFE.search(LEX.sub(" ", path.read_text())))


def main():
    bad = []
    for rel, attr in {**FORBIDDING, **DENYING}.items():
        if attr not in (ROOT / rel).read_text():
            bad.append(f"{rel}: lacks {attr}")
    for crate in CRATES:
        for p in sorted((ROOT / crate).rglob("*.rs")):
            rel = p.relative_to(ROOT).as_posix()
            if "/target/" in rel or "/src/ffi/" in rel or not has_unsafe(p):
                continue
            bad.append(f"{rel}: `unsafe` outside an ffi/ module")
    for b in bad:
        print(b)
    if bad:
        return 1
    print("OK: `unsafe` only in ffi/ modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
