#include "train/model_spec.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::train {

using config::KeyType;

void add_model_schema(config::Schema& s) {
  s.text("model_type", "gpt2", "model family, used for Hugging Face export", {"gpt2", "llama"})
      .integer("vocab_size", std::nullopt, "vocabulary size (the tokenizer's, before padding)", 1, 1 << 24)
      .integer("make_vocab_size_divisible_by", 1, "pad the embedding rows to a multiple of this", 1, 1 << 16)
      .integer("seq_length", 1024, "tokens per sample (also the position table size)", 1, 1 << 21)
      .integer("num_layers", std::nullopt, "transformer blocks", 1, 4096)
      .integer("hidden_size", std::nullopt, "model width", 1, 1 << 17)
      .integer("num_attention_heads", std::nullopt, "query heads", 1, 4096)
      .integer("num_query_groups", std::nullopt, "key/value heads for GQA (default: num_attention_heads)", 1, 4096)
      .integer("ffn_hidden_size", std::nullopt, "MLP width (default: 4 * hidden_size)", 1, 1 << 20)
      .text("normalization", "LayerNorm", "LayerNorm or RMSNorm", {"LayerNorm", "RMSNorm"})
      .number("norm_epsilon", 1e-5, "epsilon of the norms", 0.0, 1.0)
      .text("activation", "gelu", "MLP activation: gelu (tanh) or swiglu", {"gelu", "swiglu"})
      .text("position_embedding_type", "learned_absolute", "learned_absolute or rope",
            {"learned_absolute", "rope"})
      .number("rotary_base", 10000.0, "RoPE base (theta)", 1.0)
      .flag("untie_embeddings_and_output_weights", false, "separate output head instead of the embedding")
      .flag("add_bias_linear", true, "biases in the linear layers")
      .number("init_method_std", 0.02, "standard deviation of the weight init", 0.0, 1.0);
}

namespace {
int64_t req(const config::Value& p, const char* key) {
  const config::Value* v = p.find_path(key);
  if (!v || v->is_null()) {
    throw ConfigError(fmt::format("model key '{}' is not set (set it in the model preset or overrides)", key));
  }
  return v->as_int();
}
int64_t opt(const config::Value& p, const char* key, int64_t def) {
  const config::Value* v = p.find_path(key);
  return v && !v->is_null() ? v->as_int() : def;
}
}  // namespace

ModelSpec ModelSpec::from_config(const config::Value& p) {
  ModelSpec m;
  m.model_type = p.find_path("model_type")->as_string();
  m.vocab_size = req(p, "vocab_size");
  int64_t div = opt(p, "make_vocab_size_divisible_by", 1);
  m.padded_vocab_size = (m.vocab_size + div - 1) / div * div;
  m.seq_length = req(p, "seq_length");
  m.num_layers = req(p, "num_layers");
  m.hidden_size = req(p, "hidden_size");
  m.num_attention_heads = req(p, "num_attention_heads");
  m.num_query_groups = opt(p, "num_query_groups", m.num_attention_heads);
  m.ffn_hidden_size = opt(p, "ffn_hidden_size", 4 * m.hidden_size);
  m.layernorm = p.find_path("normalization")->as_string() == "LayerNorm";
  m.norm_epsilon = p.find_path("norm_epsilon")->as_double();
  m.swiglu = p.find_path("activation")->as_string() == "swiglu";
  m.rope = p.find_path("position_embedding_type")->as_string() == "rope";
  m.rotary_base = p.find_path("rotary_base")->as_double();
  m.untied = p.find_path("untie_embeddings_and_output_weights")->as_bool();
  m.bias = p.find_path("add_bias_linear")->as_bool();
  m.init_method_std = p.find_path("init_method_std")->as_double();
  auto where = [&](const char* k) { return p.find_path(k) ? p.find_path(k)->origin().str() : std::string("?"); };
  if (m.hidden_size % m.num_attention_heads != 0) {
    throw ConfigError(fmt::format("{}: hidden_size {} is not divisible by num_attention_heads {}",
                                  where("hidden_size"), m.hidden_size, m.num_attention_heads));
  }
  if (m.num_attention_heads % m.num_query_groups != 0) {
    throw ConfigError(fmt::format("{}: num_attention_heads {} is not divisible by num_query_groups {}",
                                  where("num_query_groups"), m.num_attention_heads, m.num_query_groups));
  }
  if (m.rope && m.head_dim() % 2 != 0) {
    throw ConfigError(fmt::format("{}: RoPE needs an even head dimension, got {}", where("hidden_size"), m.head_dim()));
  }
  return m;
}

int64_t ModelSpec::num_parameters() const {
  int64_t C = hidden_size, L = num_layers, V = padded_vocab_size;
  int64_t norm = layernorm ? 2 * C : C;
  int64_t per_layer = 2 * norm + C * qkv_dim() + C * C + C * fc_dim() + ffn_hidden_size * C;
  if (bias) per_layer += qkv_dim() + C + fc_dim() + C;
  int64_t total = V * C + (rope ? 0 : seq_length * C) + L * per_layer + norm;
  if (untied) total += V * C;
  return total;
}

double ModelSpec::flops_per_token() const {
  double C = hidden_size, L = num_layers;
  double matmul = L * (C * qkv_dim() + C * C + C * fc_dim() + ffn_hidden_size * C) + C * padded_vocab_size;
  return 6.0 * matmul + 6.0 * L * C * seq_length;
}

}  // namespace primus::train
