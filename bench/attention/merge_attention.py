#!/usr/bin/env python3
"""Joins `primus benchmark attention`'s JSON lines and torch_sdpa.py's results of ONE device run
into bench/results/attention.jsonl lines in DESIGN.md's Measurements format: for every case and
direction (fwd, bwd), one line per backend (CUDNN, TURBO) or kernel variant (--variants, e.g.
TURBO_SM80) and one for the best of the backends (what autotune would pick; a variant is not
among its choices), each against torch SDPA on the same case; ratio = ours / anchor (higher is
better). Our lines against the device's GEMM ceiling are copied as they are.

Usage: merge_attention.py --ours ours.jsonl --torch torch.jsonl --out bench/results/attention.jsonl
                          [--replace] [--rename OLD=NEW ...]
The lines are appended to --out (a results log keeps every run); --replace writes a new file.
"""
import argparse, json

# The dispatcher's backends (turbo/dispatch/backend_type.h); other names are kernel variants.
DISPATCH_BACKENDS = {"CPU", "CUBLASLT", "CUDNN", "TURBO"}


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    ap = argparse.ArgumentParser()
    for k in ("ours", "torch", "out"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--append", action="store_true", help="the default; kept for old command lines")
    ap.add_argument("--replace", action="store_true", help="overwrite --out instead of appending")
    ap.add_argument("--rename", action="append", default=[],
                    help="OLD=NEW: record backend OLD of this run as NEW (e.g. when a default kernel changed after the run)")
    a = ap.parse_args()
    ours = [r for r in load(a.ours) if r.get("bench") == "attention"]
    torch_rows = load(a.torch)
    meta_t = next(r for r in torch_rows if r.get("meta"))
    anchor = {r["case"]: r for r in torch_rows if not r.get("meta")}
    renames = dict(x.split("=", 1) for x in a.rename)
    lines = []
    by_key = {}  # (case, direction) -> [our lines]
    for r in ours:
        r["backend"] = renames.get(r["backend"], r["backend"])
        lines.append(r)
        case, _, direction = r["case"].rpartition("/")
        by_key.setdefault((case, direction), []).append(r)
    for (case, direction), rows in by_key.items():
        t = anchor.get(case)
        if not t:
            continue
        ref = t[f"{direction}_tflops"]
        name = f"torch.nn.functional.scaled_dot_product_attention (torch {meta_t['torch']}, kernel {t.get('kernel', '?')})"
        cands = [(r["backend"], r["ours"]) for r in rows]
        dispatchable = [v for be, v in cands if be in DISPATCH_BACKENDS]
        if dispatchable:
            cands.append(("best", max(dispatchable)))
        for be, v in cands:
            lines.append({"bench": "attention", "case": f"{case}/{be}", "device": rows[0]["device"],
                          "date": rows[0]["date"], "commit": rows[0]["commit"], "metric": f"{direction} TFLOP/s",
                          "ours": v, "anchor": ref, "anchor_name": name, "ratio": round(v / ref, 4)})
    with open(a.out, "w" if a.replace else "a") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"wrote {len(lines)} lines to {a.out}")


if __name__ == "__main__":
    main()
