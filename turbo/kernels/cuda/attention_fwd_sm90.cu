// Flash-attention forward for Hopper (sm_90a): both GEMMs on warpgroup MMA (wgmma).
//
// One block per (query tile of 128 rows, head, batch row) with two warpgroups of 64 rows each.
// Q, K and V tiles sit in shared memory in the 128-byte-swizzled layout wgmma reads directly
// (each 64-column slab of a tile is [rows][64] with 128-byte rows, 16-byte chunk c of row r at
// c ^ (r % 8)); K/V tiles of 128 keys are double-buffered with cp.async. Per key tile a warpgroup
//   S = Q K^T     wgmma, A and B from shared memory (both K-major)
//   softmax       in registers (the accumulator layout is mma.sync's, per warp), base 2
//   O += P V      wgmma, A = P from registers, B = V from shared memory (MN-major)
// Compared with the mma.sync kernel (attention_fwd.cu) this removes the ldmatrix traffic and uses
// the wider tensor-core path. Three kernels share that per-warpgroup loop (FwdWarpgroup):
// flash_fwd_sm90_ws_kernel (the default; FlashAttention-3 style: a producer warpgroup loads Q and
// K/V stages with TMA under mbarriers while two consumer warpgroups overlap each tile's softmax
// with the previous tile's P V), the same overlapped loop fed by cp.async from every thread
// (sm90pipe), and the serial loop (sm90); PRIMUS_TURBO_ATTN_KERNEL picks one (docs/attention.md).
// In the warp-specialised kernel the two consumer warpgroups also take turns to issue their
// products (FlashAttention-3's ping-pong: one's softmax runs under the other's GEMMs), and its
// blocks are persistent (one per SM walking query tiles, WsTiles). Not done: FP8.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "core/util/error.h"
#include "turbo/core/env_switch.h"
#include "turbo/core/cuda_check.h"
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

struct Sm90Args {
  const void *q, *k, *v;
  void* out;
  float* lse;
  const int32_t* cu;
  int num_docs;
  int T, H, KVH;
  float scale_log2;
  bool causal;
  int window;             // 0: none; else query t sees keys > t - window
  uint32_t v_lbo, v_sbo;  // descriptor offsets of the MN-major V operand
  int B = 1;              // batch rows (the warp-specialised kernel's tile count)
};

constexpr int kBM = 128, kBN = 128;  // query rows per block (two warpgroups), keys per tile

// Where a block works: its query tile, its head, and the key range its rows can see (from the
// document start of its first row to its last row (causal) or its last row's document end).
struct BlockGeometry {
  int q0, h, b, g, k_begin, k_end, n_tiles;
  // The block's own tile: grid (query tiles, heads, batch rows), causal tiles heaviest first.
  __device__ __forceinline__ explicit BlockGeometry(const Sm90Args& p)
      : BlockGeometry(p, p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z) {}
  __device__ __forceinline__ BlockGeometry(const Sm90Args& p, int m_tile, int h_, int b_) {
    h = h_, b = b_, g = h / (p.H / p.KVH);
    q0 = m_tile * kBM;
    const int q_last = min(q0 + kBM, p.T) - 1;
    k_begin = doc_of(p.cu, p.num_docs, b, q0, p.T).start;
    // Keys before the first row's window are seen by no row of the block.
    if (p.window > 0) k_begin = max(k_begin, q0 - p.window + 1);
    k_end = p.causal ? q_last + 1 : doc_of(p.cu, p.num_docs, b, q_last, p.T).end;
    n_tiles = k_end > k_begin ? (k_end - k_begin + kBN - 1) / kBN : 0;
  }
};

// One warpgroup's share of a block: 64 query rows, their O accumulator (64 x D, f32) and
// online-softmax state in registers, and the steps of the flash-attention loop over key tiles.
// kFuse: the softmax keeps scores unscaled until exp2(s * scale_log2 - max) (one FFMA per score)
// and scales each tile's maximum once; only for scale_log2 > 0, which keeps the order.
template <class T, int D, bool kFuse = false>
struct FwdWarpgroup {
  static constexpr int BM = kBM, BN = kBN;
  float o[D / 2];          // D/8 column groups x 4 (the accumulator layout of wgmma)
  float s[BN / 2];         // scores, then probabilities, of the current key tile
  uint32_t pa[BN / 16][4]; // probabilities as A fragments of the P V product
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  int row0, row1, lt, lg, k_begin, k_end, q0;
  DocSpan d0, d1;
  bool causal, varlen;
  int window;
  float scale_log2;
  uint32_t q_wg, v_lbo, v_sbo;

  // wg: 0 or 1 (which 64 rows of the block); sQ: the block's Q tile.
  __device__ __forceinline__ FwdWarpgroup(const Sm90Args& p, const BlockGeometry& geo, int wg, uint32_t sQ) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    lg = lane / 4, lt = lane % 4;
    q0 = geo.q0, k_begin = geo.k_begin, k_end = geo.k_end;
    row0 = geo.q0 + wg * 64 + warp * 16 + lg, row1 = row0 + 8;
    d0 = doc_of(p.cu, p.num_docs, geo.b, min(row0, p.T - 1), p.T);
    d1 = doc_of(p.cu, p.num_docs, geo.b, min(row1, p.T - 1), p.T);
    // The keys each row may see: its document, cut at the row's window (row t sees key j only if
    // t - j < window), so the mask's document test is the window's too.
    if (p.window > 0) d0.start = max(d0.start, row0 - p.window + 1), d1.start = max(d1.start, row1 - p.window + 1);
    causal = p.causal, varlen = p.cu != nullptr, window = p.window, scale_log2 = p.scale_log2;
    q_wg = sQ + wg * 64 * 128;  // this warpgroup's rows inside each Q slab
    v_lbo = p.v_lbo, v_sbo = p.v_sbo;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  }

  // S = Q K^T (64 x BN), issued asynchronously as one wgmma group.
  __device__ __forceinline__ void issue_s(uint32_t sK) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk % 4) * 32;  // 16 columns = 32 bytes into the slab's rows
      const uint64_t da = make_desc(q_wg + (kk / 4) * Sw128<BM>::kSlab + koff, 16, 1024);
      const uint64_t db = make_desc(sK + (kk / 4) * Sw128<BN>::kSlab + koff, 16, 1024);
      Wgmma<T>::template ss<BN>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // O += P V, P from registers, issued asynchronously as one wgmma group.
  __device__ __forceinline__ void issue_pv(uint32_t sV) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) Wgmma<T>::template rs_tb<D>(o, pa[kk], make_desc(sV + kk * 2048, v_lbo, v_sbo));
    wgmma_commit();
  }
  // Softmax of key tile j in place: s becomes exp2(scaled score - new max); returns the factors
  // that rescale the old O (applied by rescale_o once O is no longer being written).
  __device__ __forceinline__ void softmax(int j, float& alpha0, float& alpha1) {
    const int k0 = k_begin + j * BN;
    if constexpr (!kFuse) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] *= scale_log2;
    }
    // The window masks a tile whose first key lies before the block's last row's window.
    const bool need_mask = k0 + BN > k_end || (causal && k0 + BN - 1 > q0) || varlen || (window > 0 && k0 < q0 + BM - window);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + i * 8 + 2 * lt + (e & 1);
          const int row = e < 2 ? row0 : row1;
          const DocSpan& d = e < 2 ? d0 : d1;
          const bool ok = col < k_end && col >= d.start && col < d.end && (!causal || col <= row);
          if (!ok) s[i * 4 + e] = -INFINITY;
        }
      }
    }
    float mx0 = kFuse ? -INFINITY : m0, mx1 = kFuse ? -INFINITY : m1;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      mx0 = fmaxf(mx0, fmaxf(s[i * 4 + 0], s[i * 4 + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[i * 4 + 2], s[i * 4 + 3]));
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
    }
    if constexpr (kFuse) mx0 = fmaxf(m0, mx0 * scale_log2), mx1 = fmaxf(m1, mx1 * scale_log2);
    // A row that has seen only masked keys keeps max -inf; subtract 0 then (exp2(-inf) = 0).
    const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
    alpha0 = fast_exp2(m0 - base0), alpha1 = fast_exp2(m1 - base1);
    m0 = mx0, m1 = mx1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      if constexpr (kFuse) {
        s[i * 4 + 0] = fast_exp2(fmaf(s[i * 4 + 0], scale_log2, -base0));
        s[i * 4 + 1] = fast_exp2(fmaf(s[i * 4 + 1], scale_log2, -base0));
        s[i * 4 + 2] = fast_exp2(fmaf(s[i * 4 + 2], scale_log2, -base1));
        s[i * 4 + 3] = fast_exp2(fmaf(s[i * 4 + 3], scale_log2, -base1));
      } else {
        s[i * 4 + 0] = fast_exp2(s[i * 4 + 0] - base0), s[i * 4 + 1] = fast_exp2(s[i * 4 + 1] - base0);
        s[i * 4 + 2] = fast_exp2(s[i * 4 + 2] - base1), s[i * 4 + 3] = fast_exp2(s[i * 4 + 3] - base1);
      }
      rs0 += s[i * 4 + 0] + s[i * 4 + 1];
      rs1 += s[i * 4 + 2] + s[i * 4 + 3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
  }
  __device__ __forceinline__ void rescale_o(float alpha0, float alpha1) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i * 4 + 0] *= alpha0, o[i * 4 + 1] *= alpha0;
      o[i * 4 + 2] *= alpha1, o[i * 4 + 3] *= alpha1;
    }
  }
  // Column group i of P is half of the A fragment of k-step i/2: (i even) a0,a1, (odd) a2,a3.
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      pa[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(s[i * 4 + 0], s[i * 4 + 1]);
      pa[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(s[i * 4 + 2], s[i * 4 + 3]);
    }
  }
  // S_j, then softmax, then P_j V_j, one after the other.
  __device__ __forceinline__ void step_serial(int j, uint32_t sK, uint32_t sV) {
    float a0, a1;
    fence_regs<BN / 2>(s);
    wgmma_fence();
    issue_s(sK);
    wgmma_wait<0>();
    fence_regs<BN / 2>(s);
    softmax(j, a0, a1);
    rescale_o(a0, a1);
    pack_p();
    fence_regs<D / 2>(o);
    wgmma_fence();
    issue_pv(sV);
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
  }
  // Pipelined (FlashAttention-3's intra-warpgroup overlap): first tile: S_0 and softmax_0 only.
  // Turn (ping-pong between the two consumer warpgroups, see flash_fwd_sm90_ws_kernel): begin()
  // before a step issues its products, end() right after; NoTurn for the kernels without it.
  struct NoTurn {
    __device__ __forceinline__ void begin() const {}
    __device__ __forceinline__ void end(bool = true) const {}
  };
  template <class Turn = NoTurn>
  __device__ __forceinline__ void step_first(uint32_t sK, const Turn& turn = Turn{}) {
    float a0, a1;
    fence_regs<BN / 2>(s);
    turn.begin();
    wgmma_fence();
    issue_s(sK);
    turn.end();
    wgmma_wait<0>();
    fence_regs<BN / 2>(s);
    softmax(0, a0, a1);  // O is still zero: nothing to rescale
    pack_p();
  }
  // Tile j >= 1: issue S_j and P_{j-1} V_{j-1} together, run softmax_j while the P V product is
  // on the tensor cores, then rescale O. `on_pv_done` runs once V_{j-1} is no longer read.
  template <class F, class Turn = NoTurn>
  __device__ __forceinline__ void step_overlapped(int j, uint32_t sK, uint32_t sV_prev, F&& on_pv_done, const Turn& turn = Turn{}) {
    float a0, a1;
    fence_regs<BN / 2>(s);
    fence_regs<D / 2>(o);
    turn.begin();
    wgmma_fence();
    issue_s(sK);
    issue_pv(sV_prev);
    turn.end();
    wgmma_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
    fence_regs<BN / 2>(s);
    softmax(j, a0, a1);
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
    on_pv_done();
    rescale_o(a0, a1);
    pack_p();
  }
  // Last P V product of the pipelined loop.
  // not_last: a Turn hands over even after this product (a persistent block's next tile follows).
  template <class Turn = NoTurn>
  __device__ __forceinline__ void step_last(uint32_t sV, const Turn& turn = Turn{}, bool not_last = false) {
    fence_regs<D / 2>(o);
    turn.begin();
    wgmma_fence();
    issue_pv(sV);
    turn.end(not_last);
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
  }

  // Normalise, write lse, and store O: staged in this warp's own 16 rows of the Q tile (which
  // nobody reads any more) so the global stores are whole 16-byte row chunks.
  __device__ __forceinline__ void store(const Sm90Args& p, const BlockGeometry& geo, int wg, uint32_t sQ) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
      l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const int T_len = p.T;
    if (lt == 0) {
      float* lse = p.lse + (static_cast<int64_t>(geo.b) * p.H + geo.h) * T_len;
      if (row0 < T_len) lse[row0] = l0 > 0.0f ? (m0 + log2f(l0)) * kLn2 : -INFINITY;
      if (row1 < T_len) lse[row1] = l1 > 0.0f ? (m1 + log2f(l1)) * kLn2 : -INFINITY;
    }
    const int r_loc = wg * 64 + warp * 16;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = i * 8 + 2 * lt;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Sw128<BM>::offset(r_loc + lg, col)),
                   "r"(Mma<T>::pack(o[i * 4 + 0] * inv0, o[i * 4 + 1] * inv0)));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Sw128<BM>::offset(r_loc + lg + 8, col)),
                   "r"(Mma<T>::pack(o[i * 4 + 2] * inv1, o[i * 4 + 3] * inv1)));
    }
    __syncwarp();
    const int64_t q_stride = static_cast<int64_t>(p.H) * D;
    T* oh = static_cast<T*>(p.out) + (static_cast<int64_t>(geo.b) * T_len * p.H + geo.h) * D;
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int i = 0; i < 16 * kChunks / 32; ++i) {
      const int idx = i * 32 + lane;
      const int r = idx / kChunks, c = idx % kChunks;
      const int row = geo.q0 + r_loc + r;
      if (row < T_len) {
        int4 v;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(sQ + Sw128<BM>::offset(r_loc + r, c * 8)));
        *reinterpret_cast<int4*>(oh + static_cast<int64_t>(row) * q_stride + c * 8) = v;
      }
    }
  }
};

// ---- variant 1: all threads load with cp.async ---------------------------------------------
// kPipe: the overlapped loop (K/V in three stages: tile j+1 loads while V_{j-1} and K_j are being
// read); otherwise the serial loop (two stages).
template <int D_, bool kPipe>
struct Sm90Config {
  static constexpr int D = D_, BM = kBM, BN = kBN;
  static constexpr int kThreads = 256;  // two warpgroups of 64 query rows
  static constexpr int kStages = kPipe ? 3 : 2;
  static constexpr int kSmemQ = BM * D * 2, kSmemKV = BN * D * 2;
  static constexpr int kSmem = kSmemQ + 2 * kStages * kSmemKV + 1024;  // + alignment slack
};

template <class T, class C, bool kPipe>
__global__ void __launch_bounds__(C::kThreads, 1) flash_fwd_sm90_kernel(const Sm90Args p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BM = C::BM, BN = C::BN, kStages = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t sQ = base;
  const uint32_t sKV = sQ + C::kSmemQ;  // stage s: K at sKV + 2*s*kSmemKV, V after it
  const BlockGeometry geo(p);
  const int wg = threadIdx.x / 128;
  const int64_t q_stride = static_cast<int64_t>(p.H) * D, kv_stride = static_cast<int64_t>(p.KVH) * D;
  const T* qh = static_cast<const T*>(p.q) + (static_cast<int64_t>(geo.b) * p.T * p.H + geo.h) * D;
  const T* kh = static_cast<const T*>(p.k) + (static_cast<int64_t>(geo.b) * p.T * p.KVH + geo.g) * D;
  const T* vh = static_cast<const T*>(p.v) + (static_cast<int64_t>(geo.b) * p.T * p.KVH + geo.g) * D;
  const int n_tiles = geo.n_tiles;
  auto stage_k = [&](int j) { return sKV + (j % kStages) * 2 * C::kSmemKV; };
  auto load_kv = [&](int j) {
    const uint32_t sk = stage_k(j);
    load_tile_sw128<BN, D, C::kThreads>(sk, kh, kv_stride, geo.k_begin + j * BN, p.T);
    load_tile_sw128<BN, D, C::kThreads>(sk + C::kSmemKV, vh, kv_stride, geo.k_begin + j * BN, p.T);
  };
  FwdWarpgroup<T, D> w(p, geo, wg, sQ);

  load_tile_sw128<BM, D, C::kThreads>(sQ, qh, q_stride, geo.q0, p.T);
  cp_async_commit();
  if (n_tiles > 0) load_kv(0);
  cp_async_commit();

  if constexpr (kPipe) {
    if (n_tiles > 0) {
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      if (n_tiles > 1) load_kv(1);
      cp_async_commit();
      w.step_first(stage_k(0));
      for (int j = 1; j < n_tiles; ++j) {
        cp_async_wait<0>();  // tile j has landed
        fence_proxy_async();
        __syncthreads();     // ... for every thread; and all are past iteration j-1 (stage of j+1 free)
        if (j + 1 < n_tiles) load_kv(j + 1);
        cp_async_commit();
        w.step_overlapped(j, stage_k(j), stage_k(j - 1) + C::kSmemKV, [] {});
      }
      w.step_last(stage_k(n_tiles - 1) + C::kSmemKV);
    }
  } else {
    for (int j = 0; j < n_tiles; ++j) {
      if (j + 1 < n_tiles) load_kv(j + 1);
      cp_async_commit();
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      w.step_serial(j, stage_k(j), stage_k(j) + C::kSmemKV);
      __syncthreads();  // the next iteration's loads overwrite the stage read here
    }
  }
  cp_async_wait<0>();
  w.store(p, geo, wg, sQ);
#else
  __trap();  // built for an architecture without wgmma: the launcher never selects this kernel there
#endif
}

template <class T, int D, bool kPipe>
void launch(const FlashAttnParams& prm, const Sm90Args& a, cudaStream_t stream) {
  using C = Sm90Config<D, kPipe>;
  auto kernel = flash_fwd_sm90_kernel<T, C, kPipe>;
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>((prm.T + C::BM - 1) / C::BM), static_cast<unsigned>(prm.H),
                  static_cast<unsigned>(prm.B));
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(a);
  CUDA_CHECK_LAST();
}

// ---- variant 2: warp specialisation (FlashAttention-3): a producer warp loads with TMA --------
// Warpgroup 0 gives up most of its registers (setmaxnreg) and one of its threads issues the TMA
// copies of Q and of the K/V tiles (three stages) against mbarriers; the two consumer warpgroups
// take the registers and run the overlapped loop, waiting on "full" barriers and releasing each
// stage on its "empty" barrier once the P V product that read it has completed. No block-wide
// barrier is needed inside the loop.
template <int D_>
struct WsConfig {
  static constexpr int D = D_, BM = kBM, BN = kBN;
  static constexpr int kThreads = 384;
  static constexpr int kStages = 3;
  // Q buffers: at head_dim 64 two, so that a persistent block loads its next tile's Q while it
  // finishes the current one; head_dim 128 has no room for a second (3 K/V stages take 192 KiB).
  static constexpr int kQBufs = D == 64 ? 2 : 1;
  static constexpr int kSmemQ = BM * D * 2, kSmemKV = BN * D * 2;
  // Barriers: the ring's (Q buffer 0's load barrier, kStages full, kStages empty), then the other
  // Q buffers' load barriers and every Q buffer's empty barrier.
  static constexpr int kBars = 1 + 2 * kStages + (kQBufs - 1) + kQBufs;
  static constexpr int kSmem = kQBufs * kSmemQ + 2 * kStages * kSmemKV + 1024 + 8 * kBars;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128*40 + 256*232 <= 65536
};
static_assert(WsConfig<128>::kSmem <= 227 * 1024 && WsConfig<64>::kSmem <= 227 * 1024, "shared memory per block");

// The warp-specialised forward's work tiles, numbered 0 .. count - 1 over (query tile, head,
// batch row); blocks take them by snake_work (one per block, or persistent blocks several). Heads are taken in groups of `group`
// (head, batch row) pairs; within a group causal tiles come heaviest first over the group's heads
// (query tile slowest: each round of the grid takes tiles of about equal cost) and non-causal ones
// head by head. group = 1 (the default) goes head by head, causal tiles heaviest first within each
// head; on an H200 it beat groups of all heads and groups sized to keep their K/V in
// L2 (persistent, causal: 497 vs 389 TFLOP/s at 8x2048x16 heads, head_dim 128; equal elsewhere).
struct WsTiles {
  int tiles_m, H, HB, count, group;
  bool causal;
  __device__ __forceinline__ WsTiles(const Sm90Args& p, int group_)
      : tiles_m((p.T + kBM - 1) / kBM), H(p.H), HB(p.H * p.B), count(tiles_m * HB), group(group_), causal(p.causal) {}
  __device__ __forceinline__ BlockGeometry at(const Sm90Args& p, int t) const {
    const int g0 = t / (tiles_m * group) * group;  // the group's first (head, batch row) pair
    const int gs = min(group, HB - g0), in = t - g0 * tiles_m;
    const int m = causal ? in / gs : in % tiles_m, hb = g0 + (causal ? in % gs : in / tiles_m);
    return BlockGeometry(p, causal ? tiles_m - 1 - m : m, hb % H, hb / H);
  }
};

template <class T, class C, bool kFuse>
__global__ void __launch_bounds__(C::kThreads, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                             const __grid_constant__ CUtensorMap tv, const Sm90Args p, const int pingpong, const int group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BM = C::BM, BN = C::BN, S = C::kStages, QB = C::kQBufs;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sKV = base + QB * C::kSmemQ;
  const uint32_t bars = sKV + 2 * S * C::kSmemKV;
  auto sQ = [&](int qb) { return base + qb * C::kSmemQ; };
  auto full = [&](int st) { return bars + 8u * (1 + st); };
  auto empty = [&](int st) { return bars + 8u * (1 + S + st); };
  auto bar_q = [&](int qb) { return qb == 0 ? bars : bars + 8u * (2 * S + qb); };  // Q buffer qb loaded
  auto q_empty = [&](int qb) { return bars + 8u * (2 * S + QB + qb); };         // ... and read (O stored)
  auto stage = [&](int r) { return sKV + (r % S) * 2 * C::kSmemKV; };           // ring slot of K/V tile r
  const WsTiles tiles(p, group);
  if (threadIdx.x == 0) {
    for (int qb = 1; qb < QB; ++qb) mbar_init(bar_q(qb), 1);
    for (int qb = 0; qb < QB; ++qb) mbar_init(q_empty(qb), 8);
    mbar_init_ring(bars, S, 8);  // bar_q(0), full(st), empty(st); fences the inits above too
  }
  __syncthreads();

  // Every block walks its tiles (snake_work); `it` counts them (Q buffer it % QB)
  // and `r` the K/V tiles it has gone through (ring slot r % S), both continuing across tiles.
  if (threadIdx.x < 128) {  // producer warpgroup
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      int r = 0;
      auto load_kv = [&](const BlockGeometry& geo, int j) {
        const int st = r % S;
        if (r >= S) mbar_wait(empty(st), ((r / S) - 1) & 1);
        mbar_expect_tx(full(st), 2 * C::kSmemKV);
        const int k0 = geo.k_begin + j * BN;
        for (int slab = 0; slab < D / 64; ++slab) {
          tma_load_bthd(stage(r) + slab * Sw128<BN>::kSlab, &tk, full(st), slab * 64, geo.g, k0, geo.b);
          tma_load_bthd(stage(r) + C::kSmemKV + slab * Sw128<BN>::kSlab, &tv, full(st), slab * 64, geo.g, k0, geo.b);
        }
        ++r;
      };
      for (int it = 0, t = snake_work(0); t < tiles.count; t = snake_work(++it)) {
        const BlockGeometry geo = tiles.at(p, t);
        // The first K/V tile before Q: with one Q buffer, Q waits for the previous tile's O store.
        if (geo.n_tiles > 0) load_kv(geo, 0);
        const int qb = it % QB;
        if (it >= QB) mbar_wait(q_empty(qb), ((it / QB) - 1) & 1);
        mbar_expect_tx(bar_q(qb), C::kSmemQ);
        for (int slab = 0; slab < D / 64; ++slab)
          tma_load_bthd(sQ(qb) + slab * Sw128<BM>::kSlab, &tq, bar_q(qb), slab * 64, geo.h, geo.q0, geo.b);
        for (int j = 1; j < geo.n_tiles; ++j) load_kv(geo, j);
      }
    }
  } else {  // two consumer warpgroups
    setmaxnreg_inc<C::kConsumerRegs>();
    const int cwg = threadIdx.x / 128 - 1;
    const bool lane0 = threadIdx.x % 32 == 0;
    // Ping-pong (pingpong != 0): the warpgroups take turns to issue their products (named barrier
    // 1 + wg is this warpgroup's turn), so one's softmax runs while the other's GEMMs hold the
    // tensor cores. Warpgroup 0 goes first; each step's end() hands the turn over (across tiles
    // too), except warpgroup 1's very last, which would leave an arrival nobody waits for.
    struct Turn {
      int wg, on;
      __device__ __forceinline__ void begin() const {
        if (on) named_sync(1 + wg, 256);
      }
      __device__ __forceinline__ void end(bool not_last = true) const {
        if (on && (wg == 0 || not_last)) named_arrive(2 - wg, 256);
      }
    };
    const Turn turn{cwg, pingpong};
    if (turn.on && cwg == 1) named_arrive(1, 256);
    int r = 0;
    for (int it = 0, t = snake_work(0); t < tiles.count; t = snake_work(++it)) {
      const BlockGeometry geo = tiles.at(p, t);
      const int qb = it % QB, n = geo.n_tiles;
      FwdWarpgroup<T, D, kFuse> w(p, geo, cwg, sQ(qb));
      mbar_wait(bar_q(qb), (it / QB) & 1);
      if (n > 0) {
        mbar_wait(full(r % S), (r / S) & 1);
        w.step_first(stage(r), turn);
        for (int j = 1; j < n; ++j) {
          ++r;
          mbar_wait(full(r % S), (r / S) & 1);
          w.step_overlapped(
              j, stage(r), stage(r - 1) + C::kSmemKV, [&] {
                if (lane0) mbar_arrive(empty((r - 1) % S));
              },
              turn);
        }
        w.step_last(stage(r) + C::kSmemKV, turn, snake_work(it + 1) < tiles.count);
        if (lane0) mbar_arrive(empty(r % S));  // the last P V product has read its V
        ++r;
      }
      w.store(p, geo, cwg, sQ(qb));  // stages O in this warp's rows of the Q buffer
      fence_proxy_async();           // those reads and writes before the next TMA write of the buffer
      __syncwarp();
      if (lane0) mbar_arrive(q_empty(qb));
    }
  }
#else
  __trap();
#endif
}

template <class T, int D>
void launch_ws(const FlashAttnParams& prm, const Sm90Args& a, cudaStream_t stream) {
  using C = WsConfig<D>;
  // PRIMUS_TURBO_ATTN_FWD_FUSED_SCALE=0 (read on every call, for A/B runs): scores scaled before
  // the softmax's maximum instead of inside exp2's argument (FwdWarpgroup's kFuse, which needs a
  // positive scale).
  const bool fuse = a.scale_log2 > 0.0f && env_choice("PRIMUS_TURBO_ATTN_FWD_FUSED_SCALE", {"0", "1"}, "1") == "1";
  auto kernel = fuse ? flash_fwd_sm90_ws_kernel<T, C, true> : flash_fwd_sm90_ws_kernel<T, C, false>;
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(flash_fwd_sm90_ws_kernel<T, C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    CUDA_CHECK(cudaFuncSetAttribute(flash_fwd_sm90_ws_kernel<T, C, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  const CUtensorMap tq = attention_map(a.q, prm.dtype, prm.B, prm.T, prm.H, D, C::BM, "q", prm.q_row);
  const CUtensorMap tk = attention_map(a.k, prm.dtype, prm.B, prm.T, prm.KVH, D, C::BN, "k", prm.k_row);
  const CUtensorMap tv = attention_map(a.v, prm.dtype, prm.B, prm.T, prm.KVH, D, C::BN, "v", prm.v_row);
  // Persistent blocks (one per SM, each walking tiles, so a block's next Q and K/V load under its
  // current tile's O store); PRIMUS_TURBO_ATTN_FWD_PERSISTENT=0 (read on every call, for A/B runs)
  // launches one block per tile instead. PRIMUS_TURBO_ATTN_FWD_GROUP=N: (head, batch row) pairs per
  // group of the tile order (WsTiles; default 1).
  const bool persistent = env_choice("PRIMUS_TURBO_ATTN_FWD_PERSISTENT", {"0", "1"}, "1") == "1";
  const int64_t n_tiles = (prm.T + C::BM - 1) / C::BM * prm.H * prm.B;
  PRIMUS_CHECK(n_tiles < (int64_t{1} << 31), "attention forward (sm90): {} tiles of {} query rows", n_tiles, C::BM);
  const dim3 grid(static_cast<unsigned>(persistent ? std::min<int64_t>(n_tiles, sm_count()) : n_tiles));
  const int64_t group = std::min<int64_t>(env_int("PRIMUS_TURBO_ATTN_FWD_GROUP", 1, INT32_MAX, 1), prm.H * prm.B);
  // PRIMUS_TURBO_ATTN_FWD_PINGPONG=0 (read on every call, for A/B runs): the consumer warpgroups
  // issue their products whenever they are ready instead of taking turns (see the kernel; turns
  // measured +15% at head_dim 128, +6% at 64 on an H200).
  const int pingpong = env_choice("PRIMUS_TURBO_ATTN_FWD_PINGPONG", {"0", "1"}, "1") == "1" ? 1 : 0;
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(tq, tk, tv, a, pingpong, static_cast<int>(group));
  CUDA_CHECK_LAST();
}

}  // namespace

bool flash_forward_sm90_available() {
  static const int major = [] {
    int dev = 0, m = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return m * 10 + minor;
  }();
  return major == 90;  // sm_90a code runs on compute capability 9.0 only
}

void flash_forward_sm90(const FlashAttnParams& prm, void* out, float* lse, const void* q, const void* k, const void* v,
                        FwdKernel kind, cudaStream_t stream) {
  Sm90Args a{q, k, v, out, lse, prm.cu_seqlens, static_cast<int>(prm.num_docs), static_cast<int>(prm.T),
             static_cast<int>(prm.H), static_cast<int>(prm.KVH), prm.scale * kLog2e, prm.causal,
             static_cast<int>(prm.window < prm.T ? prm.window : 0), 0, 1024, static_cast<int>(prm.B)};
  // V is the MN-major B operand: LBO steps between 64-column slabs of head_dim (one slab is
  // kBN rows of 128 bytes), SBO between groups of 8 keys (1024 bytes).
  // PRIMUS_TURBO_ATTN_SM90_VDESC=swap exchanges them: a diagnostic of the descriptor convention
  // (tests/attention_gpu shows the swapped form fails).
  a.v_lbo = static_cast<uint32_t>(kBN * 128);
  if (env_choice("PRIMUS_TURBO_ATTN_SM90_VDESC", {"default", "swap"}, "default") == "swap") std::swap(a.v_lbo, a.v_sbo);
  // TMA needs 16-byte aligned bases; without the driver entry point use the cp.async kernel.
  const bool aligned = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) & 15) == 0;
  if (kind == FwdKernel::Sm90Ws && (!encode_tiled() || !aligned)) kind = FwdKernel::Sm90Pipe;
  PRIMUS_CHECK(!prm.strided() || kind == FwdKernel::Sm90Ws,
               "flash_attention_forward: row-strided q/k/v need the warp-specialised kernel (see flash_attention_takes_row_strides)");
  auto go = [&](auto tag) {
    using T = decltype(tag);
    auto by_d = [&](auto d) {
      constexpr int D = decltype(d)::value;
      if (kind == FwdKernel::Sm90Ws) launch_ws<T, D>(prm, a, stream);
      else if (kind == FwdKernel::Sm90Pipe) launch<T, D, true>(prm, a, stream);
      else launch<T, D, false>(prm, a, stream);
    };
    if (prm.D == 128) by_d(std::integral_constant<int, 128>{});
    else by_d(std::integral_constant<int, 64>{});
  };
  if (prm.dtype == DType::BF16) go(__nv_bfloat16{});
  else go(__half{});
}

}  // namespace primus::turbo::cuda
