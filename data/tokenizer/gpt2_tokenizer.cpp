// GPT-2's tokenizer from OpenAI's files: encoder.json (byte-level token -> id) and vocab.bpe
// (one merge "a b" per line, rank = line number after the "#version" header). The special
// token <|endoftext|> (50256) ends documents.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "data/tokenizer/bpe.h"
#include "data/tokenizer/token_id.h"

namespace primus::data {
namespace {

namespace stdfs = std::filesystem;

bool has_vocab(const stdfs::path& dir) {
  std::error_code ec;
  return stdfs::is_regular_file(dir / "encoder.json", ec) && stdfs::is_regular_file(dir / "vocab.bpe", ec);
}

stdfs::path exe_dir() {
  std::error_code ec;
  auto exe = stdfs::read_symlink("/proc/self/exe", ec);
  return ec ? stdfs::path() : exe.parent_path();
}

std::vector<std::pair<std::string, std::string>> read_merges(const stdfs::path& file) {
  std::string text = fs::read_file(file);
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(50000);
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos) {
      throw FormatError(fmt::format("{}:{}: expected a merge 'a b', got '{}'", file.string(),
                                    line_no, line));
    }
    merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
  }
  return merges;
}

}  // namespace

stdfs::path gpt2_vocab_dir() {
  if (const char* env = std::getenv("PRIMUS_GPT2_VOCAB_DIR"); env && *env) {
    if (!has_vocab(env)) {
      throw IoError(fmt::format("PRIMUS_GPT2_VOCAB_DIR={}: no encoder.json and vocab.bpe there", env));
    }
    return env;
  }
  std::vector<stdfs::path> tried;
#ifdef PRIMUS_GPT2_VOCAB_DIR_DEFAULT
  tried.emplace_back(PRIMUS_GPT2_VOCAB_DIR_DEFAULT);
#endif
  if (auto dir = exe_dir(); !dir.empty()) {
    tried.push_back(dir / ".." / ".." / "third_party" / "gpt2");
    tried.push_back(dir / ".." / "third_party" / "gpt2");
  }
  std::string list;
  for (auto& dir : tried) {
    if (has_vocab(dir)) return dir.lexically_normal();
    list += (list.empty() ? "" : ", ") + dir.lexically_normal().string();
  }
  throw IoError(fmt::format(
      "GPT-2 vocabulary (encoder.json, vocab.bpe) not found in {}; set PRIMUS_GPT2_VOCAB_DIR to the "
      "folder holding them (third_party/gpt2 of the Primus sources)",
      list));
}

std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const stdfs::path& dir) {
  auto encoder_file = dir / "encoder.json";
  auto merges_file = dir / "vocab.bpe";
  BpeSpec spec;
  spec.name = "gpt2";
  spec.source = fmt::format("{} + {}", encoder_file.string(), merges_file.string());
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(fs::read_file(encoder_file));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", encoder_file.string(), e.what()));
  }
  if (!encoder.is_object()) {
    throw FormatError(fmt::format("{}: expected an object token -> id", encoder_file.string()));
  }
  spec.vocab.reserve(encoder.size());
  for (auto& [tok, id] : encoder.items()) {
    const std::string& name = tok;  // clang < 16 cannot capture a structured binding
    spec.vocab.emplace_back(name, read_token_id(id, [&] { return fmt::format("{}: token '{}'", encoder_file.string(), name); }));
  }
  spec.merges = read_merges(merges_file);
  auto eot = encoder.find("<|endoftext|>");
  if (eot == encoder.end()) {
    throw FormatError(fmt::format("{}: has no <|endoftext|> token", encoder_file.string()));
  }
  spec.eod_id = read_token_id(*eot, [&] { return fmt::format("{}: token '<|endoftext|>'", encoder_file.string()); });
  spec.added.push_back({"<|endoftext|>", spec.eod_id, false, false});
  spec.pre = PreTokenizerKind::Gpt2;
  return make_bpe_tokenizer(std::move(spec));
}

}  // namespace primus::data
