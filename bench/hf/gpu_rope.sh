#!/usr/bin/env bash
# Llama-3.1/3.2 RoPE frequency scaling (rope_scaling {rope_type: llama3}) against transformers, on
# the GPU machine (issue #40: continued pretraining of Llama-3.2-1B). Run from the repository
# root with $BIN (the built primus, on PATH and LD_LIBRARY_PATH) and $OUT set; about a minute.
#   1. python (torch + transformers) builds a tiny LlamaForCausalLM (2 layers, hidden 128, 2 heads
#      of 64, 1 kv head, vocab 512) with random weights (std 0.1; q and k projections 0.3, so the
#      attention is peaked and position-dependent; norm weights 1 +- 0.1) and
#      rope_scaling llama3 {factor 16, low 1, high 4, original_max_position_embeddings 32}: the
#      256-token text is 8x the original context, so most pairs' frequencies are divided or
#      blended. save_pretrained twice with the same weights: "scaled", and "plain" without the
#      scaling. transformers 5 spells it rope_parameters, 4 rope_scaling; the script writes the
#      installed version's spelling (Primus reads both). Reference losses: each folder reloaded by
#      transformers in fp32 (eager attention, CPU) on the text's bytes.
#   2. primus import hf FOLDER CKPT --tokenizer bytes --seq-length 256, then `primus generate
#      --checkpoint CKPT --score` (reference backend, fp32): |ours - transformers| <= 1e-5 * loss
#      for both folders, and the scaled loss differs from the plain one by more than 100x that
#      (the scaling is live).
#   3. primus export hf of the imported scaled checkpoint: transformers loads it (rope_scaling as
#      written by Primus) and gives the same fp32 loss (1e-5).
#   4. The cuda backend (bf16, the scaled cos/sin table): `train` with load_hf of the scaled folder
#      over a dataset of exactly one sample (the text + end-of-document = 257 tokens): the first
#      step's loss equals transformers' on it within 2e-2 (bf16), and 20 steps lower it.
# Step 0 runs the GPU gtests of the scaling (test_cuda_gpu). Writes $OUT/rope.jsonl (one row per
# check) and prints a PASS/FAIL table last.
PART=rope
# shellcheck source=bench/hf/common.sh
source bench/hf/common.sh

row() {  # case status metric ours ref detail
  ROWS+=("$(printf '%-16s %-5s %-24s ours %-12s ref %-12s %s' "$1" "$2" "$3" "$4" "$5" "$6")")
  printf '{"bench": "hf_rope_scaling", "case": "%s", "status": "%s", "metric": "%s", "ours": %s, "ref": %s, "detail": "%s", "device": "%s", "date": "%s", "commit": "%s"}\n' \
    "$1" "$2" "$3" "${4:-null}" "${5:-null}" "$6" "$DEVICE" "$DATE" "$COMMIT" >> "$OUT/rope.jsonl"
}
finish() {
  echo
  echo "rope scaling (commit $COMMIT, $DEVICE)"
  printf '%s\n' "${ROWS[@]}"
  ! printf '%s\n' "${ROWS[@]}" | grep -q " FAIL "
  exit $?
}

# 0. The GPU gtests: the cuda model's scaled cos/sin table against the reference (step-0 loss and
#    every gradient, bf16 gates) and the inference engine's llama3_rope_scaling family.
"$BIN/test_cuda_gpu" --gtest_filter='RopeScalingGpuTest.*:Families/GenerateTest.*llama3_rope_scaling' \
  > "$W/gtest.log" 2>&1
grc=$?
cp "$W/gtest.log" "$OUT/"
if [ $grc -eq 0 ] && grep -q "PASSED  \] 4 tests" "$W/gtest.log" && ! grep -q "SKIPPED \]" "$W/gtest.log"; then st=PASS; else st=FAIL; fi
row gtests "$st" "test_cuda_gpu_4_tests" "" "" "$(grep -o 'rope scaling, gpu.*' "$W/gtest.log" | head -1 | tr '"' "'")"

BASE="the king speaks to the people and the queen waits for her lord.."  # 64 bytes
TEXT="$BASE$BASE$BASE$BASE"                                               # 256 bytes
[ ${#TEXT} -eq 256 ] || { echo "text must be 256 bytes, is ${#TEXT}"; exit 2; }
printf '%s\n' "$TEXT" > "$W/one.txt"

python3 - "$W" "$TEXT" > "$W/make.log" 2>&1 <<'PY'
import json, os, sys
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

work, text = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
major = int(transformers.__version__.split(".")[0])
common = dict(vocab_size=512, num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=0, attention_dropout=0.0, tie_word_embeddings=False)
def config(scaled):
    if major >= 5:
        rp = dict(scaling) if scaled else {"rope_type": "default"}
        rp["rope_theta"] = 10000.0
        return LlamaConfig(**common, rope_parameters=rp)
    return LlamaConfig(**common, rope_theta=10000.0, rope_scaling=dict(scaling) if scaled else None)

def load(d):
    try:  # transformers 5 names it dtype, 4 torch_dtype
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    except TypeError:
        return AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()

model = AutoModelForCausalLM.from_config(config(True), attn_implementation="eager").float()
with torch.no_grad():
    for n, p in model.named_parameters():
        if n.endswith(("q_proj.weight", "k_proj.weight")):
            p.normal_(0.0, 0.3)  # peaked attention: which keys a query picks depends on the rotation
        elif p.dim() >= 2:
            p.normal_(0.0, 0.1)
        else:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
weights = {n: p.detach().clone() for n, p in model.named_parameters()}  # parameters only: no rotary buffers
score_ids = list(text.encode())   # what `generate --score` reads
sample_ids = score_ids + [0]      # the one training sample: the bytes and the end-of-document
ref = {"transformers": transformers.__version__, "torch": torch.__version__}
for name, scaled in (("scaled", True), ("plain", False)):
    m = AutoModelForCausalLM.from_config(config(scaled), attn_implementation="eager").float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(weights[n])
    d = os.path.join(work, "hf", name)
    m.save_pretrained(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    back = load(d)
    with torch.no_grad():
        s = back(input_ids=torch.tensor([score_ids]), labels=torch.tensor([score_ids])).loss.item()
        t = back(input_ids=torch.tensor([sample_ids]), labels=torch.tensor([sample_ids])).loss.item()
    ref[name] = {"score_fp32": s, "sample_fp32": t,
                 "rope": cfg.get("rope_scaling") or cfg.get("rope_parameters")}
    print(name, ref[name], flush=True)
json.dump(ref, open(os.path.join(work, "ref.json"), "w"), indent=1)
PY
rc=$?
tail -4 "$W/make.log"
cp "$W/make.log" "$OUT/make.log"
if [ $rc -ne 0 ]; then
  row make_models FAIL python "" "" "see make.log"
  finish
fi
primus data prepare --input "$W/one.txt" --tokenizer bytes --output-prefix "$W/one" --quiet > "$W/prepare.log" 2>&1

ref() { python3 -c "import json,sys; print(json.load(open('$W/ref.json'))['$1']['$2'])"; }
# within A B REL: |A - B| <= REL * |B|
within() { python3 -c "import sys; a,b,r=map(float,sys.argv[1:]); sys.exit(0 if abs(a-b) <= r*abs(b) else 1)" "$1" "$2" "$3"; }

declare -A OURS
for name in scaled plain; do
  ck="$W/ck/$name"
  if ! primus import hf "$W/hf/$name" "$ck" --tokenizer bytes --seq-length 256 > "$W/import-$name.log" 2>&1; then
    cp "$W/import-$name.log" "$OUT/"
    row "$name" FAIL import "" "" "$(tail -1 "$W/import-$name.log" | tr '"' "'" | cut -c1-200)"
    continue
  fi
  row "$name" PASS import "" "" "$(ref "$name" rope | tr "'" ' ' | cut -c1-150)"
  ours=$(primus generate --checkpoint "$ck" --score --prompt "$TEXT" 2> "$W/score-$name.log" | tail -1)
  OURS[$name]=$ours
  want=$(ref "$name" score_fp32)
  if [ -n "$ours" ] && within "$ours" "$want" 1e-5; then st=PASS; else st=FAIL; fi
  row "$name" "$st" "fp32_loss_rel1e-5" "${ours:-null}" "$want" "primus generate --score (reference, fp32)"
done

# The scaling is live: the two folders hold the same weights, only the rotation differs.
s=${OURS[scaled]:-} p=${OURS[plain]:-}
if [ -n "$s" ] && [ -n "$p" ] && ! within "$s" "$p" 1e-3; then st=PASS; else st=FAIL; fi
row scaling_live "$st" "scaled_vs_plain_gt1e-3" "${s:-null}" "${p:-null}" "same weights, rope_scaling on vs off"

# Export: transformers reads Primus' rope_scaling and computes the same loss.
if primus export hf "$W/ck/scaled" "$W/export" --dtype fp32 > "$W/export.log" 2>&1; then
  python3 - "$W" "$TEXT" > "$W/export-check.log" 2>&1 <<'PY'
import json, sys, torch
from transformers import AutoModelForCausalLM
w, text = sys.argv[1], sys.argv[2]
try:
    m = AutoModelForCausalLM.from_pretrained(f"{w}/export", dtype=torch.float32, attn_implementation="eager").eval()
except TypeError:
    m = AutoModelForCausalLM.from_pretrained(f"{w}/export", torch_dtype=torch.float32, attn_implementation="eager").eval()
ids = torch.tensor([list(text.encode())])
with torch.no_grad():
    print(json.dumps({"loss": m(input_ids=ids, labels=ids).loss.item(),
                      "rope": json.load(open(f"{w}/export/config.json")).get("rope_scaling")}))
PY
  got=$(tail -1 "$W/export-check.log" | python3 -c "import json,sys; print(json.load(sys.stdin)['loss'])" 2>/dev/null)
  want=$(ref scaled score_fp32)
  if [ -n "$got" ] && within "$got" "$want" 1e-5; then st=PASS; else st=FAIL; fi
  row export "$st" "hf_loss_rel1e-5" "${got:-null}" "$want" "transformers on primus export hf (fp32)"
else
  cp "$W/export.log" "$OUT/"
  row export FAIL export "" "" "$(tail -1 "$W/export.log" | tr '"' "'" | cut -c1-200)"
fi

# bf16 on the cuda backend: continued pretraining from the scaled folder.
cat > "$W/cuda.yaml" <<EOF
work_group: local
user_name: local
exp_name: rope_cuda
workspace: $W/ws
modules:
  pre_trainer:
    framework: ${FRAMEWORK:-cuda}
    config: pretrain.yaml
    overrides:
      load_hf: $W/hf/scaled
      tokenizer_type: bytes
      seq_length: 256
      data_path: [$W/one]
      split: 1.0
      micro_batch_size: 1
      global_batch_size: 1
      train_iters: 20
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
primus train pretrain --config "$W/cuda.yaml" > "$W/train.log" 2>&1
trc=$?
cp "$W/train.log" "$OUT/"
m="$W/ws/local/local/rope_cuda/metrics.jsonl"
if [ $trc -ne 0 ] || [ ! -f "$m" ]; then
  row cuda FAIL cuda_train "" "" "rc=$trc, see train.log"
  finish
fi
read -r first last < <(python3 -c "
import json
l=[json.loads(x)['loss'] for x in open('$m') if 'loss' in json.loads(x)]
print(l[0], l[-1])")
want=$(ref scaled sample_fp32)
if within "$first" "$want" 2e-2; then st=PASS; else st=FAIL; fi
row cuda "$st" "cuda_step1_rel2e-2" "$first" "$want" "transformers fp32; plain model: $(ref plain sample_fp32)"
if python3 -c "import sys; sys.exit(0 if $last < $first - 0.1 else 1)"; then st=PASS; else st=FAIL; fi
row cuda "$st" "cuda_loss_decreases" "$last" "$first" "loss after 20 steps vs step 1"
finish
