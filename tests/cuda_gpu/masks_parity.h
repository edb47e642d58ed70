// Sliding-window attention and document masking (reset_attention_mask / reset_position_ids) in
// the cuda model against the reference backend, on the same weights, batch and masks: the step-0
// loss and every gradient. masks_host_test.cpp runs the cases in host mode (fp32 on Turbo's CPU
// backends, test_cuda_unit), masks_gpu_test.cpp on the device (bf16, the TURBO attention
// kernels, the document-table kernel; test_cuda_gpu).
#pragma once
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>

#include "backends/reference/model.h"
#include "tests/cuda_gpu/cuda_fixture.h"
#include "train/document_masks.h"

namespace primus::backends::cuda::testing {

struct MaskCase {
  const char* name;
  bool llama;
  int64_t window;
  train::DocumentMasking masking;
};

struct MaskParity {
  double loss = 0, ref_loss = 0;
  std::vector<std::pair<std::string, double>> errors;
};

// B = 2 rows of T = 64 random tokens with 3 end-of-document tokens each at random places.
inline MaskParity mask_parity(const MaskCase& mc, turbo::Device device, unsigned seed) {
  train::ModelSpec spec = tiny_spec(mc.llama);
  spec.sliding_window = mc.window;
  spec.init_method_std = 0.1;
  const int64_t B = 2, T = spec.seq_length;
  std::mt19937 rng(seed);
  reference::GptModel<float> ref(spec, B, T);
  ref.init_weights(seed);
  for (float& w : ref.params) w = round_bf16(w);
  train::DocumentMasking masking = mc.masking;
  masking.eod_id = static_cast<int32_t>(spec.vocab_size - 1);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, masking.eod_id - 1), at(1, static_cast<int32_t>(T) - 2);
  for (auto& x : tokens) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  for (int64_t b = 0; b < B; ++b)
    for (int e = 0; e < 3; ++e) tokens[b * T + at(rng)] = masking.eod_id;
  const double dloss = 1.0 / double(B * T);
  ref.set_document_masking(masking);
  ref.zero_grad();
  MaskParity r;
  r.ref_loss = ref.forward(tokens.data(), targets.data(), B, T, dloss);
  ref.backward();

  CudaModelOptions mo = options(spec, B, device);
  mo.document_masking = masking;
  CudaModel model(spec, mo, ops_for(Attn::Default));
  model.set_params(ref.params.data());
  model.zero_grad();
  model.forward(tokens.data(), targets.data(), B, T, static_cast<float>(dloss), 0);
  model.backward();
  r.loss = model.read_loss_sum(1);
  std::vector<float> grads(static_cast<size_t>(model.layout().total));
  model.get_grads(grads.data());
  for (const auto& t : model.layout().tensors)
    r.errors.push_back({t.name, rel_l2(grads.data() + t.offset, ref.grads.data() + t.offset, t.numel)});
  return r;
}

inline const MaskCase kMaskCases[] = {
    {"llama_window", true, 13, {}},
    {"llama_documents", true, 0, {true, true, -1}},
    {"llama_positions_only", true, 0, {false, true, -1}},
    {"llama_window_documents", true, 9, {true, true, -1}},
    {"gpt2_documents", false, 0, {true, true, -1}},
};

inline void expect_mask_parity(turbo::Device device, double loss_tol, double grad_gate) {
  for (const MaskCase& mc : kMaskCases) {
    const unsigned seed = std::random_device{}();
    SCOPED_TRACE(::testing::Message() << mc.name << " seed " << seed);
    const MaskParity r = mask_parity(mc, device, seed);
    EXPECT_NEAR(r.loss, r.ref_loss, loss_tol * r.ref_loss) << "step-0 loss";
    EXPECT_GT(r.errors.size(), 10u);
    for (const auto& [name, e] : r.errors) EXPECT_LT(e, grad_gate) << name;
  }
}

// A packed sample of two documents (A: 23 tokens ending in the eod, B: 41) with both resets:
// its mean loss is the token-weighted mean of the two documents' losses run alone (B = 1 each),
// on the cuda model itself (Llama: RoPE positions restart; GPT-2: learned ones). Returns
// {packed, weighted separate, the same packed sample without the masks}.
inline std::array<double, 3> packed_vs_separate(bool llama, turbo::Device device, unsigned seed) {
  train::ModelSpec spec = tiny_spec(llama);
  spec.init_method_std = 0.1;
  const int64_t T = spec.seq_length, a = 23;
  std::mt19937 rng(seed);
  const int32_t eod = static_cast<int32_t>(spec.vocab_size - 1);
  std::uniform_int_distribution<int32_t> tok(0, eod - 1);
  std::vector<int32_t> tokens(T), targets(T);
  for (auto& x : tokens) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  tokens[a - 1] = eod;
  reference::GptModel<float> init(spec, 1, T);
  init.init_weights(seed);
  for (float& w : init.params) w = round_bf16(w);
  auto loss_of = [&](bool masks, int64_t from, int64_t n) {
    CudaModelOptions mo = options(spec, 1, device);
    if (masks) mo.document_masking = {true, true, eod};
    CudaModel model(spec, mo, ops_for(Attn::Default));
    model.set_params(init.params.data());
    model.forward(tokens.data() + from, targets.data() + from, 1, n, 0.0f, 0);
    return model.read_loss_sum(1);
  };
  const double packed = loss_of(true, 0, T), plain = loss_of(false, 0, T);
  const double separate = (a * loss_of(false, 0, a) + (T - a) * loss_of(false, a, T - a)) / static_cast<double>(T);
  return {packed, separate, plain};
}

// masks_matter: the packed sample's loss must differ from the same sample's without the masks.
// Not a relative margin: how much document B's loss moves when it sees document A depends on the
// random tokens and weights (down to 5e-5 relative with some seeds), while with the masks ignored
// the two runs are the same computation and give the same bits.
inline void expect_packed_equals_separate(turbo::Device device, double tol, bool masks_matter) {
  for (bool llama : {true, false}) {
    const unsigned seed = std::random_device{}();
    SCOPED_TRACE(::testing::Message() << (llama ? "llama" : "gpt2") << " seed " << seed);
    const auto [packed, separate, plain] = packed_vs_separate(llama, device, seed);
    EXPECT_NEAR(packed, separate, tol * separate) << "a packed sample must score as its documents alone";
    if (masks_matter) EXPECT_NE(plain, packed) << "the masks changed nothing";
  }
}

}  // namespace primus::backends::cuda::testing
