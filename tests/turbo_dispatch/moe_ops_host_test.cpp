// The MoE routing ops (turbo/ops/moe.h) on host tensors: each of the eight dispatches to the CPU
// backend and gives what the reference kernel gives on the same arguments, and malformed calls fail
// with errors that name the op, the argument and what was expected. (The device kernels are tested
// against the same reference in tests/turbo_gpu/moe_test.cpp.)
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/ops/moe.h"
#include "tests/turbo_dispatch/host_views.h"

namespace primus::turbo {
namespace {

using testing::host;

// "what" is in the message of the RuntimeError that f throws.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const RuntimeError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

class MoeOpsHost : public ::testing::Test {
 protected:
  void SetUp() override {
    rng.seed(std::random_device{}());
    GlobalBackendManager::instance().reset();
  }
  void TearDown() override { GlobalBackendManager::instance().reset(); }
  std::vector<float> randn(int64_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
  }
  std::mt19937 rng;
};

// Router -> plan (with dropping) -> permute -> unpermute and the backwards through the ops, each
// against the reference kernel called directly on copies of the same inputs.
TEST_F(MoeOpsHost, EveryOpRunsTheReferenceOnHostTensors) {
  const int64_t N = 37, E = 16, K = 4, C = 12, align = 4;
  RouterConfig cfg;
  cfg.num_experts = E, cfg.topk = K, cfg.score = RouterScore::Sigmoid, cfg.num_groups = 4, cfg.group_topk = 2;
  cfg.scaling_factor = 2.5;
  auto logits = randn(N * E), bias = randn(E, 0.1f);
  std::vector<int32_t> idx(N * K), counts(E);
  std::vector<float> w(N * K), probs(N * E), psum(E), z(1);
  RouterForwardArgs f;
  f.cfg = cfg;
  f.logits = host(logits, {N, E}), f.bias = host(bias, {E});
  f.topk_idx = host(idx, {N, K}), f.topk_weight = host(w, {N, K}), f.probs = host(probs, {N, E});
  f.counts = host(counts, {E}), f.prob_sum = host(psum, {E}), f.z_sum = host(z, {1});
  EXPECT_EQ(router_forward(f), BackendType::CPU);
  std::vector<int32_t> r_idx(N * K), r_counts(E);
  std::vector<float> r_w(N * K), r_probs(N * E), r_psum(E);
  float r_z = 0;
  cpu::router_forward<float>(r_idx.data(), r_w.data(), r_probs.data(), r_counts.data(), r_psum.data(), &r_z,
                             logits.data(), bias.data(), N, cfg);
  EXPECT_EQ(idx, r_idx);
  EXPECT_EQ(w, r_w);
  EXPECT_EQ(counts, r_counts);
  EXPECT_EQ(z[0], r_z);

  auto dweight = randn(N * K);
  std::vector<float> dlogits(N * E), r_dl(N * E);
  RouterBackwardArgs b;
  b.cfg = cfg;
  b.dlogits = host(dlogits, {N, E}), b.dweight = host(dweight, {N, K});
  b.logits = f.logits, b.probs = f.probs, b.topk_idx = f.topk_idx, b.counts = f.counts;
  b.aux_coeff = 0.1, b.z_coeff = 0.01;
  EXPECT_EQ(router_backward(b), BackendType::CPU);
  cpu::router_backward<float>(r_dl.data(), dweight.data(), logits.data(), probs.data(), idx.data(), counts.data(), N,
                              cfg, 0.1, 0.01);
  EXPECT_EQ(dlogits, r_dl);

  const int64_t R = moe_permuted_rows_max(N, K, E, align), capacity = N * K / E;
  std::vector<int32_t> rows(N * K), off(E + 1), kept(E), r_rows(N * K), r_off(E + 1), r_kept(E);
  MoePlanArgs p;
  p.topk_idx = f.topk_idx, p.topk_weight = f.topk_weight, p.counts = f.counts, p.align = align;
  p.capacity = capacity, p.policy = DropPolicy::Probs;
  p.row_of_slot = host(rows, {N, K}), p.offsets = host(off, {E + 1}), p.kept = host(kept, {E});
  EXPECT_EQ(moe_plan_rows(p), BackendType::CPU);
  cpu::moe_plan_rows<float>(r_rows.data(), r_off.data(), r_kept.data(), idx.data(), w.data(), counts.data(), N, K, E,
                            align, capacity, DropPolicy::Probs);
  EXPECT_EQ(rows, r_rows);
  EXPECT_EQ(off, r_off);
  EXPECT_EQ(kept, r_kept);

  auto x = randn(N * C);
  std::vector<float> perm(R * C, 5.0f), r_perm(R * C, 5.0f);
  MoePermuteArgs pa;
  pa.out = host(perm, {R, C}), pa.inp = host(x, {N, C}), pa.row_of_slot = p.row_of_slot;
  pa.offsets = p.offsets, pa.kept = p.kept;
  EXPECT_EQ(moe_permute(pa), BackendType::CPU);
  cpu::moe_permute<float>(r_perm.data(), x.data(), rows.data(), off.data(), kept.data(), N, K, E, C);
  EXPECT_EQ(perm, r_perm);

  auto dperm = randn(R * C);
  std::vector<float> dx(N * C, 1.0f), r_dx(N * C, 1.0f);
  MoePermuteBackwardArgs pb;
  pb.dinp = host(dx, {N, C}), pb.dout = host(dperm, {R, C}), pb.row_of_slot = p.row_of_slot, pb.accumulate = true;
  EXPECT_EQ(moe_permute_backward(pb), BackendType::CPU);
  cpu::moe_permute_backward<float>(r_dx.data(), dperm.data(), rows.data(), N, K, C, true);
  EXPECT_EQ(dx, r_dx);

  auto eo = randn(R * C);
  std::vector<float> y(N * C), r_y(N * C);
  MoeUnpermuteArgs ua;
  ua.out = host(y, {N, C}), ua.inp = host(eo, {R, C}), ua.weight = f.topk_weight, ua.row_of_slot = p.row_of_slot;
  EXPECT_EQ(moe_unpermute(ua), BackendType::CPU);
  cpu::moe_unpermute<float>(r_y.data(), eo.data(), w.data(), rows.data(), N, K, C, false);
  EXPECT_EQ(y, r_y);

  auto dy = randn(N * C);
  std::vector<float> deo(R * C, 3.0f), r_deo(R * C, 3.0f), dw(N * K), r_dw(N * K);
  MoeUnpermuteBackwardArgs ub;
  ub.dinp = host(deo, {R, C}), ub.dweight = host(dw, {N, K}), ub.dout = host(dy, {N, C}), ub.inp = ua.inp;
  ub.weight = f.topk_weight, ub.row_of_slot = p.row_of_slot, ub.offsets = p.offsets, ub.kept = p.kept;
  EXPECT_EQ(moe_unpermute_backward(ub), BackendType::CPU);
  cpu::moe_unpermute_backward<float>(r_deo.data(), r_dw.data(), dy.data(), eo.data(), w.data(), rows.data(),
                                     off.data(), kept.data(), N, K, E, C);
  EXPECT_EQ(deo, r_deo);
  EXPECT_EQ(dw, r_dw);
}

TEST_F(MoeOpsHost, MalformedCallsNameTheOpArgumentAndExpectation) {
  const int64_t N = 8, E = 8, K = 2;
  std::vector<float> logits(N * E, 0.5f), w(N * K), probs(N * E), psum(E), z(1);
  std::vector<int32_t> idx(N * K), counts(E);
  RouterForwardArgs f;
  f.cfg.num_experts = E, f.cfg.topk = K;
  f.logits = host(logits, {N, E});
  f.topk_idx = host(idx, {N, K}), f.topk_weight = host(w, {N, K}), f.probs = host(probs, {N, E});
  f.counts = host(counts, {E}), f.prob_sum = host(psum, {E}), f.z_sum = host(z, {1});
  router_forward(f);  // well formed

  RouterForwardArgs bad = f;
  bad.topk_weight = host(w, {N * K});
  expect_error([&] { router_forward(bad); }, {"router_forward", "topk_weight", "[8, 2]"});
  bad = f;
  bad.counts = TensorView(probs.data(), DType::F32, Device::CPU, {E});
  expect_error([&] { router_forward(bad); }, {"router_forward", "counts", "i32", "f32"});
  bad = f;
  bad.cfg.topk = 9;
  expect_error([&] { router_forward(bad); }, {"router_forward", "topk 9"});
  bad = f;
  bad.cfg.num_groups = 3;  // 8 experts do not split into 3 groups
  expect_error([&] { router_forward(bad); }, {"router_forward", "num_groups 3"});
  bad.cfg.num_groups = 4, bad.cfg.group_topk = 1;  // one chosen group of 2 experts holds topk 2
  router_forward(bad);
  bad.cfg.topk = 3;  // but not 3
  expect_error([&] { router_forward(bad); }, {"router_forward", "topk 3", "group_topk"});

  // The plan: an expert index outside [0, E) and an alignment below one.
  std::vector<int32_t> rows(N * K), off(E + 1), kept(E);
  MoePlanArgs p;
  p.topk_idx = f.topk_idx, p.topk_weight = f.topk_weight, p.counts = f.counts;
  p.row_of_slot = host(rows, {N, K}), p.offsets = host(off, {E + 1}), p.kept = host(kept, {E});
  std::iota(idx.begin(), idx.end(), 0);
  for (auto& e : idx) e %= E;
  moe_plan_rows(p);
  idx[5] = static_cast<int32_t>(E);
  expect_error([&] { moe_plan_rows(p); }, {"moe_plan_rows", "topk_idx[5] = 8"});
  idx[5] = 0;
  p.align = 0;
  expect_error([&] { moe_plan_rows(p); }, {"moe_plan_rows", "align 0"});
  p.align = 16;
  moe_plan_rows(p);

  // A permuted buffer smaller than the plan spans, and token tensors of two dtypes.
  const int64_t C = 4;
  std::vector<float> x(N * C), small(4 * C);
  MoePermuteArgs pa;
  pa.inp = host(x, {N, C}), pa.out = host(small, {4, C});
  pa.row_of_slot = p.row_of_slot, pa.offsets = p.offsets, pa.kept = p.kept;
  expect_error([&] { moe_permute(pa); }, {"moe_permute", "offsets[E]", "4"});
  std::vector<uint16_t> xb(N * C);
  pa.inp = TensorView(xb.data(), DType::BF16, Device::CPU, {N, C});
  expect_error([&] { moe_permute(pa); }, {"moe_permute", "out", "bf16"});

  // The sequence-wise statistics: a sequence length that does not divide the tokens, and outputs
  // of another row count than the sequences.
  std::vector<int32_t> sc(2 * E);
  std::vector<float> sp(2 * E);
  MoeSequenceStatsArgs q;
  q.topk_idx = f.topk_idx, q.probs = f.probs, q.seq_len = 4;
  q.counts = host(sc, {2, E}), q.prob_sum = host(sp, {2, E});
  EXPECT_EQ(moe_sequence_stats(q), BackendType::CPU);
  q.seq_len = 3;
  expect_error([&] { moe_sequence_stats(q); }, {"moe_sequence_stats", "run of 3 rows", "8 tokens"});
  q.seq_len = 8;
  expect_error([&] { moe_sequence_stats(q); }, {"moe_sequence_stats", "counts of 2 sequences", "1 runs"});
  q.seq_len = 2;  // runs of 2 rows, four of them: two per sequence
  EXPECT_EQ(moe_sequence_stats(q), BackendType::CPU);

  // The sequence-wise router backward: its counts [S,E] must divide the runs.
  RouterBackwardArgs rb;
  rb.cfg = f.cfg;
  std::vector<float> dl(8 * E), dw(8 * f.cfg.topk);
  rb.dlogits = host(dl, {8, E}), rb.dweight = host(dw, {8, f.cfg.topk});
  rb.logits = f.logits, rb.topk_idx = f.topk_idx, rb.counts = q.counts;
  rb.seq_len = 4, rb.seq_run = 2;
  EXPECT_EQ(router_backward(rb), BackendType::CPU);
  rb.seq_run = 3;
  expect_error([&] { router_backward(rb); }, {"router_backward", "run of 3 rows", "8 tokens"});
  rb.seq_len = 8, rb.seq_run = 0;
  expect_error([&] { router_backward(rb); }, {"router_backward", "counts of 2 sequences", "1 runs"});
  rb.seq_len = 0;
  expect_error([&] { router_backward(rb); }, {"router_backward", "counts"});
}

// The forced-balance draw through the op: the reference kernel's values, and a call on an integer
// tensor refused by name.
TEST_F(MoeOpsHost, RandomLogitsAreTheKernelsDraw) {
  std::vector<float> got(6 * 5, -1.0f), want(6 * 5);
  EXPECT_EQ(moe_random_logits({host(got, {6, 5}), 99, {}}), BackendType::CPU);
  cpu::moe_random_logits(want.data(), 6, 5, 99);
  EXPECT_EQ(got, want);
  std::vector<int32_t> ints(6);
  expect_error([&] { moe_random_logits({host(ints, {2, 3}), 1, {}}); }, {"moe_random_logits", "logits", "f32"});
}

// The sequence-wise statistics through the op: each sequence's counts and sums of p, as the
// reference kernel gives them, and rows that add up to the whole batch's router statistics.
TEST_F(MoeOpsHost, SequenceStatsSplitTheRoutersStatisticsBySequence) {
  const int64_t S = 3, T = 5, N = S * T, E = 6, K = 2;
  auto logits = randn(N * E);
  std::vector<int32_t> idx(N * K), counts(E), sc(S * E), r_sc(S * E);
  std::vector<float> w(N * K), probs(N * E), psum(E), z(1), sp(S * E), r_sp(S * E);
  RouterForwardArgs f;
  f.cfg.num_experts = E, f.cfg.topk = K;
  f.logits = host(logits, {N, E});
  f.topk_idx = host(idx, {N, K}), f.topk_weight = host(w, {N, K}), f.probs = host(probs, {N, E});
  f.counts = host(counts, {E}), f.prob_sum = host(psum, {E}), f.z_sum = host(z, {1});
  router_forward(f);
  MoeSequenceStatsArgs q;
  q.topk_idx = f.topk_idx, q.probs = f.probs, q.seq_len = T;
  q.counts = host(sc, {S, E}), q.prob_sum = host(sp, {S, E});
  EXPECT_EQ(moe_sequence_stats(q), BackendType::CPU);
  cpu::moe_sequence_stats<float>(r_sc.data(), r_sp.data(), idx.data(), probs.data(), N, {S, T, T}, K, E);
  EXPECT_EQ(sc, r_sc);
  EXPECT_EQ(sp, r_sp);
  for (int64_t e = 0; e < E; ++e) {
    int32_t c = 0;
    double p = 0;
    for (int64_t s = 0; s < S; ++s) c += sc[s * E + e], p += sp[s * E + e];
    EXPECT_EQ(c, counts[e]) << "expert " << e;
    EXPECT_NEAR(p, psum[e], 1e-5) << "expert " << e;
  }
}

}  // namespace
}  // namespace primus::turbo
