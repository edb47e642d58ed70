# Executed instructions and kernel time of the TURBO attention backward main kernel under Nsight Compute, for
# each carried build (primus = HEAD, primus_new = the candidate) at a head_dim-128 and a Llama-like shape.
# From the repository root on the GPU machine, after bench/attention/env_ab.sh unpacked .carry-cuda:
#   bash bench/attention/runs/2026-11-28-h200-s23-desc/ncu_count.sh
# Executed instructions and duration of the TURBO backward main kernel, per binary and shape.
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=/tmp/attn-ab-bin:$cudnn_dir:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
for shape in 8x2048x16x16x128 8x2048x32x8x64:packed; do for b in primus primus_new; do
  $NCU --clock-control none --metrics smsp__inst_executed.sum,gpu__time_duration.sum -k regex:flash_bwd_sm90_ws --launch-skip 2 --launch-count 1 \
    /tmp/attn-ab-bin/$b benchmark attention --shapes $shape --backend TURBO --iters 3 2>&1 | grep -E "inst_executed|duration" | sed "s/^/$shape $b /"
done; done
