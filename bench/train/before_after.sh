#!/usr/bin/env bash
# One device call that compares two builds of primus with each other and with torch.compile: a
# change that must not move the numbers (a refactor) is shown by
#   1. GPT-2 124M (B16 x T1024) and Llama-3.2-1B (B8 x T2048) tokens/s of the baseline build, this
#      build and ../shared/bench/torch_anchor.py (torch.compile) back to back, ROUNDS rounds of the two
#      primus builds (default 2) around one anchor run per case; rows in $OUT/train.jsonl
#      (DESIGN.md "Measurements": ours = this build, anchor = torch.compile; a second row per case
#      compares this build with the baseline);
#   2. the first DET_STEPS (default 10) training losses of both builds with deterministic: true (and
#      cuBLASLt's heuristic algorithms, gemm_algo_search=1, so no timing picks a GEMM) on the same
#      cases, compared bit for bit (metrics.jsonl prints each loss with round-trip precision).
# The GPU tests of this build run first when the carry has test_cuda_gpu (TEST_FILTER, default the
# step, parity and launch-ahead tests).
#
# Carry (default .carry-ba, filled by `bench/train/prepare_carry.sh` for this build plus the
# baseline's binary as primus_base.xz or .gz): primus.{xz,gz}, primus_base.{xz,gz},
# [test_cuda_gpu.{xz,gz}], libgomp.so.1, torch_anchor.py, commit.txt, base_commit.txt.
#   run(command="bash bench/train/before_after.sh", carry=[".carry-ba"])
# $OUT gets train.jsonl, summary.txt (the table) and logs.tar.gz (every run's log and metrics).
# Prints the table last.
set -u
CARRY=${CARRY:-.carry-ba}
RESULT=${OUT:-/tmp/ba-out}  # what comes back: train.jsonl, summary.txt, logs.tar.gz
OUT=/tmp/ba-work            # every run's log and metrics, packed into logs.tar.gz at the end
BIN=/tmp/ba-bin
STEPS=${STEPS:-30}
MEASURE=${MEASURE:-20}
ROUNDS=${ROUNDS:-2}
DET_STEPS=${DET_STEPS:-10}
mkdir -p "$OUT" "$BIN" "$RESULT"
for f in "$CARRY"/*.gz "$CARRY"/*.xz; do
  [ -e "$f" ] || continue
  n=$(basename "${f%.*}")
  case "$f" in *.xz) xz -dc "$f" > "$BIN/$n" ;; *) gunzip -c "$f" > "$BIN/$n" ;; esac && chmod +x "$BIN/$n"
done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
export PRIMUS_BIN=$BIN/primus
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
BASE=$(cat "$CARRY/base_commit.txt" 2>/dev/null || echo baseline)
echo "device $DEVICE; this build $COMMIT; baseline $BASE"

tests="-"
if [ -x "$BIN/test_cuda_gpu" ]; then
  timeout 240 "$BIN/test_cuda_gpu" --gtest_brief=1 --gtest_filter="${TEST_FILTER:-*StepGpu*:*LaunchAhead*:*Parity*:*Fallback*:*Default*}" \
    > "$OUT/tests.log" 2>&1
  tests="rc=$? $(grep -E '^\[  PASSED  \]|FAILED TEST' "$OUT/tests.log" | tr '\n' ' ')"
  echo "test_cuda_gpu: $tests"
fi

# case: preset batch seq config det_batch. Llama's deterministic comparison runs at micro-batch 2:
# builds before the deterministic-scratch fix (hooks.h) cannot run it at 8 (the cuDNN workspace);
# this build also runs it alone at 8 (the full-batch row of the table).
CASES=("gpt2-124M 16 1024 examples/cuda/gpt2-124M-shakespeare.yaml 16"
       "llama3.2-1B 8 2048 examples/cuda/llama3.2-1B.yaml 2")
run_primus() {  # bin name steps extra... -> $OUT/<name>.metrics.jsonl
  local bin=$1 name=$2 steps=$3 cfg=$4 batch=$5 seq=$6; shift 6
  local ws=/tmp/ba-ws-$name
  rm -rf "$ws"
  timeout 240 "$BIN/$bin" train pretrain --config "$cfg" mock_data=true train_iters="$steps" micro_batch_size="$batch" \
    global_batch_size="$batch" seq_length="$seq" lr_warmup_iters=5 log_interval=1 eval_interval=0 save_interval=0 \
    save_at_end=false workspace="$ws" exp_name=m "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/$name.log"
  cp "$ws"/*/*/m/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
  rm -rf "$ws"
}
for c in "${CASES[@]}"; do
  read -r preset batch seq cfg det_batch <<< "$c"
  for r in $(seq "$ROUNDS"); do
    for bin in primus_base primus; do run_primus "$bin" "${preset}_${bin}_r$r" "$STEPS" "$cfg" "$batch" "$seq"; done
  done
  timeout 240 python3 "$CARRY/torch_anchor.py" --model "$preset" --batch "$batch" --mode compile \
    > "$OUT/${preset}_anchor.json" 2> "$OUT/${preset}_anchor.err"
  for bin in primus_base primus; do
    run_primus "$bin" "${preset}_${bin}_det" "$DET_STEPS" "$cfg" "$det_batch" "$seq" deterministic=true gemm_algo_search=1
  done
  if [ "$det_batch" != "$batch" ]; then
    run_primus primus "${preset}_primus_det_full" "$DET_STEPS" "$cfg" "$batch" "$seq" deterministic=true gemm_algo_search=1
  fi
done

python3 - "$OUT" "$DEVICE" "$COMMIT" "$BASE" "$MEASURE" "$ROUNDS" "$DET_STEPS" "$tests" > "$OUT/summary.txt" <<'PY'
import json, os, sys, datetime, statistics
out, device, commit, base, measure, rounds, det_steps, tests = sys.argv[1:9]
measure, rounds, det_steps = int(measure), int(rounds), int(det_steps)
date = datetime.date.today().isoformat()

def steps(name):
    try:
        return [json.loads(l) for l in open(os.path.join(out, name + ".metrics.jsonl")) if '"tokens_per_s"' in l]
    except OSError:
        return []

def tok_s(name):
    m = steps(name)[-measure:]
    return sum(s["tokens_per_s"] * s["step_s"] for s in m) / sum(s["step_s"] for s in m) if m else None

rows, table = [], []
for preset, batch, seq, det_batch in (("gpt2-124M", 16, 1024, 16), ("llama3.2-1B", 8, 2048, 2)):
    case = f"{preset}/b{batch}/t{seq}/mock"
    per = {b: [tok_s(f"{preset}_{b}_r{r}") for r in range(1, rounds + 1)] for b in ("primus_base", "primus")}
    try:
        a = json.loads(open(os.path.join(out, f"{preset}_anchor.json")).read().strip().splitlines()[-1])
    except Exception:
        a = None
    ok = all(v for vs in per.values() for v in vs)
    new = statistics.median(per["primus"]) if ok else None
    old = statistics.median(per["primus_base"]) if ok else None
    base_row = {"bench": "train", "case": case, "device": device, "date": date, "commit": commit}
    if ok and a:
        rows.append(dict(base_row, metric="tokens_per_s", ours=round(new), anchor=a["tok_s"],
                         anchor_name=f"torch.compile ({a['anchor']})", ratio=round(new / a["tok_s"], 4),
                         note=f"median of {rounds} runs; baseline {base} in the same call: {round(old)} tok/s, "
                              f"{old / a['tok_s']:.4f}x"))
    if ok:
        rows.append(dict(base_row, metric="tokens_per_s vs baseline build", ours=round(new), anchor=round(old),
                         anchor_name=f"primus {base}", ratio=round(new / old, 4),
                         note=f"runs this build {[round(x) for x in per['primus']]}, baseline "
                              f"{[round(x) for x in per['primus_base']]}"))
    # Deterministic losses, bit for bit (the JSON text of each step's loss).
    det = {}
    for b in ("primus_base", "primus"):
        try:
            det[b] = [l.split('"loss":')[1].split(",")[0] for l in open(os.path.join(out, f"{preset}_{b}_det.metrics.jsonl"))
                      if '"tokens_per_s"' in l][:det_steps]
        except (OSError, IndexError):
            det[b] = []
    same = len(det["primus"]) == det_steps and det["primus"] == det["primus_base"]
    first_diff = next((i + 1 for i, (x, y) in enumerate(zip(det["primus"], det["primus_base"])) if x != y), None)
    rows.append(dict(base_row, case=f"{preset}/b{det_batch}/t{seq}/mock/deterministic",
                     metric=f"deterministic losses of steps 1-{det_steps} equal to the baseline's (bits)",
                     ours=len(det["primus"]), anchor=len(det["primus_base"]), anchor_name=f"primus {base}",
                     ratio=1.0 if same else 0.0, note=f"step 1 {det['primus'][:1]}, step {det_steps} {det['primus'][-1:]}"))
    full = len(steps(f"{preset}_primus_det_full")) if det_batch != batch else None
    table.append((case, new, old, a["tok_s"] if a else None, same, first_diff, det["primus"][-1:],
                  (len(det["primus"]), len(det["primus_base"])), det_batch, full))
with open(os.path.join(out, "train.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print(f"\ntests: {tests}")
print(f"{'case':28} {'this build':>11} {'baseline':>11} {'torch.compile':>13} {'new/base':>9} {'new/torch':>9}  det. losses")
for case, new, old, anc, same, diff, last, counts, det_batch, full in table:
    fmt = lambda x: f"{x:,.0f}" if x else "-"
    r1 = f"{new / old:.4f}" if new and old else "-"
    r2 = f"{new / anc:.4f}" if new and anc else "-"
    if same:
        d = f"equal x{det_steps} at b{det_batch} (last {last[0]})"
    elif diff:
        d = f"DIFFER at step {diff}"
    else:
        d = f"incomplete: {counts[0]} (this build) / {counts[1]} (baseline) of {det_steps} steps"
    if full is not None:
        d += f"; this build at b{case.split('/b')[1].split('/')[0]}: {full} of {det_steps} steps"
    print(f"{case:28} {fmt(new):>11} {fmt(old):>11} {fmt(anc):>13} {r1:>9} {r2:>9}  {d}")
PY
cp "$OUT/train.jsonl" "$OUT/summary.txt" "$RESULT/" 2>/dev/null
tar -C "$OUT" -czf "$RESULT/logs.tar.gz" .
cat "$OUT/summary.txt"
