#!/usr/bin/env bash
# Fills .carry-fp8 (ignored by git through .git/info/exclude) for bench/fp8/run_on_gpu.sh: primus
# and the GPU test binaries (xz), libgomp.so.1, the PyTorch anchors (torch_anchor.py,
# torch_fp8_anchor.py from ../shared/bench, which does not travel), scale_layout_probe and
# commit.txt. Usage, from the repository root:
#   bench/fp8/prepare_carry.sh [build-dir]      (default build)
set -eu
BUILD=${1:-build}
CARRY=.carry-fp8
BINS=${BINS:-"primus test_turbo_gpu test_cuda_gpu"}
# shellcheck disable=SC2086  # the targets are words
flock /tmp/primus-build.lock cmake --build "$BUILD" -j2 --target $BINS
mkdir -p "$CARRY"
rm -f "$CARRY"/*.xz
for b in $BINS; do xz -T2 -6 -c "$BUILD/bin/$b" > "$CARRY/$b.xz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
cp ../shared/bench/torch_anchor.py ../shared/bench/torch_fp8_anchor.py "$CARRY/"
nvcc -O2 -arch=sm_90a -o "$CARRY/scale_layout_probe" bench/fp8/scale_layout_probe.cu -lcublasLt
dirty=$(git diff --quiet HEAD || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-fp8/' .git/info/exclude || echo '/.carry-fp8/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
