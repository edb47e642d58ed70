#!/usr/bin/env bash
# Hugging Face import on the GPU machine (issue #40, item 1). Run from the repository root with
# $BIN (the built primus, on PATH and LD_LIBRARY_PATH) and $OUT set; about a minute.
#   1. python (torch + transformers) builds small random-weight models and saves them with
#      save_pretrained: Llama (untied, fp32), Llama (tied, fp32, sharded with max_shard_size),
#      Qwen2 (q/k/v biases, saved in bf16), Qwen3 (head_dim 64 over a width of 128, q/k norms),
#      Mistral (sliding_window 16 < seq 64). Weights are drawn wider than transformers' init
#      (std 0.1, norm weights 1 +- 0.1, biases +- 0.1) so the loss is far from log(vocab) and every
#      tensor matters. Reference losses: each folder reloaded by transformers in fp32 (eager
#      attention, CPU) on a fixed 64-byte text.
#   2. primus import hf FOLDER CKPT --tokenizer bytes, then `primus generate --checkpoint CKPT
#      --score` (reference backend, fp32) on the same bytes: |ours - transformers| <= 1e-5 * loss.
#   3. continued pretraining on the cuda backend (bf16): `train` with load_hf and no model preset
#      over a dataset of exactly one sample (the text's bytes + end-of-document = seq_length + 1
#      tokens, so every batch is that sample): the first step's loss equals transformers' on it
#      within bf16 tolerance (2e-2 relative), and after 30 steps the loss is lower.
# A family whose Primus keys are not in the build is skipped with SKIP and the reason (the
# importer's error). Writes $OUT/import.jsonl (one row per check) and prints a PASS/FAIL table last.
PART=import
# shellcheck source=bench/hf/common.sh
source bench/hf/common.sh

row() {  # case status metric ours ref detail
  ROWS+=("$(printf '%-26s %-5s %-18s ours %-12s ref %-12s %s' "$1" "$2" "$3" "$4" "$5" "$6")")
  printf '{"bench": "hf_import", "case": "%s", "status": "%s", "metric": "%s", "ours": %s, "ref": %s, "detail": "%s", "device": "%s", "date": "%s", "commit": "%s"}\n' \
    "$1" "$2" "$3" "${4:-null}" "${5:-null}" "$6" "$DEVICE" "$DATE" "$COMMIT" >> "$OUT/import.jsonl"
}

TEXT="the king speaks to the people and the queen waits for her lord.."  # 64 bytes
[ ${#TEXT} -eq 64 ] || { echo "text must be 64 bytes, is ${#TEXT}"; exit 2; }
printf '%s\n' "$TEXT" > "$W/one.txt"

python3 - "$W" "$TEXT" > "$W/make.log" 2>&1 <<'PY'
import json, os, sys
import torch
import transformers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

work, text = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
common = dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              rope_theta=10000.0, bos_token_id=0, eos_token_id=0, attention_dropout=0.0)
models = {
    "llama": (LlamaConfig, dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False), {}, torch.float32),
    "llama_tied_sharded": (LlamaConfig, dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                             num_key_value_heads=2, tie_word_embeddings=True),
                           {"max_shard_size": "300KB"}, torch.float32),
    "qwen2_bf16": (Qwen2Config, dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                     num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=False),
                   {}, torch.bfloat16),
    "qwen3": (Qwen3Config, dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                                use_sliding_window=False), {}, torch.float32),
    "mistral": (MistralConfig, dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                    num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False),
                {}, torch.float32),
}
score_ids = list(text.encode())          # what `generate --score` reads
sample_ids = score_ids + [0]             # the one training sample: the bytes and the end-of-document
ref = {"transformers": transformers.__version__, "torch": torch.__version__}
for name, (cls, kw, save_kw, dtype) in models.items():
    cfg = cls(**common, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    d = os.path.join(work, "hf", name)
    model.to(dtype).save_pretrained(d, **save_kw)
    files = sorted(os.listdir(d))
    try:  # transformers 5 names it dtype, 4 torch_dtype
        back = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    except TypeError:
        back = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        s = back(input_ids=torch.tensor([score_ids]), labels=torch.tensor([score_ids])).loss.item()
        t = back(input_ids=torch.tensor([sample_ids]), labels=torch.tensor([sample_ids])).loss.item()
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        b = back.to(dev, torch.bfloat16)
        tb = b(input_ids=torch.tensor([sample_ids], device=dev), labels=torch.tensor([sample_ids], device=dev)).loss.item()
    ref[name] = {"score_fp32": s, "sample_fp32": t, "sample_bf16": tb, "files": files}
    print(name, ref[name], flush=True)
json.dump(ref, open(os.path.join(work, "ref.json"), "w"), indent=1)
PY
rc=$?
tail -8 "$W/make.log"
cp "$W/make.log" "$OUT/make.log"
if [ $rc -ne 0 ]; then
  row make_models FAIL python "" "" "see make.log"
  printf '%s\n' "${ROWS[@]}"
  exit 1
fi
primus data prepare --input "$W/one.txt" --tokenizer bytes --output-prefix "$W/one" --quiet > "$W/prepare.log" 2>&1

ref() { python3 -c "import json,sys; print(json.load(open('$W/ref.json'))['$1']['$2'])"; }
# within A B REL: |A - B| <= REL * |B|
within() { python3 -c "import sys; a,b,r=map(float,sys.argv[1:]); sys.exit(0 if abs(a-b) <= r*abs(b) else 1)" "$1" "$2" "$3"; }

for name in llama llama_tied_sharded qwen2_bf16 qwen3 mistral; do
  hf="$W/hf/$name"
  ck="$W/ck/$name"
  if ! primus import hf "$hf" "$ck" --tokenizer bytes --seq-length 64 > "$W/import-$name.log" 2>&1; then
    cp "$W/import-$name.log" "$OUT/"
    why=$(grep -o "is not supported by this build: .*" "$W/import-$name.log" | head -1 | tr '"' "'")
    if [ -n "$why" ]; then
      row "$name" SKIP import "" "" "$why"
    else
      row "$name" FAIL import "" "" "$(tail -1 "$W/import-$name.log" | tr '"' "'" | cut -c1-200)"
    fi
    continue
  fi
  row "$name" PASS import "" "" "$(ref "$name" files | tr "'" ' ' | cut -c1-120)"

  # fp32: the reference backend's score of the text against transformers' fp32 loss.
  ours=$(primus generate --checkpoint "$ck" --score --prompt "$TEXT" 2> "$W/score-$name.log" | tail -1)
  want=$(ref "$name" score_fp32)
  if [ -n "$ours" ] && within "$ours" "$want" 1e-5; then st=PASS; else st=FAIL; fi
  row "$name" "$st" "fp32_loss_rel1e-5" "${ours:-null}" "$want" "primus generate --score (reference, fp32)"

  # bf16: continued pretraining on the cuda backend from load_hf.
  cat > "$W/$name.yaml" <<EOF
work_group: local
user_name: local
exp_name: $name
workspace: $W/ws
modules:
  pre_trainer:
    framework: ${FRAMEWORK:-cuda}
    config: pretrain.yaml
    overrides:
      load_hf: $hf
      tokenizer_type: bytes
      seq_length: 64
      data_path: [$W/one]
      split: 1.0
      micro_batch_size: 1
      global_batch_size: 1
      train_iters: 30
      lr: 1.0e-3
      min_lr: 1.0e-4
      lr_warmup_iters: 0
      weight_decay: 0.0
      eval_interval: 0
      log_interval: 1
      save_at_end: false
      save_interval: 0
      sample_tokens: 0
EOF
  primus train pretrain --config "$W/$name.yaml" > "$W/train-$name.log" 2>&1
  trc=$?
  cp "$W/train-$name.log" "$OUT/"
  m="$W/ws/local/local/$name/metrics.jsonl"
  if [ $trc -ne 0 ] || [ ! -f "$m" ]; then
    row "$name" FAIL cuda_train "" "" "rc=$trc, see train-$name.log"
    continue
  fi
  read -r first last < <(python3 -c "
import json
l=[json.loads(x)['loss'] for x in open('$m') if 'loss' in json.loads(x)]
print(l[0], l[-1])")
  want=$(ref "$name" sample_fp32)
  if within "$first" "$want" 2e-2; then st=PASS; else st=FAIL; fi
  row "$name" "$st" "cuda_step1_rel2e-2" "$first" "$want" "transformers bf16: $(ref "$name" sample_bf16)"
  if python3 -c "import sys; sys.exit(0 if $last < $first - 0.1 else 1)"; then st=PASS; else st=FAIL; fi
  row "$name" "$st" "cuda_loss_decreases" "$last" "$first" "loss after 30 steps vs step 1"
done

echo
echo "hf import (commit $COMMIT, $DEVICE)"
printf '%s\n' "${ROWS[@]}"
! printf '%s\n' "${ROWS[@]}" | grep -q " FAIL "
