// Shared device helpers for Turbo's CUDA kernels: 128-bit vector access, fp32 conversion of
// the storage types, warp/block reductions, and the dtype switch of the launchers.
// Kernels keep their arithmetic in fp32 whatever the storage type (bf16 carries 8 mantissa bits;
// sums over thousands of elements in bf16 would lose the result).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

using bf16 = __nv_bfloat16;

// ---- conversions -------------------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// ---- 128-bit vectors ---------------------------------------------------------------------
// Vec<T>: 16 bytes of T (8 bf16 or 4 float), loaded and stored with one instruction. Every
// memory-bound kernel moves data through these: a warp then touches 512 contiguous bytes per
// instruction, which is what the memory system serves at full rate.
template <class T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
  __device__ __forceinline__ float get(int i) const { return to_f32(v[i]); }
  __device__ __forceinline__ void set(int i, float x) { v[i] = from_f32<T>(x); }
};
template <class T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> r;
  *reinterpret_cast<int4*>(&r) = *reinterpret_cast<const int4*>(p);
  return r;
}
// Streaming load (evict-first): for data read exactly once, so it does not push reused data out of L2.
template <class T>
__device__ __forceinline__ Vec<T> load_vec_cs(const T* p) {
  Vec<T> r;
  *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
  return r;
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&v);
}
template <class T>
__device__ __forceinline__ void store_vec_cs(T* p, const Vec<T>& v) {
  __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}

// ---- reductions --------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// Sum over the block; every thread gets the result. `smem` holds >= 32 floats. The order of
// additions is fixed by the block shape, so results are bitwise reproducible.
__device__ __forceinline__ float block_sum(float x, float* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  x = warp_sum(x);
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = lane < warps ? smem[lane] : 0.0f;
  return warp_sum(x);
}
__device__ __forceinline__ float block_max(float x, float* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = lane < warps ? smem[lane] : -INFINITY;
  return warp_max(x);
}

// ---- launch helpers ----------------------------------------------------------------------
inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }
int sm_count();  // multiprocessors of the current device (cached)

}  // namespace primus::turbo::cuda

// Calls body with `scalar_t` bound to the storage type of `dtype` (f32 or bf16); anything else
// throws primus::RuntimeError naming `op`.
#define PRIMUS_DISPATCH_FLOAT_BF16(dtype, op, ...)                                            \
  [&] {                                                                                       \
    switch (dtype) {                                                                          \
      case ::primus::turbo::DType::F32: { using scalar_t = float; return __VA_ARGS__(); }     \
      case ::primus::turbo::DType::BF16: { using scalar_t = ::primus::turbo::cuda::bf16; return __VA_ARGS__(); } \
      default:                                                                                \
        throw ::primus::RuntimeError(fmt::format("{}: dtype {} not supported (f32, bf16)", op, \
                                                 ::primus::turbo::dtype_name(dtype)));       \
    }                                                                                         \
  }()
