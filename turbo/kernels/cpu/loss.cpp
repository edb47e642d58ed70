// Cross-entropy: parallel over rows, each row's sum of exponentials in double. Per-row losses are
// kept in a double buffer and summed in row order, so the total does not depend on the thread
// count.
#include "turbo/kernels/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/util/error.h"
#include "turbo/kernels/cpu/vec_math.h"

namespace primus::turbo::cpu {
namespace {

// The row stride: V unless a padded row length was given (which must hold the V classes).
int64_t stride_of(int64_t V, int64_t ld) {
  PRIMUS_CHECK(ld == 0 || ld >= V, "cross_entropy: row length {} is shorter than the vocabulary {}", ld, V);
  return ld > 0 ? ld : V;
}

void check_targets(const int32_t* targets, int64_t N, int64_t V, int32_t ignore_index) {
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    PRIMUS_CHECK(t == ignore_index || (t >= 0 && t < V),
                 "cross_entropy: target {} of row {} is outside the vocabulary [0, {}) and is not "
                 "ignore_index {}",
                 t, n, V, ignore_index);
  }
}

// The per-row loops, CPU-cloned and vectorised: exp_v is the vectorisable exp for float (glibc's
// for double); sums of exponentials accumulate in double.
template <typename Real>
PRIMUS_INLINE Real row_max(const Real* x, int64_t V) {
  Real m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t v = 1; v < V; ++v) m = std::max(m, x[v]);
  return m;
}

// log(sum_v exp(x[v])), max-subtracted.
template <typename Real>
PRIMUS_CPU_CLONES double row_logsumexp(const Real* x, int64_t V) {
  const Real m = row_max(x, V);
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) sum += detail::exp_v(x[v] - m);
  return static_cast<double>(m) + std::log(sum);
}

// dx[v] = dloss * exp(x[v] - lse)   (dx may be x).
template <typename Real>
PRIMUS_CPU_CLONES void row_softmax_scaled(Real* dx, const Real* x, int64_t V, double lse,
                                          double dloss) {
  const Real l = static_cast<Real>(lse), d = static_cast<Real>(dloss);
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) dx[v] = d * detail::exp_v(x[v] - l);
}

// dx[v] = exp(x[v] - max), returning (max, sum of those) for the fused pass (dx may be x).
template <typename Real>
PRIMUS_CPU_CLONES double row_exp_shifted(Real* dx, const Real* x, int64_t V, Real* max_out) {
  const Real m = row_max(x, V);
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) {
    const Real e = detail::exp_v(x[v] - m);
    dx[v] = e;
    sum += e;
  }
  *max_out = m;
  return sum;
}

template <typename Real>
PRIMUS_CPU_CLONES void row_scale(Real* dx, int64_t V, double scale) {
  const Real s = static_cast<Real>(scale);
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) dx[v] *= s;
}

// Runs row(n) -> loss of row n over all rows and returns the ordered total.
template <class Row>
CrossEntropyResult over_rows(const int32_t* targets, int64_t N, int32_t ignore_index, Row&& row) {
  std::vector<double> row_loss(static_cast<size_t>(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) row_loss[n] = row(n);
  CrossEntropyResult r;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    r.loss_sum += row_loss[n];
    ++r.count;
  }
  return r;
}

}  // namespace

int64_t cross_entropy_count(const int32_t* targets, int64_t N, int32_t ignore_index) {
  return std::count_if(targets, targets + N, [&](int32_t t) { return t != ignore_index; });
}

template <typename Real>
CrossEntropyResult cross_entropy_forward(Real* losses, Real* lse, const Real* logits,
                                         const int32_t* targets, int64_t N, int64_t V,
                                         int32_t ignore_index, int64_t ld) {
  check_targets(targets, N, V, ignore_index);
  const int64_t S = stride_of(V, ld);
  return over_rows(targets, N, ignore_index, [&](int64_t n) {
    const Real* x = logits + n * S;
    const double l = row_logsumexp(x, V);
    lse[n] = static_cast<Real>(l);
    const double loss = targets[n] == ignore_index ? 0.0 : l - static_cast<double>(x[targets[n]]);
    if (losses) losses[n] = static_cast<Real>(loss);
    return loss;
  });
}

template <typename Real>
void cross_entropy_backward(Real* dlogits, const Real* logits, const Real* lse,
                            const int32_t* targets, int64_t N, int64_t V, double dloss,
                            int32_t ignore_index, int64_t ld) {
  check_targets(targets, N, V, ignore_index);
  const int64_t S = stride_of(V, ld);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x = logits + n * S;
    Real* dx = dlogits + n * S;
    std::fill(dx + V, dx + S, Real(0));  // padded columns: not classes, no gradient
    if (targets[n] == ignore_index) {
      std::fill(dx, dx + V, Real(0));
      continue;
    }
    row_softmax_scaled(dx, x, V, static_cast<double>(lse[n]), dloss);
    dx[targets[n]] -= static_cast<Real>(dloss);
  }
}

template <typename Real>
CrossEntropyResult cross_entropy_forward_backward(Real* dlogits, Real* losses, const Real* logits,
                                                  const int32_t* targets, int64_t N, int64_t V,
                                                  double dloss, int32_t ignore_index, int64_t ld) {
  check_targets(targets, N, V, ignore_index);
  const int64_t S = stride_of(V, ld);
  return over_rows(targets, N, ignore_index, [&](int64_t n) {
    const Real* x = logits + n * S;
    Real* dx = dlogits + n * S;  // may be x itself: x[v] is read before dx[v] is written
    std::fill(dx + V, dx + S, Real(0));  // padded columns: not classes, no gradient
    if (targets[n] == ignore_index) {
      std::fill(dx, dx + V, Real(0));
      if (losses) losses[n] = Real(0);
      return 0.0;
    }
    const double x_target = static_cast<double>(x[targets[n]]);
    Real m;
    const double sum = row_exp_shifted(dx, x, V, &m);
    const double loss = static_cast<double>(m) + std::log(sum) - x_target;
    if (losses) losses[n] = static_cast<Real>(loss);
    row_scale(dx, V, dloss / sum);
    dx[targets[n]] -= static_cast<Real>(dloss);
    return loss;
  });
}

#define PRIMUS_INSTANTIATE(Real)                                                              \
  template CrossEntropyResult cross_entropy_forward<Real>(                                    \
      Real*, Real*, const Real*, const int32_t*, int64_t, int64_t, int32_t, int64_t);         \
  template void cross_entropy_backward<Real>(Real*, const Real*, const Real*, const int32_t*, \
                                             int64_t, int64_t, double, int32_t, int64_t);     \
  template CrossEntropyResult cross_entropy_forward_backward<Real>(                           \
      Real*, Real*, const Real*, const int32_t*, int64_t, int64_t, double, int32_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
