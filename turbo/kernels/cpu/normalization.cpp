// LayerNorm / RMSNorm. Row statistics are per-row (parallel over rows); the weight and bias
// gradients are sums over rows, done in a second pass parallel over column blocks so that each
// column is summed in row order (deterministic, no per-thread partial buffers). The normalised
// value is recomputed from inp, mean and rstd rather than saved, as llm.c does.
#include "turbo/kernels/cpu/normalization.h"

#include <cmath>

#include "turbo/kernels/cpu/parallel.h"

namespace primus::turbo::cpu {

template <typename Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight,
                       const Real* bias, int64_t N, int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x = inp + n * C;
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    const double m = sum / static_cast<double>(C);
    double var = 0.0;
#pragma omp simd reduction(+ : var)
    for (int64_t c = 0; c < C; ++c) {
      const double d = x[c] - m;
      var += d * d;
    }
    const double rs = 1.0 / std::sqrt(var / static_cast<double>(C) + eps);
    const Real mr = static_cast<Real>(m), rr = static_cast<Real>(rs);
    Real* o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - mr) * rr * weight[c] + bias[c];
    mean[n] = mr;
    rstd[n] = rr;
  }
}

template <typename Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                        const Real* weight, const Real* mean, const Real* rstd, int64_t N,
                        int64_t C) {
  // dinp = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dout * weight.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x = inp + n * C;
    const Real* dy = dout + n * C;
    const Real m = mean[n], rs = rstd[n];
    double sum_g = 0.0, sum_gx = 0.0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int64_t c = 0; c < C; ++c) {
      const Real g = dy[c] * weight[c];
      sum_g += g;
      sum_gx += g * ((x[c] - m) * rs);
    }
    const Real mean_g = static_cast<Real>(sum_g / static_cast<double>(C));
    const Real mean_gx = static_cast<Real>(sum_gx / static_cast<double>(C));
    Real* dx = dinp + n * C;
    for (int64_t c = 0; c < C; ++c) {
      const Real xhat = (x[c] - m) * rs;
      dx[c] += rs * (dy[c] * weight[c] - mean_g - xhat * mean_gx);
    }
  }
  detail::for_column_blocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t n = 0; n < N; ++n) {
      const Real* x = inp + n * C;
      const Real* dy = dout + n * C;
      const Real m = mean[n], rs = rstd[n];
      for (int64_t c = c0; c < c1; ++c) dweight[c] += dy[c] * ((x[c] - m) * rs);
      if (dbias) {
        for (int64_t c = c0; c < c1; ++c) dbias[c] += dy[c];
      }
    }
  });
}

template <typename Real>
void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, int64_t N,
                     int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x = inp + n * C;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[c]) * x[c];
    const Real rs = static_cast<Real>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    Real* o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = x[c] * rs * weight[c];
    rstd[n] = rs;
  }
}

template <typename Real>
void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp,
                      const Real* weight, const Real* rstd, int64_t N, int64_t C) {
  // dinp = rstd * (g - xhat * mean(g * xhat)), with g = dout * weight and xhat = x * rstd.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x = inp + n * C;
    const Real* dy = dout + n * C;
    const Real rs = rstd[n];
    double sum_gx = 0.0;
#pragma omp simd reduction(+ : sum_gx)
    for (int64_t c = 0; c < C; ++c) sum_gx += dy[c] * weight[c] * (x[c] * rs);
    const Real mean_gx = static_cast<Real>(sum_gx / static_cast<double>(C));
    Real* dx = dinp + n * C;
    for (int64_t c = 0; c < C; ++c) dx[c] += rs * (dy[c] * weight[c] - x[c] * rs * mean_gx);
  }
  detail::for_column_blocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t n = 0; n < N; ++n) {
      const Real* x = inp + n * C;
      const Real* dy = dout + n * C;
      const Real rs = rstd[n];
      for (int64_t c = c0; c < c1; ++c) dweight[c] += dy[c] * (x[c] * rs);
    }
  });
}

// Each head row is one rmsnorm row; the rows of one weight are the heads [0, q_heads) or
// [q_heads, Hx) of every token, so each group runs as N rows of a strided walk. Written as plain
// loops over the rmsnorm formulas above (the reference is read, not tuned).
template <typename Real>
void head_rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* wq, const Real* wk, int64_t N,
                          int64_t Hx, int64_t q_heads, int64_t D, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N * Hx; ++r) {
    const Real* w = (r % Hx) < q_heads ? wq : wk;
    rmsnorm_forward(out + r * D, rstd + r, inp + r * D, w, 1, D, eps);
  }
}

template <typename Real>
void head_rmsnorm_backward(Real* dinp, Real* dwq, Real* dwk, const Real* dout, const Real* inp, const Real* wq,
                           const Real* wk, const Real* rstd, int64_t N, int64_t Hx, int64_t q_heads, int64_t D) {
  // Serial over rows: every row adds into one of the two weight gradients.
  for (int64_t r = 0; r < N * Hx; ++r) {
    const bool q = (r % Hx) < q_heads;
    rmsnorm_backward(dinp + r * D, q ? dwq : dwk, dout + r * D, inp + r * D, q ? wq : wk, rstd + r, 1, D);
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                                   \
  template void layernorm_forward<Real>(Real*, Real*, Real*, const Real*, const Real*,             \
                                        const Real*, int64_t, int64_t, double);                    \
  template void layernorm_backward<Real>(Real*, Real*, Real*, const Real*, const Real*,            \
                                         const Real*, const Real*, const Real*, int64_t, int64_t); \
  template void rmsnorm_forward<Real>(Real*, Real*, const Real*, const Real*, int64_t, int64_t,    \
                                      double);                                                     \
  template void rmsnorm_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*,        \
                                       const Real*, int64_t, int64_t);                          \
  template void head_rmsnorm_forward<Real>(Real*, Real*, const Real*, const Real*, const Real*, int64_t, int64_t, \
                                           int64_t, int64_t, double);                                           \
  template void head_rmsnorm_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*,          \
                                            const Real*, const Real*, int64_t, int64_t, int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
