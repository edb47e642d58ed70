#!/usr/bin/env bash
# Session 22: the deferred GELU-aux epilogue of the TURBO GEMM with its D passes spread in quarters
# over every k-tile of the next main loop (PRIMUS_TURBO_GEMM_GELU_DEFER=2) against one chunk per
# k-tile (=1) and the one-pass epilogue (=0), in one device call: the GPU tests first, then per
# process an in-process A/B (`primus benchmark gemm --ab PRIMUS_TURBO_GEMM_GELU_DEFER=0,1,2`),
# PROCS processes, plus one process with PROBE_IDENTITY (no GELU math: the deferral's ceiling).
# SM clocks and power are sampled every 100 ms into $OUT/smi.csv.
# Carry: primus.gz, test_turbo_gpu.gz, libgomp.so.1, commit.txt in $CARRY.
#   run(command="CARRY=.carry-gelu bash bench/ops/runs/2026-11-28-h200-s22-gelu-quarters/quarters_ab.sh", carry=[".carry-gelu"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
CARRY=${CARRY:-.carry-gelu}
OUT=${OUT:-/tmp/gelu-quarters-out}
BIN=/tmp/gelu-quarters-bin
SHAPES=${SHAPES:-16384x3072x768+gelu,32768x3072x768+gelu}
ROUNDS=${ROUNDS:-5}
PROCS=${PROCS:-2}
VALUES=${VALUES:-0,1,2}
source bench/ops/carry_setup.sh  # $BIN, LD_LIBRARY_PATH, COMMIT, $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>/dev/null &
SMI=$!
GTEST=${GTEST-"test_turbo_gpu:*DeferredGeluAux*:*GeluEpilogues*:*StagedEpilogue*:*Gpt2TrainingShapes*"}
source bench/ops/gtest_stage.sh
gtest_stage "$BIN" "$OUT" 400
run_ab() {  # name, extra env
  env $2 timeout 200 "$BIN/primus" benchmark gemm --shapes "$SHAPES" --iters 30 \
    --ab PRIMUS_TURBO_GEMM_GELU_DEFER=$VALUES --ab-rounds "$ROUNDS" --json "$OUT/ab_$1.jsonl" --commit "$COMMIT" \
    > "$OUT/ab_$1.log" 2>&1
  echo "== $1 rc=$?"
  grep -i "gelu" "$OUT/ab_$1.log" | head -12
}
for i in $(seq 1 "$PROCS"); do run_ab "p$i" ""; done
[ -n "${IDENTITY-1}" ] && run_ab identity "PROBE_IDENTITY=1"
kill $SMI 2>/dev/null
