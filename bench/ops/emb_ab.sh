#!/usr/bin/env bash
# The embedding backward, this build against a baseline build, in one call: the embedding GPU tests,
# then `primus benchmark embedding` of both binaries in two interleaved rounds on uniform tokens
# (V 50304), 64 ids and 8 ids (long runs of one token, as real text's frequent tokens).
# Carry: .carry-cuda (primus.gz, test_turbo_gpu.gz) and .carry-probe/primus_old.gz (the baseline).
#   run(command="bash bench/ops/emb_ab.sh", carry=[".carry-cuda", ".carry-probe"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && gunzip -c .carry-probe/primus_old.gz > /tmp/pb/primus_old && gunzip -c .carry-cuda/test_turbo_gpu.gz > /tmp/pb/test_turbo_gpu && chmod +x /tmp/pb/*
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
/tmp/pb/test_turbo_gpu --gtest_filter='*Embedding*' 2>&1 | grep -E "OK|FAILED|PASSED|Failure|error" | head -20
for r in 1 2; do
  echo "== round $r old"; /tmp/pb/primus_old benchmark embedding --shapes 16x1024x768x50304,16x1024x768x64,16x1024x768x8 --backend TURBO 2>&1 | grep -E "embedding_bwd" | head -3
  echo "== round $r new"; /tmp/pb/primus benchmark embedding --shapes 16x1024x768x50304,16x1024x768x64,16x1024x768x8 --backend TURBO 2>&1 | grep -E "embedding_bwd" | head -3
done
