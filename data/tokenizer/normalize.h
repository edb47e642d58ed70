// The normalizers of Hugging Face tokenizer.json files that byte-level BPE tokenizers use:
// Unicode normalization forms (Qwen2 / Qwen2.5 / Qwen3 files carry {"type": "NFC"}), literal
// Replace, Prepend (Llama-2 / Mistral files), and Sequence of those. The Unicode forms come from utf8proc.
//
// tokenizers runs the normalizer on each text segment between added tokens (after the
// non-"normalized" added tokens are split out), before pre-tokenization; BpeTokenizer does the
// same. Text that is not valid UTF-8 (which tokenizers never sees: Python strings are Unicode)
// keeps its malformed bytes unchanged, and the valid runs around them are normalized each.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace primus::data {

struct NormalizerStep {
  // Prepend: `content` is put before the text when the text is not empty (SentencePiece-style
  // files: Prepend("\u2581") then Replace(" " -> "\u2581")).
  enum class Kind { NFC, NFD, NFKC, NFKD, Replace, Prepend };
  Kind kind = Kind::NFC;
  std::string pattern;  // Replace: the literal text replaced (non-empty)
  std::string content;  // Replace: what replaces it; Prepend: what is prepended
};

// The steps of one normalizer, applied in order; empty means none.
struct Normalizer {
  std::vector<NormalizerStep> steps;

  bool empty() const { return steps.empty(); }
  // The normalized text. The Unicode forms send only the non-ASCII stretches to utf8proc
  // (normalize.cpp says why that is exact); pure ASCII text comes back without a call.
  std::string apply(std::string_view text) const;
  // E.g. "NFC" or "Sequence[NFKC, Replace]"; "none" when empty.
  std::string describe() const;
};

const char* normalizer_kind_name(NormalizerStep::Kind kind);

}  // namespace primus::data
