// Device-side random fill for the attention benchmark: uniform values in [-scale, scale) from a
// counter hash, so large inputs cost no host time and no timing runs on zeros (zeros would
// flatter the tensor cores).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench/attention/fill_random.h"
#include "turbo/core/cuda_check.h"

namespace primus::bench {
namespace {
__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 27; x *= 0x94d049bb133111ebull; x ^= x >> 31;
  return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}
template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = scale * hash_uniform(static_cast<uint64_t>(i), seed);
    if constexpr (std::is_same_v<T, __half>) p[i] = __float2half_rn(v); else p[i] = __float2bfloat16_rn(v);
  }
}
}  // namespace

void fill_random(void* p, turbo::DType dt, int64_t n, uint64_t seed, float scale) {
  if (dt == turbo::DType::F16) fill_kernel<<<2048, 256>>>(static_cast<__half*>(p), n, seed, scale);
  else fill_kernel<<<2048, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CUDA_CHECK_LAST();
}
}  // namespace primus::bench
