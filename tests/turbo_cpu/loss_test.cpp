#include "turbo/kernels/cpu/loss.h"

#include <cmath>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct CeCfg {
  int64_t N, V;
  std::vector<int32_t> targets;
  bool fused = false;
};

// Output: the mean loss (one scalar). The gradient check then covers dloss = dout / count.
template <typename Real>
struct CrossEntropyOp {
  CeCfg c;
  std::vector<Real> lse, losses;
  explicit CrossEntropyOp(const CeCfg& cfg) : c(cfg), lse(c.N), losses(c.N) {}
  std::vector<InputSpec> inputs() const {
    return {{"logits", static_cast<size_t>(c.N * c.V), -3, 3, /*accumulates=*/false}};
  }
  size_t out_size() const { return 1; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    out[0] = static_cast<Real>(
        cross_entropy_forward(losses.data(), lse.data(), x[0].data(), c.targets.data(), c.N, c.V)
            .mean());
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    const double dloss = dout[0] / static_cast<double>(cross_entropy_count(c.targets.data(), c.N));
    if (c.fused) {
      cross_entropy_forward_backward(dx[0].data(), static_cast<Real*>(nullptr), x[0].data(),
                                     c.targets.data(), c.N, c.V, dloss);
    } else {
      cross_entropy_backward(dx[0].data(), x[0].data(), lse.data(), c.targets.data(), c.N, c.V,
                             dloss);
    }
  }
};

class CrossEntropyTest : public OpTest {
 protected:
  // Targets with some rows ignored.
  CeCfg cfg(int64_t N, int64_t V, bool fused = false) {
    CeCfg c{N, V, rng.ints(N, 0, static_cast<int32_t>(V - 1)), fused};
    c.targets[1] = kIgnoreIndex;
    c.targets[N - 1] = kIgnoreIndex;
    return c;
  }
};

TEST_F(CrossEntropyTest, Gradients) { check_gradients<CrossEntropyOp>(cfg(6, 11), rng); }
TEST_F(CrossEntropyTest, FusedGradients) { check_gradients<CrossEntropyOp>(cfg(6, 11, true), rng); }
TEST_F(CrossEntropyTest, FloatMatchesDouble) {
  check_float_vs_double<CrossEntropyOp>(cfg(64, 5000), rng);
  check_float_vs_double<CrossEntropyOp>(cfg(64, 5000, true), rng);
}

// Against -log_softmax written out directly (no max subtraction: fine for these logits).
TEST_F(CrossEntropyTest, MatchesLogSoftmaxAndIgnoresRows) {
  const CeCfg c = cfg(9, 13);
  const auto logits = rng.vec(c.N * c.V, -4, 4);
  std::vector<double> losses(c.N), lse(c.N);
  const CrossEntropyResult r =
      cross_entropy_forward(losses.data(), lse.data(), logits.data(), c.targets.data(), c.N, c.V);
  double total = 0;
  for (int64_t n = 0; n < c.N; ++n) {
    double z = 0;
    for (int64_t v = 0; v < c.V; ++v) z += std::exp(logits[n * c.V + v]);
    EXPECT_NEAR(lse[n], std::log(z), 1e-12);
    if (c.targets[n] == kIgnoreIndex) {
      EXPECT_EQ(losses[n], 0.0);
      continue;
    }
    const double want = std::log(z) - logits[n * c.V + c.targets[n]];
    EXPECT_NEAR(losses[n], want, 1e-12);
    total += want;
  }
  EXPECT_EQ(r.count, c.N - 2);
  EXPECT_EQ(cross_entropy_count(c.targets.data(), c.N), c.N - 2);
  EXPECT_NEAR(r.mean(), total / (c.N - 2), 1e-12);

  std::vector<double> dlogits(c.N * c.V, 7.0);  // overwritten, ignored rows included
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), c.targets.data(), c.N, c.V,
                         0.5);
  for (int64_t v = 0; v < c.V; ++v) EXPECT_EQ(dlogits[1 * c.V + v], 0.0);
}

// The loss is shift-invariant per row; max subtraction keeps huge logits finite and exact.
TEST_F(CrossEntropyTest, StableForHugeLogits) {
  const CeCfg c = cfg(8, 300);
  const auto logits = rng.vec(c.N * c.V, -5, 5);
  auto shifted = logits;
  for (double& x : shifted) x += 1e4;
  std::vector<double> lse(c.N);
  const auto r = cross_entropy_forward(static_cast<double*>(nullptr), lse.data(), logits.data(),
                                       c.targets.data(), c.N, c.V);
  const auto rs = cross_entropy_forward(static_cast<double*>(nullptr), lse.data(), shifted.data(),
                                        c.targets.data(), c.N, c.V);
  EXPECT_NEAR(rs.mean(), r.mean(), 1e-9);
  EXPECT_GT(r.mean(), 0.0);
}

// Fused and separate backward agree; the in-place variants give the same bits as out-of-place.
TEST_F(CrossEntropyTest, FusedAndInPlace) {
  const CeCfg c = cfg(16, 300);
  const auto logits = rng.vec<float>(c.N * c.V, -8, 8);
  std::vector<float> lse(c.N), dl(c.N * c.V), fused(c.N * c.V);
  const auto r = cross_entropy_forward(static_cast<float*>(nullptr), lse.data(), logits.data(),
                                       c.targets.data(), c.N, c.V);
  cross_entropy_backward(dl.data(), logits.data(), lse.data(), c.targets.data(), c.N, c.V, 0.25);
  const auto rf = cross_entropy_forward_backward(fused.data(), static_cast<float*>(nullptr),
                                                 logits.data(), c.targets.data(), c.N, c.V, 0.25);
  EXPECT_NEAR(rf.loss_sum, r.loss_sum, 1e-12 * r.loss_sum);
  EXPECT_LT(rel_error(fused, dl), 1e-5);

  std::vector<float> inplace = logits;
  cross_entropy_backward(inplace.data(), inplace.data(), lse.data(), c.targets.data(), c.N, c.V,
                         0.25);
  EXPECT_EQ(inplace, dl);
  inplace = logits;
  cross_entropy_forward_backward(inplace.data(), static_cast<float*>(nullptr), inplace.data(),
                                 c.targets.data(), c.N, c.V, 0.25);
  EXPECT_EQ(inplace, fused);
}

TEST_F(CrossEntropyTest, RejectsTargetsOutsideVocabulary) {
  const std::vector<int32_t> targets{0, 5};
  std::vector<float> logits(2 * 5), lse(2);
  EXPECT_THROW(cross_entropy_forward(static_cast<float*>(nullptr), lse.data(), logits.data(),
                                     targets.data(), 2, 5),
               RuntimeError);
}

// A padded vocabulary (rows ld > V apart): the loss and the first V gradient columns equal the
// unpadded computation, whatever the padded columns hold; the padded columns get 0 gradient.
TEST_F(CrossEntropyTest, PaddedRowsIgnoreTheirExtraColumns) {
  const int64_t N = 5, V = 7, ld = 12;
  const std::vector<int32_t> targets{0, 6, kIgnoreIndex, 3, 5};
  const auto compact = rng.vec<double>(N * V, -4, 4);
  std::vector<double> padded(N * ld);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < ld; ++v) padded[n * ld + v] = v < V ? compact[n * V + v] : 50.0 + v;  // large: would win
  }
  std::vector<double> lse(N), lse_p(N), loss(N), loss_p(N), d(N * V), d_p(N * ld, 7.0), f_p = padded;
  const auto r = cross_entropy_forward(loss.data(), lse.data(), compact.data(), targets.data(), N, V);
  const auto rp = cross_entropy_forward(loss_p.data(), lse_p.data(), padded.data(), targets.data(), N, V,
                                        kIgnoreIndex, ld);
  EXPECT_EQ(rp.count, r.count);
  EXPECT_NEAR(rp.loss_sum, r.loss_sum, 1e-12 * std::abs(r.loss_sum));
  EXPECT_EQ(lse_p, lse);
  cross_entropy_backward(d.data(), compact.data(), lse.data(), targets.data(), N, V, 0.5);
  cross_entropy_backward(d_p.data(), padded.data(), lse_p.data(), targets.data(), N, V, 0.5, kIgnoreIndex, ld);
  const auto rf = cross_entropy_forward_backward(f_p.data(), static_cast<double*>(nullptr), f_p.data(),
                                                 targets.data(), N, V, 0.5, kIgnoreIndex, ld);
  EXPECT_NEAR(rf.loss_sum, r.loss_sum, 1e-12 * std::abs(r.loss_sum));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < ld; ++v) {
      const double want = v < V ? d[n * V + v] : 0.0;
      EXPECT_EQ(d_p[n * ld + v], want) << n << "," << v;
      EXPECT_NEAR(f_p[n * ld + v], want, 1e-14) << n << "," << v;
    }
  }
  EXPECT_THROW(cross_entropy_forward(loss.data(), lse.data(), padded.data(), targets.data(), N, V, kIgnoreIndex, V - 1),
               RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
