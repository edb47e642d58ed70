// Multi-tensor AdamW and global gradient norm.
//
// What it fuses and why: a model has ~150 parameter tensors; one launch per tensor (or several
// elementwise kernels per tensor: decay, moments, update, bf16 copy) costs launch gaps that
// exceed the memory time of the small tensors. Here every tensor is cut into chunks of
// kMultiTensorChunk elements, a prefix table of chunk counts lives in device memory, and block b
// finds its tensor by binary search: one launch updates everything, reading each of master, grad,
// m, v once and writing master, m, v and the bf16 model copy once (128-bit accesses where the
// tensor's pointers allow, scalar otherwise). With split masters (turbo/ops/optimizer.h) the
// master is read and written as the model copy's bf16 words and a u16 buffer of low words, so the
// model copy costs no write of its own. bf16 moments (AdamWStorage) are read widened and written
// rounded stochastically (turbo/core/stochastic_round.h): 4 of the update's bytes a parameter each.
#include <fmt/format.h>

#include <type_traits>
#include <vector>

#include "turbo/core/stochastic_round.h"
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/optimizer.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;  // one float4 per step
static_assert(kMultiTensorChunk % (kThreads * kPerThread) == 0, "chunk must be whole vector steps");

struct TableView {
  const MultiTensorEntry* entries;
  const int64_t* chunk_start;  // [n + 1]
};
__device__ __forceinline__ TableView table_view(const void* table, int n) {
  const auto* e = static_cast<const MultiTensorEntry*>(table);
  return {e, reinterpret_cast<const int64_t*>(e + n)};
}

// The tensor that chunk b belongs to: largest t with chunk_start[t] <= b.
__device__ __forceinline__ int find_tensor(const int64_t* starts, int n, int64_t b) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// This block's chunk: its tensor's entry and the elements [begin, end) of it.
struct BlockChunk {
  MultiTensorEntry e;
  int64_t begin, end;
};
__device__ __forceinline__ BlockChunk block_chunk(const void* table, int n) {
  const TableView tv = table_view(table, n);
  const int64_t b = blockIdx.x;
  const int t = find_tensor(tv.chunk_start, n, b);
  BlockChunk c{tv.entries[t], (b - tv.chunk_start[t]) * kMultiTensorChunk, 0};
  c.end = min(c.e.numel, c.begin + kMultiTensorChunk);
  return c;
}

template <class G>
__device__ __forceinline__ void load4(const G* g, int64_t i, float out[4]);
template <>
__device__ __forceinline__ void load4<float>(const float* g, int64_t i, float out[4]) {
  const float4 v = __ldcs(reinterpret_cast<const float4*>(g + i));
  out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}
template <>
__device__ __forceinline__ void load4<bf16>(const bf16* g, int64_t i, float out[4]) {
  // bf16 is the top half of an f32: shifts, not a reinterpreted local (which put it on the stack).
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(g + i));
  out[0] = __uint_as_float(raw.x << 16), out[1] = __uint_as_float(raw.x & 0xffff0000u);
  out[2] = __uint_as_float(raw.y << 16), out[3] = __uint_as_float(raw.y & 0xffff0000u);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A moment's four elements at i: f32 (one float4) or bf16 (one 8-byte word, widened).
template <bool kB16>
__device__ __forceinline__ void load_moment4(const void* p, int64_t i, float out[4]) {
  if constexpr (kB16) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(p) + i);
    out[0] = __uint_as_float(raw.x << 16), out[1] = __uint_as_float(raw.x & 0xffff0000u);
    out[2] = __uint_as_float(raw.y << 16), out[3] = __uint_as_float(raw.y & 0xffff0000u);
  } else {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
}
// ... and stored: bf16 rounded stochastically, with the m (kV false) or v half of each element's hash.
template <bool kB16, bool kV>
__device__ __forceinline__ void store_moment4(void* p, int64_t i, const float x[4], const uint32_t h[4]) {
  if constexpr (kB16) {
    const auto r = [&](int k) -> uint32_t {
      return kV ? bf16_bits_stochastic(x[k], h[k] >> 16) : bf16_bits_stochastic(x[k], h[k]);
    };
    __stcs(reinterpret_cast<uint2*>(static_cast<bf16*>(p) + i), make_uint2(r(0) | (r(1) << 16), r(2) | (r(3) << 16)));
  } else {
    __stcs(reinterpret_cast<float4*>(static_cast<float*>(p) + i), make_float4(x[0], x[1], x[2], x[3]));
  }
}
template <bool kB16>
__device__ __forceinline__ float load_moment(const void* p, int64_t i) {
  if constexpr (kB16) return __bfloat162float(static_cast<const bf16*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}
template <bool kB16, bool kV>
__device__ __forceinline__ void store_moment(void* p, int64_t i, float x, uint32_t h) {
  if constexpr (kB16) {
    reinterpret_cast<uint16_t*>(p)[i] = kV ? bf16_bits_stochastic(x, h >> 16) : bf16_bits_stochastic(x, h);
  } else {
    static_cast<float*>(p)[i] = x;
  }
}

struct AdamWScalars {
  float lr, bc1, bc2;
  uint32_t step;  // the stochastic rounding's step key (bf16 moments)
};

// Every operation rounded explicitly (no contraction left to the compiler), so that each
// instantiation of the kernel below (with or without the norm, f32 or bf16 gradients) gives the
// same bits for the same inputs: the optimizer in the backward is checked bit for bit against
// the update after it.
__device__ __forceinline__ float adamw_one(float p, float g, float& m, float& v, float lr,
                                           float b1, float b2, float eps, float wd, float bc1,
                                           float bc2) {
  p = __fmaf_rn(-__fmul_rn(lr, wd), p, p);  // decoupled decay on the old value (torch order)
  m = __fmaf_rn(b1, m, __fmul_rn(__fsub_rn(1.0f, b1), g));
  v = __fmaf_rn(b2, v, __fmul_rn(__fmul_rn(__fsub_rn(1.0f, b2), g), g));
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bc2)), eps);
  return __fsub_rn(p, __fdiv_rn(__fmul_rn(lr, __fdiv_rn(m, bc1)), denom));
}

// Split masters (turbo/core/dtype.h): the fp32 bits from the bf16 high word and the low word, and
// back (high: rounded to nearest, ties away from zero; low: the value's own low 16 bits).
__device__ __forceinline__ float join_split(uint32_t hi, uint32_t lo) {
  return __uint_as_float((hi << 16) + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(lo))));
}
__device__ __forceinline__ uint32_t split_hi(float p) { return (__float_as_uint(p) + 0x8000u) >> 16; }
// Two values' high (or low) words packed as one 32-bit word, the first in the low half.
__device__ __forceinline__ uint32_t pack_hi2(float a, float b) { return split_hi(a) | (split_hi(b) << 16); }
__device__ __forceinline__ uint32_t pack_lo2(float a, float b) {
  return (__float_as_uint(a) & 0xffffu) | (__float_as_uint(b) << 16);
}

// The update of elements [begin, end) of tensor e; returns the sum of squares of the (unscaled)
// gradients read when kNorm. kSplit: the master is e.model's high words and e.master_lo's low words.
// kMom: bit 0 m is bf16, bit 1 v is bf16.
template <class G, bool kNorm, bool kSplit, int kMom>
__device__ __forceinline__ float adamw_chunk(const MultiTensorEntry& e, int64_t begin, int64_t end, const AdamWStep& hp,
                                             const AdamWScalars& s, float scale) {
  const float wd = e.decay ? hp.weight_decay : 0.0f;
  const G* grad = static_cast<const G*>(e.grad);
  bf16* model = static_cast<bf16*>(e.model);
  uint16_t* lo = e.master_lo;
  constexpr bool kM16 = kMom & 1, kV16 = (kMom & 2) != 0;
  // Uniform per tensor, so no divergence: the vector path needs 16-byte master and f32 m/v, 8-byte
  // bf16 m/v, 8- or 16-byte grad, and 8-byte model (and low-word) pointers (offsets are multiples
  // of 4 elements).
  constexpr int W = kPerThread;
  const bool vec = (reinterpret_cast<uintptr_t>(kSplit ? nullptr : e.master) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(e.m) % (kM16 ? 8 : 16) == 0) &&
                   (reinterpret_cast<uintptr_t>(e.v) % (kV16 ? 8 : 16) == 0) &&
                   (reinterpret_cast<uintptr_t>(grad) % (4 * sizeof(G)) == 0) &&
                   ((reinterpret_cast<uintptr_t>(model) | reinterpret_cast<uintptr_t>(lo)) % 8 == 0);
  const int64_t vec_end = vec ? begin + ((end - begin) / W) * W : begin;
  float ss = 0.0f;
  for (int64_t i = begin + threadIdx.x * W; i < vec_end; i += kThreads * W) {
    float g[W];
    load4<G>(grad, i, g);
    float p[W];
    if (kSplit) {
      const uint2 h = __ldcs(reinterpret_cast<const uint2*>(model + i));
      const uint2 l = __ldcs(reinterpret_cast<const uint2*>(lo + i));
      p[0] = join_split(h.x & 0xffffu, l.x & 0xffffu), p[1] = join_split(h.x >> 16, l.x >> 16);
      p[2] = join_split(h.y & 0xffffu, l.y & 0xffffu), p[3] = join_split(h.y >> 16, l.y >> 16);
    } else {
      const float4 p4 = *reinterpret_cast<const float4*>(e.master + i);
      p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
    }
    float m[W], v[W];
    load_moment4<kM16>(e.m, i, m);
    load_moment4<kV16>(e.v, i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (kNorm) ss = __fmaf_rn(g[k], g[k], ss);
      p[k] = adamw_one(p[k], __fmul_rn(g[k], scale), m[k], v[k], s.lr, hp.beta1, hp.beta2, hp.eps, wd, s.bc1, s.bc2);
    }
    uint32_t h[W] = {0, 0, 0, 0};
    if constexpr (kMom != 0) {
#pragma unroll
      for (int k = 0; k < W; ++k) h[k] = sr_hash(static_cast<uint64_t>(e.sr_key + i + k), s.step);
    }
    store_moment4<kM16, false>(e.m, i, m, h);
    store_moment4<kV16, true>(e.v, i, v, h);
    if (kSplit) {
      __stcs(reinterpret_cast<uint2*>(lo + i), make_uint2(pack_lo2(p[0], p[1]), pack_lo2(p[2], p[3])));
      *reinterpret_cast<uint2*>(model + i) = make_uint2(pack_hi2(p[0], p[1]), pack_hi2(p[2], p[3]));
    } else {
      __stcs(reinterpret_cast<float4*>(e.master + i), make_float4(p[0], p[1], p[2], p[3]));
      if (model) *reinterpret_cast<uint2*>(model + i) = make_uint2(pack_bf16x2(p[0], p[1]), pack_bf16x2(p[2], p[3]));
    }
  }
  auto* model_bits = reinterpret_cast<uint16_t*>(model);
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) {
    float m = load_moment<kM16>(e.m, i), v = load_moment<kV16>(e.v, i);
    const float graw = to_f32(grad[i]);
    if (kNorm) ss = __fmaf_rn(graw, graw, ss);
    const float p0 = kSplit ? join_split(model_bits[i], lo[i]) : e.master[i];
    const float p = adamw_one(p0, __fmul_rn(graw, scale), m, v, s.lr, hp.beta1, hp.beta2, hp.eps, wd, s.bc1, s.bc2);
    const uint32_t h = kMom != 0 ? sr_hash(static_cast<uint64_t>(e.sr_key + i), s.step) : 0u;
    store_moment<kM16, false>(e.m, i, m, h);
    store_moment<kV16, true>(e.v, i, v, h);
    if (kSplit) {
      model_bits[i] = static_cast<uint16_t>(split_hi(p));
      lo[i] = static_cast<uint16_t>(__float_as_uint(p) & 0xffffu);
    } else {
      e.master[i] = p;
      if (model) model[i] = __float2bfloat16_rn(p);
    }
  }
  return ss;
}

// Four elements a thread per step: one float4 of master, m and v, an 8-byte store of the bf16
// copy (eight a thread, with 16-byte stores of the copy, measured slower on an H200: 3,359 vs
// 3,855 GB/s with the copy, 80,254 vs 83,766 tok/s training olmoe-mini). Each block's tensor says
// its gradient's dtype (uniform over the block). kNorm: also the sum of squares of this block's
// (unscaled) gradients into partial[block], for the norm of exactly what was applied, in the same
// pass over the gradients (the optimizer in the backward); a skipped update leaves NaN there.
// Five blocks an SM (48 registers), stated: with both gradient dtypes in one kernel, ptxas's own
// choice of the same 48 registers spilled 16 bytes (4 when told).
template <bool kNorm, bool kSplit, int kMom>
__global__ void __launch_bounds__(kThreads, 5)
adamw_kernel(const void* table, int n, AdamWStep hp, AdamWScalars host, const float* grad_scale,
             const float* device_scalars, float* partial) {
  const float scale = grad_scale ? *grad_scale : 1.0f;
  // A non-finite scale marks a non-finite step (the caller's on-device check): leave everything
  // as it is, so no host decision is needed between the gradients and the update.
  if (!isfinite(scale)) {
    if (kNorm && threadIdx.x == 0) partial[blockIdx.x] = __int_as_float(0x7fc00000);
    return;
  }
  const BlockChunk c = block_chunk(table, n);
  const MultiTensorEntry& e = c.e;
  const int64_t b = blockIdx.x, begin = c.begin, end = c.end;
  AdamWScalars s = host;
  if (device_scalars) {
    s.lr = device_scalars[0], s.bc1 = device_scalars[1], s.bc2 = device_scalars[2];
    if (kMom != 0) s.step = static_cast<uint32_t>(device_scalars[3]);
  }
  __shared__ float smem[32];
  const auto run = [&](auto g) {
    const float ss = adamw_chunk<decltype(g), kNorm, kSplit, kMom>(e, begin, end, hp, s, scale);
    if (kNorm) {
      const float sum = block_sum(ss, smem);
      if (threadIdx.x == 0) partial[b] = sum;
    }
  };
  if (e.grad_bf16) run(bf16{});
  else run(float{});
}

template <class G>
__device__ __forceinline__ float sum_squares_chunk(const MultiTensorEntry& e, int64_t begin, int64_t end) {
  const G* grad = static_cast<const G*>(e.grad);
  const bool vec = reinterpret_cast<uintptr_t>(grad) % (4 * sizeof(G)) == 0;
  const int64_t vec_end = vec ? begin + ((end - begin) / 4) * 4 : begin;
  float s = 0.0f;
  for (int64_t i = begin + threadIdx.x * 4; i < vec_end; i += kThreads * 4) {
    float g[4];
    load4<G>(grad, i, g);
    s += g[0] * g[0] + g[1] * g[1] + g[2] * g[2] + g[3] * g[3];
  }
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) {
    const float g = to_f32(grad[i]);
    s += g * g;
  }
  return s;
}

__global__ void __launch_bounds__(kThreads)
sum_squares_kernel(float* partial, const void* table, int n) {
  __shared__ float smem[32];
  const BlockChunk c = block_chunk(table, n);
  const MultiTensorEntry& e = c.e;
  const int64_t b = blockIdx.x, begin = c.begin, end = c.end;
  float s = e.grad_bf16 ? sum_squares_chunk<bf16>(e, begin, end) : sum_squares_chunk<float>(e, begin, end);
  s = block_sum(s, smem);
  if (threadIdx.x == 0) partial[b] = s;
}

// One block. Each thread adds partials tid, tid + blockDim, ... in that order (kIlp loads in flight
// before they are added; the padding past num adds 0.0, which leaves a double sum unchanged), so
// the result is the bits of the plain strided loop in fewer memory round trips: Llama-3.2-1B's
// ~366k partials took 89 us one load at a time (H200 trace).
__global__ void finish_norm_kernel(float* out, const float* partial, int64_t num, float max_norm) {
  __shared__ double smem[32];
  constexpr int kIlp = 16;
  const int64_t stride = blockDim.x;
  double s = 0.0;
  for (int64_t base = threadIdx.x; base < num; base += kIlp * stride) {
    float x[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = base + u * stride;
      x[u] = i < num ? partial[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) s += x[u];
  }
  // Fixed-shape tree in double: the same bits every run.
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < blockDim.x / 32 ? smem[threadIdx.x] : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) {
      const double norm = sqrt(s);
      out[0] = static_cast<float>(norm);
      out[1] = max_norm > 0.0f ? static_cast<float>(fmin(1.0, max_norm / (norm + 1e-6))) : 1.0f;
    }
  }
}

}  // namespace

size_t multi_tensor_table_bytes(int n) {
  return static_cast<size_t>(n) * sizeof(MultiTensorEntry) + static_cast<size_t>(n + 1) * sizeof(int64_t);
}

int64_t multi_tensor_table_build(void* device_table, const MultiTensorEntry* entries, int n) {
  if (n <= 0) throw RuntimeError("multi_tensor_table_build: no tensors");
  std::vector<char> host(multi_tensor_table_bytes(n));
  auto* starts = reinterpret_cast<int64_t*>(host.data() + n * sizeof(MultiTensorEntry));
  int64_t chunks = 0;
  for (int i = 0; i < n; ++i) {
    const MultiTensorEntry& e = entries[i];
    const bool master = e.master ? !e.master_lo : e.master_lo && e.model;  // f32, or split with its high words
    if (e.sr_key < 0) throw RuntimeError(fmt::format("multi_tensor_table_build: tensor {} has sr_key {} < 0", i, e.sr_key));
    if (e.numel <= 0 || !master || !e.grad || !e.m || !e.v)
      throw RuntimeError(fmt::format("multi_tensor_table_build: tensor {} has numel {} or a null pointer (grad, m, v "
                                     "and either master or master_lo with model are required)",
                                     i, e.numel));
    starts[i] = chunks;
    chunks += (e.numel + kMultiTensorChunk - 1) / kMultiTensorChunk;
  }
  starts[n] = chunks;
  std::memcpy(host.data(), entries, n * sizeof(MultiTensorEntry));
  CUDA_CHECK(cudaMemcpy(device_table, host.data(), host.size(), cudaMemcpyHostToDevice));
  return chunks;
}

void adamw_multi_tensor(const void* table, int n, int64_t chunks, const AdamWStep& hp, const float* grad_scale,
                        const float* device_scalars, cudaStream_t stream, float* norm_out, void* scratch,
                        const AdamWStorage& storage) {
  if (chunks <= 0) return;
  if (norm_out && !scratch) throw RuntimeError("adamw_multi_tensor: the gradient norm needs scratch for its partial sums");
  const AdamWScalars host{hp.lr, static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step))),
                          static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step))),
                          static_cast<uint32_t>(hp.step)};
  const unsigned grid = static_cast<unsigned>(chunks);
  auto* partial = static_cast<float*>(scratch);
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(table, n, hp, host, grad_scale, device_scalars, norm_out ? partial : nullptr);
  };
  // The instantiation for (norm, split, moments' dtypes), each a compile-time choice.
  const auto with_moments = [&](auto norm, auto split) {
    constexpr bool kN = decltype(norm)::value, kS = decltype(split)::value;
    switch ((storage.m_bf16 ? 1 : 0) | (storage.v_bf16 ? 2 : 0)) {
      case 0: launch(adamw_kernel<kN, kS, 0>); break;
      case 1: launch(adamw_kernel<kN, kS, 1>); break;
      case 2: launch(adamw_kernel<kN, kS, 2>); break;
      default: launch(adamw_kernel<kN, kS, 3>); break;
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (norm_out)
    storage.split_master ? with_moments(T{}, T{}) : with_moments(T{}, F{});
  else
    storage.split_master ? with_moments(F{}, T{}) : with_moments(F{}, F{});
  CUDA_CHECK_LAST();
  if (norm_out) {
    finish_norm_kernel<<<1, 1024, 0, stream>>>(norm_out, static_cast<const float*>(scratch), chunks, 0.0f);
    CUDA_CHECK_LAST();
  }
}

size_t grad_norm_scratch_bytes(int64_t chunks) { return static_cast<size_t>(chunks) * sizeof(float); }

void grad_norm_multi_tensor(float* out, const void* table, int n, int64_t chunks, float max_norm, void* scratch,
                            cudaStream_t stream) {
  if (chunks <= 0) throw RuntimeError("grad_norm_multi_tensor: empty table");
  float* partial = static_cast<float*>(scratch);
  sum_squares_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(partial, table, n);
  CUDA_CHECK_LAST();
  finish_norm_kernel<<<1, 1024, 0, stream>>>(out, partial, chunks, max_norm);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
