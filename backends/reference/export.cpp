#include "backends/reference/export.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "data/tokenizer/tokenizer.h"
#include "io/checkpoint.h"
#include "io/hf_export.h"
#include "train/checkpointing.h"
#include "train/inference_checkpoint.h"

namespace primus::backends::reference {

void export_hf_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                          const std::string& dtype) {
  std::filesystem::path dir = checkpoint;
  if (!std::filesystem::exists(dir / io::kManifestFile)) {
    auto latest = io::find_latest(dir);
    if (!latest) throw IoError(fmt::format("no checkpoint in '{}'", checkpoint.string()));
    dir = latest->dir;
  }
  io::CheckpointData data = io::load_checkpoint(dir);
  if (!data.state.contains("model_spec")) {
    throw FormatError(fmt::format("checkpoint {}: trainer_state.json has no model_spec", dir.string()));
  }
  train::ModelSpec spec = train::spec_from_json(data.state["model_spec"]);
  bool gpt2 = spec.layernorm && !spec.swiglu && !spec.rope && spec.bias;
  bool llama = !spec.layernorm && spec.swiglu && spec.rope;
  if (!gpt2 && !llama) {
    throw FormatError(fmt::format("checkpoint {}: this architecture mixes GPT-2 and Llama features and has no "
                                  "Hugging Face class (GPT2LMHeadModel needs LayerNorm+GELU+learned positions+biases; "
                                  "LlamaForCausalLM needs RMSNorm+SwiGLU+RoPE)",
                                  dir.string()));
  }
  train::ParamLayout layout = train::make_param_layout(spec);
  std::vector<float> params(layout.total);
  train::unpack_checkpoint(data, dir, spec, layout, params.data(), nullptr, nullptr);
  int eos = 0;
  if (data.state.contains("tokenizer")) {
    try {
      eos = data::make_tokenizer(train::checkpoint_tokenizer(data.state["tokenizer"].get<std::string>(), dir))->eod_id();
    } catch (const Error& e) {
      spdlog::warn("export: tokenizer '{}' not available ({}); eos_token_id = 0", data.state["tokenizer"].dump(), e.what());
    }
  }
  write_hf_folder(spec, params.data(), eos, out, dtype);
  if (data.state.contains("tokenizer")) {
    export_tokenizer(train::checkpoint_tokenizer(data.state["tokenizer"].get<std::string>(), dir), out);
  }
  spdlog::info("exported {} ({}) to {}", dir.string(), dtype, out.string());
}

void export_tokenizer(const std::string& tokenizer, const std::filesystem::path& out) {
  namespace fsys = std::filesystem;
  std::error_code ec;
  // What AutoTokenizer.from_pretrained(OUT) reads, so that the folder round-trips through
  // `primus import hf` and transformers alike: a tokenizer.json (with the tokenizer_config.json
  // beside it, which names the end-of-text token), or GPT-2's vocabulary under the names
  // GPT2Tokenizer looks for. The byte tokenizer has no Hugging Face form.
  std::vector<std::pair<fsys::path, std::string>> files;
  if (tokenizer == "gpt2") {
    const fsys::path v = data::gpt2_vocab_dir();
    files = {{v / "encoder.json", "vocab.json"}, {v / "vocab.bpe", "merges.txt"}};
  } else if (tokenizer != "bytes" && !tokenizer.empty()) {
    fsys::path json = tokenizer;
    if (fsys::is_directory(json, ec)) json /= "tokenizer.json";
    if (!fsys::is_regular_file(json, ec) || json.filename() != "tokenizer.json") {
      spdlog::warn("export: tokenizer '{}' is not a tokenizer.json; the folder has no tokenizer files", tokenizer);
      return;
    }
    files = {{json, "tokenizer.json"}};
    if (fsys::is_regular_file(json.parent_path() / "tokenizer_config.json", ec))
      files.emplace_back(json.parent_path() / "tokenizer_config.json", "tokenizer_config.json");
  }
  for (const auto& [from, name] : files) fs::atomic_write_file(out / name, fs::read_file(from));
}

std::map<std::string, io::TensorBlob> hf_state_dict(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                                    const float* params) {
  std::map<std::string, io::TensorBlob> tensors;
  for (auto& t : layout.tensors) {
    bool vocab = t.name == "embedding.weight" || t.name == "output_layer.weight";
    for (auto& part : t.hf) {
      std::vector<float> buf;
      auto shape = train::to_hf(t, part, params, buf, vocab ? spec.vocab_size : 0);
      tensors.emplace(part.name, io::TensorBlob::from_vector(shape, std::move(buf)));
    }
  }
  return tensors;
}

void write_hf_folder(const train::ModelSpec& spec, const float* params, int eos, const std::filesystem::path& out,
                     const std::string& dtype) {
  io::HfExportOptions opts;
  if (dtype == "fp32") {
    opts.dtype = io::DType::F32;
  } else if (dtype == "bf16") {
    opts.dtype = io::DType::BF16;
  } else {
    throw UsageError(fmt::format("export dtype must be bf16 or fp32, got '{}'", dtype));
  }
  // The config first: it refuses what transformers has no class for before anything is written.
  auto config = nlohmann::json::parse(train::hf_config_json(spec, eos));
  config["torch_dtype"] = dtype == "fp32" ? "float32" : "bfloat16";
  io::export_hf(out, config, hf_state_dict(spec, train::make_param_layout(spec), params), opts);
}

}  // namespace primus::backends::reference
