#!/usr/bin/env bash
# The TURBO GELU-aux GEMM (fc forward, 16384x3072x768 by default) under Nsight Compute, one launch
# per variant of VARIANTS (environment settings; "-" = none): the speed-of-light, warp-state and
# pipe figures, and the 40 SASS instructions with the most warp-stall samples (program order).
#   run(command="OUT=$OUT CARRY=.carry-gelu bash bench/ops/runs/2026-11-28-h200-s21-gelu-defer/ncu_gelu.sh", carry=[".carry-gelu"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
set -u
CARRY=${CARRY:-.carry-gelu}
OUT=${OUT:-/tmp/ncu-gelu}
SHAPE=${SHAPE:-16384x3072x768+gelu}
VARIANTS=${VARIANTS:-"PRIMUS_TURBO_GEMM_GELU_DEFER=0 PRIMUS_TURBO_GEMM_GELU_DEFER=1"}
BIN=/tmp/ncu-gelu-bin
mkdir -p "$OUT" "$BIN"
gunzip -c "$CARRY/primus.gz" > "$BIN/primus" && chmod +x "$BIN/primus"
export LD_LIBRARY_PATH=$BIN:$PWD/$CARRY:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
i=0
for v in $VARIANTS; do
  i=$((i + 1))
  e=""; [ "$v" != - ] && e=$v
  # The case's first product is the GELU-aux forward: skip its first launches (warm-up), take one.
  env $e "$NCU" --clock-control none --set full --import-source no -k regex:gemm_sm90_kernel --launch-skip 3 --launch-count 1 \
    "$BIN/primus" benchmark gemm --shapes "$SHAPE" --backend TURBO --iters 5 > "$OUT/details_$i.txt" 2>&1
  env $e "$NCU" --clock-control none --section SourceCounters --section WarpStateStats -k regex:gemm_sm90_kernel \
    --launch-skip 3 --launch-count 1 --page source --print-source sass --csv \
    "$BIN/primus" benchmark gemm --shapes "$SHAPE" --backend TURBO --iters 5 > "$OUT/sass_$i.csv" 2> "$OUT/sass_err_$i.txt"
  echo "== variant $i: $v"
  grep -E "^  [a-z_]+.*gemm_sm90_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc Active|Issue Slots Busy|Warp Cycles Per Issued Instruction|Registers Per Thread|Dynamic Shared Memory Per Block|Tensor" "$OUT/details_$i.txt" | head -20
  grep -E "Stall [A-Z][a-z]+ .*[0-9]" "$OUT/details_$i.txt" | head -12
  python3 - "$OUT/sass_$i.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
try:
    hdr_i = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r))
except StopIteration:
    print("no source page"); sys.exit()
hdr = rows[hdr_i]; body = rows[hdr_i + 1:]
def col(name):
    for i, h in enumerate(hdr):
        if h.startswith(name): return i
src = col("Source"); samp = col("Warp Stall Sampling (All")
if samp is None: samp = col("Warp Stall Sampling")
tot = sum(float(r[samp] or 0) for r in body if len(r) > samp) or 1
print("samples", tot, "instructions", len(body))
top = sorted(range(len(body)), key=lambda i: -float(body[i][samp] or 0))[:40]
for i in sorted(top):
    print(f"{i:5d} {float(body[i][samp] or 0) / tot * 100:5.1f}%  {body[i][src][:100]}")
PY
done
