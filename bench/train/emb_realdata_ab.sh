#!/usr/bin/env bash
# GPT-2 124M on real text (tinyshakespeare, GPT-2 BPE; B16 x T1024, graph on), two primus binaries
# back to back: throughput over 30 steps and the profiled embedding backward. Real text repeats a
# few tokens a lot (mock data's uniform tokens do not), which is what the embedding backward's run
# sums see. Carry: .carry-cuda (primus.gz = new) and .carry-probe (primus_old.gz = baseline).
#   run(command="bash bench/train/emb_realdata_ab.sh", carry=[".carry-cuda", ".carry-probe"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb
gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && gunzip -c .carry-probe/primus_old.gz > /tmp/pb/primus_old
chmod +x /tmp/pb/primus /tmp/pb/primus_old
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 exp_name=bench)
for round in 1 2; do
  for bin in primus_old primus; do
    WS=/tmp/ws_$bin
    timeout 150 /tmp/pb/$bin "${ARGS[@]}" train_iters=30 log_interval=10 workspace="$WS" > /tmp/log_$bin 2>&1
    echo "round $round $bin rc=$? $(grep -o 'step 30/30.*tok/s' /tmp/log_$bin | sed 's/| loss.*| \([0-9]* tok\/s\)/\1/')"
  done
done
for bin in primus_old primus; do
  PRIMUS_CUDA_PROFILE=1 timeout 150 /tmp/pb/$bin "${ARGS[@]}" train_iters=12 log_interval=4 workspace=/tmp/ws_p_$bin > /tmp/plog_$bin 2>&1
  echo "profile $bin rc=$?"; grep -iE "embedding|per step|total" /tmp/plog_$bin | head -6
done
