// MoE routing on the device (TURBO) against the CPU reference kernels (turbo/kernels/cpu/moe.h):
// the fused router and its backward, the row plan with both drop policies, permute / unpermute and
// their backwards in f32 and bf16, bitwise determinism, and a whole routing step captured as one
// CUDA graph (no host synchronisation inside).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <numeric>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/moe.h"
#include "turbo/ops/cast.h"
#include "turbo/ops/moe.h"

namespace primus::turbo::testing {
namespace {

class MoeGpuTest : public GpuTest {
 protected:
  std::vector<int32_t> get_i32(const TensorView& t) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    CUDA_CHECK(cudaMemcpy(v.data(), t.data, v.size() * 4, cudaMemcpyDeviceToHost));
    return v;
  }
  TensorView i32(std::initializer_list<int64_t> shape) { return make(DType::I32, shape); }
  TensorView f32(std::initializer_list<int64_t> shape) { return make(DType::F32, shape); }
  std::vector<float> uniform(int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng_);
    return v;
  }
  // A random routing: each token K distinct experts out of `allowed` (the rest receive nothing).
  std::vector<int32_t> random_routing(int64_t N, int64_t K, const std::vector<int32_t>& allowed) {
    std::vector<int32_t> idx(static_cast<size_t>(N * K)), pool = allowed;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        std::uniform_int_distribution<size_t> d(static_cast<size_t>(k), pool.size() - 1);
        std::swap(pool[static_cast<size_t>(k)], pool[d(rng_)]);
        idx[static_cast<size_t>(n * K + k)] = pool[static_cast<size_t>(k)];
      }
    }
    return idx;
  }
};

// ---- router ------------------------------------------------------------------------------------
struct RouterCase {
  const char* name;
  int64_t N, E, K;
  RouterScore score;
  bool pre_softmax;
  int64_t groups, group_topk;
  double scaling;
  bool bias;
  bool quantised;     // logits (and bias) on a coarse grid: many exact ties
  bool starve = false;  // every fifth expert's logits pushed far down: experts that receive nothing
};

class MoeRouterGpuTest : public MoeGpuTest, public ::testing::WithParamInterface<RouterCase> {};

TEST_P(MoeRouterGpuTest, ForwardAndBackwardMatchReference) {
  const RouterCase& c = GetParam();
  RouterConfig cfg;
  cfg.num_experts = c.E, cfg.topk = c.K, cfg.score = c.score, cfg.pre_softmax = c.pre_softmax;
  cfg.num_groups = c.groups, cfg.group_topk = c.group_topk, cfg.scaling_factor = c.scaling;
  const int64_t N = c.N, E = c.E, K = c.K;

  auto logits = randn(N * E, 1.5f);
  auto bias = randn(E, 0.2f);
  if (c.quantised) {
    for (auto& x : logits) x = std::round(x * 2.0f) / 2.0f;  // steps of 0.5: equal logits in most rows
    for (auto& b : bias) b = std::round(b * 8.0f) / 8.0f;
  }
  if (c.starve)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 2; e < E; e += 5) logits[n * E + e] -= 40.0f;

  // The reference.
  std::vector<int32_t> r_idx(N * K), r_counts(E);
  std::vector<float> r_w(N * K), r_probs(N * E), r_psum(E);
  float r_z = 0;
  cpu::router_forward<float>(r_idx.data(), r_w.data(), r_probs.data(), r_counts.data(), r_psum.data(), &r_z,
                             logits.data(), c.bias ? bias.data() : nullptr, N, cfg);

  RouterForwardArgs f;
  f.cfg = cfg;
  f.logits = f32({N, E});
  put(f.logits, logits);
  if (c.bias) {
    f.bias = f32({E});
    put(f.bias, bias);
  }
  f.topk_idx = i32({N, K}), f.topk_weight = f32({N, K}), f.probs = f32({N, E});
  f.counts = i32({E}), f.prob_sum = f32({E}), f.z_sum = f32({1});
  for (auto t : {f.topk_idx, f.topk_weight, f.probs, f.counts, f.prob_sum, f.z_sum}) poison(t);
  f.ctx = ctx;
  EXPECT_EQ(router_forward(f), BackendType::TURBO);

  // The same experts, in the same order, for every token; weights and statistics to fp32 rounding.
  const auto idx = get_i32(f.topk_idx);
  int64_t first_diff = -1;
  for (int64_t s = 0; s < N * K && first_diff < 0; ++s)
    if (idx[s] != r_idx[s]) first_diff = s;
  EXPECT_EQ(first_diff, -1) << "token " << first_diff / K << " slot " << first_diff % K << ": got expert "
                            << (first_diff >= 0 ? idx[first_diff] : 0) << ", reference "
                            << (first_diff >= 0 ? r_idx[first_diff] : 0);
  EXPECT_EQ(get_i32(f.counts), r_counts);
  EXPECT_LT(rel_err(get(f.topk_weight), r_w), 1e-6);
  EXPECT_LT(rel_err(get(f.probs), r_probs), 1e-6);
  EXPECT_LT(rel_err(get(f.prob_sum), r_psum), 1e-6);
  EXPECT_LT(rel_err(get(f.z_sum), std::vector<float>{r_z}), 1e-6);
  if (c.starve) {
    EXPECT_EQ(r_counts[2], 0) << "a starved expert got tokens: the case does not test empty experts";
  }

  // Deterministic: the same call gives the same bits, the float sums over tokens included.
  const auto b_w = bytes(f.topk_weight), b_p = bytes(f.probs), b_ps = bytes(f.prob_sum), b_z = bytes(f.z_sum);
  for (auto t : {f.topk_idx, f.topk_weight, f.probs, f.counts, f.prob_sum, f.z_sum}) poison(t);
  router_forward(f);
  EXPECT_EQ(get_i32(f.topk_idx), idx);
  EXPECT_EQ(bytes(f.topk_weight), b_w);
  EXPECT_EQ(bytes(f.probs), b_p);
  EXPECT_EQ(bytes(f.prob_sum), b_ps);
  EXPECT_EQ(bytes(f.z_sum), b_z);

  // Backward: the weights' gradient plus both loss terms, against the reference on its own routing.
  const auto dweight = randn(N * K, 1.0f);
  const double aux_coeff = 0.01 * N, z_coeff = 0.001 * N;  // scaled up so both terms show in dlogits
  std::vector<float> r_dl(N * E);
  cpu::router_backward<float>(r_dl.data(), dweight.data(), logits.data(), r_probs.data(), r_idx.data(),
                              r_counts.data(), N, cfg, aux_coeff, z_coeff);
  RouterBackwardArgs b;
  b.cfg = cfg;
  b.dlogits = f32({N, E});
  b.dweight = f32({N, K});
  put(b.dweight, dweight);
  b.logits = f.logits, b.probs = f.probs, b.topk_idx = f.topk_idx, b.counts = f.counts;
  b.aux_coeff = aux_coeff, b.z_coeff = z_coeff;
  b.ctx = ctx;
  poison(b.dlogits);
  EXPECT_EQ(router_backward(b), BackendType::TURBO);
  EXPECT_LT(rel_err(get(b.dlogits), r_dl), 1e-5);
  const auto b_dl = bytes(b.dlogits);
  poison(b.dlogits);
  router_backward(b);
  EXPECT_EQ(bytes(b.dlogits), b_dl);

  // The sequence-wise loss in one launch: two sequences whose runs of 16 rows alternate (as a
  // context-parallel rank's chunks lie), each token's gradient from its own sequence's counts.
  const cpu::SequenceRuns runs{2, 16, (N / 32) * 16};
  const int64_t Ns = 2 * runs.seq_len;
  std::vector<int32_t> r_sc(2 * E);
  std::vector<float> r_sp(2 * E), r_sdl(Ns * E);
  cpu::moe_sequence_stats<float>(r_sc.data(), r_sp.data(), r_idx.data(), r_probs.data(), Ns, runs, K, E);
  cpu::router_backward<float>(r_sdl.data(), dweight.data(), logits.data(), r_probs.data(), r_idx.data(), r_sc.data(),
                              Ns, cfg, aux_coeff, z_coeff, &runs);
  RouterBackwardArgs q = b;
  q.dlogits = b.dlogits.slice0(0, Ns), q.dweight = b.dweight.slice0(0, Ns), q.logits = f.logits.slice0(0, Ns);
  q.probs = f.probs.slice0(0, Ns), q.topk_idx = f.topk_idx.slice0(0, Ns);
  q.counts = i32({2, E});
  put_i32(q.counts, r_sc);
  q.seq_len = runs.seq_len, q.seq_run = runs.run;
  poison(q.dlogits);
  EXPECT_EQ(router_backward(q), BackendType::TURBO);
  const auto got = get(q.dlogits);
  EXPECT_LT(rel_err(got, r_sdl), 1e-5);
  EXPECT_GT(rel_err(got, std::vector<float>(r_dl.begin(), r_dl.begin() + Ns * E)), 1e-4)
      << "the sequences' counts must move the gradient off the batch's";

  // A list of balancing types, one launch: the batch's switch loss, the sequences' and a global
  // one's (other counts) as three terms whose gradients add.
  std::vector<int32_t> r_other(E);
  for (int64_t e = 0; e < E; ++e) r_other[e] = r_counts[e] + static_cast<int32_t>((5 * e + 2) % 13);
  const cpu::AuxTerm r_more[2] = {{r_sc.data(), 2.0 * aux_coeff, runs}, {r_other.data(), 0.5 * aux_coeff, {}}};
  std::vector<float> r_ldl(Ns * E);
  cpu::router_backward<float>(r_ldl.data(), dweight.data(), logits.data(), r_probs.data(), r_idx.data(),
                              r_counts.data(), Ns, cfg, aux_coeff, z_coeff, nullptr, r_more, 2);
  RouterBackwardArgs l = q;
  l.counts = f.counts;
  l.seq_len = l.seq_run = 0;
  RouterBackwardArgs::AuxTerm other;
  other.counts = i32({E});
  put_i32(other.counts, r_other);
  other.coeff = 0.5 * aux_coeff;
  l.more_aux = {{q.counts, 2.0 * aux_coeff, runs.seq_len, runs.run}, other};
  poison(l.dlogits);
  EXPECT_EQ(router_backward(l), BackendType::TURBO);
  const auto listed = get(l.dlogits);
  EXPECT_LT(rel_err(listed, r_ldl), 1e-5);
  EXPECT_GT(rel_err(listed, got), 1e-4) << "the further terms must move the gradient";
}

INSTANTIATE_TEST_SUITE_P(
    Turbo, MoeRouterGpuTest,
    ::testing::Values(
        RouterCase{"mixtral_e8_k2", 4099, 8, 2, RouterScore::Softmax, false, 1, 1, 1.0, false, false},
        RouterCase{"olmoe_e64_k8_pre", 4099, 64, 8, RouterScore::Softmax, true, 1, 1, 1.0, false, false},
        RouterCase{"softmax_bias_e32_k4", 1000, 32, 4, RouterScore::Softmax, false, 1, 1, 1.0, true, false},
        RouterCase{"dsv3_e256_k8_g8_4", 4099, 256, 8, RouterScore::Sigmoid, false, 8, 4, 2.5, true, false},
        RouterCase{"dsv3_e64_k6_g8_3", 4099, 64, 6, RouterScore::Sigmoid, false, 8, 3, 2.5, true, false},
        RouterCase{"pre_e160_k6_g4_2", 777, 160, 6, RouterScore::Softmax, true, 4, 2, 1.0, true, false},
        RouterCase{"sigmoid_top1_e20", 513, 20, 1, RouterScore::Sigmoid, false, 1, 1, 1.0, false, false},
        RouterCase{"ties_softmax_e64_k8", 2048, 64, 8, RouterScore::Softmax, false, 1, 1, 1.0, false, true},
        RouterCase{"ties_pre_e64_k8", 2048, 64, 8, RouterScore::Softmax, true, 1, 1, 1.0, false, true},
        RouterCase{"ties_dsv3_e64_k6_g8_3", 2048, 64, 6, RouterScore::Sigmoid, false, 8, 3, 2.5, true, true},
        RouterCase{"ties_dsv3_e256_k8_g8_4", 2048, 256, 8, RouterScore::Sigmoid, false, 8, 4, 2.5, false, true},
        RouterCase{"starved_e64_k6", 1500, 64, 6, RouterScore::Sigmoid, false, 1, 1, 2.5, true, false, true}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- the sequence-wise aux loss's statistics --------------------------------------------------
// Each sequence's counts (exact) and sums of p (fp64 in another order: 1e-6) against the CPU
// kernel, on a routing where some experts receive nothing and with more experts than one block
// column serves; the same bits on a second run.
TEST_F(MoeGpuTest, SequenceStatsMatchReference) {
  for (const auto& [S, T, E, K] : std::vector<std::array<int64_t, 4>>{{4, 2048, 64, 8}, {3, 1000, 8, 2},
                                                                      {2, 777, 256, 8}, {5, 64, 40, 6}}) {
    SCOPED_TRACE(::testing::Message() << "S=" << S << " T=" << T << " E=" << E << " K=" << K);
    const int64_t N = S * T;
    std::vector<int32_t> allowed;
    for (int32_t e = 0; e < E; ++e)
      if (e % 5 != 3) allowed.push_back(e);  // every fifth expert starved
    const std::vector<int32_t> idx = random_routing(N, K, allowed);
    const std::vector<float> probs = uniform(N * E, 0.0f, 1.0f);
    std::vector<int32_t> r_counts(S * E);
    std::vector<float> r_sums(S * E);
    cpu::moe_sequence_stats<float>(r_counts.data(), r_sums.data(), idx.data(), probs.data(), N, {S, T, T}, K, E);
    MoeSequenceStatsArgs q;
    q.topk_idx = i32({N, K});
    q.probs = f32({N, E});
    put_i32(q.topk_idx, idx);
    put(q.probs, probs);
    q.seq_len = T;
    q.counts = i32({S, E});
    q.prob_sum = f32({S, E});
    q.ctx = ctx;
    poison(q.counts);
    poison(q.prob_sum);
    EXPECT_EQ(moe_sequence_stats(q), BackendType::TURBO);
    EXPECT_EQ(get_i32(q.counts), r_counts);
    EXPECT_LT(rel_err(get(q.prob_sum), r_sums), 1e-6);
    const auto counts_bytes = bytes(q.counts), sums_bytes = bytes(q.prob_sum);
    poison(q.prob_sum);
    moe_sequence_stats(q);
    EXPECT_EQ(bytes(q.counts), counts_bytes);
    EXPECT_EQ(bytes(q.prob_sum), sums_bytes);
    if (T % 2 == 0) {  // each sequence as two runs of T / 2, the runs of all sequences in turn
      cpu::moe_sequence_stats<float>(r_counts.data(), r_sums.data(), idx.data(), probs.data(), N, {S, T / 2, T}, K, E);
      q.seq_len = T / 2;
      poison(q.counts);
      poison(q.prob_sum);
      moe_sequence_stats(q);
      EXPECT_EQ(get_i32(q.counts), r_counts);
      EXPECT_LT(rel_err(get(q.prob_sum), r_sums), 1e-6);
    }
  }
}

// moe_router_force_load_balancing's draw on the device: the CPU kernel's bits.
TEST_F(MoeGpuTest, RandomLogitsAreTheReferencesBits) {
  for (const auto& [N, E] : std::vector<std::array<int64_t, 2>>{{4099, 64}, {2048, 256}, {777, 8}}) {
    std::vector<float> want(N * E);
    cpu::moe_random_logits(want.data(), N, E, 12345 + N);
    MoeRandomLogitsArgs a{f32({N, E}), static_cast<uint64_t>(12345 + N), ctx};
    poison(a.logits);
    EXPECT_EQ(moe_random_logits(a), BackendType::TURBO);
    EXPECT_EQ(get(a.logits), want) << "N=" << N << " E=" << E;
  }
}

// ---- the row plan ------------------------------------------------------------------------------
struct PlanCase {
  const char* name;
  int64_t N, K, E, align;
  double capacity_factor;  // < 0: dropless; capacity = ceil(N*K/E * factor)
  DropPolicy policy;
  bool tied_weights;       // weights on 4 levels: many equal weights within an expert
  int64_t starved = 0;     // the last `starved` experts receive nothing
};

class MoePlanGpuTest : public MoeGpuTest, public ::testing::WithParamInterface<PlanCase> {};

TEST_P(MoePlanGpuTest, RowsMatchReference) {
  const PlanCase& c = GetParam();
  const int64_t N = c.N, K = c.K, E = c.E;
  std::vector<int32_t> allowed(static_cast<size_t>(E - c.starved));
  std::iota(allowed.begin(), allowed.end(), 0);
  const auto idx = random_routing(N, K, allowed);
  auto w = uniform(N * K, 0.0f, 1.0f);
  if (c.tied_weights)
    for (auto& x : w) x = std::floor(x * 4.0f) / 4.0f;
  const int64_t capacity =
      c.capacity_factor < 0 ? -1 : static_cast<int64_t>(std::ceil(double(N * K) / double(E) * c.capacity_factor));
  std::vector<int32_t> counts(E, 0), r_rows(N * K), r_off(E + 1), r_kept(E);
  for (int32_t e : idx) ++counts[e];
  cpu::moe_plan_rows<float>(r_rows.data(), r_off.data(), r_kept.data(), idx.data(), w.data(), counts.data(), N, K, E,
                            c.align, capacity, c.policy);

  MoePlanArgs p;
  p.topk_idx = i32({N, K}), p.topk_weight = f32({N, K}), p.counts = i32({E});
  put_i32(p.topk_idx, idx);
  put(p.topk_weight, w);
  put_i32(p.counts, counts);
  p.align = c.align, p.capacity = capacity, p.policy = c.policy;
  p.row_of_slot = i32({N, K}), p.offsets = i32({E + 1}), p.kept = i32({E});
  for (auto t : {p.row_of_slot, p.offsets, p.kept}) poison(t);
  p.ctx = ctx;
  EXPECT_EQ(moe_plan_rows(p), BackendType::TURBO);
  EXPECT_EQ(get_i32(p.offsets), r_off);
  EXPECT_EQ(get_i32(p.kept), r_kept);
  const auto rows = get_i32(p.row_of_slot);
  int64_t first_diff = -1;
  for (int64_t s = 0; s < N * K && first_diff < 0; ++s)
    if (rows[s] != r_rows[s]) first_diff = s;
  EXPECT_EQ(first_diff, -1) << "slot " << first_diff << " (expert " << (first_diff >= 0 ? idx[first_diff] : 0)
                            << "): row " << (first_diff >= 0 ? rows[first_diff] : 0) << ", reference "
                            << (first_diff >= 0 ? r_rows[first_diff] : 0);
  // The case exercises what it names.
  const bool dropped = std::any_of(r_rows.begin(), r_rows.end(), [](int32_t r) { return r < 0; });
  EXPECT_EQ(dropped, capacity >= 0 && capacity < *std::max_element(counts.begin(), counts.end()));
  if (c.starved > 0) {
    EXPECT_EQ(r_kept[E - 1], 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Turbo, MoePlanGpuTest,
    ::testing::Values(PlanCase{"dropless_e64_k8_a16", 4099, 8, 64, 16, -1, DropPolicy::Probs, false, 5},
                      PlanCase{"dropless_e8_k2_a1", 1000, 2, 8, 1, -1, DropPolicy::Probs, false},
                      PlanCase{"dropless_e512_k16_a128", 3000, 16, 512, 128, -1, DropPolicy::Position, false, 40},
                      PlanCase{"probs_e64_k8", 4099, 8, 64, 16, 0.8, DropPolicy::Probs, false, 3},
                      PlanCase{"probs_ties_e64_k6", 4099, 6, 64, 8, 0.7, DropPolicy::Probs, true},
                      PlanCase{"position_e64_k6", 4099, 6, 64, 8, 0.7, DropPolicy::Position, false, 2},
                      PlanCase{"probs_e256_k8", 8192, 8, 256, 16, 1.0, DropPolicy::Probs, false},
                      PlanCase{"probs_ties_e8_k2_long", 65536, 2, 8, 16, 0.9, DropPolicy::Probs, true},
                      PlanCase{"position_e8_k2_long", 65536, 2, 8, 16, 0.9, DropPolicy::Position, false},
                      PlanCase{"probs_capacity0", 500, 2, 8, 4, 0.0, DropPolicy::Probs, false},
                      PlanCase{"probs_no_drop", 500, 2, 8, 4, 8.0, DropPolicy::Probs, false}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- permute / unpermute -----------------------------------------------------------------------
struct PermuteCase {
  DType dt;
  int64_t N, K, E, C, align;
  double capacity_factor;  // < 0: dropless (Position policy otherwise)
};

class MoePermuteGpuTest : public MoeGpuTest, public ::testing::WithParamInterface<PermuteCase> {};

TEST_P(MoePermuteGpuTest, AllFourMatchReference) {
  const PermuteCase& c = GetParam();
  const int64_t N = c.N, K = c.K, E = c.E, C = c.C;
  std::vector<int32_t> allowed(static_cast<size_t>(E - 1));  // the last expert receives nothing
  std::iota(allowed.begin(), allowed.end(), 0);
  const auto idx = random_routing(N, K, allowed);
  const int64_t capacity =
      c.capacity_factor < 0 ? -1 : static_cast<int64_t>(std::ceil(double(N * K) / double(E) * c.capacity_factor));
  std::vector<int32_t> counts(E, 0), rows(N * K), off(E + 1), kept(E);
  for (int32_t e : idx) ++counts[e];
  const std::vector<float> no_w(N * K, 1.0f);
  const int64_t used = cpu::moe_plan_rows<float>(rows.data(), off.data(), kept.data(), idx.data(), no_w.data(),
                                                 counts.data(), N, K, E, c.align, capacity, DropPolicy::Position);
  // The permuted buffer as a training step sizes it, plus rows past the bound, which no op may touch.
  const int64_t R = cpu::moe_permuted_rows_max(N, K, E, c.align) + 3;
  ASSERT_LE(used, R);
  TensorView d_rows = i32({N, K}), d_off = i32({E + 1}), d_kept = i32({E});
  put_i32(d_rows, rows);
  put_i32(d_off, off);
  put_i32(d_kept, kept);
  auto untouched = [&](const TensorView& t) {  // rows [used, R) still hold the poison's bytes
    const auto b = bytes(t);
    const size_t from = static_cast<size_t>(used * C) * dtype_size(t.dtype);
    return std::all_of(b.begin() + static_cast<std::ptrdiff_t>(from), b.end(), [](uint8_t x) { return x == 0xFF; });
  };
  auto head = [&](const std::vector<float>& v, int64_t n_rows) {
    return std::vector<float>(v.begin(), v.begin() + n_rows * C);
  };

  // permute: an exact copy (the values are the dtype's), padding rows zero.
  TensorView inp = make(c.dt, {N, C}), out = make(c.dt, {R, C});
  const auto x = random_tensor(inp);
  std::vector<float> r_out(R * C, 7.0f);
  cpu::moe_permute<float>(r_out.data(), x.data(), rows.data(), off.data(), kept.data(), N, K, E, C);
  poison(out);
  MoePermuteArgs pa;
  pa.out = out, pa.inp = inp, pa.row_of_slot = d_rows, pa.offsets = d_off, pa.kept = d_kept, pa.ctx = ctx;
  EXPECT_EQ(moe_permute(pa), BackendType::TURBO);
  EXPECT_EQ(rel_err(head(get(out), used), head(r_out, used)), 0.0);
  EXPECT_TRUE(untouched(out)) << "moe_permute wrote past offsets[E]";

  // permute backward, both modes: f32 sums in the reference's order, so bitwise equal there.
  TensorView dperm = make(c.dt, {R, C}), dx = make(c.dt, {N, C});
  const auto dpv = random_tensor(dperm);
  for (bool acc : {false, true}) {
    const auto dx0 = random_tensor(dx);
    std::vector<float> r_dx = dx0;
    cpu::moe_permute_backward<float>(r_dx.data(), dpv.data(), rows.data(), N, K, C, acc);
    MoePermuteBackwardArgs pb;
    pb.dinp = dx, pb.dout = dperm, pb.row_of_slot = d_rows, pb.accumulate = acc, pb.ctx = ctx;
    EXPECT_EQ(moe_permute_backward(pb), BackendType::TURBO);
    const double err = rel_err(get(dx), round_all(c.dt, r_dx));
    if (c.dt == DType::F32) EXPECT_EQ(err, 0.0) << "accumulate " << acc;
    else EXPECT_LT(err, gate(c.dt)) << "accumulate " << acc;
  }

  // unpermute with routing weights, both modes.
  TensorView expert_out = make(c.dt, {R, C}), y = make(c.dt, {N, C}), wt = f32({N, K});
  const auto eo = random_tensor(expert_out);
  const auto wv = uniform(N * K, 0.05f, 1.0f);
  put(wt, wv);
  for (bool acc : {false, true}) {
    const auto y0 = random_tensor(y);
    std::vector<float> r_y = y0;
    cpu::moe_unpermute<float>(r_y.data(), eo.data(), wv.data(), rows.data(), N, K, C, acc);
    MoeUnpermuteArgs ua;
    ua.out = y, ua.inp = expert_out, ua.weight = wt, ua.row_of_slot = d_rows, ua.accumulate = acc, ua.ctx = ctx;
    EXPECT_EQ(moe_unpermute(ua), BackendType::TURBO);
    EXPECT_LT(rel_err(get(y), r_y), gate(c.dt)) << "accumulate " << acc;
  }

  // unpermute backward: dinp rows (padding zero, rows past offsets[E] untouched) and dweight.
  TensorView dy = make(c.dt, {N, C}), dexp = make(c.dt, {R, C}), dw = f32({N, K});
  const auto dyv = random_tensor(dy);
  std::vector<float> r_dexp(R * C, 7.0f), r_dw(N * K);
  cpu::moe_unpermute_backward<float>(r_dexp.data(), r_dw.data(), dyv.data(), eo.data(), wv.data(), rows.data(),
                                     off.data(), kept.data(), N, K, E, C);
  poison(dexp);
  poison(dw);
  MoeUnpermuteBackwardArgs ub;
  ub.dinp = dexp, ub.dweight = dw, ub.dout = dy, ub.inp = expert_out, ub.weight = wt;
  ub.row_of_slot = d_rows, ub.offsets = d_off, ub.kept = d_kept, ub.ctx = ctx;
  EXPECT_EQ(moe_unpermute_backward(ub), BackendType::TURBO);
  EXPECT_LT(rel_err(head(get(dexp), used), head(r_dexp, used)), gate(c.dt));
  EXPECT_TRUE(untouched(dexp)) << "moe_unpermute_backward wrote past offsets[E]";
  EXPECT_LT(rel_err(get(dw), r_dw), c.dt == DType::F32 ? 1e-5 : 1e-2);
  if (capacity >= 0) {
    const auto got_dw = get(dw);
    for (int64_t s = 0; s < N * K; ++s)
      if (rows[s] < 0) ASSERT_EQ(got_dw[s], 0.0f) << "a dropped slot's dweight";
  }
  // Deterministic: dweight's dot products reduce in a fixed order.
  const auto b_dw = bytes(dw), b_dexp = bytes(dexp);
  poison(dw);
  moe_unpermute_backward(ub);
  EXPECT_EQ(bytes(dw), b_dw);
  EXPECT_EQ(bytes(dexp), b_dexp);
}

INSTANTIATE_TEST_SUITE_P(Turbo, MoePermuteGpuTest,
                         ::testing::Values(PermuteCase{DType::BF16, 1031, 8, 64, 2048, 16, -1},
                                           PermuteCase{DType::F32, 1031, 8, 64, 2048, 16, -1},
                                           PermuteCase{DType::BF16, 777, 2, 8, 1024, 16, 0.8},
                                           PermuteCase{DType::F32, 777, 6, 64, 1024, 8, 0.7},
                                           PermuteCase{DType::BF16, 500, 4, 16, 100, 4, -1},  // 200-byte rows: scalar path
                                           PermuteCase{DType::F32, 500, 4, 16, 100, 4, 0.9},
                                           PermuteCase{DType::BF16, 300, 3, 8, 7, 1, -1},
                                           PermuteCase{DType::F32, 300, 3, 8, 7, 1, 0.6}),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return fmt::format("{}_N{}_K{}_E{}_C{}_{}", dtype_name(p.dt), p.N, p.K, p.E, p.C,
                                              p.capacity_factor < 0 ? "dropless" : "capacity");
                         });

// ---- a routing step as one CUDA graph ----------------------------------------------------------
// router -> plan (Probs dropping) -> permute -> unpermute captured once, replayed on new logits:
// the replay must match the ops run eagerly on those logits, which it can only do if nothing in
// them reads a routing-dependent size on the host.
TEST_F(MoeGpuTest, RoutingStepCapturesAsOneGraph) {
  const int64_t N = 2048, E = 64, K = 6, C = 256, align = 16;
  RouterConfig cfg;
  cfg.num_experts = E, cfg.topk = K, cfg.score = RouterScore::Sigmoid, cfg.num_groups = 8, cfg.group_topk = 3;
  cfg.scaling_factor = 2.5;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ExecContext sctx = ctx;
  sctx.stream = stream;
  const int64_t R = cpu::moe_permuted_rows_max(N, K, E, align);

  RouterForwardArgs f;
  f.cfg = cfg, f.ctx = sctx;
  f.logits = f32({N, E}), f.topk_idx = i32({N, K}), f.topk_weight = f32({N, K}), f.probs = f32({N, E});
  f.counts = i32({E}), f.prob_sum = f32({E}), f.z_sum = f32({1});
  MoePlanArgs p;
  p.topk_idx = f.topk_idx, p.topk_weight = f.topk_weight, p.counts = f.counts, p.align = align;
  p.capacity = N * K / E, p.policy = DropPolicy::Probs, p.ctx = sctx;
  p.row_of_slot = i32({N, K}), p.offsets = i32({E + 1}), p.kept = i32({E});
  MoePermuteArgs pa;
  pa.inp = make(DType::BF16, {N, C}), pa.out = make(DType::BF16, {R, C}), pa.row_of_slot = p.row_of_slot;
  pa.offsets = p.offsets, pa.kept = p.kept, pa.ctx = sctx;
  MoeUnpermuteArgs ua;
  ua.inp = pa.out, ua.out = make(DType::BF16, {N, C}), ua.weight = f.topk_weight, ua.row_of_slot = p.row_of_slot;
  ua.ctx = sctx;
  random_tensor(pa.inp);
  auto step = [&] {
    router_forward(f);
    moe_plan_rows(p);
    moe_permute(pa);
    moe_unpermute(ua);
  };

  put(f.logits, randn(N * E, 1.5f));  // logits at capture time: the graph must not bake them in
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step();
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 2; ++round) {
    put(f.logits, randn(N * E, 1.5f));
    step();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto e_rows = get_i32(p.row_of_slot), e_off = get_i32(p.offsets);
    const auto e_y = bytes(ua.out);
    for (auto t : {p.row_of_slot, p.offsets}) poison(t);
    poison(ua.out);
    CUDA_CHECK(cudaDeviceSynchronize());  // the poison (legacy stream) lands before the replay starts
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(get_i32(p.row_of_slot), e_rows) << "round " << round;
    EXPECT_EQ(get_i32(p.offsets), e_off) << "round " << round;
    EXPECT_EQ(bytes(ua.out), e_y) << "round " << round;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Shapes and configurations the kernels do not serve are refused by TURBO's check, not run wrong.
// Token counts through a float reduction (context parallelism sums an MoE layer's counts over
// its group): i32 -> f32 -> i32 on the device and on the host gives the counts back, up to 2^24.
TEST_F(MoeGpuTest, CountsCastToFloatAndBackExactly) {
  std::vector<int32_t> counts = {0, 1, 7, 65536, (1 << 24) - 1, 123457};
  for (int i = 0; i < 200; ++i) counts.push_back(static_cast<int32_t>(rng_() % (1 << 24)));
  const int64_t n = static_cast<int64_t>(counts.size());
  const TensorView ci = make(DType::I32, {n}), cf = make(DType::F32, {n}), back = make(DType::I32, {n});
  put_i32(ci, counts);
  cast(cf, ci, ctx);
  cast(back, cf, ctx);
  const std::vector<float> f = get(cf);
  std::vector<int32_t> got(counts.size());
  CUDA_CHECK(cudaMemcpy(got.data(), back.data, got.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < counts.size(); ++i) {
    EXPECT_EQ(f[i], static_cast<float>(counts[i])) << i;
    EXPECT_EQ(got[i], counts[i]) << i;
  }
  std::vector<float> hf(counts.size());
  std::vector<int32_t> hb(counts.size());
  const TensorView hci(counts.data(), DType::I32, Device::CPU, {n}), hcf(hf.data(), DType::F32, Device::CPU, {n});
  const TensorView hback(hb.data(), DType::I32, Device::CPU, {n});
  cast(hcf, hci, ExecContext{});
  cast(hback, hcf, ExecContext{});
  EXPECT_EQ(hb, counts);
}

TEST_F(MoeGpuTest, RefusesWhatTheKernelsCannotServe) {
  RouterConfig cfg;
  cfg.num_experts = 512, cfg.topk = 8;
  RouterForwardArgs f;
  f.cfg = cfg, f.ctx = ctx;
  const int64_t N = 4;
  f.logits = f32({N, 512}), f.topk_idx = i32({N, 8}), f.topk_weight = f32({N, 8}), f.probs = f32({N, 512});
  f.counts = i32({512}), f.prob_sum = f32({512}), f.z_sum = f32({1});
  EXPECT_THROW(router_forward(f), RuntimeError);  // a device tensor, no backend for E = 512
  f.cfg.num_experts = 64;                           // now a shape error, named
  try {
    router_forward(f);
    FAIL() << "expected a shape error";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("logits"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace primus::turbo::testing
