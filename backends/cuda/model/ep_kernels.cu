#include "backends/cuda/model/ep_kernels.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda::ep {
namespace {

__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) x[i] *= s;
}

// Two values a thread per iteration (n2 pairs), the odd last one by thread 0.
__global__ void scale_bf16_kernel(__nv_bfloat162* x, int64_t n2, __nv_bfloat16* tail, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n2; i += int64_t{gridDim.x} * blockDim.x) {
    const float2 v = __bfloat1622float2(x[i]);
    x[i] = __floats2bfloat162_rn(v.x * s, v.y * s);
  }
  if (tail && blockIdx.x == 0 && threadIdx.x == 0) *tail = __float2bfloat16_rn(__bfloat162float(*tail) * s);
}

// One block per row (grid-stride over rows); W words of T per row.
template <typename T>
__global__ void gather_kernel(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, const int32_t* map, int64_t rows,
                              int64_t W) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t from = map[r];
    T* d = dst + r * ld_dst;
    if (from < 0) {
      for (int64_t c = threadIdx.x; c < W; c += blockDim.x) d[c] = T{};
    } else {
      const T* s = src + int64_t{from} * ld_src;
      for (int64_t c = threadIdx.x; c < W; c += blockDim.x) d[c] = s[c];
    }
  }
}

template <typename T>
void launch_gather(void* dst, int64_t ld_dst, const void* src, int64_t ld_src, const int32_t* map, int64_t rows,
                   int64_t W, cudaStream_t stream) {
  const int blocks = static_cast<int>(rows < 65535 ? rows : 65535);
  gather_kernel<T><<<blocks, 128, 0, stream>>>(static_cast<T*>(dst), ld_dst, static_cast<const T*>(src), ld_src, map,
                                               rows, W);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gather_rows(void* dst, int64_t ld_dst, const void* src, int64_t ld_src, const int32_t* map, int64_t rows,
                 int64_t cols, int esize, cudaStream_t stream) {
  if (rows <= 0) return;
  // 16-byte words where every row start and the width allow it, else the element itself.
  const int64_t bytes = cols * esize, ld_d = ld_dst * esize, ld_s = ld_src * esize;
  const bool wide = bytes % 16 == 0 && ld_d % 16 == 0 && ld_s % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (wide) {
    launch_gather<uint4>(dst, ld_d / 16, src, ld_s / 16, map, rows, bytes / 16, stream);
  } else if (esize == 2) {
    launch_gather<uint16_t>(dst, ld_dst, src, ld_src, map, rows, cols, stream);
  } else {
    launch_gather<uint32_t>(dst, ld_dst, src, ld_src, map, rows, cols, stream);
  }
}

void scale_f32(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 4096 ? want : 4096);
  scale_kernel<<<blocks, kThreads, 0, stream>>>(x, n, s);
  CUDA_CHECK(cudaGetLastError());
}

void scale_bf16(void* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t n2 = n / 2, want = (n2 + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 1 ? 1 : want < 4096 ? want : 4096);
  __nv_bfloat16* b = static_cast<__nv_bfloat16*>(x);
  scale_bf16_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<__nv_bfloat162*>(b), n2, n % 2 ? b + n - 1 : nullptr,
                                                     s);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace primus::backends::cuda::ep
