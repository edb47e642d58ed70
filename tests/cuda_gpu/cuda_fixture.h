// Shared pieces of the CUDA backend's GPU tests: the tiny GPT-2 and Llama both backends train,
// a fixture that skips without a device, bf16 rounding, and the relative L2 error.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/device.h"
#include "backends/cuda/hooks.h"
#include "train/model_spec.h"
#include "turbo/core/cuda_check.h"
#include "turbo/core/dtype.h"

namespace primus::backends::cuda::testing {

// Tiny but not degenerate: head_dim 64 (what every attention kernel serves), two layers, the
// Llama one with grouped-query attention (2 query heads per kv head), RoPE, SwiGLU, untied head.
inline train::ModelSpec tiny_spec(bool llama) {
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

inline float round_bf16(float x) { return turbo::bf16_bits_to_float(turbo::float_to_bf16_bits(x)); }

// ||got - ref|| / ||ref||; infinite when got holds a NaN or inf.
inline double rel_l2(const float* got, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The attention implementations a model can run with: the slot's default and the fallback.
enum class Attn { Default, Fallback };
inline std::string attn_name(Attn a) { return a == Attn::Default ? default_attention_name() : "fallback"; }
CudaOps ops_for(Attn a);

class CudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (turbo::cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
    select_device(0);
  }
};

}  // namespace primus::backends::cuda::testing
