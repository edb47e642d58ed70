#include "cuda_fixture.h"

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <iterator>
#include <map>

#include "backends/cuda/attention_fallback.h"
#include "backends/cuda/model.h"
#include "backends/reference/model.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"

namespace primus::backends::cuda::testing {

train::ModelSpec tiny_spec(bool llama) {
  train::ModelSpec m;
  m.model_type = llama ? "llama" : "gpt2";
  m.vocab_size = 256;
  m.padded_vocab_size = 256;
  m.seq_length = 64;
  m.num_layers = 2;
  m.hidden_size = 128;
  m.num_attention_heads = 2;
  m.num_query_groups = llama ? 1 : 2;
  m.ffn_hidden_size = llama ? 256 : 512;
  m.layernorm = !llama;
  m.swiglu = llama;
  m.rope = llama;
  m.rotary_base = 10000;
  m.untied = llama;
  m.bias = !llama;
  m.init_method_std = 0.02;
  return m;
}

double rel_l2(const float* got, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

CudaOps ops_for(Attn a) {
  CudaOps o = CudaOps::defaults();
  if (a == Attn::Fallback) {
    o.attention_forward = fallback_attention_forward;
    o.attention_backward = fallback_attention_backward;
  }
  return o;
}

CudaModelOptions options(const train::ModelSpec& spec, int64_t B, turbo::Device device) {
  CudaModelOptions mo;
  mo.max_batch = B;
  mo.max_seq = spec.seq_length;
  mo.device = device;
  mo.attention_scratch_bytes = fallback_attention_scratch_bytes(B, spec.seq_length, spec.num_attention_heads,
                                                                spec.num_query_groups, spec.head_dim(), 4);
  return mo;
}

namespace {
constexpr double kLr = 2e-3, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-8, kDecay = 0.1, kClip = 1.0;
}  // namespace

Batches::Batches(int64_t T, int steps) {
  // The sources may sit elsewhere than at build time (the GPU machine): $PRIMUS_SOURCE_DIR wins.
  const char* env = std::getenv("PRIMUS_SOURCE_DIR");
  const std::string path = std::string(env && *env ? env : PRIMUS_SOURCE_DIR) + "/examples/data/tinyshakespeare.txt";
  std::ifstream f(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.size() < 100000) throw std::runtime_error(path + " is missing or short (set PRIMUS_SOURCE_DIR)");
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<size_t> off(0, text.size() - size_t(T) - 2);
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> in(kTrainBatch * T), tg(kTrainBatch * T);
    for (int64_t b = 0; b < kTrainBatch; ++b) {
      const size_t o = off(rng);
      for (int64_t t = 0; t < T; ++t) {
        in[b * T + t] = static_cast<unsigned char>(text[o + t]);
        tg[b * T + t] = static_cast<unsigned char>(text[o + t + 1]);
      }
    }
    inputs.push_back(std::move(in));
    targets.push_back(std::move(tg));
  }
}

std::vector<float> initial_params(const train::ModelSpec& spec) {
  reference::GptModel<float> m(spec, 1, spec.seq_length);
  m.init_weights(1234);
  for (auto& w : m.params) w = round_bf16(w);
  return m.params;
}

namespace {

const std::vector<double>& reference_curve(bool llama, int steps) {
  static std::map<std::pair<bool, int>, std::vector<double>> cache;
  auto it = cache.find({llama, steps});
  if (it != cache.end()) return it->second;
  const train::ModelSpec spec = tiny_spec(llama);
  const int64_t T = spec.seq_length;
  Batches data(T, steps);
  reference::GptModel<float> ref(spec, kTrainBatch, T);
  ref.params = initial_params(spec);
  std::vector<float> m(ref.params.size(), 0.0f), v(ref.params.size(), 0.0f);
  std::vector<double> curve;
  for (int s = 0; s < steps; ++s) {
    ref.zero_grad();
    curve.push_back(
        ref.forward(data.inputs[s].data(), data.targets[s].data(), kTrainBatch, T, 1.0 / double(kTrainBatch * T)));
    ref.backward();
    const double norm = std::sqrt(turbo::cpu::sum_squares(ref.grads.data(), int64_t(ref.grads.size())));
    turbo::cpu::AdamWParams hp;
    hp.lr = kLr, hp.beta1 = kBeta1, hp.beta2 = kBeta2, hp.eps = kEps, hp.step = s + 1;
    hp.grad_scale = turbo::cpu::clip_scale(norm, kClip);
    for (const auto& t : ref.layout().tensors) {
      hp.weight_decay = t.decay ? kDecay : 0.0;
      turbo::cpu::adamw_update(ref.params.data() + t.offset, ref.grads.data() + t.offset, m.data() + t.offset,
                               v.data() + t.offset, t.numel, hp);
    }
  }
  return cache[{llama, steps}] = curve;
}

}  // namespace

Step0 step0_parity(bool llama, Attn attn, turbo::Device device, unsigned seed) {
  train::ModelSpec spec = tiny_spec(llama);
  spec.init_method_std = 0.1;  // enough signal through attention for the q/k gradients
  const int64_t B = 4, T = spec.seq_length;
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
  Step0 r;
  r.ref_loss = ref.forward(tokens.data(), targets.data(), B, T, dloss);
  ref.backward();

  CudaModel model(spec, options(spec, B, device), ops_for(attn));
  EXPECT_EQ(model.layout().total, ref.layout().total);
  model.set_params(ref.params.data());
  model.zero_grad();
  model.forward(tokens.data(), targets.data(), B, T, static_cast<float>(dloss), 0);
  model.backward();
  r.loss = model.read_loss_sum(1);
  std::vector<float> grads(static_cast<size_t>(model.layout().total));
  model.get_grads(grads.data());
  for (const auto& t : model.layout().tensors)
    r.errors.push_back({t.name, rel_l2(grads.data() + t.offset, ref.grads.data() + t.offset, t.numel)});
  model.forward(tokens.data(), targets.data(), B, T, 0.0f, 0);
  r.eval_loss = model.read_loss_sum(1);
  std::vector<float> again(grads.size());
  model.get_grads(again.data());
  r.eval_kept_grads = again == grads;
  return r;
}

std::pair<std::vector<double>, std::vector<double>> training_curves(bool llama, Attn attn, turbo::Device device,
                                                                    int steps) {
  const train::ModelSpec spec = tiny_spec(llama);
  const int64_t T = spec.seq_length;
  const std::vector<double>& ref = reference_curve(llama, steps);
  Batches data(T, steps);
  CudaModel model(spec, options(spec, kTrainBatch, device), ops_for(attn));
  const std::vector<float> init = initial_params(spec);
  model.set_params(init.data());
  std::vector<double> curve;
  for (int s = 0; s < steps; ++s) {
    model.zero_grad();
    model.forward(data.inputs[s].data(), data.targets[s].data(), kTrainBatch, T, 1.0f / float(kTrainBatch * T), 0);
    model.backward();
    model.grad_norm(static_cast<float>(kClip));
    curve.push_back(model.read_loss_sum(1));
    turbo::AdamWHyper hp;
    hp.lr = float(kLr), hp.beta1 = float(kBeta1), hp.beta2 = float(kBeta2), hp.eps = float(kEps);
    hp.weight_decay = float(kDecay);
    hp.step = s + 1;
    model.update(hp);
  }
  return {curve, ref};
}

}  // namespace primus::backends::cuda::testing
