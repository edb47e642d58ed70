#!/usr/bin/env bash
# Builds Primus with AddressSanitizer + UndefinedBehaviorSanitizer (PRIMUS_SANITIZE=ON, CPU
# only) in build-asan and runs the unit and e2e tests there. Exits non-zero when a test fails
# or a sanitizer reports: every report aborts the process that made it (a test binary, or a
# `primus` child of an e2e test, whose exit status the test checks).
#
# Usage: scripts/sanitize.sh [--build-dir DIR] [--no-build | --no-test] [extra ctest args]
#
# The libraries at -O1 -g1 without NDEBUG: asserts stay on, the tests run about 2-3x slower than
# Release instead of 10x at -O0, and reports carry file:line. The tests' own sources are at -O0
# (PRIMUS_TEST_OPT, cmake/Testing.cmake): half the compile time, and the tests' time is spent in
# the libraries. Tests labelled `slow_asan` (none at present; see docs/hardening.md) are skipped
# here because the Release run already covers them.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build-asan
BUILD=1
TEST=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --no-test) TEST=0; shift ;;
    *) break ;;
  esac
done
if [ "$BUILD" = 1 ]; then
  # A unity build (8 sources per compiler run): measured on 2 cores, 1,290 s instead of 2,058 s,
  # because most of each source's compile time is the headers it shares with the others.
  # PRIMUS_UNITY_BUILD=OFF builds source by source.
  cmake -S . -B "$BUILD_DIR" -DPRIMUS_SANITIZE=ON -DPRIMUS_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DCMAKE_UNITY_BUILD="${PRIMUS_UNITY_BUILD:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 >/dev/null
  # Only what the tests run (the test binaries and the CLI they drive): benchmarks and tools
  # would double the build time for nothing the tests exercise.
  targets=$(cmake --build "$BUILD_DIR" --target help | sed -n 's/^\.\.\. \(test_[A-Za-z0-9_]*\|primus\)$/\1/p')
  # Under scripts/test.sh the jobs come from its make's shared pool (the jobserver in MAKEFLAGS).
  case " ${MAKEFLAGS:-} " in *jobserver*) jobs=() ;; *) jobs=(-j "$(nproc)") ;; esac
  cmake --build "$BUILD_DIR" "${jobs[@]}" --target $targets
fi
[ "$TEST" = 1 ] || exit 0
# halt/abort on the first report, so nothing is only printed; leaks count as errors.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" --timeout 900 -L 'unit|e2e' -LE 'slow_asan' "$@"
