// Importing Hugging Face folders (train/hf_import.h): every family `export hf` writes comes back
// bit for bit (fp32), bf16 folders give the bf16-rounded values, sharded folders and fp16
// tensors read the same, padded vocabulary rows are zero, tied heads stay tied; config.json gives
// the model spec; broken folders are refused naming the tensor, the file or the config key; the
// `load_hf` key resolves the model keys (a conflicting user key is an error). What transformers
// computes from such a folder is bench/hf/gpu_import.sh's job on the GPU machine.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "backends/reference/export.h"
#include "core/util/error.h"
#include "io/checkpoint.h"
#include "io/dtype.h"
#include "io/hf_export.h"
#include "io/safetensors.h"
#include "tests/common/tiny_models.h"
#include "train/checkpointing.h"
#include "train/data_setup.h"
#include "train/hf_import.h"
#include "train/param_layout.h"
#include "train/training_args.h"

// No using-directives at namespace scope: the tests are compiled as one unity source.
namespace primus::hf_import_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Dir {
  fs::path path;
  explicit Dir(const std::string& name)
      : path(fs::temp_directory_path() / fmt::format("primus_hf_import_{}_{}", name, ::getpid())) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
};

// Fresh random weights (a new seed per call), padded vocabulary rows zero as training keeps them.
std::vector<float> random_params(const train::ModelSpec& spec, const train::ParamLayout& layout) {
  static std::mt19937 seeds(std::random_device{}());
  std::mt19937 rng(seeds());
  std::normal_distribution<float> n(0.f, 0.5f);
  std::vector<float> p(static_cast<size_t>(layout.total));
  for (auto& x : p) x = n(rng);
  for (const char* name : {"embedding.weight", "output_layer.weight"}) {
    if (const train::ParamTensor* t = layout.find(name)) {
      std::fill(p.begin() + t->offset + spec.vocab_size * spec.hidden_size, p.begin() + t->offset + t->numel, 0.f);
    }
  }
  return p;
}

train::HfImportOptions options_for(const train::ModelSpec& s) {
  train::HfImportOptions o;
  o.seq_length = s.rope ? s.seq_length : 0;
  o.make_vocab_size_divisible_by = s.padded_vocab_size;  // vocab 29 -> 32 as the tiny models pad
  return o;
}

// Every family this build exports, tiny and with its distinguishing features.
std::vector<train::ModelSpec> families() {
  std::vector<train::ModelSpec> v;
  v.push_back(testing::tiny_gpt2());
  train::ModelSpec gpt2_untied = testing::tiny_gpt2();
  gpt2_untied.untied = true;
  v.push_back(gpt2_untied);
  v.push_back(testing::tiny_llama());
  train::ModelSpec llama_tied = testing::tiny_llama();
  llama_tied.untied = false;
  v.push_back(llama_tied);
  v.push_back(testing::tiny_qwen3());
  v.push_back(testing::tiny_qwen2());
  train::ModelSpec llama3 = testing::tiny_llama();  // Llama-3.1/3.2's rope_scaling
  llama3.rope_scaling = {true, 32.0, 1.0, 4.0, 8192.0};
  v.push_back(llama3);
  train::ModelSpec mistral = testing::tiny_llama();
  mistral.model_type = "mistral";
  mistral.sliding_window = 4;
  v.push_back(mistral);
  train::ModelSpec mixtral = testing::tiny_moe();
  mixtral.moe.moe_layers = {true, true, true};
  v.push_back(mixtral);
  v.push_back(testing::tiny_qwen3_moe());
  train::ModelSpec qwen3_moe_dense_first = testing::tiny_qwen3_moe();
  qwen3_moe_dense_first.moe.moe_layers = {false, true, true};
  qwen3_moe_dense_first.moe.pre_softmax = true;  // norm_topk_prob false
  v.push_back(qwen3_moe_dense_first);
  v.push_back(testing::tiny_olmoe());
  for (auto& s : v) {
    s.moe.z_loss_coeff = 0;  // a training choice config.json does not carry
    // With every layer MoE no dense MLP exists; config.json has only the experts' width.
    if (s.moe.enabled() && s.num_moe_layers() == s.num_layers) s.ffn_hidden_size = s.moe.ffn_hidden_size;
  }
  return v;
}

std::string name_of(const train::ModelSpec& s) {
  return fmt::format("{}{}", s.model_type, s.untied ? "_untied" : "_tied");
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}
void write_json(const fs::path& p, const json& j) { std::ofstream(p) << j.dump(2); }

// Rewrites dir/model.safetensors through `edit` (names -> blobs).
void rewrite_weights(const fs::path& dir, const std::function<void(std::map<std::string, io::TensorBlob>&)>& edit) {
  std::map<std::string, io::TensorBlob> t;
  {
    auto f = io::SafetensorsFile::open(dir / "model.safetensors");
    for (auto& info : f.tensors()) {
      auto v = f.read_fp32(info.name);
      t.emplace(info.name, io::TensorBlob::from_vector(info.shape, std::move(v)));
    }
  }
  edit(t);
  io::SafetensorsWriter w;
  for (auto& [n, b] : t) w.add(n, b);
  w.set_metadata("format", "pt");
  w.write(dir / "model.safetensors");
}

TEST(HfImport, ExportThenImportIsBitIdenticalForEveryFamily) {
  for (const train::ModelSpec& spec : families()) {
    SCOPED_TRACE(name_of(spec));
    Dir d(name_of(spec));
    const train::ParamLayout layout = train::make_param_layout(spec);
    const std::vector<float> params = random_params(spec, layout);
    backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
    const train::ModelSpec got = train::spec_from_hf_dir(d.path, options_for(spec));
    EXPECT_EQ(train::spec_json(got), train::spec_json(spec));
    std::vector<float> back(params.size(), 123.f);
    train::load_hf_weights(d.path, got, train::make_param_layout(got), back.data());
    ASSERT_EQ(back.size(), params.size());
    EXPECT_EQ(std::memcmp(back.data(), params.data(), sizeof(float) * params.size()), 0);
  }
}

TEST(HfImport, Bf16FolderGivesTheRoundedValues) {
  for (const train::ModelSpec& spec : {testing::tiny_gpt2(), testing::tiny_qwen3()}) {
    Dir d("bf16_" + spec.model_type);
    const train::ParamLayout layout = train::make_param_layout(spec);
    const std::vector<float> params = random_params(spec, layout);
    backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "bf16");
    std::vector<float> back(params.size());
    train::load_hf_weights(d.path, spec, layout, back.data());
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(back[i], io::bf16_to_fp32(io::fp32_to_bf16(params[i]))) << spec.model_type << " element " << i;
    }
  }
}

TEST(HfImport, ShardedFolderAndFp16Tensors) {
  const train::ModelSpec spec = testing::tiny_qwen3_moe();
  const train::ParamLayout layout = train::make_param_layout(spec);
  const std::vector<float> params = random_params(spec, layout);
  Dir d("sharded");
  io::HfExportOptions o;
  o.dtype = io::DType::F32;
  o.max_shard_bytes = 4096;  // many shards
  io::export_hf(d.path, json::parse(train::hf_config_json(spec, 7)),
                backends::reference::hf_state_dict(spec, layout, params.data()), o);
  ASSERT_FALSE(fs::exists(d.path / "model.safetensors"));
  ASSERT_TRUE(fs::exists(d.path / "model.safetensors.index.json"));
  std::vector<float> back(params.size());
  train::load_hf_weights(d.path, spec, layout, back.data());
  EXPECT_EQ(std::memcmp(back.data(), params.data(), sizeof(float) * params.size()), 0);

  // The same weights as F16 in one file: each value is fp16's.
  const train::ModelSpec small = testing::tiny_llama();
  const train::ParamLayout sl = train::make_param_layout(small);
  std::vector<float> sp = random_params(small, sl);
  Dir h("fp16");
  backends::reference::write_hf_folder(small, sp.data(), 7, h.path, "fp32");
  std::map<std::string, std::vector<float>> want;
  rewrite_weights(h.path, [&](std::map<std::string, io::TensorBlob>& t) {
    for (auto& [n, b] : t) {
      auto v = b.to_vector<float>();
      std::vector<uint16_t> half(v.size());
      std::vector<float> exact(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        // The compiler's fp16 (round to nearest even) is the file's value; reading widens it exactly.
        const _Float16 x = static_cast<_Float16>(v[i]);
        std::memcpy(&half[i], &x, 2);
        exact[i] = static_cast<float>(x);
      }
      want[n] = exact;
      b = io::TensorBlob::copy_of(io::DType::F16, b.shape(), half.data(), half.size() * 2);
    }
  });
  std::vector<float> got(sp.size());
  train::load_hf_weights(h.path, small, sl, got.data());
  for (auto& t : sl.tensors) {
    for (auto& part : t.hf) {
      std::vector<float> ours;
      auto shape = train::to_hf(t, part, got.data(), ours, t.name == "embedding.weight" || t.name == "output_layer.weight"
                                                               ? small.vocab_size
                                                               : 0);
      ASSERT_EQ(ours, want.at(part.name)) << part.name;
    }
  }
}

TEST(HfImport, VocabularyPaddingRowsAreZero) {
  train::ModelSpec spec = testing::tiny_llama(29, 29);
  const train::ParamLayout layout = train::make_param_layout(spec);
  const std::vector<float> params = random_params(spec, layout);
  Dir d("pad");
  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  train::HfImportOptions o;
  o.seq_length = spec.seq_length;
  o.make_vocab_size_divisible_by = 64;
  const train::ModelSpec padded = train::spec_from_hf_dir(d.path, o);
  ASSERT_EQ(padded.padded_vocab_size, 64);
  const train::ParamLayout pl = train::make_param_layout(padded);
  std::vector<float> back(static_cast<size_t>(pl.total), 5.f);
  train::load_hf_weights(d.path, padded, pl, back.data());
  const int64_t C = spec.hidden_size;
  for (const char* n : {"embedding.weight", "output_layer.weight"}) {
    const auto& a = layout.get(n);
    const auto& b = pl.get(n);
    for (int64_t i = 0; i < 29 * C; ++i) ASSERT_EQ(back[b.offset + i], params[a.offset + i]) << n;
    for (int64_t i = 29 * C; i < 64 * C; ++i) ASSERT_EQ(back[b.offset + i], 0.f) << n << " padded row";
  }
  EXPECT_EQ(back[pl.get("final_norm.weight").offset], params[layout.get("final_norm.weight").offset]);
}

TEST(HfImport, TiedHeadInTheFileMustEqualTheEmbedding) {
  const train::ModelSpec spec = testing::tiny_gpt2();
  const train::ParamLayout layout = train::make_param_layout(spec);
  const std::vector<float> params = random_params(spec, layout);
  Dir d("tied");
  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  rewrite_weights(d.path, [](auto& t) { t.emplace("lm_head.weight", t.at("transformer.wte.weight")); });
  std::vector<float> back(params.size());
  train::load_hf_weights(d.path, spec, layout, back.data());  // equal: accepted
  EXPECT_EQ(back, params);
  rewrite_weights(d.path, [](auto& t) {
    auto v = t.at("lm_head.weight").template to_vector<float>();
    v[3] += 1;
    t["lm_head.weight"] = io::TensorBlob::from_vector(t.at("lm_head.weight").shape(), std::move(v));
  });
  const std::string e = error_of([&] { train::load_hf_weights(d.path, spec, layout, back.data()); });
  EXPECT_NE(e.find("lm_head.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("tie_word_embeddings"), std::string::npos) << e;
}

TEST(HfImport, Gpt2SavedAsBaseModelAndBuffersTransformersSkips) {
  const train::ModelSpec spec = testing::tiny_gpt2();
  const train::ParamLayout layout = train::make_param_layout(spec);
  const std::vector<float> params = random_params(spec, layout);
  Dir d("base");
  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  rewrite_weights(d.path, [](std::map<std::string, io::TensorBlob>& t) {
    std::map<std::string, io::TensorBlob> out;
    for (auto& [n, b] : t) out.emplace(n.substr(std::string("transformer.").size()), b);  // the hub's gpt2 names
    out.emplace("h.0.attn.bias", io::TensorBlob::from_vector<float>({1, 1, 8, 8}, std::vector<float>(64, 1.f)));
    t = std::move(out);
  });
  std::vector<float> back(params.size());
  train::load_hf_weights(d.path, spec, layout, back.data());
  EXPECT_EQ(back, params);
}

class HfImportErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    spec = testing::tiny_llama();
    layout = train::make_param_layout(spec);
    params = random_params(spec, layout);
    backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  }
  std::string load_error() {
    std::vector<float> back(params.size());
    return error_of([&] { train::load_hf_weights(d.path, spec, layout, back.data()); });
  }
  std::string spec_error() {
    return error_of([&] { (void)train::spec_from_hf_dir(d.path, options_for(spec)); });
  }
  void edit_config(const std::function<void(json&)>& f) {
    json c = read_json(d.path / "config.json");
    f(c);
    write_json(d.path / "config.json", c);
  }
  Dir d{"errors"};
  train::ModelSpec spec;
  train::ParamLayout layout;
  std::vector<float> params;
};

TEST_F(HfImportErrors, MissingUnexpectedMisshapenAndNonFloatTensors) {
  const std::string file = (d.path / "model.safetensors").string();
  rewrite_weights(d.path, [](auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
  std::string e = load_error();
  EXPECT_NE(e.find("'model.layers.1.mlp.up_proj.weight' is missing"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;

  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  rewrite_weights(d.path, [](auto& t) {
    t.emplace("model.layers.0.self_attn.o_proj.bias", io::TensorBlob::from_vector<float>({16}, std::vector<float>(16)));
  });
  e = load_error();
  EXPECT_NE(e.find("unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;

  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  rewrite_weights(d.path, [](auto& t) {
    t["model.layers.0.self_attn.k_proj.weight"] = io::TensorBlob::from_vector<float>({8, 15}, std::vector<float>(120));
  });
  e = load_error();
  EXPECT_NE(e.find("'model.layers.0.self_attn.k_proj.weight' has shape [8, 15]"), std::string::npos) << e;
  EXPECT_NE(e.find("[8, 16]"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;

  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  rewrite_weights(d.path, [](auto& t) {
    t["model.norm.weight"] = io::TensorBlob::from_vector<int32_t>({16}, std::vector<int32_t>(16));
  });
  e = load_error();
  EXPECT_NE(e.find("'model.norm.weight' is I32"), std::string::npos) << e;

  // A truncated file.
  backends::reference::write_hf_folder(spec, params.data(), 7, d.path, "fp32");
  fs::resize_file(d.path / "model.safetensors", fs::file_size(d.path / "model.safetensors") / 2);
  e = load_error();
  EXPECT_NE(e.find(file), std::string::npos) << e;
}

TEST_F(HfImportErrors, BrokenShardsAndMissingFiles) {
  io::HfExportOptions o;
  o.dtype = io::DType::F32;
  o.max_shard_bytes = 2048;
  io::export_hf(d.path, json::parse(train::hf_config_json(spec, 7)),
                backends::reference::hf_state_dict(spec, layout, params.data()), o);
  json index = read_json(d.path / "model.safetensors.index.json");
  const std::string shard = index["weight_map"]["model.norm.weight"];
  // A tensor the index puts in the wrong shard.
  json bad = index;
  bad["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"];
  if (bad["weight_map"]["model.norm.weight"] != shard) {
    write_json(d.path / "model.safetensors.index.json", bad);
    std::string e = load_error();
    EXPECT_NE(e.find("'model.norm.weight' is listed in"), std::string::npos) << e;
  }
  // A shard missing.
  write_json(d.path / "model.safetensors.index.json", index);
  fs::rename(d.path / shard, d.path / (shard + ".moved"));
  std::string e = load_error();
  EXPECT_NE(e.find(shard + "', which is missing"), std::string::npos) << e;
  // No weights at all.
  fs::remove(d.path / "model.safetensors.index.json");
  e = load_error();
  EXPECT_NE(e.find("neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << e;
  // No config.json.
  fs::remove(d.path / "config.json");
  e = spec_error();
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
}

TEST_F(HfImportErrors, ConfigKeysWeDoNotImplementAreNamed) {
  const json orig = read_json(d.path / "config.json");
  auto expect = [&](const std::function<void(json&)>& f, const std::string& key) {
    write_json(d.path / "config.json", orig);
    edit_config(f);
    const std::string e = spec_error();
    EXPECT_NE(e.find("'" + key + "'"), std::string::npos) << key << ": " << e;
    EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  };
  // llama3 without its other three numbers (transformers requires them), and other rope types.
  expect([](json& c) { c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}}; }, "rope_scaling");
  expect([](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }, "rope_scaling");
  expect([](json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; }, "rope_scaling");
  expect([](json& c) {
    c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 4.0},
                         {"high_freq_factor", 1.0}, {"original_max_position_embeddings", 8192}};
  }, "rope_scaling");
  expect([](json& c) { c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}}; }, "rope_parameters");
  expect([](json& c) { c["hidden_act"] = "gelu"; }, "hidden_act");
  expect([](json& c) { c["attention_bias"] = true; }, "attention_bias");
  expect([](json& c) { c["model_type"] = "phi3"; }, "model_type");
  expect([](json& c) { c.erase("num_hidden_layers"); }, "num_hidden_layers");
  expect([](json& c) {
    c["model_type"] = "qwen2";
    c["use_sliding_window"] = true;
  }, "use_sliding_window");
  expect([](json& c) {
    c["model_type"] = "qwen3";
    c["layer_types"] = {"full_attention", "sliding_attention"};
  }, "layer_types");
  // transformers 5's rope_parameters with the plain rotation is read.
  write_json(d.path / "config.json", orig);
  edit_config([](json& c) {
    c.erase("rope_theta");
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  });
  EXPECT_EQ(train::spec_from_hf_dir(d.path, options_for(spec)).rotary_base, 5e5);
}

// Llama-3.2-1B's config.json says rope_scaling {rope_type: llama3, ...} (transformers 4);
// transformers 5 writes the same numbers into rope_parameters with rope_theta. Both are read into
// use_rope_scaling / rope_scaling_*.
TEST_F(HfImportErrors, Llama3RopeScalingIsReadInBothSpellings) {
  const json orig = read_json(d.path / "config.json");
  const RopeScaling want{true, 32.0, 1.0, 4.0, 8192.0};
  edit_config([](json& c) {
    c["rope_theta"] = 5e5;
    c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  });
  train::ModelSpec got = train::spec_from_hf_dir(d.path, options_for(spec));
  EXPECT_TRUE(got.rope_scaling == want);
  EXPECT_EQ(got.rotary_base, 5e5);
  EXPECT_NE(got.summary().find("rope scaling x32"), std::string::npos) << got.summary();
  write_json(d.path / "config.json", orig);
  edit_config([](json& c) {
    c.erase("rope_theta");
    c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 5e5}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  });
  got = train::spec_from_hf_dir(d.path, options_for(spec));
  EXPECT_TRUE(got.rope_scaling == want);
  EXPECT_EQ(got.rotary_base, 5e5);
  // Without rope_scaling the spec has none, and its checkpoint JSON no rope_scaling key.
  write_json(d.path / "config.json", orig);
  got = train::spec_from_hf_dir(d.path, options_for(spec));
  EXPECT_FALSE(got.rope_scaling.enabled);
  EXPECT_FALSE(train::spec_json(got).contains("rope_scaling"));
}

// ---- load_hf ----

config::Value params_with(std::vector<std::pair<std::string, config::Value>> user) {
  config::Schema s;
  train::add_model_schema(s);
  train::add_training_schema(s);
  train::add_hf_import_schema(s);
  config::Value p = config::Value::map();
  for (auto& [k, v] : user) p.set_path(k, v);
  s.apply_defaults(p);
  return p;
}
config::Value at(const std::string& v) { return config::Value::string(v, {"exp.yaml", 3, 1}); }
config::Value at(int64_t v) { return config::Value::integer(v, {"exp.yaml", 4, 1}); }

TEST_F(HfImportErrors, LoadHfTakesTheModelKeysAndRefusesConflicts) {
  write_json(d.path / "tokenizer.json", json::object());  // only its presence matters here
  const std::string dir = d.path.string();
  config::Value p = train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"seq_length", at(int64_t{8})}}), "exp.yaml");
  const train::ModelSpec got = train::ModelSpec::from_config(p);
  train::ModelSpec want = spec;
  want.padded_vocab_size = want.vocab_size;  // make_vocab_size_divisible_by left at 1
  EXPECT_EQ(train::spec_json(got), train::spec_json(want));
  EXPECT_EQ(p.find_path("tokenizer_type")->as_string(), (d.path / "tokenizer.json").string());
  EXPECT_NE(p.find_path("num_layers")->origin().str().find("config.json"), std::string::npos);
  // A module preset's tokenizer (not the experiment's choice) gives way to the folder's.
  p = train::resolve_load_hf(params_with({{"load_hf", at(dir)},
                                          {"tokenizer_type", config::Value::string("gpt2", {"trainer_base.yaml", 20, 1})}}),
                             "exp.yaml");
  EXPECT_EQ(p.find_path("tokenizer_type")->as_string(), (d.path / "tokenizer.json").string());

  // A user key equal to config.json's is fine; another value is an error naming both places.
  EXPECT_NO_THROW(train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"num_layers", at(int64_t{2})}}), "exp.yaml"));
  std::string e = error_of([&] {
    train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"num_layers", at(int64_t{3})}}), "exp.yaml");
  });
  EXPECT_NE(e.find("exp.yaml:4:1: num_layers = 3 conflicts with"), std::string::npos) << e;
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  e = error_of([&] { train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"normalization", at("LayerNorm")}}), "exp.yaml"); });
  EXPECT_NE(e.find("normalization = LayerNorm conflicts"), std::string::npos) << e;
  // seq_length: the schema default capped by max_position_embeddings; more than that is refused.
  p = train::resolve_load_hf(params_with({{"load_hf", at(dir)}}), "exp.yaml");
  EXPECT_EQ(p.find_path("seq_length")->as_int(), 8);  // the tiny model's max_position_embeddings
  e = error_of([&] { train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"seq_length", at(int64_t{9})}}), "exp.yaml"); });
  EXPECT_NE(e.find("seq_length 9 exceeds max_position_embeddings 8"), std::string::npos) << e;
  // load and load_hf together; no tokenizer.json and no tokenizer_type.
  e = error_of([&] { train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"load", at("/ckpt")}}), "exp.yaml"); });
  EXPECT_NE(e.find("load_hf and load"), std::string::npos) << e;
  fs::remove(d.path / "tokenizer.json");
  e = error_of([&] { train::resolve_load_hf(params_with({{"load_hf", at(dir)}}), "exp.yaml"); });
  EXPECT_NE(e.find("has no tokenizer.json; set tokenizer_type"), std::string::npos) << e;
  p = train::resolve_load_hf(params_with({{"load_hf", at(dir)}, {"tokenizer_type", at("bytes")}}), "exp.yaml");
  EXPECT_EQ(p.find_path("tokenizer_type")->as_string(), "bytes");
  // Without load_hf nothing changes.
  const config::Value plain = params_with({{"num_layers", at(int64_t{3})}});
  EXPECT_TRUE(train::resolve_load_hf(plain, "exp.yaml").same_content(plain));
}

// A byte-level BPE tokenizer.json without merges: the 256 byte symbols and <|endoftext|>.
json byte_tokenizer_json() {
  json vocab = json::object();
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : 256 + n++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[s] = b;
  }
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"single_word", false},
                                         {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                         {"special", true}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                             {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false},
                     {"byte_fallback", false}, {"vocab", vocab}, {"merges", json::array()}}}};
}

TEST(HfImport, ImportWritesACheckpointWithSpecAndTokenizer) {
  const train::ModelSpec spec = testing::tiny_qwen3(300, 304);
  const train::ParamLayout layout = train::make_param_layout(spec);
  const std::vector<float> params = random_params(spec, layout);
  Dir hf("ckpt_src"), out("ckpt_out");
  backends::reference::write_hf_folder(spec, params.data(), 256, hf.path, "fp32");
  write_json(hf.path / "tokenizer.json", byte_tokenizer_json());
  const fs::path dir = train::import_hf_checkpoint(hf.path, out.path, options_for(spec));
  EXPECT_EQ(dir, io::checkpoint_dir(out.path, 0));
  io::CheckpointData data = io::load_checkpoint(dir);  // verified against its manifest, tokenizer.json included
  EXPECT_TRUE(train::weights_only_checkpoint(data.state));
  EXPECT_EQ(data.state["step"], 0);
  EXPECT_EQ(data.state["model_spec"], train::spec_json(spec));
  const std::string tok = data.state["tokenizer"];
  EXPECT_EQ(tok, "tokenizer.json");  // relative to the checkpoint (train::checkpoint_tokenizer)
  EXPECT_EQ(read_json(dir / tok), byte_tokenizer_json());
  std::vector<float> back(params.size());
  train::unpack_checkpoint(data, dir, spec, layout, back.data(), nullptr, nullptr);
  EXPECT_EQ(back, params);
  // Resuming from it is refused with what to do instead.
  train::CheckpointArgs c;
  c.load = out.path;
  const std::string e = error_of([&] { (void)train::resume_dir(c); });
  EXPECT_NE(e.find("load_hf"), std::string::npos) << e;
  // A tokenizer with more ids than the model's vocabulary is refused.
  const std::string e2 = error_of([&] { train::import_hf_checkpoint(hf.path, out.path, options_for(spec), "gpt2"); });
  EXPECT_NE(e2.find("more than the model's vocab_size 300"), std::string::npos) << e2;
}

}  // namespace
}  // namespace primus::hf_import_test
