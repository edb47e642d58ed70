# Sourced by bench/ops/ncu_gemm.sh and ncu_grouped_gemm.sh, before their `set -e` (scripts/gpu_env.sh
# probes with commands that may fail), with CARRY set: unpacks $CARRY/primus.gz to /tmp/pb/primus,
# puts the carry's libraries on the loader's path, and sets OUTDIR ($OUT, else /tmp/ncu_out) and
# NCU (Nsight Compute's command line).
# shellcheck disable=SC1091
source scripts/gpu_env.sh
OUTDIR=${OUT:-/tmp/ncu_out}
mkdir -p "$OUTDIR" /tmp/pb
gunzip -c "$CARRY/primus.gz" > /tmp/pb/primus && chmod +x /tmp/pb/primus
export LD_LIBRARY_PATH="$PWD/$CARRY:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
