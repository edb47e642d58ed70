#!/usr/bin/env bash
# TURBO GEMM launch-plan sweep (issue [turbo]: the TURBO kernel >= 0.9x cuBLASLt on every training
# shape). For the linear layers of GPT-2 124M and Llama-3.2-1B (M = 16384 tokens; fwd, dgrad and
# wgrad of each), times cuBLASLt once and the TURBO kernel under every forced launch plan
# (PRIMUS_TURBO_GEMM_PLAN = tile width x k-splits, gemm_sm90.h) and both schedules, all in one
# call, then prints per case: cuBLASLt, TURBO's automatic plan, the best forced plan and their
# ratios. Raw lines in $OUT/sweep.jsonl.
# From the repository root on the GPU machine, with primus unpacked in $BIN (default: the
# carried .carry-cuda/primus.gz):
#   run(command="bash bench/ops/plan_sweep.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/sweep-out}
BIN=${BIN:-/tmp/sweep-bin}
mkdir -p "$OUT" "$BIN"
[ -x "$BIN/primus" ] || { gunzip -c .carry-cuda/primus.gz > "$BIN/primus" && chmod +x "$BIN/primus"; }
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:$(dirname "${lt:-/x/x}"):${LD_LIBRARY_PATH:-}
cp .carry-cuda/lib*.so* "$BIN/" 2>/dev/null
# MxNxK of each layer: GPT-2 qkv, attn_proj, fc, fc_proj, lm_head; Llama kv, q_o, gate_up, down.
SHAPES=${SHAPES:-16384x2304x768,16384x768x768,16384x3072x768,16384x768x3072,16384x50304x768,16384x1024x2048,16384x2048x2048,16384x16384x2048,16384x2048x8192}
PLANS=${PLANS:-"128x1 256x1 128x2 256x2 128x4 256x4 128x8"}
ITERS=${ITERS:-30}
J=$OUT/sweep.jsonl
: > "$J"
run() {  # $1: tag; environment set by the caller
  local tag=$1 tmp=$OUT/tmp.jsonl
  rm -f "$tmp"
  timeout 120 "$BIN/primus" benchmark gemm --shapes "$SHAPES" --backend "$2" --iters "$ITERS" --json "$tmp" \
    > "$OUT/log_$tag.txt" 2>&1 || echo "sweep $tag: rc=$? (see log_$tag.txt)"
  [ -f "$tmp" ] && python3 -c "
import json,sys
for l in open('$tmp'):
    r=json.loads(l); r['sweep']='$tag'; print(json.dumps(r))" >> "$J"
}
run cublaslt CUBLASLT
run turbo-auto TURBO
PRIMUS_TURBO_GEMM_SCHEDULE=pingpong run turbo-auto-pingpong TURBO
for p in $PLANS; do
  PRIMUS_TURBO_GEMM_PLAN=$p run "turbo-$p" TURBO
done
python3 - "$J" <<'EOF' | tee "$OUT/summary.txt"
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
t = collections.defaultdict(dict)  # case -> sweep -> TFLOP/s
for r in rows:
    if r.get("metric") == "TFLOP/s":
        t[r["case"]].setdefault(r["sweep"], r["ours"])
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
