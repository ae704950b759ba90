#!/usr/bin/env python3
"""Draws the plots docs/PERFORMANCE.md shows from the CSV files beside it (the figures the
benchmarks printed, copied from the tables): `python3 docs/plots/plot.py` (needs
matplotlib) writes docs/plots/*.png."""

import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(name):
    with open(os.path.join(HERE, name)) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def prefetch_streams():
    data = rows("prefetch_streams.csv")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, row in zip(axes, ["50us 4KiB", "window 1ms 128KiB"]):
        for cores, style in (("1", "o-"), ("2", "s--")):
            pts = [(int(r["streams"]), float(r["gain"])) for r in data
                   if r["row"] == row and r["cores"] == cores]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                    label=f"{cores} core{'s' if cores == '2' else ''}")
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("interleaved sequential streams")
        ax.set_ylabel("gain per stream (ring on / off)")
        ax.set_ylim(bottom=0)
        ax.set_title({"50us 4KiB": "4 KiB reads, 50 µs base: core-bound",
                      "window 1ms 128KiB": "128 KiB reads, 1 ms base: window-bound"}[row])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "prefetch_streams.png"), dpi=110)


if __name__ == "__main__":
    prefetch_streams()
