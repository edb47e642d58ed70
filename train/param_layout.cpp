#include "train/param_layout.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "core/util/error.h"

namespace primus::train {

namespace {
// A MoE layer's tensors (after norm2): router, stacked routed experts, the optional shared
// expert and the optional expert bias, with the Hugging Face names of the model's family
// (Mixtral's block_sparse_moe.*; OLMoE / Qwen-MoE / DeepSeek's mlp.*).
template <class Add, class AddBuffer>
void add_moe_layer_impl(const ModelSpec& m, const std::string& p, const std::string& hp, Add& add, AddBuffer& add_buffer) {
  const int64_t C = m.hidden_size, E = m.moe.num_experts, Fe = m.moe.ffn_hidden_size, Fs = m.moe.shared_ffn_hidden_size;
  const bool mixtral = m.model_type == "mixtral";
  const std::string hm = hp + (mixtral ? "block_sparse_moe." : "mlp.");
  auto one = [](std::string n, int64_t begin, int64_t rows) { return HfPart{std::move(n), begin, rows, HfTransform::None, 0}; };
  add(p + "moe.router.weight", {E, C}, true, std::vector<HfPart>{one(hm + "gate.weight", 0, E)});
  if (m.moe.expert_bias) add_buffer(p + "moe.router.expert_bias", {E}, std::vector<HfPart>{one(hm + "gate.e_score_correction_bias", 0, E)});
  // The experts held (all but on an expert-parallel rank), named by their global index.
  const int64_t El = m.moe.held_experts(), e0 = m.moe.first_expert;
  std::vector<HfPart> fc, proj;
  for (int64_t e = 0; e < El; ++e) {
    const std::string x = fmt::format("{}experts.{}.", hm, e0 + e);
    fc.push_back(one(x + (mixtral ? "w1.weight" : "gate_proj.weight"), e * 2 * Fe, Fe));
    fc.push_back(one(x + (mixtral ? "w3.weight" : "up_proj.weight"), e * 2 * Fe + Fe, Fe));
    proj.push_back(one(x + (mixtral ? "w2.weight" : "down_proj.weight"), e * C, C));
  }
  add(p + "moe.experts.fc.weight", {El, 2 * Fe, C}, true, std::move(fc));
  add(p + "moe.experts.proj.weight", {El, C, Fe}, true, std::move(proj));
  if (Fs > 0) {
    const std::string s = hm + "shared_experts.";
    add(p + "moe.shared.fc.weight", {2 * Fs, C}, true,
        std::vector<HfPart>{one(s + "gate_proj.weight", 0, Fs), one(s + "up_proj.weight", Fs, Fs)});
    add(p + "moe.shared.proj.weight", {C, Fs}, true, std::vector<HfPart>{one(s + "down_proj.weight", 0, C)});
  }
}
}  // namespace

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const ParamTensor& ParamLayout::get(const std::string& name) const {
  if (const ParamTensor* t = find(name)) return *t;
  throw RuntimeError(fmt::format("no parameter '{}' in this model", name));
}

ParamLayout make_param_layout(const ModelSpec& m) {
  ParamLayout L;
  const int64_t C = m.hidden_size, V = m.padded_vocab_size, F = m.ffn_hidden_size;
  const bool gpt2 = !m.swiglu && !m.rope;  // HF naming follows the family
  auto add = [&](std::string name, std::vector<int64_t> shape, bool decay, std::vector<HfPart> hf) {
    ParamTensor t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.numel = 1;
    for (auto d : t.shape) t.numel *= d;
    t.offset = L.total;
    t.decay = decay;
    t.hf = std::move(hf);
    L.total += t.numel;
    L.tensors.push_back(std::move(t));
  };
  auto whole = [](std::string n, int64_t rows, HfTransform tr = HfTransform::None) {
    return std::vector<HfPart>{{std::move(n), 0, rows, tr, 0}};
  };
  auto add_buffer = [&](std::string name, std::vector<int64_t> shape, std::vector<HfPart> hf) {
    add(std::move(name), std::move(shape), false, std::move(hf));
    L.tensors.back().trainable = false;
  };
  const std::string pre = gpt2 ? "transformer." : "model.";
  add("embedding.weight", {V, C}, true, whole(gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight", V));
  if (!m.rope) add("position_embedding.weight", {m.seq_length, C}, true, whole("transformer.wpe.weight", m.seq_length));
  const int64_t H = m.num_attention_heads, KV = m.num_query_groups, D = m.head_dim();
  for (int64_t l = 0; l < m.num_layers; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    std::string hp = gpt2 ? fmt::format("transformer.h.{}.", l) : fmt::format("model.layers.{}.", l);
    auto norm = [&](const std::string& ours, const std::string& hf_gpt2, const std::string& hf_llama) {
      add(p + ours + ".weight", {C}, false, whole(hp + (gpt2 ? hf_gpt2 : hf_llama) + ".weight", C));
      if (m.layernorm) add(p + ours + ".bias", {C}, false, whole(hp + (gpt2 ? hf_gpt2 : hf_llama) + ".bias", C));
    };
    norm("norm1", "ln_1", "input_layernorm");
    if (gpt2) {
      add(p + "attn.qkv.weight", {m.qkv_dim(), C}, true, whole(hp + "attn.c_attn.weight", m.qkv_dim(), HfTransform::Transpose));
      if (m.qkv_bias()) add(p + "attn.qkv.bias", {m.qkv_dim()}, false, whole(hp + "attn.c_attn.bias", m.qkv_dim()));
      add(p + "attn.proj.weight", {C, m.q_dim()}, true, whole(hp + "attn.c_proj.weight", C, HfTransform::Transpose));
      if (m.bias) add(p + "attn.proj.bias", {C}, false, whole(hp + "attn.c_proj.bias", C));
    } else {
      HfTransform qk = m.rope ? HfTransform::RopeRows : HfTransform::None;
      std::vector<HfPart> qkv = {{hp + "self_attn.q_proj.weight", 0, H * D, qk, H},
                                 {hp + "self_attn.k_proj.weight", H * D, KV * D, qk, KV},
                                 {hp + "self_attn.v_proj.weight", H * D + KV * D, KV * D, HfTransform::None, 0}};
      add(p + "attn.qkv.weight", {m.qkv_dim(), C}, true, qkv);
      if (m.qkv_bias()) {  // rows as the weight's: q and k take RoPE's row permutation
        std::vector<HfPart> qkvb = {{hp + "self_attn.q_proj.bias", 0, H * D, qk, H},
                                    {hp + "self_attn.k_proj.bias", H * D, KV * D, qk, KV},
                                    {hp + "self_attn.v_proj.bias", H * D + KV * D, KV * D, HfTransform::None, 0}};
        add(p + "attn.qkv.bias", {m.qkv_dim()}, false, qkvb);
      }
      add(p + "attn.proj.weight", {C, m.q_dim()}, true, whole(hp + "self_attn.o_proj.weight", C));
      if (m.bias) add(p + "attn.proj.bias", {C}, false, whole(hp + "self_attn.o_proj.bias", C));
    }
    if (m.qk_layernorm) {
      // Per head: one weight of head_dim per norm, shared by the heads. Our features are RoPE's
      // interleaved pairs, HF's the half-split ones, so the weight takes the q/k rows'
      // permutation (as one "head"); without RoPE the features are in the same order. Over the
      // whole projection (OLMoE): weights of heads x head_dim, permuted per head as the q/k rows.
      const HfTransform nt = m.rope ? HfTransform::RopeRows : HfTransform::None;
      const std::string ha = hp + (gpt2 ? "attn." : "self_attn.");
      const int64_t qh = m.qk_norm_whole ? H : 1, kh = m.qk_norm_whole ? KV : 1;
      add(p + "attn.q_norm.weight", {m.q_norm_dim()}, false,
          std::vector<HfPart>{{ha + "q_norm.weight", 0, m.q_norm_dim(), nt, qh}});
      add(p + "attn.k_norm.weight", {m.k_norm_dim()}, false,
          std::vector<HfPart>{{ha + "k_norm.weight", 0, m.k_norm_dim(), nt, kh}});
    }
    norm("norm2", "ln_2", "post_attention_layernorm");
    if (m.is_moe_layer(l)) {
      add_moe_layer_impl(m, p, hp, add, add_buffer);
      continue;
    }
    if (gpt2) {
      add(p + "mlp.fc.weight", {m.fc_dim(), C}, true, whole(hp + "mlp.c_fc.weight", m.fc_dim(), HfTransform::Transpose));
      if (m.bias) add(p + "mlp.fc.bias", {m.fc_dim()}, false, whole(hp + "mlp.c_fc.bias", m.fc_dim()));
      add(p + "mlp.proj.weight", {C, F}, true, whole(hp + "mlp.c_proj.weight", C, HfTransform::Transpose));
      if (m.bias) add(p + "mlp.proj.bias", {C}, false, whole(hp + "mlp.c_proj.bias", C));
    } else {
      std::vector<HfPart> fc;
      if (m.swiglu) {
        fc = {{hp + "mlp.gate_proj.weight", 0, F, HfTransform::None, 0}, {hp + "mlp.up_proj.weight", F, F, HfTransform::None, 0}};
      } else {
        fc = whole(hp + "mlp.up_proj.weight", F);
      }
      add(p + "mlp.fc.weight", {m.fc_dim(), C}, true, fc);
      if (m.bias) {
        std::vector<HfPart> fcb;
        if (m.swiglu) {
          fcb = {{hp + "mlp.gate_proj.bias", 0, F, HfTransform::None, 0}, {hp + "mlp.up_proj.bias", F, F, HfTransform::None, 0}};
        } else {
          fcb = whole(hp + "mlp.up_proj.bias", F);
        }
        add(p + "mlp.fc.bias", {m.fc_dim()}, false, fcb);
      }
      add(p + "mlp.proj.weight", {C, F}, true, whole(hp + "mlp.down_proj.weight", C));
      if (m.bias) add(p + "mlp.proj.bias", {C}, false, whole(hp + "mlp.down_proj.bias", C));
    }
  }
  add("final_norm.weight", {C}, false, whole(gpt2 ? "transformer.ln_f.weight" : "model.norm.weight", C));
  if (m.layernorm) add("final_norm.bias", {C}, false, whole(gpt2 ? "transformer.ln_f.bias" : "model.norm.bias", C));
  if (m.untied) add("output_layer.weight", {V, C}, true, whole("lm_head.weight", V));
  (void)pre;
  return L;
}

namespace {
int64_t cols_of(const ParamTensor& t) { return t.shape.size() >= 2 ? t.shape.back() : 1; }

// Row r of the part in HF order comes from row src_row(r) of ours (RopeRows permutes per head).
int64_t our_row(const HfPart& p, int64_t hf_row) {
  if (p.transform != HfTransform::RopeRows) return p.row_begin + hf_row;
  int64_t D = p.rows / p.heads;
  int64_t h = hf_row / D, j = hf_row % D;
  // HF half-split feature j of a head is our interleaved feature: j < D/2 -> 2j, else 2(j-D/2)+1.
  int64_t ours = j < D / 2 ? 2 * j : 2 * (j - D / 2) + 1;
  return p.row_begin + h * D + ours;
}
}  // namespace

std::vector<int64_t> to_hf(const ParamTensor& t, const HfPart& part, const float* ours,
                           std::vector<float>& out, int64_t vocab_rows) {
  const int64_t cols = cols_of(t);
  int64_t rows = part.rows;
  if (vocab_rows > 0 && vocab_rows < rows && part.transform == HfTransform::None) rows = vocab_rows;
  out.resize(static_cast<size_t>(rows * cols));
  const float* base = ours + t.offset;
  if (part.transform == HfTransform::Transpose) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = base[(part.row_begin + r) * cols + c];
    return {cols, rows};
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&out[r * cols], base + our_row(part, r) * cols, sizeof(float) * cols);
  if (t.shape.size() == 1) return {rows};
  return {rows, cols};
}

void from_hf(const ParamTensor& t, const HfPart& part, const float* hf,
             const std::vector<int64_t>& hf_shape, float* ours) {
  const int64_t cols = cols_of(t);
  float* base = ours + t.offset;
  std::vector<int64_t> want = part.transform == HfTransform::Transpose ? std::vector<int64_t>{cols, part.rows}
                              : t.shape.size() == 1                    ? std::vector<int64_t>{part.rows}
                                                                       : std::vector<int64_t>{part.rows, cols};
  if (hf_shape != want) {
    throw FormatError(fmt::format("tensor '{}' has shape [{}], the model expects [{}]", part.name,
                                  fmt::join(hf_shape, ", "), fmt::join(want, ", ")));
  }
  if (part.transform == HfTransform::Transpose) {
    for (int64_t r = 0; r < part.rows; ++r)
      for (int64_t c = 0; c < cols; ++c) base[(part.row_begin + r) * cols + c] = hf[c * part.rows + r];
    return;
  }
  for (int64_t r = 0; r < part.rows; ++r)
    std::memcpy(base + our_row(part, r) * cols, hf + r * cols, sizeof(float) * cols);
}

namespace {
// The MoE models transformers can load with our tensors: Mixtral (softmax top-k renormalised,
// every layer MoE, no shared expert, no query/key norms), Qwen3-MoE (softmax, renormalised or
// not as norm_topk_prob says, per-head query/key norms, dense layers where mlp_only_layers
// lists them) and OLMoE (as Qwen3-MoE, every layer MoE, query/key norms over the whole
// projection width). DeepSeek-V3 needs multi-head latent attention.
void check_hf_moe(const ModelSpec& m) {
  const MoeSpec& e = m.moe;
  if (e.force_load_balancing) {
    throw ConfigError("export to Hugging Face: moe_router_force_load_balancing routes by a pseudo-random draw, not by "
                      "the router's weights (a benchmark setting); transformers would route this model otherwise");
  }
  if (m.model_type != "mixtral" && m.model_type != "qwen3_moe" && m.model_type != "olmoe") {
    std::string why = m.model_type == "deepseek_v3" ? " (DeepSeek-V3 needs multi-head latent attention)" : "";
    throw ConfigError(fmt::format("export to Hugging Face: model_type '{}' with experts is not supported yet{} "
                                  "(Mixtral, Qwen3-MoE and OLMoE are: set model_type: mixtral, qwen3_moe or olmoe)",
                                  m.model_type, why));
  }
  const bool qwen = m.model_type == "qwen3_moe", olmoe = m.model_type == "olmoe";
  const char* cls = qwen ? "Qwen3MoeForCausalLM" : olmoe ? "OlmoeForCausalLM" : "MixtralForCausalLM";
  std::string why;
  if (e.sigmoid) why = "its router is not a softmax (moe_router_score_function)";
  else if (e.pre_softmax && !qwen && !olmoe) why = "its router is not softmax over the top-k (moe_router_pre_softmax)";
  else if (e.num_groups > 1) why = "it uses group-limited routing";
  else if (e.topk_scaling_factor != 1.0) why = "moe_router_topk_scaling_factor is not 1";
  else if (e.shared_ffn_hidden_size > 0) why = "it has a shared expert";
  else if (e.expert_bias) why = "its router has an expert bias";
  else if (!qwen && m.num_moe_layers() != m.num_layers) why = "not every layer is MoE";
  else if (m.add_qkv_bias) why = "it has q/k/v biases (add_qkv_bias)";
  else if (qwen && (!m.qk_layernorm || m.qk_norm_whole))
    why = "Qwen3-MoE normalises every query and key head (set qk_layernorm: true, qk_layernorm_scope: head)";
  else if (olmoe && (!m.qk_layernorm || !m.qk_norm_whole))
    why = "OLMoE normalises the whole q and k projections (set qk_layernorm: true, qk_layernorm_scope: projection)";
  else if (olmoe && m.q_dim() != m.hidden_size)
    why = "OLMoE's heads are hidden_size / num_attention_heads wide (kv_channels differs)";
  else if (!qwen && !olmoe && m.qk_layernorm) why = "Mixtral has no query/key norms (qk_layernorm)";
  if (!why.empty()) throw ConfigError(fmt::format("export as {}: the model differs from it: {}", cls, why));
}

// What every Llama-like config.json (Llama, Qwen3, Mixtral, Qwen3-MoE) says the same way. Llama-3's
// frequency scaling is rope_scaling {rope_type: llama3}, which every one of these classes reads
// through transformers' shared RoPE initialisation.
nlohmann::json llama_like_config(const ModelSpec& m, const char* cls, const char* type, int eos) {
  nlohmann::json j = {{"architectures", {cls}}, {"model_type", type}, {"vocab_size", m.vocab_size},
          {"max_position_embeddings", m.seq_length}, {"hidden_size", m.hidden_size},
          {"intermediate_size", m.ffn_hidden_size}, {"num_hidden_layers", m.num_layers},
          {"num_attention_heads", m.num_attention_heads}, {"num_key_value_heads", m.num_query_groups},
          {"head_dim", m.head_dim()}, {"hidden_act", "silu"}, {"rms_norm_eps", m.norm_epsilon},
          {"rope_theta", m.rotary_base}, {"tie_word_embeddings", !m.untied}, {"attention_dropout", 0.0},
          {"initializer_range", m.init_method_std}, {"bos_token_id", eos}, {"eos_token_id", eos},
          {"torch_dtype", "float32"}};
  if (m.rope_scaling.enabled) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", m.rope_scaling.factor},
                         {"low_freq_factor", m.rope_scaling.low_freq_factor},
                         {"high_freq_factor", m.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings",
                          static_cast<int64_t>(m.rope_scaling.original_max_position)}};
  }
  return j;
}
}  // namespace

std::string hf_config_json(const ModelSpec& m, int eos) {
  if (m.sliding_window > 0 && m.model_type != "mistral") {
    throw ConfigError(fmt::format("export: sliding_window {} is exported only as MistralForCausalLM (set model_type: "
                                  "mistral); the {} class attends to every earlier token",
                                  m.sliding_window, m.model_type));
  }
  nlohmann::json j;
  const bool qwen_attention = m.qk_layernorm;  // only Qwen3's classes normalise q/k per head
  if (m.moe.enabled()) {
    check_hf_moe(m);
    if (m.model_type == "qwen3_moe") {
      j = llama_like_config(m, "Qwen3MoeForCausalLM", "qwen3_moe", eos);
      // Dense layers (moe_layer_freq, moe_first_k_dense_replace) are Qwen3-MoE's mlp_only_layers,
      // MLPs of intermediate_size; every other layer is sparse with decoder_sparse_step 1.
      std::vector<int64_t> dense;
      for (int64_t l = 0; l < m.num_layers; ++l)
        if (!m.is_moe_layer(l)) dense.push_back(l);
      j.update({{"moe_intermediate_size", m.moe.ffn_hidden_size}, {"num_experts", m.moe.num_experts},
                {"num_experts_per_tok", m.moe.topk}, {"norm_topk_prob", !m.moe.pre_softmax},
                {"decoder_sparse_step", 1}, {"mlp_only_layers", dense},
                {"router_aux_loss_coef", m.moe.primary_coeff()}, {"output_router_logits", false},
                {"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr},
                {"max_window_layers", m.num_layers}});
      return j.dump(2);
    }
    if (m.model_type == "olmoe") {
      // OlmoeConfig: intermediate_size is an expert's width; no head_dim key (hidden / heads).
      j = llama_like_config(m, "OlmoeForCausalLM", "olmoe", eos);
      j.erase("head_dim");
      j.update({{"intermediate_size", m.moe.ffn_hidden_size}, {"num_experts", m.moe.num_experts},
                {"num_experts_per_tok", m.moe.topk}, {"norm_topk_prob", !m.moe.pre_softmax},
                {"router_aux_loss_coef", m.moe.primary_coeff()}, {"output_router_logits", false},
                {"attention_bias", false}, {"clip_qkv", nullptr}, {"pad_token_id", nullptr}});
      return j.dump(2);
    }
    j = llama_like_config(m, "MixtralForCausalLM", "mixtral", eos);
    j.erase("intermediate_size");
    j.update({{"intermediate_size", m.moe.ffn_hidden_size}, {"num_local_experts", m.moe.num_experts},
              {"num_experts_per_tok", m.moe.topk}, {"router_aux_loss_coef", m.moe.primary_coeff()},
              {"output_router_logits", false}, {"sliding_window", nullptr}});
    return j.dump(2);
  }
  if (m.qk_norm_whole) {
    // Dense models with whole-projection q/k norms are OLMo2's, which also moves the layer norms
    // after the sublayers: no Primus setting matches it.
    throw ConfigError("export to Hugging Face: a dense model with qk_layernorm_scope: projection has no transformers "
                      "class (OLMoE is the family with these norms: it needs num_experts > 0)");
  }
  if (!m.swiglu && !m.rope) {
    if (m.q_dim() != m.hidden_size || m.qk_layernorm || !m.bias) {
      throw ConfigError("export as GPT2LMHeadModel: GPT-2 has neither a head dimension other than hidden_size / "
                        "num_attention_heads (kv_channels) nor query/key norms (qk_layernorm), and it has every bias "
                        "(add_bias_linear: true)");
    }
    j = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", m.vocab_size},
         {"n_positions", m.seq_length}, {"n_ctx", m.seq_length}, {"n_embd", m.hidden_size},
         {"n_layer", m.num_layers}, {"n_head", m.num_attention_heads}, {"n_inner", m.ffn_hidden_size},
         {"activation_function", "gelu_new"}, {"layer_norm_epsilon", m.norm_epsilon},
         {"initializer_range", m.init_method_std}, {"tie_word_embeddings", !m.untied},
         {"bos_token_id", eos}, {"eos_token_id", eos}, {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0}, {"torch_dtype", "float32"}};
  } else if (qwen_attention) {
    // Qwen3ForCausalLM: Llama's layout with q_norm / k_norm per head. Its attention_bias puts a
    // bias on q, k, v and o but none on the MLP, which no Primus setting matches.
    if (m.bias || m.add_qkv_bias) {
      throw ConfigError("export as Qwen3ForCausalLM: Qwen3 has no MLP biases and no q/k/v-only biases (set "
                        "add_bias_linear: false, add_qkv_bias: false)");
    }
    j = llama_like_config(m, "Qwen3ForCausalLM", "qwen3", eos);
    j.update({{"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr},
              {"max_window_layers", m.num_layers}});
  } else if (m.model_type == "qwen2" || (m.add_qkv_bias && !m.bias)) {
    // Qwen2ForCausalLM: Llama's layout with biases on q, k and v only (always there). Its
    // sliding window is off (use_sliding_window false; the window fields are informational).
    if (!m.add_qkv_bias || m.bias) {
      throw ConfigError("export as Qwen2ForCausalLM: Qwen2 has biases on q, k and v and nowhere else (set "
                        "add_qkv_bias: true, add_bias_linear: false)");
    }
    j = llama_like_config(m, "Qwen2ForCausalLM", "qwen2", eos);
    j.update({{"use_sliding_window", false}, {"sliding_window", nullptr}, {"max_window_layers", m.num_layers}});
  } else if (m.model_type == "mistral") {
    if (m.bias) throw ConfigError("export as MistralForCausalLM: Mistral has no biases (set add_bias_linear: false)");
    j = llama_like_config(m, "MistralForCausalLM", "mistral", eos);
    // Same semantics (transformers: kv_idx > q_idx - sliding_window); null: full attention.
    j.update({{"sliding_window", m.sliding_window > 0 ? nlohmann::json(m.sliding_window) : nlohmann::json(nullptr)}});
  } else {
    j = llama_like_config(m, "LlamaForCausalLM", "llama", eos);
    j.update({{"attention_bias", m.bias}, {"mlp_bias", m.bias}});
  }
  return j.dump(2);
}

}  // namespace primus::train
