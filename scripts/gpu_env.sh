# Sourced on the GPU machine: puts the CUDA 13 libraries our binaries need on LD_LIBRARY_PATH.
# cuBLASLt: the toolkit's, else the one in PyTorch's nvidia wheel; cuDNN 9: the wheel's (the one
# torch itself loads), else any on the system.
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 /usr/lib/x86_64-linux-gnu/libcublasLt.so.13 2>/dev/null | head -1)
if [ -z "$lt" ]; then
  lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib', 'libcublasLt.so.13'))" 2>/dev/null)
fi
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
if [ -z "$cudnn_dir" ] || [ ! -e "$cudnn_dir/libcudnn.so.9" ]; then
  cudnn_dir=$(dirname "$(find /usr /opt -name 'libcudnn.so.9' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH=$(dirname "${lt:-/nonexistent/x}"):${cudnn_dir:-/nonexistent}:${LD_LIBRARY_PATH:-}
