#!/usr/bin/env bash
# Fills .carry-projection (ignored by git through .git/info/exclude) for
# bench/projection/run_on_gpu.sh: primus.xz (a CUDA build), libgomp.so.1 and commit.txt. Usage,
# from the repository root:
#   bench/projection/prepare_carry.sh [build-dir]      (default build)
set -eu
BUILD=${1:-build}
CARRY=.carry-projection
flock /tmp/primus-build.lock cmake --build "$BUILD" -j2 --target primus
mkdir -p "$CARRY"
xz -T2 -6 -c "$BUILD/bin/primus" > "$CARRY/primus.xz"
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
dirty=$(git diff --quiet HEAD || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-projection/' .git/info/exclude || echo '/.carry-projection/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
