#include "data/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::data {

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "gpt2") return make_gpt2_tokenizer(gpt2_vocab_dir());
  if (spec == "bytes") return make_byte_tokenizer();
  std::error_code ec;
  std::filesystem::path path(spec);
  if (std::filesystem::is_directory(path, ec)) path /= "tokenizer.json";
  if (std::filesystem::is_regular_file(path, ec)) return make_hf_tokenizer(path);
  throw ConfigError(fmt::format(
      "unknown tokenizer '{}': expected gpt2, bytes, or the path of a tokenizer.json (or of a "
      "folder holding one)",
      spec));
}

}  // namespace primus::data
