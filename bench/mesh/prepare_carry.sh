#!/usr/bin/env bash
# Fills .carry-mesh (ignored through .git/info/exclude) for bench/mesh/run_on_gpu.sh: the GPU test
# binaries (xz), libgomp.so.1 and commit.txt. Usage, from the repository root:
#   bash bench/mesh/prepare_carry.sh [build-dir]      (default build; CUDA for sm_90a)
set -eu
BUILD=${1:-build}
CARRY=.carry-mesh
BINS=${BINS:-"test_cuda_gpu test_turbo_gpu test_threaded_gpu"}
# shellcheck disable=SC2086  # the targets are words
flock /tmp/primus-build.lock cmake --build "$BUILD" -j2 --target $BINS
mkdir -p "$CARRY"
rm -f "$CARRY"/*.xz
for b in $BINS; do xz -T2 -6 -c "$BUILD/bin/$b" > "$CARRY/$b.xz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
dirty=$(git diff --quiet HEAD || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-mesh/' .git/info/exclude || echo '/.carry-mesh/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
