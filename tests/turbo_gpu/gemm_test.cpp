// GEMM on the device (CUBLASLT backend) against a double-precision host product and against
// the CPU reference kernels (matmul_forward/backward) for the linear-layer helpers.
#include <gtest/gtest.h>

#include "gpu_fixture.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"
#include "turbo/ops/gemm.h"

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
