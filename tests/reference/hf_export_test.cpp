// `primus export hf` for the Qwen3 families on the CPU: a tiny Qwen3 and a tiny Qwen3-MoE are
// written as Hugging Face folders, read back from the safetensors file and mapped onto our
// layout again: every tensor named and shaped as transformers' Qwen3ForCausalLM /
// Qwen3MoeForCausalLM expect, nothing extra, and every value back in place. What transformers
// itself computes from the folder is tests/reference/qwen3_hf_parity.py's job (GPU machine).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "backends/reference/export.h"
#include "backends/reference/model.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "io/safetensors.h"
#include "tests/common/tiny_models.h"
#include "train/param_layout.h"

using namespace primus;
using primus::backends::reference::GptModel;

namespace {

struct ExportDir {
  std::filesystem::path path;
  explicit ExportDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / fmt::format("primus_hf_export_{}_{}", name, ::getpid())) {
    std::filesystem::remove_all(path);
  }
  ~ExportDir() { std::filesystem::remove_all(path); }
};

// Writes `spec`'s initialised weights (norm weights jittered so a misplaced norm shows) and
// reads them back; returns the config.
nlohmann::json round_trip(const train::ModelSpec& spec, const std::string& name) {
  GptModel<float> model(spec, 1, spec.seq_length);
  model.init_weights(17);
  std::mt19937 rng(3);
  std::normal_distribution<float> jitter(0.f, 0.3f);
  for (const auto& t : model.layout().tensors)
    if (t.name.find("norm") != std::string::npos)
      for (int64_t i = 0; i < t.numel; ++i) model.params[t.offset + i] += jitter(rng);
  ExportDir dir(name);
  backends::reference::write_hf_folder(spec, model.params.data(), 0, dir.path, "fp32");
  auto st = io::SafetensorsFile::open(dir.path / "model.safetensors");
  std::vector<float> back(model.params.size(), 0.f);
  size_t parts = 0;
  for (const auto& t : model.layout().tensors) {
    const bool vocab = t.name == "embedding.weight" || t.name == "output_layer.weight";
    for (const auto& part : t.hf) {
      ++parts;
      EXPECT_TRUE(st.contains(part.name)) << part.name;
      if (!st.contains(part.name)) continue;
      std::vector<int64_t> shape = st.info(part.name).shape;
      std::vector<float> v = st.read_fp32(part.name);
      if (vocab) {  // trimmed to the real vocabulary: pad it back for from_hf
        EXPECT_EQ(shape[0], spec.vocab_size) << part.name;
        shape[0] = part.rows;
        v.resize(static_cast<size_t>(part.rows * shape[1]), 0.f);
      }
      train::from_hf(t, part, v.data(), shape, back.data());
    }
  }
  EXPECT_EQ(st.tensors().size(), parts);  // nothing the model does not have
  size_t differ = 0;
  for (size_t i = 0; i < back.size(); ++i) differ += back[i] != model.params[i];
  EXPECT_EQ(differ, 0u) << "elements that did not come back";
  return nlohmann::json::parse(fs::read_file(dir.path / "config.json"));
}

std::vector<int64_t> shape_in(const train::ModelSpec& spec, const std::string& name, const std::string& hf) {
  GptModel<float> model(spec, 1, spec.seq_length);
  ExportDir dir(name);
  backends::reference::write_hf_folder(spec, model.params.data(), 0, dir.path, "fp32");
  return io::SafetensorsFile::open(dir.path / "model.safetensors").info(hf).shape;
}

}  // namespace

TEST(HfExport, Qwen3RoundTripsThroughSafetensors) {
  const train::ModelSpec spec = primus::testing::tiny_qwen3();
  nlohmann::json cfg = round_trip(spec, "qwen3");
  EXPECT_EQ(cfg["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(cfg["model_type"], "qwen3");
  EXPECT_EQ(cfg["head_dim"], 6);
  EXPECT_EQ(cfg["hidden_size"], 16);
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
  EXPECT_EQ(cfg["attention_bias"], false);
  EXPECT_EQ(cfg["vocab_size"], 29);
  // Qwen3's shapes: q_proj heads x head_dim = 24 rows, o_proj back to the width, one norm
  // weight of head_dim for all heads.
  EXPECT_EQ(shape_in(spec, "qwen3s", "model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{24, 16}));
  EXPECT_EQ(shape_in(spec, "qwen3s", "model.layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(shape_in(spec, "qwen3s", "model.layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(shape_in(spec, "qwen3s", "model.layers.0.self_attn.q_norm.weight"), (std::vector<int64_t>{6}));
  EXPECT_EQ(shape_in(spec, "qwen3s", "model.layers.0.self_attn.k_norm.weight"), (std::vector<int64_t>{6}));
}

TEST(HfExport, Qwen3MoeRoundTripsThroughSafetensors) {
  train::ModelSpec spec = primus::testing::tiny_qwen3_moe();
  nlohmann::json cfg = round_trip(spec, "qwen3moe");
  EXPECT_EQ(cfg["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(cfg["num_experts"], 6);
  EXPECT_EQ(cfg["num_experts_per_tok"], 2);
  EXPECT_EQ(cfg["moe_intermediate_size"], 12);
  EXPECT_EQ(cfg["norm_topk_prob"], true);
  EXPECT_EQ(cfg["decoder_sparse_step"], 1);
  EXPECT_EQ(cfg["mlp_only_layers"], nlohmann::json::array());
  EXPECT_EQ(cfg["head_dim"], 6);
  EXPECT_EQ(shape_in(spec, "qwen3moes", "model.layers.2.mlp.experts.5.down_proj.weight"), (std::vector<int64_t>{16, 12}));
  EXPECT_EQ(shape_in(spec, "qwen3moes", "model.layers.2.mlp.gate.weight"), (std::vector<int64_t>{6, 16}));
  // A dense first layer is one of Qwen3-MoE's mlp_only_layers (an MLP of intermediate_size);
  // OLMoE's pre-softmax router is Qwen3-MoE's norm_topk_prob: false.
  spec.moe.moe_layers = {false, true, true};
  spec.moe.pre_softmax = true;
  cfg = round_trip(spec, "qwen3moe_dense0");
  EXPECT_EQ(cfg["mlp_only_layers"], nlohmann::json::array({0}));
  EXPECT_EQ(cfg["intermediate_size"], spec.ffn_hidden_size);
  EXPECT_EQ(cfg["norm_topk_prob"], false);
}

// What transformers has no class for is refused before anything is written, with the reason.
TEST(HfExport, FamiliesWithoutAHfClassAreRefused) {
  auto error_of = [](const train::ModelSpec& m) {
    try {
      train::hf_config_json(m, 0);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  train::ModelSpec olmoe = primus::testing::tiny_qwen3_moe();  // per-head norms: OLMoE's span the projection
  olmoe.model_type = "olmoe";
  EXPECT_NE(error_of(olmoe).find("qk_layernorm_scope: projection"), std::string::npos) << error_of(olmoe);
  train::ModelSpec mixtral = primus::testing::tiny_qwen3_moe();
  mixtral.model_type = "mixtral";
  EXPECT_NE(error_of(mixtral).find("Mixtral has no query/key norms"), std::string::npos) << error_of(mixtral);
  mixtral.qk_layernorm = false;  // kv_channels alone is fine: Mixtral's config has head_dim
  EXPECT_EQ(error_of(mixtral), "");
  train::ModelSpec no_norm = primus::testing::tiny_qwen3_moe();
  no_norm.qk_layernorm = false;
  EXPECT_NE(error_of(no_norm).find("qk_layernorm: true"), std::string::npos) << error_of(no_norm);
  train::ModelSpec shared = primus::testing::tiny_qwen3_moe();
  shared.moe.shared_ffn_hidden_size = 8;
  EXPECT_NE(error_of(shared).find("shared expert"), std::string::npos);
  train::ModelSpec gpt2 = primus::testing::tiny_gpt2();
  gpt2.kv_channels = 8;
  EXPECT_NE(error_of(gpt2).find("kv_channels"), std::string::npos);
  // Without the norms a kv_channels model is Llama (LlamaConfig has head_dim).
  train::ModelSpec llama = primus::testing::tiny_qwen3();
  llama.qk_layernorm = false;
  EXPECT_EQ(nlohmann::json::parse(train::hf_config_json(llama, 0))["architectures"][0], "LlamaForCausalLM");
  ExportDir dir("refused");
  GptModel<float> model(olmoe, 1, 8);
  EXPECT_THROW(backends::reference::write_hf_folder(olmoe, model.params.data(), 0, dir.path, "fp32"), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(dir.path / "model.safetensors"));
}
