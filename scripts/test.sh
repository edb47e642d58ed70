#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, runs ctest (GPU tests skip themselves when
# no GPU is present). Exits non-zero when any test fails.
# Usage: scripts/test.sh [--build-dir DIR] [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build
if [ "${1:-}" = "--build-dir" ]; then BUILD_DIR=$2; shift 2; fi
scripts/setup.sh --build-dir "$BUILD_DIR"
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
