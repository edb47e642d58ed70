// Softmax cross-entropy over the vocabulary, forward and backward fused.
//
// What it fuses and why: the LM head's logits are the largest activation of a step (N x V:
// 16384 x 50304 bf16 is 1.6 GB). Unfused (softmax to fp32 probabilities, loss, gradient) they
// would be written and read several times, in fp32. Here one block owns a row: pass 1 reads it
// once keeping an online max and sum of exponentials per thread; pass 2 reads it again (from L2:
// the grid is sized so the rows in flight fit there) and writes the gradient in place over the
// logits. HBM traffic is one read and one write of the logits, in their own dtype.
#include <fmt/format.h>

#include <algorithm>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/cross_entropy.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kThreads = 1024;

// kUnroll: vectors each thread loads before using any. kMinBlocks: resident blocks per SM the
// register budget must allow (2 when two rows per SM fit in L2 next to each other, else 1 with
// deeper unrolling instead: more bytes in flight per block).
template <class T, int kUnroll, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
cross_entropy_kernel(T* dlogits, float* losses, float* lse_out, const T* logits,
                     const int32_t* targets, int N, int V, int Vp, float dloss, int ignore_index) {
  constexpr int W = Vec<T>::kSize;
  __shared__ float smem[32];
  const int nvec = Vp / W;
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    const T* x = logits + static_cast<int64_t>(row) * Vp;
    // Pass 1: per-thread running max m and sum s of exp(x - m). kUnroll vectors are loaded
    // before any is used, so each thread keeps several loads in flight.
    float m = -INFINITY, s = 0.0f;
    for (int j0 = threadIdx.x; j0 < nvec; j0 += kUnroll * blockDim.x) {
      Vec<T> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * blockDim.x;
        if (j < nvec) v[u] = load_vec(x + j * W);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * blockDim.x;
        if (j >= nvec) continue;
        float vmax = -INFINITY;
#pragma unroll
        for (int e = 0; e < W; ++e)
          if (j * W + e < V) vmax = fmaxf(vmax, v[u].get(e));
        if (vmax == -INFINITY) continue;  // all padding
        const float nm = fmaxf(m, vmax);
        float add = 0.0f;
#pragma unroll
        for (int e = 0; e < W; ++e)
          if (j * W + e < V) add += __expf(v[u].get(e) - nm);
        s = s * __expf(m - nm) + add;
        m = nm;
      }
    }
    const float row_max = block_max(m, smem);
    const float scaled = m == -INFINITY ? 0.0f : s * __expf(m - row_max);
    const float sum = block_sum(scaled, smem);
    const float lse = row_max + __logf(sum);
    const int target = targets[row];
    const bool ignored = target == ignore_index;
    const bool bad = !ignored && (target < 0 || target >= V);
    if (threadIdx.x == 0) {
      float loss = 0.0f;
      if (bad) loss = __int_as_float(0x7fc00000);
      else if (!ignored) loss = lse - to_f32(x[target]);
      if (losses) losses[row] = loss;
      if (lse_out) lse_out[row] = lse;
    }
    if (!dlogits) continue;
    // Pass 2: gradient, written over the row (each element by the thread that read it).
    T* g = dlogits + static_cast<int64_t>(row) * Vp;
    const float scale = ignored ? 0.0f : dloss;
    // The row is both read and written here (in place): the loads of a batch are issued before
    // its stores, which the compiler could not reorder on its own (it must assume aliasing).
    for (int j0 = threadIdx.x; j0 < nvec; j0 += kUnroll * blockDim.x) {
      Vec<T> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * blockDim.x;
        if (j < nvec) v[u] = load_vec_cs(x + j * W);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * blockDim.x;
        if (j >= nvec) continue;
        Vec<T> out;
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const int col = j * W + e;
          const float p = col < V ? __expf(v[u].get(e) - lse) : 0.0f;
          out.set(e, col < V ? scale * (p - (col == target ? 1.0f : 0.0f)) : 0.0f);
        }
        store_vec_cs(g + j * W, out);
      }
    }
  }
}

__global__ void sum_kernel(float* out, const float* x, int64_t n) {
  __shared__ float smem[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

void cross_entropy_forward_backward(DType dtype, void* dlogits, float* losses, float* lse,
                                    const void* logits, const int32_t* targets, int64_t N,
                                    int64_t V, int64_t Vp, float dloss, int32_t ignore_index,
                                    cudaStream_t stream) {
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (Vp % w != 0 || V > Vp || V <= 0)
    throw RuntimeError(fmt::format("cross_entropy: need 0 < V={} <= Vp={} and Vp a multiple of {}", V, Vp, w));
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "cross_entropy", [&] {
    // Rows in flight (grid) are capped so that their second read hits L2 (~60% of it).
    int dev = 0, l2 = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    const int64_t row_bytes = Vp * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t fit = std::max<int64_t>(1, (static_cast<int64_t>(l2) * 3 / 5) / row_bytes);
    const bool two_per_sm = fit >= 2 * static_cast<int64_t>(sm_count());
    const int64_t grid = std::min<int64_t>(N, static_cast<int64_t>(sm_count()) * (two_per_sm ? 2 : 1));
    auto go = [&](auto kernel) {
      kernel<<<static_cast<int>(grid), kThreads, 0, stream>>>(
          static_cast<scalar_t*>(dlogits), losses, lse, static_cast<const scalar_t*>(logits), targets,
          static_cast<int>(N), static_cast<int>(V), static_cast<int>(Vp), dloss, ignore_index);
    };
    if (two_per_sm)
      go(cross_entropy_kernel<scalar_t, 1, 2>);
    else
      go(cross_entropy_kernel<scalar_t, 2, 1>);
    CUDA_CHECK_LAST();
  });
}

void sum_f32(float* out, const float* x, int64_t n, cudaStream_t stream) {
  sum_kernel<<<1, 1024, 0, stream>>>(out, x, n);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
