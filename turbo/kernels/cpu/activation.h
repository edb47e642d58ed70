// Pointwise activations of the MLP block: GELU (GPT-2, tanh approximation) and SwiGLU (Llama).
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out[n] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), over a flat array of n elements
// (torch's gelu(approximate="tanh")). Overwrites out; out may alias inp.
template <typename Real>
void gelu_forward(Real* out, const Real* inp, int64_t n);

// dinp[n] += dout[n] * gelu'(inp[n]). Needs the forward's input (not its output).
template <typename Real>
void gelu_backward(Real* dinp, const Real* inp, const Real* dout, int64_t n);

// gate_up [N, 2F] holds [gate | up] halves per row (gate = columns [0,F), up = [F,2F)).
// out[N,F] = silu(gate) * up, silu(x) = x * sigmoid(x). Overwrites out.
template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int64_t N, int64_t F);

// dgate_up [N,2F] += d/d(gate_up) from dout [N,F]: the gate half gets dout*up*silu'(gate), the up
// half dout*silu(gate). Needs the forward's input gate_up.
template <typename Real>
void swiglu_backward(Real* dgate_up, const Real* gate_up, const Real* dout, int64_t N, int64_t F);

}  // namespace primus::turbo::cpu
