// Flash-attention backward (FlashAttention-2 schedule) on mma.sync tensor cores.
//
// Three launches:
//   1. delta[b,h,t] = dout · out; the same pass zeroes the row's f32 dq accumulator.
//   2. The main kernel (this file's mma.sync one, or on sm_90 attention_bwd_sm90.cu's wgmma one):
//      one block per (key tile of BN keys, kv head, batch row). Its warps own
//      16 keys each and keep their dK and dV (16 x D, f32) in registers while the block walks
//      the query tiles (BM rows) of every query head in the kv head's group. Per query tile:
//        S^T = K Q^T -> P^T = exp(scale S^T - lse)     (recomputed, never stored)
//        dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T (dP^T - delta) scale,  dK += dS^T Q
//        dQ += dS K     (dS^T goes through shared memory; the block adds its share to the f32
//                        accumulator with atomics, since many key tiles touch one query row)
//      Q/dO tiles are double-buffered with cp.async. dK/dV of a key tile come from one block
//      only, so they are deterministic; dQ's atomic order is not (f32 sums, then rounded).
//   3. dq = cast(dq accumulator).
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

template <int D_, int BN_, int BM_>
struct BwdConfig {
  static constexpr int D = D_, BN = BN_, BM = BM_;
  static constexpr int kWarps = BN / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpsM = BM / 16;             // dQ: warps along the query rows
  static constexpr int kWarpsN = kWarps / kWarpsM;    //     and along head_dim
  static constexpr int kDqCols = D / kWarpsN;
  static constexpr int kSmemKV = BN * D * 2;
  static constexpr int kSmemQ = BM * D * 2;
  static constexpr int kSmemDS = BN * BM * 2;
  // K, V, Q[2], dO[2], dS^T, lse[2], delta[2]
  static constexpr int kSmem = 2 * kSmemKV + 4 * kSmemQ + kSmemDS + 4 * BM * 4;
  static_assert(kWarps % kWarpsM == 0 && kDqCols % 16 == 0, "dQ warp tiling");
};

struct BwdArgs {
  const void *q, *k, *v, *dout;
  const float *lse, *delta;
  float* dq_acc;  // [B,T,H,D] f32
  void *dk, *dv;
  const int32_t* cu;
  int num_docs;
  int T, H, KVH;
  float scale, scale_log2;
  bool causal;
  int window;  // 0: none; else query t sees keys > t - window
};

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

template <class T, class C>
__global__ void __launch_bounds__(C::kThreads, 1) flash_bwd_kernel(const BwdArgs p) {
  constexpr int D = C::D, BN = C::BN, BM = C::BM;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = smem_addr(smem), sV = sK + C::kSmemKV;
  const uint32_t sQ0 = sV + C::kSmemKV;                 // Q buffers: sQ0 + buf * kSmemQ
  const uint32_t sdO0 = sQ0 + 2 * C::kSmemQ;            // dO buffers
  const uint32_t sdS = sdO0 + 2 * C::kSmemQ;            // dS^T [BN][BM]
  float* s_lse = reinterpret_cast<float*>(smem + 2 * C::kSmemKV + 4 * C::kSmemQ + C::kSmemDS);  // [2][BM]
  float* s_delta = s_lse + 2 * BM;                                                              // [2][BM]

  const int c0 = blockIdx.x * BN, g = blockIdx.y, b = blockIdx.z;
  const int T_len = p.T, group = p.H / p.KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lg = lane / 4, lt = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.H) * D, kv_stride = static_cast<int64_t>(p.KVH) * D;
  const int64_t row_base = static_cast<int64_t>(b) * T_len;

  load_tile<BN, D, C::kThreads>(sK, static_cast<const T*>(p.k) + (row_base * p.KVH + g) * D, kv_stride, c0, T_len);
  load_tile<BN, D, C::kThreads>(sV, static_cast<const T*>(p.v) + (row_base * p.KVH + g) * D, kv_stride, c0, T_len);
  cp_async_commit();

  // Queries that can see these keys: the documents of the first and last key, and (causal)
  // no query before the first key.
  const int c_last = min(c0 + BN, T_len) - 1;
  const DocSpan first_doc = doc_of(p.cu, p.num_docs, b, c0, T_len);
  const DocSpan last_doc = doc_of(p.cu, p.num_docs, b, c_last, T_len);
  const int q_begin = p.causal ? max(first_doc.start, c0) : first_doc.start;
  // A window ends the queries at the last key's window (later queries see none of these keys).
  const int q_end = p.window > 0 ? min(last_doc.end, c_last + p.window) : last_doc.end;
  const int n_q = q_end > q_begin ? (q_end - q_begin + BM - 1) / BM : 0;
  const int total = n_q * group;
  const int key0 = c0 + warp * 16 + lg, key1 = key0 + 8;
  // The queries that may see each key: its document, cut at the key's window (query q sees key j
  // only if q - j < window), so the mask's document test is the window's too.
  DocSpan kd0 = doc_of(p.cu, p.num_docs, b, min(key0, T_len - 1), T_len);
  DocSpan kd1 = doc_of(p.cu, p.num_docs, b, min(key1, T_len - 1), T_len);
  if (p.window > 0) kd0.end = min(kd0.end, key0 + p.window), kd1.end = min(kd1.end, key1 + p.window);
  const bool varlen = p.cu != nullptr;

  auto prefetch = [&](int it, int buf) {
    const int h = g * group + it / n_q;
    const int q0 = q_begin + (it % n_q) * BM;
    const int64_t head_off = (row_base * p.H + h) * D;
    load_tile<BM, D, C::kThreads>(sQ0 + buf * C::kSmemQ, static_cast<const T*>(p.q) + head_off, q_stride, q0, T_len);
    load_tile<BM, D, C::kThreads>(sdO0 + buf * C::kSmemQ, static_cast<const T*>(p.dout) + head_off, q_stride, q0, T_len);
    if (threadIdx.x < BM) {
      const int q = q0 + static_cast<int>(threadIdx.x);
      const bool ok = q < T_len;
      const int64_t off = (static_cast<int64_t>(b) * p.H + h) * T_len + (ok ? q : 0);
      cp_async4(smem_addr(s_lse + buf * BM + threadIdx.x), p.lse + off, ok);
      cp_async4(smem_addr(s_delta + buf * BM + threadIdx.x), p.delta + off, ok);
    }
  };
  if (total > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) prefetch(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int buf = it & 1;
    const int h = g * group + it / n_q;
    const int q0 = q_begin + (it % n_q) * BM;
    const uint32_t sQ = sQ0 + buf * C::kSmemQ, sdO = sdO0 + buf * C::kSmemQ;
    const float* lse = s_lse + buf * BM;
    const float* delta = s_delta + buf * BM;

    // S^T = K Q^T for this warp's 16 keys and the tile's BM queries.
    float st[BM / 8][4];
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4];
      load_a<D>(ka, sK, warp * 16, kk * 16);
#pragma unroll
      for (int n = 0; n < BM / 16; ++n) {
        uint32_t bf[4];
        load_b_nk<D>(bf, sQ, n * 16, kk * 16);
        Mma<T>::mma(st[2 * n], ka, bf);
        Mma<T>::mma(st[2 * n + 1], ka, bf + 2);
      }
    }

    // P^T = exp2(scale*log2e * S^T - lse*log2e), zero where masked.
    const bool need_mask = varlen || q0 + BM > T_len || c0 + BN > T_len || (p.causal && q0 < c0 + BN - 1) ||
                           (p.window > 0 && q0 + BM - p.window > c0);
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = i * 8 + 2 * lt + (e & 1);
        float v = fast_exp2(st[i][e] * p.scale_log2 - lse[qi] * kLog2e);
        if (need_mask) {
          const int q = q0 + qi;
          const int key = e < 2 ? key0 : key1;
          const DocSpan& d = e < 2 ? kd0 : kd1;
          const bool ok = q < T_len && key < T_len && q >= d.start && q < d.end && (!p.causal || q >= key);
          if (!ok) v = 0.0f;
        }
        st[i][e] = v;
      }
    }

    // dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = Mma<T>::pack(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = Mma<T>::pack(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = Mma<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t bf[4];
        load_b_kn<D>(bf, sdO, n * 16, kk * 16);
        Mma<T>::mma(dv[2 * n], pa, bf);
        Mma<T>::mma(dv[2 * n + 1], pa, bf + 2);
      }
    }

    // dP^T = V dO^T.
    float dp[BM / 8][4];
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t va[4];
      load_a<D>(va, sV, warp * 16, kk * 16);
#pragma unroll
      for (int n = 0; n < BM / 16; ++n) {
        uint32_t bf[4];
        load_b_nk<D>(bf, sdO, n * 16, kk * 16);
        Mma<T>::mma(dp[2 * n], va, bf);
        Mma<T>::mma(dp[2 * n + 1], va, bf + 2);
      }
    }

    // dS^T = P^T (dP^T - delta) scale, kept in dp; also written to shared memory for dQ.
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = i * 8 + 2 * lt + (e & 1);
        dp[i][e] = st[i][e] * (dp[i][e] - delta[qi]) * p.scale;
      }
      const int col = i * 8 + 2 * lt;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Swizzle<BM>::offset(warp * 16 + lg, col)),
                   "r"(Mma<T>::pack(dp[i][0], dp[i][1])));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + Swizzle<BM>::offset(warp * 16 + lg + 8, col)),
                   "r"(Mma<T>::pack(dp[i][2], dp[i][3])));
    }

    // dK += dS^T Q.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t da[4];
      da[0] = Mma<T>::pack(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = Mma<T>::pack(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = Mma<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = Mma<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t bf[4];
        load_b_kn<D>(bf, sQ, n * 16, kk * 16);
        Mma<T>::mma(dk[2 * n], da, bf);
        Mma<T>::mma(dk[2 * n + 1], da, bf + 2);
      }
    }
    __syncthreads();  // dS^T complete

    // dQ += dS K for this tile: warp (wm, wn) takes 16 query rows x kDqCols columns.
    {
      const int wm = warp % C::kWarpsM, wn = warp / C::kWarpsM;
      float dq[C::kDqCols / 8][4];
#pragma unroll
      for (int i = 0; i < C::kDqCols / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t a[4];
        load_a_trans<BM>(a, sdS, wm * 16, ks * 16);
#pragma unroll
        for (int n = 0; n < C::kDqCols / 16; ++n) {
          uint32_t bf[4];
          load_b_kn<D>(bf, sK, wn * C::kDqCols + n * 16, ks * 16);
          Mma<T>::mma(dq[2 * n], a, bf);
          Mma<T>::mma(dq[2 * n + 1], a, bf + 2);
        }
      }
      const int r0 = q0 + wm * 16 + lg, r1 = r0 + 8;
      float* base = p.dq_acc + (row_base * p.H + h) * D + wn * C::kDqCols + 2 * lt;
#pragma unroll
      for (int i = 0; i < C::kDqCols / 8; ++i) {
        if (r0 < T_len) atomic_add2(base + static_cast<int64_t>(r0) * q_stride + i * 8, dq[i][0], dq[i][1]);
        if (r1 < T_len) atomic_add2(base + static_cast<int64_t>(r1) * q_stride + i * 8, dq[i][2], dq[i][3]);
      }
    }
    __syncthreads();  // buffers of this iteration are refilled by the next prefetch
  }
  cp_async_wait<0>();
  __syncthreads();

  // Write dK, dV: each warp stages its own 16 rows (in the K and V tiles) for 16-byte stores.
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = i * 8 + 2 * lt;
    const int r = warp * 16 + lg;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Swizzle<D>::offset(r, col)), "r"(Mma<T>::pack(dk[i][0], dk[i][1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sK + Swizzle<D>::offset(r + 8, col)), "r"(Mma<T>::pack(dk[i][2], dk[i][3])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Swizzle<D>::offset(r, col)), "r"(Mma<T>::pack(dv[i][0], dv[i][1])));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sV + Swizzle<D>::offset(r + 8, col)), "r"(Mma<T>::pack(dv[i][2], dv[i][3])));
  }
  __syncwarp();
  T* dkh = static_cast<T*>(p.dk) + (row_base * p.KVH + g) * D;
  T* dvh = static_cast<T*>(p.dv) + (row_base * p.KVH + g) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int key = c0 + warp * 16 + r;
    if (key < T_len) {
      int4 a, v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w)
                   : "r"(sK + Swizzle<D>::offset(warp * 16 + r, c * 8)));
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(sV + Swizzle<D>::offset(warp * 16 + r, c * 8)));
      *reinterpret_cast<int4*>(dkh + static_cast<int64_t>(key) * kv_stride + c * 8) = a;
      *reinterpret_cast<int4*>(dvh + static_cast<int64_t>(key) * kv_stride + c * 8) = v;
    }
  }
}

// The pass before the main kernel, per (b,t,h) row: delta[b,h,t] = sum_d dout[b,t,h,d] * out[b,t,h,d],
// and the row's D floats of the f32 dq accumulator zeroed (one pass instead of a memset beside it).
// With `ld` (the warp-specialised Hopper kernel's rows, [B*H][2][ld_stride]) it writes lse[b,h,t] *
// log2(e) and delta there instead of into `delta`. D / 8 threads share a row, 16 bytes of dout and
// of out each (the op requires 16-byte aligned tensors), so a warp takes 256 / D rows at once.
template <class T, int D>
__global__ void __launch_bounds__(256) flash_bwd_prep_kernel(float* delta, float* ld, const float* lse, int64_t ld_stride,
                                                              const uint4* dout, const uint4* out, float4* dq_acc,
                                                              int64_t rows, int T_len, int H) {
  constexpr int kTpr = D / 8;  // threads per row
  static_assert(kTpr <= 32 && (kTpr & (kTpr - 1)) == 0, "a row's threads: a power of two within a warp");
  const int sub = threadIdx.x % kTpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (256 / kTpr) + threadIdx.x / kTpr;
  const bool valid = row < rows;  // every lane stays for the shuffles below
  float acc = 0.0f;
  if (valid) {
    const uint4 a = __ldg(dout + row * kTpr + sub), o = __ldg(out + row * kTpr + sub);
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, ow[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = Mma<T>::unpack(aw[i]), y = Mma<T>::unpack(ow[i]);
      acc += x.x * y.x + x.y * y.y;
    }
    float4* z = dq_acc + (row * kTpr + sub) * 2;  // this thread's 8 floats of the row
    z[0] = z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int off = kTpr / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && sub == 0) {
    const int64_t bt = row / H;  // row = (b*T + t)*H + h
    const int h = static_cast<int>(row % H);
    const int64_t b = bt / T_len, t = bt % T_len;
    const int64_t bh = b * H + h;
    if (ld) {
      ld[bh * 2 * ld_stride + t] = lse[bh * T_len + t] * kLog2e;
      ld[(bh * 2 + 1) * ld_stride + t] = acc;
    } else {
      delta[bh * T_len + t] = acc;
    }
  }
}

// dq = cast(acc), eight elements a thread (16-byte stores); acc is dense [rows][width], dq's rows
// dq_row elements apart (width: dense; a packed gradient's slice: more). width and dq_row are
// multiples of 8.
template <class T>
__global__ void flash_bwd_cast_kernel(T* dq, const float4* acc, int64_t n8, int64_t width, int64_t dq_row) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const float4 v = __ldg(acc + 2 * i), w = __ldg(acc + 2 * i + 1);
  const int64_t e = i * 8, row = e / width;
  *reinterpret_cast<uint4*>(dq + row * dq_row + (e - row * width)) =
      uint4{Mma<T>::pack(v.x, v.y), Mma<T>::pack(v.z, v.w), Mma<T>::pack(w.x, w.y), Mma<T>::pack(w.z, w.w)};
}

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
// Row stride of the (lse, delta) rows: T rounded up to 4 floats (TMA strides are 16-byte multiples).
int64_t ld_stride(const FlashAttnParams& p) { return (p.T + 3) / 4 * 4; }

template <class T, class C>
void launch_bwd(const FlashAttnParams& prm, const BwdArgs& a, cudaStream_t stream) {
  auto kernel = flash_bwd_kernel<T, C>;
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>((prm.T + C::BN - 1) / C::BN), static_cast<unsigned>(prm.KVH),
                  static_cast<unsigned>(prm.B));
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(a);
  CUDA_CHECK_LAST();
}

template <class T>
void run_bwd(const FlashAttnParams& prm, void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
             const void* v, const void* out, const float* lse, void* scratch, cudaStream_t stream) {
  const int64_t rows = prm.B * prm.T * prm.H;
  const int64_t n = rows * prm.D;
  float* dq_acc = static_cast<float*>(scratch);
  float* delta = reinterpret_cast<float*>(static_cast<char*>(scratch) + align_up(static_cast<size_t>(n) * sizeof(float)));
  FlashBwdPointers ptrs{q, k, v, dout, lse, delta, dq_acc, dk, dv};
  BwdKernel kind = flash_backward_kernel();
  if (kind == BwdKernel::Sm90Ws && !flash_backward_sm90_ws_usable(ptrs)) kind = BwdKernel::Sm90;
  PRIMUS_CHECK(!prm.strided() || kind == BwdKernel::Sm90Ws,
               "flash_attention_backward: row-strided q/k/v/dq/dk/dv need the warp-specialised Hopper kernel");
  float* ld = nullptr;
  if (kind == BwdKernel::Sm90Ws) {
    // The delta region of the scratch holds the (lse, delta) rows instead (see scratch_bytes).
    ld = delta, ptrs.delta = nullptr;
    ptrs.ld = ld, ptrs.ld_stride = ld_stride(prm);
  }
  // delta (or the (lse, delta) rows) and the zeroed dq accumulator, in one pass.
  PRIMUS_CHECK(((reinterpret_cast<uintptr_t>(dout) | reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(dq)) & 15u) == 0,
               "flash_attention_backward: dout ({}), out ({}) and dq ({}) must start 16-byte aligned", dout, out, dq);
  const unsigned prep_grid = static_cast<unsigned>((rows * prm.D / 8 + 255) / 256);  // D / 8 threads a row
  auto prep = prm.D == 128 ? flash_bwd_prep_kernel<T, 128> : flash_bwd_prep_kernel<T, 64>;
  prep<<<prep_grid, 256, 0, stream>>>(ld ? nullptr : delta, ld, lse, ptrs.ld_stride, static_cast<const uint4*>(dout),
                                      static_cast<const uint4*>(out), reinterpret_cast<float4*>(dq_acc), rows,
                                      static_cast<int>(prm.T), static_cast<int>(prm.H));
  CUDA_CHECK_LAST();
  if (kind != BwdKernel::Sm80) {
    flash_backward_sm90_main(prm, ptrs, stream);
  } else {
    BwdArgs a{q, k, v, dout, lse, delta, dq_acc, dk, dv, prm.cu_seqlens, static_cast<int>(prm.num_docs),
              static_cast<int>(prm.T), static_cast<int>(prm.H), static_cast<int>(prm.KVH), prm.scale,
              prm.scale * kLog2e, prm.causal, static_cast<int>(prm.window < prm.T ? prm.window : 0)};
    if (prm.D == 128) launch_bwd<T, BwdConfig<128, 128, 64>>(prm, a, stream);
    else launch_bwd<T, BwdConfig<64, 128, 64>>(prm, a, stream);
  }
  const int64_t n8 = n / 8;  // n = rows * D, a multiple of 8 (head_dim 64 or 128)
  const int64_t width = prm.H * prm.D;
  flash_bwd_cast_kernel<T><<<static_cast<unsigned>((n8 + 255) / 256), 256, 0, stream>>>(
      static_cast<T*>(dq), reinterpret_cast<const float4*>(dq_acc), n8, width, prm.dq_row ? prm.dq_row : width);
  CUDA_CHECK_LAST();
}

}  // namespace

BwdKernel flash_backward_kernel() {
  const std::string k = env_choice("PRIMUS_TURBO_ATTN_BWD_KERNEL", {"sm80", "sm90", "sm90ws"}, "sm90ws");
  if (k == "sm80" || !flash_forward_sm90_available()) return BwdKernel::Sm80;
  return k == "sm90ws" ? BwdKernel::Sm90Ws : BwdKernel::Sm90;
}

size_t flash_attention_backward_scratch_bytes(const FlashAttnParams& p) {
  // The f32 dQ accumulator, then delta [B,H,T] or (whichever kernel the call picks) the
  // warp-specialised kernel's (lse, delta) rows [B*H][2][ld_stride], the larger of the two.
  return align_up(static_cast<size_t>(p.B * p.T * p.H * p.D) * sizeof(float)) +
         align_up(static_cast<size_t>(p.B * p.H * 2 * ld_stride(p)) * sizeof(float));
}

void flash_attention_backward(const FlashAttnParams& prm, void* dq, void* dk, void* dv, const void* dout, const void* q,
                              const void* k, const void* v, const void* out, const float* lse, void* scratch,
                              cudaStream_t stream) {
  if (auto why = flash_attention_unsupported_reason(prm.dtype, prm.D); !why.empty())
    throw RuntimeError("flash_attention_backward: " + why);
  PRIMUS_CHECK(prm.B > 0 && prm.T > 0 && prm.H > 0 && prm.KVH > 0 && prm.H % prm.KVH == 0,
               "flash_attention_backward: bad shape B={} T={} H={} KVH={}", prm.B, prm.T, prm.H, prm.KVH);
  PRIMUS_CHECK(scratch != nullptr, "flash_attention_backward: needs scratch");
  if (prm.dtype == DType::BF16) run_bwd<__nv_bfloat16>(prm, dq, dk, dv, dout, q, k, v, out, lse, scratch, stream);
  else run_bwd<__half>(prm, dq, dk, dv, dout, q, k, v, out, lse, scratch, stream);
}

}  // namespace primus::turbo::cuda
