#!/usr/bin/env bash
# One device call comparing two builds of primus on MoE training, alternating in the same call:
# $CARRY/primus_base.xz (before) and $CARRY/primus.xz (after), ROUNDS times each (default 2) on
# PRESET (default olmoe-mini: examples/cuda/<preset>.yaml, mock data, micro-batch 4 x 2048), STEPS
# steps (default 16), tokens/s the mean of the last MEASURE (default 8); EXTRA adds overrides to
# both. GG_SHAPES (grouped_gemm syntax, default olmoe's fc) also times the TURBO grouped GEMM with
# both binaries. TURBO_FILTER / CUDA_FILTER run the new build's GPU tests first (empty: none).
# Prints a short table last. From the repository root, after bench/moe/prepare_carry.sh and
# copying the earlier build's primus.xz to $CARRY/primus_base.xz:
#   run(command="bash bench/moe/ab_on_gpu.sh", carry=[".carry-moe"])
set -u
CARRY=${CARRY:-.carry-moe}
BIN=/tmp/moe-bin
PRESET=${PRESET:-olmoe-mini}
STEPS=${STEPS:-16}
MEASURE=${MEASURE:-8}
ROUNDS=${ROUNDS:-2}
GG_SHAPES=${GG_SHAPES:-8192x64x8x2048x2048}
# shellcheck source=scripts/gpu_carry.sh
source scripts/gpu_carry.sh
T=/tmp/moe-ab
mkdir -p "$T"
: > "$T/table.txt"
if [ -n "${TURBO_FILTER:-}" ]; then
  timeout 240 "$BIN/test_turbo_gpu" --gtest_brief=1 --gtest_filter="$TURBO_FILTER" > "$T/turbo.log" 2>&1
  echo "test_turbo_gpu ($TURBO_FILTER): rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$T/turbo.log" | tr '\n' ' ')" | tee -a "$T/table.txt"
fi
if [ -n "${CUDA_FILTER:-}" ]; then
  timeout 300 "$BIN/test_cuda_gpu" --gtest_brief=1 --gtest_filter="$CUDA_FILTER" > "$T/cuda.log" 2>&1
  echo "test_cuda_gpu ($CUDA_FILTER): rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$T/cuda.log" | tr '\n' ' ')" | tee -a "$T/table.txt"
fi
for b in primus_base primus; do
  timeout 120 "$BIN/$b" benchmark grouped_gemm --backend TURBO --shapes "$GG_SHAPES" > "$T/gg.$b.txt" 2>&1
  echo "== grouped_gemm $b"; grep -E "TURBO" "$T/gg.$b.txt" | head -6
done
for r in $(seq 1 "$ROUNDS"); do
  for b in primus_base primus; do
    rm -rf "$T/ws"
    # shellcheck disable=SC2086  # EXTRA holds words
    timeout 240 "$BIN/$b" train pretrain --config "examples/cuda/$PRESET.yaml" train_iters="$STEPS" micro_batch_size=4 \
      global_batch_size=4 save_at_end=false workspace="$T/ws" exp_name=m ${EXTRA:-} > "$T/$b.$r.log" 2>&1
    python3 - "$T" "$b" "$r" "$MEASURE" <<'PY' | tee -a "$T/table.txt"
import glob, json, sys
t, b, r, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
f = glob.glob(f"{t}/ws/*/*/m/metrics.jsonl")
m = [json.loads(l) for l in open(f[0]) if '"tokens_per_s"' in l][-n:] if f else []
v = sum(s["tokens_per_s"] * s["step_s"] for s in m) / sum(s["step_s"] for s in m) if m else 0
print(f"round {r} {b}: {v:,.0f} tok/s (loss {m[-1]['loss']:.4f})" if m else f"round {r} {b}: no metrics")
PY
  done
done
python3 - "$T/table.txt" <<'PY'
import re, sys
v = {"primus_base": [], "primus": []}
for l in open(sys.argv[1]):
    m = re.match(r"round \d+ (\S+): ([\d,]+) tok/s", l)
    if m: v[m.group(1)].append(float(m.group(2).replace(",", "")))
if v["primus_base"] and v["primus"]:
    a, b = sum(v["primus_base"]) / len(v["primus_base"]), sum(v["primus"]) / len(v["primus"])
    print(f"mean: base {a:,.0f}, new {b:,.0f} tok/s: {b / a:.4f}x")
PY
echo "== table"; cat "$T/table.txt"
