// GELU and SwiGLU. Elementwise: each thread takes one contiguous range, and the range functions
// are CPU-cloned so their loops run on the widest vector unit available. Nothing is saved beyond
// the input (recomputing the sigmoid is cheaper than storing it).
//
// GELU's tanh form is evaluated through the identity 0.5 (1 + tanh(u)) = sigmoid(2u): the same
// function, but with an exp the compiler can vectorise instead of a call to tanh.
#include "turbo/kernels/cpu/activation.h"

#include "turbo/kernels/cpu/parallel.h"
#include "turbo/kernels/cpu/vec_math.h"

namespace primus::turbo::cpu {
namespace {

using detail::sigmoid_v;

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluCubic = 0.044715;

template <typename Real>
PRIMUS_CPU_CLONES void gelu_forward_range(Real* out, const Real* inp, int64_t begin, int64_t end) {
  const Real a = static_cast<Real>(kSqrt2OverPi), b = static_cast<Real>(kGeluCubic);
  for (int64_t i = begin; i < end; ++i) {
    const Real x = inp[i];
    out[i] = x * sigmoid_v(Real(2) * a * (x + b * x * x * x));
  }
}

template <typename Real>
PRIMUS_CPU_CLONES void gelu_backward_range(Real* dinp, const Real* inp, const Real* dout,
                                           int64_t begin, int64_t end) {
  const Real a = static_cast<Real>(kSqrt2OverPi), b = static_cast<Real>(kGeluCubic);
  for (int64_t i = begin; i < end; ++i) {
    const Real x = inp[i];
    const Real s = sigmoid_v(Real(2) * a * (x + b * x * x * x));
    // d/dx 0.5 x (1 + tanh u) = s + 2 x s (1 - s) u',  u' = a (1 + 3 b x^2),  s = sigmoid(2u)
    const Real grad = s + Real(2) * x * s * (Real(1) - s) * a * (Real(1) + Real(3) * b * x * x);
    dinp[i] += grad * dout[i];
  }
}

template <typename Real>
PRIMUS_CPU_CLONES void swiglu_forward_rows(Real* out, const Real* gate_up, int64_t F, int64_t n0,
                                           int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const Real* gate = gate_up + n * 2 * F;
    const Real* up = gate + F;
    Real* o = out + n * F;
    for (int64_t f = 0; f < F; ++f) o[f] = gate[f] * sigmoid_v(gate[f]) * up[f];
  }
}

template <typename Real>
PRIMUS_CPU_CLONES void swiglu_backward_rows(Real* dgate_up, const Real* gate_up, const Real* dout,
                                            int64_t F, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const Real* gate = gate_up + n * 2 * F;
    const Real* up = gate + F;
    const Real* dy = dout + n * F;
    Real* dgate = dgate_up + n * 2 * F;
    Real* dup = dgate + F;
    for (int64_t f = 0; f < F; ++f) {
      const Real s = sigmoid_v(gate[f]);
      const Real silu = gate[f] * s;
      // silu'(x) = s + x s (1 - s)
      dgate[f] += dy[f] * up[f] * (s + silu * (Real(1) - s));
      dup[f] += dy[f] * silu;
    }
  }
}

}  // namespace

template <typename Real>
void gelu_forward(Real* out, const Real* inp, int64_t n) {
  detail::parallel_ranges(n, 1, [&](int64_t b, int64_t e) { gelu_forward_range(out, inp, b, e); });
}

template <typename Real>
void gelu_backward(Real* dinp, const Real* inp, const Real* dout, int64_t n) {
  detail::parallel_ranges(
      n, 1, [&](int64_t b, int64_t e) { gelu_backward_range(dinp, inp, dout, b, e); });
}

template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int64_t N, int64_t F) {
  detail::parallel_ranges(
      N, 2 * F, [&](int64_t b, int64_t e) { swiglu_forward_rows(out, gate_up, F, b, e); });
}

template <typename Real>
void swiglu_backward(Real* dgate_up, const Real* gate_up, const Real* dout, int64_t N, int64_t F) {
  detail::parallel_ranges(N, 2 * F, [&](int64_t b, int64_t e) {
    swiglu_backward_rows(dgate_up, gate_up, dout, F, b, e);
  });
}

#define PRIMUS_INSTANTIATE(Real)                                               \
  template void gelu_forward<Real>(Real*, const Real*, int64_t);               \
  template void gelu_backward<Real>(Real*, const Real*, const Real*, int64_t); \
  template void swiglu_forward<Real>(Real*, const Real*, int64_t, int64_t);    \
  template void swiglu_backward<Real>(Real*, const Real*, const Real*, int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
