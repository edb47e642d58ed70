// Elementwise helpers too small to deserve a family of their own.
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/elementwise.h"

namespace primus::turbo::cuda {
namespace {
__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] += src[i];
}
}  // namespace

void add_inplace_f32(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_inplace_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(dst, src, n);
  CUDA_CHECK_LAST();
}
}  // namespace primus::turbo::cuda
