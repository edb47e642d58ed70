// Softmax cross-entropy over the vocabulary, from logits (the LM head's output).
// Shapes: logits/dlogits [N,V] (N = B*T rows), targets [N] int32, lse [N].
// Rows whose target equals ignore_index (-100, as in torch) contribute neither loss nor gradient.
// Padded vocabulary: with ld > V the rows are ld apart and only the first V columns are classes
// (the softmax is over them); the backward writes 0 into columns [V, ld), so padded rows of the
// LM head get no gradient (as llm.c and the cuda backend). ld = 0 means V.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

inline constexpr int32_t kIgnoreIndex = -100;

struct CrossEntropyResult {
  double loss_sum = 0.0;  // sum of -log softmax(logits)[target] over the counted rows
  int64_t count = 0;      // rows whose target is not ignore_index
  // Mean over the counted rows (0 when there are none, as no gradient flows then either).
  double mean() const { return count > 0 ? loss_sum / static_cast<double>(count) : 0.0; }
};

// Number of rows of targets[N] that are not ignore_index: the denominator of the mean loss,
// known before the forward (so dloss = 1 / (count * grad_accum_steps) can be fixed up front).
int64_t cross_entropy_count(const int32_t* targets, int64_t N, int32_t ignore_index = kIgnoreIndex);

// Loss of every row: losses[N] (0 for ignored rows; may be nullptr) and lse[N] =
// log(sum_v exp(logits[n,v])), the one value the backward needs. Overwrites losses and lse.
// A target outside [0, V) that is not ignore_index throws primus::RuntimeError. Reductions run
// in double (max-subtracted); the sum over rows is in row order.
template <typename Real>
CrossEntropyResult cross_entropy_forward(Real* losses, Real* lse, const Real* logits,
                                         const int32_t* targets, int64_t N, int64_t V,
                                         int32_t ignore_index = kIgnoreIndex, int64_t ld = 0);

// dlogits[n,v] = dloss * (softmax(logits[n])[v] - [v == target[n]]), and 0 for ignored rows.
// OVERWRITES dlogits (it is the first gradient of the backward pass); dlogits may be the logits
// buffer itself, to reuse its memory. For the mean loss, dloss = 1 / count (times
// 1 / grad_accum_steps when micro-batches are accumulated).
template <typename Real>
void cross_entropy_backward(Real* dlogits, const Real* logits, const Real* lse,
                            const int32_t* targets, int64_t N, int64_t V, double dloss,
                            int32_t ignore_index = kIgnoreIndex, int64_t ld = 0);

// Forward and backward in one pass over the logits (one exp per element instead of two): what a
// training step uses. Same loss as cross_entropy_forward; dlogits equal cross_entropy_backward's up
// to rounding (softmax as exp(x - max) / sum instead of exp(x - lse)). dlogits may alias logits.
template <typename Real>
CrossEntropyResult cross_entropy_forward_backward(Real* dlogits, Real* losses, const Real* logits,
                                                  const int32_t* targets, int64_t N, int64_t V,
                                                  double dloss,
                                                  int32_t ignore_index = kIgnoreIndex, int64_t ld = 0);

}  // namespace primus::turbo::cpu
