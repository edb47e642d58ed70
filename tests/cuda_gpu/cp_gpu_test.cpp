// Context parallelism in the CUDA model on the GPU: two ranks as threads sharing one GPU, the
// collectives through device memory (parallel/cuda/threaded_device_ops.h), each holding its two
// chunks of every sequence, against one rank for 20 steps of GPT-2 and a GQA Llama. bf16 gate of
// DESIGN.md, as the tensor-parallel test's: every step's mean loss within 1e-2 relative, the
// gradient norm within 1e-2 for the first 10 steps, the final weights within 1e-2. After that the
// bf16 trajectories have separated and the norm at a gradient spike is sensitive to them (GPT-2
// step 16 on an H200: cp2 -5.0%, loss -1.4e-4): later norms are held to 2% or 4x the distance of
// one rank with the other attention kernel (same model, other rounding), whichever is larger.
// Each rank's activations are those of its own tokens (plus the gathered k|v).
#define PRIMUS_CP_PARITY_DEVICE 1
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "bf16_gate.h"
#include "cp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class CpGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<bool> {};

TEST_P(CpGpuTest, TwoRanksOnOneGpuTrainAsOne) {
  const bool llama = GetParam();
  const train::ModelSpec spec = tiny_spec(llama);
  constexpr int kSteps = 20;
  const CpRun one = run_cp(spec, 1, turbo::Device::CUDA, kSteps);
  const CpRun two = run_cp(spec, 2, turbo::Device::CUDA, kSteps);
  const CpRun other = run_cp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one global norm";
  const std::vector<double> mean = rank_mean(two.loss);
  const Bf16Steps g =
      expect_bf16_steps("cp2", one.loss[0], one.gnorm[0], mean, two.gnorm[0], other.loss[0], other.gnorm[0]);
  const double worst_loss = g.worst_loss, worst_norm = g.worst_norm;
  const double dp = rel_l2(two.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-2);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.2) << "the run must learn";
  std::printf("[gpu %s cp2] %d steps: loss %.4f -> %.4f (cp2 %.4f), worst relative loss %.1e, grad norm %.1e, "
              "weights %.1e; activations per rank %.2f MiB vs %.2f MiB on one\n",
              llama ? "llama" : "gpt2", kSteps, one.loss[0].front(), one.loss[0].back(),
              mean.back(), worst_loss, worst_norm, dp,
              two.activation_bytes[0] / 1048576.0, one.activation_bytes[0] / 1048576.0);
}

INSTANTIATE_TEST_SUITE_P(Models, CpGpuTest, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "llama" : "gpt2"); });

// The optimizer in the backward under context parallelism (each layer's gradients averaged over
// the group before its update): the Llama cp2 on one GPU against one rank with it, at the same
// bf16 gate. Not run yet (no GPU lent).
class CpGpuInBackwardTest : public CudaGpuTest {};

TEST_F(CpGpuInBackwardTest, TwoRanksOnOneGpuTrainAsOne) {
  const train::ModelSpec spec = tiny_spec(true);
  constexpr int kSteps = 20;
  const CpRun one = run_cp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Default, {}, true);
  const CpRun two = run_cp(spec, 2, turbo::Device::CUDA, kSteps, Attn::Default, {}, true);
  const CpRun other = run_cp(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback, {}, true);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(two.gnorm[1][s], two.gnorm[0][s]) << "step " << s << ": one global norm";
  const Bf16Steps g = expect_bf16_steps("cp2 in backward", one.loss[0], one.gnorm[0], two.loss[0], two.gnorm[0],
                                        other.loss[0], other.gnorm[0]);
  const double dp = rel_l2(two.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-2);
  std::printf("[gpu llama cp2 in backward] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e\n", kSteps,
              g.worst_loss, g.worst_norm, dp);
}

}  // namespace
}  // namespace primus::backends::cuda::testing
