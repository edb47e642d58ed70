// Llama-3.1/3.2's RoPE frequency scaling in the cuda model against the reference backend: the
// step-0 loss and every gradient of a tiny Llama (head dim 64) whose original context (8) is
// an eighth of the sequence (64): pair 0's frequency is blended, every other one divided by 32. Host mode
// (rope_scaling_host_test.cpp, test_cuda_unit) checks that the scaling reaches the CPU rotation
// of the forward and the backward; the GPU run (rope_scaling_gpu_test.cpp, test_cuda_gpu) that
// it reaches the device cos/sin table. Both also check that the scaling is live: on the same
// weights and batch the plain rotation's gradients lie far outside the parity gate.
#pragma once
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "backends/reference/model.h"
#include "tests/cuda_gpu/cuda_fixture.h"
#include "train/param_layout.h"

namespace primus::backends::cuda::testing {

inline train::ModelSpec rope_scaling_spec() {
  train::ModelSpec m = tiny_spec(true);
  m.rope_scaling = {true, 32.0, 1.0, 4.0, 8.0};
  return m;
}

// How far the plain rotation's gradients lie from the scaled one's, on the same weights and
// batch (reference backend, fp32): the largest relative L2 difference over the tensors.
inline double scaled_vs_plain_gradients(const train::ModelSpec& spec, unsigned seed) {
  const int64_t B = 2, T = spec.seq_length;
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.vocab_size) - 1);
  for (auto& x : tokens) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  auto grads = [&](const train::ModelSpec& s) {
    train::ModelSpec m = s;
    m.init_method_std = 0.1;
    reference::GptModel<float> ref(m, B, T);
    ref.init_weights(seed);
    ref.zero_grad();
    ref.forward(tokens.data(), targets.data(), B, T, 1.0 / double(B * T));
    ref.backward();
    return ref.grads;
  };
  train::ModelSpec plain = spec;
  plain.rope_scaling.enabled = false;
  const std::vector<float> a = grads(spec), b = grads(plain);
  double worst = 0;
  for (const auto& t : train::make_param_layout(spec).tensors)
    worst = std::max(worst, rel_l2(b.data() + t.offset, a.data() + t.offset, t.numel));
  return worst;
}

inline void expect_rope_scaling_parity(turbo::Device device, double loss_tol, double grad_gate) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const train::ModelSpec spec = rope_scaling_spec();
  const Step0 r = step0_parity(spec, Attn::Default, device, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, loss_tol * r.ref_loss) << "step-0 loss";
  EXPECT_GT(r.errors.size(), 10u);
  double worst = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    EXPECT_LT(e, grad_gate) << name;
  }
  // The scaling is live: the plain rotation's gradients lie well outside the gate.
  const double live = scaled_vs_plain_gradients(spec, seed);
  EXPECT_GT(live, 3 * grad_gate) << "the scaled and the plain rotation give the same gradients";
  std::printf("[rope scaling, %s] loss %.7f ref %.7f, worst gradient relative L2 %.2e; plain rotation's gradients "
              "%.2e away\n",
              device == turbo::Device::CPU ? "host" : "gpu", r.loss, r.ref_loss, worst, live);
}

}  // namespace primus::backends::cuda::testing
