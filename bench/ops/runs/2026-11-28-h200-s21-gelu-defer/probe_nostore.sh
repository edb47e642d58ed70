source scripts/gpu_env.sh
BIN=/tmp/pb; mkdir -p $BIN; gunzip -c .carry-probe/primus.gz > $BIN/primus; chmod +x $BIN/primus
export LD_LIBRARY_PATH=$BIN:$PWD/.carry-probe:$LD_LIBRARY_PATH
for r in 1 2; do
for v in ${PROBE_VARIANTS:-"-" "PROBE_NOSTORE=1"}; do
  e=""; [ "$v" != - ] && e=$v
  env $e $BIN/primus benchmark gemm --shapes 16384x3072x768+gelu,16384x3072x768 --backend TURBO --iters 30 --ab PRIMUS_TURBO_GEMM_GELU_DEFER=0,1 --ab-rounds 3 2>&1 | grep -E "TURBO .*TFLOP" | grep -E "gelu_aux|/fwd " | sed "s/^/[$v] /"
done
done
