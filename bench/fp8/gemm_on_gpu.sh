#!/usr/bin/env bash
# One device call for issue #38 [fp8], the FP8 GEMMs: `primus benchmark gemm_fp8` (turbo::gemm on
# E4M3 operands, tensorwise / rowwise / blockwise 1x128 x 128x128 scales, bf16 out; CUBLASLT) and
# torch._scaled_mm on the same shapes and scales (bench/fp8/gemm_torch.py, from this checkout),
# ROUNDS (3) times each, alternating (ours, torch, ours, torch, ...: a GPU's clocks drift over a
# call, so neither side gets only the cool or only the hot minutes); then gemm_torch.py --merge
# pairs the shapes and writes DESIGN.md "Measurements" rows, a table last. From the repository
# root with .carry-fp8 (bench/fp8/prepare_carry.sh; BINS=primus is enough here; the carried primus
# must have the gemm_fp8 family):
#   run(command="bash bench/fp8/gemm_on_gpu.sh", carry=[".carry-fp8"])
# Options (environment): ROUNDS (3); ITERS (50 timed calls per product, each side); SHAPES (MxNxK,...;
# default: the family's GPU cases, Llama-3.2-1B and GPT-2 124M at 16384 tokens and 8192^3, the
# same list as gemm_torch.py's); ALGO_SEARCH=n (our cuBLASLt algorithm search over its top n,
# PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH, as training runs it; default: the heuristic's first, as torch);
# BUDGET_S (225: every stage's timeout is cut to what is left of it, so the call ends with its rows);
# IDLE_MS (10: our side idles this long before each timed series, as gemm_torch.py's ~10 ms
# torch.cuda._sleep does; 0: none), IDLE_ON (device: a spin kernel our timed calls queue behind, as
# torch's; host: the GPU idles and our host gets no lead), TORCH_SLEEP_CYCLES (gemm_torch.py's spin,
# 20000000; 0: none). Both sides must idle alike: after an idle the H200 runs its first milliseconds
# of FP8 GEMMs at higher clocks under its 700 W cap (docs/performance.md, "FP8 GEMMs").
# TRACE=1: after the rounds, one more pass of each side with cuBLASLt's API trace
# (CUBLASLT_LOG_LEVEL=5) into the rounds' folder (in the tarball), and each side's first matmul
# lines (layouts, scale modes, the algorithm and its tile) in $OUT/trace.txt; use with a short SHAPES.
# $OUT: gemm_fp8.jsonl (the rows: cat it onto bench/results/gemm_fp8.jsonl here), summary.txt (the
# table) and gemm_fp8_rounds.tar.gz (each round's files, the logs, env.txt).
set -u
CARRY=${CARRY:-.carry-fp8}
OUT=${OUT:-/tmp/gemm-fp8-out}
BIN=/tmp/gemm-fp8-bin
W=/tmp/gemm-fp8-rounds
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-50}
SHAPES=${SHAPES:-}
source bench/tools/carry.sh
carry_deadline "${BUDGET_S:-225}"
rm -rf "$W"
mkdir -p "$OUT" "$W"
carry_unpack "$CARRY" "$BIN"
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
TV=$(python3 -c "import torch; print(torch.__version__)" 2>/dev/null)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
  echo "commit $COMMIT"; echo "torch $TV"; echo "ours idle ${IDLE_MS:-10} ms on ${IDLE_ON:-device}, torch sleep ${TORCH_SLEEP_CYCLES:-20000000} cycles"; } | tee "$W/env.txt"
if ! "$BIN/primus" benchmark --help 2>&1 | grep -q gemm_fp8; then
  echo "the carried primus ($CARRY, commit $COMMIT) has no gemm_fp8 benchmark family: refill the carry" \
       "(BINS=primus bench/fp8/prepare_carry.sh) and call again"
  exit 2
fi
[ -n "${ALGO_SEARCH:-}" ] && export PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH=$ALGO_SEARCH
for r in $(seq 1 "$ROUNDS"); do
  t0=$SECONDS
  # shellcheck disable=SC2086  # the optional flags are words
  timeout "$(cap 60)" "$BIN/primus" benchmark gemm_fp8 --backend CUBLASLT --iters "$ITERS" ${SHAPES:+--shapes $SHAPES} \
    --idle-ms "${IDLE_MS:-10}" --idle-on "${IDLE_ON:-device}" \
    --json "$W/ours_r$r.jsonl" --commit "$COMMIT" >> "$W/ours.log" 2>&1
  echo "ours, round $r: exit code $? ($((SECONDS - t0)) s)"
  t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout "$(cap 75)" python3 bench/fp8/gemm_torch.py --iters "$ITERS" ${SHAPES:+--shapes "$SHAPES"} \
    --sleep-cycles "${TORCH_SLEEP_CYCLES:-20000000}" \
    --out "$W/torch_r$r.jsonl" >> "$W/torch.log" 2>&1
  echo "torch, round $r: exit code $? ($((SECONDS - t0)) s)"
done
grep -E "^  gemm_fp8_|skipped|error" "$W/ours.log" | tail -30
grep -E "error|Error" "$W/torch.log" | tail -10
python3 bench/fp8/gemm_torch.py --merge --ours $(seq -f "$W/ours_r%g.jsonl" 1 "$ROUNDS") \
  --torch $(seq -f "$W/torch_r%g.jsonl" 1 "$ROUNDS") --out "$OUT/gemm_fp8.jsonl" --replace --torch-version "$TV" \
  --harness "ours: --idle-ms ${IDLE_MS:-10} --idle-on ${IDLE_ON:-device}; torch: --sleep-cycles ${TORCH_SLEEP_CYCLES:-20000000}" \
  | tee "$OUT/summary.txt"
if [ "${TRACE:-0}" = 1 ]; then
  # shellcheck disable=SC2086  # the optional flags are words
  CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE="$W/trace_ours.log" timeout "$(cap 60)" "$BIN/primus" benchmark gemm_fp8 \
    --backend CUBLASLT --iters 2 ${SHAPES:+--shapes $SHAPES} > /dev/null 2>&1
  CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE="$W/trace_torch.log" timeout "$(cap 75)" python3 bench/fp8/gemm_torch.py \
    --iters 2 ${SHAPES:+--shapes "$SHAPES"} --out /dev/null > /dev/null 2>&1
  for side in ours torch; do
    echo "== $side"
    grep -E "\[cublasLtMatmul\]" "$W/trace_$side.log" 2>/dev/null | cut -c1-1200 | head -12
  done > "$OUT/trace.txt"
  tail -40 "$OUT/trace.txt"
fi
tar czf "$OUT/gemm_fp8_rounds.tar.gz" -C "$(dirname "$W")" "$(basename "$W")"
