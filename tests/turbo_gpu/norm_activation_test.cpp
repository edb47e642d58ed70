// Fused residual + LayerNorm / RMSNorm, GELU and SwiGLU on the device (TURBO) against the CPU
// reference kernels, in f32 and bf16.
#include <gtest/gtest.h>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/normalization.h"

namespace primus::turbo::testing {
namespace {

struct NormCase {
  NormType type;
  DType dt;
  int64_t C;
};

class NormTest : public GpuTest, public ::testing::WithParamInterface<NormCase> {};

TEST_P(NormTest, FusedResidualForwardAndBackwardMatchReference) {
  const auto [type, dt, C] = GetParam();
  const bool ln = type == NormType::LayerNorm;
  const int64_t N = 257;  // more rows than blocks in flight? no: odd, so the last block is partial
  TensorView x = make(dt, {N, C}), r = make(dt, {N, C}), w = make(dt, {C}), b = make(dt, {C});
  auto xv = random_tensor(x), rv = random_tensor(r), wv = random_tensor(w, 0.5f), bv = random_tensor(b, 0.5f);
  TensorView out = make(dt, {N, C}), res = make(dt, {N, C});
  TensorView mean = make(DType::F32, {N}), rstd = make(DType::F32, {N});
  for (auto t : {out, res, mean, rstd}) poison(t);
  NormForwardArgs f;
  f.type = type;
  f.out = out; f.mean = mean; f.rstd = rstd; f.residual_out = res;
  f.inp = x; f.residual = r; f.weight = w;
  if (ln) f.bias = b;
  f.ctx = ctx;
  EXPECT_EQ(norm_forward(f), BackendType::TURBO);

  // Reference on the same (dtype-rounded) values: residual rounded to dt as the kernel stores it.
  std::vector<float> rres(xv.size());
  cpu::residual_forward(rres.data(), xv.data(), rv.data(), static_cast<int64_t>(xv.size()));
  rres = round_all(dt, rres);
  std::vector<float> rout(xv.size()), rmean(N), rrstd(N);
  if (ln)
    cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), rres.data(), wv.data(), bv.data(), N, C, 1e-5);
  else
    cpu::rmsnorm_forward(rout.data(), rrstd.data(), rres.data(), wv.data(), N, C, 1e-5);
  EXPECT_EQ(rel_err(get(res), rres), 0.0) << "residual_out is the rounded sum";
  EXPECT_LT(rel_err(get(out), rout), gate(dt));
  EXPECT_LT(rel_err(get(rstd), rrstd), 1e-5);
  if (ln) {
    EXPECT_LT(rel_err(get(mean), rmean), 1e-5);
  }

  // Backward: accumulates into dinp (the residual stream's gradient) and the f32 param grads.
  TensorView dout = make(dt, {N, C}), dinp = make(dt, {N, C});
  TensorView dw = make(DType::F32, {C}), db = make(DType::F32, {C});
  auto doutv = random_tensor(dout), dinp0 = random_tensor(dinp), dw0 = random_tensor(dw), db0 = random_tensor(db);
  NormBackwardArgs bw;
  bw.type = type;
  bw.dinp = dinp; bw.dweight = dw;
  if (ln) bw.dbias = db;
  bw.dout = dout; bw.inp = res; bw.weight = w; bw.mean = mean; bw.rstd = rstd;
  bw.ctx = ctx;
  EXPECT_EQ(norm_backward(bw), BackendType::TURBO);
  // The reference uses its own statistics (rmean/rrstd), so stat errors show up here too.
  std::vector<float> rdinp = dinp0, rdw = dw0, rdb = db0;
  if (ln)
    cpu::layernorm_backward(rdinp.data(), rdw.data(), rdb.data(), doutv.data(), rres.data(), wv.data(),
                            rmean.data(), rrstd.data(), N, C);
  else
    cpu::rmsnorm_backward(rdinp.data(), rdw.data(), doutv.data(), rres.data(), wv.data(), rrstd.data(), N, C);
  EXPECT_LT(rel_err(get(dinp), rdinp), gate(dt));
  EXPECT_LT(rel_err(get(dw), rdw), gate(dt));
  if (ln) {
    EXPECT_LT(rel_err(get(db), rdb), gate(dt));
  }

  // Determinism: the same backward from the same state gives the same bits.
  auto dinp1 = bytes(dinp), dw1 = bytes(dw);
  put(dinp, dinp0);
  put(dw, dw0);
  put(db, db0);
  norm_backward(bw);
  EXPECT_EQ(bytes(dinp), dinp1);
  EXPECT_EQ(bytes(dw), dw1);
}

INSTANTIATE_TEST_SUITE_P(
    Turbo, NormTest,
    ::testing::Values(NormCase{NormType::LayerNorm, DType::BF16, 768}, NormCase{NormType::LayerNorm, DType::F32, 768},
                      NormCase{NormType::RMSNorm, DType::BF16, 2048}, NormCase{NormType::RMSNorm, DType::F32, 2048},
                      NormCase{NormType::LayerNorm, DType::BF16, 8192}, NormCase{NormType::RMSNorm, DType::F32, 72}),
    [](const auto& info) {
      return fmt::format("{}_{}_C{}", info.param.type == NormType::LayerNorm ? "ln" : "rms",
                         dtype_name(info.param.dt), info.param.C);
    });

class ActivationTest : public GpuDTypeTest {};

TEST_P(ActivationTest, GeluForwardBackward) {
  const DType dt = GetParam();
  const int64_t n = 3 * 1024 * 8 + 64;
  TensorView x = make(dt, {n}), y = make(dt, {n}), dy = make(dt, {n}), dx = make(dt, {n});
  auto xv = random_tensor(x, 2.0f), dyv = random_tensor(dy);
  poison(y);
  poison(dx);
  EXPECT_EQ(activation_forward({Activation::Gelu, y, x, ctx}), BackendType::TURBO);
  std::vector<float> ry(xv.size()), rdx(xv.size(), 0.0f);
  cpu::gelu_forward(ry.data(), xv.data(), n);
  EXPECT_LT(rel_err(get(y), ry), gate(dt));
  ActivationBackwardArgs b{Activation::Gelu, dx, x, dy, false, ctx};
  activation_backward(b);
  cpu::gelu_backward(rdx.data(), xv.data(), dyv.data(), n);
  EXPECT_LT(rel_err(get(dx), rdx), gate(dt));
  // accumulate: dx += again
  b.accumulate = true;
  activation_backward(b);
  cpu::gelu_backward(rdx.data(), xv.data(), dyv.data(), n);
  EXPECT_LT(rel_err(get(dx), rdx), gate(dt));
}

TEST_P(ActivationTest, SwigluForwardBackward) {
  const DType dt = GetParam();
  const int64_t N = 130, F = 1024 + 8;
  TensorView gu = make(dt, {N, 2 * F}), y = make(dt, {N, F}), dy = make(dt, {N, F}), dgu = make(dt, {N, 2 * F});
  auto guv = random_tensor(gu, 2.0f), dyv = random_tensor(dy);
  poison(y);
  poison(dgu);
  EXPECT_EQ(activation_forward({Activation::SwiGLU, y, gu, ctx}), BackendType::TURBO);
  std::vector<float> ry(static_cast<size_t>(N * F)), rdgu(guv.size(), 0.0f);
  cpu::swiglu_forward(ry.data(), guv.data(), N, F);
  EXPECT_LT(rel_err(get(y), ry), gate(dt));
  activation_backward({Activation::SwiGLU, dgu, gu, dy, false, ctx});
  cpu::swiglu_backward(rdgu.data(), guv.data(), dyv.data(), N, F);
  EXPECT_LT(rel_err(get(dgu), rdgu), gate(dt));
}

INSTANTIATE_TEST_SUITE_P(Turbo, ActivationTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

}  // namespace
}  // namespace primus::turbo::testing
