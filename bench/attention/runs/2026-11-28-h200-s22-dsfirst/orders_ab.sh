#!/usr/bin/env bash
# Session 22: the TURBO attention backward's consumer orders at head_dim 64 (128-query tiles,
# PRIMUS_TURBO_ATTN_BWD_DS_FIRST, see BwdWsConfig in turbo/kernels/cuda/attention_bwd_sm90.cu)
# in one device call: test_attention_gpu under each order in TEST_ORDERS, then PROCS processes
# each timing every order of ORDERS in turn per shape
# (`primus benchmark attention --backend TURBO --ab ... --ab-rounds ROUNDS`), then CUDNN.
# Carry .carry-cuda: primus.gz, test_attention_gpu.gz, libgomp.so.1.
#   run(command="OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s22-dsfirst/orders_ab.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/attn-orders-out}
BIN=/tmp/attn-orders-bin
# Call 4 ran ORDERS=0,1,2,3 TEST_ORDERS="2 3" on a binary that still had order 3 (dropped since).
ORDERS=${ORDERS:-0,1,2}
ROUNDS=${ROUNDS:-3}
PROCS=${PROCS:-2}
SHAPES=${SHAPES:-16x1024x12x12x64,16x1024x12x12x64:packed,8x2048x32x8x64:packed,8x2048x16x16x64}
mkdir -p "$OUT" "$BIN"
for f in .carry-cuda/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp .carry-cuda/lib*.so* "$BIN/" 2>/dev/null
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$BIN:${cudnn:-/x}:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for o in ${TEST_ORDERS-0 1 2}; do
  PRIMUS_TURBO_ATTN_BWD_DS_FIRST=$o timeout 300 "$BIN/test_attention_gpu" --gtest_brief=1 > "$OUT/tests_order$o.log" 2>&1
  echo "test_attention_gpu order $o rc=$?"; grep -E "FAILED|PASSED|Failure" "$OUT/tests_order$o.log" | tail -6
done
for i in $(seq "$PROCS"); do
  "$BIN/primus" benchmark attention --backend TURBO --iters 20 --shapes "$SHAPES" --ab "PRIMUS_TURBO_ATTN_BWD_DS_FIRST=$ORDERS" \
    --ab-rounds "$ROUNDS" --json "$OUT/ab_p$i.jsonl" > "$OUT/ab_p$i.log" 2>&1 || echo "process $i rc=$?"
done
"$BIN/primus" benchmark attention --backend CUDNN --iters 20 --shapes "$SHAPES" --json "$OUT/cudnn.jsonl" > "$OUT/cudnn.log" 2>&1
grep -h "bwd" "$OUT"/ab_p*.log "$OUT/cudnn.log" | sed 's/  */ /g' | cut -c1-150
