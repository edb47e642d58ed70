#!/usr/bin/env bash
# The FP8 quantizers' hot kernels keep their chunks in registers: none of their instantiations may
# touch local memory (a chunk whose address escapes, e.g. into a non-inlined helper, makes the
# compiler store every loaded chunk to local memory; on H200 that cost the tile and folded SwiGLU
# quantizers 27-36% of their time). Compiles the source to PTX for sm_90a at -O3, as the build does,
# and counts .local accesses per kernel entry.
# Usage: ptx_local_memory_test.sh NVCC SOURCE_ROOT FILE KERNEL...   (FILE relative to SOURCE_ROOT)
set -euo pipefail
nvcc=$1 root=$2 file=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$nvcc" -O3 -DNDEBUG -arch=compute_90a --expt-relaxed-constexpr -std=c++17 -I"$root" -ptx "$root/$file" \
  -o "$tmp/out.ptx"
status=0
for kernel in "$@"; do
  # one line per matching entry: its count of .local lines up to the entry's closing brace
  report=$(awk -v k="$kernel" '
    /^(\.visible )?\.entry / { inside = index($0, k) > 0; n = 0; next }
    inside && /\.local/ { n++ }
    inside && /^}/ { print n; inside = 0 }' "$tmp/out.ptx")
  entries=$(printf '%s\n' "$report" | grep -c . || true)
  if [ "$entries" -eq 0 ]; then
    echo "FAIL: no kernel named like '$kernel' in $file (renamed? update the test)"
    status=1
    continue
  fi
  bad=$(printf '%s\n' "$report" | awk '$1 > 0' | wc -l)
  if [ "$bad" -gt 0 ]; then
    echo "FAIL: $bad of $entries instantiations of $kernel use local memory ($file)"
    status=1
  else
    echo "ok: $entries instantiations of $kernel, no local memory"
  fi
done
exit $status
