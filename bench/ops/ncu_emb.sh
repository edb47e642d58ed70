#!/usr/bin/env bash
# Nsight Compute durations of the embedding backward's kernels (iota, CUB radix sort, run sums) for 8
# token ids (runs of ~2048 rows), this build and the baseline (.carry-probe/primus_old.gz).
#   run(command="bash bench/ops/ncu_emb.sh", carry=[".carry-cuda", ".carry-probe"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && gunzip -c .carry-probe/primus_old.gz > /tmp/pb/primus_old && chmod +x /tmp/pb/*
export LD_LIBRARY_PATH="$PWD/.carry-cuda:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for bin in primus_old primus; do echo "== $bin"
"$NCU" --clock-control none --metrics gpu__time_duration.sum -k "regex:run_sum|Radix|iota" --launch-count 14 /tmp/pb/$bin benchmark embedding --shapes 16x1024x768x8 --backend TURBO --iters 2 2>&1 | grep -E "run_sum|Radix|iota|gpu__time_duration" | sed -E 's/^ *//; s/\(.*\) \(([0-9]+), 1, 1\)x\(([0-9]+).*/ grid \1 x \2/; s/gpu__time_duration.sum *//' | cut -c1-110 | head -30
done
