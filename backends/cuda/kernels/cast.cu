#include <cuda_bf16.h>

#include "backends/cuda/kernels/cast.h"
#include "turbo/kernels/cuda/common.cuh"

namespace primus::backends::cuda::kernels {

namespace {
__global__ void cast_kernel(__nv_bfloat16* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}
}  // namespace

void cast_f32_to_bf16(void* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = (n + 255) / 256, cap = int64_t(turbo::cuda::sm_count()) * 16;
  cast_kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(dst), src, n);
  CUDA_CHECK_LAST();
}

}  // namespace primus::backends::cuda::kernels
