#!/usr/bin/env python3
"""Checks Primus' Hugging Face exports with the reference libraries: every safetensors file
opens with `safetensors` (which validates the format), sharded and single exports hold the same
values, and `transformers` loads each folder with no missing or unexpected weights and runs it.

    python3 tests/io/hf_check.py build/tests/io/hf_sample

The sample is written by the test HfExport.WritesSampleForTransformersCheck (test_io): folders
f32/, bf16/ and bf16_sharded/ holding the same tiny Llama. Needs torch, safetensors and
transformers (present on the GPU machine, not in the build image). Exits 1 on any failure.
"""
import glob
import os
import sys

import torch
from safetensors import safe_open


def tensors_of(folder):
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            assert f.metadata().get("format") == "pt", f"{path}: no format=pt metadata"
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def main():
    root = sys.argv[1]
    f32 = tensors_of(os.path.join(root, "f32"))
    bf16 = tensors_of(os.path.join(root, "bf16"))
    sharded = tensors_of(os.path.join(root, "bf16_sharded"))
    print(f"safetensors: {len(f32)} tensors; dtypes f32={f32['lm_head.weight'].dtype}, "
          f"bf16={bf16['lm_head.weight'].dtype}")
    bad = 0
    for name, t in f32.items():
        if t.dtype != torch.float32 or bf16[name].dtype != torch.bfloat16:
            print(f"WRONG DTYPE {name}")
            bad += 1
        # torch's own fp32->bf16 cast rounds to nearest even, as Primus must.
        if not torch.equal(t.to(torch.bfloat16), bf16[name]):
            print(f"BF16 ROUNDING DIFFERS {name}")
            bad += 1
        if not torch.equal(bf16[name], sharded[name]):
            print(f"SHARDED DIFFERS {name}")
            bad += 1

    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: skipped the model load")
        return 1 if bad else 0
    for sub in ("f32", "bf16", "bf16_sharded"):
        model, info = AutoModelForCausalLM.from_pretrained(os.path.join(root, sub),
                                                           output_loading_info=True)
        # Lists in older transformers, sets in newer ones.
        missing = [k for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
                   for k in info.get(key, [])]
        if missing:
            print(f"{sub}: loading problems {missing}")
            bad += 1
        sd = model.state_dict()
        for name, t in f32.items():
            want = t if sub == "f32" else bf16[name]
            if not torch.equal(sd[name].to(want.dtype).cpu(), want):
                print(f"{sub}: {name} loaded differently")
                bad += 1
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 3]])).logits
        print(f"{sub}: transformers loaded {type(model).__name__} ({model.dtype}), "
              f"logits {tuple(logits.shape)}, finite={bool(torch.isfinite(logits).all())}")
        bad += not bool(torch.isfinite(logits).all())
    print("OK" if bad == 0 else f"FAILED: {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
