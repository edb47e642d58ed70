#!/usr/bin/env bash
# The Hopper attention backward's dQ path, A/B in one device call (session 16): the attention GPU
# tests (GTEST_FILTER, default all), then `primus benchmark attention --backend TURBO` over SHAPES,
# ROUNDS times alternating the default (TMA reduce-adds) and PRIMUS_TURBO_ATTN_BWD_DQ=atomic, then
# CUDNN once on the same shapes. Carry: .carry-cuda with primus.gz, test_attention_gpu.gz, libgomp.so.1.
#   run(command="OUT=$OUT bash bench/attention/dq_ab.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/dq-ab-out}
BIN=/tmp/dq-ab-bin
mkdir -p "$OUT" "$BIN"
for f in .carry-cuda/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp .carry-cuda/lib*.so* "$BIN/" 2>/dev/null
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:${cudnn:-/x}:$(dirname "${lt:-/x/x}"):${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SHAPES=${SHAPES:-8x2048x16x16x128,2x8192x16x16x128,4x4096x32x8x128,16x1024x12x12x64}
if [ -x "$BIN/test_attention_gpu" ]; then
  timeout 400 "$BIN/test_attention_gpu" --gtest_brief=1 --gtest_filter="${GTEST_FILTER:-*}" > "$OUT/tests.log" 2>&1
  echo "test_attention_gpu rc=$?"; grep -E "FAILED|PASSED" "$OUT/tests.log" | tail -8
fi
for r in $(seq "${ROUNDS:-2}"); do
  for v in tma atomic; do
    PRIMUS_TURBO_ATTN_BWD_DQ=$v "$BIN/primus" benchmark attention --backend TURBO --iters 20 --shapes "$SHAPES" \
      --json "$OUT/${v}_$r.jsonl" > "$OUT/${v}_$r.log" 2>&1 || echo "$v round $r rc=$?"
  done
done
"$BIN/primus" benchmark attention --backend CUDNN --iters 20 --shapes "$SHAPES" --json "$OUT/cudnn.jsonl" > "$OUT/cudnn.log" 2>&1
python3 - "$OUT" "${ROUNDS:-2}" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
v = {}
for tag in ("tma", "atomic"):
    for r in range(1, rounds + 1):
        for l in open(f"{out}/{tag}_{r}.jsonl"):
            j = json.loads(l)
            if j.get("metric") == "TFLOP/s": v.setdefault((j["case"], tag), []).append(j["ours"])
for l in open(f"{out}/cudnn.jsonl"):
    j = json.loads(l)
    if j.get("metric") == "TFLOP/s": v.setdefault((j["case"], "cudnn"), []).append(j["ours"])
print(f"{'case':<40}{'TURBO tma':>10}{'atomic':>9}{'tma/atom':>9}{'CUDNN':>8}{'tma/CUDNN':>10}")
for case in dict.fromkeys(c for c, _ in v):
    m = {t: statistics.median(v[(case, t)]) for t in ("tma", "atomic", "cudnn") if (case, t) in v}
    g = lambda a, b: f"{m[a] / m[b]:.3f}" if a in m and b in m else "-"
    print(f"{case:<40}{m.get('tma', 0):>10.1f}{m.get('atomic', 0):>9.1f}{g('tma', 'atomic'):>9}{m.get('cudnn', 0):>8.1f}{g('tma', 'cudnn'):>10}")
PY
