#include "turbo/kernels/cpu/optimizer.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "tests/turbo_cpu/op_check.h"
#include "turbo/core/dtype.h"
#include "turbo/core/stochastic_round.h"

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

// Stochastic rounding to bf16 (turbo/core/stochastic_round.h): the result is one of the two bf16
// neighbours, their mean over keys is the value, the bits are a pure function of (key, step), and
// infinities and NaN keep their class.
TEST_F(AdamWTest, StochasticRoundingIsUnbiasedAndKeyed) {
  const float lo = bf16_bits_value(0x3f80), hi = bf16_bits_value(0x3f81);  // 1 and 1 + 2^-7
  for (const double frac : {0.3, 0.01}) {
    const float x = static_cast<float>(lo + frac * (hi - lo));
    double sum = 0.0;
    const int n = 200000;
    for (int k = 0; k < n; ++k) {
      const float r = bf16_bits_value(bf16_bits_stochastic(x, sr_hash(uint64_t(k), 7)));
      ASSERT_TRUE(r == lo || r == hi) << r;
      sum += r;
    }
    // The standard error of the mean is (hi - lo) sqrt(frac (1 - frac) / n) <= 1.1e-3 (hi - lo).
    EXPECT_NEAR(sum / n, x, 5e-3 * (hi - lo)) << "fraction " << frac;
    // -x rounds to the negatives of the same neighbours.
    EXPECT_EQ(bf16_bits_value(bf16_bits_stochastic(-x, sr_hash(5, 7))), -bf16_bits_value(bf16_bits_stochastic(x, sr_hash(5, 7))));
  }
  EXPECT_EQ(sr_hash(123456789012345ull, 3), sr_hash(123456789012345ull, 3));
  int differ_step = 0, differ_key = 0;
  for (uint64_t k = 0; k < 1000; ++k) {
    differ_step += sr_hash(k, 3) != sr_hash(k, 4);
    differ_key += sr_hash(k, 3) != sr_hash(k + (uint64_t(1) << 32), 3);  // the high half of the key counts
  }
  EXPECT_GT(differ_step, 990);
  EXPECT_GT(differ_key, 990);
  EXPECT_TRUE(std::isinf(bf16_bits_value(bf16_bits_stochastic(INFINITY, 0xffffu))));
  EXPECT_TRUE(std::isnan(bf16_bits_value(bf16_bits_stochastic(std::nanf(""), 0xffffu))));
  EXPECT_EQ(bf16_bits_value(bf16_bits_stochastic(2.5f, 0xffffu)), 2.5f) << "a bf16 value stays itself";
}

// Why the rounding is stochastic: after a large gradient, beta2 = 0.999 and zero gradients should
// let v decay as 0.999^t. A bf16 v rounded to nearest never moves (0.999 v rounds back to v); the
// stochastically rounded one follows the fp32 decay on average.
TEST_F(AdamWTest, Bf16SecondMomentDecaysOnlyWithStochasticRounding) {
  const int64_t n = 512, steps = 1000;
  std::vector<float> p(n, 1.0f), g(n, 0.0f), m(n, 0.0f), v(n, 1.0f), p32(n, 1.0f), m32(n, 0.0f), v32(n, 1.0f);
  std::vector<float> v_rn(n, 1.0f);
  AdamWParams hp{1e-4, 0.9, 0.999, 1e-8, 0.0, 1, 1.0};
  hp.v_bf16 = true;
  hp.m_bf16 = true;
  for (int64_t s = 1; s <= steps; ++s) {
    hp.step = s;
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp);
    AdamWParams f = hp;
    f.m_bf16 = f.v_bf16 = false;
    adamw_update(p32.data(), g.data(), m32.data(), v32.data(), n, f);
    for (auto& x : v_rn) x = bf16_bits_value(float_to_bf16_bits(0.999f * x));  // the same, to nearest
  }
  double mean = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(v[i], bf16_bits_value(float_to_bf16_bits(v[i]))) << "v holds bf16 values";
    mean += v[i] / n;
  }
  const double want = std::pow(0.999, double(steps));  // 0.368
  EXPECT_NEAR(v32[0], want, 1e-4);
  EXPECT_NEAR(mean, want, 0.02 * want);
  EXPECT_EQ(v_rn[0], 1.0f) << "round to nearest: v stuck at its peak";
}

// bf16 moments through the update: the stored moments are the fp32 ones rounded to a neighbour,
// the weights take the same step as with fp32 moments (the update uses the unrounded values), and
// the key is per element, so one call over n elements equals two calls over halves with their keys.
TEST_F(AdamWTest, Bf16MomentsStoreNeighboursAndTheKeyIsPerElement) {
  const int64_t n = 1000;
  std::vector<float> p0(n), g(n), m0(n), v0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = static_cast<float>(rng.uniform());
    g[i] = static_cast<float>(rng.uniform());
    m0[i] = bf16_bits_value(float_to_bf16_bits(static_cast<float>(0.1 * rng.uniform())));
    v0[i] = bf16_bits_value(float_to_bf16_bits(static_cast<float>(0.01 * std::abs(rng.uniform()))));
  }
  AdamWParams hp{3e-4, 0.9, 0.95, 1e-8, 0.1, 3, 1.0};
  std::vector<float> p32 = p0, m32 = m0, v32 = v0;
  adamw_update(p32.data(), g.data(), m32.data(), v32.data(), n, hp);
  hp.m_bf16 = hp.v_bf16 = true;
  hp.sr_key = 4096;
  std::vector<float> p = p0, m = m0, v = v0;
  adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp);
  int m_changed = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(p[i], p32[i]) << "element " << i;
    for (auto [got, want] : {std::pair{m[i], m32[i]}, {v[i], v32[i]}}) {
      const float down = bf16_bits_value(static_cast<uint16_t>(float_to_bf16_bits(want) - 1));
      const float up = bf16_bits_value(static_cast<uint16_t>(float_to_bf16_bits(want) + 1));
      ASSERT_TRUE(got == bf16_bits_value(float_to_bf16_bits(got))) << "element " << i;
      ASSERT_GE(got, std::min(down, up)) << "element " << i;
      ASSERT_LE(got, std::max(down, up)) << "element " << i;
    }
    m_changed += m[i] != m0[i];
  }
  EXPECT_GT(m_changed, n / 2);
  std::vector<float> ph = p0, mh = m0, vh = v0;
  hp.sr_key = 4096;
  adamw_update(ph.data(), g.data(), mh.data(), vh.data(), n / 2, hp);
  hp.sr_key = 4096 + n / 2;
  adamw_update(ph.data() + n / 2, g.data() + n / 2, mh.data() + n / 2, vh.data() + n / 2, n - n / 2, hp);
  EXPECT_EQ(std::memcmp(mh.data(), m.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(vh.data(), v.data(), n * 4), 0);
  hp.sr_key = 0;  // another key: other bits
  std::vector<float> pk = p0, mk = m0, vk = v0;
  adamw_update(pk.data(), g.data(), mk.data(), vk.data(), n, hp);
  EXPECT_NE(std::memcmp(mk.data(), m.data(), n * 4), 0);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
