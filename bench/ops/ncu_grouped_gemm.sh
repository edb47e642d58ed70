#!/usr/bin/env bash
# Profile the TURBO grouped GEMM with Nsight Compute: one launch of the forward and one of the
# weight gradient of one product, each with its details page and its per-instruction (SASS) table
# of stall samples, so where a kernel's warps wait can be read instruction by instruction. Runs on
# the GPU machine over .carry-gg (bench/ops/grouped_gemm_prepare_carry.sh):
#   run(command="SHAPE=8192x64x8x2048x2048 bash bench/ops/ncu_grouped_gemm.sh", carry=[".carry-gg"])
# SHAPE is `primus benchmark grouped_gemm`'s tokens x experts x topk x N x K. KINDS (default
# "fwd wgrad") picks the launches: fwd, wgrad, dgrad (the plain input gradient of SHAPE), and
# dgrad_swiglu (the input gradient with SwiGLU in its epilogue, of the benchmark's first proj layer,
# olmoe's balanced one: --shapes cases carry no SwiGLU, so this kind runs the default cases). Writes
# $OUT/ncu_<kind>.txt (details) and $OUT/sass_<kind>.csv (source page), and prints the summary and
# the instructions with the most stall samples.
CARRY=${CARRY:-.carry-gg}
SHAPE=${SHAPE:-8192x64x8x2048x2048}
# shellcheck source=bench/ops/ncu_setup.sh
source bench/ops/ncu_setup.sh
set -uo pipefail
# The kernels' template arguments tell them apart (demangled as "(int)0"): the forward is rows mode
# with both operands K-major, the weight gradient writes f32.
for kind in ${KINDS:-fwd wgrad}; do
  shapes=(--shapes "$SHAPE")
  case "$kind" in
    fwd) filt='regex:grouped_gemm_sm90_kernel<__nv_bfloat16, __nv_bfloat16, \(int\)0, \(int\)0, \(int\)0,' ;;
    wgrad) filt='regex:grouped_gemm_sm90_kernel<__nv_bfloat16, float, \(int\)1,' ;;
    dgrad) filt='regex:grouped_gemm_sm90_kernel<__nv_bfloat16, __nv_bfloat16, \(int\)0, \(int\)0, \(int\)1, \(int\)128, \(bool\)1, \(bool\)0, \(int\)0>' ;;
    dgrad_swiglu) filt='regex:grouped_gemm_sm90_kernel<__nv_bfloat16, __nv_bfloat16, \(int\)0, \(int\)0, \(int\)1, \(int\)128, \(bool\)1, \(bool\)0, \(int\)2>'
                  shapes=() ;;
    *) echo "KINDS: unknown kind $kind"; exit 2 ;;
  esac
  "$NCU" --clock-control none --set full --import-source no --kernel-name-base demangled -k "$filt" \
    --launch-skip 3 --launch-count 1 -o "/tmp/pb/$kind" -f \
    /tmp/pb/primus benchmark grouped_gemm --backend TURBO "${shapes[@]}" > "/tmp/pb/$kind.log" 2>&1
  "$NCU" --import "/tmp/pb/$kind.ncu-rep" --page details > "$OUTDIR/ncu_$kind.txt" 2>&1
  "$NCU" --import "/tmp/pb/$kind.ncu-rep" --page source --print-source sass --csv > "$OUTDIR/sass_$kind.csv" 2>&1
  echo "== $kind (${shapes[1]:-the default benchmark cases})"
  grep -E 'Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per Thread|Executed Ipc Active|Issue Slots Busy' \
    "$OUTDIR/ncu_$kind.txt" | head -12
  tail -2 "/tmp/pb/$kind.log"
done
