#!/usr/bin/env bash
# Host time per training step (the trainer's end-of-run line): GPT-2 124M B16, 30 steps, on mock data and on
# tinyshakespeare, with a host-side switch on and off, in one call: AB_VAR (default PRIMUS_CUDA_READ_AHEAD,
# reading the next step's batches ahead; PRIMUS_CUDA_LAUNCH_AHEAD: queueing step s + 1 before reading step s's
# result). Without either the device idles while the host is between steps and staging batches.
#   run(command="AB_VAR=PRIMUS_CUDA_LAUNCH_AHEAD bash bench/train/host_time.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null 2>&1
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 exp_name=bench train_iters=30 log_interval=10)
# Each data choice with the switch on (the default) and off, interleaved, ROUNDS times (default 2).
AB_VAR=${AB_VAR:-PRIMUS_CUDA_READ_AHEAD}
for r in $(seq "${ROUNDS:-2}"); do
  for m in true false; do
    for ra in 1 0; do
      env "$AB_VAR=$ra" timeout 150 /tmp/pb/primus "${ARGS[@]}" mock_data=$m workspace=/tmp/ws_h_$m > /tmp/h_$m.log 2>&1
      echo "== round $r mock_data=$m $AB_VAR=$ra rc=$?"
      grep -E "step 30/30|host time per step" /tmp/h_$m.log | sed 's/.*\] //; s/| loss.*grad norm [0-9.]* //; s/| tflops.*//'
    done
  done
done
