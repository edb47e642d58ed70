// Muon's elementwise steps around the Newton-Schulz GEMMs (see muon.h). Memory-bound and small
// next to the GEMMs (each touches the matrix once or twice); the norm is two-stage (a fixed grid
// of partial sums, then every block of the next kernel sums them in the same order), so results
// are bitwise reproducible and nothing leaves the device, which keeps the step graph-capturable.
#include <algorithm>
#include <cmath>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/muon.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool vetoed(const float* grad_scale) { return grad_scale && !isfinite(*grad_scale); }

__global__ void __launch_bounds__(kThreads)
muon_momentum_kernel(const float* __restrict__ grad, float* __restrict__ m, float* __restrict__ u, int64_t n,
                     float momentum, int nesterov, const float* grad_scale, float* partial) {
  __shared__ float smem[32];
  if (vetoed(grad_scale)) return;
  const float s = grad_scale ? *grad_scale : 1.0f;
  float sq = 0.f;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const float g = s * grad[i];
    const float mi = momentum * m[i] + g;
    m[i] = mi;
    const float ui = nesterov ? g + momentum * mi : mi;
    u[i] = ui;
    sq += ui * ui;
  }
  sq = block_sum(sq, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = sq;
}

// Per-block partial sums of u^2 alone (a matrix put together from tensor-parallel pieces).
__global__ void __launch_bounds__(kThreads)
muon_sum_squares_kernel(const float* __restrict__ u, int64_t n, const float* grad_scale, float* partial) {
  __shared__ float smem[32];
  if (vetoed(grad_scale)) return;
  float sq = 0.f;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    sq += u[i] * u[i];
  sq = block_sum(sq, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = sq;
}

__global__ void __launch_bounds__(kThreads)
muon_normalize_kernel(const float* __restrict__ u, bf16* __restrict__ x, int64_t rows, int64_t cols,
                      const float* __restrict__ partial, int parts, const float* grad_scale) {
  __shared__ float smem[32];
  if (vetoed(grad_scale)) return;
  float sq = threadIdx.x < parts ? partial[threadIdx.x] : 0.f;
  sq = block_sum(sq, smem);
  const float inv = 1.0f / (sqrtf(sq) + 1e-7f);
  const bool tall = rows > cols;
  const int64_t n = rows * cols;
  for (int64_t k = blockIdx.x * int64_t{kThreads} + threadIdx.x; k < n; k += int64_t{gridDim.x} * kThreads) {
    // Tall: k indexes x = u^T [cols, rows] (coalesced writes); else the same layout as u.
    const int64_t src = tall ? (k % rows) * cols + k / rows : k;
    x[k] = __float2bfloat16_rn(u[src] * inv);
  }
}

__global__ void __launch_bounds__(kThreads)
muon_apply_kernel(float* __restrict__ master, bf16* __restrict__ model, const bf16* __restrict__ x, int64_t rows,
                  int64_t cols, int64_t full_rows, int64_t full_cols, int64_t row0, int64_t col0, float lr,
                  const float* device_lr, float lr_scale, float weight_decay, float rms_scale,
                  const float* grad_scale) {
  if (vetoed(grad_scale)) return;
  const float l = device_lr ? *device_lr * lr_scale : lr;
  const float decay = 1.0f - l * weight_decay, step = l * rms_scale;
  const bool tall = full_rows > full_cols;
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    // Element (r, c) of this piece is (row0 + r, col0 + c) of the whole O; O[R][C] = x[C][R] when tall.
    const int64_t r = row0 + i / cols, c = col0 + i % cols;
    const int64_t src = tall ? c * full_rows + r : r * full_cols + c;
    const float p = master[i] * decay - step * __bfloat162float(x[src]);
    master[i] = p;
    if (model) model[i] = __float2bfloat16_rn(p);
  }
}

__global__ void __launch_bounds__(kThreads)
muon_axpby_kernel(const bf16* x, const bf16* y, bf16* out, int64_t n,  // out may be x or y
                  float alpha, float beta, const float* grad_scale) {
  if (vetoed(grad_scale)) return;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    out[i] = __float2bfloat16_rn(alpha * __bfloat162float(x[i]) + beta * __bfloat162float(y[i]));
  }
}

int grid_for(int64_t n, int cap) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cap, ceil_div(n, kThreads * 4)))); }

}  // namespace

void muon_momentum(const float* grad, float* m, float* u, int64_t n, float momentum, bool nesterov,
                   const float* grad_scale, float* partial, cudaStream_t stream) {
  static_assert(kMuonMaxParts <= kThreads, "muon_normalize sums the partials with one thread each");
  const int grid = grid_for(n, kMuonMaxParts);
  // Unused partials must read as zero: the next kernel sums all kMuonMaxParts.
  if (grid < kMuonMaxParts) CUDA_CHECK(cudaMemsetAsync(partial + grid, 0, sizeof(float) * (kMuonMaxParts - grid), stream));
  muon_momentum_kernel<<<grid, kThreads, 0, stream>>>(grad, m, u, n, momentum, nesterov ? 1 : 0, grad_scale, partial);
  CUDA_CHECK_LAST();
}

void muon_sum_squares(const float* u, int64_t n, const float* grad_scale, float* partial, cudaStream_t stream) {
  const int grid = grid_for(n, kMuonMaxParts);
  if (grid < kMuonMaxParts) CUDA_CHECK(cudaMemsetAsync(partial + grid, 0, sizeof(float) * (kMuonMaxParts - grid), stream));
  muon_sum_squares_kernel<<<grid, kThreads, 0, stream>>>(u, n, grad_scale, partial);
  CUDA_CHECK_LAST();
}

void muon_normalize(const float* u, void* x_bf16, int64_t rows, int64_t cols, const float* partial,
                    const float* grad_scale, cudaStream_t stream) {
  muon_normalize_kernel<<<grid_for(rows * cols, 1024), kThreads, 0, stream>>>(u, static_cast<bf16*>(x_bf16), rows, cols,
                                                                              partial, kMuonMaxParts, grad_scale);
  CUDA_CHECK_LAST();
}

void muon_apply(float* master, void* model_bf16, const void* x_bf16, int64_t rows, int64_t cols, int64_t full_rows,
                int64_t full_cols, int64_t row0, int64_t col0, float lr, const float* device_lr, float lr_scale,
                float weight_decay, float rms_scale, const float* grad_scale, cudaStream_t stream) {
  muon_apply_kernel<<<grid_for(rows * cols, 1024), kThreads, 0, stream>>>(
      master, static_cast<bf16*>(model_bf16), static_cast<const bf16*>(x_bf16), rows, cols, full_rows, full_cols, row0,
      col0, lr, device_lr, lr_scale, weight_decay, rms_scale, grad_scale);
  CUDA_CHECK_LAST();
}

void muon_axpby(const void* x_bf16, const void* y_bf16, void* out_bf16, int64_t n, float alpha, float beta,
                const float* grad_scale, cudaStream_t stream) {
  muon_axpby_kernel<<<grid_for(n, 1024), kThreads, 0, stream>>>(static_cast<const bf16*>(x_bf16),
                                                                static_cast<const bf16*>(y_bf16),
                                                                static_cast<bf16*>(out_bf16), n, alpha, beta, grad_scale);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
