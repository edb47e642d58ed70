// Expert parallelism in the CUDA model, checked without a GPU: two and four ranks as threads running
// the model in host mode (fp32 on Turbo's CPU kernels, the same decoder code as on the device),
// each holding its experts and training on its part of every batch, against one rank holding every
// expert on the whole batch (ep_parity.h), for the Mixtral-style and DeepSeek-style tiny MoEs. fp32
// gate of DESIGN.md: every step's mean loss and the one gradient norm within 1e-5 relative, the final
// weights within 1e-4 (the order of summation differs: the dense gradients' mean over the ranks,
// each expert's rows from several ranks).
#include <gtest/gtest.h>

#include <cstdio>
#include <tuple>

#include "ep_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class EpHostTest : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(EpHostTest, RanksTrainAsOne) {
  const auto [deepseek, ep] = GetParam();
  const train::ModelSpec spec = ep_spec(deepseek);
  constexpr int kSteps = 6;
  const EpRun one = run_ep(spec, 1, turbo::Device::CPU, kSteps);
  const EpRun many = run_ep(spec, ep, turbo::Device::CPU, kSteps);
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss, one.gnorm, many.rank_loss, many.rank_gnorm, false);
  const double dw = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dw, 1e-4);
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.1) << "the run must learn";
  std::printf("[host %s ep%d] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              deepseek ? "deepseek_moe" : "mixtral_moe", ep, kSteps, one.loss.front(), one.loss.back(), worst_loss,
              worst_norm, dw);
}

INSTANTIATE_TEST_SUITE_P(Models, EpHostTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(2, 4)), [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "deepseek" : "mixtral") + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
