// Tensor parallelism in the CUDA model on the GPU: two ranks as threads sharing one GPU, the
// collectives through device memory (parallel/cuda/threaded_device_ops.h), against one rank, for
// 20 steps of GPT-2, a GQA Llama and Qwen3's per-head q|k norms, each with and without sequence
// parallelism, with bf16's own spread measured
// beside it: one rank again with the other attention kernel (same model, other rounding).
// bf16 gate of DESIGN.md: every step's loss within 1e-2 of one rank's (measured: <= 1e-3, as the
// fallback run), the final weights within 1e-2, the gradient norm within 1e-2 for the first 10
// steps. After that the bf16 trajectories have separated, and at a gradient spike the norm is
// sensitive to them (Llama step 18 on an H200: tp2 +9.1%, the fallback attention +3.4%): later
// norms are held to 2% or 4x the fallback run's distance, whichever is larger. Each rank's model
// also holds less device memory than the whole one.
#define PRIMUS_TP_PARITY_DEVICE 1
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "bf16_gate.h"
#include "tp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class TpGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<std::tuple<int, bool>> {};

TEST_P(TpGpuTest, TwoRanksOnOneGpuTrainAsOne) {
  const auto [which, sp] = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 20;
  const TpRun one = run_tp(spec, 1, turbo::Device::CUDA, kSteps);
  const TpRun two = run_tp(spec, 2, turbo::Device::CUDA, kSteps, Attn::Default, sp);
  // bf16's own spread: one rank again with the other attention kernel (other rounding, same model).
  const TpRun other = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s)
    EXPECT_EQ(two.loss[1][s], two.loss[0][s]) << "step " << s << ": every rank has the whole loss";
  const Bf16Steps g = expect_bf16_steps("tp2", one.loss[0], one.gnorm[0], two.loss[0], two.gnorm[0], other.loss[0],
                                        other.gnorm[0]);
  const double worst_loss = g.worst_loss, worst_norm = g.worst_norm;
  const WeightDistance w = expect_weights_close(two.params, one.params, other.params);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  EXPECT_LT(two.reserved_bytes[0], one.reserved_bytes[0]);
  EXPECT_LT(two.activation_bytes[0], one.activation_bytes[0]);
  std::printf("[gpu %s tp2%s] %d steps: loss %.4f -> %.4f (tp2 %.4f), worst relative loss %.1e, grad norm %.1e, "
              "weights %.1e (fallback attention %.1e); per rank: model memory %.1f MiB vs %.1f MiB on one, activations %.2f "
              "vs %.2f MiB\n",
              tp_spec_name(which), sp ? "+sp" : "", kSteps, one.loss[0].front(), one.loss[0].back(),
              two.loss[0].back(), worst_loss, worst_norm, w.dw, w.spread, two.reserved_bytes[0] / 1048576.0,
              one.reserved_bytes[0] / 1048576.0, two.activation_bytes[0] / 1048576.0,
              one.activation_bytes[0] / 1048576.0);
}

INSTANTIATE_TEST_SUITE_P(Models, TpGpuTest, ::testing::Combine(::testing::Values(0, 1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(tp_spec_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_sp" : "");
                         });

// The optimizer in the backward under tensor parallelism with sequence parallelism, two ranks
// sharing the GPU against one rank with it (eager steps, as every parity run): the bf16 gate of
// TpGpuTest, the fallback attention's run as the spread.
class TpGpuInBackwardTest : public CudaGpuTest, public ::testing::WithParamInterface<int> {};

TEST_P(TpGpuInBackwardTest, TwoRanksOnOneGpuTrainAsOne) {
  const int which = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 20;
  const TpRun one = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Default, false, {}, true);
  const TpRun two = run_tp(spec, 2, turbo::Device::CUDA, kSteps, Attn::Default, true, {}, true);
  const TpRun other = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback, false, {}, true);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one norm";
  const Bf16Steps g = expect_bf16_steps("tp2 in backward", one.loss[0], one.gnorm[0], two.loss[0], two.gnorm[0],
                                        other.loss[0], other.gnorm[0]);
  const WeightDistance w = expect_weights_close(two.params, one.params, other.params);
  std::printf("[gpu %s tp2+sp in backward] %d steps: loss %.4f -> %.4f (tp2 %.4f), worst relative loss %.1e, grad "
              "norm %.1e, weights %.1e (fallback attention %.1e)\n",
              tp_spec_name(which), kSteps, one.loss[0].front(), one.loss[0].back(), two.loss[0].back(), g.worst_loss,
              g.worst_norm, w.dw, w.spread);
}

INSTANTIATE_TEST_SUITE_P(Models, TpGpuInBackwardTest, ::testing::Values(1, 3),
                         [](const auto& info) { return std::string(tp_spec_name(info.param)); });

// Muon under tensor parallelism on the GPU (the pieces' momentum updates gathered over the tp group,
// Newton-Schulz's bf16 GEMMs on the whole matrix on every rank): tp2 with sequence parallelism
// against one rank with Muon, the bf16 gate of TpGpuTest with the fallback attention's run as the
// spread. The DeepSeek-style MoE's single key/value group is replicated on both ranks.
class TpGpuMuonTest : public CudaGpuTest, public ::testing::WithParamInterface<int> {};

TEST_P(TpGpuMuonTest, TwoRanksOnOneGpuTrainAsOne) {
  const int which = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 20;
  const TpRun one = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Default, false, {}, false, true);
  const TpRun two = run_tp(spec, 2, turbo::Device::CUDA, kSteps, Attn::Default, true, {}, false, true);
  const TpRun other = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback, false, {}, false, true);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one norm";
  const Bf16Steps g = expect_bf16_steps("tp2 muon", one.loss[0], one.gnorm[0], two.loss[0], two.gnorm[0],
                                        other.loss[0], other.gnorm[0]);
  const WeightDistance w = expect_weights_close(two.params, one.params, other.params);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  std::printf("[gpu %s tp2+sp muon] %d steps: loss %.4f -> %.4f (tp2 %.4f), worst relative loss %.1e, grad norm %.1e, "
              "weights %.1e (fallback attention %.1e)\n",
              tp_spec_name(which), kSteps, one.loss[0].front(), one.loss[0].back(), two.loss[0].back(), g.worst_loss,
              g.worst_norm, w.dw, w.spread);
}

INSTANTIATE_TEST_SUITE_P(Models, TpGpuMuonTest, ::testing::Values(0, 1, 3),
                         [](const auto& info) { return std::string(tp_spec_name(info.param)); });

// Four ranks over the Llama's and Qwen3's two key/value groups: each group replicated on two
// ranks (its gradient summed over them, counted once in the norm). The loss, weight and first-10-
// steps gates are the tp2 test's. Past step 10 the runs sit at gradient spikes where one
// sample of another rounding is a noisy yardstick: on an H200 the Llama's tp4 norm was +4.6% at
// step 16 where the fallback run happened to be +1.1%, and +2.6% at step 18 where the fallback
// was +3.4% (losses within 1.0e-3 throughout); on an H100 +6.5% at step 16 where the fallback was
// +1.5% (losses within 1.4e-3, mean distance 1.7% against 1.3%, weights 2.7e-3). So each later step
// is held to 8% (the mesh test's bound) or 4x the fallback's distance, and the later steps' mean
// distance to 2% or twice the fallback's mean (measured 1.4% against 1.0%; Qwen3 0.5%).
class TpGpuKvTest : public CudaGpuTest, public ::testing::WithParamInterface<int> {};

TEST_P(TpGpuKvTest, FourRanksReplicatingKeyValueGroupsTrainAsOne) {
  const int which = GetParam();
  const train::ModelSpec spec = tp_spec(which);
  constexpr int kSteps = 20;
  const TpRun one = run_tp(spec, 1, turbo::Device::CUDA, kSteps);
  const TpRun four = run_tp(spec, 4, turbo::Device::CUDA, kSteps);
  const TpRun other = run_tp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback);
  const Bf16Steps g = expect_bf16_steps("tp4", one.loss[0], one.gnorm[0], four.loss[0], four.gnorm[0], other.loss[0],
                                        other.gnorm[0], /*late_floor=*/8e-2);
  const double worst_loss = g.worst_loss, worst_norm = g.worst_norm, late = g.late_norm, late_other = g.late_other;
  EXPECT_LT(late, std::max(2e-2, 2 * late_other)) << "mean grad-norm distance past step 10 (fallback " << late_other << ")";
  const double dp = rel_l2(four.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-2);
  std::printf("[gpu %s tp4, kv groups replicated x2] %d steps: loss %.4f -> %.4f (tp4 %.4f), worst relative loss %.1e, "
              "grad norm %.1e (mean past step 10 %.1e, fallback %.1e), weights %.1e\n",
              tp_spec_name(which), kSteps, one.loss[0].front(), one.loss[0].back(), four.loss[0].back(), worst_loss,
              worst_norm, late, late_other, dp);
}

INSTANTIATE_TEST_SUITE_P(Models, TpGpuKvTest, ::testing::Values(1, 2),
                         [](const auto& info) { return std::string(tp_spec_name(info.param)); });

}  // namespace
}  // namespace primus::backends::cuda::testing
