// Step 0 of the CUDA model against the reference backend's GptModel<float> (the oracle), for the
// tiny GPT-2 and Llama and each attention implementation: same weights (the reference's init,
// norm weights and biases jittered so their gradients are generic, all rounded to bf16 so both
// sides compute with identical weights), same random batch.
// Gates: loss relative error < 1e-2 (the bf16 gate); every parameter tensor's gradient
// relative L2 error ||g_cuda - g_ref|| / ||g_ref|| < 2e-2. The errors are printed per tensor.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backends/cuda/attention_fallback.h"
#include "backends/cuda/model.h"
#include "backends/reference/model.h"
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
  train::ModelSpec spec = tiny_spec(llama);
  spec.init_method_std = 0.1;  // enough signal through attention for the q/k gradients
  const int64_t B = 4, T = spec.seq_length;
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937 rng(seed);

  reference::GptModel<float> ref(spec, B, T);
  ref.init_weights(seed);
  std::normal_distribution<float> jitter(0.0f, 0.1f);
  for (const auto& t : ref.layout().tensors) {
    const bool generic = t.name.find("norm") != std::string::npos || t.name.find("bias") != std::string::npos;
    for (int64_t i = 0; i < t.numel; ++i) {
      float& w = ref.params[t.offset + i];
      if (generic) w += jitter(rng);
      w = round_bf16(w);
    }
  }
  std::vector<int32_t> tokens(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(spec.vocab_size) - 1);
  for (auto& x : tokens) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  const double dloss = 1.0 / double(B * T);

  ref.zero_grad();
  const double ref_loss = ref.forward(tokens.data(), targets.data(), B, T, dloss);
  ref.backward();

  CudaModelOptions mo;
  mo.max_batch = B;
  mo.max_seq = T;
  mo.attention_scratch_bytes =
      fallback_attention_scratch_bytes(B, T, spec.num_attention_heads, spec.num_query_groups, spec.head_dim());
  CudaModel model(spec, mo, ops_for(attn));
  ASSERT_EQ(model.layout().total, ref.layout().total);
  model.set_params(ref.params.data());
  model.zero_grad();
  model.forward(tokens.data(), targets.data(), B, T, static_cast<float>(dloss), 0);
  model.backward();
  const double loss = model.read_loss_sum(1);
  EXPECT_NEAR(loss, ref_loss, 1e-2 * ref_loss) << "step-0 loss";

  std::vector<float> grads(static_cast<size_t>(model.layout().total));
  model.get_grads(grads.data());
  std::string table;
  double worst = 0;
  for (const auto& t : model.layout().tensors) {
    const double e = rel_l2(grads.data() + t.offset, ref.grads.data() + t.offset, t.numel);
    worst = std::max(worst, e);
    table += fmt::format("  {:<28} {:.2e}\n", t.name, e);
    EXPECT_LT(e, 2e-2) << t.name;
  }
  std::printf("[%s, attention %s] loss cuda %.6f ref %.6f; gradient relative L2 per tensor (worst %.2e):\n%s",
              spec.model_type.c_str(), attn_name(attn).c_str(), loss, ref_loss, worst, table.c_str());

  // Evaluation (no gradient) gives the same loss and leaves the gradients alone.
  model.forward(tokens.data(), targets.data(), B, T, 0.0f, 0);
  EXPECT_NEAR(model.read_loss_sum(1), loss, 1e-5 * loss);
  std::vector<float> again(grads.size());
  model.get_grads(again.data());
  EXPECT_EQ(again, grads);
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
