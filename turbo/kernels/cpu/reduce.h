// Reductions over flat gradient arrays: the global gradient norm and its clipping.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// sum_i x[i]^2, accumulated in double over fixed chunks combined in order (the same bits for any
// thread count). Sum these over several arrays (or ranks) before taking the square root.
template <typename Real>
double sum_squares(const Real* x, int64_t n);

// The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by:
// min(1, max_norm / (total_norm + 1e-6)), i.e. max_norm / (total_norm + 1e-6) once the norm
// exceeds max_norm and 1 otherwise (torch's clamp also dips below 1 for norms within 1e-6 under
// max_norm; so does this, to match it bit for bit).
double clip_scale(double total_norm, double max_norm);

// x[i] *= scale (in place).
template <typename Real>
void scale_inplace(Real* x, int64_t n, double scale);

// One flat gradient array: returns its L2 norm (before clipping) and scales grads in place by
// clip_scale(norm, max_norm) when that is below 1.
template <typename Real>
double clip_grad_norm(Real* grads, int64_t n, double max_norm);

}  // namespace primus::turbo::cpu
