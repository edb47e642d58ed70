// Sharded data parallelism in the CUDA model on the GPU: two ranks as threads sharing one GPU, the
// collectives through device memory (parallel/cuda/threaded_device_ops.h), each with its own
// micro-batch, against one rank accumulating both, for 20 steps of GPT-2 and Llama under
// optim_grads (ZeRO-2) and optim_grads_params (FSDP), with bf16's own spread measured beside it:
// one rank again with the other attention kernel. bf16 gate of DESIGN.md, as the tensor-parallel
// test's: every step's mean loss within 1e-2 relative, the gradient norm within 1e-2 for the first
// 10 steps and then within 2% or 4x the fallback run's distance, the final weights within 1e-2. The
// state each rank holds (master weights, moments, averaged gradient, bf16 weights at rest) is
// 1/2 of one rank's, read from the model's own memory plan.
#define PRIMUS_FSDP_PARITY_DEVICE 1
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "bf16_gate.h"
#include "fsdp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

using parallel::DpSharding;

// Each of the two ranks accumulates two micro-batches a step (optim reduces on the second alone).
class FsdpGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<std::tuple<bool, DpSharding>> {};

TEST_P(FsdpGpuTest, TwoRanksOnOneGpuTrainAsOneAccumulating) {
  const auto [llama, sharding] = GetParam();
  const train::ModelSpec spec = tiny_spec(llama);
  const char* name = sharding == DpSharding::Optim ? "zero1" : sharding == DpSharding::OptimGrads ? "zero2" : "fsdp2";
  constexpr int kSteps = 20;
  const FsdpRun one = run_fsdp(spec, 1, DpSharding::NoShard, turbo::Device::CUDA, kSteps, 4);
  const FsdpRun two = run_fsdp(spec, 2, sharding, turbo::Device::CUDA, kSteps, 4);
  // bf16's own spread: one rank with the fallback attention
  const FsdpRun other = run_fsdp(spec, 1, DpSharding::NoShard, turbo::Device::CUDA, kSteps, 4, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one global norm";
  const std::vector<double> mean = rank_mean(two.loss);
  const Bf16Steps g = expect_bf16_steps(name, one.loss[0], one.gnorm[0], mean, two.gnorm[0], other.loss[0], other.gnorm[0]);
  const double worst_loss = g.worst_loss, worst_norm = g.worst_norm;
  const double dp = rel_l2(two.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-2);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  // The state per rank, from the plans the two models were built with.
  auto hub = parallel::ThreadedGroup::create(2, std::chrono::seconds(5));
  std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(0);
  CudaModelOptions mo = options(spec, kTrainBatch, turbo::Device::CUDA);
  const auto [all1, shard1] = planned_state_bytes(spec, mo);
  mo.dp_group = pg.get();
  mo.dp_sharding = sharding;
  const auto [all2, shard2] = planned_state_bytes(spec, mo);
  const double P = double(train::make_param_layout(spec).total);
  EXPECT_LT(double(shard2), 18.0 * P / 2 * 1.1) << "master, moments, averaged gradient and bf16 chunk: 1/2";
  EXPECT_LT(all2, all1);
  std::printf("[gpu %s %s] %d steps: loss %.4f -> %.4f (%s %.4f), worst relative loss %.1e, grad norm %.1e, weights "
              "%.1e; per rank: state %.2f MiB (its shard %.2f MiB) vs %.2f MiB on one rank (%.0f parameters)\n",
              llama ? "llama" : "gpt2", name, kSteps, one.loss[0].front(), one.loss[0].back(), name,
              mean.back(), worst_loss, worst_norm, dp, all2 / 1048576.0,
              shard2 / 1048576.0, all1 / 1048576.0, P);
  (void)shard1;
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpGpuTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(DpSharding::Optim, DpSharding::OptimGrads,
                                                                                 DpSharding::OptimGradsParams)),
                         [](const auto& info) {
                           const DpSharding s = std::get<1>(info.param);
                           return std::string(std::get<0>(info.param) ? "llama" : "gpt2") +
                                  (s == DpSharding::Optim ? "_zero1" : s == DpSharding::OptimGrads ? "_zero2" : "_fsdp");
                         });

// MoE layers (DeepSeek-style: sigmoid router, expert bias, shared expert) and FP8 linears (rowwise
// and blockwise, the experts too) under optim_grads_params: two ranks sharing the GPU against one rank
// accumulating both micro-batches, with the same bf16 gate (the fallback attention's run as the
// spread). The trainer-level checks of the same layouts run in CI (host_moe_dp_test.cpp,
// host_fp8_fsdp_test.cpp).
struct FsdpModelCase {
  const char* name;
  bool moe;
  const char* fp8_format;  // null: bf16
  const char* fp8_scaling;
  bool wide = false;  // every width a multiple of 128 (blockwise FP8)
};

class FsdpGpuModelsTest : public CudaGpuTest, public ::testing::WithParamInterface<FsdpModelCase> {};

TEST_P(FsdpGpuModelsTest, TwoRanksOnOneGpuTrainAsOneAccumulating) {
  const FsdpModelCase c = GetParam();
  const train::ModelSpec spec = c.moe ? (c.wide ? tiny_moe_spec_128(true) : tiny_moe_spec(true)) : tiny_spec(true);
  constexpr int kSteps = 20;
  const auto run = [&](int world, DpSharding sharding, Attn attn) {
    return run_fsdp(spec, world, sharding, turbo::Device::CUDA, kSteps, 2, attn, c.fp8_format, c.fp8_scaling);
  };
  const FsdpRun one = run(1, DpSharding::NoShard, Attn::Default);
  const FsdpRun two = run(2, DpSharding::OptimGradsParams, Attn::Default);
  const FsdpRun other = run(1, DpSharding::NoShard, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one global norm";
  const std::vector<double> mean = rank_mean(two.loss);
  // With FP8 the late gradient norms move more per step than the floor of 2%: blockwise MoE on an
  // H200 read 3.2% at step 17 of 20 (losses within 5e-4), while the fallback attention's own run
  // was 2.7% from the reference one step later. 4% for the FP8 cases; bf16 keeps the 2% floor.
  const double late_floor = c.fp8_format ? 4e-2 : 2e-2;
  const Bf16Steps g = expect_bf16_steps(c.name, one.loss[0], one.gnorm[0], mean, two.gnorm[0], other.loss[0],
                                        other.gnorm[0], late_floor);
  // The final weights: within 1e-2, or twice the fallback attention's own distance (blockwise FP8
  // MoE: 2.1e-2 from the reference after 20 steps on an H200).
  const auto n = static_cast<int64_t>(one.params.size());
  const double dp = rel_l2(two.params.data(), one.params.data(), n);
  const double spread = rel_l2(other.params.data(), one.params.data(), n);
  EXPECT_LT(dp, std::max(1e-2, 2 * spread));
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  std::printf("[gpu %s] %d steps: loss %.4f -> %.4f (two ranks %.4f), worst relative loss %.1e, grad norm %.1e, "
              "weights %.1e (fallback attention %.1e)\n",
              c.name, kSteps, one.loss[0].front(), one.loss[0].back(), mean.back(), g.worst_loss, g.worst_norm, dp,
              spread);
}

INSTANTIATE_TEST_SUITE_P(Layouts, FsdpGpuModelsTest,
                         ::testing::Values(FsdpModelCase{"moe_fsdp", true, nullptr, nullptr},
                                           FsdpModelCase{"llama_fp8_rowwise_fsdp", false, "hybrid", "rowwise"},
                                           FsdpModelCase{"moe_fp8_rowwise_fsdp", true, "hybrid", "rowwise"},
                                           FsdpModelCase{"moe_fp8_blockwise_fsdp", true, "e4m3", "blockwise", true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace primus::backends::cuda::testing

namespace primus::backends::cuda::testing {
namespace {

// The optimizer in the backward beside plain data parallelism on the GPU: two replicas as threads
// sharing the GPU, each its own batch of 4 and each layer's gradients averaged over them before its
// update (two gradient windows), against one rank taking both batches as one micro-batch of 8, for
// 20 steps; the bf16 gate above with one rank on the fallback attention as the spread, and the
// final weights within 1e-2 or twice that run's distance (routing is discrete). The DeepSeek-style
// MoE (the switch loss off: it is each replica's own batch's) with its experts' gradients in bf16,
// as the MoE presets train.
class DpGpuInBackwardTest : public CudaGpuTest, public ::testing::WithParamInterface<int> {};

TEST_P(DpGpuInBackwardTest, TwoReplicasOnOneGpuTrainAsOne) {
  const int which = GetParam();
  train::ModelSpec spec = which == 2 ? tiny_moe_spec(true) : tiny_spec(which == 1);
  spec.moe.aux_loss_coeff = 0.0;
  const bool bf16g = which == 2;
  const char* name = which == 0 ? "gpt2" : which == 1 ? "llama" : "deepseek_moe";
  constexpr int kSteps = 20;
  const FsdpRun one = run_dp_in_backward(spec, 1, 2, turbo::Device::CUDA, kSteps, Attn::Default, bf16g);
  const FsdpRun two = run_dp_in_backward(spec, 2, 2, turbo::Device::CUDA, kSteps, Attn::Default, bf16g);
  const FsdpRun other = run_dp_in_backward(spec, 1, 2, turbo::Device::CUDA, kSteps, Attn::Fallback, bf16g);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one norm";
    EXPECT_EQ(two.loss[1][s], two.loss[0][s]) << "step " << s << ": the averaged loss";
  }
  const Bf16Steps g = expect_bf16_steps("dp2 in backward", one.loss[0], one.gnorm[0], two.loss[0], two.gnorm[0],
                                        other.loss[0], other.gnorm[0]);
  const WeightDistance w = expect_weights_close(two.params, one.params, other.params);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  std::printf("[gpu %s dp2 in backward%s] %d steps: loss %.4f -> %.4f (dp2 %.4f), worst relative loss %.1e, grad norm "
              "%.1e, weights %.1e (fallback attention %.1e); gradient buffer %lld -> %lld elements\n",
              name, bf16g ? ", bf16 expert gradients" : "", kSteps, one.loss[0].front(), one.loss[0].back(),
              two.loss[0].back(), g.worst_loss, g.worst_norm, w.dw, w.spread, static_cast<long long>(one.grad_elems), static_cast<long long>(two.grad_elems));
}

INSTANTIATE_TEST_SUITE_P(Models, DpGpuInBackwardTest, ::testing::Values(0, 1, 2), [](const auto& info) {
  return std::string(info.param == 0 ? "gpt2" : info.param == 1 ? "llama" : "deepseek_moe");
});

}  // namespace
}  // namespace primus::backends::cuda::testing
