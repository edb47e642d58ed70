#!/usr/bin/env bash
# One device call: the GPU op tests, then primus_ops_bench and torch_ops.py back to back on the
# same GPU. Run from the repository root with the carried folder (default .carry-turbo) holding
# test_turbo_gpu.gz, primus_ops_bench.gz, libgomp.so.1 and the bench/ops python scripts.
# Results go to $OUT (device.txt, tests.log, ours.jsonl, torch.jsonl, bench.log).
set -u
CARRY=${CARRY:-.carry-turbo}
OUT=${OUT:-/tmp/turbo-out}
mkdir -p "$OUT" /tmp/turbo-bin
for f in "$CARRY"/*.gz; do gunzip -c "$f" > /tmp/turbo-bin/$(basename "$f" .gz); chmod +x /tmp/turbo-bin/$(basename "$f" .gz); done
cp "$CARRY"/lib*.so* /tmp/turbo-bin/ 2>/dev/null
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 /usr/lib/x86_64-linux-gnu/libcublasLt.so.13 2>/dev/null | head -1)
if [ -z "$lt" ]; then lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], 'lib', 'libcublasLt.so.13'))" 2>/dev/null); fi
export LD_LIBRARY_PATH=/tmp/turbo-bin:$(dirname "${lt:-/nonexistent/x}"):${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print(torch.__version__)" > "$OUT/torch_version.txt" 2>/dev/null
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  /tmp/turbo-bin/test_turbo_gpu --gtest_brief=1 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  /tmp/turbo-bin/primus_ops_bench --out "$OUT/ours.jsonl" ${ONLY:+--only $ONLY} 2>&1 | tee "$OUT/bench.log"
  PYTHONUNBUFFERED=1 python3 "$CARRY/torch_ops.py" --out "$OUT/torch.jsonl" ${ONLY:+--only $ONLY} 2>&1 | tee "$OUT/torch.log"
fi
