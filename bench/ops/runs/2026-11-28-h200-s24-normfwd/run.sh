#!/usr/bin/env bash
# Session 24, one device call: the norm forward's resident grid (PRIMUS_TURBO_NORM_FWD_GRID=resident,
# the new default) against one block per row group (=rows, the grid before). 1) the norm GPU tests,
# 2) `primus benchmark norm --ab` (both grids alternating per product in one process), 3) GPT-2 124M
# B16 and Llama-3.2-1B B8 training with each grid (30 steps, ROUNDS interleaved processes), 4) the
# memory-bound rows of torch_ops.py (PyTorch eager) in the same call.
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s24-normfwd/run.sh", carry=[".carry-turbo"])
set -u
CARRY=${CARRY:-.carry-turbo}
BIN=/tmp/turbo-bin
OUT=${OUT:-/tmp/normfwd-out}
# shellcheck disable=SC1091
source bench/ops/carry_setup.sh
# shellcheck disable=SC1091
source scripts/gpu_env.sh
"$BIN/test_turbo_gpu" --gtest_brief=1 --gtest_filter='*Norm*' > "$OUT/tests.log" 2>&1
echo "norm tests rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -8
"$BIN/primus" benchmark norm --ab PRIMUS_TURBO_NORM_FWD_GRID=resident,rows --ab-rounds "${AB_ROUNDS:-5}" \
  --json "$OUT/ab.jsonl" --commit "$COMMIT" > "$OUT/ab.log" 2>&1
echo "benchmark --ab rc=$?"; grep -E "_fwd" "$OUT/ab.log" | head -30
PYTHONUNBUFFERED=1 python3 bench/ops/torch_ops.py --out "$OUT/torch.jsonl" --only mem > "$OUT/torch.log" 2>&1 ||
  echo "torch_ops rc=$?"
for model in gpt2 llama; do
  if [ "$model" = gpt2 ]; then
    cfg=examples/cuda/gpt2-124M-shakespeare.yaml; shape="micro_batch_size=16 global_batch_size=16 seq_length=1024"
  else
    cfg=examples/cuda/llama3.2-1B.yaml; shape="micro_batch_size=8 global_batch_size=8 seq_length=2048"
  fi
  for round in $(seq "${ROUNDS:-2}"); do
    for grid in resident rows; do
      PRIMUS_TURBO_NORM_FWD_GRID=$grid timeout 300 "$BIN/primus" train pretrain --config "$cfg" $shape \
        lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true \
        train_iters=30 log_interval=10 workspace=/tmp/ws_normfwd > "$OUT/train_${model}_${grid}_r$round.log" 2>&1
      echo "$model $grid round $round rc=$? $(grep -o 'step 30/30.*tok/s' "$OUT/train_${model}_${grid}_r$round.log" | grep -o '[0-9]* tok/s' | tail -1)"
    done
  done
done
