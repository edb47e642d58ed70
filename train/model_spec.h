// The architecture every backend trains, from the Megatron-style model keys. GPT-2 (LayerNorm,
// GELU, learned positions, tied head, biases) and Llama (RMSNorm, RoPE, GQA, SwiGLU, untied,
// no biases) are two settings of the same decoder.
#pragma once
#include <cstdint>
#include <string>

#include "core/config/schema.h"
#include "core/config/value.h"

namespace primus::train {

struct ModelSpec {
  std::string model_type = "gpt2";  // gpt2 | llama: names used for Hugging Face export
  int64_t vocab_size = 0;           // tokenizer's vocabulary
  int64_t padded_vocab_size = 0;    // rounded up to make_vocab_size_divisible_by
  int64_t seq_length = 0;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;     // kv heads; == heads for multi-head attention
  int64_t ffn_hidden_size = 0;
  bool layernorm = true;            // false: RMSNorm
  double norm_epsilon = 1e-5;
  bool swiglu = false;              // false: GELU (tanh)
  bool rope = false;                // false: learned absolute positions
  double rotary_base = 10000;
  bool untied = false;              // separate output head
  bool bias = true;                 // biases in linear layers
  double init_method_std = 0.02;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t kv_dim() const { return num_query_groups * head_dim(); }
  int64_t qkv_dim() const { return hidden_size + 2 * kv_dim(); }
  int64_t fc_dim() const { return swiglu ? 2 * ffn_hidden_size : ffn_hidden_size; }
  // Parameter count (with the padded vocabulary).
  int64_t num_parameters() const;
  // Training FLOPs per token (forward + backward): 6 * matmul params + attention, as in the
  // PaLM paper's MFU accounting (attention counted causal-full: 6 * L * C * T).
  double flops_per_token() const;

  static ModelSpec from_config(const config::Value& params);  // checks consistency
};

// Adds every model key (type, default, range, doc) to a backend's schema.
void add_model_schema(config::Schema& s);

}  // namespace primus::train
