#include "turbo/kernels/cpu/rope.h"

#include <cmath>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct RopeCfg {
  int64_t B, T, H, D;
  double base;
  std::vector<int32_t> positions;  // empty: pos = t
  RopeScaling scaling{};
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
    rope_forward(out.data(), x[0].data(), pos(), c.B, c.T, c.H, c.D, c.base, c.scaling);
  }
  void backward(const Inputs<Real>&, const std::vector<Real>& dout, Inputs<Real>& dx) {
    rope_backward(dx[0].data(), dout.data(), pos(), c.B, c.T, c.H, c.D, c.base, c.scaling);
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

// Llama-3.2's scaling (factor 32, low 1, high 4, original 8192, base 500000, head dim 64): the
// expected frequencies are worked from the rule by hand, f_i = 500000^(-i/32),
// wavelen_i = 2 pi / f_i, kept below 8192/4 = 2048, divided by 32 above 8192/1, else blended with
// s = (8192 / wavelen_i - 1) / (4 - 1):
//   i=0 : wavelen 6.28            -> kept, 1
//   i=14: wavelen 1956.497 < 2048 -> kept, 500000^(-14/32) = 0.003211445994752591
//   i=15: wavelen 2948.303, s = 0.5928492950029659 -> (1-s) f/32 + s f = 0.001290547928209264
//   i=16: wavelen 4442.883, s = 0.28128260516325104, f = 1/sqrt(500000) -> 0.00042955679655936815
//   i=17: wavelen 6695.109, s = 0.07452656416074303 -> 9.70828780262767e-05
//   i=18: wavelen 10089.06 > 8192 -> f/32 = 0.000622772421914596 / 32 = 1.9461638184831125e-05
//   i=31: 500000^(-31/32) / 32 = 9.41830672543491e-08
TEST_F(RopeTest, Llama3ScaledFrequenciesMatchTheRuleWorkedByHand) {
  const RopeScaling s{true, 32.0, 1.0, 4.0, 8192.0};
  std::vector<double> f(32), plain(32);
  rope_inv_freq(f.data(), 64, 500000.0, s);
  rope_inv_freq(plain.data(), 64, 500000.0);
  const std::vector<std::pair<int, double>> expected = {
      {0, 1.0},
      {14, 0.003211445994752591},
      {15, 0.001290547928209264},
      {16, 0.00042955679655936815},
      {17, 9.70828780262767e-05},
      {18, 1.9461638184831125e-05},
      {31, 9.41830672543491e-08}};
  for (auto [i, want] : expected) EXPECT_NEAR(f[i], want, 1e-13 * want) << "pair " << i;
  for (int i = 0; i <= 14; ++i) EXPECT_EQ(f[i], plain[i]) << "high frequency " << i << " must be unchanged";
  for (int i = 18; i < 32; ++i) EXPECT_NEAR(f[i], plain[i] / 32.0, 1e-15 * plain[i]) << "low frequency " << i;
  // Disabled scaling, or a factor of 1, is the plain rotation.
  std::vector<double> one(32);
  rope_inv_freq(one.data(), 64, 500000.0, RopeScaling{true, 1.0, 1.0, 4.0, 8192.0});
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(one[i], plain[i], 1e-15 * plain[i]);
}

TEST_F(RopeTest, Llama3ScalingRotatesByTheScaledFrequencies) {
  // A small original context (64) so that short head dims have pairs in all three regions.
  const RopeScaling s{true, 8.0, 1.0, 4.0, 64.0};
  const int64_t T = 40, D = 16;
  std::vector<double> f(D / 2);
  rope_inv_freq(f.data(), D, 10000.0, s);
  const auto x = rng.vec(T * D);
  std::vector<double> y(x.size());
  rope_forward(y.data(), x.data(), nullptr, 1, T, 1, D, 10000.0, s);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = static_cast<double>(t) * f[i], x0 = x[t * D + 2 * i], x1 = x[t * D + 2 * i + 1];
      EXPECT_NEAR(y[t * D + 2 * i], x0 * std::cos(a) - x1 * std::sin(a), 1e-12);
      EXPECT_NEAR(y[t * D + 2 * i + 1], x0 * std::sin(a) + x1 * std::cos(a), 1e-12);
    }
  }
  int kept = 0, divided = 0, blended = 0;
  std::vector<double> plain(D / 2);
  rope_inv_freq(plain.data(), D, 10000.0);
  for (int64_t i = 0; i < D / 2; ++i) {
    if (f[i] == plain[i]) ++kept;
    else if (std::abs(f[i] - plain[i] / 8.0) < 1e-15) ++divided;
    else ++blended;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST_F(RopeTest, GradientsWithLlama3Scaling) {
  check_gradients<RopeOp>(RopeCfg{1, 6, 2, 16, 10000.0, {5, 0, 2, 63, 17, 1}, RopeScaling{true, 8.0, 1.0, 4.0, 64.0}},
                          rng);
}

TEST_F(RopeTest, Llama3ScalingRefusesParametersTheRuleCannotUse) {
  std::vector<double> f(4);
  EXPECT_THROW(rope_inv_freq(f.data(), 8, 10000.0, RopeScaling{true, 0.0, 1.0, 4.0, 64.0}), RuntimeError);
  EXPECT_THROW(rope_inv_freq(f.data(), 8, 10000.0, RopeScaling{true, 8.0, 4.0, 4.0, 64.0}), RuntimeError);
  EXPECT_THROW(rope_inv_freq(f.data(), 8, 10000.0, RopeScaling{true, 8.0, 1.0, 4.0, 0.0}), RuntimeError);
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
