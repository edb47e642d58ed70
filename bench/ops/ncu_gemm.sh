#!/usr/bin/env bash
# Profile one GEMM product with Nsight Compute under both kernel backends (TURBO and CUBLASLT), one
# kernel launch each, so their launch shapes (grid, cluster, shared memory), tensor-pipe activity,
# L2 / DRAM traffic and stall reasons can be read side by side. Runs on the GPU machine over a carry
# made by bench/train/prepare_carry.sh:
#   CARRY=.carry-cuda SHAPES="16384x2304x768" bash bench/ops/ncu_gemm.sh
# Writes $OUT/ncu_<shape>_<backend>.txt (details page) and a short summary on stdout.
CARRY=${CARRY:-.carry-cuda}
SHAPES=${SHAPES:-16384x2304x768}
# shellcheck source=bench/ops/ncu_setup.sh
source bench/ops/ncu_setup.sh
set -euo pipefail
for shape in $SHAPES; do
  for be in TURBO CUBLASLT; do
    f="$OUTDIR/ncu_${shape//[^0-9a-zA-Z]/_}_${be}.txt"
    # One timed launch of the product's kernel. TURBO's kernel is gemm_sm90_kernel; cuBLASLt's
    # are also what the run's ceiling (an 8192^3 GEMM, at most ~25 launches) runs first, so skip
    # past those into the product's 40 timed launches.
    if [ "$be" = TURBO ]; then filt='regex:gemm_sm90_kernel'; skip=5; else filt='regex:nvjet|xmma|gemm|cutlass'; skip=32; fi
    "$NCU" --clock-control none --set full --launch-skip "$skip" --launch-count 1 -k "$filt" \
      /tmp/pb/primus benchmark gemm --shapes "$shape" --backend "$be" --iters 40 > "$f" 2>&1 || true
    echo "== $shape $be"
    grep -E '^  [A-Za-z_].*\(|Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Grid Size|Cluster Size|Block Size|Dynamic Shared Memory Per Block|Registers Per Thread|Executed Ipc Active' "$f" | head -24 || true
  done
done
