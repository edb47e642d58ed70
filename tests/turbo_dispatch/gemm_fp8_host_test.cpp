// FP8 GEMM operands and the FP8 linear layers on host tensors (the CPU backend: the reference
// the device path is compared with in tests/turbo_gpu/gemm_fp8_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/arena.h"
#include "turbo/core/dtype.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/fp8_delayed.h"
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
      double sq = 0.0, s = 0.0, mag = 0.0;
      for (int64_t k = 0; k < C; ++k) {
        sq += double(qx[i * C + k]) * qw[j * C + k];
        mag += std::fabs(double(qx[i * C + k]) * qw[j * C + k]);
        s += double(x[i * C + k]) * w[j * C + k];
      }
      // The f32 GEMM's rounding: at most about C f32 ulps of the sum of |terms| (a sum that cancels
      // to a small value keeps the error of its large terms), far below a wrong scale or code.
      EXPECT_NEAR(out[i * OC + j], sq * sx * sw, 2.0 * C * 6e-8 * mag * sx * sw + 1e-12);
      num += (out[i * OC + j] - s) * (out[i * OC + j] - s);
      den += s * s;
    }
  EXPECT_GT(10 * std::log10(den / num), 25.0);
}

}  // namespace

// ---- per-group FP8 scaling: the GEMM's scale layouts and the rowwise / blockwise linear layers ----
// Helpers in a named namespace: the host test binaries are unity builds.
namespace fp8_group_gemm_test {

using G = Fp8Granularity;

// The scale index of element (r, k) of an operand stored [R, K] (A as [M,K], B as its [N,K]),
// written out from fp8_granularity.h's comment rather than taken from fp8_scale_index.
int64_t scale_index(G g, int64_t R, int64_t K, int64_t r, int64_t k) {
  switch (g) {
    case G::Tensor: return 0;
    case G::Row: return r;
    case G::Block1x128: return (k / 128) * R + r;
    case G::Block128x128: return (r / 128) * ((K / 128 + 3) / 4 * 4) + k / 128;
  }
  return -1;
}
int64_t scale_numel(G g, int64_t R, int64_t K) {
  switch (g) {
    case G::Tensor: return 1;
    case G::Row: return R;
    case G::Block1x128: return (K / 128) * R;
    case G::Block128x128: return (R / 128) * ((K / 128 + 3) / 4 * 4);
  }
  return -1;
}

float decode(DType t, uint8_t b) { return t == DType::F8E4M3 ? f8e4m3_bits_to_float(b) : f8e5m2_bits_to_float(b); }

// A stored [R, K] FP8 operand with random finite bytes and a distinct random scale per group;
// entries of a scale tensor that no element reads (128x128 padding) hold NaN, so reading one
// would show.
struct Operand {
  DType dt;
  G g;
  int64_t R, K;
  std::vector<uint8_t> q;
  std::vector<float> scale;
  Operand(DType dt_, G g_, int64_t R_, int64_t K_, std::mt19937& rng) : dt(dt_), g(g_), R(R_), K(K_) {
    std::uniform_real_distribution<float> u(-3.0f, 3.0f), e(-4.0f, 4.0f);
    q.resize(static_cast<size_t>(R * K));
    for (auto& b : q) b = dt == DType::F8E4M3 ? float_to_f8e4m3_bits(u(rng)) : float_to_f8e5m2_bits(u(rng));
    scale.assign(static_cast<size_t>(scale_numel(g, R, K)), std::numeric_limits<float>::quiet_NaN());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) {
        float& s = scale[static_cast<size_t>(scale_index(g, R, K, r, k))];
        if (std::isnan(s)) s = std::exp2(e(rng));
      }
  }
  double at(int64_t r, int64_t k) const {
    return double(decode(dt, q[r * K + k])) * scale[static_cast<size_t>(scale_index(g, R, K, r, k))];
  }
  TensorView scale_view() { return TensorView(scale.data(), DType::F32, Device::CPU, {int64_t(scale.size())}); }
};

// GemmArgs for D [M,N] f32 = A [M,K] @ (B stored [N,K])^T, the K-contiguous layout of the GPU.
GemmArgs args_of(Operand& a, Operand& b, std::vector<float>& d) {
  GemmArgs g;
  g.a = TensorView(a.q.data(), a.dt, Device::CPU, {a.R, a.K});
  g.b = TensorView(b.q.data(), b.dt, Device::CPU, {b.R, b.K}).transposed();
  d.assign(static_cast<size_t>(a.R * b.R), 0.0f);
  g.d = TensorView(d.data(), DType::F32, Device::CPU, {a.R, b.R});
  g.a_scale = a.scale_view();
  g.b_scale = b.scale_view();
  g.a_scaling = a.g;
  g.b_scaling = b.g;
  return g;
}

struct Pairing {
  G ga, gb;
  DType ta, tb;
};
void PrintTo(const Pairing& p, std::ostream* os) {
  *os << "A " << fp8_granularity_name(p.ga) << " " << dtype_name(p.ta) << ", B " << fp8_granularity_name(p.gb) << " "
      << dtype_name(p.tb);
}
class Fp8GroupGemmHost : public ::testing::TestWithParam<Pairing> {};

// D equals sum_k (A[i,k] a_scale(i,k)) (B[j,k] b_scale(j,k)) in double within 1e-5 of
// sum_k |..| |..| (f32 GEMM of the dequantized operands); M, N multiples of 128 and K = 384 so that
// the 128x128 scale rows carry a padding entry (NaN here, never read).
TEST_P(Fp8GroupGemmHost, MatchesDequantizedDoubleLoop) {
  const auto [ga, gb, ta, tb] = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t M = 256, N = 128, K = 384;
  Operand a(ta, ga, M, K, rng), b(tb, gb, N, K, rng);
  std::vector<float> d;
  GemmArgs g = args_of(a, b, d);
  EXPECT_EQ(gemm(g), BackendType::CPU);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = a.at(i, k) * b.at(j, k);
        s += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(d[i * N + j], s, 1e-5 * mag) << i << "," << j;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, Fp8GroupGemmHost,
    ::testing::Values(Pairing{G::Row, G::Row, DType::F8E4M3, DType::F8E5M2},
                      Pairing{G::Row, G::Row, DType::F8E5M2, DType::F8E4M3},
                      Pairing{G::Block1x128, G::Block1x128, DType::F8E4M3, DType::F8E4M3},
                      Pairing{G::Block1x128, G::Block128x128, DType::F8E4M3, DType::F8E4M3},
                      Pairing{G::Block128x128, G::Block1x128, DType::F8E4M3, DType::F8E4M3}),
    [](const auto& info) {
      return std::string(fp8_granularity_name(info.param.ga)) == "row"
                 ? "RowRow_" + std::string(dtype_name(info.param.ta)) + "_" + std::string(dtype_name(info.param.tb))
                 : std::string("A") + (info.param.ga == G::Block1x128 ? "1x128" : "128x128") + "_B" +
                       (info.param.gb == G::Block1x128 ? "1x128" : "128x128");
    });

// What turbo::gemm refuses with per-group scales, and the message it gives.
TEST(Fp8GroupGemmHostErrors, RefusesBadPairingsAndSizes) {
  std::mt19937 rng(1);
  const auto refuse = [](GemmArgs g, const std::string& part) {
    const std::string e = error_of([&] { gemm(g); });
    EXPECT_NE(e.find(part), std::string::npos) << "expected '" << part << "', got '" << e << "'";
  };
  std::vector<float> d;
  {
    Operand a(DType::F8E4M3, G::Block128x128, 128, 256, rng), b(DType::F8E4M3, G::Block128x128, 128, 256, rng);
    refuse(args_of(a, b, d), "do not pair");
  }
  {
    Operand a(DType::F8E4M3, G::Row, 128, 256, rng), b(DType::F8E4M3, G::Tensor, 128, 256, rng);
    refuse(args_of(a, b, d), "row (A) and tensor (B) differ");
    Operand at(DType::F8E4M3, G::Tensor, 128, 256, rng), br(DType::F8E4M3, G::Row, 128, 256, rng);
    refuse(args_of(at, br, d), "tensor (A) and row (B) differ");
  }
  {
    Operand a(DType::F8E4M3, G::Block1x128, 128, 256, rng), r(DType::F8E4M3, G::Row, 128, 256, rng);
    refuse(args_of(a, r, d), "do not pair");  // block with a non-block operand
  }
  {
    Operand a(DType::F8E4M3, G::Block1x128, 128, 256, rng), b(DType::F8E5M2, G::Block128x128, 128, 256, rng);
    refuse(args_of(a, b, d), "block-scaled FP8 GEMMs take f8e4m3 operands");
    Operand a5(DType::F8E5M2, G::Block1x128, 128, 256, rng), b4(DType::F8E4M3, G::Block1x128, 128, 256, rng);
    refuse(args_of(a5, b4, d), "block-scaled FP8 GEMMs take f8e4m3 operands");
  }
  {
    // K = 192: a 1x128 tile would straddle the end of K. (Operands and scales sized for K = 256.)
    Operand a(DType::F8E4M3, G::Block1x128, 128, 256, rng), b(DType::F8E4M3, G::Block1x128, 128, 256, rng);
    GemmArgs g = args_of(a, b, d);
    g.a = TensorView(a.q.data(), DType::F8E4M3, Device::CPU, {128, 192});
    g.b = TensorView(b.q.data(), DType::F8E4M3, Device::CPU, {128, 192}).transposed();
    refuse(g, "multiples of 128");
  }
  {
    Operand a(DType::F8E4M3, G::Block1x128, 128, 256, rng), b(DType::F8E4M3, G::Block128x128, 128, 256, rng);
    GemmArgs g = args_of(a, b, d);
    EXPECT_EQ(gemm(g), BackendType::CPU);  // the valid pairing, before breaking it
    g.fp8_fast_accum = true;
    refuse(g, "without fast accumulation");
    g = args_of(a, b, d);
    ASSERT_EQ(g.b_scale.numel(), 4);  // 128x128 scales of B [128, 256]: [1, pad4(2)] = 4 entries...
    g.b_scale.shape[0] = 2;           // ...the unpadded 2 are refused
    refuse(g, "needs b_scale as 4 contiguous f32");
    g = args_of(a, b, d);
    g.a_scale.shape[0] = 128;  // one tile per row, not K/128 = 2
    refuse(g, "needs a_scale as 256 contiguous f32");
  }
  {
    Operand a(DType::F8E4M3, G::Row, 128, 64, rng), b(DType::F8E4M3, G::Row, 96, 64, rng);
    GemmArgs g = args_of(a, b, d);
    EXPECT_EQ(gemm(g), BackendType::CPU);
    g.b_scale.shape[0] = 128;  // A's row count, not B's (N = 96)
    refuse(g, "row scaling needs b_scale as 96 contiguous f32");
  }
}

// ---- the linear layers under the rowwise and blockwise recipes ----------------------------------

double snr_db(const std::vector<float>& got, const std::vector<float>& ref, int64_t row_len = 0,
              const std::vector<bool>* rows = nullptr) {
  double sig = 0, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (rows && !(*rows)[i / static_cast<size_t>(row_len)]) continue;
    sig += double(ref[i]) * ref[i];
    err += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
  }
  return 10 * std::log10(sig / err);
}

struct LinearCase {
  const char* format;
  const char* scaling;
};
void PrintTo(const LinearCase& c, std::ostream* os) { *os << c.format << " " << c.scaling; }
class Fp8GroupLinearHost : public ::testing::TestWithParam<LinearCase> {};

TensorView host(std::vector<float>& v, int64_t r, int64_t c) { return TensorView(v.data(), DType::F32, Device::CPU, {r, c}); }

// Random normal x, w, dout with a few outlier token rows (x50) in x and dout: the forward output,
// the input gradient and the weight gradient of the FP8 layer against the f32 layer: SNR >= 25 dB
// where every operand is E4M3, >= 20 dB for the gradients of the hybrid recipe (dout in E5M2).
TEST_P(Fp8GroupLinearHost, ForwardAndBackwardMeetSnrGates) {
  const auto [format, scaling] = GetParam();
  const Fp8Recipe r = parse_fp8_recipe(format, scaling, "fp8", "fp8_recipe");
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t N = 256, C = 256, OC = 384;
  const int64_t q = linear_fp8_multiple(r);
  ASSERT_TRUE(N % q == 0 && C % q == 0 && OC % q == 0);
  std::vector<float> x(N * C), w(OC * C), dy(N * OC);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = 0.05f * nd(rng);
  for (auto& v : dy) v = nd(rng);
  for (int64_t row : {3, 100, 201}) for (int64_t c = 0; c < C; ++c) x[row * C + c] *= 50.0f;
  for (int64_t row : {17, 130}) for (int64_t c = 0; c < OC; ++c) dy[row * OC + c] *= 50.0f;
  auto arena = make_host_arena(linear_fp8_scratch_bytes(N, C, OC));  // the documented upper bound
  ExecContext ctx;
  ctx.scratch = arena.get();
  std::vector<float> out(N * OC), out_ref(N * OC), dx(N * C, 7.0f), dx_ref(N * C), dw(OC * C, 7.0f), dw_ref(OC * C);
  linear_forward_fp8(host(out, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx, r);
  linear_forward(host(out_ref, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx);
  // accumulate flags false: dx and dw (pre-filled with 7) are overwritten.
  linear_backward_fp8(host(dx, N, C), host(dw, OC, C), {}, host(dy, N, OC), host(x, N, C), host(w, OC, C), false, ctx,
                      r, false);
  linear_backward(host(dx_ref, N, C), host(dw_ref, OC, C), {}, host(dy, N, OC), host(x, N, C), host(w, OC, C), false,
                  ctx, false);
  const double grad_gate = r.grad == DType::F8E5M2 ? 20.0 : 25.0;
  const double s_out = snr_db(out, out_ref), s_dx = snr_db(dx, dx_ref), s_dw = snr_db(dw, dw_ref);
  EXPECT_GE(s_out, 25.0) << "forward";
  EXPECT_GE(s_dx, grad_gate) << "dinp";
  EXPECT_GE(s_dw, grad_gate) << "dweight";
  EXPECT_EQ(arena->used(), 0u);  // the scratch is given back
  // Only the recipe's own rounding: far from exact (not the f32 result by accident), far from noise.
  EXPECT_LT(s_out, 60.0);
  EXPECT_LT(s_dw, 60.0);
}

INSTANTIATE_TEST_SUITE_P(Fp8, Fp8GroupLinearHost,
                         ::testing::Values(LinearCase{"e4m3", "rowwise"}, LinearCase{"hybrid", "rowwise"},
                                           LinearCase{"e4m3", "blockwise"}),
                         [](const auto& info) { return std::string(info.param.format) + "_" + info.param.scaling; });

// The point of per-row scales: with outlier rows in x, one tensor-wide scale pushes the ordinary
// rows down into E4M3's subnormals, a scale per row does not. Over the ordinary rows the rowwise
// and blockwise forward outputs are far more accurate than the tensorwise one.
TEST(Fp8GroupLinearHostOutliers, RowwiseBeatsTensorwiseOnOrdinaryRows) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t N = 256, C = 256, OC = 384;
  std::vector<float> x(N * C), w(OC * C), ref(N * OC);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = 0.05f * nd(rng);
  std::vector<bool> ordinary(N, true);
  for (int64_t row : {3, 100, 201}) {
    ordinary[row] = false;
    for (int64_t c = 0; c < C; ++c) x[row * C + c] *= 65536.0f;
  }
  auto arena = make_host_arena(linear_fp8_scratch_bytes(N, C, OC));
  ExecContext ctx;
  ctx.scratch = arena.get();
  linear_forward(host(ref, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx);
  const auto forward = [&](const char* scaling) {
    std::vector<float> out(N * OC);
    linear_forward_fp8(host(out, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx,
                       parse_fp8_recipe("e4m3", scaling, "fp8", "fp8_recipe"));
    return out;
  };
  const std::vector<float> t = forward("tensorwise"), rw = forward("rowwise"), bw = forward("blockwise");
  const double s_t = snr_db(t, ref, OC, &ordinary), s_r = snr_db(rw, ref, OC, &ordinary), s_b = snr_db(bw, ref, OC, &ordinary);
  EXPECT_GE(s_r, 25.0);
  EXPECT_GE(s_b, 25.0);
  EXPECT_GT(s_r, s_t + 10.0) << "rowwise " << s_r << " dB, tensorwise " << s_t << " dB";
  EXPECT_GT(s_b, s_t + 10.0) << "blockwise " << s_b << " dB, tensorwise " << s_t << " dB";
  // Over the whole output (dominated by the outlier rows) every recipe passes the gate.
  EXPECT_GE(snr_db(t, ref), 25.0);
  EXPECT_GE(snr_db(rw, ref), 25.0);
}

TEST(Fp8RecipeScaling, ParsesAndRefuses) {
  const Fp8Recipe b = parse_fp8_recipe("e4m3", "blockwise", "fp8", "fp8_recipe");
  EXPECT_EQ(b.scaling, Fp8Scaling::Blockwise);
  EXPECT_FALSE(b.fast_accum_fwd);
  EXPECT_EQ(b.grad, DType::F8E4M3);
  EXPECT_EQ(b.act_granularity(), G::Block1x128);
  EXPECT_EQ(b.weight_granularity(), G::Block128x128);
  const Fp8Recipe rw = parse_fp8_recipe("hybrid", "rowwise", "fp8", "fp8_recipe");
  EXPECT_EQ(rw.scaling, Fp8Scaling::Rowwise);
  EXPECT_EQ(rw.grad, DType::F8E5M2);
  EXPECT_TRUE(rw.fast_accum_fwd);
  EXPECT_EQ(rw.act_granularity(), G::Row);
  EXPECT_EQ(rw.weight_granularity(), G::Row);
  EXPECT_EQ(parse_fp8_recipe("hybrid", "tensorwise", "fp8", "fp8_recipe").scaling, Fp8Scaling::Tensorwise);
  try {
    parse_fp8_recipe("hybrid", "blockwise", "fp8", "fp8_recipe");
    ADD_FAILURE() << "hybrid blockwise accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_recipe"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("e4m3"), std::string::npos) << e.what();
  }
  try {
    parse_fp8_recipe("e4m3", "columnwise", "fp8", "fp8_recipe");
    ADD_FAILURE() << "unknown scaling accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_recipe"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("columnwise"), std::string::npos) << e.what();
  }
  EXPECT_EQ(linear_fp8_multiple(b), 128);   // blockwise: the scale blocks
  EXPECT_EQ(linear_fp8_multiple(rw), 16);   // rowwise: Hopper's FP8 GEMMs
  EXPECT_EQ(linear_fp8_multiple(parse_fp8_recipe("hybrid", "fp8")), 16);
}

// An input saved in FP8 (Fp8SavedInputs): the forward writes q(x)^T into the layer's slot with
// the same forward output, and the backward's weight gradient read from the slot equals the one
// quantized from x itself, bit for bit, even when the x it is handed is garbage by then; for every
// scaling (blockwise: its 1x128 scales along the tokens). A slot too small for the call is refused.
TEST(Fp8SavedInputsHost, TheWeightGradientReadsTheForwardsCopy) {
  for (const auto& [format, scaling] : {std::pair{"hybrid", "tensorwise"}, std::pair{"hybrid", "rowwise"},
                                        std::pair{"e4m3", "blockwise"}}) {
    SCOPED_TRACE(scaling);
    Fp8Recipe r = parse_fp8_recipe(format, scaling, "fp8", "fp8_recipe");
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> nd;
    const int64_t N = 256, C = 128, OC = 384;
    std::vector<float> x(N * C), w(OC * C), dy(N * OC);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) v = 0.05f * nd(rng);
    for (auto& v : dy) v = nd(rng);
    auto arena = make_host_arena(linear_fp8_scratch_bytes(N, C, OC));
    ExecContext ctx;
    ctx.scratch = arena.get();
    std::vector<float> out(N * OC), out_saved(N * OC), dx(N * C), dx_saved(N * C), dw(OC * C), dw_saved(OC * C);
    linear_forward_fp8(host(out, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx, r);
    linear_backward_fp8(host(dx, N, C), host(dw, OC, C), {}, host(dy, N, OC), host(x, N, C), host(w, OC, C), false, ctx,
                        r, false);
    std::vector<uint8_t> q_t(C * N, 0xAB);
    std::vector<float> scales(fp8_saved_scale_numel(r, N, C), -1.0f);
    r.saved = std::make_shared<Fp8SavedInputs>(r.act_granularity());
    r.saved->add(w.data(), {TensorView(q_t.data(), r.fwd, Device::CPU, {C * N}),
                            TensorView(scales.data(), DType::F32, Device::CPU, {static_cast<int64_t>(scales.size())})});
    linear_forward_fp8(host(out_saved, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx, r);
    EXPECT_EQ(out_saved, out);
    EXPECT_NE(q_t, std::vector<uint8_t>(C * N, 0xAB)) << "the forward wrote no copy";
    std::vector<float> garbage(N * C, std::numeric_limits<float>::quiet_NaN());
    linear_backward_fp8(host(dx_saved, N, C), host(dw_saved, OC, C), {}, host(dy, N, OC), host(garbage, N, C),
                        host(w, OC, C), false, ctx, r, false);
    EXPECT_EQ(dw_saved, dw) << "the weight gradient did not read the saved copy";
    EXPECT_EQ(dx_saved, dx);
    // The wgrad-only call reads it too.
    std::vector<float> dw_only(OC * C);
    linear_backward_fp8({}, host(dw_only, OC, C), {}, host(dy, N, OC), host(garbage, N, C), host(w, OC, C), false, ctx,
                        r, false);
    EXPECT_EQ(dw_only, dw);
    Fp8Recipe small = r;
    small.saved = std::make_shared<Fp8SavedInputs>(r.act_granularity());
    small.saved->add(w.data(), {TensorView(q_t.data(), r.fwd, Device::CPU, {C * N / 2}),
                                TensorView(scales.data(), DType::F32, Device::CPU, {static_cast<int64_t>(scales.size())})});
    EXPECT_NE(error_of([&] { linear_forward_fp8(host(out, N, OC), host(x, N, C), host(w, OC, C), {}, {}, ctx, small); })
                  .find("too small"),
              std::string::npos);
  }
}

// Delayed scaling with the SwiGLU folded into the quantizer (Fp8Producers): the down-projection's
// forward and weight gradient on act = swiglu(gate_up), and the up-projection's gradients on
// dgate_up, never written, give the results of the same calls on the written tensors, bit for
// bit, with the same amaxes recorded; the entry is used once and dropped; without a delayed scale
// (before the first recorded step) and with a bias gradient the call writes the tensor instead.
TEST(Fp8ProducersHost, LinearCallsQuantizeTheActivationTheyComputeThemselves) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  const int64_t N = 64, F = 128, H = 96;
  const auto randv = [&](int64_t n, float sc) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = sc * nd(rng);
    return v;
  };
  std::vector<float> gate_up = randv(N * 2 * F, 2.0f), dact = randv(N * F, 0.5f), ln = randv(N * H, 1.0f),
                     dres = randv(N * H, 0.5f), w_down = randv(H * F, 0.05f), w_up = randv(2 * F * H, 0.05f);
  auto arena = make_host_arena(4 * linear_fp8_scratch_bytes(N, 2 * F, 2 * F));
  ExecContext ctx;
  ctx.scratch = arena.get();
  // The written tensors, by the activation op.
  std::vector<float> act(N * F), dgu(N * 2 * F);
  activation_forward({Activation::SwiGLU, host(act, N, F), host(gate_up, N, 2 * F), ctx});
  {
    ActivationBackwardArgs b;
    b.act = Activation::SwiGLU;
    b.dinp = host(dgu, N, 2 * F);
    b.inp = host(gate_up, N, 2 * F);
    b.dout = host(dact, N, F);
    b.ctx = ctx;
    activation_backward(b);
  }
  Fp8Recipe r = parse_fp8_recipe("hybrid", "delayed", "fp8", "fp8_recipe");
  r.delayed = std::make_shared<Fp8DelayedScaling>(Fp8DelayedOptions{});
  r.delayed->add_layer(w_down.data(), "down");
  r.delayed->add_layer(w_up.data(), "up");
  std::vector<float> history(6), scale(6), fp8max(6);
  for (int t = 0; t < 6; ++t) fp8max[t] = r.delayed->fp8_max_of_tensor(t);
  r.delayed->bind(TensorView(history.data(), DType::F32, Device::CPU, {6}), TensorView(scale.data(), DType::F32, Device::CPU, {6}),
                  TensorView(fp8max.data(), DType::F32, Device::CPU, {6}));
  const std::vector<float> scales = {30.0f, 2000.0f, 9000.0f, 50.0f, 3000.0f, 20000.0f};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Run {
    std::vector<float> out, dx_down, dw_down, dx_up, dw_up, history;
  };
  // The down-projection (forward, then both gradients without a saved copy) and the up-projection's
  // gradients; with `fold` on never-written act and dgate_up buffers and the producers put before
  // each call, as the decoder does.
  const auto run = [&](bool fold, bool use_history) {
    Fp8Recipe rr = r;
    rr.producers = fold ? std::make_shared<Fp8Producers>() : nullptr;
    r.delayed->use_history = use_history;
    scale = scales;
    std::fill(history.begin(), history.end(), 0.0f);
    Run o{std::vector<float>(N * H), std::vector<float>(N * F), std::vector<float>(H * F), std::vector<float>(N * H),
          std::vector<float>(2 * F * H), {}};
    std::vector<float> act_buf(N * F, nan), dgu_buf(N * 2 * F, nan);
    std::vector<float>& a = fold ? act_buf : act;
    std::vector<float>& d = fold ? dgu_buf : dgu;
    const auto put_act = [&] {
      if (fold) rr.producers->put(host(a, N, F), {QuantizePrologue::SwiGLU, host(gate_up, N, 2 * F), {}});
    };
    put_act();
    linear_forward_fp8(host(o.out, N, H), host(a, N, F), host(w_down, H, F), {}, {}, ctx, rr);
    if (fold) EXPECT_EQ(rr.producers->find(host(a, N, F)), nullptr) << "the entry outlived its call";
    put_act();
    linear_backward_fp8(host(o.dx_down, N, F), host(o.dw_down, H, F), {}, host(dres, N, H), host(a, N, F),
                        host(w_down, H, F), false, ctx, rr, false);
    if (fold)
      rr.producers->put(host(d, N, 2 * F),
                        {QuantizePrologue::SwiGLUBackward, host(dact, N, F), host(gate_up, N, 2 * F)});
    linear_backward_fp8(host(o.dx_up, N, H), host(o.dw_up, 2 * F, H), {}, host(d, N, 2 * F), host(ln, N, H),
                        host(w_up, 2 * F, H), false, ctx, rr, false);
    o.history = history;
    if (fold) {
      EXPECT_EQ(rr.producers->puts, 3);
      if (use_history) {
        EXPECT_EQ(rr.producers->folded, 3);
        EXPECT_EQ(rr.producers->written, 0);
        EXPECT_TRUE(std::isnan(act_buf[0]) && std::isnan(act_buf.back())) << "act was written";
        EXPECT_TRUE(std::isnan(dgu_buf[0]) && std::isnan(dgu_buf.back())) << "dgate_up was written";
      } else {  // current scaling: each call writes its tensor, then quantizes it
        EXPECT_EQ(rr.producers->folded, 0);
        EXPECT_EQ(rr.producers->written, 3);
        EXPECT_EQ(act_buf, act);
        EXPECT_EQ(dgu_buf, dgu);
      }
    }
    return o;
  };
  for (const bool use_history : {true, false}) {
    SCOPED_TRACE(use_history ? "delayed scales" : "no scale yet");
    const Run want = run(false, use_history), got = run(true, use_history);
    EXPECT_EQ(got.out, want.out);
    EXPECT_EQ(got.dx_down, want.dx_down);
    EXPECT_EQ(got.dw_down, want.dw_down);
    EXPECT_EQ(got.dx_up, want.dx_up);
    EXPECT_EQ(got.dw_up, want.dw_up);
    EXPECT_EQ(got.history, want.history);
    EXPECT_GT(got.history[0], 0.0f) << "no amax recorded for act";
  }
  // A bias gradient reads dgate_up itself: the call writes it first.
  Fp8Recipe rr = r;
  rr.producers = std::make_shared<Fp8Producers>();
  r.delayed->use_history = true;
  std::vector<float> dgu_buf(N * 2 * F, nan), dx(N * H), dw(2 * F * H), db(2 * F, 0.0f);
  rr.producers->put(host(dgu_buf, N, 2 * F), {QuantizePrologue::SwiGLUBackward, host(dact, N, F), host(gate_up, N, 2 * F)});
  linear_backward_fp8(host(dx, N, H), host(dw, 2 * F, H), TensorView(db.data(), DType::F32, Device::CPU, {2 * F}),
                      host(dgu_buf, N, 2 * F), host(ln, N, H), host(w_up, 2 * F, H), false, ctx, rr, false);
  EXPECT_EQ(rr.producers->written, 1);
  EXPECT_EQ(dgu_buf, dgu);
  // put() names what it expected.
  std::vector<float> wrong(N * F);
  EXPECT_NE(error_of([&] {
              rr.producers->put(host(wrong, N, F), {QuantizePrologue::SwiGLUBackward, host(dact, N, F), host(gate_up, N, 2 * F)});
            }).find("Fp8Producers::put"),
            std::string::npos);
}

}  // namespace fp8_group_gemm_test
}  // namespace primus::turbo
