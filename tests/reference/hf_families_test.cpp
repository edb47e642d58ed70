// The families of issue [hf] item 2 on the CPU: Qwen2 (q/k/v-only biases), Mistral (sliding
// window) and OLMoE (q/k RMSNorms over the whole projection) exported as Hugging Face folders:
// config.json as transformers' Qwen2Config / MistralConfig / OlmoeConfig read it, every tensor
// named and shaped as their classes expect, values back in place when mapped onto our layout
// again, and the row permutation RoPE needs applied alike to a projection's weight rows, its
// bias and its whole-width norm weight. What transformers computes from the folders is
// bench/hf/gpu_families.sh's job (GPU machine).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>

#include "backends/reference/export.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "io/safetensors.h"
#include "tests/common/tiny_models.h"
#include "train/checkpointing.h"
#include "train/param_layout.h"

using namespace primus;

namespace {

struct Folder {
  std::filesystem::path path;
  explicit Folder(const std::string& name)
      : path(std::filesystem::temp_directory_path() / fmt::format("primus_hf_families_{}_{}", name, ::getpid())) {
    std::filesystem::remove_all(path);
  }
  ~Folder() { std::filesystem::remove_all(path); }
};

struct Exported {
  nlohmann::json config;
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> tensors;
};

// Exports fresh random parameters (every element distinct: a misplaced row shows) in fp32, reads
// the folder back, and checks that mapping it onto our layout gives the parameters bit for bit.
Exported export_and_back(const train::ModelSpec& spec, const std::string& name, std::vector<float>* params_out = nullptr) {
  const train::ParamLayout layout = train::make_param_layout(spec);
  std::vector<float> params(static_cast<size_t>(layout.total));
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(name)));
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& p : params) p = normal(rng);
  for (const char* t : {"embedding.weight", "output_layer.weight"})  // padded rows stay zero (not exported)
    if (const train::ParamTensor* e = layout.find(t))
      std::fill(params.begin() + e->offset + spec.vocab_size * spec.hidden_size, params.begin() + e->offset + e->numel,
                0.f);
  Folder dir(name);
  backends::reference::write_hf_folder(spec, params.data(), 0, dir.path, "fp32");
  Exported out;
  out.config = nlohmann::json::parse(fs::read_file(dir.path / "config.json"));
  auto st = io::SafetensorsFile::open(dir.path / "model.safetensors");
  std::vector<float> back(params.size(), 0.f);
  size_t parts = 0;
  for (const auto& t : layout.tensors) {
    const bool vocab = t.name == "embedding.weight" || t.name == "output_layer.weight";
    for (const auto& part : t.hf) {
      ++parts;
      if (!st.contains(part.name)) {
        ADD_FAILURE() << "missing " << part.name;
        continue;
      }
      std::vector<int64_t> shape = st.info(part.name).shape;
      std::vector<float> v = st.read_fp32(part.name);
      out.tensors[part.name] = {shape, v};
      if (vocab) {
        shape[0] = part.rows;
        v.resize(static_cast<size_t>(part.rows * shape[1]), 0.f);
      }
      train::from_hf(t, part, v.data(), shape, back.data());
    }
  }
  EXPECT_EQ(st.tensors().size(), parts) << "tensors the model does not have";
  size_t differ = 0;
  for (size_t i = 0; i < back.size(); ++i) differ += back[i] != params[i];
  EXPECT_EQ(differ, 0u) << "elements that did not come back";
  if (params_out) *params_out = std::move(params);
  return out;
}

std::string export_error(const train::ModelSpec& m) {
  try {
    train::hf_config_json(m, 0);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Rows of a HF tensor [rows, cols] as vectors.
std::vector<float> hf_row(const Exported& e, const std::string& name, int64_t r) {
  const auto& [shape, v] = e.tensors.at(name);
  const int64_t cols = shape.size() == 2 ? shape[1] : 1;
  return std::vector<float>(v.begin() + r * cols, v.begin() + (r + 1) * cols);
}

// For a 2-D HF weight and a 1-D HF tensor of as many rows (a bias, a whole-width norm weight),
// whether each HF row r of both came from the same row of ours: we write our row i's first
// weight column and the vector's element i equal before export, so they must stay equal after.
void expect_rows_travel_together(const train::ModelSpec& spec, const std::string& ours_w, const std::string& ours_v,
                                 int64_t row0, const std::string& hf_w, const std::string& hf_v,
                                 const std::string& name) {
  const train::ParamLayout layout = train::make_param_layout(spec);
  std::vector<float> params;
  export_and_back(spec, name, &params);
  const train::ParamTensor& w = layout.get(ours_w);
  const train::ParamTensor& v = layout.get(ours_v);
  const int64_t cols = w.shape.back();
  for (int64_t i = 0; i < v.numel; ++i) params[v.offset + i] = params[w.offset + (row0 + i) * cols];
  Folder dir(name + "_rows");
  backends::reference::write_hf_folder(spec, params.data(), 0, dir.path, "fp32");
  auto st = io::SafetensorsFile::open(dir.path / "model.safetensors");
  const std::vector<float> W = st.read_fp32(hf_w), V = st.read_fp32(hf_v);
  const int64_t hf_cols = st.info(hf_w).shape[1];
  ASSERT_EQ(static_cast<int64_t>(V.size()), st.info(hf_w).shape[0]);
  for (size_t r = 0; r < V.size(); ++r) EXPECT_EQ(V[r], W[r * hf_cols]) << hf_v << " row " << r;
}

}  // namespace

TEST(HfFamilies, Qwen2ExportsQkvBiasesOnly) {
  const train::ModelSpec spec = primus::testing::tiny_qwen2();
  const Exported e = export_and_back(spec, "qwen2");
  const nlohmann::json& c = e.config;
  EXPECT_EQ(c["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_EQ(c["model_type"], "qwen2");
  EXPECT_EQ(c["use_sliding_window"], false);
  EXPECT_TRUE(c["sliding_window"].is_null());
  EXPECT_EQ(c["max_window_layers"], spec.num_layers);
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_EQ(c["rope_theta"], spec.rotary_base);
  EXPECT_EQ(c["rms_norm_eps"], spec.norm_epsilon);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["hidden_act"], "silu");
  EXPECT_FALSE(c.contains("attention_bias"));  // Qwen2's q/k/v biases are not a config choice
  EXPECT_EQ(e.tensors.at("model.layers.1.self_attn.q_proj.bias").first, (std::vector<int64_t>{16}));
  EXPECT_EQ(e.tensors.at("model.layers.1.self_attn.k_proj.bias").first, (std::vector<int64_t>{8}));
  EXPECT_EQ(e.tensors.at("model.layers.1.self_attn.v_proj.bias").first, (std::vector<int64_t>{8}));
  for (const auto& [name, t] : e.tensors) {  // no bias on o_proj or the MLP
    const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (bias) EXPECT_NE(name.find("_proj.bias"), std::string::npos) << name;
    EXPECT_EQ(name.find("o_proj.bias"), std::string::npos) << name;
    EXPECT_EQ(name.find("mlp.") != std::string::npos && bias, false) << name;
  }
  // q's and k's bias rows follow their weight rows through RoPE's half-split permutation (v's
  // are not permuted): the fused bias covers all q|k|v rows, so row 0 of ours lines up with each.
  for (const char* part : {"q_proj", "k_proj", "v_proj"}) {
    expect_rows_travel_together(spec, "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias", 0,
                                fmt::format("model.layers.0.self_attn.{}.weight", part),
                                fmt::format("model.layers.0.self_attn.{}.bias", part), fmt::format("qwen2_{}", part));
  }
  train::ModelSpec tied = spec;
  tied.untied = false;
  EXPECT_EQ(export_and_back(tied, "qwen2_tied").config["tie_word_embeddings"], true);
}

TEST(HfFamilies, Qwen2PresetCountsMatchTransformers) {
  // Qwen2.5-0.5B and -1.5B (their config.json): transformers counts 494,032,768 and 1,543,714,304.
  train::ModelSpec m = primus::testing::tiny_qwen2();
  m.vocab_size = m.padded_vocab_size = 151936;
  m.num_layers = 24, m.hidden_size = 896, m.num_attention_heads = 14, m.num_query_groups = 2;
  m.kv_channels = 64, m.ffn_hidden_size = 4864, m.untied = false;
  EXPECT_EQ(m.num_parameters(), 494032768);
  m.num_layers = 28, m.hidden_size = 1536, m.num_attention_heads = 12, m.kv_channels = 128, m.ffn_hidden_size = 8960;
  EXPECT_EQ(m.num_parameters(), 1543714304);
}

// Llama-3.2's rope scaling as transformers' LlamaConfig reads it (rope_scaling with rope_type
// llama3 and the four numbers of _compute_llama3_parameters); none without it.
TEST(HfFamilies, LlamaExportsRopeScaling) {
  train::ModelSpec spec = primus::testing::tiny_llama();
  EXPECT_FALSE(export_and_back(spec, "llama_plain").config.contains("rope_scaling"));
  spec.rope_scaling = {true, 32.0, 1.0, 4.0, 8192.0};
  const nlohmann::json c = export_and_back(spec, "llama3").config;
  EXPECT_EQ(c["architectures"][0], "LlamaForCausalLM");
  const nlohmann::json want = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  EXPECT_EQ(c["rope_scaling"], want) << c.dump();
  EXPECT_TRUE(c["rope_scaling"]["original_max_position_embeddings"].is_number_integer());
}

TEST(HfFamilies, MistralExportsItsWindow) {
  train::ModelSpec spec = primus::testing::tiny_llama();
  spec.model_type = "mistral";
  spec.sliding_window = 3;
  Exported e = export_and_back(spec, "mistral");
  EXPECT_EQ(e.config["architectures"][0], "MistralForCausalLM");
  EXPECT_EQ(e.config["model_type"], "mistral");
  EXPECT_EQ(e.config["sliding_window"], 3);
  EXPECT_EQ(e.config["head_dim"], 4);
  spec.sliding_window = 0;  // full attention: null, as MistralConfig spells it
  EXPECT_TRUE(export_and_back(spec, "mistral_full").config["sliding_window"].is_null());
  spec.bias = true;
  EXPECT_NE(export_error(spec).find("Mistral has no biases"), std::string::npos) << export_error(spec);
}

TEST(HfFamilies, OlmoeExportsWholeProjectionNorms) {
  const train::ModelSpec spec = primus::testing::tiny_olmoe();
  const Exported e = export_and_back(spec, "olmoe");
  const nlohmann::json& c = e.config;
  EXPECT_EQ(c["architectures"][0], "OlmoeForCausalLM");
  EXPECT_EQ(c["model_type"], "olmoe");
  EXPECT_EQ(c["num_experts"], 6);
  EXPECT_EQ(c["num_experts_per_tok"], 2);
  EXPECT_EQ(c["intermediate_size"], 12);  // OlmoeConfig's intermediate_size is an expert's
  EXPECT_EQ(c["norm_topk_prob"], false);
  EXPECT_EQ(c["router_aux_loss_coef"], 0.01);
  EXPECT_TRUE(c["clip_qkv"].is_null());
  EXPECT_FALSE(c.contains("head_dim"));
  // transformers' OlmoeAttention: q_norm = RMSNorm(hidden_size), k_norm = RMSNorm(head_dim x kv heads).
  EXPECT_EQ(e.tensors.at("model.layers.0.self_attn.q_norm.weight").first, (std::vector<int64_t>{16}));
  EXPECT_EQ(e.tensors.at("model.layers.2.self_attn.k_norm.weight").first, (std::vector<int64_t>{8}));
  EXPECT_EQ(e.tensors.at("model.layers.1.mlp.experts.5.down_proj.weight").first, (std::vector<int64_t>{16, 12}));
  EXPECT_EQ(e.tensors.at("model.layers.1.mlp.gate.weight").first, (std::vector<int64_t>{6, 16}));
  // The norm weights' features are permuted per head exactly as q's and k's rows.
  expect_rows_travel_together(spec, "layers.1.attn.qkv.weight", "layers.1.attn.q_norm.weight", 0,
                              "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_norm.weight",
                              "olmoe_q");
  expect_rows_travel_together(spec, "layers.1.attn.qkv.weight", "layers.1.attn.k_norm.weight", spec.q_dim(),
                              "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_norm.weight",
                              "olmoe_k");
}

TEST(HfFamilies, OlmoePresetCountMatchesTransformers) {
  // OLMoE-1B-7B: transformers counts 6,919,161,856 parameters, its q/k norms' 65,536 included.
  train::ModelSpec m = primus::testing::tiny_olmoe();
  m.vocab_size = m.padded_vocab_size = 50304;
  m.num_layers = 16, m.hidden_size = 2048, m.num_attention_heads = m.num_query_groups = 16, m.kv_channels = 128;
  m.ffn_hidden_size = 1024;
  m.moe.num_experts = 64, m.moe.topk = 8, m.moe.ffn_hidden_size = 1024;
  m.moe.moe_layers.assign(16, true);
  EXPECT_EQ(m.num_parameters(), 6919161856);
}

// Refusals name what the transformers class lacks.
TEST(HfFamilies, MismatchedFamiliesAreRefusedWithTheReason) {
  train::ModelSpec qwen2 = primus::testing::tiny_qwen2();
  qwen2.add_qkv_bias = false;
  EXPECT_NE(export_error(qwen2).find("add_qkv_bias: true"), std::string::npos) << export_error(qwen2);
  train::ModelSpec qwen3 = primus::testing::tiny_qwen3();
  qwen3.add_qkv_bias = true;
  EXPECT_NE(export_error(qwen3).find("Qwen3ForCausalLM"), std::string::npos) << export_error(qwen3);
  train::ModelSpec olmoe = primus::testing::tiny_olmoe();
  olmoe.qk_norm_whole = false;
  EXPECT_NE(export_error(olmoe).find("qk_layernorm_scope: projection"), std::string::npos) << export_error(olmoe);
  olmoe = primus::testing::tiny_olmoe();
  olmoe.kv_channels = 6;
  EXPECT_NE(export_error(olmoe).find("kv_channels"), std::string::npos) << export_error(olmoe);
  train::ModelSpec qwen3_moe = primus::testing::tiny_qwen3_moe();
  qwen3_moe.qk_norm_whole = true;
  EXPECT_NE(export_error(qwen3_moe).find("qk_layernorm_scope: head"), std::string::npos) << export_error(qwen3_moe);
  train::ModelSpec dense_whole = primus::testing::tiny_llama();
  dense_whole.qk_layernorm = dense_whole.qk_norm_whole = true;
  EXPECT_NE(export_error(dense_whole).find("qk_layernorm_scope: projection"), std::string::npos)
      << export_error(dense_whole);
  // A llama-typed model with q/k/v-only biases is Qwen2's architecture.
  train::ModelSpec llama = primus::testing::tiny_llama();
  llama.add_qkv_bias = true;
  EXPECT_EQ(nlohmann::json::parse(train::hf_config_json(llama, 0))["architectures"][0], "Qwen2ForCausalLM");
}

// The new fields travel in a checkpoint's model_spec, and only when set (older checkpoints and
// today's Llama ones keep their bytes).
TEST(HfFamilies, SpecJsonCarriesTheNewFields) {
  const train::ModelSpec olmoe = primus::testing::tiny_olmoe(), qwen2 = primus::testing::tiny_qwen2();
  const nlohmann::json jo = train::spec_json(olmoe), jq = train::spec_json(qwen2);
  EXPECT_EQ(jo.at("qk_norm_whole"), true);
  EXPECT_EQ(jq.at("add_qkv_bias"), true);
  EXPECT_TRUE(train::spec_from_json(jo).qk_norm_whole);
  EXPECT_TRUE(train::spec_from_json(jq).add_qkv_bias);
  EXPECT_EQ(train::spec_json(train::spec_from_json(jo)), jo);
  const nlohmann::json jl = train::spec_json(primus::testing::tiny_llama());
  EXPECT_FALSE(jl.contains("qk_norm_whole"));
  EXPECT_FALSE(jl.contains("add_qkv_bias"));
}
