// Expert parallelism in the CUDA model on the GPU: two and four ranks as threads sharing one GPU
// (the all-to-alls and the gradients' means through device memory, parallel/cuda/
// threaded_device_ops.h), each holding its experts and training on its part of every batch,
// against one rank holding every expert on the whole batch (ep_parity.h), for 20 steps of the
// Mixtral-style and DeepSeek-style tiny MoEs, with bf16's own spread measured beside it: one rank
// again with the other attention kernel. The bf16 gate of bf16_gate.h: losses and early gradient
// norms within 1e-2 (later norms within 2% or the spread's multiple), the final weights within 1e-2
// or twice the spread (routing is discrete: a rounding difference moves tokens between experts).
#define PRIMUS_EP_PARITY_DEVICE 1
#include <gtest/gtest.h>

#include <cstdio>
#include <tuple>

#include "bf16_gate.h"
#include "ep_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class EpGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<std::tuple<bool, int>> {};

TEST_P(EpGpuTest, RanksOnOneGpuTrainAsOne) {
  const auto [deepseek, ep] = GetParam();
  const train::ModelSpec spec = ep_spec(deepseek);
  constexpr int kSteps = 20;
  const EpRun one = run_ep(spec, 1, turbo::Device::CUDA, kSteps);
  const EpRun many = run_ep(spec, ep, turbo::Device::CUDA, kSteps);
  const EpRun other = run_ep(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s)
    for (int r = 1; r < ep; ++r) EXPECT_EQ(many.rank_gnorm[r][s], many.rank_gnorm[0][s]) << "step " << s << ": one norm";
  const Bf16Steps g =
      expect_bf16_steps(ep == 2 ? "ep2" : "ep4", one.loss, one.gnorm, many.loss, many.gnorm, other.loss, other.gnorm);
  const WeightDistance w = expect_weights_close(many.params, one.params, other.params);
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.2) << "the run must learn";
  std::printf("[gpu %s ep%d] %d steps: loss %.4f -> %.4f (ep %.4f), worst relative loss %.1e, grad norm %.1e, weights "
              "%.1e (fallback attention %.1e)\n",
              deepseek ? "deepseek_moe" : "mixtral_moe", ep, kSteps, one.loss.front(), one.loss.back(),
              many.loss.back(), g.worst_loss, g.worst_norm, w.dw, w.spread);
}

INSTANTIATE_TEST_SUITE_P(Models, EpGpuTest, ::testing::Combine(::testing::Bool(), ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "deepseek" : "mixtral") + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
