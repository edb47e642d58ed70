// Context parallelism in the CUDA model, checked without a GPU: two and four ranks as threads
// running the model in host mode (fp32 on Turbo's CPU kernels, the same decoder and attention
// code as on the device) against one rank, for GPT-2 (learned positions) and a GQA Llama (RoPE).
// fp32 gate of DESIGN.md: every step's mean loss over the ranks and gradient norm within 1e-5
// relative of one rank's, the final weights within 1e-4 (the attention's sums are split by key
// chunks and merged by log-sum-exp; the weights' gradients are summed in another order).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "core/util/error.h"
#include "tests/core/test_util.h"
#include "cp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class CpHostTest : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(CpHostTest, RanksTrainAsOne) {
  const auto [llama, cp] = GetParam();
  const train::ModelSpec spec = tiny_spec(llama);
  constexpr int kSteps = 6;
  const CpRun one = run_cp(spec, 1, turbo::Device::CPU, kSteps);
  const CpRun many = run_cp(spec, cp, turbo::Device::CPU, kSteps);
  for (int s = 0; s < kSteps; ++s) EXPECT_NE(many.loss[1][s], many.loss[0][s]) << "each rank its own tokens";
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], many.loss, many.gnorm, false);
  const double dp = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dp, 1e-4);
  EXPECT_LT(one.loss[0].back(), one.loss[0].front() - 0.1) << "the run must learn";
  std::printf("[host %s cp%d] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              llama ? "llama" : "gpt2", cp, kSteps, one.loss[0].front(), one.loss[0].back(), worst_loss, worst_norm, dp);
}

INSTANTIATE_TEST_SUITE_P(Models, CpHostTest, ::testing::Combine(::testing::Bool(), ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "llama" : "gpt2") + "_cp" +
                                  std::to_string(std::get<1>(info.param));
                         });

// FP8 linear layers under context parallelism keep their inputs for the backward as FP8
// transposed copies (turbo::Fp8SavedInputs), as one process does: each rank's copies are of its
// own tokens, the bytes its backward would quantize again, so every rank's losses and the final
// weights equal those of the same ranks without the copies bit for bit, for each scaling, with
// less activation memory. The copied side also takes the SwiGLU kernels' maxima (rowwise), which
// the host quantizer checks against its own pass, and under delayed scaling has the SwiGLU folded
// into its quantizers (turbo::Fp8Producers).
TEST(CpHostFp8, InputsSavedInFp8GiveTheSameStepsWithLessMemory) {
  const train::ModelSpec spec = tiny_spec(true);
  constexpr int kSteps = 4, kCp = 2;
  for (const char* scaling : {"tensorwise", "rowwise", "delayed"}) {
    SCOPED_TRACE(scaling);
    const CpRun saved = run_cp(spec, kCp, turbo::Device::CPU, kSteps, Attn::Default,
                               [&] { return fp8_test_recipe("hybrid", scaling, {.saved = true, .maxima = true, .producers = true}); });
    const CpRun plain = run_cp(spec, kCp, turbo::Device::CPU, kSteps, Attn::Default,
                               [&] { return fp8_test_recipe("hybrid", scaling); });
    for (int r = 0; r < kCp; ++r) {
      EXPECT_EQ(saved.loss[r], plain.loss[r]) << "rank " << r;
      EXPECT_EQ(saved.saved_slots[r], static_cast<size_t>(3 * spec.num_layers)) << "rank " << r;
      EXPECT_LT(saved.activation_bytes[r], plain.activation_bytes[r]) << "rank " << r;
    }
    EXPECT_TRUE(saved.params == plain.params) << "weights differ";
    EXPECT_NE(saved.loss[0], saved.loss[1]) << "each rank its own tokens";
  }
}

// The optimizer in the backward under context parallelism: each layer's gradients averaged over
// the group before its update, the loss slots before the first (so every rank reads the sequences'
// mean loss): GPT-2 cp2 and the GQA Llama cp4 against one rank with it, at the fp32 gate.
TEST(CpHostInBackward, RanksTrainAsOne) {
  for (const auto& [llama, cp] : {std::pair{false, 2}, std::pair{true, 4}}) {
    SCOPED_TRACE(std::string(llama ? "llama" : "gpt2") + " cp" + std::to_string(cp));
    const train::ModelSpec spec = tiny_spec(llama);
    constexpr int kSteps = 6;
    const CpRun one = run_cp(spec, 1, turbo::Device::CPU, kSteps, Attn::Default, {}, true);
    const CpRun many = run_cp(spec, cp, turbo::Device::CPU, kSteps, Attn::Default, {}, true);
    // Every rank reads the averaged loss.
    const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss[0], one.gnorm[0], many.loss, many.gnorm, true);
    const double dp = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
    EXPECT_LT(dp, 1e-4);
    std::printf("[host %s cp%d in backward] %d steps: worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
                llama ? "llama" : "gpt2", cp, kSteps, worst_loss, worst_norm, dp);
  }
}

TEST(CpHostRefusals, UnsupportedCombinationsNameTheKey) {
  auto hub = parallel::ThreadedGroup::create(2, std::chrono::seconds(5));
  std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(0);
  auto expect_config_error = [](auto&& f, const char* key) { primus::testing::expect_error<ConfigError>(f, {key}); };
  const train::ModelSpec spec = tiny_spec(true);
  auto build = [&](auto&& tweak, train::ModelSpec s) {
    CudaModelOptions mo = options(s, 2, turbo::Device::CPU);
    mo.cp_group = pg.get();
    tweak(mo);
    CudaModel model(s, mo, ops_for(Attn::Default));
  };
  train::ModelSpec windowed = spec;
  windowed.sliding_window = 16;
  expect_config_error([&] { build([](CudaModelOptions&) {}, windowed); }, "context_parallel_size");
  expect_config_error([&] { build([](CudaModelOptions& mo) { mo.document_masking.reset_attention_mask = true; }, spec); },
                      "reset_attention_mask");
}

}  // namespace
}  // namespace primus::backends::cuda::testing
