#!/usr/bin/env bash
# The model families of issue #40 item 2 on the GPU machine: Qwen2 / Qwen2.5 (q/k/v-only biases,
# add_qkv_bias), OLMoE (q/k RMSNorms over the whole projection, qk_layernorm_scope: projection)
# and Mistral's export (MistralForCausalLM with its window). Run from the repository root with
# $BIN (the built primus and test binaries, on PATH and LD_LIBRARY_PATH) and $OUT set; about 2
# minutes.
#   1. test_cuda_gpu FamilyParityTest: the cuda model (bf16) against the reference backend for a
#      tiny Qwen2, a dense model with whole-projection q/k norms and a tiny OLMoE (every layer MoE):
#      step-0 loss within 1e-2 and every gradient (the q|k|v bias and the two norm weights
#      included) under the bf16 gate of model_parity_test.cpp.
#   2. cuda training through the binary: qwen2/tiny and moe/olmoe-tiny learn (loss falls by 0.5
#      over 40 steps) with CUDA graphs and the default bias-gradient path.
#   3. transformers (bench/hf/families_hf_parity.py): tiny Qwen2, OLMoE and Mistral trained by the
#      reference backend and by the cuda backend, exported with `primus export hf`; each loads as
#      its class with no missing/unexpected weights, greedy text equals Primus', the loss equals
#      `primus generate --score` within 1e-4 (fp32 export) / 2e-2 (bf16), and the family's own
#      tensors are live (resetting them changes transformers' loss). The cuda engine's greedy text
#      against transformers' is reported (bf16 may part at a near-tie). Skipped without
#      torch/transformers.
# Writes $OUT/families.jsonl (one row per check, plus the oracle's JSON lines) and prints a
# PASS/FAIL table last.
PART=families
# shellcheck source=bench/hf/common.sh
source bench/hf/common.sh

record() {  # name rc seconds
  local status=PASS
  [ "$2" -eq 0 ] || status=FAIL
  ROWS+=("$(printf '%-34s %-5s %6ss' "$1" "$status" "$3")")
  printf '{"bench": "families", "case": "%s", "device": "%s", "date": "%s", "commit": "%s", "metric": "pass", "ours": %d, "seconds": %s}\n' \
    "$1" "$DEVICE" "$DATE" "$COMMIT" "$([ "$2" -eq 0 ] && echo 1 || echo 0)" "$3" >> "$OUT/families.jsonl"
}

run_check() {  # name command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$W/$name.log" 2>&1
  local rc=$?
  tail -8 "$W/$name.log"
  cp "$W/$name.log" "$OUT/$name.log"
  record "$name" "$rc" "$((SECONDS - t0))"
}

# 1. Device model against the reference backend.
run_check cuda_family_parity "$BIN/test_cuda_gpu" --gtest_filter='Cuda/FamilyParityTest.*'

# 2. cuda training through the binary on bytes of a generated text.
python3 - "$W/corpus.txt" <<'PY'
import random, sys
rng = random.Random(0)
who = ["the king", "a citizen", "my lord", "the queen", "his friend", "our army"]
verb = ["speaks to", "waits for", "fights", "loves", "forgets", "follows"]
what = ["the people", "his sword", "the crown", "her brother", "the night", "Rome"]
with open(sys.argv[1], "w") as f:
    f.write("\n".join(f"{rng.choice(who).capitalize()} {rng.choice(verb)} {rng.choice(what)}." for _ in range(4000)))
PY
train_cuda() {  # name preset
  local ws="$W/ws-$1"
  cat > "$W/$1.yaml" <<EOF
workspace: $ws
exp_name: $1
modules:
  pre_trainer:
    framework: cuda
    config: pretrain.yaml
    model: $2
    overrides:
      tokenizer_type: bytes
      vocab_size: 256
      seq_length: 128
      train_iters: 40
      micro_batch_size: 8
      global_batch_size: 8
      lr: 3.0e-3
      min_lr: 3.0e-4
      lr_warmup_iters: 4
      log_interval: 1
      eval_interval: 0
      save_interval: 0
      save_at_end: false
      sample_tokens: 0
      data_path: ["$W/corpus.txt"]
      split: 0.95
EOF
  "$BIN/primus" train pretrain --config "$W/$1.yaml" > "$W/train-$1.log" 2>&1 || return 1
  local m
  m=$(find "$ws" -name metrics.jsonl | head -1)
  python3 - "$m" <<'PY'
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
print("losses", losses[0], "->", losses[-1], "over", len(losses), "steps")
sys.exit(0 if len(losses) == 40 and losses[-1] < losses[0] - 0.5 else 1)
PY
}
run_check cuda_train_qwen2 train_cuda qwen2 qwen2/tiny.yaml
run_check cuda_train_olmoe train_cuda olmoe moe/olmoe-tiny.yaml

# 3. transformers against Primus' exports, checkpoints of both backends.
if python3 -c "import torch, transformers" 2>/dev/null; then
  run_check hf_families_reference python3 bench/hf/families_hf_parity.py "$BIN/primus" "$W/hf" --cuda \
    --framework reference
  grep '^{' "$OUT/hf_families_reference.log" >> "$OUT/families_hf_parity.jsonl"
  run_check hf_families_cuda python3 bench/hf/families_hf_parity.py "$BIN/primus" "$W/hf" --framework cuda \
    --families qwen2,olmoe
  grep '^{' "$OUT/hf_families_cuda.log" >> "$OUT/families_hf_parity.jsonl"
else
  ROWS+=("$(printf '%-34s %-5s' hf_families SKIP) (no torch/transformers)")
fi

echo
echo "== families (Qwen2 q/k/v bias, OLMoE whole-projection q/k norms, Mistral export) =="
printf '%s\n' "${ROWS[@]}"
