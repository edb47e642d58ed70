// Decode attention: the single-query attention of token-by-token generation. Each step reads
// the whole KV cache once and does two FLOPs per byte, so the kernel is a memory-bound sweep:
// one block per (query, head), its warps taking keys round-robin. A warp holds the head's query
// spread over its lanes (element d on lane d % 32), computes a key's score with one warp
// reduction, and keeps an online softmax (running max, sum and weighted value sum in fp32);
// the warps' partial results are merged through shared memory at the end. Keys of one position
// are contiguous [KVH, D], so a warp's key load is D contiguous elements (coalesced).
//
// kv_cache_write appends the new token's key and value rows (after RoPE and q/k norms) at each
// sequence's position before the attention reads them.
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/decode_attention.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kWarps = 8;

template <class T, int EPL>  // EPL: elements per lane, ceil(D / 32)
__global__ void __launch_bounds__(kWarps * 32)
    decode_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc,
                            const T* __restrict__ vc, const int32_t* __restrict__ slot,
                            const int32_t* __restrict__ len, int H, int KVH, int D, int64_t cap, int64_t window,
                            float scale, int64_t q_row) {
  const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = h / (H / KVH);
  const int64_t L = len[i], j0 = window > 0 && L > window ? L - window : 0;
  const T* kb = kc + (static_cast<int64_t>(slot[i]) * cap * KVH + g) * D;
  const T* vb = vc + (static_cast<int64_t>(slot[i]) * cap * KVH + g) * D;
  const int64_t pos_stride = static_cast<int64_t>(KVH) * D;
  float qv[EPL], acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane + 32 * e;
    qv[e] = d < D ? to_f32(q[i * q_row + static_cast<int64_t>(h) * D + d]) * scale : 0.0f;
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = j0 + warp; j < L; j += kWarps) {
    const T* kj = kb + j * pos_stride;
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) s += qv[e] * to_f32(kj[d]);
    }
    s = warp_sum(s);
    const float mn = fmaxf(m, s), corr = __expf(m - mn), p = __expf(s - mn);
    l = l * corr + p;
    const T* vj = vb + j * pos_stride;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      acc[e] = acc[e] * corr + (d < D ? p * to_f32(vj[d]) : 0.0f);
    }
    m = mn;
  }
  __shared__ float sm[kWarps], sl[kWarps];
  __shared__ float sacc[kWarps][EPL * 32];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) sacc[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  float Ls = 0.0f;
  float f[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    f[w] = sm[w] == -INFINITY ? 0.0f : __expf(sm[w] - M);  // a warp that saw no key adds nothing
    Ls += sl[w] * f[w];
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += sacc[w][d] * f[w];
    out[(static_cast<int64_t>(i) * H + h) * D + d] = from_f32<T>(o / Ls);
  }
}

template <class T>
__global__ void kv_cache_write_kernel(T* kc, T* vc, const T* k, const T* v, int64_t src_row,
                                      const int32_t* slot, const int32_t* len, int64_t W, int64_t cap) {
  const int i = blockIdx.x;
  const int64_t at = (static_cast<int64_t>(slot[i]) * cap + len[i] - 1) * W;
  for (int64_t c = threadIdx.x; c < W; c += blockDim.x) {
    kc[at + c] = k[i * src_row + c];
    vc[at + c] = v[i * src_row + c];
  }
}

}  // namespace

void decode_attention_forward(DType dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                              const int32_t* slot, const int32_t* len, int64_t n, int64_t H, int64_t KVH, int64_t D,
                              int64_t cap, int64_t window, float scale, int64_t q_row, cudaStream_t stream) {
  if (n == 0) return;
  if (D > kDecodeAttentionMaxDim)
    throw RuntimeError(fmt::format("decode_attention: head dim {} above {}", D, kDecodeAttentionMaxDim));
  if (q_row == 0) q_row = H * D;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(H));
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "decode_attention", [&] {
    auto launch = [&](auto epl) {
      constexpr int EPL = decltype(epl)::value;
      decode_attention_kernel<scalar_t, EPL><<<grid, kWarps * 32, 0, stream>>>(
          static_cast<scalar_t*>(out), static_cast<const scalar_t*>(q), static_cast<const scalar_t*>(k_cache),
          static_cast<const scalar_t*>(v_cache), slot, len, static_cast<int>(H), static_cast<int>(KVH),
          static_cast<int>(D), cap, window, scale, q_row);
    };
    if (D <= 32) launch(std::integral_constant<int, 1>{});
    else if (D <= 64) launch(std::integral_constant<int, 2>{});
    else if (D <= 128) launch(std::integral_constant<int, 4>{});
    else launch(std::integral_constant<int, 8>{});
  });
  CUDA_CHECK_LAST();
}

void kv_cache_write(DType dtype, void* k_cache, void* v_cache, const void* k, const void* v, int64_t src_row,
                    const int32_t* slot, const int32_t* len, int64_t n, int64_t KVH, int64_t D, int64_t cap,
                    cudaStream_t stream) {
  if (n == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "kv_cache_write", [&] {
    kv_cache_write_kernel<scalar_t><<<static_cast<unsigned>(n), 256, 0, stream>>>(
        static_cast<scalar_t*>(k_cache), static_cast<scalar_t*>(v_cache), static_cast<const scalar_t*>(k),
        static_cast<const scalar_t*>(v), src_row, slot, len, KVH * D, cap);
  });
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
