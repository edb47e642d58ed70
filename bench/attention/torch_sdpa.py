#!/usr/bin/env python3
"""The anchor of `primus benchmark attention`: torch.nn.functional.scaled_dot_product_attention
on the same cases, same dtype (bf16) and memory layout ([B,T,H,D] tensors viewed as [B,H,T,D]),
timed as the median of --iters CUDA-event-timed calls after three warm-ups (each call waited
for; `primus benchmark` enqueues its calls back to back). Backward is timed as
torch.autograd.grad of the output (no .grad accumulation). GQA cases repeat nothing:
enable_gqa=True lets SDPA read the shared kv heads.

Writes one JSON object per case to --out, with the backend PyTorch reports for that call."""
import argparse, json, sys

import torch
import torch.nn.functional as F

CASES = [  # the default GPU cases of turbo/bench/cases_attention.cpp, same names
    ("causal_d128_t2048", 8, 2048, 16, 16, 128, True),
    ("causal_d128_t8192", 2, 8192, 16, 16, 128, True),
    ("gpt2_causal_d64_t1024", 16, 1024, 12, 12, 64, True),
    ("gqa4_causal_d128_t4096", 4, 4096, 32, 8, 128, True),
]


def median_ms(iters, fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def backend_in_use(q, k, v, causal, gqa):
    """Which SDPA kernel PyTorch's profiler sees for this call (names differ by version)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for n in names:
        low = n.lower()
        if "cudnn" in low or "sm90" in low or "fmha" in low or "flash" in low or "attention" in low:
            return n[:120]
    return ";".join(names)[:200]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name(0)
    with open(a.out, "w") as f:
        meta = {"meta": 1, "device": dev, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        f.write(json.dumps(meta) + "\n")
        print(json.dumps(meta))
        for name, B, T, H, KVH, D, causal in CASES:
            if a.only and a.only not in name:
                continue
            torch.manual_seed(0)
            mk = lambda h: (torch.rand(B, T, h, D, device="cuda", dtype=torch.bfloat16) * 2 - 1)
            q, k, v = mk(H), mk(KVH), mk(KVH)
            dout = mk(H).transpose(1, 2)
            q, k, v = (t.transpose(1, 2).requires_grad_(True) for t in (q, k, v))  # [B,H,T,D] views
            gqa = H != KVH
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            fwd_ms = median_ms(a.iters, fwd)
            out = fwd()
            bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            bwd_ms = median_ms(a.iters, bwd)
            flops = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
            rec = {"case": name, "backend": "torch_sdpa", "B": B, "T": T, "H": H, "KVH": KVH, "D": D,
                   "causal": causal, "fwd_ms": round(fwd_ms, 4), "bwd_ms": round(bwd_ms, 4),
                   "fwd_tflops": round(flops / fwd_ms / 1e9, 2), "bwd_tflops": round(2.5 * flops / bwd_ms / 1e9, 2),
                   "kernel": backend_in_use(q.detach(), k.detach(), v.detach(), causal, gqa)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(json.dumps(rec))
            sys.stdout.flush()
            del q, k, v, out, dout
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
