#!/usr/bin/env python3
"""Outside oracle for the Qwen3 families of `primus export hf`: transformers' Qwen3ForCausalLM
and Qwen3MoeForCausalLM, loaded from Primus' exported folders, must compute what Primus computes.

For each family it trains a tiny byte-level model with the reference backend on the CPU (a head
dimension of 24 over a width of 64, query/key norms; the MoE one with 8 experts top-2 in every
layer), so the norm weights and every projection have moved from their init, then:
  1. hf_parity.py on the checkpoint: the folder loads with no missing or unexpected weights,
     greedy text equals `primus generate --temperature 0`, and the loss over a text equals
     Primus' `generate --score` within 1e-4 (fp32 export) and 2e-2 (bf16 export);
  2. the exported class is the one the family names, and the loss transformers computes over a
     batch of random byte sequences equals the loss the same folder gives with the query/key
     norms' weights kept (a check that the norms are live: set to ones, the loss must change).
Usage: qwen3_hf_parity.py PRIMUS_BIN WORKDIR [TEXT_FILE]
(without TEXT_FILE: a generated text of short sentences, learnable enough to move every weight)
Prints one JSON line per family and exits non-zero on a mismatch. Needs torch and transformers
(the GPU machine; CPU is enough).
"""
import json, os, subprocess, sys
import torch
from transformers import AutoModelForCausalLM

primus, work = sys.argv[1], sys.argv[2]
text_file = sys.argv[3] if len(sys.argv) > 3 else None
here = os.path.dirname(os.path.abspath(__file__))
os.makedirs(work, exist_ok=True)

FAMILIES = {
    "qwen3": ("qwen3/tiny.yaml", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("qwen3/tiny.yaml", "Qwen3MoeForCausalLM",
                  {"model_type": "qwen3_moe", "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64,
                   "moe_aux_loss_coeff": 0.001}),
}


def make_corpus():
    if text_file:
        return os.path.abspath(text_file)
    import random
    rng = random.Random(0)
    who = ["the king", "a citizen", "my lord", "the queen", "his friend", "our army"]
    verb = ["speaks to", "waits for", "fights", "loves", "forgets", "follows"]
    what = ["the people", "his sword", "the crown", "her brother", "the night", "Rome"]
    lines = [f"{rng.choice(who).capitalize()} {rng.choice(verb)} {rng.choice(what)}." for _ in range(4000)]
    path = os.path.join(work, "corpus.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


corpus = make_corpus()


def train(name, preset, extra):
    ws = os.path.join(work, name)
    overrides = {"tokenizer_type": "bytes", "vocab_size": 256, "seq_length": 64, "train_iters": 100,
                 "micro_batch_size": 8, "global_batch_size": 8, "lr": 3.0e-3, "min_lr": 3.0e-4,
                 "lr_warmup_iters": 5, "log_interval": 20, "eval_interval": 0, "save_interval": 100,
                 "sample_tokens": 0, "data_path": [corpus], "split": 0.95}
    overrides.update(extra)
    body = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in overrides.items())
    exp = os.path.join(work, f"{name}.yaml")
    with open(exp, "w") as f:
        f.write(f"workspace: {ws}\nexp_name: {name}\nmodules:\n  pre_trainer:\n    framework: reference\n"
                f"    config: pretrain.yaml\n    model: {preset}\n    overrides:\n{body}")
    subprocess.run([primus, "train", "pretrain", "--config", exp], check=True, capture_output=True)
    for root, dirs, _ in os.walk(ws):
        if "checkpoints" in dirs:
            return os.path.join(root, "checkpoints")
    raise RuntimeError(f"{name}: no checkpoints under {ws}")


ok = True
for name, (preset, cls, extra) in FAMILIES.items():
    out = {"family": name}
    ckpt = train(name, preset, extra)
    r = subprocess.run([sys.executable, os.path.join(here, "hf_parity.py"), primus, ckpt, os.path.join(work, "hf-" + name)],
                       capture_output=True, text=True)
    out["hf_parity"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else r.stderr[-500:]
    fam_ok = r.returncode == 0
    d = os.path.join(work, "hf-" + name, "fp32")  # hf_parity.py's fp32 export
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    out["class"] = type(model).__name__
    fam_ok = fam_ok and out["class"] == cls
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 64), generator=g)
    with torch.no_grad():
        loss = model(x, labels=x).loss.item()
        norms = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
        out["qk_norms"] = len(norms)
        for p in norms:
            p.fill_(1.0)
        loss_ones = model(x, labels=x).loss.item()
    out["batch_loss"], out["batch_loss_norms_reset"] = loss, loss_ones
    # 2 layers x (q, k); the trained weights must matter to the loss, or the check above proved nothing.
    fam_ok = fam_ok and len(norms) == 4 and abs(loss - loss_ones) > 1e-6
    out["ok"] = fam_ok
    ok = ok and fam_ok
    print(json.dumps(out))
sys.exit(0 if ok else 1)
