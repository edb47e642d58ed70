#!/usr/bin/env bash
# Builds what bench/train/run_on_gpu.sh needs on the GPU machine and fills .carry-cuda (ignored
# by git through .git/info/exclude): primus.gz, test_cuda_gpu.gz (gzip keeps the carry small),
# libgomp.so.1 (OpenMP of the reference oracle in the tests; Ubuntu images may lack it),
# torch_anchor.py, bf16_noise_floor.py (the outside oracle the test stage runs on the test
# binary's PRIMUS_PARITY_DUMP output, which is written on the GPU machine) and commit.txt.
# Usage, from the repository root:
#   bench/train/prepare_carry.sh [build-dir]      (default build-cuda)
set -eu
BUILD=${1:-build-cuda}
CARRY=.carry-cuda
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -DPRIMUS_CUDA=ON
fi
make -C "$BUILD" -j2 primus test_cuda_gpu ${WITH_OPS_TESTS:+test_turbo_gpu test_attention_gpu}
mkdir -p "$CARRY"
# XZ=1: xz instead of gzip (~11 MB a binary against ~18: primus and the three test binaries then fit
# one call's 64 MiB; run_on_gpu.sh and env_ab.sh read either, the other bench/train scripts primus.gz).
rm -f "$CARRY"/*.gz "$CARRY"/*.xz
pack() {
  if [ -n "${XZ:-}" ]; then xz -T2 -6 -c "$BUILD/bin/$1" > "$CARRY/$1.xz"; else gzip -9 -c "$BUILD/bin/$1" > "$CARRY/$1.gz"; fi
}
pack primus
pack test_cuda_gpu
# WITH_OPS_TESTS=1: also test_turbo_gpu and test_attention_gpu (the FP8 GEMM / quantizer op tests
# and the deterministic attention backward's test in the test stage; OPS_TEST_FILTER='*' runs all).
if [ -n "${WITH_OPS_TESTS:-}" ]; then
  pack test_turbo_gpu
  pack test_attention_gpu
fi
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$CARRY/libgomp.so.1"
cp ../shared/bench/torch_anchor.py "$CARRY/torch_anchor.py" 2>/dev/null || cp /work/shared/bench/torch_anchor.py "$CARRY/"
cp tests/cuda_gpu/bf16_noise_floor.py "$CARRY/bf16_noise_floor.py"
dirty=$(git diff --quiet HEAD -- backends/cuda turbo train || echo "-dirty")
echo "$(git rev-parse --short HEAD)$dirty" > "$CARRY/commit.txt"
grep -qx '/.carry-cuda/' .git/info/exclude || echo '/.carry-cuda/' >> .git/info/exclude
du -ch "$CARRY"/* | tail -1
# A device call sends the tracked (and untracked, not ignored) files plus the carry: 64 MiB at most.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carry=$(du -cb "$CARRY"/* | tail -1 | cut -f1)
total=$((tree + carry))
echo "device call: working tree $((tree / 1048576)) MiB + carry $((carry / 1048576)) MiB = $((total / 1048576)) MiB (limit 64)"
if [ "$total" -gt $((64 * 1048576)) ]; then
  echo "prepare_carry.sh: over the device call's 64 MiB: leave out what the call does not need" \
    "(e.g. test_turbo_gpu.gz: run without WITH_OPS_TESTS; bench/train/run_on_gpu.sh skips the op tests then)" >&2
  exit 3
fi
