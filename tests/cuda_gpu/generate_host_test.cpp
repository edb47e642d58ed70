// The inference engine in host mode (fp32, Turbo's CPU backends; no GPU needed) against the
// reference model: generate_fixture.h. MoE routing with token dropping is refused.
#include "tests/cuda_gpu/generate_fixture.h"

#include "core/util/error.h"

namespace primus::backends::cuda::testing {
namespace {

using GenerateHostTest = GenerateTestT<turbo::Device::CPU>;
TEST_P(GenerateHostTest, PrefillAndDecodeLogitsEqualTheReference) { PrefillAndDecodeLogitsEqualTheReference(); }
TEST_P(GenerateHostTest, CachedDecodeEqualsWindowRecompute) { CachedDecodeEqualsWindowRecompute(); }
TEST_P(GenerateHostTest, GreedyTokensEqualTheReferenceAwayFromTies) { GreedyTokensEqualTheReferenceAwayFromTies(); }
INSTANTIATE_TEST_SUITE_P(Families, GenerateHostTest, ::testing::Range(0, kGenerateFamilies), generate_family_name);

TEST(InferenceEngine, RefusesTokenDropping) {
  train::ModelSpec s = tiny_moe_spec(false);
  s.moe.capacity_factor = 1.25;
  const std::vector<float> p(static_cast<size_t>(train::make_param_layout(s).total), 0.0f);
  try {
    InferenceEngine e(s, p.data(), 1, turbo::Device::CPU);
    FAIL() << "a capacity factor accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("moe_expert_capacity_factor"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
