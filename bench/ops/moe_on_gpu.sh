#!/usr/bin/env bash
# One device call for the MoE routing ops (turbo/ops/moe.h): their GPU tests against the CPU
# reference, then `primus benchmark moe` (router, plan, permutes at the MoE presets' shapes).
# Run from the repository root with the carried folder (default .carry-moe-ops, filled by
# bench/ops/moe_prepare_carry.sh). STAGE=tests|bench|all (default all). Results in $OUT
# (device.txt, tests.log, bench.log, moe.jsonl); then, here:
#   cat <files_at>/moe.jsonl >> bench/results/ops.jsonl
set -u
CARRY=${CARRY:-.carry-moe-ops}
OUT=${OUT:-/tmp/moe-out}
BIN=/tmp/moe-bin
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  # A kernel that hangs must not eat the call: the tests get 120 s, and a timeout skips the bench.
  timeout 120 "$BIN/test_turbo_gpu" --gtest_filter='*Moe*' --gtest_brief=1 > "$OUT/tests.log" 2>&1
  rc=$?
  tail -30 "$OUT/tests.log"
  echo "tests exit code $rc"
  if [ $rc = 124 ]; then echo "tests timed out: skipping the benchmark"; STAGE=tests; fi
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  rm -f "$OUT/moe.jsonl"
  timeout 180 "$BIN/primus" benchmark moe --json "$OUT/moe.jsonl" --commit "$COMMIT" > "$OUT/bench.log" 2>&1
  echo "benchmark exit code $?"
  cat "$OUT/bench.log"
fi
