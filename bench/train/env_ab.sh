#!/usr/bin/env bash
# GPT-2 124M training (B16 x T1024, mock data, graph on, 30 steps) under several environment sets,
# ROUNDS (default 2) interleaved rounds in one call: step-30 tokens/s of each run with the median SM
# clock and board power sampled while it trained (nvidia-smi, 100 ms). Each set gets its own cuBLASLt
# algorithm cache file (fresh in round 1, reused after), so sets that change the algorithm search do
# not read each other's choices. CONFIG / SHAPE pick another model as in gaps.sh. The clock and power
# figures cover only samples over 300 W past the first fifth: a 30-step GPT-2 run trains for under a
# second, so they mostly show the start-up (STEPS=200 for a steady-state reading). Ends with each set's
# mean tokens/s, range and change against the first set.
#   run(command="VARIANTS='base:;sus30:PRIMUS_TURBO_CUBLASLT_SEARCH_MS=30' bash bench/train/env_ab.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb
if [ -e .carry-cuda/primus.xz ]; then xz -dc .carry-cuda/primus.xz > /tmp/pb/primus; else gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus; fi
chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
ARGS=(train pretrain --config "${CONFIG:-examples/cuda/gpt2-124M-shakespeare.yaml}"
      ${SHAPE:-micro_batch_size=16 global_batch_size=16 seq_length=1024}
      lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true
      train_iters=${STEPS:-30} log_interval=10 ${MODEL_ARGS:-})
IFS=';' read -ra SETS <<< "${VARIANTS:?VARIANTS='name:VAR=value ...;name2:...'}"
rm -f /tmp/envab_cache_*.json /tmp/envab_tps.txt
for round in $(seq "${ROUNDS:-2}"); do
  for i in "${!SETS[@]}"; do
    name=${SETS[$i]%%:*}; vars=${SETS[$i]#*:}
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > /tmp/envab_clk.csv &
    smi=$!
    env $vars PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=/tmp/envab_cache_$i.json timeout 300 /tmp/pb/primus "${ARGS[@]}" \
      workspace=/tmp/ws_envab > /tmp/envab.log 2>&1
    rc=$?; kill $smi 2>/dev/null; wait $smi 2>/dev/null
    tps=$(grep -o "step ${STEPS:-30}/${STEPS:-30}.*tok/s" /tmp/envab.log | sed 's/.*| \([0-9]* tok\/s\)/\1/')
    pw=$(python3 -c "
rows=[l.split(',') for l in open('/tmp/envab_clk.csv') if l.strip() and l[0].isdigit()]
b=sorted((float(c),float(p)) for c,p in rows if float(p)>300)
b=b[len(b)//5:] if len(b)>5 else b
if b:
  cs=sorted(x[0] for x in b); ps=sorted(x[1] for x in b)
  print(f'clock {cs[len(cs)//2]:.0f} MHz, power {ps[len(ps)//2]:.0f} W ({len(b)} samples)')
")
    echo "round $round $name rc=$rc $tps | $pw"
    echo "$name ${tps%% *}" >> /tmp/envab_tps.txt
  done
done
# Per set: mean, range and the mean against the first set's (same call, interleaved rounds).
python3 - <<'PY'
import collections
runs = collections.OrderedDict()
for line in open("/tmp/envab_tps.txt"):
    name, _, v = line.strip().partition(" ")
    runs.setdefault(name, [])
    if v.isdigit():
        runs[name].append(int(v))
base = None
for name, v in runs.items():
    if not v:
        print(f"{name:>24}: no tokens/s (failed runs)")
        continue
    mean = sum(v) / len(v)
    base = base or mean
    print(f"{name:>24}: mean {mean:,.0f} tok/s over {len(v)} (range {min(v):,}-{max(v):,}), {100 * (mean / base - 1):+.2f}% vs the first set")
PY
