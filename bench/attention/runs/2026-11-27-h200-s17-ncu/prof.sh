# The warp-specialised TURBO attention backward under Nsight Compute (H200, session 17): head_dim 128
# (T=2048) and 64 (GPT-2), warp-state and throughput sections. From the repository root on the GPU
# machine: OUT=$OUT bash <this file>
source "$(dirname "$0")/bin_setup.sh"
for shape in 8x2048x16x16x128 16x1024x12x12x64; do
  $NCU --clock-control none --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_tensor_op_gmma_cycles_active\.avg\.pct_of_peak_sustained_active" \
    -k regex:flash_bwd_sm90_ws --launch-skip 2 --launch-count 1 $BIN/primus benchmark attention --shapes $shape --backend TURBO \
    --iters 5 > $OUT/ncu_$shape.txt 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Executed Ipc A|Issue Slots Busy|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Stall|stall|issue_stalled|gmma" $OUT/ncu_$shape.txt | grep -v " 0$\| 0\.0[0-9]$" | head -60
done
