// The per-head RMSNorm (Qwen3's query/key norms) on the device (TURBO) against the CPU
// reference: in place on the q|k columns of a packed q|k|v projection, the v columns untouched,
// forward, saved input and statistics, backward and both weight gradients, bitwise repeatable.
#include <gtest/gtest.h>

#include <vector>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/ops/head_norm.h"

namespace primus::turbo::testing {
namespace {

class HeadNormTest : public GpuDTypeTest {};

TEST_P(HeadNormTest, PackedQkColumnsMatchTheReference) {
  const DType dt = GetParam();
  // D = 128 (Qwen3) and an odd one below a warp's multiple; 3 query heads per key head.
  for (const int64_t D : {int64_t{128}, int64_t{40}}) {
    SCOPED_TRACE(fmt::format("D {}", D));
    const int64_t B = 3, T = 37, H = 6, KV = 2, Hx = H + KV, W = (H + 2 * KV) * D, N = B * T;
    TensorView packed = make(dt, {B, T, W}), saved = make(dt, {B, T, Hx, D}), rstd = make(DType::F32, {N * Hx});
    TensorView wq = make(dt, {D}), wk = make(dt, {D}), dwq = make(DType::F32, {D}), dwk = make(DType::F32, {D});
    const auto pv = random_tensor(packed, 2.0f);
    auto wqv = randn(D, 0.3f, dt), wkv = randn(D, 0.3f, dt);
    for (auto& w : wqv) w = round_to(dt, 1.0f + w);
    for (auto& w : wkv) w = round_to(dt, 1.0f + w);
    put(wq, wqv);
    put(wk, wkv);
    TensorView x(packed.data, dt, Device::CUDA, {B, T, Hx, D});
    x.strides = {T * W, W, D, 1};
    HeadNormArgs a;
    a.x = x, a.saved = saved, a.rstd = rstd, a.weight = wq, a.weight_k = wk, a.q_heads = H, a.eps = 1e-6f, a.ctx = ctx;
    poison(saved);
    poison(rstd);
    EXPECT_EQ(head_norm(a), BackendType::TURBO);
    // Reference on the dense q|k columns.
    std::vector<float> xin(size_t(N * Hx * D)), ry(xin.size()), rr(size_t(N * Hx));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Hx * D; ++j) xin[size_t(n * Hx * D + j)] = pv[size_t(n * W + j)];
    cpu::head_rmsnorm_forward(ry.data(), rr.data(), xin.data(), wqv.data(), wkv.data(), N, Hx, H, D, 1e-6);
    const auto got = get(packed);
    std::vector<float> gy(xin.size());
    int64_t v_changed = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < W; ++j) {
        if (j < Hx * D)
          gy[size_t(n * Hx * D + j)] = got[size_t(n * W + j)];
        else
          v_changed += got[size_t(n * W + j)] != pv[size_t(n * W + j)];
      }
    EXPECT_EQ(v_changed, 0) << "the v columns changed";
    EXPECT_LT(rel_err(gy, ry), gate(dt));
    EXPECT_EQ(get(saved), xin) << "saved is not the pre-norm input";
    EXPECT_LT(rel_err(get(rstd), rr), 1e-5);
    // Backward from a random d(out) placed in the q|k columns.
    const auto dyv = randn(N * Hx * D, 1.0f, dt);
    std::vector<float> dpacked = got;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Hx * D; ++j) dpacked[size_t(n * W + j)] = dyv[size_t(n * Hx * D + j)];
    auto run_backward = [&] {
      put(packed, dpacked);
      CUDA_CHECK(cudaMemset(dwq.data, 0, dwq.nbytes()));
      CUDA_CHECK(cudaMemset(dwk.data, 0, dwk.nbytes()));
      HeadNormArgs b = a;
      b.backward = true, b.dweight = dwq, b.dweight_k = dwk;
      EXPECT_EQ(head_norm(b), BackendType::TURBO);
      return std::vector<std::vector<uint8_t>>{bytes(packed), bytes(dwq), bytes(dwk)};
    };
    const auto first = run_backward();
    std::vector<float> rdx(xin.size(), 0.0f), rdwq(size_t(D), 0.0f), rdwk(size_t(D), 0.0f);
    cpu::head_rmsnorm_backward(rdx.data(), rdwq.data(), rdwk.data(), dyv.data(), xin.data(), wqv.data(), wkv.data(),
                               rr.data(), N, Hx, H, D);
    const auto gb = get(packed);
    std::vector<float> gdx(xin.size());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Hx * D; ++j) gdx[size_t(n * Hx * D + j)] = gb[size_t(n * W + j)];
    EXPECT_LT(rel_err(gdx, rdx), gate(dt));
    EXPECT_LT(rel_err(get(dwq), rdwq), 1e-4);
    EXPECT_LT(rel_err(get(dwk), rdwk), 1e-4);
    EXPECT_TRUE(run_backward() == first) << "the backward is not bitwise repeatable";
  }
}

INSTANTIATE_TEST_SUITE_P(Turbo, HeadNormTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

}  // namespace
}  // namespace primus::turbo::testing
