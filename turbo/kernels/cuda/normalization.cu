// Fused residual-add + LayerNorm / RMSNorm, forward and backward.
//
// What it fuses and why: a transformer block computes x = x + branch, then norm(x). Unfused
// that is three passes (add: 3 tensor accesses; norm: 2 more); fused, each element is read
// once from each input and written once to each output (4 accesses), and the statistics never
// leave the chip. The backward adds its input gradient straight into the residual stream's
// gradient (the residual add's backward is the identity), so it needs no separate add either.
//
// Shape of the work: a block owns whole rows (grid-strided, a few blocks per SM) and each
// thread keeps kVec 128-bit vectors of its row in registers, so the row is read from memory
// once even though the statistics need two passes over it (mean, then centred variance).
// LayerNorm and RMSNorm are one template (kRms: no mean, no bias).
//
// Parameter gradients are summed per block in registers, written as [grid, C] partials and
// reduced in block order by a second kernel: no atomics, so the result is bitwise reproducible.
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/normalization.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kMaxThreads = 512;

template <class T, int kVec, bool kRms>
__global__ void __launch_bounds__(kMaxThreads)
norm_forward_kernel(T* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                    T* __restrict__ residual_out, const T* __restrict__ inp,
                    const T* __restrict__ residual, const T* __restrict__ weight,
                    const T* __restrict__ bias, int N, int C, float eps) {
  constexpr int W = Vec<T>::kSize;
  __shared__ float smem[32];
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t base = static_cast<int64_t>(row) * C;
    float vals[kVec][W];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        Vec<T> a = load_vec(inp + base + j * W);
        if (residual) {
          const Vec<T> r = load_vec(residual + base + j * W);
#pragma unroll
          for (int e = 0; e < W; ++e) a.set(e, a.get(e) + r.get(e));  // rounded to T, as stored
          store_vec(residual_out + base + j * W, a);
        }
#pragma unroll
        for (int e = 0; e < W; ++e) { vals[i][e] = a.get(e); sum += vals[i][e]; }
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) vals[i][e] = 0.0f;
      }
    }
    const float mean = kRms ? 0.0f : block_sum(sum, smem) * inv_c;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
#pragma unroll
        for (int e = 0; e < W; ++e) { const float d = vals[i][e] - mean; sq += d * d; }
      }
    }
    const float rstd = rsqrtf(block_sum(sq, smem) * inv_c + eps);
    if (threadIdx.x == 0) {
      if (!kRms && mean_out) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        const Vec<T> w = load_vec(weight + j * W);
        Vec<T> b;
        if (!kRms && bias) b = load_vec(bias + j * W);
        Vec<T> o;
#pragma unroll
        for (int e = 0; e < W; ++e) {
          float y = (vals[i][e] - mean) * rstd * w.get(e);
          if (!kRms && bias) y += b.get(e);
          o.set(e, y);
        }
        store_vec(out + base + j * W, o);
      }
    }
  }
}

template <class T, int kVec, bool kRms>
__global__ void __launch_bounds__(kMaxThreads)
norm_backward_kernel(T* __restrict__ dinp, float* __restrict__ dweight_part,
                     float* __restrict__ dbias_part, const T* __restrict__ dout,
                     const T* __restrict__ inp, const T* __restrict__ weight,
                     const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C,
                     bool accumulate) {
  constexpr int W = Vec<T>::kSize;
  __shared__ float smem[32];
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);
  float w[kVec][W], dw[kVec][W], db[kVec][W];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int j = threadIdx.x + i * blockDim.x;
    Vec<T> wv;
    if (j < nvec) wv = load_vec(weight + j * W);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      w[i][e] = j < nvec ? wv.get(e) : 0.0f;
      dw[i][e] = 0.0f;
      db[i][e] = 0.0f;
    }
  }
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t base = static_cast<int64_t>(row) * C;
    const float mu = kRms ? 0.0f : mean[row];
    const float rs = rstd[row];
    float g[kVec][W], xh[kVec][W];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        const Vec<T> gv = load_vec(dout + base + j * W);
        const Vec<T> xv = load_vec(inp + base + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          g[i][e] = gv.get(e);
          xh[i][e] = (xv.get(e) - mu) * rs;
          const float dn = g[i][e] * w[i][e];
          s1 += dn;
          s2 += dn * xh[i][e];
          dw[i][e] += g[i][e] * xh[i][e];
          db[i][e] += g[i][e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) g[i][e] = xh[i][e] = 0.0f;
      }
    }
    const float mean_dn = kRms ? 0.0f : block_sum(s1, smem) * inv_c;
    const float mean_dn_xh = block_sum(s2, smem) * inv_c;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        Vec<T> d;
        if (accumulate) d = load_vec(dinp + base + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float v = (g[i][e] * w[i][e] - mean_dn - xh[i][e] * mean_dn_xh) * rs;
          d.set(e, accumulate ? d.get(e) + v : v);
        }
        store_vec(dinp + base + j * W, d);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int j = threadIdx.x + i * blockDim.x;
    if (j < nvec) {
      float* pw = dweight_part + static_cast<int64_t>(blockIdx.x) * C + j * W;
#pragma unroll
      for (int e = 0; e < W; ++e) pw[e] = dw[i][e];
      if (dbias_part) {
        float* pb = dbias_part + static_cast<int64_t>(blockIdx.x) * C + j * W;
#pragma unroll
        for (int e = 0; e < W; ++e) pb[e] = db[i][e];
      }
    }
  }
}

// dst[c] += sum over g of part[g, c], in g order (deterministic).
__global__ void column_sum_add_kernel(float* __restrict__ dst, const float* __restrict__ part,
                                      int G, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int g = 0; g < G; ++g) s += part[static_cast<int64_t>(g) * C + c];
  dst[c] += s;
}

struct Shape {
  int kvec, threads, grid;
};
template <class T>
Shape shape_for(int64_t N, int64_t C) {
  const int nvec = static_cast<int>(C / Vec<T>::kSize);
  int kvec = 1;
  while (kvec < 4 && ceil_div(nvec, kvec) > kMaxThreads) kvec *= 2;
  const int threads = ceil_div(ceil_div(nvec, kvec), 32) * 32;
  const int per_sm = std::max(1, 2048 / threads);
  const int grid = static_cast<int>(std::min<int64_t>(N, static_cast<int64_t>(sm_count()) * per_sm));
  return {kvec, threads, std::max(grid, 1)};
}

template <class T, bool kRms>
void launch_forward(void* out, float* mean, float* rstd, void* res_out, const void* inp,
                    const void* res, const void* w, const void* b, int64_t N, int64_t C, float eps,
                    cudaStream_t s) {
  const Shape sh = shape_for<T>(N, C);
  auto go = [&](auto kernel) {
    kernel<<<sh.grid, sh.threads, 0, s>>>(static_cast<T*>(out), mean, rstd, static_cast<T*>(res_out),
                                          static_cast<const T*>(inp), static_cast<const T*>(res),
                                          static_cast<const T*>(w), static_cast<const T*>(b),
                                          static_cast<int>(N), static_cast<int>(C), eps);
  };
  switch (sh.kvec) {
    case 1: go(norm_forward_kernel<T, 1, kRms>); break;
    case 2: go(norm_forward_kernel<T, 2, kRms>); break;
    default: go(norm_forward_kernel<T, 4, kRms>); break;
  }
  CUDA_CHECK_LAST();
}

template <class T, bool kRms>
void launch_backward(void* dinp, float* dw, float* db, const void* dout, const void* inp,
                     const void* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                     bool acc, void* scratch, cudaStream_t s) {
  const Shape sh = shape_for<T>(N, C);
  float* pw = static_cast<float*>(scratch);
  float* pb = db ? pw + static_cast<int64_t>(sh.grid) * C : nullptr;
  auto go = [&](auto kernel) {
    kernel<<<sh.grid, sh.threads, 0, s>>>(static_cast<T*>(dinp), pw, pb, static_cast<const T*>(dout),
                                          static_cast<const T*>(inp), static_cast<const T*>(w), mean,
                                          rstd, static_cast<int>(N), static_cast<int>(C), acc);
  };
  switch (sh.kvec) {
    case 1: go(norm_backward_kernel<T, 1, kRms>); break;
    case 2: go(norm_backward_kernel<T, 2, kRms>); break;
    default: go(norm_backward_kernel<T, 4, kRms>); break;
  }
  CUDA_CHECK_LAST();
  const int cgrid = ceil_div(C, 256);
  column_sum_add_kernel<<<cgrid, 256, 0, s>>>(dw, pw, sh.grid, static_cast<int>(C));
  CUDA_CHECK_LAST();
  if (db) {
    column_sum_add_kernel<<<cgrid, 256, 0, s>>>(db, pb, sh.grid, static_cast<int>(C));
    CUDA_CHECK_LAST();
  }
}

}  // namespace

const char* norm_unsupported_reason(DType dtype, int64_t C) {
  if (dtype != DType::F32 && dtype != DType::BF16) return "dtype must be f32 or bf16";
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (C <= 0 || C % w != 0) return "C must be a positive multiple of the 128-bit vector width (8 bf16 / 4 f32)";
  if (C / w > 4 * kMaxThreads) return "C too large (at most 16384 bf16 / 8192 f32 columns)";
  return "";
}

void norm_forward(NormKind kind, DType dtype, void* out, float* mean, float* rstd, void* residual_out,
                  const void* inp, const void* residual, const void* weight, const void* bias,
                  int64_t N, int64_t C, float eps, cudaStream_t stream) {
  if (const char* why = norm_unsupported_reason(dtype, C); *why)
    throw RuntimeError(fmt::format("norm_forward C={} {}: {}", C, dtype_name(dtype), why));
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "norm_forward", [&] {
    if (kind == NormKind::RMSNorm)
      launch_forward<scalar_t, true>(out, mean, rstd, residual_out, inp, residual, weight, nullptr, N, C, eps, stream);
    else
      launch_forward<scalar_t, false>(out, mean, rstd, residual_out, inp, residual, weight, bias, N, C, eps, stream);
  });
}

size_t norm_backward_scratch_bytes(int64_t N, int64_t C) {
  // The grid depends on the dtype's vector width only through the thread count; size for the
  // larger of the two (f32: more vectors per row, so fewer blocks per SM is never larger).
  const int64_t g = std::max(shape_for<float>(N, C).grid, shape_for<bf16>(N, C).grid);
  return static_cast<size_t>(2 * g * C) * sizeof(float);
}

void norm_backward(NormKind kind, DType dtype, void* dinp, float* dweight, float* dbias,
                   const void* dout, const void* inp, const void* weight, const float* mean,
                   const float* rstd, int64_t N, int64_t C, bool accumulate_dinp, void* scratch,
                   cudaStream_t stream) {
  if (const char* why = norm_unsupported_reason(dtype, C); *why)
    throw RuntimeError(fmt::format("norm_backward C={} {}: {}", C, dtype_name(dtype), why));
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "norm_backward", [&] {
    if (kind == NormKind::RMSNorm)
      launch_backward<scalar_t, true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, N, C,
                                      accumulate_dinp, scratch, stream);
    else
      launch_backward<scalar_t, false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                       accumulate_dinp, scratch, stream);
  });
}

}  // namespace primus::turbo::cuda
