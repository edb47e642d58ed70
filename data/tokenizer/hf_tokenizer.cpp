// Hugging Face tokenizer.json files with a BPE model:
// - byte-level BPE: GPT-2 style (ByteLevel pre-tokenizer with its regex) and Llama-3 / Qwen2
//   style (Split with its regex or Qwen2's, then ByteLevel), with no normalizer or a
//   Unicode-form / Replace one (Qwen2, Qwen2.5 and Qwen3 files have NFC);
// - SentencePiece-style BPE (Llama-2, Mistral, Mixtral): byte_fallback, pieces spelled with
//   "▁", the normalizer Sequence[Prepend("▁"), Replace(" " -> "▁")] or a Metaspace
//   pre-tokenizer, and the decoder Sequence[Replace, ByteFallback, Fuse, Strip].
// Anything else is refused with an error naming the file and the unsupported part, rather than
// tokenizing differently from the library that wrote the file.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "data/tokenizer/bpe.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/token_id.h"

namespace primus::data {
namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                     : std::string("?");
}

[[noreturn]] void unsupported(const stdfs::path& file, const std::string& what) {
  throw FormatError(fmt::format("{}: {} is not supported (Primus reads BPE tokenizer.json files: "
                                "byte-level as GPT-2, Llama-3 and Qwen2, SentencePiece-style as "
                                "Llama-2 and Mistral)",
                                file.string(), what));
}

bool null_or_empty(const json& m, const char* key) {
  return !m.contains(key) || m[key].is_null() || (m[key].is_string() && m[key].get<std::string>().empty());
}

void read_model(const stdfs::path& file, const json& m, BpeSpec& spec) {
  if (!m.is_object()) unsupported(file, "a model that is not an object");
  std::string type = m.value("type", m.contains("merges") ? "BPE" : "?");
  if (type != "BPE") unsupported(file, fmt::format("model type '{}'", type));
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0) {
    unsupported(file, "BPE dropout");
  }
  if (!null_or_empty(m, "continuing_subword_prefix") || !null_or_empty(m, "end_of_word_suffix")) {
    unsupported(file, "a BPE continuing_subword_prefix / end_of_word_suffix");
  }
  spec.ignore_merges = m.value("ignore_merges", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    spec.unk_token = m["unk_token"].get<std::string>();
  }
  const json& vocab = m.at("vocab");
  if (!vocab.is_object()) throw FormatError(fmt::format("{}: model.vocab is not an object", file.string()));
  spec.vocab.reserve(vocab.size());
  for (auto& [tok, id] : vocab.items()) {
    const std::string& name = tok;  // clang < 16 cannot capture a structured binding
    spec.vocab.emplace_back(name, read_token_id(id, [&] { return fmt::format("{}: model.vocab['{}']", file.string(), name); }));
  }
  const json& merges = m.at("merges");
  spec.merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& mg = merges[r];
    if (mg.is_string()) {  // "a b" (tokenizers < 0.20)
      auto s = mg.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        throw FormatError(fmt::format("{}: model.merges[{}] = '{}' is not 'a b'", file.string(), r, s));
      }
      spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (mg.is_array() && mg.size() == 2) {  // ["a", "b"]
      spec.merges.emplace_back(mg[0].get<std::string>(), mg[1].get<std::string>());
    } else {
      throw FormatError(fmt::format("{}: model.merges[{}] is neither 'a b' nor [a, b]", file.string(), r));
    }
  }
}

PreTokenizerKind split_kind(const stdfs::path& file, const json& split) {
  if (split.value("behavior", "") != "Isolated" || split.value("invert", false)) {
    unsupported(file, "a Split pre-tokenizer whose behavior is not Isolated (or inverted)");
  }
  const json& pat = split.at("pattern");
  if (!pat.contains("Regex")) unsupported(file, "a Split pre-tokenizer with a String pattern");
  auto regex = pat["Regex"].get<std::string>();
  for (auto kind : {PreTokenizerKind::Gpt2, PreTokenizerKind::Llama3, PreTokenizerKind::Qwen2}) {
    if (regex == pretokenizer_regex(kind)) return kind;
  }
  unsupported(file, fmt::format("the Split regex '{}' (known: the GPT-2, Llama-3 and Qwen2 "
                                "patterns)", regex));
}

void read_pre_tokenizer(const stdfs::path& file, const json& p, BpeSpec& spec) {
  std::string type = type_of(p);
  if (type == "ByteLevel") {
    if (!p.value("use_regex", true)) unsupported(file, "a ByteLevel pre-tokenizer without its regex alone");
    spec.pre = PreTokenizerKind::Gpt2;
    spec.prefix_space = p.value("add_prefix_space", false) ? PrefixSpace::PerSegment : PrefixSpace::None;
    return;
  }
  if (type == "Sequence") {
    const json& list = p.at("pretokenizers");
    if (list.size() == 2 && type_of(list[0]) == "Split" && type_of(list[1]) == "ByteLevel") {
      if (list[1].value("use_regex", true)) {
        unsupported(file, "Split followed by a ByteLevel pre-tokenizer that also applies its regex");
      }
      spec.pre = split_kind(file, list[0]);
      spec.prefix_space = list[1].value("add_prefix_space", false) ? PrefixSpace::PerPiece : PrefixSpace::None;
      return;
    }
    std::string types;
    for (auto& x : list) types += (types.empty() ? "" : ", ") + type_of(x);
    unsupported(file, fmt::format("pre_tokenizer Sequence[{}] (supported: ByteLevel, or "
                                  "Sequence[Split, ByteLevel])", types));
  }
  unsupported(file, fmt::format("pre_tokenizer '{}'", p.is_null() ? "null" : type));
}

// Sequences nest no deeper than this in real files; the bound keeps a hostile file from
// exhausting the stack.
constexpr int kMaxSequenceDepth = 32;

[[noreturn]] void too_deep(const stdfs::path& file, const char* what) {
  throw FormatError(fmt::format("{}: {} Sequence nested deeper than {}", file.string(), what, kMaxSequenceDepth));
}

// What marks a file as SentencePiece-style BPE (pieces spelled with "▁", bytes as <0xNN>
// tokens) rather than byte-level BPE, which is then read as one; empty when nothing does.
std::string sentencepiece_sign(const stdfs::path& file, const json& j) {
  auto has_type = [&](const json& x, const char* list_key, const std::string& type, int depth, auto&& self) -> bool {
    if (!x.is_object()) return false;
    if (type_of(x) == type) return true;
    if (depth > kMaxSequenceDepth) too_deep(file, list_key);
    if (x.contains(list_key) && x[list_key].is_array()) {
      for (const auto& y : x[list_key]) {
        if (self(y, list_key, type, depth + 1, self)) return true;
      }
    }
    return false;
  };
  const json& m = j["model"];
  if (m.is_object() && m.contains("byte_fallback") && m["byte_fallback"].is_boolean() &&
      m["byte_fallback"].get<bool>()) {
    return "model.byte_fallback";
  }
  if (j.contains("pre_tokenizer") && has_type(j["pre_tokenizer"], "pretokenizers", "Metaspace", 0, has_type)) {
    return "a Metaspace pre-tokenizer";
  }
  if (j.contains("decoder")) {
    for (const char* t : {"Metaspace", "ByteFallback"}) {
      if (has_type(j["decoder"], "decoders", t, 0, has_type)) return fmt::format("a {} decoder", t);
    }
  }
  if (j.contains("normalizer") && has_type(j["normalizer"], "normalizers", "Prepend", 0, has_type)) {
    return "a Prepend normalizer";
  }
  return {};
}

void read_normalizer(const stdfs::path& file, const json& n, Normalizer& out, int depth = 0) {
  if (n.is_null()) return;
  std::string type = type_of(n);
  if (type == "Sequence") {
    if (depth > kMaxSequenceDepth) too_deep(file, "normalizers");
    for (const auto& x : n.at("normalizers")) read_normalizer(file, x, out, depth + 1);
    return;
  }
  for (auto kind : {NormalizerStep::Kind::NFC, NormalizerStep::Kind::NFD, NormalizerStep::Kind::NFKC,
                    NormalizerStep::Kind::NFKD}) {
    if (type == normalizer_kind_name(kind)) {
      out.steps.push_back({kind, {}, {}});
      return;
    }
  }
  if (type == "Prepend") {
    out.steps.push_back({NormalizerStep::Kind::Prepend, {}, n.at("prepend").get<std::string>()});
    return;
  }
  if (type == "Replace") {
    const json& pat = n.at("pattern");
    if (!pat.contains("String")) unsupported(file, "a Replace normalizer with a Regex pattern");
    NormalizerStep step{NormalizerStep::Kind::Replace, pat["String"].get<std::string>(),
                        n.at("content").get<std::string>()};
    // tokenizers matches an empty pattern between every two characters; no real file does that.
    if (step.pattern.empty()) unsupported(file, "a Replace normalizer with an empty pattern");
    out.steps.push_back(std::move(step));
    return;
  }
  unsupported(file, fmt::format("normalizer '{}' (supported: NFC, NFD, NFKC, NFKD, Replace of a "
                                "string, Prepend, and Sequence of those)",
                                type));
}

void read_decoder(const stdfs::path& file, const json& d) {
  if (d.is_null() || type_of(d) == "ByteLevel") return;
  unsupported(file, fmt::format("decoder '{}'", type_of(d)));
}

// A SentencePiece-style file's pre-tokenizer: none (the Prepend/Replace normalizer does the
// spaces) or Metaspace.
void read_sp_pre_tokenizer(const stdfs::path& file, const json& p, SentencePieceSpec& sp) {
  if (p.is_null()) return;
  if (type_of(p) != "Metaspace") {
    unsupported(file, fmt::format("pre_tokenizer '{}' in a SentencePiece-style file (supported: "
                                  "none, Metaspace)", type_of(p)));
  }
  sp.metaspace = true;
  sp.replacement = p.value("replacement", std::string("\u2581"));
  if (sp.replacement.empty()) unsupported(file, "an empty Metaspace replacement");
  sp.split = p.value("split", true);
  // Files before tokenizers 0.19 carry add_prefix_space instead of prepend_scheme.
  std::string scheme = p.contains("prepend_scheme") ? p["prepend_scheme"].get<std::string>()
                       : p.value("add_prefix_space", true) ? "always" : "never";
  using Scheme = SentencePieceSpec::PrependScheme;
  if (scheme == "always") sp.prepend = Scheme::Always;
  else if (scheme == "first") sp.prepend = Scheme::First;
  else if (scheme == "never") sp.prepend = Scheme::Never;
  else unsupported(file, fmt::format("Metaspace prepend_scheme '{}'", scheme));
}

// A SentencePiece-style file's decoder: a Sequence of Replace (of a string), ByteFallback, Fuse
// and Strip, as Llama-2 and Mistral files have.
void read_sp_decoder(const stdfs::path& file, const json& d, SentencePieceSpec& sp, int depth = 0) {
  std::string type = type_of(d);
  if (type == "Sequence") {
    if (depth > kMaxSequenceDepth) too_deep(file, "decoders");
    for (const auto& x : d.at("decoders")) read_sp_decoder(file, x, sp, depth + 1);
    return;
  }
  SpDecodeStep step;
  if (type == "Replace") {
    const json& pat = d.at("pattern");
    if (!pat.contains("String")) unsupported(file, "a Replace decoder with a Regex pattern");
    step.kind = SpDecodeStep::Kind::Replace;
    step.pattern = pat["String"].get<std::string>();
    step.content = d.at("content").get<std::string>();
    if (step.pattern.empty()) unsupported(file, "a Replace decoder with an empty pattern");
  } else if (type == "ByteFallback") {
    step.kind = SpDecodeStep::Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = SpDecodeStep::Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = SpDecodeStep::Kind::Strip;
    step.content = d.at("content").get<std::string>();
    step.start = d.value("start", 0);
    step.stop = d.value("stop", 0);
    if (step.start < 0 || step.stop < 0) unsupported(file, "a Strip decoder with a negative count");
  } else {
    unsupported(file, fmt::format("decoder '{}' in a SentencePiece-style file (supported: "
                                  "Sequence of Replace, ByteFallback, Fuse, Strip)",
                                  d.is_null() ? "null" : type));
  }
  sp.decoder.push_back(std::move(step));
}

// The end-of-document token: tokenizer_config.json's eos_token when the file is there (as
// transformers does), else the first of the usual names that the tokenizer has.
int32_t find_eod(const stdfs::path& file, const BpeSpec& spec) {
  const bool sp = spec.sentencepiece.has_value();
  auto id_of = [&](const std::string& content) -> int32_t {
    for (auto& a : spec.added) {
      if (a.content == content) return a.id;
    }
    std::string form = sp ? content : byte_level::encode_token(content);
    for (auto& [tok, id] : spec.vocab) {
      if (tok == form) return id;
    }
    return -1;
  };
  auto config = file.parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (stdfs::is_regular_file(config, ec)) {
    json c;
    try {
      c = json::parse(fs::read_file(config));
    } catch (const json::exception& e) {
      throw FormatError(fmt::format("{}: not valid JSON: {}", config.string(), e.what()));
    }
    if (c.contains("eos_token")) {
      const json& e = c["eos_token"];
      std::string content = e.is_string()                            ? e.get<std::string>()
                            : e.is_object() && e.contains("content") ? e["content"].get<std::string>()
                                                                     : std::string();
      if (!content.empty()) {
        int32_t id = id_of(content);
        if (id < 0) {
          throw FormatError(fmt::format("{}: eos_token '{}' is not a token of {}", config.string(),
                                        content, file.string()));
        }
        return id;
      }
    }
  }
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>"}) {
    if (int32_t id = id_of(name); id >= 0) return id;
  }
  return -1;
}

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const stdfs::path& file) {
  json j;
  try {
    j = json::parse(fs::read_file(file));
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", file.string(), e.what()));
  }
  BpeSpec spec;
  spec.source = file.string();
  try {
    if (!j.is_object() || !j.contains("model")) {
      throw FormatError(fmt::format("{}: not a tokenizer.json (no \"model\")", file.string()));
    }
    read_normalizer(file, j.value("normalizer", json()), spec.normalizer);
    read_model(file, j["model"], spec);
    if (std::string sign = sentencepiece_sign(file, j); !sign.empty()) {
      SentencePieceSpec sp;
      const json& m = j["model"];
      sp.byte_fallback = m.value("byte_fallback", false);
      sp.fuse_unk = m.value("fuse_unk", false);
      read_sp_pre_tokenizer(file, j.value("pre_tokenizer", json()), sp);
      read_sp_decoder(file, j.value("decoder", json()), sp);
      spec.sentencepiece = std::move(sp);
    } else {
      read_pre_tokenizer(file, j.value("pre_tokenizer", json()), spec);
      read_decoder(file, j.value("decoder", json()));
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
        const json& a = j["added_tokens"][i];
        int32_t id = read_token_id(a.at("id"), [&] { return fmt::format("{}: added_tokens[{}]", file.string(), i); });
        // tokenizers' default: special tokens are matched in the raw text, others normalized.
        bool normalized = a.value("normalized", !a.value("special", false));
        spec.added.push_back({a.at("content").get<std::string>(), id, a.value("lstrip", false),
                              a.value("rstrip", false), normalized});
      }
    }
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: unexpected structure: {}", file.string(), e.what()));
  }
  spec.eod_id = find_eod(file, spec);
  if (spec.sentencepiece) {
    spec.name = fmt::format("tokenizer.json:{} (BPE, sentencepiece, {}{})", file.string(),
                            spec.sentencepiece->metaspace ? "Metaspace" : "normalizer ",
                            spec.sentencepiece->metaspace ? "" : spec.normalizer.describe());
  } else if (spec.normalizer.empty()) {
    spec.name = fmt::format("tokenizer.json:{} (BPE, {})", file.string(), pretokenizer_name(spec.pre));
  } else {
    spec.name = fmt::format("tokenizer.json:{} (BPE, {}, {})", file.string(), pretokenizer_name(spec.pre),
                            spec.normalizer.describe());
  }
  return make_bpe_tokenizer(std::move(spec));
}

}  // namespace primus::data
