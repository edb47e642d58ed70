#!/usr/bin/env bash
# SM clock and power while GPT-2 124M trains (B16 x T1024, mock data, graph on, 150 steps): nvidia-smi sampled
# every 100 ms, printed as min / median / max over the run's steady part, beside the same run's step time.
# Tells how far the sustained clock sits below the boost clock that isolated kernels (Nsight Compute) see.
#   run(command="bash bench/train/clocks.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv,noheader
ARGS=(train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml micro_batch_size=16 global_batch_size=16
      seq_length=1024 lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true
      train_iters=${STEPS:-150} log_interval=25 ${MODEL_ARGS:-})
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > /tmp/clk.csv &
smi=$!
timeout 300 /tmp/pb/primus "${ARGS[@]}" workspace=/tmp/ws_c > /tmp/c.log 2>&1
echo "train rc=$?"; kill $smi
grep -E "step +[0-9]+/" /tmp/c.log | sed 's/.*\] //; s/| lr.*| \([0-9]* tok\/s\).*/\1/' | tail -4
python3 - <<'PY'
rows = [l.strip().split(",") for l in open("/tmp/clk.csv") if l.strip() and l[0].isdigit()]
busy = [(float(c), float(p), float(t)) for c, p, t in rows if float(p) > 200]  # samples while the GPU works
if busy:
    n = len(busy)
    for i, name in enumerate(["clock MHz", "power W", "temperature C"]):
        v = sorted(x[i] for x in busy[n // 5:])  # past the first fifth (start-up)
        print(f"{name}: min {v[0]:.0f}  median {v[len(v) // 2]:.0f}  max {v[-1]:.0f}  ({len(v)} samples over 200 W)")
PY
command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -2 || echo "no nsys"
