// Device-side random fill for the benchmarks (see fill.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <fmt/format.h>

#include "core/util/error.h"
#include "turbo/bench/fill.h"
#include "turbo/core/cuda_check.h"

namespace primus::turbo::bench {
namespace {
__device__ __forceinline__ float hash_uniform_dev(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
}
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return v;
}
template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = from_float<T>(offset + scale * hash_uniform_dev(i, seed));
}
__global__ void fill_int_kernel(int32_t* p, int64_t n, uint64_t seed, int32_t hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<int32_t>((hash_uniform_dev(i, seed) * 0.5f + 0.5f) * static_cast<float>(hi)) % hi;
}
__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
}  // namespace

void spin_device(double ms) {
  spin_kernel<<<1, 1>>>(static_cast<uint64_t>(ms * 1e6));
  CUDA_CHECK_LAST();
}

void fill_uniform_device(void* p, DType dt, int64_t n, uint64_t seed, float scale, float offset) {
  switch (dt) {
    case DType::BF16: fill_kernel<<<4096, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale, offset); break;
    case DType::F16: fill_kernel<<<4096, 256>>>(static_cast<__half*>(p), n, seed, scale, offset); break;
    case DType::F32: fill_kernel<<<4096, 256>>>(static_cast<float*>(p), n, seed, scale, offset); break;
    default:
      throw RuntimeError(fmt::format("fill_uniform_device: dtype {} is not f32, bf16 or f16", dtype_name(dt)));
  }
  CUDA_CHECK_LAST();
}

void fill_ints_device(int32_t* p, int64_t n, uint64_t seed, int32_t hi) {
  fill_int_kernel<<<1024, 256>>>(p, n, seed, hi);
  CUDA_CHECK_LAST();
}
}  // namespace primus::turbo::bench
