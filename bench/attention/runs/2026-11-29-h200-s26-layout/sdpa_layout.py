#!/usr/bin/env python3
"""Does cuDNN's SDPA kernel time depend on the q/k/v layout? torch 2.11, cuDNN backend, causal, bf16.
Layouts: packed (q, k, v column slices of one [B, T, (H + 2 KV) D] tensor, as our models and the anchor's
qkv.split run it), bthd (each a contiguous [B, T, H, D] viewed as [B, H, T, D]) and bhtd (contiguous
[B, H, T, D]). Per layout: the flash fprop / bprop kernels' mean time from torch.profiler over ITERS calls."""
import json, sys, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import profile, ProfilerActivity

ITERS = 30

def make(layout, B, T, H, KV, D):
    g = torch.Generator(device="cuda").manual_seed(1)
    if layout == "packed":
        qkv = torch.randn(B, T, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        q, k, v = qkv.split([H * D, KV * D, KV * D], -1)
        q, k, v = q.view(B, T, H, D).transpose(1, 2), k.view(B, T, KV, D).transpose(1, 2), v.view(B, T, KV, D).transpose(1, 2)
        return (qkv,), q, k, v
    if layout == "bthd":
        leaves = [torch.randn(B, T, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for n in (H, KV, KV)]
        return tuple(leaves), *[t.transpose(1, 2) for t in leaves]
    leaves = [torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for n in (H, KV, KV)]
    return tuple(leaves), *leaves

def run(shape, layout):
    B, T, H, KV, D = shape
    leaves, q, k, v = make(layout, B, T, H, KV, D)
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def once():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
            torch.autograd.grad(o, leaves, dout)
        for _ in range(5):
            once()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(ITERS):
                once()
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t and ("fprop" in e.key or "bprop" in e.key or "dot_do_o" in e.key or "convert_dq" in e.key or "copy" in e.key.lower() or "elementwise" in e.key.lower()):
            out[e.key[:70]] = round(t / ITERS, 1)
    return out

for shape in [(16, 1024, 12, 12, 64), (8, 2048, 32, 8, 64)]:
    for rnd in range(2):
        for layout in ("packed", "bthd", "bhtd"):
            print(json.dumps({"shape": "x".join(map(str, shape)), "round": rnd, "layout": layout, "us_per_call": run(shape, layout)}), flush=True)
