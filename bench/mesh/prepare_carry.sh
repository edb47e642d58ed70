#!/usr/bin/env bash
# Fills .carry-mesh (ignored through .git/info/exclude) for bench/mesh/run_on_gpu.sh: the GPU test
# binaries and primus (xz), libgomp.so.1 and commit.txt (bench/tools/carry.sh). Usage, from the
# repository root:
#   bash bench/mesh/prepare_carry.sh [build-dir]      (default build; CUDA for sm_90a)
set -eu
source bench/tools/carry.sh
# shellcheck disable=SC2086  # the targets are words
carry_pack .carry-mesh "${1:-build}" ${BINS:-primus test_cuda_gpu test_turbo_gpu test_threaded_gpu}
du -ch .carry-mesh/* | tail -1
