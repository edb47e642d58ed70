#!/usr/bin/env bash
# One device call: the GPU op tests, then `primus benchmark` (our side) and torch_ops.py (the
# PyTorch side) back to back on the same GPU, so one call gives the side-by-side ratio.
# Run from the repository root with the carried folder (default .carry-turbo, filled by
# bench/ops/prepare_carry.sh) holding test_turbo_gpu.gz, test_turbo_{lazy,real}_libs.gz, libgomp.so.1,
# commit.txt and primus.gz (a CUDA build of primus; else .carry-cuda/primus.gz, else
# $PRIMUS_CUDA_BIN).
# Results go to $OUT (device.txt, tests.log, ours.jsonl, torch.jsonl, bench.log, torch.log; with
# ROUNDS=n also ours_r<i>.jsonl / torch_r<i>.jsonl, both sides timed n times alternating);
# then, here: bench/ops/merge_ops.py --ours ours_r1.jsonl ... --torch torch_r1.jsonl ... --out bench/results/ops.jsonl
# (it appends; each line the median of the rounds, with the per-round ratio range).
# STAGE=tests|bench|all (default all); ONLY=gemm|mem limits the benchmark.
# cuBLASLt is found by primus itself at first use (turbo/core/dynamic_library.h: the loader's
# path, /usr/local/cuda/lib64, PyTorch's nvidia/cublas/lib); scripts/gpu_env.sh only adds the
# same folders to LD_LIBRARY_PATH, preferring the toolkit's cuBLASLt and the wheel's cuDNN.
set -u
CARRY=${CARRY:-.carry-turbo}
OUT=${OUT:-/tmp/turbo-out}
BIN=/tmp/turbo-bin
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do [ -f "$f" ] && gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
PRIMUS=${PRIMUS_CUDA_BIN:-$BIN/primus}
if [ ! -x "$PRIMUS" ] && [ -f .carry-cuda/primus.gz ]; then
  gunzip -c .carry-cuda/primus.gz > "$BIN/primus" && chmod +x "$BIN/primus" && PRIMUS=$BIN/primus
fi
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || cat .carry-cuda/commit.txt 2>/dev/null || echo unknown)
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print(torch.__version__)" > "$OUT/torch_version.txt" 2>/dev/null
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  PRIMUS_BIN=$PRIMUS "$BIN/test_turbo_gpu" --gtest_brief=1 2>&1 | tee "$OUT/tests.log" | tail -40
  # Loaded at first use: primus must not need cuBLASLt/cuDNN to start, and must say why when missing.
  { ldd "$PRIMUS" | grep -E "cublas|cudnn" || echo "primus: no load-time cuBLASLt/cuDNN dependency";
    for t in test_turbo_lazy_libs test_turbo_real_libs; do [ -x "$BIN/$t" ] && "$BIN/$t" --gtest_brief=1; done; } 2>&1 |
    tee -a "$OUT/tests.log" | tail -8
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  ops="gemm norm activation rope embedding loss optimizer"
  [ "${ONLY:-}" = gemm ] && ops="gemm"
  [ "${ONLY:-}" = mem ] && ops="norm activation rope embedding loss optimizer"
  # ROUNDS=n (default 1): both sides n times, alternating, into ours_r<i>.jsonl / torch_r<i>.jsonl
  # (round 1 also as ours.jsonl / torch.jsonl); merge_ops.py then takes the medians.
  ROUNDS=${ROUNDS:-1}
  rm -f "$OUT"/ours*.jsonl "$OUT"/torch*.jsonl
  for r in $(seq 1 "$ROUNDS"); do
    "$PRIMUS" benchmark $ops --json "$OUT/ours_r$r.jsonl" --commit "$COMMIT" 2>&1 | tee "$OUT/bench_r$r.log" |
      { [ "$r" = 1 ] && cat || tail -3; }
    PYTHONUNBUFFERED=1 python3 bench/ops/torch_ops.py --out "$OUT/torch_r$r.jsonl" ${ONLY:+--only $ONLY} 2>&1 |
      tee "$OUT/torch_r$r.log" | { [ "$r" = 1 ] && cat || tail -3; }
  done
  cp "$OUT/ours_r1.jsonl" "$OUT/ours.jsonl"; cp "$OUT/torch_r1.jsonl" "$OUT/torch.jsonl"
  cp "$OUT/bench_r1.log" "$OUT/bench.log"; cp "$OUT/torch_r1.log" "$OUT/torch.log"
  echo "merge here: bench/ops/merge_ops.py --ours $(seq -s ' ' -f 'ours_r%g.jsonl' 1 "$ROUNDS")" \
    "--torch $(seq -s ' ' -f 'torch_r%g.jsonl' 1 "$ROUNDS") --out bench/results/ops.jsonl"
fi
