// SwiGLU's element arithmetic, shared by the activation kernels (activation.cu) and the FP8
// quantizer that computes the activation as it reads (quantize.cu), so that both write the same
// bits: an FP8 copy quantized from gate_up directly equals the activation kernel's output
// quantized afterwards.
#pragma once
#include <cuda_runtime.h>

namespace primus::turbo::cuda {

// The sigmoid's reciprocal is the hardware's approximate one (rcp.approx.ftz: within 1 ulp of
// 1 / y, one instruction where the correctly rounded __frcp_rn adds a refinement and a slow-path
// check). The grouped GEMM's SwiGLU epilogues do this arithmetic for every element in the time
// the other warpgroup's k-loop leaves them, and were limited by instruction issue
// (docs/performance.md, "Each epilogue on its own"). 1 + exp(-x) is at least 1 (or +inf, whose
// reciprocal is 0), so flushing denormals changes nothing. Every SwiGLU path calls this, so the
// fused and separate kernels still write the same bits.
__device__ __forceinline__ float rcp_approx(float y) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}
__device__ __forceinline__ float sigmoid_f(float x) { return rcp_approx(1.0f + __expf(-x)); }
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
