#!/usr/bin/env bash
# Fills .carry-fp8 (ignored by git through .git/info/exclude) for bench/fp8/run_on_gpu.sh: primus
# and the GPU test binaries (xz), libgomp.so.1, the PyTorch anchors (torch_anchor.py,
# torch_fp8_anchor.py from ../shared/bench, which does not travel), scale_layout_probe and
# commit.txt. Usage, from the repository root:
#   bench/fp8/prepare_carry.sh [build-dir]      (default build)
set -eu
source bench/tools/carry.sh
BUILD=${1:-build}
CARRY=.carry-fp8
# shellcheck disable=SC2086  # the targets are words
carry_pack "$CARRY" "$BUILD" ${BINS:-primus test_turbo_gpu test_cuda_gpu}
cp ../shared/bench/torch_anchor.py ../shared/bench/torch_fp8_anchor.py "$CARRY/"
nvcc -O2 -arch=sm_90a -o "$CARRY/scale_layout_probe" bench/fp8/scale_layout_probe.cu -lcublasLt
du -ch "$CARRY"/* | tail -1
