// Softmax cross-entropy over the vocabulary, forward and backward fused.
//
// What it fuses and why: the LM head's logits are the largest activation of a step (N x V:
// 16384 x 50304 bf16 is 1.6 GB). Unfused (softmax to fp32 probabilities, loss, gradient) they
// would be written and read several times, in fp32.
//
// Two kernels. The on-chip one (sm_90, bf16, rows up to 8 x ~113 KB) holds the row in shared
// memory (one CTA, or a cluster of CTAs for a row larger than an SM's share), so HBM sees one
// read and one write of the logits. The legacy one (anything else, or PRIMUS_TURBO_CE_KERNEL=legacy)
// gives a row to one block: pass 1 reads it keeping an online max and sum of exponentials per
// thread; pass 2 reads it again and writes the gradient in place; the grid is sized so that the
// rows in flight would fit L2, but measured on an H100 (GPT-2, 16384 x 50304) it costs what two
// reads and a write from HBM cost.
#include <cooperative_groups.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "turbo/core/env_switch.h"
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
                     const int32_t* targets, int N, int V, int Vp, float dloss_in, const float* kept,
                     int ignore_index) {
  constexpr int W = Vec<T>::kSize;
  const float dloss = kept ? dloss_in / fmaxf(*kept, 1.0f) : dloss_in;
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

// ---- On-chip kernel (sm_90, bf16): one HBM read and one write per row -----------------------
// The row is copied once into shared memory (cp.async, 16-byte vectors, all in flight at once in
// four commit groups); each thread folds its vectors into a running max and sum of exponentials
// as their group lands, and the gradient is computed from shared memory once the row's log-sum-exp
// is known (before: a max pass and a sum pass after the whole row had arrived). A row that does
// not fit one SM is split over a thread-block cluster of C CTAs (C = 1, 2, 4 or 8): CTA r holds
// vectors [r*S, (r+1)*S) of the row (S = ceil(Vp/8 / C)), and the CTAs exchange their partial
// max and sum through distributed shared memory. Every CTA combines the C partials in rank order
// (one warp, a fixed butterfly), so all of them, and every run, get bitwise the same lse.
// C is the smallest for which two CTAs fit an SM (one loads while the other computes and writes):
// GPT-2's 50304 columns: C = 1 (100.6 KB per CTA); Llama-3's 128256: C = 4 (64.1 KB, 3 per SM).
constexpr int kOnChipMaxThreads = 512;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The C partials `stat[k]` of the cluster, combined in rank order (lane r reads rank r): every
// thread of every CTA of the cluster gets the same value.
template <int kCluster, bool kMax>
__device__ __forceinline__ float cluster_combine(float* stat) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x % 32;
  float v = kMax ? -INFINITY : 0.0f;
  if (lane < kCluster) v = *cluster.map_shared_rank(stat, lane);
  return kMax ? warp_max(v) : warp_sum(v);
}

// Folds one vector's values (padding already -inf) into the thread's running max m and sum s of
// exponentials (base 2: s = sum of 2^((x - m) log2 e)).
__device__ __forceinline__ void fold_vals(const float (&x)[Vec<bf16>::kSize], float& m, float& s) {
  constexpr int W = Vec<bf16>::kSize;
  float vmax = x[0];
#pragma unroll
  for (int e = 1; e < W; ++e) vmax = fmaxf(vmax, x[e]);
  if (vmax == -INFINITY) return;  // padding only, or a -inf run
  const float nm = fmaxf(m, vmax);
  const float nm2 = -nm * kLog2e;
  float add = 0.0f;
#pragma unroll
  for (int e = 0; e < W; ++e) add += ex2(fmaf(x[e], kLog2e, nm2));  // padding: ex2(-inf) = 0
  s = s * ex2((m - nm) * kLog2e) + add;  // m = -inf: s is 0 and ex2(-inf) is 0
  m = nm;
}
// Folds 16-byte vector j of this CTA's slice (local columns >= cols are padding). By value: one
// 16-byte shared-memory load (a reference made it one load per element, 30% slower).
__device__ __forceinline__ void fold_vec(const Vec<bf16> v, int j, int cols, float& m, float& s) {
  constexpr int W = Vec<bf16>::kSize;
  // The padding check per vector, not per element (only the last vector of a slice can hold
  // padding; the one-row kernel is near instruction-issue bound under ncu). The two
  // paths each call the fold, so the compiler keeps the branch instead of selecting every element
  // against the bound (it did with one path and a `whole ||` condition per element). Fewer
  // instructions beyond this (four variants measured) cost the streamed kernel 1-2% (H200).
  float x[W];
  if ((j + 1) * W <= cols) {
#pragma unroll
    for (int e = 0; e < W; ++e) x[e] = v.get(e);
    fold_vals(x, m, s);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) x[e] = j * W + e < cols ? v.get(e) : -INFINITY;
    fold_vals(x, m, s);
  }
}

// One row's slice of a CTA after the fold: the block's (then the cluster's) max and sum, the
// row's loss and lse, and the gradient of the slice from the vectors in `buf` (thread t's are
// t, t + blockDim, ...; the ones it copied). With a cluster this ends with the cluster barrier's
// arrive (every partial read); the caller waits on it before the CTA's `stat` is written again
// or the CTA exits (a CTA's shared memory must outlive the other CTAs' reads of it).
template <int kCluster>
__device__ __forceinline__ void finish_row(const Vec<bf16>* buf, float m, float s, float* red, float* stat,
                                           bf16* dlogits, float* losses, float* lse_out, int64_t row, int rank,
                                           int v0, int cnt, int cols, int V, int Vp, int target, float dloss,
                                           int ignore_index) {
  namespace cg = cooperative_groups;
  constexpr int W = Vec<bf16>::kSize;
  // The block reductions' barriers also make every thread's copies visible to the whole block.
  const float bmax = block_max(m, red);
  s = block_sum(m == -INFINITY ? 0.0f : s * ex2((m - bmax) * kLog2e), red);
  m = bmax;
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0) stat[0] = m;
    cg::this_cluster().sync();  // also: every CTA of the cluster is running (DSMEM is valid)
    const float cmax = cluster_combine<kCluster, true>(&stat[0]);
    if (threadIdx.x == 0) stat[1] = m == -INFINITY ? 0.0f : s * ex2((m - cmax) * kLog2e);
    m = cmax;
    cg::this_cluster().sync();
    s = cluster_combine<kCluster, false>(&stat[1]);
    cg::this_cluster().barrier_arrive();  // the partials have been read
  }
  const float lse = m + __logf(s);

  const bool ignored = target == ignore_index;
  const bool bad = !ignored && (target < 0 || target >= V);
  const int tl = !ignored && !bad ? target - v0 * W : -1;  // the target's local column (none: -1)
  if (threadIdx.x == 0) {
    // The loss needs logits[target]: the CTA holding it writes it (rank 0 when there is none).
    const bool here = !ignored && !bad ? tl >= 0 && tl < cnt * W : rank == 0;
    if (here && losses) {
      float loss = 0.0f;
      if (bad) loss = __int_as_float(0x7fc00000);
      else if (!ignored) loss = lse - __bfloat162float(reinterpret_cast<const bf16*>(buf)[tl]);
      losses[row] = loss;
    }
    if (rank == 0 && lse_out) lse_out[row] = lse;
  }
  if (dlogits) {
    // Gradient over the slice (in place is safe: every read of the row from global memory is done).
    bf16* g = dlogits + row * Vp + static_cast<int64_t>(v0) * W;
    const float scale = ignored ? 0.0f : dloss;
    const float nl2 = -lse * kLog2e;
    // The fast path's scale goes into the exponent: scale * 2^a = 2^(a + log2 scale) (scale 0: 2^-inf = 0).
    const bool fold_scale = scale >= 0.0f;
    const float nl2s = fold_scale ? nl2 + __log2f(scale) : nl2;
#pragma unroll 4
    for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
      const Vec<bf16> v = buf[j];
      Vec<bf16> out;
      if (fold_scale && (j + 1) * W <= cols && static_cast<unsigned>(tl - j * W) >= static_cast<unsigned>(W)) {
        // Neither padding nor the target in this vector (all but a handful of a row's vectors).
#pragma unroll
        for (int e = 0; e < W; ++e) out.set(e, ex2(fmaf(v.get(e), kLog2e, nl2s)));
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const int col = j * W + e;
          const float p = ex2(fmaf(v.get(e), kLog2e, nl2));
          out.set(e, col < cols ? scale * (p - (col == tl ? 1.0f : 0.0f)) : 0.0f);
        }
      }
      store_vec_cs(g + static_cast<int64_t>(j) * W, out);
    }
  }
}

// Grid: N * kCluster CTAs (cluster c = row c). Dynamic shared memory: slice * 16 bytes.
template <int kCluster>
__global__ void __launch_bounds__(kOnChipMaxThreads, 1)
cross_entropy_onchip_kernel(bf16* dlogits, float* losses, float* lse_out, const bf16* logits,
                            const int32_t* targets, int V, int Vp, int slice, float dloss_in, const float* kept,
                            int ignore_index) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  const float dloss = kept ? dloss_in / fmaxf(*kept, 1.0f) : dloss_in;
  constexpr int W = Vec<bf16>::kSize;
  extern __shared__ __align__(16) unsigned char row_smem[];
  __shared__ float red[32];
  __shared__ float stat[2];  // this CTA's partial max and sum, read by the whole cluster
  const Vec<bf16>* buf = reinterpret_cast<const Vec<bf16>*>(row_smem);
  const int rank = kCluster > 1 ? static_cast<int>(blockIdx.x % kCluster) : 0;
  const int64_t row = blockIdx.x / kCluster;
  const int v0 = rank * slice;                             // first vector of the row held here
  const int cnt = max(0, min(slice, Vp / W - v0));         // vectors held here
  const int cols = V - v0 * W;                             // local columns < cols are classes
  const bf16* x = logits + row * Vp + static_cast<int64_t>(v0) * W;
  // The copies go out in kGroups commit groups (thread t's vectors t, t + blockDim, ... in order,
  // a quarter of them per group), and each thread folds its own vectors into a running max and
  // sum of exponentials as each group lands, so the arithmetic overlaps the rest of the row's
  // arrival; a thread reads only the vectors it copied, so no barrier is needed until the
  // block's reduction.
  constexpr int kGroups = 4;
  const int bd = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  const int per = (cnt + bd - 1) / bd;           // vectors per thread (the first threads')
  const int q = (per + kGroups - 1) / kGroups;   // per group
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    for (int k = g * q; k < min(per, (g + 1) * q); ++k) {
      const int j = tid + k * bd;
      if (j < cnt) cp_async16(row_smem + static_cast<size_t>(j) * 16, x + static_cast<int64_t>(j) * W);
    }
    cp_async_commit();
  }
  const int target = targets[row];  // in flight with the copies
  float m = -INFINITY, s = 0.0f;
  auto fold = [&](int g) {
    for (int k = g * q; k < min(per, (g + 1) * q); ++k) {
      const int j = tid + k * bd;
      if (j >= cnt) break;
      fold_vec(buf[j], j, cols, m, s);
    }
  };
  cp_async_wait_group<kGroups - 1>();
  fold(0);
  cp_async_wait_group<kGroups - 2>();
  fold(1);
  cp_async_wait_group<kGroups - 3>();
  fold(2);
  cp_async_wait_group<0>();
  fold(3);
  static_assert(kGroups == 4, "the waits above are written out for 4 groups");
  finish_row<kCluster>(buf, m, s, red, stat, dlogits, losses, lse_out, row, rank, v0, cnt, cols, V, Vp, target, dloss,
                       ignore_index);
  if constexpr (kCluster > 1) cooperative_groups::this_cluster().barrier_wait();
#endif
}

// ---- Streamed on-chip kernel (clusters: rows too long for one CTA) -------------------------
// Persistent clusters: cluster c takes rows c, c + clusters, ... and each CTA keeps two slice
// buffers, so the copies of a cluster's next row go out before the current row's statistics,
// cluster exchange and gradient, and HBM reads go on while the CTA computes and writes. (The
// one-row-per-cluster kernel above relies on other resident CTAs for that overlap.) Alone it is
// slower than that kernel on Llama-3's rows; in a power-capped training step it is faster (see
// stream_config). With the same cluster size the two give the same bits (same slices, same order
// of additions); the default sizes differ.
// Grid: clusters * kCluster CTAs. Dynamic shared memory: 2 * slice * 16 bytes.
template <int kCluster>
__global__ void __launch_bounds__(kOnChipMaxThreads, 1)
cross_entropy_stream_kernel(bf16* dlogits, float* losses, float* lse_out, const bf16* logits,
                            const int32_t* targets, int N, int V, int Vp, int slice, float dloss_in,
                            const float* kept, int ignore_index) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  const float dloss = kept ? dloss_in / fmaxf(*kept, 1.0f) : dloss_in;
  constexpr int W = Vec<bf16>::kSize;
  extern __shared__ __align__(16) unsigned char row_smem[];
  __shared__ float red[32];
  __shared__ float stat[2];
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const int clusters = static_cast<int>(gridDim.x / kCluster);
  const int v0 = rank * slice;
  const int cnt = max(0, min(slice, Vp / W - v0));
  const int cols = V - v0 * W;
  const int bd = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  const size_t half = static_cast<size_t>(slice) * 16;
  // Thread t copies (and later reads) only its own vectors t, t + blockDim, ...: a buffer can be
  // refilled without a barrier once the thread's own reads of it are done.
  auto issue = [&](int row, int b) {
    const bf16* x = logits + static_cast<int64_t>(row) * Vp + static_cast<int64_t>(v0) * W;
    unsigned char* dst = row_smem + b * half;
    for (int j = tid; j < cnt; j += bd) cp_async16(dst + static_cast<size_t>(j) * 16, x + static_cast<int64_t>(j) * W);
    cp_async_commit();
  };
  int row = static_cast<int>(blockIdx.x / kCluster);
  if (row < N) issue(row, 0);
  for (int b = 0, first = 1; row < N; row += clusters, b ^= 1, first = 0) {
    const int next = row + clusters;
    const int target = targets[row];
    // The refill below goes to the buffer of the row before; thread 0 read another thread's
    // vector of it (the target's logit) for that row's loss.
    if (!first) __syncthreads();
    if (next < N) {
      issue(next, b ^ 1);
      cp_async_wait_group<1>();  // this row's group has landed; the next one's is in flight
    } else {
      cp_async_wait_group<0>();
    }
    const Vec<bf16>* buf = reinterpret_cast<const Vec<bf16>*>(row_smem + b * half);
    float m = -INFINITY, s = 0.0f;
    for (int j = tid; j < cnt; j += bd) fold_vec(buf[j], j, cols, m, s);
    // The previous row's partials have been read by every CTA before `stat` is written again.
    if (!first) cooperative_groups::this_cluster().barrier_wait();
    finish_row<kCluster>(buf, m, s, red, stat, dlogits, losses, lse_out, row, rank, v0, cnt, cols, V, Vp, target,
                         dloss, ignore_index);
  }
  if (static_cast<int>(blockIdx.x / kCluster) < N) cooperative_groups::this_cluster().barrier_wait();
#endif
}

__global__ void sum_kernel(float* out, const float* x, int64_t n, const float* kept, float numerator) {
  __shared__ float smem[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) *out = kept ? s * (numerator / fmaxf(*kept, 1.0f)) : s;
}

__global__ void count_kept_kernel(float* out, const int32_t* targets, int64_t n, int ignore_index) {
  __shared__ float smem[32];
  float c = 0.0f;  // exact: a block's partial counts stay far below 2^24
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) c += targets[i] != ignore_index ? 1.0f : 0.0f;
  c = block_sum(c, smem);
  if (threadIdx.x == 0) *out = c;
}

// ---- on-chip kernel: configuration and launch ----------------------------------------------
struct OnChipConfig {
  int cluster = 0;  // 0: the on-chip kernel does not serve this row
  int slice = 0;    // 16-byte vectors of the row per CTA
  int threads = 0;
  size_t smem = 0;  // dynamic shared memory per CTA
};

struct DeviceLimits {
  int cc = 0, per_sm = 0, per_block_optin = 0, reserved = 0;
};
const DeviceLimits& device_limits() {
  static std::mutex mu;
  static std::map<int, DeviceLimits> cache;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  DeviceLimits d;
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  d.cc = major * 10 + minor;
  CUDA_CHECK(cudaDeviceGetAttribute(&d.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  return cache.emplace(dev, d).first->second;
}

// Static shared memory of the on-chip kernel (red[32] + stat[2]), with slack for alignment.
constexpr size_t kOnChipStatic = 256;

// min_cluster: the smallest cluster tried (1; env PRIMUS_TURBO_CE_CLUSTER=2|4|8 raises it, to
// measure smaller slices with more CTAs per SM against the default).
OnChipConfig onchip_config(int64_t Vp, const DeviceLimits& d, int min_cluster = 1) {
  OnChipConfig c;
  if (d.cc < 90) return c;  // clusters, and the code is built for sm_90a
  const int64_t nvec = Vp / 8;
  // Two CTAs per SM if possible (one loads while the other computes), else one.
  const int64_t two = static_cast<int64_t>(d.per_sm) / 2 - d.reserved - static_cast<int64_t>(kOnChipStatic);
  const int64_t one = std::min<int64_t>(d.per_block_optin, d.per_sm - d.reserved) - static_cast<int64_t>(kOnChipStatic);
  for (int64_t budget : {two, one}) {
    for (int cl : {1, 2, 4, 8}) {
      if (cl < min_cluster) continue;
      const int64_t slice = (nvec + cl - 1) / cl;
      if (slice * 16 > budget) continue;
      c.cluster = cl;
      c.slice = static_cast<int>(slice);
      c.smem = static_cast<size_t>(slice) * 16;
      // ~4 vectors per thread or more, 128..512 threads.
      c.threads = static_cast<int>(std::clamp<int64_t>((slice / 4 + 31) / 32 * 32, 128, kOnChipMaxThreads));
      return c;
    }
  }
  return c;
}

template <int kCluster>
bool launch_onchip(const OnChipConfig& c, const DeviceLimits& d, bf16* dlogits, float* losses, float* lse, const bf16* logits,
                   const int32_t* targets, int64_t N, int V, int Vp, float dloss, const float* kept, int ignore_index,
                   cudaStream_t stream) {
  auto* kernel = cross_entropy_onchip_kernel<kCluster>;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  // Per device and configuration, once: the shared-memory opt-in and whether it can run at all
  // (cudaOccupancyMaxActiveClusters is 0 when a cluster of CTAs this large cannot be resident).
  static std::mutex mu;
  static std::map<std::tuple<int, size_t, int>, bool> ok;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(static_cast<unsigned>(N * kCluster));
  cfg.blockDim = dim3(static_cast<unsigned>(c.threads));
  cfg.dynamicSmemBytes = c.smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = kCluster > 1 ? 1 : 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(dev, c.smem, c.threads);
    auto it = ok.find(key);
    if (it == ok.end()) {
      // The opt-in is the most any configuration uses (the attribute is a cap; occupancy follows
      // the launch's own size), so configurations of one kernel never undo each other's.
      bool good = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       d.per_block_optin - static_cast<int>(kOnChipStatic)) == cudaSuccess;
      int active = 0;
      if (good && kCluster > 1)
        good = cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) == cudaSuccess && active > 0;
      else if (good)
        good = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&active, kernel, c.threads, c.smem) == cudaSuccess &&
               active > 0;
      (void)cudaGetLastError();  // a refusal above is an answer, not an error to report later
      it = ok.emplace(key, good).first;
    }
    if (!it->second) return false;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, dlogits, losses, lse, logits, targets, V, Vp, c.slice, dloss, kept,
                                ignore_index));
  return true;
}

// The streamed kernel's configuration for rows that need a cluster: the smallest cluster whose
// two slice buffers let three CTAs share an SM, else the smallest whose buffers fit one CTA.
// Llama-3's 128256 columns: clusters of 8 CTAs of 2 x 32 KB. Measured on an H200 training
// Llama-3.2-1B (B8 x T2048, 3 rounds in one call): 69,587-69,742 tok/s, against
// 68,736-68,818 with clusters of 4 (one 2 x 64 KB CTA per SM) and 68,473-68,603 for one cluster
// of 4 per row (the kernel above); run alone, the op itself is faster as one cluster per row
// (2.69 vs 3.51 ms for 16384 rows): the step's clocks under its power cap are what moved
// (median 1,545-1,575 MHz vs 1,485-1,500).
OnChipConfig stream_config(int64_t Vp, const DeviceLimits& d, int min_cluster) {
  OnChipConfig c;
  if (d.cc < 90) return c;
  const int64_t nvec = Vp / 8;
  const int64_t three = static_cast<int64_t>(d.per_sm) / 3 - d.reserved - static_cast<int64_t>(kOnChipStatic);
  const int64_t one = std::min<int64_t>(d.per_block_optin, d.per_sm - d.reserved) - static_cast<int64_t>(kOnChipStatic);
  for (int64_t budget : {three, one}) {
    for (int cl : {2, 4, 8}) {
      if (cl < min_cluster) continue;
      const int64_t slice = (nvec + cl - 1) / cl;
      if (2 * slice * 16 > budget) continue;
      c.cluster = cl;
      c.slice = static_cast<int>(slice);
      c.smem = static_cast<size_t>(2 * slice) * 16;
      c.threads = static_cast<int>(std::clamp<int64_t>((slice / 4 + 31) / 32 * 32, 128, kOnChipMaxThreads));
      return c;
    }
  }
  return c;
}

// Launches the streamed kernel with as many clusters as can be resident at once (at most one per
// row); false (nothing launched) when none can.
template <int kCluster>
bool launch_stream(const OnChipConfig& c, const DeviceLimits& d, bf16* dlogits, float* losses, float* lse,
                   const bf16* logits, const int32_t* targets, int64_t N, int V, int Vp, float dloss, const float* kept,
                   int ignore_index, cudaStream_t stream) {
  auto* kernel = cross_entropy_stream_kernel<kCluster>;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(static_cast<unsigned>(c.threads));
  cfg.dynamicSmemBytes = c.smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  static std::mutex mu;
  static std::map<std::tuple<int, size_t, int, int>, int> resident;  // (device, smem, threads, cluster) -> clusters
  int clusters = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(dev, c.smem, c.threads, kCluster);
    auto it = resident.find(key);
    if (it == resident.end()) {
      int active = 0;
      cfg.gridDim = dim3(static_cast<unsigned>(kCluster));
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               d.per_block_optin - static_cast<int>(kOnChipStatic)) != cudaSuccess ||
          cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) != cudaSuccess)
        active = 0;
      (void)cudaGetLastError();  // a refusal above is an answer, not an error to report later
      it = resident.emplace(key, active).first;
    }
    clusters = it->second;
  }
  if (clusters <= 0) return false;
  clusters = static_cast<int>(std::min<int64_t>(clusters, N));
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, dlogits, losses, lse, logits, targets, static_cast<int>(N), V, Vp,
                                c.slice, dloss, kept, ignore_index));
  return true;
}

int env_min_cluster() {
  static const int v = [] {
    return std::stoi(env_choice("PRIMUS_TURBO_CE_CLUSTER", {"1", "2", "4", "8"}, "1"));
  }();
  return v;
}

// f(std::integral_constant<int, C>{}) for the cluster size C in {1, 2, 4, 8}; false for any other.
template <class F>
bool with_cluster(int cluster, F&& f) {
  switch (cluster) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return false;
  }
}

// PRIMUS_TURBO_CE_KERNEL (read once): legacy (the two-read kernel), onchip (one row per cluster
// also where a row needs a cluster), unset or anything else: the default.
enum class EnvKernel { Default, Legacy, OnChip };
EnvKernel env_kernel() {
  static const EnvKernel k = [] {
    const std::string k = env_choice("PRIMUS_TURBO_CE_KERNEL", {"default", "legacy", "onchip"}, "default");
    if (k == "legacy") return EnvKernel::Legacy;
    if (k == "onchip") return EnvKernel::OnChip;
    return EnvKernel::Default;
  }();
  return k;
}

}  // namespace

int cross_entropy_onchip_cluster(DType dtype, int64_t Vp) {
  if (dtype != DType::BF16 || Vp % 8 != 0 || Vp <= 0) return 0;
  return onchip_config(Vp, device_limits()).cluster;
}

void cross_entropy_forward_backward(DType dtype, void* dlogits, float* losses, float* lse,
                                    const void* logits, const int32_t* targets, int64_t N,
                                    int64_t V, int64_t Vp, float dloss, const float* kept, int32_t ignore_index,
                                    cudaStream_t stream, CrossEntropyKernel which) {
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (Vp % w != 0 || V > Vp || V <= 0)
    throw RuntimeError(fmt::format("cross_entropy: need 0 < V={} <= Vp={} and Vp a multiple of {}", V, Vp, w));
  if (N == 0) return;
  if (Vp > INT32_MAX || N > INT32_MAX)
    throw RuntimeError(fmt::format("cross_entropy: N={} and Vp={} must fit int32", N, Vp));
  if (which == CrossEntropyKernel::Auto && env_kernel() == EnvKernel::Legacy) which = CrossEntropyKernel::Legacy;
  if (which == CrossEntropyKernel::Auto && env_kernel() == EnvKernel::OnChip) which = CrossEntropyKernel::OneRowPerCluster;
  if (dtype == DType::BF16 && which != CrossEntropyKernel::Legacy) {
    const DeviceLimits& d = device_limits();
    const OnChipConfig c = onchip_config(Vp, d, env_min_cluster());
    // Rows that need a cluster: the streamed kernel, unless one row per cluster is asked for.
    const OnChipConfig sc = c.cluster > 1 && which == CrossEntropyKernel::Auto ? stream_config(Vp, d, env_min_cluster())
                                                                               : OnChipConfig{};
    auto run = [&](const OnChipConfig& cfg, auto launch) {
      return launch(cfg, d, static_cast<bf16*>(dlogits), losses, lse, static_cast<const bf16*>(logits), targets, N,
                    static_cast<int>(V), static_cast<int>(Vp), dloss, kept, ignore_index, stream);
    };
    const bool launched =
        with_cluster(sc.cluster,
                     [&](auto k) {
                       constexpr int K = decltype(k)::value;
                       if constexpr (K > 1) return run(sc, launch_stream<K>);
                       else return false;
                     }) ||
        (N * c.cluster <= INT32_MAX &&
         with_cluster(c.cluster, [&](auto k) { return run(c, launch_onchip<decltype(k)::value>); }));
    if (launched) {
      CUDA_CHECK_LAST();
      return;
    }
  }
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
          static_cast<int>(N), static_cast<int>(V), static_cast<int>(Vp), dloss, kept, ignore_index);
    };
    if (two_per_sm)
      go(cross_entropy_kernel<scalar_t, 1, 2>);
    else
      go(cross_entropy_kernel<scalar_t, 2, 1>);
    CUDA_CHECK_LAST();
  });
}

void sum_f32(float* out, const float* x, int64_t n, const float* kept, float numerator, cudaStream_t stream) {
  sum_kernel<<<1, 1024, 0, stream>>>(out, x, n, kept, numerator);
  CUDA_CHECK_LAST();
}

void count_kept(float* out, const int32_t* targets, int64_t n, int32_t ignore_index, cudaStream_t stream) {
  count_kept_kernel<<<1, 1024, 0, stream>>>(out, targets, n, ignore_index);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
