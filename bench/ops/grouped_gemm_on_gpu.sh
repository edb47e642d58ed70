#!/usr/bin/env bash
# One device call for the grouped GEMM (turbo/ops/grouped_gemm.h): the GPU tests of the op, our
# benchmark (`primus benchmark grouped_gemm`: TURBO and CUBLASLT) and PyTorch's torch._grouped_mm
# (bench/ops/torch_grouped_mm.py) on exactly the groups our run used, back to back on one GPU;
# prints a short table, ratios last.
# Run from the repository root with the carried folder (default .carry-gg, filled by
# bench/ops/grouped_gemm_prepare_carry.sh) holding primus.gz, test_turbo_gpu.gz, libgomp.so.1 and
# commit.txt. STAGE=tests|bench|all (default all); TESTS=<gtest filter> (default every grouped GEMM
# test); ROUNDS, BACKEND, AB (below). Results in $OUT (tests.log with the device first, bench.log,
# torch.log, merged.jsonl); then, here:
#   cat <files_at>/merged.jsonl >> bench/results/grouped_gemm.jsonl
set -u
CARRY=${CARRY:-.carry-gg}
OUT=${OUT:-/tmp/gg-out}
BIN=/tmp/gg-bin
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
TV=$(python3 -c "import torch; print(torch.__version__)" 2>/dev/null)
DEV=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; echo "torch $TV")
echo "$DEV"
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  # A kernel that hangs must not eat the call: the tests get 150 s, and a timeout skips the bench.
  echo "$DEV" > "$OUT/tests.log"
  timeout 150 "$BIN/test_turbo_gpu" --gtest_filter="${TESTS:-*GroupedGemm*}" --gtest_brief=1 >> "$OUT/tests.log" 2>&1
  rc=$?
  tail -40 "$OUT/tests.log"
  echo "tests exit code $rc"
  if [ $rc = 124 ]; then echo "tests timed out: skipping the benchmark"; STAGE=tests; fi
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  # ROUNDS=n (default 2): ours and torch's n times each, alternating (a GPU's clocks drift over a
  # long run: measured side by side, neither side gets only the cool or only the hot minutes);
  # merge_ops.py keeps the medians and each ratio's range over the rounds.
  # BACKEND=TURBO times only ours (default: TURBO and CUBLASLT, cross-checked against each other).
  GG_GROUPS=/tmp/gg-groups.jsonl
  W=/tmp/gg-rounds
  rm -rf "$GG_GROUPS" "$W" "$OUT/merged.jsonl"
  mkdir -p "$W"
  ROUNDS=${ROUNDS:-2}
  # AB=1: ours is TURBO under each value of AB_VAR (default the schedule, values AB_VALUES, default
  # coop,pingpong; --ab, one value after the other in each round), and each value is set against
  # torch's rounds on its own (backend "TURBO[coop]", "TURBO[pingpong]"; for another variable
  # "TURBO[VAR=value]").
  AB_VAR=${AB_VAR:-PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE}
  AB_VALUES=${AB_VALUES:-coop,pingpong}
  for r in $(seq 1 "$ROUNDS"); do
    if [ "${AB:-0}" = 1 ]; then
      PRIMUS_BENCH_GROUPED_GEMM_GROUPS="$GG_GROUPS" timeout 240 "$BIN/primus" benchmark grouped_gemm --backend TURBO \
        --ab $AB_VAR=$AB_VALUES --ab-rounds 1 --json "$W/ab_r$r.jsonl" --commit "$COMMIT" >> "$OUT/bench.log" 2>&1
    else
      PRIMUS_BENCH_GROUPED_GEMM_GROUPS="$GG_GROUPS" timeout 240 "$BIN/primus" benchmark grouped_gemm \
        ${BACKEND:+--backend $BACKEND} --json "$W/ours_r$r.jsonl" --commit "$COMMIT" >> "$OUT/bench.log" 2>&1
    fi
    echo "ours, round $r: exit code $?"
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/ops/torch_grouped_mm.py --groups "$GG_GROUPS" \
      --out "$W/torch_r$r.jsonl" >> "$OUT/torch.log" 2>&1
    echo "torch, round $r: exit code $?"
  done
  torch_files=$(seq -f "$W/torch_r%g.jsonl" 1 "$ROUNDS")
  if [ "${AB:-0}" = 1 ]; then
    for sc in ${AB_VALUES//,/ }; do
      for r in $(seq 1 "$ROUNDS"); do
        python3 -c "
import json, sys
for l in open(sys.argv[1]):
    x = json.loads(l) if l.strip() else None
    if x and x.get('case', '').endswith(' [$AB_VAR=' + sys.argv[2] + ']'):
        x['case'] = x['case'].rsplit(' [', 1)[0]
        x['backend'] = 'TURBO[' + (sys.argv[2] if '$AB_VAR' == 'PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE' else '$AB_VAR=' + sys.argv[2]) + ']'
        print(json.dumps(x))" "$W/ab_r$r.jsonl" $sc > "$W/ours_${sc}_r$r.jsonl"
      done
      python3 bench/ops/merge_ops.py --bench grouped_gemm --ours $(seq -f "$W/ours_${sc}_r%g.jsonl" 1 "$ROUNDS") \
        --torch $torch_files --out "$OUT/merged.jsonl" --torch-version "$TV"
    done
  else
    python3 bench/ops/merge_ops.py --bench grouped_gemm --ours $(seq -f "$W/ours_r%g.jsonl" 1 "$ROUNDS") \
      --torch $torch_files --out "$OUT/merged.jsonl" --replace --torch-version "$TV"
  fi
  python3 - "$OUT/merged.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
vs = {(r["case"], r["backend"]): r for r in rows if str(r.get("anchor_name", "")).startswith("torch")}
cases = list(dict.fromkeys(c for c, _ in vs))
lanes = list(dict.fromkeys(b for _, b in vs))
print("\nTFLOP/s (median of the rounds); ratio = ours / torch._grouped_mm, same call, same groups [range over rounds]")
print(f"{'case':38s} {'torch':>7s}" + "".join(f" {b:>16s} {'ratio':>6s} {'range':>15s}" for b in lanes))
for c in cases:
    any_r = next(vs[(c, b)] for b in lanes if (c, b) in vs)
    line = f"{c[len('grouped_gemm/'):]:38s} {any_r['anchor']:7.1f}"
    for b in lanes:
        r = vs.get((c, b))
        line += f" {r['ours']:16.1f} {r['ratio']:6.3f} {str(r.get('ratio_range', '')):>15s}" if r else f" {'-':>16s} {'':6s} {'':15s}"
    print(line)
PY
fi
