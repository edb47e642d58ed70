#include <cuda_bf16.h>

#include "turbo/kernels/cuda/cast.h"
#include "turbo/kernels/cuda/common.cuh"

namespace primus::turbo::cuda {

namespace {
__global__ void cast_kernel(__nv_bfloat16* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void i32_to_f32_kernel(float* __restrict__ dst, const int32_t* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = static_cast<float>(src[i]);
}

__global__ void f32_to_i32_kernel(int32_t* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2int_rn(src[i]);
}

__global__ void zero_ranges_kernel(float* __restrict__ base, const int64_t* __restrict__ table, int n, int64_t total) {
  const int64_t* prefix = table;
  const int64_t* offset = table + n + 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int lo = 0, hi = n;  // the range r with prefix[r] <= i < prefix[r + 1]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (prefix[mid] <= i) lo = mid;
      else hi = mid;
    }
    base[offset[lo] + (i - prefix[lo])] = 0.0f;
  }
}
}  // namespace

void zero_ranges_f32(float* base, const int64_t* table, int n, int64_t total, cudaStream_t stream) {
  if (n <= 0 || total <= 0) return;
  const int64_t blocks = (total + 255) / 256, cap = int64_t(turbo::cuda::sm_count()) * 16;
  zero_ranges_kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), 256, 0, stream>>>(base, table, n, total);
  CUDA_CHECK_LAST();
}

void cast_f32_to_bf16(void* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = (n + 255) / 256, cap = int64_t(turbo::cuda::sm_count()) * 16;
  cast_kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(dst), src, n);
  CUDA_CHECK_LAST();
}

void cast_i32_to_f32(float* dst, const int32_t* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = (n + 255) / 256, cap = int64_t(turbo::cuda::sm_count()) * 16;
  i32_to_f32_kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), 256, 0, stream>>>(dst, src, n);
  CUDA_CHECK_LAST();
}

void cast_f32_to_i32(int32_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = (n + 255) / 256, cap = int64_t(turbo::cuda::sm_count()) * 16;
  f32_to_i32_kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), 256, 0, stream>>>(dst, src, n);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
