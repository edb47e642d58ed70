// Elementwise helpers too small to deserve a family of their own.
#include <fmt/format.h>

#include <algorithm>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/elementwise.h"

namespace primus::turbo::cuda {
namespace {
__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

// Four elements a thread when both pointers are 16-byte aligned (the tail one at a time).
template <bool kRound, bool kAccumulate>
__global__ void add_gradient_kernel(float* __restrict__ dst, const float* __restrict__ src, int64_t n, bool vec) {
  auto one = [](float d, float s) {
    if constexpr (kRound) s = __bfloat162float(__float2bfloat16_rn(s));
    return kAccumulate ? d + s : s;
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t j = i; j < n4; j += stride) {
      const float4 s = reinterpret_cast<const float4*>(src)[j];
      float4 d = kAccumulate ? reinterpret_cast<const float4*>(dst)[j] : make_float4(0, 0, 0, 0);
      d.x = one(d.x, s.x);
      d.y = one(d.y, s.y);
      d.z = one(d.z, s.z);
      d.w = one(d.w, s.w);
      reinterpret_cast<float4*>(dst)[j] = d;
    }
    i += n4 * 4;
  }
  for (; i < n; i += stride) dst[i] = one(kAccumulate ? dst[i] : 0.0f, src[i]);
}

// Column sums, stage 1. Block (32 lanes x kWarps warps) = one strip of 32 * V columns (V
// consecutive columns per lane: one 16-byte load when kVec) by one chunk of `rows_per_chunk`
// rows; warp w takes rows w, w + kWarps, ... of the chunk, kUnroll rows in flight. The warps'
// sums meet in shared memory in warp order; the block writes one partial row
// partials[chunk, strip columns].
constexpr int kWarps = 8, kUnroll = 8;

template <class T, int V, bool kVec>
__global__ void __launch_bounds__(32 * kWarps)
column_sum_partial_kernel(float* __restrict__ partials, const T* __restrict__ src, int N, int C, int64_t ld,
                          int rows_per_chunk) {
  __shared__ float acc[kWarps][32 * V];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c0 = blockIdx.x * 32 * V + lane * V;
  const int r_begin = blockIdx.y * rows_per_chunk, r_end = min(N, r_begin + rows_per_chunk);
  float s[V];
#pragma unroll
  for (int e = 0; e < V; ++e) s[e] = 0.0f;
  auto add_row = [&](int r) {
    const T* p = src + static_cast<int64_t>(r) * ld + c0;
    if constexpr (kVec) {
      const Vec<T> v = load_vec_cs(p);
#pragma unroll
      for (int e = 0; e < V; ++e) s[e] += v.get(e);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (c0 + e < C) s[e] += to_f32(p[e]);
    }
  };
  if (!kVec || c0 < C) {  // kVec: C is a multiple of V, so a lane's columns are all in or all out
    int r = r_begin + warp;
    for (; r + (kUnroll - 1) * kWarps < r_end; r += kUnroll * kWarps) {
      if constexpr (kVec) {
        Vec<T> v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = load_vec_cs(src + static_cast<int64_t>(r + u * kWarps) * ld + c0);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int e = 0; e < V; ++e) s[e] += v[u].get(e);
      } else {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) add_row(r + u * kWarps);
      }
    }
    for (; r < r_end; r += kWarps) add_row(r);
  }
#pragma unroll
  for (int e = 0; e < V; ++e) acc[warp][lane * V + e] = s[e];
  __syncthreads();
  float* out = partials + static_cast<int64_t>(blockIdx.y) * C + blockIdx.x * 32 * V;
  for (int j = threadIdx.x; j < 32 * V; j += blockDim.x) {
    if (blockIdx.x * 32 * V + j >= C) break;
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += acc[w][j];
    out[j] = t;
  }
}

// Stage 2 (add_column_partials): blockIdx.y picks the pair, a block of 256 threads owns 8
// columns; thread (lane g0 = tid / 8, column tid % 8) sums partial rows g0, g0 + 32, ... in
// order, loading a batch of kBatch rows before adding any (one memory latency per batch, not per
// row), and the 32 subtotals of a column are added as a fixed pairwise tree. dst is read at the
// start, under the loads. The same bits on every run. (Before: 32 columns x 32 row subsets per
// block, one row per load and a 32-step serial sum: 5.8 us for GPT-2's 3 x 768 columns of 132
// partial rows on an H200, a sixth of the LayerNorm backward.)
struct PartialPairs {
  float* dst[3];
  const float* part[3];
};
constexpr int kPartCols = 8, kPartLanes = 32, kBatch = 8;
__global__ void __launch_bounds__(kPartCols * kPartLanes) add_column_partials_kernel(PartialPairs pp, int G, int C) {
  __shared__ float sm[kPartLanes][kPartCols + 1];
  float* __restrict__ dst = pp.dst[blockIdx.y];
  const float* __restrict__ part = pp.part[blockIdx.y];
  const int col = static_cast<int>(threadIdx.x) % kPartCols, g0 = static_cast<int>(threadIdx.x) / kPartCols;
  const int c = blockIdx.x * kPartCols + col;
  const bool ok = c < C;
  const float d0 = ok && g0 == 0 ? dst[c] : 0.0f;
  float v = 0.0f;
  if (ok) {
    for (int base = g0; base < G; base += kBatch * kPartLanes) {
      float x[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int g = base + k * kPartLanes;
        x[k] = g < G ? part[static_cast<int64_t>(g) * C + c] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) v += x[k];
    }
  }
  sm[g0][col] = v;
  __syncthreads();
#pragma unroll
  for (int s = kPartLanes / 2; s >= 1; s /= 2) {
    if (g0 < s) sm[g0][col] += sm[g0 + s][col];
    __syncthreads();
  }
  if (ok && g0 == 0) dst[c] = d0 + sm[0][col];
}

template <class T, int V, bool kVec>
void launch_partials(float* partials, const void* src, int64_t N, int64_t C, int64_t ld, int rows_per_chunk,
                     int64_t chunks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(C, int64_t{32} * V)), static_cast<unsigned>(chunks));
  column_sum_partial_kernel<T, V, kVec><<<grid, 32 * kWarps, 0, stream>>>(
      partials, static_cast<const T*>(src), static_cast<int>(N), static_cast<int>(C), ld, rows_per_chunk);
}

// Row chunks: about four blocks per SM over all strips (32 warps, 8 rows of 16 bytes per lane
// in flight each: enough bytes outstanding for HBM), each chunk at least 64 rows.
int64_t chunks_for(int64_t N, int64_t C) {
  const int64_t strips = std::max<int64_t>(1, ceil_div(C, int64_t{256}));
  const int64_t want = std::max<int64_t>(1, ceil_div(int64_t{4} * sm_count(), strips));
  return std::max<int64_t>(1, std::min<int64_t>(want, ceil_div(N, int64_t{64})));
}
// One thread per 4 columns of a row (kVec) or per column: dweight[r, c] (+)= s[r, c] for c < C
// and, by the row's first thread, dbias[r] += s[r, C].
template <int kVec, bool kAccumulate>
__global__ void split_ones_gradient_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                           const float* __restrict__ s, int64_t rows, int64_t C, int64_t ld) {
  const int64_t per_row = C / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row, c = (i % per_row) * kVec;
  const float* src = s + r * ld + c;
  float* dst = dweight + r * C + c;
  if constexpr (kVec == 4) {
    float4 v = *reinterpret_cast<const float4*>(src);
    if (kAccumulate) {
      const float4 o = *reinterpret_cast<const float4*>(dst);
      v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
    }
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    *dst = kAccumulate ? *dst + *src : *src;
  }
  if (c == 0 && dbias) dbias[r] += s[r * ld + C];
}
__global__ void broadcast_kernel(float* __restrict__ dst, int64_t n, const float* __restrict__ src) {
  const float v = __ldg(src);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) dst[i] = v;
}
}  // namespace

void split_ones_gradient(float* dweight, float* dbias, const float* s, int64_t rows, int64_t C, int64_t ld,
                         bool accumulate, cudaStream_t stream) {
  if (rows <= 0 || C <= 0) return;
  if (ld <= C) throw RuntimeError(fmt::format("split_ones_gradient: row stride {} leaves no column after C={}", ld, C));
  const bool vec = C % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(s) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dweight) % 16 == 0;
  const int64_t threads = rows * (vec ? C / 4 : C);
  const unsigned grid = static_cast<unsigned>(ceil_div(threads, int64_t{256}));
  if (vec && accumulate) split_ones_gradient_kernel<4, true><<<grid, 256, 0, stream>>>(dweight, dbias, s, rows, C, ld);
  else if (vec) split_ones_gradient_kernel<4, false><<<grid, 256, 0, stream>>>(dweight, dbias, s, rows, C, ld);
  else if (accumulate) split_ones_gradient_kernel<1, true><<<grid, 256, 0, stream>>>(dweight, dbias, s, rows, C, ld);
  else split_ones_gradient_kernel<1, false><<<grid, 256, 0, stream>>>(dweight, dbias, s, rows, C, ld);
  CUDA_CHECK_LAST();
}

void broadcast_f32(float* dst, int64_t n, const float* src, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned g = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, 256), 1, int64_t(sm_count()) * 4));
  broadcast_kernel<<<g, 256, 0, stream>>>(dst, n, src);
  CUDA_CHECK_LAST();
}

void add_inplace_f32(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_inplace_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(dst, src, n);
  CUDA_CHECK_LAST();
}

void add_gradient_f32(float* dst, const float* src, int64_t n, bool round_bf16, bool accumulate, cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0;
  const int64_t blocks = std::min<int64_t>(ceil_div(vec ? (n + 3) / 4 : n, 256), int64_t(sm_count()) * 16);
  const unsigned g = static_cast<unsigned>(std::max<int64_t>(blocks, 1));
  if (round_bf16 && accumulate) add_gradient_kernel<true, true><<<g, 256, 0, stream>>>(dst, src, n, vec);
  else if (round_bf16) add_gradient_kernel<true, false><<<g, 256, 0, stream>>>(dst, src, n, vec);
  else if (accumulate) add_gradient_kernel<false, true><<<g, 256, 0, stream>>>(dst, src, n, vec);
  else add_gradient_kernel<false, false><<<g, 256, 0, stream>>>(dst, src, n, vec);
  CUDA_CHECK_LAST();
}

int64_t column_sum_partials(int64_t N, int64_t C) { return N <= 0 || C <= 0 ? 0 : chunks_for(N, C) * C; }

void column_sum_accumulate(float* dst, const void* src, DType dtype, int64_t N, int64_t C, int64_t ld,
                           float* partials, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  if (N > INT32_MAX || C > INT32_MAX || ld < C)
    throw RuntimeError(fmt::format("column_sum_accumulate: bad shape [{}, {}] ld {}", N, C, ld));
  const int64_t G = chunks_for(N, C);
  const int rows_per_chunk = static_cast<int>(ceil_div(N, G));
  const int64_t chunks = ceil_div(N, int64_t{rows_per_chunk});  // <= G
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (dtype == DType::BF16) {
    if (aligned && C % 8 == 0 && ld % 8 == 0) launch_partials<bf16, 8, true>(partials, src, N, C, ld, rows_per_chunk, chunks, stream);
    else launch_partials<bf16, 1, false>(partials, src, N, C, ld, rows_per_chunk, chunks, stream);
  } else if (dtype == DType::F32) {
    if (aligned && C % 4 == 0 && ld % 4 == 0) launch_partials<float, 4, true>(partials, src, N, C, ld, rows_per_chunk, chunks, stream);
    else launch_partials<float, 1, false>(partials, src, N, C, ld, rows_per_chunk, chunks, stream);
  } else {
    throw RuntimeError(fmt::format("column_sum_accumulate: dtype {} (f32 or bf16)", dtype_name(dtype)));
  }
  CUDA_CHECK_LAST();
  const ColumnPartials pair{dst, partials};
  add_column_partials(&pair, 1, static_cast<int>(chunks), C, stream);
}

void add_column_partials(const ColumnPartials* pairs, int count, int G, int64_t C, cudaStream_t stream) {
  if (count <= 0 || C <= 0) return;
  if (count > 3) throw RuntimeError(fmt::format("add_column_partials: {} pairs (at most 3 per launch)", count));
  PartialPairs pp{};
  for (int i = 0; i < count; ++i) {
    pp.dst[i] = pairs[i].dst;
    pp.part[i] = pairs[i].partials;
  }
  add_column_partials_kernel<<<dim3(static_cast<unsigned>(ceil_div(C, int64_t{kPartCols})), static_cast<unsigned>(count)),
                               kPartCols * kPartLanes, 0, stream>>>(pp, G, static_cast<int>(C));
  CUDA_CHECK_LAST();
}
}  // namespace primus::turbo::cuda
