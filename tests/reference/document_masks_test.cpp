// Document masking in the reference model (reset_attention_mask + reset_position_ids): a packed
// sample of two documents gives every token the logits (so the per-token losses) of the two
// documents run separately, with RoPE and with learned positions; without the masks it does not.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backends/reference/model.h"
#include "tests/common/tiny_models.h"

using namespace primus;
using primus::backends::reference::GptModel;

namespace {

constexpr int32_t kEod = 28;  // tiny models' last vocabulary id

std::vector<float> logits_of(GptModel<float>& m, const std::vector<int32_t>& tokens) {
  const auto T = static_cast<int64_t>(tokens.size());
  m.forward(tokens.data(), nullptr, 1, T);
  const int64_t V = m.spec().padded_vocab_size;
  return std::vector<float>(m.logits(), m.logits() + T * V);
}

// Per-token cross-entropy against targets over the first `vocab` of each row's `V` logits (the
// padded columns are not part of the softmax, as in the model's loss).
std::vector<double> token_losses(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t V,
                                 int64_t vocab) {
  std::vector<double> out;
  for (size_t t = 0; t < targets.size(); ++t) {
    const float* l = logits.data() + t * V;
    double m = l[0], s = 0;
    for (int64_t v = 1; v < vocab; ++v) m = std::max<double>(m, l[v]);
    for (int64_t v = 0; v < vocab; ++v) s += std::exp(l[v] - m);
    out.push_back(m + std::log(s) - l[targets[t]]);
  }
  return out;
}

void packed_equals_separate(train::ModelSpec spec) {
  const int64_t T = 24, a = 10;  // document A: 9 tokens + EOD; document B: 14 tokens
  spec.seq_length = T;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, kEod - 1);
  std::vector<int32_t> packed(T), targets(T);
  for (auto& x : packed) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  packed[a - 1] = kEod;
  const std::vector<int32_t> doc_a(packed.begin(), packed.begin() + a), doc_b(packed.begin() + a, packed.end());
  const int64_t V = spec.padded_vocab_size;

  GptModel<float> model(spec, 1, T);
  model.init_weights(rng());
  const std::vector<float> la = logits_of(model, doc_a), lb = logits_of(model, doc_b);
  const std::vector<float> unmasked = logits_of(model, packed);
  model.set_document_masking({true, true, kEod});
  const std::vector<float> lp = logits_of(model, packed);

  std::vector<float> separate = la;
  separate.insert(separate.end(), lb.begin(), lb.end());
  ASSERT_EQ(separate.size(), lp.size());
  double max_diff = 0, scale = 0, unmasked_diff = 0;
  for (size_t i = 0; i < lp.size(); ++i) {
    max_diff = std::max<double>(max_diff, std::abs(lp[i] - separate[i]));
    unmasked_diff = std::max<double>(unmasked_diff, std::abs(unmasked[i] - separate[i]));
    scale = std::max<double>(scale, std::abs(separate[i]));
  }
  EXPECT_LT(max_diff, 1e-5 * scale) << "packed logits differ from the documents run alone";
  EXPECT_GT(unmasked_diff, 1e-3 * scale) << "without masks document B must see document A";
  // The per-token losses, and the packed batch's mean loss is the token-weighted mean of the two.
  const auto loss_p = token_losses(lp, targets, V, spec.vocab_size),
             loss_s = token_losses(separate, targets, V, spec.vocab_size);
  for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(loss_p[t], loss_s[t], 1e-5) << "token " << t;
  double mean_s = 0;
  for (double l : loss_s) mean_s += l / T;
  EXPECT_NEAR(model.forward(packed.data(), targets.data(), 1, T), mean_s, 1e-5);
}

}  // namespace

TEST(ReferenceDocumentMasks, PackedEqualsSeparateRope) { packed_equals_separate(primus::testing::tiny_llama()); }
TEST(ReferenceDocumentMasks, PackedEqualsSeparateLearnedPositions) {
  packed_equals_separate(primus::testing::tiny_gpt2());
}
TEST(ReferenceDocumentMasks, PackedEqualsSeparateWithSlidingWindow) {
  train::ModelSpec m = primus::testing::tiny_llama();
  m.sliding_window = 4;  // the window stops at the document start as well
  packed_equals_separate(m);
}

// A window shorter than the sequence changes the logits of tokens past the window only.
TEST(ReferenceSlidingWindow, ChangesOnlyTokensPastTheWindow) {
  train::ModelSpec spec = primus::testing::tiny_llama();
  spec.seq_length = 16;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 28);
  std::vector<int32_t> tokens(16);
  for (auto& x : tokens) x = tok(rng);
  GptModel<float> full(spec, 1, 16);
  full.init_weights(3);
  spec.sliding_window = 5;
  GptModel<float> windowed(spec, 1, 16);
  windowed.params = full.params;
  const auto a = logits_of(full, tokens), b = logits_of(windowed, tokens);
  const int64_t V = spec.padded_vocab_size;
  for (int64_t t = 0; t < 16; ++t) {
    double d = 0;
    for (int64_t v = 0; v < V; ++v) d = std::max<double>(d, std::abs(a[t * V + v] - b[t * V + v]));
    if (t < 5) EXPECT_EQ(d, 0.0) << "token " << t << " sees at most 5 keys either way";
    else EXPECT_GT(d, 1e-6) << "token " << t << " lost keys to the window";
  }
}
