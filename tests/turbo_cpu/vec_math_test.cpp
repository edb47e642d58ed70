// The vectorisable exp behind the float kernels (turbo/kernels/cpu/vec_math.h).
#include "turbo/kernels/cpu/vec_math.h"

#include <cmath>
#include <limits>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

using detail::exp_fast;

TEST(ExpFast, WithinTwoUlpOverTheNormalRange) {
  double worst = 0;
  float worst_x = 0;
  for (float x = -87.3f; x < 88.7f; x += 7.3e-4f) {
    const double want = std::exp(static_cast<double>(x));
    const double rel = std::abs(exp_fast(x) - want) / want;
    if (rel > worst) worst = rel, worst_x = x;
  }
  EXPECT_LT(worst, 2 * std::numeric_limits<float>::epsilon()) << "at x = " << worst_x;
}

TEST(ExpFast, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(exp_fast(0.0f), 1.0f);
  EXPECT_EQ(exp_fast(-inf), 0.0f);  // masked attention scores must give exactly 0
  EXPECT_EQ(exp_fast(-200.0f), 0.0f);
  EXPECT_EQ(exp_fast(200.0f), inf);
  EXPECT_EQ(exp_fast(inf), inf);
  EXPECT_TRUE(std::isnan(exp_fast(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_FLOAT_EQ(exp_fast(88.7f), std::exp(88.7f));  // 2^128 * p must not overflow early
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
