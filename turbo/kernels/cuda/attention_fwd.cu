// Flash-attention forward (FlashAttention-2 schedule) on mma.sync tensor cores.
//
// One block per (query tile of BM rows, head, batch row); each of its warps owns 16 query rows,
// holds their Q fragments in registers for the whole run, and keeps its slice of O (16 x D, f32)
// and the online-softmax state (running max m and sum l per row) in registers. K/V tiles of BN
// keys stream through shared memory, double-buffered with cp.async so the next tile loads while
// this one is multiplied. Scores never leave registers: S = Q K^T (f32), masked, exponentiated
// in base 2 with the scale folded in, packed to bf16/f16 and fed to O += P V as A fragments.
// Causal blocks are launched heaviest first (the last query tiles see the most keys).
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/util/error.h"
#include "turbo/core/env_switch.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/attention_flash.h"
#include "turbo/kernels/cuda/attention_mma.cuh"
#include "turbo/kernels/cuda/attention_sm90.h"

namespace primus::turbo::cuda {
namespace {

using namespace attn;

template <int D_, int BM_, int BN_>
struct FwdConfig {
  static constexpr int D = D_, BM = BM_, BN = BN_;
  static constexpr int kWarps = BM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSmemQ = BM * D * 2;
  static constexpr int kSmemKV = BN * D * 2;
  static constexpr int kSmem = kSmemQ + 4 * kSmemKV;  // Q, then K0 V0 K1 V1
};

struct FwdArgs {
  const void *q, *k, *v;
  void* out;
  float* lse;
  const int32_t* cu;
  int num_docs;
  int T, H, KVH;
  float scale_log2;  // softmax scale * log2(e)
  bool causal;
  int window;  // 0: none; else query t sees keys > t - window
};

template <class T, class C>
__global__ void __launch_bounds__(C::kThreads, 1) flash_fwd_kernel(const FwdArgs p) {
  constexpr int D = C::D, BM = C::BM, BN = C::BN;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sKV = sQ + C::kSmemQ;  // buffer s: K at sKV + 2*s*kSmemKV, V after it

  const int tiles_m = gridDim.x;
  const int m_tile = p.causal ? tiles_m - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z;
  const int g = h / (p.H / p.KVH);
  const int q0 = m_tile * BM;
  const int T_len = p.T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lg = lane / 4, lt = lane % 4;

  const int64_t q_stride = static_cast<int64_t>(p.H) * D, kv_stride = static_cast<int64_t>(p.KVH) * D;
  const T* qh = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * T_len * p.H + h) * D;
  const T* kh = static_cast<const T*>(p.k) + (static_cast<int64_t>(b) * T_len * p.KVH + g) * D;
  const T* vh = static_cast<const T*>(p.v) + (static_cast<int64_t>(b) * T_len * p.KVH + g) * D;

  // Keys this block needs: from the document start of its first row to (causal) its last row
  // or (otherwise) the document end of its last row.
  const int q_last = min(q0 + BM, T_len) - 1;
  const DocSpan first_doc = doc_of(p.cu, p.num_docs, b, q0, T_len);
  const DocSpan last_doc = doc_of(p.cu, p.num_docs, b, q_last, T_len);
  // A window starts the block's keys at its first row's window (earlier keys see no row).
  const int k_begin = p.window > 0 ? max(first_doc.start, q0 - p.window + 1) : first_doc.start;
  const int k_end = p.causal ? q_last + 1 : last_doc.end;
  // This thread's two rows and their documents.
  const int row0 = q0 + warp * 16 + lg, row1 = row0 + 8;
  // The keys each row may see: its document, cut at the row's window (row t sees key j only if
  // t - j < window), so the mask's document test is the window's too.
  DocSpan d0 = doc_of(p.cu, p.num_docs, b, min(row0, T_len - 1), T_len);
  DocSpan d1 = doc_of(p.cu, p.num_docs, b, min(row1, T_len - 1), T_len);
  if (p.window > 0) d0.start = max(d0.start, row0 - p.window + 1), d1.start = max(d1.start, row1 - p.window + 1);
  const bool varlen = p.cu != nullptr;

  load_tile<BM, D, C::kThreads>(sQ, qh, q_stride, q0, T_len);
  cp_async_commit();
  auto load_kv = [&](int k0, int buf) {
    const uint32_t sk = sKV + buf * 2 * C::kSmemKV;
    load_tile<BN, D, C::kThreads>(sk, kh, kv_stride, k0, T_len);
    load_tile<BN, D, C::kThreads>(sk + C::kSmemKV, vh, kv_stride, k0, T_len);
  };
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;
  if (n_tiles > 0) load_kv(k_begin, 0);
  cp_async_commit();

  // Q fragments stay in registers.
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], sQ, warp * 16, kk * 16);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = k_begin + j * BN;
    if (j + 1 < n_tiles) load_kv(k0 + BN, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t sK = sKV + (j & 1) * 2 * C::kSmemKV, sV = sK + C::kSmemKV;

    // S = Q K^T for this warp's 16 rows and BN keys.
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < BN / 16; ++n) {
        uint32_t bf[4];
        load_b_nk<D>(bf, sK, n * 16, kk * 16);
        Mma<T>::mma(s[2 * n], qf[kk], bf);
        Mma<T>::mma(s[2 * n + 1], qf[kk], bf + 2);
      }
    }

    // Scale into base-2 units first (so any sign of the scale keeps max and mask right), then
    // mask keys past the sequence, after the query (causal) or outside the query's document.
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] *= p.scale_log2;
    // The window masks a tile whose first key lies before its last row's window.
    const bool need_mask = k0 + BN > k_end || (p.causal && k0 + BN - 1 > q0) || varlen ||
                           (p.window > 0 && k0 < q0 + BM - p.window);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + i * 8 + 2 * lt + (e & 1);
          const int row = e < 2 ? row0 : row1;
          const DocSpan& d = e < 2 ? d0 : d1;
          const bool ok = col < k_end && col >= d.start && col < d.end && (!p.causal || col <= row);
          if (!ok) s[i][e] = -INFINITY;
        }
      }
    }

    // Online softmax in base 2: new running max, rescale the old O and sums.
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
      mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
    }
    // A row that has seen only masked keys keeps max -inf; subtract 0 then (exp2(-inf) = 0).
    const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
    const float alpha0 = fast_exp2(m0 - base0), alpha1 = fast_exp2(m1 - base1);
    m0 = mx0, m1 = mx1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[i][0] = fast_exp2(s[i][0] - base0);
      s[i][1] = fast_exp2(s[i][1] - base0);
      s[i][2] = fast_exp2(s[i][2] - base1);
      s[i][3] = fast_exp2(s[i][3] - base1);
      rs0 += s[i][0] + s[i][1];
      rs1 += s[i][2] + s[i][3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha0, o[i][1] *= alpha0;
      o[i][2] *= alpha1, o[i][3] *= alpha1;
    }

    // O += P V, P taken straight from the score registers.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t bf[4];
        load_b_kn<D>(bf, sV, n * 16, kk * 16);
        Mma<T>::mma(o[2 * n], pa, bf);
        Mma<T>::mma(o[2 * n + 1], pa, bf + 2);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite the buffer read here
  }
  cp_async_wait<0>();

  // Finish the row sums across the quad, normalise, write lse and O (staged through the Q tile).
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
  // Each warp writes only its own 16 rows of the Q tile, which only it has read.
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = i * 8 + 2 * lt;
    const uint32_t lo = Mma<T>::pack(o[i][0] * inv0, o[i][1] * inv0);
    const uint32_t hi = Mma<T>::pack(o[i][2] * inv1, o[i][3] * inv1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Swizzle<D>::offset(warp * 16 + lg, col)), "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + Swizzle<D>::offset(warp * 16 + lg + 8, col)), "r"(hi));
  }
  __syncwarp();
  T* oh = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * T_len * p.H + h) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = q0 + warp * 16 + r;
    if (row < T_len) {
      int4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(sQ + Swizzle<D>::offset(warp * 16 + r, c * 8)));
      *reinterpret_cast<int4*>(oh + static_cast<int64_t>(row) * q_stride + c * 8) = v;
    }
  }
}

template <class T, class C>
void launch_fwd(const FlashAttnParams& prm, const FwdArgs& a, cudaStream_t stream) {
  auto kernel = flash_fwd_kernel<T, C>;
  static bool configured = false;  // per instantiation; the attribute is per function
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>((prm.T + C::BM - 1) / C::BM), static_cast<unsigned>(prm.H),
                  static_cast<unsigned>(prm.B));
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(a);
  CUDA_CHECK_LAST();
}

template <class T>
void dispatch_fwd(const FlashAttnParams& prm, const FwdArgs& a, cudaStream_t stream) {
  if (prm.D == 128) launch_fwd<T, FwdConfig<128, 128, 64>>(prm, a, stream);
  else launch_fwd<T, FwdConfig<64, 128, 128>>(prm, a, stream);
}

}  // namespace

std::string flash_attention_unsupported_reason(DType dtype, int64_t head_dim) {
  if (dtype != DType::BF16 && dtype != DType::F16)
    return fmt::format("dtype {} (Turbo flash attention: bf16 or f16)", dtype_name(dtype));
  if (head_dim != 64 && head_dim != 128) return fmt::format("head_dim {} (Turbo flash attention: 64 or 128)", head_dim);
  return "";
}

FwdKernel flash_forward_kernel() {
  const std::string k = env_choice("PRIMUS_TURBO_ATTN_KERNEL", {"sm80", "sm90", "sm90pipe", "sm90ws"}, "sm90ws");
  if (k == "sm80" || !flash_forward_sm90_available()) return FwdKernel::Sm80;
  if (k == "sm90") return FwdKernel::Sm90;
  if (k == "sm90pipe") return FwdKernel::Sm90Pipe;
  return FwdKernel::Sm90Ws;
}

void flash_attention_forward(const FlashAttnParams& prm, void* out, float* lse, const void* q, const void* k,
                             const void* v, cudaStream_t stream) {
  if (auto why = flash_attention_unsupported_reason(prm.dtype, prm.D); !why.empty())
    throw RuntimeError("flash_attention_forward: " + why);
  PRIMUS_CHECK(prm.B > 0 && prm.T > 0 && prm.H > 0 && prm.KVH > 0 && prm.H % prm.KVH == 0,
               "flash_attention_forward: bad shape B={} T={} H={} KVH={}", prm.B, prm.T, prm.H, prm.KVH);
  PRIMUS_CHECK(prm.B * prm.T < (int64_t{1} << 31), "flash_attention_forward: B*T={} exceeds int32 indexing", prm.B * prm.T);
  if (const FwdKernel kern = flash_forward_kernel(); kern != FwdKernel::Sm80) {
    flash_forward_sm90(prm, out, lse, q, k, v, kern, stream);
    return;
  }
  PRIMUS_CHECK(!prm.strided(), "flash_attention_forward: row-strided q/k/v need the warp-specialised Hopper kernel");
  FwdArgs a{q, k, v, out, lse, prm.cu_seqlens, static_cast<int>(prm.num_docs), static_cast<int>(prm.T),
            static_cast<int>(prm.H), static_cast<int>(prm.KVH), prm.scale * kLog2e, prm.causal, static_cast<int>(prm.window < prm.T ? prm.window : 0)};
  if (prm.dtype == DType::BF16) dispatch_fwd<__nv_bfloat16>(prm, a, stream);
  else dispatch_fwd<__half>(prm, a, stream);
}

}  // namespace primus::turbo::cuda
