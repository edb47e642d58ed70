#!/usr/bin/env bash
# One device call for the attention work: environment facts, the attention tests, then
# `primus benchmark attention` (our side: CUDNN and TURBO, each against the GEMM ceiling)
# and torch_sdpa.py (PyTorch's SDPA) back to back on the same GPU.
# Run from the repository root with the carried folder (default .carry-attn) holding
# test_attention_gpu.gz, test_attention_host.gz, libgomp.so.1 and optionally primus.gz (a CUDA
# build of primus; else .carry-cuda/primus.gz, else $PRIMUS_CUDA_BIN) and commit.txt.
# Results go to $OUT: env.txt, tests.log, ours.jsonl, torch.jsonl, bench.log; then, here:
#   bench/attention/merge_attention.py --ours ours.jsonl --torch torch.jsonl --out bench/results/attention.jsonl --append
# STAGE=tests|bench|all (default all); GTEST_FILTER is passed through to the GPU tests.
# VARIANTS=<A,B,...> or all: TURBO's kernel variants timed too, in the same run (`primus benchmark
# attention --variants`, e.g. TURBO_SM80; their lines go to ours.jsonl under the variant's name).
# Every backend and variant after CUDNN is cross-checked against it on the same inputs (the
# "xcheck" key of its lines, and a table at the end of bench.log).
set -u
CARRY=${CARRY:-.carry-attn}
OUT=${OUT:-/tmp/attn-out}
BIN=/tmp/attn-bin
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)"; chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
PRIMUS=${PRIMUS_CUDA_BIN:-$BIN/primus}
if [ ! -x "$PRIMUS" ] && [ -f .carry-cuda/primus.gz ]; then
  gunzip -c .carry-cuda/primus.gz > "$BIN/primus" && chmod +x "$BIN/primus" && PRIMUS=$BIN/primus
fi
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || cat .carry-cuda/commit.txt 2>/dev/null || echo unknown)

# cuDNN: the one PyTorch loads (its wheel), else any on the system.
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
if [ -z "$cudnn_dir" ] || [ ! -e "$cudnn_dir/libcudnn.so.9" ]; then
  cudnn_dir=$(dirname "$(find /usr /opt -name 'libcudnn.so.9' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH=$BIN:$cudnn_dir:${LD_LIBRARY_PATH:-}
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
  echo "cudnn_dir=$cudnn_dir"; ls "$cudnn_dir" 2>&1 | head -20
  find /usr /opt -name 'libcudnn.so.9*' 2>/dev/null | head
  ls /usr/local/cuda*/lib64 2>/dev/null | grep -E "cudart|cublas" | head
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'cuda', torch.version.cuda)"
  ldd "$BIN/test_attention_gpu" | grep -E "not found|cudnn|gomp"
  echo "HGMMA instructions in test_attention_gpu: $(cuobjdump -sass "$BIN/test_attention_gpu" 2>/dev/null | grep -c HGMMA)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  timeout 60 "$BIN/test_attention_host" --gtest_brief=1 > "$OUT/tests.log" 2>&1
  CUDNN_LOGLEVEL_DBG=1 CUDNN_LOGDEST_DBG=stderr timeout ${TEST_TIMEOUT:-300} "$BIN/test_attention_gpu" \
    --gtest_brief=1 ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} >> "$OUT/tests.log" 2>&1
  echo "test rc=$?" >> "$OUT/tests.log"
  grep -v "^\[cudnn\|^ *i!" "$OUT/tests.log" | tail -60
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  rm -f "$OUT/ours.jsonl"
  timeout ${BENCH_TIMEOUT:-200} "$PRIMUS" benchmark attention --iters 20 ${VARIANTS:+--variants "$VARIANTS"} \
    --json "$OUT/ours.jsonl" --commit "$COMMIT" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"
  PYTHONUNBUFFERED=1 timeout ${TORCH_TIMEOUT:-200} python3 bench/attention/torch_sdpa.py --out "$OUT/torch.jsonl" \
    ${ONLY:+--only $ONLY} >> "$OUT/bench.log" 2>&1
  echo "torch rc=$?" >> "$OUT/bench.log"
  cat "$OUT/bench.log" | cut -c1-600
fi
