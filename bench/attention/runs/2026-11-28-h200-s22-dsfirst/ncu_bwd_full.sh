#!/usr/bin/env bash
# The head_dim-64 attention backward's main kernels at GPT-2's shape under Nsight Compute
# (--set full, one launch each after two), TURBO (sm90ws, the order in PRIMUS_TURBO_ATTN_BWD_DS_FIRST)
# beside cuDNN's bprop kernel: speed of light, pipes, warp states. From the repository root:
#   OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s22-dsfirst/ncu_bwd_full.sh
source "$(dirname "$0")/../2026-11-27-h200-s17-ncu/bin_setup.sh"  # primus into $BIN, library path, $NCU
SHAPE=${SHAPE:-16x1024x12x12x64}
for be in TURBO CUDNN; do
  if [ $be = CUDNN ]; then k='regex:bprop'; else k='regex:flash_bwd_sm90_ws'; fi
  f=$OUT/ncu_bwd_full_${SHAPE//[^0-9a-zA-Z]/_}_$be.txt
  $NCU --clock-control none --set full --import-source no -k "$k" --launch-skip 2 --launch-count 1 \
    $BIN/primus benchmark attention --shapes "$SHAPE" --backend $be --iters 3 > "$f" 2>&1
  echo "== $SHAPE $be"
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|highest-utilized|Registers Per Thread|Stall [A-Z][a-z]+ .*[0-9]" "$f" | head -40
done
