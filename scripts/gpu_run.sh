#!/usr/bin/env bash
# The one call on the GPU machine: GPU tests, op benchmarks, attention benchmark, outside-oracle
# checks (Hugging Face parity of `primus export hf`) and, once backends/cuda exists, the
# side-by-side training benchmark against ../shared/bench/torch_anchor.py; a short table last.
# Build here first (scripts/gpu_prepare.sh fills the carried folders), then on the device:
#   run(command="scripts/gpu_run.sh", carry=[".carry", ".carry-turbo", ".carry-attn", ".carry-cuda"])
# Writes everything under $OUT (device tool) or /tmp/primus-gpu-out.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/primus-gpu-out}
mkdir -p "$OUT"
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

# 1. Hugging Face parity of exported checkpoints (CPU; transformers is on the GPU machine).
#    The primus binary: .carry/bin/primus, else the CUDA build carried in .carry-cuda.
source scripts/gpu_env.sh
PRIMUS_BIN=.carry/bin/primus
if [ ! -x "$PRIMUS_BIN" ] && [ -f .carry-cuda/primus.gz ]; then
  mkdir -p /tmp/primus-bin && gunzip -c .carry-cuda/primus.gz > /tmp/primus-bin/primus && chmod +x /tmp/primus-bin/primus
  cp .carry-cuda/lib*.so* /tmp/primus-bin/ 2>/dev/null
  export LD_LIBRARY_PATH=/tmp/primus-bin:$LD_LIBRARY_PATH
  PRIMUS_BIN=/tmp/primus-bin/primus
fi
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2
if [ -x "$PRIMUS_BIN" ] && [ -d .carry/ckpt ]; then
  for ck in .carry/ckpt/*/; do
    name=$(basename "$ck")
    if python3 tests/reference/hf_parity.py "$PRIMUS_BIN" "$ck" "/tmp/hfp-$name" > "$OUT/hf_parity_$name.json" 2> "$OUT/hf_parity_$name.err"; then
      summary+=("hf parity $name: PASS $(cat "$OUT/hf_parity_$name.json" | head -c 300)")
    else
      summary+=("hf parity $name: FAIL (see hf_parity_$name.json/.err)"); tail -5 "$OUT/hf_parity_$name.err"
    fi
  done
fi

# 2. Turbo op tests and benchmarks (ours and torch in this same call).
# RUN_OPS=0 skips stages 2 and 3 (when their results in bench/results are from this commit).
RUN_OPS=${RUN_OPS:-1}
if [ "$RUN_OPS" = 1 ] && [ -d .carry-turbo ] && [ -x bench/ops/run_on_gpu.sh ]; then
  OUT="$OUT/turbo" CARRY=.carry-turbo bench/ops/run_on_gpu.sh > "$OUT/turbo.log" 2>&1
  summary+=("turbo: $(grep -E 'PASSED|FAILED' "$OUT/turbo/tests.log" 2>/dev/null | tail -2 | tr '\n' ' ')")
fi

# 3. Attention tests and benchmark.
if [ "$RUN_OPS" = 1 ] && [ -d .carry-attn ] && [ -x bench/attention/run_on_gpu.sh ]; then
  OUT="$OUT/attention" CARRY=.carry-attn bench/attention/run_on_gpu.sh > "$OUT/attention.log" 2>&1
  summary+=("attention: $(grep -E 'PASSED|FAILED' "$OUT/attention/tests.log" 2>/dev/null | tail -2 | tr '\n' ' ')")
fi

# 4. The CUDA backend: correctness vs the reference backend, then training side by side with
#    ../shared/bench/torch_anchor.py (copied into .carry-cuda).
if [ -d .carry-cuda ] && [ -f bench/train/run_on_gpu.sh ]; then
  OUT="$OUT/train" CARRY=.carry-cuda bash bench/train/run_on_gpu.sh > "$OUT/train.log" 2>&1
  summary+=("cuda backend: $(grep -E 'PASSED|FAILED|rc=' "$OUT/train/tests.log" 2>/dev/null | tail -2 | tr '\n' ' ')")
  tail -12 "$OUT/train.log"
fi

echo
echo "==== summary ($(date -u +%F) on $(cut -d, -f1 "$OUT/device.txt"))"
for s in "${summary[@]}"; do echo "- $s"; done
