#!/usr/bin/env bash
# Fills .carry-turbo (ignored by git through .git/info/exclude) for bench/ops/run_on_gpu.sh and
# bench/attention/run_on_gpu.sh: primus.gz (the CUDA build whose `primus benchmark` is our side),
# test_turbo_gpu.gz, test_turbo_lazy_libs.gz, test_turbo_real_libs.gz, libgomp.so.1 and commit.txt. Usage, from the
# repository root:   bench/ops/prepare_carry.sh [build-dir]      (default build-turbo)
set -eu
BUILD=${1:-build-turbo}
CARRY=.carry-turbo
cmake --build "$BUILD" -j2 --target primus test_turbo_gpu test_turbo_lazy_libs test_turbo_real_libs
mkdir -p "$CARRY"
for b in primus test_turbo_gpu test_turbo_lazy_libs test_turbo_real_libs; do gzip -9 -c "$BUILD/bin/$b" > "$CARRY/$b.gz"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
dirty=$(git diff --quiet HEAD -- turbo cli || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-turbo/' .git/info/exclude || echo '/.carry-turbo/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
