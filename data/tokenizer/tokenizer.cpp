#include "data/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/util/error.h"

namespace primus::data {

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "gpt2") return make_gpt2_tokenizer(gpt2_vocab_dir());
  if (spec == "bytes") return make_byte_tokenizer();
  std::error_code ec;
  std::filesystem::path path(spec);
  if (std::filesystem::is_directory(path, ec)) path /= "tokenizer.json";
  if (std::filesystem::is_regular_file(path, ec)) return make_hf_tokenizer(path);
  // A Hub id ("org/name") is looked up offline in the Hugging Face cache.
  const size_t slash = spec.find('/');
  if (!std::filesystem::exists(spec, ec) && slash != std::string::npos && slash > 0 &&
      spec.find('/', slash + 1) == std::string::npos) {
    std::filesystem::path cached;
    try {
      cached = resolve_hf_tokenizer_model(spec);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("unknown tokenizer '{}': not gpt2, bytes or a path; as a Hugging Face Hub id: {}",
                                    spec, e.what()));
    }
    return make_hf_tokenizer(cached);
  }
  throw ConfigError(fmt::format(
      "unknown tokenizer '{}': expected gpt2, bytes, the path of a tokenizer.json (or of a folder holding one), "
      "or a Hugging Face Hub id (org/name) in the Hugging Face cache",
      spec));
}

std::filesystem::path resolve_hf_tokenizer_model(const std::string& model) {
  namespace fsys = std::filesystem;
  std::error_code ec;
  fsys::path path(model);
  if (fsys::is_directory(path, ec)) path /= "tokenizer.json";
  if (fsys::is_regular_file(path, ec)) return path;
  if (fsys::exists(model, ec)) {
    throw ConfigError(fmt::format("tokenizer_model '{}' holds no tokenizer.json", model));
  }
  fsys::path cache;
  if (const char* c = std::getenv("HF_HUB_CACHE"); c && *c) {
    cache = c;
  } else if (const char* h = std::getenv("HF_HOME"); h && *h) {
    cache = fsys::path(h) / "hub";
  } else if (const char* home = std::getenv("HOME"); home && *home) {
    cache = fsys::path(home) / ".cache/huggingface/hub";
  }
  const size_t slash = model.find('/');
  const bool hub_id = slash != std::string::npos && slash > 0 && slash + 1 < model.size() &&
                      model.find('/', slash + 1) == std::string::npos;
  if (hub_id && !cache.empty()) {
    const fsys::path repo = cache / ("models--" + model.substr(0, slash) + "--" + model.substr(slash + 1));
    // refs/main names the snapshot transformers would load; without it, any snapshot that has one.
    std::string rev;
    if (std::ifstream ref(repo / "refs" / "main"); ref) std::getline(ref, rev);
    if (!rev.empty() && fsys::is_regular_file(repo / "snapshots" / rev / "tokenizer.json", ec)) {
      return repo / "snapshots" / rev / "tokenizer.json";
    }
    std::vector<fsys::path> found;
    for (const auto& e : fsys::directory_iterator(repo / "snapshots", ec)) {
      if (fsys::is_regular_file(e.path() / "tokenizer.json", ec)) found.push_back(e.path() / "tokenizer.json");
    }
    if (!found.empty()) return *std::min_element(found.begin(), found.end());
  }
  throw ConfigError(fmt::format(
      "tokenizer_model '{}': no such folder or tokenizer.json{}; nothing is downloaded here: give a local path, or "
      "fetch it first (e.g. `huggingface-cli download {} tokenizer.json`)",
      model,
      hub_id ? fmt::format(", and no tokenizer.json for it in the Hugging Face cache ({})",
                           cache.empty() ? std::string("unset: no HF_HUB_CACHE, HF_HOME or HOME") : cache.string())
             : std::string(),
      hub_id ? model : std::string("ORG/NAME")));
}

}  // namespace primus::data
