#!/usr/bin/env python3
"""Joins `primus benchmark`'s JSON lines and torch_ops.py's results of ONE device run into
bench/results/ops.jsonl lines in DESIGN.md's Measurements format.

Written out:
  - every line of ours as it is (each measurement against its device ceiling measured in the
    same run: a bf16 GEMM for TFLOP/s, a device-to-device copy for GB/s; the ceilings' own lines
    have no anchor);
  - for every case torch_ops.py measured under the same name: ours against the PyTorch anchor
    (its time converted with our work count, so both are in the same unit; ratio = ours /
    anchor, higher is better). "copy/512MiB" (our copy ceiling) is compared with torch's copy_.

Usage: merge_ops.py --ours ours.jsonl --torch torch.jsonl --out bench/results/ops.jsonl
                    [--torch-version 2.11.0+cu130] [--replace]
The lines are appended to --out (a results log keeps every run); --replace writes a new file.
"""
import argparse, json


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def anchor_name(case, tv):
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
    for k in ("ours", "torch", "out"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--torch-version", default="")
    ap.add_argument("--append", action="store_true", help="the default; kept for old command lines")
    ap.add_argument("--replace", action="store_true", help="overwrite --out instead of appending")
    a = ap.parse_args()
    ours = [r for r in load(a.ours) if r.get("bench") == "ops"]
    anchor = {r["case"]: r["ms"] for r in load(a.torch)}
    tv = f" ({'torch ' + a.torch_version})" if a.torch_version else ""
    lines = []
    for r in ours:
        lines.append(r)
        if r["case"] in anchor:
            scale = 1e9 if r["metric"] == "TFLOP/s" else 1e6
            t = r["work"] / anchor[r["case"]] / scale
            lines.append({"bench": "ops", "case": r["case"], "device": r["device"], "date": r["date"],
                          "commit": r["commit"], "metric": r["metric"], "ours": r["ours"], "anchor": round(t, 3),
                          "anchor_name": anchor_name(r["case"], tv), "ratio": round(r["ours"] / t, 4),
                          "backend": r["backend"], "dtype": r["dtype"]})
    with open(a.out, "w" if a.replace else "a") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"{'wrote' if a.replace else 'appended'} {len(lines)} lines to {a.out}")


if __name__ == "__main__":
    main()
