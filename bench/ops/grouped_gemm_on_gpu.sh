#!/usr/bin/env bash
# One device call for the grouped GEMM (turbo/ops/grouped_gemm.h): the GPU tests of the op, our
# benchmark (`primus benchmark grouped_gemm`: TURBO and CUBLASLT) and PyTorch's torch._grouped_mm
# (bench/ops/torch_grouped_mm.py) on exactly the groups our run used, back to back on one GPU;
# prints a short table, ratios last.
# Run from the repository root with the carried folder (default .carry-gg, filled by
# bench/ops/grouped_gemm_prepare_carry.sh) holding primus.gz, test_turbo_gpu.gz, libgomp.so.1 and
# commit.txt. STAGE=tests|bench|all (default all); TESTS=<gtest filter> (default every grouped GEMM
# test); ROUNDS, BACKEND (below); AB=1 adds the TURBO schedule A/B (coop against pingpong,
# `--ab PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE=coop,pingpong`). Results in $OUT (tests.log with the
# device first, bench.log, torch.log, ab.log, ab.jsonl, merged.jsonl); then, here:
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
  rm -rf "$GG_GROUPS" "$W" "$OUT/merged.jsonl" "$OUT/ab.jsonl"
  mkdir -p "$W"
  ROUNDS=${ROUNDS:-2}
  for r in $(seq 1 "$ROUNDS"); do
    PRIMUS_BENCH_GROUPED_GEMM_GROUPS="$GG_GROUPS" timeout 240 "$BIN/primus" benchmark grouped_gemm \
      ${BACKEND:+--backend $BACKEND} --json "$W/ours_r$r.jsonl" --commit "$COMMIT" >> "$OUT/bench.log" 2>&1
    echo "ours, round $r: exit code $?"
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/ops/torch_grouped_mm.py --groups "$GG_GROUPS" \
      --out "$W/torch_r$r.jsonl" >> "$OUT/torch.log" 2>&1
    echo "torch, round $r: exit code $?"
  done
  if [ "${AB:-0}" = 1 ]; then
    timeout 200 "$BIN/primus" benchmark grouped_gemm --backend TURBO --ab PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE=coop,pingpong \
      --json "$OUT/ab.jsonl" --commit "$COMMIT" > "$OUT/ab.log" 2>&1
    echo "schedule A/B exit code $?"
  fi
  python3 bench/ops/merge_ops.py --bench grouped_gemm --ours $(seq -f "$W/ours_r%g.jsonl" 1 "$ROUNDS") \
    --torch $(seq -f "$W/torch_r%g.jsonl" 1 "$ROUNDS") --out "$OUT/merged.jsonl" --replace --torch-version "$TV"
  python3 - "$OUT/merged.jsonl" "$OUT/ab.jsonl" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ab = {}
if os.path.exists(sys.argv[2]):
    for l in open(sys.argv[2]):
        r = json.loads(l) if l.strip() else {}
        if "[PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE=" in r.get("case", ""):
            name, sched = r["case"].split(" [PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE=")
            ab[(name, sched.rstrip("]"))] = r["ours"]
vs = {(r["case"], r["backend"]): r for r in rows if str(r.get("anchor_name", "")).startswith("torch")}
cases = list(dict.fromkeys(c for c, _ in vs))
f = lambda x: f"{x:8.1f}" if isinstance(x, (int, float)) else f"{'-':>8s}"
print(f"\nTFLOP/s; ratios over torch._grouped_mm (same call, same groups)")
print(f"{'case':40s} {'torch':>8s} {'cuBLASLt':>8s} {'coop':>8s} {'pingpong':>8s} {'TURBO':>8s}  {'TURBO/torch':>11s} {'range':>13s}")
for c in cases:
    t, l = vs.get((c, "TURBO")), vs.get((c, "CUBLASLT"))
    torch_tf = (t or l)["anchor"]
    co, pp = ab.get((c, "coop")), ab.get((c, "pingpong"))
    print(f"{c[len('grouped_gemm/'):]:40s} {f(torch_tf)} {f(l and l['ours'])} {f(co)} {f(pp)} {f(t and t['ours'])}  "
          f"{(t['ratio'] if t else float('nan')):11.3f} {str(t.get('ratio_range', '')) if t else '':>13s}")
PY
fi
