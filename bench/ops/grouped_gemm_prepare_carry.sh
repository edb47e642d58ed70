#!/usr/bin/env bash
# Fills .carry-gg (ignored through .git/info/exclude) for bench/ops/grouped_gemm_on_gpu.sh from the
# shared CUDA build: primus.gz, test_turbo_gpu.gz, libgomp.so.1 and commit.txt. Builds the two
# targets under the build lock first. Usage, from the repository root:
#   bench/ops/grouped_gemm_prepare_carry.sh [build-dir]      (default build)
set -eu
BUILD=${1:-build}
CARRY=.carry-gg
flock /tmp/primus-build.lock cmake --build "$BUILD" -j2 --target primus test_turbo_gpu
mkdir -p "$CARRY"
for b in primus test_turbo_gpu; do gzip -6 -c "$BUILD/bin/$b" > "$CARRY/$b.gz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
dirty=$(git diff --quiet HEAD -- turbo cli || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-gg/' .git/info/exclude || echo '/.carry-gg/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
