# Temporary driver (session 3): 2-GPU ZeRO-1 throughput under NCCL channel / bucket-size variants,
# against 1 GPU in the same call. Prints one line per run.
CARRY=.carry-scaling; BIN=/tmp/scaling-bin; mkdir -p $BIN /tmp/v
for f in $CARRY/*.gz; do gunzip -c $f > $BIN/$(basename $f .gz); chmod +x $BIN/$(basename $f .gz); done
cp $CARRY/lib*.so* $BIN/ 2>/dev/null
source scripts/gpu_env.sh; export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
G2=(--config examples/cuda/gpt2-124M-shakespeare.yaml mock_data=true seq_length=1024 micro_batch_size=16 train_iters=30 lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 save_at_end=false)
LL=(--config examples/cuda/llama3.2-1B.yaml mock_data=true micro_batch_size=4 train_iters=30 lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 save_at_end=false)
tok() { python3 -c "
import json,glob
m=[json.loads(l) for l in open(glob.glob('/tmp/vws/*/*/$1/metrics.jsonl')[0]) if 'tokens_per_s' in l][-20:]
print(round(sum(s['tokens_per_s']*s['step_s'] for s in m)/sum(s['step_s'] for s in m)))"; }
run() { local name=$1 n=$2; shift 2; local c=($BIN/primus); [ $n -gt 1 ] && c+=(launch --nproc-per-node $n --timeout 60 --)
  timeout 90 "${c[@]}" train pretrain workspace=/tmp/vws exp_name=$name "$@" > /tmp/v/$name.log 2>&1; echo "$name rc=$? $(tok $name)"; }
run g1 1 "${G2[@]}" global_batch_size=16
run g2_b160 2 "${G2[@]}" global_batch_size=32 use_distributed_optimizer=true ddp_bucket_size_mb=160
run g2_b80 2 "${G2[@]}" global_batch_size=32 use_distributed_optimizer=true ddp_bucket_size_mb=80
run l1 1 "${LL[@]}" global_batch_size=4
run l2_b160 2 "${LL[@]}" global_batch_size=8 use_distributed_optimizer=true ddp_bucket_size_mb=160
run l2_b80 2 "${LL[@]}" global_batch_size=8 use_distributed_optimizer=true ddp_bucket_size_mb=80
tar czf $OUT/v.tgz -C /tmp/v .
