// Device-side random fill for the op benchmark: timing on zeros would flatter the kernels
// (zeros move faster through the tensor cores and compress in the memory system).
#include <cuda_bf16.h>

#include "bench/ops/fill.h"
#include "turbo/core/cuda_check.h"

namespace primus::bench {
namespace {
__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
}
template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = offset + scale * hash_uniform(i, seed);
    if constexpr (sizeof(T) == 2) p[i] = __float2bfloat16_rn(v); else p[i] = v;
  }
}
__global__ void fill_int_kernel(int32_t* p, int64_t n, uint64_t seed, int32_t hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<int32_t>((hash_uniform(i, seed) * 0.5f + 0.5f) * static_cast<float>(hi)) % hi;
}
}  // namespace

void fill_uniform(void* p, turbo::DType dt, int64_t n, uint64_t seed, float scale, float offset) {
  if (dt == turbo::DType::BF16)
    fill_kernel<<<4096, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale, offset);
  else
    fill_kernel<<<4096, 256>>>(static_cast<float*>(p), n, seed, scale, offset);
  CUDA_CHECK_LAST();
}

void fill_ints(int32_t* p, int64_t n, uint64_t seed, int32_t hi) {
  fill_int_kernel<<<1024, 256>>>(p, n, seed, hi);
  CUDA_CHECK_LAST();
}
}  // namespace primus::bench
