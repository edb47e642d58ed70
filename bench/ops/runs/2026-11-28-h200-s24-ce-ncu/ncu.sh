#!/usr/bin/env bash
# Session 24: why the streamed cross-entropy kernel (the default for Llama-3's 128256 columns: clusters of 8 CTAs,
# persistent, two slice buffers) reads 56% of copy alone while the one-row-per-cluster kernel reads 72.5%.
# One launch of each under Nsight Compute (sections: speed of light, memory, occupancy, launch, warp states,
# scheduler), 16384 x 128256 bf16, from `primus benchmark loss --shapes 16384x128256`.
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s24-ce-ncu/ncu.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/ce-ncu}
mkdir -p /tmp/pb "$OUT" && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/env.txt"
/tmp/pb/primus benchmark loss --shapes 16384x128256 > "$OUT/bench.log" 2>&1; grep cross_entropy "$OUT/bench.log" | head -8
for k in stream onchip; do
  timeout 240 "$NCU" --clock-control none -k "regex:cross_entropy_${k}_kernel" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    /tmp/pb/primus benchmark loss --shapes 16384x128256 --iters 5 > "$OUT/ncu_$k.txt" 2>&1
  echo "ncu $k rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Cluster Size|Block Size|Grid Size|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Waves Per SM|Block Limit" "$OUT/ncu_$k.txt" | head -30
done
