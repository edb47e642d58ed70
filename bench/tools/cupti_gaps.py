#!/usr/bin/env python3
"""Gaps between a training step's kernels, from turbo/bench/tools/cupti_trace.cpp's CSV.

Usage: cupti_gaps.py cupti_trace.csv [step_index]
Steps end at the AdamW kernel; step_index (default: the middle complete one) picks one. Prints the
step's span, its kernel/memset/memcpy time, the idle time between consecutive records, the largest
gaps with the records around them, and the idle time summed by the record that follows it.
"""
import csv
import re
import sys
from collections import defaultdict


def short(name):
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("void ", "")
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*", "", name)
    return name.split("::")[-1][:56]


def load_steps(path, step_arg=""):
    """The trace's records in start order, the indices of its AdamW kernels (each ends a step) and the
    step to read: step_arg if given (clamped), else the middle complete one. None when under 3 steps."""
    rows = list(csv.DictReader(open(path)))
    recs = sorted(({"kind": r["kind"], "s": int(r["start_ns"]), "e": int(r["end_ns"]), "name": r["name"],
                    "bytes": int(r["bytes"]), "grid": int(r["grid"]), "graph": int(r["graph"])} for r in rows),
                  key=lambda r: r["s"])
    ends = [i for i, r in enumerate(recs) if "adamw" in r["name"].lower()]
    if len(ends) < 3:
        print(f"{len(recs)} records, {len(ends)} AdamW kernels: not enough steps")
        return None
    k = int(step_arg) if step_arg else len(ends) // 2
    return recs, ends, max(1, min(k, len(ends) - 1))


def main():
    loaded = load_steps(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    if loaded is None:
        return
    recs, ends, k = loaded
    step = [r for r in recs[ends[k - 1] + 1: ends[k] + 1] if r["kind"] in "KS" or r["graph"]]
    span = (step[-1]["e"] - recs[ends[k - 1]]["e"]) / 1e3
    busy = sum(r["e"] - r["s"] for r in step) / 1e3
    gaps = []
    prev = recs[ends[k - 1]]
    for r in step:
        gaps.append(((r["s"] - prev["e"]) / 1e3, prev, r))
        prev = r
    idle = sum(max(g, 0) for g, _, _ in gaps)
    print(f"step {k} of {len(ends)}: {len(step)} records ({sum(r['kind'] == 'K' for r in step)} kernels, "
          f"{sum(r['kind'] == 'S' for r in step)} memsets, {sum(r['kind'] == 'C' for r in step)} copies); "
          f"span {span / 1e3:.3f} ms from the previous AdamW's end, busy {busy / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms")
    hist = defaultdict(lambda: [0, 0.0])
    for g, _, _ in gaps:
        b = "<0" if g < 0 else "<1us" if g < 1 else "1-2us" if g < 2 else "2-5us" if g < 5 else "5-20us" if g < 20 else ">=20us"
        hist[b][0] += 1
        hist[b][1] += max(g, 0)
    print("gaps: " + ", ".join(f"{b}: {n} ({t:.0f} us)" for b, (n, t) in sorted(hist.items())))
    print("largest gaps (us, previous -> next):")
    for g, p, r in sorted(gaps, key=lambda x: -x[0])[:20]:
        print(f"  {g:7.1f}  {short(p['name'])} ({(p['e'] - p['s']) / 1e3:.1f} us) -> {short(r['name'])} "
              f"({(r['e'] - r['s']) / 1e3:.1f} us{', %d bytes' % r['bytes'] if r['bytes'] else ''})")
    by = defaultdict(lambda: [0, 0.0, 0.0])
    for g, _, r in gaps:
        b = by[short(r["name"])]
        b[0] += 1
        b[1] += max(g, 0)
        b[2] += (r["e"] - r["s"]) / 1e3
    print(f"{'idle before / time of':56s} {'n':>4s} {'idle us':>8s} {'per':>6s} {'busy us':>9s}")
    for name, (n, g, t) in sorted(by.items(), key=lambda x: -x[1][1])[:25]:
        print(f"{name:56s} {n:4d} {g:8.1f} {g / n:6.2f} {t:9.1f}")


if __name__ == "__main__":
    main()
