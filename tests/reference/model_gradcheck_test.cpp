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

void gradcheck(const train::ModelSpec& spec) {
  const int64_t B = 2, T = 8;
  GptModel<double> model(spec, B, T);
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

  model.zero_grad();
  double loss = model.forward(tokens.data(), targets.data(), B, T, 1.0 / (B * T));
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, std::log(static_cast<double>(spec.padded_vocab_size)), 2.0);
  model.backward();
  std::vector<double> analytic = model.grads;

  const double eps = 1e-5;
  int checked = 0;
  for (auto& t : model.layout().tensors) {
    std::uniform_int_distribution<int64_t> pos(0, t.numel - 1);
    for (int probe = 0; probe < 6; ++probe) {
      int64_t i = t.offset + pos(rng);
      double saved = model.params[i];
      model.params[i] = saved + eps;
      double lp = model.forward(tokens.data(), targets.data(), B, T);
      model.params[i] = saved - eps;
      double lm = model.forward(tokens.data(), targets.data(), B, T);
      model.params[i] = saved;
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
}

}  // namespace

TEST(ReferenceModel, GradCheckTinyGpt2) { gradcheck(tiny(false)); }
TEST(ReferenceModel, GradCheckTinyLlama) { gradcheck(tiny(true)); }

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
