// Step 0 of the CUDA model on the device against the reference backend's GptModel<float> (the
// oracle), for the tiny GPT-2 and Llama and each attention implementation (see step0_parity).
// Gates: loss relative error < 1e-2 (the bf16 gate); every parameter tensor's gradient relative
// L2 error ||g_cuda - g_ref|| / ||g_ref|| < 2e-2. The errors are printed per tensor.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

struct Case {
  bool llama;
  Attn attn;
};

class ModelParityTest : public CudaGpuTest, public ::testing::WithParamInterface<Case> {};

TEST_P(ModelParityTest, LossAndEveryGradientMatchReference) {
  const auto [llama, attn] = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const Step0 r = step0_parity(llama, attn, turbo::Device::CUDA, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-2 * r.ref_loss) << "step-0 loss";
  std::string table;
  double worst = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    table += fmt::format("  {:<28} {:.2e}\n", name, e);
    EXPECT_LT(e, 2e-2) << name;
  }
  std::printf("[%s, attention %s] loss cuda %.6f ref %.6f; gradient relative L2 per tensor (worst %.2e):\n%s",
              llama ? "llama" : "gpt2", attn_name(attn).c_str(), r.loss, r.ref_loss, worst, table.c_str());
  EXPECT_NEAR(r.eval_loss, r.loss, 1e-5 * r.loss) << "a forward without gradient gives the same loss";
  EXPECT_TRUE(r.eval_kept_grads) << "a forward without gradient must not touch the gradients";
}

INSTANTIATE_TEST_SUITE_P(Cuda, ModelParityTest,
                         ::testing::Values(Case{false, Attn::Default}, Case{false, Attn::Fallback},
                                           Case{true, Attn::Default}, Case{true, Attn::Fallback}),
                         [](const auto& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt2") +
                                  (info.param.attn == Attn::Default ? "Default" : "Fallback");
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
