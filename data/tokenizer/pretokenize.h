// Pre-tokenizers: split text into the pieces that BPE then encodes one by one. Each is a
// hand-written scanner equivalent to one regex (leftmost alternative wins, greedy runs,
// backtracking of `\s+(?!\S)` reproduced), so no regex engine is needed and it runs at
// memory speed. Pieces tile the input exactly: concatenated, they give the text back.
#pragma once
#include <cstddef>
#include <string_view>

namespace primus::data {

enum class PreTokenizerKind {
  // GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  Gpt2,
  // Llama-3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //          ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  Llama3,
  // Qwen2: the Llama-3 pattern with \p{N} (single digits) instead of \p{N}{1,3}.
  Qwen2,
};

// End (byte offset, > pos) of the piece that starts at byte `pos` of `text` (pos < size).
size_t next_piece(PreTokenizerKind kind, std::string_view text, size_t pos);

// The regex a kind stands for, as written in a tokenizer.json "Split" pre-tokenizer.
std::string_view pretokenizer_regex(PreTokenizerKind kind);

const char* pretokenizer_name(PreTokenizerKind kind);

}  // namespace primus::data
