#!/usr/bin/env bash
# Installs what is missing (Debian packages only; quick when everything is there) and builds
# build/bin/primus. Idempotent. Usage: scripts/setup.sh [--build-dir DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build
DO_BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    *) echo "setup.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

PACKAGES=(build-essential cmake libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libfmt-dev
          libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
          clang-14 libclang-rt-14-dev pkg-config libcairo2-dev libgloo-dev libutf8proc-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y --no-install-recommends "${missing[@]}" ||
    { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends "${missing[@]}"; }
fi

if [ "$DO_BUILD" = 1 ]; then
  # Unity build of the C++ sources (8 a compiler run; CMake 3.25 leaves the .cu files as they are):
  # most of a source's compile time is the headers it shares with the others. PRIMUS_UNITY_BUILD=OFF
  # builds source by source (e.g. to find a missing include).
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="${PRIMUS_UNITY_BUILD:-ON}" \
    -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 >/dev/null
  # Under scripts/test.sh the jobs come from its make's shared pool (the jobserver in MAKEFLAGS).
  case " ${MAKEFLAGS:-} " in *jobserver*) jobs=() ;; *) jobs=(-j "$(nproc)") ;; esac
  cmake --build "$BUILD_DIR" "${jobs[@]}"
fi
