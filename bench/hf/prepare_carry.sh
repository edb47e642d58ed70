#!/usr/bin/env bash
# Fills .carry-hf (ignored by git through .git/info/exclude) for bench/hf/run_on_gpu.sh: primus and
# the GPU test binaries (xz), libgomp.so.1, tinyshakespeare (from ../shared/data, which does not
# travel) and commit.txt. Usage, from the repository root:
#   bench/hf/prepare_carry.sh [build-dir]      (default build)
set -eu
BUILD=${1:-build}
CARRY=.carry-hf
BINS=${BINS:-"primus test_cuda_gpu test_cuda_unit test_turbo_gpu test_attention_gpu"}
# shellcheck disable=SC2086  # the targets are words
flock /tmp/primus-build.lock cmake --build "$BUILD" -j2 --target $BINS
mkdir -p "$CARRY"
rm -f "$CARRY"/*.xz
for b in $BINS; do xz -T2 -6 -c "$BUILD/bin/$b" > "$CARRY/$b.xz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
cp ../shared/data/tinyshakespeare.txt "$CARRY/"
dirty=$(git diff --quiet HEAD || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-hf/' .git/info/exclude || echo '/.carry-hf/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
