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

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

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

// ---- the row-group backward (default) ----------------------------------------------------
// A row group of k warps (k = 1 for rows of up to 768 bf16 / 512 f32 columns, more for longer
// rows) owns one row at a time and walks rows with a grid stride; a block holds max(1, 4 / k)
// groups (128 threads, 256 when k = 8). A lane owns kVec 128-bit vectors of the row,
// j = lane + i * 32k. The row's two sums are reduced by shuffles, and for k > 1 across the group's warps through shared memory
// under a named barrier of the group only (one per row): groups never wait for each other.
// The next row's dout / inp and statistics are loaded while this row is reduced, and the
// current row's dinp (when accumulating) before its reductions. The parameter-gradient (and
// dinp column-sum) partials live in registers per lane, are combined across the block's groups
// through shared memory in group order at the end, and written as one [C] row per block and
// gradient: [kAcc][grid][C], reduced in block order by column_sums_add_kernel. No atomics.
constexpr int kRowThreads = 256;  // the largest block (k = 8)

__device__ __forceinline__ void group_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

template <class T, int kVec, bool kRms, bool kColsum, bool kAccumulate>
__global__ void __launch_bounds__(kRowThreads)
norm_backward_rows_kernel(T* __restrict__ dinp, float* __restrict__ part, const T* __restrict__ dout,
                          const T* __restrict__ inp, const T* __restrict__ weight,
                          const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C) {
  constexpr int W = Vec<T>::kSize;
  constexpr bool kBias = !kRms;  // LayerNorm always sums dbias (dropped when it has none)
  __shared__ float2 red[2][kRowThreads / 32];  // [parity][warp]: the row sums of each warp
  extern __shared__ float4 sbuf4[];             // [ty][C] floats when ty > 1
  float* sbuf = reinterpret_cast<float*>(sbuf4);
  const int tx = blockDim.x, ty = blockDim.y;  // tx = 32k threads per row group
  const int lane = threadIdx.x, y = threadIdx.y;
  const int k = tx / 32, warp = y * k + lane / 32;
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);

  float dw[kVec][W], db[kBias ? kVec : 1][W], cs[kColsum ? kVec : 1][W];
#pragma unroll
  for (int i = 0; i < kVec; ++i)
#pragma unroll
    for (int e = 0; e < W; ++e) {
      dw[i][e] = 0.0f;
      if constexpr (kBias) db[i][e] = 0.0f;
      if constexpr (kColsum) cs[i][e] = 0.0f;
    }

  const int stride = gridDim.x * ty;
  int row = blockIdx.x * ty + y;  // uniform over the group: the group's loop and barriers agree
  Vec<T> gc[kVec], xc[kVec];
  float mu_c = 0.0f, rs_c = 0.0f;
  auto load_row = [&](int r, Vec<T>* g, Vec<T>* x, float& mu, float& rs) {
    const int64_t off = static_cast<int64_t>(r) * C;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + i * tx;
      if (j < nvec) {
        g[i] = load_vec(dout + off + j * W);
        x[i] = load_vec(inp + off + j * W);
      }
    }
    if constexpr (!kRms) mu = mean[r];
    rs = rstd[r];
  };
  if (row < N) load_row(row, gc, xc, mu_c, rs_c);
  int parity = 0;
  for (; row < N; row += stride) {
    const int64_t off = static_cast<int64_t>(row) * C;
    Vec<T> dc[kAccumulate ? kVec : 1];
    if constexpr (kAccumulate) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int j = lane + i * tx;
        if (j < nvec) dc[i] = load_vec(dinp + off + j * W);
      }
    }
    Vec<T> gn[kVec], xn[kVec];
    float mu_n = 0.0f, rs_n = 0.0f;
    const int next = row + stride;
    if (next < N) load_row(next, gn, xn, mu_n, rs_n);

    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + i * tx;
      if (j < nvec) {
        const Vec<T> wv = load_vec(weight + j * W);  // L1-resident: re-read instead of held
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float g = gc[i].get(e), xh = (xc[i].get(e) - mu_c) * rs_c, dn = g * wv.get(e);
          if constexpr (!kRms) s1 += dn;
          s2 += dn * xh;
          dw[i][e] += g * xh;
          if constexpr (kBias) db[i][e] += g;
        }
      }
    }
    if constexpr (!kRms) s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (k > 1) {
      // Double-buffered by row parity: a slot is rewritten two rows later, after every warp of
      // the group has passed the barrier of the row between, hence after its reads of this one.
      if (lane % 32 == 0) red[parity][warp] = make_float2(s1, s2);
      group_barrier(1 + y, tx);
      s1 = s2 = 0.0f;
      for (int w = 0; w < k; ++w) {
        const float2 v = red[parity][y * k + w];
        s1 += v.x;
        s2 += v.y;
      }
      parity ^= 1;
    }
    const float mean_dn = kRms ? 0.0f : s1 * inv_c, mean_dn_xh = s2 * inv_c;
    // Recompute xhat and dout * weight from the packed row rather than keep the first pass's
    // f32 values alive across the reductions (twice the registers): the compiler cannot merge
    // the two passes through these opaque copies.
    float mu2 = mu_c, rs2 = rs_c;
    const T* w2 = weight;
    asm volatile("" : "+f"(mu2), "+f"(rs2), "+l"(w2));
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + i * tx;
      if (j < nvec) {
        const Vec<T> wv = load_vec(w2 + j * W);
        Vec<T> d;
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float xh = (xc[i].get(e) - mu2) * rs2;
          const float v = (gc[i].get(e) * wv.get(e) - mean_dn - xh * mean_dn_xh) * rs2;
          if constexpr (kAccumulate) d.set(e, dc[i].get(e) + v);
          else d.set(e, v);
          if constexpr (kColsum) cs[i][e] += d.get(e);  // the value as stored (rounded to T)
        }
        store_vec(dinp + off + j * W, d);
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      gc[i] = gn[i];
      xc[i] = xn[i];
    }
    mu_c = mu_n;
    rs_c = rs_n;
  }

  // Partials: slot 0 dweight, then dbias (LayerNorm), then the dinp column sums.
  const int64_t slot = static_cast<int64_t>(gridDim.x) * C;
  float* dst = part + static_cast<int64_t>(blockIdx.x) * C;
  auto flush = [&](auto& acc, float* out) {
    if (ty == 1) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int j = lane + i * tx;
        if (j < nvec)
#pragma unroll
          for (int e = 0; e < W; e += 4)
            *reinterpret_cast<float4*>(out + j * W + e) = make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]);
      }
      return;
    }
    // Each group writes its row of [ty][C], then the block sums the rows in group order.
    __syncthreads();  // the previous flush's reads of sbuf are done
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + i * tx;
      if (j < nvec)
#pragma unroll
        for (int e = 0; e < W; e += 4)
          *reinterpret_cast<float4*>(sbuf + static_cast<int64_t>(y) * C + j * W + e) =
              make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]);
    }
    __syncthreads();
    for (int c = y * tx + lane; c < C; c += tx * ty) {
      float s = 0.0f;
      for (int g = 0; g < ty; ++g) s += sbuf[g * C + c];
      out[c] = s;
    }
  };
  flush(dw, dst);
  if constexpr (kBias) flush(db, dst + slot);
  if constexpr (kColsum) flush(cs, dst + (kBias ? 2 : 1) * slot);
}

// dst[a][c] += sum over g of part[a][g, c] for up to three (dst, part) pairs (blockIdx.y picks
// one), in the order of column_sum_add_kernel: deterministic.
struct ColumnSums {
  float* dst[3];
  const float* part[3];
};
__global__ void column_sums_add_kernel(ColumnSums s, int G, int C) {
  __shared__ float sm[32][33];
  float* __restrict__ dst = s.dst[blockIdx.y];
  const float* __restrict__ part = s.part[blockIdx.y];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float v = 0.0f;
  if (c < C)
    for (int g = threadIdx.y; g < G; g += 32) v += part[static_cast<int64_t>(g) * C + c];
  sm[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
    for (int i = 0; i < 32; ++i) t += sm[i][threadIdx.x];
    dst[c] += t;
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


// Shape of the row-group kernel: k warps per row (a power of two up to 8), the fewest that keep
// each lane at <= 3 bf16 / 4 f32 vectors (24 / 16 columns: the partials of up to three
// gradients stay in registers), then kvec vectors per lane; blocks of 4 warps (8 when k = 8),
// ty = 4 / k row groups each. Small blocks: the register file, not whole 8-warp blocks, sets
// how many rows are in flight per SM. PRIMUS_TURBO_NORM_BWD_VEC=1..4 overrides the 3 / 4 (for
// tuning runs).
struct RowShape {
  int kvec, k, ty;
  int64_t row_blocks;
  size_t smem;  // [ty][C] floats for combining the groups' partials (at most 12 KiB)
};
int max_vec_override() {
  const char* e = std::getenv("PRIMUS_TURBO_NORM_BWD_VEC");
  const int v = e ? std::atoi(e) : 0;
  return v >= 1 && v <= 4 ? v : 0;
}
template <class T>
RowShape row_shape_for(int64_t N, int64_t C) {
  const int nvec = static_cast<int>(C / Vec<T>::kSize);
  const int ov = max_vec_override();
  const int max_vec = ov ? ov : sizeof(T) == 2 ? 3 : 4;
  int k = 1;
  while (k < 8 && nvec > 32 * k * max_vec) k *= 2;
  const int kvec = ceil_div(nvec, 32 * k);  // <= 4 within norm_unsupported_reason's limit
  const int ty = std::max(1, 4 / k);
  return {kvec, k, ty, (N + ty - 1) / ty, ty > 1 ? static_cast<size_t>(ty) * C * sizeof(float) : 0};
}
// At most 32 warps per SM: enough loads in flight with the next row prefetched, and it bounds
// the partials (and their scratch) independently of the occupancy.
constexpr int kRowMaxWarpsPerSm = 32;
int rows_blocks_per_sm_cap(const RowShape& sh) { return kRowMaxWarpsPerSm / (sh.k * sh.ty); }
// Upper bound of rows_grid for any shape (blocks have at least 4 warps, one row group at least one row).
int64_t rows_grid_bound(int64_t N) {
  return std::max<int64_t>(1, std::min<int64_t>(N, static_cast<int64_t>(sm_count()) * (kRowMaxWarpsPerSm / 4)));
}
template <class Kernel>
int rows_grid(Kernel kernel, const RowShape& sh) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t>, int> cache;
  const int threads = 32 * sh.k * sh.ty;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, sh.smem);
  int per_sm = 0;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      per_sm = it->second;
    } else {
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, sh.smem));
      cache.emplace(key, per_sm);
    }
  }
  per_sm = std::min(std::max(per_sm, 1), rows_blocks_per_sm_cap(sh));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sh.row_blocks, static_cast<int64_t>(sm_count()) * per_sm)));
}

template <class T>
using RowsKernel = void (*)(T*, float*, const T*, const T*, const T*, const float*, const float*, int, int);
template <class T, bool kRms, bool kColsum, bool kAcc>
RowsKernel<T> rows_kernel_for(int kvec) {
  switch (kvec) {
    case 1: return norm_backward_rows_kernel<T, 1, kRms, kColsum, kAcc>;
    case 2: return norm_backward_rows_kernel<T, 2, kRms, kColsum, kAcc>;
    case 3: return norm_backward_rows_kernel<T, 3, kRms, kColsum, kAcc>;
    default: return norm_backward_rows_kernel<T, 4, kRms, kColsum, kAcc>;
  }
}
template <class T, bool kRms>
RowsKernel<T> rows_kernel_for(int kvec, bool colsum, bool acc) {
  if (colsum) return acc ? rows_kernel_for<T, kRms, true, true>(kvec) : rows_kernel_for<T, kRms, true, false>(kvec);
  return acc ? rows_kernel_for<T, kRms, false, true>(kvec) : rows_kernel_for<T, kRms, false, false>(kvec);
}

template <class T, bool kRms>
void launch_backward_rows(void* dinp, float* dw, float* db, float* colsum, const void* dout, const void* inp,
                          const void* w, const float* mean, const float* rstd, int64_t N, int64_t C, bool acc,
                          void* scratch, cudaStream_t s) {
  const RowShape sh = row_shape_for<T>(N, C);
  const RowsKernel<T> kernel = rows_kernel_for<T, kRms>(sh.kvec, colsum != nullptr, acc);
  const int grid = rows_grid(kernel, sh);
  float* part = static_cast<float*>(scratch);
  kernel<<<grid, dim3(32 * sh.k, sh.ty), sh.smem, s>>>(static_cast<T*>(dinp), part, static_cast<const T*>(dout),
                                                        static_cast<const T*>(inp), static_cast<const T*>(w), mean, rstd,
                                                        static_cast<int>(N), static_cast<int>(C));
  CUDA_CHECK_LAST();
  // The kernel's slots: dweight, dbias (LayerNorm, written even without a dbias), colsum.
  const int64_t slot = static_cast<int64_t>(grid) * C;
  ColumnSums sums{};
  int n = 0;
  sums.dst[n] = dw;
  sums.part[n++] = part;
  if (!kRms && db) {
    sums.dst[n] = db;
    sums.part[n++] = part + slot;
  }
  if (colsum) {
    sums.dst[n] = colsum;
    sums.part[n++] = part + (kRms ? 1 : 2) * slot;
  }
  column_sums_add_kernel<<<dim3(ceil_div(C, 32), n), dim3(32, 32), 0, s>>>(sums, grid, static_cast<int>(C));
  CUDA_CHECK_LAST();
}

// PRIMUS_TURBO_NORM_BWD_KERNEL=legacy selects norm_backward_kernel (the block-synchronised one)
// for A/B timing; read on every call. It has no dinp column sum: calls that ask for one always
// take the row-group kernel.
bool legacy_backward_requested() {
  const char* e = std::getenv("PRIMUS_TURBO_NORM_BWD_KERNEL");
  return e && std::strcmp(e, "legacy") == 0;
}

}  // namespace

const char* norm_unsupported_reason(DType dtype, int64_t C) {
  if (dtype != DType::F32 && dtype != DType::BF16) return "dtype must be f32 or bf16";
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (C <= 0 || C % w != 0) return "C must be a positive multiple of the 128-bit vector width (8 bf16 / 4 f32)";
  if (C / w > 4 * kBwdThreads) return "C too large (at most 8192 bf16 / 4096 f32 columns)";
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
  // The larger of the two kernels' partials, for either dtype (the grids depend on it through
  // the block shape): the legacy kernel's 2 [grid, C] arrays at its occupancy bound, the row
  // kernel's up to 3 (dweight, dbias, dinp column sums) at its grid bound.
  const int64_t g_legacy = std::max(max_resident_grid(shape_for<float>(N, C, true)), max_resident_grid(shape_for<bf16>(N, C, true)));
  const int64_t g_rows = rows_grid_bound(N);
  return static_cast<size_t>(std::max(2 * g_legacy, 3 * g_rows) * C) * sizeof(float);
}

void norm_backward(NormKind kind, DType dtype, void* dinp, float* dweight, float* dbias,
                   const void* dout, const void* inp, const void* weight, const float* mean,
                   const float* rstd, int64_t N, int64_t C, bool accumulate_dinp, void* scratch,
                   cudaStream_t stream, float* dinp_colsum) {
  if (const char* why = norm_unsupported_reason(dtype, C); *why)
    throw RuntimeError(fmt::format("norm_backward C={} {}: {}", C, dtype_name(dtype), why));
  if (N == 0) return;
  const bool legacy = dinp_colsum == nullptr && legacy_backward_requested();
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "norm_backward", [&] {
    if (legacy) {
      if (kind == NormKind::RMSNorm)
        launch_backward<scalar_t, true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, N, C,
                                        accumulate_dinp, scratch, stream);
      else
        launch_backward<scalar_t, false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                         accumulate_dinp, scratch, stream);
    } else if (kind == NormKind::RMSNorm) {
      launch_backward_rows<scalar_t, true>(dinp, dweight, nullptr, dinp_colsum, dout, inp, weight, nullptr, rstd,
                                           N, C, accumulate_dinp, scratch, stream);
    } else {
      launch_backward_rows<scalar_t, false>(dinp, dweight, dbias, dinp_colsum, dout, inp, weight, mean, rstd, N,
                                            C, accumulate_dinp, scratch, stream);
    }
  });
}

}  // namespace primus::turbo::cuda
