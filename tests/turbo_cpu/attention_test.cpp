#include "turbo/kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct AttnCfg {
  AttentionParams p;
  std::vector<int32_t> cu;  // empty: whole rows
  // Positions of the T queries / Tk keys (empty: 0..T-1 / 0..Tk-1).
  std::vector<int32_t> qpos, kpos;
};

// Direct O(T*Tk) attention in double: which keys a query sees is decided per (query, key) pair
// from document ids and positions, independently of how the kernel walks segments. A query
// that sees no key gets out = 0 and lse = -inf.
void naive_attention(std::vector<double>& out, std::vector<double>& lse,
                     const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, const AttnCfg& c) {
  const AttentionParams& p = c.p;
  const int64_t Tk = p.keys();
  std::vector<int> doc(p.B * p.T, 0);
  for (size_t d = 0; d + 1 < c.cu.size(); ++d)
    for (int32_t t = c.cu[d]; t < c.cu[d + 1]; ++t) doc[t] = static_cast<int>(d);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t) doc[b * p.T + t] += static_cast<int>(b * 1000);
  auto qpos = [&](int64_t i) -> int64_t { return c.qpos.empty() ? i : c.qpos[i]; };
  auto kpos = [&](int64_t j) -> int64_t { return c.kpos.empty() ? j : c.kpos[j]; };
  out.assign(p.B * p.T * p.H * p.D, 0.0);
  lse.assign(p.B * p.H * p.T, 0.0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t g = h / (p.H / p.KVH);
      for (int64_t i = 0; i < p.T; ++i) {
        std::vector<double> s(Tk, -INFINITY);
        double m = -INFINITY;
        const int64_t pi = qpos(i);
        for (int64_t j = 0; j < Tk; ++j) {
          const int64_t pj = kpos(j);
          if (!c.cu.empty() && doc[b * p.T + j] != doc[b * p.T + i]) continue;
          if (p.causal && pj > pi) continue;
          if (p.window > 0 && pi - pj >= p.window) continue;  // transformers: kv_idx > q_idx - window
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d)
            dot +=
                q[((b * p.T + i) * p.H + h) * p.D + d] * k[((b * Tk + j) * p.KVH + g) * p.D + d];
          s[j] = dot * p.scale();
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) {
          lse[(b * p.H + h) * p.T + i] = -INFINITY;
          continue;
        }
        double sum = 0;
        for (int64_t j = 0; j < Tk; ++j) sum += std::exp(s[j] - m);
        lse[(b * p.H + h) * p.T + i] = m + std::log(sum);
        for (int64_t j = 0; j < Tk; ++j) {
          const double w = std::exp(s[j] - m) / sum;
          for (int64_t d = 0; d < p.D; ++d)
            out[((b * p.T + i) * p.H + h) * p.D + d] +=
                w * v[((b * Tk + j) * p.KVH + g) * p.D + d];
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
    c.p.q_positions = c.qpos.empty() ? nullptr : c.qpos.data();
    c.p.k_positions = c.kpos.empty() ? nullptr : c.kpos.data();
  }
  size_t q_size() const { return c.p.B * c.p.T * c.p.H * c.p.D; }
  size_t kv_size() const { return c.p.B * c.p.keys() * c.p.KVH * c.p.D; }
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

// Largest difference of two lse tensors; a row at -inf (no key seen) in one must be -inf in the
// other (+inf is returned otherwise, where plain max_abs_diff would skip the NaN).
template <typename A>
double lse_diff(const std::vector<A>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool ia = std::isinf(static_cast<double>(a[i])), ib = std::isinf(b[i]);
    if (ia != ib || std::isnan(static_cast<double>(a[i]))) return INFINITY;
    if (ia && (a[i] > 0 || b[i] > 0)) return INFINITY;
    if (!ia) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
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
    EXPECT_LT(lse_diff(op.lse, want_lse), 1e-12);
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

// ---- Queries and keys as different token sets at explicit positions (ring attention's blocks)

namespace positioned_tests {

AttnCfg positioned(int64_t B, int64_t H, int64_t KVH, int64_t D, std::vector<int32_t> qpos,
                   std::vector<int32_t> kpos, int64_t window = 0, bool causal = true) {
  AttnCfg c = cfg(B, static_cast<int64_t>(qpos.size()), H, KVH, D, causal, {}, window);
  c.p.Tk = static_cast<int64_t>(kpos.size());
  c.qpos = std::move(qpos);
  c.kpos = std::move(kpos);
  return c;
}

// Rows [n, inner] of x taken at `rows` (one batch row after another: x is [B, T, inner]).
std::vector<double> take_rows(const std::vector<double>& x, int64_t B, int64_t T, int64_t inner,
                              const std::vector<int32_t>& rows) {
  std::vector<double> y;
  for (int64_t b = 0; b < B; ++b)
    for (int32_t r : rows)
      y.insert(y.end(), x.begin() + (b * T + r) * inner, x.begin() + (b * T + r + 1) * inner);
  return y;
}
// The inverse: y's rows added into x at `rows`.
void add_rows(std::vector<double>& x, const std::vector<double>& y, int64_t B, int64_t T,
              int64_t inner, const std::vector<int32_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < inner; ++e)
        x[(b * T + rows[i]) * inner + e] += y[(b * n + i) * inner + e];
}

}  // namespace positioned_tests
using positioned_tests::positioned;

// Random positions (repeats and any order), more or fewer keys than queries, both or one of the
// position tables, non-causal: the kernel against the brute-force reference.
TEST_F(AttentionTest, PositionsMatchNaive) {
  for (const auto& [T, Tk] : {std::pair{37, 50}, std::pair{45, 20}, std::pair{7, 70}}) {
    const std::vector<int32_t> qpos = rng.ints(T, 0, 90), kpos = rng.ints(Tk, 0, 90);
    for (int64_t w : {0, 1, 9, 40}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " Tk=" << Tk << " window=" << w);
      expect_matches_naive(positioned(2, 4, 2, 8, qpos, kpos, w));
    }
    expect_matches_naive(positioned(2, 4, 2, 8, qpos, kpos, 0, false));
    AttnCfg only_q = positioned(1, 4, 1, 8, qpos, {}, 5);  // keys at 0..Tk-1
    only_q.p.Tk = Tk;
    expect_matches_naive(only_q);
    AttnCfg none = cfg(2, T, 4, 2, 8, true);  // keys are the first Tk positions, no tables
    none.p.Tk = Tk;
    expect_matches_naive(none);
  }
}

// The keys 0..T-1 split in two blocks (shuffled, so positions come in any order): each block's
// attention merged equals attention over all keys; and each block's backward given the merged
// out and lse gives dq (summed over blocks) and that block's dk/dv of the full backward.
TEST_F(AttentionTest, MergedKeyBlocksEqualAttentionOverTheirUnion) {
  using positioned_tests::add_rows;
  using positioned_tests::take_rows;
  const int64_t B = 2, T = 45, H = 4, KVH = 2, D = 8;
  for (int64_t w : {0, 6}) {
    SCOPED_TRACE(w);
    const AttnCfg full = cfg(B, T, H, KVH, D, true, {}, w);
    AttentionOp<double> whole(full);
    Inputs<double> x;
    for (const InputSpec& s : whole.inputs()) x.push_back(rng.vec(s.size, s.lo, s.hi));
    std::vector<double> want_out(whole.out_size());
    whole.forward(x, want_out);
    const std::vector<double> dout = rng.vec(whole.out_size());
    Inputs<double> want_dx;
    for (const auto& t : x) want_dx.emplace_back(t.size(), 0.0);
    whole.backward(x, dout, want_dx);

    std::vector<int32_t> perm(T);
    for (int32_t i = 0; i < T; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<unsigned>(rng.integer(0, 1 << 30))));
    const std::vector<std::vector<int32_t>> blocks{{perm.begin(), perm.begin() + 19},
                                                    {perm.begin() + 19, perm.end()}};
    std::vector<AttentionParams> ps;
    Inputs<double> ks, vs;
    for (const auto& rows : blocks) {
      AttentionParams p = full.p;
      p.Tk = static_cast<int64_t>(rows.size());
      p.k_positions = rows.data();
      ps.push_back(p);
      ks.push_back(take_rows(x[1], B, T, KVH * D, rows));
      vs.push_back(take_rows(x[2], B, T, KVH * D, rows));
    }
    for (const int first : {0, 1}) {  // merging is exact in either order
      SCOPED_TRACE(first);
      std::vector<double> out(whole.out_size()), lse(B * H * T), out_b(out.size()), lse_b(lse.size());
      attention_forward(out.data(), lse.data(), x[0].data(), ks[first].data(), vs[first].data(), ps[first]);
      attention_forward(out_b.data(), lse_b.data(), x[0].data(), ks[1 - first].data(),
                        vs[1 - first].data(), ps[1 - first]);
      // Query 0 sees only key 0, which lies in one block: the other block's row 0 is empty.
      EXPECT_TRUE(std::isinf(lse[0]) || std::isinf(lse_b[0])) << lse[0] << " " << lse_b[0];
      attention_merge(out.data(), lse.data(), out_b.data(), lse_b.data(), B, T, H, D);
      EXPECT_LT(rel_error(out, want_out), 1e-12);
      EXPECT_LT(lse_diff(lse, whole.lse), 1e-12);

      std::vector<double> dq(x[0].size(), 0.0), dk(x[1].size(), 0.0), dv(x[2].size(), 0.0);
      for (size_t i = 0; i < blocks.size(); ++i) {
        std::vector<double> dkb(ks[i].size(), 0.0), dvb(vs[i].size(), 0.0);
        attention_backward(dq.data(), dkb.data(), dvb.data(), dout.data(), x[0].data(),
                           ks[i].data(), vs[i].data(), out.data(), lse.data(), ps[i]);
        add_rows(dk, dkb, B, T, KVH * D, blocks[i]);
        add_rows(dv, dvb, B, T, KVH * D, blocks[i]);
      }
      EXPECT_LT(rel_error(dq, want_dx[0]), 1e-12);
      EXPECT_LT(rel_error(dk, want_dx[1]), 1e-12);
      EXPECT_LT(rel_error(dv, want_dx[2]), 1e-12);
    }
  }
}

// Queries that see no key of the block (all keys later, or all before the window): out exactly
// 0, lse -inf, no NaN anywhere, and the backward adds nothing for them.
TEST_F(AttentionTest, FullyMaskedRows) {
  const std::vector<int32_t> qpos{3, 12, 0, 30, 11}, kpos{10, 11, 12, 13};
  for (int64_t w : {0, 5}) {  // with window 5, the query at 30 sees none of 10..13 either
    SCOPED_TRACE(w);
    const AttnCfg c = positioned(2, 4, 2, 8, qpos, kpos, w);
    expect_matches_naive(c);
    AttentionOp<float> op(c);
    Inputs<float> x;
    for (const InputSpec& s : op.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
    std::vector<float> out(op.out_size());
    op.forward(x, out);
    const int64_t T = 5, H = 4, D = 8;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          const bool empty = qpos[t] < 10 || (w > 0 && qpos[t] - 13 >= w);
          const float l = op.lse[(b * H + h) * T + t];
          EXPECT_EQ(std::isinf(l) && l < 0, empty) << "t=" << t << " lse=" << l;
          for (int64_t d = 0; d < D; ++d) {
            const float o = out[((b * T + t) * H + h) * D + d];
            EXPECT_FALSE(std::isnan(o));
            if (empty) {
              EXPECT_EQ(o, 0.f);
            }
          }
        }
    const std::vector<float> dout = rng.vec<float>(op.out_size());
    Inputs<float> dx;
    for (const auto& t : x) dx.push_back(rng.vec<float>(t.size()));
    const Inputs<float> before = dx;
    op.backward(x, dout, dx);
    for (const auto& g : dx)
      for (float e : g) EXPECT_FALSE(std::isnan(e));
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const bool empty = qpos[t] < 10 || (w > 0 && qpos[t] - 13 >= w);
        const size_t row = static_cast<size_t>((b * T + t) * H * D);
        for (size_t h = 0; h < static_cast<size_t>(H); ++h) {
          // A head that sees keys moves its dq; one element's share can round away against the
          // accumulated value (seed 1787033499), so the head's elements are judged together.
          size_t changed = 0;
          for (size_t e = row + h * D; e < row + (h + 1) * D; ++e) {
            if (empty) EXPECT_EQ(dx[0][e], before[0][e]) << "dq of an empty row changed";
            changed += dx[0][e] != before[0][e];
          }
          if (!empty) EXPECT_GT(changed, 0u) << "dq of row " << t << " head " << h << " did not move";
        }
      }
  }
  // Every key after every query: nothing seen at all, and the backward changes no bit.
  AttentionOp<float> none(positioned(1, 2, 1, 4, {0, 1, 2}, {5, 6}));
  Inputs<float> x;
  for (const InputSpec& s : none.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
  std::vector<float> out(none.out_size(), 7.f);
  none.forward(x, out);
  EXPECT_EQ(out, std::vector<float>(out.size(), 0.f));
  for (float l : none.lse) EXPECT_EQ(l, -INFINITY);
  Inputs<float> dx;
  for (const auto& t : x) dx.push_back(rng.vec<float>(t.size()));
  const Inputs<float> before = dx;
  none.backward(x, rng.vec<float>(out.size()), dx);
  EXPECT_EQ(dx, before);
}

// attention_merge with an empty side: -inf on the block's side leaves the running values as
// they are, -inf on the running side takes the block's; both finite is the weighted sum.
TEST_F(AttentionTest, MergeHandlesEmptySides) {
  const double inf = INFINITY;
  // B=1, T=4, H=1, D=2: rows (running, block) lse = (-inf, -inf), (-inf, 0.5), (1.5, -inf), (0.2, -0.7).
  std::vector<double> out{0, 0, 0, 0, 3, 4, 5, 6}, lse{-inf, -inf, 1.5, 0.2};
  const std::vector<double> out_b{0, 0, 1, 2, 0, 0, 7, 8}, lse_b{-inf, 0.5, -inf, -0.7};
  attention_merge(out.data(), lse.data(), out_b.data(), lse_b.data(), 1, 4, 1, 2);
  const double l3 = std::log(std::exp(0.2) + std::exp(-0.7));
  const double wa = std::exp(0.2 - l3), wb = std::exp(-0.7 - l3);
  EXPECT_EQ(lse[0], -inf);
  EXPECT_EQ(lse[1], 0.5);
  EXPECT_EQ(lse[2], 1.5);
  EXPECT_NEAR(lse[3], l3, 1e-15);
  const std::vector<double> want{0, 0, 1, 2, 3, 4, wa * 5 + wb * 7, wa * 6 + wb * 8};
  EXPECT_LT(max_abs_diff(out, want), 1e-15);
}

// fp64 central differences through positions, different key counts, windows, empty rows, GQA,
// and the float kernel against the double one.
TEST_F(AttentionTest, GradientsWithPositions) {
  check_gradients<AttentionOp>(positioned(2, 4, 2, 3, {5, 2, 9, 7, 0}, {4, 1, 8, 3, 6, 9, 2}), rng);
  check_gradients<AttentionOp>(positioned(2, 4, 2, 3, {5, 2, 9, 7, 0}, {4, 1, 8, 3, 6, 9, 2}, 3), rng);
  check_gradients<AttentionOp>(positioned(1, 2, 1, 3, {1, 6, 2}, {5, 0, 3, 4}, 0, false), rng);
  check_gradients<AttentionOp>(positioned(1, 2, 2, 2, rng.ints(40, 0, 60), rng.ints(9, 0, 60), 20), rng);
  check_float_vs_double<AttentionOp>(positioned(2, 4, 2, 16, rng.ints(70, 0, 150), rng.ints(90, 0, 150), 40), rng);
}

// A NaN in a query must reach that query's output and lse (the trainers find non-finite steps by
// it), also where the row's first keys are masked (a sliding window), so that a maximum that
// skips NaN would otherwise read "sees no key" and give 0. Rows without the NaN stay finite.
TEST_F(AttentionTest, NanQueryReachesItsOutput) {
  for (int64_t window : {0, 3}) {
    SCOPED_TRACE(window);
    const AttnCfg c = cfg(1, 16, 2, 1, 8, true, {}, window);
    AttentionOp<float> op(c);
    Inputs<float> x;
    for (const InputSpec& s : op.inputs()) x.push_back(rng.vec<float>(s.size, s.lo, s.hi));
    const int64_t t_bad = 9, h_bad = 1, H = 2, D = 8, T = 16;
    x[0][(t_bad * H + h_bad) * D + 2] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> out(op.out_size());
    op.forward(x, out);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const bool bad = t == t_bad && h == h_bad;
        EXPECT_EQ(std::isnan(op.lse[h * T + t]), bad) << "t=" << t << " h=" << h;
        EXPECT_EQ(std::isnan(out[(t * H + h) * D]), bad) << "t=" << t << " h=" << h;
      }
  }
}

TEST_F(AttentionTest, RejectsPositionsWithDocuments) {
  std::vector<float> buf(1 << 12);
  const std::vector<int32_t> cu{0, 3, 8}, pos{0, 1, 2, 3, 4, 5, 6, 7};
  AttentionParams p;
  p.B = 1, p.T = 8, p.H = 2, p.KVH = 1, p.D = 4;
  p.cu_seqlens = cu.data(), p.num_docs = 2;
  p.k_positions = pos.data();
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
  p.k_positions = nullptr, p.Tk = 6;
  EXPECT_THROW(attention_backward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                  buf.data(), buf.data(), buf.data(), buf.data(), p),
               RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
