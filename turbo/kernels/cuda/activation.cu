// Pointwise activations: GELU (tanh approximation) and SwiGLU, forward and backward.
//
// Nothing to fuse inside them; what matters is moving each byte once at full width. Each
// thread handles one 128-bit vector per input (8 bf16 / 4 f32) with a grid-stride loop; the
// math runs in fp32. The backward reads the forward's input (not its output), so the forward
// output need not be kept: with SwiGLU that saves a [N, F] tensor per layer.
#include <fmt/format.h>

#include <type_traits>

#include "turbo/kernels/cuda/activation.h"
#include "turbo/kernels/cuda/common.cuh"

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
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + __expf(-x)); }

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
    const T* row = gate_up + r * 2 * F;
    const Vec<T> g = load_vec_cs(row + c);
    const Vec<T> u = load_vec_cs(row + F + c);
    Vec<T> y;
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float x = g.get(e);
      y.set(e, x * sigmoid_f(x) * u.get(e));
    }
    store_vec(out + r * F + c, y);
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
    const T* row = gate_up + r * 2 * F;
    T* drow = dgate_up + r * 2 * F;
    const Vec<T> g = load_vec_cs(row + c);
    const Vec<T> u = load_vec_cs(row + F + c);
    const Vec<T> d = load_vec_cs(dout + r * F + c);
    Vec<T> dg, du;
    if (acc) { dg = load_vec(drow + c); du = load_vec(drow + F + c); }
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float x = g.get(e), s = sigmoid_f(x), silu = x * s;
      const float dsilu = s * (1.0f + x * (1.0f - s));
      const float vg = d.get(e) * u.get(e) * dsilu, vu = d.get(e) * silu;
      dg.set(e, acc ? dg.get(e) + vg : vg);
      du.set(e, acc ? du.get(e) + vu : vu);
    }
    store_vec(drow + c, dg);
    store_vec(drow + F + c, du);
  }
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
                    cudaStream_t stream) {
  check_multiple("swiglu_forward", dtype, F, "F");
  if (N * F == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "swiglu_forward", [&] {
    const int64_t items = N * (F / Vec<scalar_t>::kSize);
    swiglu_forward_kernel<scalar_t><<<grid_for(items, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(gate_up), N, F);
    CUDA_CHECK_LAST();
  });
}

void swiglu_backward(DType dtype, void* dgate_up, const void* gate_up, const void* dout, int64_t N,
                     int64_t F, bool accumulate, cudaStream_t stream) {
  check_multiple("swiglu_backward", dtype, F, "F");
  if (N * F == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "swiglu_backward", [&] {
    const int64_t items = N * (F / Vec<scalar_t>::kSize);
    swiglu_backward_kernel<scalar_t><<<grid_for(items, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(dgate_up), static_cast<const scalar_t*>(gate_up),
        static_cast<const scalar_t*>(dout), N, F, accumulate);
    CUDA_CHECK_LAST();
  });
}

}  // namespace primus::turbo::cuda
