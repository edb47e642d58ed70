#!/usr/bin/env python3
"""The PyTorch side of the FP8 GEMM comparison (issue #38), and the merge of both sides.

Timing (default): torch._scaled_mm on the shapes of `primus benchmark gemm_fp8`, E4M3 operands
quantized as the FP8 linear layers do (current scaling, amax / 448), output bf16:
  A  = q(x), x [M, K] row-major;   B = q(w).t(), w [N, K] row-major (so B is column-major [K, N])
  tensorwise  scale_a, scale_b f32 scalars;                     use_fast_accum=True
  rowwise     scale_a [M, 1], scale_b [1, N] f32;               use_fast_accum=True
  blockwise   scale_a 1x128 tiles: [M, K/128] with strides (1, M) (M fastest, as turbo's
              Block1x128); scale_b 128x128 blocks of w: scale_b.t() is [N/128, K/128] row-major
              (strides (K/128, 1); the padded stride pad4(K/128) is tried when that is refused);
              use_fast_accum=False. PyTorch runs this through cuBLASLt's block-scaled GEMM on
              Hopper, the same library as our CUBLASLT backend.
The contract is aten/src/ATen/native/cuda/ScaledBlas.cpp (get_joint_scaling): rowwise wants
scale_a [M, 1] and scale_b [1, N], both contiguous, and mat2 column-major.
Each product: WARMUP calls, then ITERS calls each between its own pair of CUDA events (as
primus's BenchDevice times, the median; the upper one of an even count), after a spin kernel
(torch.cuda._sleep, --sleep-cycles) that lets the host queue the calls ahead of the GPU, so Python's
launch cost stays outside the events; `primus benchmark --idle-ms` gives our side the same idle. One JSON line per shape (stdout, and appended to --out):
  {"shape": "MxNxK", "label", "M", "N", "K", "device", "torch", "iters",
   "tensorwise": {"ms", "tflops", "ms_mean"}, "rowwise": {...}, "blockwise": {...} or {"error": "..."}}

Merge (--merge): `primus benchmark gemm_fp8 --json` files of each round (--ours, in order) and
this program's (--torch, same order) -> rows in DESIGN.md's Measurements format (--out, appended;
--replace overwrites), then a table on stdout:
  gemm_fp8_rowwise/<shape>     ours against torch._scaled_mm rowwise     (target >= 1.1)
  gemm_fp8_tensorwise/<shape>  ours against torch._scaled_mm tensorwise
  gemm_fp8_blockwise/<shape>   ours against torch._scaled_mm blockwise (cuBLASLt's block-scaled
                               GEMM; target >= 1.0) where torch ran it, and against torch rowwise
                               (what the finer scales cost)
ours and anchor are medians over the rounds (TFLOP/s = 2MNK / median ms), ratio = ours / anchor,
"ratio_range" the lowest and highest per-round ratio (round i against round i).

Usage:
  gemm_torch.py [--shapes 16384x3072x2048,...] [--modes tensorwise,rowwise,blockwise] [--iters 50] [--out F]
  gemm_torch.py --merge --ours o1.jsonl o2.jsonl --torch t1.jsonl t2.jsonl --out gemm_fp8.jsonl
"""
import argparse
import json
import statistics
import sys

# (label, M, N, K): `primus benchmark gemm_fp8`'s default GPU cases (turbo/bench/cases_gemm.cpp).
T = 16384
SHAPES = [("llama/qkv", T, 3072, 2048), ("llama/attn_out", T, 2048, 2048), ("llama/gate_up", T, 16384, 2048),
          ("llama/down", T, 2048, 8192), ("gpt2/qkv", T, 2304, 768), ("gpt2/attn_proj", T, 768, 768),
          ("gpt2/fc", T, 3072, 768), ("gpt2/fc_proj", T, 768, 3072), ("8192^3", 8192, 8192, 8192)]
MODES = ("tensorwise", "rowwise", "blockwise")
FP8_MAX = 448.0


def shape_key(m, n, k):
    return f"{m}x{n}x{k}"


def parse_shapes(text):
    if not text:
        return SHAPES
    labels = {shape_key(m, n, k): l for l, m, n, k in SHAPES}
    out = []
    for s in text.split(","):
        m, n, k = (int(v) for v in s.split("x"))
        out.append((labels.get(s, ""), m, n, k))
    return out


# ---- timing -------------------------------------------------------------------------------------

def quantize(torch, t, groups):
    """q(t) in e4m3 and its dequantization factors, per group of `groups`: 'tensor', 'row',
    '1x128' (rows x 128 columns) or '128x128'; the factors shaped [1], [R], [R, C/128], [R/128, C/128]."""
    r, c = t.shape
    tf = t.float()
    if groups == "tensor":
        amax = tf.abs().amax().reshape(1)
        scale = FP8_MAX / amax.clamp_min(1e-12)
        q = (tf * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    elif groups == "row":
        amax = tf.abs().amax(dim=1)
        scale = FP8_MAX / amax.clamp_min(1e-12)
        q = (tf * scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    elif groups == "1x128":
        v = tf.view(r, c // 128, 128)
        scale = FP8_MAX / v.abs().amax(dim=2).clamp_min(1e-12)  # [R, C/128]
        q = (v * scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(r, c).to(torch.float8_e4m3fn)
    else:
        v = tf.view(r // 128, 128, c // 128, 128)
        scale = FP8_MAX / v.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [R/128, C/128]
        q = (v * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(r, c).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).float()


def operands(torch, x, w, mode):
    """(a, b, scale_a, scale_b candidates, fast accum) as torch._scaled_mm takes them."""
    n, k = w.shape
    if mode == "tensorwise":
        qa, sa = quantize(torch, x, "tensor")
        qw, sw = quantize(torch, w, "tensor")
        return qa, qw.t(), [(sa.reshape(()), sw.reshape(()), "scalar")], True
    if mode == "rowwise":
        qa, sa = quantize(torch, x, "row")
        qw, sw = quantize(torch, w, "row")
        return qa, qw.t(), [(sa.reshape(-1, 1).contiguous(), sw.reshape(1, -1).contiguous(), "[M,1] x [1,N]")], True
    qa, sa = quantize(torch, x, "1x128")  # [M, K/128]
    qw, sw = quantize(torch, w, "128x128")  # [N/128, K/128]
    sa_outer = sa.t().contiguous().t()  # strides (1, M): the row index fastest
    kb = k // 128
    pad = (kb + 3) // 4 * 4
    sw_padded = torch.ones(n // 128, pad, device=sw.device, dtype=torch.float32)
    sw_padded[:, :kb] = sw
    return qa, qw.t(), [(sa_outer, sw.t(), "1x128 x 128x128"),
                        (sa_outer, sw_padded[:, :kb].t(), "1x128 x 128x128, scale_b stride pad4(K/128)")], False


def time_ms(torch, fn, iters, warmup, sleep_cycles):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    whole = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    if sleep_cycles > 0:
        torch.cuda._sleep(sleep_cycles)  # 20M cycles, ~10 ms of spinning: the host queues the calls meanwhile
    whole[0].record()
    for a, b in ev:
        a.record()
        fn()
        b.record()
    whole[1].record()
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in ev)
    return ms[len(ms) // 2], whole[0].elapsed_time(whole[1]) / iters


def run_timing(a):
    import torch
    dev = torch.cuda.get_device_name(0)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"gemm_torch.py: unknown mode {m!r} (known: {', '.join(MODES)})")
    out = open(a.out, "a") if a.out else None
    g = torch.Generator(device="cuda").manual_seed(1234)
    for label, m, n, k in parse_shapes(a.shapes):
        x = torch.rand(m, k, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).to(torch.bfloat16)
        w = torch.rand(n, k, device="cuda", generator=g, dtype=torch.float32).mul_(0.1).sub_(0.05).to(torch.bfloat16)
        line = {"shape": shape_key(m, n, k), "label": label, "M": m, "N": n, "K": k, "device": dev,
                "torch": torch.__version__, "iters": a.iters}
        flops = 2.0 * m * n * k
        for mode in modes:
            try:
                qa, qb, scales, fast = operands(torch, x, w, mode)
                errors = []
                for sa, sb, layout in scales:
                    try:
                        def fn(sa=sa, sb=sb):
                            return torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
                        y = fn()
                        torch.cuda.synchronize()
                        if not bool(torch.isfinite(y[:8]).all()):
                            raise RuntimeError("non-finite output")
                        del y
                        ms, ms_mean = time_ms(torch, fn, a.iters, a.warmup, a.sleep_cycles)
                        line[mode] = {"ms": sig(ms), "tflops": sig(flops / ms / 1e9), "ms_mean": sig(ms_mean), "scales": layout, "fast_accum": fast}
                        break
                    except Exception as e:  # a refused layout: the next one, else the error
                        errors.append(f"{layout}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                else:
                    line[mode] = {"error": "; ".join(errors)}
                del qa, qb, scales
            except Exception as e:
                line[mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        del x, w
        torch.cuda.empty_cache()
        text = json.dumps(line)
        print(text, flush=True)
        if out:
            out.write(text + "\n")
            out.flush()


# ---- merge --------------------------------------------------------------------------------------

def load(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []


def sig(v):
    """Six significant digits, as primus writes its numbers."""
    return float(f"{v:.6g}")


def merge(a):
    if len(a.ours) != len(a.torch):
        sys.exit(f"gemm_torch.py --merge: {len(a.ours)} --ours files but {len(a.torch)} --torch files: one of each per round")
    # ours[r][(gran, shape)] = row (the device backend's; CUBLASLT unless --backend says otherwise)
    ours = []
    order = []
    for p in a.ours:
        rows = {}
        for r in load(p):
            c = r.get("case", "")
            if r.get("bench") != "gemm_fp8" or not c.startswith("gemm_fp8_") or r.get("backend") != a.backend:
                continue
            gran, shape = c[len("gemm_fp8_"):].split("/", 1)
            rows[(gran, shape)] = r
            if shape not in order:
                order.append(shape)
        ours.append(rows)
    # torch[r][shape] = line
    torch_r = [{l["shape"]: l for l in load(p)} for p in a.torch]
    tv = a.torch_version or next((l.get("torch") for t in torch_r for l in t.values() if l.get("torch")), "")
    for t in torch_r:
        for s, l in t.items():
            if s not in order:
                order.append(s)

    def torch_ms(r, shape, mode):
        v = torch_r[r].get(shape, {}).get(mode, {})
        return v.get("ms") if isinstance(v, dict) else None

    anchors = {
        "tensorwise": ("tensorwise", f"torch._scaled_mm tensorwise (PyTorch {tv})", None, ""),
        "rowwise": ("rowwise", f"torch._scaled_mm rowwise (PyTorch {tv})", 1.1, ""),
        "blockwise": ("blockwise", f"torch._scaled_mm blockwise 1x128 x 128x128, cuBLASLt block-scaled (PyTorch {tv})", 1.0,
                      "both sides cuBLASLt's block-scaled FP8 GEMM (ours: turbo::gemm's CUBLASLT backend)"),
        "blockwise_vs_row": ("rowwise", f"torch._scaled_mm rowwise (PyTorch {tv})", None,
                             "blockwise against torch's rowwise: what 1x128 x 128x128 scales cost (no fast "
                             "accumulation) against per-row scales with it; not the issue's blockwise target"),
    }
    lines, table = [], {}
    for shape in order:
        m, n, k = (int(v) for v in shape.split("x"))
        flops = 2.0 * m * n * k
        for kind in ("tensorwise", "rowwise", "blockwise", "blockwise_vs_row"):
            gran = "blockwise" if kind == "blockwise_vs_row" else kind
            mine = [(i, rows[(gran, shape)]) for i, rows in enumerate(ours) if (gran, shape) in rows]
            if not mine:
                continue
            first = mine[0][1]
            ours_ms = statistics.median(r["ms"] for _, r in mine)
            ours_tf = flops / ours_ms / 1e9
            table.setdefault(shape, {})[f"ours_{gran}"] = ours_tf
            mode, name, target, note = anchors[kind]
            pairs = [(r["ms"], torch_ms(i, shape, mode)) for i, r in mine if i < len(torch_r)]
            pairs = [(o, t) for o, t in pairs if t]
            if not pairs:
                if kind != "blockwise_vs_row":
                    err = next((torch_r[i].get(shape, {}).get(mode, {}).get("error") for i, _ in mine
                                if i < len(torch_r) and isinstance(torch_r[i].get(shape, {}).get(mode), dict)), None)
                    table[shape][f"err_{mode}"] = err or "not run"
                continue
            t_ms = statistics.median(t for _, t in pairs)
            t_tf = flops / t_ms / 1e9
            table[shape][f"torch_{mode}"] = t_tf
            table[shape][f"ratio_{kind}"] = ours_tf / t_tf
            label = next((torch_r[i].get(shape, {}).get("label") for i in range(len(torch_r)) if torch_r[i].get(shape, {}).get("label")), "")
            table[shape]["label"] = label
            line = {"bench": "gemm_fp8", "case": first["case"], "device": first["device"], "date": first["date"],
                    "commit": first["commit"], "metric": "TFLOP/s", "ours": sig(ours_tf), "anchor": sig(t_tf),
                    "anchor_name": name, "ratio": round(ours_tf / t_tf, 4), "backend": first.get("backend"),
                    "dtype": first.get("dtype"), "ms": sig(ours_ms), "anchor_ms": sig(t_ms),
                    "work": flops, "rounds": len(pairs),
                    "ratio_range": [round(min(t / o for o, t in pairs), 4), round(max(t / o for o, t in pairs), 4)]}
            if label:
                line["layer"] = label
            if a.harness:
                line["harness"] = a.harness
            if target is not None:
                line["target"] = target
            if kind == "blockwise_vs_row" and "torch_blockwise" not in table[shape]:
                note = ("torch._scaled_mm ran no block-scaled GEMM here (" + table[shape].get("err_blockwise", "not run")
                        + "); cuBLASLt's block-scaled GEMM is what our CUBLASLT backend itself runs, so torch's rowwise "
                        "GEMM is the anchor")
            if note:
                line["note"] = note
            lines.append(line)
    with open(a.out, "w" if a.replace else "a") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
    print(f"{'wrote' if a.replace else 'appended'} {len(lines)} rows to {a.out} ({len(a.ours)} round(s), PyTorch {tv})")

    def cell(v, w=7, f="{:.1f}"):
        return f"{f.format(v):>{w}s}" if isinstance(v, (int, float)) else f"{'-':>{w}s}"

    print("\nFP8 GEMM, e4m3 -> bf16, TFLOP/s (median of the rounds); ratio = ours / torch._scaled_mm, same call"
          "\n  t = tensorwise, r = rowwise, b = blockwise 1x128 x 128x128; targets: r/r >= 1.1, b/b >= 1.0")
    hdr = (f"{'shape':17s} {'layer':15s} {'ours t':>7s} {'ours r':>7s} {'ours b':>7s} {'torch t':>7s} {'torch r':>7s} "
           f"{'torch b':>7s} {'t/t':>6s} {'r/r':>6s} {'b/b':>6s} {'b/r':>6s}")
    print(hdr)
    for shape in order:
        t = table.get(shape, {})
        print(f"{shape:17s} {t.get('label', ''):15s} {cell(t.get('ours_tensorwise'))} {cell(t.get('ours_rowwise'))} "
              f"{cell(t.get('ours_blockwise'))} {cell(t.get('torch_tensorwise'))} {cell(t.get('torch_rowwise'))} "
              f"{cell(t.get('torch_blockwise'))} {cell(t.get('ratio_tensorwise'), 6, '{:.3f}')} "
              f"{cell(t.get('ratio_rowwise'), 6, '{:.3f}')} {cell(t.get('ratio_blockwise'), 6, '{:.3f}')} "
              f"{cell(t.get('ratio_blockwise_vs_row'), 6, '{:.3f}')}")
    errs = {(s, k[4:]): v for s, t in table.items() for k, v in t.items() if k.startswith("err_")}
    for (s, mode), e in errs.items():
        print(f"  torch {mode} {s}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="", help="MxNxK,... (default: the gemm_fp8 family's GPU cases)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sleep-cycles", type=int, default=20_000_000,
                    help="torch.cuda._sleep before each timed series (0: none; primus's side: --idle-ms)")
    ap.add_argument("--out", default="", help="timing: also append the lines here; --merge: the rows' file")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--ours", nargs="+", default=[])
    ap.add_argument("--torch", nargs="+", default=[])
    ap.add_argument("--backend", default="CUBLASLT", help="--merge: whose lines of ours (default CUBLASLT)")
    ap.add_argument("--torch-version", default="")
    ap.add_argument("--harness", default="", help="--merge: how both sides were timed, recorded in each row")
    ap.add_argument("--replace", action="store_true", help="--merge: overwrite --out instead of appending")
    a = ap.parse_args()
    if a.merge:
        if not a.ours or not a.torch or not a.out:
            ap.error("--merge needs --ours, --torch and --out")
        merge(a)
    else:
        run_timing(a)


if __name__ == "__main__":
    main()
