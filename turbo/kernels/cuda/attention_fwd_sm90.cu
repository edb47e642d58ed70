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
#include "turbo/kernels/cuda/attention_wgmma_ops.cuh"

namespace primus::turbo::cuda {
namespace {

using namespace attn;

// ---- 128B-swizzled tiles and wgmma descriptors --------------------------------------------------
template <int ROWS>
struct Sw128 {
  static constexpr uint32_t kSlab = ROWS * 128;  // bytes of one [ROWS][64] column slab
  static __device__ __forceinline__ uint32_t offset(int row, int col) {
    return static_cast<uint32_t>((col >> 6) * kSlab + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2);
  }
};

template <int ROWS, int D, int NT, class T>
__device__ __forceinline__ void load_tile_sw128(uint32_t dst, const T* head_base, int64_t row_stride, int r0, int T_len) {
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int i = 0; i < kTotal / NT; ++i) {
    const int idx = i * NT + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = r0 + r;
    const bool ok = row >= 0 && row < T_len;
    const T* src = head_base + (ok ? static_cast<int64_t>(row) * row_stride : 0) + c * 8;
    cp_async16(dst + Sw128<ROWS>::offset(r, c * 8), src, ok);
  }
}

// Matrix descriptor, 128-byte swizzle (mode 1 in bits 62-63); addresses and offsets in bytes.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins accumulator registers around asynchronous wgmma (no moves across the issue/wait pair).
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Shared memory written by the generic proxy (cp.async) and next read by wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int D_>
struct Sm90Config {
  static constexpr int D = D_, BM = 128, BN = 128;
  static constexpr int kThreads = 256;  // two warpgroups of 64 query rows
  static constexpr int kSmemQ = BM * D * 2, kSmemKV = BN * D * 2;
  static constexpr int kSmem = kSmemQ + 4 * kSmemKV + 1024;  // + alignment slack
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

template <class T, class C>
__global__ void __launch_bounds__(C::kThreads, 1) flash_fwd_sm90_kernel(const Sm90Args p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = C::D, BM = C::BM, BN = C::BN;
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

  load_tile_sw128<BM, D, C::kThreads>(sQ, qh, q_stride, q0, T_len);
  cp_async_commit();
  auto load_kv = [&](int k0, int stage) {
    const uint32_t sk = sKV + stage * 2 * C::kSmemKV;
    load_tile_sw128<BN, D, C::kThreads>(sk, kh, kv_stride, k0, T_len);
    load_tile_sw128<BN, D, C::kThreads>(sk + C::kSmemKV, vh, kv_stride, k0, T_len);
  };
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;
  if (n_tiles > 0) load_kv(k_begin, 0);
  cp_async_commit();

  float o[D / 2];  // 64 x D accumulator of this warpgroup: D/8 column groups x 4
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const uint32_t q_wg = sQ + wg * 64 * 128;  // this warpgroup's rows inside each Q slab

  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = k_begin + j * BN;
    if (j + 1 < n_tiles) load_kv(k0 + BN, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const uint32_t sK = sKV + (j & 1) * 2 * C::kSmemKV, sV = sK + C::kSmemKV;

    // S = Q K^T (64 x BN per warpgroup).
    float s[BN / 2];
    fence_regs<BN / 2>(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk % 4) * 32;  // 16 columns = 32 bytes into the slab's rows
      const uint64_t da = make_desc(q_wg + (kk / 4) * Sw128<BM>::kSlab + koff, 16, 1024);
      const uint64_t db = make_desc(sK + (kk / 4) * Sw128<BN>::kSlab + koff, 16, 1024);
      Wgmma<T>::template ss<BN>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<BN / 2>(s);

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
    const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
    const float alpha0 = fast_exp2(m0 - base0), alpha1 = fast_exp2(m1 - base1);
    m0 = mx0, m1 = mx1;
    float rs0 = 0.0f, rs1 = 0.0f;
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const float e0 = fast_exp2(s[i * 4 + 0] - base0), e1 = fast_exp2(s[i * 4 + 1] - base0);
      const float e2 = fast_exp2(s[i * 4 + 2] - base1), e3 = fast_exp2(s[i * 4 + 3] - base1);
      rs0 += e0 + e1;
      rs1 += e2 + e3;
      // Column group i is half of the A fragment of k-step i/2: (i even) -> a0,a1, (odd) -> a2,a3.
      pa[i / 2][(i & 1) * 2 + 0] = Mma<T>::pack(e0, e1);
      pa[i / 2][(i & 1) * 2 + 1] = Mma<T>::pack(e2, e3);
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i * 4 + 0] *= alpha0, o[i * 4 + 1] *= alpha0;
      o[i * 4 + 2] *= alpha1, o[i * 4 + 3] *= alpha1;
    }

    // O += P V.
    fence_regs<D / 2>(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t dv = make_desc(sV + kk * 2048, p.v_lbo, p.v_sbo);
      Wgmma<T>::template rs_tb<D>(o, pa[kk], dv);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
    __syncthreads();  // the next iteration's loads overwrite the stage read here
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

template <class T, class C>
void launch(const FlashAttnParams& prm, const Sm90Args& a, cudaStream_t stream) {
  auto kernel = flash_fwd_sm90_kernel<T, C>;
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
                        cudaStream_t stream) {
  Sm90Args a{q, k, v, out, lse, prm.cu_seqlens, static_cast<int>(prm.num_docs), static_cast<int>(prm.T),
             static_cast<int>(prm.H), static_cast<int>(prm.KVH), prm.scale * kLog2e, prm.causal, 0, 1024};
  // V is the MN-major B operand: LBO steps between 64-column slabs of head_dim, SBO between
  // groups of 8 keys (1024 bytes). PRIMUS_TURBO_ATTN_SM90_VDESC=swap exchanges them (a
  // diagnostic for the descriptor convention; see tests/attention_gpu).
  a.v_lbo = static_cast<uint32_t>(Sm90Config<128>::BN * 128);
  const char* env = std::getenv("PRIMUS_TURBO_ATTN_SM90_VDESC");
  if (env && std::strcmp(env, "swap") == 0) std::swap(a.v_lbo, a.v_sbo);
  if (prm.dtype == DType::BF16) {
    if (prm.D == 128) launch<__nv_bfloat16, Sm90Config<128>>(prm, a, stream);
    else launch<__nv_bfloat16, Sm90Config<64>>(prm, a, stream);
  } else {
    if (prm.D == 128) launch<__half, Sm90Config<128>>(prm, a, stream);
    else launch<__half, Sm90Config<64>>(prm, a, stream);
  }
}

}  // namespace primus::turbo::cuda
