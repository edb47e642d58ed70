#!/usr/bin/env bash
# The deferred GELU-aux epilogue (PRIMUS_TURBO_GEMM_GELU_DEFER, turbo/kernels/cuda/gemm_sm90.cu) in
# one device call: its GPU tests first, then per process an in-process A/B (`primus benchmark gemm
# --ab PRIMUS_TURBO_GEMM_GELU_DEFER=0,1`, TURBO and cuBLASLt interleaved) under each forced TURBO
# plan of PLANS, each <plan>[:<schedule>] (PRIMUS_TURBO_GEMM_PLAN and PRIMUS_TURBO_GEMM_SCHEDULE are
# read once per process; plan "auto" = the planner's choice; the deferral needs 128x1:coop).
# Carry: primus.gz, test_turbo_gpu.gz, libgomp.so.1, commit.txt in $CARRY.
#   run(command="CARRY=.carry-gelu bash bench/ops/runs/2026-11-28-h200-s21-gelu-defer/gelu_defer_ab.sh", carry=[".carry-gelu"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
CARRY=${CARRY:-.carry-gelu}
OUT=${OUT:-/tmp/gelu-defer-out}
BIN=/tmp/gelu-defer-bin
SHAPES=${SHAPES:-16384x3072x768+gelu,32768x3072x768+gelu}
PLANS=${PLANS:-"auto 128x1:coop"}
ROUNDS=${ROUNDS:-5}
source bench/ops/carry_setup.sh  # $BIN, LD_LIBRARY_PATH, COMMIT, $OUT/env.txt
GTEST=${GTEST-"test_turbo_gpu:*DeferredGeluAux*:*GeluEpilogues*:*StagedEpilogue*:*Gpt2TrainingShapes*"}
source bench/ops/gtest_stage.sh
gtest_stage "$BIN" "$OUT" 400
for plan in $PLANS; do
  penv=""
  pl=${plan%%:*}
  [ "$pl" != auto ] && penv="PRIMUS_TURBO_GEMM_PLAN=$pl"
  [ "$pl" != "$plan" ] && penv="$penv PRIMUS_TURBO_GEMM_SCHEDULE=${plan#*:}"
  env $penv timeout 250 "$BIN/primus" benchmark gemm --shapes "$SHAPES" --iters 30 \
    --ab PRIMUS_TURBO_GEMM_GELU_DEFER=0,1 --ab-rounds "$ROUNDS" --json "$OUT/ab_${plan//:/_}.jsonl" --commit "$COMMIT" \
    > "$OUT/ab_${plan//:/_}.log" 2>&1
  echo "plan $plan rc=$?"
  grep -E "gelu_aux|TFLOP" "$OUT/ab_${plan//:/_}.log" | grep -i "gelu_aux" | head -20
done
