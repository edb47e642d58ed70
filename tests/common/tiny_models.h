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

// MoE variants of tiny_llama. Mixtral style: 3 layers (the first dense), 6 experts of width 12,
// softmax top-2 renormalised, aux and z losses. DeepSeek style: 8 experts in 4 groups (2 chosen),
// sigmoid top-4 with the expert bias, scaling 2.5 and a shared expert.
inline train::ModelSpec tiny_moe(bool deepseek = false, int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_llama(vocab, padded, seq);
  m.model_type = deepseek ? "deepseek_v3" : "mixtral";
  m.num_layers = 3;
  train::MoeSpec& e = m.moe;
  e.moe_layers = {false, true, true};
  e.aux_loss_coeff = 0.01;
  e.z_loss_coeff = 0.001;
  if (!deepseek) {
    e.num_experts = 6, e.topk = 2, e.ffn_hidden_size = 12;
  } else {
    e.num_experts = 8, e.topk = 4, e.ffn_hidden_size = 10, e.shared_ffn_hidden_size = 14;
    e.sigmoid = true, e.num_groups = 4, e.group_topk = 2, e.topk_scaling_factor = 2.5, e.expert_bias = true;
  }
  return m;
}

// Qwen3 family: tiny_llama with a head dimension that is not hidden / heads (4 heads of 6 over a
// width of 16, so q is 24 wide and kv 12) and per-head query/key RMSNorms. The odd widths catch
// any code that still takes the query width or the attention output for hidden_size.
inline train::ModelSpec tiny_qwen3(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_llama(vocab, padded, seq);
  m.model_type = "qwen3";
  m.kv_channels = 6;
  m.qk_layernorm = true;
  return m;
}

// Qwen3-MoE: tiny_qwen3's attention with tiny_moe's Mixtral-style router (softmax top-2,
// renormalised, as Qwen3-MoE's norm_topk_prob), every layer MoE as Qwen3-30B-A3B.
inline train::ModelSpec tiny_qwen3_moe(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_moe(false, vocab, padded, seq);
  m.model_type = "qwen3_moe";
  m.kv_channels = 6;
  m.qk_layernorm = true;
  m.moe.moe_layers = {true, true, true};
  return m;
}

// Qwen2 family: tiny_llama with biases on q, k and v only (add_qkv_bias).
inline train::ModelSpec tiny_qwen2(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_llama(vocab, padded, seq);
  m.model_type = "qwen2";
  m.add_qkv_bias = true;
  return m;
}

// OLMoE: every layer a MoE of tiny_moe's experts, softmax over all experts before the top-2 and
// no renormalisation (norm_topk_prob false), and q/k RMSNorms over the whole projection width
// (weights of 4 heads x 4 = 16 and 2 kv heads x 4 = 8).
inline train::ModelSpec tiny_olmoe(int64_t vocab = 29, int64_t padded = 32, int64_t seq = 8) {
  train::ModelSpec m = tiny_moe(false, vocab, padded, seq);
  m.model_type = "olmoe";
  m.qk_layernorm = m.qk_norm_whole = true;
  m.moe.pre_softmax = true;
  m.moe.moe_layers = {true, true, true};
  return m;
}

}  // namespace primus::testing
