// FP8 GEMM operands and the FP8 linear layers on host tensors (the CPU backend: the reference
// the device path is compared with in tests/turbo_gpu/gemm_fp8_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/util/error.h"
#include "turbo/core/arena.h"
#include "turbo/core/dtype.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/gemm_fp8.h"

namespace primus::turbo {
namespace {

std::vector<uint8_t> to_fp8(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> q(v.size());
  for (size_t i = 0; i < v.size(); ++i) q[i] = t == DType::F8E4M3 ? float_to_f8e4m3_bits(v[i]) : float_to_f8e5m2_bits(v[i]);
  return q;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Small integers and halves are exact in E4M3 and E5M2: the scaled product is exact in f32.
TEST(Fp8GemmHost, ScaledProductOfExactValuesIsExact) {
  const int64_t M = 3, N = 4, K = 16;
  std::vector<float> av(M * K), bv(N * K);
  for (int64_t i = 0; i < M * K; ++i) av[i] = float((i * 7) % 9 - 4) * 0.5f;
  for (int64_t i = 0; i < N * K; ++i) bv[i] = float((i * 5) % 7 - 3);
  auto aq = to_fp8(av, DType::F8E4M3), bq = to_fp8(bv, DType::F8E5M2);
  float sa = 0.25f, sb = 3.0f;
  std::vector<float> d(M * N, 1.0f);
  GemmArgs g;
  g.a = TensorView(aq.data(), DType::F8E4M3, Device::CPU, {M, K});
  g.b = TensorView(bq.data(), DType::F8E5M2, Device::CPU, {N, K}).transposed();
  g.d = TensorView(d.data(), DType::F32, Device::CPU, {M, N});
  g.a_scale = TensorView(&sa, DType::F32, Device::CPU, {1});
  g.b_scale = TensorView(&sb, DType::F32, Device::CPU, {1});
  g.beta = 2.0f;
  EXPECT_EQ(gemm(g), BackendType::CPU);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(av[i * K + k]) * bv[j * K + k];
      EXPECT_EQ(d[i * N + j], float(2.0 + 0.75 * s)) << i << "," << j;
    }
}

TEST(Fp8GemmHost, BadOperandsNameTheProblem) {
  std::vector<uint8_t> q(64 * 64);
  std::vector<float> f(64 * 64), d(64 * 64);
  float one = 1.0f;
  GemmArgs g;
  g.a = TensorView(q.data(), DType::F8E4M3, Device::CPU, {64, 64});
  g.b = TensorView(f.data(), DType::F32, Device::CPU, {64, 64});
  g.d = TensorView(d.data(), DType::F32, Device::CPU, {64, 64});
  g.a_scale = g.b_scale = TensorView(&one, DType::F32, Device::CPU, {1});
  EXPECT_NE(error_of([&] { gemm(g); }).find("two FP8 operands"), std::string::npos);
  g.a = TensorView(q.data(), DType::F8E5M2, Device::CPU, {64, 64});
  g.b = TensorView(q.data(), DType::F8E5M2, Device::CPU, {64, 64}).transposed();
  EXPECT_NE(error_of([&] { gemm(g); }).find("both f8e5m2"), std::string::npos);
  g.a = TensorView(q.data(), DType::F8E4M3, Device::CPU, {64, 64});
  g.a_scale = {};
  EXPECT_NE(error_of([&] { gemm(g); }).find("a_scale"), std::string::npos);
  // Scales on bf16 operands are a mistake, not ignored.
  GemmArgs h;
  h.a = TensorView(f.data(), DType::F32, Device::CPU, {64, 64});
  h.b = h.a;
  h.d = TensorView(d.data(), DType::F32, Device::CPU, {64, 64});
  h.a_scale = TensorView(&one, DType::F32, Device::CPU, {1});
  EXPECT_NE(error_of([&] { gemm(h); }).find("FP8 operands only"), std::string::npos);
}

TEST(Fp8Recipe, ParsesHybridAndE4m3AndRefusesTheRest) {
  EXPECT_EQ(parse_fp8_recipe("hybrid", "fp8").grad, DType::F8E5M2);
  EXPECT_EQ(parse_fp8_recipe("e4m3", "fp8").grad, DType::F8E4M3);
  EXPECT_EQ(parse_fp8_recipe("e4m3", "fp8").name(), "e4m3");
  const std::string e = error_of([] { parse_fp8_recipe("delayed", "model.yaml: fp8"); });
  EXPECT_NE(e.find("model.yaml: fp8"), std::string::npos) << e;
  EXPECT_NE(e.find("delayed"), std::string::npos) << e;
}

// The host linear layer quantizes per tensor with scale = 448 / amax (E4M3): its output equals
// the product of those quantized values exactly (f32 GEMM of exact fp8 values), and is close to
// the unquantized product (SNR above DESIGN.md's 25 dB gate for E4M3).
TEST(Fp8LinearHost, ForwardIsTheProductOfPerTensorQuantizedOperands) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  const int64_t N = 64, C = 48, OC = 32;
  std::vector<float> x(N * C), w(OC * C), out(N * OC);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = 0.1f * nd(rng);
  auto arena = make_host_arena(size_t{8} << 20);
  ExecContext ctx;
  ctx.scratch = arena.get();
  linear_forward_fp8(TensorView(out.data(), DType::F32, Device::CPU, {N, OC}),
                     TensorView(x.data(), DType::F32, Device::CPU, {N, C}),
                     TensorView(w.data(), DType::F32, Device::CPU, {OC, C}), {}, {}, ctx);
  auto quant = [](const std::vector<float>& v, float* scale_inv) {
    float amax = 0.0f;
    for (float e : v) amax = std::max(amax, std::fabs(e));
    const float scale = 448.0f / amax;
    *scale_inv = 1.0f / scale;
    std::vector<float> q(v.size());
    for (size_t i = 0; i < v.size(); ++i) q[i] = f8e4m3_bits_to_float(float_to_f8e4m3_bits(v[i] * scale));
    return q;
  };
  float sx = 0, sw = 0;
  const auto qx = quant(x, &sx), qw = quant(w, &sw);
  double num = 0, den = 0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < OC; ++j) {
      double sq = 0.0, s = 0.0;
      for (int64_t k = 0; k < C; ++k) {
        sq += double(qx[i * C + k]) * qw[j * C + k];
        s += double(x[i * C + k]) * w[j * C + k];
      }
      EXPECT_NEAR(out[i * OC + j], sq * sx * sw, 1e-5 * (std::fabs(sq * sx * sw) + 1e-3));
      num += (out[i * OC + j] - s) * (out[i * OC + j] - s);
      den += s * s;
    }
  EXPECT_GT(10 * std::log10(den / num), 25.0);
}

}  // namespace
}  // namespace primus::turbo
