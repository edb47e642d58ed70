#include "backends/cuda/model/ep_kernels.h"

#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda::ep {
namespace {

__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) x[i] *= s;
}

}  // namespace

void scale_f32(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 4096 ? want : 4096);
  scale_kernel<<<blocks, kThreads, 0, stream>>>(x, n, s);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace primus::backends::cuda::ep
