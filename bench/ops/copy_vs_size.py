#!/usr/bin/env python3
"""Device-to-device copy bandwidth against the size of the copy (PyTorch's copy kernel and
cudaMemcpyAsync), to show what a memory-bound op of a given byte count can reach at all: the
`primus benchmark` ceiling is one 512 MiB copy, a steady state that ops moving 25-270 MB
(a GPT-2 / Llama norm at 16384 tokens) cannot reach. GB/s counts bytes read + bytes written.
Usage (GPU machine): python3 bench/ops/copy_vs_size.py [--json FILE]"""
import argparse, json, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--json", default="")
ap.add_argument("--iters", type=int, default=50)
a = ap.parse_args()
dev = torch.cuda.get_device_name()
rows = []
for mb in [12.5, 25, 50, 100, 134, 200, 512 * 1.048576]:
    n = int(mb * 1e6) // 2
    x = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    y = torch.empty_like(x)
    for kind in ["copy_", "memcpy"]:
        def run():
            if kind == "copy_":
                y.copy_(x)
            else:
                y.untyped_storage().copy_(x.untyped_storage(), non_blocking=True)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = 1e9
        for _ in range(3):
            s.record()
            for _ in range(a.iters):
                run()
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / a.iters)
        gbs = 2 * x.numel() * 2 / (best * 1e-3) / 1e9
        rows.append({"bench": "ops", "case": f"copy/{kind}/{x.numel() * 2 / 1e6:.1f}MB", "device": dev,
                     "metric": "GB/s", "ours": round(gbs, 2), "ms": round(best, 6)})
        print(f"  copy {kind:7s} {x.numel() * 2 / 1e6:9.1f} MB  {best * 1e3:9.2f} us  {gbs:9.1f} GB/s")
if a.json:
    with open(a.json, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
