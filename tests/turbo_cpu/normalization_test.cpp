#include "turbo/kernels/cpu/normalization.h"

#include <cmath>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct NormCfg {
  int64_t N, C;
  double eps;
};

template <typename Real>
struct LayerNormOp {
  NormCfg c;
  std::vector<Real> mean, rstd;
  explicit LayerNormOp(const NormCfg& cfg) : c(cfg), mean(c.N), rstd(c.N) {}
  std::vector<InputSpec> inputs() const {
    const size_t nc = c.N * c.C, C = c.C;
    return {{"inp", nc, -2, 2}, {"weight", C, 0.5, 1.5}, {"bias", C}};
  }
  size_t out_size() const { return c.N * c.C; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x[0].data(), x[1].data(), x[2].data(),
                      c.N, c.C, c.eps);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    layernorm_backward(dx[0].data(), dx[1].data(), dx[2].data(), dout.data(), x[0].data(),
                       x[1].data(), mean.data(), rstd.data(), c.N, c.C);
  }
};

template <typename Real>
struct RmsNormOp {
  NormCfg c;
  std::vector<Real> rstd;
  explicit RmsNormOp(const NormCfg& cfg) : c(cfg), rstd(c.N) {}
  std::vector<InputSpec> inputs() const {
    const size_t nc = c.N * c.C, C = c.C;
    return {{"inp", nc, -2, 2}, {"weight", C, 0.5, 1.5}};
  }
  size_t out_size() const { return c.N * c.C; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    rmsnorm_forward(out.data(), rstd.data(), x[0].data(), x[1].data(), c.N, c.C, c.eps);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    rmsnorm_backward(dx[0].data(), dx[1].data(), dout.data(), x[0].data(), x[1].data(), rstd.data(),
                     c.N, c.C);
  }
};

// Qwen3's per-head norm: 3 tokens of 3 query + 2 key heads of 6, two weights.
struct HeadNormCfg {
  int64_t N, Hx, q_heads, D;
};
template <typename Real>
struct HeadRmsNormOp {
  HeadNormCfg c;
  std::vector<Real> rstd;
  explicit HeadRmsNormOp(const HeadNormCfg& cfg) : c(cfg), rstd(c.N * c.Hx) {}
  std::vector<InputSpec> inputs() const {
    const size_t n = c.N * c.Hx * c.D, D = c.D;
    return {{"inp", n, -2, 2}, {"weight_q", D, 0.5, 1.5}, {"weight_k", D, 0.5, 1.5}};
  }
  size_t out_size() const { return c.N * c.Hx * c.D; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    head_rmsnorm_forward(out.data(), rstd.data(), x[0].data(), x[1].data(), x[2].data(), c.N, c.Hx, c.q_heads, c.D,
                         1e-6);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    head_rmsnorm_backward(dx[0].data(), dx[1].data(), dx[2].data(), dout.data(), x[0].data(), x[1].data(),
                          x[2].data(), rstd.data(), c.N, c.Hx, c.q_heads, c.D);
  }
};

using NormTest = OpTest;

TEST_F(NormTest, HeadRmsNormGradients) { check_gradients<HeadRmsNormOp>(HeadNormCfg{3, 5, 3, 6}, rng); }

// Each (token, head) row is its own RMSNorm with its group's weight: query heads wq, key heads wk.
TEST_F(NormTest, HeadRmsNormIsAnRmsNormPerHead) {
  const int64_t N = 2, Hx = 3, q_heads = 2, D = 5;
  const auto x = rng.vec(N * Hx * D, -3, 3), wq = rng.vec(D), wk = rng.vec(D);
  std::vector<double> out(N * Hx * D), rstd(N * Hx), row(D), r(1);
  head_rmsnorm_forward(out.data(), rstd.data(), x.data(), wq.data(), wk.data(), N, Hx, q_heads, D, 1e-6);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hx; ++h) {
      const int64_t o = (n * Hx + h) * D;
      rmsnorm_forward(row.data(), r.data(), x.data() + o, h < q_heads ? wq.data() : wk.data(), 1, D, 1e-6);
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[o + d], row[d]) << n << "," << h << "," << d;
    }
}

// C = 70 spans two column blocks of the weight-gradient pass (64 wide) and a ragged tail.
TEST_F(NormTest, LayerNormGradients) { check_gradients<LayerNormOp>(NormCfg{5, 70, 1e-5}, rng); }
TEST_F(NormTest, LayerNormFloatMatchesDouble) {
  check_float_vs_double<LayerNormOp>(NormCfg{64, 384, 1e-5}, rng);
}
TEST_F(NormTest, RmsNormGradients) { check_gradients<RmsNormOp>(NormCfg{5, 70, 1e-6}, rng); }
TEST_F(NormTest, RmsNormFloatMatchesDouble) {
  check_float_vs_double<RmsNormOp>(NormCfg{64, 384, 1e-6}, rng);
}

// The forward against the textbook formula, including the saved statistics.
TEST_F(NormTest, LayerNormMatchesDefinition) {
  const int64_t N = 3, C = 17;
  const auto x = rng.vec(N * C, -3, 3), w = rng.vec(C), b = rng.vec(C);
  std::vector<double> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5);
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c] / C;
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    EXPECT_NEAR(mean[n], m, 1e-12);
    EXPECT_NEAR(rstd[n], 1 / std::sqrt(v + 1e-5), 1e-10);
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out[n * C + c], (x[n * C + c] - m) / std::sqrt(v + 1e-5) * w[c] + b[c], 1e-10);
  }
}

TEST_F(NormTest, RmsNormMatchesDefinition) {
  const int64_t N = 3, C = 17;
  const auto x = rng.vec(N * C, -3, 3), w = rng.vec(C);
  std::vector<double> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c] / C;
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out[n * C + c], x[n * C + c] / std::sqrt(ms + 1e-6) * w[c], 1e-10);
  }
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
