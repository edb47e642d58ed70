#include "turbo/kernels/cpu/matmul.h"

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct MatmulCfg {
  int64_t N, C, OC;
  bool bias = true;
};

template <typename Real>
struct MatmulOp {
  MatmulCfg c;
  explicit MatmulOp(const MatmulCfg& cfg) : c(cfg) {}
  std::vector<InputSpec> inputs() const {
    std::vector<InputSpec> in{{"inp", static_cast<size_t>(c.N * c.C)},
                              {"weight", static_cast<size_t>(c.OC * c.C)}};
    if (c.bias) in.push_back({"bias", static_cast<size_t>(c.OC)});
    return in;
  }
  size_t out_size() const { return c.N * c.OC; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    matmul_forward(out.data(), x[0].data(), x[1].data(), c.bias ? x[2].data() : nullptr, c.N, c.C,
                   c.OC);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    matmul_backward(dx[0].data(), dx[1].data(), c.bias ? dx[2].data() : nullptr, dout.data(),
                    x[0].data(), x[1].data(), c.N, c.C, c.OC);
  }
};

using MatmulTest = OpTest;

TEST_F(MatmulTest, GradientsWithBias) { check_gradients<MatmulOp>(MatmulCfg{7, 5, 70}, rng); }
TEST_F(MatmulTest, GradientsWithoutBias) {
  check_gradients<MatmulOp>(MatmulCfg{4, 9, 3, false}, rng);
}
TEST_F(MatmulTest, FloatMatchesDouble) {
  check_float_vs_double<MatmulOp>(MatmulCfg{256, 384, 1152}, rng);
}

TEST_F(MatmulTest, ForwardIsLinearConvention) {
  const int64_t N = 3, C = 4, OC = 5;
  const auto x = rng.vec(N * C), w = rng.vec(OC * C), b = rng.vec(OC);
  std::vector<double> out(N * OC, 123.0);  // overwritten, not accumulated
  matmul_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = b[o];
      for (int64_t k = 0; k < C; ++k) s += x[n * C + k] * w[o * C + k];
      EXPECT_NEAR(out[n * OC + o], s, 1e-12);
    }
}

// Gradients of a frozen input or weight can be skipped.
TEST_F(MatmulTest, BackwardSkipsNullOutputs) {
  const int64_t N = 6, C = 5, OC = 4;
  const auto x = rng.vec(N * C), w = rng.vec(OC * C), dout = rng.vec(N * OC);
  std::vector<double> dw_all(OC * C, 0.0), dx_all(N * C, 0.0), dw_only(OC * C, 0.0);
  matmul_backward(dx_all.data(), dw_all.data(), static_cast<double*>(nullptr), dout.data(),
                  x.data(), w.data(), N, C, OC);
  matmul_backward(static_cast<double*>(nullptr), dw_only.data(), static_cast<double*>(nullptr),
                  dout.data(), x.data(), w.data(), N, C, OC);
  EXPECT_EQ(dw_all, dw_only);
  EXPECT_GT(max_abs(dx_all), 0.0);
}

// Repeated calls give the same bits (with a fixed BLAS thread count; see matmul.cpp for why not
// across thread counts).
TEST_F(MatmulTest, BackwardIsReproducible) {
  const int64_t N = 512, C = 384, OC = 384;
  const auto x = rng.vec<float>(N * C), w = rng.vec<float>(OC * C), dout = rng.vec<float>(N * OC);
  const auto b = rng.vec<float>(OC);
  auto run = [&] {
    std::vector<float> out(N * OC), dx(N * C, 0.f), dw(OC * C, 0.f), db(OC, 0.f);
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
    matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), N, C, OC);
    for (const auto* v : {&dx, &dw, &db}) out.insert(out.end(), v->begin(), v->end());
    return out;
  };
  EXPECT_EQ(run(), run());
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
