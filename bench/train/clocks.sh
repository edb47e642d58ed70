#!/usr/bin/env bash
# SM clock, power and energy per step while training, ours (primus, graph on, mock data) and the PyTorch anchor
# (torch.compile, ../shared/bench/torch_anchor.py from the carry) back to back on the same GPU, for each case of
# CASES (default "gpt2-124M:16"; e.g. "gpt2-124M:16 gpt2-124M:32 llama3.2-1B:8"). nvidia-smi samples every 100 ms;
# min / median / max over the steady part of each run (samples over 200 W, past the first fifth), the run's
# step time, and energy per step = median power x step time. Under the H200's 700 W cap a faster step draws the
# same power, so energy per step is what a step costs (docs/performance.md, "How to measure").
# STEPS (ours; GPT-2 400, Llama 50) and ANCHOR_STEPS (GPT-2 300, Llama 40) set the runs' lengths; ANCHOR=0 skips the anchor.
#   run(command="CASES='gpt2-124M:16 llama3.2-1B:8' bash bench/train/clocks.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
CARRY=${CARRY:-.carry-cuda}
mkdir -p /tmp/pb
if [ -e "$CARRY/primus.xz" ]; then xz -dc "$CARRY/primus.xz" > /tmp/pb/primus; else gunzip -c "$CARRY/primus.gz" > /tmp/pb/primus; fi
chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/$CARRY:${LD_LIBRARY_PATH:-}"
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv,noheader

summary() {  # $1: samples file, $2: step ms, $3: label
  python3 - "$1" "$2" "$3" <<'PY'
import sys
rows = [l.strip().split(",") for l in open(sys.argv[1]) if l.strip() and l[0].isdigit()]
busy = [(float(c), float(p), float(t)) for c, p, t in rows if float(p) > 200]  # samples while the GPU works
step_ms = float(sys.argv[2] or 0)
if not busy:
    print(f"{sys.argv[3]:<28} no samples over 200 W"); sys.exit()
v = [sorted(x[i] for x in busy[len(busy) // 5:]) for i in range(3)]
med = [x[len(x) // 2] for x in v]
print(f"{sys.argv[3]:<28} step {step_ms:8.2f} ms | clock MHz {v[0][0]:.0f} / {med[0]:.0f} / {v[0][-1]:.0f} | power W "
      f"{v[1][0]:.0f} / {med[1]:.0f} / {v[1][-1]:.0f} | {med[2]:.0f} C | {med[1] * step_ms / 1e3:6.2f} J/step "
      f"({len(v[0])} samples)")
PY
}

for c in ${CASES:-gpt2-124M:16}; do
  preset=${c%%:*} batch=${c#*:}
  case $preset in
    gpt2-124M) cfg=examples/cuda/gpt2-124M-shakespeare.yaml; seq=1024; steps=${STEPS:-400} asteps=${ANCHOR_STEPS:-300} ;;
    llama3.2-1B) cfg=examples/cuda/llama3.2-1B.yaml; seq=2048; steps=${STEPS:-50} asteps=${ANCHOR_STEPS:-40} ;;
    *) echo "unknown preset $preset"; continue ;;
  esac
  rm -rf /tmp/ws_c
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > /tmp/clk.csv &
  smi=$!
  # shellcheck disable=SC2086  # MODEL_ARGS: several key=value overrides, split on purpose
  timeout 300 /tmp/pb/primus train pretrain --config "$cfg" micro_batch_size="$batch" global_batch_size="$batch" \
    seq_length="$seq" lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true \
    train_iters="$steps" log_interval=$((steps / 5)) workspace=/tmp/ws_c ${MODEL_ARGS:-} > /tmp/c.log 2>&1
  rc=$?; kill $smi
  tok=$(grep -o '[0-9]* tok/s' /tmp/c.log | tail -1 | cut -d' ' -f1)
  step=$(python3 -c "print($batch * $seq / ${tok:-0} * 1e3 if ${tok:-0} else 0)")
  summary /tmp/clk.csv "$step" "primus $preset B$batch (rc=$rc)"
  [ "${ANCHOR:-1}" = 0 ] && continue
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > /tmp/clk_a.csv &
  smi=$!
  timeout 300 python3 "$CARRY/torch_anchor.py" --model "$preset" --batch "$batch" --mode compile \
    --steps "$asteps" > /tmp/a.json 2> /tmp/a.err
  rc=$?; kill $smi
  step=$(python3 -c "import json; print(json.loads(open('/tmp/a.json').read().strip().splitlines()[-1])['step_ms'])" 2>/dev/null)
  summary /tmp/clk_a.csv "${step:-0}" "torch.compile $preset B$batch (rc=$rc)"
done
