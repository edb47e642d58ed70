// Tensor parallelism in the CUDA model, checked without a GPU: two ranks as threads running the
// model in host mode (fp32 on Turbo's CPU kernels, the same decoder code as on the device) against
// one rank, for GPT-2, a GQA Llama and Qwen3's per-head q|k norms, with and without sequence
// parallelism. fp32 gate of DESIGN.md: every
// step's loss and gradient norm within 1e-5 relative of one rank's, the final weights within 1e-4
// (only the order of summation differs: the row-parallel GEMMs' two halves, the loss's two
// halves of the vocabulary).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "core/util/error.h"
#include "tests/core/test_util.h"
#include "tp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class TpHostTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TpHostTest, TwoRanksTrainAsOne) {
  const auto [which, sp] = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 8;
  const TpRun one = run_tp(spec, 1, turbo::Device::CPU, kSteps);
  const TpRun two = run_tp(spec, 2, turbo::Device::CPU, kSteps, Attn::Default, sp);
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], two.loss, two.gnorm, true);
  const double dp = rel_l2(two.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-4);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
  if (sp) EXPECT_LT(two.activation_bytes[0], one.activation_bytes[0]) << "the residual stream is split";
  std::printf("[host %s tp2%s] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e; "
              "activations %zu vs %zu bytes\n",
              tp_spec_name(which), sp ? "+sp" : "", kSteps, one.loss[0].front(), one.loss[0].back(), worst_loss,
              worst_norm, dp, two.activation_bytes[0], one.activation_bytes[0]);
}

INSTANTIATE_TEST_SUITE_P(Models, TpHostTest, ::testing::Combine(::testing::Values(0, 1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(tp_spec_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_sp" : "");
                         });

// The optimizer in the backward under tensor parallelism: each layer's partial gradients summed
// and replicated key/value rows exchanged just before its update, its norm counted once over the
// group. Every model of the tp tests (and the Llama and Qwen3 on 4 ranks, their key/value groups
// replicated), with sequence parallelism, against one rank with the optimizer in the backward:
// the same fp32 gate.
class TpHostInBackwardTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(TpHostInBackwardTest, RanksTrainAsOne) {
  const auto [which, tp] = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 6;
  const TpRun one = run_tp(spec, 1, turbo::Device::CPU, kSteps, Attn::Default, false, {}, true);
  const TpRun many = run_tp(spec, tp, turbo::Device::CPU, kSteps, Attn::Default, true, {}, true);
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], many.loss, many.gnorm, true);
  const double dp = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-4);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
  std::printf("[host %s tp%d+sp in backward] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              tp_spec_name(which), tp, kSteps, worst_loss, worst_norm, dp);
}

INSTANTIATE_TEST_SUITE_P(Models, TpHostInBackwardTest,
                         ::testing::Values(std::tuple{0, 2}, std::tuple{1, 4}, std::tuple{2, 4}, std::tuple{3, 2}),
                         [](const auto& info) {
                           return std::string(tp_spec_name(std::get<0>(info.param))) + "_tp" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Muon under tensor parallelism: each rank's matrix blocks are row or column ranges of the global
// blocks, whose momentum updates are gathered for Newton-Schulz (CudaModel::tp_muon_pieces). GPT-2,
// the GQA Llama, Qwen3 (per-head q/k norms: AdamW) and the DeepSeek-style MoE (experts' gate, up
// and down pieces, the shared expert), tp2 with sequence parallelism, against one rank with Muon
// at the fp32 gate.
class TpHostMuonTest : public ::testing::TestWithParam<int> {};

TEST_P(TpHostMuonTest, RanksTrainAsOne) {
  const int which = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 6;
  const TpRun one = run_tp(spec, 1, turbo::Device::CPU, kSteps, Attn::Default, false, {}, false, true);
  const TpRun two = run_tp(spec, 2, turbo::Device::CPU, kSteps, Attn::Default, true, {}, false, true);
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], two.loss, two.gnorm, true);
  const double dp = rel_l2(two.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-4);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
  const TpRun adamw = run_tp(spec, 1, turbo::Device::CPU, kSteps);
  EXPECT_GT(rel_l2(adamw.params.data(), one.params.data(), static_cast<int64_t>(one.params.size())), 1e-3)
      << "Muon's run must differ from AdamW's";
  std::printf("[host %s tp2+sp muon] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              tp_spec_name(which), kSteps, worst_loss, worst_norm, dp);
}

INSTANTIATE_TEST_SUITE_P(Models, TpHostMuonTest, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return std::string(tp_spec_name(info.param)); });

// More ranks than key/value groups (4 ranks, 2 groups): each group replicated on two ranks, its
// gradient summed over them and counted once in the norm; the Llama and Qwen3 of above, with and
// without sequence parallelism, against one rank at the same fp32 gate.
class TpHostKvTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TpHostKvTest, FourRanksReplicatingKeyValueGroupsTrainAsOne) {
  const auto [which, sp] = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  ASSERT_EQ(spec.num_query_groups, 2);
  constexpr int kSteps = 6;
  const TpRun one = run_tp(spec, 1, turbo::Device::CPU, kSteps);
  const TpRun four = run_tp(spec, 4, turbo::Device::CPU, kSteps, Attn::Default, sp);
  double worst_loss = 0, worst_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 1; r < 4; ++r) EXPECT_EQ(four.gnorm[r][s], four.gnorm[0][s]) << "rank " << r << " step " << s;
    const double dl = std::fabs(four.loss[0][s] - one.loss[0][s]) / one.loss[0][s];
    const double dn = std::fabs(four.gnorm[0][s] - one.gnorm[0][s]) / one.gnorm[0][s];
    worst_loss = std::max(worst_loss, dl);
    worst_norm = std::max(worst_norm, dn);
    EXPECT_LT(dl, 1e-5) << "step " << s;
    EXPECT_LT(dn, 1e-5) << "step " << s << ": " << four.gnorm[0][s] << " vs " << one.gnorm[0][s];
  }
  const double dp = rel_l2(four.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-4);
  std::printf("[host %s tp4%s, kv groups replicated x2] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              tp_spec_name(which), sp ? "+sp" : "", kSteps, worst_loss, worst_norm, dp);
}

INSTANTIATE_TEST_SUITE_P(Models, TpHostKvTest, ::testing::Combine(::testing::Values(1, 2), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(tp_spec_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_sp" : "");
                         });

// FP8 linear layers under tensor parallelism keep their inputs for the backward as FP8 transposed
// copies, as one process does: the column-parallel layers' copy of the (gathered, with sequence
// parallelism) norm output, the row-parallel ones' of this rank's slice of the activation. The
// bytes are those the backward would quantize again, so each rank's losses and the final weights
// equal those of the same ranks without the copies bit for bit, with less activation memory. The
// copied side also takes the SwiGLU kernels' maxima (rowwise; turbo::Fp8Maxima) of each rank's
// slice of the activation and of dgate_up, which the host quantizer checks against its own pass;
// under delayed scaling it has the SwiGLU folded into its quantizers (turbo::Fp8Producers).
TEST(TpHostFp8, InputsSavedInFp8GiveTheSameStepsWithLessMemory) {
  const train::ModelSpec spec = tiny_spec(true);
  constexpr int kSteps = 4, kTp = 2;
  for (bool sp : {false, true}) {
    for (const char* scaling : {"tensorwise", "rowwise", "delayed"}) {
      SCOPED_TRACE(std::string(scaling) + (sp ? " with sequence parallelism" : ""));
      const TpRun saved = run_tp(spec, kTp, turbo::Device::CPU, kSteps, Attn::Default, sp,
                                 [&] { return fp8_test_recipe("hybrid", scaling, {.saved = true, .maxima = true, .producers = true}); });
      const TpRun plain = run_tp(spec, kTp, turbo::Device::CPU, kSteps, Attn::Default, sp,
                                 [&] { return fp8_test_recipe("hybrid", scaling); });
      for (int r = 0; r < kTp; ++r) {
        EXPECT_EQ(saved.loss[r], plain.loss[r]) << "rank " << r;
        EXPECT_EQ(saved.saved_slots[r], static_cast<size_t>(3 * spec.num_layers)) << "rank " << r;
        EXPECT_LT(saved.activation_bytes[r], plain.activation_bytes[r]) << "rank " << r;
      }
      EXPECT_TRUE(saved.params == plain.params) << "weights differ";
    }
  }
}

// The layouts the cuda model refuses under tensor parallelism, each with the key that names it.
TEST(TpHostRefusals, UnsupportedCombinationsNameTheirKey) {
  const train::ModelSpec spec = tp_spec(1);
  auto hub = parallel::ThreadedGroup::create(1, std::chrono::seconds(5));
  std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(0);
  auto build = [&](bool sp, auto&& tweak) {
    // A one-rank group cannot stand for rank 0 of 2: the map/group check comes first unless the
    // refusal does, so every case below must be refused before the group is looked at.
    auto map = std::make_shared<train::TpShardMap>(spec, 2, 0, sp);
    CudaModelOptions mo = options(map->local_spec(), 2, turbo::Device::CPU);
    mo.tp_group = pg.get();
    mo.tp_map = map;
    tweak(mo);
    CudaModel model(map->local_spec(), mo, ops_for(Attn::Default));
  };
  auto expect_config_error = [](auto&& f, const char* key) { primus::testing::expect_error<ConfigError>(f, {key}); };
  expect_config_error([&] { build(true, [](CudaModelOptions& mo) { mo.max_batch = 1, mo.max_seq = 63; }); },
                      "sequence_parallel");
  // And a group whose size is not the map's.
  expect_config_error([&] { build(false, [](CudaModelOptions&) {}); }, "tensor parallelism");
}

}  // namespace
}  // namespace primus::backends::cuda::testing
