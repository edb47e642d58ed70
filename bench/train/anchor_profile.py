#!/usr/bin/env python3
"""Where the PyTorch anchor's training step spends its GPU time, by kernel family.

Builds the same model, optimizer and step as torch_anchor.py (imported from --anchor-dir: the
carried copy of ../shared/bench/torch_anchor.py), warms up (torch.compile), times --steps
steps without the profiler, then profiles --profile-steps steps with torch.profiler and sums
the kernels' device time per step by family:
  gemm       cuBLAS / cuBLASLt / nvjet / CUTLASS matrix kernels (and Triton mm templates)
  attention  SDPA kernels (flash, cuDNN, memory-efficient)
  optimizer  fused AdamW (multi-tensor apply)
  other      everything else (Inductor's fused elementwise / norm / loss kernels, copies, ...)
Prints one JSON line: step_ms (unprofiled wall time), the per-family ms per step, their sum
(busy_ms) and the 15 largest kernels. Used to bound what any implementation can gain over the
anchor when its GEMMs and attention run at the same libraries' speed (docs/performance.md, "The
step against torch.compile").
Usage: python3 anchor_profile.py --anchor-dir .carry-cuda --model llama3.2-1B --batch 8
"""
import argparse, json, os, sys, tempfile, time

FAMILIES = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "triton_tem", "splitk", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor")),
)


def family(name):
    low = name.lower()
    if low.startswith("triton_") and not low.startswith("triton_tem"):
        return "other"  # Inductor's fused kernels: their names quote the ops they fuse (sdpa, mm, ...)
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchor-dir", required=True)
    ap.add_argument("--model", default="gpt2-124M")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, a.anchor_dir)
    import torch
    import torch_anchor as ta
    fam, V, T, L, C, H, KV, F_ = ta.PRESETS[a.model]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    m = ta.Decoder(fam, V, T, L, C, H, KV, F_).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    f = torch.compile(m)
    x = torch.randint(0, V, (a.batch, T), device="cuda")
    y = torch.randint(0, V, (a.batch, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / a.steps * 1e3
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profile_steps):
            step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    per_fam, per_kernel = {}, {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        us = float(e.get("dur", 0))
        fm = family(e["name"])
        per_fam[fm] = per_fam.get(fm, 0.0) + us
        k = per_kernel.setdefault(e["name"], [fm, 0.0, 0])
        k[1] += us; k[2] += 1
    n = a.profile_steps
    fams = {k: round(v / n / 1e3, 3) for k, v in sorted(per_fam.items())}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:15]
    print(json.dumps({"model": a.model, "batch": a.batch, "seq": T, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), "step_ms": round(step_ms, 3),
                      "busy_ms": round(sum(per_fam.values()) / n / 1e3, 3), "families_ms": fams,
                      "top": [{"name": nm[:90], "family": v[0], "ms_per_step": round(v[1] / n / 1e3, 3),
                               "launches_per_step": v[2] // n} for nm, v in top]}), flush=True)


if __name__ == "__main__":
    main()
