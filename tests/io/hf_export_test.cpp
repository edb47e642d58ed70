#include "io/hf_export.h"

#include <set>

#include "io/safetensors.h"
#include "io_test_util.h"

namespace {

using namespace primus::io;
using nlohmann::json;
using primus::io::testing::read_bytes;

class HfExport : public primus::io::testing::TempDirTest {
 protected:
  std::map<std::string, TensorBlob> make_tensors() {
    std::map<std::string, TensorBlob> t;
    t["model.embed_tokens.weight"] = TensorBlob::from_vector<float>({64, 16}, random_floats(1024));
    t["model.layers.0.self_attn.q_proj.weight"] = TensorBlob::from_vector<float>({16, 16}, random_floats(256));
    t["model.norm.weight"] = TensorBlob::from_vector<float>({16}, random_floats(16));
    t["lm_head.weight"] = TensorBlob::from_vector<float>({64, 16}, random_floats(1024));
    t["model.position_ids"] = TensorBlob::from_vector<int64_t>({1, 8}, {0, 1, 2, 3, 4, 5, 6, 7});
    return t;
  }
  json config() const {
    return {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", 16},
            {"bos_token_id", 1}, {"eos_token_id", 2}};
  }
};

TEST_F(HfExport, Bf16SingleFileWithConfigs) {
  auto tensors = make_tensors();
  export_hf(dir(), config(), tensors);  // default: BF16, one file
  auto f = SafetensorsFile::open(dir() / "model.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");  // transformers refuses files without it
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (const auto& [name, blob] : tensors) {
    const auto& info = f.info(name);
    EXPECT_EQ(info.shape, blob.shape()) << name;
    if (blob.dtype() == DType::I64) {
      EXPECT_EQ(info.dtype, DType::I64);
      EXPECT_EQ(f.read_as<int64_t>(name), blob.to_vector<int64_t>());
      continue;
    }
    ASSERT_EQ(info.dtype, DType::BF16) << name;
    auto got = f.read_as<uint16_t>(name);
    auto src = blob.to_vector<float>();
    for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(got[i], fp32_to_bf16(src[i])) << name << i;
  }
  json cfg = json::parse(read_bytes(dir() / "config.json"));
  json want = config();
  want["torch_dtype"] = "bfloat16";
  EXPECT_EQ(cfg, want);
  json gen = json::parse(read_bytes(dir() / "generation_config.json"));
  EXPECT_EQ(gen["bos_token_id"], 1);
  EXPECT_EQ(gen["eos_token_id"], 2);
  EXPECT_FALSE(gen.contains("pad_token_id"));
}

TEST_F(HfExport, Fp32KeepsBytesAndGivenGenerationConfig) {
  auto tensors = make_tensors();
  HfExportOptions opts;
  opts.dtype = DType::F32;
  opts.generation_config = {{"do_sample", true}, {"temperature", 0.8}};
  json cfg = config();
  cfg["torch_dtype"] = "float32";
  export_hf(dir(), cfg, tensors, opts);
  auto f = SafetensorsFile::open(dir() / "model.safetensors");
  for (const auto& [name, blob] : tensors) {
    auto d = f.data(name);
    ASSERT_EQ(d.size(), blob.nbytes());
    EXPECT_EQ(std::memcmp(d.data(), blob.data(), d.size()), 0) << name;
  }
  EXPECT_EQ(json::parse(read_bytes(dir() / "generation_config.json")), opts.generation_config);
}

TEST_F(HfExport, ShardsWithIndexAndRemovesStaleLayout) {
  auto tensors = make_tensors();
  export_hf(dir(), config(), tensors);  // a single file first
  HfExportOptions opts;
  opts.max_shard_bytes = 2100;  // the two 64x16 bf16 tensors (2048 bytes) cannot share a shard
  export_hf(dir(), config(), tensors, opts);
  EXPECT_FALSE(std::filesystem::exists(dir() / "model.safetensors")) << "stale single file kept";
  json index = json::parse(read_bytes(dir() / "model.safetensors.index.json"));
  uint64_t total = 0;
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    auto f = SafetensorsFile::open(dir() / file.get<std::string>());
    EXPECT_TRUE(f.contains(name)) << name << " not in " << file;
    total += f.info(name).nbytes;
    files.insert(file.get<std::string>());
  }
  EXPECT_EQ(index["weight_map"].size(), tensors.size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_GE(files.size(), 3u);
  for (const auto& f : files) {
    EXPECT_TRUE(f.starts_with("model-0000")) << f;
    EXPECT_LE(std::filesystem::file_size(dir() / f), 2100u + 1024) << f;  // plus the header
  }
  export_hf(dir(), config(), tensors);  // back to one file: the shards and index go
  for (const auto& f : files) EXPECT_FALSE(std::filesystem::exists(dir() / f)) << f;
  EXPECT_FALSE(std::filesystem::exists(dir() / "model.safetensors.index.json"));
  EXPECT_TRUE(std::filesystem::exists(dir() / "model.safetensors"));
}

TEST_F(HfExport, RefusesUnsupportedDtype) {
  HfExportOptions opts;
  opts.dtype = DType::F16;
  EXPECT_THROW(export_hf(dir(), config(), make_tensors(), opts), primus::ConfigError);
}

}  // namespace

namespace {

// Leaves a tiny, complete Llama export (and a Primus checkpoint of the same weights) in the
// build folder, for tests/io/hf_check.py to load with safetensors and transformers on a machine
// that has them.
TEST_F(HfExport, WritesSampleForTransformersCheck) {
  const int64_t vocab = 64, hidden = 16, inter = 32;
  std::map<std::string, TensorBlob> t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    auto v = random_floats(n);
    for (auto& x : v) x *= 0.05f;
    t[name] = TensorBlob::from_vector<float>(std::move(shape), std::move(v));
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  add("model.layers.0.input_layernorm.weight", {hidden});
  add("model.layers.0.post_attention_layernorm.weight", {hidden});
  for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    add(std::string("model.layers.0.self_attn.") + p + ".weight", {hidden, hidden});
  }
  add("model.layers.0.mlp.gate_proj.weight", {inter, hidden});
  add("model.layers.0.mlp.up_proj.weight", {inter, hidden});
  add("model.layers.0.mlp.down_proj.weight", {hidden, inter});
  add("model.norm.weight", {hidden});
  add("lm_head.weight", {vocab, hidden});
  json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
              {"vocab_size", vocab}, {"hidden_size", hidden}, {"intermediate_size", inter},
              {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 2},
              {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5},
              {"tie_word_embeddings", false}, {"bos_token_id", 1}, {"eos_token_id", 2}};

  auto out = std::filesystem::path(PRIMUS_BINARY_DIR) / "tests" / "io" / "hf_sample";
  std::filesystem::remove_all(out);
  HfExportOptions f32;
  f32.dtype = DType::F32;
  export_hf(out / "f32", cfg, t, f32);
  export_hf(out / "bf16", cfg, t);
  HfExportOptions sharded;
  sharded.max_shard_bytes = 4096;
  export_hf(out / "bf16_sharded", cfg, t, sharded);
  auto back = SafetensorsFile::open(out / "f32" / "model.safetensors");
  EXPECT_EQ(back.names().size(), t.size());
  EXPECT_EQ(back.read_as<float>("lm_head.weight"), t.at("lm_head.weight").to_vector<float>());
}

}  // namespace
