// Launchers of the pointwise MLP activations (activation.cu): GELU (tanh approximation, GPT-2)
// and SwiGLU (Llama). dtype f32 or bf16; all pointers 16-byte aligned.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

// out[n] = gelu_tanh(inp[n]); out may alias inp. n must be a multiple of 8.
void gelu_forward(DType dtype, void* out, const void* inp, int64_t n, cudaStream_t stream);
// dinp[n] = (or += when accumulate) dout[n] * gelu_tanh'(inp[n]); inp is the forward's input.
// dinp may alias dout (when !accumulate).
void gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n,
                   bool accumulate, cudaStream_t stream);

// gate_up [N, 2F] = [gate | up] per row; out [N, F] = silu(gate) * up. F multiple of 8.
// maxima (optional, f32 [N + F + 1] on the device): overwritten with max |out| of each row, then
// of each column, then of all of out, as stored (turbo::ActivationForwardArgs::maxima).
void swiglu_forward(DType dtype, void* out, const void* gate_up, int64_t N, int64_t F,
                    cudaStream_t stream, float* maxima = nullptr);
// dgate_up [N, 2F] = (or +=) the gradient of both halves from dout [N, F]. maxima (optional, f32
// [N + 2F + 1]): as swiglu_forward's, of dgate_up.
void swiglu_backward(DType dtype, void* dgate_up, const void* gate_up, const void* dout, int64_t N,
                     int64_t F, bool accumulate, cudaStream_t stream, float* maxima = nullptr);

}  // namespace primus::turbo::cuda
