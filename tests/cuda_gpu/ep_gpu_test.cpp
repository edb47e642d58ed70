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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
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

// The MoE presets' fastest recipe under ep2 and ep4 (the optimizer in the backward, clip 0; the
// experts' gradients in bf16, divided by ep in bf16 before their update; fp32 masters split into the
// bf16 weights and their low halves), and FP8 experts under ep2 (rowwise: Mixtral-style; blockwise:
// DeepSeek-style on the 128-wide model, groups padded to 128 rows), and the experts recomputed in
// the backward (selective, full: the rows moved again by each layer's saved plan): each against one
// rank with the same recipe, within the bf16 gate measured against one rank with the other
// attention kernel.
// FP8 runs quantize some tensors at other granularities on the two sides (a column-scaled copy's
// maxima are over this rank's rows), so their steps differ by FP8's rounding as well: the late
// norms' floor is 5e-2 for them (the FP8 runs under data parallelism, FsdpGpuTest, read up to
// 4.9e-2 on an H100), or twice the worst late distance of the other attention kernel's run where
// that is larger: blockwise FP8's late gradient norms spike, and a spike lands a step earlier or
// later on another trajectory (Mixtral-style blockwise with split masters on an H100: one rank's
// norm 1.52 at step 17 where the other kernel's run read 1.25, the ep run 1.74 at step 18 where one
// rank read 2.00, their losses 2e-4 apart). The early steps' gates are bf16's.
class EpGpuRecipeTest : public CudaGpuTest, public ::testing::WithParamInterface<EpRecipeCase> {};

TEST_P(EpGpuRecipeTest, RanksOnOneGpuTrainAsOne) {
  const EpRecipeCase& c = GetParam();
  const std::unique_ptr<EpCase> ec = ep_case(c);
  const train::ModelSpec& spec = ec->spec;
  const turbo::Fp8Recipe* fp8 = ec->fp8.get();
  const EpRecipe& recipe = ec->recipe;
  constexpr int kSteps = 20;
  const EpRun one = run_ep(spec, 1, turbo::Device::CUDA, kSteps, Attn::Default, recipe);
  const EpRun many = run_ep(spec, c.ep, turbo::Device::CUDA, kSteps, Attn::Default, recipe);
  const EpRun other = run_ep(spec, 1, turbo::Device::CUDA, kSteps, Attn::Fallback, recipe);
  for (int s = 0; s < kSteps; ++s)
    for (int r = 1; r < c.ep; ++r) EXPECT_EQ(many.rank_gnorm[r][s], many.rank_gnorm[0][s]) << "step " << s << ": one norm";
  double late_floor = 2e-2;
  if (fp8) {
    late_floor = 5e-2;
    for (int s = 10; s < kSteps; ++s)
      late_floor = std::max(late_floor, 2 * std::fabs(other.gnorm[s] - one.gnorm[s]) / one.gnorm[s]);
  }
  const Bf16Steps g =
      expect_bf16_steps(c.name, one.loss, one.gnorm, many.loss, many.gnorm, other.loss, other.gnorm, late_floor);
  const WeightDistance w = expect_weights_close(many.params, one.params, other.params);
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.2) << "the run must learn";
  std::printf("[gpu %s ep%d] %d steps: loss %.4f -> %.4f (ep %.4f), worst relative loss %.1e, grad norm %.1e, weights "
              "%.1e (fallback attention %.1e)\n",
              c.name, c.ep, kSteps, one.loss.front(), one.loss.back(), many.loss.back(), g.worst_loss, g.worst_norm, w.dw,
              w.spread);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, EpGpuRecipeTest,
    ::testing::Values(EpRecipeCase{"mixtral_fast_ep2", false, false, 2, false, true, nullptr, nullptr},
                      // Experts 128 wide: SwiGLU in the grouped GEMMs' epilogues over the held groups.
                      EpRecipeCase{"mixtral_fast_128_ep2", false, true, 2, false, true, nullptr, nullptr},
                      EpRecipeCase{"deepseek_fast_ep4", true, false, 4, false, true, nullptr, nullptr},
                      EpRecipeCase{"mixtral_fp8_rowwise_ep2", false, false, 2, false, false, "hybrid", "rowwise"},
                      EpRecipeCase{"deepseek_fp8_blockwise_ep2", true, true, 2, false, false, "e4m3", "blockwise"},
                      EpRecipeCase{"mixtral_fp8_blockwise_fast_ep2", false, true, 2, false, true, "e4m3", "blockwise"},
                      EpRecipeCase{"mixtral_fast_selective_ep2", false, false, 2, false, true, nullptr, nullptr,
                                   Recompute::Selective},
                      EpRecipeCase{"mixtral_fp8_rowwise_full_ep2", false, false, 2, false, false, "hybrid", "rowwise",
                                   Recompute::Full},
                      EpRecipeCase{"deepseek_muon_ep2", true, false, 2, false, false, nullptr, nullptr,
                                   Recompute::None, true}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace primus::backends::cuda::testing
