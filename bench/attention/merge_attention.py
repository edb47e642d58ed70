#!/usr/bin/env python3
"""Joins primus_attention_bench's and torch_sdpa.py's results of ONE device run into
bench/results/attention.jsonl lines in DESIGN.md's Measurements format: for every case and
metric (fwd_tflops, bwd_tflops), one line per backend (CUDNN; TURBO with its default kernels;
TURBO_SM90_WS = the TMA warp-specialised forward; TURBO_SM90_PIPE = the cp.async-fed pipelined
wgmma forward; TURBO_SM90_SIMPLE = the wgmma forward without the softmax/GEMM overlap;
TURBO_SM80 = the mma.sync kernels) and one for the best dispatchable one (what autotune would pick), each against torch SDPA of the same case; ratio = ours /
anchor (higher is better).

Usage: merge_attention.py --ours ours.jsonl --torch torch.jsonl --date 2026-11-22
                          --commit abc1234 --out bench/results/attention.jsonl [--append]
                          [--rename OLD=NEW ...]
"""
import argparse, json


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    ap = argparse.ArgumentParser()
    for k in ("ours", "torch", "date", "commit", "out"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--rename", action="append", default=[],
                    help="OLD=NEW: record backend OLD of this run as NEW (e.g. when a default kernel changed after the run)")
    a = ap.parse_args()
    ours, torch_rows = load(a.ours), load(a.torch)
    meta_o = next(r for r in ours if r.get("meta"))  # (a file may hold several invocations' meta lines)
    meta_t = next(r for r in torch_rows if r.get("meta"))
    anchor = {r["case"]: r for r in torch_rows if not r.get("meta")}
    lines = []
    by_case = {}
    renames = dict(x.split("=", 1) for x in a.rename)
    for r in ours:
        if r.get("meta") or "error" in r:
            continue
        r["backend"] = renames.get(r["backend"], r["backend"])
        by_case.setdefault(r["case"], []).append(r)
    for case, rows in by_case.items():
        t = anchor.get(case)
        if not t:
            continue
        name = f"torch.nn.functional.scaled_dot_product_attention (torch {meta_t['torch']}, kernel {t.get('kernel', '?')})"
        for metric in ("fwd_tflops", "bwd_tflops"):
            cands = [(r["backend"], r[metric]) for r in rows]
            cands.append(("best", max(v for _, v in cands)))
            for be, v in cands:
                lines.append({"bench": "attention", "case": f"{case}/{be}", "device": meta_o["device"], "date": a.date,
                              "commit": a.commit, "metric": metric.replace("_tflops", " TFLOP/s"), "ours": v,
                              "anchor": t[metric], "anchor_name": name, "ratio": round(v / t[metric], 4)})
    with open(a.out, "a" if a.append else "w") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"wrote {len(lines)} lines to {a.out}")


if __name__ == "__main__":
    main()
