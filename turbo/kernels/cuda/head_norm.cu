// Per-head RMSNorm over the q|k columns of the packed qkv projection (Qwen3's query/key norms),
// forward and backward, in place.
//
// A row is one head of one token: D (<= 256) elements, so one warp owns a row, each lane up to
// 8 elements in registers; the reduction is a warp shuffle and nothing waits on a block barrier
// per row. In place is safe because a warp reads its whole row before writing it. The forward
// keeps a dense copy of the pre-norm values for the backward (the in-place output is what RoPE
// then rotates, and the attention's backward needs the rotated values, so the input cannot be
// recomputed from the buffer). The backward's weight gradients are summed over every row of the
// batch: each block adds its rows into per-lane registers, then its warps into shared memory in
// a fixed order, and a second kernel adds the blocks' partials in block order, so the result is
// the same bits on every run (no atomics).
#include <fmt/format.h>

#include <algorithm>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/head_norm.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kPerLane = kHeadNormMaxDim / 32;
constexpr int kWarps = 8;                  // per block
constexpr int64_t kTokensPerBlockMin = 16;
constexpr int64_t kMaxBwdBlocks = 1024;

int64_t head_norm_bwd_blocks(int64_t N) {
  return std::max<int64_t>(1, std::min(kMaxBwdBlocks, (N + kTokensPerBlockMin - 1) / kTokensPerBlockMin));
}

template <class T>
__global__ void head_norm_fwd_kernel(T* x, int64_t row_stride, T* saved, float* rstd, const T* wq, const T* wk,
                                     int64_t rows, int Hx, int q_heads, int D, float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows; r += warps) {
    const int64_t n = r / Hx;
    const int h = static_cast<int>(r % Hx);
    T* xr = x + n * row_stride + static_cast<int64_t>(h) * D;
    T* sr = saved + r * D;
    const T* w = h < q_heads ? wq : wk;
    float v[kPerLane];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      v[j] = i < D ? to_f32(xr[i]) : 0.0f;
      ss += v[j] * v[j];
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < D) {
        sr[i] = xr[i];
        xr[i] = from_f32<T>(v[j] * rs * to_f32(w[i]));
      }
    }
    if (lane == 0) rstd[r] = rs;
  }
}

// Block b takes tokens [b * per_block, (b + 1) * per_block) and writes its weight-gradient
// partials, q then k, to partials[b, 0:2D].
template <class T>
__global__ void head_norm_bwd_kernel(T* x, int64_t row_stride, const T* saved, const float* rstd, const T* wq,
                                     const T* wk, float* partials, int64_t N, int64_t per_block, int Hx, int q_heads,
                                     int D) {
  extern __shared__ float smem[];  // [kWarps][2D]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t0 = blockIdx.x * per_block, t1 = t0 + per_block < N ? t0 + per_block : N;
  float pq[kPerLane], pk[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) pq[j] = pk[j] = 0.0f;
  for (int64_t r = t0 * Hx + warp; r < t1 * Hx; r += kWarps) {
    const int64_t n = r / Hx;
    const int h = static_cast<int>(r % Hx);
    const bool is_q = h < q_heads;
    T* xr = x + n * row_stride + static_cast<int64_t>(h) * D;
    const T* sr = saved + r * D;
    const T* w = is_q ? wq : wk;
    const float rs = rstd[r];
    float dy[kPerLane], xh[kPerLane], g[kPerLane];
    float sum_gx = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      dy[j] = i < D ? to_f32(xr[i]) : 0.0f;
      xh[j] = i < D ? to_f32(sr[i]) * rs : 0.0f;
      g[j] = i < D ? dy[j] * to_f32(w[i]) : 0.0f;
      sum_gx += g[j] * xh[j];
    }
    const float mean_gx = warp_sum(sum_gx) / static_cast<float>(D);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < D) xr[i] = from_f32<T>(rs * (g[j] - xh[j] * mean_gx));
      if (is_q)
        pq[j] += dy[j] * xh[j];
      else
        pk[j] += dy[j] * xh[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i < D) {
      smem[warp * 2 * D + i] = pq[j];
      smem[warp * 2 * D + D + i] = pk[j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * D; c += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += smem[w * 2 * D + c];
    partials[blockIdx.x * static_cast<int64_t>(2 * D) + c] = s;
  }
}

__global__ void head_norm_dw_kernel(float* dwq, float* dwk, const float* partials, int64_t blocks, int D) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * D) return;
  float s = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) s += partials[b * 2 * D + c];
  if (c < D)
    dwq[c] += s;
  else
    dwk[c - D] += s;
}

void head_norm_check(const char* op, int64_t row_stride, int64_t Hx, int64_t q_heads, int64_t D) {
  if (D < 1 || D > kHeadNormMaxDim)
    throw RuntimeError(fmt::format("{}: head dim D={} outside [1, {}]", op, D, kHeadNormMaxDim));
  if (q_heads < 0 || q_heads > Hx) throw RuntimeError(fmt::format("{}: q_heads {} outside [0, {}]", op, q_heads, Hx));
  if (row_stride < Hx * D)
    throw RuntimeError(fmt::format("{}: token row stride {} below Hx*D = {}", op, row_stride, Hx * D));
}

}  // namespace

size_t head_norm_backward_scratch_bytes(int64_t N, int64_t D) {
  return static_cast<size_t>(head_norm_bwd_blocks(N) * 2 * D) * sizeof(float);
}

void head_norm_forward(DType dtype, void* x, int64_t row_stride, void* saved, float* rstd, const void* wq,
                       const void* wk, int64_t N, int64_t Hx, int64_t q_heads, int64_t D, float eps,
                       cudaStream_t stream) {
  head_norm_check("head_norm_forward", row_stride, Hx, q_heads, D);
  const int64_t rows = N * Hx;
  if (rows == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "head_norm_forward", [&] {
    const int threads = kWarps * 32;
    const int64_t cap = static_cast<int64_t>(sm_count()) * 16;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + kWarps - 1) / kWarps, cap)));
    head_norm_fwd_kernel<scalar_t><<<grid, threads, 0, stream>>>(
        static_cast<scalar_t*>(x), row_stride, static_cast<scalar_t*>(saved), rstd, static_cast<const scalar_t*>(wq),
        static_cast<const scalar_t*>(wk), rows, static_cast<int>(Hx), static_cast<int>(q_heads), static_cast<int>(D),
        eps);
    CUDA_CHECK_LAST();
  });
}

void head_norm_backward(DType dtype, void* x, int64_t row_stride, const void* saved, const float* rstd,
                        const void* wq, const void* wk, float* dwq, float* dwk, int64_t N, int64_t Hx,
                        int64_t q_heads, int64_t D, void* scratch, cudaStream_t stream) {
  head_norm_check("head_norm_backward", row_stride, Hx, q_heads, D);
  if (N * Hx == 0) return;
  const int64_t blocks = head_norm_bwd_blocks(N);
  const int64_t per_block = (N + blocks - 1) / blocks;
  float* partials = static_cast<float*>(scratch);
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "head_norm_backward", [&] {
    const size_t smem = static_cast<size_t>(kWarps * 2 * D) * sizeof(float);
    head_norm_bwd_kernel<scalar_t><<<static_cast<unsigned>(blocks), kWarps * 32, smem, stream>>>(
        static_cast<scalar_t*>(x), row_stride, static_cast<const scalar_t*>(saved), rstd,
        static_cast<const scalar_t*>(wq), static_cast<const scalar_t*>(wk), partials, N, per_block,
        static_cast<int>(Hx), static_cast<int>(q_heads), static_cast<int>(D));
    CUDA_CHECK_LAST();
  });
  head_norm_dw_kernel<<<static_cast<unsigned>(ceil_div(2 * D, 256)), 256, 0, stream>>>(dwq, dwk, partials, blocks,
                                                                                     static_cast<int>(D));
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
