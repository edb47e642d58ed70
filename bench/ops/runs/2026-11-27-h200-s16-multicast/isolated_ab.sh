# quick A/B: same plan, auto vs forced, alone and after other shapes
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"; BIN=/tmp/b; mkdir -p $BIN; gunzip -c .carry-cuda/primus.gz > $BIN/primus; chmod +x $BIN/primus
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:$(dirname "$lt"):.carry-cuda:${LD_LIBRARY_PATH:-}
b() { "$BIN/primus" benchmark gemm --shapes "$1" --backend TURBO --iters 30 2>&1 | grep -E "gemm/16384x2048x2048" | awk -v t="$2" '{print t, $1, $3, $5}'; }
for r in 1 2; do
  b 16384x2048x2048 "alone-auto"
  PRIMUS_TURBO_GEMM_PLAN=256x1 b 16384x2048x2048 "alone-256x1"
  b 16384x1024x2048,16384x2048x2048 "afterkv-auto"
  PRIMUS_TURBO_GEMM_PLAN=256x1 b 16384x1024x2048,16384x2048x2048 "afterkv-256x1"
  PRIMUS_TURBO_GEMM_PLAN=256x2 b 16384x1024x2048,16384x2048x2048 "afterkv-256x2"
  PRIMUS_TURBO_GEMM_MULTICAST=1 PRIMUS_TURBO_GEMM_PLAN=256x1 b 16384x2048x2048 "alone-mc256"
done
