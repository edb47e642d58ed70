#!/usr/bin/env bash
# Session 25, one device call: the staged norm backward's fused finish (PRIMUS_TURBO_NORM_BWD_FINISH=fused:
# a cooperative launch that adds up its own partials after a grid barrier). 1) the norm GPU tests (incl.
# FusedFinishGivesTheBitsOfTheSeparateLaunch), 2) `primus benchmark norm --ab` separate vs fused,
# 3) GPT-2 124M B16 training with each (the step is a captured CUDA graph: the cooperative launch inside
# it), ROUNDS interleaved processes. Output in one archive (at most 8 files come back).
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s25-normfinish/run.sh", carry=[".carry-nf"])
set -u
OUT=${OUT:-/tmp/nf-out}
C=${CARRY:-.carry-nf}
B=/tmp/nfbin; mkdir -p "$B" "$OUT"
for f in "$C"/*.xz; do n=$(basename "${f%.*}"); xz -dc "$f" > "$B/$n"; chmod +x "$B/$n"; done
cp "$C"/libgomp.so.1 "$B"/
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/env.txt"
timeout 120 "$B/test_turbo_gpu" --gtest_brief=1 --gtest_filter="${GTEST:-*FusedFinish*:Turbo/NormTest.*}" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -6
timeout 90 "$B/primus" benchmark norm --ab PRIMUS_TURBO_NORM_BWD_FINISH=separate,fused --ab-rounds "${AB_ROUNDS:-5}" \
  --json "$OUT/ab.jsonl" --commit "$(cat "$C/commit.txt" 2>/dev/null || echo unknown)" > "$OUT/ab.log" 2>&1
echo "benchmark --ab rc=$?"; grep -E '^  (layernorm_bwd|rmsnorm_bwd)[^ ]* .* ms ' "$OUT/ab.log"
cfg=examples/cuda/gpt2-124M-shakespeare.yaml; shape="micro_batch_size=16 global_batch_size=16 seq_length=1024"
for round in $(seq "${ROUNDS:-2}"); do
  for v in separate fused; do
    # shellcheck disable=SC2086
    PRIMUS_TURBO_NORM_BWD_FINISH=$v timeout 120 "$B/primus" train pretrain --config "$cfg" $shape \
      lr_warmup_iters=5 eval_interval=0 save_interval=0 save_at_end=false exp_name=bench mock_data=true \
      train_iters=30 log_interval=10 workspace=/tmp/ws_nf > "$OUT/train_${v}_r$round.log" 2>&1
    echo "gpt2 $v round $round rc=$? $(grep -o 'step 30/30.*' "$OUT/train_${v}_r$round.log" | grep -o 'loss [0-9.]*\|[0-9]* tok/s' | tr '\n' ' ')"
  done
done
tar czf /tmp/nf_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/nf_all.tgz "$OUT/all.tgz"
