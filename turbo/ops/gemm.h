// GEMM: D = epilogue(alpha * A @ B + beta * D), the op behind every linear layer.
//
// Operands are TensorViews; a layout is shape + strides, so transposition is a view, not a
// flag: pass W.transposed() to multiply by W^T. A [M,K] and B [K,N] may each be row-major
// (stride(-1) == 1) or column-major (stride(-2) == 1, e.g. a transposed view); D [M,N] must be
// row-major. 3-D views [batch, ., .] run a strided batched GEMM (a batch stride of 0 broadcasts).
// dtypes: A, B bf16/f16 with D the same or f32, or all f32 (fp32 accumulation throughout).
// FP8: A, B f8e4m3/f8e5m2 (not both e5m2) with D bf16/f16/f32 and dequantization scales:
// D = epilogue(alpha * sum_k a_scale(i,k) * b_scale(k,j) * A[i,k] B[k,j] + beta * D), where
// a_scale/b_scale are f32 views on the operands' device (the scale_inv that turbo::quantize_fp8
// writes) at the granularities a_scaling / b_scaling (turbo/core/fp8_granularity.h), read for A
// as the [M, K] matrix and for B as its stored [N, K] (B^T): Tensor [1]; Row [M] / [N] (both
// operands Row); Block1x128 [K/128, M] / [K/128, N]; Block128x128 [M/128, pad4(K/128)] /
// [N/128, pad4(K/128)]; the block granularities pair 1x128 with 1x128 or with 128x128 (not two
// 128x128 operands), take E4M3 operands, K a multiple of 128 and no fast accumulation. On the
// GPU (cuBLASLt, Hopper) both FP8 operands must be K-contiguous: A row-major [M,K] and B the
// transposed view of a row-major [N,K]; turbo/ops/gemm_fp8.h has the linear layers built on it.
//
// Backends: CUBLASLT (device tensors; default), TURBO (Turbo's sm90a kernel: bf16/f16, epilogues
// none, bias, gelu_aux(_bias), dgelu; the default for those epilogues on 16-bit tensors, see
// PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND in gemm.cpp), CPU (host f32 tensors, OpenBLAS). Chosen per call
// by the dispatcher: PRIMUS_TURBO_GEMM_BACKEND, PRIMUS_TURBO_AUTO_TUNE, set_backend("gemm", ...).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/core/fp8_granularity.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

enum class GemmEpilogue : uint8_t {
  None,
  Bias,         // D += bias[N]
  Gelu,         // D = gelu_tanh(D)
  GeluBias,     // D = gelu_tanh(D + bias[N])
  GeluAux,      // aux[M,N] = D; D = gelu_tanh(aux)         (aux: pre-activation for backward)
  GeluAuxBias,  // aux[M,N] = D + bias[N]; D = gelu_tanh(aux)
  DGelu,        // D = D * gelu_tanh'(aux)                   (backward through the activation)
  DGeluBGrad,   // as DGelu and bias[N] = column sums of D   (bias gradient, OVERWRITTEN)
  BGradA,       // bias[M] = sums of A over K                (e.g. db of dW = dout^T @ x; OVERWRITTEN)
  BGradB,       // bias[N] = sums of B over K                (OVERWRITTEN)
};
const char* gemm_epilogue_name(GemmEpilogue e);

struct GemmArgs {
  TensorView a, b, d;
  float alpha = 1.0f, beta = 0.0f;
  GemmEpilogue epilogue = GemmEpilogue::None;
  TensorView bias;          // see GemmEpilogue; dtype of D
  TensorView aux;           // [M,N] row-major, dtype of D, row stride a multiple of 8
  bool allow_tf32 = false;  // f32 only: TF32 tensor cores (about 1e-3 relative error)
  TensorView a_scale, b_scale;  // FP8 only: f32 dequantization factors (see above)
  Fp8Granularity a_scaling = Fp8Granularity::Tensor, b_scaling = Fp8Granularity::Tensor;  // FP8 only
  bool fp8_fast_accum = false;  // FP8 only: cuBLASLt's fast accumulation (no periodic promotion
                                // of the tensor-core partial sums to fp32; forward passes only)
  ExecContext ctx;

  // Shapes, dtypes, layouts, epilogue: the autotune key (no pointers).
  std::string key() const;
  Precision precision() const { return precision_of(a.dtype); }
};

// Runs the GEMM on the dispatched backend and returns which one ran. Throws
// primus::RuntimeError naming the shapes when the operands do not fit together.
BackendType gemm(const GemmArgs& args);

// Linear layers in the nn.Linear convention: inp [N,C], weight [OC,C], bias [OC], out [N,OC].
// out = inp @ weight^T (+ bias); with `aux` defined the output is gelu_tanh of that and aux
// [N,OC] keeps the pre-activation (GPT-2's MLP up-projection).
BackendType linear_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                           const TensorView& bias, const TensorView& aux, const ExecContext& ctx);

// Backward of linear_forward from dout [N,OC]:
//   dinp [N,C] = dout @ weight (+= when accumulate_dinp)          (skipped if dinp undefined)
//   dweight [OC,C] += dout^T @ inp (= when !accumulate_dweight)  (skipped if undefined)
//   dbias [OC] += column sums of dout, fused into the dweight GEMM (skipped if undefined; always +=)
// dweight/dbias may be f32 with bf16 activations (fp32 gradient accumulation). accumulate_dweight
// = false is the first micro-batch's form: the GEMM writes dweight (beta 0) instead of reading it
// back, so the caller need not zero it first.
void linear_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const TensorView& weight,
                     bool accumulate_dinp, const ExecContext& ctx, bool accumulate_dweight = true);

// A linear layer's weight and bias gradients from its weight GEMM alone. `inp_ones` is the layer
// input [N, C] kept with padded rows, [N, Cp] with Cp > C, whose column C holds 1 in every row and
// whose later columns hold 0 (turbo::norm_forward writes such padded rows, leaving the padding as
// it was). Then dout^T @ inp_ones = [dout^T @ inp | column sums of dout | 0 ...]: one GEMM into f32
// scratch [OC, Cp] yields both, and a small pass moves them out:
//   dweight [OC, C] f32 += its first C columns (= when !accumulate_dweight), dbias [OC] f32 += column C.
// It replaces bias_grad's pass over dout ([N, OC]) by a pass over [OC, Cp] f32, a small fraction
// when N (tokens) is much larger than C. The GEMM runs through turbo::gemm (the dispatched backend);
// on the device the scratch comes from ctx.scratch.
void linear_backward_weight_ones(const TensorView& dweight, const TensorView& dbias, const TensorView& dout,
                                 const TensorView& inp_ones, const ExecContext& ctx, bool accumulate_dweight = true);
// Bytes of ctx.scratch that linear_backward_weight_ones needs for OC outputs and Cp padded columns.
size_t linear_backward_weight_ones_scratch_bytes(int64_t OC, int64_t Cp);

// dbias [C] f32 += column sums of dout [N,C] (f32 or bf16, rows may be strided): a linear layer's
// bias gradient as its own reduction, for callers whose weight-gradient GEMM should stay free of
// the bias-gradient epilogue (on an H100 that epilogue costs GPT-2's layers 20-55% of the GEMM).
// Deterministic on the device (fixed-order partial sums, no atomics);
// host f32 tensors on the CPU in row order, accumulated in double.
void bias_grad(const TensorView& dbias, const TensorView& dout, const ExecContext& ctx);

// dpre [N,C] = (dout [N,OC] @ weight [OC,C]) * gelu_tanh'(pre_aux [N,C]), and, when dbias is
// defined, dbias [C] = column sums of dpre (overwritten): the input gradient of a linear layer
// whose input was gelu(pre_aux), fused into one GEMM epilogue.
void linear_backward_input_dgelu(const TensorView& dpre, const TensorView& dbias,
                                 const TensorView& dout, const TensorView& weight,
                                 const TensorView& pre_aux, const ExecContext& ctx);

}  // namespace primus::turbo
