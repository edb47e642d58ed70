#include "turbo/kernels/cpu/attention.h"

#include <omp.h>

#include <cmath>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct AttnCfg {
  AttentionParams p;
  std::vector<int32_t> cu;  // empty: whole rows
};

// Direct O(T^2) attention in double: which keys a query sees is decided per (query, key) pair
// from document ids, independently of how the kernel walks segments.
void naive_attention(std::vector<double>& out, std::vector<double>& lse,
                     const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, const AttnCfg& c) {
  const AttentionParams& p = c.p;
  std::vector<int> doc(p.B * p.T, 0);
  for (size_t d = 0; d + 1 < c.cu.size(); ++d)
    for (int32_t t = c.cu[d]; t < c.cu[d + 1]; ++t) doc[t] = static_cast<int>(d);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t) doc[b * p.T + t] += static_cast<int>(b * 1000);
  out.assign(p.B * p.T * p.H * p.D, 0.0);
  lse.assign(p.B * p.H * p.T, 0.0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t g = h / (p.H / p.KVH);
      for (int64_t i = 0; i < p.T; ++i) {
        std::vector<double> s(p.T, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < p.T; ++j) {
          if (doc[b * p.T + j] != doc[b * p.T + i] || (p.causal && j > i)) continue;
          if (p.window > 0 && i - j >= p.window) continue;  // transformers: kv_idx > q_idx - window
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d)
            dot +=
                q[((b * p.T + i) * p.H + h) * p.D + d] * k[((b * p.T + j) * p.KVH + g) * p.D + d];
          s[j] = dot * p.scale();
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < p.T; ++j) sum += std::exp(s[j] - m);
        lse[(b * p.H + h) * p.T + i] = m + std::log(sum);
        for (int64_t j = 0; j < p.T; ++j) {
          const double w = std::exp(s[j] - m) / sum;
          for (int64_t d = 0; d < p.D; ++d)
            out[((b * p.T + i) * p.H + h) * p.D + d] +=
                w * v[((b * p.T + j) * p.KVH + g) * p.D + d];
        }
      }
    }
}

template <typename Real>
struct AttentionOp {
  AttnCfg c;
  std::vector<Real> lse, out_saved;
  explicit AttentionOp(const AttnCfg& cfg) : c(cfg), lse(c.p.B * c.p.H * c.p.T) {
    c.p.cu_seqlens = c.cu.empty() ? nullptr : c.cu.data();
    c.p.num_docs = c.cu.empty() ? 0 : static_cast<int64_t>(c.cu.size()) - 1;
  }
  size_t q_size() const { return c.p.B * c.p.T * c.p.H * c.p.D; }
  size_t kv_size() const { return c.p.B * c.p.T * c.p.KVH * c.p.D; }
  std::vector<InputSpec> inputs() const {
    return {{"q", q_size(), -2, 2}, {"k", kv_size(), -2, 2}, {"v", kv_size()}};
  }
  size_t out_size() const { return q_size(); }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    attention_forward(out.data(), lse.data(), x[0].data(), x[1].data(), x[2].data(), c.p);
    out_saved = out;
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    attention_backward(dx[0].data(), dx[1].data(), dx[2].data(), dout.data(), x[0].data(),
                       x[1].data(), x[2].data(), out_saved.data(), lse.data(), c.p);
  }
};

AttnCfg cfg(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool causal,
            std::vector<int32_t> cu = {}, int64_t window = 0) {
  AttnCfg c;
  c.p.B = B, c.p.T = T, c.p.H = H, c.p.KVH = KVH, c.p.D = D, c.p.causal = causal;
  c.p.window = window;
  c.cu = std::move(cu);
  return c;
}

class AttentionTest : public OpTest {
 protected:
  void expect_matches_naive(const AttnCfg& c) {
    AttentionOp<double> op(c);
    Inputs<double> x;
    for (const InputSpec& s : op.inputs()) x.push_back(rng.vec(s.size, s.lo, s.hi));
    std::vector<double> out(op.out_size()), want_out, want_lse;
    op.forward(x, out);
    naive_attention(want_out, want_lse, x[0], x[1], x[2], c);
    EXPECT_LT(rel_error(out, want_out), 1e-12);
    EXPECT_LT(max_abs_diff(op.lse, want_lse), 1e-12);
  }
};

TEST_F(AttentionTest, MatchesNaiveMultiHeadCausal) {
  expect_matches_naive(cfg(2, 37, 3, 3, 8, true));
}
TEST_F(AttentionTest, MatchesNaiveGqaCausal) { expect_matches_naive(cfg(2, 70, 4, 2, 8, true)); }
TEST_F(AttentionTest, MatchesNaiveGqaNonCausal) {
  expect_matches_naive(cfg(2, 70, 4, 2, 8, false));
}
TEST_F(AttentionTest, MatchesNaiveMultiQuery) { expect_matches_naive(cfg(1, 40, 4, 1, 8, true)); }
TEST_F(AttentionTest, MatchesNaiveCustomScale) {
  AttnCfg c = cfg(1, 9, 2, 1, 4, true);
  c.p.softmax_scale = 0.37;
  expect_matches_naive(c);
}
TEST_F(AttentionTest, MatchesNaiveVarlen) {
  // Row 0 holds documents of 5 and 45 tokens (the second spans two query blocks); row 1 one
  // empty document, then 20 + 30. Causal and not.
  const std::vector<int32_t> cu{0, 5, 50, 50, 70, 100};
  expect_matches_naive(cfg(2, 50, 4, 2, 8, true, cu));
  expect_matches_naive(cfg(2, 50, 4, 2, 8, false, cu));
}

// Sliding window: query t sees keys t - window < j <= t. Windows of one key, shorter than the
// 32-row query block, equal to it, crossing block edges, and at least T (no effect).
TEST_F(AttentionTest, MatchesNaiveSlidingWindow) {
  for (int64_t w : {1, 5, 32, 33, 69, 70, 200}) {
    SCOPED_TRACE(w);
    expect_matches_naive(cfg(2, 70, 4, 2, 8, true, {}, w));
  }
  expect_matches_naive(cfg(1, 40, 4, 1, 8, true, {}, 7));  // multi-query
}
TEST_F(AttentionTest, MatchesNaiveSlidingWindowVarlen) {
  // The window stops at the document start too.
  const std::vector<int32_t> cu{0, 5, 50, 50, 70, 100};
  for (int64_t w : {1, 3, 17, 64}) {
    SCOPED_TRACE(w);
    expect_matches_naive(cfg(2, 50, 4, 2, 8, true, cu, w));
  }
}
TEST_F(AttentionTest, SlidingWindowAtLeastTChangesNothing) {
  AttentionOp<float> full(cfg(2, 45, 4, 2, 16, true)), wide(cfg(2, 45, 4, 2, 16, true, {}, 45));
  Inputs<float> x;
  for (const InputSpec& s : full.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
  std::vector<float> a(full.out_size()), b(full.out_size());
  full.forward(x, a);
  wide.forward(x, b);
  EXPECT_EQ(a, b);
  EXPECT_EQ(full.lse, wide.lse);
}
TEST_F(AttentionTest, GradientsSlidingWindow) {
  check_gradients<AttentionOp>(cfg(2, 7, 4, 2, 3, true, {}, 3), rng);
  check_gradients<AttentionOp>(cfg(1, 40, 2, 2, 2, true, {}, 9), rng);  // across query blocks
  check_gradients<AttentionOp>(cfg(2, 6, 2, 1, 3, true, {0, 2, 6, 9, 12}, 2), rng);
}
// The fixed-size table of train/document_masks.h (every token's document start, repeated entries
// being empty documents) describes the same documents as the compact one: bit-identical results.
TEST_F(AttentionTest, VarlenWithEmptyDocumentsEqualsCompactTable) {
  const std::vector<int32_t> compact{0, 5, 20, 26, 40};  // B=2, T=20
  std::vector<int32_t> fixed(41);
  for (size_t d = 0; d + 1 < compact.size(); ++d)
    for (int32_t i = compact[d]; i < compact[d + 1]; ++i) fixed[i] = compact[d];
  fixed[40] = 40;
  for (int64_t w : {0, 4}) {
    AttentionOp<float> a(cfg(2, 20, 4, 2, 8, true, compact, w)), b(cfg(2, 20, 4, 2, 8, true, fixed, w));
    Inputs<float> x;
    for (const InputSpec& s : a.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
    std::vector<float> oa(a.out_size()), ob(b.out_size());
    a.forward(x, oa);
    b.forward(x, ob);
    EXPECT_EQ(oa, ob);
    const std::vector<float> dout = rng.vec<float>(a.out_size());
    Inputs<float> da, db;
    for (const auto& t : x) da.emplace_back(t.size(), 0.f), db.emplace_back(t.size(), 0.f);
    a.backward(x, dout, da);
    b.backward(x, dout, db);
    EXPECT_EQ(da, db);
  }
}

TEST_F(AttentionTest, GradientsGqaCausal) {
  check_gradients<AttentionOp>(cfg(2, 5, 4, 2, 3, true), rng);
}
TEST_F(AttentionTest, GradientsGqaNonCausal) {
  check_gradients<AttentionOp>(cfg(2, 5, 4, 2, 3, false), rng);
}
TEST_F(AttentionTest, GradientsMultiQuery) {
  check_gradients<AttentionOp>(cfg(1, 6, 4, 1, 3, true), rng);
}
TEST_F(AttentionTest, GradientsMultiHeadAcrossQueryBlocks) {
  check_gradients<AttentionOp>(cfg(1, 40, 2, 2, 2, true), rng);
}
TEST_F(AttentionTest, GradientsVarlen) {
  check_gradients<AttentionOp>(cfg(2, 6, 2, 1, 3, true, {0, 2, 6, 9, 12}), rng);
  check_gradients<AttentionOp>(cfg(2, 6, 2, 1, 3, false, {0, 2, 6, 9, 12}), rng);
}
TEST_F(AttentionTest, FloatMatchesDouble) {
  check_float_vs_double<AttentionOp>(cfg(2, 100, 4, 2, 16, true), rng);
  check_float_vs_double<AttentionOp>(cfg(1, 100, 4, 1, 16, false, {0, 30, 100}), rng);
}

// Packed documents do not see each other: rewriting document 2 leaves document 1's outputs and
// gradients bit-identical, and document 1 alone gives the same bits as document 1 packed.
TEST_F(AttentionTest, VarlenDocumentsAreIndependent) {
  const int64_t T = 60, H = 4, KVH = 2, D = 16, split = 23;
  AttentionOp<float> packed(cfg(1, T, H, KVH, D, true, {0, split, T}));
  Inputs<float> x;
  for (const InputSpec& s : packed.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
  std::vector<float> dout = rng.vec<float>(packed.out_size());
  auto run = [&](AttentionOp<float>& op, const Inputs<float>& in, const std::vector<float>& dy) {
    std::vector<float> out(op.out_size());
    op.forward(in, out);
    Inputs<float> dx;
    for (const auto& t : in) dx.emplace_back(t.size(), 0.f);
    op.backward(in, dy, dx);
    return std::make_pair(out, dx);
  };
  const auto [out1, dx1] = run(packed, x, dout);

  Inputs<float> x2 = x;  // new tokens in document 2 (rows split..T of q, k, v) and a new dout
  std::vector<float> dout2 = dout;
  for (int t = 0; t < 3; ++t) {
    const size_t row = x2[t].size() / T;
    for (size_t e = split * row; e < x2[t].size(); ++e)
      x2[t][e] = static_cast<float>(rng.uniform());
  }
  for (size_t e = split * H * D; e < dout2.size(); ++e)
    dout2[e] = static_cast<float>(rng.uniform());
  AttentionOp<float> packed2(cfg(1, T, H, KVH, D, true, {0, split, T}));
  const auto [out2, dx2] = run(packed2, x2, dout2);

  auto prefix = [](const std::vector<float>& v, size_t n) {
    return std::vector<float>(v.begin(), v.begin() + n);
  };
  EXPECT_EQ(prefix(out1, split * H * D), prefix(out2, split * H * D));
  EXPECT_NE(out1, out2);
  EXPECT_EQ(prefix(dx1[0], split * H * D), prefix(dx2[0], split * H * D));
  EXPECT_EQ(prefix(dx1[1], split * KVH * D), prefix(dx2[1], split * KVH * D));
  EXPECT_EQ(prefix(dx1[2], split * KVH * D), prefix(dx2[2], split * KVH * D));

  AttentionOp<float> alone(cfg(1, split, H, KVH, D, true));
  Inputs<float> x_alone{prefix(x[0], split * H * D), prefix(x[1], split * KVH * D),
                        prefix(x[2], split * KVH * D)};
  const auto [out3, dx3] = run(alone, x_alone, prefix(dout, split * H * D));
  EXPECT_EQ(out3, prefix(out1, split * H * D));
  EXPECT_EQ(dx3[1], prefix(dx1[1], split * KVH * D));
}

TEST_F(AttentionTest, BackwardIsDeterministic) {
  AttnCfg c = cfg(2, 70, 4, 2, 16, true);
  AttentionOp<float> op(c);
  Inputs<float> x;
  for (const InputSpec& s : op.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
  std::vector<float> out(op.out_size());
  op.forward(x, out);
  const std::vector<float> dout = rng.vec<float>(op.out_size());
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Inputs<float> dx;
    for (const auto& t : x) dx.emplace_back(t.size(), 0.f);
    op.backward(x, dout, dx);
    omp_set_num_threads(saved);
    return dx;
  };
  const auto first = run(2);
  EXPECT_EQ(first, run(2));
  EXPECT_EQ(first, run(1));
  EXPECT_EQ(first, run(3));
}

TEST_F(AttentionTest, RejectsBadShapesAndOffsets) {
  std::vector<float> buf(1 << 12);
  AttentionParams p;
  p.B = 2, p.T = 8, p.H = 3, p.KVH = 2, p.D = 4;  // H not a multiple of KVH
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
  p.H = 4;
  const std::vector<int32_t> crossing{0, 5, 12, 16};  // [5, 12) crosses the row boundary at 8
  p.cu_seqlens = crossing.data(), p.num_docs = 3;
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
  const std::vector<int32_t> short_total{0, 8, 15};  // ends before B*T = 16
  p.cu_seqlens = short_total.data(), p.num_docs = 2;
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
  p.cu_seqlens = nullptr, p.num_docs = 0;
  p.window = -1;
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
  p.window = 3, p.causal = false;  // a window is causal (Mistral)
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
