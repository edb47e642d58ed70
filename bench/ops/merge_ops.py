#!/usr/bin/env python3
"""Joins primus_ops_bench's and torch_ops.py's results of ONE device run into
bench/results/ops.jsonl lines in DESIGN.md's Measurements format.

For every case: ours (primus_ops_bench's value) against the PyTorch anchor of the same case
name (its time converted with our work count, so both are in the same unit; ratio = ours /
anchor, higher is better). For memory-bound cases a second line compares ours with the copy
bandwidth measured in the same run (ratio = share of copy bandwidth). "+search" variants of the
GEMMs are compared with the plain torch case.

Usage: merge_ops.py --ours ours.jsonl --torch torch.jsonl --device "NVIDIA H100 80GB HBM3"
                    --date 2026-11-22 --commit abc1234 --out bench/results/ops.jsonl
"""
import argparse, json


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    ap = argparse.ArgumentParser()
    for k in ("ours", "torch", "device", "date", "commit", "out"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--torch-version", default="")
    a = ap.parse_args()
    ours = load(a.ours)
    anchor = {r["case"]: r["ms"] for r in load(a.torch)}
    copy = next(r for r in ours if r["case"].startswith("copy/"))
    tv = f" {a.torch_version}" if a.torch_version else ""
    lines = []

    def line(case, metric, ours_v, anchor_v, anchor_name):
        lines.append({"bench": "ops", "case": case, "device": a.device, "date": a.date, "commit": a.commit,
                      "metric": metric, "ours": round(ours_v, 3), "anchor": round(anchor_v, 3),
                      "anchor_name": anchor_name, "ratio": round(ours_v / anchor_v, 4)})

    for r in ours:
        case = r["case"]
        base = case.replace("+search", "")
        if base in anchor:
            scale = 1e9 if r["metric"] == "TFLOP/s" else 1e6
            name = "torch.matmul bf16" if case.startswith("gemm/") else "PyTorch eager"
            if case.startswith("copy/"):
                name = "torch copy_"
            elif case.startswith("adamw/"):
                name = "torch.optim.AdamW(fused=True)"
            elif case.startswith("grad_norm/"):
                name = "torch clip_grad_norm_(foreach=True)"
            line(case, r["metric"], r["value"], r["work"] / anchor[base] / scale, name + tv)
        if r["metric"] == "GB/s" and not case.startswith("copy/"):
            line(case, "GB/s vs copy", r["value"], copy["value"], "cudaMemcpyAsync D2D, same run")
    with open(a.out, "w") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"wrote {len(lines)} lines to {a.out}")


if __name__ == "__main__":
    main()
