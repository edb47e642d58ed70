// The public ops on host tensors: the CPU backend of gemm (every layout and epilogue against a
// plain double product) and the dispatch of a device-default op to CPU for host tensors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/optimizer.h"

namespace primus::turbo {
namespace {

struct HostMat {
  std::vector<float> stored;
  TensorView view;  // logical [r, c]
  std::vector<float> logical;
};

class OpsHost : public ::testing::Test {
 protected:
  void SetUp() override {
    rng.seed(std::random_device{}());
    GlobalBackendManager::instance().reset();
    GlobalBackendManager::instance().set_warning_sink([this](const std::string& w) { warnings.push_back(w); });
  }
  void TearDown() override {
    GlobalBackendManager::instance().set_warning_sink(nullptr);
    GlobalBackendManager::instance().reset();
  }
  std::vector<float> randn(int64_t n) {
    std::normal_distribution<float> d;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
  }
  HostMat mat(int64_t r, int64_t c, bool col_major) {
    HostMat m;
    m.logical = randn(r * c);
    m.stored.resize(m.logical.size());
    if (!col_major) {
      m.stored = m.logical;
      m.view = TensorView(m.stored.data(), DType::F32, Device::CPU, {r, c});
    } else {
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) m.stored[j * r + i] = m.logical[i * c + j];
      m.view = TensorView(m.stored.data(), DType::F32, Device::CPU, {c, r}).transposed();
    }
    return m;
  }
  std::mt19937 rng;
  std::vector<std::string> warnings;
};

double rel(const std::vector<float>& got, const std::vector<double>& ref) {
  double n = 0, d = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    n += (got[i] - ref[i]) * (got[i] - ref[i]);
    d += ref[i] * ref[i];
  }
  return std::sqrt(n / d);
}

TEST_F(OpsHost, GemmCpuBackendAllLayoutsBiasAndBiasGrads) {
  const int64_t M = 23, N = 17, K = 31;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      HostMat a = mat(M, K, ta), b = mat(K, N, tb);
      std::vector<float> d(static_cast<size_t>(M * N), NAN), bias = randn(N);
      std::vector<double> ref(static_cast<size_t>(M * N), 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          for (int64_t k = 0; k < K; ++k) ref[i * N + j] += double(a.logical[i * K + k]) * b.logical[k * N + j];
          ref[i * N + j] += bias[j];
        }
      GemmArgs g;
      g.a = a.view;
      g.b = b.view;
      g.d = TensorView(d.data(), DType::F32, Device::CPU, {M, N});
      g.epilogue = GemmEpilogue::Bias;
      g.bias = TensorView(bias.data(), DType::F32, Device::CPU, {N});
      EXPECT_EQ(gemm(g), BackendType::CPU);
      EXPECT_LT(rel(d, ref), 1e-5) << "ta=" << ta << " tb=" << tb;

      std::vector<float> ga(static_cast<size_t>(M)), gb(static_cast<size_t>(N));
      g.epilogue = GemmEpilogue::BGradA;
      g.bias = TensorView(ga.data(), DType::F32, Device::CPU, {M});
      gemm(g);
      g.epilogue = GemmEpilogue::BGradB;
      g.bias = TensorView(gb.data(), DType::F32, Device::CPU, {N});
      gemm(g);
      std::vector<double> ra(static_cast<size_t>(M), 0.0), rb(static_cast<size_t>(N), 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) ra[i] += a.logical[i * K + k];
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < N; ++j) rb[j] += b.logical[k * N + j];
      EXPECT_LT(rel(ga, ra), 1e-5);
      EXPECT_LT(rel(gb, rb), 1e-5);
    }
}

TEST_F(OpsHost, LinearBackwardAccumulatesParameterGradients) {
  const int64_t N = 9, C = 12, OC = 7;
  auto x = randn(N * C), w = randn(OC * C), dout = randn(N * OC);
  auto dw = randn(OC * C), db = randn(OC);
  std::vector<float> dx(static_cast<size_t>(N * C), NAN);
  auto dw0 = dw, db0 = db;
  auto T = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView(v.data(), DType::F32, Device::CPU, s);
  };
  linear_backward(T(dx, {N, C}), T(dw, {OC, C}), T(db, {OC}), T(dout, {N, OC}), T(x, {N, C}), T(w, {OC, C}), false, {});
  std::vector<double> rdx(dx.size(), 0.0), rdw(dw0.begin(), dw0.end()), rdb(db0.begin(), db0.end());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      rdb[o] += dout[n * OC + o];
      for (int64_t c = 0; c < C; ++c) {
        rdx[n * C + c] += double(dout[n * OC + o]) * w[o * C + c];
        rdw[o * C + c] += double(dout[n * OC + o]) * x[n * C + c];
      }
    }
  EXPECT_LT(rel(dx, rdx), 1e-5);
  EXPECT_LT(rel(dw, rdw), 1e-5);
  EXPECT_LT(rel(db, rdb), 1e-5);
}

// The weight and bias gradients from one GEMM over an input with a column of ones after its C
// columns: += and = (first micro-batch) forms, against double sums; shapes that do not fit throw.
TEST_F(OpsHost, WeightGradOnesGivesWeightAndBiasGradients) {
  const int64_t N = 11, C = 12, Cp = 16, OC = 5;
  for (bool acc : {true, false}) {
    auto x = randn(N * Cp), dout = randn(N * OC), dw = randn(OC * C), db = randn(OC);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = C; c < Cp; ++c) x[n * Cp + c] = c == C ? 1.0f : 0.0f;
    const auto dw0 = dw, db0 = db;
    auto T = [](std::vector<float>& v, std::initializer_list<int64_t> s) { return TensorView(v.data(), DType::F32, Device::CPU, s); };
    linear_backward_weight_ones(T(dw, {OC, C}), T(db, {OC}), T(dout, {N, OC}), T(x, {N, Cp}), {}, acc);
    std::vector<double> rdw(dw.size(), 0.0), rdb(db0.begin(), db0.end());
    if (acc) rdw.assign(dw0.begin(), dw0.end());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        rdb[o] += dout[n * OC + o];
        for (int64_t c = 0; c < C; ++c) rdw[o * C + c] += double(dout[n * OC + o]) * x[n * Cp + c];
      }
    EXPECT_LT(rel(dw, rdw), 1e-5) << "acc " << acc;
    EXPECT_LT(rel(db, rdb), 1e-5) << "acc " << acc;
    std::vector<float> narrow(N * C);
    EXPECT_THROW(linear_backward_weight_ones(T(dw, {OC, C}), T(db, {OC}), T(dout, {N, OC}), T(narrow, {N, C}), {}, acc),
                 RuntimeError) << "an input without a column after C was accepted";
  }
}

// norm_forward into padded rows: the values of a dense output, the padding untouched.
TEST_F(OpsHost, NormForwardWritesPaddedRows) {
  const int64_t N = 6, C = 8, Cp = 12;
  auto x = randn(N * C), w = randn(C), b = randn(C);
  std::vector<float> dense(N * C), padded(N * Cp, 7.0f), mean(N), rstd(N);
  NormForwardArgs f;
  f.inp = TensorView(x.data(), DType::F32, Device::CPU, {N, C});
  f.weight = TensorView(w.data(), DType::F32, Device::CPU, {C});
  f.bias = TensorView(b.data(), DType::F32, Device::CPU, {C});
  f.mean = TensorView(mean.data(), DType::F32, Device::CPU, {N});
  f.rstd = TensorView(rstd.data(), DType::F32, Device::CPU, {N});
  f.out = TensorView(dense.data(), DType::F32, Device::CPU, {N, C});
  norm_forward(f);
  f.out = TensorView(padded.data(), DType::F32, Device::CPU, {N, C});
  f.out.strides = {Cp, 1};
  norm_forward(f);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(padded[n * Cp + c], dense[n * C + c]) << n << "," << c;
    for (int64_t c = C; c < Cp; ++c) EXPECT_EQ(padded[n * Cp + c], 7.0f) << "padding written at " << n << "," << c;
  }
}

TEST_F(OpsHost, BiasGradAccumulatesColumnSumsOfStridedRows) {
  const int64_t N = 37, C = 24, ld = 40;  // rows 40 apart: a view of columns [8, 32) of a wider buffer
  auto buf = randn(N * ld), db = randn(C);
  const std::vector<float> db0 = db;
  TensorView dout(buf.data() + 8, DType::F32, Device::CPU, {N, C});
  dout.strides[0] = ld;
  bias_grad(TensorView(db.data(), DType::F32, Device::CPU, {C}), dout, {});
  for (int64_t c = 0; c < C; ++c) {
    double ref = db0[c];
    for (int64_t n = 0; n < N; ++n) ref += buf[n * ld + 8 + c];
    EXPECT_NEAR(db[c], ref, 1e-5 * (1.0 + std::abs(ref))) << "column " << c;
  }
  // Shapes that do not fit are refused with the op's name.
  std::vector<float> small(C - 1);
  try {
    bias_grad(TensorView(small.data(), DType::F32, Device::CPU, {C - 1}), dout, {});
    FAIL() << "a dbias of the wrong size was accepted";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("bias_grad"), std::string::npos) << e.what();
  }
}

TEST_F(OpsHost, HostTensorsFallBackToCpuWithOneWarning) {
  const int64_t N = 5, C = 16;
  auto x = randn(N * C), w = randn(C), b = randn(C);
  std::vector<float> out(x.size()), mean(N), rstd(N), rout(x.size()), rmean(N), rrstd(N);
  NormForwardArgs f;
  f.out = TensorView(out.data(), DType::F32, Device::CPU, {N, C});
  f.mean = TensorView(mean.data(), DType::F32, Device::CPU, {N});
  f.rstd = TensorView(rstd.data(), DType::F32, Device::CPU, {N});
  f.inp = TensorView(x.data(), DType::F32, Device::CPU, {N, C});
  f.weight = TensorView(w.data(), DType::F32, Device::CPU, {C});
  f.bias = TensorView(b.data(), DType::F32, Device::CPU, {C});
  EXPECT_EQ(norm_forward(f), BackendType::CPU);
  EXPECT_EQ(norm_forward(f), BackendType::CPU);
  cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5);
  EXPECT_EQ(out, rout);
  if (turbo_has_cuda()) {
    ASSERT_EQ(warnings.size(), 1u) << "the fallback from TURBO to CPU warns once";
    EXPECT_NE(warnings[0].find("falling back to CPU"), std::string::npos) << warnings[0];
  } else {
    EXPECT_TRUE(warnings.empty()) << "a CPU-only build has CPU as the default";
  }
  // Forcing the device backend on host tensors is an error, not a fallback.
  if (turbo_has_cuda()) {
    GlobalBackendManager::instance().set_backend("norm", BackendType::TURBO);
    EXPECT_THROW(norm_forward(f), RuntimeError);
  }
}

TEST_F(OpsHost, ShapeErrorsNameOpAndTensor) {
  std::vector<float> x(16), w(3), out(16), rstd(4);
  NormForwardArgs f;
  f.type = NormType::RMSNorm;
  f.out = TensorView(out.data(), DType::F32, Device::CPU, {4, 4});
  f.rstd = TensorView(rstd.data(), DType::F32, Device::CPU, {4});
  f.inp = TensorView(x.data(), DType::F32, Device::CPU, {4, 4});
  f.weight = TensorView(w.data(), DType::F32, Device::CPU, {3});
  try {
    norm_forward(f);
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("norm_forward: weight: expected shape [4]"), std::string::npos) << e.what();
  }
}

// norm_backward on host tensors with dinp_colsum: the CPU backend adds the column sums of the
// final dinp (after its accumulate) onto a nonzero dinp_colsum; LayerNorm and RMSNorm, with and
// without accumulate_dinp; and the argument checks of dinp_colsum.
TEST_F(OpsHost, NormBackwardDinpColumnSumsOnTheCpu) {
  const int64_t N = 7, C = 12;
  for (NormType type : {NormType::LayerNorm, NormType::RMSNorm})
    for (bool acc : {true, false}) {
      SCOPED_TRACE(std::string(type == NormType::LayerNorm ? "layernorm" : "rmsnorm") + (acc ? " acc" : " set"));
      const bool ln = type == NormType::LayerNorm;
      auto x = randn(N * C), w = randn(C), dout = randn(N * C), dinp = randn(N * C), cs = randn(C);
      std::vector<float> mean(N), rstd(N), out(N * C), dw(C, 0.5f), db(C, -0.5f);
      if (ln) cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), w.data(), N, C, 1e-5);
      else cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5);
      // Reference: the kernel's own dinp (accumulated or from zero), then its column sums.
      std::vector<float> rdinp = acc ? dinp : std::vector<float>(dinp.size(), 0.0f), rdw = dw, rdb = db;
      if (ln)
        cpu::layernorm_backward(rdinp.data(), rdw.data(), rdb.data(), dout.data(), x.data(), w.data(), mean.data(),
                                rstd.data(), N, C);
      else
        cpu::rmsnorm_backward(rdinp.data(), rdw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
      std::vector<double> rcs(cs.begin(), cs.end());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) rcs[c] += rdinp[n * C + c];

      NormBackwardArgs b;
      b.type = type;
      b.dinp = TensorView(dinp.data(), DType::F32, Device::CPU, {N, C});
      b.dweight = TensorView(dw.data(), DType::F32, Device::CPU, {C});
      if (ln) b.dbias = TensorView(db.data(), DType::F32, Device::CPU, {C});
      b.dinp_colsum = TensorView(cs.data(), DType::F32, Device::CPU, {C});
      b.dout = TensorView(dout.data(), DType::F32, Device::CPU, {N, C});
      b.inp = TensorView(x.data(), DType::F32, Device::CPU, {N, C});
      b.weight = TensorView(w.data(), DType::F32, Device::CPU, {C});
      if (ln) b.mean = TensorView(mean.data(), DType::F32, Device::CPU, {N});
      b.rstd = TensorView(rstd.data(), DType::F32, Device::CPU, {N});
      b.accumulate_dinp = acc;
      EXPECT_EQ(norm_backward(b), BackendType::CPU);
      EXPECT_EQ(dinp, rdinp);
      EXPECT_EQ(dw, rdw);
      // Added to, not overwritten: the (normal, nonzero) initial values are part of the reference.
      for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(cs[c], rcs[c], 1e-5 * (1.0 + std::abs(rcs[c]))) << "column " << c;
      EXPECT_NE(b.key().find("colsum=1"), std::string::npos) << b.key();
      // Without dinp_colsum nothing else changes (and the key says so).
      b.dinp_colsum = {};
      EXPECT_NE(b.key().find("colsum=0"), std::string::npos) << b.key();
    }
}

TEST_F(OpsHost, NormBackwardDinpColumnSumsArgumentChecks) {
  const int64_t N = 3, C = 8;
  std::vector<float> x(N * C, 1.0f), w(C, 1.0f), dout(N * C), dinp(N * C), dw(C), rstd(N, 1.0f), cs(C + 1);
  std::vector<uint16_t> cs16(C);
  NormBackwardArgs b;
  b.type = NormType::RMSNorm;
  b.dinp = TensorView(dinp.data(), DType::F32, Device::CPU, {N, C});
  b.dweight = TensorView(dw.data(), DType::F32, Device::CPU, {C});
  b.dout = TensorView(dout.data(), DType::F32, Device::CPU, {N, C});
  b.inp = TensorView(x.data(), DType::F32, Device::CPU, {N, C});
  b.weight = TensorView(w.data(), DType::F32, Device::CPU, {C});
  b.rstd = TensorView(rstd.data(), DType::F32, Device::CPU, {N});
  auto expect_error = [&](const char* want) {
    try {
      norm_backward(b);
      ADD_FAILURE() << "accepted; wanted an error naming " << want;
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  b.dinp_colsum = TensorView(cs.data(), DType::F32, Device::CPU, {C + 1});
  expect_error("dinp_colsum");
  b.dinp_colsum = TensorView(cs16.data(), DType::BF16, Device::CPU, {C});
  expect_error("dinp_colsum");
  b.dinp_colsum = TensorView(cs.data(), DType::F32, Device::CUDA, {C});  // never dereferenced: refused first
  expect_error("norm_backward");
  b.dinp_colsum = TensorView(cs.data(), DType::F32, Device::CPU, {C});
  EXPECT_EQ(norm_backward(b), BackendType::CPU);
}

// A split fp32 value (turbo/core/dtype.h) joins back to its exact bits for every low half (all
// 65536, both signs, across exponents, zero, the smallest subnormal and the largest finite
// value), and its high half is the value rounded to nearest bf16: equal to round-to-nearest-even
// except in an exact tie whose truncation is even, where it rounds away from zero instead.
TEST(SplitF32, JoinsBackExactlyAndRoundsTiesAwayFromZero) {
  auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; };
  auto from = [](uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; };
  int64_t ties_away = 0;
  for (uint32_t hi : {0x0000u, 0x0001u, 0x3f80u, 0x3f81u, 0x4049u, 0x7f7eu, 0x7f7fu, 0x8000u, 0xbf80u, 0xbf81u, 0xff7fu}) {
    for (uint32_t low = 0; low < 0x10000u; ++low) {
      const uint32_t u = (hi << 16) | low;
      const float f = from(u);
      ASSERT_EQ(bits(join_f32(split_f32_hi(f), split_f32_lo(f))), u) << std::hex << u;
      const uint16_t rne = float_to_bf16_bits(f), h = split_f32_hi(f);
      const bool tie_even = low == 0x8000u && (hi & 1u) == 0;
      if (tie_even) {
        ++ties_away;
        ASSERT_EQ(h, static_cast<uint16_t>(hi + 1)) << std::hex << u;
        ASSERT_EQ(rne, static_cast<uint16_t>(hi)) << std::hex << u;
      } else {
        ASSERT_EQ(h, rne) << std::hex << u;
      }
    }
  }
  EXPECT_EQ(ties_away, 5);
  for (float f : {0.0f, -0.0f, 1.0f, -3.5f, 1e-45f, 3.4028235e38f, -3.4028235e38f})
    EXPECT_EQ(bits(join_f32(split_f32_hi(f), split_f32_lo(f))), bits(f)) << f;
}

// AdamW over split masters on the CPU backend: the joined masters, m and v after three steps are
// the bits of the same update over f32 masters; the model copy is the masters' high halves; a
// vetoed step writes nothing; a split table without its model copy is refused.
TEST_F(OpsHost, AdamWOverSplitMastersGivesTheF32MastersBits) {
  const std::vector<int64_t> sizes = {1000, 7, 4099};
  std::vector<std::vector<float>> f32_p, f32_m, f32_v, s_m, s_v, grads;
  std::vector<std::vector<uint16_t>> hi, lo, f32_model;
  for (int64_t n : sizes) {
    std::vector<float> p = randn(n);
    // Exact ties among them: the low half 0x8000 under an even and an odd high half.
    for (int64_t i = 0; i < n; i += 97) {
      uint32_t u;
      std::memcpy(&u, &p[size_t(i)], 4);
      u = (u & 0xffff0000u) | 0x8000u;
      std::memcpy(&p[size_t(i)], &u, 4);
    }
    std::vector<float> v = randn(n);
    for (auto& x : v) x = 0.01f * x * x;
    f32_p.push_back(p), f32_m.push_back(randn(n)), f32_v.push_back(v), grads.push_back(randn(n));
    s_m.push_back(f32_m.back()), s_v.push_back(v);
    hi.emplace_back(), lo.emplace_back(), f32_model.emplace_back(size_t(n));
    for (float x : p) hi.back().push_back(split_f32_hi(x)), lo.back().push_back(split_f32_lo(x));
  }
  std::vector<AdamWTensor> f32s, splits;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    auto view = [n](auto& v, DType t) { return TensorView(v.data(), t, Device::CPU, {n}); };
    f32s.push_back({view(f32_p[i], DType::F32), view(f32_model[i], DType::BF16), view(grads[i], DType::F32),
                    view(f32_m[i], DType::F32), view(f32_v[i], DType::F32), i != 1});
    splits.push_back({view(lo[i], DType::U16), view(hi[i], DType::BF16), view(grads[i], DType::F32),
                      view(s_m[i], DType::F32), view(s_v[i], DType::F32), i != 1});
  }
  MultiTensorAdamW of(f32s, nullptr), os(splits, nullptr);
  EXPECT_FALSE(of.split_master());
  EXPECT_TRUE(os.split_master());
  AdamWHyper hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    hp.step = step;
    EXPECT_EQ(of.step(hp, {}, {}, {}), BackendType::CPU);
    EXPECT_EQ(os.step(hp, {}, {}, {}), BackendType::CPU);
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (size_t i = 0; i < f32_p[t].size(); ++i) {
      const float joined = join_f32(hi[t][i], lo[t][i]);
      ASSERT_EQ(std::memcmp(&joined, &f32_p[t][i], 4), 0) << "tensor " << t << " element " << i;
      ASSERT_EQ(hi[t][i], split_f32_hi(f32_p[t][i]));
      ASSERT_EQ(std::memcmp(&s_m[t][i], &f32_m[t][i], 4), 0);
      ASSERT_EQ(std::memcmp(&s_v[t][i], &f32_v[t][i], 4), 0);
    }
  }
  std::vector<float> nan_scale = {std::nanf("")};
  const std::vector<uint16_t> before = lo[0];
  os.step(hp, TensorView(nan_scale.data(), DType::F32, Device::CPU, {1}), {}, {});
  EXPECT_EQ(lo[0], before) << "a vetoed step writes nothing";
  std::vector<AdamWTensor> no_model = splits;
  no_model[1].model = TensorView();
  EXPECT_THROW(MultiTensorAdamW(no_model, nullptr), RuntimeError);
  std::vector<AdamWTensor> mixed = {f32s[0], splits[1]};
  EXPECT_THROW(MultiTensorAdamW(mixed, nullptr), RuntimeError);
}

// AdamW with bf16 moments on the CPU backend: the bf16 views hold exactly what the kernel's
// stochastically rounded f32 moments are (turbo/kernels/cpu/optimizer.h, keyed by each tensor's
// sr_key), the weights the same; f16 moments, moments of mixed dtypes and negative keys are refused.
TEST_F(OpsHost, AdamWOverBf16MomentsHoldsTheKernelsRoundedValues) {
  const std::vector<int64_t> sizes = {1000, 7, 4099};
  const std::vector<int64_t> keys = {0, 1000, 1 << 20};
  std::vector<std::vector<float>> p, g, m, v, rp, rm, rv;
  std::vector<std::vector<uint16_t>> m16, v16;
  for (int64_t n : sizes) {
    p.push_back(randn(n)), g.push_back(randn(n)), m.push_back(randn(n)), v.push_back(randn(n));
    for (auto& x : v.back()) x = 0.01f * x * x;
    m16.emplace_back(), v16.emplace_back();
    for (auto& x : m.back()) x = bf16_bits_to_float(float_to_bf16_bits(0.1f * x)), m16.back().push_back(float_to_bf16_bits(x));
    for (auto& x : v.back()) x = bf16_bits_to_float(float_to_bf16_bits(x)), v16.back().push_back(float_to_bf16_bits(x));
    rp.push_back(p.back()), rm.push_back(m.back()), rv.push_back(v.back());
  }
  std::vector<AdamWTensor> ts;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    auto view = [n](auto& x, DType t) { return TensorView(x.data(), t, Device::CPU, {n}); };
    ts.push_back({view(p[i], DType::F32), {}, view(g[i], DType::F32), view(m16[i], DType::BF16),
                  view(v16[i], DType::BF16), i != 1, keys[i]});
  }
  MultiTensorAdamW opt(ts, nullptr);
  EXPECT_EQ(opt.m_dtype(), DType::BF16);
  EXPECT_EQ(opt.v_dtype(), DType::BF16);
  AdamWHyper hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    hp.step = step;
    EXPECT_EQ(opt.step(hp, {}, {}, {}), BackendType::CPU);
    for (size_t i = 0; i < sizes.size(); ++i) {
      cpu::AdamWParams k;
      k.lr = hp.lr, k.beta1 = hp.beta1, k.beta2 = hp.beta2, k.eps = hp.eps, k.step = step;
      k.weight_decay = i != 1 ? hp.weight_decay : 0.0;
      k.m_bf16 = k.v_bf16 = true;
      k.sr_key = keys[i];
      cpu::adamw_update(rp[i].data(), g[i].data(), rm[i].data(), rv[i].data(), sizes[i], k);
    }
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (size_t i = 0; i < p[t].size(); ++i) {
      ASSERT_EQ(std::memcmp(&p[t][i], &rp[t][i], 4), 0) << "tensor " << t << " element " << i;
      ASSERT_EQ(bf16_bits_to_float(m16[t][i]), rm[t][i]) << "tensor " << t << " element " << i;
      ASSERT_EQ(bf16_bits_to_float(v16[t][i]), rv[t][i]) << "tensor " << t << " element " << i;
    }
  }
  std::vector<uint16_t> h16(1000);
  std::vector<AdamWTensor> bad = ts;
  bad[0].m = TensorView(h16.data(), DType::F16, Device::CPU, {1000});
  EXPECT_THROW(MultiTensorAdamW(bad, nullptr), RuntimeError);
  bad = ts;
  bad[2].v = TensorView(rv[2].data(), DType::F32, Device::CPU, {4099});  // v f32 beside bf16 ones
  EXPECT_THROW(MultiTensorAdamW(bad, nullptr), RuntimeError);
  bad = ts;
  bad[1].sr_key = -1;
  EXPECT_THROW(MultiTensorAdamW(bad, nullptr), RuntimeError);
}

}  // namespace
}  // namespace primus::turbo
