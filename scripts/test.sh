#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, runs ctest (GPU tests skip themselves when
# no GPU is present), then runs the unit and e2e tests again in an AddressSanitizer +
# UndefinedBehaviorSanitizer build (scripts/sanitize.sh, build-asan) and ends with a fuzz smoke
# run (scripts/fuzz.sh, build-fuzz). Exits non-zero when a build or a test fails or a sanitizer
# or a fuzz target reports.
# Usage: scripts/test.sh [--build-dir DIR] [extra ctest args]
#   PRIMUS_SANITIZE=0       skip the sanitizer pass (a quick local run; CI keeps it)
#   PRIMUS_FUZZ_RUNS=N      inputs per fuzz target in the fuzz smoke run (default 10000, seed 1:
#                           reproducible, so CI cannot fail by chance; 0 skips it; needs clang-14,
#                           which setup.sh installs). Longer, random-seeded campaigns: scripts/fuzz.sh.
#
# The three builds (Release in DIR, build-asan, build-fuzz) run side by side under one make whose
# jobserver lends them $(nproc) compile jobs in all: where one build alone would leave a core idle
# (its configure step, a link, the end of a dependency chain) another one's compile takes it. The
# tests start once all three are built, so no compile competes with a test's timing. Each stage's
# start is logged with the seconds since the script began; each build's lines carry its name.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build
if [ "${1:-}" = "--build-dir" ]; then BUILD_DIR=$2; shift 2; fi
SANITIZE=${PRIMUS_SANITIZE:-1}
FUZZ_RUNS=${PRIMUS_FUZZ_RUNS:-10000}
JOBS=$(nproc)
t0=$(date +%s)
stage() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

stage "packages"
scripts/setup.sh --no-build
rc=0
builds=(main)
[ "$SANITIZE" != 0 ] && builds+=(asan)
if [ "$FUZZ_RUNS" != 0 ]; then
  if command -v clang++-14 >/dev/null; then
    builds+=(fuzz)
  else
    echo "clang++-14 is missing (scripts/setup.sh installs it): the fuzz smoke run fails" >&2
    rc=1
    FUZZ_RUNS=0
  fi
fi

stage "builds: ${builds[*]} ($JOBS jobs in all)"
# -k: the other builds go on when one fails, so one run shows every build's errors.
make -k --no-print-directory -j"$JOBS" -f - "${builds[@]}" <<EOF || { stage "a build failed"; exit 1; }
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
.PHONY: main asan fuzz
main: ; +@scripts/setup.sh --build-dir $(printf %q "$BUILD_DIR") 2>&1 | sed -u 's/^/[main] /'
asan: ; +@scripts/sanitize.sh --no-test 2>&1 | sed -u 's/^/[asan] /'
fuzz: ; +@scripts/fuzz.sh --no-run 2>&1 | sed -u 's/^/[fuzz] /'
EOF

stage "tests (ctest in $BUILD_DIR)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 900 "$@") || rc=1
if [ "$SANITIZE" != 0 ]; then
  stage "sanitizer pass (ASan + UBSan, build-asan)"
  scripts/sanitize.sh --no-build || rc=1
fi
if [ "$FUZZ_RUNS" != 0 ]; then
  stage "fuzz smoke run (${FUZZ_RUNS} inputs per target, seed 1)"
  scripts/fuzz.sh --no-build --runs "$FUZZ_RUNS" --seed 1 --jobs "$JOBS" || rc=1
fi
stage "done, exit $rc"
exit $rc
