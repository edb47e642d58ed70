#!/usr/bin/env bash
# The GPU timeline of GPT-2 124M training steps (B16 x T1024, mock data, graph on) through the CUPTI tracer
# (turbo/bench/tools/cupti_trace.cpp, LD_PRELOAD), and the idle time between one replayed step's kernels
# (bench/tools/cupti_gaps.py). Carry .carry-cuda with libcupti_trace.so and libcupti.so.13
# (bench/tools/build_cupti_trace.sh). MODEL_ARGS adds training overrides; $OUT/cupti_trace.csv keeps the trace.
#   run(command="bash bench/train/gaps.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
OUT=${OUT:-/tmp/gaps-out}
mkdir -p /tmp/pb "$OUT"
if [ -e .carry-cuda/primus.xz ]; then xz -dc .carry-cuda/primus.xz > /tmp/pb/primus; else gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus; fi
chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
# CONFIG / SHAPE: another model (e.g. CONFIG=examples/cuda/llama3.2-1B.yaml SHAPE="micro_batch_size=8
# global_batch_size=8 seq_length=2048").
ARGS=(train pretrain --config "${CONFIG:-examples/cuda/gpt2-124M-shakespeare.yaml}"
      ${SHAPE:-micro_batch_size=16 global_batch_size=16 seq_length=1024}
      lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true
      train_iters=${STEPS:-20} log_interval=10 ${MODEL_ARGS:-})
timeout 300 env PRIMUS_CUPTI_TRACE="$OUT/cupti_trace.csv" LD_PRELOAD="$PWD/.carry-cuda/libcupti_trace.so" \
  /tmp/pb/primus "${ARGS[@]}" workspace=/tmp/ws_g > /tmp/g.log 2>&1
echo "traced run rc=$?: $(grep -o 'step [0-9]*/[0-9]*.*tok/s' /tmp/g.log | tail -1 | sed 's/| loss.*| \([0-9]* tok\/s\)/\1/')"
grep cupti_trace /tmp/g.log
timeout 200 /tmp/pb/primus "${ARGS[@]}" workspace=/tmp/ws_g2 > /tmp/g2.log 2>&1
echo "untraced run rc=$?: $(grep -o 'step [0-9]*/[0-9]*.*tok/s' /tmp/g2.log | tail -1 | sed 's/| loss.*| \([0-9]* tok\/s\)/\1/')"
python3 bench/tools/cupti_gaps.py "$OUT/cupti_trace.csv"
python3 bench/tools/cupti_kernels.py "$OUT/cupti_trace.csv" "" "${KERNEL_ROWS:-30}"
