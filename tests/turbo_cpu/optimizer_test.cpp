#include "turbo/kernels/cpu/optimizer.h"

#include <cmath>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

using AdamWTest = OpTest;

// Two steps written out by hand from torch.optim.AdamW's documented algorithm, with and without
// weight decay.
TEST_F(AdamWTest, TwoStepsMatchHandComputation) {
  const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-6;
  for (const double wd : {0.0, 0.1}) {
    const int64_t n = 5;
    const auto p0 = rng.vec(n), g1 = rng.vec(n), g2 = rng.vec(n);
    std::vector<double> p = p0, m(n, 0.0), v(n, 0.0);
    AdamWParams hp{lr, b1, b2, eps, wd, 1, 1.0};
    adamw_update(p.data(), g1.data(), m.data(), v.data(), n, hp);
    hp.step = 2;
    adamw_update(p.data(), g2.data(), m.data(), v.data(), n, hp);
    for (int64_t i = 0; i < n; ++i) {
      // step 1
      double q = p0[i] - lr * wd * p0[i];
      double mi = (1 - b1) * g1[i], vi = (1 - b2) * g1[i] * g1[i];
      q -= lr * (mi / (1 - b1)) / (std::sqrt(vi / (1 - b2)) + eps);
      // step 2
      q -= lr * wd * q;
      mi = b1 * mi + (1 - b1) * g2[i];
      vi = b2 * vi + (1 - b2) * g2[i] * g2[i];
      q -= lr * (mi / (1 - b1 * b1)) / (std::sqrt(vi / (1 - b2 * b2)) + eps);
      EXPECT_NEAR(p[i], q, 1e-14) << "weight_decay " << wd << ", element " << i;
      EXPECT_NEAR(m[i], mi, 1e-15);
      EXPECT_NEAR(v[i], vi, 1e-15);
    }
    if (wd == 0.0) continue;
    // Decay really acted: the same steps without it end elsewhere.
    std::vector<double> p_nd = p0, m_nd(n, 0.0), v_nd(n, 0.0);
    AdamWParams nd{lr, b1, b2, eps, 0.0, 1, 1.0};
    adamw_update(p_nd.data(), g1.data(), m_nd.data(), v_nd.data(), n, nd);
    EXPECT_GT(max_abs_diff(p_nd, p), 1e-5);
  }
}

// grad_scale is the same as scaling the gradients first; float tracks double.
TEST_F(AdamWTest, GradScaleAndFloat) {
  const int64_t n = 1000;
  const auto p0 = rng.vec(n), g = rng.vec(n);
  std::vector<double> g_scaled(n);
  for (int64_t i = 0; i < n; ++i) g_scaled[i] = 0.25 * g[i];
  AdamWParams hp{3e-4, 0.9, 0.95, 1e-8, 0.1, 3, 0.25};
  std::vector<double> p1 = p0, m1(n, 0.1), v1(n, 0.2), p2 = p0, m2(n, 0.1), v2(n, 0.2);
  adamw_update(p1.data(), g.data(), m1.data(), v1.data(), n, hp);
  hp.grad_scale = 1.0;
  adamw_update(p2.data(), g_scaled.data(), m2.data(), v2.data(), n, hp);
  EXPECT_LT(max_abs_diff(p1, p2), 1e-15);

  std::vector<float> pf(p0.begin(), p0.end()), gf(g_scaled.begin(), g_scaled.end()), mf(n, 0.1f),
      vf(n, 0.2f);
  adamw_update(pf.data(), gf.data(), mf.data(), vf.data(), n, hp);
  std::vector<double> delta_d(n), delta_f(n);
  for (int64_t i = 0; i < n; ++i) {
    delta_d[i] = p2[i] - p0[i];
    delta_f[i] = static_cast<double>(pf[i]) - static_cast<float>(p0[i]);
  }
  EXPECT_LT(rel_error(delta_f, delta_d), 1e-3);  // the update itself, not just the parameter
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
