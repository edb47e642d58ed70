#!/usr/bin/env bash
# Host time per training step (the trainer's end-of-run line): GPT-2 124M B16, 30 steps, on mock data and on
# tinyshakespeare, with and without reading the next step's batches ahead, in one call. The device idles while
# the host is between steps and staging batches.
#   run(command="bash bench/train/host_time.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null 2>&1
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 exp_name=bench train_iters=30 log_interval=10)
# Each data choice with the next step's batches read ahead (the default) and without (PRIMUS_CUDA_READ_AHEAD=0),
# interleaved, ROUNDS times (default 2).
for r in $(seq "${ROUNDS:-2}"); do
  for m in true false; do
    for ra in 1 0; do
      PRIMUS_CUDA_READ_AHEAD=$ra timeout 150 /tmp/pb/primus "${ARGS[@]}" mock_data=$m workspace=/tmp/ws_h_$m > /tmp/h_$m.log 2>&1
      echo "== round $r mock_data=$m read_ahead=$ra rc=$?"
      grep -E "step 30/30|host time per step" /tmp/h_$m.log | sed 's/.*\] //; s/| loss.*grad norm [0-9.]* //; s/| tflops.*//'
    done
  done
done
