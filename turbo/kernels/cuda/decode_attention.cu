// Decode attention: the single-query attention of token-by-token generation, split over the key
// range ("flash-decoding"). Each step reads the whole KV cache once at two FLOPs per byte, so the
// kernel must keep the whole GPU busy even at batch 1, where one block per (query, head) would
// give only H blocks each sweeping thousands of keys one after another.
//
// Grid (sequence i, head group, split s). A head group is HPB query heads of one kv head (GQA:
// HPB = 4, 2 or 1, the largest of those dividing H / KVH), so one K/V load serves HPB heads. The
// key range [j0, L) (j0 from the sliding window) is cut into `nsplit` contiguous chunks of
// max(kMinChunk, ceil((L - j0) / nsplit)) keys; split s takes the s-th, and a split past the end
// writes an empty partial (max -inf, sum 0) and exits. nsplit comes from the host-known shape
// only (n, H, KVH, cap: enough blocks to fill the GPU, at most kMaxSplits, at most cap /
// kMinChunk), never from the lengths, which live on the device: decode steps are captured in
// CUDA graphs.
//
// Inside a block, kWarps warps take keys round-robin; in a warp TPK lanes share a key (a power of
// two, D split into 16-byte vectors, NV vectors per lane), so a warp scores 32 / TPK keys at once
// with a log2(TPK)-step shuffle reduction, and a key row of a K/V load is TPK contiguous 16-byte
// vectors. Each lane group keeps an online softmax (running max, sum and unnormalised weighted
// value sum, fp32) per head; the groups merge by shuffles, the warps through shared memory. With
// one split the block normalises and writes `out`; otherwise it writes (max, sum) and the fp32
// accumulator [D] to the workspace, and decode_attention_merge_kernel combines the splits of
// each (query, head). Rows whose D is not a multiple of the vector or whose caches are not
// 16-byte aligned take the same path with scalar loads.
//
// Measured on an H200 (bf16, 32 q / 8 kv heads, D 64, cap 8192; back-to-back launches, both
// kernels counted): batch 1 at 128 / 1024 / 4096 / 8064 keys 9.6 / 11.3 / 19.1 / 24.0 us a call,
// against 7.7 / 42.6 / 161.8 / 315.2 us for the former one block per (query, head); batch 8 at
// 8064 keys 102 us (was 616). Short contexts pay the merge kernel's launch (~2 us).
//
// kv_cache_write appends the new token's key and value rows (after RoPE and q/k norms) at each
// sequence's position before the attention reads them.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/decode_attention.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxSplits = 64;
constexpr int64_t kMinChunk = 64;     // keys per split at least
constexpr int64_t kTargetBlocks = 528;  // ~4 blocks per SM on a 132-SM H100 / H200

int64_t heads_per_block(int64_t G) { return G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1; }

int64_t splits_for(int64_t n, int64_t H, int64_t KVH, int64_t cap) {
  const int64_t base = n * (H / heads_per_block(H / KVH));
  int64_t s = (kTargetBlocks + base - 1) / base;
  s = std::min<int64_t>(s, (cap + kMinChunk - 1) / kMinChunk);
  s = std::min<int64_t>(s, kMaxSplits);
  return std::max<int64_t>(s, 1);
}

int64_t partial_bytes(int64_t n, int64_t H, int64_t D, int64_t nsplit) {
  return nsplit <= 1 ? 0 : n * H * nsplit * (D + 2) * static_cast<int64_t>(sizeof(float));
}

// The VEC elements at d0 of a row into f (zeros past D).
template <class T, bool VECOK>
__device__ __forceinline__ void load_chunk(const T* row, int d0, int D, float* f) {
  constexpr int VEC = Vec<T>::kSize;
  if constexpr (VECOK) {
    if (d0 < D) {
      const Vec<T> v = load_vec(row + d0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = v.get(e);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.0f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = d0 + e < D ? to_f32(row[d0 + e]) : 0.0f;
  }
}

// TPK lanes per key, NV 16-byte vectors per lane, HPB query heads per block; VECOK: vector loads.
// Launched with kWarps * 32 threads. __maxnreg__ rather than __launch_bounds__: with the latter
// ptxas held some variants at 64 / 72 / 128 registers and spilled a few bytes; they need at most 143.
template <class T, int TPK, int NV, int HPB, bool VECOK>
__global__ void __maxnreg__(160)
    decode_attention_kernel(T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
                            const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                            const int32_t* __restrict__ slot, const int32_t* __restrict__ len, int H, int KVH, int D,
                            int64_t cap, int64_t window, float scale, int64_t q_row, int nsplit) {
  constexpr int VEC = Vec<T>::kSize, EPL = NV * VEC, KPW = 32 / TPK, DP = TPK * EPL;  // DP: padded D
  constexpr int U = 2;  // key steps per loop iteration (their loads issued together)
  const int i = blockIdx.x, h0 = blockIdx.y * HPB, s = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, sub = lane % TPK, grp = lane / TPK;
  const int g = h0 / (H / KVH);
  const int64_t L = len[i], j0 = window > 0 && L > window ? L - window : 0;
  const int64_t chunk = max(kMinChunk, (L - j0 + nsplit - 1) / nsplit);
  const int64_t js = j0 + s * chunk, je = min(L, js + chunk);
  const int64_t prow = (static_cast<int64_t>(i) * H + h0) * nsplit + s;  // partial row of head h0
  if (js >= je) {  // past the end: an empty partial (only with nsplit > 1: the first split is never empty)
    if (nsplit > 1 && threadIdx.x < HPB) {
      part_ml[(prow + static_cast<int64_t>(threadIdx.x) * nsplit) * 2] = -INFINITY;
      part_ml[(prow + static_cast<int64_t>(threadIdx.x) * nsplit) * 2 + 1] = 0.0f;
    }
    return;
  }
  const int64_t pos_stride = static_cast<int64_t>(KVH) * D;
  const T* kb = kc + (static_cast<int64_t>(slot[i]) * cap * KVH + g) * D;
  const T* vb = vc + (static_cast<int64_t>(slot[i]) * cap * KVH + g) * D;

  float qv[HPB][EPL], acc[HPB][EPL], m[HPB], l[HPB];
#pragma unroll
  for (int hh = 0; hh < HPB; ++hh) {
    const T* qh = q + i * q_row + static_cast<int64_t>(h0 + hh) * D;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = (v * TPK + sub) * VEC + e;
        qv[hh][v * VEC + e] = d < D ? to_f32(qh[d]) * scale : 0.0f;
        acc[hh][v * VEC + e] = 0.0f;
      }
    m[hh] = -INFINITY;
    l[hh] = 0.0f;
  }

  // Warp-uniform loop bounds (the shuffles need every lane); a lane group past je skips the update.
  constexpr int kStep = kWarps * KPW;
  for (int64_t jb = js + warp * KPW; jb < je; jb += U * kStep) {
    float kf[U][EPL], vf[U][EPL];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = jb + u * kStep + grp;
      ok[u] = j < je;
      const T* kj = kb + (ok[u] ? j : js) * pos_stride;
      const T* vj = vb + (ok[u] ? j : js) * pos_stride;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        load_chunk<T, VECOK>(kj, (v * TPK + sub) * VEC, D, &kf[u][v * VEC]);
        load_chunk<T, VECOK>(vj, (v * TPK + sub) * VEC, D, &vf[u][v * VEC]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int hh = 0; hh < HPB; ++hh) {
        float sc = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) sc += qv[hh][e] * kf[u][e];
#pragma unroll
        for (int o = TPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (ok[u]) {
          const float mn = fmaxf(m[hh], sc), corr = __expf(m[hh] - mn), p = __expf(sc - mn);
          l[hh] = l[hh] * corr + p;
#pragma unroll
          for (int e = 0; e < EPL; ++e) acc[hh][e] = acc[hh][e] * corr + p * vf[u][e];
          m[hh] = mn;
        }
      }
    }
  }

  // Merge the lane groups of a warp (same elements, other keys): lanes sub, sub + TPK, ...
#pragma unroll
  for (int o = TPK; o < 32; o <<= 1)
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[hh], o), lo = __shfl_xor_sync(0xffffffffu, l[hh], o);
      const float mn = fmaxf(m[hh], mo);
      const float a = m[hh] == -INFINITY ? 0.0f : __expf(m[hh] - mn), b = mo == -INFINITY ? 0.0f : __expf(mo - mn);
      l[hh] = l[hh] * a + lo * b;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[hh][e], o);
        acc[hh][e] = acc[hh][e] * a + ao * b;
      }
      m[hh] = mn;
    }

  // Merge the warps through shared memory.
  __shared__ float sm[kWarps][HPB], sl[kWarps][HPB];
  __shared__ float sacc[kWarps][HPB][DP];
  if (grp == 0) {
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) {
      if (sub == 0) {
        sm[warp][hh] = m[hh];
        sl[warp][hh] = l[hh];
      }
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) sacc[warp][hh][(v * TPK + sub) * VEC + e] = acc[hh][v * VEC + e];
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < HPB * D; t += blockDim.x) {
    const int hh = t / D, d = t % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w][hh]);
    float Ls = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = sm[w][hh] == -INFINITY ? 0.0f : __expf(sm[w][hh] - M);  // a warp that saw no key adds nothing
      Ls += sl[w][hh] * f;
      o += sacc[w][hh][d] * f;
    }
    if (nsplit == 1) {
      out[(static_cast<int64_t>(i) * H + h0 + hh) * D + d] = from_f32<T>(o / Ls);
    } else {
      const int64_t r = prow + static_cast<int64_t>(hh) * nsplit;
      part_acc[r * D + d] = o;
      if (d == 0) {
        part_ml[r * 2] = M;
        part_ml[r * 2 + 1] = Ls;
      }
    }
  }
}

// One block per (query, head): the splits' partials, rescaled to their common max, summed.
template <class T>
__global__ void __launch_bounds__(128)
    decode_attention_merge_kernel(T* __restrict__ out, const float* __restrict__ part_ml,
                                  const float* __restrict__ part_acc, int D, int nsplit) {
  const int64_t r = blockIdx.x;  // i * H + h
  __shared__ float w[kMaxSplits];
  __shared__ float total;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float M = -INFINITY;
    for (int s = lane; s < nsplit; s += 32) M = fmaxf(M, part_ml[(r * nsplit + s) * 2]);
    M = warp_max(M);
    float Ls = 0.0f;
    for (int s = lane; s < nsplit; s += 32) {
      const float ms = part_ml[(r * nsplit + s) * 2];
      const float f = ms == -INFINITY ? 0.0f : __expf(ms - M);
      w[s] = f;
      Ls += part_ml[(r * nsplit + s) * 2 + 1] * f;
    }
    Ls = warp_sum(Ls);
    if (lane == 0) total = Ls;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < nsplit; ++s)
      if (w[s] != 0.0f) o += part_acc[(r * nsplit + s) * D + d] * w[s];  // empty splits' accumulators unread
    out[r * D + d] = from_f32<T>(o / total);
  }
}

template <class T>
__global__ void kv_cache_write_kernel(T* kc, T* vc, const T* k, const T* v, int64_t src_row,
                                      const int32_t* slot, const int32_t* len, int64_t W, int64_t cap) {
  const int i = blockIdx.x;
  const int64_t at = (static_cast<int64_t>(slot[i]) * cap + len[i] - 1) * W;
  for (int64_t c = threadIdx.x; c < W; c += blockDim.x) {
    kc[at + c] = k[i * src_row + c];
    vc[at + c] = v[i * src_row + c];
  }
}

template <int V>
using IC = std::integral_constant<int, V>;

}  // namespace

int64_t decode_attention_workspace_bytes(int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t cap) {
  if (n <= 0 || H <= 0 || KVH <= 0 || H % KVH != 0) return 0;
  int64_t bytes = 0;  // the most over every batch size up to n (fewer queries take more splits)
  for (int64_t m = 1; m <= n; ++m) bytes = std::max(bytes, partial_bytes(m, H, D, splits_for(m, H, KVH, cap)));
  return bytes;
}

void decode_attention_forward(DType dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                              const int32_t* slot, const int32_t* len, int64_t n, int64_t H, int64_t KVH, int64_t D,
                              int64_t cap, int64_t window, float scale, int64_t q_row, void* workspace,
                              int64_t workspace_bytes, cudaStream_t stream) {
  if (n == 0) return;
  if (D > kDecodeAttentionMaxDim)
    throw RuntimeError(fmt::format("decode_attention: head dim {} above {}", D, kDecodeAttentionMaxDim));
  if (q_row == 0) q_row = H * D;
  int64_t nsplit = splits_for(n, H, KVH, cap);
  if (workspace == nullptr) workspace_bytes = 0;
  if (partial_bytes(n, H, D, nsplit) > workspace_bytes)  // fewer splits where the workspace is short
    nsplit = std::max<int64_t>(1, workspace_bytes / (n * H * (D + 2) * static_cast<int64_t>(sizeof(float))));
  float* part_ml = nsplit > 1 ? static_cast<float*>(workspace) : nullptr;
  float* part_acc = nsplit > 1 ? part_ml + n * H * nsplit * 2 : nullptr;
  const int64_t hpb = heads_per_block(H / KVH);
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(H / hpb), static_cast<unsigned>(nsplit));
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "decode_attention", [&] {
    constexpr int VEC = Vec<scalar_t>::kSize;
    const bool vec_ok = D % VEC == 0 && reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(v_cache) % 16 == 0;
    auto launch = [&](auto tpk, auto nv, auto hpb_c, auto vecok) {
      if constexpr (decltype(nv)::value == 1 || VEC < 8)  // bf16 rows (D <= 256) need one vector a lane
        decode_attention_kernel<scalar_t, decltype(tpk)::value, decltype(nv)::value, decltype(hpb_c)::value,
                                static_cast<bool>(decltype(vecok)::value)><<<grid, kWarps * 32, 0, stream>>>(
            static_cast<scalar_t*>(out), part_ml, part_acc, static_cast<const scalar_t*>(q),
            static_cast<const scalar_t*>(k_cache), static_cast<const scalar_t*>(v_cache), slot, len,
            static_cast<int>(H), static_cast<int>(KVH), static_cast<int>(D), cap, window, scale, q_row,
            static_cast<int>(nsplit));
    };
    auto by_vec = [&](auto tpk, auto nv, auto hpb_c) {
      if (vec_ok) launch(tpk, nv, hpb_c, IC<1>{});
      else launch(tpk, nv, hpb_c, IC<0>{});
    };
    auto by_hpb = [&](auto tpk, auto nv) {
      if (hpb == 4) by_vec(tpk, nv, IC<4>{});
      else if (hpb == 2) by_vec(tpk, nv, IC<2>{});
      else by_vec(tpk, nv, IC<1>{});
    };
    // TPK lanes per key: the 16-byte vectors of a row (ceil(D / VEC)) rounded up to a power of two,
    // at most 32; past 32 vectors (f32 rows above 128) each lane takes two.
    const int64_t vecs = (D + VEC - 1) / VEC;
    if (vecs <= 4) by_hpb(IC<4>{}, IC<1>{});
    else if (vecs <= 8) by_hpb(IC<8>{}, IC<1>{});
    else if (vecs <= 16) by_hpb(IC<16>{}, IC<1>{});
    else if (vecs <= 32) by_hpb(IC<32>{}, IC<1>{});
    else by_hpb(IC<32>{}, IC<2>{});  // f32 rows above 128
  });
  CUDA_CHECK_LAST();
  if (nsplit > 1) {
    PRIMUS_DISPATCH_FLOAT_BF16(dtype, "decode_attention merge", [&] {
      decode_attention_merge_kernel<scalar_t><<<static_cast<unsigned>(n * H), 128, 0, stream>>>(
          static_cast<scalar_t*>(out), part_ml, part_acc, static_cast<int>(D), static_cast<int>(nsplit));
    });
    CUDA_CHECK_LAST();
  }
}

void kv_cache_write(DType dtype, void* k_cache, void* v_cache, const void* k, const void* v, int64_t src_row,
                    const int32_t* slot, const int32_t* len, int64_t n, int64_t KVH, int64_t D, int64_t cap,
                    cudaStream_t stream) {
  if (n == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "kv_cache_write", [&] {
    kv_cache_write_kernel<scalar_t><<<static_cast<unsigned>(n), 256, 0, stream>>>(
        static_cast<scalar_t*>(k_cache), static_cast<scalar_t*>(v_cache), static_cast<const scalar_t*>(k),
        static_cast<const scalar_t*>(v), src_row, slot, len, KVH * D, cap);
  });
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
