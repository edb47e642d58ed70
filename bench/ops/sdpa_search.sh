#!/usr/bin/env bash
# cuDNN SDPA engine search on the GPU machine: `primus benchmark attention --backend CUDNN` at the
# training shapes (GPT-2 124M B16, Llama-3.2-1B B8, issue [attention]'s T=2048 d128) with the
# heuristics' first engine configuration and with PRIMUS_TURBO_CUDNN_SDPA_SEARCH candidates
# timed (KNOBS=1 adds knob variants), ROUNDS times alternating, so each line compares within one
# call. The search's own log (every candidate's time and engine) is printed from the first round.
#   run(command="bash bench/ops/sdpa_search.sh", carry=[".carry-cuda"])
# shellcheck disable=SC1091
source scripts/gpu_env.sh
mkdir -p /tmp/pb && gunzip -c .carry-cuda/primus.gz > /tmp/pb/primus && chmod +x /tmp/pb/primus
SHAPES=${SHAPES:-16x1024x12x12x64,8x2048x32x8x64,8x2048x16x16x128}
SEARCH=${SEARCH:-16}
for round in $(seq "${ROUNDS:-2}"); do
  for variant in "1 0" "$SEARCH 0" "$SEARCH 1"; do
    set -- $variant
    echo "== round $round: PRIMUS_TURBO_CUDNN_SDPA_SEARCH=$1 PRIMUS_TURBO_CUDNN_SDPA_KNOBS=$2"
    PRIMUS_TURBO_CUDNN_SDPA_SEARCH=$1 PRIMUS_TURBO_CUDNN_SDPA_KNOBS=$2 timeout 300 /tmp/pb/primus benchmark attention \
      --backend CUDNN --shapes "$SHAPES" > /tmp/sdpa.log 2>&1
    echo "rc=$?"
    if [ "$round" = 1 ]; then grep -o 'cuDNN SDPA.*' /tmp/sdpa.log | sed 's/\] \[/]\n    [/g'; fi
    grep -E ' attention/' /tmp/sdpa.log
  done
done
