#!/usr/bin/env bash
# Session 23: one TURBO attention switch in one device call: the warp-specialised attention GPU tests
# (GTEST_FILTER), then an in-process A/B (`primus benchmark attention --ab VAR=VALUES`, ROUNDS rounds)
# over SHAPES, then CUDNN on the same shapes. Defaults: PRIMUS_TURBO_ATTN_FWD_WGS=2,3 (the forward's two
# or three consumer warpgroups) at head_dim 64. Carry .carry-attn: primus.gz, test_attention_gpu.gz.
#   run(command="OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s23-fwd3wg/ab.sh", carry=[".carry-attn"])
set -u
OUT=${OUT:-/tmp/ab-out} BIN=/tmp/ab-bin CARRY=.carry-attn
source bench/ops/carry_setup.sh
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=${cudnn:-/x}:$LD_LIBRARY_PATH
timeout "${TEST_TIMEOUT:-300}" "$BIN/test_attention_gpu" --gtest_brief=1 --gtest_filter="${GTEST_FILTER:-*Sm90Ws*:*Packed*:*Gqa*:*Varlen*}" > "$OUT/tests.log" 2>&1
echo "test_attention_gpu rc=$?"; grep -E "FAILED|PASSED|Failure" "$OUT/tests.log" | tail -12
SHAPES=${SHAPES:-16x1024x12x12x64,16x1024x12x12x64:packed,8x2048x32x8x64:packed,4x4096x16x16x64}
"$BIN/primus" benchmark attention --backend TURBO --iters 20 --shapes "$SHAPES" \
  --ab "${VAR:-PRIMUS_TURBO_ATTN_FWD_WGS}=${VALUES:-2,3}" --ab-rounds "${ROUNDS:-3}" --json "$OUT/ab.jsonl" > "$OUT/ab.log" 2>&1 || echo "A/B rc=$?"
"$BIN/primus" benchmark attention --backend CUDNN --iters 20 --shapes "$SHAPES" --json "$OUT/cudnn.jsonl" > "$OUT/cudnn.log" 2>&1
tail -30 "$OUT/ab.log"; grep -E "bwd|fwd" "$OUT/cudnn.log" | tail -8
