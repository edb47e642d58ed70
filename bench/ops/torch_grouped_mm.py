#!/usr/bin/env python3
"""PyTorch's side of `primus benchmark grouped_gemm`: torch._grouped_mm on exactly the shapes and
group offsets our benchmark ran, read from the file it writes with
PRIMUS_BENCH_GROUPED_GEMM_GROUPS=<file> (one JSON line per case: case, G, M, N, K, offsets [G+1]),
so the router counts are generated once, in turbo/bench/cases_grouped_gemm.cpp.

Per case, under our measurement names (<case>/fwd, /dgrad, /wgrad, /wgrad_bf16), with bf16 operands:
  fwd    out [M,N]    = torch._grouped_mm(inp [M,K], weight [G,N,K].transpose(-2,-1), offs)
  dgrad  dinp [M,K]   = torch._grouped_mm(dout [M,N], weight [G,N,K], offs)
  wgrad  dW [G,N,K]   = torch._grouped_mm(dout.t() [N,M], inp [M,K], offs)   (2D x 2D, offs over M)
offs = offsets[1:] (torch takes the cumulative ends). Timed as torch_ops.py times (5 warm-ups,
then the median of 50 per-call CUDA-event timings, calls enqueued back to back), which is how
`primus benchmark` times. torch's wgrad writes bf16 (its default out_dtype); ours writes f32 in
/wgrad and bf16 in /wgrad_bf16 (the same torch product is timed under both names).

Writes {"case", "ms", "anchor"} lines to --out for merge_ops.py --bench grouped_gemm.
Usage: python3 torch_grouped_mm.py --groups groups.jsonl --out torch.jsonl
"""
import argparse, json, statistics
import torch


def time_ms(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def rnd(*shape, scale=1.0):
    return (torch.rand(*shape, device="cuda", dtype=torch.float32) * 2 - 1).mul_(scale).to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases = {}
    with open(a.groups) as f:
        for line in f:
            if line.strip():
                c = json.loads(line)
                cases[c["case"]] = c  # every lane of our run wrote the same line
    anchor = f"torch._grouped_mm bf16 (torch {torch.__version__})"
    with open(a.out, "w") as out:
        for name, c in cases.items():
            G, M, N, K = c["G"], c["M"], c["N"], c["K"]
            offs = torch.tensor(c["offsets"][1:], dtype=torch.int32, device="cuda")
            x, w, dy = rnd(M, K), rnd(G, N, K, scale=0.05), rnd(M, N)
            wt = w.transpose(-2, -1)
            runs = [("fwd", lambda: torch._grouped_mm(x, wt, offs=offs)),
                    ("dgrad", lambda: torch._grouped_mm(dy, w, offs=offs)),
                    ("wgrad", lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
                    # The same product against ours written in bf16 (primus's .../wgrad_bf16).
                    ("wgrad_bf16", lambda: torch._grouped_mm(dy.t(), x, offs=offs))]
            for prod, fn in runs:
                try:
                    ms = time_ms(fn)
                except Exception as e:  # one product torch cannot run must not hide the others
                    print(f"{name}/{prod:6s} torch failed: {str(e).splitlines()[0]}", flush=True)
                    continue
                print(f"{name + '/' + prod:52s} {ms:9.4f} ms", flush=True)
                out.write(json.dumps({"case": f"{name}/{prod}", "ms": ms, "anchor": anchor}) + "\n")
                out.flush()
            del x, w, wt, dy, offs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
