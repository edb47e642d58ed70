// Sharded data parallelism in the CUDA model (optim, optim_grads, optim_grads_params), checked
// without a GPU: the unit plan, and two ranks as threads running the model in host mode (fp32 on
// Turbo's CPU kernels, the same decoder and collective code as on the device), each accumulating
// two micro-batches a step, against one rank that accumulates all four, for GPT-2 (tied head,
// biases: the last bias gradient of a layer is written during the next layer's backward) and Llama. fp32 gate of DESIGN.md: every
// step's mean loss and gradient norm within 1e-5 relative, the final weights and moments within
// 1e-4 (only the order of summation differs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <tuple>

#include "backends/cuda/model/fsdp.h"
#include "backends/cuda/model/grad_placement.h"
#include "core/util/error.h"
#include "tests/core/test_util.h"
#include "fsdp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

using parallel::DpSharding;

TEST(FsdpPlanTest, UnitsTileTheLayoutAndShardsCoverEveryElementOnce) {
  for (bool llama : {false, true}) {
    const train::ModelSpec spec = tiny_spec(llama);
    const train::ParamLayout layout = train::make_param_layout(spec);
    for (int world : {1, 2, 3}) {
      for (DpSharding sharding : {DpSharding::Optim, DpSharding::OptimGrads, DpSharding::OptimGradsParams}) {
        const bool params = sharding == DpSharding::OptimGradsParams;
        std::vector<int> owners(size_t(layout.total), 0);
        for (int r = 0; r < world; ++r) {
          const FsdpPlan p = plan_fsdp(layout, spec.num_layers, world, r, sharding);
          EXPECT_EQ(p.shard_grads, sharding != DpSharding::Optim);
          EXPECT_EQ(p.shard_params, params);
          int64_t spans = 0;
          ASSERT_EQ(p.units.size(), size_t(spec.num_layers) + 2) << "embeddings, the layers, the top";
          EXPECT_EQ(p.units.front().begin, 0);
          EXPECT_EQ(p.units.back().end, layout.total);
          for (const FsdpUnit& u : p.units) {
            EXPECT_GE(p.span(u), u.end - u.begin);
            EXPECT_EQ(u.chunk % 64, 0);
            if (!p.shard_grads) {  // optim: every unit's gradient place its own, one after the other
              EXPECT_EQ(u.grad_base, spans);
              spans += p.span(u);
            }
            if (u.layer >= 0) {  // the ready point the decoder reports for it
              EXPECT_EQ(u.begin, layout.get(fmt::format("layers.{}.norm1.weight", u.layer)).offset);
              const FsdpUnit& first = p.units[1 + size_t(u.layer % 3)];
              if (p.shard_grads) { EXPECT_EQ(u.grad_base, first.grad_base) << "three gradient places, l % 3"; }
              if (params) {
                EXPECT_EQ(u.weight_base, p.units[1 + size_t(u.layer % 2)].weight_base) << "two weight places";
              }
            }
          }
          if (!p.shard_grads) { EXPECT_EQ(p.grad_elems, spans); }
          if (p.shard_grads && spec.num_layers > 3) { EXPECT_LT(p.grad_elems, layout.total); }
          // Places never overlap within what can be live at once: the units with places of their own.
          if (!params) { EXPECT_GE(p.weight_elems, layout.total); }
          if (params && spec.num_layers > 2) {
            EXPECT_LT(p.weight_elems, layout.total + 64 * int64_t(p.units.size()) * world);
          }
          // This rank's pieces, as the shard's own layout.
          const train::ParamLayout sl = shard_layout(p, layout);
          EXPECT_EQ(sl.total, p.shard_elems);
          int64_t covered = 0;
          for (const train::ParamTensor& t : sl.tensors) {
            const train::ParamTensor& g = layout.get(t.name);
            EXPECT_EQ(t.decay, g.decay) << t.name;
            covered += t.numel;
          }
          for (const FsdpUnit& u : p.units)
            for (int64_t i = p.owned_begin(u, r); i < p.owned_end(u, r); ++i) ++owners[size_t(i)];
          int64_t owned = 0;
          for (const FsdpUnit& u : p.units) owned += std::max<int64_t>(0, p.owned_end(u, r) - p.owned_begin(u, r));
          EXPECT_EQ(covered, owned) << "rank " << r << ": the pieces are exactly its chunks' elements";
        }
        for (int64_t i = 0; i < layout.total; ++i)
          ASSERT_EQ(owners[size_t(i)], 1) << "element " << i << " of world " << world;
        // full -> every rank's shard -> full is the identity.
        std::vector<float> full(size_t(layout.total)), back(full.size(), -1.0f);
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u01(-1.0f, 1.0f);
        for (float& x : full) x = u01(rng);
        std::vector<float> gathered;
        FsdpPlan p0;
        for (int r = 0; r < world; ++r) {
          const FsdpPlan p = plan_fsdp(layout, spec.num_layers, world, r, sharding);
          std::vector<float> shard(size_t(p.shard_elems));
          full_to_shard(p, full.data(), shard.data());
          gathered.insert(gathered.end(), shard.begin(), shard.end());
          if (r == 0) p0 = p;
        }
        shards_to_full(p0, gathered.data(), back.data());
        EXPECT_EQ(back, full);
      }
    }
  }
}

class FsdpHostTest : public ::testing::TestWithParam<std::tuple<bool, DpSharding>> {};

TEST_P(FsdpHostTest, TwoRanksTrainAsOneAccumulating) {
  const auto [llama, sharding] = GetParam();
  const train::ModelSpec spec = tiny_spec(llama);
  constexpr int kSteps = 6;
  const FsdpRun one = run_fsdp(spec, 1, DpSharding::NoShard, turbo::Device::CPU, kSteps, 4);
  const FsdpRun two = run_fsdp(spec, 2, sharding, turbo::Device::CPU, kSteps, 4);
  double worst_loss = 0, worst_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    const double mean = 0.5 * (two.loss[0][s] + two.loss[1][s]);
    EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one global norm";
    EXPECT_NE(two.loss[1][s], two.loss[0][s]) << "step " << s << ": each rank its own micro-batch";
    const double dl = std::fabs(mean - one.loss[0][s]) / one.loss[0][s];
    const double dn = std::fabs(two.gnorm[0][s] - one.gnorm[0][s]) / one.gnorm[0][s];
    worst_loss = std::max(worst_loss, dl);
    worst_norm = std::max(worst_norm, dn);
    EXPECT_LT(dl, 1e-5) << "step " << s << ": " << mean << " vs " << one.loss[0][s];
    EXPECT_LT(dn, 1e-5) << "step " << s << ": " << two.gnorm[0][s] << " vs " << one.gnorm[0][s];
  }
  // optim reduces each unit (embeddings, the layers, the top) once a step, on the last of the rank's
  // two micro-batches; the strategies that shard the gradients once a micro-batch.
  const int64_t units = spec.num_layers + 2;
  EXPECT_EQ(two.reduce_scatters, kSteps * units * (sharding == DpSharding::Optim ? 1 : 2));
  const int64_t n = static_cast<int64_t>(one.params.size());
  const double dp = rel_l2(two.params.data(), one.params.data(), n);
  const double dm = rel_l2(two.m.data(), one.m.data(), n), dv = rel_l2(two.v.data(), one.v.data(), n);
  EXPECT_LT(dp, 1e-4);
  EXPECT_LT(dm, 1e-4);
  EXPECT_LT(dv, 1e-4);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
  std::printf("[host %s %s x2] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e, "
              "moments %.1e / %.1e\n",
              llama ? "llama" : "gpt2", parallel::dp_sharding_name(sharding), kSteps, one.loss[0].front(),
              one.loss[0].back(), worst_loss, worst_norm, dp, dm, dv);
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpHostTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(DpSharding::Optim, DpSharding::OptimGrads,
                                                                                 DpSharding::OptimGradsParams)),
                         [](const auto& info) {
                           const DpSharding s = std::get<1>(info.param);
                           return std::string(std::get<0>(info.param) ? "llama" : "gpt2") +
                                  (s == DpSharding::Optim ? "_zero1" : s == DpSharding::OptimGrads ? "_zero2" : "_fsdp");
                         });

// The optimizer in the backward beside plain data parallelism (run_dp_in_backward): two and four
// replicas, each its own batch of 4, against one model taking the step's batches as one
// micro-batch, for GPT-2, the GQA Llama and the DeepSeek-style MoE (a dense first layer, a shared
// expert; the switch loss off, which is each replica's own batch's): every replica the same
// averaged loss and norm, within 1e-5 of the one model's, the weights within 1e-4. The mean of a
// layer runs while the layer below computes its gradients, so the gradient buffer holds a second
// window of the largest layer's size.
TEST(DpHostInBackward, ReplicasTrainAsOne) {
  for (int which : {0, 1, 2}) {
    train::ModelSpec spec = which == 2 ? tiny_moe_spec(true) : tiny_spec(which == 1);
    spec.moe.aux_loss_coeff = 0.0;
    for (int world : {2, 4}) {
      const char* name = which == 0 ? "gpt2" : which == 1 ? "llama" : "deepseek_moe";
      SCOPED_TRACE(fmt::format("{} dp{}", name, world));
      constexpr int kSteps = 6;
      const FsdpRun one = run_dp_in_backward(spec, 1, world, turbo::Device::CPU, kSteps);
      const FsdpRun many = run_dp_in_backward(spec, world, world, turbo::Device::CPU, kSteps);
      const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], many.loss, many.gnorm, true);
      const double dp = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
      EXPECT_LT(dp, 1e-4);
      EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
      const train::ParamLayout layout = train::make_param_layout(spec);
      const GradPlacement g1 = place_grads(layout, 1, grad_written_before_layer_backward);
      const GradPlacement g2 = place_grads(layout, 2, grad_written_before_layer_backward);
      EXPECT_EQ(one.grad_elems, g1.elems);
      EXPECT_EQ(many.grad_elems, g2.elems);
      EXPECT_EQ(g2.elems - g1.elems, g1.window_elems);
      std::printf("[host %s dp%d in backward] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e; "
                  "gradient buffer %lld -> %lld elements (two windows)\n",
                  name, world, kSteps, worst_loss, worst_norm, dp, static_cast<long long>(g1.elems),
                  static_cast<long long>(g2.elems));
    }
  }
}

// What the plan holds per rank on the device: the optimizer state, the averaged gradient and the
// bf16 weights at rest fall to 1/N (plus the chunks' padding); the gathered places add a bounded
// working set.
TEST(FsdpHostTest, DevicePlanShardsTheState) {
  train::ModelSpec spec = tiny_spec(true);
  spec.num_layers = 8;
  const train::ParamLayout layout = train::make_param_layout(spec);
  const double P = double(layout.total);
  CudaModelOptions base = options(spec, kTrainBatch, turbo::Device::CUDA);
  const auto [all1, shard1] = planned_state_bytes(spec, base);
  EXPECT_EQ(shard1, 0u);
  for (int world : {2, 4}) {
    auto hub = parallel::ThreadedGroup::create(world, std::chrono::seconds(5));
    std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(0);
    for (DpSharding sharding : {DpSharding::Optim, DpSharding::OptimGradsParams}) {
      CudaModelOptions mo = base;
      mo.dp_group = pg.get();
      mo.dp_sharding = sharding;
      const auto [all, shard] = planned_state_bytes(spec, mo);
      // fp32 master, m, v, averaged gradient and the bf16 chunk: 18 bytes per owned element.
      const double per_rank = 18.0 * P / world;
      EXPECT_GE(double(shard), per_rank);
      EXPECT_LT(double(shard), per_rank * 1.05 + 18.0 * 64 * double(spec.num_layers + 2));
      // One rank: master, m, v, gradients (fp32) and bf16 weights of the whole model. optim keeps
      // the whole gradients and weights (6 bytes an element) beside its shard.
      EXPECT_LT(double(all), double(all1)) << "world " << world;
      if (sharding == DpSharding::Optim) { EXPECT_GT(double(all), 6.0 * P + double(shard)) << "world " << world; }
      std::printf("[plan llama L8 %s x%d] state %.2f MiB (shard %.2f MiB) vs one rank %.2f MiB\n",
                  parallel::dp_sharding_name(sharding), world, all / 1048576.0, shard / 1048576.0, all1 / 1048576.0);
    }
  }
}

TEST(FsdpHostRefusals, UnsupportedCombinationsNameTheKey) {
  auto hub = parallel::ThreadedGroup::create(1, std::chrono::seconds(5));
  std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(0);
  auto expect_config_error = [](auto&& f, const char* key) { primus::testing::expect_error<ConfigError>(f, {key}); };
  auto build = [&](const train::ModelSpec& spec, auto&& tweak) {
    CudaModelOptions mo = options(spec, 2, turbo::Device::CPU);
    mo.dp_group = pg.get();
    mo.dp_sharding = DpSharding::OptimGradsParams;
    tweak(mo);
    CudaModel model(spec, mo, ops_for(Attn::Default));
  };
  // MoE layers are sharded like the others (host_moe_dp_test.cpp trains them).
  EXPECT_NO_THROW(build(tiny_moe_spec(false), [](CudaModelOptions&) {}));
  expect_config_error(
      [&] { build(tiny_spec(true), [](CudaModelOptions& mo) { mo.optimizer_in_backward = true; }); },
      "optimizer_in_backward");
}

}  // namespace
}  // namespace primus::backends::cuda::testing
