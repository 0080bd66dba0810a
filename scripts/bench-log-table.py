#!/usr/bin/env python3
"""Turns the text log of the quant-codecs `matvec` bench (criterion's stdout, e.g. from a run
on another machine) into the docs/perf.md table: GB/s of weight bytes (10^9 B/s) and % of the
read ceiling measured in the same run. Usage: scripts/bench-log-table.py LOG"""
import re
import sys

UNIT_US = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
UNIT_GB = {"MiB/s": 1.048576e-3, "GiB/s": 1.073741824, "TiB/s": 1099.511627776}
rows, name, t_us = {}, None, None
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"^([a-z_0-9]+/[A-Za-z_0-9]+)", line)
    if m:
        name = m.group(1)
    m = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+) ", line)
    if m and name and "%" not in line:
        t_us = float(m.group(1)) * UNIT_US[m.group(2)]
    m = re.search(r"thrpt:\s+\[\S+ \S+ (\S+) (\S+) ", line)
    if m and name and "%" not in line:
        rows[name] = (t_us, float(m.group(1)) * UNIT_GB[m.group(2)])
        name = None
ceiling = rows["read_ceiling/sum_1GiB"][1]
print(f"read ceiling (1 GiB sum): **{ceiling:.1f} GB/s**\n")
shapes = ["2560x2560", "640x2560", "10240x320", "32768x16384", "32768x16384_t8", "248320x2560"]
print("| format | " + " | ".join(shapes) + " |")
print("|---|" + "---:|" * len(shapes))
for dtype in ["f32", "f16", "bf16", "q8_2f", "q4tp", "q2tp", "mxfp4"]:
    cells = []
    for s in shapes:
        r = rows.get(f"matvec_{dtype}/{s}")
        cells.append(f"{r[1]:.1f} ({100 * r[1] / ceiling:.0f}%, {r[0]:.0f} us)" if r else "-")
    print(f"| {dtype} | " + " | ".join(cells) + " |")
