#!/usr/bin/env python3
"""PyTorch eager equivalents of the default GPU cases of `primus benchmark gemm norm activation
rope embedding loss optimizer` (turbo/bench/cases_*.cpp), timed the same way (5 warm-ups, then
the median of 50 per-call CUDA-event timings of calls enqueued back to back, no cache flush),
under the same case names.

Writes one JSON object per case to --out: {"case": ..., "ms": ...}; merge_ops.py pairs them
with `primus benchmark --json`'s lines. Usage: python3 torch_ops.py --out torch.jsonl [--only gemm|mem]
"""
import argparse, json, statistics
import torch
import torch.nn.functional as F

TOKENS = 16384


def time_ms(fn, reps=50):
    """Median per-call time of calls enqueued back to back, one synchronisation at the end
    (the same method as `primus benchmark`: host overhead overlaps the previous call's GPU work)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


class Rec:
    def __init__(self, path):
        self.f = open(path, "w") if path else None

    def __call__(self, case, ms):
        print(f"{case:44s} {ms:9.4f} ms", flush=True)
        if self.f:
            self.f.write(json.dumps({"case": case, "ms": ms}) + "\n"); self.f.flush()


def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.rand(*shape, device="cuda", dtype=torch.float32) * 2 - 1).mul_(scale).to(dtype)


def bench_gemm(rec):
    shapes = [("gpt2", "qkv", 768, 2304), ("gpt2", "attn_proj", 768, 768), ("gpt2", "fc", 768, 3072),
              ("gpt2", "fc_proj", 3072, 768), ("gpt2", "lm_head", 768, 50304), ("llama", "q_o", 2048, 2048),
              ("llama", "kv", 2048, 1024), ("llama", "gate_up", 2048, 16384), ("llama", "down", 8192, 2048),
              ("llama", "lm_head", 2048, 128256)]
    for model, name, C, OC in shapes:
        x, w, dy = rnd(TOKENS, C), rnd(OC, C, scale=0.05), rnd(TOKENS, OC)
        base = f"gemm/{model}/{name}"
        rec(base + "/fwd", time_ms(lambda: torch.matmul(x, w.t())))
        rec(base + "/dgrad", time_ms(lambda: torch.matmul(dy, w)))
        rec(base + "/wgrad", time_ms(lambda: torch.matmul(dy.t(), x)))
        del x, w, dy


def bench_norms(rec, model, kind, C):
    N = TOKENS
    x, r, dy = rnd(N, C), rnd(N, C), rnd(N, C)
    w, b = rnd(C), rnd(C)
    if kind == "layernorm":
        fwd = lambda t: F.layer_norm(t, (C,), w, b)
    else:
        fwd = lambda t: F.rms_norm(t, (C,), w)
    rec(f"{kind}_fwd/{model}", time_ms(lambda: fwd(x)))
    rec(f"add_{kind}_fwd/{model}", time_ms(lambda: fwd(x + r)))
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = F.layer_norm(xr, (C,), wr, br) if kind == "layernorm" else F.rms_norm(xr, (C,), wr)
    inputs = (xr, wr, br) if kind == "layernorm" else (xr, wr)
    rec(f"{kind}_bwd/{model}", time_ms(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)))


def bench_activations(rec):
    n = TOKENS * 3072
    x, dy = rnd(n, scale=3.0), rnd(n)
    rec("gelu_fwd/gpt2", time_ms(lambda: F.gelu(x, approximate="tanh")))
    rec("gelu_bwd/gpt2", time_ms(lambda: torch.ops.aten.gelu_backward(dy, x, approximate="tanh")))
    del x, dy
    Fh = 8192
    gu, dgo = rnd(TOKENS, 2 * Fh, scale=3.0), rnd(TOKENS, Fh)

    def swiglu(t):
        g, u = t.chunk(2, -1)
        return F.silu(g) * u

    rec("swiglu_fwd/llama", time_ms(lambda: swiglu(gu)))
    gur = gu.clone().requires_grad_()
    y = swiglu(gur)
    rec("swiglu_bwd/llama", time_ms(lambda: torch.autograd.grad(y, gur, dgo, retain_graph=True)))


def bench_rope(rec):
    B, T, H, D = 8, 2048, 32, 64
    inv = 500000.0 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    ang = torch.arange(T, device="cuda", dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]  # [T, 1, D/2]

    def rope(x):  # interleaved pairs, as the anchor trainer does it in eager PyTorch
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).to(x.dtype)

    q = rnd(B, T, H, D)
    rec("rope_fwd/llama", time_ms(lambda: rope(q)))
    qr = q.clone().requires_grad_()
    y = rope(qr)
    dy = rnd(B, T, H, D)
    rec("rope_bwd/llama", time_ms(lambda: torch.autograd.grad(y, qr, dy, retain_graph=True)))


def bench_embedding(rec):
    B, T, C, V = 16, 1024, 768, 50304
    wte, wpe = rnd(V, C), rnd(T, C)
    tok = torch.randint(0, V, (B, T), device="cuda")
    pos = torch.arange(T, device="cuda")
    rec("embedding_fwd/gpt2", time_ms(lambda: F.embedding(tok, wte) + F.embedding(pos, wpe)))
    dout = rnd(B, T, C)

    def bwd():
        torch.ops.aten.embedding_dense_backward(dout.view(-1, C), tok.view(-1), V, -1, False)
        torch.ops.aten.embedding_dense_backward(dout.view(-1, C), pos.repeat(B), T, -1, False)

    rec("embedding_bwd/gpt2", time_ms(bwd))


def bench_cross_entropy(rec, model, Vp, V):
    logits = rnd(TOKENS, Vp, scale=4.0).requires_grad_()
    t = torch.randint(0, V, (TOKENS,), device="cuda")
    rec(f"cross_entropy_fwdbwd/{model}",
        time_ms(lambda: torch.autograd.grad(F.cross_entropy(logits, t), logits)))
    del logits


def gpt2_param_sizes():
    C, V, T, L = 768, 50304, 1024, 12
    s = [V * C, T * C]
    for _ in range(L):
        s += [C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C]
    return s + [C, C]


def bench_optimizer(rec):
    sizes = gpt2_param_sizes()
    params = [torch.nn.Parameter(torch.rand(n, device="cuda") * 2 - 1) for n in sizes]
    for p in params:
        p.grad = (torch.rand_like(p) * 2 - 1) * 0.01
    decay = [p for p, n in zip(params, sizes) if n > 4 * 768]
    nodecay = [p for p, n in zip(params, sizes) if n <= 4 * 768]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=1e-4, fused=True)
    rec("adamw/gpt2-124M", time_ms(opt.step))
    rec("grad_norm/gpt2-124M", time_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)))
    print(f"params: {sum(sizes)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    rec = Rec(a.out)
    x = rnd(2 ** 28)
    y = torch.empty_like(x)
    rec("copy/512MiB", time_ms(lambda: y.copy_(x)))
    del x, y
    if a.only in ("", "gemm"):
        bench_gemm(rec)
    if a.only in ("", "mem"):
        bench_norms(rec, "gpt2", "layernorm", 768)
        bench_norms(rec, "llama", "rmsnorm", 2048)
        bench_activations(rec)
        bench_rope(rec)
        bench_embedding(rec)
        bench_cross_entropy(rec, "gpt2", 50304, 50257)
        bench_cross_entropy(rec, "llama", 128256, 128256)
        torch.cuda.empty_cache()
        bench_optimizer(rec)


if __name__ == "__main__":
    main()
