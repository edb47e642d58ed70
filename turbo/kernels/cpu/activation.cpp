// GELU and SwiGLU. Both are memory-bound elementwise loops: parallel over rows / elements,
// nothing saved beyond the input (recomputing tanh / sigmoid is cheaper than storing them).
#include "turbo/kernels/cpu/activation.h"

#include <cmath>

namespace primus::turbo::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluCubic = 0.044715;

template <typename Real>
Real sigmoid(Real x) {
  return Real(1) / (Real(1) + std::exp(-x));
}

}  // namespace

template <typename Real>
void gelu_forward(Real* out, const Real* inp, int64_t n) {
  const Real a = static_cast<Real>(kSqrt2OverPi), b = static_cast<Real>(kGeluCubic);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const Real x = inp[i];
    out[i] = Real(0.5) * x * (Real(1) + std::tanh(a * (x + b * x * x * x)));
  }
}

template <typename Real>
void gelu_backward(Real* dinp, const Real* inp, const Real* dout, int64_t n) {
  const Real a = static_cast<Real>(kSqrt2OverPi), b = static_cast<Real>(kGeluCubic);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const Real x = inp[i];
    const Real t = std::tanh(a * (x + b * x * x * x));
    const Real sech2 = Real(1) - t * t;
    const Real grad = Real(0.5) * (Real(1) + t) + Real(0.5) * x * sech2 * a * (Real(1) + Real(3) * b * x * x);
    dinp[i] += grad * dout[i];
  }
}

template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* gate = gate_up + n * 2 * F;
    const Real* up = gate + F;
    Real* o = out + n * F;
    for (int64_t f = 0; f < F; ++f) o[f] = gate[f] * sigmoid(gate[f]) * up[f];
  }
}

template <typename Real>
void swiglu_backward(Real* dgate_up, const Real* gate_up, const Real* dout, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const Real* gate = gate_up + n * 2 * F;
    const Real* up = gate + F;
    const Real* dy = dout + n * F;
    Real* dgate = dgate_up + n * 2 * F;
    Real* dup = dgate + F;
    for (int64_t f = 0; f < F; ++f) {
      const Real s = sigmoid(gate[f]);
      const Real silu = gate[f] * s;
      // silu'(x) = s + x s (1 - s)
      dgate[f] += dy[f] * up[f] * (s + silu * (Real(1) - s));
      dup[f] += dy[f] * silu;
    }
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                        \
  template void gelu_forward<Real>(Real*, const Real*, int64_t);                        \
  template void gelu_backward<Real>(Real*, const Real*, const Real*, int64_t);          \
  template void swiglu_forward<Real>(Real*, const Real*, int64_t, int64_t);             \
  template void swiglu_backward<Real>(Real*, const Real*, const Real*, int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
