#!/usr/bin/env python3
"""One training step's kernels by name, from turbo/bench/tools/cupti_trace.cpp's CSV: launches, total time and
the per-launch range, largest first (the counterpart of bench/train/anchor_profile.py's torch table).

Usage: cupti_kernels.py cupti_trace.csv [step_index] [rows]
Steps end at the AdamW kernel; step_index (default: the middle complete one) picks one.
"""
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cupti_gaps import load_steps  # noqa: E402  (the trace's records and step boundaries)


def main():
    loaded = load_steps(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    if loaded is None:
        return
    recs, ends, k = loaded
    n_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    step = [r for r in recs[ends[k - 1] + 1: ends[k] + 1] if r["kind"] in "KS"]
    by = defaultdict(list)
    for r in step:
        by[(r["name"][:110], r["grid"])].append((r["e"] - r["s"]) / 1e3)
    total = sum(sum(v) for v in by.values())
    print(f"step {k}: {len(step)} kernels and memsets, {total / 1e3:.3f} ms of kernel time")
    print(f"{'ms':>8s} {'n':>4s} {'min us':>8s} {'max us':>8s} {'grid':>6s}  name")
    for (name, grid), v in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:n_rows]:
        print(f"{sum(v) / 1e3:8.3f} {len(v):4d} {min(v):8.1f} {max(v):8.1f} {grid:6d}  {name}")


if __name__ == "__main__":
    main()
