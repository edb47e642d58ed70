#!/usr/bin/env bash
# Fails when ptxas serialises the wgmma instructions of a Hopper kernel for lack of registers
# ("(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to
# insufficient register resources"): every wgmma then waits for the one before it, and nothing
# else in the build says so (the default head_dim-64 attention backward was once in that state,
# and measured 10-16% slower for it). Compiles each FILE's device code alone for sm_90a
# (-cubin, no host pass) with ptxas -v, lists its kernels' spills, and fails on any C7512 whose
# kernel does not match ALLOW (an extended regex over mangled names; default: order 0 of the
# 128-query backward, kept for A/B runs, which serialises by design).
# Usage: scripts/check_ptxas.sh NVCC SOURCE_ROOT FILE...      (FILE relative to SOURCE_ROOT)
# Registered as the CTest unit test ptxas_wgmma_not_serialised (tests/turbo_gpu/CMakeLists.txt).
set -u
nvcc=$1 root=$2
shift 2
allow=${ALLOW-'BwdWsConfigILi64ELi2ELi1ELi128ELi0EE'}
rc=0
for f in "$@"; do
  log=$("$nvcc" -I"$root" -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -O3 -arch=sm_90a --expt-relaxed-constexpr \
    -std=c++17 -Xptxas -v -cubin -o /dev/null "$root/$f" 2>&1) || {
    echo "$f: nvcc failed"
    echo "$log" | tail -20
    rc=1
    continue
  }
  kernels=$(grep -c "Compiling entry function" <<< "$log")
  serial=$(grep "C7512" <<< "$log" || true)
  allowed=0 bad=$serial
  if [ -n "$serial" ] && [ -n "$allow" ]; then
    allowed=$(grep -E -c "$allow" <<< "$serial" || true)
    bad=$(grep -E -v "$allow" <<< "$serial" || true)
  fi
  spills=$(grep -E -c "[1-9][0-9]* bytes spill stores" <<< "$log" || true)
  echo "$f: $kernels kernels, $spills with spills, $allowed serialised by design (ALLOW)"
  if [ -n "$bad" ]; then
    echo "$f: wgmma serialised for lack of registers (C7512) in:"
    sed "s/.*function '\([^']*\)'.*/\1/" <<< "$bad" | c++filt | sed 's/^/  /'
    rc=1
  fi
done
exit $rc
