// The inference engine on the GPU (bf16) against the reference model: generate_fixture.h.
#include "tests/cuda_gpu/generate_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

using GenerateTest = GenerateTestT<turbo::Device::CUDA>;
TEST_P(GenerateTest, PrefillAndDecodeLogitsEqualTheReference) { PrefillAndDecodeLogitsEqualTheReference(); }
TEST_P(GenerateTest, CachedDecodeEqualsWindowRecompute) { CachedDecodeEqualsWindowRecompute(); }
TEST_P(GenerateTest, GreedyTokensEqualTheReferenceAwayFromTies) { GreedyTokensEqualTheReferenceAwayFromTies(); }
INSTANTIATE_TEST_SUITE_P(Families, GenerateTest, ::testing::Range(0, kGenerateFamilies), generate_family_name);

}  // namespace
}  // namespace primus::backends::cuda::testing
