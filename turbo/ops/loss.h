// Softmax cross-entropy over the vocabulary, forward and backward fused
// (turbo/kernels/cpu/loss.h is the reference).
//   logits [N, Vp] f32 or bf16 (Vp >= V: padded row; columns >= V are ignored and get 0 grad)
//   targets [N] int32 (ignore_index rows: loss 0, gradient 0)
//   losses [N] f32 (optional), lse [N] f32 (optional)
//   dlogits [N, Vp] (optional; may BE logits: the gradient is written in place, so neither a
//   second [N,V] buffer nor fp32 probabilities exist) = dloss * (softmax - onehot).
// Backends: TURBO (device), CPU (host f32).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct CrossEntropyArgs {
  TensorView logits, dlogits, losses, lse, targets;
  int64_t vocab = 0;          // V, the real vocabulary; 0 means logits.size(-1)
  float dloss = 1.0f;         // e.g. 1 / (number of counted rows * grad-accumulation steps)
  int32_t ignore_index = -100;
  // TURBO: run the legacy two-read kernel instead of the on-chip one (A/B in benchmarks and
  // tests; env PRIMUS_TURBO_CE_KERNEL=legacy does the same for every call).
  bool legacy_kernel = false;
  // TURBO: rows that need a cluster of CTAs run one cluster per row instead of the streamed
  // persistent kernel (A/B; env PRIMUS_TURBO_CE_KERNEL=onchip does the same for every call).
  bool one_row_per_cluster = false;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(logits.dtype); }
};

BackendType cross_entropy(const CrossEntropyArgs& args);

// CTAs per row of the TURBO on-chip kernel for rows of Vp columns of `dtype` on the current device
// (1: one CTA per row; more: a cluster, run by the streamed kernel by default), 0 where the legacy
// kernel serves them or the build has no CUDA.
int cross_entropy_turbo_cluster(DType dtype, int64_t Vp);

// out [1] f32 = sum of x [n] f32 in a fixed order (device or host; the loss sum of a step).
void sum_f32(const TensorView& out, const TensorView& x, const ExecContext& ctx);

}  // namespace primus::turbo
