#!/usr/bin/env bash
# Nsight Compute sections (speed of light, memory, warp state, occupancy, launch) of one launch each of
# the staged norm backward, the norm forward and add_column_partials at GPT-2's 16384 x 768, after
# `primus benchmark norm` for the ops' own timings. Writes $OUT/ncu_<kernel>.txt.
#   run(command="bash bench/ops/ncu_norm.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name --format=csv,noheader
/tmp/pb/primus benchmark norm --shapes 16384x768 --backend TURBO 2>&1 | tail -12
for k in norm_backward_staged norm_forward_kernel add_column_partials; do
"$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats -k "regex:$k" --launch-skip 3 --launch-count 1 /tmp/pb/primus benchmark norm --shapes 16384x768 --backend TURBO --iters 10 > $OUT/ncu_$k.txt 2>&1
grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Dynamic Shared|Grid Size|Block Size|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Eligible Warps" $OUT/ncu_$k.txt | head -40
done
