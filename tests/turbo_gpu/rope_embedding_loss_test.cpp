// RoPE, embeddings and the fused cross-entropy on the device (TURBO) against the CPU reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/embedding.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/rope.h"
#include "turbo/kernels/cuda/cross_entropy.h"
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

class EmbeddingTest : public GpuDTypeTest {
 protected:
  // The backward of `tokv` (uploaded in `tok`, [B, T]) from a random dout into random tables, against
  // the CPU reference (1e-5), then bitwise the same on a second run; returns dwte and its reference.
  std::pair<std::vector<float>, std::vector<float>> expect_backward(DType dt, const TensorView& tok,
                                                                    const std::vector<int32_t>& tokv, int64_t B,
                                                                    int64_t T, int64_t C, int64_t V, int64_t max_pos) {
    TensorView dout = make(dt, {B, T, C}), dwte = make(DType::F32, {V, C}), dwpe = make(DType::F32, {max_pos, C});
    auto doutv = random_tensor(dout), dwte0 = random_tensor(dwte), dwpe0 = random_tensor(dwpe);
    EmbeddingArgs b;
    b.dout = dout; b.dwte = dwte; b.dwpe = dwpe; b.tokens = tok; b.ctx = ctx;
    EXPECT_EQ(embedding_backward(b), BackendType::TURBO);
    std::vector<float> rdwte = dwte0, rdwpe = dwpe0;
    cpu::embedding_backward(rdwte.data(), rdwpe.data(), doutv.data(), tokv.data(), static_cast<const int32_t*>(nullptr),
                            B, T, C, V, max_pos);
    auto got = get(dwte);
    EXPECT_LT(rel_err(got, rdwte), 1e-5);
    EXPECT_LT(rel_err(get(dwpe), rdwpe), 1e-5);
    const auto first = bytes(dwte);
    put(dwte, dwte0);
    put(dwpe, dwpe0);
    embedding_backward(b);
    EXPECT_EQ(bytes(dwte), first) << "the backward must be bitwise deterministic";
    return {std::move(got), std::move(rdwte)};
  }
};

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

  expect_backward(dt, tok, tokv, B, T, C, V, max_pos);
}

// Real text repeats a few tokens a lot (a newline is ~10% of tinyshakespeare's GPT-2 tokens): one
// id for 40% of 16k tokens, a second for 10%, the rest spread, at GPT-2's and Llama's widths and
// at a width whose vectors do not fill the thread groups. Against the CPU reference, and bitwise
// the same on a second run.
TEST_P(EmbeddingTest, LongRunsOfOneTokenMatchReferenceAndAreDeterministic) {
  const DType dt = GetParam();
  for (const int64_t C : {int64_t{768}, int64_t{2048}, int64_t{200}}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    const int64_t B = 16, T = 1024, V = 1000, max_pos = 1024;
    TensorView tok = make(DType::I32, {B, T});
    auto tokv = randint(B * T, 2, static_cast<int32_t>(V));
    auto pick = randint(B * T, 0, 100);
    for (size_t i = 0; i < tokv.size(); ++i) tokv[i] = pick[i] < 40 ? 7 : pick[i] < 50 ? 1 : tokv[i];
    put_i32(tok, tokv);
    const auto [got, rdwte] = expect_backward(dt, tok, tokv, B, T, C, V, max_pos);
    // The long run's row on its own (a wrong split of the run shows here first), against the row's
    // largest value: f32 sums of 6.5k terms in another order differ by rounding (bf16 terms: exact).
    double worst = 0, scale = 0;
    for (int64_t c = 0; c < C; ++c) {
      worst = std::max(worst, std::fabs(double(got[7 * C + c]) - rdwte[7 * C + c]));
      scale = std::max(scale, std::fabs(double(rdwte[7 * C + c])));
    }
    EXPECT_LT(worst, 2e-5 * scale) << "token 7 (6.5k rows)";
  }
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

// eod_mask_loss on the device: count_kept counts the targets that keep a loss, and a kernel given
// that count (kept) scales its gradient by dloss / kept, a number the host does not have when a
// captured step replays. Each kernel that writes the gradient (the on-chip one, streamed over
// clusters for Llama-3's 128k row; the legacy one; the vocabulary-parallel one) gives the gradient
// of dloss / kept passed as a number (within one rounding of its dtype) and the same losses; the
// loss sum scales by numerator / kept.
class CrossEntropyKeptTest : public GpuTest {
 protected:
  // One rank's statistics [N, 3] as the group's [1, N, 3].
  static TensorView view_as_all(const TensorView& stats, int64_t N) {
    return TensorView(stats.data, DType::F32, stats.device, {1, N, 3});
  }
};

TEST_F(CrossEntropyKeptTest, DeviceCountScalesTheGradientAsTheNumberWould) {
  for (const auto& [N, V] : {std::pair<int64_t, int64_t>{37, 50304}, {13, 128256}}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    const DType dt = DType::BF16;
    TensorView logits = make(dt, {N, V}), g_num = make(dt, {N, V}), g_dev = make(dt, {N, V});
    TensorView l_num = make(DType::F32, {N}), l_dev = make(DType::F32, {N}), tgt = make(DType::I32, {N});
    TensorView kept = make(DType::F32, {1}), sum = make(DType::F32, {1});
    random_tensor(logits, 3.0f);
    auto tv = randint(N, 0, static_cast<int32_t>(V));
    for (int64_t i = 0; i < N; i += 3) tv[size_t(i)] = cpu::kIgnoreIndex;  // every third row masked
    put_i32(tgt, tv);
    int64_t want_kept = 0;
    for (int32_t t : tv) want_kept += t != cpu::kIgnoreIndex;
    poison(kept);
    count_kept(kept, tgt, cpu::kIgnoreIndex, ctx);
    ASSERT_EQ(get(kept)[0], static_cast<float>(want_kept));

    const float dloss = 0.5f;  // e.g. 1 / accumulation steps, for the mean over the kept rows
    for (bool legacy : {false, true}) {
      SCOPED_TRACE(legacy ? "legacy kernel" : "default kernel");
      CrossEntropyArgs a;
      a.logits = logits; a.targets = tgt; a.ctx = ctx; a.legacy_kernel = legacy;
      CrossEntropyArgs b = a;
      a.dlogits = g_num; a.losses = l_num; a.dloss = dloss / static_cast<float>(want_kept);
      b.dlogits = g_dev; b.losses = l_dev; b.dloss = dloss; b.kept = kept;
      for (auto* t : {&g_num, &g_dev, &l_num, &l_dev}) poison(*t);
      cross_entropy(a);
      cross_entropy(b);
      EXPECT_TRUE(bytes(l_num) == bytes(l_dev)) << "the losses do not depend on the scale";
      const auto x = get(g_num), y = get(g_dev);
      int64_t bad = 0;
      double largest = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        largest = std::max(largest, double(std::fabs(y[i])));
        if (!(std::fabs(x[i] - y[i]) <= 8e-3f * std::fabs(x[i]) + 1e-12f) && bad++ < 5)
          ADD_FAILURE() << "element " << i << ": " << y[i] << " want " << x[i];
      }
      EXPECT_EQ(bad, 0);
      EXPECT_GT(largest, 1e-3 * dloss / static_cast<double>(want_kept)) << "a gradient that is there";
    }
    // The loss sum over the kept rows' mean: sum x numerator / kept.
    sum_f32(sum, l_num, ctx, kept, static_cast<float>(N));
    double rsum = 0;
    for (float l : get(l_num)) rsum += l;
    EXPECT_NEAR(get(sum)[0], rsum * double(N) / double(want_kept), 1e-5 * rsum * double(N) / double(want_kept));

    // The vocabulary-parallel loss (one rank: its statistics are all of them).
    TensorView stats = make(DType::F32, {N, 3}), lv = make(dt, {N, V}), ln = make(DType::F32, {N});
    auto vp = [&](const TensorView& out_logits, float d, const TensorView& k) {
      CUDA_CHECK(cudaMemcpy(out_logits.data, logits.data, logits.nbytes(), cudaMemcpyDeviceToDevice));
      VocabParallelCrossEntropyArgs v;
      v.logits = out_logits; v.targets = tgt; v.stats = stats; v.all_stats = view_as_all(stats, N);
      v.losses = ln; v.vocab = V; v.vocab_begin = 0; v.global_vocab = V; v.dloss = d; v.kept = k; v.ctx = ctx;
      vocab_parallel_ce_stats(v);
      vocab_parallel_ce_finish(v);
    };
    vp(g_num, dloss / static_cast<float>(want_kept), {});
    vp(lv, dloss, kept);
    const auto x = get(g_num), y = get(lv);
    int64_t bad = 0;
    for (size_t i = 0; i < x.size(); ++i)
      if (!(std::fabs(x[i] - y[i]) <= 8e-3f * std::fabs(x[i]) + 1e-12f) && bad++ < 5)
        ADD_FAILURE() << "vocabulary-parallel element " << i << ": " << y[i] << " want " << x[i];
    EXPECT_EQ(bad, 0);
  }
}

// ---- the on-chip bf16 kernel (row in shared memory; clusters for large rows) ------------------
// Shapes chosen to reach every cluster size on an sm_90 device with 228 KB of shared memory per
// SM (H100, H200): `cluster` is what cross_entropy_onchip_cluster must answer there.
struct CeShape {
  const char* name;
  int64_t N, V, Vp;
  int cluster;
};
const CeShape kCeShapes[] = {
    {"gpt2_n1", 1, 50257, 50304, 1},      {"gpt2", 37, 50257, 50304, 1},
    {"v_odd_vp8", 9, 50257, 50264, 1},    // V not a multiple of 8, Vp = V rounded up to 8
    {"llama3_n1", 1, 128256, 128256, 4},  {"llama3", 13, 128256, 128256, 4},
    {"llama2", 65, 32000, 32000, 1},      {"v1000", 129, 1000, 1000, 1},
    {"v1003", 33, 1003, 1008, 1},         {"cluster2", 5, 99999, 100000, 2},
    {"cluster2_padded_rank", 4, 49999, 100000, 2},  // rank 1 holds padding only
    {"cluster8", 3, 256000, 256000, 8},
    // More rows than clusters fit the device at once: the streamed kernel's clusters take several
    // rows each through both of their row buffers.
    {"llama3_many_rows", 300, 128256, 128256, 4},
    {"cluster2_many_rows", 190, 99999, 100000, 2},
};
void PrintTo(const CeShape& s, std::ostream* os) {
  *os << s.name << " N=" << s.N << " V=" << s.V << " Vp=" << s.Vp << " cluster=" << s.cluster;
}

class CrossEntropyOnChipTest : public GpuTest, public ::testing::WithParamInterface<CeShape> {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    const CeShape& s = GetParam();
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    const int cluster = cuda::cross_entropy_onchip_cluster(DType::BF16, s.Vp);
    if (major * 10 + minor == 90)
      EXPECT_EQ(cluster, s.cluster) << "the on-chip kernel's cluster size for Vp=" << s.Vp;
    else
      std::printf("[ note ] compute capability %d.%d: on-chip cluster size %d for Vp=%lld\n", major, minor, cluster,
                  static_cast<long long>(s.Vp));
    slice_cols_ = cluster > 0 ? (s.Vp / 8 + cluster - 1) / cluster * 8 : s.Vp;
  }

  // Targets: special rows first (last and first class, ignored, out of range above and below, the
  // two sides of a cluster rank boundary), then random classes.
  std::vector<int32_t> make_targets(const CeShape& s) {
    auto t = randint(s.N, 0, static_cast<int32_t>(s.V));
    const int32_t V = static_cast<int32_t>(s.V), b = static_cast<int32_t>(std::min<int64_t>(slice_cols_, s.V - 1));
    const int32_t special[] = {V - 1, cpu::kIgnoreIndex, 0, V, b - 1, b, -1, cpu::kIgnoreIndex};
    for (int64_t i = 0; i < s.N && i < 8; ++i) t[size_t(i)] = special[i];
    return t;
  }
  // normal * 3 logits; the padding columns hold 30 (any of them counted in the softmax would move
  // the lse by ~15); the last row (N > 2) is shifted by +40 (the max subtraction matters).
  std::vector<float> make_logits(const CeShape& s, const TensorView& logits) {
    auto v = randn(s.N * s.Vp, 3.0f, DType::BF16);
    for (int64_t i = 0; i < s.N; ++i)
      for (int64_t j = 0; j < s.Vp; ++j) {
        float& x = v[size_t(i * s.Vp + j)];
        if (j >= s.V) x = 30.0f;
        else if (s.N > 2 && i == s.N - 1) x = round_to(DType::BF16, x + 40.0f);
      }
    put(logits, v);
    return v;
  }
  static bool is_bad(int32_t t, int64_t V) { return t != cpu::kIgnoreIndex && (t < 0 || t >= V); }

  int64_t slice_cols_ = 0;
};

TEST_P(CrossEntropyOnChipTest, MatchesReference) {
  const CeShape s = GetParam();
  const int64_t N = s.N, V = s.V, Vp = s.Vp;
  const DType dt = DType::BF16;
  TensorView logits = make(dt, {N, Vp}), grad = make(dt, {N, Vp}), tgt = make(DType::I32, {N});
  TensorView losses = make(DType::F32, {N}), lse = make(DType::F32, {N});
  const auto tv = make_targets(s);
  put_i32(tgt, tv);
  const float dloss = 1.0f / static_cast<float>(N + 1);

  // Reference (the CPU one throws on a bad target: those rows are computed as ignored, and their
  // expected gradient, dloss * softmax with no one-hot, as the legacy kernel writes, is built here).
  auto lv = make_logits(s, logits);
  std::vector<int32_t> rt = tv;
  for (auto& t : rt)
    if (is_bad(t, V)) t = cpu::kIgnoreIndex;
  std::vector<float> compact(static_cast<size_t>(N * V));
  for (int64_t i = 0; i < N; ++i) std::copy_n(lv.begin() + i * Vp, V, compact.begin() + i * V);
  std::vector<float> rloss(N), rlse(N), rgrad(compact.size());
  cpu::cross_entropy_forward(rloss.data(), rlse.data(), compact.data(), rt.data(), N, V);
  cpu::cross_entropy_backward(rgrad.data(), compact.data(), rlse.data(), rt.data(), N, V, dloss);
  for (int64_t i = 0; i < N; ++i)
    if (is_bad(tv[size_t(i)], V))
      for (int64_t j = 0; j < V; ++j)
        rgrad[size_t(i * V + j)] = static_cast<float>(dloss * std::exp(double(compact[size_t(i * V + j)]) - rlse[size_t(i)]));
  const auto logits_bytes = bytes(logits);

  auto check_stats = [&](bool want_losses, bool want_lse) {
    int64_t bad_loss = 0, bad_lse = 0;
    const auto gl = want_losses ? get(losses) : std::vector<float>{};
    const auto ge = want_lse ? get(lse) : std::vector<float>{};
    for (int64_t i = 0; i < N; ++i) {
      const int32_t t = tv[size_t(i)];
      if (want_losses) {
        const float g = gl[size_t(i)], r = rloss[size_t(i)];
        const bool ok = is_bad(t, V)                  ? std::isnan(g)
                        : t == cpu::kIgnoreIndex      ? g == 0.0f
                                                      : std::fabs(g - r) <= 1e-4f + 2e-6f * std::fabs(r);
        if (!ok && bad_loss++ < 5) ADD_FAILURE() << "row " << i << " target " << t << ": loss " << g << " want " << r;
      }
      if (want_lse) {
        const float g = ge[size_t(i)], r = rlse[size_t(i)];
        if (!(std::fabs(g - r) <= 1e-4f + 2e-6f * std::fabs(r)) && bad_lse++ < 5)
          ADD_FAILURE() << "row " << i << ": lse " << g << " want " << r;
      }
    }
    EXPECT_EQ(bad_loss, 0);
    EXPECT_EQ(bad_lse, 0);
  };
  auto check_grad = [&](const TensorView& out) {
    const auto g = get(out);
    int64_t bad = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int32_t t = tv[size_t(i)];
      for (int64_t j = 0; j < Vp; ++j) {
        const float x = g[size_t(i * Vp + j)];
        bool ok;
        float r = 0.0f;
        if (j >= V || t == cpu::kIgnoreIndex) {
          ok = x == 0.0f;  // padding and ignored rows: exactly 0
        } else {
          r = rgrad[size_t(i * V + j)];
          const float tol = 5e-3f * std::fabs(r) + (j == t ? 1e-5f * dloss : 0.0f);
          ok = std::fabs(x - r) <= tol;
        }
        if (!ok && bad++ < 8) ADD_FAILURE() << "row " << i << " col " << j << " target " << t << ": " << x << " want " << r;
      }
    }
    EXPECT_EQ(bad, 0) << "gradient elements off";
  };

  CrossEntropyArgs a;
  a.logits = logits; a.targets = tgt; a.vocab = V; a.dloss = dloss; a.ctx = ctx;
  {
    SCOPED_TRACE("out of place, losses only");
    CrossEntropyArgs o = a;
    o.dlogits = grad; o.losses = losses;
    poison(grad); poison(losses); poison(lse);
    EXPECT_EQ(cross_entropy(o), BackendType::TURBO);
    check_stats(true, false);
    EXPECT_TRUE(std::isnan(get(lse)[0])) << "lse was not asked for";
    check_grad(grad);
    EXPECT_TRUE(bytes(logits) == logits_bytes) << "out of place: the logits must not change";
  }
  {
    SCOPED_TRACE("no gradient, lse only");
    CrossEntropyArgs o = a;
    o.lse = lse;
    poison(losses); poison(lse);
    cross_entropy(o);
    check_stats(false, true);
    EXPECT_TRUE(bytes(logits) == logits_bytes) << "no gradient: the logits must not change";
  }
  {
    SCOPED_TRACE("in place, losses and lse");
    CrossEntropyArgs o = a;
    o.dlogits = logits; o.losses = losses; o.lse = lse;
    poison(losses); poison(lse);
    cross_entropy(o);
    check_stats(true, true);
    check_grad(logits);
  }
}

// The on-chip kernel against the legacy one on the same inputs (both out of place): the same
// losses and lse up to f32 rounding, gradients within one bf16 rounding; and run twice, bitwise
// the same (no atomics; fixed reduction order).
TEST_P(CrossEntropyOnChipTest, AgreesWithLegacyKernelAndIsDeterministic) {
  const CeShape s = GetParam();
  const int64_t N = s.N, V = s.V, Vp = s.Vp;
  const DType dt = DType::BF16;
  TensorView logits = make(dt, {N, Vp}), tgt = make(DType::I32, {N});
  TensorView g_new = make(dt, {N, Vp}), g_old = make(dt, {N, Vp});
  TensorView l_new = make(DType::F32, {N}), l_old = make(DType::F32, {N});
  TensorView e_new = make(DType::F32, {N}), e_old = make(DType::F32, {N});
  const auto tv = make_targets(s);
  put_i32(tgt, tv);
  make_logits(s, logits);
  const float dloss = 0.5f / static_cast<float>(N);
  CrossEntropyArgs a;
  a.logits = logits; a.targets = tgt; a.vocab = V; a.dloss = dloss; a.ctx = ctx;
  a.dlogits = g_new; a.losses = l_new; a.lse = e_new;
  CrossEntropyArgs b = a;
  b.dlogits = g_old; b.losses = l_old; b.lse = e_old; b.legacy_kernel = true;
  for (auto* t : {&g_new, &g_old, &l_new, &l_old, &e_new, &e_old}) poison(*t);
  cross_entropy(b);
  cross_entropy(a);
  // Losses and lse equal up to f32 rounding, gradients within one bf16 rounding.
  auto expect_agree = [&](const char* what) {
    const auto gn = get(g_new), go = get(g_old), ln = get(l_new), lo = get(l_old), en = get(e_new), eo = get(e_old);
    int64_t bad_stats = 0, bad_grad = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int32_t t = tv[size_t(i)];
      const bool loss_ok = is_bad(t, V) ? std::isnan(ln[size_t(i)]) && std::isnan(lo[size_t(i)])
                                        : std::fabs(ln[size_t(i)] - lo[size_t(i)]) <= 1e-4f + 2e-6f * std::fabs(lo[size_t(i)]);
      const bool lse_ok = std::fabs(en[size_t(i)] - eo[size_t(i)]) <= 1e-4f + 2e-6f * std::fabs(eo[size_t(i)]);
      if ((!loss_ok || !lse_ok) && bad_stats++ < 5)
        ADD_FAILURE() << "row " << i << ": loss " << ln[size_t(i)] << " vs " << what << " " << lo[size_t(i)] << ", lse "
                      << en[size_t(i)] << " vs " << eo[size_t(i)];
      for (int64_t j = 0; j < Vp; ++j) {
        const float x = gn[size_t(i * Vp + j)], y = go[size_t(i * Vp + j)];
        const float tol = 8e-3f * std::max(std::fabs(x), std::fabs(y)) + (j == t ? 1e-5f * dloss : 0.0f);
        if (!(std::fabs(x - y) <= tol) && bad_grad++ < 8)
          ADD_FAILURE() << "row " << i << " col " << j << ": grad " << x << " vs " << what << " " << y;
      }
    }
    EXPECT_EQ(bad_stats, 0) << what;
    EXPECT_EQ(bad_grad, 0) << what;
  };
  expect_agree("legacy");

  const auto first_g = bytes(g_new), first_l = bytes(l_new), first_e = bytes(e_new);
  for (auto* t : {&g_new, &l_new, &e_new}) poison(*t);
  cross_entropy(a);
  EXPECT_TRUE(bytes(g_new) == first_g) << "gradient not bitwise reproducible";
  EXPECT_TRUE(bytes(l_new) == first_l) << "losses not bitwise reproducible";
  EXPECT_TRUE(bytes(e_new) == first_e) << "lse not bitwise reproducible";

  // Rows over a cluster run the streamed kernel by default (its own cluster size, hence slices and
  // order of additions): it agrees with one cluster per row as the on-chip kernel agrees with the
  // legacy one.
  if (s.cluster > 1) {
    CrossEntropyArgs o = a;
    o.dlogits = g_old; o.losses = l_old; o.lse = e_old; o.one_row_per_cluster = true;
    for (auto* t : {&g_old, &l_old, &e_old}) poison(*t);
    cross_entropy(o);
    expect_agree("one cluster per row");
  }
}

INSTANTIATE_TEST_SUITE_P(Turbo, CrossEntropyOnChipTest, ::testing::ValuesIn(kCeShapes),
                         [](const ::testing::TestParamInfo<CeShape>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace primus::turbo::testing
