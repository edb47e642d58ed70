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
  // Optional f32 [1] beside the logits: the scale of the gradient becomes dloss / max(kept[0], 1),
  // a count made on the device (count_kept), so a captured step replays for any masked targets.
  TensorView kept;
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

// out [1] f32 = sum of x [n] f32 in a fixed order (device or host; the loss sum of a step). With
// kept (f32 [1] beside x) the sum is scaled by numerator / max(kept[0], 1).
void sum_f32(const TensorView& out, const TensorView& x, const ExecContext& ctx, const TensorView& kept = {},
             float numerator = 1.0f);

// out [1] f32 = the number of targets [n] i32 other than ignore_index (device or host): the rows
// that keep a loss, the denominator of the mean loss under masked targets.
void count_kept(const TensorView& out, const TensorView& targets, int32_t ignore_index, const ExecContext& ctx);

}  // namespace primus::turbo

namespace primus::turbo {

// Vocabulary-parallel cross-entropy (Megatron's): the logits of one row are split by vocabulary
// over a tensor-parallel group and never gathered. Each rank holds logits [N, Vl] for ids
// [vocab_begin, vocab_begin + vocab) (vocab <= Vl real columns, the rest padding). In two halves
// around one all-gather of a few floats per row:
//   vocab_parallel_ce_stats   stats f32 [N, 3] = {max, sum exp(x - max), the target's logit or
//                             0} over this rank's real columns;
//   (the caller all-gathers every rank's stats into all_stats f32 [tp, N, 3], rank order)
//   vocab_parallel_ce_finish  losses f32 [N] = log-sum-exp over the whole vocabulary - the
//                             target's logit (0 for ignore_index rows), the same on every rank;
//                             with dloss != 0 the logits are OVERWRITTEN by this rank's columns of
//                             dloss * (softmax - onehot) (0 on padding and ignored rows).
// A target outside [0, global_vocab) that is not ignore_index: RuntimeError on the host, a NaN
// loss on the device (a kernel cannot throw; the step check sees it). Host f32 or device bf16/f32.
struct VocabParallelCrossEntropyArgs {
  TensorView logits, targets, stats, all_stats, losses;
  int64_t vocab = 0;          // real columns here
  int64_t vocab_begin = 0;    // the id of column 0
  int64_t global_vocab = 0;   // the whole real vocabulary
  float dloss = 0.0f;
  TensorView kept;  // optional f32 [1]: the gradient's scale is dloss / max(kept[0], 1) (CrossEntropyArgs::kept)
  int32_t ignore_index = -100;
  ExecContext ctx;
};
void vocab_parallel_ce_stats(const VocabParallelCrossEntropyArgs& args);
void vocab_parallel_ce_finish(const VocabParallelCrossEntropyArgs& args);

}  // namespace primus::turbo
