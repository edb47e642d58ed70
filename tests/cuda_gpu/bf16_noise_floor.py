#!/usr/bin/env python3
"""Outside oracle for the CUDA model's gradient-parity gate: how far do PyTorch's own bf16 gradients
land from PyTorch's fp32 gradients on the very tiny models, weights and batches of
tests/cuda_gpu/model_parity_test.cpp? That distance is the noise floor of bf16 training on this
problem; the test's per-tensor gate is derived from it (gradient_gate() in model_parity_test.cpp).

Input: the folders written by step0_parity's dump mode, e.g. on the GPU machine
    PRIMUS_PARITY_DUMP=/tmp/parity-dump test_cuda_gpu --gtest_filter='*ParityDump*'
    python3 tests/cuda_gpu/bf16_noise_floor.py /tmp/parity-dump [--json noise_floor.json]
(bench/train/run_on_gpu.sh runs both in its test stage). Each folder holds, for one model
(gpt2 | llama), attention (default | fallback) and seed: hf/ (config.json + model.safetensors: the
bf16-rounded weights as fp32 in Hugging Face names and layouts, as `primus export hf` writes them),
batch.safetensors (tokens, targets: [B, T]), grads_ref.safetensors (the reference backend's fp32
gradients), grads_ours.safetensors (our CUDA model's bf16 gradients) and parity.json (losses, and
per tensor of ours: its Hugging Face parts and the test's relative L2).

For every (model, seed), transformers builds GPT2LMHeadModel / LlamaForCausalLM from that folder
and runs forward + backward on the same tokens/targets with the same loss (mean cross-entropy over
the B*T pairs; the targets are not the shifted tokens, so the loss is computed here, not by
labels=) in:
  fp32            fp32 weights and compute, TF32 off (the baseline)
  autocast        torch.autocast("cuda", torch.bfloat16) over fp32 master weights, transformers'
                  default SDPA attention: how people train in bf16. THE NOISE FLOOR.
  autocast-eager  the same with the eager (matmul + fp32 softmax) attention
  bf16-weights    the model cast to bf16 (weights, activations and gradients in bf16)
and prints, per tensor of ours (fused tensors such as qkv aggregate their Hugging Face parts, so
the metric is exactly the test's ||g - g_fp32|| / ||g_fp32||):
  ref~fp32        the reference backend against torch fp32: must be ~1e-6. It proves the weights,
                  names, layouts (RoPE rows, Conv1D transposes, tied head) and loss are the same
                  problem; above --mapping-tol the script fails loudly (exit 2).
  each bf16 variant above against torch fp32
  ours[attn]      our CUDA gradients against torch fp32, per attention implementation
  test[attn]      our CUDA gradients against the reference, recomputed from the dump (must equal
                  the number the C++ test computed, also checked)
then per model the worst over tensors and seeds, and the gate rule's value:
  gate = max(2e-2, 1.5 x worst "autocast")     (--floor, --margin)

--files-only needs no torch: it checks the dumps (files, names, shapes, the test's numbers
recomputed from the files) with the standard library alone, e.g. on a dump of the host model.
Exit status: 0 done, 1 bad input, 2 mapping check failed.
"""
import argparse
import contextlib
import datetime
import glob
import json
import math
import os
import struct
import sys
from array import array

HEADLINE = "autocast"  # the column the gate is derived from


class DumpError(Exception):
    """The dump folder is unusable (exit 1)."""


class MappingError(DumpError):
    """transformers' model is not the problem the dump describes (exit 2, loudly)."""


# ---------------------------------------------------------------- safetensors, standard library only
_ST_TYPES = {"F32": ("f", 4), "I32": ("i", 4), "F64": ("d", 8), "I64": ("q", 8)}


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)} of a safetensors file (validated loosely)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise DumpError(f"{path}: too short for safetensors")
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        if info["dtype"] not in _ST_TYPES:
            raise DumpError(f"{path}: {name} has dtype {info['dtype']} (expected F32/I32)")
        numel = 1
        for d in info["shape"]:
            numel *= d
        if e - b != numel * _ST_TYPES[info["dtype"]][1] or e > len(data):
            raise DumpError(f"{path}: {name}: byte range does not match its shape")
        out[name] = (info["dtype"], list(info["shape"]), data[b:e])
    return out


def to_array(entry):
    dtype, _shape, raw = entry
    a = array(_ST_TYPES[dtype][0])
    a.frombytes(bytes(raw))
    if sys.byteorder != "little":
        a.byteswap()
    return a


# ---------------------------------------------------------------- the dump
class Dump:
    def __init__(self, folder):
        self.folder = folder
        with open(os.path.join(folder, "parity.json")) as f:
            self.meta = json.load(f)
        m = self.meta
        self.model, self.attention, self.seed = m["model"], m["attention"], int(m["seed"])
        self.device = m.get("device", "cuda")
        self.tensors = [(t["name"], list(t["hf"]), float(t["rel_l2"])) for t in m["tensors"]]
        self.hf_dir = os.path.join(folder, "hf")
        for need in ("config.json", "model.safetensors"):
            if not os.path.exists(os.path.join(self.hf_dir, need)):
                raise DumpError(f"{folder}: hf/{need} missing")
        self.weights = read_safetensors(os.path.join(self.hf_dir, "model.safetensors"))
        self.grads_ref = read_safetensors(os.path.join(folder, "grads_ref.safetensors"))
        self.grads_ours = read_safetensors(os.path.join(folder, "grads_ours.safetensors"))
        self.batch = read_safetensors(os.path.join(folder, "batch.safetensors"))
        names = set(self.weights)
        listed = [p for _, parts, _ in self.tensors for p in parts]
        if sorted(listed) != sorted(names):
            raise DumpError(f"{folder}: parity.json's Hugging Face parts {sorted(set(listed) ^ names)} do not "
                            "match hf/model.safetensors")
        for what, g in (("grads_ref", self.grads_ref), ("grads_ours", self.grads_ours)):
            for n in names:
                if n not in g or g[n][1] != self.weights[n][1]:
                    raise DumpError(f"{folder}: {what}.safetensors lacks {n} or has another shape")
        B, T = int(m["batch"]), int(m["seq"])
        for n in ("tokens", "targets"):
            if n not in self.batch or self.batch[n][0] != "I32" or self.batch[n][1] != [B, T]:
                raise DumpError(f"{folder}: batch.safetensors: {n} must be I32 [{B}, {T}]")

    @property
    def label(self):
        return f"{self.model}/{self.attention}/{self.device}/seed{self.seed}"


def per_tensor(tensors, sums):
    """rel L2 per tensor of ours from per-HF-part (sum (a-b)^2, sum b^2)."""
    out = []
    for name, parts, _ in tensors:
        num = sum(sums[p][0] for p in parts)
        den = sum(sums[p][1] for p in parts)
        out.append((name, math.inf if not math.isfinite(num) else math.sqrt(num / max(den, 1e-300))))
    return out


def sums_stdlib(got, ref):
    out = {}
    for n in ref:
        a, b = to_array(got[n]), to_array(ref[n])
        num = den = 0.0
        for x, y in zip(a, b):
            if not math.isfinite(x):
                num = math.inf
                break
            num += (x - y) * (x - y)
            den += y * y
        out[n] = (num, den)
    return out


def check_test_numbers(d, recomputed):
    """Our errors against the reference, recomputed from the files, must be the C++ test's."""
    bad = []
    for (name, _, stored), (_, got) in zip(d.tensors, recomputed):
        if not (abs(got - stored) <= 1e-9 * max(stored, 1e-30) + 1e-12 or (math.isinf(got) and math.isinf(stored))):
            bad.append(f"{name}: files give {got:.9e}, the test computed {stored:.9e}")
    return bad


def fmt(x):
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.2e}")


def load_dumps(root):
    folders = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "parity.json")))
    if not folders:
        raise DumpError(f"no dump folders (*/parity.json) under {root}: run the test with PRIMUS_PARITY_DUMP={root}")
    return [Dump(f) for f in folders]


# ---------------------------------------------------------------- --files-only
def files_only(dumps):
    bad = 0
    for d in dumps:
        rec = per_tensor(d.tensors, sums_stdlib(d.grads_ours, d.grads_ref))
        problems = check_test_numbers(d, rec)
        worst = max(e for _, e in rec)
        print(f"{d.label}: {len(d.weights)} Hugging Face tensors in {len(d.tensors)} of ours; loss ours "
              f"{d.meta['loss']:.6f} ref {d.meta['ref_loss']:.6f}; worst ours-vs-ref {fmt(worst)}"
              + ("" if not problems else "  MISMATCH"))
        for p in problems:
            print("   ", p)
        bad += len(problems)
    print("files OK" if not bad else f"FAILED: {bad} recomputed errors differ from the test's")
    return 1 if bad else 0


# ---------------------------------------------------------------- torch
def torch_main(dumps, args):
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        print(f"WARNING: running on {dev}: CPU autocast is not the GPU bf16 measurement the gate needs")
    # The fp32 baseline must be real fp32: no TF32 in cuBLAS/cuDNN.
    try:
        if not hasattr(torch.backends, "fp32_precision"):
            raise AttributeError("torch < 2.9")
        torch.backends.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, ValueError):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device_name}")

    def load(folder, attn_impl):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_impl,
                                                               output_loading_info=True)
        except (TypeError, ValueError, ImportError) as e:
            print(f"  (attn_implementation={attn_impl} refused: {e}; using the default)")
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        problems = {k: list(v) for k, v in info.items()
                    if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if problems:
            raise MappingError(f"{folder}: transformers loaded the weights with problems {problems}")
        model = model.to(device=dev, dtype=torch.float32)
        model.train()  # every dropout probability is 0 in these configs
        if model.config.tie_word_embeddings and model.get_output_embeddings().weight is not \
                model.get_input_embeddings().weight:
            raise MappingError(f"{folder}: the config ties the head to the embedding but the model does not")
        return model, getattr(model.config, "_attn_implementation", "?")

    def step(model, tokens, targets, autocast):
        model.zero_grad(set_to_none=True)
        ctx = torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=tokens, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is None:
                raise MappingError(f"{n}: no gradient")
            grads[n] = p.grad.detach().float()
        return loss.item(), grads

    def tensor_of(entry):
        dtype, shape, raw = entry
        t = torch.frombuffer(bytearray(raw), dtype=torch.float32 if dtype == "F32" else torch.int32)
        return t.reshape(shape).to(dev)

    def sums(got, ref):
        out = {}
        for n, r in ref.items():
            g = got[n]
            if tuple(g.shape) != tuple(r.shape):
                raise MappingError(f"{n}: shape {tuple(g.shape)} vs {tuple(r.shape)}")
            if not bool(torch.isfinite(g).all()):
                out[n] = (math.inf, 1.0)
                continue
            out[n] = (float((g.double() - r.double()).square().sum()), float(r.double().square().sum()))
        return out

    groups = {}
    for d in dumps:
        groups.setdefault((d.model, d.seed), []).append(d)
    mapping_bad = []
    test_bad = []
    summary = {}  # model -> column -> list of per-seed worst
    for (model_name, seed), ds in sorted(groups.items()):
        d0 = ds[0]
        for d in ds[1:]:
            if d.weights.keys() != d0.weights.keys() or any(bytes(d.weights[n][2]) != bytes(d0.weights[n][2])
                                                            for n in d0.weights):
                raise DumpError(f"{d.label} and {d0.label}: same model and seed but different weights")
        tokens = tensor_of(d0.batch["tokens"]).long()
        targets = tensor_of(d0.batch["targets"]).long()
        V = int(d0.meta["vocab_size"])
        if int(targets.max()) >= V or int(tokens.max()) >= V:
            raise DumpError(f"{d0.label}: token ids beyond the vocabulary")
        ref = {n: tensor_of(e) for n, e in d0.grads_ref.items()}

        cols = {}   # column -> {tensor of ours: err}
        losses = {}
        impls = {}
        model, impls["fp32"] = load(d0.hf_dir, "sdpa")
        losses["fp32"], g32 = step(model, tokens, targets, autocast=False)
        missing = set(g32) ^ set(ref)
        if missing:
            raise MappingError(f"{d0.label}: parameters of transformers' model and the dump differ: {sorted(missing)}")
        cols["ref~fp32"] = dict(per_tensor(d0.tensors, sums(ref, g32)))
        losses["autocast"], g = step(model, tokens, targets, autocast=True)
        impls["autocast"] = impls["fp32"]
        cols["autocast"] = dict(per_tensor(d0.tensors, sums(g, g32)))
        model_eager, impls["autocast-eager"] = load(d0.hf_dir, "eager")
        losses["autocast-eager"], g = step(model_eager, tokens, targets, autocast=True)
        cols["autocast-eager"] = dict(per_tensor(d0.tensors, sums(g, g32)))
        del model_eager
        model = model.to(torch.bfloat16)
        losses["bf16-weights"], g = step(model, tokens, targets, autocast=False)
        impls["bf16-weights"] = impls["fp32"]
        cols["bf16-weights"] = dict(per_tensor(d0.tensors, sums(g, g32)))
        del model
        for d in ds:
            ours = {n: tensor_of(e) for n, e in d.grads_ours.items()}
            tag = d.attention if d.device == "cuda" else f"{d.attention}-{d.device}"
            cols[f"ours[{tag}]"] = dict(per_tensor(d.tensors, sums(ours, g32)))
            rec = per_tensor(d.tensors, sums(ours, ref))
            cols[f"test[{tag}]"] = dict(rec)
            test_bad += [f"{d.label}: {p}" for p in check_test_numbers(d, rec)]

        ref_loss = float(d0.meta["ref_loss"])
        loss_rel = abs(losses["fp32"] - ref_loss) / ref_loss
        worst_map = max(cols["ref~fp32"].values())
        ok = worst_map <= args.mapping_tol and loss_rel <= args.loss_tol
        if not ok:
            mapping_bad.append(f"{model_name} seed {seed}: reference vs torch fp32 worst gradient {worst_map:.2e} "
                               f"(tolerance {args.mapping_tol:.0e}), loss {ref_loss:.7f} vs {losses['fp32']:.7f} "
                               f"(relative {loss_rel:.1e}, tolerance {args.loss_tol:.0e})")
        print(f"\n== {model_name}, seed {seed}: loss ref {ref_loss:.6f}, torch " +
              ", ".join(f"{k} {v:.6f}" for k, v in losses.items()) +
              ", ours " + ", ".join(f"{d.attention}/{d.device} {float(d.meta['loss']):.6f}" for d in ds) +
              f"; attention: {impls}" + ("" if ok else "   <-- MAPPING CHECK FAILED"))
        names = [n for n, _, _ in d0.tensors]
        header = list(cols)
        w = max(len(n) for n in names) + 2
        cw = {c: max(12, len(c) + 2) for c in header}
        print(f"  {'tensor':<{w}}" + "".join(f"{c:>{cw[c]}}" for c in header))
        for n in names:
            print(f"  {n:<{w}}" + "".join(f"{fmt(cols[c][n]):>{cw[c]}}" for c in header))
        print(f"  {'worst':<{w}}" + "".join(f"{fmt(max(cols[c].values())):>{cw[c]}}" for c in header))
        for c in header:
            summary.setdefault(model_name, {}).setdefault(c, []).append(max(cols[c].values()))

    print(f"\n==== bf16 noise floor: worst per-tensor gradient relative L2 against torch fp32 (ref~fp32: the "
          f"reference backend; test[...]: ours against the reference, the C++ test's number); worst over "
          f"tensors, per seed in brackets")
    result = {"date": datetime.date.today().isoformat(), "device": device_name, "torch": torch.__version__,
              "transformers": transformers.__version__, "margin": args.margin, "floor": args.floor,
              "rule": f"gate = max({args.floor:g}, {args.margin:g} x worst '{HEADLINE}')",
              "mapping_ok": not mapping_bad, "models": {}}
    for model_name, cols in summary.items():
        seeds = sorted(s for (m, s) in groups if m == model_name)
        print(f"  {model_name} (seeds {seeds}):")
        for c, per_seed in cols.items():
            print(f"    {c:<22}{fmt(max(per_seed)):>10}   [" + " ".join(fmt(x) for x in per_seed) + "]")
        worst = max(cols[HEADLINE])
        gate = max(args.floor, args.margin * worst)
        print(f"    -> gate = max({args.floor:g}, {args.margin:g} x {worst:.2e}) = {gate:.2e}")
        result["models"][model_name] = {"seeds": seeds, "worst": {c: max(v) for c, v in cols.items()},
                                        "per_seed_worst": cols, "gate": gate}
    for p in test_bad:
        print("TEST NUMBER MISMATCH:", p)
    line = json.dumps(result)
    print("NOISE_FLOOR " + line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    if mapping_bad:
        print("\n" + "!" * 100)
        print("MAPPING CHECK FAILED: the reference backend and transformers' fp32 model disagree, so the dumped weights, "
              "names, layouts or loss are not the same problem; the bf16 numbers above mean nothing:")
        for p in mapping_bad:
            print("  " + p)
        print("!" * 100)
        return 2
    return 1 if test_bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump_dir")
    ap.add_argument("--json", help="also write the summary (one JSON line) here")
    ap.add_argument("--device", help="torch device (default: cuda when available)")
    ap.add_argument("--margin", type=float, default=1.5)
    ap.add_argument("--floor", type=float, default=2e-2)
    ap.add_argument("--mapping-tol", type=float, default=1e-4,
                    help="largest per-tensor rel L2 of the reference against torch fp32 (expected ~1e-6)")
    ap.add_argument("--loss-tol", type=float, default=1e-5)
    ap.add_argument("--files-only", action="store_true", help="check the dumps without torch")
    args = ap.parse_args()
    try:
        try:
            dumps = load_dumps(args.dump_dir)
        except (OSError, KeyError, ValueError) as e:
            raise DumpError(f"unreadable dump under {args.dump_dir}: {type(e).__name__}: {e}") from e
        if args.files_only:
            return files_only(dumps)
        return torch_main(dumps, args)
    except MappingError as e:
        print("!" * 100 + f"\nMAPPING CHECK FAILED: {e}\n" + "!" * 100)
        return 2
    except DumpError as e:
        print(f"bf16_noise_floor: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
