// AdamW, elementwise and parallel. The step-dependent scalars (bias corrections) are computed once
// in double; the per-element arithmetic runs in Real, like torch's fp32 optimizer.
#include "turbo/kernels/cpu/optimizer.h"

#include <cmath>

#include "core/util/error.h"
#include "turbo/core/stochastic_round.h"

namespace primus::turbo::cpu {

template <typename Real>
void adamw_update(Real* params, const Real* grads, Real* m, Real* v, int64_t n,
                  const AdamWParams& hp) {
  PRIMUS_CHECK(hp.step >= 1, "adamw: step {} must be >= 1 (it counts this update)", hp.step);
  const double bc1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
  const double bc2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
  const Real b1 = static_cast<Real>(hp.beta1), b2 = static_cast<Real>(hp.beta2);
  const Real one_minus_b1 = static_cast<Real>(1.0 - hp.beta1);
  const Real one_minus_b2 = static_cast<Real>(1.0 - hp.beta2);
  const Real decay = static_cast<Real>(1.0 - hp.lr * hp.weight_decay);
  const Real step_size = static_cast<Real>(hp.lr / bc1);
  const Real inv_sqrt_bc2 = static_cast<Real>(1.0 / std::sqrt(bc2));
  const Real eps = static_cast<Real>(hp.eps), gs = static_cast<Real>(hp.grad_scale);
  const bool m16 = hp.m_bf16, v16 = hp.v_bf16;
  const uint64_t key = static_cast<uint64_t>(hp.sr_key);
  const auto sr_step = static_cast<uint32_t>(hp.step);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const Real g = gs * grads[i];
    const Real mi = b1 * m[i] + one_minus_b1 * g;
    const Real vi = b2 * v[i] + one_minus_b2 * g * g;
    if (m16 || v16) {
      const uint32_t h = sr_hash(key + static_cast<uint64_t>(i), sr_step);
      m[i] = m16 ? static_cast<Real>(sr_round_m(static_cast<float>(mi), h)) : mi;
      v[i] = v16 ? static_cast<Real>(sr_round_v(static_cast<float>(vi), h)) : vi;
    } else {
      m[i] = mi;
      v[i] = vi;
    }
    // (m / bc1) / (sqrt(v / bc2) + eps), arranged as torch does: sqrt(v)/sqrt(bc2) + eps.
    params[i] = params[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

template void adamw_update<float>(float*, const float*, float*, float*, int64_t,
                                  const AdamWParams&);
template void adamw_update<double>(double*, const double*, double*, double*, int64_t,
                                   const AdamWParams&);

}  // namespace primus::turbo::cpu
