#!/usr/bin/env python3
"""Joins `primus benchmark`'s JSON lines and torch_ops.py's results of ONE device call into
bench/results/ops.jsonl lines in DESIGN.md's Measurements format.

Written out:
  - every line of ours (each measurement against its device ceiling measured in the same run: a
    bf16 GEMM for TFLOP/s, a device-to-device copy for GB/s; the ceilings' own lines have no
    anchor);
  - for every case torch_ops.py measured under the same name: ours against the PyTorch anchor
    (its time converted with our work count, so both are in the same unit; ratio = ours /
    anchor, higher is better). "copy/512MiB" (our copy ceiling) is compared with torch's copy_.

Rounds: a call may time both sides several times, alternating (ours, torch, ours, torch, ...:
bench/ops/run_on_gpu.sh ROUNDS=n), because single timings on a GPU move by 5-30% between runs.
Give the files in that order (--ours r1 r2 ... --torch r1 r2 ...). Each line then carries the
median over the rounds of our value and of the anchor's time, the ratio of those medians,
"rounds": n and "ratio_range": [lowest, highest] of the per-round ratios (round i of ours against
round i of torch).

Usage: merge_ops.py --ours ours.jsonl [...] --torch torch.jsonl [...] --out bench/results/ops.jsonl
                    [--torch-version 2.11.0+cu130] [--replace]
The lines are appended to --out (a results log keeps every run); --replace writes a new file.
"""
import argparse, json, statistics


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def anchor_name(case, tv):
    if case.startswith("grouped_gemm/"):
        return "torch._grouped_mm bf16" + tv
    if case.startswith("gemm/"):
        return "torch.matmul bf16" + tv
    if case.startswith("copy/"):
        return "torch copy_" + tv
    if case.startswith("adamw"):
        return "torch.optim.AdamW(fused=True)" + tv
    if case.startswith("grad_norm/"):
        return "torch clip_grad_norm_(foreach=True)" + tv
    return "PyTorch eager" + tv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, nargs="+")
    ap.add_argument("--torch", required=True, nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--torch-version", default="")
    ap.add_argument("--bench", default="ops", help="whose lines of ours to merge: ops, or grouped_gemm "
                    "(bench/ops/grouped_gemm_on_gpu.sh, torch_grouped_mm.py)")
    ap.add_argument("--append", action="store_true", help="the default; kept for old command lines")
    ap.add_argument("--replace", action="store_true", help="overwrite --out instead of appending")
    a = ap.parse_args()
    if len(a.ours) != len(a.torch):
        ap.error(f"{len(a.ours)} --ours files but {len(a.torch)} --torch files: give one of each per round")
    rounds = len(a.ours)
    ours_rounds = [[r for r in load(p) if r.get("bench") == a.bench] for p in a.ours]
    torch_rounds = [{r["case"]: r["ms"] for r in load(p)} for p in a.torch]
    tv = f" ({'torch ' + a.torch_version})" if a.torch_version else ""

    # Our lines of round 1 in their order; the other rounds' values of the same (case, backend).
    by_key = [{(r["case"], r.get("backend")): r for r in rows} for rows in ours_rounds]
    lines = []
    for first in ours_rounds[0]:
        key = (first["case"], first.get("backend"))
        mine = [rows[key] for rows in by_key if key in rows]
        r = dict(first)
        if rounds > 1:
            r["ours"] = statistics.median(x["ours"] for x in mine)
            r["ms"] = statistics.median(x["ms"] for x in mine)
            r["rounds"] = len(mine)
            if isinstance(r.get("anchor"), (int, float)):
                # the ceiling: the median of the rounds' ceilings, the ratio against it
                ceilings = [x["anchor"] for x in mine if isinstance(x.get("anchor"), (int, float))]
                r["anchor"] = statistics.median(ceilings)
                r["ratio"] = r["ours"] / r["anchor"]
        lines.append(r)
        times = [t[key[0]] for t in torch_rounds if key[0] in t]
        if not times:
            continue
        scale = 1e9 if r["metric"] == "TFLOP/s" else 1e6
        t = r["work"] / statistics.median(times) / scale
        line = {"bench": a.bench, "case": r["case"], "device": r["device"], "date": r["date"],
                "commit": r["commit"], "metric": r["metric"], "ours": r["ours"], "anchor": round(t, 3),
                "anchor_name": anchor_name(r["case"], tv), "ratio": round(r["ours"] / t, 4),
                "backend": r["backend"], "dtype": r["dtype"]}
        if rounds > 1:
            per_round = [rows[key]["ours"] / (r["work"] / tr[key[0]] / scale)
                         for rows, tr in zip(by_key, torch_rounds) if key in rows and key[0] in tr]
            line["rounds"] = len(per_round)
            line["ratio_range"] = [round(min(per_round), 4), round(max(per_round), 4)]
        lines.append(line)
    with open(a.out, "w" if a.replace else "a") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"{'wrote' if a.replace else 'appended'} {len(lines)} lines to {a.out} ({rounds} round(s))")


if __name__ == "__main__":
    main()
