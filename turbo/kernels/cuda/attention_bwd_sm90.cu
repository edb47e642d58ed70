// Flash-attention backward main kernel for Hopper (sm_90a): the five GEMMs on warpgroup MMA.
//
// One work per (key tile of 128 keys, kv head, batch row), two warpgroups of 64 keys each (the
// warp-specialised kernel's persistent blocks take several works in turn, see BwdWalk and snake_work); a
// work walks the query tiles (64 rows; 128 in the warp-specialised kernel at head_dim 64) of every
// query head of its kv head's group (attention_bwd.cu runs the delta pass before and the dQ cast
// after, as for the mma.sync kernel). Per query tile,
// with every operand in 128-byte-swizzled shared memory (attention_sm90_common.cuh):
//   S^T  = K Q^T           wgmma  A = K (smem, K-major)       B = Q (smem, K-major)
//   dP^T = V dO^T          wgmma  A = V (smem, K-major)       B = dO (smem, K-major)
//   P^T = exp(scale S^T - lse),  dS^T = P^T (dP^T - delta) scale      (registers)
//   dV  += P^T dO          wgmma  A = P^T (registers)         B = dO (smem, MN-major)
//   dK  += dS^T Q          wgmma  A = dS^T (registers)        B = Q (smem, MN-major)
//   dQ   = dS K            wgmma  A = dS (smem via dS^T, MN-major)  B = K (smem, MN-major)
// dK/dV stay in registers for the whole walk (deterministic); dQ is added to the f32 accumulator:
// for head_dim 128 each warpgroup takes 64 of dQ's columns over all 128 keys, for head_dim 64 each
// takes its own 64 keys (so both add to every element), or with 128-query tiles its own 64 query
// rows over all 128 keys. Each warpgroup puts its 64 x 64 f32 share
// in shared memory (two 32-column boxes, 128-byte swizzled) and one thread adds the block's boxes
// to the accumulator with TMA reduce-adds (cp.reduce.async.bulk.tensor .add; rows past T are
// clipped by the tensor map), which the block does not wait for: two staging buffers alternate
// between query tiles. Without a TMA descriptor (no driver entry point) the threads add their
// registers with f32 atomics instead.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/attention_flash.h"
#include "turbo/kernels/cuda/attention_mma.cuh"
#include "turbo/kernels/cuda/attention_sm90.h"
#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/attention_wgmma_ops.cuh"
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/tma_encode.h"

namespace primus::turbo::cuda {
namespace {

using namespace attn;

template <int D_>
struct BwdSm90Config {
  static constexpr int D = D_, BN = 128, BM = 64;
  static constexpr int kThreads = 256;
  static constexpr bool kSplitN = D == 128;  // dQ work split between the warpgroups by columns (else by keys)
  static constexpr bool kDqRows = false;     // (the warp-specialised kernel's 128-query tiles: by query rows)
  static constexpr int kSmemKV = BN * D * 2, kSmemQ = BM * D * 2, kSmemDS = BN * BM * 2;
  // dQ's staging: per buffer, 2 warpgroups x 2 boxes of [64 rows][32 f32] (8 KiB each, 1024-aligned).
  static constexpr int kSmemDQ = 2 * 2 * BM * 32 * 4;
  // K, V, Q[2], dO[2], dS^T, dQ[2], then lse[2][BM], delta[2][BM] (f32)
  static constexpr int kSmem = 2 * kSmemKV + 4 * kSmemQ + kSmemDS + 2 * kSmemDQ + 4 * BM * 4 + 1024;
  static_assert(kSmem <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

// Adds the box at `src` (shared memory) into the f32 tensor of `tmap` at (c0, c1, c2, c3), in this
// thread's current bulk async-group.
__device__ __forceinline__ void tma_reduce_add_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(tmap)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
}

// ---- the steps of one query tile, shared by both kernels (one warpgroup's 64 keys each) --------

// Which key rows this thread's accumulator fragments hold (rows lg and lg + 8 of its warp's 16) and
// their documents, for the mask.
struct KeyRows {
  int key0, key1;
  // The queries that may see each key: its document, cut at the key's window (so the mask's
  // document test is the window's too).
  DocSpan d0, d1;
};

// The window the kernels use: 0 where it cannot mask anything (at least T).
__device__ __forceinline__ int window_of(const FlashAttnParams& prm) {
  return prm.window > 0 && prm.window < prm.T ? static_cast<int>(prm.window) : 0;
}

// S^T = K_wg Q^T and dP^T = V_wg dO^T (64 keys x BM queries each). kTwoGroups: S^T and dP^T in
// two commit groups (S^T can be waited for alone), else one.
template <class T, class C, bool kTwoGroups>
__device__ __forceinline__ void issue_st_dpt(float* st, float* dp, uint32_t k_wg, uint32_t v_wg, uint32_t sQ, uint32_t sdO) {
  constexpr int D = C::D, BN = C::BN, BM = C::BM;
  fence_regs<BM / 2>(st);
  fence_regs<BM / 2>(dp);
  const uint64_t dk = make_desc(k_wg, 16, 1024), dv = make_desc(v_wg, 16, 1024), dq = make_desc(sQ, 16, 1024),
                 ddo = make_desc(sdO, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t koff = (kk / 4) * Sw128<BN>::kSlab + (kk % 4) * 32;
    const uint32_t qoff = (kk / 4) * Sw128<BM>::kSlab + (kk % 4) * 32;
    Wgmma<T>::template ss<BM>(st, desc_plus(dk, koff), desc_plus(dq, qoff), kk > 0);
  }
  if constexpr (kTwoGroups) wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t koff = (kk / 4) * Sw128<BN>::kSlab + (kk % 4) * 32;
    const uint32_t qoff = (kk / 4) * Sw128<BM>::kSlab + (kk % 4) * 32;
    Wgmma<T>::template ss<BM>(dp, desc_plus(dv, koff), desc_plus(ddo, qoff), kk > 0);
  }
  wgmma_commit();
}

// Column group i (4 values of the accumulator layout) of a 64 x BM tile as half of the A fragment
// of k-step i / 2: (i even) a0, a1, (odd) a2, a3.
template <class T>
__device__ __forceinline__ void pack_group(uint32_t (*a)[4], int i, const float* v) {
  a[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(v[0], v[1]);
  a[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(v[2], v[3]);
}

// st: S^T in, P^T = exp(scale S^T - lse) out (f32; masked entries exactly 0); pa: P^T as the A
// fragments of dV's product. lse holds the tile's rows' log-sum-exp times lse_mul (kLog2e for the
// natural-log values, 1 for values already in base 2).
template <class T, class C, bool kPack = true>
__device__ __forceinline__ void probabilities(float* st, uint32_t (*pa)[4], const float* lse, float lse_mul, float scale_log2,
                                              bool need_mask, int q0, int T_len, bool causal, const KeyRows& kr, int lt) {
  constexpr int BM = C::BM;
#pragma unroll
  for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int qi = i * 8 + 2 * lt + (e & 1);
      float v = fast_exp2(st[i * 4 + e] * scale_log2 - lse[qi] * lse_mul);
      if (need_mask) {
        const int q = q0 + qi;
        const int key = e < 2 ? kr.key0 : kr.key1;
        const DocSpan& d = e < 2 ? kr.d0 : kr.d1;
        const bool ok = q < T_len && key < T_len && q >= d.start && q < d.end && (!causal || q >= key);
        if (!ok) v = 0.0f;
      }
      st[i * 4 + e] = v;
    }
    if constexpr (kPack) pack_group<T>(pa, i, st + i * 4);
  }
}

// P^T (f32, from probabilities<..., false>) as the A fragments of dV's product.
template <class T, class C>
__device__ __forceinline__ void pack_probabilities(const float* st, uint32_t (*pa)[4]) {
#pragma unroll
  for (int i = 0; i < C::BM / 8; ++i) pack_group<T>(pa, i, st + i * 4);
}

// dS^T = P^T (dP^T - delta) scale as the A fragments of dK's product (da), also stored into the
// [key][query] tile sdS (one 64-column slab) that dQ's product reads; `row` is this thread's first
// key row in it.
template <class T, class C>
__device__ __forceinline__ void score_grads(const float* pt, const float* dp, uint32_t (*da)[4], const float* delta, float scale,
                                            uint32_t sdS, int row, int lt) {
  constexpr int BM = C::BM, BN = C::BN;
#pragma unroll
  for (int i = 0; i < BM / 8; ++i) {
    float dsv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) dsv[e] = pt[i * 4 + e] * (dp[i * 4 + e] - delta[i * 8 + 2 * lt + (e & 1)]) * scale;
    pack_group<T>(da, i, dsv);
    const int col = i * 8 + 2 * lt;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>::offset(row, col)), "r"(da[i / 2][(i & 1) * 2 + 0]));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>::offset(row + 8, col)), "r"(da[i / 2][(i & 1) * 2 + 1]));
  }
}

// acc (64 keys x D) += A (64 keys x BM queries, registers) B (BM x D, MN-major in shared memory):
// dV += P^T dO and dK += dS^T Q. No fence or commit.
template <class T, class C>
__device__ __forceinline__ void issue_kv_grad(float* acc, uint32_t (*a)[4], uint32_t sB) {
  const uint64_t db = make_desc(sB, Sw128<C::BM>::kSlab, 1024);
#pragma unroll
  for (int kk = 0; kk < C::BM / 16; ++kk) Wgmma<T>::template rs_tb<C::D>(acc, a[kk], desc_plus(db, kk * 2048));
}

// dq (64 queries x 64 columns) = dS K: head_dim 128, this warpgroup's 64 columns over all BN keys;
// head_dim 64, all columns over this warpgroup's 64 keys, or with 128-query tiles (kDqRows) its 64
// query rows (dS^T's column slab wg) over all BN keys. No fence or commit.
template <class T, class C>
__device__ __forceinline__ void issue_dq(float* dq, uint32_t sdS, uint32_t sK, int wg) {
  constexpr int BN = C::BN, kSteps = C::kDqRows || C::kSplitN ? BN / 16 : 64 / 16;
  // A = dS (dS^T's column slab wg with kDqRows), B = K (column slab wg with kSplitN); without
  // either, both start at this warpgroup's 64 keys.
  const uint32_t a0 = C::kDqRows ? sdS + wg * Sw128<BN>::kSlab : C::kSplitN ? sdS : sdS + wg * 4 * 2048;
  const uint32_t b0 = C::kDqRows ? sK : C::kSplitN ? sK + wg * Sw128<BN>::kSlab : sK + wg * 4 * 2048;
  const uint64_t da = make_desc(a0, Sw128<BN>::kSlab, 1024), db = make_desc(b0, Sw128<BN>::kSlab, 1024);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) Wgmma<T>::template ss_tt<64>(dq, desc_plus(da, kk * 2048), desc_plus(db, kk * 2048), kk > 0);
}

// dQ's product issued and waited for (with every product still in flight: dV's and dK's), the
// accumulators and the A fragments pinned past the wait.
template <class T, class C>
__device__ __forceinline__ void dq_product(float* dq, float* dk, float* dv, uint32_t (*pa)[4], uint32_t (*da)[4], uint32_t sdS,
                                           uint32_t sK, int wg) {
  fence_regs<32>(dq);
  wgmma_fence();
  issue_dq<T, C>(dq, sdS, sK, wg);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs<32>(dq);
  fence_regs<C::D / 2>(dv);
  fence_regs<C::D / 2>(dk);
  fence_regs<C::BM / 4>(&pa[0][0]);
  fence_regs<C::BM / 4>(&da[0][0]);
}

// This warpgroup's 64 x 64 dQ share into its two swizzled [64][32] f32 boxes at `half` (8 KiB each).
__device__ __forceinline__ void stage_dq(const float* dq, uint32_t half, int wl, int lg, int lt) {
  const int rr0 = wl * 16 + lg;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int j = (i % 4) * 2 + lt / 2;  // 16-byte chunk of the 128-byte box row
    const uint32_t box = half + (i / 4) * 8192 + (lt % 2) * 8;
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(box + rr0 * 128 + ((j ^ (rr0 & 7)) * 16)), "f"(dq[i * 4 + 0]),
                 "f"(dq[i * 4 + 1]));
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(box + (rr0 + 8) * 128 + ((j ^ ((rr0 + 8) & 7)) * 16)),
                 "f"(dq[i * 4 + 2]), "f"(dq[i * 4 + 3]));
  }
}

// dK, dV of this warp's 16 keys: staged in the K and V tiles (own rows only), then 16-byte stores.
template <class T, class C>
__device__ __forceinline__ void store_dk_dv(const float* dk, const float* dv, uint32_t sK, uint32_t sV, int r_loc, int lane,
                                            int c0, int T_len, T* dkh, T* dvh, int64_t dk_stride, int64_t dv_stride) {
  constexpr int D = C::D, BN = C::BN;
  const int lg = lane / 4, lt = lane % 4;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = i * 8 + 2 * lt;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Sw128<BN>::offset(r_loc + lg, col)), "r"(Mma<T>::pack(dk[i * 4 + 0], dk[i * 4 + 1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Sw128<BN>::offset(r_loc + lg + 8, col)), "r"(Mma<T>::pack(dk[i * 4 + 2], dk[i * 4 + 3])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Sw128<BN>::offset(r_loc + lg, col)), "r"(Mma<T>::pack(dv[i * 4 + 0], dv[i * 4 + 1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Sw128<BN>::offset(r_loc + lg + 8, col)), "r"(Mma<T>::pack(dv[i * 4 + 2], dv[i * 4 + 3])));
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int key = c0 + r_loc + r;
    if (key < T_len) {
      int4 a, v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w)
                   : "r"(sK + Sw128<BN>::offset(r_loc + r, c * 8)));
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(sV + Sw128<BN>::offset(r_loc + r, c * 8)));
      *reinterpret_cast<int4*>(dkh + static_cast<int64_t>(key) * dk_stride + c * 8) = a;
      *reinterpret_cast<int4*>(dvh + static_cast<int64_t>(key) * dv_stride + c * 8) = v;
    }
  }
}

// Which (key tile, kv head, batch row) work number idx is (both kernels). With one block per work on
// a 1-D grid, blocks start in about index order (the orders below are for that case; the
// warp-specialised kernel's persistent blocks go head by head, keyfast, by default). Causal: key tile slowest, so every block of key tile 0 (the
// longest walk, T/64 query tiles) starts first and the short walks of the last key tiles fill the
// tail (GQA T=4096 +13%, T=8192 +5-6% on an H200). Otherwise key tile fastest: a head's blocks run
// together and share its Q and dO tiles in L2 (the causal order there was 4% slower). The walk:
// `total` query tiles, head by head of the group, from q_begin.
struct BwdWalk {
  int c0, g, b, group, q_begin, n_q, total;
  // key_slowest: the causal order above (false: key tile fastest whatever the mask). group_kt > 1
  // (with key_slowest): key tiles in groups of group_kt, the groups heaviest first, within a group
  // every head's group_kt key tiles next to each other (so about 132 / group_kt heads run at once,
  // each with group_kt blocks sharing its Q, dO and dQ tiles in L2).
  // idx: the work's number (the block's own on a grid of one block per key tile).
  __device__ __forceinline__ BwdWalk(const FlashAttnParams& prm, int BN, int BM, bool key_slowest, int group_kt = 1,
                                     int idx = static_cast<int>(blockIdx.x)) {
    const int T_len = static_cast<int>(prm.T), KVH = static_cast<int>(prm.KVH);
    group = static_cast<int>(prm.H) / KVH;
    const int n_kt = (T_len + BN - 1) / BN, kvh_b = KVH * static_cast<int>(prm.B);
    int kt = key_slowest ? idx / kvh_b : idx % n_kt, rest = key_slowest ? idx % kvh_b : idx / n_kt;
    if (key_slowest && group_kt > 1) {
      const int full = n_kt / group_kt, in_full = full * group_kt * kvh_b;
      const int gsize = idx < in_full ? group_kt : n_kt - full * group_kt;
      const int r = idx < in_full ? idx % (group_kt * kvh_b) : idx - in_full;
      kt = (idx < in_full ? idx / (group_kt * kvh_b) : full) * group_kt + r % gsize;
      rest = r / gsize;
    }
    c0 = kt * BN, g = rest % KVH, b = rest / KVH;
    const int num_docs = static_cast<int>(prm.num_docs);
    const int c_last = min(c0 + BN, T_len) - 1;
    const DocSpan first_doc = doc_of(prm.cu_seqlens, num_docs, b, c0, T_len);
    const DocSpan last_doc = doc_of(prm.cu_seqlens, num_docs, b, c_last, T_len);
    q_begin = prm.causal ? max(first_doc.start, c0) : first_doc.start;
    // A window ends the queries at the last key's window (later queries see none of these keys).
    const int window = window_of(prm);
    const int q_end = window > 0 ? min(last_doc.end, c_last + window) : last_doc.end;
    n_q = q_end > q_begin ? (q_end - q_begin + BM - 1) / BM : 0;
    total = n_q * group;
  }
  __device__ __forceinline__ int head(int it) const { return g * group + it / n_q; }
  __device__ __forceinline__ int q0(int it, int BM) const { return q_begin + (it % n_q) * BM; }
  // Whether a query tile needs the element mask (ragged edges, documents, the causal diagonal, the
  // window's far edge).
  __device__ __forceinline__ bool need_mask(const FlashAttnParams& prm, int q0, int BM, int BN) const {
    const int T_len = static_cast<int>(prm.T), window = window_of(prm);
    return prm.cu_seqlens != nullptr || q0 + BM > T_len || c0 + BN > T_len || (prm.causal && q0 < c0 + BN - 1) ||
           (window > 0 && q0 + BM - window > c0);
  }
};

__device__ __forceinline__ KeyRows key_rows(const FlashAttnParams& prm, int b, int key0) {
  const int T_len = static_cast<int>(prm.T), num_docs = static_cast<int>(prm.num_docs);
  KeyRows kr;
  kr.key0 = key0, kr.key1 = key0 + 8;
  kr.d0 = doc_of(prm.cu_seqlens, num_docs, b, min(kr.key0, T_len - 1), T_len);
  kr.d1 = doc_of(prm.cu_seqlens, num_docs, b, min(kr.key1, T_len - 1), T_len);
  if (const int window = window_of(prm); window > 0) {  // query q sees key j only if q - j < window
    kr.d0.end = min(kr.d0.end, kr.key0 + window);
    kr.d1.end = min(kr.d1.end, kr.key1 + window);
  }
  return kr;
}

// ---- kernel 1: every thread loads (cp.async, two Q/dO buffers) and computes -------------------
template <class T, class C>
__global__ void __launch_bounds__(C::kThreads, 1) flash_bwd_sm90_kernel(const FlashBwdPointers p, const FlashAttnParams prm_in,
                                                                      const __grid_constant__ CUtensorMap tmap_dq, const int dq_tma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BN = C::BN, BM = C::BM;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t sK = base, sV = sK + C::kSmemKV;
  const uint32_t sQ0 = sV + C::kSmemKV, sdO0 = sQ0 + 2 * C::kSmemQ, sdS = sdO0 + 2 * C::kSmemQ;
  const uint32_t sdQ0 = sdS + C::kSmemDS;  // 1024-aligned: every region above is a multiple of 1 KiB
  float* s_lse = reinterpret_cast<float*>(smem_raw + (sdQ0 + 2 * C::kSmemDQ - raw));  // [2][BM]
  float* s_delta = s_lse + 2 * BM;                                                // [2][BM]

  const int T_len = static_cast<int>(prm_in.T), H = static_cast<int>(prm_in.H), KVH = static_cast<int>(prm_in.KVH);
  const float scale = prm_in.scale, scale_log2 = prm_in.scale * kLog2e;
  const BwdWalk w(prm_in, BN, BM, prm_in.causal);
  const int c0 = w.c0, g = w.g, b = w.b, total = w.total;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4, wl = warp % 4;
  const int lg = lane / 4, lt = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(H) * D, kv_stride = static_cast<int64_t>(KVH) * D;
  const int64_t row_base = static_cast<int64_t>(b) * T_len;

  load_tile_sw128<BN, D, C::kThreads>(sK, static_cast<const T*>(p.k) + (row_base * KVH + g) * D, kv_stride, c0, T_len);
  load_tile_sw128<BN, D, C::kThreads>(sV, static_cast<const T*>(p.v) + (row_base * KVH + g) * D, kv_stride, c0, T_len);
  cp_async_commit();

  const KeyRows kr = key_rows(prm_in, b, c0 + wg * 64 + wl * 16 + lg);

  auto prefetch = [&](int it, int buf) {
    const int h = w.head(it);
    const int q0 = w.q0(it, BM);
    const int64_t head_off = (row_base * H + h) * D;
    load_tile_sw128<BM, D, C::kThreads>(sQ0 + buf * C::kSmemQ, static_cast<const T*>(p.q) + head_off, q_stride, q0, T_len);
    load_tile_sw128<BM, D, C::kThreads>(sdO0 + buf * C::kSmemQ, static_cast<const T*>(p.dout) + head_off, q_stride, q0, T_len);
    if (threadIdx.x < BM) {
      const int q = q0 + static_cast<int>(threadIdx.x);
      const bool ok = q < T_len;
      const int64_t off = (static_cast<int64_t>(b) * H + h) * T_len + (ok ? q : 0);
      cp_async4(smem_addr(s_lse + buf * BM + threadIdx.x), p.lse + off, ok);
      cp_async4(smem_addr(s_delta + buf * BM + threadIdx.x), p.delta + off, ok);
    }
  };
  if (total > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
  const uint32_t k_wg = sK + wg * 64 * 128, v_wg = sV + wg * 64 * 128;  // this warpgroup's 64 keys

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) prefetch(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const int buf = it & 1;
    const int h = w.head(it);
    const int q0 = w.q0(it, BM);
    const uint32_t sQ = sQ0 + buf * C::kSmemQ, sdO = sdO0 + buf * C::kSmemQ;

    // S^T and dP^T (64 keys x 64 queries per warpgroup), issued together.
    float st[BM / 2], dp[BM / 2];
    issue_st_dpt<T, C, false>(st, dp, k_wg, v_wg, sQ, sdO);
    wgmma_wait<0>();
    fence_regs<BM / 2>(st);
    fence_regs<BM / 2>(dp);

    // P^T and dS^T in registers; masked entries are exactly 0; dS^T also into shared memory.
    uint32_t pa[BM / 16][4], da[BM / 16][4];
    probabilities<T, C>(st, pa, s_lse + buf * BM, kLog2e, scale_log2, w.need_mask(prm_in, q0, BM, BN), q0, T_len, prm_in.causal,
                        kr, lt);
    score_grads<T, C>(st, dp, da, s_delta + buf * BM, scale, sdS, wg * 64 + wl * 16 + lg, lt);

    // dV += P^T dO and dK += dS^T Q (both B operands MN-major: 16 queries per k-step).
    fence_regs<D / 2>(dv);
    fence_regs<D / 2>(dk);
    wgmma_fence();
    issue_kv_grad<T, C>(dv, pa, sdO);
    issue_kv_grad<T, C>(dk, da, sQ);
    wgmma_commit();

    // dQ = dS K once both warpgroups' dS^T rows are in shared memory. The TMA reduce issued from
    // this iteration's dQ buffer two query tiles ago has read it by the time the barrier passes.
    fence_proxy_async();
    if (dq_tma && threadIdx.x == 0) bulk_wait_read<1>();
    __syncthreads();
    float dq[32];  // 64 queries x 64 columns of this warpgroup
    dq_product<T, C>(dq, dk, dv, pa, da, sdS, sK, wg);
    const uint32_t sdQ = sdQ0 + buf * C::kSmemDQ;
    if (dq_tma) {
      stage_dq(dq, sdQ + wg * 2 * 8192, wl, lg, lt);
      fence_proxy_async();  // visible to the TMA unit after the barrier below
    } else {
      const int r0 = q0 + wl * 16 + lg, r1 = r0 + 8;
      const int col0 = C::kSplitN ? wg * 64 : 0;
      float* basep = p.dq_acc + (row_base * H + h) * D + col0 + 2 * lt;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (r0 < T_len) atomic_add2(basep + static_cast<int64_t>(r0) * q_stride + i * 8, dq[i * 4 + 0], dq[i * 4 + 1]);
        if (r1 < T_len) atomic_add2(basep + static_cast<int64_t>(r1) * q_stride + i * 8, dq[i * 4 + 2], dq[i * 4 + 3]);
      }
    }
    __syncthreads();  // this iteration's buffers and dS^T are refilled next
    if (dq_tma && threadIdx.x == 0) {
      // Box k of the buffer: warpgroup k / 2's columns (k % 2) * 32.. of its share (head_dim 128:
      // columns k * 32..; head_dim 64: both warpgroups add their partial sums to columns 0..63).
#pragma unroll
      for (int k = 0; k < 4; ++k)
        tma_reduce_add_4d(&tmap_dq, sdQ + k * 8192, C::kSplitN ? k * 32 : (k % 2) * 32, h, q0, b);
      bulk_commit();
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  store_dk_dv<T, C>(dk, dv, sK, sV, wg * 64 + wl * 16, lane, c0, T_len, static_cast<T*>(p.dk) + (row_base * KVH + g) * D,
                    static_cast<T*>(p.dv) + (row_base * KVH + g) * D, kv_stride, kv_stride);
  if (dq_tma && threadIdx.x == 0) bulk_wait<0>();  // the reduces have read shared memory and are done
#else
  __trap();  // built for an architecture without wgmma: the launcher never selects this kernel there
#endif
}

// ---- kernel 2: warp specialisation (FlashAttention-3 style) ----------------------------------
// Warpgroup 0 gives up its registers (setmaxnreg) and one of its threads loads by TMA: K and V
// once, then per query tile Q, dO and the tile's (lse in base 2, delta) rows into a two-stage ring
// with full / empty mbarriers. The two consumer warpgroups never wait for a block-wide barrier:
// per tile, S^T and dP^T are issued as two groups, P^T is computed while dP^T runs and dV's
// product is issued before dS^T is formed (the 128-query tiles at head_dim 64 form dS^T first,
// for registers: BwdWsConfig's Order_); dK's product runs while the warpgroups meet at one
// named barrier (head_dim 128 and 128-query tiles: dQ's product needs both warpgroups' dS^T rows;
// head_dim 64 with 64-query tiles: each warpgroup's dQ partial uses its own rows only, so the
// barrier is its own); dS^T is double-
// buffered so the next tile's rows never wait for this tile's dQ product. Each warpgroup stages its
// own dQ share and one of its threads adds it by TMA reduce-adds.
template <int D_, int Stages, int DqBufs, int BM_ = 64, int Order_ = 0>
struct BwdWsConfig : BwdSm90Config<D_> {
  using Base = BwdSm90Config<D_>;
  static constexpr int kThreads = 384, kStages = Stages, kDqBufs = DqBufs;
  // Query rows a tile: 64, or 128 at head_dim 64 (twice the independent work between the
  // warpgroups' barriers; dQ is then split between the warpgroups by query rows).
  static constexpr int BM = BM_;
  static_assert(BM == 64 || (BM == 128 && D_ == 64), "128-query tiles at head_dim 64 only");
  static constexpr bool kDqRows = BM == 128;
  // dQ's product committed before dK's, whose product then runs on under the dQ staging and the
  // next tile's first products: +1-2% with 128-query tiles at head_dim 64, -7% at head_dim 128
  // (two binaries, H200), so only there.
  // DsFirst (128-query tiles): the order FlashAttention-3 uses, for registers. With 128 queries a
  // warpgroup holds S^T and dP^T as 64 + 64 floats a thread beside dK and dV (32 + 32); the order
  // above (dV's product issued from P^T's fragments before dS^T is formed, dK's product still
  // running into the next tile) also keeps P^T's fragments (32) and dS^T's (32) live there, more
  // than the consumers' 240 registers, and ptxas then serialises every wgmma of the kernel
  // (C7512) and spills. DsFirst forms dS^T from P^T and dP^T first (waiting for dP^T), then packs
  // P^T and issues dV's and dK's products together, and has no late dK: at most S^T + dP^T + dK +
  // dV (192 floats) are live at once.
  // Order_ (PRIMUS_TURBO_ATTN_BWD_DS_FIRST): 0 the order above (with the late dK at 128-query
  // tiles); 1 DsFirst, dV's and dK's products issued together before the dQ barrier; 2 (default)
  // DsFirst with dV's product before the barrier and dK's after dQ's, so that waiting for dQ
  // leaves dK's product running under the dQ staging (within the tile: into the next one it would
  // hold dS^T's fragments beside the next S^T and dP^T again). H200, one process:
  // 1 vs 0 +9-13%, 2 vs 1 +1.5-2.6% at GPT-2 and Llama-like shapes. A fourth order (dV's product
  // before dS^T, with dS^T formed from P^T's bf16 fragments so the f32 P^T need not stay live)
  // measured 6-8% below 2 and changed dQ / dK beyond the sm90 kernel's check: dropped.
  static constexpr bool kDsFirst = Order_ == 1 || Order_ == 2;
  static constexpr bool kDkUnderFlush = Order_ == 2;
  static_assert(Order_ == 0 || BM == 128, "the register-lean orders are the 128-query tiles'");
  static constexpr bool kLateDk = kDqRows && Order_ == 0;
  static constexpr int kSmemQ = BM * D_ * 2, kSmemDS = Base::BN * BM * 2;
  // A query tile's lse (base 2) and delta rows, f32, read from the 16-byte boundary at or before the
  // tile's first row (a box BM + 4 wide; the tile starts (q0 % 4) in), one 128-byte aligned slot per stage.
  static constexpr int kLdBox = BM + 4, kLdBytes = 2 * kLdBox * 4, kSmemLD = (kLdBytes + 127) / 128 * 128;
  // K, V, Q[stages], dO[stages], dS^T[2], dQ staging[DqBufs] (each warpgroup's 64 x 64 share,
  // Base::kSmemDQ), LD[stages], then the mbarriers
  static constexpr int kSmem = 2 * Base::kSmemKV + 2 * kStages * kSmemQ + 2 * kSmemDS + kDqBufs * Base::kSmemDQ +
                               kStages * kSmemLD + 8 * (2 + 2 * kStages) + 1024;
  static_assert(kSmem <= 227 * 1024, "more shared memory than an sm_90 block may have");
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128*24 + 256*240 <= 65536
};

// The TMA descriptors of the warp-specialised kernel.
struct BwdWsMaps {
  CUtensorMap q, dout, k, v, ld, dq;
};

template <class T, class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    flash_bwd_sm90_ws_kernel(const FlashBwdPointers p, const FlashAttnParams prm, const __grid_constant__ BwdWsMaps maps,
                             const int order, const int n_work) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BN = C::BN, BM = C::BM, S = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t sK = base, sV = sK + C::kSmemKV;
  const uint32_t sQ0 = sV + C::kSmemKV, sdO0 = sQ0 + S * C::kSmemQ, sdS0 = sdO0 + S * C::kSmemQ;
  const uint32_t sdQ0 = sdS0 + 2 * C::kSmemDS, sLD0 = sdQ0 + C::kDqBufs * C::kSmemDQ;
  const uint32_t bars = sLD0 + S * C::kSmemLD;
  const uint32_t bar_kv = bars;
  auto full = [&](int st) { return bars + 8u * (1 + st); };
  auto empty = [&](int st) { return bars + 8u * (1 + S + st); };

  const uint32_t kv_empty = bars + 8u * (1 + 2 * S);  // K/V read and dK/dV staged out (8 warps)
  const int T_len = static_cast<int>(prm.T), H = static_cast<int>(prm.H), KVH = static_cast<int>(prm.KVH);
  const bool key_slowest = prm.causal && order != 1;
  // Works (key tile, kv head, batch row) 0 .. n_work - 1 in BwdWalk's order, taken by snake_work
  // (one per block, or persistent blocks several, loading the next work's first Q/dO tiles while
  // they finish the current one).
  if (threadIdx.x == 0) {
    mbar_init(kv_empty, 8);
    mbar_init_ring(bars, S, 8);  // bar_kv, full(st), empty(st); fences the init above too
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // producer warpgroup
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      int r = 0;  // Q/dO/LD tiles issued (ring slot r % S), across works
      auto load_tile = [&](const BwdWalk& w, int it) {
        const int st = r % S;
        if (r >= S) mbar_wait(empty(st), ((r / S) - 1) & 1);
        mbar_expect_tx(full(st), 2 * C::kSmemQ + C::kLdBytes);
        const int h = w.head(it), q0 = w.q0(it, BM);
        for (int slab = 0; slab < D / 64; ++slab) {
          tma_load_bthd(sQ0 + st * C::kSmemQ + slab * Sw128<BM>::kSlab, &maps.q, full(st), slab * 64, h, q0, w.b);
          tma_load_bthd(sdO0 + st * C::kSmemQ + slab * Sw128<BM>::kSlab, &maps.dout, full(st), slab * 64, h, q0, w.b);
        }
        tma_load_3d(sLD0 + st * C::kSmemLD, &maps.ld, full(st), q0 & ~3, 0, w.b * H + h);
        ++r;
      };
      for (int k = 0, idx = snake_work(0); idx < n_work; idx = snake_work(++k)) {
        const BwdWalk w(prm, BN, BM, key_slowest, order, idx);
        const int pre = min(S, w.total);  // these go in before K/V, which wait for the last work's dK/dV
        for (int it = 0; it < pre; ++it) load_tile(w, it);
        if (k > 0) mbar_wait(kv_empty, (k - 1) & 1);
        mbar_expect_tx(bar_kv, 2 * C::kSmemKV);
        for (int slab = 0; slab < D / 64; ++slab) {
          tma_load_bthd(sK + slab * Sw128<BN>::kSlab, &maps.k, bar_kv, slab * 64, w.g, w.c0, w.b);
          tma_load_bthd(sV + slab * Sw128<BN>::kSlab, &maps.v, bar_kv, slab * 64, w.g, w.c0, w.b);
        }
        for (int it = pre; it < w.total; ++it) load_tile(w, it);
      }
    }
    return;
  }

  // two consumer warpgroups
  setmaxnreg_inc<C::kConsumerRegs>();
  const float scale = prm.scale, scale_log2 = prm.scale * kLog2e;
  const int wg = threadIdx.x / 128 - 1, wl = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int lg = lane / 4, lt = lane % 4;
  const bool elected = threadIdx.x % 128 == 0;  // issues this warpgroup's dQ reduce-adds
  const uint32_t k_wg = sK + wg * 64 * 128, v_wg = sV + wg * 64 * 128;  // this warpgroup's 64 keys
  // head_dim 128 and 128-query tiles: dQ's product reads both warpgroups' dS^T rows (barrier 1
  // over 256 threads); head_dim 64 with 64-query tiles: only its own (barrier 2 + wg over 128).
  const int ds_bar = C::kSplitN || C::kDqRows ? 1 : 2 + wg, ds_bar_count = C::kSplitN || C::kDqRows ? 256 : 128;
  // dK / dV's row strides (column slices of a packed gradient, or dense)
  const int64_t dk_row = prm.dk_row ? prm.dk_row : static_cast<int64_t>(KVH) * D;
  const int64_t dv_row = prm.dv_row ? prm.dv_row : static_cast<int64_t>(KVH) * D;

  float dq[32];
  uint32_t pa[BM / 16][4], da[BM / 16][4];
  int r = 0;  // Q/dO/LD tiles consumed (ring slot r % S; dS^T buffer r % 2; dQ staging buffer r % kDqBufs), across works
  int held = -1;  // kLateDk: the ring slot whose Q the last dK product (still running) reads, or -1
  for (int k = 0, idx = snake_work(0); idx < n_work; idx = snake_work(++k)) {
    const BwdWalk w(prm, BN, BM, key_slowest, order, idx);
    const KeyRows kr = key_rows(prm, w.b, w.c0 + wg * 64 + wl * 16 + lg);
    // dQ of tile j (in dq) into this warpgroup's staging half of buffer j % kDqBufs, then its reduce-adds.
    auto flush_dq = [&](int j, int h, int q0) {
      const uint32_t half = sdQ0 + (j % C::kDqBufs) * C::kSmemDQ + wg * 2 * 8192;
      stage_dq(dq, half, wl, lg, lt);
      fence_proxy_async();
      named_sync(2 + wg, 128);
      if (elected) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
          tma_reduce_add_4d(&maps.dq, half + kk * 8192, (C::kSplitN ? wg * 64 : 0) + kk * 32, h, q0 + (C::kDqRows ? wg * 64 : 0),
                            w.b);
        bulk_commit();
      }
    };
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
    mbar_wait(bar_kv, k & 1);

    for (int it = 0; it < w.total; ++it, ++r) {
      const int st_i = r % S;
      mbar_wait(full(st_i), (r / S) & 1);
      const int h = w.head(it), q0 = w.q0(it, BM);
      const uint32_t sQ = sQ0 + st_i * C::kSmemQ, sdO = sdO0 + st_i * C::kSmemQ, sdS = sdS0 + (r & 1) * C::kSmemDS;
      const float* lse = reinterpret_cast<const float*>(smem_raw + (sLD0 + st_i * C::kSmemLD - raw)) + (q0 & 3);
      const float* delta = lse + C::kLdBox;

      float st[BM / 2], dp[BM / 2];
      issue_st_dpt<T, C, true>(st, dp, k_wg, v_wg, sQ, sdO);
      wgmma_wait<1>();  // S^T ready (and with kLateDk the last tile's dK product, committed before it), dP^T may still run
      if constexpr (C::kLateDk) {
        fence_regs<D / 2>(dk);
        if (held >= 0 && lane == 0) mbar_arrive(empty(held));  // that dK product's Q slot
        held = -1;
      }
      fence_regs<BM / 2>(st);
      if constexpr (C::kDsFirst) {
        probabilities<T, C, false>(st, pa, lse, 1.0f, scale_log2, w.need_mask(prm, q0, BM, BN), q0, T_len, prm.causal, kr, lt);
        wgmma_wait<0>();  // dP^T ready
        fence_regs<BM / 2>(dp);
        score_grads<T, C>(st, dp, da, delta, scale, sdS, wg * 64 + wl * 16 + lg, lt);
        pack_probabilities<T, C>(st, pa);
        fence_regs<D / 2>(dv);
        fence_regs<D / 2>(dk);
        wgmma_fence();
        issue_kv_grad<T, C>(dv, pa, sdO);
        if constexpr (!C::kDkUnderFlush) issue_kv_grad<T, C>(dk, da, sQ);
        wgmma_commit();
      } else {
        probabilities<T, C>(st, pa, lse, 1.0f, scale_log2, w.need_mask(prm, q0, BM, BN), q0, T_len, prm.causal, kr, lt);
        fence_regs<D / 2>(dv);
        wgmma_fence();
        issue_kv_grad<T, C>(dv, pa, sdO);
        wgmma_commit();
        wgmma_wait<1>();  // dP^T ready, dV's product may still run
        fence_regs<BM / 2>(dp);
        score_grads<T, C>(st, dp, da, delta, scale, sdS, wg * 64 + wl * 16 + lg, lt);
      }
      if constexpr (!C::kLateDk && !C::kDsFirst) {  // (kDkUnderFlush implies kDsFirst)
        fence_regs<D / 2>(dk);
        wgmma_fence();
        issue_kv_grad<T, C>(dk, da, sQ);
        wgmma_commit();
      }

      // dS^T rows in shared memory for the async proxy; this warpgroup's reduce that last read the
      // dQ buffer to be written next has read it once the barrier passes.
      fence_proxy_async();
      if (elected) bulk_wait_read<C::kDqBufs - 1>();
      named_sync(ds_bar, ds_bar_count);
      if constexpr (C::kLateDk || C::kDkUnderFlush) {
        // dQ's product is committed before dK's, so waiting for it (and dV's) leaves dK's product
        // running under the dQ staging: kDkUnderFlush waits for it after the staging; kLateDk
        // lets it run on under the next tile's S^T / dP^T too, and releases the Q slot dK reads
        // once the next tile's S^T is ready (or after the walk).
        fence_regs<32>(dq);
        fence_regs<D / 2>(dk);
        wgmma_fence();
        issue_dq<T, C>(dq, sdS, sK, wg);
        wgmma_commit();
        issue_kv_grad<T, C>(dk, da, sQ);
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs<32>(dq);
        fence_regs<D / 2>(dv);
        if constexpr (C::kLateDk) fence_regs<D / 2>(dk);
        fence_regs<BM / 4>(&pa[0][0]);
        if constexpr (C::kLateDk) {
          fence_regs<BM / 4>(&da[0][0]);
          held = st_i;
        }
      } else {
        dq_product<T, C>(dq, dk, dv, pa, da, sdS, sK, wg);
        if (lane == 0) mbar_arrive(empty(st_i));  // this warp's reads of Q, dO and the LD rows are done
      }
      flush_dq(r, h, q0);
      if constexpr (C::kDkUnderFlush) {
        wgmma_wait<0>();
        fence_regs<D / 2>(dk);
        fence_regs<BM / 4>(&da[0][0]);
        if (lane == 0) mbar_arrive(empty(st_i));
      }
    }
    if constexpr (C::kLateDk) {
      wgmma_wait<0>();  // the last dK product
      fence_regs<D / 2>(dk);
      fence_regs<BM / 4>(&da[0][0]);
      if (held >= 0 && lane == 0) mbar_arrive(empty(held));
      held = -1;
    }

    // The other warpgroup's last dQ product may still read the K tile that the staging overwrites.
    named_sync(1, 256);
    const int64_t row_base = static_cast<int64_t>(w.b) * T_len;  // dK / dV's rows
    store_dk_dv<T, C>(dk, dv, sK, sV, wg * 64 + wl * 16, lane, w.c0, T_len, static_cast<T*>(p.dk) + row_base * dk_row + w.g * D,
                      static_cast<T*>(p.dv) + row_base * dv_row + w.g * D, dk_row, dv_row);
    fence_proxy_async();  // this warp's staging reads and writes of sK / sV before the next K/V load
    __syncwarp();
    if (lane == 0) mbar_arrive(kv_empty);
  }
  if (elected) bulk_wait<0>();  // the reduces have read shared memory and are done
#else
  __trap();
#endif
}

// PRIMUS_TURBO_ATTN_BWD_DQ=atomic (read on every call, for A/B runs): the threads add dQ with f32
// atomics instead of the TMA reduce-adds.
bool dq_tma_enabled() { return env_choice("PRIMUS_TURBO_ATTN_BWD_DQ", {"tma", "atomic"}, "tma") == "tma"; }

CUtensorMap dq_map(const FlashAttnParams& prm, float* dq_acc, int D, int BM);

template <class T, int D>
void launch(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream) {
  using C = BwdSm90Config<D>;
  auto kernel = flash_bwd_sm90_kernel<T, C>;
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>((prm.T + C::BN - 1) / C::BN * prm.KVH * prm.B));  // see c0 in the kernel
  CUtensorMap tmap{};
  int dq_tma = 0;
  if (encode_tiled() && dq_tma_enabled()) tmap = dq_map(prm, ptrs.dq_acc, D, C::BM), dq_tma = 1;
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(ptrs, prm, tmap, dq_tma);
  CUDA_CHECK_LAST();
}

// dQ's accumulator [B, T, H, D] f32 as a 4-D tensor (d, head, token, batch row) in boxes of
// [64 tokens][32 f32], 128-byte swizzled: token rows past T are clipped, not added to the next
// batch row.
CUtensorMap dq_map(const FlashAttnParams& prm, float* dq_acc, int D, int BM) {
  CUtensorMap tmap{};
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(prm.H), static_cast<cuuint64_t>(prm.T),
                              static_cast<cuuint64_t>(prm.B)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(D) * 4, static_cast<cuuint64_t>(prm.H * D) * 4,
                                 static_cast<cuuint64_t>(prm.T * prm.H * D) * 4};
  const cuuint32_t box[4] = {32, 1, static_cast<cuuint32_t>(BM), 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(&tmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dq_acc, dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "attention backward (sm90): cuTensorMapEncodeTiled failed ({}) for dQ's accumulator [{}][{}][{}][{}]",
               static_cast<int>(r), prm.B, prm.T, prm.H, D);
  return tmap;
}

// The (lse in base 2, delta) rows [B*H][2][ld_stride] f32 in boxes of [2][box]; tokens past T read
// as zeros. The kernel starts each box at a multiple of 4 tokens (16 bytes): a TMA box whose
// innermost start is not 16-byte aligned stopped the kernel with an illegal instruction (H200,
// packed documents, whose query tiles start anywhere).
CUtensorMap ld_map(const FlashAttnParams& prm, const float* ld, int64_t ld_stride, int box_t) {
  CUtensorMap tmap{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(prm.T), 2, static_cast<cuuint64_t>(prm.B * prm.H)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld_stride) * 4, static_cast<cuuint64_t>(2 * ld_stride) * 4};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_t), 2, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&tmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(ld), dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "attention backward (sm90): cuTensorMapEncodeTiled failed ({}) for the lse/delta rows [{}][2][{}]",
               static_cast<int>(r), prm.B * prm.H, ld_stride);
  return tmap;
}

template <class T, class C>
void launch_ws_config(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream) {
  constexpr int D = C::D;
  auto kernel = flash_bwd_sm90_ws_kernel<T, C>;
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  BwdWsMaps maps;
  maps.q = attention_map(ptrs.q, prm.dtype, prm.B, prm.T, prm.H, D, C::BM, "q", prm.q_row);
  maps.dout = attention_map(ptrs.dout, prm.dtype, prm.B, prm.T, prm.H, D, C::BM, "dout");
  maps.k = attention_map(ptrs.k, prm.dtype, prm.B, prm.T, prm.KVH, D, C::BN, "k", prm.k_row);
  maps.v = attention_map(ptrs.v, prm.dtype, prm.B, prm.T, prm.KVH, D, C::BN, "v", prm.v_row);
  maps.ld = ld_map(prm, ptrs.ld, ptrs.ld_stride, C::kLdBox);
  maps.dq = dq_map(prm, ptrs.dq_acc, D, 64);  // each warpgroup adds 64 rows
  const int64_t n_work = (prm.T + C::BN - 1) / C::BN * prm.KVH * prm.B;  // see BwdWalk
  PRIMUS_CHECK(n_work < (int64_t{1} << 31), "attention backward (sm90): {} key tiles of {} keys", n_work, C::BN);
  // Persistent blocks (one per SM, each walking works, so a block loads its next work's first Q/dO
  // tiles under the current one's dK/dV store); PRIMUS_TURBO_ATTN_BWD_PERSISTENT=0 (read on every
  // call, for A/B runs): one block per work.
  const bool persistent = env_choice("PRIMUS_TURBO_ATTN_BWD_PERSISTENT", {"0", "1"}, "1") == "1";
  const dim3 grid(static_cast<unsigned>(persistent ? std::min<int64_t>(n_work, sm_count()) : n_work));
  // PRIMUS_TURBO_ATTN_BWD_ORDER (read on every call, for A/B runs): the causal work order (see
  // BwdWalk): heavy = key tile slowest (heaviest first), keyfast = key tile fastest (a head's
  // works together, sharing its Q, dO and dQ tiles in L2), groupN = heaviest first by groups of
  // N key tiles, each head's N works together.
  // Defaults: persistent blocks keyfast (their snake over rounds balances the causal costs; keyfast
  // against group2 there: +3-10%, H200); one block per work group2 (the hardware hands
  // blocks out in index order, so heavy works must come first, but with one block of each of ~132
  // heads running (heavy) every Q/dO/dQ tile came from DRAM (70% of its bandwidth at T=2048); pairs
  // of key tiles per head halve that (+4-8% at 8x2048x16 heads, within 0.5% elsewhere, H200)).
  const std::string ord = env_choice("PRIMUS_TURBO_ATTN_BWD_ORDER", {"heavy", "keyfast", "group2", "group4", "group8"},
                                     persistent ? "keyfast" : "group2");
  const int order = ord == "keyfast" ? 1 : ord == "heavy" ? 0 : ord[5] - '0';
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(ptrs, prm, maps, order, static_cast<int>(n_work));
  CUDA_CHECK_LAST();
}

template <class T, int D>
void launch_ws(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream) {
  // Two Q/dO stages and two dQ staging buffers: a third stage (head_dim 128: with one staging
  // buffer) measured 1-3% slower on an H200.
  // PRIMUS_TURBO_ATTN_BWD_BM (head_dim 64; read on every call, for A/B runs): query rows a tile,
  // 128 (default; one dQ staging buffer then: two do not fit beside the larger tiles) or 64. 128
  // against 64, in one process on an H200: +6.3% GPT-2, +8.1-8.4% at T = 2048 (GQA and
  // MHA), +9.5% non-causal, +3.7% packed.
  if constexpr (D == 64) {
    if (env_choice("PRIMUS_TURBO_ATTN_BWD_BM", {"64", "128"}, "128") == "128") {
      // PRIMUS_TURBO_ATTN_BWD_DS_FIRST (read on every call, for A/B runs): BwdWsConfig's Order_,
      // 2 (default) and 1 the register-lean orders, 0 dV's product before dS^T and the late dK.
      const std::string order = env_choice("PRIMUS_TURBO_ATTN_BWD_DS_FIRST", {"0", "1", "2"}, "2");
      if (order == "2") launch_ws_config<T, BwdWsConfig<64, 2, 1, 128, 2>>(prm, ptrs, stream);
      else if (order == "1") launch_ws_config<T, BwdWsConfig<64, 2, 1, 128, 1>>(prm, ptrs, stream);
      else launch_ws_config<T, BwdWsConfig<64, 2, 1, 128>>(prm, ptrs, stream);
      return;
    }
  }
  launch_ws_config<T, BwdWsConfig<D, 2, 2>>(prm, ptrs, stream);
}

}  // namespace

bool flash_attention_takes_row_strides(bool backward) {
  if (encode_tiled() == nullptr) return false;
  if (!backward) return flash_forward_kernel() == FwdKernel::Sm90Ws;
  return flash_backward_kernel() == BwdKernel::Sm90Ws && dq_tma_enabled();
}

bool flash_backward_sm90_ws_usable(const FlashBwdPointers& ptrs) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(ptrs.q) | reinterpret_cast<uintptr_t>(ptrs.k) |
                         reinterpret_cast<uintptr_t>(ptrs.v) | reinterpret_cast<uintptr_t>(ptrs.dout);
  return encode_tiled() != nullptr && (bits & 15) == 0 && dq_tma_enabled();
}

void flash_backward_sm90_main(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream) {
  const bool ws = ptrs.ld != nullptr;
  if (prm.dtype == DType::BF16) {
    if (prm.D == 128) ws ? launch_ws<__nv_bfloat16, 128>(prm, ptrs, stream) : launch<__nv_bfloat16, 128>(prm, ptrs, stream);
    else ws ? launch_ws<__nv_bfloat16, 64>(prm, ptrs, stream) : launch<__nv_bfloat16, 64>(prm, ptrs, stream);
  } else {
    if (prm.D == 128) ws ? launch_ws<__half, 128>(prm, ptrs, stream) : launch<__half, 128>(prm, ptrs, stream);
    else ws ? launch_ws<__half, 64>(prm, ptrs, stream) : launch<__half, 64>(prm, ptrs, stream);
  }
}

}  // namespace primus::turbo::cuda
