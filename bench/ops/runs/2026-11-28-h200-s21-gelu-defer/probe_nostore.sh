#!/usr/bin/env bash
# The probes of README.md (PROBE_NOSTORE, PROBE_IDENTITY, PROBE_H2, PROBE_HELPER: build with one of this folder's diffs
# applied): per variant of PROBE_VARIANTS, an in-process A/B of PRIMUS_TURBO_GEMM_GELU_DEFER=0,1 on the fc forward
# (TURBO only), twice. Carry .carry-probe (primus.gz, libgomp.so.1).
#   run(command="PROBE_VARIANTS='- PROBE_IDENTITY=1' bash bench/ops/runs/2026-11-28-h200-s21-gelu-defer/probe_nostore.sh", carry=[".carry-probe"])
source scripts/gpu_env.sh
BIN=/tmp/pb; mkdir -p $BIN; gunzip -c .carry-probe/primus.gz > $BIN/primus; chmod +x $BIN/primus
export LD_LIBRARY_PATH=$BIN:$PWD/.carry-probe:$LD_LIBRARY_PATH
for r in 1 2; do
for v in ${PROBE_VARIANTS:-"-" "PROBE_NOSTORE=1"}; do
  e=""; [ "$v" != - ] && e=$v
  env $e $BIN/primus benchmark gemm --shapes 16384x3072x768+gelu,16384x3072x768 --backend TURBO --iters 30 --ab PRIMUS_TURBO_GEMM_GELU_DEFER=0,1 --ab-rounds 3 2>&1 | grep -E "TURBO .*TFLOP" | grep -E "gelu_aux|/fwd " | sed "s/^/[$v] /"
done
done
