#!/usr/bin/env python3
"""Turns criterion's estimates for the quant-codecs `matvec` bench into the markdown table in
docs/perf.md: GB/s of weight bytes per format and shape, and % of the read ceiling measured in
the same run. Usage: scripts/perf-table.py [target/criterion]"""
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")


def gbps(group, bench):
    d = root / group / bench / "new"
    est = json.loads((d / "estimates.json").read_text())
    meta = json.loads((d / "benchmark.json").read_text())
    nbytes = meta["throughput"]["Bytes"]
    ns = est["mean"]["point_estimate"]
    return nbytes / ns, ns


ceiling, _ = gbps("read_ceiling", "sum_1GiB")
print(f"read ceiling (1 GiB sum, all cores): **{ceiling:.1f} GB/s**\n")
shapes = ["2560x2560", "640x2560", "10240x320", "32768x16384", "32768x16384_t8", "248320x2560"]
print("| format | " + " | ".join(shapes) + " |")
print("|---|" + "---:|" * len(shapes))
for dtype in ["f32", "f16", "bf16", "q8_2f", "q4tp", "q2tp", "mxfp4"]:
    cells = []
    for s in shapes:
        try:
            g, ns = gbps(f"matvec_{dtype}", s)
            cells.append(f"{g:.1f} ({100 * g / ceiling:.0f}%, {ns / 1e3:.0f} us)")
        except FileNotFoundError:
            cells.append("-")
    print(f"| {dtype} | " + " | ".join(cells) + " |")
