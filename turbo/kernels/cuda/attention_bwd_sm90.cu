// Flash-attention backward main kernel for Hopper (sm_90a): the five GEMMs on warpgroup MMA.
//
// One block per (key tile of 128 keys, kv head, batch row), two warpgroups of 64 keys each; the
// block walks the 64-query tiles of every query head of its kv head's group (attention_bwd.cu
// runs the delta pass before and the dQ cast after, as for the mma.sync kernel). Per query tile,
// with every operand in 128-byte-swizzled shared memory (attention_sm90_common.cuh):
//   S^T  = K Q^T           wgmma  A = K (smem, K-major)       B = Q (smem, K-major)
//   dP^T = V dO^T          wgmma  A = V (smem, K-major)       B = dO (smem, K-major)
//   P^T = exp(scale S^T - lse),  dS^T = P^T (dP^T - delta) scale      (registers)
//   dV  += P^T dO          wgmma  A = P^T (registers)         B = dO (smem, MN-major)
//   dK  += dS^T Q          wgmma  A = dS^T (registers)        B = Q (smem, MN-major)
//   dQ   = dS K            wgmma  A = dS (smem via dS^T, MN-major)  B = K (smem, MN-major)
// dK/dV stay in registers for the whole walk (deterministic); dQ is added to the f32 accumulator:
// for head_dim 128 each warpgroup takes 64 of dQ's columns over all 128 keys, for head_dim 64 each
// takes its own 64 keys (so both add to every element). Each warpgroup puts its 64 x 64 f32 share
// in shared memory (two 32-column boxes, 128-byte swizzled) and one thread adds the block's boxes
// to the accumulator with TMA reduce-adds (cp.reduce.async.bulk.tensor .add; rows past T are
// clipped by the tensor map), which the block does not wait for: two staging buffers alternate
// between query tiles. Without a TMA descriptor (no driver entry point) the threads add their
// registers with f32 atomics instead.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/attention_flash.h"
#include "turbo/kernels/cuda/attention_mma.cuh"
#include "turbo/kernels/cuda/attention_sm90.h"
#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/attention_wgmma_ops.cuh"
#include "turbo/kernels/cuda/tma_encode.h"

namespace primus::turbo::cuda {
namespace {

using namespace attn;

template <int D_>
struct BwdSm90Config {
  static constexpr int D = D_, BN = 128, BM = 64;
  static constexpr int kThreads = 256;
  static constexpr bool kSplitN = D == 128;  // dQ work split between the warpgroups by columns (else by keys)
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
  const int group = H / KVH;
  const bool causal = prm_in.causal;
  const int32_t* cu = prm_in.cu_seqlens;
  const int num_docs = static_cast<int>(prm_in.num_docs);
  const float scale = prm_in.scale, scale_log2 = prm_in.scale * kLog2e;
  // One block per (key tile, kv head, batch row) on a 1-D grid; blocks start in about index order.
  // Causal: key tile slowest, so every block of key tile 0 (the longest walk, T/64 query tiles)
  // starts first and the short walks of the last key tiles fill the tail (GQA T=4096 +13%, T=8192
  // +5-6% on an H200). Otherwise key tile fastest: a head's blocks run together and share its Q
  // and dO tiles in L2 (the causal order there was 4% slower).
  const int idx = static_cast<int>(blockIdx.x), n_kt = (T_len + BN - 1) / BN, kvh_b = KVH * static_cast<int>(prm_in.B);
  const int kt = prm_in.causal ? idx / kvh_b : idx % n_kt, rest = prm_in.causal ? idx % kvh_b : idx / n_kt;
  const int c0 = kt * BN, g = rest % KVH, b = rest / KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4, wl = warp % 4;
  const int lg = lane / 4, lt = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(H) * D, kv_stride = static_cast<int64_t>(KVH) * D;
  const int64_t row_base = static_cast<int64_t>(b) * T_len;

  load_tile_sw128<BN, D, C::kThreads>(sK, static_cast<const T*>(p.k) + (row_base * KVH + g) * D, kv_stride, c0, T_len);
  load_tile_sw128<BN, D, C::kThreads>(sV, static_cast<const T*>(p.v) + (row_base * KVH + g) * D, kv_stride, c0, T_len);
  cp_async_commit();

  const int c_last = min(c0 + BN, T_len) - 1;
  const DocSpan first_doc = doc_of(cu, num_docs, b, c0, T_len);
  const DocSpan last_doc = doc_of(cu, num_docs, b, c_last, T_len);
  const int q_begin = causal ? max(first_doc.start, c0) : first_doc.start;
  const int q_end = last_doc.end;
  const int n_q = q_end > q_begin ? (q_end - q_begin + BM - 1) / BM : 0;
  const int total = n_q * group;
  const int key0 = c0 + wg * 64 + wl * 16 + lg, key1 = key0 + 8;
  const DocSpan kd0 = doc_of(cu, num_docs, b, min(key0, T_len - 1), T_len);
  const DocSpan kd1 = doc_of(cu, num_docs, b, min(key1, T_len - 1), T_len);
  const bool varlen = cu != nullptr;

  auto prefetch = [&](int it, int buf) {
    const int h = g * group + it / n_q;
    const int q0 = q_begin + (it % n_q) * BM;
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
    const int h = g * group + it / n_q;
    const int q0 = q_begin + (it % n_q) * BM;
    const uint32_t sQ = sQ0 + buf * C::kSmemQ, sdO = sdO0 + buf * C::kSmemQ;
    const float* lse = s_lse + buf * BM;
    const float* delta = s_delta + buf * BM;

    // S^T and dP^T (64 keys x 64 queries per warpgroup), issued together.
    float st[BM / 2], dp[BM / 2];
    fence_regs<BM / 2>(st);
    fence_regs<BM / 2>(dp);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk / 4) * Sw128<BN>::kSlab + (kk % 4) * 32;
      const uint32_t qoff = (kk / 4) * Sw128<BM>::kSlab + (kk % 4) * 32;
      Wgmma<T>::template ss<BM>(st, make_desc(k_wg + koff, 16, 1024), make_desc(sQ + qoff, 16, 1024), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk / 4) * Sw128<BN>::kSlab + (kk % 4) * 32;
      const uint32_t qoff = (kk / 4) * Sw128<BM>::kSlab + (kk % 4) * 32;
      Wgmma<T>::template ss<BM>(dp, make_desc(v_wg + koff, 16, 1024), make_desc(sdO + qoff, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<BM / 2>(st);
    fence_regs<BM / 2>(dp);

    // P^T and dS^T in registers; masked entries are exactly 0.
    const bool need_mask = varlen || q0 + BM > T_len || c0 + BN > T_len || (causal && q0 < c0 + BN - 1);
    uint32_t pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
      float pv[4], dsv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = i * 8 + 2 * lt + (e & 1);
        float v = fast_exp2(st[i * 4 + e] * scale_log2 - lse[qi] * kLog2e);
        if (need_mask) {
          const int q = q0 + qi;
          const int key = e < 2 ? key0 : key1;
          const DocSpan& d = e < 2 ? kd0 : kd1;
          const bool ok = q < T_len && key < T_len && q >= d.start && q < d.end && (!causal || q >= key);
          if (!ok) v = 0.0f;
        }
        pv[e] = v;
        dsv[e] = v * (dp[i * 4 + e] - delta[qi]) * scale;
      }
      pa[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(pv[0], pv[1]);
      pa[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(pv[2], pv[3]);
      da[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(dsv[0], dsv[1]);
      da[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(dsv[2], dsv[3]);
      // dS^T into shared memory ([key][query], one 64-column slab) for the dQ product.
      const int r = wg * 64 + wl * 16 + lg, col = i * 8 + 2 * lt;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>::offset(r, col)), "r"(da[i / 2][(i & 1) * 2 + 0]));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>::offset(r + 8, col)), "r"(da[i / 2][(i & 1) * 2 + 1]));
    }

    // dV += P^T dO and dK += dS^T Q (both B operands MN-major: 16 queries per k-step).
    fence_regs<D / 2>(dv);
    fence_regs<D / 2>(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      Wgmma<T>::template rs_tb<D>(dv, pa[kk], make_desc(sdO + kk * 2048, Sw128<BM>::kSlab, 1024));
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      Wgmma<T>::template rs_tb<D>(dk, da[kk], make_desc(sQ + kk * 2048, Sw128<BM>::kSlab, 1024));
    wgmma_commit();

    // dQ = dS K once both warpgroups' dS^T rows are in shared memory. The TMA reduce issued from
    // this iteration's dQ buffer two query tiles ago has read it by the time the barrier passes.
    fence_proxy_async();
    if (dq_tma && threadIdx.x == 0) bulk_wait_read<1>();
    __syncthreads();
    float dq[32];  // 64 queries x 64 columns of this warpgroup
    fence_regs<32>(dq);
    wgmma_fence();
    if constexpr (C::kSplitN) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<T>::template ss_tt<64>(dq, make_desc(sdS + kk * 2048, Sw128<BN>::kSlab, 1024),
                                     make_desc(sK + wg * Sw128<BN>::kSlab + kk * 2048, Sw128<BN>::kSlab, 1024), kk > 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < 64 / 16; ++kk)
        Wgmma<T>::template ss_tt<64>(dq, make_desc(sdS + (wg * 4 + kk) * 2048, Sw128<BN>::kSlab, 1024),
                                     make_desc(sK + (wg * 4 + kk) * 2048, Sw128<BN>::kSlab, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<32>(dq);
    fence_regs<D / 2>(dv);
    fence_regs<D / 2>(dk);
    const uint32_t sdQ = sdQ0 + buf * C::kSmemDQ;
    if (dq_tma) {
      // This warpgroup's 64 x 64 share into its two swizzled [64][32] boxes (see kSmemDQ).
      const uint32_t half = sdQ + wg * 2 * 8192;
      const int rr0 = wl * 16 + lg;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int j = (i % 4) * 2 + lt / 2;  // 16-byte chunk of the 128-byte box row
        const uint32_t box = half + (i / 4) * 8192 + (lt % 2) * 8;
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(box + rr0 * 128 + ((j ^ (rr0 & 7)) * 16)),
                     "f"(dq[i * 4 + 0]), "f"(dq[i * 4 + 1]));
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(box + (rr0 + 8) * 128 + ((j ^ ((rr0 + 8) & 7)) * 16)),
                     "f"(dq[i * 4 + 2]), "f"(dq[i * 4 + 3]));
      }
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

  // dK, dV: stage each warp's 16 rows in the K and V tiles (own rows only), then 16-byte stores.
  const int r_loc = wg * 64 + wl * 16;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = i * 8 + 2 * lt;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Sw128<BN>::offset(r_loc + lg, col)), "r"(Mma<T>::pack(dk[i * 4 + 0], dk[i * 4 + 1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Sw128<BN>::offset(r_loc + lg + 8, col)), "r"(Mma<T>::pack(dk[i * 4 + 2], dk[i * 4 + 3])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Sw128<BN>::offset(r_loc + lg, col)), "r"(Mma<T>::pack(dv[i * 4 + 0], dv[i * 4 + 1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Sw128<BN>::offset(r_loc + lg + 8, col)), "r"(Mma<T>::pack(dv[i * 4 + 2], dv[i * 4 + 3])));
  }
  __syncwarp();
  T* dkh = static_cast<T*>(p.dk) + (row_base * KVH + g) * D;
  T* dvh = static_cast<T*>(p.dv) + (row_base * KVH + g) * D;
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
      *reinterpret_cast<int4*>(dkh + static_cast<int64_t>(key) * kv_stride + c * 8) = a;
      *reinterpret_cast<int4*>(dvh + static_cast<int64_t>(key) * kv_stride + c * 8) = v;
    }
  }
  if (dq_tma && threadIdx.x == 0) bulk_wait<0>();  // the reduces have read shared memory and are done
#else
  __trap();  // built for an architecture without wgmma: the launcher never selects this kernel there
#endif
}

// PRIMUS_TURBO_ATTN_BWD_DQ=atomic (read on every call, for A/B runs): the threads add dQ with f32
// atomics instead of the TMA reduce-adds.
bool dq_tma_enabled() { return env_choice("PRIMUS_TURBO_ATTN_BWD_DQ", {"tma", "atomic"}, "tma") == "tma"; }

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
  // dQ's accumulator [B, T, H, D] f32 as a 4-D tensor (d, head, token, batch row) in boxes of
  // [64 tokens][32 f32], 128-byte swizzled: token rows past T are clipped, not added to the next
  // batch row.
  CUtensorMap tmap{};
  int dq_tma = 0;
  if (encode_tiled() && dq_tma_enabled()) {
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(prm.H), static_cast<cuuint64_t>(prm.T),
                                static_cast<cuuint64_t>(prm.B)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(D) * 4, static_cast<cuuint64_t>(prm.H * D) * 4,
                                   static_cast<cuuint64_t>(prm.T * prm.H * D) * 4};
    const cuuint32_t box[4] = {32, 1, static_cast<cuuint32_t>(C::BM), 1};
    const cuuint32_t elem[4] = {1, 1, 1, 1};
    const CUresult r = encode_tiled()(&tmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ptrs.dq_acc, dims, strides, box, elem,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    PRIMUS_CHECK(r == CUDA_SUCCESS, "attention backward (sm90): cuTensorMapEncodeTiled failed ({}) for dQ's accumulator [{}][{}][{}][{}]",
                 static_cast<int>(r), prm.B, prm.T, prm.H, D);
    dq_tma = 1;
  }
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(ptrs, prm, tmap, dq_tma);
  CUDA_CHECK_LAST();
}

}  // namespace

void flash_backward_sm90_main(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream) {
  if (prm.dtype == DType::BF16) {
    if (prm.D == 128) launch<__nv_bfloat16, 128>(prm, ptrs, stream); else launch<__nv_bfloat16, 64>(prm, ptrs, stream);
  } else {
    if (prm.D == 128) launch<__half, 128>(prm, ptrs, stream); else launch<__half, 64>(prm, ptrs, stream);
  }
}

}  // namespace primus::turbo::cuda
