#!/usr/bin/env bash
# Phase profiles (PRIMUS_CUDA_PROFILE=1) of GPT-2 124M B16 on mock data and on tinyshakespeare, one after the
# other in one call, to see where real data costs time.
#   run(command="bash bench/train/profile_mock_vs_real.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null 2>&1
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16 seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 exp_name=bench train_iters=22 log_interval=11)
for m in true false; do
  PRIMUS_CUDA_PROFILE=1 timeout 150 /tmp/pb/primus "${ARGS[@]}" mock_data=$m workspace=/tmp/ws_$m > /tmp/p_$m.log 2>&1
  echo "== mock_data=$m rc=$?"; sed -n '/GPU time per phase/,/written/p' /tmp/p_$m.log | head -30
done
