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
// the wider tensor-core path; it does not (yet) specialise a producer warp, use TMA, or overlap
// one tile's softmax with the next tile's GEMM as FlashAttention-3 does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/attention_flash.h"
#include "turbo/kernels/cuda/attention_mma.cuh"
#include "turbo/kernels/cuda/attention_sm90.h"
#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/attention_wgmma_ops.cuh"

namespace primus::turbo::cuda {
namespace {

using namespace attn;

// kPipe: FlashAttention-3's intra-warpgroup overlap. Each iteration issues S_j = Q K_j^T and
// O += P_{j-1} V_{j-1} back to back, waits for S_j only, and runs softmax_j while the P V
// product of the previous tile is still on the tensor cores; O is rescaled once that product has
// landed. K/V then need three stages (tile j+1 loads while V_{j-1} and K_j are being read).
// Without kPipe each tile's S GEMM, softmax and P V GEMM run one after the other (two stages).
template <int D_, bool kPipe>
struct Sm90Config {
  static constexpr int D = D_, BM = 128, BN = 128;
  static constexpr int kThreads = 256;  // two warpgroups of 64 query rows
  static constexpr int kStages = kPipe ? 3 : 2;
  static constexpr int kSmemQ = BM * D * 2, kSmemKV = BN * D * 2;
  static constexpr int kSmem = kSmemQ + 2 * kStages * kSmemKV + 1024;  // + alignment slack
};

struct Sm90Args {
  const void *q, *k, *v;
  void* out;
  float* lse;
  const int32_t* cu;
  int num_docs;
  int T, H, KVH;
  float scale_log2;
  bool causal;
  uint32_t v_lbo, v_sbo;  // descriptor offsets of the MN-major V operand
};

template <class T, class C, bool kPipe>
__global__ void __launch_bounds__(C::kThreads, 1) flash_fwd_sm90_kernel(const Sm90Args p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BM = C::BM, BN = C::BN, kStages = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t sQ = base;
  const uint32_t sKV = sQ + C::kSmemQ;  // stage s: K at sKV + 2*s*kSmemKV, V after it

  const int tiles_m = gridDim.x;
  const int m_tile = p.causal ? tiles_m - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, g = h / (p.H / p.KVH);
  const int q0 = m_tile * BM, T_len = p.T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4, wl = warp % 4;
  const int lg = lane / 4, lt = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.H) * D, kv_stride = static_cast<int64_t>(p.KVH) * D;
  const T* qh = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * T_len * p.H + h) * D;
  const T* kh = static_cast<const T*>(p.k) + (static_cast<int64_t>(b) * T_len * p.KVH + g) * D;
  const T* vh = static_cast<const T*>(p.v) + (static_cast<int64_t>(b) * T_len * p.KVH + g) * D;

  const int q_last = min(q0 + BM, T_len) - 1;
  const DocSpan first_doc = doc_of(p.cu, p.num_docs, b, q0, T_len);
  const DocSpan last_doc = doc_of(p.cu, p.num_docs, b, q_last, T_len);
  const int k_begin = first_doc.start;
  const int k_end = p.causal ? q_last + 1 : last_doc.end;
  const int row0 = q0 + wg * 64 + wl * 16 + lg, row1 = row0 + 8;
  const DocSpan d0 = doc_of(p.cu, p.num_docs, b, min(row0, T_len - 1), T_len);
  const DocSpan d1 = doc_of(p.cu, p.num_docs, b, min(row1, T_len - 1), T_len);
  const bool varlen = p.cu != nullptr;
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;

  auto stage_k = [&](int j) { return sKV + (j % kStages) * 2 * C::kSmemKV; };
  auto load_kv = [&](int j) {
    const uint32_t sk = stage_k(j);
    load_tile_sw128<BN, D, C::kThreads>(sk, kh, kv_stride, k_begin + j * BN, T_len);
    load_tile_sw128<BN, D, C::kThreads>(sk + C::kSmemKV, vh, kv_stride, k_begin + j * BN, T_len);
  };

  float o[D / 2];  // 64 x D accumulator of this warpgroup: D/8 column groups x 4
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float s[BN / 2];
  uint32_t pa[BN / 16][4];
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const uint32_t q_wg = sQ + wg * 64 * 128;  // this warpgroup's rows inside each Q slab

  // S = Q K_j^T (64 x BN per warpgroup), issued asynchronously.
  auto issue_s = [&](int j) {
    const uint32_t sK = stage_k(j);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk % 4) * 32;  // 16 columns = 32 bytes into the slab's rows
      const uint64_t da = make_desc(q_wg + (kk / 4) * Sw128<BM>::kSlab + koff, 16, 1024);
      const uint64_t db = make_desc(sK + (kk / 4) * Sw128<BN>::kSlab + koff, 16, 1024);
      Wgmma<T>::template ss<BN>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // O += P V_j, P from registers, issued asynchronously.
  auto issue_pv = [&](int j) {
    const uint32_t sV = stage_k(j) + C::kSmemKV;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) Wgmma<T>::template rs_tb<D>(o, pa[kk], make_desc(sV + kk * 2048, p.v_lbo, p.v_sbo));
    wgmma_commit();
  };
  // Softmax of tile j in place: s becomes exp2(scaled score - new max); returns the factors that
  // rescale the old O and sums (applied by the caller once O is no longer being written).
  auto softmax = [&](int j, float& alpha0, float& alpha1) {
    const int k0 = k_begin + j * BN;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= p.scale_log2;
    const bool need_mask = k0 + BN > k_end || (p.causal && k0 + BN - 1 > q0) || varlen;
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + i * 8 + 2 * lt + (e & 1);
          const int row = e < 2 ? row0 : row1;
          const DocSpan& d = e < 2 ? d0 : d1;
          const bool ok = col < k_end && col >= d.start && col < d.end && (!p.causal || col <= row);
          if (!ok) s[i * 4 + e] = -INFINITY;
        }
      }
    }
    float mx0 = m0, mx1 = m1;
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
    // A row that has seen only masked keys keeps max -inf; subtract 0 then (exp2(-inf) = 0).
    const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
    alpha0 = fast_exp2(m0 - base0), alpha1 = fast_exp2(m1 - base1);
    m0 = mx0, m1 = mx1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[i * 4 + 0] = fast_exp2(s[i * 4 + 0] - base0), s[i * 4 + 1] = fast_exp2(s[i * 4 + 1] - base0);
      s[i * 4 + 2] = fast_exp2(s[i * 4 + 2] - base1), s[i * 4 + 3] = fast_exp2(s[i * 4 + 3] - base1);
      rs0 += s[i * 4 + 0] + s[i * 4 + 1];
      rs1 += s[i * 4 + 2] + s[i * 4 + 3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
  };
  auto rescale_o = [&](float alpha0, float alpha1) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i * 4 + 0] *= alpha0, o[i * 4 + 1] *= alpha0;
      o[i * 4 + 2] *= alpha1, o[i * 4 + 3] *= alpha1;
    }
  };
  // Column group i of P is half of the A fragment of k-step i/2: (i even) a0,a1, (odd) a2,a3.
  auto pack_p = [&] {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      pa[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(s[i * 4 + 0], s[i * 4 + 1]);
      pa[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(s[i * 4 + 2], s[i * 4 + 3]);
    }
  };

  load_tile_sw128<BM, D, C::kThreads>(sQ, qh, q_stride, q0, T_len);
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
      float a0, a1;
      fence_regs<BN / 2>(s);
      wgmma_fence();
      issue_s(0);
      wgmma_wait<0>();
      fence_regs<BN / 2>(s);
      softmax(0, a0, a1);  // o is still zero: nothing to rescale
      pack_p();
      for (int j = 1; j < n_tiles; ++j) {
        cp_async_wait<0>();  // tile j has landed
        fence_proxy_async();
        __syncthreads();     // ... for every thread; and all are past iteration j-1 (stage of j+1 free)
        if (j + 1 < n_tiles) load_kv(j + 1);
        cp_async_commit();
        fence_regs<BN / 2>(s);
        fence_regs<D / 2>(o);
        wgmma_fence();
        issue_s(j);
        issue_pv(j - 1);
        wgmma_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
        fence_regs<BN / 2>(s);
        softmax(j, a0, a1);
        wgmma_wait<0>();
        fence_regs<D / 2>(o);
        rescale_o(a0, a1);
        pack_p();
      }
      fence_regs<D / 2>(o);
      wgmma_fence();
      issue_pv(n_tiles - 1);
      wgmma_wait<0>();
      fence_regs<D / 2>(o);
    }
  } else {
    for (int j = 0; j < n_tiles; ++j) {
      if (j + 1 < n_tiles) load_kv(j + 1);
      cp_async_commit();
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      float a0, a1;
      fence_regs<BN / 2>(s);
      wgmma_fence();
      issue_s(j);
      wgmma_wait<0>();
      fence_regs<BN / 2>(s);
      softmax(j, a0, a1);
      rescale_o(a0, a1);
      pack_p();
      fence_regs<D / 2>(o);
      wgmma_fence();
      issue_pv(j);
      wgmma_wait<0>();
      fence_regs<D / 2>(o);
      __syncthreads();  // the next iteration's loads overwrite the stage read here
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int o_ = 1; o_ <= 2; o_ <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
  }
  const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
  if (lt == 0) {
    float* lse = p.lse + (static_cast<int64_t>(b) * p.H + h) * T_len;
    if (row0 < T_len) lse[row0] = l0 > 0.0f ? (m0 + log2f(l0)) * kLn2 : -INFINITY;
    if (row1 < T_len) lse[row1] = l1 > 0.0f ? (m1 + log2f(l1)) * kLn2 : -INFINITY;
  }
  // Stage O in this warp's own 16 rows of the Q tile (read by nobody else now), then store rows.
  const int r_loc = wg * 64 + wl * 16;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = i * 8 + 2 * lt;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Sw128<BM>::offset(r_loc + lg, col)),
                 "r"(Mma<T>::pack(o[i * 4 + 0] * inv0, o[i * 4 + 1] * inv0)));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Sw128<BM>::offset(r_loc + lg + 8, col)),
                 "r"(Mma<T>::pack(o[i * 4 + 2] * inv1, o[i * 4 + 3] * inv1)));
  }
  __syncwarp();
  T* oh = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * T_len * p.H + h) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = q0 + r_loc + r;
    if (row < T_len) {
      int4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(sQ + Sw128<BM>::offset(r_loc + r, c * 8)));
      *reinterpret_cast<int4*>(oh + static_cast<int64_t>(row) * q_stride + c * 8) = v;
    }
  }
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
                        bool pipelined, cudaStream_t stream) {
  Sm90Args a{q, k, v, out, lse, prm.cu_seqlens, static_cast<int>(prm.num_docs), static_cast<int>(prm.T),
             static_cast<int>(prm.H), static_cast<int>(prm.KVH), prm.scale * kLog2e, prm.causal, 0, 1024};
  // V is the MN-major B operand: LBO steps between 64-column slabs of head_dim (one slab is
  // BN rows of 128 bytes), SBO between groups of 8 keys (1024 bytes).
  // PRIMUS_TURBO_ATTN_SM90_VDESC=swap exchanges them: a diagnostic of the descriptor convention
  // (tests/attention_gpu shows the swapped form fails).
  a.v_lbo = static_cast<uint32_t>(Sm90Config<128, true>::BN * 128);
  const char* env = std::getenv("PRIMUS_TURBO_ATTN_SM90_VDESC");
  if (env && std::strcmp(env, "swap") == 0) std::swap(a.v_lbo, a.v_sbo);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (prm.D == 128) {
      if (pipelined) launch<T, 128, true>(prm, a, stream); else launch<T, 128, false>(prm, a, stream);
    } else {
      if (pipelined) launch<T, 64, true>(prm, a, stream); else launch<T, 64, false>(prm, a, stream);
    }
  };
  if (prm.dtype == DType::BF16) go(__nv_bfloat16{});
  else go(__half{});
}

}  // namespace primus::turbo::cuda
