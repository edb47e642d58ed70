#!/usr/bin/env bash
# Fills .carry-moe (ignored by git through .git/info/exclude) for bench/moe/run_on_gpu.sh:
# primus.xz, test_cuda_gpu.xz, test_turbo_gpu.xz (a CUDA build), libgomp.so.1, the MoE anchor
# (../shared/bench/torch_moe_anchor.py) and commit.txt. Usage, from the repository root:
#   bench/moe/prepare_carry.sh [build-dir]      (default build)
set -eu
BUILD=${1:-build}
CARRY=.carry-moe
cmake --build "$BUILD" -j2 --target primus test_cuda_gpu test_turbo_gpu
mkdir -p "$CARRY"
for b in primus test_cuda_gpu test_turbo_gpu; do xz -T2 -6 -c "$BUILD/bin/$b" > "$CARRY/$b.xz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
cp ../shared/bench/torch_moe_anchor.py "$CARRY/"
dirty=$(git diff --quiet HEAD || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-moe/' .git/info/exclude || echo '/.carry-moe/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
