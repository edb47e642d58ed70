#!/usr/bin/env bash
# Session 23: the head_dim-128 backward's dQ split (PRIMUS_TURBO_ATTN_BWD_DQ_SPLIT=cols|keys|keys2)
# in one device call: the warp-specialised attention GPU tests (the switch and many-tile tests run
# every split), then an in-process A/B of the three splits (`primus benchmark attention --ab`).
#   run(command="OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s23-dqsplit/split_ab.sh", carry=[".carry-attn"])
set -u
OUT=${OUT:-/tmp/split-out}
BIN=/tmp/split-bin
mkdir -p "$OUT" "$BIN"
for f in .carry-attn/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp .carry-attn/lib*.so* "$BIN/" 2>/dev/null
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$BIN:${cudnn:-/x}:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout "${TEST_TIMEOUT:-300}" "$BIN/test_attention_gpu" --gtest_brief=1 --gtest_filter="${GTEST_FILTER:-*Sm90Ws*:*Packed*:*Gqa*:*Varlen*}" > "$OUT/tests.log" 2>&1
echo "test_attention_gpu rc=$?"; grep -E "FAILED|PASSED|Failure" "$OUT/tests.log" | tail -12
SHAPES=${SHAPES:-8x2048x16x16x128,2x8192x16x16x128,4x4096x32x8x128}
"$BIN/primus" benchmark attention --backend TURBO --iters 20 --shapes "$SHAPES" \
  --ab "PRIMUS_TURBO_ATTN_BWD_DQ_SPLIT=${VALUES:-cols,keys,keys2}" --ab-rounds "${ROUNDS:-3}" --json "$OUT/ab.jsonl" > "$OUT/ab.log" 2>&1 || echo "A/B rc=$?"
"$BIN/primus" benchmark attention --backend CUDNN --iters 20 --shapes "$SHAPES" --json "$OUT/cudnn.jsonl" > "$OUT/cudnn.log" 2>&1
tail -30 "$OUT/ab.log"; grep -E "bwd|fwd" "$OUT/cudnn.log" | tail -8
