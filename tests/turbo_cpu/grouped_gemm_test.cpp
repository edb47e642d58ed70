// The grouped GEMM reference (turbo/kernels/cpu/grouped_gemm.h) against a plain triple loop per
// group in long double: forward, dgrad and wgrad over groups of every kind (empty ones first, last
// and in between, one row, many), rows past offsets[G] never touched, the weight gradient's
// overwrite and accumulate forms, and float against double.
#include "turbo/kernels/cpu/grouped_gemm.h"

#include <cmath>
#include <limits>
#include <vector>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct Groups {
  std::vector<int32_t> offsets;  // [G+1]
  int64_t M = 0;                 // buffer rows: offsets[G] plus spare rows no group owns
};

Groups groups_of(const std::vector<int32_t>& counts, int64_t spare) {
  Groups g;
  g.offsets.assign(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) g.offsets[i + 1] = g.offsets[i] + counts[i];
  g.M = g.offsets.back() + spare;
  return g;
}

// normwise max|a - b| / max|b|; infinite when `a` holds a NaN or inf (std::max would drop a NaN)
template <class A, class B>
double rel(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(static_cast<double>(a[i]))) return INFINITY;
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den > 0 ? num / den : num;
}

class GroupedGemmRefTest : public OpTest {
 protected:
  // Spare rows of the token buffers hold NaN: a reference that read them would show it.
  std::vector<double> tokens(const Groups& g, int64_t cols) {
    std::vector<double> v = rng.vec(static_cast<size_t>(g.M * cols));
    for (size_t i = static_cast<size_t>(g.offsets.back() * cols); i < v.size(); ++i)
      v[i] = std::numeric_limits<double>::quiet_NaN();
    return v;
  }
};

// The groups the tests run over: empty first / middle / last groups, a single row, unequal sizes.
const std::vector<std::vector<int32_t>>& count_sets() {
  static const std::vector<std::vector<int32_t>> sets = {
      {0, 5, 0, 1, 13, 0}, {7}, {0, 0, 9}, {3, 0, 0, 0}, {4, 11, 2, 6, 1}};
  return sets;
}

TEST_F(GroupedGemmRefTest, ForwardAndDgradMatchPerGroupProducts) {
  const int64_t N = 6, K = 5;
  for (const auto& counts : count_sets()) {
    const Groups g = groups_of(counts, 3);
    const int64_t G = static_cast<int64_t>(counts.size());
    const std::vector<double> x = tokens(g, K), dy = tokens(g, N), w = rng.vec(static_cast<size_t>(G * N * K));
    const double sentinel = 12345.0;
    std::vector<double> y(static_cast<size_t>(g.M * N), sentinel), dx(static_cast<size_t>(g.M * K), sentinel);
    grouped_gemm_forward<double>(y.data(), x.data(), w.data(), g.offsets.data(), G, N, K);
    grouped_gemm_dgrad<double>(dx.data(), dy.data(), w.data(), g.offsets.data(), G, N, K);
    std::vector<long double> want_y(y.size(), sentinel), want_dx(dx.size(), sentinel);
    for (int64_t e = 0; e < G; ++e)
      for (int64_t r = g.offsets[e]; r < g.offsets[e + 1]; ++r) {
        for (int64_t n = 0; n < N; ++n) {
          long double s = 0;
          for (int64_t k = 0; k < K; ++k) s += static_cast<long double>(x[r * K + k]) * w[(e * N + n) * K + k];
          want_y[r * N + n] = s;
        }
        for (int64_t k = 0; k < K; ++k) {
          long double s = 0;
          for (int64_t n = 0; n < N; ++n) s += static_cast<long double>(dy[r * N + n]) * w[(e * N + n) * K + k];
          want_dx[r * K + k] = s;
        }
      }
    // The spare rows still hold the sentinel: neither written nor (NaN would spread) read.
    EXPECT_LT(rel(y, want_y), 1e-12) << "forward, " << G << " groups";
    EXPECT_LT(rel(dx, want_dx), 1e-12) << "dgrad, " << G << " groups";
  }
}

TEST_F(GroupedGemmRefTest, WgradOverwritesOrAccumulatesEveryGroup) {
  const int64_t N = 4, K = 7;
  for (const auto& counts : count_sets()) {
    const Groups g = groups_of(counts, 2);
    const int64_t G = static_cast<int64_t>(counts.size());
    const std::vector<double> x = tokens(g, K), dy = tokens(g, N);
    std::vector<long double> prod(static_cast<size_t>(G * N * K), 0);
    for (int64_t e = 0; e < G; ++e)
      for (int64_t r = g.offsets[e]; r < g.offsets[e + 1]; ++r)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) prod[(e * N + n) * K + k] += static_cast<long double>(dy[r * N + n]) * x[r * K + k];
    // Overwrite: whatever dweight held is gone; an empty group's block is zero.
    std::vector<double> dw = rng.vec(prod.size(), 5, 9);
    grouped_gemm_wgrad<double>(dw.data(), dy.data(), x.data(), g.offsets.data(), G, N, K, false);
    EXPECT_LT(rel(dw, prod), 1e-12) << G << " groups, overwrite";
    for (int64_t e = 0; e < G; ++e)
      if (counts[static_cast<size_t>(e)] == 0)
        for (int64_t i = 0; i < N * K; ++i) ASSERT_EQ(dw[e * N * K + i], 0.0) << "empty group " << e;
    // Accumulate: the previous values plus the product, exactly once.
    const std::vector<double> d0 = rng.vec(prod.size());
    dw = d0;
    grouped_gemm_wgrad<double>(dw.data(), dy.data(), x.data(), g.offsets.data(), G, N, K, true);
    std::vector<long double> want(prod.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = d0[i] + prod[i];
    EXPECT_LT(rel(dw, want), 1e-12) << G << " groups, accumulate";
  }
}

// One group per row is the same as the dense product: splitting the rows differently with the same
// weight per group changes nothing, and a single group is matmul itself.
TEST_F(GroupedGemmRefTest, RegroupingRowsWithEqualWeightsChangesNothing) {
  const int64_t N = 8, K = 16, rows = 23;
  const std::vector<double> x = rng.vec(static_cast<size_t>(rows * K)), w1 = rng.vec(static_cast<size_t>(N * K));
  const Groups one = groups_of({static_cast<int32_t>(rows)}, 0), three = groups_of({10, 0, 13}, 0);
  std::vector<double> w3;
  for (int i = 0; i < 3; ++i) w3.insert(w3.end(), w1.begin(), w1.end());
  std::vector<double> y1(static_cast<size_t>(rows * N)), y3(y1.size());
  grouped_gemm_forward<double>(y1.data(), x.data(), w1.data(), one.offsets.data(), 1, N, K);
  grouped_gemm_forward<double>(y3.data(), x.data(), w3.data(), three.offsets.data(), 3, N, K);
  EXPECT_LT(rel(y3, y1), 1e-14);
}

TEST_F(GroupedGemmRefTest, FloatAgreesWithDouble) {
  const int64_t N = 24, K = 40;
  const Groups g = groups_of({17, 0, 33, 5}, 0);
  const int64_t G = 4;
  const std::vector<double> x = rng.vec(static_cast<size_t>(g.M * K)), dy = rng.vec(static_cast<size_t>(g.M * N)),
                            w = rng.vec(static_cast<size_t>(G * N * K));
  const std::vector<float> xf(x.begin(), x.end()), dyf(dy.begin(), dy.end()), wf(w.begin(), w.end());
  std::vector<double> y(static_cast<size_t>(g.M * N)), dx(static_cast<size_t>(g.M * K)), dw(static_cast<size_t>(G * N * K));
  std::vector<float> yf(y.size()), dxf(dx.size()), dwf(dw.size());
  grouped_gemm_forward<double>(y.data(), x.data(), w.data(), g.offsets.data(), G, N, K);
  grouped_gemm_forward<float>(yf.data(), xf.data(), wf.data(), g.offsets.data(), G, N, K);
  grouped_gemm_dgrad<double>(dx.data(), dy.data(), w.data(), g.offsets.data(), G, N, K);
  grouped_gemm_dgrad<float>(dxf.data(), dyf.data(), wf.data(), g.offsets.data(), G, N, K);
  grouped_gemm_wgrad<double>(dw.data(), dy.data(), x.data(), g.offsets.data(), G, N, K, false);
  grouped_gemm_wgrad<float>(dwf.data(), dyf.data(), xf.data(), g.offsets.data(), G, N, K, false);
  EXPECT_LT(rel(yf, y), 1e-5);
  EXPECT_LT(rel(dxf, dx), 1e-5);
  EXPECT_LT(rel(dwf, dw), 1e-5);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
