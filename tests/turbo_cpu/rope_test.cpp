#include "turbo/kernels/cpu/rope.h"

#include <cmath>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct RopeCfg {
  int64_t B, T, H, D;
  double base;
  std::vector<int32_t> positions;  // empty: pos = t
};

template <typename Real>
struct RopeOp {
  RopeCfg c;
  explicit RopeOp(const RopeCfg& cfg) : c(cfg) {}
  const int32_t* pos() const { return c.positions.empty() ? nullptr : c.positions.data(); }
  std::vector<InputSpec> inputs() const {
    return {{"inp", static_cast<size_t>(c.B * c.T * c.H * c.D)}};
  }
  size_t out_size() const { return c.B * c.T * c.H * c.D; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    rope_forward(out.data(), x[0].data(), pos(), c.B, c.T, c.H, c.D, c.base);
  }
  void backward(const Inputs<Real>&, const std::vector<Real>& dout, Inputs<Real>& dx) {
    rope_backward(dx[0].data(), dout.data(), pos(), c.B, c.T, c.H, c.D, c.base);
  }
};

// Hugging Face's rotate_half RoPE on one head vector x[D] at position pos.
std::vector<double> rope_half_split(const std::vector<double>& x, double pos, double base) {
  const size_t D = x.size(), half = D / 2;
  std::vector<double> y(D);
  for (size_t i = 0; i < half; ++i) {
    const double a = pos * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    y[i] = x[i] * std::cos(a) - x[i + half] * std::sin(a);
    y[i + half] = x[i + half] * std::cos(a) + x[i] * std::sin(a);
  }
  return y;
}

using RopeTest = OpTest;

TEST_F(RopeTest, Gradients) { check_gradients<RopeOp>(RopeCfg{2, 5, 3, 8, 10000.0, {}}, rng); }
TEST_F(RopeTest, GradientsWithExplicitPositions) {
  check_gradients<RopeOp>(RopeCfg{1, 4, 2, 4, 500.0, {3, 0, 1, 7}}, rng);
}
TEST_F(RopeTest, FloatMatchesDouble) {
  check_float_vs_double<RopeOp>(RopeCfg{2, 256, 6, 64, 10000.0, {}}, rng);
}

// Backward is the inverse rotation: applied to the forward's output it gives the input back.
TEST_F(RopeTest, BackwardInvertsForward) {
  const int64_t B = 2, T = 300, H = 3, D = 16;
  const auto x = rng.vec(B * T * H * D);
  std::vector<double> y(x.size()), back(x.size(), 0.0);
  rope_forward(y.data(), x.data(), nullptr, B, T, H, D, 10000.0);
  rope_backward(back.data(), y.data(), nullptr, B, T, H, D, 10000.0);
  EXPECT_LT(max_abs_diff(back, x), 1e-14);
  EXPECT_GT(max_abs_diff(y, x), 0.1);  // it did rotate
}

// Pair i of a token at position pos turns by pos * base^(-2i/D); position 0 is the identity.
TEST_F(RopeTest, RotatesInterleavedPairs) {
  const int64_t T = 5, D = 6;
  const double base = 100.0;
  const auto x = rng.vec(T * D);
  std::vector<double> y(x.size());
  rope_forward(y.data(), x.data(), nullptr, 1, T, 1, D, base);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = t * std::pow(base, -2.0 * i / D);
      const double x0 = x[t * D + 2 * i], x1 = x[t * D + 2 * i + 1];
      EXPECT_NEAR(y[t * D + 2 * i], x0 * std::cos(a) - x1 * std::sin(a), 1e-14);
      EXPECT_NEAR(y[t * D + 2 * i + 1], x0 * std::sin(a) + x1 * std::cos(a), 1e-14);
    }
}

// The permutation turns Hugging Face's convention into ours: permuting W_q / W_k rows per head
// gives per-feature the same rotated q and k, up to that same permutation, so every attention
// score q·k is unchanged.
TEST_F(RopeTest, HalfSplitPermutationMapsHuggingFaceWeights) {
  const int64_t heads = 2, D = 8, C = 5;
  const double base = 10000.0, pos = 7.0;
  const auto wq_hf = rng.vec(heads * D * C), wk_hf = rng.vec(heads * D * C), x = rng.vec(C);
  std::vector<double> wq(wq_hf.size()), wk(wk_hf.size()), roundtrip(wq_hf.size());
  rope_permute_rows(wq.data(), wq_hf.data(), heads, D, C, true);
  rope_permute_rows(wk.data(), wk_hf.data(), heads, D, C, true);
  rope_permute_rows(roundtrip.data(), wq.data(), heads, D, C, false);
  EXPECT_EQ(roundtrip, wq_hf);

  auto project = [&](const std::vector<double>& w, int64_t h) {
    std::vector<double> out(D, 0.0);
    for (int64_t j = 0; j < D; ++j)
      for (int64_t c = 0; c < C; ++c) out[j] += w[(h * D + j) * C + c] * x[c];
    return out;
  };
  std::vector<int64_t> perm(D);
  rope_half_split_permutation(perm.data(), D);
  const std::vector<int32_t> position{static_cast<int32_t>(pos)};
  for (int64_t h = 0; h < heads; ++h) {
    const auto q_hf = rope_half_split(project(wq_hf, h), pos, base);
    const auto k_hf = rope_half_split(project(wk_hf, h), pos, base);
    std::vector<double> q = project(wq, h), k = project(wk, h);
    rope_forward(q.data(), q.data(), position.data(), 1, 1, 1, D, base);
    rope_forward(k.data(), k.data(), position.data(), 1, 1, 1, D, base);
    double score = 0, score_hf = 0;
    for (int64_t j = 0; j < D; ++j) {
      EXPECT_NEAR(q[j], q_hf[perm[j]], 1e-12);
      score += q[j] * k[j];
      score_hf += q_hf[j] * k_hf[j];
    }
    EXPECT_NEAR(score, score_hf, 1e-12);
  }
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
