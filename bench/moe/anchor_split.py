"""Where the MoE anchor's step goes: forward+backward against the optimizer step.

Builds the model of ../shared/bench/torch_moe_anchor.py (imported from the carried copy, not
changed: same preset, init, torch.compile, bf16 autocast, fused AdamW over fp32 parameters) and
times each phase of every measured step with CUDA events, so the anchor's AdamW share is measured
beside ours instead of inferred from bytes. Prints one JSON line.
Usage: python3 anchor_split.py ANCHOR_DIR --model olmoe-mini [--batch 4 --steps 10 --warmup 6]
"""
import argparse, importlib.util, json, os, sys

import torch

ap = argparse.ArgumentParser()
ap.add_argument("anchor_dir")
ap.add_argument("--model", default="olmoe-mini")
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--warmup", type=int, default=6)
a = ap.parse_args()
spec = importlib.util.spec_from_file_location("anchor", os.path.join(a.anchor_dir, "torch_moe_anchor.py"))
anchor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(anchor)

torch.manual_seed(0)
m, n, active, (V, T, L, C) = anchor.build(a.model, "grouped")
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
f = torch.compile(m)
x = torch.randint(0, V, (a.batch, T), device="cuda")
y = torch.randint(0, V, (a.batch, T), device="cuda")
ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(a.steps)]
for i in range(a.warmup + a.steps):
    e = ev[i - a.warmup] if i >= a.warmup else None
    if e: e[0].record()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = f(x, y)
    loss.backward()
    if e: e[1].record()
    opt.step(); opt.zero_grad(set_to_none=True)
    if e: e[2].record()
torch.cuda.synchronize()
fb = sum(e[0].elapsed_time(e[1]) for e in ev) / a.steps
op = sum(e[1].elapsed_time(e[2]) for e in ev) / a.steps
print(json.dumps({"anchor_split": a.model, "batch": a.batch, "seq": T, "params": n, "fwd_bwd_ms": round(fb, 2),
                  "optimizer_ms": round(op, 2), "step_ms": round(fb + op, 2),
                  "optimizer_bytes_per_param_at_4.8TBps": round(op * 1e-3 * 4.8e12 / n, 1)}), flush=True)
