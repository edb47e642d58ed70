#!/usr/bin/env bash
# One device call: where a training step's GPU time goes, ours (primus, PRIMUS_CUDA_PROFILE=1, per
# phase) and the PyTorch anchor's (torch.compile, torch.profiler, per kernel family: gemm /
# attention / optimizer / other; bench/train/anchor_profile.py), for each case of CASES
# (default "gpt2-124M:16 gpt2-124M:32 llama3.2-1B:8"). Shows how much of the anchor's step is
# GEMMs and attention, i.e. what any implementation with the same libraries' GEMM and attention
# speed can gain over it (docs/performance.md, "The step against torch.compile"). Output: $OUT/split_<case>.{json,log} and a table.
#   run(command="OUT=\$OUT bash bench/train/split_step.sh", carry=[".carry-cuda"])
# The carry holds primus.xz (or .gz), libgomp.so.1 and torch_anchor.py (bench/train/prepare_carry.sh).
set -u
CARRY=${CARRY:-.carry-cuda}
OUT=${OUT:-/tmp/split-out}
BIN=/tmp/split-bin
mkdir -p "$OUT" "$BIN"
if [ -e "$CARRY/primus.xz" ]; then xz -dc "$CARRY/primus.xz" > "$BIN/primus"; else gunzip -c "$CARRY/primus.gz" > "$BIN/primus"; fi
chmod +x "$BIN/primus"; cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
for c in ${CASES:-gpt2-124M:16 gpt2-124M:32 llama3.2-1B:8}; do
  preset=${c%%:*} batch=${c#*:}
  case $preset in
    gpt2-124M) cfg=examples/cuda/gpt2-124M-shakespeare.yaml; seq=1024 ;;
    llama3.2-1B) cfg=examples/cuda/llama3.2-1B.yaml; seq=2048 ;;
    *) echo "unknown preset $preset"; continue ;;
  esac
  name=${preset}_b$batch ws=/tmp/split-ws
  rm -rf "$ws"
  PRIMUS_CUDA_PROFILE=1 timeout 200 "$BIN/primus" train pretrain --config "$cfg" mock_data=true \
    train_iters="${PROFILE_STEPS:-12}" micro_batch_size="$batch" global_batch_size="$batch" seq_length="$seq" \
    lr_warmup_iters=5 log_interval=4 eval_interval=0 save_interval=0 save_at_end=false workspace="$ws" exp_name=s \
    > "$OUT/split_${name}_ours.log" 2>&1
  echo "ours $name rc=$?"
  cp "$ws"/*/*/s/profile.json "$OUT/split_${name}_ours.json" 2>/dev/null
  rm -rf "$ws"
  timeout 300 python3 bench/train/anchor_profile.py --anchor-dir "$CARRY" --model "$preset" --batch "$batch" \
    > "$OUT/split_${name}_anchor.json" 2> "$OUT/split_${name}_anchor.err"
  echo "anchor $name rc=$?"
done
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def ours_split(p):  # our phases in the anchor's families (GEMM phases hold their epilogues and bias sums)
    f = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for ph in p["phases"]:
        n = ph["phase"]
        fam = ("gemm" if "GEMM" in n else "attention" if n in ("attention", "bwd attention")
               else "optimizer" if n.startswith("optimizer") else "other")
        f[fam] += ph["ms_per_step"]
    return f
print(f"{'case':<16} {'who':<7} {'step ms':>8} {'gemm':>8} {'attn':>8} {'adamw':>8} {'other':>8}")
for path in sorted(glob.glob(os.path.join(out, "split_*_anchor.json"))):
    name = os.path.basename(path)[len("split_"):-len("_anchor.json")]
    try:
        a = json.loads(open(path).read().strip().splitlines()[-1])
        f = a["families_ms"]
        print(f"{name:<16} {'torch':<7} {a['step_ms']:>8.2f} {f.get('gemm', 0):>8.2f} {f.get('attention', 0):>8.2f} "
              f"{f.get('optimizer', 0):>8.2f} {f.get('other', 0):>8.2f}")
    except Exception as e:
        print(f"{name:<16} torch: no result ({type(e).__name__}: {e})")
    try:
        p = json.load(open(os.path.join(out, f"split_{name}_ours.json")))
        f = ours_split(p)
        print(f"{name:<16} {'primus':<7} {p['step_ms']:>8.2f} {f['gemm']:>8.2f} {f['attention']:>8.2f} "
              f"{f['optimizer']:>8.2f} {f['other']:>8.2f}")
    except Exception as e:
        print(f"{name:<16} primus: no profile ({type(e).__name__})")
print("torch: unprofiled wall step and kernel time per family (torch.profiler); primus: profiled phases (CUDA events).")
EOF
