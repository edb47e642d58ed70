// The CUDA model's wiring, checked without a GPU: CudaModel in host mode (fp32, every op on
// Turbo's CPU backend, the fallback attention's GEMMs on the CPU GEMM) against the reference
// backend. Same comparisons as the GPU tests with the fp32 gate of DESIGN.md: loss and every
// gradient tensor within 1e-4 relative (measured: ~1e-6); 10 training steps within 1e-5 per
// step (measured: ~2e-7; both sides run the same CPU kernels, so only summation order differs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

struct Case {
  bool llama;
  Attn attn;
};

class HostParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(HostParityTest, Step0LossAndEveryGradientMatchReference) {
  const auto [llama, attn] = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const Step0 r = step0_parity(llama, attn, turbo::Device::CPU, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-5 * r.ref_loss);
  EXPECT_GT(r.errors.size(), 10u);
  double worst = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    EXPECT_LT(e, 1e-4) << name;
  }
  std::printf("[host %s, attention %s] loss %.7f ref %.7f, worst gradient relative L2 %.2e\n",
              llama ? "llama" : "gpt2", attn_name(attn).c_str(), r.loss, r.ref_loss, worst);
  EXPECT_NEAR(r.eval_loss, r.loss, 1e-6 * r.loss);
  EXPECT_TRUE(r.eval_kept_grads);
}

TEST_P(HostParityTest, TenTrainingStepsFollowTheReference) {
  const auto [llama, attn] = GetParam();
  const auto [curve, ref] = training_curves(llama, attn, turbo::Device::CPU, 10);
  ASSERT_EQ(curve.size(), 10u);
  double worst = 0;
  for (size_t s = 0; s < curve.size(); ++s) {
    worst = std::max(worst, std::fabs(curve[s] - ref[s]) / ref[s]);
    EXPECT_NEAR(curve[s], ref[s], 1e-5 * ref[s]) << "step " << s;
  }
  std::printf("[host %s, attention %s] 10 steps: loss %.4f -> %.4f, worst relative difference %.2e\n",
              llama ? "llama" : "gpt2", attn_name(attn).c_str(), curve.front(), curve.back(), worst);
  EXPECT_LT(ref.back(), ref.front() - 0.2) << "the reference must learn";
}

INSTANTIATE_TEST_SUITE_P(Host, HostParityTest,
                         ::testing::Values(Case{false, Attn::Default}, Case{false, Attn::Fallback},
                                           Case{true, Attn::Default}, Case{true, Attn::Fallback}),
                         [](const auto& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt2") +
                                  (info.param.attn == Attn::Default ? "Default" : "Fallback");
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
