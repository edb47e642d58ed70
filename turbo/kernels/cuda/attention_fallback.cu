// Fallback attention kernels (see attention_fallback.h). Correct first, then simple: one block
// per score row, the causal tail skipped, reductions in f32 in a fixed order (deterministic).
#include <cuda_bf16.h>

#include "turbo/kernels/cuda/attention_fallback.h"
#include "turbo/kernels/cuda/common.cuh"

namespace primus::turbo::cuda {

namespace tc = primus::turbo::cuda;
using tc::bf16;

namespace {

constexpr int kRowThreads = 256;

// One thread moves 8 bf16 (16 bytes) of one (b, t, h) head vector.
template <bool kToHeads>
__global__ void permute_kernel(bf16* __restrict__ dst, const bf16* __restrict__ src, int64_t B, int64_t T,
                               int64_t Hx, int64_t D, int64_t row) {
  const int64_t vecs = D / 8;
  const int64_t total = B * T * Hx * vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = i % vecs;
    int64_t r = i / vecs;
    const int64_t h = r % Hx;
    r /= Hx;
    const int64_t t = r % T;
    const int64_t b = r / T;
    const int64_t tok = (b * T + t) * row + h * D + v * 8;    // [B,T,Hx,D], tokens `row` apart
    const int64_t head = ((b * Hx + h) * T + t) * D + v * 8;  // [B,Hx,T,D]
    if (kToHeads)
      tc::store_vec(dst + head, tc::load_vec(src + tok));
    else
      tc::store_vec(dst + tok, tc::load_vec(src + head));
  }
}

__global__ void softmax_forward_kernel(bf16* __restrict__ p, float* __restrict__ lse, const float* __restrict__ s,
                                       int64_t T, bool write_lse) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const int64_t t = row % T;
  const float* srow = s + row * T;
  bf16* prow = p + row * T;
  float l;
  if (write_lse) {
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) m = fmaxf(m, srow[j]);
    m = tc::block_max(m, smem);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += __expf(srow[j] - m);
    sum = tc::block_sum(sum, smem);
    l = m + __logf(sum);
    if (threadIdx.x == 0) lse[row] = l;
  } else {
    l = lse[row];
  }
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x)
    prow[j] = __float2bfloat16_rn(j <= t ? __expf(srow[j] - l) : 0.0f);
}

__global__ void softmax_backward_kernel(bf16* __restrict__ ds, const float* __restrict__ s,
                                        const float* __restrict__ lse, const float* __restrict__ dp, int64_t T,
                                        float scale) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const int64_t t = row % T;
  const float* srow = s + row * T;
  const float* dprow = dp + row * T;
  const float l = lse[row];
  float delta = 0.0f;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) delta += __expf(srow[j] - l) * dprow[j];
  delta = tc::block_sum(delta, smem);
  bf16* dsrow = ds + row * T;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
    float v = 0.0f;
    if (j <= t) v = scale * __expf(srow[j] - l) * (dprow[j] - delta);
    dsrow[j] = __float2bfloat16_rn(v);
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  const int64_t cap = int64_t(tc::sm_count()) * 16;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

}  // namespace

void permute_to_heads(void* dst, const void* src, int64_t B, int64_t T, int64_t Hx, int64_t D, cudaStream_t s,
                      int64_t src_row) {
  permute_kernel<true><<<grid_for(B * T * Hx * D / 8, 256), 256, 0, s>>>(
      static_cast<bf16*>(dst), static_cast<const bf16*>(src), B, T, Hx, D, src_row ? src_row : Hx * D);
  CUDA_CHECK_LAST();
}

void permute_from_heads(void* dst, const void* src, int64_t B, int64_t T, int64_t Hx, int64_t D, cudaStream_t s,
                        int64_t dst_row) {
  permute_kernel<false><<<grid_for(B * T * Hx * D / 8, 256), 256, 0, s>>>(
      static_cast<bf16*>(dst), static_cast<const bf16*>(src), B, T, Hx, D, dst_row ? dst_row : Hx * D);
  CUDA_CHECK_LAST();
}

void causal_softmax_forward(void* p, float* lse, const float* s, int64_t rows, int64_t T, bool write_lse,
                            cudaStream_t stream) {
  softmax_forward_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(static_cast<bf16*>(p), lse, s, T,
                                                                                  write_lse);
  CUDA_CHECK_LAST();
}

void causal_softmax_backward(void* ds, const float* s, const float* lse, const float* dp, int64_t rows, int64_t T,
                             float scale, cudaStream_t stream) {
  softmax_backward_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(static_cast<bf16*>(ds), s, lse, dp,
                                                                                   T, scale);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
