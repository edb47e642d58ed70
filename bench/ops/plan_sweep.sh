#!/usr/bin/env bash
# TURBO GEMM launch-plan sweep (issue [turbo]: the TURBO kernel >= 0.9x cuBLASLt on every training
# shape). For the linear layers of GPT-2 124M and Llama-3.2-1B (M = 16384 tokens; fwd, dgrad and
# wgrad of each), times cuBLASLt once and the TURBO kernel under every forced launch plan
# (PRIMUS_TURBO_GEMM_PLAN = tile width x k-splits, gemm_sm90.h) and both schedules, all in one
# call, then prints per case: cuBLASLt, TURBO's automatic plan, the best forced plan and their
# ratios. Raw lines in $OUT/sweep.jsonl.
# ROUNDS=n repeats every run n times, interleaved (each figure is then the median); EXTRA="tag:VAR=v
# ..." adds TURBO runs under other environments (space-separated, each tag:VAR=v[,VAR=v]); GTEST=
# <binary:filter> first runs those tests of the carried test binary; PINGPONG=0 skips the ping-pong
# schedule's run. The stream-K check (issue [turbo], gemm_sm90_streamk.h), for example (~6 min):
#   ROUNDS=3 PINGPONG=0 PLANS=256xsk EXTRA="auto-sk:PRIMUS_TURBO_GEMM_STREAMK=1" \
#     SHAPES=16384x2304x768,16384x768x768,16384x3072x768,16384x768x3072,16384x1024x2048,16384x2048x2048 \
#     GTEST='test_turbo_gpu:*StreamK*:*EveryPlan*:*GeluEpilogues*:*Gpt2TrainingShapes*' bash bench/ops/plan_sweep.sh
# From the repository root on the GPU machine, with primus unpacked in $BIN (default: the
# carried .carry-cuda/primus.gz):
#   run(command="bash bench/ops/plan_sweep.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/sweep-out}
BIN=${BIN:-/tmp/sweep-bin}
mkdir -p "$OUT" "$BIN"
[ -x "$BIN/primus" ] || { gunzip -c .carry-cuda/primus.gz > "$BIN/primus" && chmod +x "$BIN/primus"; }
if [ -n "${GTEST:-}" ]; then
  t=${GTEST%%:*}
  [ -x "$BIN/$t" ] || { gunzip -c ".carry-cuda/$t.gz" > "$BIN/$t" && chmod +x "$BIN/$t"; }
fi
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:$(dirname "${lt:-/x/x}"):${LD_LIBRARY_PATH:-}
cp .carry-cuda/lib*.so* "$BIN/" 2>/dev/null
# MxNxK of each layer: GPT-2 qkv, attn_proj, fc, fc_proj, lm_head; Llama kv, q_o, gate_up, down.
SHAPES=${SHAPES:-16384x2304x768,16384x768x768,16384x3072x768,16384x768x3072,16384x50304x768,16384x1024x2048,16384x2048x2048,16384x16384x2048,16384x2048x8192}
PLANS=${PLANS:-"128x1 256x1 128x2 256x2 128x4 256x4 128x8"}
ITERS=${ITERS:-30}
ROUNDS=${ROUNDS:-1}
J=$OUT/sweep.jsonl
: > "$J"
# shellcheck disable=SC1091
source bench/ops/gtest_stage.sh
gtest_stage "$BIN" "$OUT"
run() {  # $1: tag; environment set by the caller
  local tag=$1 tmp=$OUT/tmp.jsonl
  rm -f "$tmp"
  timeout 120 "$BIN/primus" benchmark gemm --shapes "$SHAPES" --backend "$2" --iters "$ITERS" --json "$tmp" \
    > "$OUT/log_${tag}_r$round.txt" 2>&1 || echo "sweep $tag: rc=$? (see log_${tag}_r$round.txt)"
  [ -f "$tmp" ] && python3 -c "
import json,sys
for l in open('$tmp'):
    r=json.loads(l); r['sweep']='$tag'; r['round']=$round; print(json.dumps(r))" >> "$J"
}
# Even rounds run cuBLASLt last: over a long shape list the GPU warms and clocks drift (on an H100,
# TURBO's products late in a 13-shape run read 10-20% below the same products alone), and a fixed
# order would hand that drift to one side of every ratio.
for round in $(seq 1 "$ROUNDS"); do
  [ $((round % 2)) = 1 ] && run cublaslt CUBLASLT
  run turbo-auto TURBO
  [ "${PINGPONG:-1}" = 0 ] || PRIMUS_TURBO_GEMM_SCHEDULE=pingpong run turbo-auto-pingpong TURBO
  for p in $PLANS; do
    PRIMUS_TURBO_GEMM_PLAN=$p run "turbo-$p" TURBO
  done
  for x in ${EXTRA:-}; do  # tag:VAR=v[,VAR=v]: the assignments prefix the run (as PLAN's above)
    eval "$(echo "${x#*:}" | tr ',' ' ') run 'turbo-${x%%:*}' TURBO"
  done
  [ $((round % 2)) = 0 ] && run cublaslt CUBLASLT
done
python3 - "$J" <<'EOF' | tee "$OUT/summary.txt"
import json, sys, collections
import statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
runs = collections.defaultdict(lambda: collections.defaultdict(list))  # case -> sweep -> TFLOP/s per round
for r in rows:
    if r.get("metric") == "TFLOP/s":
        runs[r["case"]][r["sweep"]].append(r["ours"])
t = {case: {k: statistics.median(v) for k, v in s.items()} for case, s in runs.items()}  # medians over rounds
print(f"{'case':<34}{'cuBLASLt':>9}{'auto':>8}{'ratio':>7}  {'best plan':<22}{'TFLOP/s':>8}{'ratio':>7}")
for case, s in t.items():
    lt = s.get("cublaslt")
    auto = s.get("turbo-auto")
    turbo = {k: v for k, v in s.items() if k.startswith("turbo-")}
    if not turbo or not lt:
        continue
    best = max(turbo, key=turbo.get)
    f = lambda v: f"{v:.1f}" if v else "-"
    print(f"{case:<34}{f(lt):>9}{f(auto):>8}{(auto or 0) / lt:>7.3f}  {best:<22}{turbo[best]:>8.1f}{turbo[best] / lt:>7.3f}")
# Every plan per case, as TURBO / cuBLASLt (for tuning the plan model).
plans = sorted({k for s in t.values() for k in s if k.startswith("turbo-")})
print("\nTURBO / cuBLASLt per plan:")
print(f"{'case':<34}" + "".join(f"{p[6:]:>10}" for p in plans))
for case, s in t.items():
    lt = s.get("cublaslt")
    if lt:
        print(f"{case:<34}" + "".join(f"{s[p] / lt:>10.3f}" if p in s else f"{'-':>10}" for p in plans))
EOF
