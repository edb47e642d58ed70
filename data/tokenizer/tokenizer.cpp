#include "data/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include <string>

#include "core/util/error.h"
#include "core/util/hf_cache.h"

namespace primus::data {

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "gpt2") return make_gpt2_tokenizer(gpt2_vocab_dir());
  if (spec == "bytes") return make_byte_tokenizer();
  std::error_code ec;
  std::filesystem::path path(spec);
  if (std::filesystem::is_directory(path, ec)) path /= "tokenizer.json";
  if (std::filesystem::is_regular_file(path, ec)) return make_hf_tokenizer(path);
  // A Hub id ("org/name") is looked up offline in the Hugging Face cache.
  if (!std::filesystem::exists(spec, ec) && is_hub_id(spec)) {
    std::filesystem::path cached;
    try {
      cached = resolve_hf_tokenizer_model(spec, "tokenizer");
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

std::filesystem::path resolve_hf_tokenizer_model(const std::string& model, const std::string& what) {
  namespace fsys = std::filesystem;
  std::error_code ec;
  fsys::path path = resolve_hf_path(model, "tokenizer.json", what);
  if (fsys::is_directory(path, ec)) path /= "tokenizer.json";
  if (!fsys::is_regular_file(path, ec)) throw ConfigError(fmt::format("{} '{}' holds no tokenizer.json", what, model));
  return path;
}

}  // namespace primus::data
