#include "turbo/kernels/cpu/reduce.h"

#include <algorithm>
#include <cmath>

#include "turbo/kernels/cpu/parallel.h"

namespace primus::turbo::cpu {

template <typename Real>
double sum_squares(const Real* x, int64_t n) {
  return detail::chunked_sum(n, [x](int64_t begin, int64_t end) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  });
}

double clip_scale(double total_norm, double max_norm) {
  // torch clamps the coefficient at 1 rather than testing norm > max_norm; the two differ only
  // for norms within 1e-6 of max_norm, where torch scales by a hair under 1. Follow torch.
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

template <typename Real>
void scale_inplace(Real* x, int64_t n, double scale) {
  const Real s = static_cast<Real>(scale);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

template <typename Real>
double clip_grad_norm(Real* grads, int64_t n, double max_norm) {
  const double norm = std::sqrt(sum_squares(grads, n));
  const double scale = clip_scale(norm, max_norm);
  if (scale < 1.0) scale_inplace(grads, n, scale);
  return norm;
}

template double sum_squares<float>(const float*, int64_t);
template double sum_squares<double>(const double*, int64_t);
template void scale_inplace<float>(float*, int64_t, double);
template void scale_inplace<double>(double*, int64_t, double);
template double clip_grad_norm<float>(float*, int64_t, double);
template double clip_grad_norm<double>(double*, int64_t, double);

}  // namespace primus::turbo::cpu
