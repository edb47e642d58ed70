// FP8 GEMMs on the device (cuBLASLt with per-tensor scales) and the FP8 linear layers
// (turbo/ops/gemm_fp8.h) against double-precision host products and against the host path
// (the same quantization and GEMM on the CPU backends).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>
#include <utility>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/gemm_fp8.h"

namespace primus::turbo::testing {
namespace {

// Signal-to-noise ratio of `got` against `ref` in dB: 10 log10(sum ref^2 / sum (got - ref)^2).
double snr_db(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return -INFINITY;
    den += ref[i] * ref[i];
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
  }
  return 10.0 * std::log10(den / std::max(num, 1e-300));
}

// d[i,j] = sum_k a[i,k] * bt[j,k] (bt is B stored [N,K]) in double.
std::vector<double> product_nt(const std::vector<float>& a, const std::vector<float>& bt, int64_t M, int64_t N,
                               int64_t K) {
  std::vector<double> d(static_cast<size_t>(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(a[i * K + k]) * bt[j * K + k];
      d[i * N + j] = s;
    }
  return d;
}

class Fp8GemmTest : public GpuTest {
 protected:
  TensorView scalar(float v) {
    TensorView t = make(DType::F32, {1});
    put(t, {v});
    return t;
  }
};

// Operands given as FP8 values with scales: the product of the dequantized values in double is
// the exact answer; cuBLASLt (fp32 accumulation) must reproduce it to fp32/bf16 rounding.
TEST_F(Fp8GemmTest, ScaledProductMatchesDoubleForEveryTypeMix) {
  struct Case { DType a, b, d; bool fast; };
  for (const Case cs : {Case{DType::F8E4M3, DType::F8E4M3, DType::F32, false},
                        Case{DType::F8E4M3, DType::F8E4M3, DType::BF16, true},
                        Case{DType::F8E5M2, DType::F8E4M3, DType::BF16, false},
                        Case{DType::F8E4M3, DType::F8E5M2, DType::F32, false}}) {
    SCOPED_TRACE(fmt::format("A {} B {} D {} fast {}", dtype_name(cs.a), dtype_name(cs.b), dtype_name(cs.d), cs.fast));
    const int64_t M = 192, N = 320, K = 512;
    TensorView a = make(cs.a, {M, K}), bt = make(cs.b, {N, K}), d = make(cs.d, {M, N});
    const auto av = random_tensor(a, 4.0f), bv = random_tensor(bt, 4.0f);
    const float sa = 0.125f, sb = 0.0625f;
    GemmArgs g;
    g.a = a;
    g.b = bt.transposed();
    g.d = d;
    g.a_scale = scalar(sa);
    g.b_scale = scalar(sb);
    g.fp8_fast_accum = cs.fast;
    poison(d);
    EXPECT_EQ(gemm(g), BackendType::CUBLASLT);
    auto ref = product_nt(av, bv, M, N, K);
    for (auto& x : ref) x *= double(sa) * sb;
    // Hopper's FP8 tensor cores keep fewer than fp32's bits between cuBLASLt's promotions to fp32
    // (measured 1.0e-4..1.3e-4 with f32 output on an H100), fast accumulation fewer still.
    EXPECT_LT(rel_err(get(d), ref), cs.d == DType::F32 && !cs.fast ? 1e-3 : 1e-2);
  }
}

TEST_F(Fp8GemmTest, BetaAccumulatesIntoF32AndBiasEpilogueAddsInBf16) {
  const int64_t M = 128, N = 256, K = 384;
  TensorView a = make(DType::F8E5M2, {M, K}), bt = make(DType::F8E4M3, {N, K});
  const auto av = random_tensor(a, 2.0f), bv = random_tensor(bt, 2.0f);
  auto ref = product_nt(av, bv, M, N, K);
  // dW += dY^T X style: f32 output accumulated onto what is there.
  TensorView d = make(DType::F32, {M, N});
  const auto d0 = random_tensor(d);
  GemmArgs g;
  g.a = a;
  g.b = bt.transposed();
  g.d = d;
  g.beta = 1.0f;
  g.a_scale = scalar(0.5f);
  g.b_scale = scalar(0.25f);
  gemm(g);
  std::vector<double> want(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) want[i] = d0[i] + ref[i] * 0.125;
  EXPECT_LT(rel_err(get(d), want), 1e-3);

  TensorView out = make(DType::BF16, {M, N}), bias = make(DType::BF16, {N});
  const auto biasv = random_tensor(bias);
  GemmArgs h = g;
  h.d = out;
  h.beta = 0.0f;
  h.epilogue = GemmEpilogue::Bias;
  h.bias = bias;
  poison(out);
  gemm(h);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) want[i * N + j] = ref[i * N + j] * 0.125 + biasv[j];
  EXPECT_LT(rel_err(get(out), want), 1e-2);
}

TEST_F(Fp8GemmTest, RefusedLayoutsAndTypesNameTheReason) {
  const int64_t M = 64, N = 64, K = 64;
  TensorView a = make(DType::F8E4M3, {M, K}), b = make(DType::F8E4M3, {K, N}), d = make(DType::BF16, {M, N});
  random_tensor(a);
  random_tensor(b);
  GemmArgs g;
  g.a = a;
  g.b = b;  // N-contiguous B: Hopper's FP8 GEMM wants K-contiguous operands
  g.d = d;
  g.a_scale = scalar(1.0f);
  g.b_scale = scalar(1.0f);
  try {
    gemm(g);
    FAIL() << "a row-major FP8 B was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("K-contiguous"), std::string::npos) << e.what();
  }
  TensorView e5a = make(DType::F8E5M2, {M, K}), e5b = make(DType::F8E5M2, {N, K});
  g.a = e5a;
  g.b = e5b.transposed();
  EXPECT_THROW(gemm(g), std::exception);
  g.a = a;
  g.b = make(DType::F8E4M3, {N, K}).transposed();
  g.b_scale = {};
  try {
    gemm(g);
    FAIL() << "a missing scale was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("b_scale"), std::string::npos) << e.what();
  }
}

// The linear layers: device (TURBO quantization + cuBLASLt FP8) against the host path (CPU
// quantization + dequantized f32 GEMM) on the same bf16-rounded inputs, and both against the
// unquantized double product with the FP8 SNR gates of DESIGN.md (E4M3 25 dB, E5M2 20 dB).
class Fp8LinearTest : public Fp8GemmTest {
 protected:
  void SetUp() override {
    Fp8GemmTest::SetUp();
    if (IsSkipped()) return;
    host_scratch_ = make_host_arena(size_t{64} << 20);
    hctx.scratch = host_scratch_.get();
  }
  TensorView host(std::vector<float>& v, std::initializer_list<int64_t> shape) {
    return TensorView(v.data(), DType::F32, Device::CPU, shape);
  }
  ExecContext hctx;

 private:
  std::unique_ptr<Arena> host_scratch_;
};

TEST_F(Fp8LinearTest, ForwardBackwardMatchHostPathAndSnrGates) {
  const int64_t N = 512, C = 256, OC = 384;
  for (const auto& [name, scaling] : {std::pair{"hybrid", "tensorwise"}, std::pair{"e4m3", "tensorwise"},
                                      std::pair{"hybrid", "rowwise"}, std::pair{"e4m3", "rowwise"},
                                      std::pair{"e4m3", "blockwise"}}) {
    SCOPED_TRACE(fmt::format("{} {}", name, scaling));
    const Fp8Recipe r = parse_fp8_recipe(name, scaling, "test", "test_recipe");
    TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), bias = make(DType::BF16, {OC});
    auto xv = random_tensor(x), wv = random_tensor(w, 0.05f), bv = random_tensor(bias, 0.1f);
    TensorView out = make(DType::BF16, {N, OC});
    poison(out);
    linear_forward_fp8(out, x, w, bias, {}, ctx, r);
    std::vector<float> hout(size_t(N * OC));
    linear_forward_fp8(host(hout, {N, OC}), host(xv, {N, C}), host(wv, {OC, C}), host(bv, {OC}), {}, hctx, r);
    auto ref = product_nt(xv, wv, N, OC, C);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < OC; ++j) ref[i * OC + j] += bv[j];
    const auto got = get(out);
    EXPECT_LT(rel_err(got, hout), 1e-2);
    EXPECT_GT(snr_db(got, ref), 25.0);
    EXPECT_GT(snr_db(hout, ref), 25.0);

    // Backward: dinp overwritten, dweight and dbias accumulated (f32).
    TensorView dout = make(DType::BF16, {N, OC}), dx = make(DType::BF16, {N, C});
    TensorView dw = make(DType::F32, {OC, C}), db = make(DType::F32, {OC});
    auto dyv = random_tensor(dout, 0.01f);
    auto dw0 = random_tensor(dw, 0.01f), db0 = random_tensor(db, 0.01f);
    poison(dx);
    linear_backward_fp8(dx, dw, db, dout, x, w, false, ctx, r);
    std::vector<float> hdx(size_t(N * C)), hdw = dw0, hdb = db0;
    linear_backward_fp8(host(hdx, {N, C}), host(hdw, {OC, C}), host(hdb, {OC}), host(dyv, {N, OC}), host(xv, {N, C}),
                        host(wv, {OC, C}), false, hctx, r);
    // dx = dy @ w; dw = dw0 + dy^T x; db = db0 + colsum(dy)
    std::vector<double> rdx(size_t(N * C), 0.0), rdw(size_t(OC * C), 0.0), rdb(size_t(OC), 0.0);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < OC; ++j) {
        const double g = dyv[i * OC + j];
        rdb[j] += g;
        for (int64_t k = 0; k < C; ++k) {
          rdx[i * C + k] += g * wv[j * C + k];
          rdw[j * C + k] += g * xv[i * C + k];
        }
      }
    std::vector<double> rdw_total(rdw.size()), rdb_total(rdb.size());
    for (size_t i = 0; i < rdw.size(); ++i) rdw_total[i] = dw0[i] + rdw[i];
    for (size_t i = 0; i < rdb.size(); ++i) rdb_total[i] = db0[i] + rdb[i];
    const auto gdx = get(dx), gdw = get(dw), gdb = get(db);
    const double grad_gate = r.grad == DType::F8E5M2 ? 20.0 : 25.0;
    EXPECT_LT(rel_err(gdx, hdx), 1e-2);
    EXPECT_GT(snr_db(gdx, rdx), grad_gate);
    std::vector<float> gdw_delta(gdw.size()), hdw_delta(hdw.size());
    for (size_t i = 0; i < gdw.size(); ++i) gdw_delta[i] = gdw[i] - dw0[i], hdw_delta[i] = hdw[i] - dw0[i];
    EXPECT_LT(rel_err(gdw_delta, hdw_delta), 1e-3);  // same quantized operands, fp32 sums
    EXPECT_GT(snr_db(gdw_delta, rdw), grad_gate);
    EXPECT_LT(rel_err(gdb, rdb_total), 1e-5);  // the bias gradient is not quantized
  }
}

TEST_F(Fp8LinearTest, GeluForwardAndDGeluBackwardMatchHostPath) {
  const int64_t N = 256, C = 128, OC = 512;
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), bias = make(DType::BF16, {OC});
  auto xv = random_tensor(x), wv = random_tensor(w, 0.1f), bv = random_tensor(bias, 0.1f);
  TensorView act = make(DType::BF16, {N, OC}), pre = make(DType::BF16, {N, OC});
  poison(act);
  poison(pre);
  linear_forward_fp8(act, x, w, bias, pre, ctx);
  std::vector<float> hact(size_t(N * OC)), hpre(size_t(N * OC));
  linear_forward_fp8(host(hact, {N, OC}), host(xv, {N, C}), host(wv, {OC, C}), host(bv, {OC}), host(hpre, {N, OC}), hctx);
  EXPECT_LT(rel_err(get(pre), hpre), 1e-2);
  EXPECT_LT(rel_err(get(act), hact), 1e-2);

  // dpre [N,OC] = (dy [N,C2] @ w2 [C2,OC]) * gelu'(pre), the down projection's input gradient.
  const int64_t C2 = 192;
  TensorView w2 = make(DType::BF16, {C2, OC}), dy = make(DType::BF16, {N, C2}), dpre = make(DType::BF16, {N, OC});
  auto w2v = random_tensor(w2, 0.1f), dyv = random_tensor(dy, 0.1f);
  const auto prev = get(pre);
  poison(dpre);
  linear_backward_input_dgelu_fp8(dpre, {}, dy, w2, pre, ctx);
  std::vector<float> hdpre(size_t(N * OC));
  std::vector<float> prev_copy = prev;
  linear_backward_input_dgelu_fp8(host(hdpre, {N, OC}), {}, host(dyv, {N, C2}), host(w2v, {C2, OC}),
                                  host(prev_copy, {N, OC}), hctx);
  EXPECT_LT(rel_err(get(dpre), hdpre), 2e-2);
  // Against the unquantized product through the reference GELU derivative.
  std::vector<double> ref(size_t(N * OC), 0.0);
  std::vector<float> row(static_cast<size_t>(OC)), grow(static_cast<size_t>(OC));
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < OC; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < C2; ++k) s += double(dyv[i * C2 + k]) * w2v[k * OC + j];
      grow[j] = static_cast<float>(s);
      row[j] = 0.0f;
    }
    cpu::gelu_backward(row.data(), prev.data() + i * OC, grow.data(), OC);
    for (int64_t j = 0; j < OC; ++j) ref[i * OC + j] = row[j];
  }
  EXPECT_GT(snr_db(get(dpre), ref), 20.0);
}

TEST_F(Fp8LinearTest, ScratchBytesCoverEveryCall) {
  // The three calls of a layer borrow at most linear_fp8_scratch_bytes: run them in an arena of
  // exactly that size (the quantizer's partials included), for every scaling.
  for (const char* scaling : {"tensorwise", "rowwise", "blockwise"}) {
  SCOPED_TRACE(scaling);
  const Fp8Recipe r = parse_fp8_recipe("e4m3", scaling, "test", "test_recipe");
  const int64_t N = 1024, C = 256, OC = 768;
  auto tight = make_device_arena(linear_fp8_scratch_bytes(N, C, OC));
  ExecContext c = ctx;
  c.scratch = tight.get();
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), out = make(DType::BF16, {N, OC});
  random_tensor(x);
  random_tensor(w, 0.05f);
  // The arena throws (naming the borrow) when a call needs more than the stated bytes.
  ASSERT_NO_THROW(linear_forward_fp8(out, x, w, {}, {}, c, r));
  TensorView dx = make(DType::BF16, {N, C}), dw = make(DType::F32, {OC, C});
  random_tensor(dw);
  ASSERT_NO_THROW(linear_backward_fp8(dx, dw, {}, out, x, w, false, c, r));  // both gradients: the largest borrow
  ASSERT_NO_THROW(linear_backward_fp8({}, dw, {}, out, x, w, false, c, r));
  ASSERT_NO_THROW(linear_backward_fp8(dx, {}, {}, out, x, w, false, c, r));
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_GT(tight->high_water(), tight->capacity() / 2) << "the stated bytes are far above what the calls borrow";
  }
}

// Per-group scales: cuBLASLt's outer-vector and block-scaled GEMMs against the host path on the
// same FP8 bytes and scales (the host dequantizes each element with its own group's scale), for
// every pairing cuBLASLt serves; the scales are random powers of two so that a scale read from
// the wrong group (a layout error) moves the result by O(1).
TEST_F(Fp8GemmTest, GroupScaledProductsMatchTheHostPath) {
  using G = Fp8Granularity;
  const int64_t M = 384, N = 640, K = 384;  // block counts 3, 5, 3: none a multiple of 4 (the padded layout)
  std::mt19937 rng(11);
  for (const auto& [ga, gb, fast] : {std::tuple{G::Row, G::Row, false}, std::tuple{G::Row, G::Row, true},
                                     std::tuple{G::Block1x128, G::Block1x128, false},
                                     std::tuple{G::Block1x128, G::Block128x128, false},
                                     std::tuple{G::Block128x128, G::Block1x128, false}}) {
    SCOPED_TRACE(fmt::format("A {} B {} fast {}", fp8_granularity_name(ga), fp8_granularity_name(gb), fast));
    TensorView a = make(DType::F8E4M3, {M, K}), bt = make(DType::F8E4M3, {N, K}), d = make(DType::BF16, {M, N});
    auto av = random_tensor(a, 4.0f), bv = random_tensor(bt, 4.0f);
    const int64_t na = fp8_scale_numel(ga, M, K), nb = fp8_scale_numel(gb, N, K);
    std::vector<float> sa(static_cast<size_t>(na)), sb(static_cast<size_t>(nb));
    for (auto& x : sa) x = std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);
    for (auto& x : sb) x = std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);
    TensorView dsa = make(DType::F32, {na}), dsb = make(DType::F32, {nb});
    put(dsa, sa);
    put(dsb, sb);
    GemmArgs g;
    g.a = a;
    g.b = bt.transposed();
    g.d = d;
    g.a_scale = dsa;
    g.b_scale = dsb;
    g.a_scaling = ga;
    g.b_scaling = gb;
    g.fp8_fast_accum = fast;
    poison(d);
    ASSERT_EQ(gemm(g), BackendType::CUBLASLT);
    std::vector<double> ref(static_cast<size_t>(M * N), 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0.0;
        for (int64_t k = 0; k < K; ++k)
          s += double(av[i * K + k]) * sa[fp8_scale_index(ga, M, K, i, k)] * bv[j * K + k] * sb[fp8_scale_index(gb, N, K, j, k)];
        ref[i * N + j] = s;
      }
    EXPECT_LT(rel_err(get(d), ref), 1e-2);
  }
}

}  // namespace
}  // namespace primus::turbo::testing
