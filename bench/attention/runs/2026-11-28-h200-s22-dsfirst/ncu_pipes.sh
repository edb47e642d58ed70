#!/usr/bin/env bash
# Pipe utilisation of the head_dim-64 attention kernels at GPT-2's shape, TURBO (after session 22's
# order change) beside cuDNN, under Nsight Compute: tensor (gmma), XU (MUFU: the exponentials),
# FMA and ALU pipes, issue slots, duration, and the warp stall breakdown. One launch of each
# kernel after the first rounds. From the repository root on the GPU machine:
#   OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s22-dsfirst/ncu_pipes.sh
source "$(dirname "$0")/../2026-11-27-h200-s17-ncu/bin_setup.sh"  # primus into $BIN, library path, $NCU
SHAPE=${SHAPE:-16x1024x12x12x64}
M=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
for be in TURBO CUDNN; do
  if [ $be = CUDNN ]; then k='regex:fprop|bprop|flash'; else k='regex:flash_(fwd|bwd)_sm90'; fi
  f=$OUT/ncu_pipes_${SHAPE//[^0-9a-zA-Z]/_}_$be.txt
  $NCU --clock-control none --section WarpStateStats --metrics "$M" -k "$k" --launch-skip 4 --launch-count 4 \
    $BIN/primus benchmark attention --shapes "$SHAPE" --backend $be --iters 3 > "$f" 2>&1
  echo "== $SHAPE $be"
  grep -E "^  [a-zA-Z_].*\(|gmma|pipe_xu|pipe_fma|pipe_alu|issue_active|pipe_shared|duration|Stall|Warp Cycles Per Issued" "$f" | head -60
done
