// GEMM on the device (CUBLASLT and TURBO backends) against a double-precision host product and
// against the CPU reference kernels (matmul_forward/backward) for the linear-layer helpers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

#include "gpu_fixture.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/kernels/cublaslt/algo_cache.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"
#include "turbo/kernels/cuda/gemm_sm90.h"
#include "turbo/ops/cast.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/normalization.h"

namespace primus::turbo::testing {
namespace {

struct Mat {
  TensorView view;            // logical [rows, cols] (maybe a transposed view)
  std::vector<float> values;  // logical row-major values
};

class GemmTest : public GpuTest {
 protected:
  // A logical [r, c] operand stored row-major, or column-major (stored [c, r], viewed transposed).
  Mat operand(DType dt, int64_t r, int64_t c, bool col_major, float scale = 1.0f) {
    Mat m;
    m.values = randn(r * c, scale, dt);
    if (!col_major) {
      m.view = make(dt, {r, c});
      put(m.view, m.values);
    } else {
      TensorView stored = make(dt, {c, r});
      std::vector<float> t(m.values.size());
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) t[j * r + i] = m.values[i * c + j];
      put(stored, t);
      m.view = stored.transposed();
    }
    return m;
  }
  static std::vector<double> product(const std::vector<float>& a, const std::vector<float>& b, int64_t M,
                                     int64_t N, int64_t K) {
    std::vector<double> d(static_cast<size_t>(M * N), 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const double aik = a[i * K + k];
        for (int64_t j = 0; j < N; ++j) d[i * N + j] += aik * b[k * N + j];
      }
    return d;
  }
  // `stored` ([M, LD] f32) held s0 and received D [M, N] (its first N columns) += prod: D matches
  // s0 + prod at `tol` and the gap columns N..LD-1 are untouched.
  void expect_accumulated_once(const TensorView& stored, const std::vector<float>& s0, const std::vector<double>& prod,
                               int64_t M, int64_t N, int64_t LD, double tol) {
    const auto got = get(stored);
    std::vector<float> got_d(size_t(M * N)), want(size_t(M * N));
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        got_d[i * N + j] = got[i * LD + j];
        want[i * N + j] = float(s0[i * LD + j] + prod[i * N + j]);
      }
      for (int64_t j = N; j < LD; ++j) ASSERT_EQ(got[i * LD + j], s0[i * LD + j]) << "gap element " << i << "," << j;
    }
    EXPECT_LT(rel_err(got_d, want), tol) << "accumulated more or less than once";
  }
};

GemmArgs args(const TensorView& a, const TensorView& b, const TensorView& d) {
  GemmArgs g;
  g.a = a;
  g.b = b;
  g.d = d;
  return g;
}

struct Types {
  DType in, out;
};

TEST_F(GemmTest, AllTranspositionsAndTypesMatchDoubleProduct) {
  const int64_t M = 136, N = 200, K = 264;  // not powers of two; multiples of 8 for 16-bit types
  for (Types ty : {Types{DType::BF16, DType::BF16}, Types{DType::BF16, DType::F32}, Types{DType::F16, DType::F16},
                   Types{DType::F32, DType::F32}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        SCOPED_TRACE(fmt::format("{}->{} ta={} tb={}", dtype_name(ty.in), dtype_name(ty.out), ta, tb));
        Mat a = operand(ty.in, M, K, ta), b = operand(ty.in, K, N, tb);
        TensorView d = make(ty.out, {M, N});
        poison(d);
        GemmArgs g;
        g.a = a.view;
        g.b = b.view;
        g.d = d;
        g.ctx = ctx;
        EXPECT_EQ(gemm(g), BackendType::CUBLASLT);
        const double err = rel_err(get(d), product(a.values, b.values, M, N, K));
        EXPECT_LT(err, gate(ty.out == DType::F32 && ty.in == DType::F32 ? DType::F32 : DType::BF16));
        if (ty.in == DType::F32) {
          EXPECT_LT(err, 1e-5) << "fp32 must not silently run as TF32";
        }
      }
  }
}

TEST_F(GemmTest, AlphaBetaAccumulate) {
  const int64_t M = 64, N = 96, K = 128;
  Mat a = operand(DType::BF16, M, K, false), b = operand(DType::BF16, K, N, true);
  TensorView d = make(DType::F32, {M, N});
  auto d0 = random_tensor(d);
  GemmArgs g = args(a.view, b.view, d);
  g.alpha = 0.5f;
  g.beta = 1.0f;
  g.ctx = ctx;
  gemm(g);
  auto ref = product(a.values, b.values, M, N, K);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = 0.5 * ref[i] + d0[i];
  EXPECT_LT(rel_err(get(d), ref), 1e-3);
}

TEST_F(GemmTest, StridedBatchedWithBroadcastB) {
  const int64_t B = 3, M = 72, N = 40, K = 56;
  TensorView a = make(DType::BF16, {B, M, K});
  auto av = random_tensor(a);
  Mat b = operand(DType::BF16, K, N, false);  // one B for every batch entry
  TensorView d = make(DType::BF16, {B, M, N});
  poison(d);
  GemmArgs g = args(a, b.view, d);
  g.ctx = ctx;
  gemm(g);
  auto got = get(d);
  for (int64_t i = 0; i < B; ++i) {
    std::vector<float> ai(av.begin() + i * M * K, av.begin() + (i + 1) * M * K);
    std::vector<float> gi(got.begin() + i * M * N, got.begin() + (i + 1) * M * N);
    EXPECT_LT(rel_err(gi, product(ai, b.values, M, N, K)), 1e-2) << "batch " << i;
  }
}

TEST_F(GemmTest, BiasAndGeluAuxEpiloguesMatchReferenceGelu) {
  const int64_t M = 128, N = 192, K = 96;
  Mat a = operand(DType::BF16, M, K, false), b = operand(DType::BF16, K, N, true, 0.2f);
  TensorView bias = make(DType::BF16, {N});
  auto bv = random_tensor(bias);
  auto pre = product(a.values, b.values, M, N, K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) pre[i * N + j] += bv[j];
  std::vector<float> pre_f(pre.begin(), pre.end()), gelu_ref(pre.size());
  cpu::gelu_forward(gelu_ref.data(), pre_f.data(), static_cast<int64_t>(pre_f.size()));

  TensorView d = make(DType::BF16, {M, N}), aux = make(DType::BF16, {M, N});
  poison(d);
  poison(aux);
  GemmArgs g = args(a.view, b.view, d);
  g.epilogue = GemmEpilogue::GeluAuxBias;
  g.bias = bias;
  g.aux = aux;
  g.ctx = ctx;
  gemm(g);
  EXPECT_LT(rel_err(get(aux), pre), 1e-2);
  EXPECT_LT(rel_err(get(d), gelu_ref), 1e-2) << "cuBLASLt's GELU must be the tanh form";

  g.epilogue = GemmEpilogue::Bias;
  g.aux = {};
  poison(d);
  gemm(g);
  EXPECT_LT(rel_err(get(d), pre), 1e-2);
}

TEST_F(GemmTest, DGeluWithBiasGradMatchesReference) {
  const int64_t M = 128, N = 160, K = 64;
  Mat a = operand(DType::BF16, M, K, false), b = operand(DType::BF16, K, N, false);
  TensorView aux = make(DType::BF16, {M, N}), d = make(DType::BF16, {M, N}), dbias = make(DType::BF16, {N});
  auto auxv = random_tensor(aux);
  poison(d);
  poison(dbias);
  GemmArgs g = args(a.view, b.view, d);
  g.epilogue = GemmEpilogue::DGeluBGrad;
  g.aux = aux;
  g.bias = dbias;
  g.ctx = ctx;
  gemm(g);
  auto prod = product(a.values, b.values, M, N, K);
  std::vector<float> prod_f(prod.begin(), prod.end()), ref(prod.size(), 0.0f);
  cpu::gelu_backward(ref.data(), auxv.data(), prod_f.data(), static_cast<int64_t>(ref.size()));
  EXPECT_LT(rel_err(get(d), ref), 1e-2);
  std::vector<double> colsum(static_cast<size_t>(N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) colsum[j] += ref[i * N + j];
  EXPECT_LT(rel_err(get(dbias), colsum), 1e-2);
}

TEST_F(GemmTest, LinearForwardBackwardMatchCpuMatmul) {
  const int64_t N = 256, C = 192, OC = 320;
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), bias = make(DType::BF16, {OC});
  auto xv = random_tensor(x), wv = random_tensor(w, 0.1f), bv = random_tensor(bias);
  TensorView out = make(DType::BF16, {N, OC});
  poison(out);
  EXPECT_EQ(linear_forward(out, x, w, bias, {}, ctx), BackendType::CUBLASLT);
  std::vector<float> ref(static_cast<size_t>(N * OC));
  cpu::matmul_forward(ref.data(), xv.data(), wv.data(), bv.data(), N, C, OC);
  EXPECT_LT(rel_err(get(out), ref), 1e-2);

  // Backward: fp32 parameter gradients accumulate onto what is there; dinp overwritten.
  TensorView dout = make(DType::BF16, {N, OC}), dx = make(DType::BF16, {N, C});
  TensorView dw = make(DType::F32, {OC, C}), db = make(DType::F32, {OC});
  auto doutv = random_tensor(dout);
  auto dw0 = random_tensor(dw), db0 = random_tensor(db);
  poison(dx);
  linear_backward(dx, dw, db, dout, x, w, false, ctx);
  std::vector<float> rdx(static_cast<size_t>(N * C), 0.0f), rdw = dw0, rdb = db0;
  cpu::matmul_backward(rdx.data(), rdw.data(), rdb.data(), doutv.data(), xv.data(), wv.data(), N, C, OC);
  EXPECT_LT(rel_err(get(dx), rdx), 1e-2);
  EXPECT_LT(rel_err(get(dw), rdw), 1e-3);
  EXPECT_LT(rel_err(get(db), rdb), 1e-3);
}

// bias_grad: column sums of bf16 and f32 matrices (dense, row-strided, unaligned: every kernel
// variant, N around and below the chunk size), accumulated onto a nonzero dbias, bit-identical
// on a second run (fixed-order partials).
TEST_F(GemmTest, BiasGradMatchesHostColumnSumsAndIsDeterministic) {
  struct Case { DType dt; int64_t N, C, ld, col0; };
  for (const Case& k : {Case{DType::BF16, 16384, 768, 768, 0}, Case{DType::BF16, 4099, 2304, 2304, 0},
                        Case{DType::BF16, 1000, 3072, 3080, 8}, Case{DType::BF16, 77, 100, 103, 3},
                        Case{DType::BF16, 1, 24, 24, 0}, Case{DType::F32, 3001, 768, 772, 4},
                        Case{DType::F32, 130, 36, 37, 1}}) {
    SCOPED_TRACE(::testing::Message() << dtype_name(k.dt) << " N=" << k.N << " C=" << k.C << " ld=" << k.ld);
    TensorView buf = make(k.dt, {k.N, k.ld});
    auto bufv = random_tensor(buf);
    TensorView dout = buf;
    dout.data = static_cast<char*>(buf.data) + k.col0 * dtype_size(k.dt);
    dout.shape[1] = k.C;
    TensorView db = make(DType::F32, {k.C});
    auto db0 = random_tensor(db);
    bias_grad(db, dout, ctx);
    auto got = get(db);
    std::vector<double> ref(db0.begin(), db0.end());
    for (int64_t n = 0; n < k.N; ++n)
      for (int64_t c = 0; c < k.C; ++c) ref[c] += bufv[n * k.ld + k.col0 + c];
    EXPECT_LT(rel_err(got, ref), 1e-5);
    put(db, db0);
    bias_grad(db, dout, ctx);
    EXPECT_EQ(get(db), got) << "a second run gave other bits";
  }
}

// add_gradient (gradient_accumulation_fusion: false): the device kernel gives the host op's bits,
// dst = (accumulate ? dst : 0) + src rounded to bf16 or not, for sizes with and without a tail of
// fewer than four elements and with a source that is not 16-byte aligned (the scalar path); and
// the rounding is bf16's nearest even (a rounded product differs from the f32 one somewhere).
TEST_F(GemmTest, AddGradientRoundsAndAddsAsTheHostOp) {
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{1} << 20 | 3}) {
    for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
      for (const DType rt : {DType::BF16, DType::F32}) {
        for (const bool accumulate : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset << " round_to=" << dtype_name(rt)
                                            << " accumulate=" << accumulate);
          ArenaScope scope = scoped_tensors();
          TensorView dst = make(DType::F32, {n});
          TensorView buf = make(DType::F32, {n + offset});
          TensorView src = buf;
          src.data = static_cast<float*>(buf.data) + offset;
          src.shape[0] = n;
          std::vector<float> d0 = random_tensor(dst), s0 = randn(n, 3.0f);
          std::vector<float> sb(static_cast<size_t>(n + offset), 0.0f);
          std::copy(s0.begin(), s0.end(), sb.begin() + offset);
          put(buf, sb);
          add_gradient(dst, src, rt, accumulate, ctx);
          std::vector<float> want = d0;
          TensorView hd(want.data(), DType::F32, Device::CPU, {n}), hs(s0.data(), DType::F32, Device::CPU, {n});
          add_gradient(hd, hs, rt, accumulate, ExecContext{});
          const std::vector<float> got = get(dst);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), size_t(n) * 4), 0) << "device and host bits differ";
          int64_t changed = 0;
          for (int64_t i = 0; i < n; ++i) {
            const float r = rt == DType::BF16 ? round_to(DType::BF16, s0[i]) : s0[i];
            EXPECT_EQ(want[i], accumulate ? d0[i] + r : r) << i;
            changed += r != s0[i];
          }
          if (rt == DType::BF16 && n > 100) {
            EXPECT_GT(changed, 0);
          }
        }
      }
    }
  }
  TensorView a = make(DType::F32, {8}), b = make(DType::F32, {9});
  EXPECT_THROW(add_gradient(a, b, DType::BF16, true, ctx), primus::RuntimeError);
  EXPECT_THROW(add_gradient(a, a, DType::F16, true, ctx), primus::RuntimeError);
}

// linear_backward_weight_ones: the weight gradient and the bias gradient from one GEMM over an
// input whose column C is ones (then zeros to Cp), against double-precision host sums; both the
// accumulating and the overwriting (first micro-batch) form; the vector and the scalar split.
TEST_F(GemmTest, WeightGradOnesGivesWeightAndBiasGradients) {
  struct Case { int64_t N, C, Cp, OC; bool acc; };
  for (const Case& k : {Case{4099, 768, 776, 2304, true}, Case{4099, 768, 776, 3072, false},
                        Case{333, 102, 104, 40, true}, Case{64, 64, 72, 200, false}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << k.N << " C=" << k.C << " Cp=" << k.Cp << " OC=" << k.OC << " acc=" << k.acc);
    TensorView inp = make(DType::BF16, {k.N, k.Cp}), dout = make(DType::BF16, {k.N, k.OC});
    std::vector<float> iv = randn(k.N * k.Cp, 1.0f, DType::BF16);
    for (int64_t n = 0; n < k.N; ++n)
      for (int64_t c = k.C; c < k.Cp; ++c) iv[size_t(n * k.Cp + c)] = c == k.C ? 1.0f : 0.0f;
    put(inp, iv);
    const auto dv = random_tensor(dout);
    TensorView dw = make(DType::F32, {k.OC, k.C}), db = make(DType::F32, {k.OC});
    const auto dw0 = random_tensor(dw), db0 = random_tensor(db);
    linear_backward_weight_ones(dw, db, dout, inp, ctx, k.acc);
    std::vector<double> rw(size_t(k.OC * k.C)), rb(size_t(k.OC));
    for (int64_t o = 0; o < k.OC; ++o) {
      rb[size_t(o)] = db0[size_t(o)];
      for (int64_t c = 0; c < k.C; ++c) rw[size_t(o * k.C + c)] = k.acc ? dw0[size_t(o * k.C + c)] : 0.0;
    }
    for (int64_t n = 0; n < k.N; ++n)
      for (int64_t o = 0; o < k.OC; ++o) {
        const double g = dv[size_t(n * k.OC + o)];
        rb[size_t(o)] += g;
        double* row = &rw[size_t(o * k.C)];
        const float* x = &iv[size_t(n * k.Cp)];
        for (int64_t c = 0; c < k.C; ++c) row[c] += g * x[c];
      }
    EXPECT_LT(rel_err(get(dw), rw), 1e-5);
    EXPECT_LT(rel_err(get(db), rb), 1e-5);
  }
}

// The norm writes padded output rows exactly as dense ones and leaves the padding alone.
TEST_F(GemmTest, NormForwardPaddedRowsMatchDenseAndKeepThePadding) {
  const int64_t N = 1000, C = 768, Cp = 776;
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {C}), b = make(DType::BF16, {C});
  random_tensor(x), random_tensor(w), random_tensor(b);
  TensorView dense = make(DType::BF16, {N, C}), padded = make(DType::BF16, {N, Cp});
  TensorView mean = make(DType::F32, {N}), rstd = make(DType::F32, {N});
  const auto pad0 = random_tensor(padded);
  for (bool rms : {false, true}) {
    NormForwardArgs a;
    a.type = rms ? NormType::RMSNorm : NormType::LayerNorm;
    a.inp = x, a.weight = w, a.bias = rms ? TensorView() : b, a.mean = mean, a.rstd = rstd, a.ctx = ctx;
    a.out = dense;
    norm_forward(a);
    a.out = TensorView(padded.data, DType::BF16, Device::CUDA, {N, C});
    a.out.strides = {Cp, 1};
    norm_forward(a);
    const auto d = get(dense), p = get(padded);
    int64_t bad = 0, pad_changed = 0;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < C; ++c) bad += d[size_t(n * C + c)] != p[size_t(n * Cp + c)];
      for (int64_t c = C; c < Cp; ++c) pad_changed += p[size_t(n * Cp + c)] != pad0[size_t(n * Cp + c)];
    }
    EXPECT_EQ(bad, 0) << (rms ? "rmsnorm" : "layernorm");
    EXPECT_EQ(pad_changed, 0) << (rms ? "rmsnorm" : "layernorm");
  }
}

TEST_F(GemmTest, LinearFp32MatchesCpuMatmulAtFp32Gate) {
  const int64_t N = 96, C = 128, OC = 80;
  TensorView x = make(DType::F32, {N, C}), w = make(DType::F32, {OC, C}), out = make(DType::F32, {N, OC});
  auto xv = random_tensor(x), wv = random_tensor(w);
  poison(out);
  linear_forward(out, x, w, {}, {}, ctx);
  std::vector<float> ref(static_cast<size_t>(N * OC));
  cpu::matmul_forward(ref.data(), xv.data(), wv.data(), static_cast<const float*>(nullptr), N, C, OC);
  EXPECT_LT(rel_err(get(out), ref), 1e-4);
}

TEST_F(GemmTest, HeuristicIsCachedPerShape) {
  Mat a = operand(DType::BF16, 64, 64, false), b = operand(DType::BF16, 64, 48, false);
  TensorView d = make(DType::BF16, {64, 48});
  GemmArgs g = args(a.view, b.view, d);
  g.ctx = ctx;
  gemm(g);
  const size_t n = cublaslt::algo_cache_size();
  gemm(g);
  EXPECT_EQ(cublaslt::algo_cache_size(), n);
  Mat b2 = operand(DType::BF16, 64, 56, false);
  TensorView d2 = make(DType::BF16, {64, 56});
  g.b = b2.view;
  g.d = d2;
  gemm(g);
  EXPECT_EQ(cublaslt::algo_cache_size(), n + 1);
}

// ---- cuBLASLt's algorithm search and its cache file (algo_cache.h) ---------------------------
// Each test points the cache at its own folder through the environment, turns the search on
// and restores both (and drops the plans) at the end.
class AlgoSearchTest : public GemmTest {
 protected:
  void SetUp() override {
    GemmTest::SetUp();
    if (IsSkipped()) return;
    dir = std::filesystem::temp_directory_path() /
          ("primus_gemm_algos_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    file = dir / "algos.json";
    for (const char* n : {"PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", "PRIMUS_CACHE_DIR"})
      if (const char* v = std::getenv(n)) saved[n] = v;
    set_env(file.string().c_str());
    cublaslt::set_algo_search(8);
    cublaslt::set_formulation(cublaslt::Formulation::Auto);  // both formulations searched, both kept in the file
    cublaslt::clear_algo_cache();
  }
  void TearDown() override {
    if (!dir.empty()) {
      for (const char* n : {"PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", "PRIMUS_CACHE_DIR"}) {
        if (saved.count(n)) ::setenv(n, saved[n].c_str(), 1); else ::unsetenv(n);
      }
      cublaslt::set_algo_search(1);
      cublaslt::set_formulation(cublaslt::Formulation::Column);
      cublaslt::clear_algo_cache();
      std::filesystem::remove_all(dir);
    }
    GemmTest::TearDown();
  }
  static void set_env(const char* cache) { ::setenv("PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", cache, 1); }
  // A GPT-2-like problem (bf16, beta = 0) for which cuBLASLt offers several candidates.
  struct Problem {
    Mat a, b;
    TensorView d;
    GemmArgs g;
  };
  Problem problem() {
    Problem p{operand(DType::BF16, 512, 768, false), operand(DType::BF16, 768, 1024, true),
              make(DType::BF16, {512, 1024}), {}};
    p.g = args(p.a.view, p.b.view, p.d);
    p.g.ctx = ctx;
    return p;
  }
  std::map<std::string, std::string> saved;
  std::filesystem::path dir, file;
};

TEST_F(AlgoSearchTest, FirstProcessSearchesAndWritesTheNextReadsTheFileAndComputesTheSameBits) {
  Problem p = problem();
  const int64_t searches = cublaslt::algo_search_count(), hits = cublaslt::algo_cache_hits();
  EXPECT_EQ(cublaslt::algo_cache_file(), file.string());
  poison(p.d);
  gemm(p.g);
  const std::vector<uint8_t> first = bytes(p.d);
  ASSERT_EQ(cublaslt::algo_search_count(), searches + 1) << "the shape's candidates were not timed";
  EXPECT_EQ(cublaslt::algo_cache_hits(), hits);
  ASSERT_TRUE(std::filesystem::exists(file));
  cublaslt::AlgoCacheFile f(file);
  f.load();
  ASSERT_TRUE(f.load_error().empty()) << f.load_error();
  ASSERT_EQ(f.size(), 2u) << "the plain product's winner in each formulation (column order; row order under |row)";
  {
    std::ifstream in(file);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cudaDeviceProp prop{};
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    EXPECT_NE(text.find(fmt::format("{}|sm_{}{}|cublasLt ", prop.name, prop.major, prop.minor)), std::string::npos)
        << text;
    EXPECT_NE(text.find("m=512 n=1024 k=768"), std::string::npos) << text;
    EXPECT_NE(text.find("|ws33554432|row\""), std::string::npos) << text;
  }
  EXPECT_LT(rel_err(get(p.d), product(p.a.values, p.b.values, 512, 1024, 768)), gate(DType::BF16));

  // As a new process would: no plans, the file read again; the algorithm comes from it.
  cublaslt::clear_algo_cache();
  poison(p.d);
  gemm(p.g);
  EXPECT_EQ(bytes(p.d), first) << "the cached algorithm must give the searched run's bits";
  EXPECT_EQ(cublaslt::algo_search_count(), searches + 1) << "a cached shape must not be timed again";
  EXPECT_EQ(cublaslt::algo_cache_hits(), hits + 1);
}

TEST_F(AlgoSearchTest, DisabledCacheSearchesInEveryProcessAndWritesNothing) {
  set_env("0");
  ::setenv("PRIMUS_CACHE_DIR", dir.string().c_str(), 1);
  cublaslt::clear_algo_cache();
  EXPECT_EQ(cublaslt::algo_cache_file(), "");
  Problem p = problem();
  const int64_t searches = cublaslt::algo_search_count();
  gemm(p.g);
  cublaslt::clear_algo_cache();
  gemm(p.g);
  EXPECT_EQ(cublaslt::algo_search_count(), searches + 2);
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "nothing may be written with the cache disabled";
  EXPECT_LT(rel_err(get(p.d), product(p.a.values, p.b.values, 512, 1024, 768)), gate(DType::BF16));
}

TEST_F(AlgoSearchTest, CorruptFileAndRefusedEntriesFallBackToTheSearch) {
  Problem p = problem();
  const auto ref = product(p.a.values, p.b.values, 512, 1024, 768);
  { std::ofstream(file) << "{\"format\": \"primus-cublaslt-algos\", truncated"; }
  const int64_t searches = cublaslt::algo_search_count();
  poison(p.d);
  gemm(p.g);  // the corrupt file is logged and ignored, then replaced
  EXPECT_EQ(cublaslt::algo_search_count(), searches + 1);
  EXPECT_LT(rel_err(get(p.d), ref), gate(DType::BF16));
  cublaslt::AlgoCacheFile f(file);
  f.load();
  ASSERT_TRUE(f.load_error().empty()) << f.load_error();
  ASSERT_EQ(f.size(), 2u);

  // A stale entry (another cuBLASLt's bytes): every byte 0xff, which no cuBLASLt accepts.
  std::map<std::string, cublaslt::CachedAlgo> entries;
  {
    std::ifstream in(file);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(cublaslt::parse_algo_cache(text, &entries), "");
  }
  for (auto& [k, v] : entries) v.data.fill(~uint64_t{0});
  { std::ofstream(file) << cublaslt::format_algo_cache(entries); }
  cublaslt::clear_algo_cache();
  const int64_t hits = cublaslt::algo_cache_hits();
  poison(p.d);
  gemm(p.g);
  EXPECT_EQ(cublaslt::algo_cache_hits(), hits) << "cublasLtMatmulAlgoCheck accepted an all-ones algorithm";
  EXPECT_EQ(cublaslt::algo_search_count(), searches + 2);
  EXPECT_LT(rel_err(get(p.d), ref), gate(DType::BF16));
}

// The row-order formulation (CUBLASLT_ORDER_ROW layouts, operands in place), forced for every
// plain product: all four transpositions, a bf16 D written and an f32 D accumulated (beta = 1,
// rows strided), against the double product, at the bf16 gate; the plans really are row-order ones.
TEST_F(GemmTest, CublasLtRowOrderFormulationMatchesReference) {
  GlobalBackendManager::instance().set_backend("gemm", BackendType::CUBLASLT);
  cublaslt::set_formulation(cublaslt::Formulation::Row);
  const int64_t M = 192, N = 320, K = 256, LD = 336;
  const int64_t rows_before = cublaslt::row_order_plan_count();
  for (int layout = 0; layout < 4; ++layout) {
    const bool ta = layout & 2, tb = layout & 1;
    SCOPED_TRACE(fmt::format("ta={} tb={}", ta, tb));
    Mat a = operand(DType::BF16, M, K, ta), b = operand(DType::BF16, K, N, tb);
    const auto prod = product(a.values, b.values, M, N, K);
    TensorView d = make(DType::BF16, {M, N});
    poison(d);
    GemmArgs g = args(a.view, b.view, d);
    g.ctx = ctx;
    EXPECT_EQ(gemm(g), BackendType::CUBLASLT);
    EXPECT_LT(rel_err(get(d), prod), gate(DType::BF16));

    TensorView stored = make(DType::F32, {M, LD});
    auto s0 = random_tensor(stored);
    TensorView acc = stored;
    acc.shape[1] = N;
    GemmArgs ga = args(a.view, b.view, acc);
    ga.beta = 1.0f;
    ga.ctx = ctx;
    gemm(ga);
    expect_accumulated_once(stored, s0, prod, M, N, LD, 1e-3);
  }
  EXPECT_EQ(cublaslt::row_order_plan_count(), rows_before + 8) << "every product ran in row order";
  cublaslt::set_formulation(cublaslt::Formulation::Column);
  GlobalBackendManager::instance().reset();
}

// Weight gradients accumulate (beta = 1): their candidates are timed on a saved copy of D, so
// the call still adds its product exactly once, also into a row-strided D whose gaps stay as
// they were; the winner goes to the file like any other.
TEST_F(AlgoSearchTest, AccumulatingGemmsAreTimedOnASavedOutputAndAccumulateOnce) {
  const int64_t M = 256, N = 384, K = 512, LD = 400;
  Mat a = operand(DType::BF16, M, K, false), b = operand(DType::BF16, K, N, true);
  TensorView stored = make(DType::F32, {M, LD});
  auto s0 = random_tensor(stored);
  TensorView d = stored;
  d.shape[1] = N;  // [M, N] with rows LD apart
  GemmArgs g = args(a.view, b.view, d);
  g.beta = 1.0f;
  g.ctx = ctx;
  const int64_t searches = cublaslt::algo_search_count();
  gemm(g);
  EXPECT_EQ(cublaslt::algo_search_count(), searches + 1) << "the accumulating GEMM's candidates were not timed";
  EXPECT_TRUE(std::filesystem::exists(file));
  expect_accumulated_once(stored, s0, product(a.values, b.values, M, N, K), M, N, LD, 1e-3);
}

// ---- TURBO: Turbo's own sm90 kernel (turbo/kernels/cuda/gemm_sm90.cu) ------------------------------
// Forced with set_backend (as PRIMUS_TURBO_GEMM_BACKEND=TURBO would), on fresh random inputs with
// the outputs poisoned, against double-precision products of the same rounded inputs, at the bf16
// gate of DESIGN.md. Skipped on devices other than compute capability 9.0. Every case runs under
// each schedule of the persistent kernel (instances coop and pingpong: filter '*TurboGemmTest.*').
class TurboGemmTest : public GemmTest, public ::testing::WithParamInterface<cuda::GemmSm90Schedule> {
 protected:
  void SetUp() override {
    GemmTest::SetUp();
    if (IsSkipped()) return;
    cuda::gemm_sm90_force_schedule(GetParam());
    const TensorView m = make(DType::BF16, {64, 64});
    cuda::GemmSm90Problem probe;  // a valid problem: only the device can make it unsupported
    probe.m = probe.n = probe.k = 64;
    probe.a = {m.data, 64, false};
    probe.b = {m.data, 64, false};
    probe.d = m.data;
    probe.ldd = 64;
    if (auto w = cuda::gemm_sm90_unsupported_reason(probe); !w.empty()) GTEST_SKIP() << "TURBO GEMM: " << w;
    GlobalBackendManager::instance().set_backend("gemm", BackendType::TURBO);
  }
  void TearDown() override {
    GlobalBackendManager::instance().reset();
    cuda::gemm_sm90_force_plan(0, 0);
    cuda::gemm_sm90_force_schedule(cuda::GemmSm90Schedule::Auto);
    GemmTest::TearDown();
  }

  // A logical [r, c] operand whose stored rows are padded to a multiple of 8 elements (TMA's
  // 16-byte rule) with NaN in the padding, so a kernel that reads past the logical edge fails.
  // col_major: stored [c, r] and viewed transposed.
  Mat padded_operand(DType dt, int64_t r, int64_t c, bool col_major) {
    Mat m;
    m.values = randn(r * c, 1.0f, dt);
    const int64_t sr = col_major ? c : r, sc = col_major ? r : c;
    const int64_t ld = (sc + 7) / 8 * 8;
    TensorView stored = make(dt, {sr, ld});
    std::vector<float> host(static_cast<size_t>(sr * ld), NAN);
    for (int64_t i = 0; i < sr; ++i)
      for (int64_t j = 0; j < sc; ++j) host[i * ld + j] = col_major ? m.values[j * c + i] : m.values[i * c + j];
    put(stored, host);
    TensorView v = stored;
    v.shape[1] = sc;  // strides stay {ld, 1}
    m.view = col_major ? v.transposed() : v;
    return m;
  }

  // Rows `rows` of the double product (all columns).
  static std::vector<double> product_rows(const std::vector<float>& a, const std::vector<float>& b,
                                          const std::vector<int64_t>& rows, int64_t N, int64_t K) {
    std::vector<double> d(rows.size() * static_cast<size_t>(N), 0.0);
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t k = 0; k < K; ++k) {
        const double aik = a[rows[r] * K + k];
        for (int64_t j = 0; j < N; ++j) d[r * N + j] += aik * b[k * N + j];
      }
    return d;
  }
  // Two rows of every 128-row tile (its first and a random one): each tile of D is checked.
  std::vector<int64_t> sample_rows(int64_t M) {
    std::vector<int64_t> rows;
    for (int64_t r0 = 0; r0 < M; r0 += 128) {
      const int64_t n = std::min<int64_t>(128, M - r0);
      rows.push_back(r0);
      if (n > 1) rows.push_back(r0 + 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(n - 1)));
    }
    return rows;
  }
  static std::vector<float> pick_rows(const std::vector<float>& d, const std::vector<int64_t>& rows, int64_t N) {
    std::vector<float> out;
    for (int64_t r : rows) out.insert(out.end(), d.begin() + r * N, d.begin() + (r + 1) * N);
    return out;
  }
  static bool all_finite(const std::vector<float>& v) {
    for (float x : v)
      if (!std::isfinite(x)) return false;
    return true;
  }
  // D (f32, random) = A @ B + beta * D on TURBO: two rows of every tile against the double
  // product, every element written, and a rerun from the same D gives the same bits.
  void expect_accumulate(const Mat& a, const Mat& b, int64_t M, int64_t N, int64_t K, float beta, double tol) {
    TensorView d = make(DType::F32, {M, N});
    const auto d0 = random_tensor(d);
    GemmArgs g = args(a.view, b.view, d);
    g.beta = beta;
    g.ctx = ctx;
    EXPECT_EQ(gemm(g), BackendType::TURBO);
    const auto got = get(d);
    EXPECT_TRUE(all_finite(got)) << "an element was not written";
    const auto rows = sample_rows(M);
    auto want = product_rows(a.values, b.values, rows, N, K);
    const auto base = pick_rows(d0, rows, N);
    for (size_t i = 0; i < want.size(); ++i) want[i] += beta * base[i];
    EXPECT_LT(rel_err(pick_rows(got, rows, N), want), tol);
    put(d, d0);
    gemm(g);
    EXPECT_EQ(get(d), got) << "not deterministic";
  }
};

TEST_P(TurboGemmTest, AllTranspositionsOnOddShapes) {
  // Not multiples of the 128 x 256 x 64 tile in any dimension; K not a multiple of 64.
  struct Shape { int64_t M, N, K; };
  for (Shape sh : {Shape{1000, 1500, 700}, Shape{257, 131, 72}, Shape{1, 8, 8}, Shape{77, 8, 200}}) {
    for (Types ty : {Types{DType::BF16, DType::BF16}, Types{DType::BF16, DType::F32}, Types{DType::F16, DType::F16}})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          SCOPED_TRACE(fmt::format("{}x{}x{} {}->{} ta={} tb={}", sh.M, sh.N, sh.K, dtype_name(ty.in), dtype_name(ty.out), ta, tb));
          Mat a = padded_operand(ty.in, sh.M, sh.K, ta), b = padded_operand(ty.in, sh.K, sh.N, tb);
          TensorView d = make(ty.out, {sh.M, sh.N});
          poison(d);
          GemmArgs g = args(a.view, b.view, d);
          g.ctx = ctx;
          EXPECT_EQ(gemm(g), BackendType::TURBO);
          EXPECT_LT(rel_err(get(d), product(a.values, b.values, sh.M, sh.N, sh.K)), gate(DType::BF16));
        }
  }
}

TEST_P(TurboGemmTest, BiasEpilogueAndBetaAccumulate) {
  const int64_t M = 200, N = 328, K = 136;
  for (int tb = 0; tb < 2; ++tb) {
    SCOPED_TRACE(fmt::format("tb={}", tb));
    Mat a = operand(DType::BF16, M, K, false), b = operand(DType::BF16, K, N, tb, 0.2f);
    auto ref = product(a.values, b.values, M, N, K);
    // bf16 D with a bf16 bias (the forward of a linear layer).
    TensorView bias = make(DType::BF16, {N}), d = make(DType::BF16, {M, N});
    auto bv = random_tensor(bias);
    poison(d);
    GemmArgs g = args(a.view, b.view, d);
    g.epilogue = GemmEpilogue::Bias;
    g.bias = bias;
    g.ctx = ctx;
    EXPECT_EQ(gemm(g), BackendType::TURBO);
    std::vector<double> want(ref);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) want[i * N + j] += bv[j];
    EXPECT_LT(rel_err(get(d), want), gate(DType::BF16));

    // f32 D: D = 0.5 * A @ B + 1 * D (+ bias), the weight-gradient accumulation.
    TensorView d32 = make(DType::F32, {M, N}), bias32 = make(DType::F32, {N});
    auto d0 = random_tensor(d32), b32 = random_tensor(bias32);
    GemmArgs h = args(a.view, b.view, d32);
    h.alpha = 0.5f;
    h.beta = 1.0f;
    h.ctx = ctx;
    gemm(h);
    for (size_t i = 0; i < want.size(); ++i) want[i] = 0.5 * ref[i] + d0[i];
    auto got = get(d32);
    EXPECT_LT(rel_err(got, want), 1e-3);
    h.epilogue = GemmEpilogue::Bias;
    h.bias = bias32;
    h.beta = 0.25f;
    gemm(h);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) want[i * N + j] = 0.5 * ref[i * N + j] + 0.25 * got[i * N + j] + b32[j];
    EXPECT_LT(rel_err(get(d32), want), 1e-3);
  }
}

// 16-bit outputs that are row-strided (ldd > n: the gaps between rows must keep their contents),
// narrower than a tile, or cut by both edges, each with and without a bias, against the double
// product: every element of D written, nothing outside it.
TEST_P(TurboGemmTest, StridedAndNarrowOutputsKeepTheGaps) {
  struct Shape { int64_t M, N, K, ldd; };
  const float sentinel = 1536.0f;  // exact in bf16 and f16
  for (DType dt : {DType::BF16, DType::F16})
    for (Shape sh : {Shape{300, 200, 72, 224}, Shape{130, 40, 64, 40}, Shape{257, 136, 200, 136}, Shape{64, 264, 520, 512}})
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(fmt::format("{} {}x{}x{} ldd {} bias {}", dtype_name(dt), sh.M, sh.N, sh.K, sh.ldd, with_bias));
        const int64_t M = sh.M, N = sh.N, K = sh.K;
        Mat a = operand(dt, M, K, false), b = operand(dt, K, N, true, 0.2f);
        auto want = product(a.values, b.values, M, N, K);
        TensorView storage = make(dt, {M, sh.ldd});
        put(storage, std::vector<float>(static_cast<size_t>(M * sh.ldd), sentinel));
        TensorView d = storage;
        d.shape[1] = N;  // strides stay {ldd, 1}
        TensorView bias = make(dt, {N});
        const auto bv = random_tensor(bias);
        GemmArgs g = args(a.view, b.view, d);
        if (with_bias) {
          g.epilogue = GemmEpilogue::Bias;
          g.bias = bias;
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) want[i * N + j] += bv[j];
        }
        g.ctx = ctx;
        EXPECT_EQ(gemm(g), BackendType::TURBO);
        const auto all = get(storage);
        std::vector<float> got(static_cast<size_t>(M * N));
        int64_t gaps_changed = 0;
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < sh.ldd; ++j) {
            const float v = all[i * sh.ldd + j];
            if (j < N) got[i * N + j] = v;
            else gaps_changed += v != sentinel;
          }
        EXPECT_EQ(gaps_changed, 0) << "elements between D's rows were written";
        EXPECT_LT(rel_err(got, want), gate(DType::BF16));
      }
}

// Every launch plan (tile width 128/256, persistent, split-k over clusters of 2..8 blocks, or
// stream-K) on the same problem: each matches the product, and split-k and stream-K sum in a fixed
// order, so a rerun is bitwise identical. K = 1000 leaves a partial last k-tile; splits 8 of a
// 2-k-tile problem leave blocks with no k-tiles at all. Stream-K on the first shape: 144
// k-iterations over 132 blocks, so each tile's owner adds up to 15 other blocks' partials; on the
// second, one k-iteration per block (8 blocks).
TEST_P(TurboGemmTest, EveryPlanMatchesAndSplitKIsDeterministic) {
  struct Plan { int bn, splits; };
  struct Shape { int64_t M, N, K; };
  for (Shape sh : {Shape{384, 640, 1000}, Shape{136, 264, 104}}) {  // leading dims multiples of 8 (TMA)
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = layout & 2, tb = layout & 1;
      Mat a = operand(DType::BF16, sh.M, sh.K, ta), b = operand(DType::BF16, sh.K, sh.N, tb);
      const auto ref = product(a.values, b.values, sh.M, sh.N, sh.K);
      TensorView bias = make(DType::F32, {sh.N}), d = make(DType::F32, {sh.M, sh.N});
      auto bv = random_tensor(bias);
      std::vector<double> want(ref);
      for (int64_t i = 0; i < sh.M; ++i)
        for (int64_t j = 0; j < sh.N; ++j) want[i * sh.N + j] += bv[j];
      for (Plan pl : {Plan{256, 1}, Plan{128, 1}, Plan{256, 2}, Plan{128, 3}, Plan{256, 5}, Plan{128, 8},
                      Plan{160, 1}, Plan{160, 3}, Plan{256, cuda::kGemmSm90StreamK}}) {
        SCOPED_TRACE(fmt::format("{}x{}x{} ta={} tb={} bn={} splits={}", sh.M, sh.N, sh.K, ta, tb, pl.bn, pl.splits));
        cuda::gemm_sm90_force_plan(pl.bn, pl.splits);
        GemmArgs g = args(a.view, b.view, d);
        g.epilogue = GemmEpilogue::Bias;
        g.bias = bias;
        g.ctx = ctx;
        poison(d);
        gemm(g);
        const auto first = bytes(d);
        EXPECT_LT(rel_err(get(d), want), 1e-3);
        poison(d);
        gemm(g);
        EXPECT_EQ(bytes(d), first) << "not deterministic";
      }
      cuda::gemm_sm90_force_plan(0, 0);
    }
  }
}

// The products of GPT-2 124M's training step at 16384 tokens, in the layouts linear_forward /
// linear_backward use: forward inp @ W^T, input gradient dout @ W, weight gradient dout^T @ inp
// accumulated into f32. Two rows of every 128-row tile are checked against the double product;
// every element must be finite (the output was poisoned).
TEST_P(TurboGemmTest, Gpt2TrainingShapes) {
  struct Case { const char* what; int64_t M, N, K; bool ta, tb; DType out; float beta; };
  const Case cases[] = {
      {"qkv fwd", 16384, 2304, 768, false, true, DType::BF16, 0.0f},
      {"fc_proj fwd", 16384, 768, 3072, false, true, DType::BF16, 0.0f},
      {"fc fwd", 16384, 3072, 768, false, true, DType::BF16, 0.0f},
      {"fc dgrad", 16384, 768, 3072, false, false, DType::BF16, 0.0f},
      {"attn_proj wgrad", 768, 768, 16384, true, false, DType::F32, 1.0f},
      {"qkv wgrad", 2304, 768, 16384, true, false, DType::F32, 1.0f},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} {}x{}x{}", c.what, c.M, c.N, c.K));
    Mat a = operand(DType::BF16, c.M, c.K, c.ta), b = operand(DType::BF16, c.K, c.N, c.tb);
    TensorView d = make(c.out, {c.M, c.N});
    std::vector<float> d0;
    if (c.beta != 0.0f) d0 = random_tensor(d);
    else poison(d);
    GemmArgs g = args(a.view, b.view, d);
    g.beta = c.beta;
    g.ctx = ctx;
    EXPECT_EQ(gemm(g), BackendType::TURBO);
    const auto got = get(d);
    EXPECT_TRUE(all_finite(got)) << "an element was not written";
    const auto rows = sample_rows(c.M);
    auto want = product_rows(a.values, b.values, rows, c.N, c.K);
    if (c.beta != 0.0f) {
      const auto base = pick_rows(d0, rows, c.N);
      for (size_t i = 0; i < want.size(); ++i) want[i] += c.beta * base[i];
    }
    EXPECT_LT(rel_err(pick_rows(got, rows, c.N), want), gate(DType::BF16));
    const auto plan = cuda::gemm_sm90_plan(
        {c.M, c.N, c.K, DType::BF16, {a.view.data, 0, c.ta}, {b.view.data, 0, !c.tb}, d.data, c.N, c.out, 1.0f, c.beta, nullptr});
    std::printf("[ turbo gemm ] %-16s %5lldx%5lldx%5lld  tile 128x%d, splits %d, grid %d, %s\n", c.what,
                static_cast<long long>(c.M), static_cast<long long>(c.N), static_cast<long long>(c.K), plan.bn,
                plan.splits, plan.grid, plan.pingpong ? "pingpong" : "coop");
  }
}

// Many tiles per persistent block (32 x 24 tiles of 128 x 128 on ~132 SMs: each ping-pong
// warpgroup takes several, so the stage / phase bookkeeping across tiles and the alternation
// are exercised) with partial tiles at both edges and a partial last k-tile, in all four
// layouts; bf16 D with bias, f32 D with beta, f16 D with bias (bf16 / f16 D with N a multiple of
// 8 take the 16-byte store path on every tile but the last tile-column). Rows are sampled in both
// 64-row halves of every tile (ping-pong's second m64 block), plus the last row; every element
// must be written.
// Also under the forced 160-wide plan (3000 = 18 x 160 + 120: a ragged last tile; the 16-byte
// stores of 20 column groups; an N-major B's third slab half past the tile).
TEST_P(TurboGemmTest, ManyTilesPerBlockWithEdges) {
  for (int force_bn : {0, 160}) {
    SCOPED_TRACE(fmt::format("forced tile width {}", force_bn));
    cuda::gemm_sm90_force_plan(force_bn, force_bn ? 1 : 0);
    const int64_t M = 4000, N = 3000, K = 200;
    std::vector<int64_t> rows;
    for (int64_t r0 = 0; r0 < M; r0 += 128)
      for (int64_t h = r0; h < std::min(r0 + 128, M); h += 64)
        rows.push_back(h + static_cast<int64_t>(rng_() % static_cast<uint64_t>(std::min<int64_t>(64, M - h))));
    rows.push_back(M - 1);
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = layout & 2, tb = layout & 1;
      SCOPED_TRACE(fmt::format("ta={} tb={}", ta, tb));
      Mat a = operand(DType::BF16, M, K, ta), b = operand(DType::BF16, K, N, tb, 0.2f);
      const auto ref = product_rows(a.values, b.values, rows, N, K);
      const auto plan = cuda::gemm_sm90_plan({M, N, K, DType::BF16, {a.view.data, 0, ta}, {b.view.data, 0, tb}, nullptr, N,
                                              DType::BF16, 1.0f, 0.0f, nullptr});
      EXPECT_EQ(plan.splits, 1);
      EXPECT_EQ(plan.pingpong, force_bn == 0 && GetParam() == cuda::GemmSm90Schedule::Pingpong);
      if (force_bn) {
        EXPECT_EQ(plan.bn, force_bn);
      }

      TensorView bias = make(DType::BF16, {N}), d = make(DType::BF16, {M, N});
      auto bv = random_tensor(bias);
      poison(d);
      GemmArgs g = args(a.view, b.view, d);
      g.epilogue = GemmEpilogue::Bias;
      g.bias = bias;
      g.ctx = ctx;
      EXPECT_EQ(gemm(g), BackendType::TURBO);
      auto got = get(d);
      EXPECT_TRUE(all_finite(got)) << "an element was not written";
      std::vector<double> want(ref);
      for (size_t r = 0; r < rows.size(); ++r)
        for (int64_t j = 0; j < N; ++j) want[r * N + j] += bv[j];
      EXPECT_LT(rel_err(pick_rows(got, rows, N), want), gate(DType::BF16));

      TensorView d32 = make(DType::F32, {M, N});
      auto d0 = random_tensor(d32);
      GemmArgs h = args(a.view, b.view, d32);
      h.beta = 0.5f;
      h.ctx = ctx;
      EXPECT_EQ(gemm(h), BackendType::TURBO);
      got = get(d32);
      EXPECT_TRUE(all_finite(got)) << "an element was not written";
      const auto base = pick_rows(d0, rows, N);
      for (size_t i = 0; i < want.size(); ++i) want[i] = ref[i] + 0.5 * base[i];
      EXPECT_LT(rel_err(pick_rows(got, rows, N), want), 1e-3);

      // f16 in and out with an f16 bias (the 16-byte store path's other type).
      Mat a16 = operand(DType::F16, M, K, ta), b16 = operand(DType::F16, K, N, tb, 0.2f);
      TensorView bias16 = make(DType::F16, {N}), d16 = make(DType::F16, {M, N});
      auto bv16 = random_tensor(bias16);
      poison(d16);
      GemmArgs e = args(a16.view, b16.view, d16);
      e.epilogue = GemmEpilogue::Bias;
      e.bias = bias16;
      e.ctx = ctx;
      EXPECT_EQ(gemm(e), BackendType::TURBO);
      got = get(d16);
      EXPECT_TRUE(all_finite(got)) << "an element was not written (f16)";
      want = product_rows(a16.values, b16.values, rows, N, K);
      for (size_t r = 0; r < rows.size(); ++r)
        for (int64_t j = 0; j < N; ++j) want[r * N + j] += bv16[j];
      EXPECT_LT(rel_err(pick_rows(got, rows, N), want), gate(DType::BF16));
    }
  }
  cuda::gemm_sm90_force_plan(0, 0);
}

// The GELU epilogues the GPT-2 MLP can run on TURBO (gelu_aux_bias forward, dgelu input
// gradient), plus gelu_aux without a bias: against the double product and the CPU GELU, bf16 and
// f16, with N a multiple of 256 (every tile takes the 16-byte path) and N = 330 (edge tiles and
// the scalar path, aux rows not 16-byte aligned), under forced plans too: 128-wide tiles (the
// 16-byte path with 4 steps instead of 8), split-k (the epilogue after the cluster reduction) and
// stream-K (the owners' epilogue after the fix-up).
// The bias is read once from a 4-byte aligned and once from a 2-byte aligned address (the
// 16-byte path reads bias pairs as words where it can). Outputs and aux are poisoned; every
// element must be written.
TEST_P(TurboGemmTest, GeluEpiloguesMatchCpuGelu) {
  struct Shape { int64_t M, N, K; };
  struct Plan { int bn, splits; };
  for (DType dt : {DType::BF16, DType::F16})
    for (Shape sh : {Shape{384, 512, 256}, Shape{200, 330, 136}})
      for (Plan pl : {Plan{0, 0}, Plan{128, 1}, Plan{256, 2}, Plan{128, 3}, Plan{256, cuda::kGemmSm90StreamK}}) {
        SCOPED_TRACE(fmt::format("{} {}x{}x{} bn={} splits={}", dtype_name(dt), sh.M, sh.N, sh.K, pl.bn, pl.splits));
        cuda::gemm_sm90_force_plan(pl.bn, pl.splits);
        const int64_t M = sh.M, N = sh.N, K = sh.K;
        Mat a = operand(dt, M, K, false), b = operand(dt, K, N, true, 0.2f);
        const auto prod = product(a.values, b.values, M, N, K);
        TensorView bias_store = make(dt, {N + 1}), d = make(dt, {M, N}), aux = make(dt, {M, N});
        random_tensor(bias_store);
        for (int variant : {0, 1, 2}) {  // bias at an aligned address, bias at an odd element, no bias
          const bool with_bias = variant < 2;
          SCOPED_TRACE(with_bias ? fmt::format("gelu_aux_bias, bias at element {}", variant) : "gelu_aux");
          TensorView bias(static_cast<char*>(bias_store.data) + variant * dtype_size(dt), dt, Device::CUDA, {N});
          const auto bv = get(bias);
          std::vector<double> pre(prod);
          if (with_bias)
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < N; ++j) pre[i * N + j] += bv[j];
          std::vector<float> pre_f(pre.begin(), pre.end()), want(pre.size());
          cpu::gelu_forward(want.data(), pre_f.data(), static_cast<int64_t>(want.size()));
          poison(d);
          poison(aux);
          GemmArgs g = args(a.view, b.view, d);
          g.epilogue = with_bias ? GemmEpilogue::GeluAuxBias : GemmEpilogue::GeluAux;
          if (with_bias) g.bias = bias;
          g.aux = aux;
          g.ctx = ctx;
          EXPECT_EQ(gemm(g), BackendType::TURBO);
          const auto got_d = get(d), got_aux = get(aux);
          EXPECT_TRUE(all_finite(got_d) && all_finite(got_aux)) << "an element was not written";
          EXPECT_LT(rel_err(got_aux, pre), gate(DType::BF16));
          EXPECT_LT(rel_err(got_d, want), gate(DType::BF16));
        }
        // dgelu: D = (A @ B) * gelu'(aux), aux a stored pre-activation.
        const auto auxv = random_tensor(aux);
        std::vector<float> prod_f(prod.begin(), prod.end()), want(prod.size());
        cpu::gelu_backward(want.data(), auxv.data(), prod_f.data(), static_cast<int64_t>(want.size()));
        poison(d);
        GemmArgs h = args(a.view, b.view, d);
        h.epilogue = GemmEpilogue::DGelu;
        h.aux = aux;
        h.ctx = ctx;
        EXPECT_EQ(gemm(h), BackendType::TURBO);
        const auto got = get(d);
        EXPECT_TRUE(all_finite(got)) << "an element was not written (dgelu)";
        EXPECT_LT(rel_err(got, want), gate(DType::BF16));
        EXPECT_EQ(get(aux), auxv) << "dgelu must not write aux";
      }
  cuda::gemm_sm90_force_plan(0, 0);
}

// The stream-K plan (forced) where it has data-parallel waves ahead of its stream-K part (32 x 10
// tiles of 128 x 256 on at most 132 blocks: two whole tiles per block first when the device has
// <= 160 SMs), with a ragged N edge and a partial last k-tile, in all four layouts: f32 D with
// beta (the weight gradients' accumulation), bf16 D with bias (16-byte and staged stores but on the
// last tile-column), f16 D. Then GPT-2's weight gradients, the products stream-K is for (f32 D,
// beta 1, K = 16384). Rows of every tile are checked against the double product, every element
// must be written, and a rerun gives the same bits (the owners add the partials in block order).
TEST_P(TurboGemmTest, StreamKMatchesAndIsDeterministic) {
  cuda::gemm_sm90_force_plan(256, cuda::kGemmSm90StreamK);
  {
    const int64_t M = 4000, N = 2400, K = 200;
    const auto rows = sample_rows(M);
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = layout & 2, tb = layout & 1;
      SCOPED_TRACE(fmt::format("{}x{}x{} ta={} tb={}", M, N, K, ta, tb));
      Mat a = operand(DType::BF16, M, K, ta), b = operand(DType::BF16, K, N, tb, 0.2f);
      const auto ref = product_rows(a.values, b.values, rows, N, K);
      const auto plan = cuda::gemm_sm90_plan({M, N, K, DType::BF16, {a.view.data, 0, ta}, {b.view.data, 0, !tb},
                                              nullptr, N, DType::F32, 1.0f, 0.5f, nullptr});
      EXPECT_TRUE(plan.streamk);
      EXPECT_EQ(plan.bn, 256);

      expect_accumulate(a, b, M, N, K, 0.5f, 1e-3);

      TensorView bias = make(DType::BF16, {N}), d = make(DType::BF16, {M, N});
      const auto bv = random_tensor(bias);
      poison(d);
      GemmArgs g = args(a.view, b.view, d);
      g.epilogue = GemmEpilogue::Bias;
      g.bias = bias;
      g.ctx = ctx;
      EXPECT_EQ(gemm(g), BackendType::TURBO);
      const auto first = bytes(d);
      const auto got16 = get(d);
      EXPECT_TRUE(all_finite(got16)) << "an element was not written (bf16)";
      std::vector<double> want(ref);
      for (size_t r = 0; r < rows.size(); ++r)
        for (int64_t j = 0; j < N; ++j) want[r * N + j] += bv[j];
      EXPECT_LT(rel_err(pick_rows(got16, rows, N), want), gate(DType::BF16));
      poison(d);
      gemm(g);
      EXPECT_EQ(bytes(d), first) << "not deterministic (bf16, bias)";

      Mat a16 = operand(DType::F16, M, K, ta), b16 = operand(DType::F16, K, N, tb, 0.2f);
      TensorView e16 = make(DType::F16, {M, N});
      poison(e16);
      GemmArgs e = args(a16.view, b16.view, e16);
      e.ctx = ctx;
      EXPECT_EQ(gemm(e), BackendType::TURBO);
      const auto got_f16 = get(e16);
      EXPECT_TRUE(all_finite(got_f16)) << "an element was not written (f16)";
      EXPECT_LT(rel_err(pick_rows(got_f16, rows, N), product_rows(a16.values, b16.values, rows, N, K)),
                gate(DType::BF16));
    }
  }
  struct Case { const char* what; int64_t M, N, K; };
  for (const Case& c : {Case{"attn_proj wgrad", 768, 768, 16384}, Case{"fc wgrad", 3072, 768, 16384},
                        Case{"fc_proj wgrad", 768, 3072, 16384}}) {
    SCOPED_TRACE(fmt::format("{} {}x{}x{}", c.what, c.M, c.N, c.K));
    Mat a = operand(DType::BF16, c.M, c.K, true), b = operand(DType::BF16, c.K, c.N, false);
    expect_accumulate(a, b, c.M, c.N, c.K, 1.0f, gate(DType::BF16));
  }
  cuda::gemm_sm90_force_plan(0, 0);
}

// PRIMUS_TURBO_GEMM_STREAMK (read on every call): unset or 0, the automatic plan never takes
// stream-K; 1 lets it (what it then picks for GPT-2's weight gradients is printed, from the
// device's own cluster occupancy); anything else is an error that names the variable.
TEST_P(TurboGemmTest, StreamKSwitch) {
  struct Case { const char* what; int64_t M, N, K; };
  TensorView d = make(DType::F32, {8, 8});
  const TensorView x = make(DType::BF16, {64, 64});
  for (const Case& c : {Case{"attn_proj wgrad", 768, 768, 16384}, Case{"qkv wgrad", 2304, 768, 16384},
                        Case{"fc wgrad", 3072, 768, 16384}, Case{"fc_proj wgrad", 768, 3072, 16384}}) {
    const cuda::GemmSm90Problem p{c.M, c.N, c.K, DType::BF16, {x.data, c.M, true}, {x.data, c.N, false},
                                  d.data, c.N, DType::F32, 1.0f, 1.0f, nullptr};
    ::unsetenv("PRIMUS_TURBO_GEMM_STREAMK");
    EXPECT_FALSE(cuda::gemm_sm90_plan(p).streamk) << c.what;
    ::setenv("PRIMUS_TURBO_GEMM_STREAMK", "0", 1);
    EXPECT_FALSE(cuda::gemm_sm90_plan(p).streamk) << c.what;
    ::setenv("PRIMUS_TURBO_GEMM_STREAMK", "1", 1);
    const auto plan = cuda::gemm_sm90_plan(p);
    std::printf("[ turbo gemm ] PRIMUS_TURBO_GEMM_STREAMK=1 %-16s %5lldx%5lldx%5lld: %s, tile 128x%d, splits %d, grid %d\n",
                c.what, static_cast<long long>(c.M), static_cast<long long>(c.N), static_cast<long long>(c.K),
                plan.streamk ? "stream-K" : "no stream-K", plan.bn, plan.splits, plan.grid);
    ::setenv("PRIMUS_TURBO_GEMM_STREAMK", "yes", 1);
    try {
      (void)cuda::gemm_sm90_plan(p);
      ADD_FAILURE() << "expected an error";
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find("PRIMUS_TURBO_GEMM_STREAMK"), std::string::npos) << e.what();
    }
    ::unsetenv("PRIMUS_TURBO_GEMM_STREAMK");
  }
}

// The staged epilogue (stmatrix into shared memory, then the buffer written out by TMA stores, the
// default, or by the warps' own 128-byte row stores; for 16-bit D with the linear, bias, GELU-aux
// and dGELU epilogues, both schedules) computes the same values as the shuffle-transposed stores it
// replaces: the same bits of D and aux, with full tiles, an M edge (rows past M never written: TMA
// clips them), a ragged N edge (the edge tile takes the scalar path), and enough tiles (8200 rows)
// that every block writes several, so each warp's two buffers are reused while earlier stores
// may still be reading them.
TEST_P(TurboGemmTest, StagedEpilogueGivesTheBitsOfTheShuffleEpilogue) {
  struct Shape { int64_t M, N, K; };
  for (DType dt : {DType::BF16, DType::F16})
    for (Shape sh : {Shape{300, 512, 192}, Shape{1000, 776, 64}, Shape{8200, 1024, 64}})
      for (int bn : {128, 256}) {
        SCOPED_TRACE(fmt::format("{} {}x{}x{} bn={}", dtype_name(dt), sh.M, sh.N, sh.K, bn));
        cuda::gemm_sm90_force_plan(bn, 1);
        const int64_t M = sh.M, N = sh.N, K = sh.K;
        Mat a = operand(dt, M, K, false), b = operand(dt, K, N, true, 0.2f);
        TensorView bias = make(dt, {N}), d = make(dt, {M, N}), aux = make(dt, {M, N});
        random_tensor(bias);
        const auto auxv = random_tensor(aux, 2.0f);  // dGELU's input
        for (GemmEpilogue epi : {GemmEpilogue::None, GemmEpilogue::Bias, GemmEpilogue::GeluAuxBias, GemmEpilogue::DGelu}) {
          SCOPED_TRACE(static_cast<int>(epi));
          // 2: staged, TMA stores; 1: staged, the warps' stores; 0: shuffle-transposed stores.
          std::vector<uint8_t> run_d[3], run_aux[3];
          for (int staged : {2, 1, 0}) {
            SCOPED_TRACE(staged);
            if (staged == 1) ::setenv("PRIMUS_TURBO_GEMM_TMA_STORE", "0", 1);
            if (staged == 0) ::setenv("PRIMUS_TURBO_GEMM_STAGED_EPILOGUE", "0", 1);
            poison(d);
            if (epi == GemmEpilogue::DGelu) put(aux, auxv);
            else poison(aux);
            GemmArgs g = args(a.view, b.view, d);
            g.epilogue = epi;
            if (epi == GemmEpilogue::Bias || epi == GemmEpilogue::GeluAuxBias) g.bias = bias;
            if (epi == GemmEpilogue::GeluAuxBias || epi == GemmEpilogue::DGelu) g.aux = aux;
            g.ctx = ctx;
            EXPECT_EQ(gemm(g), BackendType::TURBO);
            ::unsetenv("PRIMUS_TURBO_GEMM_STAGED_EPILOGUE");
            ::unsetenv("PRIMUS_TURBO_GEMM_TMA_STORE");
            run_d[staged] = bytes(d);
            run_aux[staged] = bytes(aux);
            EXPECT_TRUE(all_finite(get(d))) << "an element was not written";
            if (epi == GemmEpilogue::GeluAuxBias) {
              EXPECT_TRUE(all_finite(get(aux))) << "an aux element was not written";
            }
          }
          EXPECT_EQ(run_d[2], run_d[0]) << "TMA stores";
          EXPECT_EQ(run_d[1], run_d[0]) << "the warps' stores";
          if (epi == GemmEpilogue::GeluAuxBias) {
            EXPECT_EQ(run_aux[2], run_aux[0]) << "TMA stores";
            EXPECT_EQ(run_aux[1], run_aux[0]) << "the warps' stores";
          }
        }
      }
  cuda::gemm_sm90_force_plan(0, 0);
}

// With PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND=TURBO, GEMMs with a bias / GELU epilogue on 16-bit
// tensors default to TURBO (the per-call rule) and the rest to CUBLASLT: plain products, f32
// outputs, the bias-gradient epilogues TURBO does not have. (Read once per process: skipped
// unless the variable is TURBO.)
TEST_P(TurboGemmTest, EpilogueGemmsDefaultToTurbo) {
  const char* e = std::getenv("PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND");
  if (!e || std::string(e) != "TURBO") GTEST_SKIP() << "PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND is not TURBO";
  GlobalBackendManager::instance().reset();
  const int64_t N = 256, C = 128, OC = 384;
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), bias = make(DType::BF16, {OC});
  random_tensor(x);
  random_tensor(w, 0.1f);
  random_tensor(bias);
  TensorView out = make(DType::BF16, {N, OC}), aux = make(DType::BF16, {N, OC});
  EXPECT_EQ(linear_forward(out, x, w, bias, {}, ctx), BackendType::TURBO);
  EXPECT_EQ(linear_forward(out, x, w, bias, aux, ctx), BackendType::TURBO);
  EXPECT_EQ(linear_forward(out, x, w, {}, aux, ctx), BackendType::TURBO);
  EXPECT_EQ(linear_forward(out, x, w, {}, {}, ctx), BackendType::CUBLASLT);
  TensorView x32 = make(DType::F32, {N, C}), w32 = make(DType::F32, {OC, C}), b32 = make(DType::F32, {OC});
  TensorView out32 = make(DType::F32, {N, OC});
  random_tensor(x32);
  random_tensor(w32);
  random_tensor(b32);
  EXPECT_EQ(linear_forward(out32, x32, w32, b32, {}, ctx), BackendType::CUBLASLT);
  GemmArgs g = args(out, w, make(DType::BF16, {N, C}));  // dgelu with the bias gradient: cuBLASLt's
  TensorView pre = make(DType::BF16, {N, C}), db = make(DType::BF16, {C});
  random_tensor(pre);
  g.epilogue = GemmEpilogue::DGeluBGrad;
  g.aux = pre;
  g.bias = db;
  g.ctx = ctx;
  EXPECT_EQ(gemm(g), BackendType::CUBLASLT);
  g.epilogue = GemmEpilogue::DGelu;
  g.bias = {};
  EXPECT_EQ(gemm(g), BackendType::TURBO);
}

TEST_P(TurboGemmTest, LinearLayerHelpersMatchCpuMatmul) {
  const int64_t N = 384, C = 264, OC = 520;
  TensorView x = make(DType::BF16, {N, C}), w = make(DType::BF16, {OC, C}), bias = make(DType::BF16, {OC});
  auto xv = random_tensor(x), wv = random_tensor(w, 0.1f), bv = random_tensor(bias);
  TensorView out = make(DType::BF16, {N, OC});
  poison(out);
  EXPECT_EQ(linear_forward(out, x, w, bias, {}, ctx), BackendType::TURBO);
  std::vector<float> ref(static_cast<size_t>(N * OC));
  cpu::matmul_forward(ref.data(), xv.data(), wv.data(), bv.data(), N, C, OC);
  EXPECT_LT(rel_err(get(out), ref), gate(DType::BF16));

  // dinp overwritten, dweight (f32) accumulated; no dbias (its epilogue is not TURBO's).
  TensorView dout = make(DType::BF16, {N, OC}), dx = make(DType::BF16, {N, C}), dw = make(DType::F32, {OC, C});
  auto doutv = random_tensor(dout);
  auto dw0 = random_tensor(dw);
  poison(dx);
  linear_backward(dx, dw, {}, dout, x, w, false, ctx);
  std::vector<float> rdx(static_cast<size_t>(N * C), 0.0f), rdw = dw0;
  cpu::matmul_backward(rdx.data(), rdw.data(), static_cast<float*>(nullptr), doutv.data(), xv.data(), wv.data(), N, C, OC);
  EXPECT_LT(rel_err(get(dx), rdx), gate(DType::BF16));
  EXPECT_LT(rel_err(get(dw), rdw), 1e-3);
}

// A forced TURBO that cannot run a call is an error naming the backend and the reason; without
// the force the same calls fall back (or run on the default, CUBLASLT).
TEST_P(TurboGemmTest, ForcedOnUnsupportedCallsNamesTheReason) {
  auto expect_error = [&](GemmArgs g, const char* part) {
    SCOPED_TRACE(part);
    try {
      gemm(g);
      ADD_FAILURE() << "expected an error";
    } catch (const RuntimeError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("backend TURBO"), std::string::npos) << w;
      EXPECT_NE(w.find(part), std::string::npos) << w;
    }
  };
  // K = 700: a contiguous [1000, 700] bf16 A has 1400-byte rows, not a multiple of 16.
  Mat a = operand(DType::BF16, 1000, 700, false), b = operand(DType::BF16, 700, 1504, false);
  TensorView d = make(DType::BF16, {1000, 1504});
  GemmArgs g = args(a.view, b.view, d);
  g.ctx = ctx;
  expect_error(g, "A's leading dimension 700 is not a multiple of 8");

  Mat a2 = operand(DType::BF16, 128, 64, false), b2 = operand(DType::BF16, 64, 128, false);
  TensorView d2 = make(DType::BF16, {128, 128}), aux = make(DType::BF16, {128, 128});
  GemmArgs h = args(a2.view, b2.view, d2);
  h.ctx = ctx;
  TensorView dbias = make(DType::BF16, {128});
  h.epilogue = GemmEpilogue::DGeluBGrad;
  h.aux = aux;
  h.bias = dbias;
  expect_error(h, "epilogue dgelu_bgrad");

  Mat a3 = operand(DType::F32, 64, 64, false), b3 = operand(DType::F32, 64, 64, false);
  TensorView d3 = make(DType::F32, {64, 64});
  GemmArgs f = args(a3.view, b3.view, d3);
  f.ctx = ctx;
  expect_error(f, "A and B are f32");

  GlobalBackendManager::instance().reset();
  EXPECT_EQ(gemm(g), BackendType::CUBLASLT);
  EXPECT_EQ(gemm(h), BackendType::CUBLASLT);
}

// Autotune times every capable backend by running it several times; a beta = 1 accumulation
// must still happen exactly once.
TEST_P(TurboGemmTest, AutotuneOfAnAccumulatingGemmAccumulatesOnce) {
  GlobalBackendManager::instance().reset();
  GlobalBackendManager::instance().set_auto_tune(true);
  const int64_t M = 256, N = 256, K = 512;
  Mat a = operand(DType::BF16, M, K, true), b = operand(DType::BF16, K, N, false);
  TensorView d = make(DType::F32, {M, N});
  auto d0 = random_tensor(d);
  GemmArgs g = args(a.view, b.view, d);
  g.beta = 1.0f;
  g.ctx = ctx;
  const BackendType chosen = gemm(g);
  EXPECT_TRUE(chosen == BackendType::TURBO || chosen == BackendType::CUBLASLT) << backend_name(chosen);
  auto want = product(a.values, b.values, M, N, K);
  for (size_t i = 0; i < want.size(); ++i) want[i] += d0[i];
  EXPECT_LT(rel_err(get(d), want), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Schedules, TurboGemmTest,
                         ::testing::Values(cuda::GemmSm90Schedule::Coop, cuda::GemmSm90Schedule::Pingpong),
                         [](const ::testing::TestParamInfo<cuda::GemmSm90Schedule>& i) {
                           return std::string(cuda::gemm_sm90_schedule_name(i.param));
                         });

TEST_F(GemmTest, ForcedCpuBackendOnDeviceTensorsIsAnError) {
  Mat a = operand(DType::BF16, 32, 32, false), b = operand(DType::BF16, 32, 32, false);
  TensorView d = make(DType::BF16, {32, 32});
  GlobalBackendManager::instance().set_backend("gemm", BackendType::CPU);
  GemmArgs g = args(a.view, b.view, d);
  g.ctx = ctx;
  try {
    gemm(g);
    ADD_FAILURE() << "expected an error";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("'gemm': backend CPU"), std::string::npos) << e.what();
  }
  GlobalBackendManager::instance().reset();
}

TEST_F(GemmTest, MismatchedShapesNameTheOperands) {
  Mat a = operand(DType::BF16, 32, 48, false), b = operand(DType::BF16, 40, 32, false);
  TensorView d = make(DType::BF16, {32, 32});
  GemmArgs g = args(a.view, b.view, d);
  try {
    gemm(g);
    ADD_FAILURE();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("do not chain"), std::string::npos) << e.what();
  }
}

TEST_F(GemmTest, CudaCheckNamesCallAndLocation) {
  try {
    CUDA_CHECK(cudaSetDevice(12345));
    ADD_FAILURE();
  } catch (const RuntimeError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("cudaSetDevice(12345)"), std::string::npos) << w;
    EXPECT_NE(w.find("gemm_test.cpp"), std::string::npos) << w;
  }
}

}  // namespace
}  // namespace primus::turbo::testing
