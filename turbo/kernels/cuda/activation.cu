// Pointwise activations: GELU (tanh approximation) and SwiGLU, forward and backward.
//
// Nothing to fuse inside them; what matters is moving each byte once at full width. Each
// thread handles one 128-bit vector per input (8 bf16 / 4 f32) with a grid-stride loop; the
// math runs in fp32. The backward reads the forward's input (not its output), so the forward
// output need not be kept: with SwiGLU that saves a [N, F] tensor per layer.
#include <fmt/format.h>

#include <numeric>
#include <type_traits>

#include "turbo/kernels/cuda/activation.h"
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/swiglu_math.cuh"

namespace primus::turbo::cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// kFast: the hardware tanh (tanh.approx.f32, one MUFU op, max relative error ~2^-11): exact
// enough for bf16/f16 outputs (their rounding step is 2^-8 / 2^-11) and it keeps the kernels at
// memory speed; tanhf's instruction sequence made the bf16 kernels compute-bound. f32 keeps tanhf.
template <bool kFast>
__device__ __forceinline__ float tanh_f(float u) {
  if constexpr (kFast) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
    return t;
  } else {
    return tanhf(u);
  }
}
template <bool kFast = false>
__device__ __forceinline__ float gelu_f(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  return 0.5f * x * (1.0f + tanh_f<kFast>(u));
}
template <bool kFast = false>
__device__ __forceinline__ float gelu_grad_f(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  const float t = tanh_f<kFast>(u);
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
// One vector of row r's silu(gate) * up at column c.
template <class T>
__device__ __forceinline__ Vec<T> swiglu_vec(const T* gate_up, int64_t r, int64_t c, int64_t F) {
  const T* row = gate_up + r * 2 * F;
  const Vec<T> g = load_vec_cs(row + c);
  const Vec<T> u = load_vec_cs(row + F + c);
  Vec<T> y;
#pragma unroll
  for (int e = 0; e < Vec<T>::kSize; ++e) {
    const float x = g.get(e);
    y.set(e, swiglu_f(x, u.get(e)));
  }
  return y;
}
// One vector of row r's dgate (dg) and dup (du) at column c, added to what drow holds when acc.
template <class T>
__device__ __forceinline__ void swiglu_grad_vec(const T* gate_up, const T* dout, const T* drow, int64_t r, int64_t c,
                                                int64_t F, bool acc, Vec<T>& dg, Vec<T>& du) {
  const T* row = gate_up + r * 2 * F;
  const Vec<T> g = load_vec_cs(row + c);
  const Vec<T> u = load_vec_cs(row + F + c);
  const Vec<T> d = load_vec_cs(dout + r * F + c);
  if (acc) { dg = load_vec(drow + c); du = load_vec(drow + F + c); }
#pragma unroll
  for (int e = 0; e < Vec<T>::kSize; ++e) {
    float vg, vu;
    swiglu_grad_f(g.get(e), u.get(e), d.get(e), vg, vu);
    dg.set(e, acc ? dg.get(e) + vg : vg);
    du.set(e, acc ? du.get(e) + vu : vu);
  }
}

template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t nvec) {
  constexpr int W = Vec<T>::kSize;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T> x = load_vec_cs(inp + i * W);
    Vec<T> y;
#pragma unroll
    for (int e = 0; e < W; ++e) y.set(e, gelu_f<!std::is_same_v<T, float>>(x.get(e)));
    store_vec(out + i * W, y);
  }
}

template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t nvec, bool acc) {
  constexpr int W = Vec<T>::kSize;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T> x = load_vec_cs(inp + i * W);
    const Vec<T> g = load_vec_cs(dout + i * W);
    Vec<T> d;
    if (acc) d = load_vec(dinp + i * W);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float v = g.get(e) * gelu_grad_f<!std::is_same_v<T, float>>(x.get(e));
      d.set(e, acc ? d.get(e) + v : v);
    }
    store_vec(dinp + i * W, d);
  }
}

// One thread per vector of the [N, F] output; row r, column vector c.
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* gate_up, int64_t N, int64_t F) {
  constexpr int W = Vec<T>::kSize;
  const int64_t fvec = F / W, total = N * fvec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / fvec, c = (i % fvec) * W;
    store_vec(out + r * F + c, swiglu_vec(gate_up, r, c, F));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate_up, const T* gate_up, const T* dout, int64_t N,
                                       int64_t F, bool acc) {
  constexpr int W = Vec<T>::kSize;
  const int64_t fvec = F / W, total = N * fvec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / fvec, c = (i % fvec) * W;
    T* drow = dgate_up + r * 2 * F;
    Vec<T> dg, du;
    swiglu_grad_vec(gate_up, dout, drow, r, c, F, acc, dg, du);
    store_vec(drow + c, dg);
    store_vec(drow + F + c, du);
  }
}

// SwiGLU with the maxima of what it writes, for the FP8 quantization that reads the result next
// (turbo::QuantizeFp8Args::maxima): max |y| of each row of the output, then of each column, then of
// the whole output, as f32 bits folded with atomicMax (order-free, so deterministic; a NaN's bits
// beat inf's beat any finite value's, as the quantizer's own pass orders them). Taken on the values
// as stored (rounded to T), so the quantizer's scales are the ones its own pass over the output
// would find.
// Tiles of 128 rows x 32W columns of F (256 threads): warp w owns 16 rows, lane l the W columns
// lW..lW+W-1, one 16-byte vector per input and row as the plain kernels above. Row maxima: a warp
// reduction per row (over both halves in the backward), one atomic per row and tile. Column
// maxima: each thread's running maxima over its 16 rows, reduced over the 8 warps through shared
// memory, one atomic per column and tile; the tile's maximum, one atomic per tile. Against the
// quantizer's own amax pass (a second full read of the output) this adds about (rows + columns) /
// 128 atomics per 128 x 128 tile. It runs slower than the plain kernels (Llama-3.2-1B's MLP on an
// H200: forward 5.0 against 3.5 ms a step, backward 6.7 against 5.6; Nsight Compute put the
// forward's L2 at 95% of its throughput with DRAM at 55%); tiles of 128 rows x 256 vectors, each
// thread down its own columns, measured forward 4.6 and backward 8.1 (docs/performance.md). The
// flat kernel below reads as the plain kernels do; these strips serve the rows it cannot take.
constexpr int kMxThreads = 256, kMxWarpRows = 16, kMxRows = kMxWarpRows * (kMxThreads / 32);

__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// One vector of row r at column c, written (y, or dgate_up's two halves in the backward) and folded
// into the column maxima cg (cu: dup's) of its W columns; returns its largest |value| as f32 bits.
template <class T, bool kBackward>
__device__ __forceinline__ uint32_t swiglu_maxima_vec(T* y, const T* gate_up, const T* dout, int64_t r, int64_t c,
                                                      int64_t F, bool acc, uint32_t (&cg)[Vec<T>::kSize],
                                                      uint32_t (&cu)[Vec<T>::kSize]) {
  constexpr int W = Vec<T>::kSize;
  uint32_t m = 0;
  if constexpr (kBackward) {
    T* drow = y + r * 2 * F;
    Vec<T> dg, du;
    swiglu_grad_vec(gate_up, dout, drow, r, c, F, acc, dg, du);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const uint32_t bg = abs_bits(dg.get(e)), bu = abs_bits(du.get(e));
      cg[e] = max(cg[e], bg);
      cu[e] = max(cu[e], bu);
      m = max(m, max(bg, bu));
    }
    store_vec(drow + c, dg);
    store_vec(drow + F + c, du);
  } else {
    const Vec<T> o = swiglu_vec(gate_up, r, c, F);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const uint32_t b = abs_bits(o.get(e));
      cg[e] = max(cg[e], b);
      m = max(m, b);
    }
    store_vec(y + r * F + c, o);
  }
  return m;
}

template <class T, bool kBackward>
__global__ void __launch_bounds__(kMxThreads) swiglu_maxima_kernel(T* y, const T* gate_up, const T* dout,
                                                                   int64_t N, int64_t F, bool acc,
                                                                   uint32_t* maxima) {
  constexpr int W = Vec<T>::kSize, kCols = 32 * W, kHalves = kBackward ? 2 : 1;
  __shared__ uint32_t colpart[kMxThreads / 32][kHalves * kCols];
  __shared__ uint32_t tile_max[kMxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kCols, c = c0 + lane * W;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kMxRows + warp * kMxWarpRows;
  const bool col_ok = c < F;  // F % W == 0: a lane's W columns are all in or all out
  uint32_t cg[W], cu[W];
#pragma unroll
  for (int e = 0; e < W; ++e) cg[e] = cu[e] = 0;
#pragma unroll 4
  for (int i = 0; i < kMxWarpRows; ++i) {
    const int64_t r = r0 + i;
    uint32_t m = 0;
    if (r < N && col_ok) m = swiglu_maxima_vec<T, kBackward>(y, gate_up, dout, r, c, F, acc, cg, cu);
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == i && r < N && m != 0) atomicMax(maxima + r, m);
  }
#pragma unroll
  for (int e = 0; e < W; ++e) {
    colpart[warp][lane * W + e] = cg[e];
    if constexpr (kBackward) colpart[warp][kCols + lane * W + e] = cu[e];
  }
  __syncthreads();
  uint32_t tm = 0;  // this thread's columns' maxima, then the tile's
  for (int k = threadIdx.x; k < kHalves * kCols; k += kMxThreads) {
    const int64_t col = c0 + k % kCols;
    if (col >= F) continue;
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kMxThreads / 32; ++w) m = max(m, colpart[w][k]);
    if (m != 0) atomicMax(maxima + N + (k < kCols ? col : F + col), m);
    tm = max(tm, m);
  }
  tm = __reduce_max_sync(0xffffffffu, tm);
  if (lane == 0) tile_max[warp] = tm;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kMxThreads / 32; ++w) m = max(m, tile_max[w]);
    if (m != 0) atomicMax(maxima + N + kHalves * F, m);
  }
}

// The same maxima with the plain kernels' reading order ("flat"): a grid-stride loop over the
// output's vectors, consecutive threads on consecutive vectors, so every block reads and writes
// whole contiguous stretches of rows. The grid's stride is a whole number of rows, so each thread
// stays on its W columns (W of dgate and W of dup in the backward) from one row to the next and
// keeps their maxima in registers, folded into the maxima with one atomic per column and thread at
// its end. Each row's 32-vector stretch lies within one warp (rows are a multiple of 32 vectors),
// whose reduction gives one atomic per row and stretch; the whole tensor's, one per warp.
// Taken where the row length allows such a grid (flat_grid), else the strips above; by default
// for the forward only (launch_swiglu_maxima).
template <class T, bool kBackward>
__global__ void __launch_bounds__(256) swiglu_maxima_flat_kernel(T* y, const T* gate_up, const T* dout, int64_t N,
                                                                 int64_t F, bool acc, uint32_t* maxima) {
  constexpr int W = Vec<T>::kSize;
  const int64_t fvec = F / W, total = N * fvec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const int64_t c = (first % fvec) * W;  // this thread's columns, the same in every row it visits
  uint32_t cg[W], cu[W], tm = 0;
#pragma unroll
  for (int e = 0; e < W; ++e) cg[e] = cu[e] = 0;
  for (int64_t i = first; i < total; i += stride) {
    const int64_t r = i / fvec;
    uint32_t m = swiglu_maxima_vec<T, kBackward>(y, gate_up, dout, r, c, F, acc, cg, cu);
    // The whole warp is in this iteration (total and stride are multiples of 32 vectors) and in row r.
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0 && m != 0) atomicMax(maxima + r, m);
  }
#pragma unroll
  for (int e = 0; e < W; ++e) {
    if (cg[e] != 0) atomicMax(maxima + N + c + e, cg[e]);
    tm = max(tm, cg[e]);
    if constexpr (kBackward) {
      if (cu[e] != 0) atomicMax(maxima + N + F + c + e, cu[e]);
      tm = max(tm, cu[e]);
    }
  }
  tm = __reduce_max_sync(0xffffffffu, tm);
  if (lane == 0 && tm != 0) atomicMax(maxima + N + (kBackward ? 2 : 1) * F, tm);
}

// flat's grid: a whole number of rows per stride (blocks * 256 a multiple of the row's fvec
// vectors), as many blocks as can be resident at once (`resident` per SM) and not more than the
// rows need; 0 when the row is not a multiple of 32 vectors or no such grid fits at once.
int flat_grid(int64_t N, int64_t fvec, int resident) {
  if (fvec % 32 != 0 || resident <= 0) return 0;
  const int64_t unit = fvec / std::gcd<int64_t>(fvec, 256);  // blocks per whole number of rows
  const int64_t slots = static_cast<int64_t>(resident) * sm_count();
  if (unit > slots) return 0;
  const int64_t rows_per_unit = unit * 256 / fvec;
  const int64_t need = (N + rows_per_unit - 1) / rows_per_unit;  // units that cover every row once
  return static_cast<int>(std::min(need, slots / unit) * unit);
}

template <class T, bool kBackward>
void launch_swiglu_maxima(T* y, const T* gate_up, const T* dout, int64_t N, int64_t F, bool acc, float* maxima,
                          cudaStream_t stream) {
  const int64_t width = kBackward ? 2 * F : F;
  CUDA_CHECK(cudaMemsetAsync(maxima, 0, sizeof(float) * static_cast<size_t>(N + width + 1), stream));
  // auto: the flat forward (0.247 against the strips' 0.302 ms, plain 0.212; 16384 x 8192 bf16, H200)
  // and the strips' backward (0.387 against the flat one's 0.393, plain 0.345).
  const std::string kernel = env_choice("PRIMUS_TURBO_SWIGLU_MAXIMA_KERNEL", {"auto", "flat", "strips"}, "auto");
  const bool strips = kernel == "strips" || (kernel == "auto" && kBackward);
  static const int resident = [] {
    int b = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, swiglu_maxima_flat_kernel<T, kBackward>, 256, 0));
    return b;
  }();
  if (const int blocks = strips ? 0 : flat_grid(N, F / Vec<T>::kSize, resident)) {
    swiglu_maxima_flat_kernel<T, kBackward><<<blocks, 256, 0, stream>>>(y, gate_up, dout, N, F, acc,
                                                                         reinterpret_cast<uint32_t*>(maxima));
    CUDA_CHECK_LAST();
    return;
  }
  constexpr int kCols = 32 * Vec<T>::kSize;
  const dim3 grid(static_cast<unsigned>((F + kCols - 1) / kCols), static_cast<unsigned>((N + kMxRows - 1) / kMxRows));
  swiglu_maxima_kernel<T, kBackward><<<grid, kMxThreads, 0, stream>>>(y, gate_up, dout, N, F, acc,
                                                                      reinterpret_cast<uint32_t*>(maxima));
  CUDA_CHECK_LAST();
}

// Enough blocks to fill every SM several times over; grid-stride loops cover the rest.
int grid_for(int64_t items, int threads) {
  const int64_t want = (items + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * (2048 / threads) * 4;
  return static_cast<int>(std::max<int64_t>(1, std::min(want, cap)));
}

void check_multiple(const char* op, DType dtype, int64_t n, const char* what) {
  const int64_t w = 16 / static_cast<int64_t>(dtype_size(dtype));
  if (n % w != 0)
    throw RuntimeError(fmt::format("{}: {}={} must be a multiple of {} for {}", op, what, n, w,
                                   dtype_name(dtype)));
}

}  // namespace

void gelu_forward(DType dtype, void* out, const void* inp, int64_t n, cudaStream_t stream) {
  check_multiple("gelu_forward", dtype, n, "n");
  if (n == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "gelu_forward", [&] {
    const int64_t nvec = n / Vec<scalar_t>::kSize;
    gelu_forward_kernel<scalar_t><<<grid_for(nvec, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), nvec);
    CUDA_CHECK_LAST();
  });
}

void gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n,
                   bool accumulate, cudaStream_t stream) {
  check_multiple("gelu_backward", dtype, n, "n");
  if (n == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "gelu_backward", [&] {
    const int64_t nvec = n / Vec<scalar_t>::kSize;
    gelu_backward_kernel<scalar_t><<<grid_for(nvec, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(inp),
        static_cast<const scalar_t*>(dout), nvec, accumulate);
    CUDA_CHECK_LAST();
  });
}

void swiglu_forward(DType dtype, void* out, const void* gate_up, int64_t N, int64_t F,
                    cudaStream_t stream, float* maxima) {
  check_multiple("swiglu_forward", dtype, F, "F");
  if (N * F == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "swiglu_forward", [&] {
    if (maxima) {
      launch_swiglu_maxima<scalar_t, false>(static_cast<scalar_t*>(out), static_cast<const scalar_t*>(gate_up),
                                            nullptr, N, F, false, maxima, stream);
      return;
    }
    const int64_t items = N * (F / Vec<scalar_t>::kSize);
    swiglu_forward_kernel<scalar_t><<<grid_for(items, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(gate_up), N, F);
    CUDA_CHECK_LAST();
  });
}

void swiglu_backward(DType dtype, void* dgate_up, const void* gate_up, const void* dout, int64_t N,
                     int64_t F, bool accumulate, cudaStream_t stream, float* maxima) {
  check_multiple("swiglu_backward", dtype, F, "F");
  if (N * F == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "swiglu_backward", [&] {
    if (maxima) {
      launch_swiglu_maxima<scalar_t, true>(static_cast<scalar_t*>(dgate_up), static_cast<const scalar_t*>(gate_up),
                                           static_cast<const scalar_t*>(dout), N, F, accumulate, maxima, stream);
      return;
    }
    const int64_t items = N * (F / Vec<scalar_t>::kSize);
    swiglu_backward_kernel<scalar_t><<<grid_for(items, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(dgate_up), static_cast<const scalar_t*>(gate_up),
        static_cast<const scalar_t*>(dout), N, F, accumulate);
    CUDA_CHECK_LAST();
  });
}

}  // namespace primus::turbo::cuda
