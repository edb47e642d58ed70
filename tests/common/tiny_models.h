// Tiny GPT-2 and Llama specs shared by the model, layout and backend tests (one fixture, not a
// copy per test).
#pragma once
#include "train/model_spec.h"

namespace primus::testing {

// GPT-2 family: LayerNorm, GELU, learned positions, tied head, biases.
inline train::ModelSpec tiny_gpt2(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m;
  m.model_type = "gpt2";
  m.vocab_size = vocab;
  m.padded_vocab_size = padded;
  m.seq_length = seq;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_attention_heads = 4;
  m.num_query_groups = 4;
  m.ffn_hidden_size = 64;
  return m;
}

// Llama family: RMSNorm, RoPE, grouped-query attention (4 heads, 2 groups), SwiGLU, untied, no biases.
inline train::ModelSpec tiny_llama(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_gpt2(vocab, padded, seq);
  m.model_type = "llama";
  m.num_query_groups = 2;
  m.ffn_hidden_size = 24;
  m.layernorm = false;
  m.swiglu = m.rope = m.untied = true;
  m.bias = false;
  return m;
}

}  // namespace primus::testing
