// Byte-level BPE: the engine behind the "gpt2" tokenizer and tokenizer.json files. Loaders
// (gpt2_tokenizer.cpp, hf_tokenizer.cpp) read their files into a BpeSpec; this file turns it
// into a tokenizer. Encoding: split out added/special tokens (leftmost-longest match; with a
// normalizer, as tokenizers does: first the non-normalized tokens in the raw text, then the
// normalizer on each segment between them, then the normalized tokens), split the rest with the
// pre-tokenizer, then BPE-merge each piece's bytes by merge rank. Pieces
// repeat (" the", ","), so merged pieces are cached per thread (piece_cache.h): the cache is
// what makes encoding fast.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/tokenizer/normalize.h"
#include "data/tokenizer/pretokenize.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::data {

// A token matched verbatim before pre-tokenization (e.g. "<|endoftext|>").
struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool lstrip = false;  // also swallows whitespace on its left
  bool rstrip = false;  // also swallows whitespace on its right
  // Matched in the normalized text (after the normalizer) rather than in the raw text; only
  // matters when the tokenizer has a normalizer.
  bool normalized = false;
};

// Where a ByteLevel pre-tokenizer's add_prefix_space puts its space.
enum class PrefixSpace {
  None,
  PerSegment,  // before each text segment between added tokens (ByteLevel with use_regex)
  PerPiece,    // before each piece of a Split (Split then ByteLevel without use_regex)
};

// One step of a SentencePiece-style decoder Sequence (tokenizers' decoders), applied in order
// to the list of token strings.
struct SpDecodeStep {
  enum class Kind {
    Replace,       // every token: `pattern` -> `content` ("\u2581" -> " ")
    ByteFallback,  // runs of "<0xNN>" tokens -> the bytes they stand for
    Fuse,          // all tokens -> one
    Strip,         // every token: up to `start` leading and `stop` trailing `content` removed
  };
  Kind kind = Kind::Fuse;
  std::string pattern, content;
  int start = 0, stop = 0;
};

// What makes a SentencePiece-style BPE (Llama-2, Mistral, Mixtral): the vocabulary is plain
// UTF-8 with "\u2581" for the space, merges apply to the Unicode characters of a piece (not its
// bytes), a character with no token becomes its UTF-8 bytes as "<0xNN>" tokens (byte_fallback)
// or unk, and the decoder is a Sequence of SpDecodeStep.
struct SentencePieceSpec {
  bool byte_fallback = false;
  bool fuse_unk = false;  // consecutive unknown characters become one unk
  // A Metaspace pre-tokenizer (newer files; older ones have the Prepend/Replace normalizer):
  // spaces -> replacement, the replacement prepended (Always: to every segment between added
  // tokens; First: to the segment at the start of the text; Never), then, with split, pieces
  // that start at each replacement.
  bool metaspace = false;
  std::string replacement = "\u2581";
  enum class PrependScheme { Always, First, Never } prepend = PrependScheme::Always;
  bool split = false;
  std::vector<SpDecodeStep> decoder;
};

// Everything a byte-level BPE tokenizer is made of, in vocabulary-file form.
struct BpeSpec {
  std::string name;    // for name() and error messages
  std::string source;  // the file(s) it came from, named in errors
  // Vocabulary in byte-level form ("Ġthe") -> id.
  std::vector<std::pair<std::string, int32_t>> vocab;
  // Merges in rank order (rank = index), each a pair of vocabulary tokens in byte-level form.
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<AddedToken> added;
  // Applied to the text between added tokens before pre-tokenization (tokenizer.json's
  // "normalizer"); empty for GPT-2 and Llama-3.
  Normalizer normalizer;
  PreTokenizerKind pre = PreTokenizerKind::Gpt2;
  PrefixSpace prefix_space = PrefixSpace::None;
  // Llama-3's "ignore_merges": a piece that is itself in the vocabulary is one token.
  bool ignore_merges = false;
  std::optional<std::string> unk_token;  // byte-level form; used for bytes with no token
  int32_t eod_id = -1;
  // Set for a SentencePiece-style BPE: vocab, merges and unk_token are then plain UTF-8
  // pieces, and pre / prefix_space are unused.
  std::optional<SentencePieceSpec> sentencepiece;
};

// Builds the tokenizer; throws FormatError naming spec.source for an inconsistent spec
// (duplicate ids, a vocabulary entry outside the byte-level alphabet, a merge whose parts or
// result are not in the vocabulary).
std::unique_ptr<Tokenizer> make_bpe_tokenizer(BpeSpec spec);

}  // namespace primus::data
