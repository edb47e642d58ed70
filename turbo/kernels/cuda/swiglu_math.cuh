// SwiGLU's element arithmetic, shared by the activation kernels (activation.cu) and the FP8
// quantizer that computes the activation as it reads (quantize.cu), so that both write the same
// bits: an FP8 copy quantized from gate_up directly equals the activation kernel's output
// quantized afterwards.
#pragma once
#include <cuda_runtime.h>

namespace primus::turbo::cuda {

// __frcp_rn is the correctly rounded reciprocal, the bits of 1.0f / y, without the division's
// slow path: the folded quantizer does this arithmetic for every element beside its transpose.
__device__ __forceinline__ float sigmoid_f(float x) { return __frcp_rn(1.0f + __expf(-x)); }
// silu(gate x) * up u.
__device__ __forceinline__ float swiglu_f(float x, float u) { return x * sigmoid_f(x) * u; }
// d(gate) and d(up) of one element from gate x, up u and the output's gradient d.
__device__ __forceinline__ void swiglu_grad_f(float x, float u, float d, float& vg, float& vu) {
  const float s = sigmoid_f(x), silu = x * s;
  const float dsilu = s * (1.0f + x * (1.0f - s));
  vg = d * u * dsilu;
  vu = d * silu;
}

}  // namespace primus::turbo::cuda
