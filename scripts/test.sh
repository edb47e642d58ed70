#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, runs ctest (GPU tests skip themselves when
# no GPU is present), then runs the unit and e2e tests again in an AddressSanitizer +
# UndefinedBehaviorSanitizer build (scripts/sanitize.sh, build-asan). Exits non-zero when any
# test fails or a sanitizer reports.
# Usage: scripts/test.sh [--build-dir DIR] [extra ctest args]
#   PRIMUS_SANITIZE=0       skip the sanitizer pass (a quick local run; CI keeps it)
#   PRIMUS_FUZZ_RUNS=N      inputs per fuzz target in the fuzz smoke run (default 10000, seed 1:
#                           reproducible, so CI cannot fail by chance; 0 skips it; needs clang-14,
#                           which setup.sh installs). Longer, random-seeded campaigns: scripts/fuzz.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build
if [ "${1:-}" = "--build-dir" ]; then BUILD_DIR=$2; shift 2; fi
scripts/setup.sh --build-dir "$BUILD_DIR"
rc=0
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@") || rc=1
if [ "${PRIMUS_SANITIZE:-1}" != 0 ]; then
  echo "== sanitizer pass (ASan + UBSan, build-asan)"
  scripts/sanitize.sh || rc=1
fi
PRIMUS_FUZZ_RUNS=${PRIMUS_FUZZ_RUNS:-10000}
if [ "$PRIMUS_FUZZ_RUNS" != 0 ]; then
  if command -v clang++-14 >/dev/null; then
    echo "== fuzz smoke run (${PRIMUS_FUZZ_RUNS} inputs per target, seed 1)"
    scripts/fuzz.sh --runs "$PRIMUS_FUZZ_RUNS" --seed 1 || rc=1
  else
    echo "clang++-14 is missing (scripts/setup.sh installs it): the fuzz smoke run fails" >&2
    rc=1
  fi
fi
exit $rc
