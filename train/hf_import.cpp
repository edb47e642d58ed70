#include "train/hf_import.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include "core/util/error.h"
#include "core/util/hf_cache.h"
#include "data/tokenizer/tokenizer.h"
#include "io/checkpoint.h"
#include "io/digest_writer.h"
#include "io/safetensors.h"
#include "train/checkpointing.h"
#include "train/data_setup.h"

namespace primus::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kHfIndexFile = "model.safetensors.index.json";
constexpr const char* kHfSingleFile = "model.safetensors";
constexpr int64_t kHfRopeSeqCap = 4096;

// The model keys this build knows (other families' keys appear as they are implemented).
const config::Schema& hf_model_schema() {
  static const config::Schema s = [] {
    config::Schema x;
    add_model_schema(x);
    return x;
  }();
  return s;
}
bool hf_have_key(const std::string& k) { return hf_model_schema().find(k) != nullptr; }
bool hf_have_model_type(const std::string& t) {
  const config::KeySpec* k = hf_model_schema().find("model_type");
  return k && std::find(k->choices.begin(), k->choices.end(), t) != k->choices.end();
}

// Reads config.json's keys, naming the file and key in every error.
class HfConfig {
 public:
  HfConfig(const json& j, fs::path file) : j_(j), file_(std::move(file)) {}
  const fs::path& file() const { return file_; }
  bool has(const char* k) const { return j_.contains(k) && !j_.at(k).is_null(); }
  const json& at(const char* k) const { return j_.at(k); }
  [[noreturn]] void refuse(const char* key, const std::string& why) const {
    std::string v = j_.contains(key) ? j_.at(key).dump() : "(absent)";
    throw ConfigError(fmt::format("{}: '{}' = {}: {}", file_.string(), key, v, why));
  }
  int64_t integer(const char* k) const {
    if (!has(k)) refuse(k, "this key is required");
    if (!j_.at(k).is_number_integer()) refuse(k, "expected an integer");
    return j_.at(k).get<int64_t>();
  }
  int64_t integer(const char* k, int64_t def) const { return has(k) ? integer(k) : def; }
  double number(const char* k, double def) const {
    if (!has(k)) return def;
    if (!j_.at(k).is_number()) refuse(k, "expected a number");
    return j_.at(k).get<double>();
  }
  bool flag(const char* k, bool def) const {
    if (!has(k)) return def;
    if (!j_.at(k).is_boolean()) refuse(k, "expected true or false");
    return j_.at(k).get<bool>();
  }
  std::string text(const char* k, const std::string& def) const {
    if (!has(k)) return def;
    if (!j_.at(k).is_string()) refuse(k, "expected a string");
    return j_.at(k).get<std::string>();
  }

 private:
  const json& j_;
  fs::path file_;
};

// The keys config.json names and where from; every key is an architecture key except those in
// soft_keys() (training choices a config.json also carries, which the user may change).
struct HfKeyWriter {
  config::Value map;
  config::Origin origin;
  void integer(const char* k, int64_t v) { map.set(k, config::Value::integer(v, origin)); }
  void number(const char* k, double v) { map.set(k, config::Value::floating(v, origin)); }
  void flag(const char* k, bool v) { map.set(k, config::Value::boolean(v, origin)); }
  void text(const char* k, std::string v) { map.set(k, config::Value::string(std::move(v), origin)); }
};

bool hf_soft_key(const std::string& k) { return k == "init_method_std" || k == "moe_aux_loss_coeff"; }

std::string hf_model_type_of(const json& j, const fs::path& file) {
  if (j.contains("model_type") && j["model_type"].is_string()) return j["model_type"].get<std::string>();
  // transformers always writes model_type; older files may carry only the class.
  static const std::vector<std::pair<std::string, std::string>> classes = {
      {"GPT2LMHeadModel", "gpt2"},       {"LlamaForCausalLM", "llama"},     {"MistralForCausalLM", "mistral"},
      {"Qwen2ForCausalLM", "qwen2"},     {"Qwen3ForCausalLM", "qwen3"},     {"MixtralForCausalLM", "mixtral"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"OlmoeForCausalLM", "olmoe"}};
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    const std::string cls = j["architectures"][0].is_string() ? j["architectures"][0].get<std::string>() : "";
    for (auto& [c, t] : classes)
      if (c == cls) return t;
  }
  throw ConfigError(fmt::format("{}: no 'model_type' (and no known class in 'architectures')", file.string()));
}

// A family whose extra architecture key is not in this build yet.
[[noreturn]] void hf_not_yet(const HfConfig& c, const std::string& type, const std::string& what) {
  throw ConfigError(fmt::format("{}: 'model_type' = \"{}\" is not supported by this build: it needs {}",
                                c.file().string(), type, what));
}

// Llama-3.1/3.2's frequency scaling from a rope_scaling (transformers 4) or rope_parameters
// (transformers 5) object whose rope_type is "llama3": the four numbers transformers'
// _compute_llama3_parameters reads, each required, into use_rope_scaling / rope_scaling_*.
void hf_llama3_scaling(const HfConfig& c, const char* key, const json& s, HfKeyWriter& w) {
  auto num = [&](const char* k) {
    if (!s.contains(k) || !s.at(k).is_number()) {
      c.refuse(key, fmt::format("rope_type \"llama3\" needs a number '{}' (transformers requires it)", k));
    }
    return s.at(k).get<double>();
  };
  const double factor = num("factor"), low = num("low_freq_factor"), high = num("high_freq_factor");
  const double orig = num("original_max_position_embeddings");
  if (!(factor > 0)) c.refuse(key, "factor must be positive");
  if (!(low > 0) || !(high > low)) c.refuse(key, "needs 0 < low_freq_factor < high_freq_factor");
  if (!(orig >= 1) || orig != std::floor(orig)) {
    c.refuse(key, "original_max_position_embeddings must be a positive integer");
  }
  w.flag("use_rope_scaling", true);
  w.number("rope_scaling_factor", factor);
  w.number("rope_scaling_low_freq_factor", low);
  w.number("rope_scaling_high_freq_factor", high);
  w.integer("rope_scaling_original_max_position_embeddings", static_cast<int64_t>(orig));
}

// RoPE: rope_theta (transformers 4) or rope_parameters {rope_type, rope_theta, ...} (transformers
// 5), into rotary_base; rope_type "llama3" (Llama-3.1/3.2) into use_rope_scaling and
// rope_scaling_*. Other rope types (YaRN, linear, dynamic, longrope) are refused by name.
void hf_rope(const HfConfig& c, HfKeyWriter& w) {
  w.flag("use_rope_scaling", false);
  if (c.has("rope_scaling")) {
    const json& s = c.at("rope_scaling");
    const std::string t = s.is_object() ? s.value("rope_type", s.value("type", std::string())) : std::string();
    if (t == "llama3") {
      hf_llama3_scaling(c, "rope_scaling", s, w);
    } else if (t != "default") {
      c.refuse("rope_scaling", fmt::format("rope_type \"{}\" is not implemented in Primus' RoPE; only the plain "
                                           "rotation (\"default\") and Llama-3's \"llama3\" are",
                                           t));
    }
  }
  if (c.has("rope_parameters")) {
    const json& p = c.at("rope_parameters");
    if (!p.is_object()) c.refuse("rope_parameters", "expected an object");
    const std::string t = p.value("rope_type", p.value("type", std::string("default")));
    if (t == "llama3") {
      hf_llama3_scaling(c, "rope_parameters", p, w);
    } else if (t != "default") {
      c.refuse("rope_parameters", fmt::format("rope_type \"{}\" is not implemented in Primus' RoPE; only the plain "
                                              "rotation (\"default\") and Llama-3's \"llama3\" are",
                                              t));
    }
    if (p.contains("partial_rotary_factor") && p["partial_rotary_factor"].is_number() &&
        p["partial_rotary_factor"].get<double>() != 1.0) {
      c.refuse("rope_parameters", "partial_rotary_factor other than 1 is not implemented");
    }
    if (p.contains("rope_theta") && p["rope_theta"].is_number()) {
      w.number("rotary_base", p["rope_theta"].get<double>());
      return;
    }
  }
  if (c.has("partial_rotary_factor") && c.number("partial_rotary_factor", 1.0) != 1.0) {
    c.refuse("partial_rotary_factor", "rotating part of each head is not implemented");
  }
  w.number("rotary_base", c.number("rope_theta", 10000.0));
}

void hf_llama_like(const HfConfig& c, const std::string& type, HfKeyWriter& w) {
  const int64_t H = c.integer("num_attention_heads");
  w.text("model_type", type);
  w.integer("vocab_size", c.integer("vocab_size"));
  w.integer("num_layers", c.integer("num_hidden_layers"));
  w.integer("hidden_size", c.integer("hidden_size"));
  w.integer("num_attention_heads", H);
  w.integer("num_query_groups", c.integer("num_key_value_heads", H));
  w.integer("kv_channels", c.integer("head_dim", c.integer("hidden_size") / std::max<int64_t>(1, H)));
  w.integer("ffn_hidden_size", c.integer("intermediate_size"));
  w.text("normalization", "RMSNorm");
  w.number("norm_epsilon", c.number("rms_norm_eps", 1e-6));
  const std::string act = c.text("hidden_act", "silu");
  if (act != "silu") c.refuse("hidden_act", "Primus' SwiGLU MLP uses silu");
  w.text("activation", "swiglu");
  w.text("position_embedding_type", "rope");
  hf_rope(c, w);
  // LlamaConfig, MistralConfig, Qwen2/3Config, MixtralConfig and OlmoeConfig default to untied.
  w.flag("untie_embeddings_and_output_weights", !c.flag("tie_word_embeddings", false));
  w.flag("add_bias_linear", false);
  w.flag("qk_layernorm", false);
  w.number("init_method_std", c.number("initializer_range", 0.02));
  w.integer("num_experts", 0);
  if (hf_have_key("add_qkv_bias")) w.flag("add_qkv_bias", false);
  if (hf_have_key("sliding_window")) w.integer("sliding_window", 0);
  if (hf_have_key("qk_layernorm_scope")) w.text("qk_layernorm_scope", "head");
  if (c.has("pretraining_tp") && c.integer("pretraining_tp") != 1) {
    c.refuse("pretraining_tp", "only 1 (the exact linear layers) is implemented");
  }
  if (c.has("clip_qkv")) c.refuse("clip_qkv", "clamping q/k/v is not implemented");
}

// Qwen2 / Qwen3 / Qwen3-MoE may use sliding windows on some layers (use_sliding_window with
// max_window_layers); Primus' window (where present) applies to every layer.
void hf_no_qwen_windows(const HfConfig& c) {
  if (c.flag("use_sliding_window", false)) {
    c.refuse("use_sliding_window", "Qwen's per-layer sliding windows (max_window_layers) are not implemented");
  }
  // transformers 5 lists each layer's attention.
  if (c.has("layer_types")) {
    if (!c.at("layer_types").is_array()) c.refuse("layer_types", "expected a list");
    for (auto& t : c.at("layer_types")) {
      if (t != "full_attention") c.refuse("layer_types", "only full attention in every layer is implemented here");
    }
  }
}

void hf_sliding_window(const HfConfig& c, const std::string& type, HfKeyWriter& w) {
  if (!c.has("sliding_window")) return;  // null: full attention
  if (!hf_have_key("sliding_window")) hf_not_yet(c, type, "sliding-window attention (key sliding_window)");
  w.integer("sliding_window", c.integer("sliding_window"));
}

void hf_moe_common(const HfConfig& c, HfKeyWriter& w) {
  w.integer("moe_router_topk", c.integer("num_experts_per_tok"));
  w.text("moe_router_score_function", "softmax");
  w.number("moe_aux_loss_coeff", c.number("router_aux_loss_coef", 0.0));
  if (c.number("router_jitter_noise", 0.0) != 0.0) {
    c.refuse("router_jitter_noise", "router jitter noise is not implemented");
  }
}

}  // namespace

json read_hf_config(const fs::path& dir) {
  const fs::path file = dir / "config.json";
  if (!fs::is_directory(dir)) throw IoError(fmt::format("Hugging Face model folder '{}' does not exist", dir.string()));
  std::ifstream in(file);
  if (!in) throw IoError(fmt::format("cannot read {} (a Hugging Face model folder has config.json)", file.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    json j = json::parse(ss.str());
    if (!j.is_object()) throw FormatError(fmt::format("{}: not a JSON object", file.string()));
    return j;
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", file.string(), e.what()));
  }
}

config::Value hf_model_keys(const json& j, const fs::path& dir) {
  const fs::path file = dir / "config.json";
  HfConfig c(j, file);
  HfKeyWriter w{config::Value::map({file.string(), 0, 0}), {file.string(), 0, 0}};
  const std::string type = hf_model_type_of(j, file);
  if (type == "gpt2") {
    const int64_t C = c.integer("n_embd");
    w.text("model_type", "gpt2");
    w.integer("vocab_size", c.integer("vocab_size"));
    w.integer("seq_length", c.integer("n_positions"));
    w.integer("num_layers", c.integer("n_layer"));
    w.integer("hidden_size", C);
    w.integer("num_attention_heads", c.integer("n_head"));
    w.integer("num_query_groups", c.integer("n_head"));
    w.integer("kv_channels", C / std::max<int64_t>(1, c.integer("n_head")));
    w.integer("ffn_hidden_size", c.integer("n_inner", 4 * C));
    w.text("normalization", "LayerNorm");
    w.number("norm_epsilon", c.number("layer_norm_epsilon", 1e-5));
    const std::string act = c.text("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      c.refuse("activation_function", "Primus' GELU is the tanh approximation (gelu_new, gelu_pytorch_tanh)");
    }
    w.text("activation", "gelu");
    w.text("position_embedding_type", "learned_absolute");
    w.flag("untie_embeddings_and_output_weights", !c.flag("tie_word_embeddings", true));  // GPT2Config: tied
    w.flag("add_bias_linear", true);
    w.flag("qk_layernorm", false);
    w.number("init_method_std", c.number("initializer_range", 0.02));
    w.integer("num_experts", 0);
    if (hf_have_key("add_qkv_bias")) w.flag("add_qkv_bias", false);
    if (hf_have_key("sliding_window")) w.integer("sliding_window", 0);
    if (hf_have_key("qk_layernorm_scope")) w.text("qk_layernorm_scope", "head");
    if (!c.flag("scale_attn_weights", true)) c.refuse("scale_attn_weights", "attention is always scaled by 1/sqrt(d)");
    if (c.flag("scale_attn_by_inverse_layer_idx", false)) {
      c.refuse("scale_attn_by_inverse_layer_idx", "scaling attention by the layer index is not implemented");
    }
    return w.map;
  }
  if (type == "llama") {
    hf_llama_like(c, type, w);
    const bool ab = c.flag("attention_bias", false), mb = c.flag("mlp_bias", false);
    if (ab != mb) {
      c.refuse(ab ? "attention_bias" : "mlp_bias",
               "Primus' add_bias_linear puts biases on the attention and the MLP together (attention_bias and "
               "mlp_bias must be equal)");
    }
    w.flag("add_bias_linear", ab);
  } else if (type == "mistral") {
    if (!hf_have_model_type("mistral")) hf_not_yet(c, type, "sliding-window attention (key sliding_window)");
    hf_llama_like(c, type, w);
    hf_sliding_window(c, type, w);
  } else if (type == "qwen2") {
    if (!hf_have_model_type("qwen2") || !hf_have_key("add_qkv_bias")) {
      hf_not_yet(c, type, "biases on q, k and v alone (key add_qkv_bias)");
    }
    hf_llama_like(c, type, w);
    hf_no_qwen_windows(c);
    w.flag("add_qkv_bias", true);
  } else if (type == "qwen3" || type == "qwen3_moe" || type == "olmoe") {
    if (type == "olmoe" && (!hf_have_model_type("olmoe") || !hf_have_key("qk_layernorm_scope"))) {
      hf_not_yet(c, type, "query/key norms over the whole projection (key qk_layernorm_scope)");
    }
    hf_llama_like(c, type, w);
    if (c.flag("attention_bias", false)) {
      c.refuse("attention_bias", "biases on q, k, v and o (with query/key norms) are not implemented");
    }
    w.flag("qk_layernorm", true);
    if (type == "olmoe") {
      w.text("qk_layernorm_scope", "projection");
      w.integer("num_experts", c.integer("num_experts"));
      w.integer("moe_ffn_hidden_size", c.integer("intermediate_size"));
      // OlmoeConfig: norm_topk_prob defaults to false (softmax over all experts, top-k kept as is).
      w.flag("moe_router_pre_softmax", !c.flag("norm_topk_prob", false));
      hf_moe_common(c, w);
    } else if (type == "qwen3_moe") {
      hf_no_qwen_windows(c);
      const int64_t L = c.integer("num_hidden_layers"), step = c.integer("decoder_sparse_step", 1);
      if (step < 1) c.refuse("decoder_sparse_step", "must be >= 1");
      std::set<int64_t> dense;
      if (c.has("mlp_only_layers")) {
        if (!c.at("mlp_only_layers").is_array()) c.refuse("mlp_only_layers", "expected a list of layer indices");
        for (auto& x : c.at("mlp_only_layers")) {
          if (!x.is_number_integer()) c.refuse("mlp_only_layers", "expected a list of layer indices");
          dense.insert(x.get<int64_t>());
        }
      }
      // Qwen3MoeDecoderLayer: sparse when not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0.
      std::vector<config::Value> layers;
      for (int64_t l = 0; l < L; ++l) {
        const bool moe = !dense.count(l) && (l + 1) % step == 0;
        layers.push_back(config::Value::integer(moe ? 1 : 0, w.origin));
      }
      w.integer("num_experts", c.integer("num_experts"));
      w.integer("moe_ffn_hidden_size", c.integer("moe_intermediate_size"));
      w.map.set("moe_layer_freq", config::Value::list(std::move(layers), w.origin));
      // Qwen3MoeConfig: norm_topk_prob defaults to false.
      w.flag("moe_router_pre_softmax", !c.flag("norm_topk_prob", false));
      hf_moe_common(c, w);
    } else {
      hf_no_qwen_windows(c);
    }
  } else if (type == "mixtral") {
    hf_llama_like(c, type, w);
    hf_sliding_window(c, type, w);
    w.integer("num_experts", c.integer("num_local_experts"));
    w.integer("moe_ffn_hidden_size", c.integer("intermediate_size"));
    w.flag("moe_router_pre_softmax", false);  // softmax over the chosen experts' logits
    hf_moe_common(c, w);
  } else {
    throw ConfigError(fmt::format("{}: 'model_type' = \"{}\" is not supported (Primus imports gpt2, llama, mistral, "
                                  "qwen2, qwen3, mixtral, qwen3_moe, olmoe)",
                                  file.string(), type));
  }
  return w.map;
}

ModelSpec spec_from_hf_dir(const fs::path& dir, const HfImportOptions& opts) {
  const json j = read_hf_config(dir);
  config::Value p = hf_model_keys(j, dir);
  const config::Origin o{"<primus import hf>", 0, 0};
  p.set("make_vocab_size_divisible_by", config::Value::integer(opts.make_vocab_size_divisible_by, o));
  if (!p.find("seq_length")) {
    HfConfig c(j, dir / "config.json");
    const int64_t mpe = c.integer("max_position_embeddings", kHfRopeSeqCap);
    int64_t T = opts.seq_length > 0 ? opts.seq_length : std::min(mpe, kHfRopeSeqCap);
    if (T > mpe) {
      throw ConfigError(fmt::format("seq_length {} exceeds max_position_embeddings {} of {}", T, mpe,
                                    (dir / "config.json").string()));
    }
    p.set("seq_length", config::Value::integer(T, o));
  } else if (opts.seq_length > 0 && opts.seq_length != p.find("seq_length")->as_int()) {
    throw ConfigError(fmt::format("seq_length {}: a model with learned positions has n_positions = {} ({})",
                                  opts.seq_length, p.find("seq_length")->as_int(), (dir / "config.json").string()));
  }
  hf_model_schema().apply_defaults(p);
  return ModelSpec::from_config(p);
}

// ---- weights ----

namespace {

struct HfTensors {
  std::vector<std::unique_ptr<io::SafetensorsFile>> files;
  std::map<std::string, const io::SafetensorsFile*> where;  // tensor name -> file
  std::string described;                                    // for messages: the file(s) read
};

HfTensors open_hf_tensors(const fs::path& dir) {
  HfTensors h;
  if (fs::exists(dir / kHfSingleFile)) {
    h.files.push_back(std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(dir / kHfSingleFile)));
    for (auto& t : h.files.back()->tensors()) h.where[t.name] = h.files.back().get();
    h.described = (dir / kHfSingleFile).string();
    return h;
  }
  const fs::path index = dir / kHfIndexFile;
  if (!fs::exists(index)) {
    std::string why = fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json")
                          ? " (only safetensors weights are read; pytorch_model.bin found: re-save with "
                            "save_pretrained(..., safe_serialization=True))"
                          : "";
    throw IoError(fmt::format("{}: neither {} nor {} is there{}", dir.string(), kHfSingleFile, kHfIndexFile, why));
  }
  json j;
  {
    std::ifstream in(index);
    std::stringstream ss;
    ss << in.rdbuf();
    try {
      j = json::parse(ss.str());
    } catch (const json::exception& e) {
      throw FormatError(fmt::format("{}: not valid JSON: {}", index.string(), e.what()));
    }
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw FormatError(fmt::format("{}: no \"weight_map\" object", index.string()));
  }
  std::map<std::string, const io::SafetensorsFile*> by_file;
  for (auto& [name, f] : j["weight_map"].items()) {
    if (!f.is_string()) throw FormatError(fmt::format("{}: tensor '{}' maps to {}, not a file name", index.string(), name, f.dump()));
    const std::string fname = f.get<std::string>();
    if (fname.empty() || fname == "." || fname == ".." || fs::path(fname).has_parent_path()) {
      throw FormatError(fmt::format("{}: tensor '{}' maps to '{}', not a file of this folder", index.string(), name, fname));
    }
    auto it = by_file.find(fname);
    if (it == by_file.end()) {
      if (!fs::exists(dir / fname)) {
        throw IoError(fmt::format("{}: tensor '{}' is in shard '{}', which is missing", index.string(), name, fname));
      }
      h.files.push_back(std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(dir / fname)));
      it = by_file.emplace(fname, h.files.back().get()).first;
    }
    if (!it->second->contains(name)) {
      throw FormatError(fmt::format("{}: tensor '{}' is listed in {} but is not in that file", (dir / fname).string(),
                                    name, index.string()));
    }
    h.where[name] = it->second;
  }
  for (auto& [fname, file] : by_file) {
    for (auto& t : file->tensors()) {
      if (!h.where.count(t.name)) {
        throw FormatError(fmt::format("{}: tensor '{}' is not listed in {}", file->source(), t.name, index.string()));
      }
    }
  }
  h.described = fmt::format("{} ({} shards)", index.string(), by_file.size());
  return h;
}

// Buffers some checkpoints carry that transformers does not load as parameters.
bool hf_ignorable(const std::string& name, const ModelSpec& spec) {
  auto ends = [&](const std::string& s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
  if (ends(".rotary_emb.inv_freq")) return true;
  if (spec.model_type == "gpt2" && (ends(".attn.bias") || ends(".attn.masked_bias"))) return true;  // causal masks
  return false;
}

bool hf_floating(io::DType d) {
  return d == io::DType::F32 || d == io::DType::BF16 || d == io::DType::F16 || d == io::DType::F64;
}

}  // namespace

void load_hf_weights(const fs::path& dir, const ModelSpec& spec, const ParamLayout& layout, float* params) {
  HfTensors h = open_hf_tensors(dir);
  std::fill(params, params + layout.total, 0.f);  // padded vocabulary rows stay zero
  std::set<std::string> used;
  // A model saved as its base class (GPT2Model, the hub's original gpt2) has no "transformer." /
  // "model." prefix; transformers accepts both.
  auto lookup = [&](const std::string& name) -> std::pair<std::string, const io::SafetensorsFile*> {
    if (auto it = h.where.find(name); it != h.where.end()) return {name, it->second};
    for (const char* pre : {"transformer.", "model."}) {
      const std::string p = pre;
      if (name.rfind(p, 0) == 0) {
        if (auto it = h.where.find(name.substr(p.size())); it != h.where.end()) return {it->first, it->second};
      }
    }
    return {name, nullptr};
  };
  auto read = [&](const io::SafetensorsFile& f, const std::string& name) {
    const io::TensorInfo& info = f.info(name);
    if (!hf_floating(info.dtype)) {
      throw FormatError(fmt::format("{}: tensor '{}' is {}; model weights must be BF16, F16, F32 or F64", f.source(),
                                    name, io::dtype_name(info.dtype)));
    }
    return f.read_fp32(name);
  };
  for (auto& t : layout.tensors) {
    const bool vocab = t.name == "embedding.weight" || t.name == "output_layer.weight";
    for (auto& part : t.hf) {
      auto [name, file] = lookup(part.name);
      if (!file) {
        throw FormatError(fmt::format("{}: tensor '{}' is missing (the {} model config.json describes needs it)",
                                      h.described, part.name, spec.model_type));
      }
      HfPart p = part;
      if (vocab && spec.vocab_size < spec.padded_vocab_size) p.rows = spec.vocab_size;  // HF has no padding rows
      std::vector<float> data = read(*file, name);
      try {
        from_hf(t, p, data.data(), file->info(name).shape, params);
      } catch (const FormatError& e) {
        throw FormatError(fmt::format("{}: {}", file->source(), e.what()));
      }
      used.insert(name);
    }
  }
  if (!spec.untied) {
    // Tied: transformers drops lm_head.weight on save, but a file may still carry it; it must then
    // be the embedding, or the model would not be the one config.json describes.
    auto [name, file] = lookup("lm_head.weight");
    if (file) {
      const ParamTensor& e = layout.get("embedding.weight");
      std::vector<float> data = read(*file, name);
      const auto& shape = file->info(name).shape;
      const int64_t C = spec.hidden_size;
      const bool same = shape == std::vector<int64_t>{spec.vocab_size, C} &&
                        std::equal(data.begin(), data.end(), params + e.offset);
      if (!same) {
        throw FormatError(fmt::format("{}: tensor 'lm_head.weight' differs from the embedding, but config.json "
                                      "ties them (tie_word_embeddings)",
                                      file->source()));
      }
      used.insert(name);
    }
  }
  for (auto& [name, file] : h.where) {
    if (used.count(name) || hf_ignorable(name, spec)) continue;
    throw FormatError(fmt::format("{}: unexpected tensor '{}': the {} model config.json describes has no such weight "
                                  "({})",
                                  file->source(), name, spec.model_type, spec.summary()));
  }
}

// ---- the training key ----

void add_hf_import_schema(config::Schema& s) {
  s.text("load_hf", std::nullopt,
         "Hugging Face model folder to start from (config.json, safetensors weights, tokenizer.json), or a Hub id "
         "(org/name) found offline in the Hugging Face cache: the model keys come from config.json, the weights "
         "from the folder; fresh optimizer, step 0");
}

fs::path load_hf_dir(const config::Value& params) {
  const config::Value* v = params.find_path("load_hf");
  if (!v || v->is_null() || v->as_string().empty()) return {};
  try {
    return resolve_hf_path(v->as_string(), "config.json", "load_hf");  // a folder, or a Hub id in the cache
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", v->origin().str(), e.what()));
  }
}

namespace {

bool hf_same_value(const config::Value& a, const config::Value& b) {
  using K = config::Value::Kind;
  auto numeric = [](const config::Value& v) { return v.kind() == K::Int || v.kind() == K::Float; };
  if (numeric(a) && numeric(b)) return a.as_double() == b.as_double();
  return a.same_content(b);
}

std::string hf_shown(const config::Value& v) { return v.is_scalar() ? v.scalar_text() : v.to_json().dump(); }
}  // namespace

config::Value resolve_load_hf(const config::Value& params, const fs::path& experiment_file) {
  const fs::path dir = load_hf_dir(params);
  if (dir.empty()) return params;
  const config::Value* lh = params.find_path("load_hf");
  if (const config::Value* l = params.find_path("load"); l && !l->is_null() && !l->as_string().empty()) {
    throw ConfigError(fmt::format("{}: load_hf and load ({}) are both set: load resumes a Primus checkpoint, load_hf "
                                  "starts from Hugging Face weights; keep one",
                                  lh->origin().str(), l->origin().str()));
  }
  const json j = read_hf_config(dir);
  const config::Value keys = hf_model_keys(j, dir);
  config::Value out = params;
  for (auto& [k, v] : keys.entries()) {
    const config::Value* cur = out.find_path(k);
    if (config::set_by_a_layer(cur)) {
      if (hf_soft_key(k) || hf_same_value(*cur, v)) continue;  // the user's training choice, or the same value
      throw ConfigError(fmt::format("{}: {} = {} conflicts with {} ({}), which load_hf ({}) takes the architecture "
                                    "from; remove the key",
                                    cur->origin().str(), k, hf_shown(*cur), (dir / "config.json").string(), hf_shown(v),
                                    lh->origin().str()));
    }
    out.set_path(k, v);
  }
  if (!keys.find("seq_length")) {
    // RoPE families: the context trained on is the user's (default min(schema default,
    // max_position_embeddings)), at most what the model was built for.
    HfConfig c(j, dir / "config.json");
    const int64_t mpe = c.integer("max_position_embeddings", int64_t{1} << 21);
    const config::Value* sl = out.find_path("seq_length");
    if (config::set_by_a_layer(sl)) {
      if (sl->as_int() > mpe) {
        throw ConfigError(fmt::format("{}: seq_length {} exceeds max_position_embeddings {} of {}", sl->origin().str(),
                                      sl->as_int(), mpe, (dir / "config.json").string()));
      }
    } else {
      const int64_t def = sl && !sl->is_null() ? sl->as_int() : 1024;
      out.set_path("seq_length", config::Value::integer(std::min(def, mpe), {(dir / "config.json").string(), 0, 0}));
    }
  }
  const config::Value* tt = out.find_path("tokenizer_type");
  const bool chosen = tt && !tt->is_null() &&
                      (tt->origin().file == experiment_file.string() || tt->origin().file.rfind("<command line", 0) == 0);
  if (!chosen) {
    const fs::path tok = dir / "tokenizer.json";
    if (!fs::exists(tok)) {
      throw ConfigError(fmt::format("{}: {} has no tokenizer.json; set tokenizer_type (gpt2, bytes or a tokenizer.json "
                                    "path)",
                                    lh->origin().str(), dir.string()));
    }
    out.set_path("tokenizer_type", config::Value::string(tok.string(), lh->origin()));
  }
  return out;
}

bool load_initial_weights(const config::Value& params, const CheckpointArgs& ckpt, const ModelSpec& spec,
                          const ParamLayout& layout, float* weights) {
  if (!resume_dir(ckpt).empty()) return false;
  if (ckpt.finetune) {
    const fs::path dir = checkpoint_in(ckpt.load);
    // The standard files, verified; other ranks' optimizer shards are not read.
    const io::CheckpointData data = io::load_checkpoint(dir, /*verify_other_files=*/false);
    unpack_checkpoint(data, dir, spec, layout, weights, nullptr, nullptr, SpecMatch::Weights);
    spdlog::info("[checkpoint] finetune: weights from {} (its step {}); fresh optimizer, step 0", dir.string(),
                 data.manifest.value("iteration", int64_t{0}));
    return true;
  }
  const fs::path dir = load_hf_dir(params);
  if (dir.empty()) return false;
  load_hf_weights(dir, spec, layout, weights);
  spdlog::info("[checkpoint] weights from Hugging Face folder {} ({}); fresh optimizer, step 0", dir.string(),
               spec.summary());
  return true;
}

bool weights_only_checkpoint(const json& state) { return state.is_object() && state.value("weights_only", false); }

// ---- primus import hf ----

namespace {
// Copies `src` into `dst` (fsync'ed), returning its size and CRC-32C for the manifest.
io::FileDigest hf_copy_with_digest(const fs::path& src, const fs::path& dst) {
  std::ifstream in(src, std::ios::binary);
  if (!in) throw IoError(fmt::format("cannot read {}", src.string()));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::FILE* f = std::fopen(dst.c_str(), "wb");
  if (!f) throw IoError(fmt::format("cannot write {}", dst.string()));
  io::DigestWriter w(f, dst.string());
  try {
    w.write(bytes);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  const bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  std::fclose(f);
  if (!ok) throw IoError(fmt::format("cannot write {}", dst.string()));
  return w.digest();
}
}  // namespace

fs::path import_hf_checkpoint(const fs::path& hf_dir, const fs::path& out_dir, const HfImportOptions& opts,
                              const std::string& tokenizer) {
  const ModelSpec spec = spec_from_hf_dir(hf_dir, opts);
  const ParamLayout layout = make_param_layout(spec);
  // The tokenizer before the weights: a folder Primus cannot tokenize for is refused early.
  const fs::path hf_tok = hf_dir / "tokenizer.json";
  const bool copy_tok = tokenizer.empty();
  std::string tok_spec = tokenizer;
  if (copy_tok) {
    if (!fs::exists(hf_tok)) {
      throw IoError(fmt::format("{} has no tokenizer.json; pass --tokenizer (gpt2, bytes or a tokenizer.json path)",
                                hf_dir.string()));
    }
    tok_spec = hf_tok.string();
  }
  std::unique_ptr<data::Tokenizer> tok;
  try {
    tok = data::make_tokenizer(tok_spec);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("{}{}", e.what(),
                                  copy_tok ? " (pass --tokenizer gpt2, bytes or another tokenizer.json to import the "
                                             "weights with another tokenizer)"
                                           : ""));
  }
  if (tok->vocab_size() > spec.vocab_size) {
    throw ConfigError(fmt::format("tokenizer {} has {} tokens, more than the model's vocab_size {} ({})", tok_spec,
                                  tok->vocab_size(), spec.vocab_size, (hf_dir / "config.json").string()));
  }
  std::vector<float> params(static_cast<size_t>(layout.total));
  load_hf_weights(hf_dir, spec, layout, params.data());

  fs::create_directories(out_dir);
  io::SaveOptions so;
  so.metadata = {{"format", "pt"}};
  if (copy_tok) {
    // The copies travel with the checkpoint and trainer_state.json names tokenizer.json relative
    // to it (train::checkpoint_tokenizer resolves it), so the folder can be moved.
    // tokenizer_config.json's eos_token picks the end-of-document token, so it is copied too:
    // the checkpoint then ends documents as the Hugging Face folder does.
    for (const std::string name : {"tokenizer.json", "tokenizer_config.json"}) {
      const fs::path src = hf_dir / name;
      if (name != "tokenizer.json" && !fs::exists(src)) continue;
      const fs::path tmp = out_dir / fmt::format(".{}.tmp-{}", name, ::getpid());
      so.adopt.push_back({name, tmp, hf_copy_with_digest(src, tmp)});
    }
    tok_spec = "tokenizer.json";
  }
  json state = {{"step", 0},
                {"backend", "import"},
                {"tokenizer", tok_spec},
                {"weights_only", true},
                {"imported_from", fs::absolute(hf_dir).string()},
                {"hf_config", read_hf_config(hf_dir)}};
  io::CheckpointData data = pack_checkpoint(spec, layout, params.data(), nullptr, nullptr, std::move(state));
  fs::path dir;
  try {
    dir = io::save_checkpoint(out_dir, 0, data, so);
  } catch (...) {
    std::error_code ec;  // the tokenizer's copy, when the save failed before adopting it
    for (auto& a : so.adopt) fs::remove(a.path, ec);
    throw;
  }
  spdlog::info("imported {} ({}) into {}", hf_dir.string(), spec.summary(), dir.string());
  return dir;
}

}  // namespace primus::train
