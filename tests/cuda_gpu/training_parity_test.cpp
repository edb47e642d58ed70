// 50 training steps of the CUDA backend against the reference backend (fp32 CPU), from the same
// (bf16-representable) initial weights on the same tinyshakespeare batches, with the trainers'
// optimizer recipe (global-norm clip 1.0, AdamW with decoupled weight decay on decayed tensors
// only). Gate: at every step |loss_cuda - loss_ref| / loss_ref < 2%; the loss must also fall,
// so the comparison is of learning curves, not of two flat lines.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <map>

#include "backends/cuda/attention_fallback.h"
#include "backends/cuda/model.h"
#include "backends/reference/model.h"
#include "cuda_fixture.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"

namespace primus::backends::cuda::testing {
namespace {

constexpr int kSteps = 50;
constexpr int64_t kBatch = 8;
constexpr double kLr = 2e-3, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-8, kDecay = 0.1, kClip = 1.0;

// Batch s: kBatch windows of T + 1 bytes of tinyshakespeare at offsets from a fixed seed.
struct Batches {
  explicit Batches(int64_t T) {
    std::ifstream f(std::string(PRIMUS_SOURCE_DIR) + "/examples/data/tinyshakespeare.txt", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_GT(text.size(), 100000u) << "examples/data/tinyshakespeare.txt";
    std::mt19937_64 rng(42);
    std::uniform_int_distribution<size_t> off(0, text.size() - size_t(T) - 2);
    for (int s = 0; s < kSteps; ++s) {
      std::vector<int32_t> in(kBatch * T), tg(kBatch * T);
      for (int64_t b = 0; b < kBatch; ++b) {
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
  std::vector<std::vector<int32_t>> inputs, targets;
};

std::vector<float> initial_params(const train::ModelSpec& spec) {
  reference::GptModel<float> m(spec, 1, spec.seq_length);
  m.init_weights(1234);
  for (auto& w : m.params) w = round_bf16(w);
  return m.params;
}

// The reference curve, computed once per model (the slow part: fp32 on the CPU).
const std::vector<double>& reference_curve(bool llama) {
  static std::map<bool, std::vector<double>> cache;
  auto it = cache.find(llama);
  if (it != cache.end()) return it->second;
  const train::ModelSpec spec = tiny_spec(llama);
  const int64_t T = spec.seq_length;
  Batches data(T);
  reference::GptModel<float> ref(spec, kBatch, T);
  ref.params = initial_params(spec);
  std::vector<float> m(ref.params.size(), 0.0f), v(ref.params.size(), 0.0f);
  std::vector<double> curve;
  for (int s = 0; s < kSteps; ++s) {
    ref.zero_grad();
    curve.push_back(ref.forward(data.inputs[s].data(), data.targets[s].data(), kBatch, T, 1.0 / double(kBatch * T)));
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
  return cache[llama] = curve;
}

struct Case {
  bool llama;
  Attn attn;
};

class TrainingParityTest : public CudaGpuTest, public ::testing::WithParamInterface<Case> {};

TEST_P(TrainingParityTest, FiftyStepsFollowTheReferenceCurve) {
  const auto [llama, attn] = GetParam();
  const train::ModelSpec spec = tiny_spec(llama);
  const int64_t T = spec.seq_length;
  const std::vector<double>& ref = reference_curve(llama);
  Batches data(T);
  CudaModelOptions mo;
  mo.max_batch = kBatch;
  mo.max_seq = T;
  mo.attention_scratch_bytes =
      fallback_attention_scratch_bytes(kBatch, T, spec.num_attention_heads, spec.num_query_groups, spec.head_dim());
  CudaModel model(spec, mo, ops_for(attn));
  const std::vector<float> init = initial_params(spec);
  model.set_params(init.data());
  std::vector<double> curve;
  double worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    model.zero_grad();
    model.forward(data.inputs[s].data(), data.targets[s].data(), kBatch, T, 1.0f / float(kBatch * T), 0);
    model.backward();
    model.grad_norm(static_cast<float>(kClip));
    curve.push_back(model.read_loss_sum(1));
    turbo::AdamWHyper hp;
    hp.lr = float(kLr), hp.beta1 = float(kBeta1), hp.beta2 = float(kBeta2), hp.eps = float(kEps);
    hp.weight_decay = float(kDecay);
    hp.step = s + 1;
    model.update(hp);
    const double rel = std::fabs(curve[s] - ref[s]) / ref[s];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 0.02) << "step " << s << ": cuda " << curve[s] << " reference " << ref[s];
  }
  std::printf("[%s, attention %s] loss cuda / reference: step 0 %.4f / %.4f, step 24 %.4f / %.4f, step 49 %.4f / "
              "%.4f; worst relative difference %.2e\n",
              spec.model_type.c_str(), attn_name(attn).c_str(), curve[0], ref[0], curve[24], ref[24], curve[49],
              ref[49], worst);
  EXPECT_LT(ref.back(), ref.front() - 0.5) << "the reference must learn, or the comparison says nothing";
}

INSTANTIATE_TEST_SUITE_P(Cuda, TrainingParityTest,
                         ::testing::Values(Case{false, Attn::Default}, Case{true, Attn::Default},
                                           Case{false, Attn::Fallback}, Case{true, Attn::Fallback}),
                         [](const auto& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt2") +
                                  (info.param.attn == Attn::Default ? "Default" : "Fallback");
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
