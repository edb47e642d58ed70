# Per-instruction warp-stall samples of the warp-specialised TURBO attention backward (Nsight
# Compute source page, SASS), head_dim 128, T=2048: the 45 instructions with most samples, in
# program order context. From the repository root on the GPU machine: OUT=$OUT bash <this file>
source "$(dirname "$0")/bin_setup.sh"
SHAPE=${SHAPE:-8x2048x16x16x128}
$NCU --clock-control none --section SourceCounters --section WarpStateStats -k regex:flash_bwd_sm90_ws --launch-skip 2 --launch-count 1 \
  --page source --print-source sass --csv $BIN/primus benchmark attention --shapes $SHAPE --backend TURBO --iters 5 > $OUT/sass_$SHAPE.csv 2> $OUT/sass_err.txt
python3 - $OUT/sass_$SHAPE.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr_i = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r))
hdr = rows[hdr_i]; body = rows[hdr_i + 1:]
print("columns:", [h for h in hdr][:40])
def col(name):
    for i, h in enumerate(hdr):
        if h.startswith(name): return i
    return None
src = col("Source"); samp = col("Warp Stall Sampling (All")
if samp is None: samp = col("Warp Stall Sampling")
tot = sum(float(r[samp] or 0) for r in body if len(r) > samp)
print("total samples", tot, "instructions", len(body))
top = sorted(range(len(body)), key=lambda i: -float(body[i][samp] or 0))[:45]
for i in sorted(top):
    r = body[i]
    print(f"{i:5d} {float(r[samp] or 0) / tot * 100:5.1f}%  {r[src][:110]}")
PY
