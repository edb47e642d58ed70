#!/usr/bin/env python3
"""Outside oracle for Primus' sliding-window attention: transformers' MistralForCausalLM, loaded
from `primus export hf` of a tiny Mistral trained with a window shorter than its sequence, must
compute what Primus computes.

1. A tiny byte-level Mistral (llama/tiny.yaml with model_type: mistral, sliding_window 16,
   seq_length 128) trains 100 steps on the reference backend (CPU), so every weight has moved.
2. tests/reference/hf_parity.py on its checkpoint: the folder loads with no missing or unexpected
   weights, greedy text equals `primus generate --temperature 0`, the loss over a text equals
   Primus' `generate --score` within 1e-4 (fp32) and 2e-2 (bf16).
3. The window is live: config.json says sliding_window 16, and transformers' loss over a batch of
   random 128-byte sequences changes when its config's window is removed (else 2. would not
   exercise it).
Usage: mistral_window_parity.py PRIMUS_BIN WORKDIR
Prints one JSON line and exits non-zero on a mismatch. Needs torch and transformers.
"""
import json, os, random, subprocess, sys
import torch
from transformers import AutoModelForCausalLM

primus, work = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
os.makedirs(work, exist_ok=True)
WINDOW = 16

rng = random.Random(0)
who = ["the king", "a citizen", "my lord", "the queen", "his friend", "our army"]
verb = ["speaks to", "waits for", "fights", "loves", "forgets", "follows"]
what = ["the people", "his sword", "the crown", "her brother", "the night", "Rome"]
corpus = os.path.join(work, "corpus.txt")
with open(corpus, "w") as f:
    f.write("\n".join(f"{rng.choice(who).capitalize()} {rng.choice(verb)} {rng.choice(what)}." for _ in range(4000)) + "\n")

ws = os.path.join(work, "mistral")
overrides = {"model_type": "mistral", "sliding_window": WINDOW, "tokenizer_type": "bytes", "vocab_size": 256,
             "seq_length": 128, "train_iters": 100, "micro_batch_size": 8, "global_batch_size": 8, "lr": 3.0e-3,
             "min_lr": 3.0e-4, "lr_warmup_iters": 5, "log_interval": 20, "eval_interval": 0, "save_interval": 100,
             "sample_tokens": 0, "data_path": [corpus], "split": 0.95}
body = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in overrides.items())
exp = os.path.join(work, "mistral.yaml")
with open(exp, "w") as f:
    f.write(f"workspace: {ws}\nexp_name: mistral\nmodules:\n  pre_trainer:\n    framework: reference\n"
            f"    config: pretrain.yaml\n    model: llama/tiny.yaml\n    overrides:\n{body}")
subprocess.run([primus, "train", "pretrain", "--config", exp], check=True, capture_output=True, cwd=root)
ckpt = next(os.path.join(r, "checkpoints") for r, d, _ in os.walk(ws) if "checkpoints" in d)

out = {"case": f"mistral_window{WINDOW}_t128"}
r = subprocess.run([sys.executable, os.path.join(root, "tests/reference/hf_parity.py"), primus, ckpt,
                    os.path.join(work, "hf")], capture_output=True, text=True)
out["hf_parity"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else r.stderr[-500:]
ok = r.returncode == 0
d = os.path.join(work, "hf", "fp32")
cfg = json.load(open(os.path.join(d, "config.json")))
out["config_sliding_window"] = cfg.get("sliding_window")
ok = ok and cfg.get("architectures") == ["MistralForCausalLM"] and cfg.get("sliding_window") == WINDOW
x = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    m = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    loss_w = m(x, labels=x).loss.item()
    m_full = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, sliding_window=None).eval()
    loss_full = m_full(x, labels=x).loss.item()
out["batch_loss_window"], out["batch_loss_no_window"] = loss_w, loss_full
ok = ok and abs(loss_w - loss_full) > 1e-5
out["ok"] = ok
print(json.dumps(out))
sys.exit(0 if ok else 1)
