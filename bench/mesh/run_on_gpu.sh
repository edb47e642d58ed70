#!/usr/bin/env bash
# One device call (one H200) for the cuda backend's mesh paths, N ranks as threads on one GPU:
#   1. tensor parallelism: test_cuda_gpu's TpGpuTest (tp2 vs one rank, 20 steps, three tiny models);
#      sharded data parallelism (FsdpGpuTest: zero2 / fsdp2 vs one rank accumulating) and context
#      parallelism (CpGpuTest: cp2 vs one rank); the three side by side (MeshGpuTest: tp x cp, FSDP x
#      tp, FSDP over dp x cp, tp x cp x dp, up to eight ranks, vs one rank accumulating); expert
#      parallelism (EpGpuTest: ep2 / ep4, each rank its experts and its part of the batch, vs one rank;
#      EpGpuRecipeTest: the same with bf16 expert gradients and split masters, FP8 experts,
#      recomputation and Muon)
#   2. the ops it added or changed: test_turbo_gpu's embedding and cross-entropy tests
#   3. the threaded process group's device collectives (test_threaded_gpu)
#   4. no regression of the one-rank model: test_cuda_gpu's parity tests against the reference
#   5. the one-GPU trainer: test_cuda_gpu's launch-ahead test (primus itself, carried) and a
#      50-step GPT-2 run of the embedded example (its last step line)
# and prints a table last. Build here first: bash bench/mesh/prepare_carry.sh, then
#   run(command="bash bench/mesh/run_on_gpu.sh", carry=[".carry-mesh"])
# STAGES=tp,fsdp,cp,mesh,ep,ops,threads,parity picks stages; every stage runs under `timeout`, cut to what is left
# before BUDGET_S (540 s).
set -u
CARRY=${CARRY:-.carry-mesh}
OUT=${OUT:-/tmp/mesh-out}
BIN=/tmp/mesh-bin
STAGES=${STAGES:-tp,fsdp,cp,mesh,ep,ops,threads,parity,trainer}
source bench/tools/carry.sh
carry_deadline "${BUDGET_S:-540}"
mkdir -p "$OUT"
carry_unpack "$CARRY" "$BIN"
echo "$(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) commit $(cat "$CARRY/commit.txt")"
want() { [[ ",$STAGES," == *",$1,"* ]]; }
declare -a ROWS
stage() {  # stage NAME SECONDS BINARY FILTER
  local name=$1 limit rc
  limit=$(cap "$2")
  timeout "$limit" "$BIN/$3" --gtest_filter="$4" > "$OUT/$name.log" 2>&1
  rc=$?
  local passed failed
  passed=$(grep -c "^\[       OK \]" "$OUT/$name.log")
  failed=$(grep -c "^\[  FAILED  \] [A-Za-z]" "$OUT/$name.log")
  ROWS+=("$(printf '%-8s rc=%-3s passed=%-4s failed=%s' "$name" "$rc" "$passed" "$failed")")
  grep -E "^\[(gpu|host)|^\[  FAILED|Failure|error" "$OUT/$name.log" | head -40
}
want tp && stage tp 240 test_cuda_gpu '*TpGpu*'
want fsdp && stage fsdp 300 test_cuda_gpu '*FsdpGpu*:*DpGpuInBackward*'
want cp && stage cp 240 test_cuda_gpu '*CpGpu*'
want mesh && stage mesh 300 test_cuda_gpu '*MeshGpu*'
want ep && stage ep 180 test_cuda_gpu '*EpGpu*'
want ops && stage ops 120 test_turbo_gpu '*Embedding*:*CrossEntropy*:*Loss*:*CountsCast*'
want threads && stage threads 60 test_threaded_gpu '*'
want parity && stage parity 240 test_cuda_gpu "${PARITY_FILTER:-*ModelParity*:*TrainingParity*}"
if want trainer && [ -x "$BIN/primus" ]; then
  stage trainer 150 test_cuda_gpu '*LaunchAhead*'
  timeout "$(cap 120)" "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml \
    workspace=/tmp/mesh-ws train_iters=50 save_interval=0 save_at_end=false eval_interval=0 > "$OUT/gpt2.log" 2>&1
  ROWS+=("$(printf '%-8s rc=%-3s %s' gpt2 "$?" "$(grep -o 'step 50/50.*' "$OUT/gpt2.log" | cut -c1-150)")")
fi
# BASELINE=<binary carried as NAME.xz> FILTER=...: the same filter on an older build, for telling a
# regression from a flaky test.
if [ -n "${BASELINE:-}" ]; then stage baseline 120 "$BASELINE" "${BASE_FILTER:-*}"; fi
tar -C "$OUT" -czf "$OUT/logs.tar.gz" --exclude=logs.tar.gz . 2>/dev/null
echo "== mesh on one GPU =="
printf '%s\n' "${ROWS[@]}"
