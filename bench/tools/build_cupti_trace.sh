#!/usr/bin/env bash
# Builds turbo/bench/tools/cupti_trace.cpp (the CUPTI tracer bench/train/gaps.sh preloads) into
# .carry-cuda/libcupti_trace.so, and copies libcupti.so.13 beside it for GPU machines whose CUDA
# install lacks CUPTI. Usage from the repository root:
#   bash bench/tools/build_cupti_trace.sh [carry-dir]
set -eu
CARRY=${1:-.carry-cuda}
CUDA=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$CARRY"
g++ -O2 -std=c++17 -shared -fPIC -I"$CUDA/include" turbo/bench/tools/cupti_trace.cpp -o "$CARRY/libcupti_trace.so" \
  -L"$CUDA/lib64" -L"$CUDA/lib" -lcupti -Wl,-rpath,'$ORIGIN'
lib=$(ls "$CUDA"/lib64/libcupti.so.13 "$CUDA"/lib/libcupti.so.13 "$CUDA"/extras/CUPTI/lib64/libcupti.so.13 2>/dev/null | head -1)
[ -n "$lib" ] && cp -L "$lib" "$CARRY/libcupti.so.13"
ls -la "$CARRY"/libcupti*
