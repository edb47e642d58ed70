// Whole-model finite-difference gradient checks in fp64, for a tiny GPT-2 and a tiny Llama
// (GQA, RoPE, SwiGLU, untied head): every parameter tensor is probed at random positions.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backends/reference/model.h"
#include "tests/common/tiny_models.h"

using namespace primus;
using primus::backends::reference::GptModel;

namespace {

train::ModelSpec tiny(bool llama) {
  train::ModelSpec m = llama ? primus::testing::tiny_llama() : primus::testing::tiny_gpt2();
  m.init_method_std = 0.3;  // large enough that every path carries signal
  return m;
}

// The routing of every MoE layer of the last forward (empty for a dense model): a
// finite-difference probe only measures the gradient when it leaves the routing as it was.
template <typename Real>
std::vector<std::vector<int32_t>> routing(const GptModel<Real>& m) {
  std::vector<std::vector<int32_t>> r;
  for (int64_t l = 0; l < m.spec().num_layers; ++l)
    if (const auto* moe = m.moe_layer(l)) {
      r.push_back(moe->topk_idx());
      r.push_back(moe->row_of_slot());  // which slots capacity dropped
    }
  return r;
}

// masking: document masks over tokens that hold its eod_id at a few places (gradcheck puts them).
// loss_eod >= 0: eod_mask_loss with that end-of-document id (placed at those places too): the
// targets after it carry no loss and the objective is the mean over the 13 that do.
void gradcheck(const train::ModelSpec& spec, const train::DocumentMasking& masking = {}, int32_t loss_eod = -1) {
  const int64_t B = 2, T = 8;
  GptModel<double> model(spec, B, T);
  model.set_document_masking(masking);
  model.init_weights(7);
  std::mt19937 rng(11);
  // Norm weights and biases away from 1/0 so their gradients are generic.
  std::normal_distribution<double> jitter(0.0, 0.2);
  for (auto& t : model.layout().tensors)
    if (t.name.find("norm") != std::string::npos || t.name.find("bias") != std::string::npos)
      for (int64_t i = 0; i < t.numel; ++i) model.params[t.offset + i] += jitter(rng);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.vocab_size - 1));
  for (auto& t : tokens) t = tok(rng);
  for (auto& t : targets) t = tok(rng);
  if (masking.enabled()) {  // documents of 3 + 5 tokens in row 0, 2 + 5 + 1 in row 1
    for (auto& t : tokens)
      if (t == masking.eod_id) t = (t + 1) % static_cast<int32_t>(spec.vocab_size);
    tokens[2] = tokens[T + 1] = tokens[T + 6] = masking.eod_id;
  }
  if (loss_eod >= 0) {
    for (auto& t : tokens)
      if (t == loss_eod) t = (t + 1) % static_cast<int32_t>(spec.vocab_size);
    tokens[2] = tokens[T + 1] = tokens[T + 6] = loss_eod;
    const int64_t kept = train::mask_eod_targets(tokens.data(), targets.data(), B * T, loss_eod, -100);
    ASSERT_EQ(kept, B * T - 3);
    model.set_loss_targets(kept, B * T);
  }

  // The expert bias only steers the choice; make it non-trivial so that it does.
  for (auto& t : model.layout().tensors)
    if (!t.trainable)
      for (int64_t i = 0; i < t.numel; ++i) model.params[t.offset + i] = jitter(rng);
  model.zero_grad();
  // The objective: the language-model loss plus the MoE layers' aux and z terms.
  double loss = model.forward(tokens.data(), targets.data(), B, T, 1.0 / (B * T));
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, std::log(static_cast<double>(spec.padded_vocab_size)), 2.0);
  if (spec.moe.enabled()) {
    EXPECT_GT(model.moe_loss(), 0.0);
  }
  model.backward();
  std::vector<double> analytic = model.grads;
  const auto base_routing = routing(model);
  auto objective = [&] { return model.forward(tokens.data(), targets.data(), B, T) + model.moe_loss(); };

  const double eps = 1e-5;
  int checked = 0, rerouted = 0;
  for (auto& t : model.layout().tensors) {
    std::uniform_int_distribution<int64_t> pos(0, t.numel - 1);
    for (int probe = 0; probe < 6; ++probe) {
      int64_t i = t.offset + pos(rng);
      double saved = model.params[i];
      model.params[i] = saved + eps;
      double lp = objective();
      bool same = routing(model) == base_routing;
      model.params[i] = saved - eps;
      double lm = objective();
      same = same && routing(model) == base_routing;
      model.params[i] = saved;
      if (!same) {  // a probe across a routing boundary measures the jump, not the gradient
        ++rerouted;
        continue;
      }
      if (!t.trainable) {  // a buffer: the objective does not depend on it smoothly, no gradient
        EXPECT_EQ(analytic[i], 0.0) << t.name;
        continue;
      }
      double numeric = (lp - lm) / (2 * eps);
      // Relative error, with an absolute floor for gradients that are zero by symmetry (the
      // key bias: softmax ignores a constant shift of the scores).
      double err = std::abs(numeric - analytic[i]);
      double denom = std::max(std::abs(numeric), std::abs(analytic[i]));
      EXPECT_TRUE(err < 1e-9 || err / denom < 1e-5)
          << t.name << "[" << (i - t.offset) << "] numeric " << numeric << " analytic " << analytic[i];
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
  EXPECT_LE(rerouted, checked / 10) << "too many probes changed the routing to check the gradient";
}

}  // namespace

TEST(ReferenceModel, GradCheckTinyGpt2) { gradcheck(tiny(false)); }
TEST(ReferenceModel, GradCheckTinyLlama) { gradcheck(tiny(true)); }

train::ModelSpec tiny_moe(bool deepseek) {
  train::ModelSpec m = primus::testing::tiny_moe(deepseek);
  m.init_method_std = 0.3;
  return m;
}
// Both router families, dense and MoE layers, experts that get no token (6 or 8 experts, 16
// tokens), the aux and z losses, the shared expert and group-limited routing with a bias.
TEST(ReferenceModel, GradCheckTinyMixtralMoe) { gradcheck(tiny_moe(false)); }
TEST(ReferenceModel, GradCheckTinyDeepSeekMoe) { gradcheck(tiny_moe(true)); }
// eod_mask_loss: the loss is the mean over the targets that keep one (13 of 16), so the
// cross-entropy's gradient scale is 1 / 13 where the trainer passes 1 / 16; the MoE balancing
// terms keep theirs (every routed token counts, masked target or not).
TEST(ReferenceModel, GradCheckWithEodMaskedLoss) {
  gradcheck(tiny(true), {}, 5);
  gradcheck(tiny_moe(true), {}, 5);
}
TEST(ReferenceModel, GradCheckMoeWithCapacityDropping) {
  train::ModelSpec m = tiny_moe(false);
  m.moe.capacity_factor = 0.75;  // fewer slots than routed: some tokens skip some experts
  gradcheck(m);
}

// DeepSeek-V3's sequence-wise balance loss (moe_router_load_balancing_type: seq_aux_loss): each of
// the B = 2 sequences' aux loss from its own counts and p sums, averaged; both router families.
TEST(ReferenceModel, GradCheckMoeWithSequenceAuxLoss) {
  for (bool deepseek : {false, true}) {
    SCOPED_TRACE(deepseek ? "sigmoid, groups, bias" : "softmax");
    train::ModelSpec m = tiny_moe(deepseek);
    m.moe.set_balance(train::MoeSpec::Balance::Sequence, 0.5);  // large enough to tell the term's gradient apart
    gradcheck(m);
  }
}

// The value of the sequence-wise loss, from the layer's own logits and choices: per sequence s,
// E * sum_e c_se * P_se / (K * T^2) with c_se the slots of s routed to e and P_se the sum of s's
// softmax probabilities; then the mean over sequences. The batch-wise loss of the same routing
// differs (so the test tells the two apart), and one sequence gives the batch-wise value.
TEST(ReferenceModel, SequenceAuxLossIsTheMeanOfEachSequencesLoss) {
  train::ModelSpec spec = tiny_moe(false);
  spec.moe.aux_loss_coeff = 0.1;
  const int64_t B = 3, T = 8, E = spec.moe.num_experts, K = spec.moe.topk;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.vocab_size - 1));
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (auto& t : tokens) t = tok(rng);
  for (auto& t : targets) t = tok(rng);
  auto run = [&](bool seq, int64_t b) {
    train::ModelSpec s = spec;
    if (seq) s.moe.set_balance(train::MoeSpec::Balance::Sequence, spec.moe.aux_loss_coeff);
    GptModel<double> model(s, b, T);
    model.init_weights(3);
    model.forward(tokens.data(), targets.data(), b, T);
    std::vector<double> aux;  // per MoE layer: the layer's value, then the one computed here
    for (int64_t l = 0; l < s.num_layers; ++l) {
      const auto* moe = model.moe_layer(l);
      if (!moe) continue;
      const std::vector<double>& logits = moe->logits();
      const std::vector<int32_t>& idx = moe->topk_idx();
      const int64_t S = seq ? b : 1, Ts = b * T / S;
      double want = 0;
      for (int64_t q = 0; q < S; ++q) {
        std::vector<double> c(E, 0.0), P(E, 0.0);
        for (int64_t n = q * Ts; n < (q + 1) * Ts; ++n) {
          for (int64_t k = 0; k < K; ++k) c[idx[n * K + k]] += 1;
          double mx = -1e300, z = 0;
          for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[n * E + e]);
          for (int64_t e = 0; e < E; ++e) z += std::exp(logits[n * E + e] - mx);
          for (int64_t e = 0; e < E; ++e) P[e] += std::exp(logits[n * E + e] - mx) / z;
        }
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += c[e] * P[e];
        want += static_cast<double>(E) * dot / (static_cast<double>(K) * Ts * Ts);
      }
      aux.push_back(moe->stats().aux);
      aux.push_back(want / static_cast<double>(S));
    }
    return aux;
  };
  const std::vector<double> per_seq = run(true, B), per_batch = run(false, B);
  ASSERT_FALSE(per_seq.empty());
  ASSERT_EQ(per_seq.size(), per_batch.size());
  for (size_t i = 0; i < per_seq.size(); i += 2) {
    EXPECT_NEAR(per_seq[i], per_seq[i + 1], 1e-12) << "layer " << i / 2 << ", sequence-wise";
    EXPECT_NEAR(per_batch[i], per_batch[i + 1], 1e-12) << "layer " << i / 2 << ", batch-wise";
    // The same weights and tokens route alike; only the grouping of the tokens differs.
    EXPECT_GT(std::abs(per_seq[i] - per_batch[i]), 1e-6) << "layer " << i / 2;
  }
  const std::vector<double> one_seq = run(true, 1), one_batch = run(false, 1);
  for (size_t i = 0; i < one_seq.size(); i += 2) EXPECT_NEAR(one_seq[i], one_batch[i], 1e-15);
}

// Qwen3's attention: a head dimension (6) that is not hidden / heads (16 / 4), so q is 24 wide
// and the output projection 24 -> 16, per-head query/key RMSNorms before RoPE, GQA (4 heads on
// 2 groups). Dense, and with every layer a Mixtral-style MoE (Qwen3-MoE's router).
train::ModelSpec tiny_qwen3(bool moe) {
  train::ModelSpec m = moe ? primus::testing::tiny_qwen3_moe() : primus::testing::tiny_qwen3();
  m.init_method_std = 0.3;
  return m;
}
TEST(ReferenceModel, GradCheckTinyQwen3) { gradcheck(tiny_qwen3(false)); }
TEST(ReferenceModel, GradCheckTinyQwen3Moe) { gradcheck(tiny_qwen3(true)); }

// The q/k norms take part: their weights get gradient, and scaling one changes the loss (a
// norm the forward skipped would pass the finite-difference check with zero on both sides).
TEST(ReferenceModel, Qwen3QueryKeyNormsShapeTheLoss) {
  const train::ModelSpec spec = tiny_qwen3(false);
  GptModel<double> model(spec, 2, 8);
  model.init_weights(5);
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) tokens[i] = (i * 7) % 29, targets[i] = (i * 5 + 3) % 29;
  model.zero_grad();
  const double base = model.forward(tokens.data(), targets.data(), 2, 8, 1.0 / 16);
  model.backward();
  for (const char* n : {"layers.0.attn.q_norm.weight", "layers.1.attn.k_norm.weight"}) {
    const auto& t = model.layout().get(n);
    EXPECT_EQ(t.numel, 6) << n;
    double g = 0;
    for (int64_t i = 0; i < t.numel; ++i) g += std::abs(model.grads[t.offset + i]);
    EXPECT_GT(g, 1e-8) << n;
    std::vector<double> saved(model.params.begin() + t.offset, model.params.begin() + t.offset + t.numel);
    for (int64_t i = 0; i < t.numel; ++i) model.params[t.offset + i] *= 3.0;
    EXPECT_GT(std::abs(model.forward(tokens.data(), targets.data(), 2, 8) - base), 1e-6) << n;
    std::copy(saved.begin(), saved.end(), model.params.begin() + t.offset);
  }
  EXPECT_EQ(model.layout().get("layers.0.attn.proj.weight").shape, (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(model.layout().get("layers.0.attn.qkv.weight").shape, (std::vector<int64_t>{24 + 2 * 12, 16}));
}

TEST(ReferenceModel, FloatMatchesDoubleForward) {
  auto spec = tiny(true);
  GptModel<float> f(spec, 2, 8);
  GptModel<double> d(spec, 2, 8);
  d.init_weights(3);
  for (size_t i = 0; i < d.params.size(); ++i) f.params[i] = static_cast<float>(d.params[i]);
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) tokens[i] = (i * 7) % 29, targets[i] = (i * 5 + 3) % 29;
  double lf = f.forward(tokens.data(), targets.data(), 2, 8);
  double ld = d.forward(tokens.data(), targets.data(), 2, 8);
  EXPECT_NEAR(lf, ld, 1e-4 * std::abs(ld));
}

// Mistral's sliding window (a window shorter than T, over GQA and RoPE) and document masking
// (attention and positions restarting after each end-of-document token), learned positions and
// RoPE alike: the analytic gradients through the masks against finite differences.
TEST(ReferenceModel, GradCheckSlidingWindow) {
  train::ModelSpec m = tiny(true);
  m.sliding_window = 3;
  gradcheck(m);
}
TEST(ReferenceModel, GradCheckDocumentMasksRope) {
  gradcheck(tiny(true), {true, true, 5});
  gradcheck(tiny(true), {false, true, 5});  // positions only (Megatron allows it)
}
TEST(ReferenceModel, GradCheckDocumentMasksLearnedPositions) { gradcheck(tiny(false), {true, true, 5}); }
TEST(ReferenceModel, GradCheckSlidingWindowWithDocumentMasks) {
  train::ModelSpec m = tiny(true);
  m.sliding_window = 2;
  gradcheck(m, {true, false, 5});
}

// Llama-3's RoPE frequency scaling with an original context of 8 (T = 8, head dim 4): pair 0
// (wavelength 6.3) blended, pair 1 (628) divided by the factor; with document masks too, whose
// restarted positions go through the same scaled rotation.
TEST(ReferenceModel, GradCheckLlama3RopeScaling) {
  train::ModelSpec m = tiny(true);
  m.rope_scaling = {true, 4.0, 1.0, 4.0, 8.0};
  gradcheck(m);
  gradcheck(m, {true, true, 5});
}

// Qwen2: biases on q, k and v and nowhere else; their gradients against finite differences.
TEST(ReferenceModel, GradCheckTinyQwen2) {
  train::ModelSpec m = primus::testing::tiny_qwen2();
  m.init_method_std = 0.3;
  const train::ParamLayout layout = train::make_param_layout(m);
  EXPECT_EQ(layout.get("layers.0.attn.qkv.bias").numel, m.qkv_dim());
  EXPECT_EQ(layout.find("layers.0.attn.proj.bias"), nullptr);
  EXPECT_EQ(layout.find("layers.0.mlp.fc.bias"), nullptr);
  gradcheck(m);
}

// OLMoE's q/k norms over the whole projection width, dense (GQA, RoPE) and with every layer MoE.
TEST(ReferenceModel, GradCheckQueryKeyNormsOverTheProjection) {
  train::ModelSpec dense = tiny(true);
  dense.qk_layernorm = dense.qk_norm_whole = true;
  gradcheck(dense);
}
TEST(ReferenceModel, GradCheckTinyOlmoe) {
  train::ModelSpec olmoe = primus::testing::tiny_olmoe();
  olmoe.init_method_std = 0.3;
  gradcheck(olmoe);
}

// Which rows a q norm spans, seen from outside: an RMSNorm is blind to a common scale of its
// row, so scaling every query row of the projection leaves a whole-projection norm's loss as it
// was and scaling one head's rows does not; per head (Qwen3) scaling one head is invisible.
TEST(ReferenceModel, QueryNormScopeDecidesWhichScalesTheLossIgnores) {
  auto loss_after_scaling = [](const train::ModelSpec& spec, int64_t rows) {
    GptModel<double> model(spec, 2, 8);
    model.init_weights(5);
    std::vector<int32_t> tokens(16), targets(16);
    for (int i = 0; i < 16; ++i) tokens[i] = (i * 7) % 29, targets[i] = (i * 5 + 3) % 29;
    const double base = model.forward(tokens.data(), targets.data(), 2, 8);
    double* w = model.param("layers.0.attn.qkv.weight");
    for (int64_t i = 0; i < rows * spec.hidden_size; ++i) w[i] *= 3.0;
    return std::abs(model.forward(tokens.data(), targets.data(), 2, 8) - base);
  };
  train::ModelSpec whole = tiny(true);
  whole.qk_layernorm = whole.qk_norm_whole = true;
  whole.norm_epsilon = 1e-12;  // so that a common scale is exactly invisible
  train::ModelSpec per_head = whole;
  per_head.qk_norm_whole = false;
  const int64_t D = whole.head_dim(), QD = whole.q_dim();
  EXPECT_EQ(train::make_param_layout(whole).get("layers.0.attn.q_norm.weight").numel, QD);
  EXPECT_EQ(train::make_param_layout(whole).get("layers.0.attn.k_norm.weight").numel, whole.kv_dim());
  EXPECT_LT(loss_after_scaling(whole, QD), 1e-6);
  EXPECT_GT(loss_after_scaling(whole, D), 1e-4);
  EXPECT_LT(loss_after_scaling(per_head, D), 1e-6);
}
