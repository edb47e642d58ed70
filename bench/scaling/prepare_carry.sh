#!/usr/bin/env bash
# Builds what bench/scaling/run_on_gpu.sh needs on the GPU machine and fills .carry-scaling
# (ignored through .git/info/exclude): primus.gz, test_nccl_gpu.gz, nccl_test_worker.gz,
# libgomp.so.1 and commit.txt. NCCL is not carried: primus loads the machine's (PyTorch's wheel)
# at run time. Usage, from the repository root:
#   bash bench/scaling/prepare_carry.sh [build-dir]      (default build-gpu)
set -eu
BUILD=${1:-build-gpu}
CARRY=.carry-scaling
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DPRIMUS_CUDA=ON
fi
cmake --build "$BUILD" -j2 --target primus test_nccl_gpu nccl_test_worker
mkdir -p "$CARRY"
for b in primus test_nccl_gpu nccl_test_worker; do gzip -9 -c "$BUILD/bin/$b" > "$CARRY/$b.gz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
dirty=$(git diff --quiet HEAD -- backends/cuda parallel train turbo || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-scaling/' .git/info/exclude || echo '/.carry-scaling/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
