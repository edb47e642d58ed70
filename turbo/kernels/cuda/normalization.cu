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

#include <map>
#include <mutex>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/normalization.h"

namespace primus::turbo::cuda {
namespace {

// Block shape: threadIdx.x walks one row's vectors (tx threads, a multiple of 32), threadIdx.y
// picks one of ty rows handled side by side. Short rows (GPT-2's 768) get one warp per row, so
// their statistics need shuffles only, and many rows per block keep enough loads in flight.
constexpr int kFwdThreads = 256, kBwdThreads = 256;

// Sum over the tx threads of this thread's row group; every thread of the group gets it.
// All threads of the block must call it (it may synchronise the block).
__device__ __forceinline__ float row_sum(float x, float* smem) {
  x = warp_sum(x);
  const int wpr = blockDim.x / 32;
  if (wpr == 1) return x;  // uniform across the block
  __syncthreads();         // smem may still be read by the previous call
  if (threadIdx.x % 32 == 0) smem[threadIdx.y * wpr + threadIdx.x / 32] = x;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < wpr; ++i) s += smem[threadIdx.y * wpr + i];
  return s;
}

template <class T, int kVec, bool kRms>
__global__ void __launch_bounds__(1024)
norm_forward_kernel(T* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                    T* __restrict__ residual_out, const T* __restrict__ inp,
                    const T* __restrict__ residual, const T* __restrict__ weight,
                    const T* __restrict__ bias, int N, int C, float eps) {
  constexpr int W = Vec<T>::kSize;
  __shared__ float smem[32];
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);
  // The loop bound is uniform over the block (row_sum synchronises it); `valid` masks rows past N.
  for (int base = blockIdx.x * blockDim.y; base < N; base += gridDim.x * blockDim.y) {
    const int row = base + threadIdx.y;
    const bool valid = row < N;
    const int64_t off = static_cast<int64_t>(valid ? row : 0) * C;
    float vals[kVec][W];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (valid && j < nvec) {
        Vec<T> a = load_vec(inp + off + j * W);
        if (residual) {
          const Vec<T> r = load_vec(residual + off + j * W);
#pragma unroll
          for (int e = 0; e < W; ++e) a.set(e, a.get(e) + r.get(e));  // rounded to T, as stored
          store_vec(residual_out + off + j * W, a);
        }
#pragma unroll
        for (int e = 0; e < W; ++e) { vals[i][e] = a.get(e); sum += vals[i][e]; }
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) vals[i][e] = 0.0f;
      }
    }
    const float mean = kRms ? 0.0f : row_sum(sum, smem) * inv_c;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (valid && j < nvec) {
#pragma unroll
        for (int e = 0; e < W; ++e) { const float d = vals[i][e] - mean; sq += d * d; }
      }
    }
    const float rstd = rsqrtf(row_sum(sq, smem) * inv_c + eps);
    if (!valid) continue;
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
        store_vec(out + off + j * W, o);
      }
    }
  }
}

// Parameter-gradient partials: each block sums its rows' contributions in registers, the row
// groups of the block are combined through shared memory in group order, and one [C] row per
// block goes to part_w / part_b ([grid, C]).
template <class T, int kVec, bool kRms>
__global__ void __launch_bounds__(kBwdThreads)
norm_backward_kernel(T* __restrict__ dinp, float* __restrict__ part_w, float* __restrict__ part_b,
                     const T* __restrict__ dout, const T* __restrict__ inp,
                     const T* __restrict__ weight, const float* __restrict__ mean,
                     const float* __restrict__ rstd, int N, int C, bool accumulate) {
  constexpr int W = Vec<T>::kSize;
  __shared__ float smem[32];
  extern __shared__ float acc[];  // [2, C] when blockDim.y > 1
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);
  float dw[kVec][W], db[kVec][W];
#pragma unroll
  for (int i = 0; i < kVec; ++i)
#pragma unroll
    for (int e = 0; e < W; ++e) dw[i][e] = db[i][e] = 0.0f;
  // Rows are software-pipelined: the next row's dout and inp are in flight while this row's
  // reductions wait at their barriers (the weight is re-read from L1 instead of held, to leave
  // registers for that).
  const int stride = gridDim.x * blockDim.y;
  Vec<T> g_cur[kVec], x_cur[kVec];
  auto load_row = [&](int base, Vec<T>* g, Vec<T>* x) {
    const int row = base + threadIdx.y;
    if (row >= N) return;
    const int64_t off = static_cast<int64_t>(row) * C;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        g[i] = load_vec(dout + off + j * W);
        x[i] = load_vec(inp + off + j * W);
      }
    }
  };
  load_row(blockIdx.x * blockDim.y, g_cur, x_cur);
  for (int base = blockIdx.x * blockDim.y; base < N; base += stride) {
    const int row = base + threadIdx.y;
    const bool valid = row < N;
    const int64_t off = static_cast<int64_t>(valid ? row : 0) * C;
    Vec<T> g_next[kVec], x_next[kVec];
    if (base + stride < N) load_row(base + stride, g_next, x_next);
    const float mu = (kRms || !valid) ? 0.0f : mean[row];
    const float rs = valid ? rstd[row] : 0.0f;
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (valid && j < nvec) {
        const Vec<T> wv = load_vec(weight + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float g = g_cur[i].get(e), xh = (x_cur[i].get(e) - mu) * rs, dn = g * wv.get(e);
          s1 += dn;
          s2 += dn * xh;
          dw[i][e] += g * xh;
          db[i][e] += g;
        }
      }
    }
    const float mean_dn = kRms ? 0.0f : row_sum(s1, smem) * inv_c;
    const float mean_dn_xh = row_sum(s2, smem) * inv_c;
    if (valid) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < nvec) {
          const Vec<T> wv = load_vec(weight + j * W);
          Vec<T> d;
          if (accumulate) d = load_vec(dinp + off + j * W);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            const float xh = (x_cur[i].get(e) - mu) * rs;
            const float v = (g_cur[i].get(e) * wv.get(e) - mean_dn - xh * mean_dn_xh) * rs;
            d.set(e, accumulate ? d.get(e) + v : v);
          }
          store_vec(dinp + off + j * W, d);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      g_cur[i] = g_next[i];
      x_cur[i] = x_next[i];
    }
  }
  float* pw = part_w + static_cast<int64_t>(blockIdx.x) * C;
  float* pb = part_b ? part_b + static_cast<int64_t>(blockIdx.x) * C : nullptr;
  if (blockDim.y == 1) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
#pragma unroll
        for (int e = 0; e < W; ++e) {
          pw[j * W + e] = dw[i][e];
          if (pb) pb[j * W + e] = db[i][e];
        }
      }
    }
    return;
  }
  // Row groups add into shared memory one after another (a fixed order: deterministic).
  for (int y = 0; y < static_cast<int>(blockDim.y); ++y) {
    if (threadIdx.y == y) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < nvec) {
#pragma unroll
          for (int e = 0; e < W; ++e) {
            acc[j * W + e] = (y == 0 ? 0.0f : acc[j * W + e]) + dw[i][e];
            acc[C + j * W + e] = (y == 0 ? 0.0f : acc[C + j * W + e]) + db[i][e];
          }
        }
      }
    }
    __syncthreads();
  }
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  for (int c = tid; c < C; c += nthreads) {
    pw[c] = acc[c];
    if (pb) pb[c] = acc[C + c];
  }
}

// dst[c] += sum over g of part[g, c]. A block owns 32 columns; its 32 thread rows each sum a
// strided subset of g in order, then row 0 adds the 32 results in order: deterministic.
__global__ void column_sum_add_kernel(float* __restrict__ dst, const float* __restrict__ part, int G, int C) {
  __shared__ float s[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float v = 0.0f;
  if (c < C)
    for (int g = threadIdx.y; g < G; g += 32) v += part[static_cast<int64_t>(g) * C + c];
  s[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
    for (int i = 0; i < 32; ++i) t += s[i][threadIdx.x];
    dst[c] += t;
  }
}

struct Shape {
  int kvec, tx, ty;
  int64_t row_blocks;  // blocks needed to give every row group one row
  size_t smem;
};

// Threads per row: the fewest (a multiple of 32, at most `max_tx`) such that each holds at most
// `target` vectors (more only when max_tx forces it, up to 4).
template <class T>
Shape shape_for(int64_t N, int64_t C, bool backward) {
  const int nvec = static_cast<int>(C / Vec<T>::kSize);
  const int target = backward ? 2 : 4, max_tx = backward ? kBwdThreads : 1024;
  const int tx = std::min(max_tx, ceil_div(ceil_div(nvec, target), 32) * 32);
  const int kvec = ceil_div(nvec, tx);
  const int block = backward ? kBwdThreads : kFwdThreads;
  int ty = std::max(1, block / tx);
  size_t smem = 0;
  if (backward && ty > 1) {
    smem = 2 * static_cast<size_t>(C) * sizeof(float);
    if (smem > 48 * 1024) { ty = 1; smem = 0; }
  }
  return {kvec, tx, ty, (N + ty - 1) / ty, smem};
}

// A persistent grid for the backward: as many blocks as fit on the device at once (one wave),
// each walking rows with a stride; that is also the number of partial rows. The occupancy query
// is cached per kernel: it costs host time on every call otherwise.
template <class Kernel>
int resident_grid(Kernel kernel, const Shape& sh) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), sh.tx * sh.ty * 65536 + static_cast<int>(sh.smem / 16));
  int per_sm = 0;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      per_sm = it->second;
    } else {
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, sh.tx * sh.ty, sh.smem));
      cache.emplace(key, per_sm);
    }
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sh.row_blocks, static_cast<int64_t>(sm_count()) * std::max(per_sm, 1))));
}
// Upper bound of resident_grid (2048 threads per SM), for sizing the partials' scratch.
int max_resident_grid(const Shape& sh) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sh.row_blocks, static_cast<int64_t>(sm_count()) * std::max(1, 2048 / (sh.tx * sh.ty)))));
}

template <class T, bool kRms>
void launch_forward(void* out, float* mean, float* rstd, void* res_out, const void* inp,
                    const void* res, const void* w, const void* b, int64_t N, int64_t C, float eps,
                    cudaStream_t s) {
  const Shape sh = shape_for<T>(N, C, false);
  auto go = [&](auto kernel) {
    // The forward writes no partials: one block per row group, as many as there are.
    kernel<<<static_cast<unsigned>(sh.row_blocks), dim3(sh.tx, sh.ty), 0, s>>>(static_cast<T*>(out), mean, rstd, static_cast<T*>(res_out),
                                                  static_cast<const T*>(inp), static_cast<const T*>(res),
                                                  static_cast<const T*>(w), static_cast<const T*>(b),
                                                  static_cast<int>(N), static_cast<int>(C), eps);
  };
  switch (sh.kvec) {
    case 1: go(norm_forward_kernel<T, 1, kRms>); break;
    case 2: go(norm_forward_kernel<T, 2, kRms>); break;
    case 3: go(norm_forward_kernel<T, 3, kRms>); break;
    default: go(norm_forward_kernel<T, 4, kRms>); break;
  }
  CUDA_CHECK_LAST();
}

template <class T, bool kRms>
void launch_backward(void* dinp, float* dw, float* db, const void* dout, const void* inp,
                     const void* w, const float* mean, const float* rstd, int64_t N, int64_t C,
                     bool acc, void* scratch, cudaStream_t s) {
  const Shape sh = shape_for<T>(N, C, true);
  float* pw = static_cast<float*>(scratch);
  float* pb = db ? pw + static_cast<int64_t>(max_resident_grid(sh)) * C : nullptr;
  int grid = 1;
  auto go = [&](auto kernel) {
    grid = resident_grid(kernel, sh);
    kernel<<<grid, dim3(sh.tx, sh.ty), sh.smem, s>>>(static_cast<T*>(dinp), pw, pb, static_cast<const T*>(dout),
                                                     static_cast<const T*>(inp), static_cast<const T*>(w), mean,
                                                     rstd, static_cast<int>(N), static_cast<int>(C), acc);
  };
  switch (sh.kvec) {
    case 1: go(norm_backward_kernel<T, 1, kRms>); break;
    case 2: go(norm_backward_kernel<T, 2, kRms>); break;
    case 3: go(norm_backward_kernel<T, 3, kRms>); break;
    default: go(norm_backward_kernel<T, 4, kRms>); break;
  }
  CUDA_CHECK_LAST();
  const dim3 cblock(32, 32);
  column_sum_add_kernel<<<ceil_div(C, 32), cblock, 0, s>>>(dw, pw, grid, static_cast<int>(C));
  CUDA_CHECK_LAST();
  if (db) {
    column_sum_add_kernel<<<ceil_div(C, 32), cblock, 0, s>>>(db, pb, grid, static_cast<int>(C));
    CUDA_CHECK_LAST();
  }
}

}  // namespace

const char* norm_unsupported_reason(DType dtype, int64_t C) {
  if (dtype != DType::F32 && dtype != DType::BF16) return "dtype must be f32 or bf16";
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (C <= 0 || C % w != 0) return "C must be a positive multiple of the 128-bit vector width (8 bf16 / 4 f32)";
  if (C / w > 4 * kBwdThreads) return "C too large (at most 16384 bf16 / 8192 f32 columns)";
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
  const int64_t g = std::max(max_resident_grid(shape_for<float>(N, C, true)), max_resident_grid(shape_for<bf16>(N, C, true)));
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
