// RoPE, embeddings and the fused cross-entropy on the device (TURBO) against the CPU reference.
#include <gtest/gtest.h>

#include <algorithm>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/embedding.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/rope.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/loss.h"
#include "turbo/ops/rope.h"

namespace primus::turbo::testing {
namespace {

class RopeTest : public GpuDTypeTest {};

TEST_P(RopeTest, ForwardBackwardWithAndWithoutPositions) {
  const DType dt = GetParam();
  const int64_t B = 2, T = 96, H = 6, D = 64, max_pos = 4096;  // H: a partial group of 4 heads
  const double base = 500000.0;
  TensorView table = make(DType::F32, {max_pos, D / 2, 2});
  rope_build_table(table, base, ctx);
  TensorView x = make(dt, {B, T, H, D}), y = make(dt, {B, T, H, D}), dx = make(dt, {B, T, H, D});
  TensorView pos = make(DType::I32, {B, T});
  auto xv = random_tensor(x);
  auto posv = randint(B * T, 0, static_cast<int32_t>(max_pos));  // large positions stress the angles
  put_i32(pos, posv);
  for (bool with_pos : {false, true}) {
    SCOPED_TRACE(with_pos ? "explicit positions" : "pos = t");
    RopeArgs a;
    a.out = y; a.inp = x; a.table = table; a.base = base; a.ctx = ctx;
    if (with_pos) a.positions = pos;
    poison(y);
    EXPECT_EQ(rope(a), BackendType::TURBO);
    std::vector<float> ry(xv.size()), rdx(xv.size(), 0.0f);
    const int32_t* p = with_pos ? posv.data() : nullptr;
    cpu::rope_forward(ry.data(), xv.data(), p, B, T, H, D, base);
    EXPECT_LT(rel_err(get(y), ry), gate(dt));
    // Backward of the forward's output returns the input (orthogonal rotation) and matches the reference.
    RopeArgs bw = a;
    bw.backward = true;
    bw.inp = y;
    bw.out = dx;
    poison(dx);
    rope(bw);
    auto yv = get(y);
    cpu::rope_backward(rdx.data(), yv.data(), p, B, T, H, D, base);
    EXPECT_LT(rel_err(get(dx), rdx), gate(dt));
    EXPECT_LT(rel_err(get(dx), xv), 2 * gate(dt));
  }
}

// q|k as the first columns of a packed [B,T,(H+KV+KV)*D] q|k|v projection (the CUDA model's
// layout): the forward rotates them in place through a strided view and leaves the v columns
// alone; the backward reads a dense dq|dk and writes the strided view. Both equal the dense op.
TEST_P(RopeTest, StridedTokenRowsMatchDense) {
  const DType dt = GetParam();
  const int64_t B = 2, T = 80, HQK = 6, KV = 2, D = 64, W = (HQK + KV) * D, max_pos = 512;
  TensorView table = make(DType::F32, {max_pos, D / 2, 2});
  rope_build_table(table, 10000.0, ctx);
  TensorView packed = make(dt, {B, T, W}), x = make(dt, {B, T, HQK, D}), y = make(dt, {B, T, HQK, D});
  const auto pv = random_tensor(packed);
  const auto es = static_cast<int64_t>(dtype_size(dt));
  auto strided = [&](const TensorView& p) {
    TensorView v(p.data, dt, Device::CUDA, {B, T, HQK, D});
    v.strides = {T * W, W, D, 1};
    return v;
  };
  // x = the q|k columns, dense; y = RoPE(x), the dense op's answer.
  CUDA_CHECK(cudaMemcpy2D(x.data, size_t(HQK * D * es), packed.data, size_t(W * es), size_t(HQK * D * es), size_t(B * T),
                          cudaMemcpyDeviceToDevice));
  RopeArgs a;
  a.out = y, a.inp = x, a.table = table, a.ctx = ctx;
  rope(a);
  RopeArgs s = a;
  s.out = s.inp = strided(packed);
  EXPECT_EQ(rope(s), BackendType::TURBO);
  const auto got = get(packed), want = get(y);
  int64_t bad_rot = 0, bad_v = 0;
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < W; ++j) {
      const float g = got[size_t(r * W + j)];
      if (j < HQK * D)
        bad_rot += g != want[size_t(r * HQK * D + j)];
      else
        bad_v += g != pv[size_t(r * W + j)];
    }
  EXPECT_EQ(bad_rot, 0) << "strided forward differs from the dense one";
  EXPECT_EQ(bad_v, 0) << "columns outside the view changed";
  // Backward: dense dout -> strided dinp.
  TensorView dx = make(dt, {B, T, HQK, D});
  RopeArgs bd = a;
  bd.backward = true, bd.inp = y, bd.out = dx;
  rope(bd);
  poison(packed);
  RopeArgs bs = bd;
  bs.out = strided(packed);
  rope(bs);
  const auto gb = get(packed), wb = get(dx);
  int64_t bad_b = 0;
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < HQK * D; ++j) bad_b += gb[size_t(r * W + j)] != wb[size_t(r * HQK * D + j)];
  EXPECT_EQ(bad_b, 0) << "strided backward differs from the dense one";
}

INSTANTIATE_TEST_SUITE_P(Turbo, RopeTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

class EmbeddingTest : public GpuDTypeTest {};

TEST_P(EmbeddingTest, ForwardAndDeterministicBackward) {
  const DType dt = GetParam();
  const int64_t B = 4, T = 160, C = 256, V = 50, max_pos = 256;  // few ids: many repeats per row
  TensorView wte = make(dt, {V, C}), wpe = make(dt, {max_pos, C}), out = make(dt, {B, T, C});
  TensorView tok = make(DType::I32, {B, T});
  auto wtev = random_tensor(wte), wpev = random_tensor(wpe);
  auto tokv = randint(B * T, 0, static_cast<int32_t>(V));
  put_i32(tok, tokv);
  poison(out);
  EmbeddingArgs f;
  f.out = out; f.tokens = tok; f.wte = wte; f.wpe = wpe; f.ctx = ctx;
  EXPECT_EQ(embedding_forward(f), BackendType::TURBO);
  std::vector<float> rout(static_cast<size_t>(B * T * C));
  cpu::embedding_forward(rout.data(), tokv.data(), static_cast<const int32_t*>(nullptr), wtev.data(), wpev.data(), B,
                         T, C, V, max_pos);
  EXPECT_LT(rel_err(get(out), rout), gate(dt));

  TensorView dout = make(dt, {B, T, C}), dwte = make(DType::F32, {V, C}), dwpe = make(DType::F32, {max_pos, C});
  auto doutv = random_tensor(dout), dwte0 = random_tensor(dwte), dwpe0 = random_tensor(dwpe);
  EmbeddingArgs b;
  b.dout = dout; b.dwte = dwte; b.dwpe = dwpe; b.tokens = tok; b.ctx = ctx;
  EXPECT_EQ(embedding_backward(b), BackendType::TURBO);
  std::vector<float> rdwte = dwte0, rdwpe = dwpe0;
  cpu::embedding_backward(rdwte.data(), rdwpe.data(), doutv.data(), tokv.data(), static_cast<const int32_t*>(nullptr),
                          B, T, C, V, max_pos);
  EXPECT_LT(rel_err(get(dwte), rdwte), 1e-5);
  EXPECT_LT(rel_err(get(dwpe), rdwpe), 1e-5);
  auto first = bytes(dwte);
  put(dwte, dwte0);
  put(dwpe, dwpe0);
  embedding_backward(b);
  EXPECT_EQ(bytes(dwte), first) << "the backward must be bitwise deterministic";
}

INSTANTIATE_TEST_SUITE_P(Turbo, EmbeddingTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

class CrossEntropyTest : public GpuDTypeTest {};

TEST_P(CrossEntropyTest, InPlaceGradientLossAndPaddingMatchReference) {
  const DType dt = GetParam();
  const int64_t N = 70, V = 1003, Vp = 1024;  // padded row, real vocabulary not a multiple of 8
  TensorView logits = make(dt, {N, Vp}), tgt = make(DType::I32, {N});
  TensorView losses = make(DType::F32, {N}), lse = make(DType::F32, {N});
  auto lv = random_tensor(logits, 3.0f);
  auto tv = randint(N, 0, static_cast<int32_t>(V));
  tv[3] = cpu::kIgnoreIndex;
  tv[17] = cpu::kIgnoreIndex;
  put_i32(tgt, tv);
  poison(losses);
  poison(lse);
  const float dloss = 1.0f / static_cast<float>(N - 2);
  CrossEntropyArgs a;
  a.logits = logits; a.dlogits = logits; a.losses = losses; a.lse = lse; a.targets = tgt;
  a.vocab = V; a.dloss = dloss; a.ctx = ctx;
  EXPECT_EQ(cross_entropy(a), BackendType::TURBO);
  // Reference on the unpadded [N, V] logits.
  std::vector<float> compact(static_cast<size_t>(N * V));
  for (int64_t i = 0; i < N; ++i) std::copy_n(lv.begin() + i * Vp, V, compact.begin() + i * V);
  std::vector<float> rloss(N), rlse(N), rgrad(compact.size());
  cpu::cross_entropy_forward(rloss.data(), rlse.data(), compact.data(), tv.data(), N, V);
  cpu::cross_entropy_backward(rgrad.data(), compact.data(), rlse.data(), tv.data(), N, V, dloss);
  EXPECT_LT(rel_err(get(losses), rloss), 1e-5);
  EXPECT_LT(rel_err(get(lse), rlse), 1e-5);
  auto g = get(logits);
  std::vector<float> gc(compact.size());
  float pad_max = 0.0f;
  for (int64_t i = 0; i < N; ++i) {
    std::copy_n(g.begin() + i * Vp, V, gc.begin() + i * V);
    for (int64_t j = V; j < Vp; ++j) pad_max = std::max(pad_max, std::fabs(g[i * Vp + j]));
  }
  EXPECT_LT(rel_err(gc, rgrad), gate(dt));
  EXPECT_EQ(pad_max, 0.0f) << "padding columns get zero gradient";
  for (int64_t j = 0; j < V; ++j) ASSERT_EQ(gc[3 * V + j], 0.0f) << "ignored rows get zero gradient";

  TensorView sum = make(DType::F32, {1});
  sum_f32(sum, losses, ctx);
  double rsum = 0.0;
  for (float l : rloss) rsum += l;
  EXPECT_NEAR(get(sum)[0], rsum, 1e-4 * std::fabs(rsum));
}

INSTANTIATE_TEST_SUITE_P(Turbo, CrossEntropyTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

}  // namespace
}  // namespace primus::turbo::testing
