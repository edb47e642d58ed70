#!/usr/bin/env bash
# Session 25, one device call: the norm forward's A/B switches (PRIMUS_TURBO_NORM_FWD_STATS=chan: one
# shuffle chain for LayerNorm's statistics; PRIMUS_TURBO_NORM_FWD_THREADS: rows per block) and the
# staged backward's warps per block (PRIMUS_TURBO_NORM_BWD_WARPS).
# 1) the norm GPU tests (incl. NormForwardSwitchTest), 2) `primus benchmark norm --ab` for each
# switch (values alternating per product in one process), 3) optionally (TRAIN=1) GPT-2 124M B16
# training with each stats value, ROUNDS interleaved processes.
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s25-normfwd/run.sh", carry=[".carry-turbo"])
set -u
CARRY=${CARRY:-.carry-turbo}
BIN=/tmp/turbo-bin
OUT=${OUT:-/tmp/normfwd-out}
# shellcheck disable=SC1091
source bench/ops/carry_setup.sh
# shellcheck disable=SC1091
source scripts/gpu_env.sh
"$BIN/test_turbo_gpu" --gtest_brief=1 --gtest_filter="${GTEST:-*Norm*}" > "$OUT/tests.log" 2>&1
echo "norm tests rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -8
for ab in ${ABS:-PRIMUS_TURBO_NORM_FWD_STATS=twopass,chan PRIMUS_TURBO_NORM_FWD_THREADS=256,64,128,512 PRIMUS_TURBO_NORM_BWD_WARPS=16,8,4}; do
  name=$(echo "$ab" | cut -d= -f1 | tr 'A-Z' 'a-z')
  "$BIN/primus" benchmark norm --ab "$ab" --ab-rounds "${AB_ROUNDS:-5}" \
    --json "$OUT/ab_$name.jsonl" --commit "$COMMIT" > "$OUT/ab_$name.log" 2>&1
  echo "benchmark --ab $ab rc=$?"; grep -E "norm" "$OUT/ab_$name.log" | head -40
done
if [ "${TRAIN:-0}" = 1 ]; then
  cfg=examples/cuda/gpt2-124M-shakespeare.yaml; shape="micro_batch_size=16 global_batch_size=16 seq_length=1024"
  for round in $(seq "${ROUNDS:-2}"); do
    for v in ${TRAIN_VALUES:-twopass chan}; do
      PRIMUS_TURBO_NORM_FWD_STATS=$v timeout 300 "$BIN/primus" train pretrain --config "$cfg" $shape \
        lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true \
        train_iters=30 log_interval=10 workspace=/tmp/ws_s25 > "$OUT/train_gpt2_${v}_r$round.log" 2>&1
      echo "gpt2 $v round $round rc=$? $(grep -o 'step 30/30.*tok/s' "$OUT/train_gpt2_${v}_r$round.log" | grep -o '[0-9]* tok/s' | tail -1)"
    done
  done
fi
