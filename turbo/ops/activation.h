// Pointwise MLP activations: GELU (tanh approximation, GPT-2) and SwiGLU (Llama).
//   gelu:   out = gelu_tanh(inp)                      any shape, contiguous
//   swiglu: out [N,F] = silu(gate) * up,  gate_up [N,2F] = [gate | up] per row
// The backwards take the forward's INPUT and write dinp = dout * f'(inp), overwriting unless
// accumulate = true (then +=, the reference kernels' convention). dtype f32 or bf16. GELU's
// backward may run in place (dinp == dout, accumulate false) on every backend.
// SwiGLU may also write the maxima of its output for the FP8 quantization that reads it next
// (QuantizeFp8Args::maxima, which then skips its own pass over the output): `maxima`, f32
// [rows + cols + 1] for the output (out [N,F] forward, dgate_up [N,2F] backward), on its device,
// overwritten with max |y| of each row, then of each column, then of the whole output, of the
// values as stored (rounded to its dtype); a NaN beats inf beats any finite value.
// Backends: TURBO (device), CPU (host f32, turbo/kernels/cpu/activation.h).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

enum class Activation : uint8_t { Gelu, SwiGLU };

struct ActivationForwardArgs {
  Activation act = Activation::Gelu;
  TensorView out, inp;  // swiglu: out [N,F], inp = gate_up [N,2F]
  ExecContext ctx;
  TensorView maxima{};  // swiglu, optional: f32 [N + F + 1] (see above)
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

struct ActivationBackwardArgs {
  Activation act = Activation::Gelu;
  TensorView dinp, inp, dout;  // swiglu: dinp = dgate_up [N,2F], inp = gate_up, dout [N,F]
  bool accumulate = false;
  ExecContext ctx;
  TensorView maxima{};  // swiglu, optional: f32 [N + 2F + 1] (see above)
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

BackendType activation_forward(const ActivationForwardArgs& args);
BackendType activation_backward(const ActivationBackwardArgs& args);

}  // namespace primus::turbo
