#!/usr/bin/env bash
# Fills .carry-hf (ignored by git through .git/info/exclude) for bench/hf/run_on_gpu.sh: primus and
# the GPU test binaries (xz), libgomp.so.1, tinyshakespeare (from ../shared/data, which does not
# travel) and commit.txt. Usage, from the repository root:
#   bench/hf/prepare_carry.sh [build-dir]      (default build)
set -eu
source bench/tools/carry.sh
# shellcheck disable=SC2086  # the targets are words
carry_pack .carry-hf "${1:-build}" ${BINS:-primus test_cuda_gpu test_cuda_unit test_turbo_gpu test_attention_gpu}
cp ../shared/data/tinyshakespeare.txt .carry-hf/
du -ch .carry-hf/* | tail -1
