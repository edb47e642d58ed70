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
//
// Deferred parameter-gradient sums (NormBackwardArgs::defer, a ColumnSumBatch): on the device the
// backward sums dweight / dbias / dinp_colsum in a second, small launch per call (per-block
// partials, then a fixed-order reduction). A model's backward runs one norm backward per norm (25
// for GPT-2 small), and those launches are short and latency-bound. With `defer` set, a call that
// runs the staged kernel (rows of up to 768 bf16 / 384 f32 columns) leaves its partials in the
// batch's buffer and its sums pending; finish_column_sums() then adds every pending sum in one
// launch, with the same bits as the immediate path. Until then those gradients are incomplete:
// finish before anything reads them (the optimizer, the gradient norm, a data-parallel reduction).
// Calls that run on the CPU or another kernel, or that find the buffer full, finish at once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

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

class ColumnSumBatch;

struct NormBackwardArgs {
  NormType type = NormType::LayerNorm;
  TensorView dinp, dweight, dbias;
  TensorView dout, inp, weight, mean, rstd;
  TensorView dinp_colsum;  // optional: f32 [C] += column sums of the final dinp
  bool accumulate_dinp = true;
  ColumnSumBatch* defer = nullptr;  // optional: leave the parameter-gradient sums pending (see above)
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

BackendType norm_forward(const NormForwardArgs& args);
BackendType norm_backward(const NormBackwardArgs& args);

// The pending sums of deferred norm backwards and the device buffer their partials live in.
class ColumnSumBatch {
 public:
  ColumnSumBatch() = default;
  // `partials`: f32 on the device, contiguous; its size bounds what can be deferred (size it with
  // norm_backward_deferred_floats for each call of a pass).
  explicit ColumnSumBatch(const TensorView& partials);
  bool empty() const { return pending_.empty(); }
  size_t pending() const { return pending_.size(); }  // gradients (dweight, dbias, ...) not yet summed
  int64_t used_floats() const { return used_; }
  int64_t capacity_floats() const { return buf_.defined() ? buf_.numel() : 0; }

  // For the ops that defer (norm_backward): `floats` of the buffer for one call's partials, or
  // nullptr when they do not fit; then each gradient that call leaves pending.
  float* reserve(int64_t floats);
  bool has_pending(const float* dst) const;
  void add_pending(float* dst, const float* partials, int G, int C);

 private:
  friend void finish_column_sums(ColumnSumBatch& batch, const ExecContext& ctx);
  struct Pending {
    float* dst;
    const float* partials;
    int G, C;
  };
  TensorView buf_;
  int64_t used_ = 0;
  std::vector<Pending> pending_;
};

// Adds every pending sum of `batch` into its gradient (one launch per 96 of them) and empties it.
void finish_column_sums(ColumnSumBatch& batch, const ExecContext& ctx);

// The f32 partials one deferred norm backward of that shape leaves in a batch's buffer; 0 when it
// would not defer (the CPU, or rows too wide for the staged kernel). Needs the device it will run on.
int64_t norm_backward_deferred_floats(NormType type, DType dtype, int64_t N, int64_t C, bool dinp_colsum,
                                      bool accumulate_dinp);

}  // namespace primus::turbo
