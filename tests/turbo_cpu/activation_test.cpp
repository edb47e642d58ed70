#include "turbo/kernels/cpu/activation.h"

#include <cmath>

#include "tests/turbo_cpu/op_check.h"
#include "turbo/kernels/cpu/residual.h"

namespace primus::turbo::cpu::testing {
namespace {

struct RowsCfg {
  int64_t N, F;
};

template <typename Real>
struct GeluOp {
  RowsCfg c;
  explicit GeluOp(const RowsCfg& cfg) : c(cfg) {}
  std::vector<InputSpec> inputs() const { return {{"inp", static_cast<size_t>(c.N * c.F), -4, 4}}; }
  size_t out_size() const { return c.N * c.F; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    gelu_forward(out.data(), x[0].data(), c.N * c.F);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    gelu_backward(dx[0].data(), x[0].data(), dout.data(), c.N * c.F);
  }
};

template <typename Real>
struct SwigluOp {
  RowsCfg c;
  explicit SwigluOp(const RowsCfg& cfg) : c(cfg) {}
  std::vector<InputSpec> inputs() const {
    return {{"gate_up", static_cast<size_t>(c.N * 2 * c.F), -4, 4}};
  }
  size_t out_size() const { return c.N * c.F; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    swiglu_forward(out.data(), x[0].data(), c.N, c.F);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    swiglu_backward(dx[0].data(), x[0].data(), dout.data(), c.N, c.F);
  }
};

template <typename Real>
struct ResidualOp {
  RowsCfg c;
  explicit ResidualOp(const RowsCfg& cfg) : c(cfg) {}
  std::vector<InputSpec> inputs() const {
    const size_t n = c.N * c.F;
    return {{"a", n}, {"b", n}};
  }
  size_t out_size() const { return c.N * c.F; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    residual_forward(out.data(), x[0].data(), x[1].data(), c.N * c.F);
  }
  void backward(const Inputs<Real>&, const std::vector<Real>& dout, Inputs<Real>& dx) {
    residual_backward(dx[0].data(), dx[1].data(), dout.data(), c.N * c.F);
  }
};

using ActivationTest = OpTest;

TEST_F(ActivationTest, GeluGradients) { check_gradients<GeluOp>(RowsCfg{3, 40}, rng); }
TEST_F(ActivationTest, GeluFloatMatchesDouble) {
  check_float_vs_double<GeluOp>(RowsCfg{64, 1536}, rng);
}
TEST_F(ActivationTest, SwigluGradients) { check_gradients<SwigluOp>(RowsCfg{3, 20}, rng); }
TEST_F(ActivationTest, SwigluFloatMatchesDouble) {
  check_float_vs_double<SwigluOp>(RowsCfg{64, 1024}, rng);
}
TEST_F(ActivationTest, ResidualGradients) { check_gradients<ResidualOp>(RowsCfg{3, 7}, rng); }
TEST_F(ActivationTest, ResidualFloatMatchesDouble) {
  check_float_vs_double<ResidualOp>(RowsCfg{64, 384}, rng);
}

// GELU's tanh form against its definition, and SwiGLU against silu(gate) * up on the halves.
TEST_F(ActivationTest, ForwardMatchesDefinitions) {
  const int64_t N = 4, F = 6;
  const auto x = rng.vec(N * 2 * F, -5, 5);
  std::vector<double> g(N * 2 * F), s(N * F);
  gelu_forward(g.data(), x.data(), N * 2 * F);
  for (int64_t i = 0; i < N * 2 * F; ++i) {
    const double v = x[i];
    const double want = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(g[i], want, 1e-14);
  }
  swiglu_forward(s.data(), x.data(), N, F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double gate = x[n * 2 * F + f], up = x[n * 2 * F + F + f];
      EXPECT_NEAR(s[n * F + f], gate / (1 + std::exp(-gate)) * up, 1e-14);
    }
}

TEST_F(ActivationTest, InPlaceGeluAndResidual) {
  auto x = rng.vec<float>(1000, -3, 3);
  const auto y = rng.vec<float>(1000);
  std::vector<float> want(1000), sum(1000);
  gelu_forward(want.data(), x.data(), 1000);
  std::vector<float> inplace = x;
  gelu_forward(inplace.data(), inplace.data(), 1000);
  EXPECT_EQ(inplace, want);
  residual_forward(sum.data(), x.data(), y.data(), 1000);
  residual_forward(x.data(), x.data(), y.data(), 1000);
  EXPECT_EQ(x, sum);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
