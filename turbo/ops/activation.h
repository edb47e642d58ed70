// Pointwise MLP activations: GELU (tanh approximation, GPT-2) and SwiGLU (Llama).
//   gelu:   out = gelu_tanh(inp)                      any shape, contiguous
//   swiglu: out [N,F] = silu(gate) * up,  gate_up [N,2F] = [gate | up] per row
// The backwards take the forward's INPUT and write dinp = dout * f'(inp), overwriting unless
// accumulate = true (then +=, the reference kernels' convention). dtype f32 or bf16. GELU's
// backward may run in place (dinp == dout, accumulate false) on every backend.
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
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

struct ActivationBackwardArgs {
  Activation act = Activation::Gelu;
  TensorView dinp, inp, dout;  // swiglu: dinp = dgate_up [N,2F], inp = gate_up, dout [N,F]
  bool accumulate = false;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

BackendType activation_forward(const ActivationForwardArgs& args);
BackendType activation_backward(const ActivationBackwardArgs& args);

}  // namespace primus::turbo
