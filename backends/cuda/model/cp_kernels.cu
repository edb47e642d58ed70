#include "backends/cuda/model/cp_kernels.h"

#include <cuda_bf16.h>

#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda::cp {
namespace {

// One block of threads per (b, t, h) row group: blockDim.x threads stride over D.
__global__ void merge_kernel(float* acc_out, float* acc_lse, const __nv_bfloat16* out, const float* lse, int64_t B,
                             int64_t T, int64_t H, int64_t D, bool first) {
  const int64_t row = blockIdx.x;  // (b * T + t) * H + h
  if (row >= B * T * H) return;
  const int64_t h = row % H, bt = row / H, t = bt % T, b = bt / T;
  const int64_t li = (b * H + h) * T + t;
  float* a = acc_out + row * D;
  const __nv_bfloat16* o = out + row * D;
  const float l_new = lse[li];
  if (first) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) a[d] = __bfloat162float(o[d]);
    __syncthreads();
    if (threadIdx.x == 0) acc_lse[li] = l_new;
    return;
  }
  const float l_old = acc_lse[li];
  const float m = fmaxf(l_old, l_new);
  const float w_old = m == -INFINITY ? 0.f : expf(l_old - m), w_new = m == -INFINITY ? 0.f : expf(l_new - m);
  const float sum = w_old + w_new;
  const float s_old = sum > 0.f ? w_old / sum : 0.f, s_new = sum > 0.f ? w_new / sum : 0.f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) a[d] = a[d] * s_old + __bfloat162float(o[d]) * s_new;
  __syncthreads();
  if (threadIdx.x == 0) acc_lse[li] = sum > 0.f ? m + logf(sum) : -INFINITY;
}

__global__ void accumulate_kernel(float* dst, int64_t ld_dst, const __nv_bfloat16* src, int64_t ld_src, int64_t rows,
                                  int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld_dst + c] += __bfloat162float(src[r * ld_src + c]);
  }
}

__global__ void cast_kernel(__nv_bfloat16* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                            int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld_dst + c] = __float2bfloat16_rn(src[r * ld_src + c]);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

}  // namespace

void merge_partial(float* acc_out, float* acc_lse, const void* out, const float* lse, int64_t B, int64_t T, int64_t H,
                   int64_t D, bool first, cudaStream_t stream) {
  const int64_t rows = B * T * H;
  if (rows == 0) return;
  merge_kernel<<<static_cast<unsigned>(rows), 64, 0, stream>>>(acc_out, acc_lse, static_cast<const __nv_bfloat16*>(out),
                                                               lse, B, T, H, D, first);
  CUDA_CHECK(cudaGetLastError());
}

void rows_accumulate(float* dst, int64_t ld_dst, const void* src, int64_t ld_src, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (rows * cols == 0) return;
  accumulate_kernel<<<grid_for(rows * cols), 256, 0, stream>>>(dst, ld_dst, static_cast<const __nv_bfloat16*>(src),
                                                               ld_src, rows, cols);
  CUDA_CHECK(cudaGetLastError());
}

void rows_cast(void* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols,
               cudaStream_t stream) {
  if (rows * cols == 0) return;
  cast_kernel<<<grid_for(rows * cols), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), ld_dst, src, ld_src, rows,
                                                         cols);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace primus::backends::cuda::cp
