#!/usr/bin/env python3
"""Outside oracle for the families of issue #40 item 2 (`primus export hf`): transformers'
Qwen2ForCausalLM (q/k/v-only biases), OlmoeForCausalLM (q/k RMSNorms over the whole projection,
softmax over all experts then top-k without renormalising) and MistralForCausalLM (sliding
window shorter than the sequence), loaded from Primus' exported folders, must compute what
Primus computes.

For each family it trains a tiny byte-level model with the reference backend on the CPU (so the
biases, the norm weights and every projection have moved from their init), then:
  1. tests/reference/hf_parity.py on the checkpoint: the folder loads with no missing, unexpected
     or mismatched weights as the family's class; greedy text equals
     `primus generate --temperature 0 --backend reference`; the loss over a text equals Primus'
     `generate --score` within 1e-4 (fp32 export) and 2e-2 (bf16 export);
  2. the feature is live: the loss transformers computes over random byte sequences changes when
     the family's own tensors are reset (Qwen2: q/k/v biases to zero; OLMoE: q/k norm weights to
     ones, which are hidden_size and kv_dim wide), or for Mistral when the window is lifted;
  3. with --cuda: `primus generate --backend cuda` (bf16, KV cache) greedy from the same prompt,
     against transformers' fp32 greedy: the number of leading bytes that agree (a report; bf16
     may part at a near-tie). MoE models are skipped there (the engine refuses them).
With --framework cuda the tiny models are trained by the cuda backend instead (bf16 compute, fp32
master weights in the checkpoint), so the export of both backends' checkpoints is covered.
Usage: families_hf_parity.py PRIMUS_BIN WORKDIR [--cuda] [--framework reference|cuda]
                             [--families qwen2,olmoe,mistral]
Prints one JSON line per family and exits non-zero on a mismatch of 1. or 2.
"""
import json, os, subprocess, sys
import torch
from transformers import AutoModelForCausalLM

args = sys.argv[1:]
primus, work = args[0], args[1]
use_cuda = "--cuda" in args
families = "qwen2,olmoe,mistral"
if "--families" in args:
    families = args[args.index("--families") + 1]
framework = args[args.index("--framework") + 1] if "--framework" in args else "reference"
here = os.path.dirname(os.path.abspath(__file__))
hf_parity = os.path.join(here, "..", "..", "tests", "reference", "hf_parity.py")
os.makedirs(work, exist_ok=True)

# name: (model preset, transformers class, overrides)
FAMILIES = {
    "qwen2": ("qwen2/tiny.yaml", "Qwen2ForCausalLM", {}),
    "olmoe": ("moe/olmoe-tiny.yaml", "OlmoeForCausalLM", {"moe_aux_loss_coeff": 0.001}),
    "mistral": ("mistral/tiny.yaml", "MistralForCausalLM", {"sliding_window": 16}),
}


def make_corpus():
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
    name = f"{name}-{framework}"
    ws = os.path.join(work, name)
    overrides = {"tokenizer_type": "bytes", "vocab_size": 256, "seq_length": 128, "train_iters": 40,
                 "micro_batch_size": 8, "global_batch_size": 8, "lr": 3.0e-3, "min_lr": 3.0e-4,
                 "lr_warmup_iters": 5, "log_interval": 20, "eval_interval": 0, "save_interval": 40,
                 "sample_tokens": 0, "data_path": [corpus], "split": 0.95}
    overrides.update(extra)
    body = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in overrides.items())
    exp = os.path.join(work, f"{name}.yaml")
    with open(exp, "w") as f:
        f.write(f"workspace: {ws}\nexp_name: {name}\nmodules:\n  pre_trainer:\n    framework: {framework}\n"
                f"    config: pretrain.yaml\n    model: {preset}\n    overrides:\n{body}")
    subprocess.run([primus, "train", "pretrain", "--config", exp], check=True, capture_output=True)
    for root, dirs, _ in os.walk(ws):
        if "checkpoints" in dirs:
            return os.path.join(root, "checkpoints")
    raise RuntimeError(f"{name}: no checkpoints under {ws}")


def batch_loss(model, x):
    with torch.no_grad():
        return model(x, labels=x).loss.item()


ok = True
for name in families.split(","):
    preset, cls, extra = FAMILIES[name]
    out = {"family": name, "trained_by": framework}
    ckpt = train(name, preset, extra)
    r = subprocess.run([sys.executable, hf_parity, primus, ckpt, os.path.join(work, f"hf-{name}-{framework}")],
                       capture_output=True, text=True)
    out["hf_parity"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else r.stderr[-800:]
    fam_ok = r.returncode == 0
    d = os.path.join(work, f"hf-{name}-{framework}", "fp32")  # hf_parity.py's fp32 export
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    out["class"] = type(model).__name__
    fam_ok = fam_ok and out["class"] == cls
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 128), generator=g)
    base = batch_loss(model, x)
    out["batch_loss"] = base
    if name == "qwen2":
        live = [p for n, p in model.named_parameters() if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        others = [n for n, _ in model.named_parameters() if n.endswith(".bias") and not n.endswith(
            ("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        out["qkv_biases"], out["other_biases"] = len(live), len(others)
        fam_ok = fam_ok and len(live) == 3 * cfg.num_hidden_layers and not others
        with torch.no_grad():
            for p in live:
                p.zero_()
    elif name == "olmoe":
        live = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
        widths = sorted({p.numel() for p in live})
        kv_dim = cfg.hidden_size // cfg.num_attention_heads * cfg.num_key_value_heads
        out["qk_norms"], out["qk_norm_widths"] = len(live), widths
        fam_ok = fam_ok and len(live) == 2 * cfg.num_hidden_layers and widths == sorted({cfg.hidden_size, kv_dim})
        with torch.no_grad():
            for p in live:
                p.fill_(1.0)
    else:  # mistral: the window must be shorter than the batch, and lifting it must change the loss
        out["sliding_window"] = cfg.sliding_window
        fam_ok = fam_ok and cfg.sliding_window == 16
        model.config.sliding_window = None
        model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, sliding_window=None).eval()
    reset = batch_loss(model, x)
    out["batch_loss_feature_off"] = reset
    fam_ok = fam_ok and abs(base - reset) > 1e-6
    if use_cuda and name != "olmoe":
        prompt, n = "ROMEO:", 60
        hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        hf_text = bytes(gen[0].tolist()).decode("utf-8", "replace")
        c = subprocess.run([primus, "generate", "-c", ckpt, "-p", prompt, "-n", str(n), "-t", "0", "--backend", "cuda",
                            "--ignore-eod"], capture_output=True, text=True)
        ours = c.stdout.rstrip("\n")
        agree = 0
        while agree < min(len(ours), len(hf_text)) and ours[agree] == hf_text[agree]:
            agree += 1
        out["cuda_greedy_rc"], out["cuda_greedy_agree_chars"], out["cuda_greedy_chars"] = c.returncode, agree, len(hf_text)
        if agree < len(hf_text):
            out["cuda_text"], out["hf_text"] = ours, hf_text
    out["ok"] = fam_ok
    ok = ok and fam_ok
    print(json.dumps(out), flush=True)
sys.exit(0 if ok else 1)
