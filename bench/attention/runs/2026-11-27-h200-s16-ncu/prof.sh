# TURBO attention backward under Nsight Compute + cuDNN kernel list (H200, session 16). From the repository root on the GPU machine: OUT=$OUT bash <this file>
set -u
BIN=/tmp/b; mkdir -p $BIN; gunzip -c .carry-cuda/primus.gz > $BIN/primus; chmod +x $BIN/primus
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:$cudnn_dir:$(dirname "$lt"):.carry-cuda:${LD_LIBRARY_PATH:-}
$BIN/primus benchmark attention --shapes 8x2048x16x16x128,16x1024x12x12x64 --iters 20 2>&1 | grep -E "attention/" 
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
$NCU --clock-control none --set full -k regex:flash_bwd_sm90 --launch-skip 2 --launch-count 1 $BIN/primus benchmark attention --shapes 8x2048x16x16x128 --backend TURBO --iters 5 > $OUT/ncu_bwd_turbo.txt 2>&1
$NCU --clock-control none -k regex:"cudnn|sm90|flash|dgrad|dot|bwd" --launch-skip 0 --launch-count 30 --metrics gpu__time_duration.sum $BIN/primus benchmark attention --shapes 8x2048x16x16x128 --backend CUDNN --iters 1 > $OUT/ncu_cudnn_list.txt 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Shared Memory Config|Theoretical Occ|Achieved Occ|Executed Ipc|Issue Slots Busy|L1/TEX Hit|L2 Cache Throughput|DRAM Throughput|Memory Throughput" $OUT/ncu_bwd_turbo.txt | head -30
grep -iE "stall|warp cycles per issued|smsp__pcsamp" $OUT/ncu_bwd_turbo.txt | head -30
