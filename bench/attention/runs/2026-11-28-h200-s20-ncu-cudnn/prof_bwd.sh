# The backward kernels only (cuDNN's flash_bprop, TURBO's warp-specialised backward), skipping the
# first launches (short calls of other cases come first): SHAPES (default 2x8192x16x16x128).
#   OUT=$OUT bash bench/attention/runs/2026-11-28-h200-s20-ncu-cudnn/prof_bwd.sh
source "$(dirname "$0")/../2026-11-27-h200-s17-ncu/bin_setup.sh"  # primus into $BIN, library path, $NCU
for shape in ${SHAPES:-2x8192x16x16x128}; do
  for be in CUDNN TURBO; do
    if [ $be = CUDNN ]; then k='regex:bprop'; else k='regex:flash_bwd_sm90_ws'; fi
    f=$OUT/ncu_bwd_${shape//[^0-9a-zA-Z]/_}_$be.txt
    $NCU --clock-control none --section LaunchStats --section SpeedOfLight --section Occupancy \
      -k "$k" --launch-skip ${SKIP:-8} --launch-count 2 $BIN/primus benchmark attention --shapes $shape --backend $be \
      --iters 5 > "$f" 2>&1
    echo "== $shape $be"
    grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per|Dynamic Shared Memory Per|Compute \(SM\) Throughput|L2 Cache Throughput|Achieved Occupancy" "$f" | cut -c1-150 | head -20
  done
done
