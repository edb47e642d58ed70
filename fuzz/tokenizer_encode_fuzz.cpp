// Fuzzes the tokenizers' encoders on arbitrary bytes (malformed UTF-8 included) and checks
// their promises: decode(encode(s)) == s (with a normalizer: encode(decode(encode(s))) ==
// encode(s), normalizing being idempotent), every id in [0, vocab_size), and the pre-tokenizers'
// pieces tile the text.
//
// Input: byte 0 picks the tokenizer (gpt2, bytes, or GPT-2's vocabulary as a tokenizer.json
// with the Llama-3 or the Qwen2 Split pre-tokenizer, the latter also with Qwen's NFC normalizer
// and with NFKC); the rest is the text.
#include <nlohmann/json.hpp>

#include "core/util/fs.h"
#include "data/tokenizer/pretokenize.h"
#include "data/tokenizer/tokenizer.h"
#include "fuzz/fuzz_target.h"

namespace {

using namespace primus::data;

// GPT-2's vocabulary and merges as a tokenizer.json with a Split(kind) + ByteLevel pre-tokenizer.
std::unique_ptr<Tokenizer> split_tokenizer(const primus::fuzz::Scratch& dir, PreTokenizerKind kind,
                                           const char* normalizer = nullptr) {
  using nlohmann::json;
  auto vocab_dir = gpt2_vocab_dir();
  json vocab = json::parse(primus::fs::read_file(vocab_dir / "encoder.json"));
  json merges = json::array();
  std::string bpe = primus::fs::read_file(vocab_dir / "vocab.bpe");
  for (size_t pos = bpe.find('\n') + 1; pos < bpe.size();) {  // skip the #version line
    size_t eol = bpe.find('\n', pos);
    if (eol == std::string::npos) eol = bpe.size();
    if (eol > pos) merges.push_back(bpe.substr(pos, eol - pos));
    pos = eol + 1;
  }
  json pre = {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Split"},
                 {"pattern", {{"Regex", std::string(pretokenizer_regex(kind))}}},
                 {"behavior", "Isolated"},
                 {"invert", false}},
                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
            {"pre_tokenizer", pre},
            {"decoder", {{"type", "ByteLevel"}}},
            {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}}}}};
  if (normalizer) j["normalizer"] = {{"type", normalizer}};
  auto name = std::string(pretokenizer_name(kind)) + (normalizer ? normalizer : "") + ".json";
  return make_hf_tokenizer(dir.write(name, j.dump()));
}

}  // namespace

PRIMUS_FUZZ_TARGET(tokenizer_encode) {
  static const primus::fuzz::Scratch dir("tokenizer_encode");
  static const std::vector<std::unique_ptr<Tokenizer>> toks = [] {
    std::vector<std::unique_ptr<Tokenizer>> t;
    t.push_back(make_tokenizer("gpt2"));
    t.push_back(make_tokenizer("bytes"));
    t.push_back(split_tokenizer(dir, PreTokenizerKind::Llama3));
    t.push_back(split_tokenizer(dir, PreTokenizerKind::Qwen2));
    t.push_back(split_tokenizer(dir, PreTokenizerKind::Qwen2, "NFC"));
    t.push_back(split_tokenizer(dir, PreTokenizerKind::Qwen2, "NFKC"));
    return t;
  }();
  if (size == 0) return;
  const Tokenizer& tok = *toks[data[0] % toks.size()];
  std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);

  for (auto kind : {PreTokenizerKind::Gpt2, PreTokenizerKind::Llama3, PreTokenizerKind::Qwen2}) {
    for (size_t pos = 0; pos < text.size();) {
      size_t end = next_piece(kind, text, pos);
      if (end <= pos || end > text.size()) {
        primus::fuzz::finding(std::string(pretokenizer_name(kind)) + ": next_piece(" + std::to_string(pos) +
                              ") = " + std::to_string(end) + " for a text of " + std::to_string(text.size()) +
                              " bytes");
      }
      pos = end;
    }
  }

  primus::fuzz::refuse_only_with_primus_errors([&] {
    std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) {
        primus::fuzz::finding(tok.name() + ": encode produced id " + std::to_string(id) + " outside the vocabulary");
      }
    }
    const std::string back = tok.decode(ids);
    const bool normalizes = &tok == toks[4].get() || &tok == toks[5].get();
    if (!normalizes && back != text) primus::fuzz::finding(tok.name() + ": decode(encode(s)) != s");
    if (normalizes && tok.encode(back) != ids) {
      primus::fuzz::finding(tok.name() + ": encode(decode(encode(s))) != encode(s)");
    }
  });
}
