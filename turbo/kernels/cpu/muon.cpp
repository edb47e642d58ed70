// Muon's Newton-Schulz iteration on the CPU: three GEMMs per step on OpenBLAS (matmul_forward),
// in the precision of Real (the CUDA path runs them in bf16 with fp32 accumulation, as Moonlight
// and Keller Jordan's reference do; this is the fp32 / fp64 oracle it is checked against).
#include "turbo/kernels/cpu/muon.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/util/error.h"
#include "turbo/kernels/cpu/matmul.h"

namespace primus::turbo::cpu {

template <typename Real>
void newton_schulz(const Real* g, int64_t rows, int64_t cols, int64_t steps, Real* out) {
  PRIMUS_CHECK(rows > 0 && cols > 0, "newton_schulz: shape [{}, {}]", rows, cols);
  const bool tall = rows > cols;
  const int64_t r = tall ? cols : rows, c = tall ? rows : cols;  // X is [r, c] with r <= c
  std::vector<Real> x(static_cast<size_t>(r * c)), xt(x.size()), a(static_cast<size_t>(r * r)), aa(a.size()),
      bx(x.size());
  double sq = 0;
  for (int64_t i = 0; i < rows * cols; ++i) sq += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  const Real inv = static_cast<Real>(1.0 / (std::sqrt(sq) + kMuonNsEps));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const Real v = g[i * cols + j] * inv;
      if (tall) x[j * c + i] = v;
      else x[i * c + j] = v;
    }
  const Real ka = static_cast<Real>(kMuonNsA), kb = static_cast<Real>(kMuonNsB), kc = static_cast<Real>(kMuonNsC);
  for (int64_t s = 0; s < steps; ++s) {
    matmul_forward<Real>(a.data(), x.data(), x.data(), nullptr, r, c, r);    // A = X X^T      [r, r]
    matmul_forward<Real>(aa.data(), a.data(), a.data(), nullptr, r, r, r);   // A A = A A^T    [r, r]
    for (size_t i = 0; i < a.size(); ++i) a[i] = kb * a[i] + kc * aa[i];     // B = b A + c A A
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) xt[j * r + i] = x[i * c + j];
    matmul_forward<Real>(bx.data(), a.data(), xt.data(), nullptr, r, r, c);  // B X = B (X^T)^T [r, c]
    for (size_t i = 0; i < x.size(); ++i) x[i] = ka * x[i] + bx[i];
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = tall ? x[j * c + i] : x[i * c + j];
}

double muon_update_scale(int64_t rows, int64_t cols, MuonScale mode, double extra) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (mode) {
    case MuonScale::Spectral: return extra * std::sqrt(std::max(r, c));
    case MuonScale::ShapeScaling: return extra * std::sqrt(std::max(1.0, r / c));
    case MuonScale::UnitRmsNorm: return extra * std::sqrt(r / c);
  }
  return extra;
}

MuonScale muon_scale_from_name(const std::string& name) {
  if (name == "spectral") return MuonScale::Spectral;
  if (name == "shape_scaling") return MuonScale::ShapeScaling;
  if (name == "unit_rms_norm") return MuonScale::UnitRmsNorm;
  throw ConfigError("muon_scale_mode '" + name + "' is not one of spectral, shape_scaling, unit_rms_norm");
}

template <typename Real>
void muon_momentum(const Real* grads, Real* m, int64_t n, const MuonParams& hp, Real* u) {
  const Real mu = static_cast<Real>(hp.momentum), gs = static_cast<Real>(hp.grad_scale);
  for (int64_t i = 0; i < n; ++i) {
    const Real g = gs * grads[i];
    const Real mi = mu * m[i] + g;
    m[i] = mi;
    u[i] = hp.nesterov ? g + mu * mi : mi;
  }
}

template <typename Real>
void muon_apply(Real* params, const Real* o, int64_t rows, int64_t cols, int64_t full_rows, int64_t full_cols,
                int64_t row0, int64_t col0, const MuonParams& hp) {
  const Real decay = static_cast<Real>(1.0 - hp.lr * hp.weight_decay);
  const Real step = static_cast<Real>(hp.lr * muon_update_scale(full_rows, full_cols, hp.scale_mode, hp.extra_scale));
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int64_t r = row0 + i / cols, c = col0 + i % cols;
    params[i] = params[i] * decay - step * o[static_cast<size_t>(r * full_cols + c)];
  }
}

template <typename Real>
void muon_update(Real* params, const Real* grads, Real* m, int64_t rows, int64_t cols, const MuonParams& hp) {
  PRIMUS_CHECK(hp.ns_steps >= 1, "muon: ns_steps {} must be >= 1", hp.ns_steps);
  const int64_t n = rows * cols;
  std::vector<Real> u(static_cast<size_t>(n)), o(static_cast<size_t>(n));
  muon_momentum<Real>(grads, m, n, hp, u.data());
  newton_schulz<Real>(u.data(), rows, cols, hp.ns_steps, o.data());
  muon_apply<Real>(params, o.data(), rows, cols, rows, cols, 0, 0, hp);
}

template void newton_schulz<float>(const float*, int64_t, int64_t, int64_t, float*);
template void newton_schulz<double>(const double*, int64_t, int64_t, int64_t, double*);
template void muon_update<float>(float*, const float*, float*, int64_t, int64_t, const MuonParams&);
template void muon_update<double>(double*, const double*, double*, int64_t, int64_t, const MuonParams&);
template void muon_momentum<float>(const float*, float*, int64_t, const MuonParams&, float*);
template void muon_apply<float>(float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                const MuonParams&);

}  // namespace primus::turbo::cpu
