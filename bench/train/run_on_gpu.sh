#!/usr/bin/env bash
# One device call for the CUDA backend: its GPU correctness tests, then GPT-2 124M training with
# primus (mock data, T=1024, micro-batch 16) and the PyTorch anchor (torch.compile, same shape)
# back to back on the same GPU. Writes $OUT/train.jsonl (DESIGN.md "Measurements") and prints a
# short table last; then bench/train/matrix_stage.sh (GPT-2 B32, Llama-3.2-1B B8, each vs torch.compile).
# Every stage runs under `timeout`. $OUT ends with train.jsonl, summaries and logs.tar.gz.
#
# Run from the repository root with the carried folder (default .carry-cuda, filled by
# bench/train/prepare_carry.sh) holding primus.gz, test_cuda_gpu.gz (or .xz), libgomp.so.1,
# torch_anchor.py, bf16_noise_floor.py and commit.txt:
#   run(command="bash bench/train/run_on_gpu.sh", carry=[".carry-cuda"])
# Results in $OUT: env.txt, tests.log, noise_floor.txt, noise_floor.json, train.log, metrics.jsonl,
# anchor.json, train.jsonl.
# The test stage also measures the bf16 noise floor that the gradient-parity gate is derived from
# (tests/cuda_gpu/bf16_noise_floor.py on the test binary's PRIMUS_PARITY_DUMP output, seeds
# 1..NOISE_SEEDS, default 4; ~30 s): summary printed, full table in noise_floor.txt.
# NOISE_FLOOR=0 skips it; TESTS_ONLY=1 stops after the test stage (no training, no anchor):
#   run(command="TESTS_ONLY=1 bash bench/train/run_on_gpu.sh", carry=[".carry-cuda"])
# TEST_FILTER=<gtest filter> runs only those tests of test_cuda_gpu as the test stage, OPS_TEST_FILTER
# those of test_turbo_gpu ('*' for all), ATTN_TEST_FILTER those of test_attention_gpu (ATTN_REPEAT
# times), each instead of the default stage. The carry's binaries may be .gz or .xz.
# STEPS (default 30) and MEASURE (default 20: the last steps averaged) change the training run.
# REALDATA=0 skips the default run on tinyshakespeare (case suffix /realdata, against the mock-data anchor).
# Step variants (issue 8): the default run captures the step as a CUDA graph (cuda_graph: auto);
# CUDA_GRAPH=1 adds the same run eagerly (cuda_graph=false, case suffix /eager); RECOMPUTE=selective|full
# adds a run with recompute_granularity; RECOMPUTE also makes a short profiled run of that setting
# (PRIMUS_CUDA_PROFILE=1, PROFILE_STEPS=12 steps) and prints its per-phase GPU time table
# ($OUT/profile.json). PROFILE=1 alone profiles the default run.
# ENV_VARIANT="VAR=value ..." adds the default run under those environment variables (an A/B of a
# switch read from the environment), case suffix /env:VAR=value.
#   run(command="CUDA_GRAPH=1 RECOMPUTE=selective HEURISTIC=0 bash bench/train/run_on_gpu.sh",
#       carry=[".carry-cuda"])
set -u
CARRY=${CARRY:-.carry-cuda}
OUT=${OUT:-/tmp/cuda-out}
BIN=/tmp/cuda-bin
STEPS=${STEPS:-30}
MEASURE=${MEASURE:-20}
PEAK=989e12
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz "$CARRY"/*.xz; do  # binaries: gzip or xz (xz fits all four test binaries in one call)
  [ -e "$f" ] || continue
  n=$(basename "${f%.*}")
  case "$f" in *.xz) xz -dc "$f" > "$BIN/$n" ;; *) gunzip -c "$f" > "$BIN/$n" ;; esac && chmod +x "$BIN/$n"
done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null

# cuBLASLt 13: the toolkit's, else the one in PyTorch's nvidia wheel (as bench/ops/run_on_gpu.sh).
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 /usr/lib/x86_64-linux-gnu/libcublasLt.so.13 2>/dev/null | head -1)
if [ -z "$lt" ]; then
  lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib', 'libcublasLt.so.13'))" 2>/dev/null)
fi
# cuDNN 9: the one PyTorch loads (its wheel), else any on the system (as bench/attention/run_on_gpu.sh).
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
if [ -z "$cudnn_dir" ] || [ ! -e "$cudnn_dir/libcudnn.so.9" ]; then
  cudnn_dir=$(dirname "$(find /usr /opt -name 'libcudnn.so.9' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH=$BIN:$(dirname "${lt:-/nonexistent/x}"):${cudnn_dir:-/nonexistent}:${LD_LIBRARY_PATH:-}
# The binaries run from $BIN, away from the tree they were built in: point them at this one.
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
export PRIMUS_BIN=$BIN/primus  # tests that run the binary (launch_ahead_test, the benchmark test)
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
  echo "commit $COMMIT"
  echo "cublasLt=$lt cudnn_dir=$cudnn_dir"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  ldd "$BIN/primus" | grep -E "not found|cublas|cudnn|gomp"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. Correctness: attention slots, step-0 loss and gradients, 50-step curves vs the reference.
# The fallback and the default attention run in separate processes, so a device fault in one
# (which poisons its CUDA context) cannot fail the other's tests.
: > "$OUT/tests.log"
rc_fallback=0; rc_default=0; rc_step=0; rc_fp8=-; rc_dump=-; rc_noise=-
if [ -n "${TEST_FILTER:-}" ]; then  # TEST_FILTER=<gtest filter>: only these tests of test_cuda_gpu
  timeout 300 "$BIN/test_cuda_gpu" --gtest_filter="$TEST_FILTER" >> "$OUT/tests.log" 2>&1
  rc_step=$?
  SKIP_TESTS=1
fi
if [ -n "${OPS_TEST_FILTER:-}" ] && [ -x "$BIN/test_turbo_gpu" ]; then  # and/or these of test_turbo_gpu ('*': all)
  timeout 420 "$BIN/test_turbo_gpu" --gtest_brief=1 --gtest_filter="$OPS_TEST_FILTER" >> "$OUT/tests.log" 2>&1
  rc_fp8="ops $?"
  SKIP_TESTS=1
fi
if [ -n "${ATTN_TEST_FILTER:-}" ] && [ -x "$BIN/test_attention_gpu" ]; then  # and/or these of test_attention_gpu
  timeout 300 "$BIN/test_attention_gpu" --gtest_filter="$ATTN_TEST_FILTER" --gtest_repeat="${ATTN_REPEAT:-1}" \
    >> "$OUT/tests.log" 2>&1
  rc=$?  # beside OPS_TEST_FILTER's status, not over it
  if [ "$rc_fp8" = - ]; then rc_fp8="attention $rc"; else rc_fp8="$rc_fp8/attention $rc"; fi
  SKIP_TESTS=1
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: when this commit's tests already ran
  timeout 90 "$BIN/test_cuda_gpu" --gtest_filter='*Fallback*' >> "$OUT/tests.log" 2>&1
  rc_fallback=$?
  timeout 90 "$BIN/test_cuda_gpu" --gtest_filter='*Default*' >> "$OUT/tests.log" 2>&1
  rc_default=$?
  # The step machinery: graph replay vs eager, NaN skip under the graph, recompute parity, profiler;
  # the trainer with and without launch-ahead (the binary in $BIN, bit for bit, resume).
  timeout 150 "$BIN/test_cuda_gpu" --gtest_filter='*StepGpu*:*LaunchAhead*' >> "$OUT/tests.log" 2>&1
  rc_step=$?
  # FP8 (patch cuda.linear.fp8): 200-step curves of the FP8 recipes vs the reference; the FP8
  # GEMM, linear-layer and quantizer op tests (and the TURBO GEMM's plans, stream-K among them)
  # when the carry has test_turbo_gpu.
  timeout 120 "$BIN/test_cuda_gpu" --gtest_filter='*Fp8*' >> "$OUT/tests.log" 2>&1
  rc_fp8=$?
  if [ -x "$BIN/test_turbo_gpu" ]; then
    timeout 300 "$BIN/test_turbo_gpu" --gtest_filter='*Fp8*:*Quantize*:*WeightGradOnes*:*NormForwardPadded*:*NormBackward*:*Embedding*:*CrossEntropy*:*StreamK*:*EveryPlan*' >> "$OUT/tests.log" 2>&1
    rc_fp8="$rc_fp8/ops $?"
  fi
  if [ -x "$BIN/test_attention_gpu" ]; then  # the deterministic cuDNN backward (cuda.attention.deterministic)
    timeout 60 "$BIN/test_attention_gpu" --gtest_filter='*Deterministic*' >> "$OUT/tests.log" 2>&1
    rc_fp8="$rc_fp8/attention $?"
  fi
  # The bf16 noise floor behind the gradient gate (model_parity_test.cpp, gradient_gate()): the
  # test binary dumps step 0 of every parity case for seeds 1..NOISE_SEEDS (weights in Hugging
  # Face names, batch, reference and our gradients), then PyTorch/transformers runs the same
  # models in fp32, bf16 autocast and bf16 weights and prints the per-tensor errors. Exit 2 of the
  # script: the reference and transformers' fp32 disagree (mapping broken), numbers meaningless.
  if [ "${NOISE_FLOOR:-1}" != 0 ]; then
    NOISE=$CARRY/bf16_noise_floor.py
    [ -f "$NOISE" ] || NOISE=tests/cuda_gpu/bf16_noise_floor.py
    DUMP=/tmp/primus-parity-dump
    rm -rf "$DUMP"
    PRIMUS_PARITY_DUMP=$DUMP PRIMUS_PARITY_DUMP_SEEDS=${NOISE_SEEDS:-4} timeout 90 "$BIN/test_cuda_gpu" \
      --gtest_filter='ParityDump.*' >> "$OUT/tests.log" 2>&1
    rc_dump=$?
    timeout 240 python3 "$NOISE" "$DUMP" --json "$OUT/noise_floor.json" > "$OUT/noise_floor.txt" 2>&1
    rc_noise=$?
    echo "noise floor rc=$rc_noise (dump rc=$rc_dump); full table: noise_floor.txt" >> "$OUT/noise_floor.txt"
    # The summary (the per-seed tables are in noise_floor.txt), or the failure's last lines.
    if grep -q "^==== bf16 noise floor" "$OUT/noise_floor.txt"; then
      sed -n '/^==== bf16 noise floor/,$p' "$OUT/noise_floor.txt"
    else
      tail -25 "$OUT/noise_floor.txt"
    fi
    rm -rf "$DUMP"
  fi
fi
echo "test rc: fallback $rc_fallback, default $rc_default, step $rc_step, fp8 $rc_fp8, noise-floor dump $rc_dump, noise floor $rc_noise" >> "$OUT/tests.log"
grep -E "^\[(gpt2|llama)|ABOVE GATE|FAILED|PASSED|rc:" "$OUT/tests.log" | tail -36
if [ "${TESTS_ONLY:-0}" = 1 ]; then
  echo "TESTS_ONLY=1: stopping after the test stage"
  exit 0
fi
# 1b. Outside oracle for checkpoints of this backend (issue [cuda]): the two byte-level examples of
# the reference backend (GPT-2 and Llama shapes) trained from the same YAML with `framework: cuda`
# (200 steps), exported with `primus export hf`, loaded by transformers: no missing weights, greedy
# generation equal to `primus generate -t 0`, and transformers' loss on a text equal to Primus'
# fp32 model (`generate --score`) within 1e-4 (fp32 export) and 2e-2 (bf16 export)
# (tests/reference/hf_parity.py). HF_PARITY=0 skips it (~40 s).
if [ "${HF_PARITY:-1}" = 1 ]; then
  for c in shakespeare llama-shakespeare; do
    sed 's/framework: reference/framework: cuda/' "examples/reference/$c.yaml" > "examples/reference/.cuda-$c.yaml"
    rm -rf "/tmp/hfp-ws/$c" "/tmp/hfp-$c"
    timeout 120 "$BIN/primus" train pretrain --config "examples/reference/.cuda-$c.yaml" train_iters=200 \
      eval_interval=100 save_interval=200 workspace="/tmp/hfp-ws/$c" > "$OUT/hf_train_$c.log" 2>&1
    echo "train rc=$?" >> "$OUT/hf_train_$c.log"
    ck=$(ls -d /tmp/hfp-ws/$c/*/*/*/checkpoints 2>/dev/null | head -1)
    timeout 120 python3 tests/reference/hf_parity.py "$BIN/primus" "${ck:-/nonexistent}" "/tmp/hfp-$c" \
      > "$OUT/hf_parity_$c.json" 2> "$OUT/hf_parity_$c.err"
    echo "hf parity ($c, cuda-trained): rc=$? $(head -c 600 "$OUT/hf_parity_$c.json")"
    grep -E "validation|step 200/200" "$OUT/hf_train_$c.log" | tail -2
    rm -f "examples/reference/.cuda-$c.yaml"
  done
fi

# 1c. Reproducibility across processes (deterministic: true, patch cuda.attention.deterministic):
# GPT-2 124M on mock data, 12 steps with a checkpoint at step 6, twice in fresh processes, then a
# third process resumed from the first run's step-6 checkpoint: every logged loss must be equal
# bit for bit (run 2 vs 1 at steps 1-12, the resumed run vs run 1 at steps 7-12). The same pair
# without the key shows what the default's attention backward does. REPRO=0 skips it (~60 s).
if [ "${REPRO:-1}" = 1 ]; then
  repro_run() {  # $1: name, rest: extra key=value
    local name=$1; shift
    timeout 120 "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml mock_data=true \
      train_iters=12 micro_batch_size=8 global_batch_size=8 seq_length=1024 lr_warmup_iters=2 log_interval=1 \
      eval_interval=0 save_interval=6 save_at_end=false keep_last_k=2 "$@" exp_name="$name" > "$OUT/repro_$name.log" 2>&1
    echo "rc=$?" >> "$OUT/repro_$name.log"
    cp /tmp/repro-ws/$name/*/*/"$name"/metrics.jsonl "$OUT/repro_$name.jsonl" 2>/dev/null
  }
  rm -rf /tmp/repro-ws
  repro_run det1 deterministic=true workspace=/tmp/repro-ws/det1
  repro_run det2 deterministic=true workspace=/tmp/repro-ws/det2
  ck=$(ls -d /tmp/repro-ws/det1/*/*/det1/checkpoints/iter_0000006 2>/dev/null | head -1)
  repro_run det_resume deterministic=true load="${ck:-/nonexistent}" workspace=/tmp/repro-ws/det_resume
  repro_run def1 workspace=/tmp/repro-ws/def1
  repro_run def2 workspace=/tmp/repro-ws/def2
  rm -rf /tmp/repro-ws
  python3 - "$OUT" <<'PY' | tee "$OUT/repro_summary.txt"
import json, os, sys
out = sys.argv[1]
def losses(name):
    try:
        return {j["step"]: j["loss"] for j in map(json.loads, open(os.path.join(out, f"repro_{name}.jsonl"))) if "loss" in j}
    except OSError:
        return {}
def same(a, b, steps):
    got = [s for s in steps if s in a and s in b]
    eq = [s for s in got if a[s] == b[s]]
    return f"{len(eq)}/{len(steps)} steps bit-identical" + ("" if len(got) == len(steps) else f" ({len(steps) - len(got)} missing)")
d1, d2, dr, f1, f2 = (losses(n) for n in ("det1", "det2", "det_resume", "def1", "def2"))
print("reproducibility, GPT-2 124M B8 T1024 mock, 12 steps:")
print("  deterministic=true, two processes:          ", same(d1, d2, range(1, 13)))
print("  deterministic=true, resumed at 6 vs straight:", same(d1, dr, range(7, 13)))
print("  default (attention backward with atomics):  ", same(f1, f2, range(1, 13)))
PY
fi

# Train with the default attention unless only the fallback passed its tests.
# FORCE_ATTN=auto|turbo|fallback overrides that choice.
ATTN=${FORCE_ATTN:-auto}
if [ -z "${FORCE_ATTN:-}" ] && [ "$rc_default" != 0 ] && [ "$rc_fallback" = 0 ]; then
  ATTN=fallback
  echo "the default attention failed its tests: training with attention_backend=fallback"
fi

# 2. Ours: GPT-2 124M, mock data, micro-batch 16 x 1024, no accumulation, no eval.
WS=/tmp/primus-train-ws
rm -rf "$WS"
timeout 100 "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml \
  mock_data=true train_iters="$STEPS" micro_batch_size=16 global_batch_size=16 seq_length=1024 \
  lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1 \
  attention_backend="$ATTN" workspace="$WS" exp_name=bench > "$OUT/train.log" 2>&1
echo "train rc=$?" >> "$OUT/train.log"
tail -12 "$OUT/train.log"
cp "$WS"/*/*/bench/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null
rm -rf "$WS"  # the 124M checkpoint (1.5 GB) stays on the machine

# 2b. The default run times cuBLASLt's top 8 candidates per GEMM shape (gemm_algo_search: 8, kept in
# the per-machine cache file; a fresh device machine starts with an empty cache, so the first run
# searches, inside its unmeasured first steps). This is the same run with cuBLASLt's heuristic
# choice only (gemm_algo_search=1), case suffix /heuristic. HEURISTIC=0 skips it.
if [ "${HEURISTIC:-1}" != 0 ]; then
  rm -rf "$WS"
  timeout 100 "$BIN/primus" train pretrain \
    --config examples/cuda/gpt2-124M-shakespeare.yaml \
    mock_data=true train_iters="$STEPS" micro_batch_size=16 global_batch_size=16 seq_length=1024 \
    lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1 gemm_algo_search=1 \
    attention_backend="$ATTN" workspace="$WS" exp_name=bench > "$OUT/train_search.log" 2>&1
  echo "train (gemm_algo_search=1: heuristic) rc=$?" >> "$OUT/train_search.log"
  tail -4 "$OUT/train_search.log"
  cp "$WS"/*/*/bench/metrics.jsonl "$OUT/metrics_search.jsonl" 2>/dev/null
  rm -rf "$WS"
fi

# 2c. Step variants: CUDA_GRAPH=1 -> the eager step (cuda_graph=false; metrics_eager.jsonl, case
# suffix /eager) next to the default graph run; RECOMPUTE=X -> a run with recompute_granularity=X
# (metrics_recompute.jsonl); then a profiled run of the recompute variant (or of the default with PROFILE=1).
EAGER_ARGS=""; RC_ARGS=""; RC_SUFFIX=""
[ "${CUDA_GRAPH:-0}" = 1 ] && EAGER_ARGS="cuda_graph=false"
if [ -n "${RECOMPUTE:-}" ]; then
  RC_ARGS="recompute_granularity=$RECOMPUTE"
  RC_SUFFIX="/recompute-$RECOMPUTE"
fi
run_variant() {  # $1: name, rest: extra key=value arguments; RUN_ENV: VAR=value ... for the process
  local name=$1; shift
  rm -rf "$WS"
  # shellcheck disable=SC2086
  env ${RUN_ENV:-} timeout 100 "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml \
    mock_data=true train_iters="$STEPS" micro_batch_size=16 global_batch_size=16 seq_length=1024 \
    lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1 "$@" \
    attention_backend="$ATTN" workspace="$WS" exp_name=bench > "$OUT/train_$name.log" 2>&1
  echo "train ($*) rc=$?" >> "$OUT/train_$name.log"
  grep -E "\[cuda\] step:|captured" "$OUT/train_$name.log" | head -3
  tail -3 "$OUT/train_$name.log"
  cp "$WS"/*/*/bench/metrics.jsonl "$OUT/metrics_$name.jsonl" 2>/dev/null
  rm -rf "$WS"
}
# shellcheck disable=SC2086
[ -n "$EAGER_ARGS" ] && run_variant eager $EAGER_ARGS
# ENV_VARIANT="VAR=value ...[;VAR=value ...]": the default run once more under each ';'-separated
# set of environment variables (an A/B of a switch read from the environment, e.g.
# PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND=TURBO), case suffix /env:<the assignments>, metrics_env<i>.jsonl.
if [ -n "${ENV_VARIANT:-}" ]; then
  IFS=';' read -ra ENV_SETS <<< "$ENV_VARIANT"
  for i in "${!ENV_SETS[@]}"; do
    # shellcheck disable=SC2086
    env ${ENV_SETS[$i]} true || { echo "ENV_VARIANT set '${ENV_SETS[$i]}' is not a list of VAR=value"; exit 2; }
    RUN_ENV=${ENV_SETS[$i]} run_variant "env$i"
  done
fi
# shellcheck disable=SC2086
[ -n "$RC_ARGS" ] && run_variant recompute $RC_ARGS
# The default run on real text (tinyshakespeare, GPT-2 BPE, tokenized on first use; ~20 s more):
# costs that depend on the tokens (the embedding backward's runs of frequent tokens; docs/performance.md,
# levers) do not show on the mock data's uniform tokens. Case suffix /realdata; its
# ratio is against the same call's mock-data anchor (torch_anchor.py has no data option; its
# kernels do not depend on the tokens). REALDATA=0 skips it.
[ "${REALDATA:-1}" != 0 ] && run_variant realdata mock_data=false
profile_run() {  # $@: extra key=value arguments; the table goes to stdout, profile.json to $OUT
  rm -rf "$WS"
  PRIMUS_CUDA_PROFILE=1 timeout 100 "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml \
    mock_data=true train_iters="${PROFILE_STEPS:-12}" micro_batch_size=16 global_batch_size=16 seq_length=1024 \
    lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1 "$@" \
    attention_backend="$ATTN" workspace="$WS" exp_name=bench >> "$OUT/train_profile.log" 2>&1
  echo "train (profiled: ${*:-default}) rc=$?" >> "$OUT/train_profile.log"
  sed -n '/\[profile\] GPU time per phase/,/\[profile\] written/p' "$OUT/train_profile.log"
  cp "$WS"/*/*/bench/profile.json "$OUT/profile.json" 2>/dev/null
  rm -rf "$WS"
}
: > "$OUT/train_profile.log"
PROFILE_ARGS=$RC_ARGS
if [ -n "$PROFILE_ARGS" ] || [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  profile_run $PROFILE_ARGS
  # Events inside a graph not readable on this driver: the same profile eagerly.
  if ! grep -q '"phases"' "$OUT/profile.json" 2>/dev/null; then
    echo "no profile from the graph run: profiling eagerly"
    # shellcheck disable=SC2086
    profile_run cuda_graph=false $PROFILE_ARGS
  fi
fi

# 3. The anchor: PyTorch, torch.compile, same model and batch.
timeout 150 python3 "$CARRY/torch_anchor.py" --model gpt2-124M --batch 16 --mode compile \
  > "$OUT/anchor.json" 2> "$OUT/anchor.err"
echo "anchor rc=$?" >> "$OUT/anchor.err"
tail -3 "$OUT/anchor.err"

# 4. train.jsonl and the table.
python3 - "$OUT" "$DEVICE" "$COMMIT" "$MEASURE" "$PEAK" "$ATTN" "$RC_SUFFIX" "${ENV_VARIANT:-}" <<'EOF'
import json, os, sys, datetime
out, device, commit, measure, peak, attn = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
rc_suffix = sys.argv[7]
env_sets = [v.strip() for v in sys.argv[8].split(";") if v.strip()] if len(sys.argv) > 8 else []
def measure_ours(name):
    steps = [json.loads(l) for l in open(os.path.join(out, name)) if '"tokens_per_s"' in l]
    last = steps[-measure:]
    secs = sum(s["step_s"] for s in last)
    tokens = sum(s["tokens_per_s"] * s["step_s"] for s in last)
    flops = sum(s["tflops"] * 1e12 * s["step_s"] for s in last)
    return {"tokens_per_s": tokens / secs, "step_ms": 1e3 * secs / len(last), "mfu": flops / secs / peak,
            "tensor_mem_gib": max(s["arena_gib"] for s in steps), "device_mem_gib": max(s["mem_gib"] for s in steps),
            "loss": steps[-1]["loss"], "steps": len(last)}
runs, anchor = [], {}
for name, suffix in [("metrics.jsonl", ""), ("metrics_search.jsonl", "/heuristic"), ("metrics_eager.jsonl", "/eager"),
                     ("metrics_recompute.jsonl", rc_suffix), ("metrics_realdata.jsonl", "/realdata")] + \
                    [(f"metrics_env{i}.jsonl", "/env:" + v.replace(" ", ",")) for i, v in enumerate(env_sets)]:
    if name != "metrics.jsonl" and not os.path.exists(os.path.join(out, name)):
        continue
    try:
        runs.append((suffix, measure_ours(name)))
    except Exception as e:
        print(f"ours ({name}): no measurement:", e)
ours = runs[0][1] if runs else {}
try:
    a = json.loads(open(os.path.join(out, "anchor.json")).read().strip().splitlines()[-1])
    anchor = {"tokens_per_s": a["tok_s"], "step_ms": a["step_ms"], "mfu": a["mfu"], "tensor_mem_gib": a["mem_gib"],
              "loss": a.get("loss"), "name": a["anchor"] + " torch.compile"}
except Exception as e:
    print("anchor: no measurement:", e)
date = datetime.date.today().isoformat()
case = "gpt2-124M/b16/t1024/mock" + ("" if attn == "auto" else "/attention-" + attn)
rows, labels = [], []  # labels: the table's first column (the case's suffix)
# ratio = ours / anchor, higher is better: times and memory are inverted.
for suffix, o_run in runs:
    for metric, higher_better in [("tokens_per_s", True), ("mfu", True), ("step_ms", False), ("tensor_mem_gib", False)]:
        o, n = o_run.get(metric), anchor.get(metric)
        r = None
        if o and n:
            r = o / n if higher_better else n / o
        # The real-text run is not mock data: its case names the data instead.
        name = case.replace("/mock", "/tinyshakespeare") if suffix == "/realdata" else case + suffix
        rows.append({"bench": "train", "case": name, "device": device, "date": date, "commit": commit,
                     "metric": metric, "ours": o, "anchor": n,
                     "anchor_name": anchor.get("name", "pytorch torch.compile"), "ratio": round(r, 4) if r else None})
        labels.append(suffix or "default")
with open(os.path.join(out, "train.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print(f"\n==== train: GPT-2 124M, B=16, T=1024, mock data, mean of the last {ours.get('steps', '?')} steps, {device}")
print("  tensor_mem_gib: ours = the model's device arenas (sized for the batch, scratch included), "
      "anchor = torch.cuda.max_memory_allocated; ours with CUDA context and libraries:", ours.get("device_mem_gib"))
print(f"  {'case':<28}{'metric':<16}{'ours':>14}{'anchor':>14}{'ratio':>10}")
for label, r in zip(labels, rows):
    fmt = lambda v: "-" if v is None else (f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}")
    print(f"  {label:<28}{r['metric']:<16}{fmt(r['ours']):>14}{fmt(r['anchor']):>14}"
          f"{fmt(r['ratio']):>10}")
print(f"  final loss: ours {ours.get('loss')}, anchor {anchor.get('loss')} (random tokens: ~ln(50257) = 10.8)")
EOF

# 5. More of issue [cuda]'s cases (GPT-2 124M at micro-batch 32, the Llama-3.2-1B shape at 8 x
# 2048), ours then torch.compile each: bench/train/matrix_stage.sh; MATRIX=none skips it.
source bench/train/matrix_stage.sh
matrix_stage 2>&1 | tee "$OUT/matrix_summary.txt"

# The device returns at most 8 files: train.jsonl, the summaries, and one archive of the rest.
(cd "$OUT" && tar czf logs.tar.gz --exclude=logs.tar.gz --exclude=train.jsonl --exclude=matrix_summary.txt \
  --exclude=noise_floor.json ./* && find . -maxdepth 1 -type f ! -name logs.tar.gz ! -name train.jsonl \
  ! -name matrix_summary.txt ! -name noise_floor.json -delete)
ls "$OUT"
