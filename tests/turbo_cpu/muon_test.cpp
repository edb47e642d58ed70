#include "turbo/kernels/cpu/muon.h"

#include <algorithm>
#include <cmath>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

using MuonTest = OpTest;

// NS5 of [[1, 2, 3], [4, 5, 6]], worked separately in Python (plain float lists, fp64): X =
// G / (||G||_F + 1e-7), five times X <- 3.4445 X + (-4.7750 A + 2.0315 A A) X with A = X X^T.
// Its singular values are 0.92040 and 0.70003: inside NS5's band, not exactly 1.
constexpr double kNs2x3[2][3] = {{-0.56829011014299002, 0.057741943115600214, 0.68377399637419023},
                                 {0.56335469750679379, 0.40561283103309687, 0.24787096455939972}};

TEST_F(MuonTest, NewtonSchulzOfA2x3MatrixMatchesTheHandWorkedValue) {
  const std::vector<double> g = {1, 2, 3, 4, 5, 6};
  std::vector<double> o(6);
  newton_schulz(g.data(), 2, 3, 5, o.data());
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(o[i * 3 + j], kNs2x3[i][j], 1e-12) << i << "," << j;
  const std::vector<float> gf = {1, 2, 3, 4, 5, 6};
  std::vector<float> of(6);
  newton_schulz(gf.data(), 2, 3, 5, of.data());
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(of[i * 3 + j], kNs2x3[i][j], 2e-6) << i << "," << j;
  // A tall matrix is orthogonalised through its transpose: NS(G^T) = NS(G)^T.
  const std::vector<double> gt = {1, 4, 2, 5, 3, 6};
  std::vector<double> ot(6);
  newton_schulz(gt.data(), 3, 2, 5, ot.data());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) EXPECT_NEAR(ot[i * 2 + j], kNs2x3[j][i], 1e-12) << i << "," << j;
}

// Eigenvalues of a small symmetric matrix (cyclic Jacobi), for the singular values of NS's output.
std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off < 1e-26) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        if (std::abs(a[p * n + q]) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * a[p * n + q]);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = a[i * n + i];
  return ev;
}

TEST_F(MuonTest, SingularValuesOfTheOutputLieInNs5sBand) {
  for (auto [rows, cols] : {std::pair{16, 8}, std::pair{8, 24}, std::pair{12, 40}, std::pair{40, 12}}) {
    const auto g = rng.vec(static_cast<size_t>(rows * cols));
    std::vector<double> o(g.size());
    newton_schulz(g.data(), rows, cols, 5, o.data());
    const int r = std::min(rows, cols);
    std::vector<double> gram(static_cast<size_t>(r * r), 0.0);  // O O^T or O^T O, whichever is r x r
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < r; ++j)
        for (int k = 0; k < std::max(rows, cols); ++k)
          gram[i * r + j] += rows <= cols ? o[i * cols + k] * o[j * cols + k] : o[k * cols + i] * o[k * cols + j];
    for (double ev : symmetric_eigenvalues(gram, r)) {
      const double sv = std::sqrt(std::max(ev, 0.0));
      EXPECT_GT(sv, 0.68) << rows << "x" << cols << " seed " << rng.seed();
      EXPECT_LT(sv, 1.22) << rows << "x" << cols;
    }
  }
}

// Two steps written out from Moonlight's algorithm with NS taken from the function checked above.
TEST_F(MuonTest, TwoStepsMatchTheAlgorithmWrittenOut) {
  const int64_t R = 4, C = 6, n = R * C;
  for (const bool nesterov : {true, false}) {
    for (const double wd : {0.0, 0.1}) {
      MuonParams hp;
      hp.lr = 0.05;
      hp.momentum = 0.9;
      hp.nesterov = nesterov;
      hp.weight_decay = wd;
      hp.grad_scale = 0.5;
      const auto p0 = rng.vec(n), g1 = rng.vec(n), g2 = rng.vec(n);
      std::vector<double> p = p0, m(n, 0.0);
      muon_update(p.data(), g1.data(), m.data(), R, C, hp);
      muon_update(p.data(), g2.data(), m.data(), R, C, hp);
      std::vector<double> q = p0, mm(n, 0.0), u(n), o(n);
      const double scale = 0.2 * std::sqrt(6.0);
      for (const auto* g : {&g1, &g2}) {
        for (int64_t i = 0; i < n; ++i) {
          const double gi = 0.5 * (*g)[i];
          mm[i] = 0.9 * mm[i] + gi;
          u[i] = nesterov ? gi + 0.9 * mm[i] : mm[i];
        }
        newton_schulz(u.data(), R, C, 5, o.data());
        for (int64_t i = 0; i < n; ++i) q[i] = q[i] * (1 - 0.05 * wd) - 0.05 * scale * o[i];
      }
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_NEAR(p[i], q[i], 1e-14) << "nesterov " << nesterov << " wd " << wd << " element " << i;
        EXPECT_NEAR(m[i], mm[i], 1e-15);
      }
    }
  }
}

TEST_F(MuonTest, UpdateRmsIsTheMatchedValueAndAZeroGradientOnlyDecays) {

  // = 0.2 * sqrt(min/min)... = 0.2 for any shape: AdamW's typical update RMS (Moonlight).
  const int64_t R = 24, C = 64, n = R * C;
  const auto g = rng.vec(n);
  std::vector<double> p(n, 0.0), m(n, 0.0);
  MuonParams hp;
  hp.lr = 1.0;
  muon_update(p.data(), g.data(), m.data(), R, C, hp);
  double sq = 0;
  for (double x : p) sq += x * x;
  const double rms = std::sqrt(sq / n);
  EXPECT_GT(rms, 0.2 * 0.75);
  EXPECT_LT(rms, 0.2 * 1.2);
  // Zero gradient and momentum: NS(0) = 0, so only the decay acts.
  const auto p0 = rng.vec(n);
  std::vector<double> q = p0, z(n, 0.0), mz(n, 0.0);
  hp.lr = 0.1;
  hp.weight_decay = 0.5;
  muon_update(q.data(), z.data(), mz.data(), R, C, hp);
  for (int64_t i = 0; i < n; ++i) EXPECT_DOUBLE_EQ(q[i], p0[i] * (1 - 0.05));
}

}  // namespace
}  // namespace primus::turbo::cpu::testing

namespace primus::turbo::cpu::testing {
namespace {
// Megatron's muon_scale_mode formulas on a wide and a tall block, times the extra factor, and the
// step they scale: the same NS output, a different length.
TEST(MuonScaleTest, ModesFollowMegatronsFormulas) {
  EXPECT_DOUBLE_EQ(muon_update_scale(4, 9, MuonScale::Spectral, 0.2), 0.2 * 3.0);
  EXPECT_DOUBLE_EQ(muon_update_scale(9, 4, MuonScale::Spectral, 1.0), 3.0);
  EXPECT_DOUBLE_EQ(muon_update_scale(4, 9, MuonScale::ShapeScaling, 1.0), 1.0);  // max(1, 4/9)
  EXPECT_DOUBLE_EQ(muon_update_scale(9, 4, MuonScale::ShapeScaling, 2.0), 2.0 * 1.5);
  EXPECT_DOUBLE_EQ(muon_update_scale(4, 9, MuonScale::UnitRmsNorm, 1.0), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(muon_update_scale(9, 4, MuonScale::UnitRmsNorm, 1.0), 1.5);
  EXPECT_EQ(muon_scale_from_name("shape_scaling"), MuonScale::ShapeScaling);
  EXPECT_THROW(muon_scale_from_name("rms"), ConfigError);
  // The step: params move by lr * scale * NS(u), so two modes differ by the ratio of their scales.
  const std::vector<double> g = {1, 2, 3, 4, 5, 6};
  std::vector<double> p1(6, 0.0), p2(6, 0.0), m1(6, 0.0), m2(6, 0.0);
  MuonParams a, b;
  a.lr = b.lr = 0.1;
  b.scale_mode = MuonScale::UnitRmsNorm;
  b.extra_scale = 1.0;
  muon_update(p1.data(), g.data(), m1.data(), 2, 3, a);
  muon_update(p2.data(), g.data(), m2.data(), 2, 3, b);
  const double ratio = (0.2 * std::sqrt(3.0)) / std::sqrt(2.0 / 3.0);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(p1[i], p2[i] * ratio, 1e-14) << i;
}
}  // namespace
}  // namespace primus::turbo::cpu::testing
