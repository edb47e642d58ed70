// The model key sliding_window in the spec: the checkpoint's spec JSON carries it (and only when
// set, so full-attention checkpoints stay byte-identical), the summary names it, and the FLOPs
// per token count the keys each query sees.
#include <gtest/gtest.h>

#include "tests/common/tiny_models.h"
#include "train/checkpointing.h"
#include "train/model_spec.h"

namespace primus::train {
namespace {

TEST(SlidingWindowSpec, CheckpointSpecCarriesTheWindow) {
  ModelSpec m = primus::testing::tiny_llama();
  EXPECT_FALSE(spec_json(m).contains("sliding_window"));
  m.sliding_window = 5;
  const nlohmann::json j = spec_json(m);
  EXPECT_EQ(j.at("sliding_window"), 5);
  EXPECT_EQ(spec_from_json(j).sliding_window, 5);
  EXPECT_NE(m.summary().find("sliding window 5"), std::string::npos) << m.summary();
}

TEST(SlidingWindowSpec, FlopsCountTheKeysEachQuerySees) {
  ModelSpec m = primus::testing::tiny_llama(29, 32, 64);  // T = 64
  const double full = m.flops_per_token();
  // Attention's term is 6 L q_dim T for causal attention (T/2 keys per query on average, twice).
  const double attn_full = 6.0 * m.num_layers * m.q_dim() * 64;
  m.sliding_window = 16;  // keys seen: 1, 2, ..., 16, then 16 for the other 48 queries
  const double avg = (16.0 * 17 / 2 + 48.0 * 16) / 64;
  EXPECT_NEAR(m.flops_per_token(), full - attn_full + 6.0 * m.num_layers * m.q_dim() * 2 * avg, 1e-6 * full);
  m.sliding_window = 64;  // a window of T: every query sees all earlier keys, T(T+1)/2 pairs
  EXPECT_NEAR(m.flops_per_token(), full - attn_full + 6.0 * m.num_layers * m.q_dim() * 65, 1e-6 * full);
}

}  // namespace
}  // namespace primus::train
