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

#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/elementwise.h"
#include "turbo/kernels/cuda/normalization.h"

namespace primus::turbo::cuda {
namespace {

// Block shape: threadIdx.x walks one row's vectors (tx threads, a multiple of 32), threadIdx.y
// picks one of ty rows handled side by side. Short rows (GPT-2's 768) get one warp per row, so
// their statistics need shuffles only, and many rows per SM keep enough loads in flight.
// The forward's blocks are small (64 threads: two GPT-2 rows, one Llama row), so an SM retires
// and refills them row by row instead of waiting for the slowest of 8 rows: +2-4% on the four
// forward rows of `primus benchmark norm` against 256, +0.3% GPT-2 training (H200).
constexpr int kFwdThreads = 64, kBwdThreads = 256;

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
                    const T* __restrict__ bias, int N, int C, int64_t ld_out, float eps) {
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
        store_vec(out + static_cast<int64_t>(row) * ld_out + j * W, o);
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
// gradient: [kAcc][grid][C], reduced in block order by add_column_partials (elementwise.h). No atomics.
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

// ---- the staged backward (default where a row fits one warp at <= 3 vectors per lane) -------
// GPT-2's rows (768 bf16) under the row-group kernel hold the current row, the prefetched next
// row, the current dinp and 72 partial sums in registers: 168-232 registers per thread, 8-12
// warps per SM, about one row per warp in flight, and the dinp read exposed once per row. Here
// the rows wait in shared memory instead: each warp owns `stages` row buffers (dout, inp and,
// when accumulating, dinp; 4.5 KiB per row for C = 768 bf16) that its lanes fill with cp.async
// (each lane copies and later reads only its own 16-byte vectors j = lane + 32 i, so the only
// cross-lane data are the row's mean / rstd, copied by lane 0 and published by __syncwarp).
// While a row is computed, the next stages - 1 rows of the warp are in flight; the registers
// hold the partial sums (72 floats), one vector at a time of the row and nothing else, so 16
// warps (one 512-thread block) fit on an SM at <= 128 registers, with 2 x 16 rows of 4.5 KiB
// in flight per SM. The weight sits in shared memory (read by all warps). Partials: the 16
// warps are combined through shared memory in warp order, one [C] row per block and gradient
// ([slot][grid][C], grid = one block per SM: 132 rows instead of the row-group kernel's 264-396),
// then add_column_partials as for the row-group kernel. Deterministic: rows go to warps by a
// fixed stride, every sum has a fixed order. PRIMUS_TURBO_NORM_BWD_STAGES=2..4 overrides the
// 3 stages (for tuning runs).
constexpr int kStagedWarps = 16;
constexpr int kStagedMaxVec = 3;

__device__ __forceinline__ uint32_t nb_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void nb_cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void nb_cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void nb_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void nb_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Shared-memory reads as volatile asm: the compiler may neither merge the two passes' reads of
// a row (which would keep the first pass's values alive across the reductions) nor move them.
template <class T>
__device__ __forceinline__ Vec<T> nb_lds_vec(uint32_t a) {
  int4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  Vec<T> r;
  *reinterpret_cast<int4*>(&r) = v;
  return r;
}
__device__ __forceinline__ float2 nb_lds_f2(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
  return v;
}

// Shared memory of the staged kernel: weight [kvec * 512 B] | statistics [warps][stages] float2
// (rounded up to 16 B) | rows [warps][stages][tensors][kvec * 512 B]. The row area is reused at
// the end for the partials ([warps][C] floats, always smaller).
__host__ __device__ constexpr int staged_row_bytes(int kvec) { return kvec * 32 * 16; }
__host__ __device__ constexpr int staged_stats_bytes(int warps, int stages) { return (warps * stages * 8 + 15) / 16 * 16; }
constexpr size_t staged_smem_bytes(int kvec, int warps, int stages, int tensors) {
  return static_cast<size_t>(staged_row_bytes(kvec)) + staged_stats_bytes(warps, stages) +
         static_cast<size_t>(warps) * stages * tensors * staged_row_bytes(kvec);
}

template <class T, int kVec, bool kRms, bool kColsum, bool kAccumulate>
__global__ void __launch_bounds__(kStagedWarps * 32, 1)
norm_backward_staged_kernel(T* __restrict__ dinp, float* __restrict__ part, const T* __restrict__ dout,
                            const T* __restrict__ inp, const T* __restrict__ weight,
                            const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C,
                            int stages) {
  constexpr int W = Vec<T>::kSize;
  constexpr bool kBias = !kRms;
  constexpr int kTensors = kAccumulate ? 3 : 2;  // dout, inp (, dinp)
  constexpr int kRow = staged_row_bytes(kVec);
  extern __shared__ float4 staged_smem4[];
  char* smem = reinterpret_cast<char*>(staged_smem4);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const int nvec = C / W;
  const float inv_c = 1.0f / static_cast<float>(C);
  const uint32_t s_w = nb_smem_addr(smem);
  const uint32_t s_stats = s_w + kRow + warp * stages * 8;
  const int rows_off = kRow + staged_stats_bytes(nwarps, stages);
  const uint32_t s_rows = s_w + rows_off + warp * stages * kTensors * kRow;

  float dw[kVec][W], db[kBias ? kVec : 1][W], cs[kColsum ? kVec : 1][W];
#pragma unroll
  for (int i = 0; i < kVec; ++i)
#pragma unroll
    for (int e = 0; e < W; ++e) {
      dw[i][e] = 0.0f;
      if constexpr (kBias) db[i][e] = 0.0f;
      if constexpr (kColsum) cs[i][e] = 0.0f;
    }

  const int stride = gridDim.x * nwarps;
  // Row r into stage st (nothing when r >= N); always one commit group, so that the group count
  // per iteration is fixed and wait_group(stages - 1) means "this iteration's row has landed".
  auto issue = [&](int r, int st) {
    if (r < N) {
      const int64_t off = static_cast<int64_t>(r) * C;
      const uint32_t b = s_rows + st * kTensors * kRow;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int j = lane + 32 * i;
        if (j < nvec) {
          nb_cp_async16(b + j * 16, dout + off + j * W);
          nb_cp_async16(b + kRow + j * 16, inp + off + j * W);
          if constexpr (kAccumulate) nb_cp_async16(b + 2 * kRow + j * 16, dinp + off + j * W);
        }
      }
      if (lane == 0) {
        if constexpr (!kRms) nb_cp_async4(s_stats + st * 8, mean + r);
        nb_cp_async4(s_stats + st * 8 + 4, rstd + r);
      }
    }
    nb_cp_commit();
  };
  int row = blockIdx.x * nwarps + warp;
  for (int p = 0; p < stages - 1; ++p) issue(row + p * stride, p);
  // The weight after the first rows are on their way (its store waits for its load).
  for (int j = threadIdx.x; j < nvec; j += blockDim.x)
    *reinterpret_cast<int4*>(smem + j * 16) = *reinterpret_cast<const int4*>(weight + j * W);
  __syncthreads();  // the weight is in shared memory

  int st = 0;  // the stage of `row`
  for (; row < N; row += stride) {
    __syncwarp();  // every lane is done with the previous row's stage (its statistics slot)
    issue(row + (stages - 1) * stride, st == 0 ? stages - 1 : st - 1);
    if (stages == 2) nb_cp_wait<1>();
    else if (stages == 3) nb_cp_wait<2>();
    else nb_cp_wait<3>();
    __syncwarp();  // lane 0's copy of the statistics is visible to the warp

    const uint32_t b = s_rows + st * kTensors * kRow;
    const float2 stat = nb_lds_f2(s_stats + st * 8);
    const float mu = kRms ? 0.0f : stat.x, rs = stat.y;
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + 32 * i;
      if (j < nvec) {
        const Vec<T> g = nb_lds_vec<T>(b + j * 16), x = nb_lds_vec<T>(b + kRow + j * 16),
                     wv = nb_lds_vec<T>(s_w + j * 16);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float gf = g.get(e), xh = (x.get(e) - mu) * rs, dn = gf * wv.get(e);
          if constexpr (!kRms) s1 += dn;
          s2 += dn * xh;
          dw[i][e] += gf * xh;
          if constexpr (kBias) db[i][e] += gf;
        }
      }
    }
    if constexpr (!kRms) s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    const float mean_dn = kRms ? 0.0f : s1 * inv_c, mean_dn_xh = s2 * inv_c;
    // The second pass's reads depend on the reductions: none of them is hoisted above the shuffles.
    uint32_t b2 = b, w2 = s_w;
    asm volatile("" : "+r"(b2), "+r"(w2) : "f"(mean_dn), "f"(mean_dn_xh));
    const int64_t off = static_cast<int64_t>(row) * C;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + 32 * i;
      if (j < nvec) {
        const Vec<T> g = nb_lds_vec<T>(b2 + j * 16), x = nb_lds_vec<T>(b2 + kRow + j * 16),
                     wv = nb_lds_vec<T>(w2 + j * 16);
        Vec<T> d;
        if constexpr (kAccumulate) d = nb_lds_vec<T>(b2 + 2 * kRow + j * 16);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float xh = (x.get(e) - mu) * rs;
          const float v = (g.get(e) * wv.get(e) - mean_dn - xh * mean_dn_xh) * rs;
          if constexpr (kAccumulate) d.set(e, d.get(e) + v);
          else d.set(e, v);
          if constexpr (kColsum) cs[i][e] += d.get(e);  // the value as stored (rounded to T)
        }
        store_vec(dinp + off + j * W, d);
      }
    }
    st = st + 1 == stages ? 0 : st + 1;
  }
  nb_cp_wait<0>();  // only empty groups can be left; none may be pending at exit
  __syncthreads();  // every warp is done with its rows: the row area takes the partials

  // Partials: slot 0 dweight, then dbias (LayerNorm), then the dinp column sums; the block's warps
  // are added in warp order.
  float* sbuf = reinterpret_cast<float*>(smem + rows_off);
  const int64_t slot = static_cast<int64_t>(gridDim.x) * C;
  float* dst = part + static_cast<int64_t>(blockIdx.x) * C;
  auto flush = [&](auto& acc, float* out) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int j = lane + 32 * i;
      if (j < nvec)
#pragma unroll
        for (int e = 0; e < W; e += 4)
          *reinterpret_cast<float4*>(sbuf + static_cast<int64_t>(warp) * C + j * W + e) =
              make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float s = 0.0f;
      for (int w = 0; w < nwarps; ++w) s += sbuf[w * C + c];
      out[c] = s;
    }
    __syncthreads();  // before the next flush rewrites sbuf
  };
  flush(dw, dst);
  if constexpr (kBias) flush(db, dst + slot);
  if constexpr (kColsum) flush(cs, dst + (kBias ? 2 : 1) * slot);
}

// The forward's block size (threads; rows per block = this / threads per row).
// PRIMUS_TURBO_NORM_FWD_THREADS overrides the 64 for A/B runs.
int fwd_threads() { return static_cast<int>(env_int("PRIMUS_TURBO_NORM_FWD_THREADS", 32, 1024, kFwdThreads)); }

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
  const int block = backward ? kBwdThreads : fwd_threads();
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
                    const void* res, const void* w, const void* b, int64_t N, int64_t C, int64_t ld_out,
                    float eps, cudaStream_t s) {
  const Shape sh = shape_for<T>(N, C, false);
  auto go = [&](auto kernel) {
    // The forward writes no partials: one block per row group, as many as there are.
    kernel<<<static_cast<unsigned>(sh.row_blocks), dim3(sh.tx, sh.ty), 0, s>>>(static_cast<T*>(out), mean, rstd, static_cast<T*>(res_out),
                                                  static_cast<const T*>(inp), static_cast<const T*>(res),
                                                  static_cast<const T*>(w), static_cast<const T*>(b),
                                                  static_cast<int>(N), static_cast<int>(C), ld_out, eps);
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
  const ColumnPartials sums[2] = {{dw, pw}, {db, pb}};
  add_column_partials(sums, db ? 2 : 1, grid, C, s);
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
  return static_cast<int>(env_int("PRIMUS_TURBO_NORM_BWD_VEC", 0, 4, 0));  // 0: automatic
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

// dst += the column sums of the partial slots a backward kernel wrote for a grid of `grid` rows:
// dweight, dbias (LayerNorm: the slot is written even without a dbias), the dinp column sums.
void finish_column_sums(bool rms, float* dw, float* db, float* colsum, const float* part, int grid, int64_t C,
                        cudaStream_t s) {
  const int64_t slot = static_cast<int64_t>(grid) * C;
  ColumnPartials sums[3];
  int n = 0;
  sums[n++] = {dw, part};
  if (!rms && db) sums[n++] = {db, part + slot};
  if (colsum) sums[n++] = {colsum, part + (rms ? 1 : 2) * slot};
  add_column_partials(sums, n, grid, C, s);
}

int staged_stages() {
  return static_cast<int>(env_int("PRIMUS_TURBO_NORM_BWD_STAGES", 2, 4, 3));
}

template <class T>
using StagedKernel = void (*)(T*, float*, const T*, const T*, const T*, const float*, const float*, int, int, int);
template <class T, bool kRms, bool kColsum, bool kAcc>
StagedKernel<T> staged_kernel_for(int kvec) {
  switch (kvec) {
    case 1: return norm_backward_staged_kernel<T, 1, kRms, kColsum, kAcc>;
    case 2: return norm_backward_staged_kernel<T, 2, kRms, kColsum, kAcc>;
    default: return norm_backward_staged_kernel<T, 3, kRms, kColsum, kAcc>;
  }
}

// The staged kernel when the row fits one warp at <= kStagedMaxVec vectors per lane (C <= 768
// bf16 / 384 f32) and the device takes its block; false (nothing launched) otherwise.
template <class T, bool kRms>
bool launch_backward_staged(void* dinp, float* dw, float* db, float* colsum, const void* dout, const void* inp,
                            const void* w, const float* mean, const float* rstd, int64_t N, int64_t C, bool acc,
                            void* scratch, cudaStream_t s) {
  const int nvec = static_cast<int>(C / Vec<T>::kSize);
  const int kvec = ceil_div(nvec, 32);
  if (kvec > kStagedMaxVec) return false;
  const int stages = staged_stages(), tensors = acc ? 3 : 2;
  StagedKernel<T> kernel;
  if (colsum) kernel = acc ? staged_kernel_for<T, kRms, true, true>(kvec) : staged_kernel_for<T, kRms, true, false>(kvec);
  else kernel = acc ? staged_kernel_for<T, kRms, false, true>(kvec) : staged_kernel_for<T, kRms, false, false>(kvec);

  // Fewer warps per block where the stages of 16 would not fit (4 stages of 3 tensors at kvec 3).
  static std::mutex mu;
  // (device, kernel, warps, smem) -> blocks per SM; the attribute is set per device.
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  static std::map<int, int> optin;  // device -> shared memory per block
  int warps = kStagedWarps, per_sm = 0, dev = 0;
  size_t smem = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  {
    std::lock_guard lock(mu);
    int& smem_optin = optin[dev];
    if (smem_optin == 0) CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    while (warps > 4 && staged_smem_bytes(kvec, warps, stages, tensors) > static_cast<size_t>(smem_optin)) warps -= 4;
    smem = staged_smem_bytes(kvec, warps, stages, tensors);
    if (smem > static_cast<size_t>(smem_optin)) return false;
    const auto key = std::make_tuple(dev, reinterpret_cast<const void*>(kernel), warps, smem);
    auto it = cache.find(key);
    if (it != cache.end()) {
      per_sm = it->second;
    } else {
      // The device's limit, not this call's size: the stage count (hence the size) may change
      // between calls, and a smaller attribute set later would fail a larger cached launch.
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * warps, smem));
      cache.emplace(key, per_sm);
    }
  }
  if (per_sm < 1) return false;
  // One block per SM in the intended configuration; never more than 2 (bounds the partials,
  // within norm_backward_scratch_bytes' rows_grid_bound).
  per_sm = std::min(per_sm, 2);
  const int grid = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((N + warps - 1) / warps, static_cast<int64_t>(sm_count()) * per_sm)));
  float* part = static_cast<float*>(scratch);
  kernel<<<grid, 32 * warps, smem, s>>>(static_cast<T*>(dinp), part, static_cast<const T*>(dout),
                                        static_cast<const T*>(inp), static_cast<const T*>(w), mean, rstd,
                                        static_cast<int>(N), static_cast<int>(C), stages);
  CUDA_CHECK_LAST();
  finish_column_sums(kRms, dw, db, colsum, part, grid, C, s);
  return true;
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
  finish_column_sums(kRms, dw, db, colsum, part, grid, C, s);
}

// PRIMUS_TURBO_NORM_BWD_KERNEL selects the kernel for A/B timing (read on every call):
// staged (default; where it does not apply, the row-group kernel), rowgroup, legacy
// (norm_backward_kernel, the block-synchronised one; it has no dinp column sum: calls that ask
// for one take the default).
enum class BwdKernel { Staged, RowGroup, Legacy };
BwdKernel backward_kernel_requested() {
  const std::string k = env_choice("PRIMUS_TURBO_NORM_BWD_KERNEL", {"staged", "rowgroup", "legacy"}, "staged");
  if (k == "legacy") return BwdKernel::Legacy;
  if (k == "rowgroup") return BwdKernel::RowGroup;
  return BwdKernel::Staged;
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
                  int64_t N, int64_t C, float eps, cudaStream_t stream, int64_t ld_out) {
  if (const char* why = norm_unsupported_reason(dtype, C); *why)
    throw RuntimeError(fmt::format("norm_forward C={} {}: {}", C, dtype_name(dtype), why));
  if (ld_out == 0) ld_out = C;
  if (ld_out < C || ld_out % (16 / static_cast<int64_t>(dtype_size(dtype))) != 0)
    throw RuntimeError(fmt::format("norm_forward: output row stride {} must be >= C={} and a multiple of the 16-byte vector", ld_out, C));
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "norm_forward", [&] {
    if (kind == NormKind::RMSNorm)
      launch_forward<scalar_t, true>(out, mean, rstd, residual_out, inp, residual, weight, nullptr, N, C, ld_out, eps, stream);
    else
      launch_forward<scalar_t, false>(out, mean, rstd, residual_out, inp, residual, weight, bias, N, C, ld_out, eps, stream);
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
  BwdKernel which = backward_kernel_requested();
  if (which == BwdKernel::Legacy && dinp_colsum) which = BwdKernel::Staged;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "norm_backward", [&] {
    if (which == BwdKernel::Staged) {
      const bool done =
          kind == NormKind::RMSNorm
              ? launch_backward_staged<scalar_t, true>(dinp, dweight, nullptr, dinp_colsum, dout, inp, weight, nullptr,
                                                       rstd, N, C, accumulate_dinp, scratch, stream)
              : launch_backward_staged<scalar_t, false>(dinp, dweight, dbias, dinp_colsum, dout, inp, weight, mean,
                                                        rstd, N, C, accumulate_dinp, scratch, stream);
      if (done) return;
    }
    if (which == BwdKernel::Legacy) {
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
