// The tokenizer interface of Primus: text <-> token ids, for data preparation and inspection.
//
// Implementations: "gpt2" (OpenAI GPT-2 byte-level BPE, vocab 50257, <|endoftext|> = 50256),
// "bytes" (one token per byte, vocab 256, end-of-document = 0, the NUL byte), and a path to a
// Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, Llama-3 and Qwen2 / Qwen2.5 /
// Qwen3 families) or a SentencePiece-style BPE model (Llama-2, Mistral, Mixtral: "▁" for the
// space, <0xNN> byte fallback). See docs/data.md for what each accepts.
//
// Text is a byte string, normally UTF-8. Round trip: decode(encode(s)) == normalize(s) for any
// byte string s, malformed UTF-8 included, where normalize is the tokenizer's normalizer. "gpt2",
// "bytes" and tokenizer.json files without a normalizer have none, so there decode(encode(s)) == s
// exactly. With one (Qwen's NFC), normalize rewrites the text between added tokens (NFC composes
// "e\u0301" into "é") and keeps malformed bytes as they are; see data/tokenizer/normalize.h.
// SentencePiece-style files hold this with normalize(s) = s for text without added tokens and
// without U+2581 ("▁", which decodes as a space), malformed UTF-8 included (byte fallback):
// with the Prepend("▁") + Replace(" " -> "▁") normalizer the decoder's Strip removes exactly
// the prepended "▁"; with a Metaspace pre-tokenizer (prepend_scheme "first") a text that starts
// with a space loses that space, and with Prepend a text segment after an added token decodes
// with a space in front, as the Hugging Face library does.
// All methods are const and thread-safe.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace primus::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Appends the ids of `text` to `out`. Special tokens written literally in the text (e.g.
  // "<|endoftext|>" for GPT-2) become their single id, as Hugging Face tokenizers do; no
  // BOS/EOS is added (callers append eod_id() where a document ends).
  virtual void encode_into(std::string_view text, std::vector<int32_t>& out) const = 0;

  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> ids;
    encode_into(text, ids);
    return ids;
  }

  // The bytes the ids stand for, concatenated. Throws RuntimeError for an id outside the
  // vocabulary. A special token decodes to its text (e.g. "<|endoftext|>").
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  // Number of ids: every id is in [0, vocab_size()).
  virtual int vocab_size() const = 0;

  // The id that ends a document in prepared data; -1 when the tokenizer has none.
  virtual int32_t eod_id() const = 0;

  // A short description, e.g. "gpt2" or "tokenizer.json:/path (BPE, llama3)".
  virtual std::string name() const = 0;
};

// Builds a tokenizer from a spec: "gpt2", "bytes", a path to a tokenizer.json (or to a folder
// holding one), or a Hub id found in the Hugging Face cache (resolve_hf_tokenizer_model). Throws
// ConfigError for an unknown spec, IoError/FormatError naming the file for unreadable or
// unsupported tokenizer files.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

// Megatron-LM's HuggingFaceTokenizer model (its tokenizer_model): a local folder holding a
// tokenizer.json or the file itself, else a Hub id ("org/name") whose cached snapshot holds one
// (core/util/hf_cache.h). Returns the tokenizer.json's path; ConfigError headed by `what` (the
// key or option it came from) saying where it looked when there is none.
std::filesystem::path resolve_hf_tokenizer_model(const std::string& model,
                                                 const std::string& what = "tokenizer_model");

// The constructors make_tokenizer dispatches to.
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::filesystem::path& vocab_dir);
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::filesystem::path& tokenizer_json);
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// Folder holding GPT-2's encoder.json and vocab.bpe: $PRIMUS_GPT2_VOCAB_DIR when set, else
// third_party/gpt2 of the source tree this was built from, else <exe>/../../third_party/gpt2.
// Throws IoError listing the places tried.
std::filesystem::path gpt2_vocab_dir();

}  // namespace primus::data
