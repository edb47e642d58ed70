#!/usr/bin/env bash
# GPT-2 124M training (B16 x T1024, graph on, 30 steps), this build against a baseline build, back to back
# in ROUNDS (default 2) interleaved rounds, on mock data and on tinyshakespeare (DATA="mock real", the
# default; either alone); then, with PROFILE_GREP set, a profiled 12-step run of each (on PROFILE_DATA, mock
# or real, default mock), the phase lines matching PROFILE_GREP (e.g. "loss|per step"). Prints step-30
# tokens/s per run.
# Carry: .carry-cuda (primus.gz = new) and .carry-probe (primus_old.gz = baseline).
#   run(command="PROFILE_GREP='loss|step' bash bench/train/bin_ab.sh", carry=[".carry-cuda", ".carry-probe"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb
gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && gunzip -c .carry-probe/primus_old.gz > /tmp/pb/primus_old
chmod +x /tmp/pb/primus /tmp/pb/primus_old
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 exp_name=bench)
for round in $(seq "${ROUNDS:-2}"); do
  for data in ${DATA:-mock real}; do
    mock=false; [ "$data" = mock ] && mock=true
    for bin in primus_old primus; do
      timeout 150 /tmp/pb/$bin "${ARGS[@]}" mock_data=$mock train_iters=30 log_interval=10 workspace=/tmp/ws_$bin > /tmp/log_$bin 2>&1
      echo "round $round $data $bin rc=$? $(grep -o 'step 30/30.*tok/s' /tmp/log_$bin | sed 's/| loss.*| \([0-9]* tok\/s\)/\1/')"
    done
  done
done
if [ -n "${PROFILE_GREP:-}" ]; then
  for bin in primus_old primus; do
    pmock=true; [ "${PROFILE_DATA:-mock}" = real ] && pmock=false
    PRIMUS_CUDA_PROFILE=1 timeout 150 /tmp/pb/$bin "${ARGS[@]}" mock_data=$pmock train_iters=12 log_interval=4 workspace=/tmp/ws_p_$bin > /tmp/plog_$bin 2>&1
    echo "profile $bin rc=$?"; grep -iE "$PROFILE_GREP" /tmp/plog_$bin | head -8
  done
fi
