// The device-side pieces of Turbo's Hopper GEMM that more than one kernel uses: the tile
// configurations (Cfg), the kernel parameters (Params), the TMA / barrier / cluster PTX pieces,
// the k-loop (mainloop) and the epilogues (store_groups, store_rows_vec16, store_rows_staged,
// store_tile). gemm_sm90.cu's kernel (the dense GEMM; its opening comment describes the design)
// and grouped_gemm_sm90.cu's (the grouped GEMM of mixture-of-experts layers) are built from them,
// so a change to the pipeline or the epilogue reaches both. Device code only; each including
// translation unit gets its own copy (anonymous namespace), as the kernels are separate files.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/gemm_sm90_streamk.h"
#include "turbo/kernels/cuda/gemm_sm90_wgmma.cuh"

namespace primus::turbo::cuda {
namespace gemm90 {
namespace {

using attn::bulk_commit;
using attn::bulk_wait;
using attn::bulk_wait_read;
using attn::fence_proxy_async;
using attn::fence_regs;
using attn::make_desc;
using attn::mbar_arrive;
using attn::mbar_expect_tx;
using attn::mbar_fence_init;
using attn::mbar_init;
using attn::mbar_wait;
using attn::smem_addr;
using attn::wgmma_commit;
using attn::wgmma_fence;
using attn::wgmma_wait;

constexpr int kBM = 128, kBK = 64, kThreads = 384;
constexpr int kGroupM = 8;           // tile-rows per raster group
constexpr int kSlabBytes = 64 * 128;  // one [64][64] swizzled slab of 16-bit elements
constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128*40 + 256*232 <= 65536
constexpr int kMaxSplits = 8;                          // portable cluster size

// PP: the ping-pong schedule (BN = 128; each consumer warpgroup owns a whole 128 x 128 tile and
// every stage feeds one warpgroup), else the cooperative one (both warpgroups on one 128 x BN tile).
// BN 160 (the linear epilogue only): 120 tiles for GPT-2's 3072 x 768 weight gradients, one wave
// on 132 SMs without split-k. An N-major B is then loaded as 3 slabs of 64 columns, the last
// half of which belongs to the next tile (read, never used).
template <int BN, bool PP = false>
struct Cfg {
  static_assert(!PP || BN == 128, "the ping-pong schedule runs 128 x 128 tiles");
  static_assert(BN == 128 || BN == 160 || BN == 256, "tile widths 128, 160 and 256");
  // Ping-pong: 6 stages of 32 KiB (7 fit without the staged epilogue's buffer, which is worth
  // more than the seventh stage).
  static constexpr int kStages = PP ? 6 : BN == 256 ? 4 : 5;
  static constexpr int kHalves = PP ? 2 : 1;        // m64 row blocks per consumer warpgroup
  static constexpr int kAcc = kHalves * BN / 2;     // accumulator floats per consumer thread
  static constexpr int kEmptyArrivals = PP ? 4 : 8;  // consumer warps reading one stage
  static constexpr int kBytesA = kBM * kBK * 2;  // 16 KiB
  static constexpr int kBytesB = BN * kBK * 2;  // a K-major B's box ([BN][64])
  static constexpr int kSlabsB = (BN + 63) / 64;  // an N-major B's slabs ([64 k][64 n] each)
  static constexpr int kStageBytes = kBytesA + kSlabsB * kSlabBytes;
  static constexpr int kBarOffset = kStages * kStageBytes;
  // The staged epilogue (store_rows_staged): kEpiBufs buffers of 2 KiB per consumer warp, after
  // the barriers, 1024-byte aligned (TMA's 128-byte swizzle reads them as stored). Two let a
  // warp fill one while the TMA store of the other is still reading it; the 160-wide tile (whose
  // epilogue is not staged) keeps one, as two would not fit beside its 5 stages.
  static constexpr int kEpiBufs = BN == 160 ? 1 : 2;
  static constexpr int kEpiOffset = (kBarOffset + 2 * kStages * 8 + 1023) / 1024 * 1024;
  static constexpr int kEpiBytes = 8 * 2048 * kEpiBufs;
  static constexpr int kSmem = kEpiOffset + kEpiBytes + 1024;  // + slack to align to 1024
  static constexpr int kGroups = BN / 8;                               // accumulator column groups
  static constexpr int kRedBytes = kGroups * 256 * 16;                 // fp32 partial tile (split-k)
  static_assert(kRedBytes <= kBarOffset, "the split-k partial tile reuses the stage memory");
  static_assert(kSmem <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

struct Params {
  int m, n;
  int tiles_m, tiles_n, kblocks, splits;
  int a_mn, b_mn;  // 1: A is M-major (stored [k][m]); 1: B is N-major (stored [k][n])
  void* d;
  int64_t ldd;
  int d_vec;    // D's element pairs may be stored as one vector (aligned base, even ldd)
  int d_vec16;  // 16-bit D, beta == 0, 16-byte aligned base and rows: whole 8-column groups per store
  float alpha, beta;
  const void* bias;
  int bias_vec;  // bias is aligned to two elements: column pairs are read as one word / float2
  void* aux;     // [m][n] in D's type, ld_aux apart: written (GeluAux) or read (DGelu)
  int64_t ld_aux;
  int aux_vec16;  // 16-bit aux, 16-byte aligned base and rows: 8-column groups per access
  int staged;     // the 16-bit epilogues through shared memory (store_rows_staged): 1 stored by the
                  // threads, 2 by TMA stores (EpiMaps)
};
// The staged epilogue's TMA stores (Params::staged == 2): D and, for GeluAux, aux as [m][n] in
// boxes of 16 rows x 64 columns, 128-byte swizzled like the per-warp buffers. Unused maps are
// copies of A's (never read).
struct EpiMaps {
  CUtensorMap d, aux;
};
// The stream-K kernels' own argument (gemm_sm90_streamk.h): the division of the work, one fp32
// partial tile per block (kGroups * 256 float4, in the consumers' register order) and one flag per
// block (0 between launches: each owner clears the flags it consumed). The other kernels get an
// empty one: with these fields in Params, ptxas spilled 4-6x more in the 256-wide dGELU kernels.
template <bool SK>
struct StreamKArgs {};
template <>
struct StreamKArgs<true> {
  streamk::Split split;
  float4* tiles;
  unsigned int* flags;
};
// The kernel's epilogue, a template argument (GemmSm90Epilogue's values): Linear = alpha, bias,
// beta only; GeluAux and DGelu as in gemm_sm90.h (16-bit D only).
constexpr int kEpiLinear = 0, kEpiGeluAux = 1, kEpiDGelu = 2;

// ---- small PTX pieces not in attention_sm90_common.cuh -----------------------------------------
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// Shared -> global TMA store of one box at (c0, c1) (inner, outer coordinates; clipped at the
// matrix edges), in this thread's current bulk async-group (attn::bulk_commit / bulk_wait*).
__device__ __forceinline__ void tma_store_2d(const void* tmap, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}
__device__ __forceinline__ void consumer_barrier() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
// Ping-pong order: named barrier kOrderBar + w means "consumer warpgroup w may start its next
// k-loop"; the waiting warpgroup syncs on it (128 threads), the other one arrives (128 threads).
constexpr int kOrderBar = 2;
// (Immediate ids, so ptxas counts the barriers the kernel really uses: 0..3.)
__device__ __forceinline__ void order_wait(int wg) {
  static_assert(kOrderBar == 2, "the ids below");
  if (wg == 0) asm volatile("bar.sync 2, 256;\n" ::: "memory");
  else asm volatile("bar.sync 3, 256;\n" ::: "memory");
}
__device__ __forceinline__ void order_pass(int wg) {
  if (wg == 0) asm volatile("bar.arrive 3, 256;\n" ::: "memory");
  else asm volatile("bar.arrive 2, 256;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster; release/acquire orders the shared-memory writes
// before it with the distributed-shared-memory reads after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t local_addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local_addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_f4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Stream-K's flags: a partial tile published at GPU scope (release) and taken (acquire).
__device__ __forceinline__ void st_release_gpu(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned int ld_acquire_gpu(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- D's element types ----------------------------------------------------------------------------
template <class T> struct Out;
template <> struct Out<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
  static __device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
};
template <> struct Out<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
  static __device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
};
template <> struct Out<__half> {
  static __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
  static __device__ __forceinline__ void store2(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
};

// Tile t -> (tile-row, tile-column): groups of kGroupM tile-rows, column by column inside a group,
// so the blocks running at one time share B's column tiles and a few rows of A in L2.
__device__ __forceinline__ void tile_coords(const Params& p, int t, int& tm, int& tn) {
  const int per_group = kGroupM * p.tiles_n;
  const int g = t / per_group;
  const int first_m = g * kGroupM;
  const int rows = min(p.tiles_m - first_m, kGroupM);
  const int r = t - g * per_group;
  tm = first_m + r % rows;
  tn = r / rows;
}

// GELU (tanh form) and its derivative on the hardware tanh (tanh.approx.f32, one MUFU op, max
// relative error ~2^-11): the epilogue's outputs are 16-bit or feed a bf16 activation, whose
// rounding step is 2^-8, and tanhf's instruction sequence would make the epilogue compute-bound.
__device__ __forceinline__ float tanh_fast(float u) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  return t;
}
__device__ __forceinline__ float gelu_fast(float x) {
  const float u = 0.7978845608028654f * fmaf(0.044715f * x * x, x, x);
  return 0.5f * x * (1.0f + tanh_fast(u));
}
__device__ __forceinline__ float gelu_grad_fast(float x) {
  const float u = 0.7978845608028654f * fmaf(0.044715f * x * x, x, x);
  const float t = tanh_fast(u);
  const float du = 0.7978845608028654f * fmaf(3.0f * 0.044715f, x * x, 1.0f);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// ---- 16-byte epilogue stores (Params::d_vec16) --------------------------------------------------
template <class OutT> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<float>(float, float) { return 0; }  // never used (16-bit D only)
// v[c] <- v[(c + r) & 3] (fwd) or v[(c - r) & 3] (!fwd) for this lane's r = 0..3, as selects.
__device__ __forceinline__ void rotate4(uint32_t (&v)[4], int r, bool fwd) {
  const bool odd = r & 1, two = r & 2;
  uint32_t t0 = v[0], t1 = v[1], t2 = v[2], t3 = v[3];
  if (fwd) {
    v[0] = odd ? t1 : t0, v[1] = odd ? t2 : t1, v[2] = odd ? t3 : t2, v[3] = odd ? t0 : t3;
  } else {
    v[0] = odd ? t3 : t0, v[1] = odd ? t0 : t1, v[2] = odd ? t1 : t2, v[3] = odd ? t2 : t3;
  }
  t0 = v[0], t1 = v[1], t2 = v[2], t3 = v[3];
  v[0] = two ? t2 : t0, v[1] = two ? t3 : t1, v[2] = two ? t0 : t2, v[3] = two ? t1 : t3;
}
// Across the 4 lanes of a quad (q = lane % 4): in, a[c] = this lane's word of group c; out,
// a[c] = lane c's word of group q. Round k: lane q reads lane (q + k) % 4, which sends its word of
// group (s - k) % 4; pre-rotating by q makes that a fixed index, post-rotating puts words in order.
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4], int q) {
  rotate4(a, q, true);  // a[c] = word of group (c + q) % 4
  uint32_t r[4];
  r[0] = a[0];
#pragma unroll
  for (int k = 1; k < 4; ++k) r[k] = __shfl_sync(0xffffffffu, a[(4 - k) & 3], (q + k) & 3, 4);
  // r[k] = lane (q + k) % 4's word of group q
  a[0] = r[0], a[1] = r[1], a[2] = r[2], a[3] = r[3];
  rotate4(a, q, false);  // a[c] = r[(c - q) % 4] = lane c's word of group q
}
template <class OutT> __device__ __forceinline__ float2 unpack2(uint32_t w);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  __nv_bfloat162 h;
  memcpy(&h, &w, 4);
  return __bfloat1622float2(h);
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, 4);
  return __half22float2(h);
}
template <> __device__ __forceinline__ float2 unpack2<float>(uint32_t) { return make_float2(0.0f, 0.0f); }  // never used

// Columns col, col + 1 of one row of a D-typed matrix (`two` false: col + 1 is past N; 0 for it),
// as one vector access where `vec` allows (even element offset, aligned base).
template <class OutT>
__device__ __forceinline__ void load_pair(const OutT* at, bool two, bool vec, float& a, float& b) {
  if (two && vec) {
    if constexpr (sizeof(OutT) == 4) {
      const float2 f = *reinterpret_cast<const float2*>(at);
      a = f.x, b = f.y;
    } else {
      const float2 f = unpack2<OutT>(*reinterpret_cast<const uint32_t*>(at));
      a = f.x, b = f.y;
    }
    return;
  }
  a = Out<OutT>::load(at);
  b = two ? Out<OutT>::load(at + 1) : 0.0f;
}

// The scalar epilogue: up to 4 accumulator column groups of a thread (groups g = 0..n-1 at
// columns col + 8g, col + 8g + 1 of rows row and row + 8; v[4g..4g+3] as wgmma lays out
// m64nNk16's f32 results: warp w of the warpgroup holds rows 16w..16w+15, lane l row l/4 (+8) and
// columns 2*(l%4) (+1) of each group of 8 columns). D = alpha * acc + bias (+ beta * D); GeluAux
// writes that value to aux and gelu of it to D; DGelu writes it times gelu'(aux) to D.
// Everything the groups read (bias, beta * D, aux) is loaded before anything is stored: a store
// to D may alias a later load from D in the compiler's eyes, so loads interleaved with stores wait
// one memory latency per group (the f32 weight-gradient GEMMs with beta = 1 went from 0.61x to
// 0.77x cuBLASLt on an H200 when their loads came first). EPI is a template argument: a kernel holds the code of its
// own epilogue only (with every variant behind run-time branches in one kernel, the plain
// products ran 25-35% slower on an H100).
template <class OutT, int EPI>
__device__ __forceinline__ void store_groups(const Params& p, int row, int col, int n, const float* v) {
  const bool r0 = row < p.m, r8 = row + 8 < p.m, beta = p.beta != 0.0f;
  float b[4][2], in[4][4];  // bias pairs; per group, beta * D (Linear/GeluAux) or aux (DGelu) of both rows
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    b[g][0] = b[g][1] = 0.0f;
    in[g][0] = in[g][1] = in[g][2] = in[g][3] = 0.0f;
    const int c = col + 8 * g;
    if (g >= n || c >= p.n) continue;
    const bool two = c + 1 < p.n;
    if (EPI != kEpiDGelu && p.bias) load_pair<OutT>(static_cast<const OutT*>(p.bias) + c, two, p.bias_vec, b[g][0], b[g][1]);
    if (EPI == kEpiDGelu || beta) {
      const OutT* src = EPI == kEpiDGelu ? static_cast<const OutT*>(p.aux) + static_cast<int64_t>(row) * p.ld_aux + c
                                         : static_cast<const OutT*>(p.d) + static_cast<int64_t>(row) * p.ldd + c;
      const int64_t ld = EPI == kEpiDGelu ? p.ld_aux : p.ldd;
      const bool vec = EPI == kEpiDGelu ? false : p.d_vec != 0;
      if (r0) load_pair<OutT>(src, two, vec, in[g][0], in[g][1]);
      if (r8) load_pair<OutT>(src + 8 * ld, two, vec, in[g][2], in[g][3]);
    }
  }
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int c = col + 8 * g;
    if (g >= n || c >= p.n) continue;
    const bool two = c + 1 < p.n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      if (r >= p.m) continue;
      float v0 = v[4 * g + 2 * h] * p.alpha + b[g][0], v1 = v[4 * g + 2 * h + 1] * p.alpha + b[g][1];
      if (EPI != kEpiDGelu && beta) v0 += p.beta * in[g][2 * h], v1 += p.beta * in[g][2 * h + 1];
      if constexpr (EPI == kEpiGeluAux) {
        OutT* x = static_cast<OutT*>(p.aux) + static_cast<int64_t>(r) * p.ld_aux + c;
        Out<OutT>::store(x, v0);
        if (two) Out<OutT>::store(x + 1, v1);
        v0 = gelu_fast(v0), v1 = gelu_fast(v1);
      } else if constexpr (EPI == kEpiDGelu) {
        v0 *= gelu_grad_fast(in[g][2 * h]), v1 *= gelu_grad_fast(in[g][2 * h + 1]);
      }
      OutT* d = static_cast<OutT*>(p.d) + static_cast<int64_t>(r) * p.ldd + c;
      if (two && p.d_vec) {
        Out<OutT>::store2(d, v0, v1);
      } else {
        Out<OutT>::store(d, v0);
        if (two) Out<OutT>::store(d + 1, v1);
      }
    }
  }
}

// The packed bias pair of columns col, col + 1 (both inside N) as one 32-bit word of D's type;
// zero bits (0.0, 0.0) without a bias. Read-only for the kernel: the non-coherent path.
template <class OutT>
__device__ __forceinline__ uint32_t bias_word(const Params& p, int col) {
  if (!p.bias) return 0u;
  const OutT* b = static_cast<const OutT*>(p.bias) + col;
  if (p.bias_vec) return __ldg(reinterpret_cast<const unsigned int*>(b));
  const unsigned short* h = reinterpret_cast<const unsigned short*>(b);
  return static_cast<uint32_t>(__ldg(h)) | (static_cast<uint32_t>(__ldg(h + 1)) << 16);
}
// What one 16-byte step (4 column groups) of store_rows_vec16 reads before it computes: the bias
// words of its groups and, for DGelu, aux's rows row and row + 8 (16 bytes each, in store order).
template <class OutT, int EPI>
struct Vec16Inputs {
  uint32_t bias[4];
  uint4 x0, x8;
  __device__ __forceinline__ void load(const Params& p, int row, int col, int q, int j, bool r0, bool r8) {
#pragma unroll
    for (int c = 0; c < 4; ++c)  // DGelu takes no bias (gemm_sm90_unsupported_reason)
      bias[c] = EPI == kEpiDGelu ? 0u : bias_word<OutT>(p, col + 8 * (4 * j + c) + 2 * q);
    if constexpr (EPI == kEpiDGelu) {
      const OutT* x = static_cast<const OutT*>(p.aux) + static_cast<int64_t>(row) * p.ld_aux + col + 8 * (4 * j + q);
      x0 = r0 ? __ldg(reinterpret_cast<const uint4*>(x)) : make_uint4(0u, 0u, 0u, 0u);
      x8 = r8 ? __ldg(reinterpret_cast<const uint4*>(x + 8 * p.ld_aux)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
};

// The epilogue of one 64-row block of a thread's accumulators (G groups of 8 columns from tile
// column col) when d_vec16 holds (and aux_vec16 for the GELU epilogues) and every column is
// inside D: whole warps only (shuffles). Lane q of a quad stores (and, for DGelu, loads) 16 bytes
// of group 4j + q per row; quad_transpose moves words between that order and the accumulators'.
// AHEAD: each step's loads (bias words, aux) are issued one step ahead, so their latency hides
// under the previous step's arithmetic and stores instead of stalling every step (the cooperative
// schedule, whose epilogue the tensor cores wait for). The ping-pong schedule's epilogue runs
// under the other warpgroup's MMAs and has no registers to spare for it (DGelu spilled).
template <class OutT, int G, int EPI, bool AHEAD>
__device__ __forceinline__ void store_rows_vec16(const Params& p, int row, int col, int q, const float* acc) {
  const bool r0 = row < p.m, r8 = row + 8 < p.m;
  Vec16Inputs<OutT, EPI> cur, next;
  cur.load(p, row, col, q, 0, r0, r8);
#pragma unroll
  for (int j = 0; j < G / 4; ++j) {
    if (AHEAD && j + 1 < G / 4) next.load(p, row, col, q, j + 1, r0, r8);
    if (!AHEAD && j > 0) cur.load(p, row, col, q, j, r0, r8);
    uint32_t xlo[4] = {0u, 0u, 0u, 0u}, xhi[4] = {0u, 0u, 0u, 0u};
    if constexpr (EPI == kEpiDGelu) {
      xlo[0] = cur.x0.x, xlo[1] = cur.x0.y, xlo[2] = cur.x0.z, xlo[3] = cur.x0.w;
      xhi[0] = cur.x8.x, xhi[1] = cur.x8.y, xhi[2] = cur.x8.z, xhi[3] = cur.x8.w;
      quad_transpose(xlo, q);  // xlo[c] = this lane's word of group 4j + c
      quad_transpose(xhi, q);
    }
    uint32_t lo[4], hi[4], alo[4], ahi[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int g = 4 * j + c;
      const float2 b = unpack2<OutT>(cur.bias[c]);
      float v0 = acc[4 * g] * p.alpha + b.x, v1 = acc[4 * g + 1] * p.alpha + b.y;
      float v2 = acc[4 * g + 2] * p.alpha + b.x, v3 = acc[4 * g + 3] * p.alpha + b.y;
      if constexpr (EPI == kEpiGeluAux) {
        alo[c] = pack2<OutT>(v0, v1);
        ahi[c] = pack2<OutT>(v2, v3);
        v0 = gelu_fast(v0), v1 = gelu_fast(v1), v2 = gelu_fast(v2), v3 = gelu_fast(v3);
      } else if constexpr (EPI == kEpiDGelu) {
        const float2 x0 = unpack2<OutT>(xlo[c]), x8 = unpack2<OutT>(xhi[c]);
        v0 *= gelu_grad_fast(x0.x), v1 *= gelu_grad_fast(x0.y), v2 *= gelu_grad_fast(x8.x), v3 *= gelu_grad_fast(x8.y);
      }
      lo[c] = pack2<OutT>(v0, v1);
      hi[c] = pack2<OutT>(v2, v3);
    }
    quad_transpose(lo, q);
    quad_transpose(hi, q);
    OutT* d = static_cast<OutT*>(p.d) + static_cast<int64_t>(row) * p.ldd + col + 8 * (4 * j + q);
    if (r0) *reinterpret_cast<uint4*>(d) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    if (r8) *reinterpret_cast<uint4*>(d + 8 * p.ldd) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    if constexpr (EPI == kEpiGeluAux) {
      quad_transpose(alo, q);
      quad_transpose(ahi, q);
      OutT* x = static_cast<OutT*>(p.aux) + static_cast<int64_t>(row) * p.ld_aux + col + 8 * (4 * j + q);
      if (r0) *reinterpret_cast<uint4*>(x) = make_uint4(alo[0], alo[1], alo[2], alo[3]);
      if (r8) *reinterpret_cast<uint4*>(x + 8 * p.ld_aux) = make_uint4(ahi[0], ahi[1], ahi[2], ahi[3]);
    }
    if (AHEAD) cur = next;
  }
}
// The Linear, GeluAux and DGelu epilogues of one warp's 16 rows x G groups of 8 columns (16-bit D,
// d_vec16, aux_vec16 for GeluAux, every column inside D) through a 2 KiB shared-memory buffer
// `buf` of its own, 64 columns at a time: alpha * acc + bias packed to 16 bits and written with
// stmatrix (the accumulators are already in its fragment layout: no shuffles), then read back as
// whole 128-byte row segments and stored 16 bytes per lane, 8 lanes per row. GeluAux does it twice
// per chunk: the value into aux, its GELU into D. The buffer's 16-byte chunks are XOR-swizzled by
// row, so both sides are free of bank conflicts. row0: the warp's first row; lane l holds rows
// row0 + l/4 (+8).
// With TMA stores (p.staged == 2) the warp's lane 0 stores each filled buffer as one box instead
// (em: the tensor maps of D and aux) and the warp goes on without waiting for it: the device's
// write bandwidth, which every SM's epilogue meets at once under the cooperative schedule, is then
// used under the next tile's main loop. The warp's NB buffers (2 KiB apart from bufs) take the
// passes in turn (nb counts them across tiles): a buffer is written again only once the store
// issued from it NB passes before has read it.
template <class OutT, int G, int EPI, int NB>
__device__ __forceinline__ void store_rows_staged(const Params& p, const EpiMaps& em, int row0, int col, int lane,
                                                  const float* acc, uint32_t bufs, int& nb) {
  static_assert(G % 8 == 0, "64-column chunks");
  const bool tma = p.staged == 2;
  // The next buffer, once its previous store has read it.
  auto acquire = [&]() {
    const uint32_t b = bufs + static_cast<uint32_t>(nb % NB) * 2048u;
    ++nb;
    if (tma && lane == 0) bulk_wait_read<NB - 1>();
    __syncwarp();
    return b;
  };
  const int q = lane % 4;
  // stmatrix addresses: lanes 8i..8i+7 give the rows of matrix i of an x4: matrix i is column
  // group 2k + (i >> 1) of the x4 number k, rows 8 * (i & 1) .. + 7.
  const int mi = lane / 8, mr = lane % 8 + 8 * (mi & 1);
  // One pass: w (16 words: [group][row, row + 8]) into buf, then buf to `out` (D or aux; map: its
  // tensor map).
  auto pass = [&](const uint32_t (&w)[16], uint32_t buf, OutT* out, int64_t ld, const CUtensorMap* map, int chunk) {
    __syncwarp();  // the previous reads of buf (this chunk's ldmatrix, or the last pass's) are done
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int g = 2 * k + (mi >> 1);
      const uint32_t a = buf + mr * 128 + ((g ^ (mr & 7)) * 16);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(w[4 * k]),
                   "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3])
                   : "memory");
    }
    if (tma) {
      fence_proxy_async();  // this lane's stmatrix writes, visible to the TMA unit
      __syncwarp();
      if (lane == 0) {
        tma_store_2d(map, buf, col + chunk * 64, row0);
        bulk_commit();
      }
      return;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8, c = lane % 8;
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(buf + r * 128 + ((c ^ (r & 7)) * 16)));
      if (row0 + r < p.m) *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * ld + col + chunk * 64 + c * 8) = v;
    }
  };
  // DGelu: aux's rows of each chunk arrive as 128-byte row segments (the next chunk's loads issued
  // before this chunk's arithmetic), go through buf, and come back with ldmatrix in the
  // accumulators' layout: no shuffles on this side either. Rows past M read as zeros.
  uint4 xin[4];
  auto load_aux = [&](int chunk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8, c = lane % 8;
      xin[i] = row0 + r < p.m ? *reinterpret_cast<const uint4*>(static_cast<const OutT*>(p.aux) +
                                                                static_cast<int64_t>(row0 + r) * p.ld_aux + col +
                                                                chunk * 64 + c * 8)
                              : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if constexpr (EPI == kEpiDGelu) load_aux(0);
#pragma unroll
  for (int chunk = 0; chunk < G / 8; ++chunk) {
    uint32_t xw[16];  // DGelu: aux in the accumulators' layout, [group][row, row + 8]
    // The chunk's buffer (GeluAux takes a second one for its second pass).
    const uint32_t buf = acquire();
    if constexpr (EPI == kEpiDGelu) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 4 * i + lane / 8, c = lane % 8;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(buf + r * 128 + ((c ^ (r & 7)) * 16)),
                     "r"(xin[i].x), "r"(xin[i].y), "r"(xin[i].z), "r"(xin[i].w)
                     : "memory");
      }
      if (chunk + 1 < G / 8) load_aux(chunk + 1);
      __syncwarp();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int g = 2 * k + (mi >> 1);
        const uint32_t a = buf + mr * 128 + ((g ^ (mr & 7)) * 16);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(xw[4 * k]), "=r"(xw[4 * k + 1]), "=r"(xw[4 * k + 2]), "=r"(xw[4 * k + 3])
                     : "r"(a)
                     : "memory");
      }
    }
    float v[32];  // [group][row: 2 values, row + 8: 2 values], before any activation
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const int gg = chunk * 8 + g;
      float b0 = 0.0f, b1 = 0.0f;
      if (p.bias) {
        const float2 b = unpack2<OutT>(*reinterpret_cast<const uint32_t*>(static_cast<const OutT*>(p.bias) + col + 8 * gg + 2 * q));
        b0 = b.x, b1 = b.y;
      }
      v[4 * g] = acc[4 * gg] * p.alpha + b0, v[4 * g + 1] = acc[4 * gg + 1] * p.alpha + b1;
      v[4 * g + 2] = acc[4 * gg + 2] * p.alpha + b0, v[4 * g + 3] = acc[4 * gg + 3] * p.alpha + b1;
    }
    if constexpr (EPI == kEpiDGelu) {
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        const float2 x0 = unpack2<OutT>(xw[2 * g]), x8 = unpack2<OutT>(xw[2 * g + 1]);
        v[4 * g] *= gelu_grad_fast(x0.x), v[4 * g + 1] *= gelu_grad_fast(x0.y);
        v[4 * g + 2] *= gelu_grad_fast(x8.x), v[4 * g + 3] *= gelu_grad_fast(x8.y);
      }
    }
    uint32_t w[16];
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      w[2 * g] = pack2<OutT>(v[4 * g], v[4 * g + 1]);
      w[2 * g + 1] = pack2<OutT>(v[4 * g + 2], v[4 * g + 3]);
    }
    if constexpr (EPI == kEpiGeluAux) {
      pass(w, buf, static_cast<OutT*>(p.aux), p.ld_aux, &em.aux, chunk);
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        w[2 * g] = pack2<OutT>(gelu_fast(v[4 * g]), gelu_fast(v[4 * g + 1]));
        w[2 * g + 1] = pack2<OutT>(gelu_fast(v[4 * g + 2]), gelu_fast(v[4 * g + 3]));
      }
    }
    pass(w, EPI == kEpiGeluAux ? acquire() : buf, static_cast<OutT*>(p.d), p.ldd, &em.d, chunk);
  }
}
// Whether a tile starting at column n0 takes the 16-byte epilogue (uniform over the tile).
template <class OutT, int BN, int EPI>
__device__ __forceinline__ bool tile_vec16(const Params& p, int n0) {
  return sizeof(OutT) == 2 && p.d_vec16 && n0 + BN <= p.n && (EPI == kEpiLinear || p.aux_vec16);
}

__device__ __forceinline__ void prefetch_l2(const void* a) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a)); }
// Pulls into L2 what the epilogue of one tile reads from device memory: the bias of columns
// [c0, c1) and rows [m0, m0 + 128) of those columns of D (beta != 0) or of aux (DGelu); thread tid
// of nthreads takes every nthreads-th row. The mainloops issue it a few k-tiles before they end,
// so the epilogue's loads find L2 rather than device memory (whose latency they would otherwise
// wait for with the tensor cores idle, under the cooperative schedule).
template <class OutT, int EPI>
__device__ __forceinline__ void prefetch_epilogue(const Params& p, int m0, int c0, int c1, int tid, int nthreads) {
  c1 = min(c1, p.n);
  if (c0 >= c1) return;
  const int64_t bytes = static_cast<int64_t>(c1 - c0) * static_cast<int64_t>(sizeof(OutT));
  const auto lines = [bytes](const OutT* first) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(first), e = a + static_cast<uintptr_t>(bytes);
    for (uintptr_t x = a & ~static_cast<uintptr_t>(127); x < e; x += 128) prefetch_l2(reinterpret_cast<const void*>(x));
  };
  if (EPI != kEpiDGelu && p.bias && tid == 0) lines(static_cast<const OutT*>(p.bias) + c0);
  const bool rows_of_d = EPI != kEpiDGelu && p.beta != 0.0f;
  if (!rows_of_d && EPI != kEpiDGelu) return;
  const OutT* rows = static_cast<const OutT*>(rows_of_d ? p.d : p.aux);
  const int64_t ld = rows_of_d ? p.ldd : p.ld_aux;
  for (int r = tid; r < kBM && m0 + r < p.m; r += nthreads) lines(rows + static_cast<int64_t>(m0 + r) * ld + c0);
}

// The k-tiles of one tile for one consumer warpgroup: wait for each stage, issue its four wgmmas,
// keep that group in flight, and release the previous stage once its group has completed.
// da / db: descriptors of this warpgroup's A rows and of B in stage 0.
// Ping-pong (C::kHalves == 2): the warpgroup multiplies both 64-row halves of A (8 KiB apart in
// the stage in both layouts) into acc[0, BN/2) and acc[BN/2, BN).
// tail() runs once, kTailAhead k-tiles before the loop ends (at its start for short loops).
// before(kb, stage) runs for every k-tile once its stage has landed, before its wgmmas: the grouped
// weight gradient zeroes there the rows of a k-tile that lie past its group (NoBefore: nothing).
constexpr int kTailAhead = 6;
struct NoBefore {
  __device__ __forceinline__ void operator()(int, int) const {}
};
template <class T, class C, int BN, int TA, int TB, class Tail, class Before = NoBefore>
__device__ __forceinline__ void mainloop(float* acc, uint64_t da, uint64_t db, uint32_t bars, int kb_count, int& stage,
                                         uint32_t& phase, const Tail& tail, const Before& before = Before{}) {
  // Descriptor units are 16 bytes. K-major: 16 elements of k are 32 bytes along a swizzled row;
  // MN-major: 16 k-rows of 128 bytes.
  // The offsets are added to the descriptors' low words only: the start address (bits 0-13, in
  // 16-byte units) of any shared-memory operand plus its offsets stays below 2^14, so no carry
  // reaches the fields above, and 32-bit adds replace the 64-bit add-with-carry chains the
  // compiler would otherwise emit for every wgmma of the MN-major operands (the weight gradient's
  // loop: about 140 instructions a k-tile before, 95 with this and its cut check hoisted).
  constexpr uint32_t kStepA = TA ? 2048 / 16 : 32 / 16, kStepB = TB ? 2048 / 16 : 32 / 16;
  const uint64_t a_hi = da & ~0xffffffffull, b_hi = db & ~0xffffffffull;
  const uint32_t a_lo = static_cast<uint32_t>(da), b_lo = static_cast<uint32_t>(db);
  const bool leader = threadIdx.x % 32 == 0;
  int prev = 0;
  const int tail_kb = max(kb_count - kTailAhead, 0);
  for (int kb = 0; kb < kb_count; ++kb) {
    if (kb == tail_kb) tail();
    mbar_wait(bars + 8u * stage, phase);
    before(kb, stage);
    const uint32_t off = static_cast<uint32_t>(stage * C::kStageBytes) >> 4;
    fence_regs<C::kAcc>(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h)
        GemmWgmma<T, BN>::template mma<TA, TB>(acc + h * (BN / 2),
                                               a_hi | (a_lo + h * (kSlabBytes / 16) + off + kk * kStepA),
                                               b_hi | (b_lo + off + kk * kStepB), 1);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs<C::kAcc>(acc);
    if (kb > 0 && leader) mbar_arrive(bars + 8u * (C::kStages + prev));
    prev = stage;
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence_regs<C::kAcc>(acc);
  if (kb_count > 0 && leader) mbar_arrive(bars + 8u * (C::kStages + prev));
}

// The cooperative schedule's epilogue of one whole 128 x BN tile (tile row tm, column tn) from
// the consumer thread's accumulators (warpgroup wg, warp, lane): the staged 16-byte stores where
// the tile allows them, else the shuffle-transposed ones, else the scalar path at the edges.
template <class OutT, class C, int BN, int EPI>
__device__ __forceinline__ void store_tile(const Params& p, const EpiMaps& em, int tm, int tn, int wg, int warp, int lane,
                                           const float* acc, uint32_t base, int& nb) {
  const int row = tm * kBM + wg * 64 + warp * 16 + lane / 4;
  const int col = tn * BN + (lane % 4) * 2;
  if constexpr (C::kGroups % 8 == 0) {  // 64-column chunks: not the 160-wide tile
    if (sizeof(OutT) == 2 && p.staged && tile_vec16<OutT, BN, EPI>(p, tn * BN)) {
      store_rows_staged<OutT, C::kGroups, EPI, C::kEpiBufs>(p, em, tm * kBM + wg * 64 + warp * 16, tn * BN, lane, acc,
                                                            base + C::kEpiOffset + (wg * 4 + warp) * 2048 * C::kEpiBufs, nb);
      return;
    }
  }
  if (tile_vec16<OutT, BN, EPI>(p, tn * BN)) {
    store_rows_vec16<OutT, C::kGroups, EPI, true>(p, row, tn * BN, lane % 4, acc);
  } else {
#pragma unroll
    for (int i = 0; i < C::kGroups; i += 4) store_groups<OutT, EPI>(p, row, col + i * 8, 4, acc + 4 * i);
  }
}

}  // namespace
}  // namespace gemm90
}  // namespace primus::turbo::cuda
