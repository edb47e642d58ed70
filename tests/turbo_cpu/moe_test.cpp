#include "turbo/kernels/cpu/moe.h"

#include <numeric>
#include <set>

#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

// The router as a function of its logits: out = [topk_weight (N*K), aux, z]. Under a perturbation
// of 1e-5 the routing (a discrete choice) stays put for random logits, so central differences see
// the same function the backward differentiates (counts held constant, as in training).
struct RouterCfg {
  int64_t N;
  RouterConfig r;
  bool bias = false;
};

template <typename Real>
struct RouterOp {
  RouterCfg c;
  std::vector<Real> bias, probs, prob_sum;
  std::vector<int32_t> idx, counts;
  explicit RouterOp(const RouterCfg& cfg) : c(cfg) {
    const int64_t E = c.r.num_experts;
    // A fixed bias with spread comparable to the scores, so it changes the choice.
    for (int64_t e = 0; e < E; ++e) bias.push_back(static_cast<Real>(c.bias ? 0.3 * std::sin(1.7 * e) : 0.0));
  }
  std::vector<InputSpec> inputs() const {
    return {{"logits", static_cast<size_t>(c.N * c.r.num_experts), -2, 2, false}};
  }
  size_t out_size() const { return c.N * c.r.topk + 2; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    const int64_t E = c.r.num_experts, K = c.r.topk;
    probs.resize(c.N * E);
    prob_sum.resize(E);
    idx.resize(c.N * K);
    counts.resize(E);
    Real z_sum;
    router_forward(idx.data(), out.data(), probs.data(), counts.data(), prob_sum.data(), &z_sum, x[0].data(),
                   c.bias ? bias.data() : nullptr, c.N, c.r);
    double aux, z;
    router_losses(&aux, &z, counts.data(), prob_sum.data(), z_sum, c.N, c.r);
    out[c.N * K] = static_cast<Real>(aux);
    out[c.N * K + 1] = static_cast<Real>(z);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    const int64_t NK = c.N * c.r.topk;
    router_backward(dx[0].data(), dout.data(), x[0].data(), probs.data(), idx.data(), counts.data(), c.N, c.r,
                    static_cast<double>(dout[NK]), static_cast<double>(dout[NK + 1]));
  }
};

// The router with the three balancing losses Megatron-LM's list form combines, as a function of
// its logits: out = [topk_weight (N*K), the batch's switch loss, the mean of the S sequences'
// losses, a switch loss whose loads are other counts (global_aux_loss's summed counts: the batch's
// plus fixed extra ones, over `span` tokens), z]. The backward passes all three as terms of one
// call, the extra load's over span tokens as the kernel's switch term over N at (N / span)^2.
struct RouterListCfg {
  int64_t S, T;
  RouterConfig r;
};
template <typename Real>
struct RouterListOp {
  RouterListCfg c;
  int64_t N;
  std::vector<Real> probs, prob_sum, seq_sum;
  std::vector<int32_t> idx, counts, seq_counts, global_counts, extra;
  int64_t span;
  explicit RouterListOp(const RouterListCfg& cfg) : c(cfg), N(cfg.S * cfg.T), span(3 * cfg.S * cfg.T) {
    for (int64_t e = 0; e < c.r.num_experts; ++e) extra.push_back(static_cast<int32_t>((7 * e + 3) % 11));
  }
  std::vector<InputSpec> inputs() const { return {{"logits", static_cast<size_t>(N * c.r.num_experts), -2, 2, false}}; }
  size_t out_size() const { return N * c.r.topk + 4; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    const int64_t E = c.r.num_experts, K = c.r.topk;
    probs.resize(N * E);
    prob_sum.resize(E);
    idx.resize(N * K);
    counts.resize(E);
    seq_counts.resize(c.S * E);
    seq_sum.resize(c.S * E);
    Real z_sum;
    router_forward(idx.data(), out.data(), probs.data(), counts.data(), prob_sum.data(), &z_sum, x[0].data(),
                   static_cast<const Real*>(nullptr), N, c.r);
    double aux, z, glob, ignored;
    router_losses(&aux, &z, counts.data(), prob_sum.data(), z_sum, N, c.r);
    moe_sequence_stats(seq_counts.data(), seq_sum.data(), idx.data(), probs.data(), N, {c.S, c.T, c.T}, K, E);
    global_counts.resize(E);
    for (int64_t e = 0; e < E; ++e) global_counts[e] = counts[e] + extra[e];
    router_losses(&glob, &ignored, global_counts.data(), prob_sum.data(), z_sum, span, c.r);
    out[N * K] = static_cast<Real>(aux);
    out[N * K + 1] = static_cast<Real>(sequence_aux_loss(seq_counts.data(), seq_sum.data(), c.S, c.T, c.r));
    out[N * K + 2] = static_cast<Real>(glob);
    out[N * K + 3] = static_cast<Real>(z);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    const int64_t NK = N * c.r.topk;
    const double shrink = static_cast<double>(N) * static_cast<double>(N) / (static_cast<double>(span) * span);
    const AuxTerm more[2] = {{seq_counts.data(), static_cast<double>(dout[NK + 1]) / static_cast<double>(c.S),
                              SequenceRuns{c.S, c.T, c.T}},
                             {global_counts.data(), static_cast<double>(dout[NK + 2]) * shrink, {}}};
    router_backward(dx[0].data(), dout.data(), x[0].data(), probs.data(), idx.data(), counts.data(), N, c.r,
                    static_cast<double>(dout[NK]), static_cast<double>(dout[NK + 3]), nullptr, more, 2);
  }
};

RouterConfig softmax_cfg(int64_t E, int64_t K, bool pre) {
  RouterConfig r;
  r.num_experts = E, r.topk = K, r.pre_softmax = pre;
  return r;
}
RouterConfig deepseek_cfg(int64_t E, int64_t K, int64_t groups, int64_t group_topk) {
  RouterConfig r;
  r.num_experts = E, r.topk = K, r.score = RouterScore::Sigmoid;
  r.num_groups = groups, r.group_topk = group_topk, r.scaling_factor = 2.5;
  return r;
}

using MoeRouterTest = OpTest;

TEST_F(MoeRouterTest, SoftmaxGradients) { check_gradients<RouterOp>(RouterCfg{6, softmax_cfg(8, 2, false)}, rng); }
TEST_F(MoeRouterTest, PreSoftmaxGradients) { check_gradients<RouterOp>(RouterCfg{6, softmax_cfg(8, 3, true)}, rng); }
TEST_F(MoeRouterTest, SigmoidGroupLimitedBiasGradients) {
  check_gradients<RouterOp>(RouterCfg{6, deepseek_cfg(16, 4, 4, 2), true}, rng);
}
TEST_F(MoeRouterTest, SigmoidTop1Gradients) {
  RouterConfig r = deepseek_cfg(8, 1, 1, 1);
  check_gradients<RouterOp>(RouterCfg{5, r}, rng);
}
// Megatron-LM's list of balancing types: the batch's, the sequences' and the global batch's losses
// at once, each with its own coefficient (check_gradients draws a random weight per output).
TEST_F(MoeRouterTest, ListedBalancingLossesGradients) {
  check_gradients<RouterListOp>(RouterListCfg{3, 5, softmax_cfg(6, 2, false)}, rng);
  check_gradients<RouterListOp>(RouterListCfg{2, 6, softmax_cfg(6, 3, true)}, rng);
  check_gradients<RouterListOp>(RouterListCfg{3, 4, deepseek_cfg(8, 2, 4, 2)}, rng);
}

// The terms add: one call with three terms gives the first term's call (with the weights' and the z
// loss's gradients) plus a call per further term alone; a term at coefficient 0 reads no counts.
TEST_F(MoeRouterTest, BalancingTermsAddTheirGradients) {
  const int64_t S = 2, T = 5, N = S * T, E = 6, K = 2;
  const RouterConfig r = softmax_cfg(E, K, false);
  const auto logits = rng.vec(N * E, -2, 2);
  std::vector<int32_t> idx(N * K), counts(E), sc(S * E), other(E);
  std::vector<double> w(N * K), probs(N * E), psum(E), sp(S * E);
  double z_sum;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), N, r);
  moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {S, T, T}, K, E);
  for (int64_t e = 0; e < E; ++e) other[e] = static_cast<int32_t>(3 * e + 1);
  const auto dweight = rng.vec(N * K, -1, 1);
  const std::vector<double> no_dweight(N * K, 0.0);
  const SequenceRuns runs{S, T, T};
  const AuxTerm more[3] = {{sc.data(), 0.4, runs}, {other.data(), 0.9, {}}, {nullptr, 0.0, {}}};
  std::vector<double> all(N * E), first(N * E), second(N * E), third(N * E);
  router_backward(all.data(), dweight.data(), logits.data(), probs.data(), idx.data(), counts.data(), N, r, 0.7, 0.2,
                  nullptr, more, 3);
  router_backward(first.data(), dweight.data(), logits.data(), probs.data(), idx.data(), counts.data(), N, r, 0.7,
                  0.2);
  router_backward(second.data(), no_dweight.data(), logits.data(), probs.data(), idx.data(), sc.data(), N, r, 0.4, 0.0,
                  &runs);
  router_backward(third.data(), no_dweight.data(), logits.data(), probs.data(), idx.data(), other.data(), N, r, 0.9,
                  0.0);
  double smallest = 1e9;
  for (int64_t i = 0; i < N * E; ++i) {
    EXPECT_NEAR(all[i], first[i] + second[i] + third[i], 1e-12) << i;
    smallest = std::min(smallest, std::fabs(second[i]) + std::fabs(third[i]));
  }
  EXPECT_GT(smallest, 0.0) << "the further terms must move every logit's gradient for the test to see them";
}

TEST_F(MoeRouterTest, FloatMatchesDouble) {
  check_float_vs_double<RouterOp>(RouterCfg{64, softmax_cfg(64, 8, false)}, rng);
  check_float_vs_double<RouterOp>(RouterCfg{64, deepseek_cfg(64, 6, 8, 3), true}, rng);
}

// Weights against their definitions, computed here from the full softmax / sigmoid.
TEST_F(MoeRouterTest, WeightsMatchDefinitions) {
  const int64_t N = 7, E = 8, K = 3;
  const auto logits = rng.vec(N * E, -3, 3);
  for (int mode = 0; mode < 3; ++mode) {
    RouterConfig r = mode < 2 ? softmax_cfg(E, K, mode == 1) : deepseek_cfg(E, K, 1, 1);
    std::vector<int32_t> idx(N * K), counts(E);
    std::vector<double> w(N * K), probs(N * E), psum(E);
    double z_sum;
    router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                   static_cast<const double*>(nullptr), N, r);
    for (int64_t n = 0; n < N; ++n) {
      const double* l = &logits[n * E];
      std::vector<double> score(E);
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += score[e] = mode < 2 ? std::exp(l[e]) : 1 / (1 + std::exp(-l[e]));
      if (mode < 2)
        for (auto& v : score) v /= s;
      // The chosen experts are the K largest scores, in descending order.
      std::vector<int64_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
      double chosen = 0;
      for (int64_t k = 0; k < K; ++k) {
        ASSERT_EQ(idx[n * K + k], order[k]) << "mode " << mode << " token " << n;
        chosen += score[order[k]];
      }
      for (int64_t k = 0; k < K; ++k) {
        const double want = mode == 0 ? score[order[k]] / chosen            // renormalised top-k
                            : mode == 1 ? score[order[k]]                   // OLMoE: not renormalised
                                        : 2.5 * score[order[k]] / chosen;   // DeepSeek-V3
        EXPECT_NEAR(w[n * K + k], want, 1e-12) << "mode " << mode;
      }
    }
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), 0), N * K);
  }
}

// Equal scores go to the lower expert index, and the expert bias steers the choice but not the
// weights.
TEST_F(MoeRouterTest, TiesAndBias) {
  const int64_t E = 6, K = 2;
  std::vector<double> logits(E, 0.5);
  std::vector<int32_t> idx(K), counts(E);
  std::vector<double> w(K), probs(E), psum(E), bias(E, 0.0);
  double z_sum;
  RouterConfig r = deepseek_cfg(E, K, 1, 1);
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), 1, r);
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 1);
  bias[4] = 0.1, bias[5] = 0.2;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(), bias.data(),
                 1, r);
  EXPECT_EQ(idx[0], 5);
  EXPECT_EQ(idx[1], 4);
  EXPECT_NEAR(w[0], 1.25, 1e-12);  // equal scores, normalised and scaled by 2.5: the bias is not in them
  EXPECT_NEAR(w[1], 1.25, 1e-12);
  EXPECT_EQ(counts[5], 1);
  EXPECT_EQ(counts[0], 0);
}

// Group-limited routing only chooses from the group_topk groups with the best top-(K/group_topk) sums.
TEST_F(MoeRouterTest, GroupLimitedChoosesFromBestGroups) {
  const int64_t E = 8, K = 2;
  // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Expert 0 alone scores highest, but group {6,7} has the
  // best sum of its top 1 + ... with K / group_topk = 1 the group score is its best expert.
  std::vector<double> logits = {3.0, -3.0, 1.0, 1.0, 0.0, 0.0, 2.0, 2.5};
  RouterConfig r = deepseek_cfg(E, K, 4, 2);
  std::vector<int32_t> idx(K), counts(E);
  std::vector<double> w(K), probs(E), psum(E);
  double z_sum;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), 1, r);
  // Best groups by top-1: {0,1} (3.0) and {6,7} (2.5); then the top 2 of experts 0,1,6,7.
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 7);
  r.group_topk = 1;  // K / group_topk = 2: group score = sum of its two best; {6,7} = 4.5 wins
  r.topk = 2;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), 1, r);
  EXPECT_EQ(idx[0], 7);
  EXPECT_EQ(idx[1], 6);
}

TEST_F(MoeRouterTest, AuxAndZLossValues) {
  const int64_t N = 6, E = 4, K = 2;
  const auto logits = rng.vec(N * E, -2, 2);
  RouterConfig r = softmax_cfg(E, K, false);
  std::vector<int32_t> idx(N * K), counts(E);
  std::vector<double> w(N * K), probs(N * E), psum(E);
  double z_sum, aux, z;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), N, r);
  router_losses(&aux, &z, counts.data(), psum.data(), z_sum, N, r);
  double want_aux = 0, want_z = 0;
  for (int64_t e = 0; e < E; ++e) {
    double p = 0;
    for (int64_t n = 0; n < N; ++n) p += probs[n * E + e];
    want_aux += counts[e] / double(N * K) * p / N;
  }
  want_aux *= E;
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(logits[n * E + e]);
    want_z += std::log(s) * std::log(s) / N;
  }
  EXPECT_NEAR(aux, want_aux, 1e-12);
  EXPECT_NEAR(z, want_z, 1e-12);
  // Perfectly uniform routing and probabilities give aux = 1 (the switch loss's minimum).
  std::vector<int32_t> even(E, N * K / E);
  std::vector<double> uniform(E, double(N) / E);
  router_losses(&aux, &z, even.data(), uniform.data(), 0.0, N, r);
  EXPECT_NEAR(aux, 1.0, 1e-12);
}

// DeepSeek-V3's sequence-wise aux loss: each sequence's counts and sums of p over its own tokens,
// the loss the mean of each sequence's switch loss (written out from the definition here); one
// sequence gives the batch-wise loss, and sequences routed unevenly give another value.
TEST_F(MoeRouterTest, SequenceWiseAuxLoss) {
  const int64_t S = 3, T = 4, N = S * T, E = 4, K = 2;
  auto logits = rng.vec(N * E, -2, 2);
  for (int64_t n = 0; n < T; ++n) logits[n * E + 0] += 6.0;  // the first sequence leans on expert 0
  RouterConfig r = softmax_cfg(E, K, false);
  std::vector<int32_t> idx(N * K), counts(E), sc(S * E);
  std::vector<double> w(N * K), probs(N * E), psum(E), sp(S * E);
  double z_sum, aux, z;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), N, r);
  router_losses(&aux, &z, counts.data(), psum.data(), z_sum, N, r);
  moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {S, T, T}, K, E);
  double want = 0;
  for (int64_t s = 0; s < S; ++s) {
    double seq = 0;
    for (int64_t e = 0; e < E; ++e) {
      int64_t c = 0;
      double p = 0;
      for (int64_t n = s * T; n < (s + 1) * T; ++n) {
        for (int64_t k = 0; k < K; ++k) c += idx[n * K + k] == e;
        p += probs[n * E + e];
      }
      EXPECT_EQ(sc[s * E + e], c) << "sequence " << s << " expert " << e;
      EXPECT_NEAR(sp[s * E + e], p, 1e-12);
      seq += double(c) / double(T * K) * p / double(T);
    }
    want += double(E) * seq / double(S);
  }
  EXPECT_NEAR(sequence_aux_loss(sc.data(), sp.data(), S, T, r), want, 1e-12);
  EXPECT_GT(std::fabs(want - aux), 1e-3) << "uneven sequences give the batch-wise value";
  moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {1, N, N}, K, E);
  EXPECT_NEAR(sequence_aux_loss(sc.data(), sp.data(), 1, N, r), aux, 1e-12);
  EXPECT_THROW(moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {1, 5, 5}, K, E),
               std::invalid_argument);
  EXPECT_THROW(moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {2, T, T}, K, E),
               std::invalid_argument)
      << "2 sequences do not divide 3 runs";
}

// Where a sequence's rows lie (SequenceRuns): S sequences of T tokens cut into 4 chunks each and laid
// out chunk-major, as context parallelism lays out a rank's chunks (all the first chunks, then the
// next), so run r is sequence r mod S. The statistics and the router's gradient must be the same
// tokens' as in the contiguous layout, and the one-launch gradient over contiguous sequences the
// same as one call per sequence.
TEST_F(MoeRouterTest, SequenceRunsLayOutChunkedSequences) {
  const int64_t S = 3, T = 8, C = 4, run = T / C, N = S * T, E = 6, K = 2;
  for (const bool sigmoid : {false, true}) {
    const RouterConfig r = sigmoid ? deepseek_cfg(E, K, 1, 1) : softmax_cfg(E, K, false);
    auto logits = rng.vec(N * E, -2, 2);
    for (int64_t n = 0; n < T; ++n) logits[n * E + 1] += 5.0;  // sequence 0 leans on expert 1
    // Row i of the chunked layout is token at(i) of the contiguous one.
    const auto at = [&](int64_t i) { const int64_t rr = i / run, c = rr / S, b = rr % S; return b * T + c * run + i % run; };
    std::vector<double> chunked(N * E);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t e = 0; e < E; ++e) chunked[i * E + e] = logits[at(i) * E + e];
    std::vector<int32_t> idx(N * K), idx2(N * K), counts(E), sc(S * E), sc2(S * E);
    std::vector<double> w(N * K), w2(N * K), probs(N * E), probs2(N * E), psum(E), sp(S * E), sp2(S * E);
    double z_sum;
    router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                   static_cast<const double*>(nullptr), N, r);
    router_forward(idx2.data(), w2.data(), probs2.data(), counts.data(), psum.data(), &z_sum, chunked.data(),
                   static_cast<const double*>(nullptr), N, r);
    moe_sequence_stats(sc.data(), sp.data(), idx.data(), probs.data(), N, {S, T, T}, K, E);
    moe_sequence_stats(sc2.data(), sp2.data(), idx2.data(), probs2.data(), N, {S, run, T}, K, E);
    EXPECT_EQ(sc2, sc);
    for (int64_t i = 0; i < S * E; ++i) EXPECT_NEAR(sp2[i], sp[i], 1e-12) << i;
    EXPECT_NE(sc[0 * E + 1], sc[1 * E + 1]) << "the sequences must differ for the test to see a mix-up";

    const auto dweight = rng.vec(N * K, -1, 1);
    std::vector<double> dw2(N * K);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t k = 0; k < K; ++k) dw2[i * K + k] = dweight[at(i) * K + k];
    const double aux = 0.7 / S, zc = 0.3;
    std::vector<double> per(N * E), one(N * E), chunk(N * E);
    for (int64_t b = 0; b < S; ++b)  // one call per sequence: its rows, its counts, N = T
      router_backward(per.data() + b * T * E, dweight.data() + b * T * K, logits.data() + b * T * E,
                      probs.data() + b * T * E, idx.data() + b * T * K, sc.data() + b * E, T, r, aux,
                      zc * double(T) / double(N));
    const SequenceRuns contiguous{S, T, T}, chunks{S, run, T};
    router_backward(one.data(), dweight.data(), logits.data(), probs.data(), idx.data(), sc.data(), N, r, aux, zc,
                    &contiguous);
    router_backward(chunk.data(), dw2.data(), chunked.data(), probs2.data(), idx2.data(), sc2.data(), N, r, aux, zc,
                    &chunks);
    double moved = 0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t e = 0; e < E; ++e) {
        EXPECT_NEAR(one[i * E + e], per[i * E + e], 1e-12) << "token " << i << " expert " << e;
        EXPECT_NEAR(chunk[i * E + e], one[at(i) * E + e], 1e-12) << "row " << i << " expert " << e;
      }
    // Against the switch loss over the batch (counts [E] over N), the gradient must differ.
    std::vector<double> batch(N * E);
    router_backward(batch.data(), dweight.data(), logits.data(), probs.data(), idx.data(), counts.data(), N, r,
                    aux * S, zc);
    for (int64_t i = 0; i < N * E; ++i) moved = std::max(moved, std::fabs(batch[i] - one[i]));
    EXPECT_GT(moved, 1e-4) << (sigmoid ? "sigmoid" : "softmax");
    const SequenceRuns bad{2, T, T};
    EXPECT_THROW(router_backward(one.data(), dweight.data(), logits.data(), probs.data(), idx.data(), sc.data(), N, r,
                                 aux, zc, &bad),
                 std::invalid_argument);
  }
}

// moe_router_force_load_balancing's draw: in [0, 1) on a 2^-24 grid, a pure function of (seed,
// token, expert) that differs between seeds, and routing by it loads every expert near equally.
TEST_F(MoeRouterTest, RandomLogitsAreAFixedDrawThatBalancesTheExperts) {
  const int64_t N = 8192, E = 64, K = 8;
  std::vector<float> a(N * E), b(N * E), c(N * E);
  moe_random_logits(a.data(), N, E, 7);
  moe_random_logits(b.data(), N, E, 7);
  moe_random_logits(c.data(), N, E, 8);
  EXPECT_EQ(a, b);
  int64_t same = 0;
  double mean = 0;
  for (int64_t i = 0; i < N * E; ++i) {
    ASSERT_GE(a[i], 0.0f);
    ASSERT_LT(a[i], 1.0f);
    ASSERT_EQ(a[i] * 16777216.0f, std::floor(a[i] * 16777216.0f));
    same += a[i] == c[i];
    mean += a[i];
  }
  EXPECT_LT(same, N * E / 1000) << "another seed gave the same draw";
  EXPECT_NEAR(mean / double(N * E), 0.5, 0.01);
  std::vector<double> logits(a.begin(), a.end()), w(N * K), probs(N * E), psum(E);
  std::vector<int32_t> idx(N * K), counts(E);
  double z_sum;
  router_forward(idx.data(), w.data(), probs.data(), counts.data(), psum.data(), &z_sum, logits.data(),
                 static_cast<const double*>(nullptr), N, softmax_cfg(E, K, false));
  const double per = double(N * K) / E;  // 1024; a binomial's spread is about 30
  for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(counts[e], per, 0.15 * per) << "expert " << e;
}

// The row plan: groups in expert order, padded to the alignment, slots in token order; empty
// experts take no rows.
TEST_F(MoeRouterTest, PlanRowsDropless) {
  const int64_t N = 9, K = 2, E = 5, align = 4;
  std::vector<int32_t> idx(N * K);
  for (int64_t n = 0; n < N; ++n) {
    idx[n * K] = static_cast<int32_t>(n % 3);                 // experts 0..2
    idx[n * K + 1] = static_cast<int32_t>(3 + (n % 2 == 0));  // 3 or 4 ...
  }
  idx[1] = 2, idx[0] = 0;  // token 0: experts 0 and 2
  std::vector<float> w(N * K, 0.5f);
  std::vector<int32_t> counts(E, 0), rows(N * K), off(E + 1), kept(E);
  for (int32_t e : idx) ++counts[e];
  const int64_t used = moe_plan_rows(rows.data(), off.data(), kept.data(), idx.data(), w.data(), counts.data(), N, K,
                                     E, align, -1, DropPolicy::Probs);
  EXPECT_EQ(used, off[E]);
  EXPECT_LE(used, moe_permuted_rows_max(N, K, E, align));
  std::set<int32_t> seen;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(kept[e], counts[e]);
    EXPECT_EQ(off[e] % align, 0);
    EXPECT_EQ(off[e + 1] - off[e], (counts[e] + align - 1) / align * align);
    int32_t prev = -1;
    for (int64_t s = 0; s < N * K; ++s) {
      if (idx[s] != e) continue;
      EXPECT_GE(rows[s], off[e]);
      EXPECT_LT(rows[s], off[e] + kept[e]);
      EXPECT_GT(rows[s], prev) << "slots of an expert are in token order";
      prev = rows[s];
      EXPECT_TRUE(seen.insert(rows[s]).second);
    }
  }
}

TEST_F(MoeRouterTest, PlanRowsCapacityPolicies) {
  const int64_t N = 6, K = 1, E = 2, align = 1;
  std::vector<int32_t> idx = {0, 0, 0, 0, 1, 0};
  std::vector<float> w = {0.1f, 0.9f, 0.5f, 0.9f, 0.3f, 0.2f};
  std::vector<int32_t> counts = {5, 1}, rows(N), off(E + 1), kept(E);
  moe_plan_rows(rows.data(), off.data(), kept.data(), idx.data(), w.data(), counts.data(), N, K, E, align, 2,
                DropPolicy::Probs);
  // Expert 0 keeps its two highest weights (tokens 1 and 3, a tie kept in token order).
  EXPECT_EQ(kept[0], 2);
  EXPECT_EQ(kept[1], 1);
  EXPECT_EQ(rows, (std::vector<int32_t>{-1, 0, -1, 1, 2, -1}));
  moe_plan_rows(rows.data(), off.data(), kept.data(), idx.data(), w.data(), counts.data(), N, K, E, align, 2,
                DropPolicy::Position);
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, -1, -1, 2, -1}));
  // Ties under Probs go to the earlier token.
  w = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  moe_plan_rows(rows.data(), off.data(), kept.data(), idx.data(), w.data(), counts.data(), N, K, E, align, 3,
                DropPolicy::Probs);
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, 2, -1, 3, -1}));
}

// Permute and unpermute as functions of their tensors over a fixed plan (with a dropped slot and
// an expert that receives nothing).
struct PermuteCfg {
  int64_t N, K, E, C, align, capacity;
};
struct Plan {
  std::vector<int32_t> idx, rows, off, kept;
  int64_t used = 0;
  explicit Plan(const PermuteCfg& c) {
    idx.resize(c.N * c.K);
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t k = 0; k < c.K; ++k) idx[n * c.K + k] = static_cast<int32_t>((n + 2 * k) % (c.E - 1));  // E-1 empty
    std::vector<int32_t> counts(c.E, 0);
    for (int32_t e : idx) ++counts[e];
    std::vector<double> w(c.N * c.K, 1.0);
    rows.resize(c.N * c.K), off.resize(c.E + 1), kept.resize(c.E);
    used = moe_plan_rows(rows.data(), off.data(), kept.data(), idx.data(), w.data(), counts.data(), c.N, c.K, c.E,
                         c.align, c.capacity, DropPolicy::Position);
  }
};

template <typename Real>
struct PermuteOp {
  PermuteCfg c;
  Plan p;
  explicit PermuteOp(const PermuteCfg& cfg) : c(cfg), p(cfg) {}
  std::vector<InputSpec> inputs() const { return {{"inp", static_cast<size_t>(c.N * c.C)}}; }
  size_t out_size() const { return p.used * c.C; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    std::fill(out.begin(), out.end(), Real(7));  // padding rows must come out zero
    moe_permute(out.data(), x[0].data(), p.rows.data(), p.off.data(), p.kept.data(), c.N, c.K, c.E, c.C);
  }
  void backward(const Inputs<Real>&, const std::vector<Real>& dout, Inputs<Real>& dx) {
    moe_permute_backward(dx[0].data(), dout.data(), p.rows.data(), c.N, c.K, c.C, true);
  }
};

template <typename Real>
struct UnpermuteOp {
  PermuteCfg c;
  Plan p;
  explicit UnpermuteOp(const PermuteCfg& cfg) : c(cfg), p(cfg) {}
  std::vector<InputSpec> inputs() const {
    return {{"expert_out", static_cast<size_t>(p.used * c.C), -1, 1, false},
            {"weight", static_cast<size_t>(c.N * c.K), 0, 1, false}};
  }
  size_t out_size() const { return c.N * c.C; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    moe_unpermute(out.data(), x[0].data(), x[1].data(), p.rows.data(), c.N, c.K, c.C, false);
  }
  void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx) {
    moe_unpermute_backward(dx[0].data(), dx[1].data(), dout.data(), x[0].data(), x[1].data(), p.rows.data(),
                           p.off.data(), p.kept.data(), c.N, c.K, c.E, c.C);
  }
};

TEST_F(MoeRouterTest, PermuteGradients) { check_gradients<PermuteOp>(PermuteCfg{7, 2, 5, 3, 4, 3}, rng); }
TEST_F(MoeRouterTest, UnpermuteGradients) { check_gradients<UnpermuteOp>(PermuteCfg{7, 2, 5, 3, 4, 3}, rng); }
TEST_F(MoeRouterTest, PermuteFloatMatchesDouble) {
  check_float_vs_double<PermuteOp>(PermuteCfg{64, 4, 9, 32, 16, -1}, rng);
  check_float_vs_double<UnpermuteOp>(PermuteCfg{64, 4, 9, 32, 16, -1}, rng);
}

// Permute then unpermute with weights summing to one per token gives the tokens back (dropless).
TEST_F(MoeRouterTest, RoundTrip) {
  const PermuteCfg c{11, 3, 6, 5, 8, -1};
  Plan p(c);
  const auto x = rng.vec(c.N * c.C);
  std::vector<double> perm(p.used * c.C), back(c.N * c.C), w(c.N * c.K, 1.0 / c.K);
  moe_permute(perm.data(), x.data(), p.rows.data(), p.off.data(), p.kept.data(), c.N, c.K, c.E, c.C);
  moe_unpermute(back.data(), perm.data(), w.data(), p.rows.data(), c.N, c.K, c.C, false);
  EXPECT_LT(max_abs_diff(back, x), 1e-12);
}

TEST(MoeBiasUpdate, MovesTowardTheMeanLoad) {
  std::vector<float> bias = {0.f, 0.f, 0.f, 0.f};
  const std::vector<int64_t> load = {10, 2, 4, 4};  // mean 5
  router_bias_update(bias.data(), load.data(), 4, 0.001);
  EXPECT_FLOAT_EQ(bias[0], -0.001f);
  EXPECT_FLOAT_EQ(bias[1], 0.001f);
  EXPECT_FLOAT_EQ(bias[2], 0.001f);
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
