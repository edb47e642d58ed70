#include "train/model_spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/util/error.h"

namespace primus::train {

using config::KeyType;

void add_model_schema(config::Schema& s) {
  s.text("model_type", "gpt2", "model family, used for Hugging Face names and export",
         {"gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "olmoe", "qwen3_moe", "deepseek_v3"})
      .integer("vocab_size", std::nullopt, "vocabulary size (the tokenizer's, before padding)", 1, 1 << 24)
      .integer("make_vocab_size_divisible_by", 1, "pad the embedding rows to a multiple of this", 1, 1 << 16)
      .integer("seq_length", 1024, "tokens per sample (also the position table size)", 1, 1 << 21)
      .integer("num_layers", std::nullopt, "transformer blocks", 1, 4096)
      .integer("hidden_size", std::nullopt, "model width", 1, 1 << 17)
      .integer("num_attention_heads", std::nullopt, "query heads", 1, 4096)
      .integer("num_query_groups", std::nullopt, "key/value heads for GQA (default: num_attention_heads)", 1, 4096)
      .integer("kv_channels", std::nullopt,
               "head dimension; q width = heads x kv_channels (default: hidden_size / num_attention_heads)", 1, 1 << 14)
      .flag("qk_layernorm", false, "RMSNorm over each query and key head before RoPE, one weight shared by the heads (Qwen3)")
      .text("qk_layernorm_scope", "head",
            "what qk_layernorm normalises: each head (Qwen3) or the whole q and k projections, weights of "
            "heads x kv_channels and kv heads x kv_channels (projection: OLMoE)",
            {"head", "projection"})
      .flag("multi_latent_attention", false,
            "Megatron-LM's multi-latent attention (DeepSeek-V2/V3): false only; MLA is not implemented "
            "(moe/deepseek-v3-gqa is DeepSeek-V3's experts with grouped-query attention)")
      .integer("mtp_num_layers", std::nullopt,
               "Megatron-LM's multi-token prediction layers (DeepSeek-V3): unset or 0 only; MTP is not implemented", 0)
      .integer("ffn_hidden_size", std::nullopt, "MLP width (default: 4 * hidden_size)", 1, 1 << 20)
      .text("normalization", "LayerNorm", "LayerNorm or RMSNorm", {"LayerNorm", "RMSNorm"})
      .number("norm_epsilon", 1e-5, "epsilon of the norms", 0.0, 1.0)
      .text("activation", "gelu", "MLP activation: gelu (tanh) or swiglu", {"gelu", "swiglu"})
      .text("position_embedding_type", "learned_absolute", "learned_absolute or rope",
            {"learned_absolute", "rope"})
      .number("rotary_base", 10000.0, "RoPE base (theta)", 1.0)
      .flag("use_rope_scaling", false,
            "Llama-3.1/3.2 RoPE frequency scaling: low frequencies divided by rope_scaling_factor, high ones kept, "
            "a smooth blend between (Hugging Face rope_scaling {rope_type: llama3})")
      .number("rope_scaling_factor", 8.0, "use_rope_scaling: divisor of the low frequencies (Llama-3.2: 32)", 1e-9)
      .number("rope_scaling_low_freq_factor", 1.0,
              "use_rope_scaling: wavelengths above original_max_position_embeddings / this are scaled", 1e-9)
      .number("rope_scaling_high_freq_factor", 4.0,
              "use_rope_scaling: wavelengths below original_max_position_embeddings / this are kept", 1e-9)
      .integer("rope_scaling_original_max_position_embeddings", 8192,
               "use_rope_scaling: the context length the model was first trained at", 1, int64_t{1} << 30)
      .integer("sliding_window", 0,
               "sliding-window attention (Mistral): a token sees itself and the sliding_window - 1 tokens "
               "before it; 0: full causal attention",
               0, int64_t{1} << 30)
      .flag("untie_embeddings_and_output_weights", false, "separate output head instead of the embedding")
      .flag("add_bias_linear", true, "biases in the linear layers")
      .flag("add_qkv_bias", false, "a bias on the q, k and v projections even without add_bias_linear (Qwen2)")
      .number("init_method_std", 0.02, "standard deviation of the weight init", 0.0, 1.0)
      .add({"group_query_attention", KeyType::Bool, config::Value::null(), {}, {}, {},
            "Megatron-LM's switch for num_query_groups: true needs num_query_groups, false refuses a "
            "num_query_groups other than num_attention_heads (Megatron-LM would ignore it); unset: "
            "num_query_groups alone decides"})
      .integer("max_position_embeddings", std::nullopt,
               "Megatron-LM's longest sequence the model is built for: at least seq_length; with learned positions "
               "the table has seq_length rows here, so there it must equal seq_length; unset: seq_length",
               1, int64_t{1} << 30)
      .number("attention_dropout", 0.0,
              "dropout on the attention probabilities: 0 only (no backend implements dropout; Megatron-LM's "
              "default is 0.1, today's pretraining recipes set 0)",
              0.0, 1.0)
      .number("hidden_dropout", 0.0,
              "dropout on the residual branches: 0 only (no backend implements dropout; Megatron-LM's default is "
              "0.1, today's pretraining recipes set 0)",
              0.0, 1.0)
      .alias("swiglu", "activation", config::Value::string("swiglu"), config::Value::string("gelu"),
             "Megatron-LM's name: true is activation: swiglu, false activation: gelu");
  // Mixture of experts (Megatron-LM's names).
  s.integer("num_experts", 0, "routed experts per MoE layer (0: dense model)", 0, 4096)
      .integer("moe_router_topk", 2, "experts each token is routed to", 1, 4096)
      .integer("moe_ffn_hidden_size", std::nullopt, "width of one routed expert (default: ffn_hidden_size)", 1, 1 << 20)
      .integer("moe_shared_expert_intermediate_size", 0, "width of the shared expert every token uses (0: none)", 0,
               1 << 20)
      .text("moe_router_score_function", "softmax", "router score: softmax (Mixtral, OLMoE) or sigmoid (DeepSeek-V3)",
            {"softmax", "sigmoid"})
      .flag("moe_router_pre_softmax", false,
            "softmax over all experts before top-k, weights not renormalised (OLMoE); default: softmax over the top-k")
      .number("moe_router_topk_scaling_factor", 1.0, "routing weights are multiplied by this", 0.0)
      .integer("moe_router_num_groups", 1, "expert groups for group-limited routing (1: no limit)", 1, 4096)
      .integer("moe_router_group_topk", 1, "groups a token may choose experts from", 1, 4096)
      .flag("moe_router_enable_expert_bias", false,
            "aux-loss-free balancing: a per-expert bias steers the choice, updated after each step")
      .number("moe_router_bias_update_rate", 1e-3, "step of the expert bias update", 0.0)
      .any("moe_aux_loss_coeff", config::KeyType::Any,
           "load-balancing loss coefficient: a number, or with a list of balancing types one number per type, in the "
           "same order",
           config::Value::floating(0.0))
      .number("moe_z_loss_coeff", 0.0, "router z-loss coefficient", 0.0)
      .any("moe_router_load_balancing_type", config::KeyType::Any,
           "the tokens moe_aux_loss_coeff's loss balances: aux_loss (the micro-batch's), "
           "seq_aux_loss (each sequence's, averaged: DeepSeek-V3), global_aux_loss (the loads of the global batch: "
           "every data-parallel rank's tokens, averaged over the step's micro-batches), none (no balancing loss), or a "
           "list of the first three, each with its own coefficient",
           config::Value::string("aux_loss"))
      .any("moe_layer_freq", config::KeyType::Any,
           "which layers are MoE: an integer N (every N-th layer, from layer 0) or a list of 0/1 per layer")
      .integer("moe_first_k_dense_replace", 0, "the first k layers stay dense (DeepSeek)", 0, 4096)
      .number("moe_expert_capacity_factor", std::nullopt,
              "slots an expert keeps per micro-batch = factor * tokens * topk / num_experts (unset: dropless)", 0.0)
      .text("moe_token_drop_policy", "probs", "which slots an over-capacity expert drops: lowest weights or latest tokens",
            {"probs", "position"})
      .flag("moe_router_force_load_balancing", false,
            "benchmarking only: every router's logits are a fixed pseudo-random draw per layer, token position and "
            "expert, so the experts get near-equal loads (gradients pass straight through, as in Megatron)")
      .text("moe_router_dtype", "fp32",
            "the routing's arithmetic: fp32 (both backends score, choose and weight the experts in fp32 or wider "
            "from f32 logits, whatever the model's dtype); Megatron's fp64 is refused by name",
            {"fp32", "fp64"})
      .text("moe_token_dispatcher_type", "alltoall",
            "how tokens reach their experts' ranks under expert parallelism: alltoall (both backends); Megatron's "
            "allgather is accepted only without expert parallelism (no token moves), flex is refused by name",
            {"alltoall", "allgather", "flex"});
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
double optd(const config::Value& p, const char* key, double def) {
  const config::Value* v = p.find_path(key);
  return v && !v->is_null() ? v->as_double() : def;
}
bool optb(const config::Value& p, const char* key, bool def) {
  const config::Value* v = p.find_path(key);
  return v && !v->is_null() ? v->as_bool() : def;
}
std::string opts(const config::Value& p, const char* key, const char* def) {
  const config::Value* v = p.find_path(key);
  return v && !v->is_null() ? v->as_string() : def;
}

// moe_router_load_balancing_type and moe_aux_loss_coeff: one type and one number, or a list of
// types with a list of numbers of the same length (Megatron-LM's list form).
bool is_text(const config::Value& v) { return v.kind() == config::Value::Kind::String; }
bool is_number(const config::Value& v) {
  return v.kind() == config::Value::Kind::Int || v.kind() == config::Value::Kind::Float;
}

template <class Fail>
void balancing_from_config(const config::Value& p, MoeSpec& e, Fail&& fail) {
  const char* tkey = "moe_router_load_balancing_type";
  const char* ckey = "moe_aux_loss_coeff";
  const config::Value* tv = p.find_path(tkey);
  const config::Value* cv = p.find_path(ckey);
  const bool tlist = tv && tv->is_list(), clist = cv && cv->is_list();
  std::vector<std::string> types;
  if (tlist) {
    for (const config::Value& it : tv->items()) {
      if (!is_text(it)) {
        fail(tkey, fmt::format("{} lists a value of type {}, not a type name", tkey,
                               config::Value::kind_name(it.kind())));
      }
      types.push_back(it.as_string());
    }
    if (types.empty()) fail(tkey, fmt::format("{} is an empty list; name a type or none", tkey));
  } else if (tv && !tv->is_null()) {
    if (!is_text(*tv)) fail(tkey, fmt::format("{} must be a type name or a list of them", tkey));
    types.push_back(tv->as_string());
  } else {
    types.push_back("aux_loss");
  }
  std::vector<double> coeffs;
  if (clist) {
    for (const config::Value& it : cv->items()) {
      if (!is_number(it)) {
        fail(ckey, fmt::format("{} lists a value of type {}, not a number", ckey, config::Value::kind_name(it.kind())));
      }
      coeffs.push_back(it.as_double());
    }
  } else {
    if (cv && !cv->is_null() && !is_number(*cv)) fail(ckey, fmt::format("{} must be a number or a list of them", ckey));
    coeffs.push_back(cv && !cv->is_null() ? cv->as_double() : 0.0);
  }
  if (tlist != clist || types.size() != coeffs.size()) {
    fail(clist ? ckey : tkey,
         fmt::format("{} lists {} and {} {}: a list of balancing types takes a list of coefficients, one per type, in "
                     "the same order (Megatron-LM's form)",
                     tkey, tlist ? fmt::format("{} types", types.size()) : "one type", ckey,
                     clist ? fmt::format("{} numbers", coeffs.size()) : "one number"));
  }
  for (double c : coeffs)
    if (!(c >= 0.0) || !std::isfinite(c)) fail(ckey, fmt::format("{} {} must be a finite number >= 0", ckey, c));
  e.batch_aux_loss = e.seq_aux_loss = e.global_aux_loss = false;
  e.aux_loss_coeff = e.seq_aux_loss_coeff = e.global_aux_loss_coeff = 0.0;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    if (t == "sinkhorn") {
      fail(tkey, fmt::format("{} 'sinkhorn' is not implemented; use aux_loss, seq_aux_loss, global_aux_loss or none "
                             "(or the aux-loss-free moe_router_enable_expert_bias)",
                             tkey));
    }
    if (t == "none" && types.size() > 1)
      fail(tkey, fmt::format("{} lists 'none' beside other types; 'none' stands alone", tkey));
    if (t == "none") {
      // No balancing loss whatever moe_aux_loss_coeff says (a preset's coefficient included), as in
      // Megatron-LM; the micro-batch's statistic is still logged.
      e.batch_aux_loss = true;
      continue;
    }
    const auto& all = MoeSpec::kBalances;
    const auto b = std::find_if(all.begin(), all.end(), [&](MoeSpec::Balance x) { return t == MoeSpec::balance_name(x); });
    if (b == all.end()) {
      fail(tkey, fmt::format("{} '{}' is not one of aux_loss, seq_aux_loss, global_aux_loss, none", tkey, t));
    }
    bool& listed = MoeSpec::listed_of(e, *b);
    if (listed) fail(tkey, fmt::format("{} lists '{}' twice", tkey, t));
    listed = true;
    MoeSpec::coeff_of(e, *b) = coeffs[i];
  }
}

template <class Where>
MoeSpec moe_from_config(const config::Value& p, const ModelSpec& m, Where&& where) {
  MoeSpec e;
  e.num_experts = opt(p, "num_experts", 0);
  auto fail = [&](const char* key, const std::string& what) {
    throw ConfigError(fmt::format("{}: {}", where(key), what));
  };
  if (e.num_experts == 0) {
    // The schema takes both balancing keys as any value (a name or a list): a dense model ignores
    // them, but a misspelt type or a negative coefficient is still refused, as the schema would.
    MoeSpec unused;
    balancing_from_config(p, unused, fail);
    return e;
  }
  // Keys the config leaves unset keep MoeSpec's defaults (the schema's, for configs that skipped it).
  e.topk = opt(p, "moe_router_topk", e.topk);
  e.ffn_hidden_size = opt(p, "moe_ffn_hidden_size", m.ffn_hidden_size);
  e.shared_ffn_hidden_size = opt(p, "moe_shared_expert_intermediate_size", e.shared_ffn_hidden_size);
  e.sigmoid = opts(p, "moe_router_score_function", "softmax") == "sigmoid";
  e.pre_softmax = optb(p, "moe_router_pre_softmax", e.pre_softmax);
  e.topk_scaling_factor = optd(p, "moe_router_topk_scaling_factor", e.topk_scaling_factor);
  e.num_groups = opt(p, "moe_router_num_groups", e.num_groups);
  e.group_topk = opt(p, "moe_router_group_topk", e.group_topk);
  e.expert_bias = optb(p, "moe_router_enable_expert_bias", e.expert_bias);
  e.bias_update_rate = optd(p, "moe_router_bias_update_rate", e.bias_update_rate);
  e.z_loss_coeff = optd(p, "moe_z_loss_coeff", e.z_loss_coeff);
  balancing_from_config(p, e, fail);
  e.capacity_factor = optd(p, "moe_expert_capacity_factor", e.capacity_factor);
  e.drop_by_position = opts(p, "moe_token_drop_policy", "probs") == "position";
  if (opts(p, "moe_router_dtype", "fp32") == "fp64") {
    fail("moe_router_dtype",
         "moe_router_dtype 'fp64' is not implemented: the router GEMM writes f32 logits, which both backends route in "
         "fp32 (the reference) or fp64 (the cuda kernel); use fp32");
  }
  const std::string dispatcher = opts(p, "moe_token_dispatcher_type", "alltoall");
  if (dispatcher == "flex") {
    fail("moe_token_dispatcher_type",
         "moe_token_dispatcher_type 'flex' (DeepEP / HybridEP) is not implemented; use alltoall");
  }
  e.allgather_dispatcher = dispatcher == "allgather";
  e.force_load_balancing = optb(p, "moe_router_force_load_balancing", e.force_load_balancing);
  const int64_t E = e.num_experts, L = m.num_layers;
  if (!m.swiglu || m.bias) {
    fail("num_experts", "MoE layers are SwiGLU experts without biases (activation: swiglu, add_bias_linear: false)");
  }
  if (e.topk > E) fail("moe_router_topk", fmt::format("moe_router_topk {} exceeds num_experts {}", e.topk, E));
  if (e.sigmoid && e.pre_softmax) {
    fail("moe_router_pre_softmax", "moe_router_pre_softmax applies to the softmax score function only");
  }
  if (e.num_groups > 1) {
    if (E % e.num_groups != 0) {
      fail("moe_router_num_groups",
           fmt::format("num_experts {} is not divisible by moe_router_num_groups {}", E, e.num_groups));
    }
    if (e.group_topk > e.num_groups) {
      fail("moe_router_group_topk",
           fmt::format("moe_router_group_topk {} exceeds moe_router_num_groups {}", e.group_topk, e.num_groups));
    }
    if (e.topk % e.group_topk != 0) {
      fail("moe_router_group_topk",
           fmt::format("moe_router_topk {} is not divisible by moe_router_group_topk {}", e.topk, e.group_topk));
    }
    if (e.topk / e.group_topk > E / e.num_groups) {
      fail("moe_router_group_topk", fmt::format("moe_router_topk / moe_router_group_topk = {} exceeds the {} experts of a "
                                                "group", e.topk / e.group_topk, E / e.num_groups));
    }
  } else if (e.group_topk != 1) {
    fail("moe_router_group_topk", "moe_router_group_topk needs moe_router_num_groups > 1");
  }
  // Which layers are MoE.
  e.moe_layers.assign(static_cast<size_t>(L), true);
  if (const config::Value* f = p.find_path("moe_layer_freq"); f && !f->is_null()) {
    if (f->is_list()) {
      const std::vector<config::Value>& items = f->items();
      if (static_cast<int64_t>(items.size()) != L) {
        fail("moe_layer_freq", fmt::format("moe_layer_freq lists {} layers, the model has {}", items.size(), L));
      }
      for (int64_t l = 0; l < L; ++l) {
        const int64_t v = items[static_cast<size_t>(l)].as_int();
        if (v != 0 && v != 1) fail("moe_layer_freq", fmt::format("moe_layer_freq[{}] is {}, expected 0 or 1", l, v));
        e.moe_layers[l] = v == 1;
      }
    } else {
      const int64_t n = f->as_int();
      if (n < 1) fail("moe_layer_freq", fmt::format("moe_layer_freq {} must be >= 1", n));
      for (int64_t l = 0; l < L; ++l) e.moe_layers[l] = l % n == 0;
    }
  }
  const int64_t dense_first = opt(p, "moe_first_k_dense_replace", 0);
  if (dense_first > L) {
    fail("moe_first_k_dense_replace", fmt::format("moe_first_k_dense_replace {} exceeds num_layers {}", dense_first, L));
  }
  for (int64_t l = 0; l < dense_first; ++l) e.moe_layers[l] = false;
  return e;
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
  m.kv_channels = opt(p, "kv_channels", 0);
  m.qk_layernorm = optb(p, "qk_layernorm", false);
  m.qk_norm_whole = opts(p, "qk_layernorm_scope", "head") == std::string("projection");
  m.layernorm = p.find_path("normalization")->as_string() == "LayerNorm";
  m.norm_epsilon = p.find_path("norm_epsilon")->as_double();
  m.swiglu = p.find_path("activation")->as_string() == "swiglu";
  m.rope = p.find_path("position_embedding_type")->as_string() == "rope";
  m.rotary_base = p.find_path("rotary_base")->as_double();
  m.rope_scaling.enabled = optb(p, "use_rope_scaling", false);
  m.rope_scaling.factor = optd(p, "rope_scaling_factor", 8.0);
  m.rope_scaling.low_freq_factor = optd(p, "rope_scaling_low_freq_factor", 1.0);
  m.rope_scaling.high_freq_factor = optd(p, "rope_scaling_high_freq_factor", 4.0);
  m.rope_scaling.original_max_position =
      static_cast<double>(opt(p, "rope_scaling_original_max_position_embeddings", 8192));
  m.sliding_window = opt(p, "sliding_window", 0);
  m.untied = p.find_path("untie_embeddings_and_output_weights")->as_bool();
  m.bias = p.find_path("add_bias_linear")->as_bool();
  m.add_qkv_bias = optb(p, "add_qkv_bias", false);
  m.init_method_std = p.find_path("init_method_std")->as_double();
  auto where = [&](const char* k) { return p.find_path(k) ? p.find_path(k)->origin().str() : std::string("?"); };
  if (m.kv_channels == 0 && m.hidden_size % m.num_attention_heads != 0) {
    throw ConfigError(fmt::format("{}: hidden_size {} is not divisible by num_attention_heads {}",
                                  where("hidden_size"), m.hidden_size, m.num_attention_heads));
  }
  if (const config::Value* gqa = p.find_path("group_query_attention"); gqa && !gqa->is_null()) {
    const config::Value* groups = p.find_path("num_query_groups");
    const bool set = groups && !groups->is_null();
    if (gqa->as_bool() && !set) {
      throw ConfigError(fmt::format("{}: group_query_attention: true needs num_query_groups (the key/value heads)",
                                    where("group_query_attention")));
    }
    if (!gqa->as_bool() && set && m.num_query_groups != m.num_attention_heads) {
      throw ConfigError(fmt::format("{}: group_query_attention: false with num_query_groups {} (set at {}): "
                                    "Megatron-LM would ignore num_query_groups and train {} key/value heads; "
                                    "remove one of the two",
                                    where("group_query_attention"), m.num_query_groups, where("num_query_groups"),
                                    m.num_attention_heads));
    }
  }
  if (const config::Value* mpe = p.find_path("max_position_embeddings"); mpe && !mpe->is_null()) {
    const int64_t n = mpe->as_int();
    if (n < m.seq_length) {
      throw ConfigError(fmt::format("{}: seq_length {} (set at {}) exceeds max_position_embeddings {}",
                                    where("max_position_embeddings"), m.seq_length, where("seq_length"), n));
    }
    if (!m.rope && n != m.seq_length) {
      throw ConfigError(fmt::format("{}: max_position_embeddings {} with learned positions: the position table has "
                                    "seq_length ({}) rows; a longer table is not implemented (set "
                                    "max_position_embeddings to seq_length, or remove it)",
                                    where("max_position_embeddings"), n, m.seq_length));
    }
  }
  for (const char* k : {"attention_dropout", "hidden_dropout"}) {
    if (const config::Value* d = p.find_path(k); d && !d->is_null() && d->as_double() != 0.0) {
      throw ConfigError(fmt::format("{}: {} {}: dropout is not implemented (no backend has it); set 0, as "
                                    "Llama-, Qwen- and DeepSeek-style pretraining does",
                                    where(k), k, d->scalar_text()));
    }
  }
  if (m.num_attention_heads % m.num_query_groups != 0) {
    throw ConfigError(fmt::format("{}: num_attention_heads {} is not divisible by num_query_groups {}",
                                  where("num_query_groups"), m.num_attention_heads, m.num_query_groups));
  }
  if (m.kv_channels == 0) m.kv_channels = m.hidden_size / m.num_attention_heads;
  if (m.rope && m.head_dim() % 2 != 0) {
    throw ConfigError(fmt::format("{}: RoPE needs an even head dimension, got {}", where("kv_channels"), m.head_dim()));
  }
  if (m.rope_scaling.enabled) {
    if (!m.rope) {
      throw ConfigError(fmt::format("{}: use_rope_scaling scales RoPE's frequencies and needs position_embedding_type: rope",
                                    where("use_rope_scaling")));
    }
    if (m.rope_scaling.high_freq_factor <= m.rope_scaling.low_freq_factor) {
      throw ConfigError(fmt::format("{}: rope_scaling_high_freq_factor {} must exceed rope_scaling_low_freq_factor {}",
                                    where("rope_scaling_high_freq_factor"), m.rope_scaling.high_freq_factor,
                                    m.rope_scaling.low_freq_factor));
    }
  }
  if (m.qk_layernorm && m.layernorm) {
    // Megatron allows a LayerNorm here; no model we export or test has one, so say so rather
    // than train something nobody can check.
    throw ConfigError(fmt::format("{}: qk_layernorm is an RMSNorm per head and needs normalization: RMSNorm",
                                  where("qk_layernorm")));
  }
  if (m.qk_norm_whole && !m.qk_layernorm) {
    throw ConfigError(fmt::format("{}: qk_layernorm_scope: projection says how qk_layernorm normalises; set "
                                  "qk_layernorm: true as well", where("qk_layernorm_scope")));
  }
  if (optb(p, "multi_latent_attention", false)) {
    throw ConfigError(fmt::format("{}: multi_latent_attention: true is not implemented (attention is multi-head or "
                                  "grouped-query; moe/deepseek-v3-gqa is DeepSeek-V3's experts with GQA)",
                                  where("multi_latent_attention")));
  }
  if (opt(p, "mtp_num_layers", 0) > 0) {
    throw ConfigError(fmt::format("{}: mtp_num_layers {}: multi-token prediction is not implemented (set it 0 or "
                                  "null)",
                                  where("mtp_num_layers"), opt(p, "mtp_num_layers", 0)));
  }
  m.moe = moe_from_config(p, m, where);
  return m;
}

std::string ModelSpec::summary() const {
  std::string s = fmt::format("{} {} layers, hidden {}, heads {}/{}", model_type, num_layers, hidden_size,
                              num_attention_heads, num_query_groups);
  if (q_dim() != hidden_size) s += fmt::format(" of {}", head_dim());
  if (qk_layernorm) s += qk_norm_whole ? ", qk norm (projection)" : ", qk norm";
  if (add_qkv_bias && !bias) s += ", qkv bias";
  if (sliding_window > 0) s += fmt::format(", sliding window {}", sliding_window);
  if (rope && rope_scaling.enabled) {
    s += fmt::format(", rope scaling x{:g} (low {:g}, high {:g}, original {:g})", rope_scaling.factor,
                     rope_scaling.low_freq_factor, rope_scaling.high_freq_factor, rope_scaling.original_max_position);
  }
  if (moe.enabled()) {
    s += fmt::format(", {} experts top-{} in {} MoE layers{}", moe.num_experts, moe.topk, num_moe_layers(),
                     moe.shared_ffn_hidden_size > 0 ? " + shared expert" : "");
    return s + fmt::format(", {} parameters ({} active)", num_parameters(), num_active_parameters());
  }
  return s + fmt::format(", {} parameters", num_parameters());
}

int64_t MoeSpec::capacity(int64_t tokens) const {
  if (capacity_factor <= 0) return -1;
  const double c = std::ceil(capacity_factor * static_cast<double>(tokens * topk) / static_cast<double>(num_experts));
  return static_cast<int64_t>(c);
}

int64_t ModelSpec::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l);
  return n;
}

namespace {
// A layer's parameters: attention, norms and its MLP; `experts` of the routed experts counted
// (all of them for the total, topk for the active count).
int64_t layer_parameters(const ModelSpec& m, int64_t l, int64_t experts) {
  const int64_t C = m.hidden_size;
  const int64_t norm = m.layernorm ? 2 * C : C;
  int64_t n = 2 * norm + C * m.qkv_dim() + m.q_dim() * C;
  if (m.bias) n += C;
  if (m.qkv_bias()) n += m.qkv_dim();
  if (m.qk_layernorm) n += m.q_norm_dim() + m.k_norm_dim();  // q_norm, k_norm
  if (m.is_moe_layer(l)) {
    n += m.moe.num_experts * C;                                 // router
    n += experts * 3 * m.moe.ffn_hidden_size * C;               // gate, up, down
    n += 3 * m.moe.shared_ffn_hidden_size * C;                  // shared expert
    if (m.moe.expert_bias) n += m.moe.num_experts;               // the bias buffer
  } else {
    n += C * m.fc_dim() + m.ffn_hidden_size * C;
    if (m.bias) n += m.fc_dim() + C;
  }
  return n;
}
}  // namespace

int64_t ModelSpec::num_parameters() const {
  const int64_t C = hidden_size, V = padded_vocab_size;
  const int64_t norm = layernorm ? 2 * C : C;
  int64_t total = V * C + (rope ? 0 : seq_length * C) + norm;
  for (int64_t l = 0; l < num_layers; ++l) total += layer_parameters(*this, l, moe.num_experts);
  if (untied) total += V * C;
  return total;
}

int64_t ModelSpec::num_active_parameters() const {
  const int64_t C = hidden_size, V = padded_vocab_size;
  const int64_t norm = layernorm ? 2 * C : C;
  int64_t total = norm + (untied ? V * C : 0);
  for (int64_t l = 0; l < num_layers; ++l) total += layer_parameters(*this, l, moe.topk);
  return total;
}

double ModelSpec::flops_per_token() const {
  const double C = hidden_size, L = num_layers;
  double matmul = C * padded_vocab_size;
  for (int64_t l = 0; l < num_layers; ++l) {
    matmul += C * qkv_dim() + q_dim() * C;
    if (is_moe_layer(l)) {
      matmul += (moe.num_experts + 3.0 * moe.topk * moe.ffn_hidden_size + 3.0 * moe.shared_ffn_hidden_size) * C;
    } else {
      matmul += C * fc_dim() + ffn_hidden_size * C;
    }
  }
  // Attention scores and values run over q_dim() channels per token (heads x head dim). Counted
  // as twice the keys an average query sees: T (causal, T/2 each); with a sliding window W < T,
  // 2 (W(W+1)/2 + (T-W)W) / T, what the kernels compute.
  const double T = static_cast<double>(seq_length), W = static_cast<double>(std::min(sliding_window, seq_length));
  const double span = sliding_window > 0 ? 2.0 * (W * (W + 1) / 2 + (T - W) * W) / T : T;
  return 6.0 * matmul + 6.0 * L * static_cast<double>(q_dim()) * span;
}

}  // namespace primus::train
