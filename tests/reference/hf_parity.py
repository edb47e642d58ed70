#!/usr/bin/env python3
"""Outside oracle for `primus export hf`: Hugging Face transformers loads the exported folder and
must agree with Primus' own CPU model on the same checkpoint.

Checks (byte-level tokenizer checkpoints, as the examples train):
  1. the folder loads as GPT2LMHeadModel / LlamaForCausalLM with no missing or unexpected weights;
  2. greedy generation from a prompt gives the same bytes as `primus generate --temperature 0`;
  3. the mean next-token loss over a text: transformers on the fp32 export equals Primus' own fp32
     model (`primus generate --score`) within 1e-4 relative, and transformers on the bf16 export
     within 2e-2 (bf16 weights).
Usage: hf_parity.py PRIMUS_BIN CHECKPOINT_DIR WORKDIR
Prints one JSON line per checkpoint and exits non-zero on a mismatch.
"""
import json, os, subprocess, sys
import torch
from transformers import AutoModelForCausalLM

primus, ckpt, work = sys.argv[1], sys.argv[2], sys.argv[3]
prompt, n = "ROMEO:", 60
ok = True
out = {}
for dtype in ("fp32", "bf16"):
    d = os.path.join(work, dtype)
    subprocess.run([primus, "export", "hf", ckpt, d, "--dtype", dtype], check=True, capture_output=True)
    model, info = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    out[dtype + "_class"] = type(model).__name__
    if bad:
        ok = False
        out[dtype + "_loading"] = {k: list(v)[:5] for k, v in bad.items()}
    model.eval()
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        if dtype == "fp32":
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
            hf_text = bytes(gen[0].tolist()).decode("utf-8", "replace").replace("\0", "\n")
            # The fp32 reference model (the default on a GPU machine is the bf16 cuda engine), not
            # stopping at end-of-text, as transformers here (eos_token_id=None).
            ours = subprocess.run([primus, "generate", "-c", ckpt, "-p", prompt, "-n", str(n), "-t", "0",
                                   "--backend", "reference", "--ignore-eod"],
                                  check=True, capture_output=True, text=True).stdout.rstrip("\n")
            out["greedy_match"] = hf_text == ours
            if hf_text != ours:
                ok = False
                out["hf_text"], out["primus_text"] = hf_text, ours
        text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
        x = torch.tensor([list(text)])
        loss = model(x, labels=x).loss.item()
        out[dtype + "_loss"] = loss
primus_loss = float(subprocess.run([primus, "generate", "-c", ckpt, "--score", "-p", text.decode()],
                                   check=True, capture_output=True, text=True).stdout.split()[-1])
out["primus_loss"] = primus_loss
out["fp32_vs_primus_rel"] = abs(out["fp32_loss"] - primus_loss) / primus_loss
out["bf16_vs_primus_rel"] = abs(out["bf16_loss"] - primus_loss) / primus_loss
out["bf16_vs_fp32_rel"] = abs(out["bf16_loss"] - out["fp32_loss"]) / out["fp32_loss"]
ok = ok and out["fp32_vs_primus_rel"] < 1e-4 and out["bf16_vs_primus_rel"] < 2e-2
out["checkpoint"], out["ok"] = ckpt, ok
print(json.dumps(out))
sys.exit(0 if ok else 1)
