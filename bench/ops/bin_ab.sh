#!/usr/bin/env bash
# One op family, this build against a baseline build, in one call: optionally the op's GPU tests
# (TEST_FILTER, a gtest filter of test_turbo_gpu), then `primus benchmark $FAMILY` of both binaries
# in ROUNDS (default 2) interleaved rounds, the lines matching GREP (default: every result line).
# SHAPES: the benchmark's --shapes (default: its own cases); BACKEND (default TURBO).
# Carry: .carry-cuda (primus.gz, test_turbo_gpu.gz) and .carry-probe/primus_old.gz (the baseline).
#   run(command="FAMILY=loss TEST_FILTER='*CrossEntropy*' bash bench/ops/bin_ab.sh",
#       carry=[".carry-cuda", ".carry-probe"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
: "${FAMILY:?FAMILY=<op family> (gemm norm activation loss optimizer rope embedding attention quantize)}"
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && gunzip -c .carry-probe/primus_old.gz > /tmp/pb/primus_old && chmod +x /tmp/pb/*
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${TEST_FILTER:-}" ]; then
  gunzip -c .carry-cuda/test_turbo_gpu.gz > /tmp/pb/test_turbo_gpu && chmod +x /tmp/pb/test_turbo_gpu
  /tmp/pb/test_turbo_gpu --gtest_filter="$TEST_FILTER" 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure|error:" | head -20
fi
args=(benchmark "$FAMILY" --backend "${BACKEND:-TURBO}")
[ -n "${SHAPES:-}" ] && args+=(--shapes "$SHAPES")
for r in $(seq "${ROUNDS:-2}"); do
  for b in old new; do
    exe=/tmp/pb/primus; [ $b = old ] && exe=/tmp/pb/primus_old
    echo "== round $r $b"
    "$exe" "${args[@]}" 2>&1 | grep -E "${GREP:-GB/s|TFLOP/s|ms}" | head -20
  done
done
