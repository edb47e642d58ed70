#include "turbo/kernels/cpu/reduce.h"

#include <omp.h>

#include <cmath>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

using ReduceTest = OpTest;

TEST_F(ReduceTest, SumSquaresMatchesDirectSumForAnyThreadCount) {
  const int64_t n = 100003;  // several chunks and a ragged tail
  const auto x = rng.vec<float>(n);
  double want = 0;
  for (float v : x) want += static_cast<double>(v) * v;
  const double got = sum_squares(x.data(), n);
  EXPECT_NEAR(got, want, 1e-9 * want);
  const int saved = omp_get_max_threads();
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(sum_squares(x.data(), n), got) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST_F(ReduceTest, ClipScalesOnlyAboveMaxNorm) {
  const int64_t n = 50000;
  auto g = rng.vec<float>(n);
  const double norm = std::sqrt(sum_squares(g.data(), n));

  auto untouched = g;
  EXPECT_EQ(clip_grad_norm(untouched.data(), n, 2 * norm), norm);
  EXPECT_EQ(untouched, g);

  const double max_norm = 0.5 * norm;
  auto clipped = g;
  EXPECT_EQ(clip_grad_norm(clipped.data(), n, max_norm), norm);
  const double scale = max_norm / (norm + 1e-6);
  EXPECT_EQ(clip_scale(norm, max_norm), scale);
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(clipped[i], g[i] * static_cast<float>(scale));
  EXPECT_NEAR(std::sqrt(sum_squares(clipped.data(), n)), max_norm, 1e-6 * max_norm);
  EXPECT_EQ(clip_scale(1.0, 5.0), 1.0);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
