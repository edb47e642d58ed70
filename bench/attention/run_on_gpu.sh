#!/usr/bin/env bash
# One device call for the attention work: environment facts, the attention tests, then
# primus_attention_bench and torch_sdpa.py back to back on the same GPU.
# Run from the repository root with the carried folder (default .carry-attn) holding
# test_attention_gpu.gz, test_attention_host.gz, primus_attention_bench.gz and libgomp.so.1.
# Results go to $OUT: env.txt, tests.log, ours.jsonl, torch.jsonl, bench.log.
# STAGE=tests|bench|all (default all); ONLY=<case substring> and VARIANTS=<A,B,...> limit the
# benchmark; GTEST_FILTER is passed through to the GPU tests. (Run 4 ran a new kernel's tests and
# bench in separate processes with GTEST_FILTER / VARIANTS, so a hang could not cost the rest.)
set -u
CARRY=${CARRY:-.carry-attn}
OUT=${OUT:-/tmp/attn-out}
BIN=/tmp/attn-bin
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)"; chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null

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
  timeout ${BENCH_TIMEOUT:-200} "$BIN/primus_attention_bench" --out "$OUT/ours.jsonl" ${ONLY:+--only $ONLY} \
    ${VARIANTS:+--variants $VARIANTS} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"
  PYTHONUNBUFFERED=1 timeout ${TORCH_TIMEOUT:-200} python3 bench/attention/torch_sdpa.py --out "$OUT/torch.jsonl" \
    ${ONLY:+--only $ONLY} >> "$OUT/bench.log" 2>&1
  echo "torch rc=$?" >> "$OUT/bench.log"
  cat "$OUT/bench.log" | cut -c1-600
fi
