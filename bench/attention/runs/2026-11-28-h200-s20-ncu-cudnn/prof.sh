# cuDNN's and TURBO's attention kernels side by side under Nsight Compute (H200, session 20): the
# training layout of GPT-2 (16x1024x12x12x64:packed) and head_dim 128 at T=8192 (2x8192x16x16x128),
# forward and backward, one launch each: launch shape (grid, block, registers, shared memory),
# throughput, occupancy and the tensor pipe. From the repository root on the GPU machine:
#   OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s20-ncu-cudnn/prof.sh
source "$(dirname "$0")/../2026-11-27-h200-s17-ncu/bin_setup.sh"  # primus into $BIN, library path, $NCU
for shape in 16x1024x12x12x64:packed 2x8192x16x16x128; do
  for be in CUDNN TURBO; do
    if [ $be = CUDNN ]; then k='regex:sdpa|fprop|bprop|flash'; else k='regex:flash_(fwd|bwd)_sm90'; fi
    f=$OUT/ncu_${shape//[^0-9a-zA-Z]/_}_$be.txt
    $NCU --clock-control none --section LaunchStats --section SpeedOfLight --section Occupancy \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
      -k "$k" --launch-count 14 $BIN/primus benchmark attention --shapes $shape --backend $be \
      --iters 3 > "$f" 2>&1
    echo "== $shape $be"
    grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per|Dynamic Shared Memory Per|Grid Size|Block Size|Compute \(SM\) Throughput|Achieved Occupancy|gmma_cycles" "$f" | head -120
  done
done
