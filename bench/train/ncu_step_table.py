#!/usr/bin/env python3
"""Table of one training step's kernels from bench/train/ncu_step.sh's Nsight Compute CSV.

Usage: ncu_step_table.py ncu_step.csv [graph_tokens_per_s] [tokens_per_step]
Steps are split at the AdamW kernel (one launch per step); the last complete step is tabulated: per
kernel name the launches, total time, DRAM bytes and bandwidth, then the sum of kernel time against the
graph run's step time (tokens_per_step / tokens_per_s): the difference is what the step spends between
kernels (launch gaps, tails) plus profiling-clock differences.
"""
import csv
import os
import sys
from collections import OrderedDict, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from cupti_gaps import short  # noqa: E402  (kernel names without namespaces and arguments)

TIME = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
BYTES = {"byte": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9, "Tbyte": 1e12}


def load(path):
    kernels = OrderedDict()
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"], "grid": row.get("Grid Size", ""),
                                           "block": row.get("Block Size", "")})
        unit, value = row["Metric Unit"], float(row["Metric Value"].replace(",", "") or 0)
        name = row["Metric Name"]
        if name.startswith("gpu__time_duration"):
            k["us"] = value * TIME.get(unit, 1.0)
        elif name.startswith("dram__bytes_read"):
            k["rd"] = value * BYTES.get(unit, 1.0)
        elif name.startswith("dram__bytes_write"):
            k["wr"] = value * BYTES.get(unit, 1.0)
        elif name.startswith("sm__cycles_elapsed.avg.per_second"):
            k["clk"], k["clk_unit"] = value, unit
    return list(kernels.values())


def main():
    ks = load(sys.argv[1])
    tps = float(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else 0.0
    tokens = float(sys.argv[3]) if len(sys.argv) > 3 else 16384.0
    ends = [i for i, k in enumerate(ks) if "adamw" in k["name"].lower()]
    if len(ends) < 2:
        print(f"{len(ks)} kernels, {len(ends)} AdamW launches: cannot split steps")
        return
    step = ks[ends[-2] + 1: ends[-1] + 1]
    total = sum(k.get("us", 0) for k in step)
    by = defaultdict(lambda: [0, 0.0, 0.0])
    for k in step:
        b = by[short(k["name"])]
        b[0] += 1
        b[1] += k.get("us", 0)
        b[2] += k.get("rd", 0) + k.get("wr", 0)
    print(f"step {len(ends)}: {len(step)} kernels, {total / 1e3:.3f} ms of kernel time")
    clocked = [k for k in step if "clk" in k and k.get("us")]
    if clocked:
        t = sum(k["us"] for k in clocked)
        print(f"SM clock, time-weighted mean over the step's kernels: "
              f"{sum(k['clk'] * k['us'] for k in clocked) / t:.3f} {clocked[0]['clk_unit']}")
    if tps > 0:
        wall = tokens / tps * 1e3
        print(f"graph run: {tps:.0f} tok/s = {wall:.3f} ms per step; between kernels: {wall - total / 1e3:.3f} ms "
              f"({(wall - total / 1e3) / wall * 100:.1f}%)")
    print(f"{'kernel':60s} {'n':>4s} {'ms':>8s} {'share':>6s} {'GB':>7s} {'GB/s':>7s} {'us/launch':>9s}")
    for name, (n, us, by_) in sorted(by.items(), key=lambda x: -x[1][1]):
        print(f"{name:60s} {n:4d} {us / 1e3:8.3f} {us / total * 100:5.1f}% {by_ / 1e9:7.3f} "
              f"{by_ / (us * 1e3) if us else 0:7.0f} {us / n:9.1f}")
    short_ones = [k for k in step if k.get("us", 0) < 5]
    print(f"kernels under 5 us: {len(short_ones)}, {sum(k['us'] for k in short_ones) / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
