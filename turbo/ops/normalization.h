// LayerNorm (GPT-2) and RMSNorm (Llama) over the last dimension, with the residual add fused.
//
// Forward, with x the activation [N,C] and an optional residual r [N,C]:
//   r defined:  residual_out = x + r;  out = norm(residual_out)
//   otherwise:  out = norm(x)
// norm(y) = (y - mean) * rstd * weight + bias  (LayerNorm; bias optional)
//         = y * rstd * weight                  (RMSNorm)
// saving mean [N] (LayerNorm) and rstd [N] (both f32) for the backward. `out` may have padded
// rows (a row stride above C, on the device a multiple of 16 bytes); the padding is not written.
// That lets a caller keep extra columns beside the output, e.g. the column of ones with which
// turbo::linear_backward_weight_ones (gemm.h) gets a linear layer's bias gradient from its weight GEMM.
//
// Backward from dout [N,C]: dinp [N,C] += the input gradient (the residual stream's gradient
// buffer: the residual add's backward is the identity, so adding is the fused backward; pass
// accumulate_dinp = false to overwrite instead), dweight [C] += and dbias [C] += (f32).
// `inp` is what was normalised: residual_out for the fused forward.
// Optional dinp_colsum (f32 [C], same device; undefined = not computed): += the column sums
// over the N rows of dinp as this call leaves them (after the accumulate; on the device the
// values as stored, i.e. rounded to bf16 when dinp is bf16), in the same pass and the same
// fixed order as dweight. In a transformer backward dinp is the residual stream's gradient, and
// its column sums are the bias gradients of the linear layers that write into the residual
// (attention projection, MLP down-projection): this saves a separate reduction for them.
//
// dtypes: activations/weight/bias f32 or bf16 (same for all), statistics and parameter
// gradients f32. Backends: TURBO (device; needs ctx.scratch for the backward), CPU (host f32).
// The CPU backend computes with the reference kernels (turbo/kernels/cpu/normalization.h).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

enum class NormType : uint8_t { LayerNorm, RMSNorm };

struct NormForwardArgs {
  NormType type = NormType::LayerNorm;
  TensorView out, mean, rstd, residual_out;  // mean unused for RMSNorm
  TensorView inp, residual, weight, bias;
  float eps = 1e-5f;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

struct NormBackwardArgs {
  NormType type = NormType::LayerNorm;
  TensorView dinp, dweight, dbias;
  TensorView dout, inp, weight, mean, rstd;
  TensorView dinp_colsum;  // optional: f32 [C] += column sums of the final dinp
  bool accumulate_dinp = true;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

BackendType norm_forward(const NormForwardArgs& args);
BackendType norm_backward(const NormBackwardArgs& args);

}  // namespace primus::turbo
