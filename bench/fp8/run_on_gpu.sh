#!/usr/bin/env bash
# One device call for issue #38 [fp8]: the FP8 GPU tests, then Llama-3.2-1B (8 x 2048, mock data)
# trained with each FP8 recipe, against torch_fp8_anchor.py (torch.compile, rowwise FP8 linears)
# and torch_anchor.py (torch.compile, bf16) on the same shape, all in this call. From the
# repository root with .carry-fp8 (bench/fp8/prepare_carry.sh):
#   run(command="bash bench/fp8/run_on_gpu.sh", carry=[".carry-fp8"])
# STAGES (default "tests train"): tests = test_turbo_gpu's FP8 GEMM / quantizer tests (TEST_FILTER)
# and the layout probe; train = the recipes (RECIPES, default "e4m3:tensorwise e4m3:rowwise
# e4m3:blockwise hybrid:tensorwise hybrid:rowwise") and the two anchors (BF16_ANCHOR=0: the FP8 one
# only; FP8_ANCHOR=0: neither, e.g. for profiles; an entry format:recipe:variant adds the overrides in VARIANT_<variant>, comma-separated, and
# runs with the environment variables in ENV_<variant>, e.g. ENV_nomx="PRIMUS_CUDA_FP8_MAXIMA=0", and
# the carried binary named in BINARY_<variant> instead of primus, e.g. BINARY_old=primus_old for an
# A/B against another build carried as primus_old.xz, whose commit the rows take from
# $CARRY/primus_old.commit ("unknown (primus_old)" without one));
# STEPS (30) / MEASURE (20). QBENCH=1 first times `primus benchmark quantize` (TURBO; QBENCH_SHAPES) on
# the Llama-3.2-1B shapes.
# Rows (DESIGN.md "Measurements") in $OUT/train.jsonl; a table last.
set -u
CARRY=${CARRY:-.carry-fp8}
OUT=${OUT:-/tmp/fp8-out}
BIN=/tmp/fp8-bin
STEPS=${STEPS:-30}
MEASURE=${MEASURE:-20}
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.xz; do xz -dc "$f" > "$BIN/$(basename "${f%.xz}")" && chmod +x "$BIN/$(basename "${f%.xz}")"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
[ -z "$lt" ] && lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib', 'libcublasLt.so.13'))" 2>/dev/null)
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$BIN:$(dirname "${lt:-/nonexistent/x}"):${cudnn_dir:-/nonexistent}:${LD_LIBRARY_PATH:-}
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
DATE=$(date -u +%Y-%m-%d)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  echo "commit $COMMIT"; } | tee "$OUT/env.txt"
SUMMARY=()
STAGES=${STAGES:-"tests train"}

if [[ " $STAGES " == *" tests "* ]]; then
  t0=$SECONDS
  "$BIN/test_turbo_gpu" --gtest_filter="${TEST_FILTER:-*Fp8*:*Quantize*}" > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED) |Failure|Expected|Which is|error" "$OUT/tests.log" | head -30
  SUMMARY+=("$(printf '%-40s rc=%s %ss' "test_turbo_gpu ${TEST_FILTER:-FP8}" "$rc" "$((SECONDS - t0))")")
  if [ -n "${CUDA_TEST_FILTER:-}" ]; then
    t0=$SECONDS
    "$BIN/test_cuda_gpu" --gtest_filter="$CUDA_TEST_FILTER" --gtest_repeat="${CUDA_TEST_REPEAT:-1}" > "$OUT/tests_cuda.log" 2>&1
    rc=$?
    grep -E "^\[  FAILED |Failure|Actual|error" "$OUT/tests_cuda.log" | sort | uniq -c | head -20
    SUMMARY+=("$(printf '%-40s rc=%s %ss' "test_cuda_gpu $CUDA_TEST_FILTER" "$rc" "$((SECONDS - t0))")")
  fi
fi

if [ "${QBENCH:-0}" = 1 ]; then
  "$BIN/primus" benchmark quantize --shapes "${QBENCH_SHAPES:-16384x2048,16384x8192,2048x8192}" --backend TURBO 2>&1 | grep -E "^  (quantize_fp8_|swiglu_)" | tee "$OUT/quantize_bench.txt"
fi

if [[ " $STAGES " == *" train "* ]]; then
  ws=/tmp/fp8-ws
  for rc_ in ${RECIPES:-e4m3:tensorwise e4m3:rowwise e4m3:blockwise hybrid:tensorwise hybrid:rowwise}; do
    # format:recipe[:variant]; a variant's overrides come from VARIANT_<variant> (comma-separated
    # key=value), e.g. RECIPES="e4m3:rowwise:oib" VARIANT_oib="optimizer_in_bwd=true,clip_grad=0".
    fmt=${rc_%%:*}; rest=${rc_#*:}; recipe=${rest%%:*}; variant=""; extra=""
    envs=""
    if [[ "$rest" == *:* ]]; then
      variant=${rest#*:}; vv="VARIANT_${variant}"; extra=${!vv:-}; extra=${extra//,/ }
      ev="ENV_${variant}"; envs=${!ev:-}; envs=${envs//,/ }
    fi
    name="llama3.2-1B_b8_fp8-${fmt}-${recipe}${variant:+-$variant}"
    rm -rf "$ws"
    t0=$SECONDS
    # shellcheck disable=SC2086  # envs: words of NAME=value
    bv="BINARY_${variant}"; exe=${!bv:-primus}
    if [ "$exe" = primus ]; then echo "$COMMIT" > "$OUT/$name.commit"
    else cat "$CARRY/$exe.commit" > "$OUT/$name.commit" 2>/dev/null || echo "unknown ($exe)" > "$OUT/$name.commit"; fi
    env $envs timeout 200 "$BIN/$exe" train pretrain --config examples/cuda/llama3.2-1B.yaml mock_data=true train_iters="$STEPS" \
      micro_batch_size=8 global_batch_size=8 seq_length=2048 lr_warmup_iters=5 log_interval=5 eval_interval=0 \
      save_interval=0 save_at_end=false workspace="$ws" exp_name=m fp8="$fmt" fp8_recipe="$recipe" $extra > "$OUT/$name.log" 2>&1
    echo "rc=$? ${SECONDS}s" >> "$OUT/$name.log"
    cp "$ws"/*/*/m/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
    grep -E "loss|error|Error" "$OUT/$name.log" | tail -2
    SUMMARY+=("$(printf '%-40s %s' "$name" "$(tail -1 "$OUT/$name.log")")")
  done
  rm -rf "$ws"
  if [ "${FP8_ANCHOR:-1}" = 1 ]; then
    timeout 240 python3 "$CARRY/torch_fp8_anchor.py" --model llama3.2-1B --batch 8 --mode compile > "$OUT/anchor_fp8.json" 2> "$OUT/anchor_fp8.err"
    SUMMARY+=("$(printf '%-40s rc=%s' "torch_fp8_anchor (rowwise, compile)" "$?")")
  fi
  if [ "${BF16_ANCHOR:-1}" = 1 ]; then
    timeout 240 python3 "$CARRY/torch_anchor.py" --model llama3.2-1B --batch 8 --mode compile > "$OUT/anchor_bf16.json" 2> "$OUT/anchor_bf16.err"
    SUMMARY+=("$(printf '%-40s rc=%s' "torch_anchor (bf16, compile)" "$?")")
  fi
  python3 - "$OUT" "$DEVICE" "$DATE" "$COMMIT" "$MEASURE" <<'PY'
import glob, json, os, sys
out, device, date, commit, measure = sys.argv[1:6]
measure = int(measure)
def anchor(f):
    try: return json.loads(open(os.path.join(out, f)).read().strip().splitlines()[-1])
    except Exception: return None
fp8a, bf16a = anchor("anchor_fp8.json"), anchor("anchor_bf16.json")
rows = []
print(f"\nLlama-3.2-1B 8 x 2048 mock data, {device}, commit {commit}")
print(f"{'case':36s} {'tok/s':>9s} {'vs fp8 anchor':>14s} {'vs bf16':>8s} {'GiB':>7s} {'final loss':>10s}")
for a, n in ((fp8a, "torch_fp8_anchor"), (bf16a, "torch_anchor bf16")):
    if a: print(f"{n:36s} {a['tok_s']:9,.0f} {'':14s} {'':8s} {a['mem_gib']:7.2f}")
for f in sorted(glob.glob(os.path.join(out, "*.metrics.jsonl"))):
    name = os.path.basename(f)[: -len(".metrics.jsonl")]
    m = [json.loads(l) for l in open(f) if '"tokens_per_s"' in l]
    if not m: continue
    last = m[-measure:]
    ours = sum(s["tokens_per_s"] * s["step_s"] for s in last) / sum(s["step_s"] for s in last)
    mem = max(s.get("arena_gib", 0) for s in last)
    peak = max(s.get("mem_gib", 0) for s in last)
    loss = m[-1].get("loss")
    case = "llama3.2-1B/b8/t2048/mock/" + name.split("_b8_")[1]
    try: run_commit = open(os.path.join(out, name + ".commit")).read().strip() or commit
    except OSError: run_commit = commit
    base = {"bench": "train", "case": case, "device": device, "date": date, "commit": run_commit}
    r1 = r2 = None
    if fp8a:
        r1 = ours / fp8a["tok_s"]
        rows.append(dict(base, metric="tokens_per_s", ours=round(ours), anchor=fp8a["tok_s"],
                         anchor_name=f"torch.compile rowwise FP8 ({fp8a['anchor']})", ratio=round(r1, 4)))
        rows.append(dict(base, metric="memory_gib (arenas; device peak in note)", ours=mem, anchor=fp8a["mem_gib"],
                         anchor_name="torch.cuda.max_memory_allocated (FP8 anchor)",
                         ratio=round(fp8a["mem_gib"] / mem, 4) if mem else None,
                         note=f"device peak incl. CUDA context and libraries {peak} GiB"))
    if bf16a:
        r2 = ours / bf16a["tok_s"]
        rows.append(dict(base, metric="tokens_per_s", ours=round(ours), anchor=bf16a["tok_s"],
                         anchor_name=f"torch.compile bf16 ({bf16a['anchor']})", ratio=round(r2, 4)))
    print(f"{name.split('_b8_')[1]:36s} {ours:9,.0f} {r1 or 0:13.3f}x {r2 or 0:7.3f}x {mem:7.2f} {loss if loss is not None else float('nan'):10.4f}")
with open(os.path.join(out, "train.jsonl"), "a") as f:
    for r in rows: f.write(json.dumps(r) + "\n")
PY
fi
# The device returns a limited number of files: the logs and metrics travel as one archive.
(cd "$OUT" && ls *.log *.metrics.jsonl >/dev/null 2>&1 && tar czf logs.tar.gz *.log *.metrics.jsonl && rm -f *.log *.metrics.jsonl *.commit)
echo
printf '%s\n' "${SUMMARY[@]}"
