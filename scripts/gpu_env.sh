# Sourced on the GPU machine: puts cuBLASLt and cuDNN 9 on LD_LIBRARY_PATH. Optional since
# primus loads both at first use and searches /usr/local/cuda/lib64 and PyTorch's pip packages
# itself (turbo/core/dynamic_library.h); what this still decides is the preference: cuBLASLt the
# toolkit's, else the wheel's; cuDNN the wheel's (the one torch itself loads), else any on the
# system. PRIMUS_CUBLASLT_LIBRARY / PRIMUS_CUDNN_LIBRARY name one file instead.
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 /usr/lib/x86_64-linux-gnu/libcublasLt.so.13 2>/dev/null | head -1)
if [ -z "$lt" ]; then
  lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib', 'libcublasLt.so.13'))" 2>/dev/null)
fi
cudnn_dir=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
if [ -z "$cudnn_dir" ] || [ ! -e "$cudnn_dir/libcudnn.so.9" ]; then
  cudnn_dir=$(dirname "$(find /usr /opt -name 'libcudnn.so.9' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH=$(dirname "${lt:-/nonexistent/x}"):${cudnn_dir:-/nonexistent}:${LD_LIBRARY_PATH:-}
