#!/usr/bin/env bash
# Every kernel of one GPT-2 124M training step (B16 x T1024, mock data) under Nsight Compute: duration and
# DRAM bytes read / written and SM clock per kernel, in launch order, as $OUT/ncu_step.csv, plus a table per kernel name
# (bench/train/ncu_step_table.py) against the same run's step time. The step runs eagerly (cuda_graph=false,
# no launch-ahead) so that each kernel is one launch; a short run first fills the cuBLASLt algorithm cache
# so the profiled run times no candidates. Steps 1-2 are warm-up; the table covers step 3.
#   run(command="bash bench/train/ncu_step.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
OUT=${OUT:-/tmp/ncu-out}
mkdir -p /tmp/pb "$OUT" && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
export PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=/tmp/ncu_algos.json PRIMUS_CUDA_LAUNCH_AHEAD=0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name --format=csv,noheader
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true
      ${MODEL_ARGS:-})
timeout 200 /tmp/pb/primus "${ARGS[@]}" train_iters=30 log_interval=10 workspace=/tmp/ws_n > /tmp/n_warm.log 2>&1
echo "graph run rc=$?: $(grep -o 'step 30/30.*tok/s' /tmp/n_warm.log | sed 's/| loss.*| \([0-9]* tok\/s\)/\1/')"
timeout 500 "$NCU" --clock-control none --nvtx --nvtx-include "step/" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_elapsed.avg.per_second --csv \
  /tmp/pb/primus "${ARGS[@]}" train_iters=3 log_interval=1 cuda_graph=false workspace=/tmp/ws_n2 > "$OUT/ncu_step.csv" 2> /tmp/n_err.log
echo "ncu rc=$? ($(wc -l < "$OUT/ncu_step.csv") lines)"; tail -3 /tmp/n_err.log
python3 bench/train/ncu_step_table.py "$OUT/ncu_step.csv" "$(grep -o '[0-9]* tok/s' /tmp/n_warm.log | tail -1 | cut -d' ' -f1)" ${TOKENS:-16384}
